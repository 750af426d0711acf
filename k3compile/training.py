"""Training a spec: build it (or reuse a matching build), then train the build with k3compile.runtime.train.

The training driver that builds lives here, beside the command line, because the runtime never imports the
compiler (shared/ARCHITECTURE.md): `k3compile.runtime.train.train` trains a build and takes a spec only with a
`build` callable, which `train` below passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from k3compile import safe_io
from k3compile.runtime import train as runtime_train
from k3compile.runtime.train import TrainError, run_device
from k3compile.spec.schema import Spec


def _same_architecture(a: Spec, b: Spec) -> bool:
    return a.model_dump(exclude={"training"}) == b.model_dump(exclude={"training"})


def _why_not_reusable(dest: Path, spec: Spec, target: str, mode: str = "both") -> str | None:
    """None when the build at `dest` is what training `spec` would build now, else why not (one phrase).

    Reused only when all match: the architecture (training.* aside: it is not compiled in), a training
    Model (and an InferenceModel unless `mode` is "train"), every pass run, this compiler version and the target.
    """
    from k3compile import __version__
    from k3compile.build import pipeline

    try:
        manifest = safe_io.read_json(dest / "manifest.json", follow=False)
        built = Spec.model_validate(manifest["spec"]["fields"])
        compiler, modes, passes = manifest["compiler"], manifest["modes"], manifest["passes"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is unreadable"
    if compiler != f"k3compile {__version__}":
        return f"it was built by {compiler}"
    if manifest.get("target") != target:
        return f"it was built for {manifest.get('target')}, not {target}"
    if "train" not in modes:
        return "it has no training Model (built with --mode infer)"
    if "infer" not in modes and mode != "train":
        return "it has no InferenceModel to generate from (built with --mode train)"
    skipped = [r.get("name") for r in passes.get("train", []) if r.get("status") != "ran"]
    if skipped or [r.get("name") for r in passes.get("train", [])] != [p.name for p in pipeline()]:
        return f"it was built with passes disabled ({', '.join(map(str, skipped)) or 'another pass list'})"
    if not _same_architecture(built, spec):
        return "its spec differs"
    return None


def build_package(spec: Spec, build_dir: Path, say, mode: str = "both") -> ModuleType:
    """Build `spec` (train and infer graphs, or with `mode="train"` the train graph only) into `build_dir`,
    reusing a build there that matches it (`_why_not_reusable`)."""
    from k3compile.build import BuildOptions, build, package_name
    from k3compile.emit.package import is_build_dir
    from k3compile.loader import load

    dest = build_dir / package_name(spec)
    run_device(None, spec)  # a GPU target on a machine without one is refused before anything is built
    target = spec.target
    if is_build_dir(dest):
        why = _why_not_reusable(dest, spec, target, mode)
        if why is None:
            say(f"reusing the build in {dest}")
            return load(dest)
        say(f"rebuilding {dest}: {why}")
    graphs = "train graph" if mode == "train" else "train and infer graphs"
    say(f"building {spec.name} ({graphs}) into {build_dir}")
    try:
        dest, _ = build(spec, build_dir, BuildOptions(mode=mode, target=target))
    except ValueError as e:
        raise TrainError(f"cannot build {spec.name}: {e}") from None
    return load(dest)


def train(spec_or_build: str | Path, steps: int, data: str | Path | None = None, out: str | Path | None = None,
          resume: bool = False, overrides: Sequence[str] = (), eval_every: int | None = None,
          progress: bool | str = True, stop_after: int | None = None, init_from: str | Path | None = None,
          extends_anywhere: bool = False, log_every: int | None = None, callbacks: Sequence[Callable[[dict], None]] = (),
          log: Sequence[str] = (), tokenizer: str | Path | None = None, data_dtype: str | None = None) -> list[dict]:
    """`k3compile.runtime.train.train`, a spec built into <out>/build first (`build_package`)."""
    return runtime_train.train(spec_or_build, steps, data, out, resume, overrides, eval_every, progress, stop_after,
                               init_from, extends_anywhere, log_every, callbacks, log, tokenizer, data_dtype,
                               build=build_package)

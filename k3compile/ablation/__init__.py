"""`k3compile ablate`: train a base spec and its variants on the same data, seeds and budget; compare them.

Every run (variant x task x seed) lives in OUT/runs/<variant>/<task>-seed<s>/ and is finished when it holds
result.json; a rerun of the same study skips finished runs and resumes the interrupted one from its checkpoint.
Results: OUT/results.json, OUT/results.md, OUT/loss.png, OUT/mqar.png (see docs/ablations.md).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from k3compile import safe_io
from k3compile.ablation.study import AblateError, RunKey, Study, load_study, resolve_study

__all__ = ["AblateError", "ablate", "load_study", "resolve_study", "run_study"]

MARKER = "study.json"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,-]", "_", name)


def _prepare(study: Study) -> Path | None:
    """Create OUT (or check that it holds this same study); returns the folder created, to undo on failure."""
    out = study.out
    marker = out / MARKER
    if out.exists() and not out.is_dir():
        raise AblateError(f"output {out} exists and is not a folder")
    if os.path.lexists(marker):
        try:
            held = safe_io.read_json(marker, follow=False)
        except safe_io.FileError as e:
            raise AblateError(f"{e}; choose another --out") from None
        if held != study.fingerprint():
            raise AblateError(f"{out} holds another study (other variants, budget, seeds, tasks or data); "
                              "choose another --out")
        return None
    if out.exists() and any(out.iterdir()):
        raise AblateError(f"output {out} exists, is not empty and holds no study; choose another --out")
    created = None if out.exists() else out
    while created is not None and not created.parent.exists():
        created = created.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        from k3compile.ablation.run import write_json

        write_json(marker, study.fingerprint())
    except OSError as e:
        raise AblateError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return created


def _run_dir(study: Study, key: RunKey) -> Path:
    return study.out / "runs" / _slug(key.variant) / f"{key.task}-seed{key.seed}"


def _result(study: Study, key: RunKey) -> dict:
    """A finished run's result.json (written by the study: a regular file, never a link)."""
    try:
        result = safe_io.read_json(_run_dir(study, key) / "result.json", follow=False)
    except safe_io.FileError as e:
        raise AblateError(f"{e}; choose another --out") from None
    if not isinstance(result, dict):
        raise AblateError(f"{_run_dir(study, key) / 'result.json'} is not a run's result; choose another --out")
    return result


def _worker(args) -> dict | None:
    """One run in a worker process (--jobs > 1): its torch thread share, its build loaded, progress on the queue."""
    study, key, threads, queue = args
    import torch

    from k3compile.ablation.run import run_one
    from k3compile.loader import load

    torch.set_num_threads(threads)
    package = load(study.out / "builds" / _slug(key.variant) / _package_dir(study, key.variant))
    return run_one(key, study.variant(key.variant), package, study.steps[key.variant], study.eval_every,
                   study.mqar, study.data, _run_dir(study, key), tick=lambda n: queue.put((key.id, n)))


def _build(spec, build_dir: Path, say):
    """The variant's training Model (train graph only: a study never serves), reusing a matching build."""
    from k3compile.training import build_package

    return build_package(spec, build_dir, say, mode="train")


def _package_dir(study: Study, variant: str) -> str:
    from k3compile.build import package_name

    return package_name(study.variant(variant).spec)


def run_study(study: Study, progress: bool = True) -> dict:
    """Build every variant, run every unfinished run, write the results; returns results.json's document."""
    from k3compile.ablation import results as res
    from k3compile.ablation.progress import display
    from k3compile.ablation.run import run_one, write_json
    from k3compile.runtime.train import _stop_flag

    created = _prepare(study)
    keys = study.runs()
    done = {k.id: _result(study, k) for k in keys if os.path.lexists(_run_dir(study, k) / "result.json")}
    todo = [k for k in keys if k.id not in done]
    try:  # the study's own folders, each checked down from OUT: a link planted there is refused
        for k in todo:
            safe_io.make_dir(_run_dir(study, k), inside=study.out)
        for v in study.variants:
            safe_io.make_dir(study.out / "builds" / _slug(v.name), inside=study.out)
    except safe_io.FileError as e:
        raise AblateError(str(e)) from None
    except OSError as e:
        raise AblateError(f"cannot write to output folder {study.out}: {e.strerror or e}") from None
    with display(progress, study, keys, done) as show:
        try:
            packages = {}
            for v in study.variants:
                if any(k.variant == v.name for k in todo):
                    packages[v.name] = _build(v.spec, study.out / "builds" / _slug(v.name), show.say)
        except BaseException:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            raise
        if study.jobs == 1 or len(todo) <= 1:
            with _stop_flag() as stopping:
                for key in todo:
                    show.start(key)
                    result = run_one(key, study.variant(key.variant), packages[key.variant], study.steps[key.variant],
                                     study.eval_every, study.mqar, study.data, _run_dir(study, key),
                                     tick=lambda n, key=key: show.tick(key, n),
                                     stopping=lambda: stopping.signum is not None)
                    if result is None:
                        from k3compile.runtime.train import Interrupted

                        show.say(f"stopped during {key.id}; rerun the same command to continue")
                        raise Interrupted(stopping.signum)
                    done[key.id] = result
                    show.finish(key, result)
        else:
            done.update(_parallel(study, todo, show))
    doc = res.collect(study, done)
    write_json(study.out / "results.json", doc)
    safe_io.write_text(study.out / "results.md", res.markdown(doc))
    res.plots(doc, study.out)
    if progress:
        show.table(doc)
    return doc


def _parallel(study: Study, todo: list[RunKey], show) -> dict:
    import multiprocessing as mp
    import os
    import queue as queues
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // study.jobs)
    manager = ctx.Manager()
    q = manager.Queue()
    finished = {}
    with ProcessPoolExecutor(study.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_worker, (study, key, threads, q)): key for key in todo}
        by_id = {k.id: k for k in todo}
        pending = set(futures)
        while pending:
            try:  # a run's bar appears with its first tick, so only the running runs show beside the study's
                message = q.get(timeout=0.5)
                while True:  # drain: a finished run's last ticks are queued before its future is done
                    show.tick(by_id[message[0]], message[1])
                    message = q.get_nowait()
            except queues.Empty:
                pass
            for f in [f for f in pending if f.done()]:
                pending.discard(f)
                finished[futures[f].id] = f.result()
                show.finish(futures[f], finished[futures[f].id])
    manager.shutdown()
    return finished


def ablate(
    base: str | Path, variants=(), grid=(), steps: int | None = None, tokens: int | None = None, seeds=None,
    tasks=None, mqar=None, data=None, overrides=(), eval_every=None, jobs: int | None = None, out=None,
    progress: bool = False,
) -> dict:  # fmt: skip
    """Run a study and return its results (results.json's document). `base` may be a STUDY.yaml (a mapping with
    a `base:` key); the arguments given (not None or empty) then override its fields. Bad input raises
    AblateError before anything is built or written."""
    if _is_study_file(base):
        study = load_study(base, variants=list(variants), grid=list(grid), steps=steps, tokens=tokens, seeds=seeds,
                           tasks=tasks, mqar=mqar, data=data, overrides=tuple(overrides), eval_every=eval_every,
                           jobs=jobs, out=out)
    else:
        study = resolve_study(base, variants, grid, steps, tokens, (0,) if seeds is None else seeds,
                              tasks or ("lm", "mqar"), mqar, data, overrides, eval_every, 1 if jobs is None else jobs,
                              out)  # fmt: skip
    return run_study(study, progress)


def _is_study_file(path) -> bool:
    """A study file is a YAML mapping with a top-level `base:` (a spec never has one), or an empty file. The file
    is read as a spec is (k3compile.spec.load.read_yaml): one that cannot be read is an AblateError here."""
    from k3compile.spec.load import SpecError, read_yaml

    try:
        data = read_yaml(path)
    except SpecError as e:
        raise AblateError(e.lines[0]) from None
    return isinstance(data, dict) and "base" in data or not data

"""One shared build of k3-tiny (both modes) for the emit tests: a build costs seconds, so it is made once."""

from __future__ import annotations

from pathlib import Path

import pytest

K3_TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) as relative path -> bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _build_variants(spec, tmp_path_factory, variants: dict) -> dict:
    """{name: (package dir, loaded package)}: `spec` built once per named BuildOptions, each in its own folder."""
    import k3compile
    from k3compile.build import build

    out = {}
    for name, options in variants.items():
        path, _ = build(spec, tmp_path_factory.mktemp(name), options)
        out[name] = (path, k3compile.load(path))
    return out


@pytest.fixture(scope="session")
def build_variants():
    """build_variants(spec, tmp_path_factory, {name: BuildOptions}) -> {name: (package dir, loaded package)}."""
    return _build_variants


def _step_differences(packages: dict, reference: str, other: str, batch: int, seq: int) -> tuple[float, dict]:
    """(relative loss difference, {parameter: relative RMS difference of its gradient}) of `other`'s build
    against `reference`'s after one forward+backward on the same tokens (and the same seeded weights)."""
    import torch

    from k3compile.kernels._common.compare import rel_rms

    tokens = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in (reference, other):
        model = packages[name][1].Model()  # seeded per-name init: every build starts from the same weights
        loss = model(tokens, tokens)
        loss.backward()
        results[name] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (loss_ref, grads_ref), (loss, grads) = results[reference], results[other]
    assert grads.keys() == grads_ref.keys() and len(grads) > 50
    errors = {n: rel_rms(grads[n], grads_ref[n]) for n in grads_ref}
    return abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), errors


@pytest.fixture(scope="session")
def step_differences():
    """step_differences(packages, reference, other, batch, seq) -> (loss difference, {parameter: gradient's})."""
    return _step_differences


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return K3_TINY


@pytest.fixture(scope="session")
def tiny_spec():
    from k3compile.spec.load import load_spec

    return load_spec(K3_TINY)


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory, tiny_spec):
    """(package dir, manifest) of `k3compile build specs/k3-tiny.yaml -o <tmp>/out`, built in-process once."""
    from k3compile.build import build

    return build(tiny_spec, tmp_path_factory.mktemp("tiny") / "out")


@pytest.fixture(scope="session")
def tiny_tree(tiny_build) -> dict[str, bytes]:
    """The shared build's files, read right after it was written."""
    return tree_bytes(tiny_build[0])


@pytest.fixture
def snapshot():
    """snapshot(dir) -> {relative path: bytes} of every file under dir."""
    return tree_bytes

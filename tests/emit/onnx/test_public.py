"""torch.onnx.export of a generated module through public APIs: k3compile.onnx_translations() as the custom
translation table, k3compile.onnx_add_functions() to complete the program; the file runs in onnxruntime and
gives what `k3compile export`'s file gives."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import k3compile


@pytest.fixture(scope="module")
def files(tiny_build, tmp_path_factory):
    """(the public path's file, `k3compile export --graph infer --mx uint8`'s file) of the shared k3-tiny build."""
    dest, _ = tiny_build
    out = tmp_path_factory.mktemp("public")
    model = k3compile.load(dest).InferenceModel().eval()
    tokens = torch.zeros(2, 100, dtype=torch.long)
    dims = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
    program = torch.onnx.export(model, (tokens,), dynamo=True, custom_translation_table=k3compile.onnx_translations(),
                                dynamic_shapes=dims, opset_version=18, optimize=False)
    k3compile.onnx_add_functions(program)
    program.save(out / "public.onnx")
    [exported] = k3compile.export_onnx(dest, out / "cli", graph="infer", mx="uint8")
    return out / "public.onnx", exported.path, model


def _run(path, tokens: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: tokens.numpy()})[0]


def test_public_export_matches_k3compile_export(files):
    """Tokens of other sizes than traced (dynamic axes); the two files run the same k3 functions."""
    public, cli, _ = files
    for shape, seed in (((3, 37), 0), ((1, 5), 1)):
        tokens = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))
        got, want = _run(public, tokens), _run(cli, tokens)
        assert got.shape == want.shape == (*shape, 256)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_translations_cover_every_translated_op():
    """The public table is the one `k3compile export` uses: the same ops (test_functions checks it covers every k3 op but translate.UNTRANSLATED)."""
    from k3compile.emit.onnx import functions, translate

    table = k3compile.onnx_translations()
    assert table.keys() == translate.table(functions.define(18, "uint8")).keys()
    assert not {op._schema.name.removeprefix("k3::") for op in table} & set(translate.UNTRANSLATED)


def test_private_exporter_refuses_another_torch(monkeypatch):
    """k3compile export's one use of torch's internal exporter runs only on the pinned torch: one ExportError line."""
    from k3compile.emit.onnx import export

    export._check_torch()  # the installed torch is the pinned one
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    with pytest.raises(export.ExportError, match=r"^k3compile export needs torch 2\.13\.x .* this is torch 2\.14\.0\+cpu;"):
        export._check_torch()

"""model.py generation: valid Python, the spec carried verbatim as data, and no spec text reaching code.

Spec strings that could carry code (the name, rule globs) are limited by the schema; what the schema
allows must reach model.py only inside string literals (or the one-line header comment).
"""

from __future__ import annotations

import ast
import io
import json
import tokenize

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from k3compile.build import pipeline
from k3compile.emit.codegen import _imports, model_source, spec_hash, spec_json
from k3compile.spec.load import SpecError, load_spec, load_spec_text
from k3compile.spec.schema import Spec

PASSES = [p.name for p in pipeline()]
INJECTIONS = ["x'); import os #", "a\nb", 'a"b', "a b", "../up", "_x", "", "x" * 65, "k3\\n", "a;b", "é"]


def _spec_json_literal(src: str) -> str:
    """The value of the module-level `SPEC_JSON = '...'` assignment, read without executing anything."""
    (value,) = [
        node.value.value
        for node in ast.parse(src).body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["SPEC_JSON"]
    ]
    return value


def _token_kinds(src: str, needle: str) -> list[str]:
    """The kinds of the tokens holding each occurrence of `needle`; asserts none straddles tokens."""
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    kinds = [tokenize.tok_name[t.type] for t in toks for _ in range(t.string.count(needle))]
    assert len(kinds) == src.count(needle), f"{needle!r} spans several tokens"
    return kinds


@pytest.mark.parametrize("name", INJECTIONS, ids=repr)
def test_spec_names_that_could_inject_code_are_rejected(tiny_path, write_spec, name):
    text = tiny_path.read_text().replace("name: k3-tiny", f"name: {json.dumps(name)}")
    with pytest.raises(SpecError) as e:
        load_spec_text(text, "evil.yaml")
    (line,) = e.value.lines
    assert line.startswith("evil.yaml:") and ": name: " in line


@pytest.mark.parametrize("name", ["x'); import os #", "a b", "../up"])
def test_set_override_cannot_inject_a_name(tiny_path, name):
    with pytest.raises(SpecError, match="name"):
        load_spec(tiny_path, [f"name={name}"])


@pytest.mark.parametrize("glob", ["layers.*'; import os #", "a\nb", "x\\", '*"*', "*#*", "", "x" * 201])
def test_quantization_globs_that_could_inject_code_are_rejected(tiny_spec, glob):
    fields = tiny_spec.model_dump(mode="json")
    fields["quantization"]["rules"][0]["match"] = glob
    with pytest.raises(ValueError, match="match"):
        Spec.model_validate(fields)


def test_emitted_model_py_compiles_and_carries_the_spec(tiny_build, tiny_tree, tiny_spec):
    src = tiny_tree["model.py"].decode()
    compile(src, "model.py", "exec")
    literal = _spec_json_literal(src)
    assert literal == spec_json(tiny_spec)
    assert Spec.model_validate_json(literal) == tiny_spec
    assert json.loads(literal) == tiny_spec.model_dump(mode="json")
    assert src.splitlines()[1] == f"# spec: 'k3-tiny', sha256 {spec_hash(tiny_spec)}"
    assert src.splitlines()[2] == f"# passes: {', '.join(PASSES)}"
    glob = tiny_spec.quantization.rules[0].match
    assert _token_kinds(src, glob) == ["STRING"]  # only inside SPEC_JSON
    assert set(_token_kinds(src, "k3-tiny")) == {"STRING", "COMMENT"}  # SPEC_JSON and the header comment
    compile(tiny_tree["__init__.py"].decode(), "__init__.py", "exec")


def test_tables_match_the_modules_they_create(tiny_build):
    import k3compile

    mod = k3compile.load(tiny_build[0])
    for cls in (mod.Model, mod.InferenceModel):
        model = cls(device="meta")
        assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(n, s) for n, s, _ in cls.PARAMETERS]
        stacked = {row[0] for row in cls.MERGED}  # merge_projections' buffers, created from the members' rows
        assert [n for n, _ in model.named_buffers() if n not in stacked] == [row[0] for row in cls.BUFFERS]
        assert set(model.state_dict()) == {r[0] for r in cls.PARAMETERS} | {r[0] for r in cls.BUFFERS if r[3]}
    assert mod.Model.PACKED == {}
    buffers = {row[0]: row for row in mod.InferenceModel.BUFFERS}
    params = {row[0] for row in mod.InferenceModel.PARAMETERS}
    for weight, pack in mod.InferenceModel.PACKED.items():
        assert weight not in params and pack["fmt"] == "e2m1" and pack["block"] == 32
        assert buffers[pack["data"]][1][:-1] == tuple(pack["shape"])[:-1]  # packed along the last dim
        assert buffers[pack["scale"]][1] == (*pack["shape"][:-1], pack["shape"][-1] // 32)


class _Tiny(nn.Module):
    """A lowered-style module: submodules only hold tensors, the code is functional."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, tokens):
        return F.embedding(tokens, self.embed.weight) * self.scale


class _CallsSubmodule(_Tiny):
    def forward(self, tokens):
        return self.embed(tokens)


def test_graphs_that_still_call_submodules_are_refused(tiny_spec):
    with pytest.raises(ValueError, match="still calls submodules"):
        model_source(tiny_spec, [], "cpu", {"train": fx.symbolic_trace(_CallsSubmodule())}, "cpu", {"train": {}})


def test_allowed_but_unusual_spec_strings_stay_inside_literals(tiny_spec):
    fields = tiny_spec.model_dump(mode="json")
    fields["name"] = "A.b_c-9"
    odd = ["layers.[0-3]*.moe.experts.*", "]]][[[", "*?[]-_.x"]
    fields["quantization"]["rules"] += [{"match": g, "weight": "mxfp8", "activation": "mxfp8"} for g in odd]
    spec = Spec.model_validate(fields)
    gm = fx.symbolic_trace(_Tiny())
    gm._non_persistent_buffers_set.add("scale")  # fx copies buffers as persistent; lowering marks them back
    src = model_source(spec, ["interleave"], "cpu", {"train": gm}, "cpu", {"train": {}})  # packed: per graph
    code = compile(src, "model.py", "exec")
    assert Spec.model_validate_json(_spec_json_literal(src)) == spec
    for glob in odd:
        assert _token_kinds(src, glob) == ["STRING"], glob
    assert set(_token_kinds(src, "A.b_c-9")) == {"STRING", "COMMENT"}
    ns: dict = {}
    exec(code, ns)
    assert ns["SPEC_JSON"] == spec_json(spec)
    assert ns["Model"].PARAMETERS == (("embed.weight", (8, 4), "float32"),)
    assert ns["Model"].BUFFERS == (("scale", (4,), "float32", False),)
    assert "InferenceModel" not in ns
    model = ns["Model"](device="meta")
    assert model(torch.zeros(2, 3, dtype=torch.long, device="meta")).shape == (2, 3, 4)


def _local_function():
    def inner(x):
        return x

    return inner


@pytest.mark.parametrize(
    "obj", [lambda x: x, _local_function(), torch.Tensor.add, object()], ids=["lambda", "local", "method", "object"]
)
def test_imports_refuse_what_cannot_be_imported_by_name(obj):
    with pytest.raises(ValueError, match="cannot be imported"):
        _imports({"f": obj})


def test_imports_for_modules_functions_and_constants():
    import torch.fx._pytree as fx_pytree
    import torch.nn.functional as F

    lines = _imports({"torch": torch, "fx_pytree": fx_pytree, "emb": F.embedding, "inf": float("inf"), "len": len})
    assert lines == [
        "import torch",
        "import torch.fx._pytree as fx_pytree",
        "from math import inf",
        "from torch.nn.functional import embedding as emb",
    ]

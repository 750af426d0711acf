"""Property tests: whatever text, bytes or mutated spec reaches the loader, it returns a Spec or raises SpecError.

Every SpecError line must keep the `file:line:col: field.path: what` form on one line.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile.spec.load import SpecError, load_spec, load_spec_text
from k3compile.spec.schema import Spec

TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"
TINY_DICT = yaml.safe_load(TINY.read_text())
# file:line:col: field.path: what -- a path part with spaces or colons comes quoted, e.g. moe.' x'
LINE_RE = re.compile(r"""^\S.*?:\d+:\d+: (\S+|\S*(['"]).*\2\S*): \S.*$""")  # a key with spaces is quoted as repr() quotes it

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def loads_or_spec_error(load, *args) -> Spec | None:
    """Run a loader; anything but a Spec or a well-formed SpecError fails the test."""
    try:
        out = load(*args)
    except SpecError as e:
        assert e.lines
        for line in e.lines:
            assert "\n" not in line and LINE_RE.match(line), line
        return None
    assert isinstance(out, Spec)
    return out


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=70_000)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["K", "M", "KKKM", "mxfp4", "bf16", "situ_glu", "quantile", "layers.*", "", "null", "h200"])
)
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _paths(obj, prefix=()):
    if prefix:
        yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(doc: dict, data) -> dict:
    """Delete, replace or rename 1-4 keys/values anywhere in a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        paths = list(_paths(doc))
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        op = data.draw(st.sampled_from(["delete", "replace", "replace", "rename"]), label="op")
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = data.draw(junk, label="value")
        elif isinstance(parent, dict):
            parent[data.draw(st.text(min_size=1, max_size=12), label="new key")] = parent.pop(key)
    return doc


@FUZZ
@given(st.data())
def test_mutated_tiny_spec_text(data):
    doc = _mutate(TINY_DICT, data)
    loads_or_spec_error(load_spec_text, yaml.safe_dump(doc, allow_unicode=True))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "k3-tiny.yaml").write_text(TINY.read_text())
    return d


@FUZZ
@given(data=st.data())
def test_mutated_tiny_spec_file_with_extends(fuzz_dir, data):
    """A child file that extends the real tiny spec and overrides a mutated part of it."""
    doc = _mutate(TINY_DICT, data)
    top = {k: v for k, v in doc.items() if data.draw(st.booleans(), label=f"keep {k}")}
    text = "extends: k3-tiny.yaml\n" + (yaml.safe_dump(top, allow_unicode=True) if top else "")
    (fuzz_dir / "child.yaml").write_text(text, encoding="utf-8")
    loads_or_spec_error(load_spec, fuzz_dir / "child.yaml")


@FUZZ
@given(st.text(max_size=300) | st.text(alphabet="{}[]:,-&*!|>'\"#%@`?\n\t abcK", max_size=200))
def test_random_text(text):
    loads_or_spec_error(load_spec_text, text)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["utf-8", "latin-1"]), st.sampled_from(["replace", "surrogateescape"]))
def test_random_bytes_decoded_and_as_files(fuzz_dir, raw, encoding, errors):
    loads_or_spec_error(load_spec_text, raw.decode(encoding, errors))
    (fuzz_dir / "raw.yaml").write_bytes(raw)
    loads_or_spec_error(load_spec, fuzz_dir / "raw.yaml")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 1200), st.sampled_from(["flow-list", "flow-map", "block-map", "block-list"]))
def test_deep_nesting(depth, style):
    if style == "flow-list":
        text = "a: " + "[" * depth + "]" * depth
    elif style == "flow-map":
        text = "a: " + "{b: " * depth + "1" + "}" * depth
    elif style == "block-map":
        text = "a:\n" + "".join(" " * i + "b:\n" for i in range(1, min(depth, 400)))
    else:
        text = "".join(" " * (2 * i) + "-\n" for i in range(min(depth, 300)))
    loads_or_spec_error(load_spec_text, text + "\n")


@FUZZ
@given(st.lists(st.text(max_size=30) | st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
    ["moe.top_k", "hidden_size", "layout.pattern", "quantization.rules", "moe", "moe.router.x", "a.b.c", "kda.decay.form"]),
    st.text(max_size=20)), max_size=3))
def test_random_overrides(overrides):
    loads_or_spec_error(load_spec, TINY, overrides)


def test_valid_mutations_still_load():
    """Sanity for the properties above: an untouched dump loads, and the right edit keeps it valid."""
    assert loads_or_spec_error(load_spec_text, yaml.safe_dump(TINY_DICT)) == load_spec(TINY)
    doc = copy.deepcopy(TINY_DICT)
    doc["moe"]["top_k"] = 8
    assert loads_or_spec_error(load_spec_text, yaml.safe_dump(doc)).moe.top_k == 8

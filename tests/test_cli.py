"""The command line: `check`, `stats` and `diff` on every shipped spec, --help for each command, the stats JSON."""

from __future__ import annotations

import json

import pytest

from k3compile.analysis.stats import spec_stats
from k3compile.cli import COMMANDS
from k3compile.spec.load import load_spec
from k3compile.spec.weights import COMPONENTS

# The fields each ablation changes against specs/k3-tiny.yaml (read off the ablation files).
ABLATION_FIELDS = {
    "all-kda.yaml": {"name", "layout.pattern", "layout.last_layer_full"},
    "all-mla.yaml": {"name", "layout.pattern"},
    "aux-loss.yaml": {"name", "moe.router.balancing"},
    "bf16.yaml": {"name", "quantization.qat", "quantization.rules", "quantization.rules[0].match",
                  "quantization.rules[0].weight", "quantization.rules[0].activation"},
    "no-attn-res.yaml": {"name", "residual.kind", "residual.mode", "residual.block_size"},
    "no-latent.yaml": {"name", "moe.latent_size"},
    "swiglu.yaml": {"name", "activation.kind", "activation.beta1", "activation.beta2"},
    "no-delta-rule.yaml": {"name", "kda.delta_rule"},
    "head-decay.yaml": {"name", "kda.decay.granularity"},
    "ratio-1-1.yaml": {"name", "layout.pattern"},
    "attn-res-full.yaml": {"name", "residual.mode", "residual.block_size"},
    "bias-sign.yaml": {"name", "moe.router.balancing"},
    "no-balancing.yaml": {"name", "moe.router.balancing"},
}


def test_check_every_shipped_spec(cli, shipped_spec):
    rc, out, err = cli("check", shipped_spec)
    assert (rc, err) == (0, "")
    spec = load_spec(shipped_spec)
    assert f"valid spec '{spec.name}'" in out
    assert f"d={spec.hidden_size}, {spec.num_layers} layers" in out


def test_stats_every_shipped_spec(cli, shipped_spec):
    rc, out, err = cli("stats", shipped_spec)
    assert (rc, err) == (0, "")
    assert "parameters" in out and "routed_experts" in out
    rc, out, _ = cli("stats", shipped_spec, "--json", "--context", "1000", "--batch", "2")
    assert rc == 0
    assert json.loads(out) == spec_stats(load_spec(shipped_spec), 1000, 2)


def test_every_ablation_is_listed(specs_dir):
    assert {p.name for p in (specs_dir / "ablations").glob("*.yaml")} == set(ABLATION_FIELDS)


def test_diff_each_ablation_against_its_base(cli, ablation, specs_dir):
    base = specs_dir / "k3-tiny.yaml"
    rc, out, err = cli("diff", base, ablation, "--json")
    assert (rc, err) == (0, "")
    diff = json.loads(out)
    assert set(diff["fields"]) == ABLATION_FIELDS[ablation.name]
    sa, sb = spec_stats(load_spec(base), diff["context"]), spec_stats(load_spec(ablation), diff["context"])
    assert diff["derived"]["params.total"] == {"a": sa["params"]["total"], "b": sb["params"]["total"],
                                              "delta": sb["params"]["total"] - sa["params"]["total"]}
    rc, out, _ = cli("diff", base, ablation)
    assert rc == 0 and "changed fields" in out and "derived numbers" in out
    for field in ABLATION_FIELDS[ablation.name]:
        assert field in out


def test_ablation_diffs_move_the_right_numbers(cli, specs_dir):
    def derived(name):
        rc, out, _ = cli("diff", specs_dir / "k3-tiny.yaml", specs_dir / "ablations" / name, "--json")
        assert rc == 0
        return json.loads(out)["derived"]

    assert derived("all-kda.yaml")["cache_bytes.mla_latent"]["b"] == 0
    assert derived("bf16.yaml")["weight_bytes.policy"]["delta"] > 0
    assert derived("no-latent.yaml")["params.by_component.latent_proj.total"]["b"] == 0
    assert derived("no-attn-res.yaml")["params.by_component.attn_res.total"]["b"] == 0
    assert derived("no-attn-res.yaml")["flops_per_token.attn_res"]["b"] == 0
    assert derived("swiglu.yaml")["params.total"]["delta"] == 0  # same weights, different nonlinearity
    assert all(v["delta"] == 0 for v in derived("aux-loss.yaml").values())
    assert derived("no-delta-rule.yaml")["params.by_component.kda.total"]["delta"] == -6 * 4 * 256  # no b_proj
    assert derived("head-decay.yaml")["params.by_component.kda.total"]["delta"] == -6 * (64 * 252 + 252)
    assert derived("ratio-1-1.yaml")["cache_bytes.mla_latent"]["delta"] > 0


def test_diff_with_itself_changes_nothing(cli, shipped_spec):
    rc, out, err = cli("diff", shipped_spec, shipped_spec, "--json")
    assert (rc, err) == (0, "")
    diff = json.loads(out)
    assert diff["fields"] == {}
    assert diff["derived"] and all(v["delta"] == 0 for v in diff["derived"].values())
    rc, out, _ = cli("diff", shipped_spec, shipped_spec)
    assert rc == 0 and "(none)" in out


def test_diff_reports_a_bad_spec(cli, write_spec, specs_dir):
    bad = write_spec("name: x\n")
    rc, out, err = cli("diff", specs_dir / "k3-tiny.yaml", bad)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert all(line.startswith(f"error: {bad}:1:1: ") for line in err.splitlines())


@pytest.mark.parametrize("command", [[]] + [[c] for c in sorted(COMMANDS)], ids=lambda c: c[0] if c else "top")
def test_help(cli, command):
    rc, out, err = cli(*command, "--help")
    assert rc == 0 and err == ""
    assert out.startswith(" ".join(["usage: k3compile", *command]))
    assert {"check": "--set", "stats": "--set", "diff": "--json"}.get(command[0] if command else "", "") in out
    if not command:
        assert all(c in out for c in COMMANDS)


def test_version(cli):
    rc, out, _ = cli("--version")
    assert rc == 0 and out.startswith("k3compile ")


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["stats"], ["stats", "x.yaml", "--context", "0"],
                                  ["stats", "x.yaml", "--batch", "many"], ["diff", "x.yaml"]])
def test_usage_errors_exit_2(cli, argv):
    rc, out, err = cli(*argv)
    assert rc == 2 and "usage:" in err and "Traceback" not in err


def test_set_reaches_stats(cli, specs_dir):
    rc, out, _ = cli("stats", specs_dir / "k3-tiny.yaml", "--json", "--set", "moe.top_k=8", "--set", "parallel.ep=4")
    st = json.loads(out)
    assert rc == 0 and st["expert_parallel"]["ep"] == 4 and st["expert_parallel"]["experts_per_rank"] == 8
    routed = st["params"]["by_component"]["routed_experts"]
    assert routed["active"] * 32 == routed["total"] * 8


# ------------------------------------------------------------------ the real command, in a subprocess


def test_stats_json_keys_subprocess(k3compile_cmd, specs_dir):
    proc = k3compile_cmd("stats", specs_dir / "kimi-k3.yaml", "--json")
    assert proc.returncode == 0 and proc.stderr == ""
    st = json.loads(proc.stdout)
    p = st["params"]
    assert isinstance(p["total"], int) and isinstance(p["active"], int)
    assert set(p["by_component"]) == set(COMPONENTS) and "routed_experts" in p["by_component"]
    for c in p["by_component"].values():
        assert set(c) == {"total", "active"}
    assert isinstance(st["flops_per_token"]["forward"], int)
    assert {"policy", "bf16"} <= set(st["weight_bytes"])
    assert {"total", "all_full_attention"} <= set(st["cache_bytes"])
    assert st == json.loads(json.dumps(spec_stats(load_spec(specs_dir / "kimi-k3.yaml"))))
    assert p["total"] == pytest.approx(2.8e12, rel=0.01)


def test_check_and_help_subprocess(k3compile_cmd, specs_dir):
    proc = k3compile_cmd("check", specs_dir / "k3-tiny.yaml", "--set", "moe.top_k=2")
    assert proc.returncode == 0 and "valid spec 'k3-tiny'" in proc.stdout
    proc = k3compile_cmd("diff", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: k3compile diff")


def test_paths_that_look_like_markup_are_printed_as_they_are(cli, tmp_path, specs_dir):
    """`[/x]` in a path is text, not a rich closing tag (which raised MarkupError)."""
    folder = tmp_path / "runs[" / "x]"
    folder.mkdir(parents=True)
    spec = folder / "k3-tiny.yaml"
    spec.write_text((specs_dir / "k3-tiny.yaml").read_text())
    rc, out, err = cli("check", spec)
    assert (rc, err) == (0, "") and f"{spec}:validspec'k3-tiny'" in "".join(out.split())  # the title may wrap
    rc, out, err = cli("diff", spec, specs_dir / "k3-tiny.yaml")
    assert (rc, err) == (0, "") and f"A = {spec}" in out

"""A study's results: per variant its spec diff, static numbers and the metrics over seeds; results.md; plots."""

from __future__ import annotations

import io
import statistics
from pathlib import Path

from k3compile import safe_io
from k3compile.ablation.study import Study
from k3compile.analysis.flops import forward_flops_per_token
from k3compile.analysis.stats import spec_stats
from k3compile.report import spec_diff

TRAIN_FLOPS_PER_FORWARD = 3  # forward + backward (twice the forward) per token


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def _mean_curve(curves: list[list]) -> list[list]:
    """Mean over seeds at the steps every seed evaluated."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
    return [[s, statistics.fmean(dict(map(tuple, c))[s] for c in curves)] for s in steps]


def collect(study: Study, results: dict[str, dict]) -> dict:
    """results.json's document from the finished runs (keyed by RunKey.id)."""
    base = study.base.spec
    out = []
    for v in study.variants:
        stats = spec_stats(v.spec)
        diff = spec_diff(base, v.spec)
        entry = {
            "variant": v.name, "spec": str(v.path), "overrides": list(v.overrides), "steps": study.steps[v.name],
            "diff": {k: d for k, d in diff["fields"].items() if k != "name"},
            "params_total": stats["params"]["total"], "params_active": stats["params"]["active"],
            "flops_per_token": stats["flops_per_token"]["forward"],
            "decode_cache_bytes": stats["cache_bytes"]["total"], "context": v.spec.context_length,
        }  # fmt: skip
        speeds = []
        for task in study.tasks:
            seq = v.spec.training.seq_len if task == "lm" else study.mqar.seq_len
            runs = [results[f"{v.name}/{task}-seed{s}"] for s in study.seeds]
            speeds += [r["tokens_per_s"] for r in runs]
            metric = runs[0]["metric"]
            entry[task] = {
                "metric": metric,
                "final": _spread([r["final"] for r in runs]),
                "best": _spread([r["best"] for r in runs]),
                "curve": _mean_curve([r["curve"] for r in runs]),
                "tokens_per_step": v.spec.training.batch_size * (
                    v.spec.training.seq_len if task == "lm" else study.mqar.seq_len),
                # forward FLOPs per token at the trained length (attention grows with it; stats use the spec's context)
                "flops_per_token_trained": forward_flops_per_token(v.spec, seq)["forward"],
            }  # fmt: skip
        entry["tokens_per_s"] = statistics.fmean(speeds)
        out.append(entry)
    main = "lm" if "lm" in study.tasks else "mqar"
    sign = 1 if main == "lm" else -1  # loss: lower first; accuracy: higher first
    out.sort(key=lambda e: sign * e[main]["final"]["mean"])
    return {"main_metric": f"{main}.final", "budget": study.budget, "seeds": list(study.seeds),
            "tasks": list(study.tasks), "mqar": study.mqar.__dict__, "data": study.data or "python stdlib sources",
            "base": study.base.name, "variants": out}  # fmt: skip


def _fmt(task_entry: dict | None, base_entry: dict | None, digits: int, percent: bool = False) -> str:
    if task_entry is None:
        return "-"
    f = task_entry["final"]
    scale = 100 if percent else 1
    text = f"{f['mean'] * scale:.{digits}f}"
    if f["n"] > 1:
        text += f" ± {f['std'] * scale:.{digits}f}"
    if base_entry is not None and base_entry is not task_entry:
        text += f" ({(f['mean'] - base_entry['final']['mean']) * scale:+.{digits}f})"
    return text


def table_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by results.md and the terminal table."""
    base = next(e for e in doc["variants"] if e["variant"] == doc["base"])
    header = ["variant", "changes", "params (active)", "FLOPs/token at context", "decode cache B", "tok/s"]
    header += [h for t, h in (("lm", "val loss (nats/byte)"), ("mqar", "MQAR acc %")) if t in doc["tasks"]]
    header += [h for t, h in (("lm", "best val loss"), ("mqar", "best MQAR %")) if t in doc["tasks"]]
    rows = []
    for e in doc["variants"]:
        changes = ", ".join(f"{k}={d['b']}" for k, d in e["diff"].items()) or "-"
        row = [e["variant"], changes, f"{e['params_total'] / 1e6:.2f}M ({e['params_active'] / 1e6:.2f}M)",
               f"{e['flops_per_token'] / 1e6:.1f}M", f"{e['decode_cache_bytes']:,}", f"{e['tokens_per_s']:.0f}"]
        for task, digits, pct in (("lm", 4, False), ("mqar", 1, True)):
            if task in doc["tasks"]:
                row.append(_fmt(e[task], base[task], digits, pct))
        for task, digits, pct in (("lm", 4, False), ("mqar", 1, True)):
            if task in doc["tasks"]:
                b = e[task]["best"]
                row.append(f"{b['mean'] * (100 if pct else 1):.{digits}f}")
        rows.append(row)
    return header, rows


def markdown(doc: dict) -> str:
    header, rows = table_rows(doc)
    lines = [f"# Ablation results (sorted by {doc['main_metric']}; deltas against `{doc['base']}`)", "",
             f"Budget {doc['budget']}, seeds {doc['seeds']}, tasks {', '.join(doc['tasks'])}; "
             f"MQAR {doc['mqar']}; LM data: {doc['data']}. Values are the mean (± spread over seeds).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> None:
    """The figure as PNG through safe_io.write_atomic (matplotlib's own open would follow a link there)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    safe_io.write_atomic(path, buffer.getbuffer())


def plots(doc: dict, out: Path) -> list[Path]:
    """loss.png (validation loss against steps and against training FLOPs) and mqar.png (accuracy against steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "lm" in doc["tasks"]:
        fig, (by_step, by_flops) = plt.subplots(1, 2, figsize=(12, 4.5))
        for e in doc["variants"]:
            steps, loss = zip(*e["lm"]["curve"])
            per_step = TRAIN_FLOPS_PER_FORWARD * e["lm"]["flops_per_token_trained"] * e["lm"]["tokens_per_step"]
            by_step.plot(steps, loss, marker=".", label=e["variant"])
            by_flops.plot([s * per_step for s in steps], loss, marker=".", label=e["variant"])
        by_step.set(xlabel="step", ylabel="validation loss (nats/byte)", title="validation loss against steps")
        by_flops.set(xlabel="training FLOPs (3 x forward, at the trained length)", xscale="log", title="validation loss against FLOPs")
        by_step.legend(fontsize=7)
        fig.tight_layout()
        _save(fig, out / "loss.png")
        plt.close(fig)
        written.append(out / "loss.png")
    if "mqar" in doc["tasks"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for e in doc["variants"]:
            steps, acc = zip(*e["mqar"]["curve"])
            ax.plot(steps, [100 * a for a in acc], marker=".", label=e["variant"])
        ax.set(xlabel="step", ylabel="held-out accuracy (%)", ylim=(0, 100),
               title=f"MQAR {doc['mqar']['num_kv_pairs']} pairs, {doc['mqar']['num_queries']} queries, "
               f"length {doc['mqar']['seq_len']}, vocab {doc['mqar']['vocab']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        _save(fig, out / "mqar.png")
        plt.close(fig)
        written.append(out / "mqar.png")
    return written

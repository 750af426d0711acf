"""What the GPU would run, without a GPU: the tensor-core kernels at bench/gpu.py's shapes, compiled per target.

    python bench/gpu_structure.py                    # every case on a100, h200 and b200: a table
    python bench/gpu_structure.py --target h200 --only mla
    python bench/gpu_structure.py --json out.json    # also write the reports (tests/kernels/test_gpu_structure.py)

Each case calls a kernel wrapper on meta tensors of the K3 shapes bench/gpu.py times; kernels/_common/sm_check.py
intercepts the launches it would make on the target (that target's launch configurations and SM count),
compiles each for the target's architecture and reports shared memory per program, registers and spilled bytes
per thread (ptxas), and whether the main products run on wgmma / tcgen05 (`wgmma`) or mma.sync (`mma`), and
whether ptxas serialized the wgmma pipeline (no overlap of the tensor cores with the other instructions).
Triton compiles on any machine; TRITON_INTERPRET is switched off for this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton: compile kernels, do not interpret them

TARGETS = ("a100", "h200", "b200")


def _meta(*shape, dtype=None):
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


def cases() -> dict[str, Callable[[], object]]:
    """Case name -> a call of the kernel wrapper at bench/gpu.py's K3 shape (bf16 unless named)."""
    import torch

    from k3compile.kernels.mla import triton as mdt
    from k3compile.kernels.experts import triton as mt
    from k3compile.kernels.mx import triton as mx
    from k3compile.kernels.short_conv import triton as sct

    u8 = torch.uint8
    E, C, w, I = 64, 256, 2048, 1536  # bench/gpu_moe.py
    M, D, O = 4096, 7168, 2048  # bench/gpu_mx.py
    x, h = _meta(E, C, w), _meta(E, C, I)
    wg, wd = _meta(E, I, w), _meta(E, w, I)
    gq = (_meta(E, I, w // 2, dtype=u8), _meta(E, I, w // 32, dtype=u8))
    dq = (_meta(E, w, I // 2, dtype=u8), _meta(E, w, I // 32, dtype=u8))
    lin = (_meta(O, D // 2, dtype=u8), _meta(O, D // 32, dtype=u8))
    f32 = torch.float32
    xf, wgf = _meta(4, 64, 128, dtype=f32), _meta(4, 256, 128, dtype=f32)  # a k3-tiny-sized fp32 training step
    return {
        "expert_glu": lambda: mt.expert_glu(x, wg, wg, "situ_glu", 4.0, 25.0),
        "expert_matmul": lambda: mt.expert_matmul(h, wd),
        "mx_expert_glu": lambda: mt.mx_expert_glu(x, *gq, *gq, 32, "situ_glu", 4.0, 25.0),
        "mx_expert_matmul": lambda: mt.mx_expert_matmul(h, *dq, 32),
        "expert_glu_bwd": lambda: mt.expert_glu_bwd([h], x, wg, wg, "situ_glu", 4.0, 25.0),
        "expert_matmul_bwd": lambda: mt.expert_matmul_bwd([_meta(E, C, w)], h, wd),
        "expert_glu fp32": lambda: mt.expert_glu(xf, wgf, wgf, "swiglu", 1.0, 1.0),
        "expert_glu_bwd fp32": lambda: mt.expert_glu_bwd([_meta(4, 64, 256, dtype=f32)], xf, wgf, wgf, "situ_glu",
                                                        4.0, 25.0),
        "mx_linear": lambda: mx.mx_linear(_meta(M, D), *lin, "e2m1", 32, None),
        "mx_linear act e4m3": lambda: mx.mx_linear(_meta(M, D), *lin, "e2m1", 32, "e4m3"),
        "mx_linear M=64 (decode)": lambda: mx.mx_linear(_meta(64, D), *lin, "e2m1", 32, None),
        "mx_expert_matmul C=16 (decode)": lambda: mt.mx_expert_matmul(_meta(E, 16, I), *dq, 32),
        "mx_linear_bwd": lambda: mx.mx_linear_bwd([_meta(M, O)], _meta(M, D), *lin, "e2m1", 32, "e4m3"),
        "mla_decode_absorbed S=32768": lambda: mdt.mla_decode_absorbed(
            _meta(32, 1, 64, 192), _meta(32, 32768, 576), _meta(64 * 256, 512), 192**-0.5),
        "short_conv": lambda: sct.short_conv(_meta(4, 4096, 4096), _meta(4096, 4), _meta(4, 4096, 3)),
        "short_conv_bwd": lambda: sct.short_conv_bwd([_meta(4, 4096, 4096), _meta(4, 4096, 3)], _meta(4, 4096, 4096),
                                                     _meta(4096, 4), _meta(4, 4096, 3)),
    }


def run(targets: tuple[str, ...], only: list[str], log: Callable[[str], None]) -> list[dict]:
    """One row per (case, target, launched kernel): the compiled kernel's report as a dict."""
    from k3compile.kernels._common import sm_check

    rows = []
    for name, call in cases().items():
        if only and not any(text in name for text in only):
            continue
        for target in targets:
            for launch in sm_check.launches(call, target):
                start = time.perf_counter()
                report = launch.compile()
                rows.append({"case": name, "target": target, "kernel": launch.name,
                             "constants": {k: v for k, v in launch.constants().items() if isinstance(v, (int, str))},
                             "num_warps": report.num_warps, "num_stages": report.num_stages,
                             "shared": report.shared, "shared_limit": sm_check.shared_limit(target),
                             "registers": report.registers, "spill_bytes": report.spill_bytes,
                             "wgmma": report.wgmma, "products": report.products, "serialized": report.wgmma_serialized})
                log(f"{name} {target} {report.summary()} ({time.perf_counter() - start:.1f} s)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", action="append", choices=TARGETS, help="targets (default: all three)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT", help="cases whose name contains TEXT")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    rows = run(tuple(args.target or TARGETS), args.only, lambda line: print(line, file=sys.stderr, flush=True))
    print("| case | target | kernel | warps x stages | shared KiB (limit) | registers | spills B | products |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        products = r["products"]
        products += " (serialized)" if r["serialized"] else ""
        print(f"| {r['case']} | {r['target']} | {r['kernel']} | {r['num_warps']} x {r['num_stages']} | "
              f"{r['shared'] / 1024:.1f} ({r['shared_limit'] // 1024}) | {r['registers']} | {r['spill_bytes']} | "
              f"{products} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

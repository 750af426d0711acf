"""The `k3compile` command line: thin, every command a call into the library.

Bad input exits with code 2 and one line per problem (`file:line:col: field: what`),
never a traceback. Heavy imports (torch) happen only in commands that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys

from k3compile import __version__
from k3compile.spec.schema import MAX_BATCH, MAX_CONTEXT  # sizes on the command line: the spec's bounds

EXIT_BAD_INPUT = 2
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


class UsageError(Exception):
    """Bad command-line input that is not a spec error (one line, exit 2)."""


def _add_extends_anywhere(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extends-anywhere", action="store_true",
                   help="let `extends:` follow absolute paths and paths outside the spec root (the working folder, "
                   "or the spec's own folder when it lies outside that); only for specs you trust")


def _add_spec_args(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    p.add_argument("spec", type=_path, help="path to a spec YAML file")
    _add_extends_anywhere(p)
    if overrides:
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="A.B=VALUE",
            help="override a field, type-checked like the file (repeatable), e.g. --set moe.top_k=8",
        )


def _shown(text: str) -> str:
    """An argument in an error, clipped: a 5,000-digit number is not echoed whole."""
    return repr(text) if len(text) <= 40 else repr(text[:20]) + f"... ({len(text):,} characters)"


def _integer(text: str) -> int:
    """An integer argument (at most 40 digits: every count k3compile takes is far smaller)."""
    if not re.fullmatch(r"\s*[-+]?\d{1,40}\s*", text):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not an integer")
    return int(text)


def _positive(text: str, limit: int | None = None) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    if limit is not None and value > limit:
        raise argparse.ArgumentTypeError(f"{value} is more than {limit:,}")
    return value


def _at_most(limit: int):
    """A positive integer of at most `limit`: sizes are bounded before any work proportional to them."""
    return lambda text: _positive(text, limit)


def _path(text: str) -> str:
    """A path argument the system can take: no name over NAME_MAX bytes, at most PATH_MAX in all (else it would
    fail deep inside a command, and be echoed whole)."""
    name_max = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    raw = os.fsencode(text)
    if len(raw) >= 4096 or any(len(part) > name_max for part in raw.split(os.fsencode(os.sep))):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is too long to be a path")
    return text


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _size(text: str) -> int:
    """A byte count such as 5GB, 200MB, 64KiB or 1000000 (Hugging Face's decimal units)."""
    m = re.fullmatch(r"\s*(\d{1,20})\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if m is None or unit not in _UNITS or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a size such as 5GB, 200MB or 1000000")
    return int(m.group(1)) * _UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3compile",
        description="Compile YAML specs of Kimi-K3-class models (KDA + Gated MLA, latent MoE, AttnRes, MX "
        "quantisation) into analysed, runnable PyTorch modules.",
        epilog="Run `k3compile COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"k3compile {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "stats",
        help="parameters, FLOPs, weight and cache bytes from the spec alone",
        description="Static analysis from the spec alone (no tensors): parameters (total, active, per component), "
        "forward FLOPs per token at a context, weight bytes under the quantisation policy and bf16, decode cache "
        "bytes (and the all-full-attention equivalent), routed-expert bytes per expert-parallel rank.",
    )
    _add_spec_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--context", type=_at_most(MAX_CONTEXT), default=None, help="context length N (default: the spec's)")
    p.add_argument("--batch", type=_at_most(MAX_BATCH), default=1, help="decode batch B for cache bytes (default 1)")

    p = sub.add_parser(
        "plan",
        help="per-rank memory and traffic of every dp x tp x pp x ep layout of N GPUs, for training and serving",
        description="From the spec alone: for every dp x tp x pp x ep layout of --gpus GPUs (tp dividing the attention "
        "heads, FFN widths and vocabulary it cuts and, by default, a node's GPUs; ep dividing the routed experts; pp at "
        "most the layers), per rank the fp32 weight, gradient and optimiser bytes (Per-Head Muon momentum, AdamW "
        "moments) as FSDP2 shards them, the activations one training step saves with and without activation "
        "checkpointing under the pipeline schedule, the bytes each collective sends per step (FSDP2 all-gather and "
        "reduce-scatter, Muon's update gather, TP all-gather/reduce-scatter, EP all-to-all, PP send/recv of the "
        "attention-residual sources), the serving weights under the quantisation policy and decode caches, and which "
        "layouts fit the GPU; the best --top of each ranking (docs/distributed.md gives every formula).",
    )
    _add_spec_args(p)
    p.add_argument("--gpus", type=_positive, required=True, help="number of GPUs N (the world size dp x tp x pp x ep)")
    p.add_argument("--gpu", choices=("h200", "h100", "a100", "b200"), required=True, help="GPU kind (its memory)")
    p.add_argument("--batch", type=_positive, default=None,
                   help="global batch in sequences, training's or the sequences served at once (default: one per GPU)")
    p.add_argument("--seq", type=_positive, default=None, help="tokens per sequence (default: training.seq_len)")
    p.add_argument("--microbatch", type=_positive, default=None,
                   help="sequences per microbatch (default: 1 under pipeline parallelism, else a replica's whole share)")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"), default="1f1b",
                   help="pipeline schedule (torch.distributed.pipelining's Schedule1F1B or ScheduleInterleaved1F1B)")
    p.add_argument("--virtual-stages", type=_positive, default=None,
                   help="stages per pipeline rank under --schedule interleaved (default 2)")
    p.add_argument("--gpus-per-node", type=_positive, default=8,
                   help="GPUs per node; tp must divide it (default 8, NVLink within the node)")
    p.add_argument("--tp-across-nodes", action="store_true", help="let tp span nodes (drops the rule above)")
    p.add_argument("--top", type=_positive, default=10, help="layouts shown per table, best first (default 10)")
    p.add_argument("--all", action="store_true", help="show every layout (tables and --json)")
    p.add_argument("--json", action="store_true", help="print one JSON document (the --top layouts, or --all)")

    p = sub.add_parser("check", help="validate a spec and print a one-screen summary",
                       description="Validate a spec (schema and cross-field checks) and summarise it.")
    _add_spec_args(p)

    p = sub.add_parser(
        "diff",
        help="changed fields between two specs, then the change in every derived number",
        description="Compare two specs: the fields that differ, then every derived number (parameters, FLOPs, "
        "bytes) side by side with the change.",
    )
    p.add_argument("a", type=_path, help="first spec")
    p.add_argument("b", type=_path, help="second spec")
    _add_extends_anywhere(p)
    p.add_argument("--context", type=_at_most(MAX_CONTEXT), default=None, help="context length for derived numbers")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = sub.add_parser(
        "build",
        help="lower, run the pass pipeline and emit an importable package",
        description="Lower a spec to a torch.fx graph over k3 ops, run the pass pipeline (interleave, attn_res, "
        "shard_experts, routing, pack_mxfp4, fuse, group_experts, merge_projections, bind_kernels; the graph is "
        "verified after each) and write "
        "DIR/<spec name>/: model.py (Model, InferenceModel), manifest.json, graphs/. Full-size specs build with "
        "meta parameters (shapes only). The build is atomic and only replaces a previous build.",
    )
    _add_spec_args(p)
    p.add_argument("-o", "--out", type=_path, default="build", help="output directory (default: build)")
    p.add_argument("--target", choices=("cpu", "a100", "h100", "h200", "b200"), help="kernel target (default: the spec's)")
    p.add_argument("--mode", choices=("train", "infer", "both"), default="both",
                   help="train: Model (QAT per the policy); infer: InferenceModel (MX-packed weights); both (default)")
    p.add_argument("--dump-after", action="append", default=[], metavar="PASS|all",
                   help="write the graph after PASS (or every pass) into DIR/<name>/graphs/ (repeatable)")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass (repeatable)")
    p.add_argument("--verify-numerics", action="store_true",
                   help="run a small real instance before and after each numerics-preserving pass; fail on a difference")
    p.add_argument("--check-every-pass", action="store_true",
                   help="propagate shapes through the whole graph after every pass (default: only where a pass "
                   "changed it, and fully once at the end)")
    p.add_argument("--cpu-kernels", choices=("auto", "c", "torch"), default="auto",
                   help="CPU target: auto (default) binds the C kernels (kernels/*/*.c, compiled once for this CPU) "
                   "where they build, else the PyTorch references; c insists on them; torch keeps the references")
    p.add_argument("--onnx", action="store_true",
                   help="then export every graph of the build to DIR/<name>/onnx/<graph>.onnx (k3compile export's defaults)")

    p = sub.add_parser(
        "generate",
        help="generate text from a build (byte-level), streaming it as it decodes",
        description="Prefill the prompt's UTF-8 bytes in chunks, then decode token by token with the KDA "
        "recurrent and short-conv state and the MLA latent cache, writing text to stdout as it comes. Takes a "
        "training checkpoint (packed into the inference weights); without one, the seeded initial weights.",
    )
    p.add_argument("build", type=_path, help="a build folder (k3compile build ... -o DIR writes DIR/<name>/), or DIR")
    p.add_argument("--checkpoint", type=_path, help="a training checkpoint or a weights folder such as import-hf's output "
                   "(default: the build's seeded initial weights)")
    p.add_argument("--prompt", required=True, help="the prompt text (encoded as UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=_integer, default=128, help="tokens (bytes) to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass in (0, 1] (default 0.95)")
    p.add_argument("--seed", type=_integer, default=0, help="sampling seed (default 0)")
    p.add_argument("--nproc", type=_positive, default=1, metavar="N",
                   help="serve from N local processes (torch.distributed.run) splitting the routed experts over the "
                   "build's parallel.ep ranks; every rank decodes the same tokens, rank 0 writes them "
                   "(the same as `torchrun --nproc-per-node N -m k3compile generate ...`)")

    p = sub.add_parser(
        "train",
        help="train a spec's (or a build's) Model on bytes, with checkpoints and validation",
        description="Train the emitted Model of a spec (built into OUT/build first) or of a build folder on "
        "byte-level data (default: the Python standard library's sources) with the spec's optimizer, schedule, "
        "gradient clipping and load balancing. Writes OUT/metrics.jsonl and OUT/checkpoints/; --resume continues "
        "exactly where a run stopped.",
    )
    p.add_argument("spec", type=_path, metavar="SPEC_OR_BUILD", help="a spec YAML file or a build folder")
    _add_extends_anywhere(p)
    p.add_argument("--steps", type=_integer, required=True, help="optimizer steps in total (the schedule's length)")
    p.add_argument("--data", type=_path, help="a text file or a folder of text files (default: the Python stdlib's "
                   "sources; byte-level), a token-id file (.npy, or .bin with --data-dtype), or text with --tokenizer")
    p.add_argument("--data-dtype", choices=["uint8", "uint16", "int16", "uint32", "int32", "int64"],
                   help="the element type of a .bin token-id file")
    p.add_argument("--tokenizer", type=_path, metavar="JSON_OR_FOLDER",
                   help="encode the --data text with this tokenizers JSON (or a folder's tokenizer.json, e.g. import-hf's output)")
    p.add_argument("--out", type=_path, help="run folder (default: runs/<spec name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a spec field (repeatable; only training.* for a build), e.g. --set training.lr=0.01")
    p.add_argument("--eval-every", type=_integer, metavar="K", help="validate and checkpoint every K steps (default: steps // 6)")
    p.add_argument("--stop-after", type=_integer, metavar="N",
                   help="stop (with a checkpoint) after N steps of this invocation; --resume continues the schedule")
    p.add_argument("--init-from", type=_path, metavar="WEIGHTS",
                   help="start from these weights instead of the seeded init: a weights folder (import-hf's output) "
                   "or a checkpoint")
    p.add_argument("--log-every", type=_positive, metavar="K",
                   help="log the steps' numbers and update the progress bar every K steps (default: 1 on the CPU, 10 "
                   "on a GPU, where reading a loss makes the host wait for the GPU)")
    p.add_argument("--log", action="append", default=[], choices=["tensorboard"],
                   help="also log the metrics to TensorBoard (events under OUT/tensorboard; needs the tensorboard "
                   "package)")
    p.add_argument("--no-progress", action="store_true",
                   help="print the messages as plain lines without the progress bar (for logs and CI)")
    p.add_argument("--nproc", type=_positive, default=1, metavar="N",
                   help="train in N local processes (started with torch.distributed.run, gloo on CPU, NCCL on CUDA): "
                   "world N = dp x ep from the spec's parallel section (dp inferred as N / ep when left at 1); "
                   "the same as `torchrun --nproc-per-node N -m k3compile train ...` (see docs/distributed.md)")

    p = sub.add_parser(
        "consolidate",
        help="turn a distributed (DCP) training checkpoint into the single-file checkpoint generate reads",
        description="Read a torch.distributed.checkpoint folder written by a multi-process `k3compile train` (any dp x "
        "ep layout) into one process holding every expert, and write its weights and buffers as a single-file "
        "safetensors checkpoint OUT/step-NNNNNN.{safetensors,json} for `generate --checkpoint` and `--init-from`.",
    )
    p.add_argument("checkpoint", type=_path, help="a run folder (its newest checkpoint) or a checkpoints/step-NNNNNN.dcp folder")
    p.add_argument("-o", "--out", type=_path, required=True, help="output folder (absent or empty)")
    p.add_argument("--build", type=_path, help="the run's build folder (default: RUN/build/<package>)")

    p = sub.add_parser(
        "import-hf",
        help="import a Hugging Face Kimi Linear checkpoint: spec, build and converted weights",
        description="Read HF_DIR/config.json and write OUT/spec.yaml (the equivalent spec; a field k3compile cannot "
        "express is an error naming it), build it into OUT/build/<name>/ and convert the safetensors shards into "
        "OUT/weights.safetensors (sharded with an index past --max-shard-size) under the build's names, streaming "
        "shard by shard. Everything is checked before anything is written; OUT appears only when complete.",
    )
    p.add_argument("hf_dir", type=_path, metavar="HF_DIR", help="a folder with config.json and model.safetensors[.index.json]")
    p.add_argument("-o", "--out", type=_path, required=True, help="output folder (absent or empty)")
    p.add_argument("--name", help="spec name (default: HF_DIR's folder name, lower case)")
    p.add_argument("--mode", choices=("train", "infer", "both"), default="both",
                   help="the build (default both); weights are named for the Model, or for the InferenceModel "
                   "(MX-packed where the policy says so) with infer")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a field of the imported spec (repeatable), e.g. --set target=h100")
    p.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="largest weights shard, e.g. 5GB (default), 200MB")
    p.add_argument("--spec-only", action="store_true", help="write OUT/spec.yaml only, from config.json alone")

    p = sub.add_parser(
        "export-hf",
        help="write a build and its weights as a Hugging Face Kimi Linear folder",
        description="Write HF_DIR/config.json and the weights in Kimi Linear's published layout (model.safetensors, "
        "sharded with model.safetensors.index.json past --max-shard-size), which transformers' "
        "KimiLinearForCausalLM.from_pretrained loads. A spec feature Kimi Linear lacks is an error naming it.",
    )
    p.add_argument("build", type=_path, help="a build folder with a training Model")
    p.add_argument("--checkpoint", type=_path, required=True, help="a training checkpoint or a weights folder (import-hf's output)")
    p.add_argument("-o", "--out", type=_path, required=True, help="output folder (absent or empty)")
    p.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="largest shard, e.g. 5GB (default), 200MB")
    _add_export_parser(sub)
    _add_ablate_parser(sub)
    return parser


def _cmd_stats(args) -> None:
    from k3compile.analysis.stats import spec_stats
    from k3compile.report import print_stats
    from k3compile.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides, args.extends_anywhere)
    stats = spec_stats(spec, args.context, args.batch)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print_stats(stats)


def _cmd_plan(args) -> None:
    from k3compile.analysis.plan import PlanError, plan
    from k3compile.report import print_plan
    from k3compile.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides, args.extends_anywhere)
    try:
        result = plan(spec, args.gpus, args.gpu, args.batch, args.seq, microbatch=args.microbatch,
                      schedule=args.schedule, virtual_stages=args.virtual_stages,
                      gpus_per_node=None if args.tp_across_nodes else args.gpus_per_node,
                      top=None if args.all else args.top)  # fmt: skip
    except PlanError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result)


def _cmd_check(args) -> None:
    from k3compile.report import print_check
    from k3compile.spec.load import load_spec

    print_check(load_spec(args.spec, args.overrides, args.extends_anywhere), args.spec)


def _cmd_diff(args) -> None:
    from k3compile.report import print_diff, spec_diff
    from k3compile.spec.load import load_spec

    a, b = (load_spec(p, extends_anywhere=args.extends_anywhere) for p in (args.a, args.b))
    diff = spec_diff(a, b, args.context)
    if args.json:
        print(json.dumps(diff, indent=2))
    else:
        print_diff(diff, args.a, args.b)


def _cmd_build(args) -> None:
    from k3compile.build import GRAPHS_OF_MODE, MODES, BuildOptions, build, pipeline
    from k3compile.emit.package import BuildDirError
    from k3compile.ir.pass_manager import NumericsMismatch, PassFailure
    from k3compile.report import print_build
    from k3compile.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides, args.extends_anywhere)
    known = [p.name for p in pipeline()]
    for name in args.disable_pass + [d for d in args.dump_after if d != "all"]:
        if name not in known:
            raise UsageError(f"unknown pass '{name}'; passes are: {', '.join(known)}")
    options = BuildOptions(
        target=args.target,
        mode=args.mode,
        disabled=frozenset(args.disable_pass),
        dump_after=frozenset(args.dump_after),
        verify_numerics=args.verify_numerics,
        check_every_pass=args.check_every_pass,
        cpu_kernels=args.cpu_kernels,
    )
    from rich.console import Console
    from rich.progress import Progress

    graphs = sum(len(GRAPHS_OF_MODE[m]) for m in (MODES if args.mode == "both" else (args.mode,)))
    console = Console(stderr=True)  # progress on a terminal's stderr only: stdout is the summary, stderr the errors
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"building {spec.name}", total=graphs * len(known))
        try:
            dest, manifest = build(
                spec, args.out, options, on_pass=lambda name: progress.update(task, advance=1, description=name)
            )
        except (PassFailure, NumericsMismatch, BuildDirError, ValueError) as e:
            raise UsageError(str(e)) from None
    print_build(dest, manifest)
    if args.onnx:
        _export_and_report(dest, dest / "onnx")


def _cmd_generate(args) -> None:
    import time

    from k3compile.runtime.generate import (
        GenerateError, build_spec, check_request, check_weights, encode, generate_tokens, load_build,
        load_inference_model, serving_device, stream_text,
    )
    from k3compile.runtime import distributed

    if not SEED_RANGE[0] <= args.seed < SEED_RANGE[1]:
        raise UsageError(f"--seed must be an integer in [-2^63, 2^64), got {args.seed}")
    layout = None
    try:
        module = load_build(args.build)
        device = serving_device(module, args.build)  # a GPU build on a machine without a GPU: one line
        spec = build_spec(module)
        if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
            distributed.degrees(spec, args.nproc)  # the layout's error in one line, before any process starts
            return _launch(args)
        prompt = encode(args.prompt)
        check_request(spec, prompt, args.max_new_tokens, args.temperature, args.top_p)
        check_weights(module, args.checkpoint)
        layout = distributed.start(spec, training=False, device=device)
        distributed.use_experts(layout)  # this rank holds and runs only its experts
        if args.checkpoint is None and layout.main:
            print(f"note: no --checkpoint: using the seeded initial weights of {args.build}", file=sys.stderr)
        model = load_inference_model(module, args.checkpoint, device)
        caches = []
        start = time.perf_counter()
        tokens = generate_tokens(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                                 on_cache=caches.append)
        write = (lambda text: (sys.stdout.write(text), sys.stdout.flush())) if layout.main else (lambda text: None)
        stream_text(tokens, write)
    except (GenerateError, distributed.LayoutError) as e:
        raise UsageError(str(e)) from None
    finally:
        if layout is not None:
            distributed.stop(layout)
    if not layout.main:
        return
    print(flush=True)
    if caches:
        b = caches[0].nbytes()
        seconds = time.perf_counter() - start
        print(f"{args.max_new_tokens} tokens after a {len(prompt)}-token prompt in {seconds:.1f} s; "
              f"cache: KDA {b['kda_state']:,} B, MLA {b['mla_latent']:,} B", file=sys.stderr)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _launch_train(args) -> None:
    """Check the training layout, then start `args.nproc` local processes of this train command."""
    from k3compile.runtime import distributed
    from k3compile.runtime.train import TrainError, resolve

    try:  # the layout's errors in one line here, before any process starts
        spec, _ = resolve(args.spec, args.overrides, args.extends_anywhere)
        distributed.degrees(spec, args.nproc)
        distributed.check_batch(spec, args.nproc)
    except (TrainError, distributed.LayoutError) as e:
        raise UsageError(str(e)) from None
    _launch(args)


def _launch(args) -> None:
    """Start `args.nproc` local processes of this command with torch.distributed.run; exit with its code."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "k3compile", *_without_nproc(args.argv)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.run(cmd, env=env).returncode
    if code:
        raise SystemExit(code)


def _cmd_train(args) -> None:
    from k3compile.emit.package import BuildDirError
    from k3compile.ir.pass_manager import NumericsMismatch, PassFailure
    from k3compile.runtime.checkpoint import CheckpointError
    from k3compile.runtime.data import DataError
    from k3compile.runtime.train import TrainError
    from k3compile.training import train

    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_train(args)
    try:
        train(args.spec, args.steps, data=args.data, out=args.out, resume=args.resume, overrides=args.overrides,
              eval_every=args.eval_every, stop_after=args.stop_after, init_from=args.init_from,
              extends_anywhere=args.extends_anywhere, log_every=args.log_every, log=args.log,
              progress="plain" if args.no_progress else True, tokenizer=args.tokenizer, data_dtype=args.data_dtype)
    except (TrainError, DataError, CheckpointError, PassFailure, NumericsMismatch, BuildDirError) as e:
        raise UsageError(str(e)) from None


def _cmd_consolidate(args) -> None:
    from k3compile.runtime.checkpoint import CheckpointError
    from k3compile.runtime.sharded_checkpoint import consolidate_run

    try:
        written = consolidate_run(args.checkpoint, args.out, args.build)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {written}")


def _cmd_import_hf(args) -> None:
    from k3compile.emit.package import BuildDirError
    from k3compile.hf.convert import import_hf
    from k3compile.ir.pass_manager import NumericsMismatch, PassFailure

    try:
        done = import_hf(args.hf_dir, args.out, name=args.name, mode=args.mode, overrides=args.overrides,
                         max_shard_bytes=args.max_shard_size, spec_only=args.spec_only)
    except (ValueError, PassFailure, NumericsMismatch, BuildDirError) as e:
        raise UsageError(" ".join(str(e).split())) from None
    print(f"spec:    {done.out / 'spec.yaml'}")
    if args.spec_only:
        return
    print(f"build:   {done.build}")
    print(f"weights: {done.tensors} tensors in {', '.join(p.name for p in done.weights)}")


def _cmd_export_hf(args) -> None:
    from k3compile.hf.export import export_hf

    try:
        files = export_hf(args.build, args.checkpoint, args.out, args.max_shard_size)
    except ValueError as e:
        raise UsageError(" ".join(str(e).split())) from None
    print(f"wrote {args.out}: {', '.join(p.name for p in files)}")


# ---------------------------------------------------------------- export (issue 12)


def _add_export_parser(sub) -> None:
    from k3compile.emit.onnx import DEFAULT_OPSET, GRAPHS, WEIGHTS

    p = sub.add_parser(
        "export",
        help="export a build's compiled graphs to ONNX (k3 ops as ONNX functions)",
        description="Export a build's compiled graphs to OUT_DIR/<graph>.onnx through torch's ONNX exporter: every "
        "k3 op becomes a local function in domain k3 whose body is standard ONNX, MXFP4 experts FLOAT4E2M1 + E8M0 "
        "through DequantizeLinear (--mx fp4) or packed bytes decoded by standard ops (--mx uint8, which "
        "onnxruntime runs on CPU). Inputs and outputs are named (tokens, positions, logits, the caches as "
        "kda_state.<layer>, ..., mla_cache.<layer> in and new.<name> out), batch and sequence axes dynamic, and the build's "
        "spec hash, compiler, graph and target are in metadata_props. Each distinct layer kind is one function "
        "too (domain k3.layer: prefill_kda, decode_moe, ...), called once per layer.",
    )
    p.add_argument("build", type=_path, help="a build folder (k3compile build ... -o DIR writes DIR/<name>/), or DIR")
    p.add_argument("-o", "--out", type=_path, required=True, metavar="OUT_DIR", help="folder for <graph>.onnx (created if missing)")
    p.add_argument("--graph", default="infer", metavar="GRAPH",
                   help=f"{' | '.join(GRAPHS)} | all: infer (tokens -> logits), prefill (tokens and zeroed caches -> "
                   "logits and caches), decode (tokens [batch, 1], positions and caches -> logits and caches); all: "
                   "every graph the build has (train is not exportable yet); default infer")
    p.add_argument("--weights", default=None, metavar="MODE",
                   help=f"{' | '.join(WEIGHTS)}: initializers in the file (external data past 2 GB), in "
                   "<graph>.onnx.data, or none (structure only: weights become typed inputs); default inline, "
                   "none for a meta-device (shapes only) build")
    p.add_argument("--mx", default="fp4", metavar="FP4|UINT8",
                   help="fp4 (FLOAT4E2M1 + E8M0 scales through DequantizeLinear, opset >= 24; default) or uint8")
    p.add_argument("--opset", type=_integer, default=DEFAULT_OPSET, metavar="N", help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--check", action="store_true",
                   help="run onnx.checker (full), strict shape inference and a numerical comparison with PyTorch "
                   "on random tokens; print the k3 functions used and the largest relative error")
    p.add_argument("--flat", action="store_true",
                   help="no layer functions: every layer's ops stay in the main graph (the k3 ops are still functions)")


def _export_and_report(build, out, **options) -> None:
    """Export, print one line per graph (and the check's findings); bad input is a UsageError, a failed check exits 1."""
    import onnx

    from k3compile.emit.onnx.export import ExportError, export_onnx

    try:
        results = export_onnx(build, out, **options)
    except ExportError as e:
        raise UsageError(str(e)) from None
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        print(f"error: the exported ONNX failed its check: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(1) from None
    for r in results:
        print(f"wrote {r.path} ({r.bytes / 1e6:.1f} MB in {r.seconds:.1f} s): {sum(r.functions.values())} k3 calls "
              f"of {len(r.functions)} functions" + (f", {sum(r.layers.values())} layer calls of {len(r.layers)} "
                                                   "layer kinds" if r.layers else ""))
        for note in r.notes:
            print(f"  note: {note}")
        if r.check is None:
            continue
        c = r.check
        print(f"  checker: {c['checker']}; shape inference: {c['shape_inference']}")
        width = max(map(len, c["functions"]))
        for name, count in c["functions"].items():
            print(f"  k3.{name:<{width}}  {count:>5}")
        for name, count in c.get("layers", {}).items():
            print(f"  k3.layer.{name:<{max(width - 6, len(name))}}  {count:>5}")
        if c["nested_functions"]:
            print(f"  called inside those: {', '.join('k3.' + n for n in c['nested_functions'])}")
        if "engine" in c:
            print(f"  {c['engine']} vs PyTorch on random tokens {c['inputs']}: largest relative error "
                  f"{c['max_relative_error']:.3g} (max-abs), {c['rms_relative_error']:.3g} (rms)")
        else:
            print(f"  numerics: {c['numerics']}")


def _cmd_export(args) -> None:
    _export_and_report(args.build, args.out, graph=args.graph, weights=args.weights, mx=args.mx.lower(),
                       opset=args.opset, check=args.check, flat=args.flat)


# ---------------------------------------------------------------- ablate (issue 14)


def _add_ablate_parser(sub) -> None:
    p = sub.add_parser(
        "ablate",
        help="train a base spec and its variants on the same data, seeds and budget; compare loss and MQAR recall",
        description="Train BASE and every VARIANT (spec files, and the points of each --grid) for the same budget on "
        "the same data order and seeds, on byte-level LM (validation loss) and MQAR (multi-query associative recall, "
        "held-out accuracy). Writes OUT/results.json, OUT/results.md, OUT/loss.png and OUT/mqar.png and prints a "
        "table. Rerun the same command to continue a stopped study: finished runs are skipped and the interrupted "
        "one resumes from its checkpoint. BASE may instead be a STUDY.yaml naming base, variants, grid, steps or "
        "tokens, seeds, tasks, mqar, data, set, eval_every, jobs and out; options given here override it.",
    )
    p.add_argument("base", type=_path, metavar="BASE_OR_STUDY", help="the base spec YAML, or a study YAML")
    p.add_argument("variants", type=_path, nargs="*", metavar="VARIANT", help="variant spec files (usually `extends:` the base)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="one variant per value of a spec field (repeatable: the cartesian product), e.g. moe.top_k=2,4,8")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=_integer, help="optimizer steps per run")
    budget.add_argument("--tokens", type=_integer, help="training tokens per run (steps = tokens / (batch x seq_len))")
    p.add_argument("--seeds", help="comma list of seeds, e.g. 0,1,2 (default 0): init and data order per seed")
    p.add_argument("--tasks", help="comma list of lm, mqar (default both)")
    p.add_argument("--mqar", action="append", default=[], metavar="KEY=N",
                   help="MQAR difficulty: num_kv_pairs, seq_len, num_queries, vocab (repeatable), e.g. num_kv_pairs=8")
    p.add_argument("--data", type=_path, help="LM text file or folder (default: the Python stdlib's sources)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a field of every variant (repeatable), e.g. --set num_layers=4")
    p.add_argument("--eval-every", type=_integer, metavar="K", help="evaluate and checkpoint every K steps (default: steps // 6)")
    p.add_argument("--jobs", type=_integer, help="runs in parallel, each with its share of the CPU threads (default 1)")
    p.add_argument("--out", type=_path, help="study folder (created; a rerun into it continues the same study)")


def _cmd_ablate(args) -> None:
    from k3compile.ablation import AblateError, ablate
    from k3compile.ir.pass_manager import NumericsMismatch, PassFailure
    from k3compile.runtime.checkpoint import CheckpointError
    from k3compile.runtime.data import DataError
    from k3compile.runtime.train import TrainError

    def ints(text, what):
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise UsageError(f"--{what}: expected a comma list of integers, got {_shown(text)}") from None

    mqar = {}
    for item in args.mqar:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--mqar: expected KEY=N, got {_shown(item)}")
        mqar[key.strip()] = ints(value, "mqar")[0]
    try:
        ablate(args.base, args.variants, args.grid, steps=args.steps, tokens=args.tokens,
               seeds=ints(args.seeds, "seeds") if args.seeds else None,
               tasks=tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else None, mqar=mqar or None,
               data=args.data, overrides=args.overrides, eval_every=args.eval_every, jobs=args.jobs, out=args.out,
               progress=True)
    except (AblateError, TrainError, DataError, CheckpointError, PassFailure, NumericsMismatch) as e:
        raise UsageError(str(e)) from None


COMMANDS = {
    "stats": _cmd_stats, "plan": _cmd_plan, "check": _cmd_check, "diff": _cmd_diff, "build": _cmd_build,
    "generate": _cmd_generate, "train": _cmd_train, "ablate": _cmd_ablate, "consolidate": _cmd_consolidate,
    "import-hf": _cmd_import_hf, "export-hf": _cmd_export_hf, "export": _cmd_export,
}


def main(argv: list[str] | None = None) -> int:
    from k3compile.spec.load import SpecError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        COMMANDS[args.command](args)
    except SpecError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt as e:  # train's Interrupted carries the signal: 130 for Ctrl-C, 143 for SIGTERM
        signum = getattr(e, "signum", signal.SIGINT)
        stopped = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(stopped, file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())

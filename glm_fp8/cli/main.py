"""``glm-fp8``: the command line of glm_fp8 (the ``main`` below is the installed script).

DESCRIPTION is what ``glm-fp8 --help`` prints first; every option's help states its default."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from glm_fp8.cli.args import SERVER_SYNTAX, int_at_least, int_in, positive_float, positive_int, server_spec
from glm_fp8.cli.plan import add_delta_arguments, plan_command
from glm_fp8.core.vocab import SCALE_FORMATS, WIRE_FORMATS


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        # The kernels run on the CPU only in Triton's interpreter; set before glm_fp8 loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from glm_fp8.cli import bench

    device = torch.device("cuda" if on_gpu else "cpu")
    available = bench.fused_backends(device)
    for name in dict.fromkeys(args.backend or []):
        if name not in available:
            parser.error(
                f"argument --backend: {name!r} is not available on {device.type} "
                f"(available here: {', '.join(available) or 'none'})"
            )
    shapes = args.shapes if args.shapes != "auto" else ("glm5" if on_gpu else "small")
    cases = bench.glm5_cases() if shapes == "glm5" else bench.small_cases()
    if args.case:
        for key in args.case:
            if not any(key in c.name for c in cases):
                parser.error(
                    f"argument --case: {key!r} matches no {shapes} case "
                    f"(available: {', '.join(c.name for c in cases)})"
                )
        cases = [c for c in cases if any(k in c.name for k in args.case)]
    with_compile = on_gpu and not args.no_compile
    print(
        f"device: {_device_name(device)}; torch {torch.__version__}; "
        f"triton {_triton_version()}; shapes: {shapes}",
        file=sys.stderr,
    )
    rows = []
    for case in cases:
        print(f"  {case.name}: {case.note}", file=sys.stderr)
        try:
            rows.extend(bench.run_case(case, device, with_compile, args.budget_ms, args.backend, args.rounds))
        except torch.OutOfMemoryError as exc:
            # GLM-5's fp32 case holds its inputs, their copy and the outputs at once (about 81 GiB):
            # more than an 80 GB GPU has. Said, and the other cases still run.
            torch.cuda.empty_cache()
            print(
                f"  {case.name}: skipped, it does not fit this GPU: {str(exc).splitlines()[0]}",
                file=sys.stderr,
            )
    print(bench.format_rows(rows, markdown=args.markdown))
    if not on_gpu:
        print(bench.CPU_NOTE)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    if torch.cuda.device_count() < 2:
        # The ranks run the kernels in Triton's interpreter; set before glm_fp8 loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from glm_fp8.cli.demo import run_demo

    return run_demo(args.world, args.layers, args.ring, args.wire)


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"


def _triton_version() -> str:
    import triton

    return triton.__version__


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line and a pointer to --help (its subcommands' too),
    not the usage block before the message."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee '{self.prog} --help'\n")


DESCRIPTION = """\
Fused block-FP8 weight updates from an RL trainer to a vLLM engine, for huge MoE models (GLM-5 and
its family). Subcommands:
  demo   a sender and receivers as local processes update a scaled-down GLM-5; every byte is
         checked against the reference (gloo on a CPU, NCCL with 2 GPUs or more; no download)
  plan   for a deployment: the mode auto picks, the predicted update time and every rank's extra
         memory; sizes and peaks per layer kind on request (a preset or a config.json; no download)
  bench  the fused quantizer against a copy of the same bytes and the PyTorch reference
Run `glm-fp8 <subcommand> --help` for its options. Python API and docs: README.md, docs/."""


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    from glm_fp8 import __version__
    from glm_fp8.model.presets import FLEETS
    from glm_fp8.planning.request import MAX_ENGINE_RANKS, MAX_ENGINES, MAX_TRAINER_GPUS

    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="glm-fp8", description=DESCRIPTION, formatter_class=raw)
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"glm-fp8 {__version__}",
        help="print the version of glm_fp8 and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,plan,bench}")
    d = sub.add_parser(
        "demo",
        help="update a scaled-down GLM-5 between local processes and check every byte",
        description="Local processes: rank 0 converts a synthetic GLM-5 scaled down 24x (hidden 256, "
        "11 experts) and sends it, layer by layer, pipelined; the others receive every layer and "
        "compare each byte with the PyTorch reference. gloo on the CPU (the kernels then run in "
        "Triton's interpreter), NCCL with 2 GPUs or more. Prints a per-layer table; exit code 0 "
        "iff every byte matched.",
    )
    d.add_argument(
        "--world",
        type=int_at_least(2),
        help="processes, >= 2: one sender and at least one receiver (default: 3 on a CPU, one per GPU "
        "up to 4)",
    )
    d.add_argument("--layers", type=positive_int, default=4, help="layers; the first is dense (default: 4)")
    d.add_argument(
        "--ring",
        type=positive_int,
        default=2,
        help="the sender's conversion buffers (1 serializes conversion and sending; receivers keep at "
        "least 2) (default: 2)",
    )
    d.add_argument(
        "--wire",
        choices=WIRE_FORMATS,
        default="fp8",
        help="the wire format: fp8: send kernel-format fp8 entries; bf16: send them unquantized, "
        "receivers quantize (default: fp8)",
    )
    d.set_defaults(func=_demo)
    p = sub.add_parser(
        "plan",
        help="the mode auto picks, update time and every rank's memory for a deployment (no download)",
        description="First a summary: the model's layer kinds and size; with --trainer-gpus (or "
        '--nodes), the mode the vLLM backend\'s mode="auto" picks and why, the predicted time of a '
        "whole-model update, and every rank's extra GPU memory during one (each figure says what it "
        "counts), and whether the master shards fit a trainer GPU; the servers are --engines replicas "
        "of one --engine-* layout, or a fleet of servers of their own layouts (--server, repeated, or "
        "--fleet), each server's busiest rank's received bytes and each trainer rank's NIC bytes said "
        "too. --detail adds the tables: each "
        "layer kind's conversion peak per path (eager, preallocated stack, glm_fp8), the fit per "
        "path, each engine rank's wire bytes and extra memory per mode, every strategy's predicted "
        "time (docs/update_time.md) and the many senders' transfer plan. --json prints all of it as "
        "one JSON object (glm_fp8.planning.report.plan_report). Flags that would be ignored or that "
        "contradict each other are refused.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        type=str.lower,
        help="an embedded preset (any case): glm-5, glm-5.2, glm-4.5, deepseek-v3, deepseek-v3.2, kimi-k2, "
        "qwen3-moe (default: the --fleet preset's model, else glm-5)",
    )
    src.add_argument("--config", help="a Hugging Face config.json instead of a preset (default: none)")
    p.add_argument("--detail", action="store_true", help="also print every table behind the summary")
    p.add_argument(
        "--target",
        choices=["hopper", "blackwell"],
        default="hopper",
        help="the layer table's kernel format: hopper: float32 block scales; blackwell: UE8M0 scales "
        "packed for DeepGEMM SM100 (vLLM's weights are Hopper's layout: not with --engine-tp or "
        "--trainer-gpus) (default: hopper)",
    )
    p.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the dtype the trainer holds its master weights in: their resident size, and the dtype "
        "they are gathered in unless --gather-dtype casts (default: fp32)",
    )
    p.add_argument(
        "--gather-dtype",
        choices=["trainer", "bf16", "fp32"],
        default="trainer",
        help="the dtype tensors travel in to the rank that converts them: trainer: no cast, each in "
        "the trainer's own dtype (the library's gather_dtype=None); bf16 or fp32: cast first, an "
        "opt-in whose bytes then differ from the checkpoint's (default: trainer)",
    )
    gpus = f"at most {MAX_TRAINER_GPUS} trainer GPUs: the many senders' plan is computed per sender"
    p.add_argument(
        "--nodes",
        type=int_in(1, MAX_TRAINER_GPUS, gpus),
        help="train nodes: the trainer GPUs are --nodes x --gpus-per-node (the same as --trainer-gpus; "
        "give one, or both agreeing) (default: none)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int_in(1, MAX_TRAINER_GPUS, gpus),
        help="GPUs per train node, with --nodes (default: 8)",
    )
    p.add_argument(
        "--gpu-gib",
        type=positive_float,
        help="usable memory per trainer GPU, GiB, for whether the master shards and a peak fit, with "
        "--trainer-gpus or --nodes (default: 139, an H200)",
    )
    p.add_argument("--entries", action="store_true", help="also list every entry of each layer kind")
    ranks = f"at most {MAX_ENGINE_RANKS} ranks per engine: each rank's shard is computed"
    p.add_argument(
        "--engine-tp",
        type=int_in(1, MAX_ENGINE_RANKS, ranks),
        help="vLLM tensor-parallel size: each engine rank's wire bytes and extra memory (default: not "
        "shown without --trainer-gpus; 8 with it)",
    )
    p.add_argument(
        "--engine-dp",
        type=int_in(1, MAX_ENGINE_RANKS, ranks),
        help="vLLM data-parallel size, with --engine-tp (default: 1)",
    )
    p.add_argument(
        "--engine-ep",
        action="store_true",
        help="vLLM --enable-expert-parallel, with --engine-tp (default: experts by MoE TP)",
    )
    p.add_argument(
        "--scale-fmt",
        choices=list(SCALE_FORMATS),
        help="block-scale format on the wire; ue8m0: powers of two, as DeepGEMM holds them (default: fp32)",
    )
    p.add_argument(
        "--trainer-gpus",
        type=int_in(1, MAX_TRAINER_GPUS, gpus),
        help="the trainer's GPUs: the mode auto picks, the predicted update time and every rank's "
        "memory for an update into --engines replicas of the --engine-* layout (default: none)",
    )
    p.add_argument(
        "--trainer",
        metavar="megatron:tpN,ppN,cpN,epN[,etpN][,firstN][,lastN][,stepN]",
        help="a Megatron-Core trainer's parallel sizes (e.g. megatron:tp4,pp8,cp2,ep16; etpN: expert "
        "tensor parallel; firstN / lastN: "
        "the first and last pipeline stages' decoder layers, as Megatron's "
        "--decoder-first/last-pipeline-num-layers; stepN: steps of N layers, one of each stage in "
        "turn, glm_fp8's step_layers): with many senders, each pipeline stage's "
        "expert-parallel ranks send its layers (default: every trainer GPU holds its share of "
        "every layer, FSDP2 / EP)",
    )
    p.add_argument(
        "--engines",
        type=int_in(1, MAX_ENGINES, "each replica is a destination of the many senders' plan"),
        help="engine replicas, with --trainer-gpus (default: 1)",
    )
    p.add_argument(
        "--link-gbps",
        type=positive_float,
        help="network link per GPU, Gb/s, with --trainer-gpus: every trainer GPU's, and every server "
        "GPU's unless its --server says gbps= (default: 400, or the --fleet preset's)",
    )
    p.add_argument(
        "--server",
        action="append",
        type=server_spec,
        metavar="SPEC",
        help="one vLLM server of a fleet, with --trainer-gpus or --nodes, instead of --engines and "
        f"--engine-*: {SERVER_SYNTAX}; repeat for each server (its ranks follow the previous "
        "server's) (repeatable; default: one engine layout)",
    )
    p.add_argument(
        "--fleet",
        choices=sorted(FLEETS),
        help="a named fleet (glm_fp8.model.presets.FLEETS): its trainer GPUs, NIC, servers and model, "
        "each unless --trainer-gpus / --nodes, --link-gbps, --model or --config says otherwise; "
        "prime-rl-glm-5.2: 128 trainer GPUs into 2 x prefill (TP 8 x DP 4, EP) + 2 x decode (DP 32, "
        "EP); glm-5-4xep8: 32 into 4 x EP 8 (default: none)",
    )
    p.add_argument(
        "--experts-split",
        action="store_true",
        help="with --trainer-gpus: the trainer's shards split experts (not Shard(0) on the expert dim), "
        "so mode auto picks scatter and many senders do not apply (default: whole experts per rank)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the whole report (summary and every table) as one JSON object instead of text",
    )
    add_delta_arguments(p)
    p.set_defaults(func=plan_command)
    b = sub.add_parser(
        "bench",
        help="time the fused quantizer against a copy of the same bytes and the reference",
        description="GB/s over the ideal bytes, share of a device-to-device copy's bandwidth "
        "measured in the same run, and peak transient memory. GLM-5 shapes on a GPU, small "
        "shapes on the CPU (Triton interpreter: the figures then show only that it runs).",
    )
    b.add_argument(
        "--shapes",
        choices=["auto", "glm5", "small"],
        default="auto",
        help="auto: glm5 on a GPU, small on the CPU (default: auto)",
    )
    b.add_argument(
        "--case", action="append", help="run only cases whose name contains this (repeatable; default: all)"
    )
    b.add_argument(
        "--backend",
        action="append",
        choices=["triton", "cuda"],
        help="time only this fused backend (repeatable; default: every one available)",
    )
    b.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile of the reference (on a GPU it is timed)"
    )
    b.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    b.add_argument(
        "--budget-ms",
        type=positive_float,
        default=1000.0,
        help="timing budget per method and round, ms (default: 1000)",
    )
    b.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="time the copy and every method in turn this many times and report medians (default: 1)",
    )
    b.add_argument("--markdown", action="store_true", help="print a Markdown table")
    b.add_argument("--json", help="also write the rows to this JSON file (default: none)")
    b.set_defaults(func=_bench)
    return parser, sub


def _interpret_kernels_on_cpu(argv: list[str]) -> None:
    """Triton's interpreter where the kernels will run on the CPU (no GPU, or ``bench --cpu``). Set
    before the parser loads: its defaults import glm_fp8 modules, which define the kernels, and a
    kernel defined without the interpreter fails on a CPU ("0 active drivers")."""
    import torch

    if not torch.cuda.is_available() or (argv[:1] == ["bench"] and "--cpu" in argv):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    _interpret_kernels_on_cpu(list(sys.argv[1:] if argv is None else argv))
    parser, sub = build_parser()
    args = parser.parse_args(argv)
    # Checks that need runtime knowledge (presets, files, cases, backends) report through the subparser.
    return args.func(args, sub.choices[args.command])

"""``glm-fp8``: the command line of glm_fp8 (the ``main`` below is the installed script).

DESCRIPTION is what ``glm-fp8 --help`` prints first; every option's help states its default."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low`` (the error names the option)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse ``type=``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        # The kernels run on the CPU only in Triton's interpreter; set before glm_fp8 loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from glm_fp8 import bench

    device = torch.device("cuda" if on_gpu else "cpu")
    available = bench.fused_backends(device)
    for name in dict.fromkeys(args.backend or []):
        if name not in available:
            parser.error(f"argument --backend: {name!r} is not available on {device.type} "
                         f"(available here: {', '.join(available) or 'none'})")  # fmt: skip
    shapes = args.shapes if args.shapes != "auto" else ("glm5" if on_gpu else "small")
    cases = bench.glm5_cases() if shapes == "glm5" else bench.small_cases()
    if args.case:
        for key in args.case:
            if not any(key in c.name for c in cases):
                parser.error(f"argument --case: {key!r} matches no {shapes} case "
                             f"(available: {', '.join(c.name for c in cases)})")  # fmt: skip
        cases = [c for c in cases if any(k in c.name for k in args.case)]
    with_compile = on_gpu and not args.no_compile
    print(f"device: {_device_name(device)}; torch {torch.__version__}; "
          f"triton {_triton_version()}; shapes: {shapes}", file=sys.stderr)  # fmt: skip
    rows = []
    for case in cases:
        print(f"  {case.name}: {case.note}", file=sys.stderr)
        rows.extend(bench.run_case(case, device, with_compile, args.budget_ms, args.backend, args.rounds))
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
    from glm_fp8.demo import run_demo

    return run_demo(args.world, args.layers, args.ring, args.mode)


def _load_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The --config file or the --model preset, validated (``glm_fp8.config.as_config``);
    argparse errors for what cannot be read or used."""
    from glm_fp8.models import PRESETS, load_config

    if not args.config:
        if args.model not in PRESETS:
            parser.error(f"argument --model: unknown preset {args.model!r} "
                         f"(expected one of: {', '.join(sorted(PRESETS))})")  # fmt: skip
        return load_config(args.model)
    try:
        return load_config(config_path=args.config)
    except ValueError as e:
        parser.error(f"argument --config: {str(e).removeprefix('config: ')}")


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch
    from tabulate import tabulate

    from glm_fp8.memory import estimate_memory, master_bytes_per_gpu
    from glm_fp8.models import layer_kind
    from glm_fp8.plan import plan_from_config

    config = _load_config(args, parser)
    if args.trainer_gpus:
        timing, transfer = _update_time(args, config, parser)
        if args.json:
            print(json.dumps(timing, indent=1))
            return 0
    engine_table = _engine_bytes_table(args, config, parser) if args.engine_tp else None  # checked first
    gib = 2**30
    plans: dict = {}  # layer kind -> (plan, layer indices), in order of first appearance
    try:
        for i in range(config["num_hidden_layers"]):
            kind = layer_kind(config, i)
            if kind not in plans:
                plans[kind] = (plan_from_config(config, i, target=args.target), [])
            plans[kind][1].append(i)
    except ValueError as e:  # a config as_config accepts whose indexer schedule is read two ways
        if not args.config:
            raise
        parser.error(f"argument --config: {args.config!r} is not a usable config: {e}")
    gather = torch.float32 if args.gather_dtype == "fp32" else torch.bfloat16
    rows = []
    for kind, (plan, idx) in plans.items():
        est = estimate_memory(plan, gather)
        rows.append([kind, len(idx), _ranges(idx), len(plan.entries), f"{plan.nbytes / gib:.2f}",
                     f"{est.inputs / gib:.2f}", f"{est.eager / gib:.1f}",
                     f"{est.preallocated_stack / gib:.1f}", f"{est.glm_fp8 / gib:.1f}"])  # fmt: skip
    total = sum(p.nbytes * len(idx) for p, idx in plans.values())
    print(f"{config['model_type']}: {config['num_hidden_layers']} layers ("
          + ", ".join(f"{len(idx)} {kind}" for kind, (_, idx) in plans.items())
          + f"); target {args.target}; gathered in {args.gather_dtype}; "
          f"all layers in kernel format {total / gib:.1f} GiB")  # fmt: skip
    print(tabulate(rows, ["layer kind", "layers", "indices", "entries", "kernel-format GiB", "gathered GiB",
                          "eager peak GiB", "prealloc-stack peak GiB", "glm_fp8 peak GiB"]))  # fmt: skip
    if args.nodes:
        world = args.nodes * args.gpus_per_node
        resident = master_bytes_per_gpu(config, world) / gib
        print(f"\nresident fp32 master shards per GPU ({world} GPUs, layers only): {resident:.1f} GiB")
        biggest = max(plans.items(), key=lambda kv: estimate_memory(kv[1][0]).eager)
        est = estimate_memory(biggest[1][0])
        paths = (("eager", est.eager), ("preallocated stack", est.preallocated_stack),
                 ("glm_fp8", est.glm_fp8))  # fmt: skip
        fits = lambda b: "yes" if resident + b / gib <= args.gpu_gib else "NO"  # noqa: E731
        table = [[name, f"{resident + b / gib:.1f}", fits(b)] for name, b in paths]
        head = [f"path ({biggest[0]} layer)", "resident + peak GiB", f"fits {args.gpu_gib:g} GiB"]
        print(tabulate(table, head))
        print("fits: the fp32 master shards of the decoder layers plus one layer's conversion "
              "peak only; optimizer state, gradients, activations, allocator cache not counted")  # fmt: skip
    if engine_table:
        print(engine_table)
    if args.trainer_gpus:
        _print_update_time(args, timing)
        if transfer is not None:
            _print_transfer_plan(transfer)
    if args.entries:
        for kind, (plan, _) in plans.items():
            print(f"\n{kind} layer entries:")
            table = [[e.name, str(e.dtype).removeprefix("torch."), tuple(e.shape), e.offset, e.nbytes]
                     for e in plan.entries]  # fmt: skip
            print(tabulate(table, ["name", "dtype", "shape", "offset", "bytes"]))
    return 0


def _fleet(args: argparse.Namespace):
    from glm_fp8.update_time import Fleet

    return Fleet(args.trainer_gpus, args.engines, args.engine_tp or 8, args.engine_dp, args.engine_ep,
                 args.link_gbps, not args.experts_split)  # fmt: skip


def _print_transfer_plan(tp) -> None:
    from tabulate import tabulate

    from glm_fp8.engine.routes import describe

    gib = 2**30
    n = len(tp.senders)
    print()
    print(f"many senders' transfer plan (glm_fp8.engine.routes; link ranks 0..{n - 1} the trainer GPUs, then "
          f"the engines' ranks): each sender sends every engine rank the part of its shard in the sender's "
          f"rows (its experts, its slice of the embeddings and heads) and in the entries it owns, one "
          f"message per engine rank and layer (at most {tp.messages_per_layer()} messages per layer in "
          f"all); the {min(n, 8)} busiest senders:")  # fmt: skip
    rows = [[rank, experts, owned, f"{sent / gib:.2f}", msgs, f"{local / gib:.2f}", f"{send / gib:.2f}",
             f"{tp.sender_peak(tp.senders.index(rank)) / gib:.2f}"]
            for rank, experts, owned, sent, msgs, local, send in describe(tp)]  # fmt: skip
    print(tabulate(rows, ["sender", "experts", "entries owned", "sent GiB", "messages", "convert slot GiB",
                          "send slot GiB", "peak GiB (ring 2)"]))  # fmt: skip


def _update_time(
    args: argparse.Namespace, config: dict, parser: argparse.ArgumentParser
) -> tuple[list[dict], object]:
    """The predictions as JSON data, and the many senders' transfer plan (None: split experts)."""
    from glm_fp8.update_time import many_senders_plan, predict, predictions_json

    fleet = _fleet(args)
    try:
        transfer = None if args.experts_split else many_senders_plan(config, fleet, scale_fmt=args.scale_fmt)
        return predictions_json(predict(config, fleet, scale_fmt=args.scale_fmt, transfer=transfer)), transfer
    except (KeyError, ValueError) as e:
        parser.error(f"argument --trainer-gpus: {e}")


def _print_update_time(args: argparse.Namespace, timing: list[dict]) -> None:
    from tabulate import tabulate

    from glm_fp8.update_time import CONVERT_SECONDS_PER_BYTE, PIPELINE_FACTOR

    gib = 2**30
    tp, dp = args.engine_tp or 8, args.engine_dp
    print(f"\npredicted whole-model update: {args.trainer_gpus} trainer GPUs -> {args.engines} engine(s) of "
          f"TP {tp} x DP {dp}{' EP' if args.engine_ep else ''}, {args.link_gbps:g} Gb/s per GPU "
          f"(model: glm_fp8.update_time; pipeline factor {PIPELINE_FACTOR}, conversion "
          f"{1 / CONVERT_SECONDS_PER_BYTE / 1e12:.2f} TB/s, both measured on the H200):")  # fmt: skip
    rows = [[p["strategy"], p["senders"], f"{p['sent'] / gib:.1f}", f"{p['received'] / gib:.1f}",
             f"{p['gathered'] / gib:.1f}", f"{p['seconds']:.2f}", f"{p['sender_peak'] / gib:.1f}"]
            for p in timing]  # fmt: skip
    print(tabulate(rows, ["strategy", "senders", "sent GiB (busiest)", "received GiB (busiest engine rank)",
                          "gathered GiB (busiest sender)", "predicted s", "sender peak GiB"]))  # fmt: skip
    for p in timing:
        print(f"  {p['strategy']}: {p['arithmetic']}")


def _engine_bytes_table(args: argparse.Namespace, config: dict, parser: argparse.ArgumentParser) -> str:
    from tabulate import tabulate

    from glm_fp8.engine import EngineLayout
    from glm_fp8.engine.pack import update_bytes

    tp, dp = args.engine_tp, args.engine_dp
    layouts = EngineLayout.all_ranks(tp, dp, args.engine_ep)
    try:
        full, per_rank = update_bytes(config, layouts, scale_fmt=args.scale_fmt)
    except (KeyError, ValueError) as e:
        ep = " --engine-ep" if args.engine_ep else ""
        parser.error(f"argument --engine-tp: {tp} with --engine-dp {dp}{ep}: {e}")
    gib = 2**30
    lay = layouts[0]
    what = f"EP {lay.ep_size}" if lay.expert_parallel else f"MoE TP {lay.moe_tp_size}"
    title = (f"\nwhole-model fp8 update (every layer, MTP, embeddings, norm, lm_head) into {tp * dp} engine "
             f"ranks (TP {tp} x DP {dp}, experts by {what}); engine extra: the GPU memory a rank's "
             "receiver takes during an update, above its parameters (a ring of 2 of its largest layer "
             "buffer, a checksum scratch, the step headers), in one update or in vLLM's two sessions (the "
             "target's layers and non-layer tensors, then the MTP layer in the draft session):")  # fmt: skip
    extra = _engine_extra(config, layouts, args.scale_fmt)
    rows = []
    for key in sorted({(b, extra[r]) for r, b in enumerate(per_rank)}):
        ranks = ", ".join(str(r) for r, b in enumerate(per_rank) if (b, extra[r]) == key)
        x, (one, broadcast, target, draft) = key
        sessions = f"{target / gib:.2f} / {draft / gib:.2f}" if draft else f"{target / gib:.2f}"
        rows.append([ranks, f"{full / gib:.2f}", f"{x / gib:.2f}", f"{x / full:.3f}",
                     f"{broadcast / gib:.2f}", f"{one / gib:.2f}", sessions])  # fmt: skip
    head = ["engine ranks", "full broadcast GiB", "scatter GiB", "scatter / full",
            "engine extra, broadcast GiB", "engine extra, scatter GiB",
            "engine extra, sessions GiB (target / draft)"]  # fmt: skip
    return title + "\n" + tabulate(rows, head)


def _engine_extra(config: dict, layouts: list, scale_fmt: str | None) -> list[tuple[int, int, int, int]]:
    """Per engine rank: its receiver's extra memory for a whole-model update in one stream (scatter),
    the same from a full broadcast, and in vLLM's target and draft sessions (scatter; many senders
    cut the same regions into segments)."""
    from glm_fp8.engine.routes import FULL, transfer_plan
    from glm_fp8.models import REST, model_layer_ids, mtp_layer_index
    from glm_fp8.plan import plans_for_model

    def plan_for(ids: list[int], engines: list):
        return transfer_plan(config, plans_for_model(config, "fp8", layer_ids=ids, scale_fmt=scale_fmt), ids,
                             engines, [0])  # fmt: skip

    mtp = mtp_layer_index(config)
    whole, target = [*model_layer_ids(config), REST], [*model_layer_ids(config, mtp=False), REST]
    scatter = [None, *layouts]
    one, broadcast = plan_for(whole, scatter), plan_for(whole, [None, *[FULL] * len(layouts)])
    tgt, drf = plan_for(target, scatter), plan_for([mtp], scatter) if mtp is not None else None
    return [(one.receiver_bytes(r), broadcast.receiver_bytes(r), tgt.receiver_bytes(r),
             drf.receiver_bytes(r, ring=1) if drf is not None else 0)
            for r in range(1, len(layouts) + 1)]  # fmt: skip


def _ranges(idx: list[int]) -> str:
    """Layer indices as ranges: [0, 1, 2, 6] -> "0-2, 6"."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    text = ", ".join(out)
    return text if len(text) <= 40 else text[:37] + "..."


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"


def _triton_version() -> str:
    import triton

    return triton.__version__


DESCRIPTION = """\
Fused block-FP8 weight updates from an RL trainer to a vLLM engine, for huge MoE models (GLM-5 and
its family). Subcommands:
  demo   a sender and receivers as local processes update a scaled-down GLM-5; every byte is
         checked against the reference (gloo on a CPU, NCCL with 2 GPUs or more; no download)
  plan   sizes, peak memory, wire bytes per engine rank and predicted update time of a model's
         update (a preset or a config.json; no download, no GPU)
  bench  the fused quantizer against a copy of the same bytes and the PyTorch reference
Run `glm-fp8 <subcommand> --help` for its options. Python API and docs: README.md, docs/."""


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="glm-fp8", description=DESCRIPTION, formatter_class=raw)
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
        "--world", type=_int_at_least(2),
        help="processes, >= 2: one sender and at least one receiver (default: 3 on a CPU, one per GPU "
        "up to 4)",
    )  # fmt: skip
    d.add_argument("--layers", type=positive_int, default=4, help="layers; the first is dense (default: 4)")
    d.add_argument(
        "--ring", type=positive_int, default=2,
        help="the sender's conversion buffers (1 serializes conversion and sending; receivers keep at "
        "least 2) (default: 2)",
    )  # fmt: skip
    d.add_argument(
        "--mode", choices=["fp8", "bf16"], default="fp8",
        help="fp8: send kernel-format fp8 entries; bf16: send them unquantized, receivers quantize "
        "(default: fp8)",
    )  # fmt: skip
    d.set_defaults(func=_demo)
    p = sub.add_parser(
        "plan",
        help="sizes, memory, wire bytes and update time of a model's update (no download)",
        description="The layer kinds of a model (dense / sparse MLP, with or without a DSA indexer as "
        "the config's schedule says), how many layers of each, their kernel-format bytes and the "
        "predicted peak transient memory of converting one: eager (prime-rl's path), a preallocated "
        "stack, glm_fp8 (glm_fp8.memory.estimate_memory). With --nodes: whether the resident fp32 "
        "master shards plus that peak fit a GPU. With --engine-tp: each engine rank's wire bytes and "
        "extra memory per mode. With --trainer-gpus: the predicted time of a whole-model update per "
        "strategy and the many senders' transfer plan (docs/update_time.md).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", default="glm-5",
        help="an embedded preset: glm-5, glm-5.2, glm-4.5, deepseek-v3, deepseek-v3.2, kimi-k2, "
        "qwen3-moe (default: glm-5)",
    )  # fmt: skip
    src.add_argument("--config", help="a Hugging Face config.json instead of a preset (default: none)")
    p.add_argument(
        "--target", choices=["hopper", "blackwell"], default="hopper",
        help="hopper: float32 block scales; blackwell: UE8M0 scales packed for DeepGEMM SM100 "
        "(default: hopper)",
    )  # fmt: skip
    p.add_argument(
        "--gather-dtype", choices=["bf16", "fp32"], default="bf16",
        help="the dtype layers are gathered in before conversion, for the memory columns (default: bf16)",
    )  # fmt: skip
    p.add_argument(
        "--nodes", type=positive_int,
        help="train nodes: also show whether resident fp32 master shards (decoder layers only) plus one "
        "layer's conversion peak fit a GPU; optimizer state, activations and other buffers are not "
        "counted (default: not shown)",
    )  # fmt: skip
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per train node (default: 8)")
    p.add_argument(
        "--gpu-gib", type=positive_float, default=139.0,
        help="usable memory per GPU, GiB, for --nodes (default: 139, an H200)",
    )  # fmt: skip
    p.add_argument("--entries", action="store_true", help="also list every entry with its offset")
    p.add_argument(
        "--engine-tp", type=positive_int,
        help="vLLM tensor-parallel size: also show each engine rank's wire bytes of a whole-model "
        "update (full broadcast against scatter) and its extra GPU memory during one (default: not shown)",
    )  # fmt: skip
    p.add_argument("--engine-dp", type=positive_int, default=1, help="vLLM data-parallel size (default: 1)")
    p.add_argument(
        "--engine-ep", action="store_true", help="vLLM --enable-expert-parallel (default: experts by MoE TP)"
    )  # fmt: skip
    p.add_argument(
        "--scale-fmt", choices=["fp32", "ue8m0"],
        help="block-scale format on the wire; ue8m0: powers of two, as DeepGEMM holds them (default: fp32)",
    )  # fmt: skip
    p.add_argument(
        "--trainer-gpus", type=positive_int,
        help="also predict the time of a whole-model update per strategy (glm_fp8.update_time) from this "
        "many trainer GPUs into --engines replicas of the --engine-* layout (default: not shown)",
    )  # fmt: skip
    p.add_argument(
        "--engines", type=positive_int, default=1, help="engine replicas, with --trainer-gpus (default: 1)"
    )  # fmt: skip
    p.add_argument(
        "--link-gbps", type=positive_float, default=400.0,
        help="network link per GPU, Gb/s, with --trainer-gpus (default: 400)",
    )  # fmt: skip
    p.add_argument(
        "--experts-split", action="store_true",
        help="the trainer's shards split experts (not Shard(0) on the expert dim): many senders must "
        "gather them (default: whole experts per rank)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="with --trainer-gpus: print only the prediction, JSON")
    p.set_defaults(func=_plan)
    b = sub.add_parser(
        "bench",
        help="time the fused quantizer against a copy of the same bytes and the reference",
        description="GB/s over the ideal bytes, share of a device-to-device copy's bandwidth "
        "measured in the same run, and peak transient memory. GLM-5 shapes on a GPU, small "
        "shapes on the CPU (Triton interpreter: the figures then show only that it runs).",
    )
    b.add_argument(
        "--shapes", choices=["auto", "glm5", "small"], default="auto",
        help="auto: glm5 on a GPU, small on the CPU (default: auto)",
    )  # fmt: skip
    b.add_argument(
        "--case", action="append", help="run only cases whose name contains this (repeatable; default: all)"
    )  # fmt: skip
    b.add_argument(
        "--backend", action="append", choices=["triton", "cuda"],
        help="time only this fused backend (repeatable; default: every one available)",
    )  # fmt: skip
    b.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile of the reference (on a GPU it is timed)"
    )  # fmt: skip
    b.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    b.add_argument(
        "--budget-ms", type=positive_float, default=1000.0,
        help="timing budget per method and round, ms (default: 1000)",
    )  # fmt: skip
    b.add_argument(
        "--rounds", type=positive_int, default=1,
        help="time the copy and every method in turn this many times and report medians (default: 1)",
    )  # fmt: skip
    b.add_argument("--markdown", action="store_true", help="print a Markdown table")
    b.add_argument("--json", help="also write the rows to this JSON file (default: none)")
    b.set_defaults(func=_bench)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    parser, sub = _parser()
    args = parser.parse_args(argv)
    # Checks that need runtime knowledge (presets, files, cases, backends) report through the subparser.
    return args.func(args, sub.choices[args.command])


if __name__ == "__main__":
    raise SystemExit(main())

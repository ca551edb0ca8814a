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


def _int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: ``check_int``'s contract on the option's text, an integer in
    [low, high] (``high`` None: no upper bound); ``why``: why the bound is there. argparse puts
    the option's name where check_int puts the argument's."""

    def parse(text: str) -> int:
        from glm_fp8._checks import check_int  # lazy, as the CLI's every glm_fp8 import

        try:
            value: object = int(text)
        except ValueError:
            value = text  # not a number: check_int refuses it, quoting the text
        try:
            return check_int("", value, low, high, f" ({why})" if why else "")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(": ")) from None

    return parse


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low``."""
    return _int_in(low)


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
    from glm_fp8.presets import PRESETS, load_config

    if not args.config:
        if args.model not in PRESETS:
            parser.error(f"argument --model: unknown preset {args.model!r} "
                         f"(expected one of: {', '.join(sorted(PRESETS))})")  # fmt: skip
        return load_config(args.model)
    try:
        return load_config(config_path=args.config)
    except ValueError as e:
        parser.error(f"argument --config: {str(e).removeprefix('config: ')}")


_GIB = 2**30
WIDTH = 100  # every line glm-fp8 plan prints fits this many characters
# PlanRequest fields -> the options that set them, for errors.
_OPTIONS = {
    "trainer_gpus": "--trainer-gpus",
    "engines": "--engines",
    "engine_tp": "--engine-tp",
    "engine_dp": "--engine-dp",
    "link_gbps": "--link-gbps",
    "gpu_gib": "--gpu-gib",
    "target": "--target",
    "master_dtype": "--master-dtype",
    "gather_dtype": "--gather-dtype",
    "scale_fmt": "--scale-fmt",
}


def _plan_request(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The ``PlanRequest`` the options describe; argparse errors for flags that would be ignored
    or that contradict each other."""
    from glm_fp8.planning import GATHER_DTYPES, MASTER_DTYPES, MAX_TRAINER_GPUS, PlanRequest

    trainer_gpus = args.trainer_gpus
    if args.gpus_per_node is not None and args.nodes is None:
        parser.error(f"argument --gpus-per-node: {args.gpus_per_node} needs --nodes (the trainer's nodes)")
    if args.nodes is not None:
        world = args.nodes * (args.gpus_per_node or 8)
        if world > MAX_TRAINER_GPUS:
            parser.error(f"argument --nodes: {args.nodes} x --gpus-per-node {args.gpus_per_node or 8} = "
                         f"{world} trainer GPUs; expected at most {MAX_TRAINER_GPUS} (the many senders' plan "
                         "is computed per sender)")  # fmt: skip
        if trainer_gpus is not None and trainer_gpus != world:
            parser.error(
                f"argument --trainer-gpus: {trainer_gpus} contradicts --nodes {args.nodes} x "
                f"--gpus-per-node {args.gpus_per_node or 8} = {world} trainer GPUs; give "
                "--trainer-gpus or --nodes, or make them agree"
            )
        trainer_gpus = world
    if trainer_gpus is None:
        for flag, value in (
            ("--engines", args.engines),
            ("--link-gbps", args.link_gbps),
            ("--experts-split", args.experts_split or None),
            ("--gpu-gib", args.gpu_gib),
        ):
            if value is not None:
                parser.error(
                    f"argument {flag}: describes the deployment and needs --trainer-gpus N (or "
                    "--nodes): without it there is no update to predict"
                )
    for flag, value in (("--engine-dp", args.engine_dp), ("--engine-ep", args.engine_ep or None)):
        if value is not None and args.engine_tp is None:
            parser.error(
                f"argument {flag}: needs --engine-tp (the engine's layout is TP x DP, experts by "
                "EP or MoE TP)"
            )
    given = {"engines": args.engines, "engine_dp": args.engine_dp, "link_gbps": args.link_gbps,
             "gpu_gib": args.gpu_gib}  # fmt: skip
    return PlanRequest(
        target=args.target,
        scale_fmt=args.scale_fmt,
        master_dtype=MASTER_DTYPES[args.master_dtype],
        gather_dtype=GATHER_DTYPES[args.gather_dtype],
        trainer_gpus=trainer_gpus,
        engine_tp=args.engine_tp,
        engine_ep=args.engine_ep,
        experts_whole=not args.experts_split,
        entries=args.entries,
        **{k: v for k, v in given.items() if v is not None},  # the rest: PlanRequest's defaults
    )


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from glm_fp8.planning import PlanArgumentError, plan_report

    config = _load_config(args, parser)
    request = _plan_request(args, parser)
    try:
        report = plan_report(config, request)
    except PlanArgumentError as e:
        option = _OPTIONS.get(e.argument, e.argument)
        if e.argument == "config":
            option = "--config" if args.config else f"--model {args.model!r}"
        if e.argument == "trainer_gpus" and args.nodes is not None and args.trainer_gpus is None:
            option = "--nodes"
        parser.error(f"argument {option}: {e.message}")
    except (KeyError, ValueError) as e:  # a config as_config accepts that the plans read two ways
        if not args.config:
            raise
        parser.error(f"argument --config: {args.config!r} is not a usable config: {e}")
    if args.json:
        from glm_fp8 import __version__

        print(json.dumps({"glm_fp8_version": __version__, **report}, indent=1))
        return 0
    for line in _summary_lines(report, args):
        print(line)
    if args.detail:
        _print_detail(report)
    if report["entries"] is not None:
        _print_entries(report)
    return 0


def _wrap(text: str, indent: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent + "  ", initial_indent=indent, break_on_hyphens=False
    )


def _gib(n: int | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / _GIB:.{digits}f}"


def _summary_lines(report: dict, args: argparse.Namespace) -> list[str]:
    """The summary: the model, then for a deployment the mode auto picks, the predicted time and
    each rank's extra memory (what each figure counts said with it)."""
    m, a, s = report["model"], report["assumptions"], report["summary"]
    kinds = ", ".join(f"{len(idx)} {kind}" for kind, idx in m["kinds"].items())
    out = _wrap(
        f"{m['model_type']}: {m['decoder_layers']} layers ({kinds}); target {a['target']}; all "
        f"layers in kernel format {m['kernel_format_bytes'] / _GIB:.1f} GiB; masters "
        f"{a['master_dtype']}, gathered in {a['gathered_in']}"
    )
    update = report["update"]
    if update is not None:
        f = update["fleet"]
        assumed = " (TP 8 assumed: pass --engine-tp)" if a["engine_tp_assumed"] else ""
        out += _wrap(
            f"deployment: {f['trainer_gpus']} trainer GPU{'s' if f['trainer_gpus'] > 1 else ''} -> "
            f"{f['engines']} engine(s) of TP "
            f"{f['engine_tp']} x DP {f['engine_dp']}{', EP' if f['engine_ep'] else ''}{assumed}; "
            f"{f['link_gbps']:g} Gb/s per GPU; experts "
            f"{'whole' if f['experts_whole'] else 'split'} per trainer rank"
        )
        name = {"senders": "many senders", "scatter": "scatter"}[s["auto_mode"]]
        out += _wrap(f'mode="auto" picks {name} (mode="{s["auto_mode"]}"): {s["auto_reason"]}')
        others = ", ".join(
            f"{p['strategy']} {p['seconds']:.2f} s"
            for p in update["strategies"]
            if p["applicable"] and p["strategy"] != s["strategy"]
        )
        out += _wrap(
            f"predicted update: {s['predicted_seconds']:.2f} s ({s['strategy']}, the whole model in "
            f"one update; others: {others})"
        )
        out.append("extra GPU memory per rank during an update (each figure says what it counts):")
        for x in s["trainer_extra"]:
            ranks = _ranks_text(x["ranks"])
            plural = "s" if len(x["ranks"]) > 1 else ""
            out += _wrap(
                f"trainer rank{plural} {ranks} ({x['role']}{plural}): "
                f"{_gib(x['bytes'])} GiB at most: {x['counts']}",
                "  ",
            )
    if s["engine_extra"] is not None:
        x = s["engine_extra"]
        draft = (
            f", {_gib(x['draft_session_bytes'])} GiB in the draft session" if x["draft_session_bytes"] else ""
        )
        indent = "  " if update is not None else ""
        if update is None:  # no mode yet: scatter's figure (many senders' within a few KiB), and broadcast's
            draft += f" (scatter; a full broadcast: {_gib(x['broadcast_bytes'])} GiB)"
        out += _wrap(
            f"engine ranks (each of {x['ranks']} per engine): {_gib(x['target_session_bytes'])} GiB in "
            f"vLLM's target session{draft}: {x['counts']}",
            indent,
        )
    if report["fits"] is not None:
        fits = report["fits"]
        auto = fits["paths"][-1]
        verdict = "fits" if auto["fits"] else "does NOT fit"
        out += _wrap(
            f"a trainer GPU: {_gib(fits['resident_master_bytes'], 1)} GiB of {fits['master_dtype']} "
            f"master shards + {_gib(auto['peak_bytes'], 1)} GiB peak = {_gib(auto['total_bytes'], 1)} "
            f"GiB: {verdict} {fits['gpu_gib']:g} GiB (optimizer state, gradients, activations "
            "not counted)"
        )
    if update is None:
        big = max(report["layer_kinds"], key=lambda k: k["peaks"]["glm_fp8"])
        out += _wrap(
            f"one sender converting a whole {big['kind']} layer: {_gib(big['peaks']['glm_fp8'], 1)} GiB "
            f"peak ({report['peak_counts']['glm_fp8']}; {report['peak_counts']['excludes']})"
        )
        out += _wrap(
            'mode="auto", the update time, every rank\'s memory: pass --trainer-gpus N (or --nodes) '
            "[--engines M --engine-tp T]"
        )
    if not args.detail:
        out += _wrap(
            "detail: --detail (layer kinds, fit, engine ranks, every strategy, transfer plan), "
            "--entries, --json"
        )
    return out


def _ranks_text(ranks: list[int], width: int = 0) -> str:
    """Ranks as ranges: [0, 1, 2, 6] -> "0-2, 6"; wrapped onto lines of ``width`` if given."""
    import textwrap

    out, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    text = ", ".join(out)
    return "\n".join(textwrap.wrap(text, width)) if width else text


def _table(rows: list[list], head: list[str]) -> list[str]:
    """A table as lines: numbers as given (already formatted) and right-aligned, text left-aligned,
    two spaces between columns and no padding beyond that (every line within ``WIDTH``)."""
    import tabulate as tab

    align = ["left" if any(_is_text(row[k]) for row in rows) else "right" for k in range(len(head))]
    old = tab.MIN_PADDING
    tab.MIN_PADDING = 0  # tabulate pads headers by 2 by default: wider columns for nothing
    try:
        return tab.tabulate(rows, head, disable_numparse=True, colalign=align).splitlines()
    finally:
        tab.MIN_PADDING = old


def _is_text(cell: object) -> bool:
    text = str(cell).replace(" / ", "").replace(".", "")
    return not (text.isdigit() or text in ("n/a", "-"))


def _print_detail(report: dict) -> None:
    counts = report["peak_counts"]
    lines = [""]
    lines += _wrap(
        f"layer kinds: one sender converting one whole layer; peaks are transient GiB ({counts['excludes']}):"
    )
    rows = [
        [
            k["kind"],
            len(k["layers"]),
            k["entries"],
            _gib(k["kernel_format_bytes"]),
            _gib(k["gathered_bytes"]),
            _gib(k["peaks"]["eager"], 1),
            _gib(k["peaks"]["preallocated_stack"], 1),
            _gib(k["peaks"]["glm_fp8"], 1),
        ]
        for k in report["layer_kinds"]
    ]
    lines += _table(
        rows,
        [
            "layer kind",
            "layers",
            "entries",
            "kernel-format\nGiB",
            "gathered\nGiB",
            "eager\npeak GiB",
            "prealloc-stack\npeak GiB",
            "glm_fp8\npeak GiB",
        ],
    )
    for k in report["layer_kinds"]:
        lines += _wrap(f"{k['kind']}: layers {_ranks_text(k['layers'])}", "  ")
    for key, name in (
        ("gathered", "gathered"),
        ("eager", "eager"),
        ("preallocated_stack", "prealloc-stack"),
        ("glm_fp8", "glm_fp8"),
    ):
        lines += _wrap(f"{name}: {counts[key]}", "  ")
    fits = report["fits"]
    if fits is not None:
        lines.append("")
        lines += _wrap(
            f"fit on a trainer GPU ({fits['trainer_gpus']} GPUs, {fits['gpu_gib']:g} GiB each): "
            f"{fits['counts']}:"
        )
        rows = [
            [p["path"], _gib(p["peak_bytes"], 1), _gib(p["total_bytes"], 1), "yes" if p["fits"] else "NO"]
            for p in fits["paths"]
        ]
        lines += _table(
            rows,
            [
                "path",
                "peak GiB",
                f"+ {_gib(fits['resident_master_bytes'], 1)} GiB masters",
                f"fits {fits['gpu_gib']:g} GiB",
            ],
        )
    engine = report["engine"]
    if engine is not None:
        lines.append("")
        lines += _wrap(
            f"engine ranks: a whole-model fp8 update (every layer, MTP, embeddings, norm, lm_head) "
            f"into {engine['ranks']} engine ranks (TP {engine['tp']} x DP {engine['dp']}, experts "
            f"by {engine['experts_by']}); wire GiB per rank, full broadcast against scatter; "
            f"extra: {report['peak_counts']['engine_extra']}, in one update or in vLLM's two "
            "sessions (the target's layers and non-layer tensors, then the MTP layer):"
        )
        rows = [
            [
                _ranks_text(r["ranks"], 24),
                _gib(r["full_broadcast_bytes"]),
                _gib(r["scatter_bytes"]),
                f"{r['scatter_bytes'] / r['full_broadcast_bytes']:.3f}",
                _gib(r["extra_broadcast_bytes"]),
                _gib(r["extra_scatter_bytes"]),
                f"{_gib(r['extra_target_session_bytes'])} / {_gib(r['extra_draft_session_bytes'])}",
            ]
            for r in engine["rows"]
        ]
        lines += _table(
            rows,
            [
                "engine ranks",
                "full\nGiB",
                "scatter\nGiB",
                "scatter\n/ full",
                "extra GiB\nbroadcast",
                "extra GiB\nscatter",
                "extra GiB, sessions\n(target / draft)",
            ],
        )
    update = report["update"]
    if update is not None:
        _update_lines(lines, report)
    for line in lines:
        print(line)


def _update_lines(lines: list[str], report: dict) -> None:
    from glm_fp8.update_time import CONVERT_SECONDS_PER_BYTE, PIPELINE_FACTOR

    update, counts = report["update"], report["peak_counts"]
    f = update["fleet"]
    lines.append("")
    lines += _wrap(
        f"predicted whole-model update: {f['trainer_gpus']} trainer GPUs -> {f['engines']} engine(s) "
        f"of TP {f['engine_tp']} x DP {f['engine_dp']}{' EP' if f['engine_ep'] else ''}, "
        f"{f['link_gbps']:g} Gb/s per GPU (model: glm_fp8.update_time; pipeline factor "
        f"{PIPELINE_FACTOR}, conversion {1 / CONVERT_SECONDS_PER_BYTE / 1e12:.2f} TB/s, both "
        "measured on the H200); GiB of the busiest rank:"
    )
    rows = []
    for p in update["strategies"]:
        if p["applicable"]:
            rows.append(
                [
                    p["strategy"],
                    p["senders"],
                    _gib(p["sent"], 1),
                    _gib(p["received"], 1),
                    _gib(p["gathered"], 1),
                    f"{p['seconds']:.2f}",
                    _gib(p["sender_peak"], 2),
                ]
            )
        else:
            rows.append([p["strategy"], "-", "-", "-", "-", "n/a", "-"])
    lines += _table(
        rows,
        [
            "strategy",
            "senders",
            "sent GiB\n(sender)",
            "received GiB\n(engine rank)",
            "gathered GiB\n(sender)",
            "predicted s",
            "sender peak\nGiB",
        ],
    )
    for p in update["strategies"]:
        lines += _wrap(
            f"{p['strategy']}: {p['arithmetic'] if p['applicable'] else 'n/a: ' + p['why_not']}", "  "
        )
    lines += _wrap(f"sender peak: {counts['sender_peak']}", "  ")
    tp = update["transfer_plan"]
    if tp is None:
        return
    n = tp["senders"]
    lines.append("")
    lines += _wrap(
        f"many senders' transfer plan (glm_fp8.transfer.routes; link ranks 0..{n - 1} the trainer "
        "GPUs, then the engines' ranks): each sender sends every engine rank the part of its "
        "shard in the sender's rows (its experts, its slice of the embeddings and heads) and in "
        f"the entries it owns, one message per engine rank and layer (at most "
        f"{tp['messages_per_layer']} messages per layer in all); the {min(n, 8)} busiest senders"
        + ("" if len(tp["rows"]) <= min(n, 8) else " and the one with the highest peak")
        + ":"
    )
    rows = [
        [
            r["sender"],
            r["experts"],
            r["entries_owned"],
            _gib(r["sent_bytes"]),
            r["messages"],
            _gib(r["convert_slot_bytes"]),
            _gib(r["send_slot_bytes"]),
            _gib(r["gathered_bytes"]),
            _gib(r["peak_bytes"]),
        ]
        for r in tp["rows"]
    ]
    lines += _table(
        rows,
        [
            "sender",
            "experts",
            "entries\nowned",
            "sent\nGiB",
            "messages",
            "convert\nslot GiB",
            "send\nslot GiB",
            "gathered\nGiB",
            "peak\nGiB",
        ],
    )
    lines += _wrap(
        "peak = 2 x (convert slot + send slot) + gathered (one layer's tensors it owns, at its "
        f"largest layer); its largest: sender {tp['max_peak_sender']}, "
        f"{_gib(tp['max_peak_bytes'])} GiB (the summary's figure)",
        "  ",
    )


_SHORT_DTYPES = {"float8_e4m3fn": "fp8 e4m3", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _print_entries(report: dict) -> None:
    for kind, entries in report["entries"].items():
        print(f"\n{kind} layer entries (offsets and bytes in the kernel-format layer buffer):")
        rows = [[e["name"], _SHORT_DTYPES.get(e["dtype"], e["dtype"]), "x".join(map(str, e["shape"])),
                 str(e["offset"]), str(e["bytes"])] for e in entries]  # fmt: skip
        for line in _table(rows, ["name", "dtype", "shape", "offset", "bytes"]):
            print(line)


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
  plan   for a deployment: the mode auto picks, the predicted update time and every rank's extra
         memory; sizes and peaks per layer kind on request (a preset or a config.json; no download)
  bench  the fused quantizer against a copy of the same bytes and the PyTorch reference
Run `glm-fp8 <subcommand> --help` for its options. Python API and docs: README.md, docs/."""


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    from glm_fp8 import __version__
    from glm_fp8.numerics import SCALE_FMTS
    from glm_fp8.planning import MAX_ENGINE_RANKS, MAX_ENGINES, MAX_TRAINER_GPUS

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="glm-fp8", description=DESCRIPTION, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"glm-fp8 {__version__}",
                        help="print the version of glm_fp8 and exit")  # fmt: skip
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
        help="the mode auto picks, update time and every rank's memory for a deployment (no download)",
        description="First a summary: the model's layer kinds and size; with --trainer-gpus (or "
        '--nodes), the mode the vLLM backend\'s mode="auto" picks and why, the predicted time of a '
        "whole-model update, and every rank's extra GPU memory during one (each figure says what it "
        "counts), and whether the master shards fit a trainer GPU. --detail adds the tables: each "
        "layer kind's conversion peak per path (eager, preallocated stack, glm_fp8), the fit per "
        "path, each engine rank's wire bytes and extra memory per mode, every strategy's predicted "
        "time (docs/update_time.md) and the many senders' transfer plan. --json prints all of it as "
        "one JSON object (glm_fp8.planning.plan_report). Flags that would be ignored or that "
        "contradict each other are refused.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", default="glm-5",
        help="an embedded preset: glm-5, glm-5.2, glm-4.5, deepseek-v3, deepseek-v3.2, kimi-k2, "
        "qwen3-moe (default: glm-5)",
    )  # fmt: skip
    src.add_argument("--config", help="a Hugging Face config.json instead of a preset (default: none)")
    p.add_argument("--detail", action="store_true", help="also print every table behind the summary")
    p.add_argument(
        "--target", choices=["hopper", "blackwell"], default="hopper",
        help="the layer table's kernel format: hopper: float32 block scales; blackwell: UE8M0 scales "
        "packed for DeepGEMM SM100 (vLLM's weights are Hopper's layout: not with --engine-tp or "
        "--trainer-gpus) (default: hopper)",
    )  # fmt: skip
    p.add_argument(
        "--master-dtype", choices=["fp32", "bf16"], default="fp32",
        help="the dtype the trainer holds its master weights in: their resident size, and the dtype "
        "they are gathered in unless --gather-dtype casts (default: fp32)",
    )  # fmt: skip
    p.add_argument(
        "--gather-dtype", choices=["trainer", "bf16", "fp32"], default="trainer",
        help="the dtype tensors travel in to the rank that converts them: trainer: no cast, each in "
        "the trainer's own dtype (the library's gather_dtype=None); bf16 or fp32: cast first, an "
        "opt-in whose bytes then differ from the checkpoint's (default: trainer)",
    )  # fmt: skip
    gpus = f"at most {MAX_TRAINER_GPUS} trainer GPUs: the many senders' plan is computed per sender"
    p.add_argument(
        "--nodes", type=_int_in(1, MAX_TRAINER_GPUS, gpus),
        help="train nodes: the trainer GPUs are --nodes x --gpus-per-node (the same as --trainer-gpus; "
        "give one, or both agreeing) (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--gpus-per-node", type=_int_in(1, MAX_TRAINER_GPUS, gpus),
        help="GPUs per train node, with --nodes (default: 8)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-gib", type=positive_float,
        help="usable memory per trainer GPU, GiB, for whether the master shards and a peak fit, with "
        "--trainer-gpus or --nodes (default: 139, an H200)",
    )  # fmt: skip
    p.add_argument("--entries", action="store_true", help="also list every entry of each layer kind")
    ranks = f"at most {MAX_ENGINE_RANKS} ranks per engine: each rank's shard is computed"
    p.add_argument(
        "--engine-tp", type=_int_in(1, MAX_ENGINE_RANKS, ranks),
        help="vLLM tensor-parallel size: each engine rank's wire bytes and extra memory (default: not "
        "shown without --trainer-gpus; 8 with it)",
    )  # fmt: skip
    p.add_argument(
        "--engine-dp", type=_int_in(1, MAX_ENGINE_RANKS, ranks),
        help="vLLM data-parallel size, with --engine-tp (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--engine-ep", action="store_true",
        help="vLLM --enable-expert-parallel, with --engine-tp (default: experts by MoE TP)",
    )  # fmt: skip
    p.add_argument(
        "--scale-fmt", choices=list(SCALE_FMTS),
        help="block-scale format on the wire; ue8m0: powers of two, as DeepGEMM holds them (default: fp32)",
    )  # fmt: skip
    p.add_argument(
        "--trainer-gpus", type=_int_in(1, MAX_TRAINER_GPUS, gpus),
        help="the trainer's GPUs: the mode auto picks, the predicted update time and every rank's "
        "memory for an update into --engines replicas of the --engine-* layout (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--engines", type=_int_in(1, MAX_ENGINES, "each replica is a destination of the many senders' plan"),
        help="engine replicas, with --trainer-gpus (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--link-gbps", type=positive_float,
        help="network link per GPU, Gb/s, with --trainer-gpus (default: 400)",
    )  # fmt: skip
    p.add_argument(
        "--experts-split", action="store_true",
        help="with --trainer-gpus: the trainer's shards split experts (not Shard(0) on the expert dim), "
        "so mode auto picks scatter and many senders do not apply (default: whole experts per rank)",
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true",
        help="print the whole report (summary and every table) as one JSON object instead of text",
    )  # fmt: skip
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

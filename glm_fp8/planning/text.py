"""``glm-fp8 plan``'s text: ``format_plan_report`` renders ``glm_fp8.planning.report.plan_report``'s
data as the summary (the fleet, the mode auto picks with its predicted time, each rank's extra
memory, each server's busiest rank's received bytes, each trainer rank's NIC bytes; with a delta,
the delta update's lines), then (``detail``) tables of the layer kinds, the fit, the engine ranks,
every strategy (and its delta update, with one) and the many senders' transfer plan, then the
entries when the report holds them. Every line fits ``WIDTH`` characters; the helpers every section
uses (lines wrapped to ``WIDTH``, GiB, rank ranges, tables) come first. A Python user gets the same
text as the command line."""

from __future__ import annotations

import textwrap

import tabulate as tab

from glm_fp8.planning.update_time import CONVERT_SECONDS_PER_BYTE, PIPELINE_FACTOR

GIB = 2**30
WIDTH = 100  # every line glm-fp8 plan prints fits this many characters


def wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent + "  ", initial_indent=indent, break_on_hyphens=False
    )


def gib(n: int | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / GIB:.{digits}f}"


def ranks_text(ranks: list[int], width: int = 0) -> str:
    """Ranks as ranges: [0, 1, 2, 6] -> "0-2, 6"; wrapped onto lines of ``width`` if given."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    text = ", ".join(out)
    return "\n".join(textwrap.wrap(text, width)) if width else text


def table(rows: list[list], head: list[str]) -> list[str]:
    """A table as lines: numbers as given (already formatted) and right-aligned, text left-aligned,
    two spaces between columns and no padding beyond that (every line within ``WIDTH``)."""
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


def deployment_lines(report: dict) -> list[str]:
    """The deployment, the mode auto picks with its predicted time (one line), the other
    strategies' times, each trainer rank's extra memory and, for a fleet, each server's."""
    a, s, update = report["assumptions"], report["summary"], report["update"]
    f = update["fleet"]
    gpus = f"{f['trainer_gpus']} trainer GPU{'s' if f['trainer_gpus'] > 1 else ''}"
    experts = f"experts {'whole' if f['experts_whole'] else 'split'} per trainer rank"
    if f.get("trainer"):  # Megatron-Core: who sends is its stages' expert-parallel ranks
        m = f["trainer"]
        stage = -(-m["ep"] // m["tp"]) * m["tp"]  # MegatronTrainer.stage_senders
        uneven = "".join(f", the {k} stage {m[k]} layers" for k in ("first", "last") if m.get(k) is not None)
        experts = (
            f"Megatron-Core TP {m['tp']} x PP {m['pp']} x CP {m['cp']}, EP {m['ep']}{uneven}: "
            f"{m['pp'] * stage} senders, each stage's {m['ep']} expert-parallel ranks sending its "
            "layers' experts"
        )
        if m.get("step_layers", 1) > 1:
            experts += f", in steps of up to {m['step_layers']} layers (one of each stage in turn)"
    if report["servers"] is None:
        assumed = " (TP 8 assumed: pass --engine-tp)" if a["engine_tp_assumed"] else ""
        # as a fleet of one server is written below: replicas x name (layout): ranks
        ep = f", EP {f['engine_tp'] * f['engine_dp']}" if f["engine_ep"] else ""
        ranks = f["engines"] * f["engine_tp"] * f["engine_dp"]
        out = wrap(
            f"deployment: {gpus} -> {f['engines']} x server0 (TP {f['engine_tp']} x DP {f['engine_dp']}{ep})"
            f"{assumed}: {ranks} server ranks; {f['link_gbps']:g} Gb/s per GPU; {experts}"
        )
    else:
        tgbps = f["link_gbps"]
        servers = " + ".join(
            f"{x['replicas']} x {x['name']} ({x['layout']}"
            + (f"; {x['link_gbps']:g} Gb/s" if x["link_gbps"] != tgbps else "")
            + ")"
            for x in s["servers"]
        )
        ranks = sum(x["replicas"] * x["ranks"] for x in s["servers"])
        unless = " unless said" if any(x["link_gbps"] != tgbps for x in s["servers"]) else ""
        out = wrap(
            f"deployment: {gpus} -> {servers}: {ranks} server ranks; {tgbps:g} Gb/s per GPU{unless}; "
            f"{experts}"
        )
    name = {"senders": "many senders", "scatter": "scatter"}[s["auto_mode"]]
    out += wrap(
        f'mode="auto" picks {name} (mode="{s["auto_mode"]}"), predicted {s["predicted_seconds"]:.2f} s for '
        f"the whole model in one update ({s['strategy']}): {s['auto_reason']}"
    )
    others = ", ".join(
        f"{p['strategy']} {p['seconds']:.2f} s"
        for p in update["strategies"]
        if p["applicable"] and p["strategy"] != s["strategy"]
    )
    fastest = s["fastest"]
    faster = (
        f"; {fastest['strategy']} is predicted faster than auto's pick"
        if fastest["strategy"] != s["strategy"] and fastest["seconds"] < s["predicted_seconds"]
        else ""
    )
    out += wrap(f"other strategies: {others}{faster}")
    out.append("extra GPU memory per rank during an update (each figure says what it counts):")
    for x in s["trainer_extra"]:
        ranks = ranks_text(x["ranks"])
        plural = "s" if len(x["ranks"]) > 1 else ""
        out += wrap(
            f"trainer rank{plural} {ranks} ({x['role']}{plural}): {gib(x['bytes'])} GiB at most: "
            f"{x['counts']}",
            "  ",
        )
    if report["servers"] is not None:
        for x in s["servers"]:
            where = "its drafter's update" if x.get("engine") == "sglang" else "the draft session"
            draft = f", {gib(x['draft_session_bytes'])} GiB in {where}" if x["draft_session_bytes"] else ""
            out += wrap(
                f"{x['name']} ranks ({x['replicas']} replica{'s' if x['replicas'] > 1 else ''} x "
                f"{x['ranks']}): "
                f"{gib(x['target_session_bytes'])} GiB in the target session{draft}",
                "  ",
            )
        out += wrap(f"(server ranks: {report['peak_counts']['engine_extra']})", "  ")
    return out


def traffic_lines(report: dict) -> list[str]:
    """What each server's busiest rank receives and what the trainer ranks send the servers, under
    the mode auto picks."""
    s = report["summary"]
    if report["servers"] is None:  # one engine layout
        out = wrap(
            f"an engine rank receives {gib(s['servers'][0]['received_bytes'])} GiB at most ({s['strategy']})"
        )
    else:
        recv = ", ".join(f"{x['name']} {gib(x['received_bytes'])} GiB" for x in s["servers"])
        out = wrap(f"received by each server's busiest rank ({s['strategy']}): {recv}")
    sent = s["sender_bytes"]
    busiest = max(range(len(sent)), key=lambda k: (sent[k], -k))
    if len(sent) == 1 or not any(sent[1:]):
        rest = "" if len(sent) == 1 else f"; trainer ranks 1-{len(sent) - 1} send the servers nothing"
        text = f"trainer rank 0 sends the servers {gib(sent[0])} GiB{rest}"
    else:
        least = min(range(len(sent)), key=lambda k: (sent[k], k))
        text = (
            f"each trainer rank sends the servers {gib(sent[least])} (rank {least}) to "
            f"{gib(sent[busiest])} GiB (rank {busiest}) over its NIC"
        )
    out += wrap(f"{text} ({s['strategy']}; every rank's: --json, summary.sender_bytes)")
    return out


def pct(x: float) -> str:
    """A fraction as a percentage with enough digits for 0.12 % and for 100 %."""
    return f"{100 * x:.3g} %"


def delta_lines(report: dict) -> list[str]:
    """The delta update of auto's strategy (``summary["delta"]``): its predicted time beside the
    dense one and the wire fraction (one line), then a sender's kept copy and memory, each
    server's receiver; nothing without a delta."""
    d = report["summary"].get("delta")
    if d is None:
        return []
    through = "dense" if d["passthrough"] is None else f"{pct(d['passthrough'])} changed"
    where = "on the GPU" if d["kept"] == "gpu" else "in pinned host memory"
    out = wrap(
        f"delta update (model prediction; {pct(d['fraction'])} of the e4m3 bytes changed, scales "
        f"{pct(d['scales_changed'])}, passthrough entries {through}): {d['seconds']:.3f} s against "
        f"{d['dense_seconds']:.2f} s dense ({d['strategy']}), {pct(d['wire_fraction'])} of the dense "
        f"bytes on the trainer's NICs: {d['arithmetic']}"
    )
    verdict = "fits" if d["fits"] else "does NOT fit"
    fits = report["fits"]
    out += wrap(
        f"a sender keeps what it last sent: {gib(d['sender_kept_bytes'])} GiB {where}; on its GPU "
        f"{gib(d['sender_gpu_bytes'])} GiB with the transient peak, + "
        f"{gib(fits['resident_master_bytes'], 1)} GiB of master shards = {gib(d['trainer_gpu_bytes'], 1)} "
        f"GiB: {verdict} {fits['gpu_gib']:g} GiB (optimizer state, gradients, activations not counted)",
        "  ",
    )
    servers = ", ".join(
        f"{x['name']} {gib(x['extra_bytes'])} GiB (dense {gib(x['dense_extra_bytes'])})" for x in d["servers"]
    )
    # One update of every layer, as the delta model counts it; the lines above count vLLM's target and
    # draft sessions apart (a smaller largest layer in each), so "dense" here is neither of those.
    out += wrap(
        f"server ranks' receiver in a delta update of every layer in one session (dense: the same receiver "
        f"without deltas, 2 slots of its largest layer, the MTP layer's included): {servers}; a rank that "
        "gets a layer dense needs the dense figure for it",
        "  ",
    )
    return out


def format_plan_report(report: dict, detail: bool = False) -> str:
    """The text ``glm-fp8 plan`` prints for ``report`` (``plan_report``'s data), without the final
    newline; ``detail``: what ``--detail`` adds. The entries follow when ``report["entries"]``
    holds them (``PlanRequest(entries=True)``)."""
    lines = _summary_lines(report, detail)
    if detail:
        lines += _detail_lines(report)
    if report["entries"] is not None:
        lines += _entries_lines(report)
    return "\n".join(lines)


def _summary_lines(report: dict, detail: bool) -> list[str]:
    """The summary: the model, then for a deployment the mode auto picks, the predicted time and
    each rank's extra memory (what each figure counts said with it)."""
    m, a, s = report["model"], report["assumptions"], report["summary"]
    kinds = ", ".join(f"{len(idx)} {kind}" for kind, idx in m["kinds"].items())
    out = wrap(
        f"{m['model_type']}: {m['decoder_layers']} layers ({kinds}); target {a['target']}; all "
        f"layers in kernel format {m['kernel_format_bytes'] / GIB:.1f} GiB; masters "
        f"{a['master_dtype']}, gathered in {a['gathered_in']}"
    )
    update = report["update"]
    if update is not None:
        out += deployment_lines(report)
    if s["engine_extra"] is not None and (update is None or report["servers"] is None):
        x = s["engine_extra"]
        draft = (
            f", {gib(x['draft_session_bytes'])} GiB in the draft session" if x["draft_session_bytes"] else ""
        )
        indent = "  " if update is not None else ""
        if update is None:  # no mode yet: scatter's figure (many senders' within a few KiB), and broadcast's
            draft += f" (scatter; a full broadcast: {gib(x['broadcast_bytes'])} GiB)"
        out += wrap(
            f"engine ranks (each of {x['ranks']} per engine): {gib(x['target_session_bytes'])} GiB in "
            f"the target session{draft}: {x['counts']}",
            indent,
        )
    if update is not None:
        out += traffic_lines(report) + delta_lines(report)
    if report["fits"] is not None:
        fits = report["fits"]
        auto = fits["paths"][-1]
        verdict = "fits" if auto["fits"] else "does NOT fit"
        out += wrap(
            f"a trainer GPU: {gib(fits['resident_master_bytes'], 1)} GiB of {fits['master_dtype']} "
            f"master shards + {gib(auto['peak_bytes'], 1)} GiB peak = {gib(auto['total_bytes'], 1)} "
            f"GiB: {verdict} {fits['gpu_gib']:g} GiB (optimizer state, gradients, activations "
            "not counted)"
        )
    if update is None:
        big = max(report["layer_kinds"], key=lambda k: k["peaks"]["glm_fp8"])
        out += wrap(
            f"one sender converting a whole {big['kind']} layer: {gib(big['peaks']['glm_fp8'], 1)} GiB "
            f"peak ({report['peak_counts']['glm_fp8']}; {report['peak_counts']['excludes']})"
        )
        out += wrap(
            'mode="auto", the update time, every rank\'s memory: pass --trainer-gpus N (or --nodes) '
            "[--engines M --engine-tp T]"
        )
    if not detail:
        out += wrap(
            "detail: --detail (layer kinds, fit, engine ranks, every strategy, transfer plan), "
            "--entries, --json"
        )
    return out


def _detail_lines(report: dict) -> list[str]:
    counts = report["peak_counts"]
    lines = [""]
    lines += wrap(
        f"layer kinds: one sender converting one whole layer; peaks are transient GiB ({counts['excludes']}):"
    )
    rows = [
        [
            k["kind"],
            len(k["layers"]),
            k["entries"],
            gib(k["kernel_format_bytes"]),
            gib(k["gathered_bytes"]),
            gib(k["peaks"]["eager"], 1),
            gib(k["peaks"]["preallocated_stack"], 1),
            gib(k["peaks"]["glm_fp8"], 1),
        ]
        for k in report["layer_kinds"]
    ]
    lines += table(
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
        lines += wrap(f"{k['kind']}: layers {ranks_text(k['layers'])}", "  ")
    for key, name in (
        ("gathered", "gathered"),
        ("eager", "eager"),
        ("preallocated_stack", "prealloc-stack"),
        ("glm_fp8", "glm_fp8"),
    ):
        lines += wrap(f"{name}: {counts[key]}", "  ")
    fits = report["fits"]
    if fits is not None:
        lines.append("")
        lines += wrap(
            f"fit on a trainer GPU ({fits['trainer_gpus']} GPUs, {fits['gpu_gib']:g} GiB each): "
            f"{fits['counts']}:"
        )
        rows = [
            [p["path"], gib(p["peak_bytes"], 1), gib(p["total_bytes"], 1), "yes" if p["fits"] else "NO"]
            for p in fits["paths"]
        ]
        lines += table(
            rows,
            [
                "path",
                "peak GiB",
                f"+ {gib(fits['resident_master_bytes'], 1)} GiB masters",
                f"fits {fits['gpu_gib']:g} GiB",
            ],
        )
    engines = report["servers"] or ([report["engine"]] if report["engine"] is not None else [])
    for engine in engines:
        lines.append("")
        server = f"{engine['name']}, {engine['replicas']} replica(s): " if "name" in engine else ""
        lines += wrap(
            f"{server}engine ranks: a whole-model fp8 update (every layer, MTP, embeddings, norm, lm_head) "
            f"into {engine['ranks']} engine ranks (TP {engine['tp']} x DP {engine['dp']}, experts "
            f"by {engine['experts_by']}); wire GiB per rank, full broadcast against scatter; "
            f"extra: {report['peak_counts']['engine_extra']}, in one update or in vLLM's two "
            "sessions (the target's layers and non-layer tensors, then the MTP layer):"
        )
        rows = [
            [
                ranks_text(r["ranks"], 24),
                gib(r["full_broadcast_bytes"]),
                gib(r["scatter_bytes"]),
                f"{r['scatter_bytes'] / r['full_broadcast_bytes']:.3f}",
                gib(r["extra_broadcast_bytes"]),
                gib(r["extra_scatter_bytes"]),
                f"{gib(r['extra_target_session_bytes'])} / {gib(r['extra_draft_session_bytes'])}",
            ]
            for r in engine["rows"]
        ]
        lines += table(
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
    return lines


def _update_lines(lines: list[str], report: dict) -> None:
    update, counts = report["update"], report["peak_counts"]
    f = update["fleet"]
    lines.append("")
    if report["servers"] is None:
        ep = f", EP {f['engine_tp'] * f['engine_dp']}" if f["engine_ep"] else ""
        into = (
            f"{f['engines']} x server0 (TP {f['engine_tp']} x DP {f['engine_dp']}{ep}), "
            f"{f['link_gbps']:g} Gb/s per GPU"
        )
    else:
        into = f"{len(report['servers'])} servers, {f['link_gbps']:g} Gb/s per trainer GPU"
    lines += wrap(
        f"predicted whole-model update: {f['trainer_gpus']} trainer GPUs -> {into} (model: "
        f"glm_fp8.planning.update_time; pipeline factor "
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
                    gib(p["sent"], 1),
                    gib(p["received"], 1),
                    gib(p["gathered"], 1),
                    f"{p['seconds']:.2f}",
                    gib(p["sender_peak"], 2),
                ]
            )
        else:
            rows.append([p["strategy"], "-", "-", "-", "-", "n/a", "-"])
    lines += table(
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
        lines += wrap(
            f"{p['strategy']}: {p['arithmetic'] if p['applicable'] else 'n/a: ' + p['why_not']}", "  "
        )
    lines += wrap(f"sender peak: {counts['sender_peak']}", "  ")
    deltas = [p for p in update["strategies"] if p["applicable"] and p.get("delta")]
    if deltas:
        _delta_table(lines, deltas, counts["delta"])
    if report["servers"] is not None:
        lines.append("")
        lines += wrap(
            "per server, each strategy: its busiest rank's received GiB and its receiver's extra GiB in "
            "one update (n/a: not modelled, vLLM's own path):"
        )
        rows = [
            [x["name"], p["strategy"], gib(x["received"], 1), gib(x["extra"]) if x["extra"] else "n/a"]
            for p in update["strategies"]
            if p["applicable"]
            for x in p["servers"]
        ]
        lines += table(rows, ["server", "strategy", "received GiB", "extra GiB"])
    tp = update["transfer_plan"]
    if tp is None:
        return
    n = tp["senders"]
    lines.append("")
    lines += wrap(
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
            gib(r["sent_bytes"]),
            r["messages"],
            gib(r["convert_slot_bytes"]),
            gib(r["send_slot_bytes"]),
            gib(r["gathered_bytes"]),
            gib(r["peak_bytes"]),
        ]
        for r in tp["rows"]
    ]
    lines += table(
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
    lines += wrap(
        "peak = 2 x (convert slot + send slot) + gathered (one layer's tensors it owns, at its "
        f"largest layer); its largest: sender {tp['max_peak_sender']}, "
        f"{gib(tp['max_peak_bytes'])} GiB (the summary's figure)",
        "  ",
    )


def _delta_table(lines: list[str], preds: list[dict], counts: dict) -> None:
    """Every fp8 strategy's delta update (model prediction) beside its dense time."""
    spec = preds[0]["delta"]["delta"]
    lines.append("")
    where = "on the GPU" if spec["kept"] == "gpu" else "in host memory"
    lines += wrap(
        f"delta update, every fp8 strategy (model prediction; {pct(spec['fraction'])} of the e4m3 bytes "
        f"changed, kept {where}); GiB of the busiest rank:"
    )
    rows = [
        [
            p["strategy"],
            gib(p["delta"]["sent"], 3),
            gib(p["delta"]["received"], 3),
            pct(p["delta"]["wire_fraction"]),
            f"{p['delta']['seconds']:.3f}",
            f"{p['seconds']:.2f}",
            gib(p["delta"]["kept"], 2),
            gib(p["delta"]["sender_peak"], 2),
        ]
        for p in preds
    ]
    lines += table(
        rows,
        [
            "strategy",
            "sent GiB\n(sender)",
            "received GiB\n(engine rank)",
            "wire /\ndense",
            "delta s",
            "dense s",
            "kept GiB\n(sender)",
            "sender peak\nGiB",
        ],
    )
    for p in preds:
        lines += wrap(f"{p['strategy']}: {p['delta']['arithmetic']}", "  ")
    for key in ("kept", "sender_peak", "engine_extra"):
        lines += wrap(f"{key.replace('_', ' ')}: {counts[key]}", "  ")


_SHORT_DTYPES = {"float8_e4m3fn": "fp8 e4m3", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _entries_lines(report: dict) -> list[str]:
    lines = []
    for kind, entries in report["entries"].items():
        lines += ["", f"{kind} layer entries (offsets and bytes in the kernel-format layer buffer):"]
        rows = [
            [
                e["name"],
                _SHORT_DTYPES.get(e["dtype"], e["dtype"]),
                "x".join(map(str, e["shape"])),
                str(e["offset"]),
                str(e["bytes"]),
            ]
            for e in entries
        ]
        lines += table(rows, ["name", "dtype", "shape", "offset", "bytes"])
    return lines


__all__ = [
    "GIB",
    "WIDTH",
    "delta_lines",
    "deployment_lines",
    "format_plan_report",
    "gib",
    "pct",
    "ranks_text",
    "table",
    "traffic_lines",
    "wrap",
]

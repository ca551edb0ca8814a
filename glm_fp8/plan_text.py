"""``glm-fp8 plan``'s text: ``format_plan_report`` renders ``glm_fp8.planning.plan_report``'s data
as the summary, then (``detail``) tables of the layer kinds, the fit, the engine ranks, every
strategy and the many senders' transfer plan, then the entries when the report holds them;
every line fits ``WIDTH`` characters. A Python user gets the same text as the command line."""

from __future__ import annotations

import textwrap

import tabulate as tab

from glm_fp8.update_time import CONVERT_SECONDS_PER_BYTE, PIPELINE_FACTOR

_GIB = 2**30
WIDTH = 100  # every line glm-fp8 plan prints fits this many characters


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


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent + "  ", initial_indent=indent, break_on_hyphens=False
    )


def _gib(n: int | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / _GIB:.{digits}f}"


def _summary_lines(report: dict, detail: bool) -> list[str]:
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
    if not detail:
        out += _wrap(
            "detail: --detail (layer kinds, fit, engine ranks, every strategy, transfer plan), "
            "--entries, --json"
        )
    return out


def _ranks_text(ranks: list[int], width: int = 0) -> str:
    """Ranks as ranges: [0, 1, 2, 6] -> "0-2, 6"; wrapped onto lines of ``width`` if given."""
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


def _detail_lines(report: dict) -> list[str]:
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
    return lines


def _update_lines(lines: list[str], report: dict) -> None:
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


def _entries_lines(report: dict) -> list[str]:
    lines = []
    for kind, entries in report["entries"].items():
        lines += ["", f"{kind} layer entries (offsets and bytes in the kernel-format layer buffer):"]
        rows = [[e["name"], _SHORT_DTYPES.get(e["dtype"], e["dtype"]), "x".join(map(str, e["shape"])),
                 str(e["offset"]), str(e["bytes"])] for e in entries]  # fmt: skip
        lines += _table(rows, ["name", "dtype", "shape", "offset", "bytes"])
    return lines


__all__ = ["WIDTH", "format_plan_report"]

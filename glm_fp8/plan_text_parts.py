"""Parts of ``glm-fp8 plan``'s text (``glm_fp8.plan_text``): the helpers every section uses (lines
wrapped to ``WIDTH``, GiB, rank ranges, tables) and the deployment's summary lines: the fleet, the
mode auto picks with its predicted time, each rank's extra memory, each server's busiest rank's
received bytes and each trainer rank's NIC bytes; with a delta, the delta update's lines."""

from __future__ import annotations

import textwrap

import tabulate as tab

_GIB = 2**30
WIDTH = 100  # every line glm-fp8 plan prints fits this many characters


def wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent + "  ", initial_indent=indent, break_on_hyphens=False
    )


def gib(n: int | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / _GIB:.{digits}f}"


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
            draft = (
                f", {gib(x['draft_session_bytes'])} GiB in the draft session"
                if x["draft_session_bytes"]
                else ""
            )
            out += wrap(
                f"{x['name']} ranks ({x['replicas']} replica{'s' if x['replicas'] > 1 else ''} x "
                f"{x['ranks']}): "
                f"{gib(x['target_session_bytes'])} GiB in vLLM's target session{draft}",
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
    staged = f", {gib(d['sender_staging_bytes'])} GiB of it staged on the GPU" if d["kept"] == "host" else ""
    verdict = "fits" if d["fits"] else "does NOT fit"
    fits = report["fits"]
    out += wrap(
        f"a sender keeps what it last sent: {gib(d['sender_kept_bytes'])} GiB {where}{staged}; on its GPU "
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


__all__ = ["WIDTH", "delta_lines", "deployment_lines", "gib", "pct", "ranks_text", "table", "traffic_lines",
           "wrap"]  # fmt: skip

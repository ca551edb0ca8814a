"""The deployment sections of ``glm_fp8.planning.report.plan_report``: each engine rank's wire bytes and
extra memory (``engine_section``, ``engine_extra``), every strategy's predicted update time and
the many senders' transfer plan (``update_section``), for one engine layout or for every server of
a fleet (``server_sections``); the summary drawn from them is ``glm_fp8.planning.summary``
(``summary_section``). Each
figure comes with a label saying what it counts (the ``*_COUNTS`` strings)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from glm_fp8.core.errors import PlanArgumentError
from glm_fp8.engine.sglang import update_indexer_form
from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, model_layer_ids, mtp_layer_index
from glm_fp8.model.plans import plans_for_model
from glm_fp8.planning.fleet import Fleet, Server
from glm_fp8.planning.request import PlanRequest
from glm_fp8.planning.summary import MODE_STRATEGY
from glm_fp8.planning.update_time import STRATEGIES, many_senders_plan, predict
from glm_fp8.transfer.pack import FULL, update_bytes
from glm_fp8.transfer.routes import describe, transfer_plan


def _config_error(e: Exception) -> None:
    """Raise a refusal of the config itself (a field the update's sizes need) as the config's."""
    text = str(e).strip(chr(39))
    if text.startswith("config."):
        raise PlanArgumentError(
            "config", f"{text}; the engine's and the update's sizes need it (the layer kinds do not)"
        ) from None


def engine_section(config: Mapping, r: PlanRequest, tp: int) -> dict:
    """Each engine rank's wire bytes and its receiver's extra memory, ranks grouped by equal
    figures: the one-layout request's engine (``engine_tp`` None: ``tp``, said as assumed)."""
    server = Server(tp, r.engine_dp, r.engine_ep, r.engines)
    try:
        server.layouts()
    except ValueError as e:
        raise PlanArgumentError("engine_tp", f"{tp} with engine_dp {r.engine_dp}: {e}") from None
    assumed = " (assumed: pass engine_tp)" if r.engine_tp is None else ""
    what = f"{tp}{assumed} with engine_dp {r.engine_dp}" + (" and engine_ep" if r.engine_ep else "")
    return server_section(config, server, r.scale_fmt, "engine_tp", what)


def server_sections(config: Mapping, r: PlanRequest) -> list[dict]:
    """``server_section`` of every server of the request's fleet (a vLLM refusal names the server)."""
    fleet = r.fleet()
    out = []
    for s, name in zip(fleet.servers, fleet.server_names()):
        what = f"{'server ' if s.name else ''}{name} ({s.describe()})"  # unnamed: "server K" already
        out.append(server_section(config, s, r.scale_fmt, "servers", what, name, fleet))
    return out


def server_section(
    config: Mapping,
    server: Server,
    scale_fmt: str | None,
    field: str,
    what: str,
    name: str | None = None,
    fleet: Fleet | None = None,
) -> dict:
    """One server's ranks (one replica: the others hold the same): each rank's wire bytes and its
    receiver's extra memory, ranks grouped by equal figures; with ``fleet``, also its ``name``,
    replicas, layout and NIC. A layout vLLM refuses raises ``PlanArgumentError(field, what: why)``."""
    try:
        layouts = server.layouts()
        # The first and last ranks first: vLLM's per-rank rules refuse a layout there at once,
        # before every rank's shard is computed.
        update_bytes(config, [layouts[0], layouts[-1]], scale_fmt=scale_fmt)
        full, per_rank = update_bytes(config, layouts, scale_fmt=scale_fmt)
        extra = engine_extra(config, layouts, scale_fmt)
    except (KeyError, ValueError) as e:
        _config_error(e)
        raise PlanArgumentError(field, f"{what}: {str(e).strip(chr(39))}") from None
    lay = layouts[0]
    groups: dict = {}
    for rank, b in enumerate(per_rank):
        groups.setdefault((b, extra[rank]), []).append(rank)
    rows = [
        {
            "ranks": ranks,
            "full_broadcast_bytes": full,
            "scatter_bytes": b,
            "extra_broadcast_bytes": broadcast,
            "extra_scatter_bytes": one,
            "extra_target_session_bytes": target,
            "extra_draft_session_bytes": draft or None,
        }
        for (b, (one, broadcast, target, draft)), ranks in sorted(groups.items())
    ]
    out = {
        "tp": server.tp,
        "dp": server.dp,
        "ep": server.ep,
        "ranks": len(layouts),
        "experts_by": f"EP {lay.ep_size}" if lay.expert_parallel else f"MoE TP {lay.moe_tp_size}",
        "rows": rows,
    }
    if fleet is not None:  # a server of a fleet: who it is, its replicas and its NIC
        gbps = server.link_gbps or fleet.link_gbps
        out.update(
            {"name": name, "replicas": server.replicas, "link_gbps": gbps, "layout": server.describe()}
        )
    return out


def engine_extra(
    config: object, layouts: list, scale_fmt: str | None = None
) -> list[tuple[int, int, int, int]]:
    """Per engine rank of ``layouts`` (one engine): its receiver's extra memory for a whole-model
    update in one stream (scatter), the same from a full broadcast, and in vLLM's target and
    draft sessions (scatter; 0 for the draft without an MTP layer). An SGLang rank's "draft
    session" is its drafter's update (the MTP layer into SGLang's draft model, right after the
    target's in the same call; docs/sglang.md#the-mtp-drafter), whose receiver holds its own ring
    after the target's gave its back. Many senders cut the same regions into segments (a few
    hundred bytes more per layer)."""
    config = as_config(config)

    form = update_indexer_form(config, layouts)  # the DSA indexer as these ranks hold it

    def plan_for(ids: list[int], engines: list):
        plans = plans_for_model(config, "fp8", layer_ids=ids, scale_fmt=scale_fmt, indexer_form=form)
        return transfer_plan(config, plans, ids, engines, [0])

    mtp = mtp_layer_index(config)
    whole, target = [*model_layer_ids(config), REST], [*model_layer_ids(config, mtp=False), REST]
    scatter = [None, *layouts]
    one, broadcast = plan_for(whole, scatter), plan_for(whole, [None, *[FULL] * len(layouts)])
    # SGLang's drafter is a model of its own: the MTP layer lands in its drafter's layout.
    drafters = [None, *(lay.drafter_layout if lay.engine == "sglang" else lay for lay in layouts)]
    tgt, drf = plan_for(target, scatter), plan_for([mtp], drafters) if mtp is not None else None
    return [
        (
            one.receiver_bytes(r),
            broadcast.receiver_bytes(r),
            tgt.receiver_bytes(r),
            drf.receiver_bytes(r, ring=1) if drf is not None else 0,
        )
        for r in range(1, len(layouts) + 1)
    ]


def update_section(config: Mapping, r: PlanRequest, tp: int) -> tuple[dict, object]:
    """Every strategy's prediction and the many senders' transfer plan, as JSON data, and that
    plan (None where many senders do not apply: split experts, one trainer rank)."""
    fleet = r.fleet()
    dtypes = {"master_dtype": r.master_dtype, "gather_dtype": r.gather_dtype}
    many = r.experts_whole and r.trainer_gpus > 1
    try:
        transfer = many_senders_plan(config, fleet, scale_fmt=r.scale_fmt, **dtypes) if many else None
        preds = {
            p.strategy: p for p in predict(config, fleet, scale_fmt=r.scale_fmt, transfer=transfer, **dtypes)
        }
    except (KeyError, ValueError) as e:
        _config_error(e)
        raise PlanArgumentError("trainer_gpus", str(e).strip(chr(39))) from None
    strategies = []
    for name in STRATEGIES:
        if name in preds and (many or name != MODE_STRATEGY["senders"]):
            strategies.append({**dataclasses.asdict(preds[name]), "applicable": True, "why_not": None})
        else:  # only many senders: several trainer ranks, each holding whole experts
            why = (
                "needs more than one trainer rank"
                if r.trainer_gpus == 1
                else "needs every trainer rank to hold whole experts (Shard(0) on the expert dim)"
            )
            strategies.append({"strategy": name, "applicable": False, "why_not": why})
    plan = None
    if transfer is not None:
        n = len(transfer.senders)
        rows = {row[0]: row for row in describe(transfer, top=n)}
        gathered = [max(transfer.gathered_bytes(t), default=0) for t in range(n)]
        peaks = [transfer.sender_peak(t) for t in range(n)]
        busiest = list(rows)[:8]  # describe orders by bytes sent
        top_peak = max(range(n), key=lambda t: (peaks[t], -t))
        if transfer.senders[top_peak] not in busiest:
            busiest.append(transfer.senders[top_peak])
        shown = []
        for rank in busiest:
            t = transfer.senders.index(rank)
            _, experts, owned, sent, msgs, local, send = rows[rank]
            shown.append(
                {
                    "sender": rank,
                    "experts": experts,
                    "entries_owned": owned,
                    "sent_bytes": sent,
                    "messages": msgs,
                    "convert_slot_bytes": local,
                    "send_slot_bytes": send,
                    "gathered_bytes": gathered[t],
                    "peak_bytes": peaks[t],
                }
            )
        plan = {
            "senders": n,
            "messages_per_layer": transfer.messages_per_layer(),
            "rows": shown,
            "max_peak_sender": transfer.senders[top_peak],
            "max_peak_bytes": peaks[top_peak],
        }
    return {"fleet": dataclasses.asdict(fleet), "strategies": strategies, "transfer_plan": plan}, transfer


__all__ = ["engine_extra", "engine_section", "server_section", "server_sections", "update_section"]

"""The deployment sections of ``glm_fp8.planning.plan_report``: each engine rank's wire bytes and
extra memory (``engine_section``, ``engine_extra``), every strategy's predicted update time and
the many senders' transfer plan (``update_section``), and the summary drawn from them (the mode
``mode="auto"`` picks, its time, every rank's extra memory: ``summary_section``). Each figure
comes with a label saying what it counts (the ``*_COUNTS`` strings)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from glm_fp8.config import as_config
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.errors import PlanArgumentError
from glm_fp8.integrations.vllm.sync import auto_mode
from glm_fp8.memory import travel_plan
from glm_fp8.models import REST, model_layer_ids, mtp_layer_index
from glm_fp8.plan import plans_for_model
from glm_fp8.plan_request import PlanRequest
from glm_fp8.transfer.pack import FULL, update_bytes
from glm_fp8.transfer.routes import describe, transfer_plan
from glm_fp8.update_time import STRATEGIES, Fleet, many_senders_plan, predict

# The vLLM backend's modes (``TrainerOptions.mode``) and the update-time strategy each runs.
MODE_STRATEGY = {"senders": "fp8 many senders", "scatter": "fp8 scatter", "broadcast": "fp8 broadcast"}

TRAINER_EXTRA_COUNTS = {
    "senders": "2 conversion slots + 2 send slots + one layer's gathered tensors it owns, each at its "
    "largest layer",
    "scatter": "2 conversion slots + 2 send slots + one layer's gathered non-expert tensors, each at its "
    "largest layer (the experts arrive quantized, into its conversion slot)",
    "scatter/split": "2 conversion slots + 2 send slots + one layer's gathered non-expert tensors + 8 "
    'experts\' tensors (gather="chunked"), each at its largest layer',
    "contributor": "one layer's non-expert tensors (every rank all-gathers them: full_tensor) + its own "
    "experts quantized",
    "contributor/split": "one layer's non-expert tensors (every rank all-gathers them: full_tensor)",
    "single": "2 conversion slots + 2 send slots, each at its largest layer (one trainer rank gathers "
    "nothing: it converts its tensors where they lie)",
}
ENGINE_EXTRA_COUNTS = (
    "its receiver's ring of its largest layer buffer (2 slots; 1 in the draft session, one layer), "
    "checksum scratch and step headers; above its parameters"
)


def _config_error(e: Exception) -> None:
    """Raise a refusal of the config itself (a field the update's sizes need) as the config's."""
    text = str(e).strip(chr(39))
    if text.startswith("config."):
        raise PlanArgumentError(
            "config", f"{text}; the engine's and the update's sizes need it (the layer kinds do not)"
        ) from None


def _layouts(r: PlanRequest, tp: int) -> list:

    try:
        return EngineLayout.all_ranks(tp, r.engine_dp, r.engine_ep)
    except ValueError as e:
        raise PlanArgumentError("engine_tp", f"{tp} with engine_dp {r.engine_dp}: {e}") from None


def engine_section(config: Mapping, r: PlanRequest, tp: int) -> dict:
    """Each engine rank's wire bytes and its receiver's extra memory, ranks grouped by equal figures."""
    layouts = _layouts(r, tp)
    assumed = " (assumed: pass engine_tp)" if r.engine_tp is None else ""
    what = f"{tp}{assumed} with engine_dp {r.engine_dp}" + (" and engine_ep" if r.engine_ep else "")
    try:
        # The first and last ranks first: vLLM's per-rank rules refuse a layout there at once,
        # before every rank's shard is computed.
        update_bytes(config, [layouts[0], layouts[-1]], scale_fmt=r.scale_fmt)
        full, per_rank = update_bytes(config, layouts, scale_fmt=r.scale_fmt)
        extra = engine_extra(config, layouts, r.scale_fmt)
    except (KeyError, ValueError) as e:
        _config_error(e)
        raise PlanArgumentError("engine_tp", f"{what}: {str(e).strip(chr(39))}") from None
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
    return {
        "tp": tp,
        "dp": r.engine_dp,
        "ep": r.engine_ep,
        "ranks": len(layouts),
        "experts_by": f"EP {lay.ep_size}" if lay.expert_parallel else f"MoE TP {lay.moe_tp_size}",
        "rows": rows,
    }


def engine_extra(
    config: object, layouts: list, scale_fmt: str | None = None
) -> list[tuple[int, int, int, int]]:
    """Per engine rank of ``layouts`` (one engine): its receiver's extra memory for a whole-model
    update in one stream (scatter), the same from a full broadcast, and in vLLM's target and
    draft sessions (scatter; 0 for the draft without an MTP layer). Many senders cut the same
    regions into segments (a few hundred bytes more per layer)."""
    config = as_config(config)

    def plan_for(ids: list[int], engines: list):
        return transfer_plan(
            config, plans_for_model(config, "fp8", layer_ids=ids, scale_fmt=scale_fmt), ids, engines, [0]
        )

    mtp = mtp_layer_index(config)
    whole, target = [*model_layer_ids(config), REST], [*model_layer_ids(config, mtp=False), REST]
    scatter = [None, *layouts]
    one, broadcast = plan_for(whole, scatter), plan_for(whole, [None, *[FULL] * len(layouts)])
    tgt, drf = plan_for(target, scatter), plan_for([mtp], scatter) if mtp is not None else None
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
    fleet = Fleet(
        r.trainer_gpus, r.engines, tp, r.engine_dp, r.engine_ep, float(r.link_gbps), r.experts_whole
    )
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


def summary_section(
    config: Mapping,
    r: PlanRequest,
    kinds: list[dict],
    engine: dict | None,
    update: dict | None,
    transfer: object,
) -> dict:
    """The mode auto picks, its predicted time and every rank's extra memory."""
    if update is None:
        hint = (
            "pass trainer_gpus (glm-fp8 plan --trainer-gpus N, or --nodes) for the mode auto picks, "
            "the predicted update time and each trainer rank's extra memory"
        )
        out = {
            "auto_mode": None,
            "auto_reason": None,
            "strategy": None,
            "predicted_seconds": None,
            "trainer_extra": None,
            "engine_extra": None,
            "hint": hint,
        }
        if engine is not None:
            out["engine_extra"] = _engine_extra_summary(engine)
        return out
    mode, why = auto_mode(r.trainer_gpus, r.experts_whole)
    strategy = MODE_STRATEGY[mode]
    pred = next(s for s in update["strategies"] if s["strategy"] == strategy)
    t = r.trainer_gpus
    if mode == "senders":
        plan = update["transfer_plan"]
        trainer = [
            {
                "ranks": list(range(t)),
                "role": "sender",
                "bytes": plan["max_peak_bytes"],
                "counts": TRAINER_EXTRA_COUNTS["senders"],
            }
        ]
        engine_extra_rows = _senders_engine_extra(transfer, t, mtp_layer_index(config), engine["ranks"])
    else:
        trainer = [
            {
                "ranks": [0],
                "role": "sender",
                "bytes": pred["sender_peak"],
                "counts": TRAINER_EXTRA_COUNTS[
                    "single" if t == 1 else "scatter" if r.experts_whole else "scatter/split"
                ],
            }
        ]
        if t > 1:
            trainer.append(
                {
                    "ranks": list(range(1, t)),
                    "role": "contributor",
                    "bytes": _contributor_bytes(config, r),
                    "counts": TRAINER_EXTRA_COUNTS["contributor" if r.experts_whole else "contributor/split"],
                }
            )
        engine_extra_rows = _engine_extra_summary(engine)
    return {
        "auto_mode": mode,
        "auto_reason": why,
        "strategy": strategy,
        "predicted_seconds": pred["seconds"],
        "trainer_extra": trainer,
        "engine_extra": engine_extra_rows,
        "hint": None,
    }


def _engine_extra_summary(engine: dict) -> dict:
    """The largest engine rank's extra memory per vLLM session, scatter's figures."""
    rows = engine["rows"]
    target = max(row["extra_target_session_bytes"] for row in rows)
    drafts = [row["extra_draft_session_bytes"] for row in rows if row["extra_draft_session_bytes"]]
    return {
        "ranks": engine["ranks"],
        "target_session_bytes": target,
        "draft_session_bytes": max(drafts) if drafts else None,
        "broadcast_bytes": max(row["extra_broadcast_bytes"] for row in rows),
        "counts": ENGINE_EXTRA_COUNTS,
    }


def _senders_engine_extra(transfer, trainer_gpus: int, mtp: int | None, per_engine: int) -> dict:
    """The largest engine rank's extra memory per vLLM session under the many senders' routes
    (the whole update's routes, split by session: each session's receiver rings its largest)."""
    target_layers = tuple(lay for lay in transfer.layers if lay.layer_idx != mtp)
    draft_layers = tuple(lay for lay in transfer.layers if lay.layer_idx == mtp)
    ranks = range(trainer_gpus, len(transfer.engines))
    tgt = dataclasses.replace(transfer, layers=target_layers)
    target = max(tgt.receiver_bytes(rank) for rank in ranks)
    draft = None
    if draft_layers:
        drf = dataclasses.replace(transfer, layers=draft_layers)
        draft = max(drf.receiver_bytes(rank, ring=1) for rank in ranks)
    return {
        "ranks": per_engine,
        "target_session_bytes": target,
        "draft_session_bytes": draft,
        "counts": ENGINE_EXTRA_COUNTS,
    }


def _contributor_bytes(config: Mapping, r: PlanRequest) -> int:
    """A trainer rank other than the one sender (scatter): at its peak, one layer's non-expert
    tensors (each rank all-gathers them: ``full_tensor``) and its own experts quantized (whole
    experts) or nothing more (split experts travel in pieces)."""
    ids = [*model_layer_ids(config), REST]
    best = 0
    for plan in {
        id(p): p for p in plans_for_model(config, "fp8", layer_ids=ids, scale_fmt=r.scale_fmt)
    }.values():
        p = travel_plan(plan, r.master_dtype, r.gather_dtype)
        rest = sum(
            (dt or torch.bfloat16).itemsize * math.prod(shape)
            for name, (shape, dt) in p.inputs.items()
            if not name.startswith("mlp.experts.")
        )
        own = 0
        if r.experts_whole:
            experts = sum(e.nbytes for e in p.entries if e.name.startswith("mlp.experts."))
            own = -(-experts // r.trainer_gpus)
        best = max(best, rest + own)
    return best


__all__ = [
    "ENGINE_EXTRA_COUNTS",
    "MODE_STRATEGY",
    "TRAINER_EXTRA_COUNTS",
    "engine_extra",
    "engine_section",
    "summary_section",
    "update_section",
]

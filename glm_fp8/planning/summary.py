"""The summary of ``glm_fp8.planning.report.plan_report`` (``summary_section``), drawn from the
deployment sections (``glm_fp8.planning.deployment``), and the labels of what each figure counts
(``*_COUNTS``): the mode ``mode="auto"`` picks (``auto_mode``: the rule of
``glm_fp8.transfer.topology.choose_mode``, also given a ``Fleet``) and its predicted time, every
trainer rank's and every server's ranks' extra memory, what each server's busiest rank receives and
what each trainer rank sends the servers over its NIC; with a delta, the delta update beside the
dense one (``delta_summary``). Each figure comes with a label saying what it counts."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from glm_fp8.model.families import REST, model_layer_ids, mtp_layer_index
from glm_fp8.model.plans import plans_for_model
from glm_fp8.planning.fleet import Fleet
from glm_fp8.planning.memory import travel_plan
from glm_fp8.planning.request import PlanRequest
from glm_fp8.transfer.topology import choose_mode

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
    "its receiver's ring of its largest step buffer (2 slots, each a layer's buffer or a step's "
    "layers' side by side; 1 in the draft session or SGLang's drafter's update, one layer), "
    "checksum scratch and step headers; above its parameters"
)
DELTA_COUNTS = {
    "kept": "a sender's copy of what it last sent: every byte of its segments (fp8 bytes, scales and "
    "passthrough entries), resident between updates where it is kept",
    "sender_peak": "the dense update's sender peak (a layer sent dense needs it) + the comparison's scratch "
    "for its largest piece + a counts message and payload bound per segment of its largest layer, per "
    "conversion ring slot (kept in host memory, nothing of the kept copy is on the GPU)",
    "engine_extra": "the dense receiver (a delta layer is rebuilt and checked in a dense ring slot) + its "
    "largest layer's counts messages and payload bounds + apply_delta's offsets for its largest piece",
}


def auto_mode(trainer_ranks: int | Fleet, experts_whole: bool | None = None) -> tuple[str, str]:
    """The mode the vLLM backend's ``mode="auto"`` picks and why
    (``glm_fp8.transfer.topology.choose_mode``): ``auto_mode(trainer_ranks, experts_whole)``
    or ``auto_mode(fleet)``. The rule reads the trainer only (its ranks, whether each holds whole
    experts): the servers, however many and of whatever layouts, do not change it."""
    if isinstance(trainer_ranks, Fleet):
        if experts_whole is not None:
            raise TypeError("auto_mode: given a Fleet, experts_whole is the fleet's; pass one or the other")
        return choose_mode(trainer_ranks.trainer_gpus, trainer_ranks.experts_whole)
    if experts_whole is None:
        raise TypeError("auto_mode: expected (trainer_ranks, experts_whole) or a Fleet")
    return choose_mode(trainer_ranks, experts_whole)


def summary_section(
    config: Mapping,
    r: PlanRequest,
    kinds: list[dict],
    engine: dict | None,
    update: dict | None,
    transfer: object,
    servers: list[dict] | None = None,
) -> dict:
    """The mode auto picks, its predicted time and every rank's extra memory; ``servers``: the
    fleet's server sections (``plan_deployment.server_sections``; None: ``engine`` is the one)."""
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
    fleet = r.fleet()
    mode, why = auto_mode(fleet)
    strategy = MODE_STRATEGY[mode]
    pred = next(s for s in update["strategies"] if s["strategy"] == strategy)
    t = r.trainer_gpus
    sections = servers or [engine]
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
        mtp = mtp_layer_index(config)
        extras = [
            _senders_engine_extra(transfer, [t + r for r in ranks], mtp, sec["ranks"])
            for ranks, sec in zip(fleet.engine_ranges(), sections)
        ]
        for x, server, sec in zip(extras, fleet.servers, sections):
            if server.engine == "sglang":  # its drafter's update has routes of its own: scatter's figure
                x["draft_session_bytes"] = _engine_extra_summary(sec)["draft_session_bytes"]
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
        extras = [_engine_extra_summary(sec) for sec in sections]
    per_server = []
    for server, name, x, load in zip(fleet.servers, fleet.server_names(), extras, pred["servers"]):
        per_server.append(
            {
                "name": name,
                "engine": server.engine,
                "layout": server.describe(),
                "replicas": server.replicas,
                "ranks": server.ranks,
                "link_gbps": server.link_gbps or fleet.link_gbps,
                "received_bytes": load["received"],
                "extra_bytes": load["extra"],
                "target_session_bytes": x["target_session_bytes"],
                "draft_session_bytes": x["draft_session_bytes"],
                "counts": ENGINE_EXTRA_COUNTS,
            }
        )
    # the server whose ranks need the most stands for all where one figure is read (older readers)
    top = max(range(len(extras)), key=lambda k: (extras[k]["target_session_bytes"], -k))
    applicable = [s for s in update["strategies"] if s["applicable"]]
    fastest = min(applicable, key=lambda s: s["seconds"])
    return {
        "auto_mode": mode,
        "auto_reason": why,
        "strategy": strategy,
        "predicted_seconds": pred["seconds"],
        "trainer_extra": trainer,
        "engine_extra": {**extras[top], "server": per_server[top]["name"]},
        "hint": None,
        "fastest": {"strategy": fastest["strategy"], "seconds": fastest["seconds"]},
        "servers": per_server,
        "sender_bytes": list(pred["sender_bytes"]),
        "trainer_link_gbps": fleet.link_gbps,
    }


def delta_summary(update: dict, summary: dict, fits: dict) -> dict | None:
    """The delta update of the strategy auto picks, beside its dense one: time, wire bytes, a
    sender's kept copy and transient memory (with the resident masters, against the GPU), each
    server's busiest rank (``DELTA_COUNTS`` says what each memory figure counts)."""
    pred = next(s for s in update["strategies"] if s["strategy"] == summary["strategy"])
    d = pred.get("delta")
    if d is None:
        return None
    spec = d["delta"]
    gpu = (d["kept"] if spec["kept"] == "gpu" else 0) + d["sender_peak"]
    total = fits["resident_master_bytes"] + gpu
    return {
        **spec,
        "strategy": pred["strategy"],
        "seconds": d["seconds"],
        "dense_seconds": pred["seconds"],
        "arithmetic": d["arithmetic"],
        "wire_fraction": d["wire_fraction"],
        "sent_bytes": d["sent"],
        "received_bytes": d["received"],
        "sender_kept_bytes": d["kept"],
        "sender_peak_bytes": d["sender_peak"],
        "sender_gpu_bytes": gpu,
        "trainer_gpu_bytes": total,
        "fits": total <= fits["gpu_gib"] * 2**30,
        "servers": [
            {
                "name": x["name"],
                "received_bytes": x["received"],
                "extra_bytes": x["extra"],
                "dense_extra_bytes": dense["extra"],
            }
            for x, dense in zip(d["servers"], pred["servers"])
        ],
        "counts": DELTA_COUNTS,
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


def _senders_engine_extra(transfer, ranks: list[int], mtp: int | None, per_engine: int) -> dict:
    """The largest extra memory of engine ranks ``ranks`` (link ranks) per vLLM session under the
    many senders' routes (the whole update's routes, split by session: each session's receiver
    rings its largest)."""
    target_layers = [pos for pos, lay in enumerate(transfer.layers) if lay.layer_idx != mtp]
    draft_layers = [pos for pos, lay in enumerate(transfer.layers) if lay.layer_idx == mtp]
    tgt = transfer.subset(target_layers)
    target = max(tgt.receiver_bytes(rank) for rank in ranks)
    draft = None
    if draft_layers:
        drf = transfer.subset(draft_layers)
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
    "DELTA_COUNTS",
    "ENGINE_EXTRA_COUNTS",
    "MODE_STRATEGY",
    "TRAINER_EXTRA_COUNTS",
    "auto_mode",
    "delta_summary",
    "summary_section",
]

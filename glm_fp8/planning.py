"""What ``glm-fp8 plan`` computes, as a library: ``plan_report`` sizes one model's update for a
deployment (trainer GPUs, engine replicas and their vLLM layout) and returns it as JSON data,
first a summary (the mode ``mode="auto"`` picks and why, the predicted update time, every rank's
extra memory), then the detail (layer kinds and their conversion peaks, whether the masters fit
a GPU, each engine rank's wire bytes and extra memory, the time of every strategy, the many
senders' transfer plan). ``auto_mode`` is the rule the vLLM backend's ``mode="auto"`` follows.

Every peak comes with a label saying what it counts (the ``*_COUNTS`` strings); none of them
counts the resident master shards, optimizer state, gradients or activations unless it says so.
The models behind the figures: ``glm_fp8.memory`` and ``glm_fp8.update_time``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from glm_fp8._checks import check_int
from glm_fp8.config import as_config
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.errors import PlanArgumentError
from glm_fp8.integrations.vllm.sync import auto_mode
from glm_fp8.memory import COUNTS, estimate_memory, master_bytes_per_gpu, travel_plan
from glm_fp8.models import REST, layer_kind, model_layer_ids, mtp_layer_index
from glm_fp8.numerics import SCALE_FMTS
from glm_fp8.plan import plan_from_config, plans_for_model
from glm_fp8.transfer.pack import FULL, update_bytes
from glm_fp8.transfer.routes import describe, transfer_plan
from glm_fp8.update_time import SENDER_PEAK_COUNTS, STRATEGIES, Fleet, many_senders_plan, predict

# Bounds on the deployment, checked before anything is built from it. The transfer plan is
# computed sender by sender and engine rank by engine rank (about 0.02-0.05 s each on a CPU),
# so these keep ``glm-fp8 plan`` within about a minute; real fleets are far smaller.
MAX_TRAINER_GPUS = 1024
MAX_ENGINE_RANKS = 512  # one engine's TP x DP (vLLM's EP needs at most one rank per routed expert)
MAX_ENGINES = 256
MAX_ALL_ENGINE_RANKS = 4096  # every replica's ranks, each a destination of the many senders' plan

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GATHER_DTYPES = {"trainer": None, "fp32": torch.float32, "bf16": torch.bfloat16}

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
EXCLUDES = "above the resident master shards; optimizer state, gradients and activations not counted"


@dataclass(frozen=True)
class PlanRequest:
    """What to size. ``trainer_gpus`` None: no deployment (layer kinds only, and the engine's
    ranks when ``engine_tp`` is given); with it, ``engine_tp`` None means TP 8 (said in the
    summary). ``master_dtype``: the dtype the trainer holds its masters in; ``gather_dtype``:
    None (no cast, the library's default) or the dtype tensors are cast to before they travel.
    ``target`` and ``scale_fmt`` as ``plan_from_config`` takes them; vLLM's sections use its
    Hopper layout, so ``target="blackwell"`` goes with no deployment and no engine."""

    target: str = "hopper"
    scale_fmt: str | None = None
    master_dtype: torch.dtype = torch.float32
    gather_dtype: torch.dtype | None = None
    trainer_gpus: int | None = None
    engines: int = 1
    engine_tp: int | None = None
    engine_dp: int = 1
    engine_ep: bool = False
    link_gbps: float = 400.0
    experts_whole: bool = True
    gpu_gib: float = 139.0
    entries: bool = False

    def check(self) -> None:
        """Refuse sizes out of bounds and combinations that mean nothing, before anything is
        built (``PlanArgumentError`` naming the field, the limit and why)."""
        limits = (
            ("trainer_gpus", MAX_TRAINER_GPUS, "the many senders' plan is computed per sender"),
            ("engines", MAX_ENGINES, "each replica is a destination of the many senders' plan"),
            ("engine_tp", MAX_ENGINE_RANKS, "each engine rank's shard is computed"),
            ("engine_dp", MAX_ENGINE_RANKS, "each engine rank's shard is computed"),
        )
        for name, limit, why in limits:
            value = getattr(self, name)
            if value is None and name in ("trainer_gpus", "engine_tp"):
                continue
            try:
                check_int(name, value, 1, limit, f" ({why})")
            except ValueError as e:  # the CLI names its option where check_int names the field
                raise PlanArgumentError(name, str(e).removeprefix(f"{name}: ")) from None
        tp = self.engine_tp or 8
        if tp * self.engine_dp > MAX_ENGINE_RANKS:
            raise PlanArgumentError(
                "engine_dp",
                f"TP {tp} x DP {self.engine_dp} = {tp * self.engine_dp} engine ranks; expected "
                f"at most {MAX_ENGINE_RANKS} (each engine rank's shard is computed)",
            )
        if self.trainer_gpus is not None and self.engines * tp * self.engine_dp > MAX_ALL_ENGINE_RANKS:
            raise PlanArgumentError(
                "engines",
                f"{self.engines} engines x {tp * self.engine_dp} ranks = "
                f"{self.engines * tp * self.engine_dp} engine ranks; expected at most "
                f"{MAX_ALL_ENGINE_RANKS} (each is a destination of the many senders' plan)",
            )
        if not (
            isinstance(self.link_gbps, (int, float)) and math.isfinite(self.link_gbps) and self.link_gbps > 0
        ):
            raise PlanArgumentError("link_gbps", f"expected a finite number > 0, got {self.link_gbps!r}")
        if not (isinstance(self.gpu_gib, (int, float)) and math.isfinite(self.gpu_gib) and self.gpu_gib > 0):
            raise PlanArgumentError("gpu_gib", f"expected a finite number > 0, got {self.gpu_gib!r}")
        if self.master_dtype not in MASTER_DTYPES.values():
            raise PlanArgumentError(
                "master_dtype", f"expected torch.float32 or torch.bfloat16, got {self.master_dtype}"
            )
        if self.gather_dtype not in GATHER_DTYPES.values():
            raise PlanArgumentError(
                "gather_dtype", f"expected None, torch.float32 or torch.bfloat16, got {self.gather_dtype}"
            )
        if self.target not in ("hopper", "blackwell"):
            raise PlanArgumentError("target", f"expected 'hopper' or 'blackwell', got {self.target!r}")
        if self.scale_fmt not in (None, *SCALE_FMTS):
            raise PlanArgumentError(
                "scale_fmt", f"expected None or one of {SCALE_FMTS}, got {self.scale_fmt!r}"
            )
        if self.target == "blackwell" and self.scale_fmt == "fp32":
            raise PlanArgumentError(
                "scale_fmt", "'fp32' with target 'blackwell': Blackwell's packed scales are ue8m0 only"
            )
        if self.target == "blackwell" and (self.trainer_gpus is not None or self.engine_tp is not None):
            raise PlanArgumentError(
                "target",
                "'blackwell' is the kernel format of the layer table only: vLLM's weights "
                "(the engine and the update) are in Hopper's layout, with scale_fmt='ue8m0' for "
                "DeepGEMM's power-of-two scales; leave target at 'hopper'",
            )


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def plan_report(config: object, request: PlanRequest | None = None) -> dict:
    """Everything ``glm-fp8 plan`` shows, as JSON data (the CLI prints it as text or as is).

    Keys, in this order: ``model``; ``assumptions`` (dtypes, target, whether the engine's TP 8 was
    assumed); ``summary`` (``auto_mode`` and ``auto_reason``, ``strategy`` and
    ``predicted_seconds``, ``trainer_extra`` and ``engine_extra``: each rank's extra memory with
    what it counts; None where no deployment was given, and ``hint`` saying what to pass);
    ``layer_kinds`` (per kind: layers, entries, bytes, each conversion path's peak);
    ``peak_counts`` (what each peak counts); ``fits`` (resident masters plus each path's peak,
    with a deployment); ``engine`` (per group of engine ranks: wire bytes and extra memory);
    ``update`` (every strategy of ``glm_fp8.update_time.STRATEGIES``, a row that does not apply
    marked so with why, and the many senders' transfer plan); ``entries`` (per kind, when
    ``request.entries``). Sizes are in bytes, times in seconds.

    Raises ``PlanArgumentError`` for a request out of bounds (``PlanRequest.check``) or one vLLM
    would refuse (naming the field to change), ValueError for a config the plans cannot use."""
    request = request or PlanRequest()
    request.check()
    config = as_config(config)
    try:
        key = json.dumps(config, sort_keys=True)
    except (TypeError, ValueError):  # a value JSON cannot hold: no cache
        report = _report(config, dataclasses.replace(request, entries=False))
    else:
        report = copy.deepcopy(_cached_report(key, dataclasses.replace(request, entries=False)))
    report["entries"] = _entries(config, request) if request.entries else None
    return report


@functools.lru_cache(maxsize=4)
def _cached_report(config_json: str, request: PlanRequest) -> dict:
    # The same question asked again (text, then --json; tests) costs nothing: the report is a
    # function of the config and the request alone.
    return _report(json.loads(config_json), request)


def _report(config: dict, r: PlanRequest) -> dict:
    """``plan_report`` without the entries: the summary first, then the detail."""
    report: dict = {}
    kinds = _layer_kinds(config, r)
    report["model"] = {
        "model_type": config["model_type"],
        "decoder_layers": config["num_hidden_layers"],
        "kinds": {k["kind"]: k["layers"] for k in kinds},
        "kernel_format_bytes": sum(k["kernel_format_bytes"] * len(k["layers"]) for k in kinds),
    }
    deployed = r.trainer_gpus is not None
    tp = r.engine_tp or 8
    report["assumptions"] = {
        "master_dtype": _dtype_name(r.master_dtype),
        "gather_dtype": _dtype_name(r.gather_dtype),
        "gathered_in": _dtype_name(r.gather_dtype)
        or f"the masters' own dtype ({_dtype_name(r.master_dtype)})",
        "target": r.target,
        "scale_fmt": r.scale_fmt,
        "engine_tp_assumed": deployed and r.engine_tp is None,
    }
    engine = _engine(config, r, tp) if (deployed or r.engine_tp is not None) else None
    update, transfer = _update(config, r, tp) if deployed else (None, None)
    summary = _summary(config, r, kinds, engine, update, transfer)
    report["summary"] = summary
    report["layer_kinds"] = kinds
    report["peak_counts"] = {
        **{k: v for k, v in COUNTS.items() if k != "inputs"},
        "gathered": COUNTS["inputs"],
        "excludes": EXCLUDES,
        "sender_peak": SENDER_PEAK_COUNTS,
        "engine_extra": ENGINE_EXTRA_COUNTS,
    }
    report["fits"] = _fits(config, r, kinds, summary) if deployed else None
    report["engine"] = engine
    report["update"] = update
    return report


def _kind_plans(config: Mapping, r: PlanRequest) -> dict:
    """Layer kind -> (its plan, its layer indices), in order of first appearance."""
    plans: dict = {}
    for i in range(config["num_hidden_layers"]):
        kind = layer_kind(config, i)
        if kind not in plans:
            plans[kind] = (plan_from_config(config, i, target=r.target, scale_fmt=r.scale_fmt), [])
        plans[kind][1].append(i)
    return plans


def _layer_kinds(config: Mapping, r: PlanRequest) -> list[dict]:

    rows = []
    for kind, (plan, idx) in _kind_plans(config, r).items():
        est = estimate_memory(travel_plan(plan, r.master_dtype, r.gather_dtype))
        rows.append(
            {
                "kind": kind,
                "layers": idx,
                "entries": len(plan.entries),
                "kernel_format_bytes": plan.nbytes,
                "gathered_bytes": est.inputs,
                "peaks": {
                    "eager": est.eager,
                    "preallocated_stack": est.preallocated_stack,
                    "glm_fp8": est.glm_fp8,
                },
            }
        )
    return rows


def _entries(config: Mapping, r: PlanRequest) -> dict:
    return {
        kind: [
            {
                "name": e.name,
                "dtype": _dtype_name(e.dtype),
                "shape": list(e.shape),
                "offset": e.offset,
                "bytes": e.nbytes,
            }
            for e in plan.entries
        ]
        for kind, (plan, _) in _kind_plans(config, r).items()
    }


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


def _engine(config: Mapping, r: PlanRequest, tp: int) -> dict:
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


def _update(config: Mapping, r: PlanRequest, tp: int) -> tuple[dict, object]:
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


def _summary(
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


def _fits(config: Mapping, r: PlanRequest, kinds: list[dict], summary: dict) -> dict:
    """Resident master shards per trainer GPU plus each path's peak, against ``gpu_gib``."""
    resident = master_bytes_per_gpu(config, r.trainer_gpus, r.master_dtype)
    budget = r.gpu_gib * 2**30
    biggest = max(kinds, key=lambda k: k["peaks"]["eager"])
    paths = [
        {"path": name, "layer_kind": biggest["kind"], "peak_bytes": biggest["peaks"][key]}
        for name, key in (
            ("eager (one sender, whole layer)", "eager"),
            ("preallocated stack (one sender, whole layer)", "preallocated_stack"),
            ("glm_fp8 (one sender, whole layer)", "glm_fp8"),
        )
    ]
    top = max(summary["trainer_extra"], key=lambda x: x["bytes"])
    paths.append(
        {
            "path": f"auto: {summary['strategy']} (the busiest trainer rank)",
            "layer_kind": None,
            "peak_bytes": top["bytes"],
        }
    )
    for p in paths:
        p["total_bytes"] = resident + p["peak_bytes"]
        p["fits"] = p["total_bytes"] <= budget
    return {
        "trainer_gpus": r.trainer_gpus,
        "master_dtype": _dtype_name(r.master_dtype),
        "resident_master_bytes": resident,
        "gpu_gib": r.gpu_gib,
        "paths": paths,
        "counts": f"the {_dtype_name(r.master_dtype)} master shards of the decoder layers (FSDP over "
        f"{r.trainer_gpus} GPUs) plus one peak; optimizer state, gradients, activations and the "
        "allocator's cache not counted",
    }


__all__ = [
    "ENGINE_EXTRA_COUNTS",
    "GATHER_DTYPES",
    "MASTER_DTYPES",
    "MAX_ALL_ENGINE_RANKS",
    "MAX_ENGINES",
    "MAX_ENGINE_RANKS",
    "MAX_TRAINER_GPUS",
    "MODE_STRATEGY",
    "PlanArgumentError",
    "PlanRequest",
    "TRAINER_EXTRA_COUNTS",
    "auto_mode",
    "engine_extra",
    "plan_report",
]

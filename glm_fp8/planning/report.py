"""What ``glm-fp8 plan`` computes, as a library: ``plan_report`` sizes one model's update for a
deployment (trainer GPUs and a fleet of vLLM servers: replicas of one layout, or several servers
of their own layouts, ``PlanRequest.servers``) and returns it as JSON data,
first a summary (the mode ``mode="auto"`` picks and why, the predicted update time, every rank's
extra memory), then the detail (layer kinds and their conversion peaks, whether the masters fit
a GPU, each engine rank's wire bytes and extra memory, the time of every strategy, the many
senders' transfer plan), and with a delta (``plan_report(..., delta=Delta(fraction, ...))``) the
delta update's time, wire bytes and memory beside the dense one's. ``auto_mode`` is the rule the
vLLM backend's ``mode="auto"`` follows (given the trainer's ranks and whether they hold whole
experts, or a ``Fleet``).

Every peak comes with a label saying what it counts (the ``*_COUNTS`` strings); none of them
counts the resident master shards, optimizer state, gradients or activations unless it says so.
The models behind the figures: ``glm_fp8.planning.memory`` and ``glm_fp8.planning.update_time``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping

from glm_fp8.core.errors import PlanArgumentError
from glm_fp8.model.config import as_config
from glm_fp8.model.families import layer_kind
from glm_fp8.model.plans import plan_from_config
from glm_fp8.planning.deployment import engine_section, server_sections, update_section
from glm_fp8.planning.memory import COUNTS, estimate_memory, master_bytes_per_gpu, travel_plan
from glm_fp8.planning.request import (
    PlanRequest,
    dtype_name,
)
from glm_fp8.planning.summary import DELTA_COUNTS, ENGINE_EXTRA_COUNTS, delta_summary, summary_section
from glm_fp8.planning.update_delta import Delta, as_delta
from glm_fp8.planning.update_time import SENDER_PEAK_COUNTS, predict

EXCLUDES = "above the resident master shards; optimizer state, gradients and activations not counted"


def plan_report(
    config: object, request: PlanRequest | None = None, delta: Delta | float | None = None
) -> dict:
    """Everything ``glm-fp8 plan`` shows, as JSON data (the CLI prints it as text or as is).

    Keys, in this order: ``model``; ``assumptions`` (dtypes, target, whether the engine's TP 8 was
    assumed); ``summary`` (``auto_mode`` and ``auto_reason``, ``strategy`` and
    ``predicted_seconds``, ``trainer_extra`` and ``engine_extra``: each rank's extra memory with
    what it counts; None where no deployment was given, and ``hint`` saying what to pass; with a
    deployment also ``servers``: per server its busiest rank's received bytes and extra memory,
    ``sender_bytes``: what each trainer rank sends the servers, ``fastest``: the strategy
    predicted fastest, ``trainer_link_gbps``);
    ``layer_kinds`` (per kind: layers, entries, bytes, each conversion path's peak);
    ``peak_counts`` (what each peak counts); ``fits`` (resident masters plus each path's peak,
    with a deployment); ``engine`` (per group of engine ranks: wire bytes and extra memory; of a
    fleet's first server); ``servers`` (a fleet's, ``PlanRequest.servers``: each server's
    ``engine`` section with its name, replicas, layout and NIC; None for one engine layout);
    ``update`` (every strategy of ``glm_fp8.planning.update_time.STRATEGIES``, a row that does not apply
    marked so with why, and the many senders' transfer plan); ``entries`` (per kind, when
    ``request.entries``). Sizes are in bytes, times in seconds.

    ``delta`` (a ``glm_fp8.planning.update_delta.Delta``, or its changed fraction; needs a deployment): each
    applicable strategy's ``delta`` (``glm_fp8.planning.update_time.DeltaPrediction`` as data) and
    ``summary["delta"]`` (auto's strategy: the delta time beside the dense one, the wire
    fraction, a sender's kept copy and whether it fits, each server's receiver; None without).

    Raises ``PlanArgumentError`` for a request out of bounds (``PlanRequest.check``) or one vLLM
    would refuse (naming the field to change), or a bad ``delta``; ValueError for a config the
    plans cannot use."""
    request = request or PlanRequest()
    request.check()
    try:
        spec = as_delta(delta)
    except ValueError as e:
        raise PlanArgumentError("delta", str(e).removeprefix("Delta.").removeprefix("fraction: ")) from None
    if spec is not None and request.trainer_gpus is None:
        raise PlanArgumentError("delta", "needs trainer_gpus: a delta update is predicted for a deployment")
    config = as_config(config)
    if request.trainer is not None:  # its pipeline split against the model's layers
        try:
            request.trainer.stage_layers(config["num_hidden_layers"])
        except ValueError as e:
            raise PlanArgumentError("trainer", str(e).removeprefix("trainer: ")) from None
    bare = dataclasses.replace(request, entries=False)
    try:
        key = json.dumps(config, sort_keys=True)
    except (TypeError, ValueError):  # a value JSON cannot hold: no cache
        report = _report(config, bare, spec)
    else:
        report = copy.deepcopy(_cached_report(key, bare, spec))
    report["entries"] = _entries(config, request) if request.entries else None
    return report


@functools.lru_cache(maxsize=4)
def _cached_report(config_json: str, request: PlanRequest, delta: Delta | None) -> dict:
    # The same question asked again (text, then --json; tests) costs nothing: the report is a
    # function of the config, the request and the delta alone.
    return _report(json.loads(config_json), request, delta)


def _report(config: dict, r: PlanRequest, delta: Delta | None = None) -> dict:
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
        "master_dtype": dtype_name(r.master_dtype),
        "gather_dtype": dtype_name(r.gather_dtype),
        "gathered_in": dtype_name(r.gather_dtype) or f"the masters' own dtype ({dtype_name(r.master_dtype)})",
        "target": r.target,
        "scale_fmt": r.scale_fmt,
        "engine_tp_assumed": deployed and r.engine_tp is None and not r.servers,
    }
    servers = server_sections(config, r) if r.servers else None
    if servers:
        engine = servers[0]
    else:
        engine = engine_section(config, r, tp) if (deployed or r.engine_tp is not None) else None
    update, transfer = update_section(config, r, tp) if deployed else (None, None)
    if delta is not None:
        _add_delta(config, r, update, transfer, delta)
    summary = summary_section(config, r, kinds, engine, update, transfer, servers)
    report["summary"] = summary
    report["layer_kinds"] = kinds
    report["peak_counts"] = {
        **{k: v for k, v in COUNTS.items() if k != "inputs"},
        "gathered": COUNTS["inputs"],
        "excludes": EXCLUDES,
        "sender_peak": SENDER_PEAK_COUNTS,
        "engine_extra": ENGINE_EXTRA_COUNTS,
        "delta": DELTA_COUNTS,
    }
    report["fits"] = _fits(config, r, kinds, summary) if deployed else None
    summary["delta"] = delta_summary(update, summary, report["fits"]) if delta is not None else None
    report["engine"] = engine
    report["servers"] = servers
    report["update"] = update
    return report


def _add_delta(config: Mapping, r: PlanRequest, update: dict, transfer: object, delta: Delta) -> None:
    """Each applicable strategy's delta update (``predict(..., delta=)``, the many senders' plan
    reused), as data under its ``delta`` key."""
    dtypes = {"master_dtype": r.master_dtype, "gather_dtype": r.gather_dtype}
    preds = predict(config, r.fleet(), scale_fmt=r.scale_fmt, transfer=transfer, delta=delta, **dtypes)
    by = {p.strategy: p.delta for p in preds}
    for s in update["strategies"]:
        if s["applicable"]:
            s["delta"] = dataclasses.asdict(by[s["strategy"]]) if by.get(s["strategy"]) else None


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
                "dtype": dtype_name(e.dtype),
                "shape": list(e.shape),
                "offset": e.offset,
                "bytes": e.nbytes,
            }
            for e in plan.entries
        ]
        for kind, (plan, _) in _kind_plans(config, r).items()
    }


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
        "master_dtype": dtype_name(r.master_dtype),
        "resident_master_bytes": resident,
        "gpu_gib": r.gpu_gib,
        "paths": paths,
        "counts": f"the {dtype_name(r.master_dtype)} master shards of the decoder layers (FSDP over "
        f"{r.trainer_gpus} GPUs) plus one peak; optimizer state, gradients, activations and the "
        "allocator's cache not counted",
    }


__all__ = ["plan_report"]

"""The update-time model behind ``glm-fp8 plan --trainer-gpus``: for each way of moving one
whole-model update (every layer, the MTP layer, embeddings, final norm, lm_head) from the
trainer to a fleet of vLLM servers (``Fleet``, ``Server``: glm_fp8.planning.fleet), the bytes the busiest
rank sends, receives and gathers, each sender's and each server's busiest rank's bytes, the
predicted time and a sender's and a server rank's transient memory.

The model (docs/update_time.md says why each term is there):

- Every GPU has one full-duplex link: a trainer GPU's ``Fleet.link_gbps``, a server GPU's its
  ``Server.link_gbps`` (default: the fleet's); NCCL's pipelined broadcast carries each byte over
  each link once, so a broadcast to many ranks costs its root what a send to one does. With one
  sender, ranks that hold the same region share one broadcast (replicas, data-parallel ranks,
  ranks of another server of the same shard); many senders send what the transfer plan says.
- Layers are pipelined (convert layer i+1 while layer i is on the wire), so an update takes the
  busiest link's bytes over its rate (a sender's out or in, a server rank's in), times
  ``PIPELINE_FACTOR``, plus the pipeline's fill: one layer's conversion. With many senders, where
  longer, the sum over the steps of each step's busiest link instead: every rank's vote closes a
  step before the next one's bytes move (``_step_seconds``, docs/update_time.md#steps).
- Gathers over the trainer's links (FSDP shards to the rank that converts) travel in the
  masters' own dtype (``master_dtype``, float32 by default: the library casts nothing unless
  given a ``gather_dtype``) and overlap with sending (the other direction of a full-duplex
  link), so they count as the rank's incoming bytes.
- A sender's peak (``Prediction.sender_peak``, ``SENDER_PEAK_COUNTS``): a ring of 2 conversion
  slots and 2 send slots, plus one layer's gathered tensors, each at its largest layer; above
  the resident master shards (optimizer state, gradients, activations not counted).

What it does not model: latency per message (votes, headers; a few hundred per update), link
contention inside a node, stragglers, and the engines' post-load steps. Delta updates
(``predict(..., delta=Delta(fraction))``: ``Prediction.delta``): the same model with the delta's
bytes, plus the sender's conversion and host copies (docs/update_time.md#delta-updates).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from glm_fp8.engine.sglang import update_indexer_form
from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.plans import plans_for_model
from glm_fp8.planning.fleet import Fleet
from glm_fp8.planning.memory import travel_plan
from glm_fp8.planning.update_delta import (
    HOST_COPY_BYTES_PER_S,
    Delta,
    DeltaTraffic,
    SenderShare,
    as_delta,
    plan_bytes,
    sender_share,
    traffic,
)
from glm_fp8.planning.update_delta import receiver_bytes as delta_receiver_bytes
from glm_fp8.transfer.owners import stack_entries
from glm_fp8.transfer.pack import FULL
from glm_fp8.transfer.routes import TransferPlan, transfer_plan

# Calibration, measured on one H200 (bench/HISTORY.md, 2026-12-04, b18801c, protocol v3): total / link
# time of one pipelined sender through the one-GPU stand-in link, 80 GLM-5 sparse layers: full broadcast
# 1.0006-1.0012, scatter into TP 8 1.0023, many senders 1.0018-1.0063; the factor bounds them all.
PIPELINE_FACTOR = 1.01
# One GLM-5 sparse layer (9.20 GiB of kernel format) converted from bf16, checksum included, in
# 10.28 ms (the full broadcast's conversion alone, 80 layers in 0.822 s).
CONVERT_SECONDS_PER_BYTE = 10.28e-3 / (9.20 * 2**30)
# Launch- and host-bound floors a layer, many senders' sender 0 (32 into 4 x EP 8), 80 GLM-5 sparse layers:
# converted and packed alone in 0.069-0.076 s; sent as deltas (conversion, comparison, packing, the read of
# their lengths) in 0.181 s (bench/RESULTS.md, the H200 at 0383511, 2026-12-05: the kept copy on the GPU,
# lr 1e-6).
CONVERT_SECONDS_PER_LAYER = 0.076 / 80
DELTA_SECONDS_PER_LAYER = 0.181 / 80
STRATEGIES = ("bf16 broadcast", "fp8 broadcast", "fp8 scatter", "fp8 many senders")
# What ``Prediction.sender_peak`` counts (every strategy alike; the terms each at its largest layer).
SENDER_PEAK_COUNTS = (
    "2 conversion slots + 2 send slots + one layer's gathered tensors; excludes the "
    "resident master shards, optimizer state, gradients and activations"
)
# Split expert stacks are gathered this many experts at a time (gather="chunked", what "auto" picks).
CHUNK_EXPERTS = 8


@dataclass(frozen=True)
class ServerLoad:
    """One server of the fleet under one strategy: its busiest rank's received bytes and its
    receiver's extra memory in one whole-model update (ring of 2 of its largest step buffers,
    checksum scratch, headers: ``TransferPlan.receiver_bytes``; None where not modelled: bf16
    broadcast, vLLM's own path)."""

    name: str
    received: int
    extra: int | None


@dataclass(frozen=True)
class Prediction:
    """One strategy: bytes of the busiest sender (out), engine rank (in) and sender (gathered
    in), the predicted seconds of a whole update, and the largest sender's peak transient bytes
    (``SENDER_PEAK_COUNTS`` says what they count); ``servers``: each server's busiest rank
    (``ServerLoad``); ``sender_bytes``: what each trainer rank sends the servers over its NIC
    (index = trainer rank; gathers not counted, they are ``gathered``); ``delta``: the same update
    sent as a delta (``predict(..., delta=)``; None for the bf16 broadcast)."""

    strategy: str
    senders: int
    sent: int
    received: int
    gathered: int
    seconds: float
    sender_peak: int
    arithmetic: str
    servers: tuple[ServerLoad, ...] = ()
    sender_bytes: tuple[int, ...] = ()
    delta: DeltaPrediction | None = None


@dataclass(frozen=True)
class DeltaPrediction:
    """One strategy's delta update (``predict(..., delta=...)``): what was asked (``delta``), the
    busiest sender's NIC bytes, the busiest engine rank's, the gathers (as dense), the predicted
    seconds and their arithmetic; ``wire_fraction``: every sender's NIC bytes over the dense
    update's; the largest sender's ``kept`` copy (on the GPU or in host memory, per
    ``delta.kept``) and its transient ``sender_peak``: the dense one (a layer sent dense still needs
    it) plus ``pack_bytes_delta``'s scratch and the delta message buffers, the kept copy not
    included; each server's busiest rank (its delta bytes and its receiver's extra memory: the
    dense receiver's and its delta buffers); each trainer rank's NIC bytes."""

    delta: Delta
    sent: int
    received: int
    gathered: int
    seconds: float
    arithmetic: str
    wire_fraction: float
    kept: int
    sender_peak: int
    servers: tuple[ServerLoad, ...] = ()
    sender_bytes: tuple[int, ...] = ()


def _whole(
    config: object,
    mode: str,
    scale_fmt: str | None,
    master_dtype: torch.dtype,
    gather_dtype: torch.dtype | None,
    fleet: Fleet,
) -> list[LayerPlan]:
    """The whole update's plans, their inputs in the dtypes they travel in (``travel_plan``), the
    DSA indexer in the form the fleet's engine ranks hold it (``update_indexer_form``)."""
    form = update_indexer_form(config, fleet.layouts())
    ids = [*model_layer_ids(config), REST]
    plans = plans_for_model(config, mode, layer_ids=ids, scale_fmt=scale_fmt, indexer_form=form)
    cache: dict[int, LayerPlan] = {}  # one object per kind, so that transfer_plan's caches still hit
    return [cache.setdefault(id(p), travel_plan(p, master_dtype, gather_dtype)) for p in plans]


def _time(
    fleet: Fleet,
    sent: int,
    gathered: int,
    received: list[int],
    fill_bytes: int,
    steps: list[float] | None = None,
) -> tuple[float, str]:
    """The busiest link's bytes over its rate (a trainer GPU's: ``sent``, ``gathered``; server k's
    GPU: ``received[k]``), times the pipeline factor, plus the fill. With one rate for every GPU
    that is the largest of the byte counts. ``steps`` (many senders): each step's own time
    (``_step_seconds``); their sum is the update's where it is longer (``_stepped``)."""
    terms = [(sent, fleet.link_bytes_per_s), (gathered, fleet.link_bytes_per_s)]
    terms += [(b, fleet.server_link_bytes_per_s(k)) for k, b in enumerate(received)]
    busiest, bw = max(terms, key=lambda x: x[0] / x[1])
    fill = CONVERT_SECONDS_PER_BYTE * fill_bytes
    whole = f"{busiest / 1e9:.1f} GB / {bw / 1e9:.1f} GB/s"
    if steps is not None and sum(steps) > busiest / bw:
        t = PIPELINE_FACTOR * sum(steps) + fill
        stepped = _stepped(steps, whole, busiest / bw)
        return t, f"{PIPELINE_FACTOR} x {stepped} + fill {fill * 1e3:.1f} ms = {t:.2f} s"
    t = PIPELINE_FACTOR * busiest / bw + fill
    return t, f"{PIPELINE_FACTOR} x {whole} + fill {fill * 1e3:.1f} ms = {t:.2f} s"


def _stepped(steps: list[float], whole: str, whole_s: float) -> str:
    return (
        f"{sum(steps):.3f} s, the sum of {len(steps)} steps' busiest links (the busiest link over the "
        f"whole update: {whole} = {whole_s:.3f} s)"
    )


def _step_seconds(fleet: Fleet, sent, received, offset: int) -> list[float]:
    """Each step's own time with many senders: its busiest link's bytes over its rate (a sender's
    out, ``sent[k][t]``; an engine rank's in, ``received[k][link rank]``, link rank ``offset + r``
    for rank r of a server's ``engine_ranges``). An update moves a step (a layer) at a time: every
    rank's vote closes a step before the next one's bytes move (``glm_fp8.transfer.sender``), so a
    sender idle in one step cannot catch up in another: the update takes the sum of its steps'
    times, not only its busiest link's bytes over the whole update."""
    rate = {
        offset + r: fleet.server_link_bytes_per_s(k)
        for k, rng in enumerate(fleet.engine_ranges())
        for r in rng
    }
    bw = fleet.link_bytes_per_s
    return [
        max(max(out, default=0) / bw, max((n / rate[r] for r, n in got.items()), default=0.0))
        for out, got in zip(sent, received)
    ]


def _loads(fleet: Fleet, extra, ranges: list[range], offset: int, received) -> list:
    """Each server's busiest rank: received bytes (``received(link rank)``) and its receiver's
    extra memory (``extra(link rank)``; None: not modelled)."""
    out = []
    for name, ranks in zip(fleet.server_names(), ranges):
        links = [offset + r for r in ranks]
        most = max(extra(r) for r in links) if extra is not None else None
        out.append(ServerLoad(name, max(received(r) for r in links), most))
    return out


def _delta_loads(fleet: Fleet, tp: TransferPlan, tr: DeltaTraffic, ranges: list[range], offset: int) -> list:
    """Each server's busiest rank in a delta update: its delta bytes and its receiver's memory."""
    extra = lambda r: delta_receiver_bytes(tp, r)
    return _loads(fleet, extra, ranges, offset, lambda r: tr.received.get(r, 0))


def _delta(
    fleet: Fleet,
    spec: Delta,
    each: tuple,
    loads: list,
    gathered: int,
    fill: int,
    share: SenderShare,
    dense_peak: int,
    dense_each: tuple,
    steps: list[float] | None = None,
) -> DeltaPrediction:
    """A strategy's ``DeltaPrediction`` from its delta bytes (``each``: every trainer rank's NIC
    bytes; ``loads``: each server's busiest rank; ``steps``, many senders: each step's own time)
    and its sender's ``share``: the busiest of its links (the dense terms), its conversion and,
    kept in host memory, its copies, as ``_time``."""
    bw = fleet.link_bytes_per_s
    gb = lambda n, rate: f"{n / 1e9:.3f} GB / {rate / 1e9:.1f} GB/s"
    terms = [(max(each) / bw, "sent " + gb(max(each), bw)), (gathered / bw, "gathered " + gb(gathered, bw))]
    for k, x in enumerate(loads):
        rate = fleet.server_link_bytes_per_s(k)
        terms.append((x.received / rate, f"received ({x.name}) " + gb(x.received, rate)))
    if steps is not None:
        link_s, link_text = max(terms, key=lambda x: x[0])
        terms.append((sum(steps), _stepped(steps, link_text, link_s)))
    terms.append((share.converted, f"conversion {share.converted * 1e3:.1f} ms"))
    if spec.kept == "host":
        host = HOST_COPY_BYTES_PER_S
        terms.append((share.kept / host, "host copy read in place " + gb(share.kept, host)))
    busiest, text = max(terms, key=lambda x: x[0])
    fill_s = CONVERT_SECONDS_PER_BYTE * fill
    t = PIPELINE_FACTOR * busiest + fill_s
    text = f"{PIPELINE_FACTOR} x {text} + fill {fill_s * 1e3:.1f} ms = {t:.3f} s"
    return DeltaPrediction(
        spec,
        max(each),
        max(x.received for x in loads),
        gathered,
        t,
        text,
        sum(each) / sum(dense_each),
        share.kept,
        dense_peak + share.scratch + share.buffers,
        tuple(loads),
        tuple(each),
    )


def predict(
    config: object,
    fleet: Fleet,
    *,
    scale_fmt: str | None = None,
    transfer: TransferPlan | None = None,
    master_dtype: torch.dtype = torch.float32,
    gather_dtype: torch.dtype | None = None,
    delta: Delta | float | None = None,
) -> list[Prediction]:
    """The four strategies of ``STRATEGIES`` for a whole-model update of ``config`` into
    ``fleet`` (see the module docstring for the model); ``transfer``: the fleet's
    ``many_senders_plan`` (built with the same dtypes) when the caller has it already. The
    trainer holds ``master_dtype`` masters and gathers them in it, or in ``gather_dtype`` when
    given (the library's opt-in cast). ``delta``: also predict a delta update of each fp8
    strategy (``Prediction.delta``; a number is ``Delta(fraction)``). Raises ValueError where
    vLLM would refuse a server's layout or for a bad ``delta``. ``config``: anything
    ``glm_fp8.model.config.as_config`` takes."""
    config = as_config(config)
    spec = as_delta(delta)
    if spec is not None and fleet.trainer is not None and fleet.trainer.step_layers > 1:
        raise ValueError(
            f"delta: a delta update carries one layer a step; the trainer {fleet.trainer.describe()} "
            "plans steps of several"
        )
    per_byte, per_layer = CONVERT_SECONDS_PER_BYTE, DELTA_SECONDS_PER_LAYER
    shares = lambda tp, t, parts: sender_share(tp, t, parts, spec, per_byte, per_layer)  # noqa: E731
    t_gpus = fleet.trainer_gpus
    gather = lambda n: n * (t_gpus - 1) // t_gpus  # noqa: E731 - the part of n held by other ranks
    ids = [*model_layer_ids(config), REST]
    out = []
    one_sender = lambda n: (n,) + (0,) * (t_gpus - 1)  # noqa: E731 - trainer rank 0 sends, the others gather

    # One sender converts everything after gathering it and broadcasts each layer once to every
    # rank of every server. fp8 with whole experts: each rank quantizes its experts and only fp8
    # travels to the sender (gather="quantize_then_gather", what "auto" picks).
    for strategy, mode in (("bf16 broadcast", "bf16"), ("fp8 broadcast", "fp8")):
        plans = _whole(config, mode, scale_fmt, master_dtype, gather_dtype, fleet)
        total = sum(p.nbytes for p in plans)
        gathered = gather(_sender_inputs(plans, mode == "fp8" and fleet.experts_whole))
        biggest = max(plans, key=lambda p: p.nbytes)
        held = max(_held_gathered(p, mode == "fp8", fleet.experts_whole, t_gpus) for p in plans)
        peak = held + 2 * biggest.nbytes  # ring of 2 conversion slots, sent from them (direct)
        # an engine rank's receiver: every rank alike (one FULL rank stands for all)
        full = transfer_plan(config, plans, ids, [None, FULL], [0]) if mode == "fp8" else None
        rx = full and full.receiver_bytes
        loads = _loads(fleet, rx, [range(1)] * len(fleet.servers), 1, {1: total}.get)
        t, text = _time(
            fleet, total, gathered, [total] * len(fleet.servers), biggest.nbytes if mode == "fp8" else 0
        )
        dp = None  # with a delta, every rank gets the whole layer's
        if spec is not None and full is not None:
            whole = round(sum(plan_bytes(p, spec) for p in plans))
            rx_delta = delta_receiver_bytes(full, 1)
            dloads = [ServerLoad(x.name, whole, rx_delta) for x in loads]
            dp = _delta(
                fleet,
                spec,
                one_sender(whole),
                dloads,
                gathered,
                biggest.nbytes,
                shares(full, 0, plans),
                peak,
                one_sender(total),
            )
        one = (total, total, gathered, t, peak, text, tuple(loads), one_sender(total), dp)
        out.append(Prediction(strategy, 1, *one))

    # Scatter: one sender, every distinct region once per layer. Ranks of any server (replicas,
    # DP ranks, another server's ranks) that hold the same region form one class and share one
    # broadcast, so one replica of each server stands for all (glm_fp8.transfer.routes).
    plans = _whole(config, "fp8", scale_fmt, master_dtype, gather_dtype, fleet)
    scatter = transfer_plan(config, plans, ids, [None, *fleet.layouts()], [0])
    per_rank = _class_bytes(scatter)
    layer_regions = [lay.wire_nbytes for lay in scatter.layers]
    sent = sum(layer_regions)
    loads = _loads(fleet, scatter.receiver_bytes, fleet.distinct_ranges(), 1, per_rank.__getitem__)
    biggest = max(range(len(plans)), key=lambda k: plans[k].nbytes)
    gathered = gather(_sender_inputs(plans, fleet.experts_whole))
    t, text = _time(fleet, sent, gathered, [x.received for x in loads], plans[biggest].nbytes)
    held = max(_held_gathered(p, True, fleet.experts_whole, t_gpus) for p in plans)
    peak = held + 2 * plans[biggest].nbytes + 2 * max(layer_regions)  # + ring of 2 send slots
    received = max(x.received for x in loads)
    dp = None
    if spec is not None:
        tr = traffic(scatter, plans, spec)
        dloads = _delta_loads(fleet, scatter, tr, fleet.distinct_ranges(), 1)
        dp = _delta(
            fleet,
            spec,
            one_sender(tr.sent[0]),
            dloads,
            gathered,
            plans[biggest].nbytes,
            shares(scatter, 0, plans),
            peak,
            one_sender(sent),
        )
    one = (sent, received, gathered, t, peak, text, tuple(loads), one_sender(sent), dp)
    out.append(Prediction("fp8 scatter", 1, *one))

    # Many senders (glm_fp8.transfer.routes, only with whole experts): each trainer rank quantizes
    # its own experts (no gather) and sends every engine rank of every server its part of them;
    # each other entry is gathered on, converted and sent by one owner. The transfer plan gives
    # every byte: what each sender sends, what an engine rank receives, what an owner gathers
    # (the part other ranks hold), the largest conversion (the pipeline's fill).
    if fleet.experts_whole:
        tp = transfer or many_senders_plan(config, fleet, scale_fmt=scale_fmt, plans=plans)
        # sender_peak: 2 x (conversion slot + send slot) + one layer's owned tensors, gathered
        n_send = len(tp.senders)  # every trainer GPU, or a Megatron trainer's senders
        # an owner gathers what the other ranks hold: the other FSDP shards, or the other TP ranks'
        held_by = fleet.trainer.tp if fleet.trainer is not None else t_gpus
        owned = lambda n: n * (held_by - 1) // held_by  # noqa: E731
        # Megatron's expert tensor parallelism: each expert's rows are gathered onto its ETP group's
        # first rank, which holds 1/ETP of them (the gather is timed at the link's rate, as the others)
        etp = fleet.trainer.etp if fleet.trainer is not None else 1
        experts = lambda s: _inputs([lay.local_plans[s] for lay in tp.layers], experts=True)  # noqa: E731
        etp_gathered = lambda s: experts(s) * (etp - 1) // etp if etp > 1 else 0  # noqa: E731
        each = tp.sent_bytes()
        got = tp.received_bytes()
        loads = _loads(fleet, tp.receiver_bytes, fleet.engine_ranges(), n_send, got.__getitem__)
        gathered = max(owned(sum(tp.gathered_bytes(s))) + etp_gathered(s) for s in range(n_send))
        fill = max(tp.sender_buffers(s)[0] for s in range(n_send))
        steps = _step_seconds(fleet, tp.steps_sent(), tp.steps_received(), n_send)
        t, text = _time(fleet, max(each), gathered, [x.received for x in loads], fill, steps)
        peak = max(tp.sender_peak(s) for s in range(n_send))
        received = max(x.received for x in loads)
        dp = None
        if spec is not None:
            tr = traffic(tp, plans, spec)
            dloads = _delta_loads(fleet, tp, tr, fleet.engine_ranges(), n_send)
            per = [shares(tp, s, [lay.local_plans[s] for lay in tp.layers]) for s in range(n_send)]
            share = SenderShare(*(max(getattr(x, f) for x in per) for f in SenderShare.__dataclass_fields__))
            dsteps = _step_seconds(fleet, tr.steps_sent, tr.steps_received, n_send)
            dp = _delta(fleet, spec, tr.sent, dloads, gathered, fill, share, peak, tuple(each), dsteps)
        out.append(
            Prediction(
                "fp8 many senders",
                n_send,
                max(each),
                received,
                gathered,
                t,
                peak,
                text,
                tuple(loads),
                tuple(each),
                dp,
            )
        )
    return out


def _class_bytes(tp: TransferPlan) -> dict[int, int]:
    """Bytes each engine rank (link rank) receives in a whole update: its class's segments, each
    counted as sent (a region and its checksum word, without the receive buffer's alignment)."""
    out: dict[int, int] = {}
    for lay in tp.layers:
        for k, ranks in enumerate(lay.classes):
            n = sum(s.nbytes for s in lay.of_class(k))
            for r in ranks:
                out[r] = out.get(r, 0) + n
    return out


def many_senders_plan(
    config: object,
    fleet: Fleet,
    *,
    scale_fmt: str | None = None,
    plans: list[LayerPlan] | None = None,
    master_dtype: torch.dtype = torch.float32,
    gather_dtype: torch.dtype | None = None,
) -> TransferPlan:
    """The transfer plan of a whole-model update into ``fleet`` from its trainer GPUs (link ranks
    0..T-1, then every server's ranks: server by server, replica by replica); ``plans``: the
    update's fp8 plans, if built already (else built with their inputs in the dtypes they travel
    in: ``predict``). A Megatron trainer (``fleet.trainer``): its senders only (link ranks 0..S-1),
    each stage's holding its layers (``MegatronTrainer.holders``)."""
    config = as_config(config)
    ids = [*model_layer_ids(config), REST]
    plans = plans or _whole(config, "fp8", scale_fmt, master_dtype, gather_dtype, fleet)
    if fleet.trainer is not None:  # Megatron: each stage's senders hold its layers
        trainer, n = fleet.trainer, fleet.trainer.senders
        engines = [None] * n + fleet.engine_layouts()
        order = trainer.update_order(config, ids)  # one layer of each stage in turn, in steps of several
        plans = [plans[ids.index(i)] for i in order]
        return transfer_plan(
            config,
            plans,
            order,
            engines,
            range(n),
            holders=trainer.holders(config, order),
            step_layers=trainer.step_layers,
        )
    engines = [None] * fleet.trainer_gpus + fleet.engine_layouts()
    return transfer_plan(config, plans, ids, engines, range(fleet.trainer_gpus))


def _inputs(plans: list[LayerPlan], experts: bool | None = None) -> int:
    """Bytes of the trainer tensors of ``plans`` in their planned (travel) dtypes: all, only the
    routed experts' (True) or all but theirs (False)."""
    return sum(
        (dtype or torch.bfloat16).itemsize * math.prod(shape)
        for p in plans
        for name, (shape, dtype) in p.inputs.items()
        if experts is None or name.startswith("mlp.experts.") == experts
    )


def _sender_inputs(plans: list[LayerPlan], fp8_experts: bool) -> int:
    """Bytes one sender collects for ``plans``: the inputs, or for the routed experts their fp8
    bytes and scales when every rank quantizes its own (``fp8_experts``)."""
    if not fp8_experts:
        return _inputs(plans)
    fp8 = sum(e.nbytes for p in plans for e in p.entries if e.name.startswith("mlp.experts."))
    return _inputs(plans, experts=False) + fp8


def _held_gathered(plan: LayerPlan, fp8: bool, experts_whole: bool, trainer_gpus: int) -> int:
    """What one sender holds gathered of one layer at once, besides its conversion buffer: every
    tensor but the expert stacks, and of those nothing when each rank quantizes its own experts
    into the sender's buffer (fp8, whole experts), else ``CHUNK_EXPERTS`` experts of the largest
    stack's sources (gather="chunked"); bf16 mode gathers the whole layer (gather="full"). A
    single trainer rank gathers nothing: it converts its tensors where they lie."""
    if trainer_gpus == 1:
        return 0  # one rank holds every tensor whole: converted where it lies, nothing gathered
    if not fp8:
        return _inputs([plan])
    rest = _inputs([plan], experts=False)
    stacks = [e for e in stack_entries(plan) if e.op == "quantize"]
    if experts_whole or not stacks:
        return rest
    chunk = max(
        sum((plan.inputs[s][1] or torch.bfloat16).itemsize * math.prod(plan.inputs[s][0]) for s in e.sources)
        * min(CHUNK_EXPERTS, e.shape[0])
        // e.shape[0]
        for e in stacks
    )
    return rest + chunk


def predictions_json(preds: list[Prediction]) -> list[dict]:
    return [asdict(p) for p in preds]


__all__ = [
    "CHUNK_EXPERTS",
    "CONVERT_SECONDS_PER_BYTE",
    "CONVERT_SECONDS_PER_LAYER",
    "DELTA_SECONDS_PER_LAYER",
    "PIPELINE_FACTOR",
    "SENDER_PEAK_COUNTS",
    "STRATEGIES",
    "DeltaPrediction",
    "Prediction",
    "ServerLoad",
    "many_senders_plan",
    "predict",
    "predictions_json",
]

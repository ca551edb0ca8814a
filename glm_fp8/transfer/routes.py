"""The transfer plan (docs/layouts.md#the-transfer-plan): which trainer rank sends which bytes of
each layer of an update to which engine ranks. Every mode is one such plan:

- **full broadcast**: one sender; every engine rank is ``FULL`` (it receives every entry whole,
  as ``glm_fp8.kernels.convert`` lays the layer out) and they form one class;
- **scatter**: one sender; each engine rank gives its ``EngineLayout`` and receives only its
  shard; each distinct piece (an entry's cut) goes once to the ranks that hold it, the pieces of
  one holder set as one segment (``glm_fp8.transfer.pack.piece_classes``);
- **many senders**: every trainer rank sends its own share: its rows of the expert stacks and of
  the largest matrices, and the other entries it owns (``glm_fp8.transfer.owners``); ranks whose
  whole region is equal form a class.

Per layer, each sender sends each class at most one **segment**: the pieces it has of the
class's pack, one after another at multiples of 256 bytes, then a checksum word. It goes as one
broadcast in its ``group`` (its sender's and its class's link ranks), else point to point to each
rank of its class (``glm_fp8.transfer.topology`` chooses: one sender, a group per class of several
ranks where the link makes groups; many senders, a group per (sender, class) only where the
senders' NICs bound the update, ``sender_groups_pay``). A segment whose bytes are its sender's
conversion buffer as that sender's plan lays it out is **direct**: sent from the conversion
buffer, never packed. One sender: its whole converted layer (the full broadcast); many senders: a
sender's largest segment when each of its pieces is an entry it converts whole, which its plan
lays out last (``_largest_whole``, ``_converted_in_place``). An engine rank may be in several
classes: its layer buffer holds the segments of its classes side by side, in class order then
sender order (``LayerRoutes.of_rank``); a sender's send buffer holds its packed segments side by
side, in class order (the broadcast classes first). The plan is computed once per update configuration,
identically on every rank, and agreed on at the manifest vote.

**Steps.** An update moves one step at a time: by default one layer a step. With
``step_layers`` > 1, consecutive layers whose holders are disjoint (a pipeline-parallel trainer's
stages, handed over in turn: ``MegatronSource.stage_layer_ids``) share a step, up to that many, so
that every stage's senders send at once (``TransferPlan.steps``). A rank's ring slot then holds
its buffers of every layer of the step side by side, in layer order (``receive_base``,
``sender_bases``).

**Order**, so that no rank waits on a group whose other members wait elsewhere: per step, every
rank posts its group broadcasts first (layer by layer), then one exchange of its point-to-point
segments of every layer of the step. A sender
posts its segments in class order; an engine rank its classes in order and, within a class, the
senders in order. So every rank's group broadcasts follow one total order, (layer, class,
sender), each group broadcast at one place in it: the earliest one not done always has all its
members at it. An exchange follows every group broadcast of its step on every rank.

Several servers on one link (``engines`` lists every server's ranks): the full broadcast is one
broadcast of each layer on the link; scatter sends each distinct piece once per holder set, so
what ranks of several servers hold alike travels once; many senders send a segment once per rank
of its class, or once to the ranks of several servers that hold the same region where groups pay.
A sender converts each layer once (its share, with many senders), however many servers there are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.kernels.checksum import checksum_rows
from glm_fp8.model.layer_plan import LayerPlan, align
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.owners import Holders, Owner, converters, divide, sender_pieces, sender_plan
from glm_fp8.transfer.pack import FULL, ShardPack, check_engines, layer_scatter, layout_words
from glm_fp8.transfer.topology import class_groups, sender_groups_pay
from glm_fp8.transfer.wire import CHECKSUM_BYTES


@dataclass(frozen=True)
class Segment(ShardPack):
    """What sender ``sender`` (its index in the senders) sends every rank of class ``cls`` for one
    layer: a ``ShardPack`` of the pieces it has of the class's region (a split entry's pieces name
    their ``rows``), then the checksum word. It lies at ``send_offset`` in the sender's send
    buffer (``direct``: in its conversion buffer, at ``conv_offset``) and at ``recv_offset`` in each
    receiving rank's layer buffer (``LayerRoutes.of_rank``: where a rank in several classes puts it). It
    travels as one broadcast in ``group`` (sorted link ranks: its sender's and its class's, or
    every rank of the link), or, ``group`` None, point to point to each rank of its class."""

    sender: int = 0
    cls: int = 0
    send_offset: int = 0
    recv_offset: int = 0
    direct: bool = False
    group: tuple[int, ...] | None = None
    conv_offset: int = 0  # where a direct segment lies in its sender's conversion buffer

    def source(self, conv: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Its ``nbytes`` where its sender holds them: in the conversion buffer ``conv`` (direct),
        else in the send buffer ``out`` (packed); each the sender's buffer of this layer."""
        if self.direct:
            return conv[self.conv_offset : self.conv_offset + self.nbytes]
        return out[self.send_offset : self.send_offset + self.nbytes]


@dataclass(frozen=True)
class LayerRoutes:
    """One layer's routes: ``classes`` (link ranks that receive the same bytes; a rank may be in
    several), ``segments`` (by class, then sender; how each travels: ``Segment.group``), ``splits``
    (each split entry, by prefixed name: every sender's rows), ``owners`` (every other entry: the
    sender, or per class the senders, that gather, convert and send it: ``owners.Owner``),
    ``local_plans`` (per sender: the part of the
    layer it converts, possibly nothing), the bytes of each sender's send buffer and of each
    class's segments side by side (``recv_nbytes``; a rank's buffer holds those of all its
    classes: ``rank_nbytes``); ``last`` (per sender, the entries its local plan lays out last,
    short names: ``owners.sender_plan`` lays a sender's converted share out alike from them)."""

    layer_idx: int
    classes: tuple[tuple[int, ...], ...]
    segments: tuple[Segment, ...]
    splits: dict[str, tuple[tuple[int, int], ...]]
    owners: dict[str, Owner]
    local_plans: tuple[LayerPlan, ...]
    send_nbytes: tuple[int, ...]
    recv_nbytes: tuple[int, ...]
    last: tuple[frozenset[str], ...]

    def of_sender(self, t: int) -> list[Segment]:
        return [s for s in self.segments if s.sender == t]

    def of_class(self, k: int) -> list[Segment]:
        return [s for s in self.segments if s.cls == k]

    def of_rank(self, rank: int) -> list[Segment]:
        """The segments link rank ``rank`` receives, in the order it receives them (its classes in
        order, each class's segments in sender order), ``recv_offset`` set to where each lies in
        its layer buffer."""
        out, base = [], 0
        for k, ranks in enumerate(self.classes):
            if rank in ranks:
                out += [dataclasses.replace(s, recv_offset=base + s.recv_offset) for s in self.of_class(k)]
                base += self.recv_nbytes[k]
        return out

    def rank_nbytes(self, rank: int) -> int:
        """Engine rank ``rank``'s layer buffer: its classes' segments side by side."""
        return sum(n for ranks, n in zip(self.classes, self.recv_nbytes) if rank in ranks)

    def starts(self, t: int) -> dict[str, int]:
        """Where sender ``t``'s rows of each split entry begin (``ShardPack.pack_into``)."""
        return {name: bounds[t][0] for name, bounds in self.splits.items()}

    def messages(self, s: Segment) -> int:
        """The messages segment ``s`` takes: one group broadcast, else one per rank of its class."""
        return 1 if s.group is not None else len(self.classes[s.cls])

    def sent_nbytes(self, t: int) -> int:
        """Bytes sender ``t`` puts on the link for this layer: a point-to-point segment once per
        rank of its class, a group broadcast once."""
        return sum(s.nbytes * self.messages(s) for s in self.of_sender(t))

    def delivered_nbytes(self, t: int) -> int:
        """Bytes of sender ``t``'s segments that engine ranks receive for this layer: each segment
        once per receiving rank, a group broadcast's too (what the receivers' NICs take in)."""
        return sum(s.nbytes * len(self.classes[s.cls]) for s in self.of_sender(t))

    @property
    def wire_nbytes(self) -> int:
        """Every segment once: the layer's distinct bytes on the wire (its header's count)."""
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class TransferPlan:
    """Routes of one update: ``senders`` (link ranks, in expert-chunk order), ``engines`` (one entry
    per link rank: None at a sender, an ``EngineLayout`` or ``FULL``), each sender's routed-expert
    ``bounds`` (in the layers it holds), every layer's routes (in the update's order) and who holds
    each layer (``holders``, per layer; empty: every sender holds every layer) and the update's
    ``steps``: the layers (positions in the update) each step carries, in order (empty: one layer a
    step)."""

    senders: tuple[int, ...]
    engines: tuple[EngineLayout | str | None, ...]
    bounds: tuple[tuple[int, int], ...]
    layers: tuple[LayerRoutes, ...]
    holders: tuple[Holders, ...] = ()
    steps: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not self.steps:
            object.__setattr__(self, "steps", tuple((pos,) for pos in range(len(self.layers))))

    def subset(self, positions: Sequence[int]) -> TransferPlan:
        """The routes of the layers at ``positions`` only (e.g. one vLLM session's), each step
        keeping those of its layers."""
        keep = sorted(positions)
        new = {p: k for k, p in enumerate(keep)}
        steps = (tuple(new[p] for p in step if p in new) for step in self.steps)
        return dataclasses.replace(
            self,
            layers=tuple(self.layers[p] for p in keep),
            holders=tuple(self.holders[p] for p in keep) if self.holders else (),
            steps=tuple(step for step in steps if step),
        )

    @functools.cached_property
    def _step_table(self) -> tuple[int, ...]:
        # per layer position its step, built once: ``step_of`` runs per layer on the hot path
        table = [0] * len(self.layers)
        for g, step in enumerate(self.steps):
            for pos in step:
                table[pos] = g
        return tuple(table)

    def step_of(self, pos: int) -> int:
        """The step that carries the layer at ``pos``."""
        return self._step_table[pos]

    def class_of(self, pos: int, rank: int) -> int:
        """The first class of ``rank`` in the layer at ``pos`` (its only one with many senders)."""
        return next(k for k, ranks in enumerate(self.layers[pos].classes) if rank in ranks)

    def groups(self) -> list[tuple[int, ...]]:
        """The groups of link ranks the update needs, in a fixed order: every group broadcast's (by
        layer, class, sender), then the senders' own (their vote before gathers, with several)."""
        out = list(dict.fromkeys(s.group for lay in self.layers for s in lay.segments if s.group is not None))
        if len(self.senders) > 1:
            out.append(tuple(sorted(self.senders)))
        return out

    def sent_bytes(self) -> list[int]:
        """Bytes each sender sends in a whole update (a point-to-point segment once per rank of its
        class, a group broadcast once)."""
        return [sum(per_sender) for per_sender in zip(*self.steps_sent())] or [0] * len(self.senders)

    def received_bytes(self) -> dict[int, int]:
        """Bytes each engine rank (link rank) receives in a whole update."""
        out: dict[int, int] = {}
        for step in self.steps_received():
            for r, n in step.items():
                out[r] = out.get(r, 0) + n
        return out

    def steps_sent(self) -> list[list[int]]:
        """Per step (in update order), the bytes each sender sends (as ``sent_bytes``)."""
        out = []
        for positions in self.steps:
            step = [0] * len(self.senders)
            for lay in (self.layers[p] for p in positions):  # one pass: thousands of segments a layer
                for s in lay.segments:
                    step[s.sender] += s.nbytes * lay.messages(s)
            out.append(step)
        return out

    def steps_received(self) -> list[dict[int, int]]:
        """Per step (in update order), the bytes each engine rank (link rank) receives."""
        out = []
        for positions in self.steps:
            step: dict[int, int] = {}
            for lay in (self.layers[p] for p in positions):
                for k, ranks in enumerate(lay.classes):
                    for r in ranks:
                        step[r] = step.get(r, 0) + lay.recv_nbytes[k]
            out.append(step)
        return out

    def receive_base(self, rank: int, pos: int) -> int:
        """Where engine rank ``rank``'s buffer of the layer at ``pos`` starts in its ring slot: after
        its buffers of the step's earlier layers."""
        step = self.steps[self.step_of(pos)]
        return sum(align(self.layers[p].rank_nbytes(rank)) for p in step[: step.index(pos)])

    def receive_slot(self, rank: int) -> int:
        """The largest step buffer engine rank ``rank`` receives (its buffers of a step's layers side
        by side): one ring slot."""
        return max(
            (side_by_side([self.layers[p].rank_nbytes(rank) for p in step]) for step in self.steps), default=0
        )

    def receiver_bytes(self, rank: int, ring: int = 2, device: str = "cuda") -> int:
        """Engine rank ``rank``'s memory above its parameters during an update (what ``Receiver``
        allocates): ``ring`` slots of its largest step buffer, the checksum's scratch (a word per
        32 KiB on CUDA), every step's header and the vote words."""
        slot = self.receive_slot(rank)
        scratch = 8 * (checksum_rows(slot) if device == "cuda" else 1)
        return ring * slot + scratch + 64 * (len(self.layers) + 3) + 8 * 3

    def sender_bases(self, t: int, pos: int) -> tuple[int, int]:
        """Where sender ``t``'s conversion and send buffers of the layer at ``pos`` start in its ring
        slots: after its buffers of the step's earlier layers."""
        step = self.steps[self.step_of(pos)]
        before = [self.layers[p] for p in step[: step.index(pos)]]
        return (
            sum(align(lay.local_plans[t].nbytes + CHECKSUM_BYTES) for lay in before),
            sum(align(lay.send_nbytes[t]) for lay in before),
        )

    def sender_buffers(self, t: int) -> tuple[int, int]:
        """(conversion slot, send slot) of sender ``t``: its largest converted share of a step (with
        room for a direct segment's checksum word) and its largest packed segments of a step; one
        ring slot each."""
        conv = send = 0
        for step in self.steps:
            lays = [self.layers[p] for p in step]
            conv = max(conv, side_by_side([lay.local_plans[t].nbytes + CHECKSUM_BYTES for lay in lays]))
            send = max(send, side_by_side([lay.send_nbytes[t] for lay in lays]))
        return conv, send

    def gathered_bytes(self, t: int) -> list[int]:
        """Per layer, the trainer tensors sender ``t`` gathers (the sources of the entries it
        owns there, whole, in their planned dtypes: ``glm_fp8.planning.update_time`` plans them in the dtype
        they travel in, an input with none is counted as bf16); it holds one layer's at a time."""
        out = []
        for lay in self.layers:
            plan = lay.local_plans[t]
            own = {name for name in lay.owners if t in converters(lay.owners, name)}
            prefix = layer_prefix(lay.layer_idx)
            srcs = {s for e in plan.entries if prefix + e.name in own for s in e.sources}
            out.append(
                sum((plan.inputs[s][1] or torch.bfloat16).itemsize * _numel(plan.inputs[s][0]) for s in srcs)
            )
        return out

    def sender_peak(self, t: int, ring: int = 2) -> int:
        """Sender ``t``'s transient bytes above its resident shards: ``ring`` slots of its
        conversion and send buffers, and one layer's gathered tensors."""
        local, send = self.sender_buffers(t)
        return ring * (local + send) + max(self.gathered_bytes(t), default=0)

    def messages_per_layer(self) -> int:
        """The most messages one layer takes (a group broadcast is one)."""
        return max(sum(lay.messages(s) for s in lay.segments) for lay in self.layers)

    def manifest(self) -> dict:
        return {
            "senders": list(self.senders),
            "engines": [lay if lay in (None, FULL) else layout_words(lay) for lay in self.engines],
            "bounds": [list(b) for b in self.bounds],
            "holders": [
                h
                if h is None
                else list(h)
                if isinstance(h, tuple)
                else [[k, list(v)] for k, v in sorted(h.items())]
                for h in self.holders
            ],
            "layers": [
                [
                    [s.sender, list(lay.classes[s.cls]), s.nbytes, s.group and list(s.group), s.direct]
                    for s in lay.segments
                ]
                for lay in self.layers
            ],
            "steps": [list(step) for step in self.steps],
        }


def stage_order(layer_ids: Sequence[int], stage_of: Mapping[int, int]) -> list[int]:
    """``layer_ids`` one of each pipeline stage in turn (``stage_of``: layer to stage): each stage's
    first layer in stage order, then each one's second, and so on; a layer ``stage_of`` does not
    name (the non-layer tensors) keeps its place at the end. The order in which steps of several
    layers (``step_layers``) carry one layer of each stage."""
    stages: dict[int, list[int]] = {}
    for i in layer_ids:
        if i in stage_of:
            stages.setdefault(stage_of[i], []).append(i)
    lists = [stages[p] for p in sorted(stages)]
    order = [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
    return order + [i for i in layer_ids if i not in stage_of]


def side_by_side(sizes: Sequence[int]) -> int:
    """The bytes of buffers of ``sizes`` laid side by side, each at a multiple of 256 bytes."""
    return sum(align(n) for n in sizes[:-1]) + (sizes[-1] if sizes else 0)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def transfer_plan(
    config: Mapping | None,
    plans: Sequence[LayerPlan],
    layer_ids: Sequence[int],
    engines: Sequence[EngineLayout | str | None],
    senders: Sequence[int],
    *,
    groups: bool = True,
    holders: Sequence[Holders] | None = None,
    step_layers: int = 1,
) -> TransferPlan:
    """The routes of an update of ``layer_ids`` (``plans[k]`` the plan of ``layer_ids[k]``) from
    ``senders`` (link ranks) into ``engines`` (one entry per link rank, see
    ``glm_fp8.transfer.pack.check_engines``; ``config`` is needed when some are ``EngineLayout``).
    ``groups``: the link can make groups, so a single sender broadcasts once to a class of several
    ranks, and many senders each once to each such class where ``sender_groups_pay`` says so.
    ``holders``: per layer, the senders (indices) that hold it (``glm_fp8.transfer.owners.Holders``:
    pipeline stages); default every sender every layer. ``step_layers``: the most layers a step
    carries (``plan_steps``). Raises ValueError for a plan the senders cannot carry out, or where
    vLLM would refuse an engine layout."""
    senders, engines = tuple(int(s) for s in senders), tuple(engines)
    check_engines(engines, senders)
    n = len(senders)
    if n > 1 and (config is None or any(p.target != "hopper" for p in plans)):
        raise ValueError(
            "senders: many senders need config= and Hopper plans (float32 scales, split by expert rows)"
        )
    if config is None and any(isinstance(lay, EngineLayout) for lay in engines):
        raise ValueError("engines: engine layouts need config= (vLLM's sharding rules read it)")
    scatters, cache = [], {}
    for plan, layer_idx in zip(plans, layer_ids):
        if id(plan) not in cache:
            cache[id(plan)] = (layer_idx, layer_scatter(plan, layer_idx, config, engines, groups=groups))
        first, scatter = cache[id(plan)]
        scatters.append(_renamed(scatter, layer_prefix(first), layer_prefix(layer_idx)))
    if holders is not None and n == 1:
        raise ValueError("holders: one sender holds every layer; holders are for many senders")
    bounds, splits, owners = divide(plans, layer_ids, scatters, n, holders)
    local_cache: dict[tuple, LayerPlan] = {}
    layers = []
    for pos, (plan, layer_idx) in enumerate(zip(plans, layer_ids)):
        scatter, split, prefix = scatters[pos], splits[pos], layer_prefix(layer_idx)
        # many senders: point to point here, then ``_sender_groups``
        cls_groups = class_groups(senders[0], scatter.classes, len(engines), groups) if n == 1 else None
        segments, recv_nbytes = [], []
        for k, pack in enumerate(scatter.packs):
            recv = 0
            for t in range(n):
                if n == 1:
                    pieces, off = list(pack.pieces), pack.data_nbytes
                else:
                    pieces, off = sender_pieces(pack, split, owners[pos], t, k)
                if pieces:
                    direct = n == 1 and _is_plan_layout(pack, plan)
                    segments.append(
                        Segment(
                            tuple(pieces),
                            off + CHECKSUM_BYTES,
                            sender=t,
                            cls=k,
                            recv_offset=recv,
                            direct=direct,
                            group=cls_groups and cls_groups[k],
                        )
                    )
                    recv = align(recv + off + CHECKSUM_BYTES)
            recv_nbytes.append(recv)
        local_plans = []
        by_sender: dict[int, list[Segment]] = {}
        for s in segments:
            by_sender.setdefault(s.sender, []).append(s)
        lasts = [_largest_whole(by_sender.get(t, []), prefix) if n > 1 else frozenset() for t in range(n)]
        for t in range(n):  # cached: a layer's plan and a sender's rows and entries repeat
            key = (
                id(plan),
                tuple(b[t] for b in split.values()),
                frozenset(name[len(prefix) :] for name in owners[pos] if t in converters(owners[pos], name)),
                lasts[t],
            )
            if key not in local_cache:
                local_cache[key] = sender_plan(plan, prefix, split, owners[pos], t, lasts[t])
            local_plans.append(local_cache[key])
        if n > 1:
            segments = _converted_in_place(segments, local_plans, prefix)
        send_nbytes = [0] * n
        placed = []
        for s in segments:  # class order within each sender
            if s.direct:
                placed.append(s)
                continue
            placed.append(dataclasses.replace(s, send_offset=send_nbytes[s.sender]))
            send_nbytes[s.sender] = align(send_nbytes[s.sender] + s.nbytes)
        layers.append(
            LayerRoutes(
                layer_idx,
                scatter.classes,
                tuple(placed),
                split,
                owners[pos],
                tuple(local_plans),
                tuple(send_nbytes),
                tuple(recv_nbytes),
                tuple(lasts),
            )
        )
    steps = plan_steps(holders, len(layers), n, step_layers)
    tp = TransferPlan(senders, engines, bounds, tuple(layers), tuple(holders or ()), steps)
    return _sender_groups(tp) if n > 1 and groups else tp


def plan_steps(
    holders: Sequence[Holders] | None, n_layers: int, n_senders: int, step_layers: int
) -> tuple[tuple[int, ...], ...]:
    """The steps of an update of ``n_layers`` layers: consecutive layers, at most ``step_layers`` a
    step, held by disjoint senders (``holders``; a layer with none named is every sender's). Each
    sender then converts at most one layer of a step, and senders of different pipeline stages
    send at once; a layer that shares a holder with the step so far starts the next step."""
    steps: list[tuple[int, ...]] = []
    step: list[int] = []
    busy: set[int] = set()
    for pos in range(n_layers):
        held = holders[pos] if holders else None
        mine = (
            set(range(n_senders))
            if held is None
            else {t for ts in held.values() for t in ts}
            if isinstance(held, Mapping)
            else set(held)
        )
        if step and (len(step) == step_layers or mine & busy):
            steps.append(tuple(step))
            step, busy = [], set()
        step.append(pos)
        busy |= mine
    if step:
        steps.append(tuple(step))
    return tuple(steps)


def _sender_groups(tp: TransferPlan) -> TransferPlan:
    """``tp`` (many senders, every segment point to point) with a group broadcast per (sender,
    class of several ranks), where ``sender_groups_pay`` says so."""
    once = [0] * len(tp.senders)
    for lay in tp.layers:
        for s in lay.segments:
            once[s.sender] += s.nbytes

    def grouped(lay: LayerRoutes, s: Segment) -> Segment:
        group = tuple(sorted((tp.senders[s.sender], *lay.classes[s.cls])))
        return dataclasses.replace(s, group=group) if len(group) > 2 else s  # a class of several ranks

    layers = [
        dataclasses.replace(lay, segments=tuple(grouped(lay, s) for s in lay.segments)) for lay in tp.layers
    ]
    made = {s.group for lay in layers for s in lay.segments if s.group is not None}
    if not sender_groups_pay(tp.sent_bytes(), once, tp.received_bytes().values(), made):
        return tp
    return dataclasses.replace(tp, layers=tuple(layers))


def _converted_in_place(
    segments: Sequence[Segment], local_plans: Sequence[LayerPlan], prefix: str
) -> list[Segment]:
    """Many senders: a sender's first segment whose bytes lie in its conversion buffer as its own
    plan lays them out (``_converted_at``: an EP rank's experts, with the entries the sender owns
    for that rank) is direct, sent from there and never packed, like the full broadcast's: no
    device copy of it, no room for it in the send buffer."""
    out, done = [], set()
    for seg in segments:
        at = None if seg.sender in done else _converted_at(seg, local_plans[seg.sender], prefix)
        if at is not None:
            seg = dataclasses.replace(seg, direct=True, conv_offset=at)
            done.add(seg.sender)
        out.append(seg)
    return out


def _largest_whole(mine: Sequence[Segment], prefix: str) -> frozenset[str]:
    """The entries (short names) of the largest of a sender's segments ``mine``, when each of its
    pieces is an entry the sender converts whole (replicated, or its own rows of a split entry):
    its conversion buffer lays them out last, so that the segment can leave from there
    (``_converted_at``)."""
    if not mine:
        return frozenset()
    top = max(mine, key=lambda s: s.nbytes)
    if any(p.shard.kind != "replicated" for p in top.pieces):
        return frozenset()
    return frozenset(p.name[len(prefix) :] for p in top.pieces)


def _converted_at(seg: Segment, plan: LayerPlan, prefix: str) -> int | None:
    """Where ``seg`` lies in a conversion buffer of ``plan`` (a sender's part of a layer), or None:
    its pieces are the plan's last entries whole, in order, each at its entry's offset less that
    base (a piece of a split entry has exactly the sender's rows: its shape is the local entry's).
    The last entries, so that the checksum word lands in the room the buffer keeps after them."""
    k = len(plan.entries) - len(seg.pieces)
    if k < 0 or not seg.pieces:
        return None
    base = plan.entries[k].offset
    ok = seg.data_nbytes == plan.nbytes - base and all(
        p.name == prefix + e.name
        and p.dtype == e.dtype
        and tuple(p.shape) == tuple(e.shape)
        and p.offset == e.offset - base
        and p.shard.kind == "replicated"
        for p, e in zip(seg.pieces, plan.entries[k:])
    )
    return base if ok else None


def _is_plan_layout(pack: ShardPack, plan: LayerPlan) -> bool:
    """The pack holds every entry whole where the plan puts it: the converted buffer is the region."""
    return (
        pack.data_nbytes == plan.nbytes
        and all(
            p.shard.kind == "replicated" and p.offset == e.offset and p.nbytes == e.nbytes
            for p, e in zip(pack.pieces, plan.entries)
        )
        and len(pack.pieces) == len(plan.entries)
    )


def _renamed(scatter, old: str, new: str):
    if old == new:
        return scatter
    packs = tuple(
        dataclasses.replace(
            pk, pieces=tuple(dataclasses.replace(p, name=new + p.name[len(old) :]) for p in pk.pieces)
        )
        for pk in scatter.packs
    )
    return dataclasses.replace(scatter, packs=packs)


def describe(tp: TransferPlan, *, top: int = 8) -> Iterator[list]:
    """Rows for ``glm-fp8 plan``: per sender (the ``top`` busiest), its experts, the entries it
    owns, bytes sent, messages per update and its ring slots."""
    sent = tp.sent_bytes()
    order = sorted(range(len(tp.senders)), key=lambda t: (-sent[t], t))[:top]
    for t in order:
        owned = sum(1 for lay in tp.layers for name in lay.owners if t in converters(lay.owners, name))
        msgs = sum(lay.messages(s) for lay in tp.layers for s in lay.of_sender(t))
        local, send = tp.sender_buffers(t)
        lo, hi = tp.bounds[t] if tp.bounds else (0, 0)
        yield [tp.senders[t], f"{lo}..{hi - 1}" if hi > lo else "-", owned, sent[t], msgs, local, send]


__all__ = ["LayerRoutes", "Segment", "TransferPlan", "describe", "plan_steps", "stage_order", "transfer_plan"]

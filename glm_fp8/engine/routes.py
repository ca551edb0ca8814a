"""The transfer plan (docs/layouts.md#the-transfer-plan): which trainer rank sends which bytes of
each layer of an update to which engine ranks. Every mode is one such plan:

- **full broadcast**: one sender; every engine rank is ``FULL`` (it receives every entry whole,
  as ``glm_fp8.convert`` lays the layer out) and they form one class;
- **scatter**: one sender; each engine rank gives its ``EngineLayout`` and receives only its
  shard; ranks that hold the same bytes form a class (``glm_fp8.engine.pack.scatter_classes``);
- **many senders**: every trainer rank sends its own share: the routed-expert stacks (whole
  experts, with their scales) and the passthrough matrices of ``SPLIT_MIN_BYTES`` or more
  (embeddings, ``lm_head``, the MTP layer's head and ``eh_proj``) are split by rows over the ``T``
  senders, sender ``t`` taking the t-th ``torch.chunk`` as FSDP2 and expert parallelism
  (``Shard(0)``) place them; every other entry is gathered on, converted and sent by one sender,
  its owner, chosen so that the senders send about as many bytes.

Per layer, each sender sends each class at most one **segment**: the pieces it has of the
class's region, one after another at multiples of 256 bytes, then a checksum word. A class of
several ranks served by a single sender gets one broadcast in the group of that sender and the
class (where the link can make groups); every other segment goes point to point to each rank of
its class. A single sender's segment that is its whole converted layer, as the plan lays it
out (the full broadcast), is **direct**: sent from the conversion buffer, never packed. An engine
rank's layer buffer holds its class's segments side by side, in sender order; a sender's send
buffer holds its packed segments side by side, in class order. The plan is computed once per
update configuration, identically on every rank, and agreed on at the manifest vote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.engine.layout import EngineLayout, Shard
from glm_fp8.engine.pack import CHECKSUM_BYTES, FULL, ShardPack, ShardPiece, layer_scatter, layout_words
from glm_fp8.kernels.checksum import checksum_rows
from glm_fp8.models import REST
from glm_fp8.plan import LayerPlan, PlanEntry, align, layer_prefix

_WHOLE = Shard("replicated")
# Passthrough matrices at least this large are split by rows: the embeddings, lm_head, the MTP
# head and eh_proj in GLM-5 (whole, they would load one sender with 7 GiB more than the others).
SPLIT_MIN_BYTES = 64 << 20


def chunk_bounds(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of each of ``parts`` pieces of ``n`` rows as ``torch.chunk`` (and so FSDP2's
    ``Shard(0)``) cuts them: ceil-sized pieces first, trailing pieces may be empty."""
    size = -(-n // parts) if parts else 0
    return tuple((min(t * size, n), min((t + 1) * size, n)) for t in range(parts))


def stack_entries(plan: LayerPlan) -> list[PlanEntry]:
    """The routed-expert stacks of a layer (3-D quantized entries) and their scales."""
    out = []
    for k, e in enumerate(plan.entries):
        if e.op == "quantize" and len(e.shape) == 3:
            out += [e, plan.entries[k + 1]]
    return out


def split_entries(plan: LayerPlan) -> list[PlanEntry]:
    """The entries split by rows over many senders: the expert stacks (and their scales) and the
    passthrough matrices of ``SPLIT_MIN_BYTES`` or more copied from one source (a row range of
    a concatenation would span its sources)."""
    big = [e for e in plan.entries if e.op == "copy" and len(e.shape) == 2 and e.nbytes >= SPLIT_MIN_BYTES]
    return stack_entries(plan) + big


@dataclass(frozen=True)
class Segment(ShardPack):
    """What sender ``sender`` (its index in the senders) sends every rank of class ``cls`` for one
    layer: a ``ShardPack`` of the pieces it has of the class's region (a split entry's pieces name
    their ``rows``), then the checksum word. It lies at ``send_offset`` in the sender's send
    buffer (``direct``: in its conversion buffer, at 0) and at ``recv_offset`` in each receiving
    rank's layer buffer."""

    sender: int = 0
    cls: int = 0
    send_offset: int = 0
    recv_offset: int = 0
    direct: bool = False


@dataclass(frozen=True)
class LayerRoutes:
    """One layer's routes: ``classes`` (link ranks that receive the same bytes), ``groups`` (per
    class, the sorted link ranks of its single sender's broadcast; None: point to point),
    ``segments`` (by class, then sender), ``splits`` (each split entry, by prefixed name: every
    sender's rows), ``owners`` (every other entry: the sender that gathers, converts and sends it),
    ``local_plans`` (per sender: the part of the layer it converts, possibly nothing), the bytes of
    each sender's send buffer and of each class's receive buffer."""

    layer_idx: int
    classes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...] | None, ...]
    segments: tuple[Segment, ...]
    splits: dict[str, tuple[tuple[int, int], ...]]
    owners: dict[str, int]
    local_plans: tuple[LayerPlan, ...]
    send_nbytes: tuple[int, ...]
    recv_nbytes: tuple[int, ...]

    def of_sender(self, t: int) -> list[Segment]:
        return [s for s in self.segments if s.sender == t]

    def of_class(self, k: int) -> list[Segment]:
        return [s for s in self.segments if s.cls == k]

    def starts(self, t: int) -> dict[str, int]:
        """Where sender ``t``'s rows of each split entry begin (``ShardPack.pack_into``)."""
        return {name: bounds[t][0] for name, bounds in self.splits.items()}

    def sent_nbytes(self, t: int) -> int:
        """Bytes sender ``t`` puts on the link for this layer: a point-to-point segment once per
        rank of its class, a group broadcast once."""
        return sum(
            s.nbytes * (1 if self.groups[s.cls] else len(self.classes[s.cls])) for s in self.of_sender(t)
        )

    @property
    def wire_nbytes(self) -> int:
        """Every segment once: the layer's distinct bytes on the wire (its header's count)."""
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class TransferPlan:
    """Routes of one update: ``senders`` (link ranks, in expert-chunk order), ``engines`` (one entry
    per link rank: None at a sender, an ``EngineLayout`` or ``FULL``), each sender's routed-expert
    ``bounds`` and every layer's routes (in the update's order)."""

    senders: tuple[int, ...]
    engines: tuple[EngineLayout | str | None, ...]
    bounds: tuple[tuple[int, int], ...]
    layers: tuple[LayerRoutes, ...]

    def class_of(self, pos: int, rank: int) -> int:
        return next(k for k, ranks in enumerate(self.layers[pos].classes) if rank in ranks)

    def groups(self) -> list[tuple[int, ...]]:
        """The groups of link ranks the update needs, in a fixed order: every class broadcast's,
        then the senders' own (their vote before gathers, with several senders)."""
        out = list(dict.fromkeys(g for lay in self.layers for g in lay.groups if g is not None))
        if len(self.senders) > 1:
            out.append(tuple(sorted(self.senders)))
        return out

    def sent_bytes(self) -> list[int]:
        """Bytes each sender sends in a whole update (a point-to-point segment once per rank of its
        class, a group broadcast once)."""
        return [sum(lay.sent_nbytes(t) for lay in self.layers) for t in range(len(self.senders))]

    def received_bytes(self) -> dict[int, int]:
        """Bytes each engine rank (link rank) receives in a whole update."""
        out: dict[int, int] = {}
        for lay in self.layers:
            for k, ranks in enumerate(lay.classes):
                for r in ranks:
                    out[r] = out.get(r, 0) + lay.recv_nbytes[k]
        return out

    def receive_slot(self, rank: int) -> int:
        """The largest layer buffer engine rank ``rank`` receives: one ring slot."""
        return max(
            (
                lay.recv_nbytes[self.class_of(pos, rank)]
                for pos, lay in enumerate(self.layers)
                if any(rank in c for c in lay.classes)
            ),
            default=0,
        )

    def receiver_bytes(self, rank: int, ring: int = 2, device: str = "cuda") -> int:
        """Engine rank ``rank``'s memory above its parameters during an update (what ``Receiver``
        allocates): ``ring`` slots of its largest layer buffer, the checksum's scratch (a word per
        32 KiB on CUDA), every step's header and the vote words."""
        slot = self.receive_slot(rank)
        scratch = 8 * (checksum_rows(slot) if device == "cuda" else 1)
        return ring * slot + scratch + 64 * (len(self.layers) + 3) + 8 * 3

    def sender_buffers(self, t: int) -> tuple[int, int]:
        """(conversion slot, send slot) of sender ``t``: its largest converted share (with room for
        a direct segment's checksum word) and its largest packed segments; one ring slot each."""
        return (
            max((lay.local_plans[t].nbytes + CHECKSUM_BYTES for lay in self.layers), default=0),
            max((lay.send_nbytes[t] for lay in self.layers), default=0),
        )

    def gathered_bytes(self, t: int) -> list[int]:
        """Per layer, the trainer tensors sender ``t`` gathers (the sources of the entries it
        owns there, whole, in their planned dtypes: ``glm_fp8.update_time`` plans them in the dtype
        they travel in, an input with none is counted as bf16); it holds one layer's at a time."""
        out = []
        for lay in self.layers:
            plan = lay.local_plans[t]
            own = {name for name, owner in lay.owners.items() if owner == t}
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
        return max(
            sum(1 if lay.groups[s.cls] else len(lay.classes[s.cls]) for s in lay.segments)
            for lay in self.layers
        )

    def manifest(self) -> dict:
        return {
            "senders": list(self.senders),
            "engines": [lay if lay in (None, FULL) else layout_words(lay) for lay in self.engines],
            "bounds": [list(b) for b in self.bounds],
            "layers": [
                [
                    [
                        s.sender,
                        list(lay.classes[s.cls]),
                        s.nbytes,
                        lay.groups[s.cls] and list(lay.groups[s.cls]),
                        s.direct,
                    ]
                    for s in lay.segments
                ]
                for lay in self.layers
            ],
        }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_engines(engines: Sequence[EngineLayout | str | None], senders: Sequence[int]) -> None:
    """``engines`` has one entry per link rank: None exactly at the senders, else an
    ``EngineLayout`` or ``FULL``."""
    if not senders:
        raise ValueError("senders: expected at least one trainer rank")
    if len(set(senders)) != len(senders):
        raise ValueError(f"senders: expected distinct link ranks, got {list(senders)}")
    bad = [s for s in senders if not 0 <= s < len(engines)]
    if bad:
        raise ValueError(f"senders: rank {bad[0]} is not a rank of the link (0..{len(engines) - 1})")
    for r, lay in enumerate(engines):
        if (r in senders) != (lay is None):
            raise ValueError(
                f"engines[{r}]: expected "
                + ("None (a sender)" if r in senders else f"the EngineLayout of rank {r} or 'full', got None")
            )
        if lay is not None and lay != FULL and not isinstance(lay, EngineLayout):
            raise TypeError(f"engines[{r}]: expected an EngineLayout or {FULL!r}, got {lay!r}")
    if all(lay is None for lay in engines):
        raise ValueError(
            f"engines: no rank of the link receives (every one of its {len(engines)} ranks is a "
            f"sender: {list(senders)})"
        )
    check_replicas(engines)


def check_replicas(engines: Sequence[EngineLayout | str | None]) -> None:
    """The engine layouts taken as a whole: the ranks of one parallel shape (TP, EP, DP sizes) form
    whole replicas, every position (tp_rank, dp_rank) held by the same number of ranks, so that
    each replica holds every shard exactly once. Two workers that both report TP rank 0 of a TP 2
    engine (and none rank 1) are refused here, naming them, before any byte moves."""
    shapes: dict[tuple, dict[tuple[int, int], list[int]]] = {}
    for r, lay in enumerate(engines):
        if isinstance(lay, EngineLayout):
            key = (lay.tp_size, lay.ep_size, lay.dp_size, lay.sequence_parallel_moe)
            shapes.setdefault(key, {}).setdefault((lay.tp_rank, lay.dp_rank), []).append(r)
    for (tp, ep, dp, _), held in shapes.items():
        copies = max(len(ranks) for ranks in held.values())
        for tp_rank in range(tp):
            for dp_rank in range(dp):
                ranks = held.get((tp_rank, dp_rank), [])
                if len(ranks) == copies:
                    continue
                crowded = next(pos for pos, rs in held.items() if len(rs) == copies)
                raise ValueError(
                    f"engines: the layouts of TP {tp} x DP {dp}{' with EP' if ep > 1 else ''} do not form "
                    f"whole replicas: tp_rank {tp_rank}, dp_rank {dp_rank} is held by "
                    f"{'ranks ' + str(ranks) if ranks else 'no rank'}, tp_rank {crowded[0]}, dp_rank "
                    f"{crowded[1]} by ranks {held[crowded]}; each replica's ranks must report every "
                    "position exactly once (check each worker's tp_rank / dp_rank)"
                )


def transfer_plan(
    config: Mapping | None,
    plans: Sequence[LayerPlan],
    layer_ids: Sequence[int],
    engines: Sequence[EngineLayout | str | None],
    senders: Sequence[int],
    *,
    groups: bool = True,
) -> TransferPlan:
    """The routes of an update of ``layer_ids`` (``plans[k]`` the plan of ``layer_ids[k]``) from
    ``senders`` (link ranks) into ``engines`` (one entry per link rank, see ``check_engines``;
    ``config`` is needed when some are ``EngineLayout``). ``groups``: the link can make groups, so
    a single sender broadcasts once to a class of several ranks. Raises ValueError for a plan the
    senders cannot carry out, or where vLLM would refuse an engine layout."""
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
            cache[id(plan)] = (layer_idx, layer_scatter(plan, layer_idx, config, engines))
        first, scatter = cache[id(plan)]
        scatters.append(_renamed(scatter, layer_prefix(first), layer_prefix(layer_idx)))
    experts = {e.shape[0] for p in plans for e in stack_entries(p)}
    if len(experts) > 1:
        raise ValueError(
            f"plans: expected one number of routed experts in every layer, got {sorted(experts)}"
        )
    bounds = chunk_bounds(experts.pop() if experts else 0, n)
    if n == 1:
        splits: list[dict] = [{} for _ in plans]
        owners = [{layer_prefix(i) + e.name: 0 for e in p.entries} for p, i in zip(plans, layer_ids)]
    else:
        splits = [
            {layer_prefix(i) + e.name: chunk_bounds(e.shape[0], n) for e in split_entries(p)}
            for p, i in zip(plans, layer_ids)
        ]
        owners = _owners(plans, layer_ids, scatters, splits, n)
    local_cache: dict[tuple, LayerPlan] = {}
    layers = []
    for pos, (plan, layer_idx) in enumerate(zip(plans, layer_ids)):
        scatter, split, prefix = scatters[pos], splits[pos], layer_prefix(layer_idx)
        # One sender broadcasts to a class of replicas (in the group of it and the class), and to a
        # class that is every other rank of the link (the link itself, which any link can do).
        cls_groups = tuple(
            tuple(sorted((senders[0], *ranks)))
            if n == 1 and ((groups and len(ranks) > 1) or len(ranks) + 1 == len(engines))
            else None
            for ranks in scatter.classes
        )
        segments, recv_nbytes = [], []
        for k, pack in enumerate(scatter.packs):
            recv = 0
            for t in range(n):
                if n == 1:
                    pieces, off = list(pack.pieces), pack.data_nbytes
                else:
                    pieces, off = _sender_pieces(pack, split, owners[pos], t)
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
                        )
                    )
                    recv = align(recv + off + CHECKSUM_BYTES)
            recv_nbytes.append(recv)
        send_nbytes = [0] * n
        placed = []
        for s in segments:  # class order within each sender
            if s.direct:
                placed.append(s)
                continue
            placed.append(dataclasses.replace(s, send_offset=send_nbytes[s.sender]))
            send_nbytes[s.sender] = align(send_nbytes[s.sender] + s.nbytes)
        local_plans = []
        for t in range(n):  # cached: a layer's plan and a sender's rows and entries repeat
            key = (id(plan), tuple(b[t] for b in split.values()),
                   frozenset(name[len(prefix) :] for name, o in owners[pos].items() if o == t))  # fmt: skip
            if key not in local_cache:
                local_cache[key] = sender_plan(plan, prefix, split, owners[pos], t)
            local_plans.append(local_cache[key])
        layers.append(
            LayerRoutes(
                layer_idx,
                scatter.classes,
                cls_groups,
                tuple(placed),
                split,
                owners[pos],
                tuple(local_plans),
                tuple(send_nbytes),
                tuple(recv_nbytes),
            )
        )
    return TransferPlan(senders, engines, bounds, tuple(layers))


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


def _sender_pieces(pack: ShardPack, split: Mapping, owners: Mapping[str, int], t: int) -> tuple[list, int]:
    """Sender ``t``'s pieces of a class's region (its rows of split entries, the entries it owns),
    laid out one after another; and their end."""
    pieces, off = [], 0
    for p in pack.pieces:
        if p.name in split:
            piece = _row_piece(p, split[p.name][t], off)
        elif owners[p.name] == t:
            piece = dataclasses.replace(p, offset=off)
        else:
            piece = None
        if piece is not None:
            pieces.append(piece)
            off = align(off + piece.nbytes)
    return pieces, off


def _row_piece(p: ShardPiece, rows: tuple[int, int], offset: int) -> ShardPiece | None:
    """The part of a class's piece ``p`` of a split entry in one sender's ``rows`` [lo, hi) of
    dim 0, or None: rows of the class's own row range (EP experts, a TP vocabulary slice) whole,
    or every row cut along the class's other dim."""
    lo, hi = rows
    if p.shard.cuts_rows(len(p.shape)):
        if not p.shard.parts:  # a rank whose vocabulary slice is all padding
            return None
        start, stop = p.shard.parts[0]
        shard = _WHOLE
    else:
        start, stop = 0, p.shape[0]  # the class holds every row (cut along another dim, or whole)
        shard = p.shard
    a, b = max(start, lo), min(stop, hi)
    if a >= b:
        return None
    return ShardPiece(p.name, p.dtype, (b - a, *p.shape[1:]), offset, shard, (a, b))


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


def _owners(plans, layer_ids, scatters, splits, n_senders: int) -> list[dict[str, int]]:
    """Each entry that is not split gets one owner: a decoder layer's go together (one gather
    per layer), the non-layer tensors one by one. Largest group first, each to the sender that
    sends the fewest bytes so far, counting its rows of the split entries (greedy,
    deterministic)."""
    load = [0] * n_senders
    groups: list[tuple[int, int, list[str]]] = []  # (bytes sent, position, names)
    for pos, (plan, layer_idx, scatter) in enumerate(zip(plans, layer_ids, scatters)):
        prefix = layer_prefix(layer_idx)
        sent: dict[str, int] = {}
        for ranks, pack in zip(scatter.classes, scatter.packs):
            for p in pack.pieces:
                sent[p.name] = sent.get(p.name, 0) + p.nbytes * len(ranks)
        for name, bounds in splits[pos].items():
            rows = max(bounds[-1][1], 1)
            for t, (lo, hi) in enumerate(bounds):
                load[t] += sent.get(name, 0) * (hi - lo) // rows
        others = [prefix + e.name for e in plan.entries if prefix + e.name not in splits[pos]]
        for names in [[x] for x in others] if layer_idx == REST else [others]:
            if names:
                groups.append((sum(sent.get(x, 0) for x in names), pos, names))
    owners: list[dict[str, int]] = [{} for _ in plans]
    for nbytes, pos, names in sorted(groups, key=lambda g: (-g[0], g[1])):
        t = min(range(n_senders), key=lambda i: (load[i], i))
        load[t] += nbytes
        for name in names:
            owners[pos][name] = t
    return owners


def sender_plan(
    plan: LayerPlan,
    prefix: str,
    splits: Mapping[str, Sequence[tuple[int, int]]],
    owners: Mapping[str, int],
    t: int,
) -> LayerPlan:
    """What sender ``t`` converts of a layer of ``plan`` (in any trainer layout, see
    ``glm_fp8.plan.adapt_plan``): its rows of every split entry (an expert stack with its scale)
    and the entries it owns, laid out afresh; the plan itself when it owns everything."""
    owned = {name[len(prefix) :] for name, o in owners.items() if o == t}
    if not splits and len(owned) == len(plan.entries):
        return plan
    rows = {name[len(prefix) :]: b[t] for name, b in splits.items() if b[t][1] > b[t][0]}
    return plan.with_rows(rows).subset(owned | set(rows))


def describe(tp: TransferPlan, *, top: int = 8) -> Iterator[list]:
    """Rows for ``glm-fp8 plan``: per sender (the ``top`` busiest), its experts, the entries it
    owns, bytes sent, messages per update and its ring slots."""
    sent = tp.sent_bytes()
    order = sorted(range(len(tp.senders)), key=lambda t: (-sent[t], t))[:top]
    for t in order:
        owned = sum(1 for lay in tp.layers for o in lay.owners.values() if o == t)
        msgs = sum(
            1 if lay.groups[s.cls] else len(lay.classes[s.cls]) for lay in tp.layers for s in lay.of_sender(t)
        )
        local, send = tp.sender_buffers(t)
        lo, hi = tp.bounds[t] if tp.bounds else (0, 0)
        yield [tp.senders[t], f"{lo}..{hi - 1}" if hi > lo else "-", owned, sent[t], msgs, local, send]


__all__ = [
    "FULL",
    "LayerRoutes",
    "SPLIT_MIN_BYTES",
    "Segment",
    "TransferPlan",
    "check_engines",
    "chunk_bounds",
    "describe",
    "sender_plan",
    "split_entries",
    "stack_entries",
    "transfer_plan",
]

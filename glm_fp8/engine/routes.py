"""Many senders (docs/layouts.md#many-senders): which trainer rank sends which bytes of an
update to which engine rank.

Two kinds of entries are split by rows (dim 0) over the ``T`` senders (the trainer ranks, in
the order of their shards), sender ``t`` taking the t-th ``torch.chunk`` as FSDP2 and expert
parallelism (``Shard(0)``) place them: the routed-expert stacks (whole experts, with their
scales) and the large passthrough matrices (embeddings, ``lm_head``, the MTP layer's head and
``eh_proj``). Each sender converts its rows itself and sends each class of engine ranks (ranks
that hold the same shard, ``glm_fp8.engine.pack.scatter_classes``) the part of their shard in
those rows. A layer's other entries are gathered on one sender, their owner, which converts and
sends them; owners are chosen so that the senders send about as many bytes.

Per layer, each sender sends each engine rank at most one message, a ``Segment``: its pieces
one after another at multiples of 256 bytes, then a checksum word. An engine rank's layer
buffer holds its class's segments side by side, in sender order; a sender's send buffer holds
its segments side by side, in class order. The plan is computed once per update
configuration, identically on every rank, and reused every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.engine.layout import EngineLayout, Shard
from glm_fp8.engine.pack import CHECKSUM_BYTES, ShardPack, ShardPiece, layer_scatter, layout_words
from glm_fp8.models import REST
from glm_fp8.plan import LayerPlan, PlanEntry, align, build_plan, layer_prefix

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
    """The entries split by rows over the senders: the expert stacks (and their scales) and the
    passthrough matrices of ``SPLIT_MIN_BYTES`` or more copied from one source (a row range of
    a concatenation would span its sources)."""
    big = [e for e in plan.entries if e.op == "copy" and len(e.shape) == 2 and e.nbytes >= SPLIT_MIN_BYTES]
    return stack_entries(plan) + big


@dataclass(frozen=True)
class Segment(ShardPack):
    """What sender ``sender`` sends every rank of class ``cls`` for one layer: a ``ShardPack`` of
    the pieces it has of the class's region (a split entry's pieces name their ``rows``), then
    the checksum word. It lies at ``send_offset`` in the sender's send buffer and at
    ``recv_offset`` in each receiving rank's layer buffer."""

    sender: int = 0
    cls: int = 0
    send_offset: int = 0
    recv_offset: int = 0


@dataclass(frozen=True)
class LayerRoutes:
    """One layer's routes: ``classes`` (link ranks that receive the same bytes), ``segments``
    (by class, then sender), ``splits`` (each split entry, by prefixed name: every sender's
    rows), ``owners`` (every other entry: the sender that gathers, converts and sends it),
    ``local_plans`` (per sender: the part of the layer it converts, possibly nothing), the
    bytes of each sender's send buffer and of each class's receive buffer."""

    layer_idx: int
    classes: tuple[tuple[int, ...], ...]
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

    @property
    def wire_nbytes(self) -> int:
        """Every segment once: the layer's distinct bytes on the wire (its header's count)."""
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class TransferPlan:
    """Routes of one update: ``senders`` (link ranks, in expert-chunk order), ``engines`` (one
    entry per link rank, None at each sender), each sender's routed experts ``bounds`` and
    every layer's routes (in the update's order)."""

    senders: tuple[int, ...]
    engines: tuple[EngineLayout | None, ...]
    bounds: tuple[tuple[int, int], ...]
    layers: tuple[LayerRoutes, ...]

    def class_of(self, pos: int, rank: int) -> int:
        return next(k for k, ranks in enumerate(self.layers[pos].classes) if rank in ranks)

    def sent_bytes(self) -> list[int]:
        """Bytes each sender sends in a whole update (a segment once per receiving rank)."""
        out = [0] * len(self.senders)
        for layer in self.layers:
            for s in layer.segments:
                out[s.sender] += s.nbytes * len(layer.classes[s.cls])
        return out

    def received_bytes(self) -> dict[int, int]:
        """Bytes each engine rank (link rank) receives in a whole update."""
        out: dict[int, int] = {}
        for layer in self.layers:
            for k, ranks in enumerate(layer.classes):
                for r in ranks:
                    out[r] = out.get(r, 0) + layer.recv_nbytes[k]
        return out

    def sender_buffers(self, t: int) -> tuple[int, int]:
        """(largest local conversion buffer, largest send buffer) of sender ``t``: one ring slot
        of each."""
        return (max((lay.local_plans[t].nbytes for lay in self.layers), default=0),
                max((lay.send_nbytes[t] for lay in self.layers), default=0))  # fmt: skip

    def gathered_bytes(self, t: int) -> list[int]:
        """Per layer, the trainer tensors sender ``t`` gathers (the sources of the entries it
        owns there, whole, in their planned dtypes); it holds one layer's at a time."""
        out = []
        for lay in self.layers:
            plan = lay.local_plans[t]
            own = {name for name, owner in lay.owners.items() if owner == t}
            prefix = layer_prefix(lay.layer_idx)
            srcs = {s for e in plan.entries if prefix + e.name in own for s in e.sources}
            out.append(sum((plan.inputs[s][1] or torch.bfloat16).itemsize * _numel(plan.inputs[s][0])
                           for s in srcs))  # fmt: skip
        return out

    def sender_peak(self, t: int, ring: int = 2) -> int:
        """Sender ``t``'s transient bytes above its resident shards: ``ring`` slots of its local
        conversion buffer and of its send buffer, and one layer's gathered tensors."""
        local, send = self.sender_buffers(t)
        return ring * (local + send) + max(self.gathered_bytes(t), default=0)

    def messages_per_layer(self) -> int:
        """The most messages one layer takes (every segment to every rank of its class)."""
        return max(sum(len(lay.classes[s.cls]) for s in lay.segments) for lay in self.layers)

    def manifest(self) -> dict:
        return {
            "senders": list(self.senders),
            "engines": [layout_words(lay) for lay in self.engines],
            "bounds": [list(b) for b in self.bounds],
            "layers": [
                [[s.sender, list(lay.classes[s.cls]), s.nbytes] for s in lay.segments] for lay in self.layers
            ],  # fmt: skip
        }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def transfer_plan(
    config: Mapping,
    plans: Sequence[LayerPlan],
    layer_ids: Sequence[int],
    engines: Sequence[EngineLayout | None],
    senders: Sequence[int],
) -> TransferPlan:
    """The routes of an fp8 update of ``layer_ids`` (``plans[k]`` the plan of ``layer_ids[k]``)
    from ``senders`` (link ranks) into ``engines`` (one entry per link rank; None exactly at
    the senders). Raises ValueError for a plan the senders cannot carry out, or where vLLM
    would refuse an engine layout."""
    senders = tuple(int(s) for s in senders)
    engines = tuple(engines)
    if not senders:
        raise ValueError("senders: expected at least one trainer rank")
    if len(set(senders)) != len(senders):
        raise ValueError(f"senders: expected distinct link ranks, got {list(senders)}")
    for r, lay in enumerate(engines):
        if (r in senders) != (lay is None):
            raise ValueError(f"engines[{r}]: expected " + ("None (a sender)" if r in senders else
                             f"the EngineLayout of rank {r}, got None"))  # fmt: skip
        if lay is not None and not isinstance(lay, EngineLayout):
            raise TypeError(f"engines[{r}]: expected an EngineLayout, got {type(lay).__name__}")
    bad = [s for s in senders if not 0 <= s < len(engines)]
    if bad:
        raise ValueError(f"senders: rank {bad[0]} is not a rank of the link (0..{len(engines) - 1})")
    n_senders = len(senders)
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
    bounds = chunk_bounds(experts.pop() if experts else 0, n_senders)
    splits = [{layer_prefix(i) + e.name: chunk_bounds(e.shape[0], n_senders) for e in split_entries(p)}
              for p, i in zip(plans, layer_ids)]  # fmt: skip
    owners = _owners(plans, layer_ids, scatters, splits, n_senders)
    local_cache: dict[tuple, LayerPlan] = {}
    layers = []
    for pos, (plan, layer_idx) in enumerate(zip(plans, layer_ids)):
        scatter, split = scatters[pos], splits[pos]
        prefix = layer_prefix(layer_idx)
        segments, recv_nbytes = [], []
        for k, pack in enumerate(scatter.packs):
            recv = 0
            for t in range(n_senders):
                pieces, off = [], 0
                for p in pack.pieces:
                    if p.name in split:
                        piece = _row_piece(p, split[p.name][t], off)
                    elif owners[pos][p.name] == t:
                        piece = dataclasses.replace(p, offset=off)
                    else:
                        piece = None
                    if piece is not None:
                        pieces.append(piece)
                        off = align(off + piece.nbytes)
                if pieces:
                    seg = Segment(tuple(pieces), off + CHECKSUM_BYTES, sender=t, cls=k, recv_offset=recv)
                    segments.append(seg)
                    recv = align(recv + off + CHECKSUM_BYTES)
            recv_nbytes.append(recv)
        send_nbytes = [0] * n_senders
        placed = []
        for s in segments:  # class order within each sender
            placed.append(dataclasses.replace(s, send_offset=send_nbytes[s.sender]))
            send_nbytes[s.sender] = align(send_nbytes[s.sender] + s.nbytes)
        local_plans = []
        for t in range(n_senders):
            owned = frozenset(n[len(prefix) :] for n, o in owners[pos].items() if o == t)
            rows = tuple((n[len(prefix) :], b[t][1] - b[t][0]) for n, b in split.items())
            key = (id(plan), rows, owned)
            if key not in local_cache:
                local_cache[key] = _local_plan(config, plan, dict(rows), owned)
            local_plans.append(local_cache[key])
        layers.append(LayerRoutes(layer_idx, scatter.classes, tuple(placed), split, owners[pos],
                                  tuple(local_plans), tuple(send_nbytes), tuple(recv_nbytes)))  # fmt: skip
    return TransferPlan(senders, engines, bounds, tuple(layers))


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
        start, stop = 0, p.shape[0]  # the class holds every row, cut along another dim
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
        )  # fmt: skip
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


def _local_plan(
    config: Mapping, plan: LayerPlan, rows: Mapping[str, int], owned: frozenset[str]
) -> LayerPlan:
    """What one sender converts of a layer: its ``rows[name]`` rows of every split entry (short
    names; an expert stack with its scale) and the entries it owns, laid out afresh."""
    split = {e.name: e for e in split_entries(plan)}
    src_rows = {s: rows[name] for name, e in split.items() for s in e.sources}
    inputs = {k: ((src_rows[k], *shape[1:]) if k in src_rows else shape, dtype)
              for k, (shape, dtype) in plan.inputs.items()}  # fmt: skip
    local = build_plan(config["model_type"], inputs, target=plan.target, quantize=plan.quantize,
                       scale_fmt=plan.scale_fmt) if src_rows else plan  # fmt: skip
    keep = set(owned) | {name for name in split if rows[name]}
    return local.subset(keep)


def describe(tp: TransferPlan, *, top: int = 8) -> Iterator[list]:
    """Rows for ``glm-fp8 plan``: per sender (the ``top`` busiest), its experts, the entries it
    owns, bytes sent, messages per update and its ring slots."""
    sent = tp.sent_bytes()
    order = sorted(range(len(tp.senders)), key=lambda t: (-sent[t], t))[:top]
    for t in order:
        owned = sum(1 for lay in tp.layers for o in lay.owners.values() if o == t)
        msgs = sum(len(lay.classes[s.cls]) for lay in tp.layers for s in lay.of_sender(t))
        local, send = tp.sender_buffers(t)
        lo, hi = tp.bounds[t] if tp.bounds else (0, 0)
        yield [tp.senders[t], f"{lo}..{hi - 1}" if hi > lo else "-", owned, sent[t], msgs, local, send]


__all__ = [
    "LayerRoutes",
    "Segment",
    "TransferPlan",
    "SPLIT_MIN_BYTES",
    "chunk_bounds",
    "describe",
    "split_entries",
    "stack_entries",
    "transfer_plan",
]

"""Many senders (docs/layouts.md#the-transfer-plan): how one update is divided among the ``T``
trainer ranks that send it. The routed-expert stacks (whole experts, with their scales) and the
passthrough matrices of ``SPLIT_MIN_BYTES`` or more (embeddings, ``lm_head``, the MTP layer's head
and ``eh_proj``) are split by rows over the senders, sender ``t`` taking the t-th ``torch.chunk``
as FSDP2 and expert parallelism (``Shard(0)``) place them; every other entry is gathered on,
converted and sent by its owner, one sender, or one per class of engine ranks where the entry
goes to many (``Owner``), chosen so that the senders of each step (a layer) send about as many
bytes: a step lasts as long as its busiest sender.
``glm_fp8.transfer.routes`` lays each sender's share out in segments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from glm_fp8.engine.layout import Shard
from glm_fp8.model.layer_plan import LayerPlan, PlanEntry, align
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.pack import LayerScatter, ShardPack, ShardPiece

_WHOLE = Shard("replicated")
# Passthrough matrices at least this large are split by rows: the embeddings, lm_head, the MTP
# head and eh_proj in GLM-5 (whole, they would load one sender with 7 GiB more than the others).
SPLIT_MIN_BYTES = 64 << 20
Rows = tuple[tuple[int, int], ...]  # [lo, hi) of dim 0, one pair per sender


def chunk_bounds(n: int, parts: int) -> Rows:
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


Holders = tuple[int, ...] | Mapping[str, tuple[int, ...]] | None
"""Which senders (their indices) hold a layer: None, every sender; a tuple, those senders, every
entry; a mapping, per entry name (short), the senders that hold it (an entry not named: every
sender). Pipeline stages: each layer is held by its stage's senders."""


def entry_holders(holders: Holders, name: str, n_senders: int) -> tuple[int, ...]:
    """The senders (indices, in order) that hold entry ``name`` (short) of a layer held by
    ``holders``."""
    if holders is None:
        return tuple(range(n_senders))
    if isinstance(holders, tuple):
        return holders
    return holders.get(name, tuple(range(n_senders)))


def divide(
    plans: Sequence[LayerPlan],
    layer_ids: Sequence[int],
    scatters: Sequence[LayerScatter],
    n_senders: int,
    holders: Sequence[Holders] | None = None,
) -> tuple[Rows, list[dict[str, Rows]], list[dict[str, Owner]]]:
    """The division of an update of ``layer_ids`` (``plans[k]`` and the classes' regions
    ``scatters[k]`` of ``layer_ids[k]``) among ``n_senders``: each sender's routed-expert rows
    (``bounds``: in the layers it holds), per layer every split entry's rows per sender (by
    prefixed name: ``torch.chunk`` over the entry's holders, in their order; none for the other
    senders) and the owners of every other entry (``Owner``: among its holders). ``holders[k]``: who holds
    ``layer_ids[k]`` (``Holders``; default every sender). One sender owns everything. Raises
    ValueError for layers with different numbers of routed experts (one expert-parallel cut
    serves every layer)."""
    holders = list(holders) if holders is not None else [None] * len(plans)
    experts = {e.shape[0] for p in plans for e in stack_entries(p)}
    if len(experts) > 1:
        raise ValueError(
            f"plans: expected one number of routed experts in every layer, got {sorted(experts)}"
        )
    if n_senders == 1:
        bounds = chunk_bounds(experts.pop() if experts else 0, 1)
        splits: list[dict] = [{} for _ in plans]
        owners = [{layer_prefix(i) + e.name: 0 for e in p.entries} for p, i in zip(plans, layer_ids)]
        return bounds, splits, owners
    splits = []
    for p, i, h in zip(plans, layer_ids, holders):
        splits.append(
            {
                layer_prefix(i) + e.name: held_bounds(
                    e.shape[0], entry_holders(h, e.name, n_senders), n_senders
                )
                for e in split_entries(p)
            }
        )
    owners = _owners(plans, layer_ids, scatters, splits, holders, n_senders)
    bounds = [(0, 0)] * n_senders
    for p, i, split in zip(plans, layer_ids, splits):
        for e in stack_entries(p):
            for t, rows in enumerate(split[layer_prefix(i) + e.name]):
                if rows[1] > rows[0] and bounds[t] == (0, 0):
                    bounds[t] = rows
    return tuple(bounds), splits, owners


def held_bounds(n: int, held: Sequence[int], n_senders: int) -> Rows:
    """[lo, hi) of ``n`` rows per sender: ``torch.chunk`` over the senders ``held`` (indices, in
    their order), (0, 0) for the others."""
    out = [(0, 0)] * n_senders
    for t, rows in zip(held, chunk_bounds(n, len(held))):
        out[t] = rows
    return tuple(out)


Owner = int | tuple[int, ...]
"""Who sends an entry that is not split: one sender (an int) to every class, or one per class of
the layer (a tuple indexed by class, -1 where the class holds none of it). Each sender named
gathers and converts the whole entry; it sends only its classes' pieces."""

# A group of entries is cut by class (each class's pieces their own owner) where it sends more
# than this fraction of the step's bytes per holder: a replicated entry sent whole from one sender
# to every replica would make the step as long as that sender's fan-out. Each further owner
# gathers and converts the entries again (the attention's few MiB), so small groups stay whole.
CLASS_SPLIT_SHARE = 1 / 16


def owner_in(owners: Mapping[str, Owner], name: str, cls: int) -> int:
    """The sender that sends class ``cls`` its pieces of entry ``name`` (prefixed)."""
    o = owners[name]
    return o if isinstance(o, int) else o[cls]


def converters(owners: Mapping[str, Owner], name: str) -> tuple[int, ...]:
    """The senders that gather and convert entry ``name`` (prefixed; none for a split entry)."""
    o = owners.get(name)
    if o is None:
        return ()
    return (o,) if isinstance(o, int) else tuple(sorted({t for t in o if t >= 0}))


def _owners(plans, layer_ids, scatters, splits, holders, n_senders: int) -> list[dict[str, Owner]]:
    """Each entry that is not split gets its owners among its holders (``Owner``); entries that
    read a trainer tensor in common (a weight and its scale, a fused entry's parts) go together,
    so each owner gathers each tensor once. An update moves a step at a time (a layer a step,
    closed by every rank's vote: docs/update_time.md#steps), so a step lasts as long as its busiest
    sender: each step's groups are balanced within the step, largest first, each to the holder
    that sends the fewest bytes of the step so far (its rows of the step's split entries
    counted), ties to the fewest bytes over the update, then the lowest index (greedy,
    deterministic). A group that would send more than ``CLASS_SPLIT_SHARE`` of the step's bytes
    per holder is cut by class: each class's pieces placed alike."""
    total = [0] * n_senders
    owners: list[dict[str, Owner]] = [{} for _ in plans]
    for pos, (plan, layer_idx, scatter) in enumerate(zip(plans, layer_ids, scatters)):
        prefix = layer_prefix(layer_idx)
        per_class: dict[str, dict[int, int]] = {}  # prefixed name -> class -> bytes sent
        for k, (ranks, pack) in enumerate(zip(scatter.classes, scatter.packs)):
            for p in pack.pieces:
                got = per_class.setdefault(p.name, {})
                got[k] = got.get(k, 0) + p.nbytes * len(ranks)
        sent = {name: sum(v.values()) for name, v in per_class.items()}
        step = [0] * n_senders
        for name, bounds in splits[pos].items():
            rows = max(max(hi for _, hi in bounds), 1)
            for t, (lo, hi) in enumerate(bounds):
                step[t] += sent.get(name, 0) * (hi - lo) // rows
        groups = _sharing_groups([e for e in plan.entries if prefix + e.name not in splits[pos]])
        held = {n: entry_holders(holders[pos], n, n_senders) for g in groups for n in g}
        step_holders = {t for g in groups for n in g for t in held[n]} | {
            t for b in splits[pos].values() for t, (lo, hi) in enumerate(b) if hi > lo
        }
        per_holder = (sum(sent.values())) / max(len(step_holders), 1)
        units = []  # (bytes, group, class or None)
        for g in groups:
            classes: dict[int, int] = {}
            for n in g:
                for k, b in per_class.get(prefix + n, {}).items():
                    classes[k] = classes.get(k, 0) + b
            nbytes = sum(classes.values())
            if len(classes) > 1 and nbytes > CLASS_SPLIT_SHARE * per_holder:
                units += [(b, g, k) for k, b in classes.items()]
            else:
                units.append((nbytes, g, None))
        # a sender that converts a group already sends a further class's pieces for nothing more;
        # another one first gathers the group's tensors (counted as if on its way out)
        gather = {tuple(g): plan.subset(g).input_bytes() for g in groups}
        chosen: dict[tuple[str, ...], dict[int | None, int]] = {}
        for nbytes, g, k in sorted(units, key=lambda u: (-u[0], u[1], -1 if u[2] is None else u[2])):
            placed = chosen.setdefault(tuple(g), {})
            extra = gather[tuple(g)]
            t = min(held[g[0]], key=lambda i: (step[i] + (0 if i in placed.values() else extra), total[i], i))
            step[t] += nbytes
            placed[k] = t
        for g, by_class in chosen.items():
            if None in by_class:
                owner: Owner = by_class[None]
            elif len(set(by_class.values())) == 1:  # every class placed on one sender
                owner = next(iter(by_class.values()))
            else:
                owner = tuple(by_class.get(k, -1) for k in range(len(scatter.classes)))
            for name in g:
                owners[pos][prefix + name] = owner
        for t in range(n_senders):
            total[t] += step[t]
    return owners


def _sharing_groups(entries: Sequence[PlanEntry]) -> list[list[str]]:
    """``entries`` (short names) grouped so that entries reading a trainer tensor in common share a
    group, and a scale its weight's (the entry before it: one conversion writes both); each group
    in plan order."""
    group_of: dict[str, int] = {}  # trainer tensor (or a weight entry's name) -> group
    groups: list[list[str]] = []
    for k, e in enumerate(entries):
        keys = [*e.sources, *(["entry:" + entries[k - 1].name] if e.op == "scale" else [])]
        hit = sorted({group_of[s] for s in keys if s in group_of})
        if not hit:
            groups.append([])
            hit = [len(groups) - 1]
        keep = hit[0]
        for g in hit[1:]:  # merge every other group this entry joins into the first
            groups[keep] += groups[g]
            groups[g] = []
            group_of.update({s: keep for s, v in group_of.items() if v == g})
        groups[keep].append(e.name)
        group_of.update({s: keep for s in [*keys, "entry:" + e.name]})
    order = {e.name: k for k, e in enumerate(entries)}
    return [sorted(g, key=order.__getitem__) for g in groups if g]


def sender_plan(
    plan: LayerPlan,
    prefix: str,
    splits: Mapping[str, Sequence[tuple[int, int]]],
    owners: Mapping[str, Owner],
    t: int,
    last: frozenset[str] = frozenset(),
) -> LayerPlan:
    """What sender ``t`` converts of a layer of ``plan`` (in any trainer layout, see
    ``glm_fp8.model.trainer_layouts.adapt_plan``): its rows of every split entry (an expert stack
    with its scale) and the entries it owns, laid out afresh, those named in ``last`` (short
    names) after the others (``LayerPlan.subset``); the plan itself when it owns everything."""
    owned = {name[len(prefix) :] for name in owners if t in converters(owners, name)}
    if not splits and len(owned) == len(plan.entries):
        return plan
    rows = {name[len(prefix) :]: b[t] for name, b in splits.items() if b[t][1] > b[t][0]}
    return plan.with_rows(rows).subset(owned | set(rows), last)


def sender_pieces(
    pack: ShardPack, split: Mapping, owners: Mapping[str, Owner], t: int, cls: int
) -> tuple[list, int]:
    """Sender ``t``'s pieces of class ``cls``'s region (its rows of split entries, the entries it
    sends that class), laid out one after another; and their end."""
    pieces, off = [], 0
    for p in pack.pieces:
        if p.name in split:
            piece = _row_piece(p, split[p.name][t], off)
        elif owner_in(owners, p.name, cls) == t:
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


__all__ = [
    "CLASS_SPLIT_SHARE",
    "SPLIT_MIN_BYTES",
    "Holders",
    "Owner",
    "chunk_bounds",
    "converters",
    "divide",
    "entry_holders",
    "held_bounds",
    "owner_in",
    "sender_pieces",
    "sender_plan",
    "split_entries",
    "stack_entries",
]

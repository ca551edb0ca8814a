"""Many senders (docs/layouts.md#the-transfer-plan): what each trainer rank checks of a layer
before any gather, and the collection and conversion of its own share (its experts, its rows of
the large passthrough matrices, the entries it owns)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from glm_fp8.kernels.convert import check_adapted_keys, check_source_dtypes, convert_checked, layer_device
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.trainer_layouts import layer_prefix, source_rows
from glm_fp8.transfer.gather import full_value, gather_rows, shard_layout, travel_dtypes
from glm_fp8.transfer.owners import (
    Holders,
    converters,
    entry_holders,
    sender_plan,
    split_entries,
    stack_entries,
)
from glm_fp8.transfer.routes import LayerRoutes


def needed_sources(plan: LayerPlan, routes: LayerRoutes, t: int) -> set[str]:
    """The trainer tensors (short names, ``plan`` adapted to the layer) sender ``t`` reads of a
    layer: the sources of its rows of each split entry (of a per-expert stack, its own experts'
    tensors only) and of each entry it owns. What it holds besides (a DTensor piece another sender
    gathers) it may pass too."""
    prefix = layer_prefix(routes.layer_idx)
    out: set[str] = set()
    for e in plan.entries:
        name = prefix + e.name
        if name in routes.splits:
            lo, hi = routes.splits[name][t]
            if hi > lo:
                out.update(s for g in e.groups()[lo:hi] for s in g) if e.per_expert else out.update(e.sources)
        elif t in converters(routes.owners, name):
            out.update(e.sources)
    return out


def check_own_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    routes: LayerRoutes,
    holders: Holders,
    t: int,
    senders: Sequence[int],
) -> None:
    """What sender ``t`` checks of its layer before any gather, so that all of them gather or none
    does (``plan`` and ``layer`` as ``trainer_view`` gives them: nothing is adapted again; ``routes``
    the layer's, ``holders`` who holds it, ``senders`` the senders' global ranks): every tensor it
    reads present (``needed_sources``: a sender hands only what it holds, nothing of a layer it does
    not hold), no unknown key, global shapes as planned (``check_adapted_keys``), passthrough
    sources of a floating dtype (``check_source_dtypes``); expert stacks that are plain tensors or
    DTensors sharded on the expert dim over the stack's holders in their order; other DTensors on
    a mesh of senders (gathered among the mesh's ranks when the entry's owner is one of them).
    ``collect_own`` then checks only what its own share adds: one device."""
    from torch.distributed.tensor import DTensor

    prefix = layer_prefix(routes.layer_idx)
    entries = check_adapted_keys(plan, layer, prefix, needed=needed_sources(plan, routes, t))
    check_source_dtypes(entries, layer, prefix)
    stacks = {s: e for e in stack_entries(plan) if e.op != "scale" for s in e.sources}
    for k, x in sorted(layer.items()):
        if not isinstance(x, DTensor):
            continue
        ranks = tuple(int(r) for r in x.device_mesh.mesh.flatten().tolist())
        e = stacks.get(k)
        if e is not None and e.per_expert:
            raise ValueError(
                f"{prefix}{k}: a per-expert DTensor; many senders read each sender's own experts, so "
                "per-expert tensors must be plain tensors on the senders that hold them (or send from "
                "one rank, which gathers them)"
            )
        if e is not None:
            held = entry_holders(holders, e.name, len(senders))
            want_ranks = tuple(senders[u] for u in held)
            want_bounds = tuple(routes.splits[prefix + e.name][u] for u in held)
            lay = shard_layout(x)
            if lay is None or lay.dim != 0 or lay.ranks != want_ranks or lay.bounds != want_bounds:
                got = (
                    "no 1-D Shard placement" if lay is None else f"dim {lay.dim} over ranks {list(lay.ranks)}"
                )
                raise ValueError(
                    f"{prefix}{k}: many senders need each expert stack sharded on the expert dim (Shard(0)) "
                    f"over the senders that hold it {list(want_ranks)} in this order, each holding experts "
                    f"{[list(b) for b in want_bounds]}; got {got}"
                )
        elif not set(ranks) <= set(senders):
            raise ValueError(
                f"{prefix}{k}: a DTensor on ranks {list(ranks)}; many senders gather it on its owner among "
                f"the senders {list(senders)}, so its mesh must be made of senders"
            )


def collect_own(
    routes: LayerRoutes,
    t: int,
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    buf: torch.Tensor,
    *,
    senders: Sequence[int],
    gather_dtype: torch.dtype | None,
    device: torch.device,
    holders: Holders = None,
    check_finite: bool = True,
) -> tuple[LayerPlan, dict[str, torch.Tensor]]:
    """Sender ``t``'s share of one layer (``check_own_layer`` passed on every sender; ``plan`` and
    ``layer`` as ``trainer_view`` gives them; ``holders`` who holds the layer): ``own_inputs``, then
    ``convert_own`` into ``buf``. Returns the plan it converted (``glm_fp8.transfer.owners.sender_plan``:
    the layout of ``routes.local_plans[t]``) and the converted views by prefixed name (none when ``t``
    has nothing of this layer). Memory above ``buf``: the gathered sources of the entries ``t``
    owns and its rows of a split entry held otherwise than split alike, in the dtype they travel
    in. Every tensor, held or gathered, is quantized in the dtype the trainer holds it in (fp32
    masters from fp32: the same bytes as one sender's), unless the ``gather_dtype`` opt-in casts
    what travels first (``travel_dtypes``). ``check_finite=False``: no host read; the caller
    checks ``buf`` (``entry_norms``)."""
    local, inputs = own_inputs(
        routes, t, plan, layer, senders=senders, gather_dtype=gather_dtype, device=device, holders=holders
    )
    return local, convert_own(local, inputs, layer_prefix(routes.layer_idx), buf, check_finite=check_finite)


def convert_own(
    local: LayerPlan,
    inputs: Mapping[str, torch.Tensor],
    prefix: str,
    buf: torch.Tensor,
    *,
    check_finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Convert sender's share ``local`` from ``inputs`` (``own_inputs``) into ``buf``: the views by
    prefixed name (none when the share is empty). Kernels only, no collective: what a sender can
    capture as a CUDA graph (``glm_fp8.transfer.graphs``)."""
    if not local.entries:
        return {}
    # ``local`` is cut from ``plan`` (already adapted) and ``inputs`` are exactly its sources at its
    # rows: the keys, shapes and dtypes were checked on the whole layer; what the share adds is
    # where its tensors are (held ones as they are, gathered ones on ``device``).
    on = layer_device(local, inputs, prefix)
    views = convert_checked(
        inputs, local, prefix, out=buf[: local.nbytes], device=on, check_finite=check_finite
    )
    return dict(views)


def own_inputs(
    routes: LayerRoutes,
    t: int,
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    *,
    senders: Sequence[int],
    gather_dtype: torch.dtype | None,
    device: torch.device,
    holders: Holders = None,
) -> tuple[LayerPlan, dict[str, torch.Tensor]]:
    """What sender ``t`` converts of one layer (``check_own_layer`` passed on every sender): gather
    the sources of the entries each sender owns onto it (collective over each DTensor's mesh of
    senders, in the same order on each; a copy on a mesh without the owner stays where it is) and
    its rows of every split entry (its experts of every stack, its vocabulary slice). Returns its
    plan (``sender_plan``) and those sources by short name, plain tensors."""
    from torch.distributed.tensor import DTensor

    prefix = layer_prefix(routes.layer_idx)
    travel = travel_dtypes(plan, gather_dtype)
    owners_of = {
        s: converters(routes.owners, prefix + e.name)
        for e in plan.entries
        if prefix + e.name in routes.owners
        for s in e.sources
    }
    inputs: dict[str, torch.Tensor] = {}
    for k in sorted(owners_of):  # the same order on every sender: the gathers pair up
        x, owners = layer.get(k), owners_of[k]
        if x is None:  # not held here (checked on the owners: ``check_own_layer``)
            continue
        if not isinstance(x, DTensor):
            if t in owners:
                inputs[k] = x
            continue
        mesh = x.device_mesh.mesh.flatten().tolist()
        dtype = travel.get(k)
        if shard_layout(x) is None:  # replicated over its mesh, or sharded otherwise: gathered whole
            if any(senders[o] in mesh for o in owners):
                got = full_value(x, dtype)  # collective over the senders' mesh
                if t in owners:
                    inputs[k] = got.to(device)
            continue
        for owner in owners:  # onto each owner in its mesh, in the same order on every sender
            if senders[owner] not in mesh:
                continue  # a copy another mesh of senders gathers (a replica the owner is not in)
            out = torch.empty(x.shape, dtype=dtype or x.dtype, device=device) if owner == t else None
            got = gather_rows(x, 0, x.shape[0], senders[owner], out, dtype)
            if owner == t:
                inputs[k] = got.to(device)
    # Split entries: this sender's rows (its experts; its slice of the vocabulary). Plain tensors
    # are read at those rows, a DTensor sharded so holds them; otherwise each sender's rows are
    # gathered onto it.
    for e in split_entries(plan):
        rows = routes.splits[prefix + e.name]
        lo, hi = rows[t]
        if e.op == "scale":
            continue
        if not any(isinstance(layer.get(k), DTensor) for k in e.sources):
            if hi > lo:
                inputs.update(source_rows(plan, e.name, layer, lo, hi))
            continue
        held = entry_holders(holders, e.name, len(senders))
        split_alike = (tuple(senders[u] for u in held), tuple(rows[u] for u in held))
        for k in e.sources:
            x = layer.get(k)
            if x is None:
                continue
            lay = shard_layout(x)
            if lay is not None and lay.dim == 0 and (lay.ranks, lay.bounds) == split_alike:
                if hi > lo:
                    inputs[k] = x.to_local()  # its own rows: read in the dtype it holds, nothing travels
                continue
            for u, (a, b) in enumerate(rows):  # the same order on every sender
                if b > a:
                    mine = u == t
                    dtype = travel.get(k)
                    out = (
                        torch.empty((b - a, *x.shape[1:]), dtype=dtype or x.dtype, device=device)
                        if mine
                        else None
                    )
                    got = gather_rows(x, a, b, senders[u], out, dtype)
                    if mine:
                        inputs[k] = got
    local = sender_plan(plan, prefix, routes.splits, routes.owners, t, routes.last[t])
    # The routes' segments were placed against their own local plan: the share converted must lie
    # alike in the buffer (a direct segment is read from it), whatever the trainer layout's inputs.
    want = routes.local_plans[t]
    if [(e.name, e.offset) for e in local.entries] != [(e.name, e.offset) for e in want.entries]:
        raise RuntimeError(
            f"{prefix}: sender {t}'s share lays out {[e.name for e in local.entries]}, "
            f"its routes {[e.name for e in want.entries]} (a bug: the two must agree)"
        )
    return local, inputs

"""One trainer layer -> one broadcast-ready buffer of kernel-format (vLLM) tensors, one pass.

Quantized entries are written by the fused kernel at their offsets (a per-expert source, one
job per expert); row concatenations are copied row block by row block into their slot (no
``torch.cat`` temporary); passthrough tensors are copied in, converted to the entry's dtype.
The returned dict holds views into the one buffer, so the bytes that go on the wire are the
bytes the kernels wrote. Any trainer layout is read (docs/trainers.md#trainer-layouts).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Mapping

import torch

from glm_fp8.core import checks
from glm_fp8.core.errors import NonFiniteError
from glm_fp8.core.numerics import BLOCK, INPUT_DTYPES, ceil_blocks
from glm_fp8.kernels.jobs import Job, check_finite_tensors, plan_job, run_jobs
from glm_fp8.model.indexer import INDEXER_PREFIX
from glm_fp8.model.layer_plan import LayerPlan, PlanEntry
from glm_fp8.model.plans import plan_from_state_dict, unsent_keys, warn_unsent
from glm_fp8.model.trainer_layouts import adapt_plan, layer_prefix, strip_layer

_INDEXER_FULL = " (the plan's layer has an indexer: a full layer of the config's indexer schedule)"


def check_layer(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], prefix: str, only: Collection[str] | None = None
) -> torch.device | None:
    """Check a layer's tensors (short names, any trainer layout: ``plan`` is adapted to it)
    against ``plan``: ``check_layer_keys``, then passthrough sources of a floating dtype (any of
    bfloat16, float16, float32: they are converted to the entry's dtype as they are copied) and
    one device. Messages name ``prefix + key``. Returns the device (None: no tensor is read)."""
    return check_adapted_layer(adapt_plan(plan, layer, prefix=prefix), layer, prefix, only)


def check_adapted_layer(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], prefix: str, only: Collection[str] | None = None
) -> torch.device | None:
    """``check_layer`` for a ``plan`` already adapted to ``layer``'s trainer layout (``adapt_plan``,
    or ``glm_fp8.transfer.gather.trainer_view``) and a layer under short names: it adapts nothing,
    so that a sender adapts and checks each layer once, where it enters."""
    wanted = check_adapted_keys(plan, layer, prefix, only)
    check_source_dtypes(wanted, layer, prefix)
    return layer_device(plan, layer, prefix)


def check_source_dtypes(
    entries: Collection[PlanEntry], layer: Mapping[str, torch.Tensor], prefix: str
) -> None:
    """The sources of the passthrough ``entries`` (of a plan adapted to ``layer``) that ``layer``
    holds are of a floating dtype: each is converted to its entry's dtype as it is copied.
    TypeError naming ``prefix + key``."""
    for e in entries:
        if e.op in ("copy", "concat"):
            for s in e.sources:
                if s in layer and layer[s].dtype not in INPUT_DTYPES:
                    raise TypeError(
                        f"{prefix}{s}: expected a floating dtype (bfloat16, float16 or float32; written to "
                        f"{e.name} as {e.dtype}), got {layer[s].dtype}"
                    )


def layer_device(plan: LayerPlan, layer: Mapping[str, torch.Tensor], prefix: str) -> torch.device | None:
    """The one device of ``layer``'s tensors that ``plan`` (adapted to it) reads; None when it
    reads none. ValueError naming ``prefix + key`` for a second device."""
    named = [(prefix + k, t) for k, t in layer.items() if k in plan.inputs]
    return checks.check_same_device(named) if named else None


def check_layer_keys(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], prefix: str, only: Collection[str] | None = None
) -> list[PlanEntry]:
    """The part of ``check_layer`` that every trainer rank of a sharded layer decides alike
    (``plan`` adapted to the layer's trainer layout): ``only`` names entries of the plan, every
    key needed (the sources of the entries in ``only``, or of all; every expert's of a per-expert
    source), no unknown key, tensors with data, every (global) shape as planned. A tensor the
    engine has no parameter for (``glm_fp8.model.plans.unsent_keys``: indexer tensors on a layer
    the schedule shares, a routing bias the config's engine lacks) is not an error: it is left
    out, said once per process (``warnings.warn``). Returns the entries wanted (those in
    ``only``, or all; a weight's scale with it)."""
    return check_adapted_keys(adapt_plan(plan, layer, prefix=prefix), layer, prefix, only)


def check_adapted_keys(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    prefix: str,
    only: Collection[str] | None = None,
    needed: Collection[str] | None = None,
) -> list[PlanEntry]:
    """``check_layer_keys`` for a ``plan`` already adapted to ``layer``'s trainer layout and a
    layer under short names: it adapts nothing. ``needed``: the keys that must be present (a
    sender of many that reads only its share), instead of every source of the wanted entries."""
    wanted = wanted_entries(plan, only)
    needed = {s for e in wanted for s in e.sources} if needed is None else set(needed)
    missing = [k for k in plan.inputs if k in needed and k not in layer]
    if missing:
        shape = plan.inputs[missing[0]][0]
        hint = _INDEXER_FULL if missing[0].startswith(INDEXER_PREFIX) else ""
        raise KeyError(f"{prefix}{missing[0]}: missing; expected a tensor of shape {shape}{hint}")
    extra = sorted(set(layer) - set(plan.inputs))
    unsent = unsent_keys(plan.kind, extra)
    extra = [k for k in extra if k not in unsent]
    if extra:
        raise KeyError(
            f"{prefix}{extra[0]}: unexpected key; the plan of this {plan.kind} layer "
            f"({plan.layout} trainer layout) has no entry for it"
        )
    for k, (shape, _) in plan.inputs.items():
        t = layer.get(k)
        if t is None:
            continue
        checks.check_tensor(prefix + k, t)  # a dense tensor with data: not sparse, not meta
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{prefix}{k}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    warn_unsent(unsent, prefix)
    return wanted


def wanted_entries(plan: LayerPlan, only: Collection[str] | None) -> list[PlanEntry]:
    """The entries ``only`` selects (every one for None), in plan order; a quantized weight and
    its scale go together (one job writes both), whichever of them is named. ValueError naming a
    name that is not an entry of the plan."""
    if only is None:
        return list(plan.entries)
    if isinstance(only, str):
        raise TypeError(f"only: expected a collection of entry names, got the str {only!r}")
    names = set(only)
    unknown = sorted(names - {e.name for e in plan.entries})
    if unknown:
        raise ValueError(
            f"only: {unknown[0]!r} is not an entry of this {plan.kind} layer's plan (entries: "
            f"{', '.join(e.name for e in plan.entries)})"
        )
    entries = plan.entries
    for k, e in enumerate(entries):
        if e.op == "scale" and (e.name in names or entries[k - 1].name in names):
            names |= {e.name, entries[k - 1].name}
    return [e for e in entries if e.name in names]


def convert_layer(
    state_dict: Mapping[str, torch.Tensor],
    layer_idx: int,
    *,
    out: torch.Tensor | None = None,
    plan: LayerPlan | None = None,
    target: str | None = None,
    check_finite: bool = True,
    backend: str | None = None,
    only: Collection[str] | None = None,
) -> OrderedDict[str, torch.Tensor]:
    """Convert one trainer layer into kernel format inside one byte buffer.

    Args:
        state_dict: the layer's trainer tensors, in any trainer layout (prime-rl stacks, Hugging
            Face modules or per-expert checkpoint names; docs/trainers.md#trainer-layouts), under
            ``model.layers.{layer_idx}.`` names or short names (taken as this layer's; a key of
            another layer is refused); plain tensors on one device, any strides, each in the
            dtype the trainer holds it (bfloat16, float16 or float32).
        out: optional contiguous uint8 buffer of ``plan.nbytes`` bytes (a ring slot) whose
            address is a multiple of 16 bytes; allocated if None. The plan puts every entry
            at a multiple of 256 bytes from the start and views it as float32, int32, bfloat16
            or fp8, so each view is as aligned as the start (up to 256). 16 is a multiple of
            every dtype's element size (the largest, complex128, is 16), which ``.view(dtype)``
            and the device's loads need, and the width of a vector access, which the kernels
            and copies take at full speed; the allocators align a buffer far beyond it.
        plan: a ``LayerPlan`` (any trainer layout: it is adapted to the state dict's,
            ``glm_fp8.model.trainer_layouts.adapt_plan``); inferred from ``state_dict`` if None (cache
            it across updates).
        target: "hopper" (float32 scales) or "blackwell" (ue8m0 scales packed for DeepGEMM
            SM100). With a plan, must match the plan's target or be None.
        check_finite: raise ``NonFiniteError`` naming the tensor and element for NaN/Inf in a
            source; one flag for all the quantized entries. See "Errors" for what ``out`` holds.
        backend: as in ``quantize_blockwise``.
        only: write only these entries (kernel-format names without the prefix; a weight and
            its scale go together); the state dict then needs only their sources. A name that
            is not an entry of the plan is a ValueError. A sender that collects the expert
            stacks piece by piece writes the rest this way (``glm_fp8.transfer.gather``).

    Returns:
        ``{"model.layers.{i}.<kernel name>": view}`` in the plan's order (every entry, written
        or not), views into ``out``.

    Dtypes: a quantized entry is quantized from the dtype its sources are held in (a float32
    master from float32); a passthrough entry is written in the plan's dtype for it (for a plan
    from a config, the engine's: float32 for the routing bias and the indexer's k_norm) by one
    converting copy of each source: exact when widening, round-to-nearest-even when narrowing
    (as the engine's loader's ``copy_`` does).

    Errors: every argument and tensor check (keys, shapes, dtypes, devices, ``out``) and, with
    ``check_finite``, the NaN/Inf check of the passthrough sources run before any byte of
    ``out`` is written. The quantized sources' NaN/Inf check is the fused kernels' own flag,
    read once after they ran: when it fires, ``out`` holds every written entry of this call
    (passthrough entries exact; quantized entries written, the block holding the NaN/Inf with
    a non-finite scale and meaningless bytes; on Blackwell the packed scale entries not yet
    written) and must not be sent.

    Memory: above inputs and ``out``, the finite check's maximum of each passthrough source (a
    few bytes per entry); for Blackwell also the float32 scales before packing (O(number of
    blocks) bytes).
    """
    layer = strip_layer(state_dict, layer_idx)
    if plan is None:
        plan = plan_from_state_dict(layer, target=target or "hopper")
    elif target is not None and target != plan.target:
        raise ValueError(f"target: expected {plan.target!r} (the plan's target), got {target!r}")
    prefix = layer_prefix(layer_idx)
    plan = adapt_plan(plan, layer, prefix=prefix)
    device = check_adapted_layer(plan, layer, prefix, only)
    return convert_checked(
        layer, plan, prefix, out=out, device=device, check_finite=check_finite, backend=backend, only=only
    )


def convert_checked(
    layer: Mapping[str, torch.Tensor],
    plan: LayerPlan,
    prefix: str,
    *,
    out: torch.Tensor | None,
    device: torch.device | None,
    check_finite: bool = True,
    backend: str | None = None,
    only: Collection[str] | None = None,
) -> OrderedDict[str, torch.Tensor]:
    """``convert_layer`` past its checks of the layer: ``layer`` under short names, ``plan``
    adapted to it, both checked (``check_adapted_layer``, which gave ``device``; or, for a sender's
    share, the layer's checks on its whole and ``layer_device``). Only ``out`` is checked here
    (allocated on ``device`` when None), then the entries are written; views by ``prefix + name``."""
    inputs = [(prefix + k, t) for k, t in layer.items() if k in plan.inputs]
    if out is None:
        if device is None:
            raise ValueError(
                "state_dict: no tensor to convert (the entries in only need none); pass out= "
                "to give the buffer"
            )
        out = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    else:
        checks.check_out("out", out, (plan.nbytes,), torch.uint8, device or out.device)
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous uint8 buffer")
        checks.check_no_overlap([("out", out)], inputs)
        checks.check_aligned("out", out, checks.BUFFER_ALIGN, "the plan's views need it")
    return _fill_layer(layer, plan, out, prefix, check_finite, only, backend)


def _fill_layer(
    layer: Mapping[str, torch.Tensor],
    plan: LayerPlan,
    out: torch.Tensor,
    prefix: str,
    check_finite: bool,
    only: Collection[str] | None,
    backend: str | None,
) -> OrderedDict[str, torch.Tensor]:
    """Write the entries of ``plan`` (those ``only`` selects, or all) into ``out`` from
    already-validated tensors; returns every entry's view. Nothing is written before every job
    is planned (checked) and the passthrough sources are found finite."""
    views = OrderedDict((prefix + name, view) for name, view in plan.views(out))
    blackwell = plan.target == "blackwell"
    jobs: list[Job] = []
    packs: list[tuple[torch.Tensor, torch.Tensor]] = []
    entries = plan.entries
    wanted = wanted_entries(plan, only)
    scale_of = {e.name: entries[k + 1] for k, e in enumerate(entries) if e.op == "quantize"}
    for e in wanted:
        if e.op != "quantize":
            continue
        scale_entry = scale_of[e.name]
        q, scale_view = views[prefix + e.name], views[prefix + scale_entry.name]
        # Blackwell: float32 scales first, packed into the entry below.
        blocks = (*scale_entry.shape[:-2], ceil_blocks(e.shape[-2]), ceil_blocks(e.shape[-1]))
        scales = torch.empty(blocks, dtype=torch.float32, device=out.device) if blackwell else scale_view
        if e.per_expert:  # one job per expert: its sources are separate tensors
            for j, group in enumerate(e.groups()):
                srcs = [(prefix + s, layer[s]) for s in group]
                jobs.append(
                    plan_job(
                        srcs, q[j], scales[j], f"{prefix}{e.name}[{j}]", f"{prefix}{scale_entry.name}[{j}]"
                    )
                )
        else:
            srcs = [(prefix + s, _squeeze(layer[s], e.squeeze)) for s in e.sources]
            jobs.append(plan_job(srcs, q, scales, prefix + e.name, prefix + scale_entry.name))
        if blackwell:
            packs.append((scales, scale_view))
    passthrough = [e for e in wanted if e.op in ("copy", "concat")]
    if check_finite:
        check_finite_tensors([(prefix + s, layer[s]) for e in passthrough for s in e.sources])
    pairs = []
    for e in passthrough:
        dst = views[prefix + e.name]
        for j, group in enumerate(e.groups()):
            srcs = [_squeeze(layer[s], e.squeeze) for s in group]
            pairs += _row_pieces(dst[j] if e.per_expert else dst, srcs)
    if pairs:
        # One multi-tensor launch for all passthrough pieces instead of one each; it converts
        # each source to its destination's dtype.
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    if jobs:
        run_jobs(jobs, plan.scale_fmt, check_finite, None, backend)
    for scales, packed in packs:
        pack_ue8m0_sm100(scales, packed)
    return views


def _squeeze(t: torch.Tensor, squeeze: bool) -> torch.Tensor:
    return t[0] if squeeze and t.dim() == 3 and t.shape[0] == 1 else t


def _row_pieces(dst: torch.Tensor, sources: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source) pairs that lay sources one after another along dim -2 (dim 0
    for 1-D) of ``dst``: the concatenation is written piece by piece, never built."""
    dim = -2 if dst.dim() >= 2 else 0
    start = 0
    pieces = []
    for src in sources:
        n = src.shape[dim]
        pieces.append((dst.narrow(dim, start, n), src))
        start += n
    return pieces


def pack_ue8m0_sm100(scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """DeepGEMM SM100 scale layout from ue8m0 block scales (docs/layouts.md).

    ``scales`` [(G,) ceil(N/128), ceil(K/128)] float32 powers of two; ``out`` int32 view
    [(G,) N, ceil(ceil(K/128)/4)] with MN-major strides. Byte j of out[n, p] is the biased
    exponent of K-block 4p + j's scale for row n; missing K-blocks are 0.
    """
    n, p = out.shape[-2], out.shape[-1]
    exps = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # [(G,) nbn, nbk]
    nbk = exps.shape[-1]
    padded = torch.zeros((*exps.shape[:-1], 4 * p), dtype=torch.uint8, device=exps.device)
    padded[..., :nbk] = exps
    per_block_row = padded.view(*exps.shape[:-1], p, 4).view(torch.int32).squeeze(-1)  # [(G,) nbn, p]
    # Row n takes block-row n // 128; expand into the MN-major destination without a [N, P] temp.
    for rb in range(per_block_row.shape[-2]):
        rows = out.narrow(-2, rb * BLOCK, min(BLOCK, n - rb * BLOCK))
        rows.copy_(per_block_row[..., rb : rb + 1, :].expand_as(rows))
    return out


def check_finite_entries(
    plan: LayerPlan, buf: torch.Tensor, layer_idx: int, ops: tuple[str, ...] = ("scale", "copy", "concat")
) -> None:
    """Raise ``NonFiniteError`` if an entry of a filled layer buffer whose op is in ``ops`` holds
    NaN/Inf (a quantized entry's NaN/Inf shows in its scales): max |x| of every such entry in
    one multi-tensor reduction, one host read; no temporary beyond a float per entry. For
    buffers written piece by piece, where the kernels' own flag was not used."""
    raise_if_non_finite(entry_norms(plan, buf, ops), layer_idx)


def entry_norms(
    plan: LayerPlan, buf: torch.Tensor, ops: tuple[str, ...] = ("scale", "copy", "concat")
) -> tuple[list[str], torch.Tensor | None]:
    """The device half of ``check_finite_entries``: (entry names, max |x| of each, stacked),
    queued on the current stream with no host read, so that a pipeline can read it later."""
    floating = [(e.name, e.view(buf)) for e in plan.entries if e.op in ops and e.dtype.is_floating_point]
    if not floating:
        return [], None
    return [n for n, _ in floating], torch.stack(torch._foreach_norm([v for _, v in floating], float("inf")))


def raise_if_non_finite(
    norms: tuple[list[str], torch.Tensor | None],
    layer_idx: int,
    plan: LayerPlan | None = None,
    outcome: str = "the update was aborted",
) -> None:
    """The host half of ``check_finite_entries``: one read of ``entry_norms``' result; a
    ``NonFiniteError`` naming the first entry with NaN/Inf, and with ``plan`` (the one the norms
    were taken of) the trainer tensors it was made from."""
    names, values = norms
    if values is None or bool(torch.isfinite(values).all()):
        return
    bad = next(n for n, m in zip(names, values.tolist()) if not math.isfinite(m)).removesuffix("_scale_inv")
    prefix, srcs = layer_prefix(layer_idx), (bad,) if plan is None else plan.entry(bad).sources
    named = ", ".join(prefix + s for s in srcs[:4]) + (", ..." if len(srcs) > 4 else "")
    sources = "" if plan is None else f" ({named})"
    raise NonFiniteError(
        f"{prefix}{bad}: NaN or Inf in its sources{sources}; {outcome}",
        source=prefix + srcs[0],
        expert=None,
        block=None,
    )


__all__ = [
    "check_adapted_keys",
    "check_adapted_layer",
    "check_finite_entries",
    "check_layer",
    "check_layer_keys",
    "check_source_dtypes",
    "convert_checked",
    "convert_layer",
    "entry_norms",
    "layer_device",
    "pack_ue8m0_sm100",
    "raise_if_non_finite",
    "wanted_entries",
]

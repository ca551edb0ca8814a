"""Landing an update in an engine rank's parameters: what ``Receiver.load_into`` checks of them
before the first byte arrives, and the copies that write each received piece into them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core import checks
from glm_fp8.core.numerics import blocks_shape
from glm_fp8.engine.layout import copy_shard_into
from glm_fp8.engine.specs import EngineParam
from glm_fp8.kernels.quantize import quantize_blockwise
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.trainer_layouts import layer_prefix

# (engine dtype, wire dtype) pairs a landing converts exactly: plans given by the caller may carry
# a float32 engine parameter (indexer.k_norm, e_score_correction_bias) in bf16 or fp16.
WIDENING = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)}


@dataclass(frozen=True)
class Expected:
    """One parameter an update writes: its name in ``params``, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def expected_params(
    layer_ids: Sequence[int],
    plans: Sequence[LayerPlan],
    targets: Mapping[str, EngineParam] | None,
    bf16_params: Mapping[str, torch.Tensor] | None = None,
) -> list[Expected]:
    """Every parameter an update of ``plans`` writes: under vLLM's name (``targets``: kernel-format
    name -> engine parameter) or the kernel-format one (None). ``bf16_params``: in bf16 mode, an
    entry whose ``_scale_inv`` is among them lands quantized, as fp8 with its float32 scales."""
    out = []
    for layer_idx, plan in zip(layer_ids, plans):
        prefix = layer_prefix(layer_idx)
        for e in plan.entries:
            name, shape = prefix + e.name, tuple(e.shape)
            if targets is not None:
                if name not in targets:  # an entry of the indexer form this rank does not hold
                    continue
                t = targets[name]
                out.append(Expected(t.name, t.dtype, tuple(t.shape)))
            elif bf16_params is not None and name + "_scale_inv" in bf16_params:
                out.append(Expected(name, torch.float8_e4m3fn, shape))
                scale = blocks_shape(shape[-2], shape[-1], *shape[:-2])
                out.append(Expected(name + "_scale_inv", torch.float32, scale))
            else:
                out.append(Expected(name, e.dtype, shape))
    return out


def check_param(
    name: str, p: object, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params[{name!r}]: expected a torch.Tensor, got {type(p).__name__}")
    if tuple(p.shape) != shape or p.dtype != dtype:
        raise ValueError(f"params[{name!r}]: expected {dtype} {shape}, got {p.dtype} {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"params[{name!r}]: expected device {device} (the receiver's), got {p.device}")
    if p.requires_grad:
        raise ValueError(
            f"params[{name!r}]: requires grad; an in-place update needs plain tensors (pass "
            "p.detach() or the module's parameters under torch.no_grad() as .data)"
        )
    checks.check_no_self_overlap(f"params[{name!r}]", p)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.dtype, tuple(a.shape), a.stride()) == (
        b.data_ptr(),
        b.dtype,
        tuple(b.shape),
        b.stride(),
    )


def check_params(
    params: Mapping[str, torch.Tensor],
    expected: Sequence[Expected],
    device: torch.device,
    aliases: Mapping[str, str],
) -> None:
    """Every expected parameter is in ``params`` with its dtype, shape and device, needs no grad,
    has no element that aliases another (a stride-0 ``expand()`` view) and shares no byte with
    another expected parameter (two names bound to one tensor, overlapping or interleaved views:
    byte spans are compared), except each ``aliases`` name of the update, which must be the very
    tensor of the name it maps to (vLLM's MTP drafter holds the target's ``lm_head`` as its
    ``shared_head.head``) and is not written. Raises the first problem, naming the parameter."""
    names = {e.name for e in expected}
    for alias, target in aliases.items():
        if alias not in names:
            continue  # not part of this update
        if target not in params or alias not in params:
            raise KeyError(f"aliases: {alias!r} -> {target!r}: both must be in params")
        if not _same_view(params[alias], params[target]):
            raise ValueError(f"aliases: params[{alias!r}] is not the same tensor as params[{target!r}]")
    spans = []
    for e in expected:
        if e.name not in params:
            raise KeyError(f"params: missing {e.name!r} ({e.dtype}, {e.shape})")
        check_param(e.name, params[e.name], e.dtype, e.shape, device)
        if e.name not in aliases and params[e.name].numel():
            spans.append((*checks.byte_span(params[e.name]), e.name))
    spans.sort()
    for (lo, hi, name), (olo, ohi, other) in zip(spans, spans[1:]):
        if olo < hi:
            raise ValueError(
                f"params[{other!r}]: shares memory with params[{name!r}] (their byte spans overlap); "
                "each parameter an update writes must be its own tensor (declare a tensor held under "
                "two names in aliases=)"
            )
        del lo, ohi


def land_layer(
    views: Sequence[tuple[str, torch.Tensor, tuple[int, int] | None]],
    params: Mapping[str, torch.Tensor],
    targets: Mapping[str, EngineParam] | None,
    aliases: Mapping[str, str],
    *,
    full: bool,
    quantize_fmt: str | None = None,
) -> None:
    """Land one layer's ``(name, view, rows)`` pieces: into full-size parameters under the
    kernel-format names (``targets`` None; ``quantize_fmt``: bf16 mode, quantize into an fp8
    parameter that has a ``_scale_inv`` beside it), or into engine parameters, cutting this rank's
    shard from whole entries (``full``) or taking the cut pieces as they came. Aliases are skipped,
    and so is a whole entry that ``targets`` lacks: one of the indexer form this rank does not hold
    (an update of both forms; the receiver's ``_targets`` gave every other entry its parameter)."""
    for name, view, rows in views:
        if targets is not None and name not in targets:
            continue
        target = targets[name] if targets is not None else None
        key = target.name if target is not None else name
        if key in aliases:
            continue
        if target is None and quantize_fmt is not None and name + "_scale_inv" in params:
            quantize_blockwise(
                view,
                out=params[name],
                scale_out=params[name + "_scale_inv"],
                scale_fmt=quantize_fmt,
                check_finite=False,
            )
        elif target is None:
            land_full(params[name], view, rows)
        elif full:
            land_shard(params[key], view, target)
        else:
            land_piece(params[key], view, target, rows)


def land_full(dst: torch.Tensor, view: torch.Tensor, rows: tuple[int, int] | None) -> None:
    """A whole entry (or rows [a, b) of its dim 0) into a full-size parameter."""
    full_region(dst, rows).copy_(view)


def full_region(dst: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """The region of full-size parameter ``dst`` that a piece lands in: all of it, or rows [a, b)."""
    return dst if rows is None else dst.narrow(0, rows[0], rows[1] - rows[0])


def land_shard(dst: torch.Tensor, view: torch.Tensor, target: EngineParam) -> None:
    """This rank's cut of a whole received entry into its engine parameter (no full-size
    temporary; a widening entry is one small 1-D tensor, converted whole)."""
    if dst.dtype != view.dtype:
        view = view.to(dst.dtype)
    copy_shard_into(dst, view, target.shard)


def land_piece(
    dst: torch.Tensor, view: torch.Tensor, target: EngineParam, rows: tuple[int, int] | None
) -> None:
    """``view`` is already this rank's cut (no padding rows), landed in ``piece_region``. Many
    senders: padding rows are zeroed by ``zero_padding`` once per layer. One sender: the whole
    cut, padding zeroed here."""
    if dst.dtype != view.dtype:
        view = view.to(dst.dtype)
    piece_region(dst, target, rows).copy_(view)
    if rows is None and target.shard.kind != "replicated":
        zero_padding(dst, target)


def piece_region(dst: torch.Tensor, target: EngineParam, rows: tuple[int, int] | None) -> torch.Tensor:
    """The region of parameter ``dst`` that one piece of ``target`` lands in (a delta update
    rebuilds the piece from it): the rank's cut without padding rows; many senders: ``rows`` [a, b)
    of the full entry's dim 0 (experts, vocabulary rows), cut along its other dims, at the rank's
    rows for them."""
    shard = target.shard
    if rows is not None:
        cuts_rows = shard.cuts_rows(dst.dim())
        dst = dst.narrow(0, rows[0] - (shard.parts[0][0] if cuts_rows else 0), rows[1] - rows[0])
        if cuts_rows:  # the rank's own rows, whole
            return dst
    if shard.kind == "replicated":
        return dst
    return dst.narrow(shard.dim, 0, shard.length - shard.pad)


def zero_padding(dst: torch.Tensor, target: EngineParam) -> None:
    """Zero a padded parameter's padding rows (vocabulary rows past V)."""
    shard = target.shard
    if shard.pad:
        dst.narrow(shard.dim, shard.length - shard.pad, shard.pad).zero_()


__all__ = [
    "WIDENING",
    "Expected",
    "check_param",
    "check_params",
    "full_region",
    "land_full",
    "land_piece",
    "land_shard",
    "piece_region",
    "zero_padding",
]

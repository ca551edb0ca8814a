"""Pure-PyTorch block-FP8 quantization: the oracle every backend is compared against.

Implements docs/numerics.md literally and gives the same bits on CPU and CUDA:

- ``s = max(fl32(amax * C), fl32(1e-12))`` with ``C = fl32(1/448)``: a multiplication by an
  explicit float32 tensor, because ``tensor / python_scalar`` is a true division on the CPU
  but a multiplication by the reciprocal on CUDA, and GLM-5 was served with the latter.
- ``q = e4m3fn(RNE(clamp(fl32(W / s), -448, 448)))``: tensor-by-tensor division is IEEE on
  both devices, and the clamp comes first because eager PyTorch's fp8 cast does not saturate.

It favours clarity over memory: it upcasts and pads whole matrices. Use it to check, not to
ship a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from glm_fp8.core.numerics import (
    BLOCK,
    FP8_MAX,
    INPUT_DTYPES,
    INV_FP8_MAX_BITS,
    SCALE_FLOOR_BITS,
    ceil_blocks,
)
from glm_fp8.core.vocab import SCALE_FORMATS, check_choice
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.plans import squeezed
from glm_fp8.model.trainer_layouts import layer_prefix


def _f32_from_bits(bits: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32, device=device).view(torch.float32)[0]


def round_scale_up_to_pow2(s: torch.Tensor) -> torch.Tensor:
    """ue8m0: round positive float32 scales up to a power of two by bit arithmetic.

    A non-zero mantissa bumps the exponent and clears the mantissa. Non-finite values pass
    through unchanged (they mark a non-finite block, see ``quantize_blockwise_ref``).
    """
    bits = s.view(torch.int32)
    bumped = (bits & 0x7F800000) + 0x00800000
    rounded = torch.where((bits & 0x007FFFFF) != 0, bumped, bits).view(torch.float32)
    return torch.where(torch.isfinite(s), rounded, s)


def block_scales_ref(x: torch.Tensor, scale_fmt: str = "fp32") -> torch.Tensor:
    """Per-128x128-block scales ``s`` of a [R, C] or [E, R, C] tensor, float32."""
    xf, r, c = _padded_f32(x)
    e = xf.shape[0]
    blocks = xf.view(e, xf.shape[1] // BLOCK, BLOCK, xf.shape[2] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    s = amax * _f32_from_bits(INV_FP8_MAX_BITS, x.device)
    # torch.maximum propagates NaN, so a non-finite block keeps a non-finite scale.
    s = torch.maximum(s, _f32_from_bits(SCALE_FLOOR_BITS, x.device))
    if scale_fmt == "ue8m0":
        s = round_scale_up_to_pow2(s)
    return s if x.dim() == 3 else s[0]


def _padded_f32(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    e, r, c = x3.shape
    xf = x3.to(torch.float32)
    # Zero padding never changes a block's amax (|0| <= amax), so partial blocks are exact.
    pad_r, pad_c = ceil_blocks(r) * BLOCK - r, ceil_blocks(c) * BLOCK - c
    if pad_r or pad_c:
        xf = torch.nn.functional.pad(xf, (0, pad_c, 0, pad_r))
    return xf.reshape(e, xf.shape[1], xf.shape[2]), r, c


def quantize_blockwise_ref(x: torch.Tensor, scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a [R, C] matrix or [E, R, C] stack to fp8 e4m3fn with 128x128 block scales.

    Returns ``(q, s)``: ``q`` has ``x``'s shape and dtype ``torch.float8_e4m3fn``; ``s`` is
    float32 of shape [(E,) ceil(R/128), ceil(C/128)] with ``x ~= q * s`` blockwise.
    A block holding NaN or Inf gets a non-finite scale and NaN bytes, as eager PyTorch gives.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x: expected dtype bfloat16, float16 or float32, got {x.dtype}")
    check_choice("scale_fmt", scale_fmt, SCALE_FORMATS)
    s = block_scales_ref(x, scale_fmt)
    xf, r, c = _padded_f32(x)
    s3 = s if x.dim() == 3 else s.unsqueeze(0)
    s_full = s3.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    y = torch.clamp(xf / s_full, -FP8_MAX, FP8_MAX)
    # The byte's sign is x's sign bit (-0.0 -> 0x80), set explicitly so no device's cast of a
    # signed zero or NaN can differ.
    sign = torch.signbit(xf).to(torch.uint8) << 7
    q = ((y.to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F) | sign).view(torch.float8_e4m3fn)
    q = q[:, :r, :c]
    q = q if x.dim() == 3 else q[0]
    return q.contiguous(), s


def quantize_concat_ref(
    sources: Sequence[torch.Tensor], scale_fmt: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference applied to ``torch.cat(sources, dim=-2)``: what fused kernels must match."""
    return quantize_blockwise_ref(torch.cat(list(sources), dim=-2), scale_fmt)


def quantize_experts_ref(
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, scale_fmt: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM fused-MoE tensors ``(w13, w13_scale_inv, w2, w2_scale_inv)``, one expert at a time.

    This is the eager path a trainer runs today (concatenate, quantize per expert, stack).
    """
    w13, w13_s, w2q, w2_s = [], [], [], []
    for e in range(w1.shape[0]):
        q, s = quantize_concat_ref((w1[e], w3[e]), scale_fmt)
        w13.append(q)
        w13_s.append(s)
        q, s = quantize_blockwise_ref(w2[e], scale_fmt)
        w2q.append(q)
        w2_s.append(s)
    if not w13:
        e, i2, h = 0, w1.shape[1] + w3.shape[1], w1.shape[2]
        dev = w1.device
        return (
            torch.empty(e, i2, h, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(e, ceil_blocks(i2), ceil_blocks(h), device=dev),
            torch.empty(e, *w2.shape[1:], dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(e, ceil_blocks(w2.shape[1]), ceil_blocks(w2.shape[2]), device=dev),
        )
    return torch.stack(w13), torch.stack(w13_s), torch.stack(w2q), torch.stack(w2_s)


def dequantize_blockwise_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q * s`` blockwise, float32: for sanity checks and error measurements."""
    r, c = q.shape[-2], q.shape[-1]
    s_full = s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.to(torch.float32) * s_full[..., :r, :c]


def pack_ue8m0_sm100_ref(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """DeepGEMM SM100 scale values [(G,) N, ceil(nbk/4)] int32 (contiguous; layout aside)."""
    exps = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.int64)
    per_row = exps.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
    p = -(-per_row.shape[-1] // 4)
    per_row = torch.nn.functional.pad(per_row, (0, 4 * p - per_row.shape[-1]))
    b = per_row.view(*per_row.shape[:-1], p, 4)
    packed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # int64 -> int32 keeps the low 32 bits (two's complement), as the bytes say.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def convert_layer_ref(
    layer: Mapping[str, torch.Tensor], layer_idx: int, plan: LayerPlan, per_expert: bool = False
) -> dict[str, torch.Tensor]:
    """The eager composition a layer converter must match: ``torch.cat`` of each entry's
    sources (a per-expert entry: each expert's sources, then ``torch.stack``), then
    ``quantize_blockwise_ref`` on them in their own dtype (Blackwell: ue8m0, then the SM100
    packing); a passthrough entry is the concatenation cast to the entry's dtype (``.to``,
    round-to-nearest-even when narrowing). ``layer`` holds short trainer names in the plan's
    trainer layout.

    ``per_expert``: quantize each expert of a stack on its own and ``torch.stack`` the results,
    as prime-rl does (the same bits; the float32 temporaries are one expert's, not the stack's).
    """
    out = {}
    prefix = layer_prefix(layer_idx)
    fmt, packed = plan.scale_fmt, plan.target == "blackwell"
    pending = None
    for e in plan.entries:
        if e.op == "scale":
            s = pending
            out[prefix + e.name] = pack_ue8m0_sm100_ref(s, e.shape[-2]) if packed else s
            continue
        cats = []
        for group in e.groups():
            srcs = [squeezed(layer[s], e.squeeze) for s in group]
            cats.append(torch.cat(srcs, dim=-2 if srcs[0].dim() >= 2 else 0))
        if e.per_expert:
            cat = torch.stack(cats) if cats else torch.empty(e.shape, dtype=torch.float32)
        else:
            cat = cats[0]
        if e.op != "quantize":
            out[prefix + e.name] = cat.to(e.dtype)
        elif per_expert and cat.dim() == 3 and cat.shape[0]:
            per = [quantize_blockwise_ref(cat[k], fmt) for k in range(cat.shape[0])]
            out[prefix + e.name], pending = torch.stack([q for q, _ in per]), torch.stack([s for _, s in per])
        else:
            out[prefix + e.name], pending = quantize_blockwise_ref(cat, fmt)
    return out


# -- Delta encoding (docs/delta.md): the changes between two quantizations of one entry. --------------
# Blocks are taken in (expert, row block, column block) order. A block with n changed bytes out
# of v valid positions is sparse when 3 n <= v (an int16 in-block offset r * 128 + c and a uint8
# value per change, offsets ascending) and dense otherwise (all its v bytes, row-major over its
# valid rows and columns, no offsets). Scales travel as (int32 flat block index, float32) pairs.


def delta_block_sizes(shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Valid positions of every 128x128 block of a [(E,) R, C] entry, int64, flat block order."""
    e, r, c = (1, *shape) if len(shape) == 2 else tuple(shape)
    rows = (r - torch.arange(ceil_blocks(r), device=device) * BLOCK).clamp(max=BLOCK)
    cols = (c - torch.arange(ceil_blocks(c), device=device) * BLOCK).clamp(max=BLOCK)
    return (rows[:, None] * cols[None, :]).flatten().repeat(e)


def _blocked_u8(q: torch.Tensor) -> torch.Tensor:
    """fp8 bytes as uint8 [blocks, 128 * 128], zero padded, flat block order."""
    q3 = (q if q.dim() == 3 else q.unsqueeze(0)).view(torch.uint8)
    e, r, c = q3.shape
    nr, nc = ceil_blocks(r), ceil_blocks(c)
    padded = torch.zeros(e, nr * BLOCK, nc * BLOCK, dtype=torch.uint8, device=q.device)
    padded[:, :r, :c] = q3
    return padded.view(e, nr, BLOCK, nc, BLOCK).permute(0, 1, 3, 2, 4).reshape(e * nr * nc, BLOCK * BLOCK)


def _valid_mask(shape: Sequence[int], device: torch.device) -> torch.Tensor:
    e, r, c = (1, *shape) if len(shape) == 2 else tuple(shape)
    ones = torch.ones(e, r, c, dtype=torch.float8_e4m3fn, device=device)
    return _blocked_u8(ones) != 0


def delta_encode_ref(
    prev_q: torch.Tensor, prev_s: torch.Tensor, new_q: torch.Tensor, new_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The changes from ``(prev_q, prev_s)`` to ``(new_q, new_s)`` (same shapes):
    ``(counts int32 [blocks], positions int16 [P], values uint8 [V], scale_index int32 [S],
    scale_values float32 [S])``. ``counts`` is every block's number of changed bytes (dense
    blocks too); ``positions`` holds the sparse blocks' offsets, ``values`` every block's bytes
    in block order."""
    old, new = _blocked_u8(prev_q), _blocked_u8(new_q)
    changed = old != new  # padding is zero in both, so never "changed"
    counts = changed.sum(dim=1)
    dense = 3 * counts > delta_block_sizes(new_q.shape, new_q.device)
    positions = (changed & ~dense[:, None]).nonzero()[:, 1].to(torch.int16)
    send = torch.where(dense[:, None], _valid_mask(new_q.shape, new_q.device), changed)
    values = new[send]  # boolean indexing keeps row-major (block, offset) order
    sch = (prev_s.view(torch.int32) != new_s.view(torch.int32)).flatten()
    scale_index = sch.nonzero()[:, 0].to(torch.int32)
    return counts.to(torch.int32), positions, values, scale_index, new_s.flatten()[scale_index.long()]


def delta_apply_ref(
    prev_q: torch.Tensor,
    prev_s: torch.Tensor,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    scale_index: torch.Tensor,
    scale_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous ``(q, s)``: ``prev_q`` / ``prev_s`` with the changes of
    ``delta_encode_ref`` written in. Inputs are not modified; the encoding is trusted."""
    shape = prev_q.shape
    sizes = delta_block_sizes(shape, prev_q.device)
    counts = counts.long()
    dense = 3 * counts > sizes
    blocks = _blocked_u8(prev_q)
    send = torch.zeros_like(blocks, dtype=torch.bool)
    sparse_ids = torch.arange(len(counts), device=counts.device).repeat_interleave(
        torch.where(dense, 0, counts)
    )
    send.view(-1)[sparse_ids * BLOCK * BLOCK + positions.long()] = True
    send = torch.where(dense[:, None], _valid_mask(shape, prev_q.device), send)
    blocks[send] = values
    e, r, c = (1, *shape) if len(shape) == 2 else tuple(shape)
    nr, nc = ceil_blocks(r), ceil_blocks(c)
    q = blocks.view(e, nr, nc, BLOCK, BLOCK).permute(0, 1, 3, 2, 4).reshape(e, nr * BLOCK, nc * BLOCK)
    q = q[:, :r, :c].contiguous().view(torch.float8_e4m3fn).reshape(shape)
    s = prev_s.contiguous().clone()
    s.view(-1)[scale_index.long()] = scale_values
    return q, s


__all__ = [
    "block_scales_ref",
    "convert_layer_ref",
    "delta_apply_ref",
    "delta_block_sizes",
    "delta_encode_ref",
    "dequantize_blockwise_ref",
    "pack_ue8m0_sm100_ref",
    "quantize_blockwise_ref",
    "quantize_concat_ref",
    "quantize_experts_ref",
    "round_scale_up_to_pow2",
]

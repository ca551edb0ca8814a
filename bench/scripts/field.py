"""What the delta benchmarks share of the field's encodings of an FP8 change
(docs/delta.md#beside-the-field): ``delta_fraction.py`` counts their bytes over real AdamW steps,
``delta_apply.py`` times them on the trainer and on the engine. One definition each, so that both
measure the same encoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ZSTD_LEVEL = 1  # slime's and miles' level


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where the bytes of an element differ (any dtype), as bool of ``new``'s shape."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[new.element_size()]
    return new.view(ints) != old.view(ints)


def checkpoint_tensors(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The FP8 checkpoint's tensors (views) of a stacked entry ``name`` ("w13" or "w2") or of its
    scales: per expert ``gate_proj`` and ``up_proj`` (the halves of w13's rows) or ``down_proj``."""
    if name == "w13":
        half = t.shape[1] // 2
        return [part for e in t for part in (e[:half], e[half:])]
    return list(t)


@dataclass(frozen=True)
class SlimeDeltas:
    """slime's ``deltas`` encoding of one tensor: ``data``, the gaps between its ``count`` changed
    positions (the first from 0) as little-endian uint16, or uint32 when one exceeds 65535
    (``wide``), then the new values' bytes. Empty when nothing changed."""

    count: int
    wide: bool
    data: bytes


def slime_deltas(where: torch.Tensor, new: torch.Tensor) -> SlimeDeltas:
    """The ``deltas`` of ``new`` at the positions ``where`` (bool, ``new``'s shape) marks."""
    pos = where.flatten().nonzero().flatten()
    if not len(pos):
        return SlimeDeltas(0, False, b"")
    gaps = torch.diff(pos, prepend=pos.new_zeros(1))
    wide = int(gaps.max()) > 0xFFFF
    values = new.flatten()[pos].contiguous().view(torch.uint8)
    data = gaps.cpu().numpy().astype("<u4" if wide else "<u2").tobytes() + values.cpu().numpy().tobytes()
    return SlimeDeltas(len(pos), wide, data)

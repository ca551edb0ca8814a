"""Which engine ranks may take a layer as a delta (docs/delta.md#in-the-transfer).

A delta is exact only on the bytes it was computed against. Every update has a number; the sender
records per layer the update its kept copy is at (``KeptVersions``), each engine rank per layer
the update it holds (``HeldVersions``). A rank takes a layer's delta only when the two numbers are
equal; any other rank (restarted, newly added, behind after a failed update, or whose checksum
after applying differed) gets the layer dense, from the kept copy, in the same update. Nothing is
rolled back: a failed update leaves the kept copy ahead for the layers it compared, which makes
those layers dense next time.

A held vector travels as int64, ``NONE`` (-1) for a layer the rank does not hold as any update.
"""

from __future__ import annotations

import torch

NONE = -1


def _check_update(update: int) -> int:
    if isinstance(update, bool) or not isinstance(update, int) or update < 0:
        raise ValueError(f"update: expected an update number >= 0, got {update!r}")
    return update


class KeptVersions:
    """The sender's side: per layer position, the update its kept copy holds (``NONE``: no kept
    copy yet, so every rank gets the layer dense). Which ranks take a layer as a delta is decided
    from every rank's versions together: ``glm_fp8.transfer.delta.segments.delta_layers``."""

    def __init__(self, layers: int):
        self.kept = [NONE] * layers

    def compared(self, pos: int, update: int) -> None:
        """The kept copy of layer ``pos`` now holds update ``update`` (after quantize_compare,
        whatever then happens on the wire)."""
        self.kept[pos] = _check_update(update)


class HeldVersions:
    """An engine rank's side: per layer position, the update it holds."""

    def __init__(self, layers: int):
        self.held = [NONE] * layers

    def vector(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The held numbers as int64, for the vote before an update."""
        return torch.tensor(self.held, dtype=torch.int64, device=device)

    def writing(self, pos: int) -> None:
        """Layer ``pos`` is being written: until ``holds`` it is no update (a failure midway leaves
        it so)."""
        self.held[pos] = NONE

    def holds(self, pos: int, update: int) -> None:
        """Layer ``pos`` holds update ``update``: applied and its checksum equal to the sender's."""
        self.held[pos] = _check_update(update)


__all__ = ["NONE", "HeldVersions", "KeptVersions"]

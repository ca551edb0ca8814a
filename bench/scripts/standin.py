"""What the delta benchmarks share on the one-GPU stand-in link (``pipeline.py --delta-lr``,
``engine_rank.py --delta``): the stand-in trainer step and the versions exchange of a link with no
peers."""

from __future__ import annotations

import torch

STEP_CHUNK = 2**26  # elements of one chunk of the stand-in trainer step (its randn: 256 MiB fp32)


def trainer_step(shadow: dict, masters: dict, lr: float, gen: torch.Generator) -> None:
    """The stand-in for an optimizer step: ``w32 -= lr * sign(randn)`` on each fp32 ``shadow``
    (a mixed-precision trainer's master), ``STEP_CHUNK`` elements at a time along dim 0 (no
    full-size temporary), each master copied from it (cast to its dtype) unless it is its own
    shadow. It moves every weight by ``lr``, as Adam's normalized step does at most; the changed
    fractions of real AdamW steps are bench/scripts/delta_fraction.py's."""
    for name, w32 in shadow.items():
        master = masters[name]
        whole = w32.dim() == 0
        w, m = (w32.view(1), master.view(1)) if whole else (w32, master)
        rows = max(1, STEP_CHUNK // max(1, w[0].numel()))
        for a in range(0, w.shape[0], rows):
            part = w[a : a + rows]
            part.sub_(torch.randn(part.shape, generator=gen, device=part.device).sign_(), alpha=lr)
            if master is not w32:
                m[a : a + rows].copy_(part)


def versions_in_step(tensor: torch.Tensor, rank: int, size: int) -> None:
    """A stand-in link's ``all_reduce_max`` of the delta versions table (int64 [link size,
    layers + 1], each rank's row: ``SenderDelta.begin``; votes are 1-D and left alone): every row
    becomes ``rank``'s, as if every engine rank held what this sender last sent and every other
    sender kept the same versions. A rank out of step would take that layer dense, with the ranks
    that share a broadcast with it (tests/transfer/test_delta_transfer.py checks that on gloo);
    this measures the steady state."""
    if tensor.dim() == 2 and tensor.shape[0] == size:
        tensor.copy_(tensor[rank].clone().expand_as(tensor))  # no self-overlapping copy

"""What the delta benchmarks share on the one-GPU stand-in link (``pipeline.py --delta-lr``,
``engine_rank.py --delta``): the stand-in trainer step and the versions exchange of a link with no
peers."""

from __future__ import annotations

import torch

STEP_CHUNK = 2**26  # elements of one chunk of the stand-in trainer step (its randn: 256 MiB fp32)


# Adam's direction m_hat / sqrt(v_hat) (betas 0.9, 0.999) for gradients drawn i.i.d. N(0, 1), once
# its moments are warm: m ~ N(0, (1 - 0.9) / (1 + 0.9)), v ~ 1. A simulation of those moments
# (1e6 weights) gives a mean |direction| of 1.0 at step 1 (sign(g)), 0.27 at step 10, 0.21 at step
# 20 and 0.19 at step 30, against 0.183 for this Gaussian.
ADAM_STEADY_STD = ((1 - 0.9) / (1 + 0.9)) ** 0.5
STEPS = ("sign", "adam")


def trainer_step(shadow: dict, masters: dict, lr: float, gen: torch.Generator, step: str = "sign") -> None:
    """The stand-in for an optimizer step on each fp32 ``shadow`` (a mixed-precision trainer's
    master): ``sign``, ``w32 -= lr * sign(randn)``, Adam's first step (every weight moves by lr,
    the most Adam's normalized step moves it; real AdamW's worst step in delta_fraction.py's runs);
    ``adam``, ``w32 -= lr * ADAM_STEADY_STD * randn``, Adam's step once warm (a typical weight
    moves by about a fifth of lr, as in the later steps of those runs). ``STEP_CHUNK`` elements at
    a time along dim 0 (no full-size temporary), each master copied from it (cast to its dtype)
    unless it is its own shadow. Real gradients carry signal: the changed fractions of real AdamW
    steps are bench/scripts/delta_fraction.py's."""
    if step not in STEPS:
        raise ValueError(f"step: expected one of {STEPS}, got {step!r}")
    for name, w32 in shadow.items():
        master = masters[name]
        whole = w32.dim() == 0
        w, m = (w32.view(1), master.view(1)) if whole else (w32, master)
        rows = max(1, STEP_CHUNK // max(1, w[0].numel()))
        for a in range(0, w.shape[0], rows):
            part = w[a : a + rows]
            noise = torch.randn(part.shape, generator=gen, device=part.device)
            if step == "sign":
                part.sub_(noise.sign_(), alpha=lr)
            else:
                part.sub_(noise, alpha=lr * ADAM_STEADY_STD)
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

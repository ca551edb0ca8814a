"""The eager reference as a backend (``"torch"``): any device, one expert at a time, copied into
the caller's views. For checks and CPU-only machines, not for speed."""

from __future__ import annotations

import torch

from glm_fp8.kernels.reference import quantize_concat_ref


def launch(work, ue8m0: bool, nonfinite: torch.Tensor | None, config: object = None) -> None:
    """The reference, one expert at a time, copied into the caller's views."""
    for sources, q, s in work:
        for e in range(q.shape[0]):
            q_e, s_e = quantize_concat_ref([src[e] for src in sources], "ue8m0" if ue8m0 else "fp32")
            q[e].view(torch.uint8).copy_(q_e.view(torch.uint8))
            s[e].copy_(s_e)
            if nonfinite is not None:
                nonfinite.bitwise_or_((~torch.isfinite(s_e)).any().to(torch.int32))

"""The public face of the quantizer: ``quantize_blockwise`` (any 2-D or stacked weight from up
to four row sources), ``quantize_experts`` (a layer's routed experts into vLLM's fused-MoE
layout, ``ExpertsFP8``). Each checks every argument first, then runs its jobs on a backend
(``glm_fp8.kernels.jobs``, ``glm_fp8.kernels.backends``): the Triton kernel, the CUDA C++ kernel of the same
name in ``csrc/``, or the reference; every backend writes the bits of docs/numerics.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core import checks
from glm_fp8.core.numerics import ceil_blocks
from glm_fp8.kernels.jobs import plan_job, run_jobs
from glm_fp8.kernels.triton_quantize import LaunchConfig, check_config


def quantize_blockwise(
    sources: torch.Tensor | Sequence[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    scale_fmt: str = "fp32",
    check_finite: bool = True,
    config: LaunchConfig | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``torch.cat(sources, dim=-2)`` to fp8 e4m3fn with 128x128 block scales.

    Args:
        sources: one tensor or up to four, all 2-D [R_k, C] or all 3-D [E, R_k, C], of one
            dtype (bfloat16, float16 or float32) and device, any strides. They are read in
            place: no concatenation, ``.contiguous()`` or dtype conversion happens.
        out: optional float8_e4m3fn [(E,) sum R_k, C] buffer (any strides, a view is fine).
        scale_out: optional float32 [(E,) ceil(R/128), ceil(C/128)] buffer.
        scale_fmt: "fp32" (Hopper) or "ue8m0" (scales rounded up to powers of two, Blackwell).
        check_finite: raise ``NonFiniteError`` naming the source, expert and block when an
            input holds NaN/Inf. This synchronizes with the device once. With False nothing is
            checked and a non-finite value poisons its own block only: that block's scale is NaN
            or Inf and its bytes are meaningless (NaN or 0); every other block is exact.

    Returns:
        ``(q, scale)``, bit-identical to ``glm_fp8.kernels.reference.quantize_concat_ref``.

    Memory: writes ``out``/``scale_out`` in place and touches no byte outside them; with both
    given it allocates nothing (the finite check's int32 flag is allocated by a thread's first
    call on a device and kept). Without them it allocates exactly the outputs. On an error
    from the finite check the outputs hold the poisoned block; argument errors are raised
    before anything is written.

    ``backend``: "auto", "triton", "cuda" (the compiled extension) or "torch" (the eager
    reference; allocates the concatenation and float32 temporaries of one expert at a time);
    None takes ``glm_fp8.get_default_backend()``. Every backend gives the same bits.
    ``config`` tunes the Triton launch (``LaunchConfig``); None picks the measured default for
    the input dtype. Every config gives the same bits.
    """
    checks.check_scale_fmt(scale_fmt)
    named = checks.named_sources(sources)
    check_config(config)
    job = plan_job(named, out, scale_out, "out", "scale_out")
    checks.check_no_overlap([("out", job.q), ("scale_out", job.s)], named)
    run_jobs([job], scale_fmt, check_finite, config, backend)
    return job.q, job.s


@dataclass(frozen=True)
class ExpertsFP8:
    """A layer's routed experts in vLLM's fused-MoE fp8 layout (docs/layouts.md).

    w13 [E, 2I, H] float8_e4m3fn (rows [0, I) gate = w1, [I, 2I) up = w3),
    w13_scale_inv [E, ceil(2I/128), ceil(H/128)] float32,
    w2 [E, H, I] float8_e4m3fn, w2_scale_inv [E, ceil(H/128), ceil(I/128)] float32.
    """

    w13: torch.Tensor
    w13_scale_inv: torch.Tensor
    w2: torch.Tensor
    w2_scale_inv: torch.Tensor

    @classmethod
    def empty(
        cls, experts: int, hidden: int, intermediate: int, device: torch.device | str = "cuda"
    ) -> ExpertsFP8:
        """Allocate the four outputs (uninitialized) for E experts, hidden H, intermediate I."""
        e, h, i = experts, hidden, intermediate
        return cls(
            torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(e, ceil_blocks(2 * i), ceil_blocks(h), dtype=torch.float32, device=device),
            torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(e, ceil_blocks(h), ceil_blocks(i), dtype=torch.float32, device=device),
        )

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(vLLM parameter suffix, tensor)`` pairs, e.g. ``("w13_weight", w13)``."""
        yield "w13_weight", self.w13
        yield "w13_weight_scale_inv", self.w13_scale_inv
        yield "w2_weight", self.w2
        yield "w2_weight_scale_inv", self.w2_scale_inv

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.items())


def quantize_experts(
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    out: ExpertsFP8 | None = None,
    scale_fmt: str = "fp32",
    check_finite: bool = True,
    config: LaunchConfig | None = None,
    backend: str | None = None,
) -> ExpertsFP8:
    """Quantize one layer's routed experts into vLLM's fused-MoE fp8 tensors, all experts at once.

    Args:
        w1, w3: gate and up projections, [E, I, H]; w2: down projection, [E, H, I]. bfloat16,
            float16 or float32 (w1 and w3 alike), any strides (a transposed [E, H, I] view
            of w1 is read as it is).
        out: optional ``ExpertsFP8`` of caller buffers (views into a larger buffer are fine).
        scale_fmt, check_finite, config, backend: as in ``quantize_blockwise``.

    Two jobs, w13 from the concatenation [w1; w3] per expert (no ``torch.cat``) and w2: one
    launch on the CUDA backend (when the dtypes match), two on Triton. Every argument is
    checked before the first launch. Memory as in
    ``quantize_blockwise``: with ``out`` nothing is allocated; without it, exactly the outputs.
    """
    checks.check_scale_fmt(scale_fmt)
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        checks.check_input(name, t, ndim=3)
    checks.check_same_device([("w1", w1), ("w3", w3), ("w2", w2)])
    if w3.shape != w1.shape:
        raise ValueError(f"w3: expected shape {tuple(w1.shape)} (as w1), got {tuple(w3.shape)}")
    e, i, h = w1.shape
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"w2: expected shape {(e, h, i)} ([E, H, I] with E, I, H from w1), got {tuple(w2.shape)}"
        )
    if out is not None and not isinstance(out, ExpertsFP8):
        raise TypeError(f"out: expected an ExpertsFP8, got {type(out).__name__}")
    check_config(config)
    o = out or ExpertsFP8(None, None, None, None)  # type: ignore[arg-type]
    j13 = plan_job([("w1", w1), ("w3", w3)], o.w13, o.w13_scale_inv, "out.w13", "out.w13_scale_inv", True)
    j2 = plan_job([("w2", w2)], o.w2, o.w2_scale_inv, "out.w2", "out.w2_scale_inv", True)
    checks.check_no_overlap(
        [("out.w13", j13.q), ("out.w13_scale_inv", j13.s), ("out.w2", j2.q), ("out.w2_scale_inv", j2.s)],
        [("w1", w1), ("w3", w3), ("w2", w2)],
    )
    run_jobs([j13, j2], scale_fmt, check_finite, config, backend)
    return ExpertsFP8(j13.q, j13.s, j2.q, j2.s)


__all__ = ["ExpertsFP8", "quantize_blockwise", "quantize_experts"]

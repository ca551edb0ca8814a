"""Launching ``quantize_blockwise_kernel``: its tuning knobs (``LaunchConfig``), the kept
compiled kernels for direct launches, and ``launch``, the Triton backend's entry in
``glm_fp8.backends.LAUNCHERS``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from glm_fp8._checks import check_int
from glm_fp8.kernels import interpreting
from glm_fp8.kernels.triton_quantize import quantize_blockwise_kernel, quantize_blockwise_kernel_unaligned_out
from glm_fp8.numerics import BLOCK, MAX_SOURCES, ceil_blocks


def _stores_vectorize(q: torch.Tensor) -> bool:
    """Whether Triton can prove 16-byte alignment for every row of the [E, R, C] fp8 output:
    it specializes pointers and integer arguments on divisibility by 16."""
    return q.stride(2) == 1 and q.data_ptr() % 16 == 0 and q.stride(1) % 16 == 0 and q.stride(0) % 16 == 0


@dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs of ``quantize_blockwise_kernel``; the defaults are the measured best on an
    H200 from bf16 and from float32 (``bench/scripts/sweep.py``, bench/RESULTS.md); float16
    takes the bf16 code path. Every config gives the same bits."""

    cb_per_prog: int = 1  # grid mode: 128x128 tiles per program, along a row block
    num_warps: int = 8
    # Register cap per thread (ptxas .maxnreg), None: the compiler's choice. A program keeps a
    # whole 128x128 tile in registers, so the cap decides how many programs share a
    # multiprocessor: uncapped, 8 warps took 163 (float32) to 221 (bf16) registers, one
    # program per SM; 80 fits three, unspilled at 8 warps (fewer warps need a higher cap).
    maxnreg: int | None = 80
    # Persistent mode when > 0: this many programs per multiprocessor loop over all tiles,
    # software-pipelined num_stages deep. 0: one program per cb_per_prog tiles.
    programs_per_sm: int = 0
    num_stages: int = 1
    # x / s as one reciprocal per block plus two FMA corrections (correctly rounded, cheaper
    # than an IEEE division per element); False uses tl.math.div_rn per element.
    fma_div: bool = True
    # Encode e4m3 with integer arithmetic instead of the hardware cvt. None: only under
    # TRITON_INTERPRET=1, whose fp8 cast does not round to nearest-even (docs/numerics.md#traps).
    soft_fp8: bool | None = None
    # x / s from x itself (the sign bit put back on the byte) rather than from |x|: the same
    # bits, with only x live after the amax (float32, 8 warps: 163 -> 80 registers unspilled).
    signed_quotient: bool = True

    def __post_init__(self) -> None:
        """Refuse at construction what the launch would refuse late (triton asserts a power-of-two
        warp count when it compiles) or what ptxas would quietly not honour (a register cap)."""
        for name, kind, optional in _FIELD_KINDS:
            value = getattr(self, name)
            fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if fits or (value is None and optional):
                continue
            want = ("a bool" if kind is bool else "an int") + (" or None" if optional else "")
            raise TypeError(f"config.{name}: expected {want}, got {value!r} ({type(value).__name__})")
        check_int("config.cb_per_prog", self.cb_per_prog, 1)
        w = self.num_warps
        if not (1 <= w <= _MAX_WARPS and w & (w - 1) == 0):
            raise ValueError(f"config.num_warps: expected a power of two in [1, {_MAX_WARPS}], got {w}")
        lo, hi = _MAXNREG_RANGE
        if self.maxnreg is not None and not lo <= self.maxnreg <= hi:
            raise ValueError(f"config.maxnreg: expected None or an int in [{lo}, {hi}], got {self.maxnreg}")
        check_int("config.programs_per_sm", self.programs_per_sm, 0)
        check_int("config.num_stages", self.num_stages, 1)


# (field, type, None allowed) of every LaunchConfig field; bool is not taken for an int.
_FIELD_KINDS = (
    ("cb_per_prog", int, False), ("num_warps", int, False), ("maxnreg", int, True),
    ("programs_per_sm", int, False), ("num_stages", int, False), ("fma_div", bool, False),
    ("soft_fp8", bool, True), ("signed_quotient", bool, False),
)  # fmt: skip
# A program is one CTA of 32 * num_warps threads: triton asserts a power of two, and a CTA holds
# at most 1024 threads (beyond, triton raises OutOfResources "threads" when it loads the kernel).
_MAX_WARPS = 32
# ptxas .maxnreg: 255 registers is the per-thread maximum (sm_35 onwards), and a cap under the
# ABI minimum is raised to it without a word. On the H200 (triton 3.6) this kernel compiled with
# maxnreg 8 or 16 used 24 registers (spilling), and with 256 or 1000 as uncapped (170).
_MAXNREG_RANGE = (16, 255)


def check_config(config: object) -> None:
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config: expected a LaunchConfig or None, got {type(config).__name__}")


# One tile per 8-warp program capped at 80 registers: the sweep's best from bf16 and from
# float32 on the H200 (bench/RESULTS.md has the figures).
DEFAULT_CONFIG = LaunchConfig()


def default_config(dtype: torch.dtype) -> LaunchConfig:
    """The launch config used when a call passes none; one for every input dtype today."""
    return DEFAULT_CONFIG


# Launch path. triton's JIT front end re-derives the specialization of all ~40 arguments on
# every call, about twice the host time of the direct launch below (bench/RESULTS.md, host
# time per call), which matters for small layers. ``launch_triton`` keeps the compiled kernel
# per exact specialization key instead and calls it directly. The key holds everything triton
# specializes on: the integer arguments themselves (so their ==1 / %16 / width classes), each
# pointer's address mod 16, the input dtype, the constexprs and the compile options. So equal
# keys mean the same compiled kernel. ``CompiledKernel[grid](*args)`` takes every argument in
# signature order, as the JIT front end passes them, on the triton versions listed here (read
# in their sources; 3.6 ran on the H200); others take the JIT path on every call.
_DIRECT_LAUNCH_TRITON = ("3.6", "3.7", "3.8", "3.9")
_direct_launch = (
    ".".join(triton.__version__.split(".")[:2]) in _DIRECT_LAUNCH_TRITON
    and os.environ.get("GLM_FP8_TRITON_DIRECT_LAUNCH", "1") != "0"
)
_compiled_kernels: dict[tuple, object] = {}
_MAX_COMPILED_KERNELS = 4096  # distinct shapes/strides/alignments; cleared when exceeded


_CONSTEXPR_NAMES = ("NUM_SRC", "ROW_GATHER", "CB_PER_PROG", "PERSISTENT", "STAGES", "UE8M0", "SOFT_FP8",
                    "FMA_DIV", "NAN_MAX", "FLAG", "SIGNED_Y", "PAIRED_CVT", "BR", "BC")  # fmt: skip


def _launch_args(
    sources: Sequence[torch.Tensor], q: torch.Tensor, s: torch.Tensor, nonfinite: torch.Tensor | None
) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Pointer tensors (q, scale, flag, four sources) and integer arguments, in signature order;
    the integers end with the experts, row blocks and column blocks."""
    e, r, c = q.shape
    padded = list(sources) + [sources[0]] * (MAX_SOURCES - len(sources))
    bounds = []
    row = 0
    for src in sources[:-1]:
        row += src.shape[1]
        bounds.append(row)
    bounds += [r] * (MAX_SOURCES - len(sources))
    ints = (*bounds, r, c, *(st for src in padded for st in src.stride()), *q.stride(), *s.stride(),
            e, ceil_blocks(r), ceil_blocks(c))  # fmt: skip
    return [q, s, s if nonfinite is None else nonfinite, *padded], ints


def launch_triton(
    sources: Sequence[torch.Tensor],
    q: torch.Tensor,
    s: torch.Tensor,
    ue8m0: bool,
    nonfinite: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> None:
    """Launch over already-validated 3-D views: sources [E, R_k, C], q [E, R, C], s [E, Rb, Cb];
    ``nonfinite`` (int32 [1]) is set to 1 if a block's scale is NaN/Inf."""
    config = config or default_config(sources[0].dtype)
    tensors, ints = _launch_args(sources, q, s, nonfinite)
    e, n_rb, n_cb = ints[-3:]  # experts, row blocks, column blocks
    n_tiles = e * n_rb * n_cb
    if n_tiles == 0:
        return
    interpret = interpreting()
    if not interpret and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # compiled kernels and streams belong to one device
            return launch_triton(sources, q, s, ue8m0, nonfinite, config)
    if config.programs_per_sm > 0:
        sms = 4 if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = min(n_tiles, config.programs_per_sm * sms)
    else:
        grid = e * n_rb * -(-n_cb // config.cb_per_prog)
    soft_fp8 = interpret if config.soft_fp8 is None else config.soft_fp8
    # Row gather needs row-major sources: with a column stride other than 1 (a transposed
    # view) Triton 3.6 vectorized the per-row pointers across a source boundary (seen on H200).
    row_gather = all(src.stride(2) == 1 and src.stride(1) != 1 for src in sources)
    # Two elements per fp8 cvt only where the tile's layout is the store's (row-major sources
    # and output rows): elsewhere ptxas miscompiled the paired cvt (triton_quantize.py). A row
    # stride of 1 too (a one-column output) is excluded: Triton specializes integer arguments
    # equal to 1, the store then looks contiguous along rows and took the other layout (H200).
    paired_cvt = row_gather and q.stride(2) == 1 and q.stride(1) != 1
    # In signature order after the integers (_CONSTEXPR_NAMES).
    constexprs = (len(sources), row_gather, config.cb_per_prog, config.programs_per_sm > 0,
                  config.num_stages, ue8m0, soft_fp8, config.fma_div, not interpret, nonfinite is not None,
                  config.signed_quotient, paired_cvt, BLOCK, BLOCK)  # fmt: skip
    aligned_out = _stores_vectorize(q)
    kernel = quantize_blockwise_kernel if aligned_out else quantize_blockwise_kernel_unaligned_out
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    if interpret or not _direct_launch:
        _jit_launch(kernel, grid, tensors, ints, constexprs, options)
        return
    ptrs = [t.data_ptr() for t in tensors]
    key = (aligned_out, q.device.index, sources[0].dtype, constexprs, config.num_warps, config.num_stages,
           config.maxnreg, ints, tuple(p & 15 for p in ptrs))  # fmt: skip
    compiled = _compiled_kernels.get(key)
    if compiled is None:
        compiled = _jit_launch(kernel, grid, tensors, ints, constexprs, options)
        if hasattr(compiled, "result"):  # triton's asynchronous compile mode hands back a future
            compiled = compiled.result()
        if len(_compiled_kernels) >= _MAX_COMPILED_KERNELS:
            _compiled_kernels.clear()
        _compiled_kernels[key] = compiled
        return
    # Raw addresses: the launcher then skips a data_ptr() call and a driver query per pointer.
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    compiled[(grid, 1, 1)](*ptrs, *ints, *constexprs, stream=stream)


def _jit_launch(
    kernel: triton.runtime.JITFunction,
    grid: int,
    tensors: list[torch.Tensor],
    ints: tuple[int, ...],
    constexprs: tuple,
    options: dict,
) -> object:
    """The launch through triton's JIT front end (compiles on a new specialization)."""
    q, *rest = tensors
    return kernel[(grid,)](
        q.view(torch.uint8), *rest, *ints, **dict(zip(_CONSTEXPR_NAMES, constexprs)), **options,
        enable_fp_fusion=False,  # no contraction may change a rounding docs/numerics.md fixes
    )  # fmt: skip


def launch(work, ue8m0: bool, nonfinite: torch.Tensor | None, config: LaunchConfig | None) -> None:
    """The Triton backend: one launch per job of ``work`` (validated 3-D views)."""
    for sources, q, s in work:
        launch_triton(sources, q, s, ue8m0, nonfinite, config)

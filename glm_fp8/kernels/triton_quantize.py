"""The Triton backend: the kernel ``quantize_blockwise_kernel`` and its launcher, side by side.

The kernel quantizes w13, w2 and every 2-D weight. Each program reads 128x128 tiles of a
row-concatenation of up to four sources (w13 = [w1; w3] is two sources), takes the block amax,
and writes the fp8 bytes and the block scale straight into the output tensors. The concatenation
never exists; a block that straddles two sources reads rows from both. Numerics:
docs/numerics.md, bit for bit (``glm_fp8.kernels.reference``).

The launcher: the kernel's tuning knobs (``LaunchConfig``), the kept compiled kernels for direct
launches, and ``launch``, the Triton backend's entry in ``glm_fp8.kernels.backends``. The delta
kernels (``glm_fp8.kernels.triton_delta``) share the tile's math (``load_concat``,
``block_scale_code``) and the launch arguments (``launch_args``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm_fp8.core.checks import check_int
from glm_fp8.core.numerics import BLOCK, INV_FP8_MAX_BITS, MAX_SOURCES, SCALE_FLOOR_BITS, ceil_blocks


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Bit patterns as constexpr globals, so the kernel builds fl32(1/448) and fl32(1e-12) exactly.
_INV_FP8_MAX_BITS = tl.constexpr(INV_FP8_MAX_BITS)
_SCALE_FLOOR_BITS = tl.constexpr(SCALE_FLOOR_BITS)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _load_source_rows(x, p_src, i_e, r_lo, r_hi, o_r, o_c, m_c, s_e, s_r, s_c):
    """Overwrite the rows of ``x`` that fall in source rows [r_lo, r_hi) of the concatenation."""
    m_r = (o_r >= r_lo) & (o_r < r_hi)  # [BR]
    p_x = p_src + i_e * s_e + (o_r - r_lo)[:, None] * s_r + o_c[None, :] * s_c  # [BR, BC]
    b_x = tl.load(p_x, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    # where, not +: adding a masked 0.0 would turn a -0.0 element into +0.0.
    return tl.where(m_r[:, None], b_x, x)


@triton.jit
def load_concat(
    i_e,
    o_r,
    o_c,
    m_c,
    p_x0,
    p_x1,
    p_x2,
    p_x3,
    r1,
    r2,
    r3,
    R,
    s_x0e,
    s_x0r,
    s_x0c,
    s_x1e,
    s_x1r,
    s_x1c,
    s_x2e,
    s_x2r,
    s_x2c,
    s_x3e,
    s_x3r,
    s_x3c,
    NUM_SRC: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """Rows ``o_r``, columns ``o_c`` of the sources' row concatenation as a float32 tile (0.0 where
    masked), a load from each source: any strides, each source its own."""
    b_x = tl.zeros([BR, BC], dtype=tl.float32)
    b_x = _load_source_rows(b_x, p_x0, i_e, 0, r1, o_r, o_c, m_c, s_x0e, s_x0r, s_x0c)
    if NUM_SRC > 1:
        b_x = _load_source_rows(b_x, p_x1, i_e, r1, r2, o_r, o_c, m_c, s_x1e, s_x1r, s_x1c)
    if NUM_SRC > 2:
        b_x = _load_source_rows(b_x, p_x2, i_e, r2, r3, o_r, o_c, m_c, s_x2e, s_x2r, s_x2c)
    if NUM_SRC > 3:
        b_x = _load_source_rows(b_x, p_x3, i_e, r3, R, o_r, o_c, m_c, s_x3e, s_x3r, s_x3c)
    return b_x


@triton.jit
def _e4m3_code_soft(y):
    """e4m3fn code (7 bits, no sign) of float32 ``y`` in [0, 448] or NaN, RNE in integer math.

    Exists because Triton's CPU interpreter does not round to nearest-even when casting to
    fp8 (docs/numerics.md#traps). Values already on the e4m3 grid convert exactly everywhere.
    """
    b_bits = y.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits, round to nearest, ties to even (carries bump the exponent).
    b_rn = (b_bits + 0x7FFFF + ((b_bits >> 20) & 1)) & -0x100000
    b_code_n = ((b_rn >> 23) - 120) * 8 + ((b_rn >> 20) & 7)  # (e - 127 + 7) << 3 | m
    # Subnormal range (y < 2**-6): the grid step is 2**-9; adding 2**14 rounds there (RNE).
    b_sub = (y + 16384.0) - 16384.0
    b_code_s = (b_sub * 512.0).to(tl.int32)
    b_code = tl.where(y < 0.015625, b_code_s, b_code_n)
    return tl.where(y != y, 0x7F, b_code)


@triton.jit
def block_scale_code(
    b_x,
    p_flag,
    UE8M0: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    FMA_DIV: tl.constexpr,
    NAN_MAX: tl.constexpr,
    FLAG: tl.constexpr,
    SIGNED_Y: tl.constexpr,
    PAIRED_CVT: tl.constexpr,
):
    """The scale of one tile ``b_x`` (float32 [BR, BC], 0.0 outside the entry) and its e4m3fn
    bytes as int32 (code | sign), docs/numerics.md bit for bit. The quantize kernel and the delta
    compare kernel (triton_delta.py) both take them from here, so a sender's compared bytes are
    the quantizer's own. Sets ``p_flag`` for a NaN/Inf scale (FLAG)."""
    # The amax reads magnitudes; the quotient below is taken from x itself (every step is
    # sign-symmetric under round-to-nearest-even), so that |x| is not kept beside x.
    b_a = tl.abs(b_x)  # [BR, BC]
    # A NaN/Inf must reach the amax (tl.max skips NaN) so that the scale marks the block.
    if NAN_MAX:
        b_amax = tl.reduce(tl.reduce(b_a, 1, _max_propagate_nan), 0, _max_propagate_nan)
    else:
        # Same result, vectorized for the interpreter (its custom reduce runs element by
        # element): x * 0 is NaN exactly for NaN/Inf, so the sum is NaN iff one is here.
        b_amax = tl.max(b_a) + tl.sum(b_x * 0.0)
    inv_max = tl.full([], _INV_FP8_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    floor = tl.full([], _SCALE_FLOOR_BITS, tl.int32).to(tl.float32, bitcast=True)
    b_s = tl.maximum(b_amax * inv_max, floor, propagate_nan=tl.PropagateNan.ALL)
    if UE8M0:
        b_sb = b_s.to(tl.int32, bitcast=True)
        b_up = ((b_sb & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
        b_s = tl.where(((b_sb & 0x007FFFFF) != 0) & (b_s < float("inf")), b_up, b_s)
    if FLAG:
        # One int32 for the whole call (or layer): a single read tells whether any block failed.
        tl.store(p_flag, 1, mask=(b_s != b_s) | (b_s == float("inf")))

    b_n = b_x if SIGNED_Y else b_a  # numerator
    if FMA_DIV:
        # q0 = x * RN(1/s) is within 2 ulp; each step q += (x - q*s) * r with an exact
        # FMA remainder narrows that, and from a faithful q one step is correctly rounded
        # (Markstein). Cheaper than an IEEE division per element, which made us ALU-bound.
        b_r = tl.math.div_rn(1.0, b_s)
        b_y = b_n * b_r
        b_y = tl.fma(tl.fma(-b_y, b_s, b_n), b_r, b_y)
        b_y = tl.fma(tl.fma(-b_y, b_s, b_n), b_r, b_y)
    else:
        b_y = tl.math.div_rn(b_n, b_s)
    if SOFT_FP8:
        b_code = _e4m3_code_soft(tl.minimum(tl.abs(b_y), 448.0, propagate_nan=tl.PropagateNan.ALL))
    elif PAIRED_CVT:
        # cvt.rn.satfinite: RNE, and values past +-448 saturate (the clamp of docs/numerics.md).
        b_code = b_y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        # The same cvt, one element per instruction, its byte zero-extended to 32 bits. When the
        # tile's register layout and the store's differ (a column-major source, or an output
        # whose rows are not contiguous), its bytes reach the store through shared memory; the
        # paired cvt's 16-bit results were then packed two by two and ptxas (12.8 as bundled
        # with Triton 3.6, and 12.9) folded one pair into F2FP...PACK_AB_MERGE_C and read the
        # other's high byte from a wrong register (H200: a quarter of the bytes wrong, scales
        # right).
        b_code = tl.inline_asm_elementwise(
            "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1; cvt.u32.u16 $0, h; }",
            "=r,r",
            [b_y],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    # The sign bit of x goes on the byte whatever the quotient's zero sign: -0.0 gives 0x80.
    b_sign = (b_x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return b_s, b_code | b_sign


@triton.jit
def _quantize_tile(
    i_e,
    i_rb,
    i_cb,  # int64: expert, row block, column block
    p_q,
    p_s,
    p_flag,
    p_x0,
    p_x1,
    p_x2,
    p_x3,
    r1,
    r2,
    r3,
    R,
    C,
    s_x0e,
    s_x0r,
    s_x0c,
    s_x1e,
    s_x1r,
    s_x1c,
    s_x2e,
    s_x2r,
    s_x2c,
    s_x3e,
    s_x3r,
    s_x3c,
    s_qe,
    s_qr,
    s_qc,
    s_se,
    s_sr,
    s_sc,
    NUM_SRC: tl.constexpr,
    ROW_GATHER: tl.constexpr,
    UE8M0: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    FMA_DIV: tl.constexpr,
    NAN_MAX: tl.constexpr,
    FLAG: tl.constexpr,
    SIGNED_Y: tl.constexpr,
    PAIRED_CVT: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """Quantize one 128x128 tile of the row-concatenated sources into q and its scale."""
    o_r = i_rb * BR + tl.arange(0, BR).to(tl.int64)  # [BR]
    o_c = i_cb * BC + tl.arange(0, BC).to(tl.int64)  # [BC]
    m_r = o_r < R
    m_c = o_c < C
    if ROW_GATHER:
        # One base pointer per row, taken from the source that holds it: a single load per tile.
        p_row = p_x0 + i_e * s_x0e + o_r * s_x0r  # [BR]
        if NUM_SRC > 1:
            p_row = tl.where(o_r >= r1, p_x1 + i_e * s_x1e + (o_r - r1) * s_x1r, p_row)
        if NUM_SRC > 2:
            p_row = tl.where(o_r >= r2, p_x2 + i_e * s_x2e + (o_r - r2) * s_x2r, p_row)
        if NUM_SRC > 3:
            p_row = tl.where(o_r >= r3, p_x3 + i_e * s_x3e + (o_r - r3) * s_x3r, p_row)
        p_x = p_row[:, None] + o_c[None, :] * s_x0c  # [BR, BC]
        b_x = tl.load(p_x, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    else:
        b_x = load_concat(
            i_e,
            o_r,
            o_c,
            m_c,
            p_x0,
            p_x1,
            p_x2,
            p_x3,
            r1,
            r2,
            r3,
            R,
            s_x0e,
            s_x0r,
            s_x0c,
            s_x1e,
            s_x1r,
            s_x1c,
            s_x2e,
            s_x2r,
            s_x2c,
            s_x3e,
            s_x3r,
            s_x3c,
            NUM_SRC,
            BR,
            BC,
        )

    b_s, b_byte = block_scale_code(b_x, p_flag, UE8M0, SOFT_FP8, FMA_DIV, NAN_MAX, FLAG, SIGNED_Y, PAIRED_CVT)
    b_q = b_byte.to(tl.uint8)

    p_qt = p_q + i_e * s_qe + o_r[:, None] * s_qr + o_c[None, :] * s_qc
    tl.store(p_qt, b_q, mask=m_r[:, None] & m_c[None, :])
    tl.store(p_s + i_e * s_se + i_rb * s_sr + i_cb * s_sc, b_s)


def _quantize_blockwise(
    p_q,  # uint8 view of the fp8 output, [E, R, C]
    p_s,  # float32 scales, [E, ceil(R/128), ceil(C/128)]
    p_flag,  # int32 set to 1 when a block's scale is NaN/Inf (FLAG only)
    p_x0,
    p_x1,
    p_x2,
    p_x3,  # sources; source k holds rows [r_k, r_{k+1}) (unused: any pointer)
    r1,
    r2,
    r3,
    R,
    C,
    s_x0e,
    s_x0r,
    s_x0c,
    s_x1e,
    s_x1r,
    s_x1c,
    s_x2e,
    s_x2r,
    s_x2c,
    s_x3e,
    s_x3r,
    s_x3c,
    s_qe,
    s_qr,
    s_qc,
    s_se,
    s_sr,
    s_sc,
    n_e,
    n_rb,
    n_cb,
    NUM_SRC: tl.constexpr,
    ROW_GATHER: tl.constexpr,  # row-major sources: pick a source per row, one load per tile
    CB_PER_PROG: tl.constexpr,  # grid mode: column blocks per program, left to right
    PERSISTENT: tl.constexpr,  # persistent mode: programs stride over all tiles
    STAGES: tl.constexpr,  # persistent mode: software-pipelining depth of the tile loop
    UE8M0: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # integer e4m3 encoding (interpreter) instead of the hardware cvt
    FMA_DIV: tl.constexpr,  # correctly rounded x / s from one reciprocal and FMA corrections
    NAN_MAX: tl.constexpr,  # NaN-propagating max reduction (GPU) instead of max + sum(x * 0)
    FLAG: tl.constexpr,  # write p_flag for non-finite blocks
    SIGNED_Y: tl.constexpr,  # quotient from x (sign kept) instead of |x|: fewer live registers
    PAIRED_CVT: tl.constexpr,  # two elements per fp8 cvt: only row-major sources and output
    BR: tl.constexpr = 128,
    BC: tl.constexpr = 128,
):
    # Tiles are numbered with column blocks fastest, so neighbouring programs share rows.
    # All index arithmetic is int64: one GLM-5 expert stack has 3.2e9 elements.
    i_p = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        n_tiles = n_e * n_rb * n_cb
        for i_t in tl.range(i_p, n_tiles, tl.num_programs(0), num_stages=STAGES):
            _quantize_tile(
                i_t // (n_cb * n_rb),
                (i_t // n_cb) % n_rb,
                i_t % n_cb,
                p_q,
                p_s,
                p_flag,
                p_x0,
                p_x1,
                p_x2,
                p_x3,
                r1,
                r2,
                r3,
                R,
                C,
                s_x0e,
                s_x0r,
                s_x0c,
                s_x1e,
                s_x1r,
                s_x1c,
                s_x2e,
                s_x2r,
                s_x2c,
                s_x3e,
                s_x3r,
                s_x3c,
                s_qe,
                s_qr,
                s_qc,
                s_se,
                s_sr,
                s_sc,
                NUM_SRC,
                ROW_GATHER,
                UE8M0,
                SOFT_FP8,
                FMA_DIV,
                NAN_MAX,
                FLAG,
                SIGNED_Y,
                PAIRED_CVT,
                BR,
                BC,
            )
    else:
        n_cg = tl.cdiv(n_cb, CB_PER_PROG)
        i_cg = i_p % n_cg
        i_rb = (i_p // n_cg) % n_rb
        i_e = i_p // (n_cg * n_rb)
        for j in tl.static_range(CB_PER_PROG):
            i_cb = i_cg * CB_PER_PROG + j
            if i_cb < n_cb:
                _quantize_tile(
                    i_e,
                    i_rb,
                    i_cb,
                    p_q,
                    p_s,
                    p_flag,
                    p_x0,
                    p_x1,
                    p_x2,
                    p_x3,
                    r1,
                    r2,
                    r3,
                    R,
                    C,
                    s_x0e,
                    s_x0r,
                    s_x0c,
                    s_x1e,
                    s_x1r,
                    s_x1c,
                    s_x2e,
                    s_x2r,
                    s_x2c,
                    s_x3e,
                    s_x3r,
                    s_x3c,
                    s_qe,
                    s_qr,
                    s_qc,
                    s_se,
                    s_sr,
                    s_sc,
                    NUM_SRC,
                    ROW_GATHER,
                    UE8M0,
                    SOFT_FP8,
                    FMA_DIV,
                    NAN_MAX,
                    FLAG,
                    SIGNED_Y,
                    PAIRED_CVT,
                    BR,
                    BC,
                )


quantize_blockwise_kernel = triton.jit(_quantize_blockwise)
# The same kernel compiled without assuming 16-byte-aligned sources, for outputs that cannot
# take vector stores. On the H200 (Triton 3.6) the main kernel wrote wrong bytes (odd columns,
# from row 16 of a tile) when vectorized source loads met unaligned byte stores, e.g. an output
# of 261 columns or one starting 3 bytes into a buffer; unaligned loads with any stores, and
# aligned loads with aligned stores, were bit-exact (bench/HISTORY.md, 2026-12-02).
SOURCE_POINTERS = ["p_x0", "p_x1", "p_x2", "p_x3"]
NO_ALIGN_KW = (
    "do_not_specialize_on_alignment"
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    else "do_not_specialize"
)
quantize_blockwise_kernel_unaligned_out = triton.jit(**{NO_ALIGN_KW: SOURCE_POINTERS})(_quantize_blockwise)


def stores_vectorize(q: torch.Tensor) -> bool:
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
    ("cb_per_prog", int, False),
    ("num_warps", int, False),
    ("maxnreg", int, True),
    ("programs_per_sm", int, False),
    ("num_stages", int, False),
    ("fma_div", bool, False),
    ("soft_fp8", bool, True),
    ("signed_quotient", bool, False),
)
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


_CONSTEXPR_NAMES = (
    "NUM_SRC",
    "ROW_GATHER",
    "CB_PER_PROG",
    "PERSISTENT",
    "STAGES",
    "UE8M0",
    "SOFT_FP8",
    "FMA_DIV",
    "NAN_MAX",
    "FLAG",
    "SIGNED_Y",
    "PAIRED_CVT",
    "BR",
    "BC",
)


def launch_args(
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
    ints = (
        *bounds,
        r,
        c,
        *(st for src in padded for st in src.stride()),
        *q.stride(),
        *s.stride(),
        e,
        ceil_blocks(r),
        ceil_blocks(c),
    )
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
    tensors, ints = launch_args(sources, q, s, nonfinite)
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
    constexprs = (
        len(sources),
        row_gather,
        config.cb_per_prog,
        config.programs_per_sm > 0,
        config.num_stages,
        ue8m0,
        soft_fp8,
        config.fma_div,
        not interpret,
        nonfinite is not None,
        config.signed_quotient,
        paired_cvt,
        BLOCK,
        BLOCK,
    )
    aligned_out = stores_vectorize(q)
    kernel = quantize_blockwise_kernel if aligned_out else quantize_blockwise_kernel_unaligned_out
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    if interpret or not _direct_launch:
        _jit_launch(kernel, grid, tensors, ints, constexprs, options)
        return
    ptrs = [t.data_ptr() for t in tensors]
    key = (
        aligned_out,
        q.device.index,
        sources[0].dtype,
        constexprs,
        config.num_warps,
        config.num_stages,
        config.maxnreg,
        ints,
        tuple(p & 15 for p in ptrs),
    )
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
        q.view(torch.uint8),
        *rest,
        *ints,
        **dict(zip(_CONSTEXPR_NAMES, constexprs)),
        **options,
        enable_fp_fusion=False,  # no contraction may change a rounding docs/numerics.md fixes
    )


def launch(work, ue8m0: bool, nonfinite: torch.Tensor | None, config: LaunchConfig | None) -> None:
    """The Triton backend: one launch per job of ``work`` (validated 3-D views)."""
    for sources, q, s in work:
        launch_triton(sources, q, s, ue8m0, nonfinite, config)

"""The Triton kernel: ``quantize_blockwise_kernel`` quantizes w13, w2 and every 2-D weight.

Each program reads 128x128 tiles of a row-concatenation of up to four sources (w13 = [w1; w3]
is two sources), takes the block amax, and writes the fp8 bytes and the block scale straight
into the output tensors. The concatenation never exists; a block that straddles two sources
reads rows from both. Numerics: docs/numerics.md, bit for bit (``glm_fp8.reference``).
Launched by ``glm_fp8.kernels.triton_launch``.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from glm_fp8.numerics import INV_FP8_MAX_BITS, SCALE_FLOOR_BITS

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
def _load_concat(
    i_e, o_r, o_c, m_c, p_x0, p_x1, p_x2, p_x3, r1, r2, r3, R,
    s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
    NUM_SRC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
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
def _block_scale_code(
    b_x, p_flag,
    UE8M0: tl.constexpr, SOFT_FP8: tl.constexpr, FMA_DIV: tl.constexpr, NAN_MAX: tl.constexpr,
    FLAG: tl.constexpr, SIGNED_Y: tl.constexpr, PAIRED_CVT: tl.constexpr,
):  # fmt: skip
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
    i_e, i_rb, i_cb,  # int64: expert, row block, column block
    p_q, p_s, p_flag, p_x0, p_x1, p_x2, p_x3, r1, r2, r3, R, C,
    s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
    s_qe, s_qr, s_qc, s_se, s_sr, s_sc,
    NUM_SRC: tl.constexpr, ROW_GATHER: tl.constexpr, UE8M0: tl.constexpr,
    SOFT_FP8: tl.constexpr, FMA_DIV: tl.constexpr, NAN_MAX: tl.constexpr, FLAG: tl.constexpr,
    SIGNED_Y: tl.constexpr, PAIRED_CVT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
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
        b_x = _load_concat(
            i_e, o_r, o_c, m_c, p_x0, p_x1, p_x2, p_x3, r1, r2, r3, R,
            s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
            NUM_SRC, BR, BC,
        )  # fmt: skip

    b_s, b_byte = _block_scale_code(
        b_x, p_flag, UE8M0, SOFT_FP8, FMA_DIV, NAN_MAX, FLAG, SIGNED_Y, PAIRED_CVT
    )
    b_q = b_byte.to(tl.uint8)

    p_qt = p_q + i_e * s_qe + o_r[:, None] * s_qr + o_c[None, :] * s_qc
    tl.store(p_qt, b_q, mask=m_r[:, None] & m_c[None, :])
    tl.store(p_s + i_e * s_se + i_rb * s_sr + i_cb * s_sc, b_s)


def _quantize_blockwise(
    p_q,  # uint8 view of the fp8 output, [E, R, C]
    p_s,  # float32 scales, [E, ceil(R/128), ceil(C/128)]
    p_flag,  # int32 set to 1 when a block's scale is NaN/Inf (FLAG only)
    p_x0, p_x1, p_x2, p_x3,  # sources; source k holds rows [r_k, r_{k+1}) (unused: any pointer)
    r1, r2, r3, R, C,
    s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
    s_qe, s_qr, s_qc, s_se, s_sr, s_sc,
    n_e, n_rb, n_cb,
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
):  # fmt: skip
    # Tiles are numbered with column blocks fastest, so neighbouring programs share rows.
    # All index arithmetic is int64: one GLM-5 expert stack has 3.2e9 elements.
    i_p = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        n_tiles = n_e * n_rb * n_cb
        for i_t in tl.range(i_p, n_tiles, tl.num_programs(0), num_stages=STAGES):
            _quantize_tile(
                i_t // (n_cb * n_rb), (i_t // n_cb) % n_rb, i_t % n_cb,
                p_q, p_s, p_flag, p_x0, p_x1, p_x2, p_x3, r1, r2, r3, R, C,
                s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
                s_qe, s_qr, s_qc, s_se, s_sr, s_sc,
                NUM_SRC, ROW_GATHER, UE8M0, SOFT_FP8, FMA_DIV, NAN_MAX, FLAG, SIGNED_Y, PAIRED_CVT, BR, BC,
            )  # fmt: skip
    else:
        n_cg = tl.cdiv(n_cb, CB_PER_PROG)
        i_cg = i_p % n_cg
        i_rb = (i_p // n_cg) % n_rb
        i_e = i_p // (n_cg * n_rb)
        for j in tl.static_range(CB_PER_PROG):
            i_cb = i_cg * CB_PER_PROG + j
            if i_cb < n_cb:
                _quantize_tile(
                    i_e, i_rb, i_cb,
                    p_q, p_s, p_flag, p_x0, p_x1, p_x2, p_x3, r1, r2, r3, R, C,
                    s_x0e, s_x0r, s_x0c, s_x1e, s_x1r, s_x1c, s_x2e, s_x2r, s_x2c, s_x3e, s_x3r, s_x3c,
                    s_qe, s_qr, s_qc, s_se, s_sr, s_sc,
                    NUM_SRC, ROW_GATHER, UE8M0, SOFT_FP8, FMA_DIV, NAN_MAX, FLAG, SIGNED_Y, PAIRED_CVT,
                    BR, BC,
                )  # fmt: skip


quantize_blockwise_kernel = triton.jit(_quantize_blockwise)
# The same kernel compiled without assuming 16-byte-aligned sources, for outputs that cannot
# take vector stores. On the H200 (Triton 3.6) the main kernel wrote wrong bytes (odd columns,
# from row 16 of a tile) when vectorized source loads met unaligned byte stores, e.g. an output
# of 261 columns or one starting 3 bytes into a buffer; unaligned loads with any stores, and
# aligned loads with aligned stores, were bit-exact (bench/HISTORY.md, 2026-12-02).
_SOURCE_POINTERS = ["p_x0", "p_x1", "p_x2", "p_x3"]
_NO_ALIGN_KW = (
    "do_not_specialize_on_alignment"
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    else "do_not_specialize"
)
quantize_blockwise_kernel_unaligned_out = triton.jit(**{_NO_ALIGN_KW: _SOURCE_POINTERS})(_quantize_blockwise)

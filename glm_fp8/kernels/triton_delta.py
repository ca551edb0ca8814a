"""The delta kernels (docs/delta.md) and their launchers, one 128x128 block per program.

- ``delta_compare_kernel``: quantizes a block of the row-concatenated sources exactly as
  ``quantize_blockwise_kernel`` does (docs/numerics.md), compares its bytes and scale with the
  kept copy of what the engine holds, writes the changed bytes and the new scale into the kept
  copy, and emits the block's changed count, a scale-changed flag and a bitmap of the changed
  positions (16-bit words, 2 KiB per block). The only pass over the new weights.
- ``delta_bytes_kernel``: the same comparison of bytes already converted (a segment of the
  transfer, any entry's bytes seen as uint8 rows): new against kept, the kept copy moved to the new
  bytes, the count and the bitmap; no quantization.
- ``delta_words_kernel``: the same for a piece whose bytes lie in block order, 8 bytes a lane, and
  each block's part of the new bytes' checksum (the transfer's segments: ``pack_bytes_delta``).
- ``delta_totals_kernel`` and ``delta_offsets_kernel``: a program per 1,024 blocks each, the
  chunks' totals and then the pack kernel's per-block offsets on the device, laid out as the
  wire's payload (``glm_fp8.transfer.delta.wire``) and the payload's running length updated, so
  that a sender packs a segment with no host read (``pack_bytes_delta``).
- ``delta_pack_kernel``: turns the bitmap, word by word, into the wire's sorted int16 offsets and
  the uint8 values at offsets given by a prefix sum of the counts; a dense block copies all its
  bytes. Reads the bitmap and the changed bytes of changed blocks only.
- ``delta_check_kernel``: the engine's check of received offsets before anything is written: per
  sparse block, its offsets outside its valid rows and columns (no per-offset temporaries).
- ``delta_apply_kernel``: the engine's side, writes the values at their positions (or a dense
  block whole) into an fp8 parameter of any strides.

Block order is (expert, row block, column block); offsets within a block are r * 128 + c.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.kernels.checksum import K1, K2, K3, checksum_terms
from glm_fp8.kernels.triton_quantize import (
    NO_ALIGN_KW,
    SOURCE_POINTERS,
    block_scale_code,
    interpreting,
    launch_args,
    load_concat,
    stores_vectorize,
)

WORD = 16  # bits per bitmap word: int16 words, so no sum of shifted bits ever overflows
BITMAP_WORDS = BLOCK * BLOCK // WORD  # per block
APPLY_CHUNK = 256  # sparse positions one step of the apply loop writes
OFFSETS_CHUNK = 1024  # blocks a program of the offsets kernels sums and scans


def _delta_compare(
    p_kq,
    p_ks,
    p_bits,
    p_cnt,
    p_sch,
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
    s_ke,
    s_kr,
    s_kc,
    s_se,
    s_sr,
    s_sc,
    n_rb,
    n_cb,
    NUM_SRC: tl.constexpr,
    UE8M0: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    NAN_MAX: tl.constexpr,
    FLAG: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    WBITS: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_e = i_b // (n_rb * n_cb)
    i_rb = (i_b // n_cb) % n_rb
    i_cb = i_b % n_cb
    o_r = i_rb * BR + tl.arange(0, BR).to(tl.int64)
    o_c = i_cb * BC + tl.arange(0, BC).to(tl.int64)
    m_c = o_c < C
    m_t = (o_r < R)[:, None] & m_c[None, :]
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

    # The scale and the bytes from quantize_blockwise_kernel's own code, with its default config's
    # division (fma_div, signed_quotient); one element per cvt (PAIRED_CVT off): the kept copy may
    # be a view of any strides, where the paired cvt was miscompiled (triton_quantize.py says how).
    b_s, b_q = block_scale_code(
        b_x,
        p_flag,
        UE8M0,
        SOFT_FP8,
        FMA_DIV=True,
        NAN_MAX=NAN_MAX,
        FLAG=FLAG,
        SIGNED_Y=True,
        PAIRED_CVT=False,
    )
    b_ok = (b_s == b_s) & (b_s < float("inf"))

    p_kt = p_kq + i_e * s_ke + o_r[:, None] * s_kr + o_c[None, :] * s_kc
    b_old = tl.load(p_kt, mask=m_t, other=0).to(tl.int32)
    b_chg = (b_q != b_old) & m_t
    p_st = p_ks + i_e * s_se + i_rb * s_sr + i_cb * s_sc
    b_sch = tl.load(p_st).to(tl.int32, bitcast=True) != b_s.to(tl.int32, bitcast=True)
    if FLAG:
        # A non-finite block leaves the kept copy alone; the call then raises.
        tl.store(p_kt, b_q.to(tl.uint8), mask=(b_chg.to(tl.int32) * b_ok.to(tl.int32)) != 0)
        tl.store(p_st, b_s, mask=b_ok)
    else:
        tl.store(p_kt, b_q.to(tl.uint8), mask=b_chg)
        tl.store(p_st, b_s)
    tl.store(p_cnt + i_b, tl.sum(b_chg.to(tl.int32)))
    tl.store(p_sch + i_b, b_sch.to(tl.int8))
    b_bit = tl.reshape(b_chg.to(tl.int32), [BR, BC // WBITS, WBITS]) << tl.arange(0, WBITS)[None, None, :]
    b_w = tl.sum(b_bit, axis=2)  # [BR, BC // WBITS]: distinct bits, so the sum is the OR
    o_w = tl.arange(0, BR)[:, None] * (BC // WBITS) + tl.arange(0, BC // WBITS)[None, :]
    tl.store(p_bits + i_b * (BR * BC // WBITS) + o_w, b_w.to(tl.int16))


delta_compare_kernel = triton.jit(_delta_compare)
# Without assuming 16-byte-aligned sources, for a kept copy whose rows cannot take vector stores:
# on the H200 vectorized source loads with unaligned byte stores wrote wrong bytes in the
# quantize kernel (triton_quantize.py), so this kernel takes the same precaution.
delta_compare_kernel_unaligned_out = triton.jit(**{NO_ALIGN_KW: SOURCE_POINTERS})(_delta_compare)


@triton.jit
def _popcount16(x):
    """Set bits of each int32 lane holding a 16-bit word (SWAR: no popcount instruction in
    Triton's language, and none in its interpreter)."""
    x = x - ((x >> 1) & 0x5555)
    x = (x & 0x3333) + ((x >> 2) & 0x3333)
    x = (x + (x >> 4)) & 0x0F0F
    return (x + (x >> 8)) & 0x1F


@triton.jit
def delta_bytes_kernel(
    p_new,
    p_kq,
    p_bits,
    p_cnt,
    R,
    C,
    s_ne,
    s_nr,
    s_nc,
    s_ke,
    s_kr,
    s_kc,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    WBITS: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_e = i_b // (n_rb * n_cb)
    o_r = ((i_b // n_cb) % n_rb) * BR + tl.arange(0, BR).to(tl.int64)
    o_c = (i_b % n_cb) * BC + tl.arange(0, BC).to(tl.int64)
    m_t = (o_r < R)[:, None] & (o_c < C)[None, :]
    b_new = tl.load(p_new + i_e * s_ne + o_r[:, None] * s_nr + o_c[None, :] * s_nc, mask=m_t, other=0)
    p_kt = p_kq + i_e * s_ke + o_r[:, None] * s_kr + o_c[None, :] * s_kc
    b_old = tl.load(p_kt, mask=m_t, other=0)
    b_chg = (b_new != b_old) & m_t
    tl.store(p_kt, b_new, mask=b_chg)
    tl.store(p_cnt + i_b, tl.sum(b_chg.to(tl.int32)))
    b_bit = tl.reshape(b_chg.to(tl.int32), [BR, BC // WBITS, WBITS]) << tl.arange(0, WBITS)[None, None, :]
    b_w = tl.sum(b_bit, axis=2)  # distinct bits: the sum is the OR
    o_w = tl.arange(0, BR)[:, None] * (BC // WBITS) + tl.arange(0, BC // WBITS)[None, :]
    tl.store(p_bits + i_b * (BR * BC // WBITS) + o_w, b_w.to(tl.int16))


@triton.jit
def delta_words_kernel(
    p_new,
    p_kept,
    p_bits,
    p_cnt,
    p_sum,
    n_words,
    first,
    k1,
    k2,
    k3,
    PAIRS: tl.constexpr,
):
    """``delta_bytes_kernel``'s comparison of a piece whose bytes lie in block order (rows of 128
    contiguous bytes, or one row), read 8 bytes a lane (int64 words; a lane per byte costs the
    bitmap's sum of shifted bits over 16,384 lanes a block), and each block's sum of checksum
    terms (``glm_fp8.kernels.checksum``) of the new words at positions ``first + i``: a segment's
    checksum with no pass of its own. A pair of words is one bitmap word (16 bytes)."""
    i_b = tl.program_id(0).to(tl.int64)
    o_p = i_b * PAIRS + tl.arange(0, PAIRS).to(tl.int64)
    o_w = o_p[:, None] * 2 + tl.arange(0, 2)[None, :]  # [PAIRS, 2]
    m_w = o_w < n_words
    b_new = tl.load(p_new + o_w, mask=m_w, other=0)
    b_x = b_new ^ tl.load(p_kept + o_w, mask=m_w, other=0)
    tl.store(p_kept + o_w, b_new, mask=b_x != 0)
    # Per byte, whether it differs, as bit 8k of the word: (x & 0x7F) + 0x7F carries into bit 7
    # for a nonzero low part, | x adds the byte's own bit 7 (no carry crosses a byte). The shift
    # is arithmetic on int64, the mask drops what it fills in.
    b_t = ((((b_x & 0x7F7F7F7F7F7F7F7F) + 0x7F7F7F7F7F7F7F7F) | b_x) >> 7) & 0x0101010101010101
    # Gather bit 8k to bit 56 + k: the multiplier's bit 7 (8 - k) lands each there, every other
    # product bit lies elsewhere (8k + 7m are distinct) and wraps off above bit 63.
    b_m = ((b_t * 0x0102040810204080) >> 56) & 0xFF
    b_w = tl.sum(b_m << (tl.arange(0, 2) * 8)[None, :], axis=1).to(tl.int32)  # [PAIRS] bitmap words
    tl.store(p_bits + o_p, b_w.to(tl.int16))
    tl.store(p_cnt + i_b, tl.sum(_popcount16(b_w), axis=0))
    b_c = checksum_terms(b_new.to(tl.uint64, bitcast=True), first + o_w, k1, k2, k3)
    tl.store(p_sum + i_b, tl.sum(tl.sum(tl.where(m_w, b_c, 0), axis=1), axis=0).to(tl.int64, bitcast=True))


@triton.jit
def _program_block(p_cnt, R, C, n_rb, n_cb, BR: tl.constexpr, BC: tl.constexpr):
    """This program's block: its index and count of changed bytes, its expert, first row and
    column, valid rows and columns, and in-block row and column offsets with the valid mask."""
    i_b = tl.program_id(0).to(tl.int64)
    i_e = i_b // (n_rb * n_cb)
    r0 = ((i_b // n_cb) % n_rb) * BR
    c0 = (i_b % n_cb) * BC
    nr = tl.minimum(R - r0, BR)
    nc = tl.minimum(C - c0, BC)
    o_r = tl.arange(0, BR).to(tl.int64)
    o_c = tl.arange(0, BC).to(tl.int64)
    m_t = (o_r < nr)[:, None] & (o_c < nc)[None, :]
    return i_b, tl.load(p_cnt + i_b), i_e, r0, c0, nr, nc, o_r, o_c, m_t


@triton.jit
def _block_fields(
    p_cnt, start, n_blocks, R, C, n_rb, n_cb, BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr
):
    """Blocks ``start + [0, CHUNK)``: their offsets and values on the wire (a block with more than
    a third of its valid bytes changed goes whole: no offsets, every valid byte), their indices
    and mask. Indices in int32 (a piece has far fewer than 2**31 blocks): int64 division is
    emulated on the GPU, and it dominated this helper."""
    o_k = start + tl.arange(0, CHUNK)
    m_k = o_k < n_blocks
    n = tl.load(p_cnt + o_k, mask=m_k, other=0).to(tl.int64)
    rows = tl.minimum(R - ((o_k // n_cb) % n_rb) * BR, BR)
    cols = tl.minimum(C - (o_k % n_cb) * BC, BC)
    v = tl.where(m_k, rows * cols, 0).to(tl.int64)
    dense = 3 * n > v
    return tl.where(dense, 0, n), tl.where(dense, v, n), o_k, m_k


@triton.jit
def delta_totals_kernel(
    p_cnt,
    p_tot,
    p_len,
    n_blocks,
    n_chunks,
    R,
    C,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The offsets' first launch, a program per CHUNK blocks: the chunk's totals of positions and
    values into ``p_tot[0, chunk]`` and ``p_tot[1, chunk]`` (``p_tot`` int64 [2, n_chunks + 1]);
    program 0 also copies the payload's length ``*p_len`` into ``p_tot[0, n_chunks]``, so that the
    second launch reads it there while its last program moves ``*p_len``."""
    i_c = tl.program_id(0)
    pos, val, _, _ = _block_fields(p_cnt, i_c * CHUNK, n_blocks, R, C, n_rb, n_cb, BR, BC, CHUNK)
    tl.store(p_tot + i_c, tl.sum(pos, axis=0))
    tl.store(p_tot + (n_chunks + 1) + i_c, tl.sum(val, axis=0))
    if i_c == 0:
        tl.store(p_tot + n_chunks, tl.load(p_len))


@triton.jit
def delta_offsets_kernel(
    p_cnt,
    p_tot,
    p_poff,
    p_voff,
    p_len,
    n_blocks,
    n_chunks,
    R,
    C,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """The offsets' second launch, a program per CHUNK blocks, for an unscaled piece at payload
    byte ``base`` (``delta_totals_kernel`` left it and the chunks' totals in ``p_tot``): its
    offsets (int16) there, its values after them at the next multiple of ALIGN, each block's start
    in them (positions in int16 units, values in bytes, from the payload's start). The last
    program moves ``*p_len`` past both fields, each padded to ALIGN."""
    i_c = tl.program_id(0)
    base = tl.load(p_tot + n_chunks)
    before_p = tl.zeros([CHUNK], dtype=tl.int64)
    all_p = tl.zeros([CHUNK], dtype=tl.int64)
    before_v = tl.zeros([CHUNK], dtype=tl.int64)
    all_v = tl.zeros([CHUNK], dtype=tl.int64)
    for start in range(0, n_chunks, CHUNK):
        o_t = start + tl.arange(0, CHUNK)
        m_t = o_t < n_chunks
        t_p = tl.load(p_tot + o_t, mask=m_t, other=0)
        t_v = tl.load(p_tot + (n_chunks + 1) + o_t, mask=m_t, other=0)
        all_p += t_p
        all_v += t_v
        before_p += tl.where(o_t < i_c, t_p, 0)
        before_v += tl.where(o_t < i_c, t_v, 0)
    n_pos = tl.sum(all_p, axis=0)
    v0 = base + (2 * n_pos + ALIGN - 1) // ALIGN * ALIGN
    pos, val, o_k, m_k = _block_fields(p_cnt, i_c * CHUNK, n_blocks, R, C, n_rb, n_cb, BR, BC, CHUNK)
    c_p = base // 2 + tl.sum(before_p, axis=0)  # positions: int16 units
    c_v = v0 + tl.sum(before_v, axis=0)
    tl.store(p_poff + o_k, c_p + tl.cumsum(pos, axis=0) - pos, mask=m_k)
    tl.store(p_voff + o_k, c_v + tl.cumsum(val, axis=0) - val, mask=m_k)
    if i_c == n_chunks - 1:
        tl.store(p_len, v0 + (tl.sum(all_v, axis=0) + ALIGN - 1) // ALIGN * ALIGN)


@triton.jit
def delta_pack_kernel(
    p_kq,
    p_bits,
    p_cnt,
    p_poff,
    p_voff,
    p_pos,
    p_val,
    R,
    C,
    s_ke,
    s_kr,
    s_kc,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    WBITS: tl.constexpr,
):
    i_b, n, i_e, r0, c0, nr, nc, o_r, o_c, m_t = _program_block(p_cnt, R, C, n_rb, n_cb, BR, BC)
    if n > 0:
        v0 = tl.load(p_voff + i_b)
        if 3 * n > nr * nc:  # dense: every valid byte, row-major over the valid columns
            p_kt = p_kq + i_e * s_ke + (r0 + o_r)[:, None] * s_kr + (c0 + o_c)[None, :] * s_kc
            b_v = tl.load(p_kt, mask=m_t, other=0)
            tl.store(p_val + v0 + o_r[:, None] * nc + o_c[None, :], b_v, mask=m_t)
        else:
            # Word by word of the bitmap, not byte by byte of the block: a changed byte's
            # row-major rank is the set bits of the words before its word (one scan over the
            # block's 1,024 words) plus the bits below it in its own word. Each round takes every
            # word's lowest set bit, so a block runs as many rounds as its fullest word has bits
            # (16 at most, few where changes are sparse), and reads only changed bytes.
            o_w = tl.arange(0, BR * BC // WBITS)
            b_w = tl.load(p_bits + i_b * (BR * BC // WBITS) + o_w).to(tl.int32) & ((1 << WBITS) - 1)
            b_n = _popcount16(b_w)
            b_rank = tl.cumsum(b_n, axis=0) - b_n
            o_wr = (o_w // (BC // WBITS)).to(tl.int64)  # the word's row in the block
            o_wc = (o_w % (BC // WBITS)) * WBITS  # its first column
            p0 = tl.load(p_poff + i_b)
            p_kb = p_kq + i_e * s_ke + (r0 + o_wr) * s_kr + c0 * s_kc
            while tl.max(b_w, axis=0) > 0:
                m_p = b_w != 0
                b_low = b_w & -b_w
                o_cc = o_wc + _popcount16(b_low - 1)  # the lowest set bit's column
                b_v = tl.load(p_kb + o_cc.to(tl.int64) * s_kc, mask=m_p, other=0)
                tl.store(p_pos + p0 + b_rank, (o_wr * BC + o_cc).to(tl.int16), mask=m_p)
                tl.store(p_val + v0 + b_rank, b_v, mask=m_p)
                b_rank += m_p.to(tl.int32)
                b_w = b_w ^ b_low


@triton.jit
def delta_check_kernel(
    p_q,
    p_cnt,
    p_poff,
    p_pos,
    p_bad,
    n_pos,
    R,
    C,
    s_qe,
    s_qr,
    s_qc,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Per sparse block, how many of its offsets fall outside its valid rows and columns (into
    ``p_bad``, zeroed; ``p_q`` and its strides, unread, keep the per-block launcher's order). Reads
    only offsets in [0, n_pos): counts that do not match the offsets
    (refused by the caller) never read past them; a sparse block has at most v / 3 offsets."""
    i_b, n, i_e, r0, c0, nr, nc, o_r, o_c, m_t = _program_block(p_cnt, R, C, n_rb, n_cb, BR, BC)
    if n > 0:
        if 3 * n <= nr * nc:
            p0 = tl.load(p_poff + i_b)
            acc = tl.zeros([CHUNK], dtype=tl.int32)
            for start in range(0, n, CHUNK):
                o_k = p0 + start + tl.arange(0, CHUNK)
                m_k = (o_k < p0 + n) & (o_k >= 0) & (o_k < n_pos)
                b_p = tl.load(p_pos + o_k, mask=m_k, other=0).to(tl.int32)
                acc += (m_k & ((b_p < 0) | (b_p // BC >= nr) | (b_p % BC >= nc))).to(tl.int32)
            tl.store(p_bad + i_b, tl.sum(acc, axis=0))


@triton.jit
def delta_apply_kernel(
    p_q,
    p_cnt,
    p_poff,
    p_voff,
    p_pos,
    p_val,
    R,
    C,
    s_qe,
    s_qr,
    s_qc,
    n_rb,
    n_cb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i_b, n, i_e, r0, c0, nr, nc, o_r, o_c, m_t = _program_block(p_cnt, R, C, n_rb, n_cb, BR, BC)
    if n > 0:
        v0 = tl.load(p_voff + i_b)
        p_qb = p_q + i_e * s_qe + r0 * s_qr + c0 * s_qc
        if 3 * n > nr * nc:
            b_v = tl.load(p_val + v0 + o_r[:, None] * nc + o_c[None, :], mask=m_t)
            tl.store(p_qb + o_r[:, None] * s_qr + o_c[None, :] * s_qc, b_v, mask=m_t)
        else:
            p0 = tl.load(p_poff + i_b)
            for start in range(0, n, CHUNK):
                o_k = start + tl.arange(0, CHUNK)
                m_k = o_k < n
                b_p = tl.load(p_pos + p0 + o_k, mask=m_k, other=0).to(tl.int64)
                b_v = tl.load(p_val + v0 + o_k, mask=m_k)
                tl.store(p_qb + (b_p // BC) * s_qr + (b_p % BC) * s_qc, b_v, mask=m_k)


def _grid_dims(q3: torch.Tensor) -> tuple[int, int, int]:
    e, r, c = q3.shape
    return e, ceil_blocks(r), ceil_blocks(c)


def launch_compare(
    sources: Sequence[torch.Tensor],
    kept_q: torch.Tensor,
    kept_s: torch.Tensor,
    bits: torch.Tensor,
    counts: torch.Tensor,
    scale_changed: torch.Tensor,
    ue8m0: bool,
    nonfinite: torch.Tensor | None,
) -> None:
    """Checked 3-D views: sources [E, R_k, C], kept_q fp8 [E, R, C], kept_s [E, Rb, Cb]; outputs
    bits int16 [blocks * BITMAP_WORDS], counts int32 [blocks], scale_changed int8 [blocks]."""
    tensors, ints = launch_args(sources, kept_q, kept_s, nonfinite)  # the quantize kernel's order
    q, s, flag, *padded = tensors
    e, n_rb, n_cb = ints[-3:]
    if e * n_rb * n_cb == 0:
        return
    interpret = interpreting()
    kernel = delta_compare_kernel if stores_vectorize(q) else delta_compare_kernel_unaligned_out
    with _on_device(q):
        kernel[(e * n_rb * n_cb,)](
            q.view(torch.uint8),
            s,
            bits,
            counts,
            scale_changed,
            flag,
            *padded,
            *ints[:-3],
            n_rb,
            n_cb,
            NUM_SRC=len(sources),
            UE8M0=ue8m0,
            SOFT_FP8=interpret,
            NAN_MAX=not interpret,
            FLAG=nonfinite is not None,
            BR=BLOCK,
            BC=BLOCK,
            WBITS=WORD,
            num_warps=8,
            enable_fp_fusion=False,  # no contraction may change a rounding docs/numerics.md fixes
        )


def launch_compare_bytes(
    new: torch.Tensor, kept: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """Checked uint8 [E, R, C] views of the same shape: ``kept`` moved to ``new``; outputs bits
    int16 [blocks * BITMAP_WORDS], counts int32 [blocks]."""
    with _on_device(kept):
        e, n_rb, n_cb = _grid_dims(kept)
        if e * n_rb * n_cb:
            delta_bytes_kernel[(e * n_rb * n_cb,)](
                new,
                kept,
                bits,
                counts,
                kept.shape[1],
                kept.shape[2],
                *new.stride(),
                *kept.stride(),
                n_rb,
                n_cb,
                BR=BLOCK,
                BC=BLOCK,
                WBITS=WORD,
                num_warps=8,
            )


def words_fit(new: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether ``launch_compare_words`` takes these uint8 pieces: [R, C], contiguous, their bytes in
    block order (C = 128, or one row of at most 128), whole 8-byte words at 8-byte addresses."""
    if new.dim() != 2 or new.shape != kept.shape:
        return False
    r, c = new.shape
    return (
        (c == BLOCK or (r == 1 and c <= BLOCK))
        and new.numel() % 8 == 0
        and all(t.is_contiguous() and t.data_ptr() % 8 == 0 for t in (new, kept))
    )


def launch_compare_words(
    new: torch.Tensor,
    kept: torch.Tensor,
    bits: torch.Tensor,
    counts: torch.Tensor,
    sums: torch.Tensor,
    first: int,
    *,
    num_warps: int = 8,
) -> None:
    """Checked uint8 pieces [R, C] that ``words_fit``: ``kept`` moved to ``new``; outputs bits int16
    [blocks * BITMAP_WORDS], counts int32 [blocks] (as ``launch_compare_bytes``) and sums int64
    [blocks], each block's checksum terms of ``new`` at word positions from ``first`` on."""
    blocks = triton.cdiv(new.numel(), BLOCK * BLOCK)
    if blocks == 0:
        return
    with _on_device(kept):
        delta_words_kernel[(blocks,)](
            new.view(torch.int64),
            kept.view(torch.int64),
            bits,
            counts,
            sums,
            new.numel() // 8,
            first,
            K1,
            K2,
            K3,
            PAIRS=BITMAP_WORDS,
            num_warps=num_warps,
        )


class Wire(NamedTuple):
    """A delta's tensors as the pack kernel fills them and the apply kernel reads them."""

    counts: torch.Tensor  # int32 [blocks]
    pos_offsets: torch.Tensor  # int64 [blocks]: exclusive prefix sums of the positions per block
    val_offsets: torch.Tensor  # int64 [blocks]: the same for the values
    positions: torch.Tensor  # int16 [P]
    values: torch.Tensor  # uint8 [V]


def launch_pack(kept_q: torch.Tensor, bits: torch.Tensor, wire: Wire, *, num_warps: int = 8) -> None:
    """kept_q fp8 [E, R, C] (already updated) and launch_compare's bits: fill wire's positions and values."""
    _launch_per_block(delta_pack_kernel, kept_q, (bits, *wire), WBITS=WORD, num_warps=num_warps)


def launch_offsets(
    shape: tuple[int, int, int],
    counts: torch.Tensor,
    pos_offsets: torch.Tensor,
    val_offsets: torch.Tensor,
    length: torch.Tensor,
    align: int,
) -> None:
    """A piece of ``shape`` [E, R, C] with its block ``counts`` (int32): fill ``pos_offsets`` and
    ``val_offsets`` (int64 [blocks]) at payload byte ``length`` (int64 [1], on the device), which
    moves past the piece's fields. Two launches of a program per OFFSETS_CHUNK blocks
    (``delta_totals_kernel``, ``delta_offsets_kernel``); allocates int64 [2, chunks + 1]."""
    e, r, c = shape
    n_rb, n_cb = ceil_blocks(r), ceil_blocks(c)
    n_blocks = e * n_rb * n_cb
    if n_blocks == 0:
        return
    n_chunks = triton.cdiv(n_blocks, OFFSETS_CHUNK)
    totals = torch.empty(2, n_chunks + 1, dtype=torch.int64, device=counts.device)
    meta = {"BR": BLOCK, "BC": BLOCK, "CHUNK": OFFSETS_CHUNK, "num_warps": 4}
    with _on_device(counts):
        delta_totals_kernel[(n_chunks,)](counts, totals, length, n_blocks, n_chunks, r, c, n_rb, n_cb, **meta)
        delta_offsets_kernel[(n_chunks,)](
            counts,
            totals,
            pos_offsets,
            val_offsets,
            length,
            n_blocks,
            n_chunks,
            r,
            c,
            n_rb,
            n_cb,
            ALIGN=align,
            **meta,
        )


def launch_check(
    q: torch.Tensor,
    counts: torch.Tensor,
    pos_offsets: torch.Tensor,
    positions: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    """``bad`` (int32 [blocks], zeroed): per sparse block of q [E, R, C], its offsets outside its
    valid rows and columns (``delta_check_kernel``)."""
    _launch_per_block(
        delta_check_kernel,
        q,
        (counts, pos_offsets, positions, bad, positions.numel()),
        CHUNK=APPLY_CHUNK,
        num_warps=4,
    )


def launch_apply(q: torch.Tensor, wire: Wire) -> None:
    """Write checked changes into the fp8 parameter view q [E, R, C] (any strides)."""
    _launch_per_block(delta_apply_kernel, q, wire, CHUNK=APPLY_CHUNK, num_warps=4)


def _launch_per_block(kernel, q: torch.Tensor, tensors: Sequence[torch.Tensor], **meta) -> None:
    """A program per 128x128 block of q [E, R, C]: kernel(q's bytes, *tensors, R, C, q's strides,
    row blocks, column blocks, BR, BC, **meta)."""
    e, n_rb, n_cb = _grid_dims(q)
    if e * n_rb * n_cb == 0:
        return
    with _on_device(q):
        kernel[(e * n_rb * n_cb,)](
            q.view(torch.uint8),
            *tensors,
            q.shape[1],
            q.shape[2],
            *q.stride(),
            n_rb,
            n_cb,
            BR=BLOCK,
            BC=BLOCK,
            **meta,
        )


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Compiled kernels and streams belong to one device: launch on the tensor's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


__all__ = [
    "APPLY_CHUNK",
    "BITMAP_WORDS",
    "WORD",
    "Wire",
    "delta_apply_kernel",
    "delta_bytes_kernel",
    "delta_check_kernel",
    "delta_compare_kernel",
    "delta_offsets_kernel",
    "delta_pack_kernel",
    "delta_totals_kernel",
    "delta_words_kernel",
    "launch_apply",
    "launch_check",
    "launch_compare",
    "launch_compare_bytes",
    "launch_compare_words",
    "launch_offsets",
    "launch_pack",
    "words_fit",
]

"""The checksum of a message on the wire (docs/layouts.md#checksum): a position-dependent mix of
every 8-byte word, summed.

For words ``w_0 .. w_{n-1}`` (little-endian, as int64) the checksum is the wrapping 64-bit sum
of ``mix(w_i XOR (i * K1))``, where ``mix`` is splitmix64's finalizer (``x ^= x >>> 31; x *=
K2; x ^= x >>> 29; x *= K3; x ^= x >>> 32``, logical shifts). Each term is a bijection of its
word for a given position, so any change to a single word changes the sum; the key and the
finalizer make a change of two words (swapped, +x and -x, top bits flipped in both) cancel only
by a 64-bit coincidence, which a plain or position-weighted sum does not.

Two implementations of the same integer function, equal bit for bit because wrapping integer
arithmetic is exact in any order: a Triton kernel (one read of the message, a partial sum per
32 KiB row into a scratch buffer) for CUDA tensors, and chunked torch ops for CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_WORDS = 4096  # 32 KiB per program: the scratch holds one partial sum per row
K1, K2, K3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CPU_CHUNK = 1 << 20  # words per torch step on the CPU (8 MiB of temporaries)


def _signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


@triton.jit
def checksum_terms(b_w, o_w, k1, k2, k3):
    """Each word's term of the sum, ``mix(w XOR (i * K1))`` (uint64): ``b_w`` the words as uint64,
    ``o_w`` their positions in the message. The keys come in as arguments (a kernel's uint64
    parameters), as ``checksum_rows_kernel`` and the delta comparison pass them."""
    b_x = b_w ^ (o_w.to(tl.uint64) * k1)
    b_x = b_x ^ (b_x >> 31)
    b_x = b_x * k2
    b_x = b_x ^ (b_x >> 29)
    b_x = b_x * k3
    return b_x ^ (b_x >> 32)


@triton.jit
def checksum_rows_kernel(p_words, p_partial, n_words, k1, k2, k3, ROW: tl.constexpr):
    """Program r writes the wrapping sum of ``mix`` over words [r * ROW, (r + 1) * ROW)."""
    i_r = tl.program_id(0).to(tl.int64)
    o_w = i_r * ROW + tl.arange(0, ROW)
    m_w = o_w < n_words
    b_w = tl.load(p_words + o_w, mask=m_w, other=0).to(tl.uint64, bitcast=True)
    b_x = tl.where(m_w, checksum_terms(b_w, o_w, k1, k2, k3), 0)
    tl.store(p_partial + i_r, tl.sum(b_x, axis=0).to(tl.int64, bitcast=True))


def checksum_rows(n_bytes: int) -> int:
    """Scratch entries (int64) a message of ``n_bytes`` needs on a CUDA device."""
    return max(1, -(-n_bytes // (8 * ROW_WORDS)))


def checksum_triton(words: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The checksum of int64 ``words`` as an int64 device scalar; ``scratch`` holds at least
    ``checksum_rows`` int64 entries. Queued on the current stream, no host read."""
    n = words.numel()
    rows = checksum_rows(8 * n)
    partial = scratch[:rows]
    if n == 0:
        return partial[:1].zero_().sum()
    checksum_rows_kernel[(rows,)](words, partial, n, K1, K2, K3, ROW=ROW_WORDS)
    return partial.sum()


def checksum_torch(words: torch.Tensor, first: int = 0) -> torch.Tensor:
    """The same function in torch ops, chunk by chunk (CPU tensors; any device works). ``first``:
    the position of ``words[0]`` in its message (the terms of a part of a message, summed)."""
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    k1, k2, k3 = _signed(K1), _signed(K2), _signed(K3)
    for start in range(0, words.numel(), _CPU_CHUNK):
        w = words[start : start + _CPU_CHUNK]
        at = first + start
        x = torch.arange(at, at + w.numel(), dtype=torch.int64, device=w.device).mul_(k1)
        x.bitwise_xor_(w)
        x.bitwise_xor_((x >> 31) & ((1 << 33) - 1))  # >> is arithmetic on int64: mask it logical
        x.mul_(k2)
        x.bitwise_xor_((x >> 29) & ((1 << 35) - 1))
        x.mul_(k3)
        x.bitwise_xor_((x >> 32) & ((1 << 32) - 1))
        total += x.sum()
    return total


__all__ = [
    "K1",
    "K2",
    "K3",
    "ROW_WORDS",
    "checksum_rows",
    "checksum_rows_kernel",
    "checksum_terms",
    "checksum_torch",
    "checksum_triton",
]

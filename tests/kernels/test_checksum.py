"""The message checksum (glm_fp8.kernels.checksum, docs/layouts.md#checksum).

Invariant: every implementation computes the same 64-bit function (the Triton kernel, on the GPU
or in Triton's interpreter on the CPU; the torch ops of the CPU path; a plain Python oracle), and
the function changes when a message changes in the ways the wire can change it: a flipped bit,
two words swapped within a 32 KiB row, +x and -x in two words of a row, the top bit flipped in two
words, rows reordered, a stale tail.
"""

import pytest
import torch

from glm_fp8.kernels.checksum import K1, K2, K3, checksum_rows, checksum_torch, checksum_triton
from glm_fp8.transfer.wire import checksum_scratch, message_checksum

M64 = (1 << 64) - 1
# The kernel runs where Triton does: the GPU, or the CPU under Triton's interpreter (conftest.py).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _oracle(words: torch.Tensor) -> int:
    total = 0
    for i, w in enumerate(words.tolist()):
        x = (w & M64) ^ ((i * K1) & M64)
        x ^= x >> 31
        x = (x * K2) & M64
        x ^= x >> 29
        x = (x * K3) & M64
        x ^= x >> 32
        total = (total + x) & M64
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize("n", [0, 1, 5, 4096, 4097, 2 * 4096 + 3])
def test_every_implementation_computes_the_same_function(n):
    gen = torch.Generator().manual_seed(n)
    words = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    words[: n // 4] = 0  # zero words still count: their position is mixed in
    scratch = torch.empty(checksum_rows(8 * n), dtype=torch.int64, device=KERNEL_DEVICE)
    want = _oracle(words)
    assert int(checksum_torch(words)) == want
    assert int(checksum_triton(words.to(KERNEL_DEVICE), scratch)) == want


def _message(nbytes: int = 3 * (32 << 10) + 256) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


def _changes(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    words = buf.view(torch.int64)
    out = {}
    x = buf.clone()
    x[100] ^= 1
    out["one flipped bit"] = x
    x = buf.clone()
    w = x.view(torch.int64)
    w[10], w[11] = words[11].clone(), words[10].clone()
    out["two words swapped in a row"] = x
    x = buf.clone()
    w = x.view(torch.int64)
    w[20] += 12345
    w[21] -= 12345
    out["+x and -x in two words of a row"] = x
    x = buf.clone()
    w = x.view(torch.int64)
    w[30] ^= -(2**63)
    w[4000] ^= -(2**63)
    out["top bit flipped in two words"] = x
    x = buf.clone()
    row = 32 << 10
    x[:row], x[row : 2 * row] = buf[row : 2 * row], buf[:row]
    out["two rows swapped"] = x
    x = buf.clone()
    x[-1024:] = 0
    out["a stale tail"] = x
    return out


@pytest.mark.parametrize("cuts", [(0, 7, 4096), (1, 2, 3, 5000), (4097,)])
def test_the_terms_of_a_message_in_parts_sum_to_its_checksum(cuts):
    """``checksum_torch(part, first)`` counts each word at its position in the whole message: the
    parts' sums add up to the message's checksum (the delta comparison takes a segment's checksum
    piece by piece)."""
    words = torch.randint(-(1 << 62), 1 << 62, (sum(cuts),), generator=torch.Generator().manual_seed(5))
    whole, at, parts = int(checksum_torch(words)), 0, 0
    for n in cuts:
        parts += int(checksum_torch(words[at : at + n], at))
        at += n
    assert (parts - whole) % (1 << 64) == 0


def test_it_sees_every_change_the_wire_can_make():
    buf = _message()
    assert len(set(buf.view(torch.int64).tolist())) == buf.numel() // 8  # distinct words: swaps change bytes
    scratch = checksum_scratch(buf.numel(), buf.device)
    base = int(message_checksum(buf, scratch))
    assert int(message_checksum(buf.clone(), scratch)) == base
    for what, other in _changes(buf).items():
        assert int(message_checksum(other, scratch)) != base, what
        words = other.view(torch.int64).to(KERNEL_DEVICE)
        assert int(checksum_triton(words, torch.empty(8, dtype=torch.int64, device=KERNEL_DEVICE))) != base, (
            what
        )


def test_a_length_not_a_multiple_of_eight_is_refused():
    with pytest.raises(ValueError, match="message_checksum: expected a multiple of 8 bytes, got 12"):
        message_checksum(torch.zeros(12, dtype=torch.uint8), torch.empty(1, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200 by bench/gpu_run.sh)")
def test_seeded_fuzz_the_gpu_kernel_against_the_torch_ops():
    """Seeded differential fuzz on the GPU: random lengths (partial rows, one word, several rows)
    and byte offsets into a larger buffer, random and structured words (zeros, all ones, repeats);
    the Triton kernel on the GPU, the torch ops on the GPU and on the CPU give the same value."""
    gen = torch.Generator().manual_seed(20261204)
    for case in range(200):
        n = int(torch.randint(1, 3 * 4096 + 17, (1,), generator=gen))
        offset = 8 * int(torch.randint(0, 64, (1,), generator=gen))
        kind = case % 4
        raw = torch.randint(0, 256, (offset + 8 * n,), dtype=torch.uint8, generator=gen)
        if kind == 1:
            raw[offset:] = 0
        elif kind == 2:
            raw[offset:] = 0xFF
        elif kind == 3:
            raw[offset:] = raw[offset : offset + 8].repeat(n)
        data = raw.cuda()[offset:]
        scratch = checksum_scratch(data.numel(), data.device)
        got = int(message_checksum(data, scratch))
        assert got == int(checksum_torch(data.view(torch.int64))), (case, n, offset, kind)
        assert got == int(checksum_torch(data.cpu().view(torch.int64))), (case, n, offset, kind)
    big = torch.randint(
        0, 256, (3 << 30,), dtype=torch.uint8, device="cuda", generator=None
    )  # 3 GiB: int64 offsets
    assert int(message_checksum(big, checksum_scratch(big.numel(), big.device))) == int(
        checksum_torch(big.view(torch.int64))
    )

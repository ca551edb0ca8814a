"""The message checksum (glm_fp8.kernels.checksum, docs/layouts.md#checksum).

Invariant: every implementation computes the same 64-bit function (the Triton kernel, run by the
interpreter here and on the GPU by bench/gpu_run.sh; the torch ops of the CPU path; a plain
Python oracle), and the function changes when a message changes in the ways the wire can change
it: a flipped bit, two words swapped within a 32 KiB row, +x and -x in two words of a row, the
top bit flipped in two words, rows reordered, a stale tail.
"""

import pytest
import torch

from glm_fp8.kernels.checksum import K1, K2, K3, checksum_rows, checksum_torch, checksum_triton
from glm_fp8.transfer.wire import checksum_scratch, message_checksum

M64 = (1 << 64) - 1


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
    scratch = torch.empty(checksum_rows(8 * n), dtype=torch.int64)
    want = _oracle(words)
    assert int(checksum_torch(words)) == want
    assert int(checksum_triton(words, scratch)) == want  # the kernel, in Triton's interpreter


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


def test_it_sees_every_change_the_wire_can_make():
    buf = _message()
    assert len(set(buf.view(torch.int64).tolist())) == buf.numel() // 8  # distinct words: swaps change bytes
    scratch = checksum_scratch(buf.numel(), buf.device)
    base = int(message_checksum(buf, scratch))
    assert int(message_checksum(buf.clone(), scratch)) == base
    for what, other in _changes(buf).items():
        assert int(message_checksum(other, scratch)) != base, what
        assert int(checksum_triton(other.view(torch.int64), torch.empty(8, dtype=torch.int64))) != base, what


def test_a_length_not_a_multiple_of_eight_is_refused():
    with pytest.raises(ValueError, match="message_checksum: expected a multiple of 8 bytes, got 12"):
        message_checksum(torch.zeros(12, dtype=torch.uint8), torch.empty(1, dtype=torch.int64))

"""The reference against hand-computed blocks, so that reference and kernels cannot share a
mistake. Expected bytes are worked out in the comments from docs/numerics.md, not from code."""

import pytest
import torch

from glm_fp8.kernels.reference import (
    dequantize_blockwise_ref,
    quantize_blockwise_ref,
    quantize_concat_ref,
    round_scale_up_to_pow2,
)


def _bits(x: torch.Tensor) -> list[int]:
    return x.reshape(-1).view(torch.int32).tolist()


def _block(values: list[float], dtype=torch.bfloat16) -> torch.Tensor:
    """A 128x128 block: ``values`` in the first row, the rest zero."""
    x = torch.zeros(128, 128, dtype=dtype)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64).to(dtype)
    return x


def test_scale_is_amax_times_rounded_reciprocal():
    # amax 1.015625: fl32(1.015625 * fl32(1/448)) = 0x3B14924A, while the correctly rounded
    # quotient 1.015625 / 448 would be 0x3B149249 (docs/numerics.md#scale).
    _, s = quantize_blockwise_ref(_block([1.015625, -0.5]))
    assert _bits(s) == [0x3B14924A]


def test_fp32_scale_block_by_hand():
    # amax 1: s = fl32(1/448) = 0x3B124925, slightly above 1/448, so 1/s = 447.99997 -> 448 (0x7E);
    # 0.5/s = 223.99998 -> 224 = 1.75 * 2^7 -> exp 7+7=14, mantissa 110 -> 0x76; -1 -> 0xFE.
    q, s = quantize_blockwise_ref(_block([1.0, 0.5, -1.0]))
    assert _bits(s) == [0x3B124925]
    assert q.view(torch.uint8)[0, :4].tolist() == [0x7E, 0x76, 0xFE, 0x00]


def test_ue8m0_ties_subnormals_and_signed_zero_by_hand():
    # amax 1: s = 0x3B124925 has mantissa bits, so ue8m0 rounds it up to 2^-8 (0x3B800000).
    # y = x * 256 exactly. Grid steps: 4 in [32, 64), 8 in [64, 128), 2^-9 below 2^-6.
    values = [
        1.0,  # 256 = 2^8: exp 15, mant 0 -> 0x78
        42 / 256,  # 42: tie of 40 (mant 010) and 44 (011) -> even 40 -> 0x62
        46 / 256,  # 46: tie of 44 and 48 (100) -> 48 -> 0x64
        -42 / 256,  # -> 0xE2
        127.5 / 256,  # 127.5 -> 128 = 2^7: exp 14 -> 0x70
        1.5 * 2**-17,  # 1.5 * 2^-9: subnormal tie of codes 1 and 2 -> 2 -> 0x02
        2.5 * 2**-17,  # 2.5 * 2^-9: tie of 2 and 3 -> 2 -> 0x02
        -(2**-30),  # rounds to -0 -> 0x80
        -0.0,  # -> 0x80
        0.0,  # -> 0x00
    ]
    q, s = quantize_blockwise_ref(_block(values), scale_fmt="ue8m0")
    assert _bits(s) == [0x3B800000]
    expected = [0x78, 0x62, 0x64, 0xE2, 0x70, 0x02, 0x02, 0x80, 0x80, 0x00]
    assert q.view(torch.uint8)[0, : len(values)].tolist() == expected


def test_zero_block_takes_the_floor():
    # amax 0: s = fl32(1e-12) = 0x2B8CBCCC; ue8m0: 1e-12 = 1.0995 * 2^-40 -> 2^-39 = 0x2C000000.
    q, s = quantize_blockwise_ref(torch.zeros(128, 128))
    assert _bits(s) == [0x2B8CBCCC] and q.view(torch.uint8).unique().tolist() == [0]
    _, s = quantize_blockwise_ref(torch.zeros(128, 128), scale_fmt="ue8m0")
    assert _bits(s) == [0x2C000000]


def test_no_nan_bytes_from_finite_input():
    # x / s can land a hair above 448 (s is rounded); the clamp keeps such values on the grid's
    # top code 0x7E, where an unclamped eager cast would give NaN (0x7F) past 464.
    x = torch.randn(256, 256) * 100
    q, _ = quantize_blockwise_ref(x)
    assert not ((q.view(torch.uint8) & 0x7F) == 0x7F).any()


def test_round_scale_up_to_pow2_edges():
    s = torch.tensor([1.0, 1.0000001, 0.75, 2.0**-20, float("nan"), float("inf")])
    out = round_scale_up_to_pow2(s)
    assert out[:4].tolist() == [1.0, 2.0, 1.0, 2.0**-20]
    assert out[4].isnan() and out[5].isinf()


def test_partial_blocks_and_stacks():
    x = torch.randn(3, 130, 129, dtype=torch.float16)
    q, s = quantize_blockwise_ref(x)
    assert q.shape == x.shape and s.shape == (3, 2, 2)
    for e in range(3):
        qe, se = quantize_blockwise_ref(x[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
    err = (dequantize_blockwise_ref(q, s) - x.float()).abs().max() / x.float().abs().max()
    assert err < 0.07  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative


def test_concat_is_one_matrix():
    a, b = torch.randn(100, 64), torch.randn(60, 64)
    q, s = quantize_concat_ref([a, b])
    qc, sc = quantize_blockwise_ref(torch.cat([a, b]))
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s, sc)
    assert s.shape == (2, 1)  # row block 0 straddles a (rows 0-99) and b (rows 100-127)


def test_non_finite_poisons_its_block_only():
    x = torch.randn(256, 128)
    x[3, 4] = float("nan")
    _, s = quantize_blockwise_ref(x)
    assert s[0, 0].isnan() and s[1, 0].isfinite()


@pytest.mark.parametrize("bad", ["rank", "dtype", "fmt"])
def test_reference_rejects_bad_input(bad):
    x = {"rank": torch.zeros(4), "dtype": torch.zeros(4, 4, dtype=torch.int32)}.get(bad, torch.zeros(4, 4))
    with pytest.raises((ValueError, TypeError)):
        quantize_blockwise_ref(x, scale_fmt="e8" if bad == "fmt" else "fp32")

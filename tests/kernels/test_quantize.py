"""Fused kernels against the reference, bit for bit, on every backend that runs here.

Invariant: for any valid input and any backend, ``quantize_blockwise(sources)`` writes exactly
the bytes and scales of ``quantize_concat_ref(sources)`` into every element of its outputs and
into no other byte. Outputs are poisoned (0xFF / NaN) first, so an unwritten element cannot pass.
Tests taking the ``backend`` fixture run once per backend (conftest.BACKENDS); tests taking a
``config`` exercise the Triton kernel's launch variants.
"""

import pytest
import torch
from conftest import GPU_BACKENDS, ON_GPU, assert_same_bits, poisoned_f32, poisoned_fp8

from glm_fp8 import ExpertsFP8, LaunchConfig, NonFiniteError, quantize_blockwise, quantize_experts
from glm_fp8.core.numerics import ceil_blocks
from glm_fp8.kernels.reference import quantize_concat_ref, quantize_experts_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FMTS = ["fp32", "ue8m0"]
# Kernel variants that must all agree: launch shapes and both arithmetic paths.
CONFIGS = [
    LaunchConfig(),
    LaunchConfig(cb_per_prog=3, num_warps=4, fma_div=False),
    LaunchConfig(programs_per_sm=1, num_stages=2, num_warps=4),
    LaunchConfig(soft_fp8=not ON_GPU, fma_div=True) if ON_GPU else LaunchConfig(cb_per_prog=2),
    LaunchConfig(soft_fp8=True, fma_div=False),
    LaunchConfig(cb_per_prog=2, num_warps=4, maxnreg=None, signed_quotient=False),
    LaunchConfig(signed_quotient=False, fma_div=False),
]


def _check(sources, scale_fmt="fp32", config=None, backend=None, **kw):
    sources = sources if isinstance(sources, (list, tuple)) else [sources]
    q_ref, s_ref = quantize_concat_ref(sources, scale_fmt)
    out, scale_out = poisoned_fp8(q_ref.shape, q_ref.device), poisoned_f32(s_ref.shape, s_ref.device)
    q, s = quantize_blockwise(
        sources, out=out, scale_out=scale_out, scale_fmt=scale_fmt, config=config, backend=backend, **kw
    )
    assert q is out and s is scale_out
    assert_same_bits(q, s, q_ref, s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_fmt", FMTS)
@pytest.mark.parametrize("magnitude", [1e-9, 1e-3, 1.0, 1e3])
def test_random_stack_two_sources(device, dtype, scale_fmt, magnitude, backend):
    # rows 100 + 90: row block 0 straddles the boundary; 260 columns end in a partial block.
    a = (torch.randn(2, 100, 260, device=device) * magnitude).to(dtype)
    b = (torch.randn(2, 90, 260, device=device) * magnitude * 3).to(dtype)
    _check([a, b], scale_fmt, backend=backend)


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: (
        f"cb{c.cb_per_prog}-p{c.programs_per_sm}-w{c.num_warps}-fma{int(c.fma_div)}-soft{c.soft_fp8}"
        f"-signed{int(c.signed_quotient)}-r{c.maxnreg}"
    ),
)
@pytest.mark.parametrize("scale_fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_launch_variants_agree(device, config, scale_fmt, dtype):
    """Every launch config gives the reference's bits, on both signs and on -0.0."""
    x = torch.randn(3, 140, 520, device=device) * torch.logspace(-4, 2, 520, device=device)
    x[:, 7, :] = -0.0
    x[1, 130:, 300:] = -x[1, 130:, 300:].abs()  # an all-negative partial block
    _check(x.to(dtype), scale_fmt, config)


@pytest.mark.parametrize("scale_fmt", FMTS)
def test_zero_tiny_and_wide_range_blocks(device, scale_fmt, backend):
    x = torch.randn(256, 384, device=device)
    x[:128, :128] = 0.0  # all-zero block: scale takes the 1e-12 floor
    x[:128, 128:256] *= 1e-30  # tiny block: below the floor's reach
    x[128:, :128] = torch.randn(128, 128, device=device) * 1e-40  # float32 subnormals
    x[128:, 128:256] = -0.0  # negative zeros keep their sign byte 0x80
    x[:128, 256:] *= 3e38 / x[:128, 256:].abs().max()  # near float32's largest
    _check(x, scale_fmt, backend=backend)
    _check(x.to(torch.bfloat16), scale_fmt, backend=backend)


def _ties() -> torch.Tensor:
    # amax 1 with ue8m0 gives s = 2^-8, so x = (k + 1/2) * step * 2^-8 is an exact e4m3 tie.
    steps = torch.tensor([2.0**-9] * 8 + [2.0**-6] * 8 + [2.0**-3] * 8 + [1.0] * 8 + [8.0] * 8 + [16.0] * 8)
    bases = torch.tensor([0.0] + [2.0**-6, 2.0**-3, 1.0, 8.0, 64.0, 128.0]).repeat_interleave(8)
    k = torch.arange(48) % 8
    ties = (bases[:48] + (k + 0.5) * steps) / 256.0
    x = torch.zeros(128, 128)
    x[0, 0] = 1.0
    x[1:, :48] = ties * torch.where(torch.rand(127, 48) < 0.5, -1.0, 1.0)
    x[1:, 48:96] = ties[torch.randperm(48)]
    return x


@pytest.mark.parametrize("config", CONFIGS[:3] + CONFIGS[4:])
def test_rounding_ties(device, config):
    x = _ties().to(device)
    _check(x, "ue8m0", config)
    _check(x.to(torch.bfloat16), "ue8m0", config)


def test_rounding_ties_every_backend(device, backend):
    x = _ties().to(device)
    _check(x, "ue8m0", backend=backend)
    _check(x.to(torch.bfloat16), "ue8m0", backend=backend)


@pytest.mark.parametrize("rows", [[1], [127, 1], [128, 128], [100, 60, 3, 200], [5, 0, 250]])
def test_partial_blocks_and_straddles(device, rows, backend):
    sources = [torch.randn(r, 131, device=device, dtype=torch.bfloat16) * (k + 1) for k, r in enumerate(rows)]
    _check(sources, backend=backend)


def test_one_column_and_one_row(device, backend):
    _check(torch.randn(1, 1, device=device), backend=backend)
    _check(torch.randn(300, 1, device=device), backend=backend)
    _check(torch.randn(1, 300, device=device), backend=backend)


def test_strided_inputs_are_read_in_place(device, backend):
    base = torch.randn(4, 300, 200, device=device, dtype=torch.bfloat16)
    t = base.transpose(1, 2)  # [4, 200, 300], column stride 200
    sl = base[::2, 10:170]  # every other expert, a row slice
    cs = base[:2, :, ::2]  # column stride 2
    _check([t[:2, :150], t[2:, 150:]], backend=backend)
    _check(sl, backend=backend)
    _check([cs[:, :70], cs[:, 70:]], backend=backend)
    # Sources with different column strides take the per-source masked loads.
    _check(
        [base[:, :100, :150].transpose(1, 2), torch.randn(4, 60, 100, device=device, dtype=torch.bfloat16)],
        backend=backend,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_and_scalar_access_paths(device, backend, dtype):
    """Aligned rows take vector loads/stores, with a scalar tail when C % 8 != 0; an odd
    element offset or an odd output offset forces the scalar paths. All must agree."""
    base = torch.randn(3, 300, 272, device=device).to(dtype) * torch.logspace(-3, 3, 272, device=device).to(
        dtype
    )
    _check(base[:, :, :261], backend=backend)  # 16-byte aligned rows, 261 = 32 * 8 + 5
    _check([base[:, :100], base[:, 100:140], base[:, 140:141], base[:, 141:]], backend=backend)
    _check(base[:, :, 1:], backend=backend)  # rows start one element past alignment
    q_ref, s_ref = quantize_concat_ref([base])
    big = torch.full((3, 300, 280), 0xFF, dtype=torch.uint8, device=device)
    out = big[:, :, 3:275].view(torch.float8_e4m3fn)  # output rows 3 bytes past alignment
    scale_out = poisoned_f32(s_ref.shape, device)
    quantize_blockwise(base, out=out, scale_out=scale_out, backend=backend)
    assert_same_bits(out, scale_out, q_ref, s_ref)
    assert (big[:, :, :3] == 0xFF).all() and (big[:, :, 275:] == 0xFF).all()


def test_repeated_launches_keep_each_specialization(device, backend):
    """On a GPU the second call of a shape launches the compiled kernel kept from the first;
    a different alignment or stride of the same shape must get its own kernel (bits checked on
    poisoned outputs each time)."""
    base = torch.randn(2, 300, 272, device=device)
    for x in (base, base, base[:, :, 1:], base, base[:, :, :256], base[:, :, 16:]):
        for _ in range(2):
            _check(x, backend=backend)
            _check([x[:, :100], x[:, 100:]], backend=backend)


def test_launch_arguments_follow_the_kernel_signature():
    """The direct launch passes every argument positionally: pointers, integers, constexprs."""
    from glm_fp8.kernels.triton_quantize import launch_args, quantize_blockwise_kernel

    srcs = [torch.randn(2, 100, 300), torch.randn(2, 60, 300)]
    q = torch.empty(2, 160, 300, dtype=torch.float8_e4m3fn)
    s = torch.empty(2, 2, 3)
    tensors, ints = launch_args(srcs, q, s, None)
    names = quantize_blockwise_kernel.arg_names
    constexprs = [
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
    ]
    assert names[: len(tensors)] == ["p_q", "p_s", "p_flag", "p_x0", "p_x1", "p_x2", "p_x3"]
    assert names[len(tensors) + len(ints) :] == constexprs
    by_name = dict(zip(names[len(tensors) :], ints))
    assert [by_name[k] for k in ("r1", "r2", "r3", "R", "C")] == [100, 160, 160, 160, 300]
    assert (by_name["s_x1e"], by_name["s_x1r"], by_name["s_qe"], by_name["s_sr"]) == (18000, 300, 48000, 3)
    assert (by_name["n_e"], by_name["n_rb"], by_name["n_cb"]) == (2, 2, 3)


def test_unaligned_outputs_take_the_kernel_without_source_alignment():
    """Triton 3.6 on the H200 miscompiled vectorized source loads feeding unaligned byte
    stores; such outputs go to the twin kernel compiled without source-alignment assumptions."""
    from glm_fp8.kernels.triton_quantize import stores_vectorize

    buf = torch.empty(2 * 300 * 272 + 16, dtype=torch.uint8)
    assert stores_vectorize(buf[16:].view(2, 300, 272))
    assert not stores_vectorize(buf[3 : 3 + 2 * 300 * 272].view(2, 300, 272))  # 3 bytes in
    assert not stores_vectorize(buf[: 2 * 300 * 261].view(2, 300, 261))  # rows of 261 bytes
    assert not stores_vectorize(buf[: 2 * 300 * 272].view(2, 272, 300).transpose(1, 2))


def test_out_is_a_view_into_a_larger_buffer(device, backend):
    e, r, c = 2, 150, 200
    w1, w3 = torch.randn(e, 70, c, device=device), torch.randn(e, 80, c, device=device)
    q_ref, s_ref = quantize_concat_ref([w1, w3])
    big = torch.full((e + 1, r + 7, c + 9), 0xAB, dtype=torch.uint8, device=device)
    big_s = torch.full((e, 5, 5), -7.0, device=device)
    out = big[1:, 3 : 3 + r, 4 : 4 + c].view(torch.float8_e4m3fn)
    scale_out = big_s[:, 1:3, 2:4]
    before = big.clone()
    quantize_blockwise([w1, w3], out=out, scale_out=scale_out, backend=backend)
    assert_same_bits(out, scale_out, q_ref, s_ref)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[1:, 3 : 3 + r, 4 : 4 + c] = False
    assert torch.equal(big[untouched], before[untouched])
    s_untouched = torch.ones_like(big_s, dtype=torch.bool)
    s_untouched[:, 1:3, 2:4] = False
    assert (big_s[s_untouched] == -7.0).all()


def test_allocating_wrapper_returns_exact_outputs(device, backend):
    x = torch.randn(3, 200, 130, device=device, dtype=torch.float16)
    q, s = quantize_blockwise(x, backend=backend)
    assert q.shape == (3, 200, 130) and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert s.shape == (3, 2, 2) and s.dtype == torch.float32
    assert_same_bits(q, s, *quantize_concat_ref([x]))


@pytest.mark.parametrize("shape", [(0, 100, 100), (3, 0, 100), (3, 100, 0), (0, 0), (5, 0)])
def test_empty_inputs(device, shape, backend):
    x = torch.randn(shape, device=device)
    q, s = quantize_blockwise(x, backend=backend)
    assert q.shape == shape and s.shape == (*shape[:-2], ceil_blocks(shape[-2]), ceil_blocks(shape[-1]))


def test_single_expert(device, backend):
    _check(torch.randn(1, 260, 140, device=device, dtype=torch.bfloat16), backend=backend)


# ---------------------------------------------------------------------------------- experts


def _experts(e, i, h, device, dtype=torch.bfloat16, transposed=False):
    if transposed:  # torchtitan-style storage [E, H, I] read through a transposed view
        w1 = torch.randn(e, h, i, device=device, dtype=dtype).transpose(1, 2)
        w3 = torch.randn(e, h, i, device=device, dtype=dtype).transpose(1, 2)
    else:
        w1 = torch.randn(e, i, h, device=device, dtype=dtype)
        w3 = torch.randn(e, i, h, device=device, dtype=dtype) * 2
    w2 = torch.randn(e, h, i, device=device, dtype=dtype) * 0.5
    return w1, w3, w2


@pytest.mark.parametrize("e", [0, 1, 3])
@pytest.mark.parametrize("scale_fmt", FMTS)
@pytest.mark.parametrize("transposed", [False, True])
def test_experts_match_eager_per_expert_path(device, e, scale_fmt, transposed, backend):
    w1, w3, w2 = _experts(e, 96, 136, device, transposed=transposed)  # 2I = 192: straddles
    ref = quantize_experts_ref(w1, w3, w2, scale_fmt)
    got = quantize_experts(w1, w3, w2, scale_fmt=scale_fmt, backend=backend)
    assert_same_bits(got.w13, got.w13_scale_inv, ref[0], ref[1])
    assert_same_bits(got.w2, got.w2_scale_inv, ref[2], ref[3])


def test_experts_into_caller_buffers(device, backend):
    w1, w3, w2 = _experts(2, 64, 200, device, dtype=torch.float32)
    out = ExpertsFP8.empty(2, 200, 64, device=device)
    for _, t in out.items():
        (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).fill_(
            0xFF if t.dtype != torch.float32 else float("nan")
        )
    got = quantize_experts(w1, w3, w2, out=out, backend=backend)
    assert all(a is b for (_, a), (_, b) in zip(got.items(), out.items()))
    ref = quantize_experts_ref(w1, w3, w2)
    assert_same_bits(got.w13, got.w13_scale_inv, ref[0], ref[1])
    assert_same_bits(got.w2, got.w2_scale_inv, ref[2], ref[3])
    assert [n for n, _ in got.items()] == [
        "w13_weight",
        "w13_weight_scale_inv",
        "w2_weight",
        "w2_weight_scale_inv",
    ]
    assert got.nbytes == 2 * (128 * 200 + 200 * 64) + 4 * 2 * (1 * 2 + 2 * 1)


# ---------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_named(device, value, backend):
    a, b = torch.randn(2, 100, 300, device=device), torch.randn(2, 70, 300, device=device)
    b[1, 40, 290] = value
    with pytest.raises(NonFiniteError, match=r"sources\[1\].*sources\[1\]\[1, 40, 290\].*block 1,2") as info:
        quantize_blockwise([a, b], backend=backend)
    assert (info.value.source, info.value.expert, info.value.block) == ("sources[1]", 1, (1, 2))


@pytest.mark.parametrize("weight", ["w1", "w3", "w2"])
def test_non_finite_in_experts_names_the_weight(device, backend, weight):
    w = dict(zip(("w1", "w3", "w2"), _experts(3, 64, 128, device)))
    w[weight][2, 10, 5] = float("nan")
    w1, w3, w2 = w.values()
    with pytest.raises(NonFiniteError, match=rf"{weight}: nan at {weight}\[2, 10, 5\]"):
        quantize_experts(w1, w3, w2, backend=backend)


def test_flag_is_clean_for_the_next_call(device, backend):
    """The finite check's flag lives across calls (one per thread and device): a call that
    found NaN, or failed after its kernels ran, leaves it zero for the next one."""
    from glm_fp8.kernels import backends, jobs

    x = torch.randn(256, 256, device=device)
    x[3, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize_blockwise(x, backend=backend)
    x[3, 3] = 1.0
    _check(x, backend=backend)  # raises NonFiniteError if the flag were still set
    assert jobs.nonfinite_flag(x.device).item() == 0

    def set_then_fail(work, ue8m0, flag, config):
        flag.fill_(1)
        raise RuntimeError("launcher failed")

    saved = backends.LAUNCHERS["torch"]
    backends.LAUNCHERS["torch"] = set_then_fail
    try:
        with pytest.raises(RuntimeError, match="launcher failed"):
            quantize_blockwise(x, backend="torch")
    finally:
        backends.LAUNCHERS["torch"] = saved
    assert jobs.nonfinite_flag(x.device).item() == 0
    _check(x, backend=backend)


def test_check_finite_off_poisons_only_that_block(device, backend):
    x = torch.randn(256, 256, device=device)
    x[130, 3] = float("nan")
    q, s = quantize_blockwise(x, check_finite=False, backend=backend)
    assert s[1, 0].isnan() and torch.isfinite(s[[0, 0, 1], [0, 1, 1]]).all()
    q_ref, s_ref = quantize_concat_ref([x])
    keep = torch.ones(256, 256, dtype=torch.bool)
    keep[128:, :128] = False
    assert torch.equal(q.cpu().view(torch.uint8)[keep], q_ref.cpu().view(torch.uint8)[keep])


@pytest.mark.skipif(not ON_GPU, reason="needs > 2**31 elements on a GPU (run on the H200)")
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
def test_64bit_addressing_past_2_pow_31_elements(gpu_backend):
    # 2 experts of [8192, 2**17 + 100] bf16: 2.15e9 elements, 4.3 GB. int32 offsets would wrap.
    x = torch.randn(2, 8192, 2**17 + 100, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    q, s = quantize_blockwise(x, backend=gpu_backend)
    tail = x[1, -300:, -1000:]  # blocks straddling nothing; compare the last corner exactly
    q_ref, s_ref = quantize_concat_ref([x[1, -256:, -1124:]])
    assert torch.equal(q[1, -256:, -1124:].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s[1, -2:, -9:], s_ref)
    del tail


@pytest.mark.skipif(not ON_GPU, reason="device memory accounting needs CUDA")
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
@pytest.mark.parametrize("check_finite", [True, False])
def test_with_out_nothing_is_allocated(gpu_backend, check_finite):
    """With ``out`` given a call allocates no device memory at all: the finite check's flag is
    allocated by the first call of a thread on a device and reused."""
    w1, w3, w2 = _experts(16, 512, 1024, "cuda")
    out = ExpertsFP8.empty(16, 1024, 512, device="cuda")
    quantize_experts(w1, w3, w2, out=out, backend=gpu_backend)  # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    quantize_experts(w1, w3, w2, out=out, check_finite=check_finite, backend=gpu_backend)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base == 0

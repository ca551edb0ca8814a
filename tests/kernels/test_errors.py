"""Bad arguments raise ValueError/TypeError naming the argument, before any byte is written."""

import pytest
import torch
from conftest import BACKENDS, poisoned_f32, poisoned_fp8

from glm_fp8 import (
    ExpertsFP8,
    LaunchConfig,
    get_default_backend,
    quantize_blockwise,
    quantize_experts,
    set_default_backend,
)
from glm_fp8.kernels.reference import quantize_concat_ref


def _raises(exc, match, fn, *watch):
    before = [t.clone() for t in watch]
    with pytest.raises(exc, match=match):
        fn()
    for b, t in zip(before, watch):  # nothing was written
        assert torch.equal(b.view(torch.uint8), t.view(torch.uint8))


def test_blockwise_argument_errors(device):
    x = torch.randn(2, 130, 140, device=device)
    out, sc = poisoned_fp8((2, 130, 140), device), poisoned_f32((2, 2, 2), device)
    q = lambda *a, **k: lambda: quantize_blockwise(*a, **k)  # noqa: E731
    _raises(
        TypeError,
        r"sources\[0\]: expected dtype bfloat16, float16 or float32, got torch.int32",
        q([x.to(torch.int32)]),
        out,
    )
    _raises(TypeError, "sources: expected a tensor or a sequence", q(iter([x])))
    _raises(ValueError, "sources: expected at least one", q([]))
    _raises(ValueError, "at most 4 tensors", q([x] * 5))
    _raises(ValueError, r"sources: expected a 2-D or 3-D tensor, got shape \(140,\)", q(x[0, 0]))
    _raises(TypeError, r"sources\[1\]: expected dtype torch.float32 \(as sources\[0\]\)", q([x, x.half()]))
    _raises(ValueError, r"sources\[1\]: expected a 3-D tensor \(as sources\[0\]\)", q([x, x[0]]))
    _raises(ValueError, r"sources\[1\]: expected 140 columns", q([x, x[..., :139]]))
    _raises(ValueError, r"sources\[1\]: expected 2 experts", q([x, x[:1]]))
    _raises(
        ValueError,
        r"out: expected shape \(2, 130, 140\), got \(2, 130, 139\)",
        q(x, out=out[..., :139], scale_out=sc),
        sc,
    )
    _raises(
        TypeError,
        "out: expected dtype torch.float8_e4m3fn, got torch.uint8",
        q(x, out=out.view(torch.uint8), scale_out=sc),
        sc,
    )
    _raises(
        ValueError,
        r"scale_out: expected shape \(2, 2, 2\), got \(2, 2, 1\)",
        q(x, out=out, scale_out=sc[..., :1]),
        out,
    )
    _raises(
        TypeError,
        "scale_out: expected dtype torch.float32, got torch.float64",
        q(x, out=out, scale_out=sc.double()),
        out,
    )
    _raises(ValueError, "scale_fmt: expected one of", q(x, scale_fmt="e8m0"))
    _raises(
        ValueError, "out: dimension 0 has stride 0", q(x, out=out[:1].expand(2, 130, 140), scale_out=sc), sc
    )
    # An output that shares bytes with an input, or with the other output.
    xb = torch.randn(2, 130, 140, device=device, dtype=torch.bfloat16)
    alias = xb.view(torch.uint8)[..., :140].view(torch.float8_e4m3fn)
    _raises(ValueError, "out: overlaps sources", q(xb, out=alias, scale_out=sc), xb, sc)
    flat = torch.empty(2 * 130 * 140, dtype=torch.uint8, device=device)
    _raises(
        ValueError,
        "out: overlaps scale_out",
        q(
            x,
            out=flat.view(torch.float8_e4m3fn).view(2, 130, 140),
            scale_out=flat[:32].view(torch.float32).view(2, 2, 2),
        ),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices (cpu and cuda)")
def test_device_mismatch_is_named():
    with pytest.raises(
        ValueError, match=r"sources\[1\]: expected device cuda:0 \(as sources\[0\]\), got cpu"
    ):
        quantize_blockwise([torch.randn(4, 4, device="cuda"), torch.randn(4, 4)])
    x = torch.randn(4, 4, device="cuda")
    with pytest.raises(ValueError, match="out: expected device cuda:0, got cpu"):
        quantize_blockwise(x, out=torch.empty(4, 4, dtype=torch.float8_e4m3fn))


def test_experts_argument_errors(device):
    w1 = torch.randn(2, 64, 96, device=device)
    w2 = torch.randn(2, 96, 64, device=device)
    out = ExpertsFP8.empty(2, 96, 64, device=device)
    _raises(
        ValueError,
        r"w3: expected shape \(2, 64, 96\) \(as w1\), got \(3, 64, 96\)",
        lambda: quantize_experts(w1, torch.randn(3, 64, 96, device=device), w2),
    )
    _raises(
        ValueError, r"w2: expected shape \(2, 96, 64\)", lambda: quantize_experts(w1, w1, w2.transpose(1, 2))
    )
    _raises(
        ValueError,
        r"w1: expected a 3-D tensor, got shape \(64, 96\)",
        lambda: quantize_experts(w1[0], w1[0], w2[0]),
    )
    _raises(
        TypeError, r"w3: expected dtype torch.float32 \(as w1\)", lambda: quantize_experts(w1, w1.half(), w2)
    )
    _raises(
        TypeError,
        "out: expected an ExpertsFP8, got tuple",
        lambda: quantize_experts(w1, w1, w2, out=tuple(t for _, t in out.items())),
    )
    bad = ExpertsFP8(out.w13, out.w13_scale_inv, out.w2, out.w13_scale_inv)
    # Two outputs sharing one buffer, and a wrong w2 buffer: caught before the w13 launch.
    _raises(
        ValueError,
        "out.w13_scale_inv: overlaps out.w2_scale_inv",
        lambda: quantize_experts(w1, w1, w2, out=bad),
        out.w13,
    )
    small = ExpertsFP8.empty(2, 96, 64, device=device)
    wrong = ExpertsFP8(small.w13, small.w13_scale_inv, small.w2, torch.empty(2, 1, 2, device=device))
    _raises(
        ValueError,
        r"out.w2_scale_inv: expected shape \(2, 1, 1\), got \(2, 1, 2\)",
        lambda: quantize_experts(w1, w1, w2, out=wrong),
        small.w13,
    )


def test_cpu_without_interpreter_is_refused_by_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton': the inputs are on cpu"):
        quantize_blockwise(torch.randn(4, 4), backend="triton")


def test_auto_on_cpu_without_interpreter_takes_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(130, 260)
    q, s = quantize_blockwise(x)  # backend "auto" -> "torch"
    assert torch.equal(q.view(torch.uint8), quantize_concat_ref([x])[0].view(torch.uint8))


def test_backend_errors(device):
    x = torch.randn(4, 4, device=device)
    with pytest.raises(ValueError, match=r"backend: expected one of .*'torch', got 'cutlass'"):
        quantize_blockwise(x, backend="cutlass")
    with pytest.raises(ValueError, match="config: a LaunchConfig tunes the Triton backend, but backend="):
        quantize_blockwise(x, backend="torch", config=LaunchConfig())
    with pytest.raises(ValueError, match="backend: expected one of"):
        set_default_backend("fast")
    if "cuda" not in BACKENDS:
        with pytest.raises(RuntimeError, match="backend='cuda'"):
            quantize_blockwise(x, backend="cuda")


def test_default_backend_is_used(device, monkeypatch):
    import glm_fp8.kernels.backends as backends
    from glm_fp8.kernels import torch_ref

    calls = []
    monkeypatch.setitem(backends.LAUNCHERS, "torch", lambda *a: calls.append(a) or torch_ref.launch(*a))
    x = torch.randn(4, 4, device=device)
    set_default_backend("torch")
    try:
        quantize_blockwise(x)
    finally:
        set_default_backend("auto")
    assert len(calls) == 1 and get_default_backend() == "auto"


# --- Hardening (item 5): outputs that alias themselves, cannot be written, have no data -------


def _overlapping(shape, strides, dtype, device, fill):
    """A view whose elements share memory (non-zero strides), over a buffer of ``fill`` bytes;
    returns (view, the whole buffer) so a test can watch every byte."""
    n = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    base = torch.full((n * dtype.itemsize,), fill, dtype=torch.uint8, device=device).view(dtype)
    return base.as_strided(shape, strides), base


def test_outputs_that_overlap_themselves_are_refused(device):
    x = torch.randn(2, 130, 140, device=device)
    out, sc = poisoned_fp8((2, 130, 140), device), poisoned_f32((2, 2, 2), device)
    # Rows 139 elements apart, 140 wide: each row's last element is the next row's first.
    rows, rows_base = _overlapping((2, 130, 140), (130 * 139 + 1, 139, 1), torch.float8_e4m3fn, device, 0xFF)
    _raises(
        ValueError,
        r"out: expected an output whose elements cannot overlap, got shape \(2, 130, 140\) with strides "
        r"\(18071, 139, 1\): dimension 1 steps 139 elements, inside the 140",
        lambda: quantize_blockwise(x, out=rows, scale_out=sc),
        rows_base,
        sc,
    )
    # An [8, 8] view of 64 elements with strides (1, 1).
    diag, diag_base = _overlapping((8, 8), (1, 1), torch.float8_e4m3fn, device, 0xFF)
    _raises(
        ValueError,
        r"out: expected an output whose elements cannot overlap, got shape \(8, 8\) with strides \(1, 1\)",
        lambda: quantize_blockwise(x[0, :8, :8], out=diag),
        diag_base,
    )
    # Scales: expert 1 is expert 0 shifted by one scale.
    scales, s_base = _overlapping((2, 2, 2), (1, 2, 1), torch.float32, device, 0xFF)
    _raises(
        ValueError,
        r"scale_out: expected an output whose elements cannot overlap",
        lambda: quantize_blockwise(x, out=out, scale_out=scales),
        out,
        s_base,
    )
    # Permuted and sliced outputs never overlap: accepted, and the result is exact.
    perm = poisoned_fp8((140, 2, 130), device).permute(1, 2, 0)
    q, s = quantize_blockwise(x, out=perm, scale_out=sc, backend="torch")
    q_ref, s_ref = quantize_concat_ref([x])
    assert q is perm and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_experts_outputs_that_overlap_themselves_are_refused(device):
    w1 = torch.randn(2, 64, 96, device=device)
    w2 = torch.randn(2, 96, 64, device=device)
    out = ExpertsFP8.empty(2, 96, 64, device=device)
    # Both experts of w13 on one [128, 96] slab, rows 96 apart: expert 1 starts at row 1.
    w13, base = _overlapping((2, 128, 96), (96, 96, 1), torch.float8_e4m3fn, device, 0xFF)
    bad = ExpertsFP8(w13, out.w13_scale_inv, out.w2, out.w2_scale_inv)
    _raises(
        ValueError,
        r"out.w13: expected an output whose elements cannot overlap, got shape \(2, 128, 96\) with "
        r"strides \(96, 96, 1\): dimension 1 steps 96 elements",
        lambda: quantize_experts(w1, w1, w2, out=bad),
        base,
        out.w13_scale_inv,
        out.w2,
        out.w2_scale_inv,
    )
    w2_out, base = _overlapping((2, 96, 64), (96 * 64, 32, 1), torch.float8_e4m3fn, device, 0xFF)
    bad = ExpertsFP8(out.w13, out.w13_scale_inv, w2_out, out.w2_scale_inv)
    _raises(
        ValueError,
        r"out.w2: expected an output whose elements cannot overlap",
        lambda: quantize_experts(w1, w1, w2, out=bad),
        base,
        out.w13,
        out.w13_scale_inv,
        out.w2_scale_inv,
    )


def test_outputs_that_cannot_be_written_are_refused(device):
    x = torch.randn(2, 130, 140, device=device)
    out, sc = poisoned_fp8((2, 130, 140), device), poisoned_f32((2, 2, 2), device)
    q = lambda **k: lambda: quantize_blockwise(x, backend="torch", **k)  # noqa: E731
    needs_grad = poisoned_f32((2, 2, 2), device).requires_grad_()
    _raises(
        ValueError,
        r"^scale_out: expected a tensor that does not require grad \(it is written outside autograd\), "
        r"got requires_grad=True; pass scale_out.detach\(\)$",
        q(out=out, scale_out=needs_grad),
        out,
        needs_grad.detach(),
    )
    with torch.inference_mode():
        frozen_q = poisoned_fp8((2, 130, 140), device)
        frozen_s = poisoned_f32((2, 2, 2), device)
    frozen = (
        r"expected a tensor writable outside inference mode, got an inference tensor \(allocated under "
        r"torch.inference_mode\(\)\); allocate it outside inference mode or make this call under "
        r"torch.inference_mode\(\)$"
    )
    _raises(ValueError, "^out: " + frozen, q(out=frozen_q, scale_out=sc), frozen_q, sc)
    _raises(ValueError, "^scale_out: " + frozen, q(out=out, scale_out=frozen_s), out, frozen_s)
    # Inside inference mode the write is allowed, by torch and by us: same bits as the reference.
    with torch.inference_mode():
        got_q, got_s = quantize_blockwise(x, out=frozen_q, scale_out=frozen_s, backend="torch")
    q_ref, s_ref = quantize_concat_ref([x])
    assert torch.equal(got_q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(got_s, s_ref)
    # quantize_experts names the field.
    w1, w2 = torch.randn(2, 64, 96, device=device), torch.randn(2, 96, 64, device=device)
    with torch.inference_mode():
        frozen_out = ExpertsFP8.empty(2, 96, 64, device=device)
    _raises(
        ValueError,
        "^out.w13: " + frozen,
        lambda: quantize_experts(w1, w1, w2, out=frozen_out),
        *(t for _, t in frozen_out.items()),
    )


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_and_meta_tensors_are_refused(device):
    x = torch.randn(2, 130, 140, device=device)
    out, sc = poisoned_fp8((2, 130, 140), device), poisoned_f32((2, 2, 2), device)
    q = lambda *a, **k: lambda: quantize_blockwise(*a, **k)  # noqa: E731
    out2, sc2 = poisoned_fp8((260, 140), device), poisoned_f32((3, 2), device)
    _raises(
        TypeError,
        r"^sources\[1\]: expected a strided \(dense\) tensor, got layout torch.sparse_coo$",
        q([x[0], x[1].to_sparse()], out=out2, scale_out=sc2),
        out2,
        sc2,
    )
    _raises(
        ValueError,
        r"^sources: expected a tensor with data, got a meta tensor$",
        q(x.to("meta"), out=out, scale_out=sc),
        out,
        sc,
    )
    _raises(
        TypeError,
        r"^scale_out: expected a strided \(dense\) tensor, got layout torch.sparse_coo$",
        q(x, out=out, scale_out=sc.to_sparse()),
        out,
    )
    csr = poisoned_f32((2, 2), device).to_sparse_csr()  # is_contiguous() raises on these
    _raises(
        TypeError,
        r"^scale_out: expected a strided \(dense\) tensor, got layout torch.sparse_csr$",
        q(x[0], out=out[0], scale_out=csr),
        out,
    )
    _raises(
        ValueError,
        r"^out: expected a tensor with data, got a meta tensor$",
        q(x, out=torch.empty(2, 130, 140, dtype=torch.float8_e4m3fn, device="meta"), scale_out=sc),
        sc,
    )
    w1, w2 = torch.randn(2, 64, 96, device=device), torch.randn(2, 96, 64, device=device)
    _raises(
        TypeError,
        r"^w3: expected a strided \(dense\) tensor, got layout torch.sparse_coo$",
        lambda: quantize_experts(w1, w1.to_sparse(), w2),
    )
    _raises(
        ValueError,
        r"^w2: expected a tensor with data, got a meta tensor$",
        lambda: quantize_experts(w1, w1, w2.to("meta")),
    )
    out = ExpertsFP8.empty(2, 96, 64, device=device)
    bad = ExpertsFP8(out.w13, out.w13_scale_inv, out.w2, out.w2_scale_inv.to("meta"))
    _raises(
        ValueError,
        r"^out.w2_scale_inv: expected a tensor with data, got a meta tensor$",
        lambda: quantize_experts(w1, w1, w2, out=bad),
        out.w13,
        out.w13_scale_inv,
        out.w2,
    )


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"num_warps": 3}, ValueError, r"^config.num_warps: expected a power of two in \[1, 32\], got 3$"),
        ({"num_warps": 64}, ValueError, r"^config.num_warps: expected a power of two in \[1, 32\], got 64$"),
        ({"num_warps": 0}, ValueError, r"^config.num_warps: expected a power of two in \[1, 32\], got 0$"),
        ({"maxnreg": 8}, ValueError, r"^config.maxnreg: expected None or an int in \[16, 255\], got 8$"),
        ({"maxnreg": 256}, ValueError, r"^config.maxnreg: expected None or an int in \[16, 255\], got 256$"),
        ({"cb_per_prog": 0}, ValueError, r"^config.cb_per_prog: expected an integer >= 1, got 0$"),
        ({"programs_per_sm": -1}, ValueError, r"^config.programs_per_sm: expected an integer >= 0, got -1$"),
        ({"num_stages": 0}, ValueError, r"^config.num_stages: expected an integer >= 1, got 0$"),
        ({"num_warps": 8.0}, TypeError, r"^config.num_warps: expected an int, got 8.0 \(float\)$"),
        ({"cb_per_prog": True}, TypeError, r"^config.cb_per_prog: expected an int, got True \(bool\)$"),
        ({"maxnreg": "80"}, TypeError, r"^config.maxnreg: expected an int or None, got '80' \(str\)$"),
        ({"fma_div": 1}, TypeError, r"^config.fma_div: expected a bool, got 1 \(int\)$"),
        ({"signed_quotient": None}, TypeError, r"^config.signed_quotient: expected a bool, got None"),
        ({"soft_fp8": "yes"}, TypeError, r"^config.soft_fp8: expected a bool or None, got 'yes' \(str\)$"),
    ],
)
def test_launch_config_out_of_range_is_refused(kw, exc, match):
    with pytest.raises(exc, match=match):
        LaunchConfig(**kw)
    import dataclasses

    with pytest.raises(exc, match=match):  # replace() builds through __post_init__ too
        dataclasses.replace(LaunchConfig(), **kw)


def test_launch_config_range_edges_are_accepted(device):
    for kw in (
        {"num_warps": 1},
        {"num_warps": 32},
        {"maxnreg": 16},
        {"maxnreg": 255},
        {"maxnreg": None},
        {"programs_per_sm": 0},
        {"soft_fp8": None},
        {"soft_fp8": False},
    ):
        LaunchConfig(**kw)
    x = torch.randn(4, 4, device=device)
    out = poisoned_fp8((4, 4), device)
    _raises(
        TypeError,
        "^config: expected a LaunchConfig or None, got dict$",
        lambda: quantize_blockwise(x, out=out, config={"num_warps": 4}),
        out,
    )
    w1 = torch.randn(1, 4, 4, device=device)
    with pytest.raises(TypeError, match="^config: expected a LaunchConfig or None, got dict$"):
        quantize_experts(w1, w1, w1, config={"num_warps": 4})


def test_a_first_call_under_inference_mode_leaves_later_calls_working(device):
    """The finite check's flag is kept per thread and device: when a thread's first call runs
    under torch.inference_mode(), later calls outside it must still reset the flag (it once was
    an inference tensor, and every later call raised)."""
    import threading

    x = torch.randn(130, 140, device=device)
    q_ref, s_ref = quantize_concat_ref([x])
    results = []

    def thread():
        try:
            with torch.inference_mode():
                quantize_blockwise(x, backend="torch")
            got_q, got_s = quantize_blockwise(x, backend="torch")
            results.append(
                torch.equal(got_q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(got_s, s_ref)
            )
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    t = threading.Thread(target=thread)  # a fresh thread: its flag is allocated by the first call
    t.start()
    t.join(timeout=60)
    assert results == [True], results


def test_a_tp_size_vllm_refuses_names_the_sizes_that_fit():
    """An engine layout whose shards break vLLM's 128 rule says which tensor-parallel sizes fit
    this model (computed from its shapes, at the layout's DP size and EP choice) and what to set;
    expert parallelism is offered only where it lifts the routed experts' limit."""
    from glm_fp8 import EngineLayout, engine_param_specs
    from glm_fp8.model.presets import TINY_GLM5

    # TINY_GLM5: o_proj's 256 columns allow TP 1 and 2 only (a multiple of 128 per rank).
    match = (
        r"o_proj\.weight: .* multiple of 128 .*; for this model \(data_parallel_size 1, expert "
        r"parallelism off\) the valid tensor-parallel sizes are 1, 2: set vLLM's --tensor-parallel-size "
        r"\(EngineLayout tp_size\) to one of them$"
    )
    with pytest.raises(ValueError, match=match):
        engine_param_specs(TINY_GLM5, EngineLayout(tp_size=4, tp_rank=1))
    # moe_intermediate 512 over TP 2 x DP 4 without EP: 64 per rank. At DP 4 only TP 1 fits (MoE
    # TP 4: 128 per rank); with EP, TP 2 fits too.
    match = (
        r"w13_weight: .* 512 / 8 = 64 .*data_parallel_size 4, expert parallelism off\) the valid "
        r"tensor-parallel sizes are 1: .*, or turn on expert parallelism \(--enable-expert-parallel\), "
        r"with which tensor-parallel sizes 2 fit too$"
    )
    with pytest.raises(ValueError, match=match):
        engine_param_specs(TINY_GLM5, EngineLayout(tp_size=2, dp_size=4))
    # The sizes named are accepted.
    assert engine_param_specs(TINY_GLM5, EngineLayout(tp_size=2, tp_rank=1))
    assert engine_param_specs(TINY_GLM5, EngineLayout(dp_size=4, dp_rank=3))
    assert engine_param_specs(TINY_GLM5, EngineLayout.from_vllm(2, 1, 4, 3, enable_expert_parallel=True))

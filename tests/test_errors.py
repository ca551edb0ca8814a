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
from glm_fp8.reference import quantize_concat_ref


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
    with pytest.raises(ValueError, match=r"backend: expected one of \(.*'torch'\), got 'cutlass'"):
        quantize_blockwise(x, backend="cutlass")
    with pytest.raises(ValueError, match="config: a LaunchConfig tunes the Triton backend, but backend="):
        quantize_blockwise(x, backend="torch", config=LaunchConfig())
    with pytest.raises(ValueError, match="backend: expected one of"):
        set_default_backend("fast")
    if "cuda" not in BACKENDS:
        with pytest.raises(RuntimeError, match="backend='cuda'"):
            quantize_blockwise(x, backend="cuda")


def test_default_backend_is_used(device, monkeypatch):
    import glm_fp8.backends as backends

    calls = []
    monkeypatch.setitem(backends.LAUNCHERS, "torch", lambda *a: calls.append(a) or backends.launch_torch(*a))
    x = torch.randn(4, 4, device=device)
    set_default_backend("torch")
    try:
        quantize_blockwise(x)
    finally:
        set_default_backend("auto")
    assert len(calls) == 1 and get_default_backend() == "auto"

"""The backend switch, and the CUDA backend's torch.library op under torch.compile and CUDA graphs.

Invariant: the op ``torch.ops.glm_fp8.quantize_blockwise_`` writes the reference's bits for every
job of a group in eager mode, inside a compiled graph and in a replayed CUDA graph; every backend named in
``available_backends`` runs the public functions (the bitwise suite in test_quantize.py).
"""

import pytest
import torch
from conftest import BACKENDS, GPU_BACKENDS, ON_GPU, assert_same_bits, poisoned_f32, poisoned_fp8

from glm_fp8 import ExpertsFP8, available_backends, quantize_blockwise, quantize_experts
from glm_fp8.kernels.backends import resolve_backend
from glm_fp8.kernels.reference import quantize_concat_ref, quantize_experts_ref

needs_cuda_backend = pytest.mark.skipif("cuda" not in BACKENDS, reason="the CUDA extension is not built here")


def test_auto_picks_the_first_available(device):
    assert resolve_backend("auto", device) == available_backends(device)[0]
    assert available_backends(device)[-1] == "torch"  # the reference runs anywhere
    assert resolve_backend(None, device, config_given=True) == "triton"


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_available_backends_are_exactly_what_backend_accepts(device, monkeypatch, interpret):
    """With no argument, this machine's device; on the CPU triton only under the interpreter. Each
    name listed runs (on a CPU: quantizes a small tensor), each other name is refused, on every
    device type (a CUDA device where none is visible lists nothing)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert available_backends() == available_backends(device)
    if not ON_GPU:
        assert available_backends() == (["triton", "torch"] if interpret == "1" else ["torch"])
    for dev in [torch.device("cpu"), torch.device("cuda")]:
        listed = available_backends(dev)
        for name in ("triton", "cuda", "torch"):
            if name in listed:
                assert resolve_backend(name, dev) == name
            else:
                with pytest.raises(RuntimeError, match=f"backend='{name}'"):
                    resolve_backend(name, dev)
        if listed:
            assert resolve_backend("auto", dev) == listed[0]
    if not ON_GPU:
        x = torch.randn(3, 130, 140)
        want = quantize_concat_ref([x])[0].view(torch.uint8)
        for name in available_backends():
            assert torch.equal(quantize_blockwise(x, backend=name)[0].view(torch.uint8), want), name


@needs_cuda_backend
def test_op_checks_its_contract_before_launching():
    x = torch.randn(2, 130, 256, device="cuda", dtype=torch.bfloat16)
    q, s = poisoned_fp8((2, 130, 256), "cuda"), poisoned_f32((2, 2, 2), "cuda")
    op = torch.ops.glm_fp8.quantize_blockwise_
    with pytest.raises(ValueError, match=r"q\[0\]: expected shape \[2, 130, 256\], got \[2, 129, 256\]"):
        op([q[:, :129]], [s], [x], [1], False, None)
    with pytest.raises(ValueError, match=r"scale\[1\]: expected shape \[2, 2, 2\]"):
        op([q, q], [s, s[:, :1]], [x, x], [1, 1], False, None)
    with pytest.raises(TypeError, match="sources\\[1\\]: expected dtype BFloat16"):
        op([q], [s], [x[:, :100], x[:, 100:].float()], [2], False, None)
    with pytest.raises(TypeError, match="one call quantizes one input dtype"):
        op([q, q], [s, s], [x, x.float()], [1, 1], False, None)
    with pytest.raises(ValueError, match="num_sources\\[0\\]: expected 1 to 4 tensors, got 5"):
        op([q], [s], [x[:, :26]] * 5, [5], False, None)
    with pytest.raises(ValueError, match="sources: expected 2 tensors \\(the sum of num_sources\\), got 1"):
        op([q, q], [s, s], [x], [1, 1], False, None)
    with pytest.raises(ValueError, match="q, scale: expected one tensor per job"):
        op([q], [s, s], [x], [1], False, None)
    with pytest.raises(TypeError, match="nonfinite: expected dtype int32"):
        op([q], [s], [x], [1], False, torch.zeros(1, device="cuda"))
    assert (q.view(torch.uint8) == 0xFF).all() and s.isnan().all()  # nothing was written


@needs_cuda_backend
def test_op_runs_a_group_of_jobs_as_one_grid():
    """Jobs of different shapes, source counts and strides (and an empty one) share one launch;
    each lands in its own outputs with the reference's bits, and nothing else is written."""
    a = torch.randn(3, 200, 300, device="cuda") * 0.3
    b = torch.randn(3, 300, 130, device="cuda").transpose(1, 2) * 40  # [3, 130, 300], strided
    c = torch.randn(3, 77, 128, device="cuda") * 1e-6
    empty = torch.randn(3, 0, 128, device="cuda")
    jobs = [[a[:, :90], a[:, 90:], b], [c], [empty]]
    refs = [quantize_concat_ref(list(srcs)) for srcs in jobs]
    qs = [poisoned_fp8(q.shape, "cuda") for q, _ in refs]
    ss = [poisoned_f32(s.shape, "cuda") for _, s in refs]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sources = [t for srcs in jobs for t in srcs]
    torch.ops.glm_fp8.quantize_blockwise_(qs, ss, sources, [len(j) for j in jobs], False, flag)
    for q, s, (q_ref, s_ref) in zip(qs, ss, refs):
        assert_same_bits(q, s, q_ref, s_ref)
    assert flag.item() == 0
    c[1, 5, 7] = float("inf")
    torch.ops.glm_fp8.quantize_blockwise_(qs, ss, sources, [len(j) for j in jobs], False, flag)
    assert flag.item() == 1 and ss[1][1, 0, 0].isinf() and ss[0].isfinite().all()


@needs_cuda_backend
def test_op_under_torch_compile():
    x = torch.randn(2, 200, 300, device="cuda", dtype=torch.bfloat16)
    q_ref, s_ref = quantize_concat_ref([x[:, :90], x[:, 90:]])
    q2_ref, s2_ref = quantize_concat_ref([x[:, 50:]])

    @torch.compile(fullgraph=True)
    def step(w, q, s, q2, s2):
        sources = [w[:, :90], w[:, 90:], w[:, 50:]]
        torch.ops.glm_fp8.quantize_blockwise_([q, q2], [s, s2], sources, [2, 1], False, None)
        return s.amax()

    q, s = poisoned_fp8(q_ref.shape, "cuda"), poisoned_f32(s_ref.shape, "cuda")
    q2, s2 = poisoned_fp8(q2_ref.shape, "cuda"), poisoned_f32(s2_ref.shape, "cuda")
    amax = step(x, q, s, q2, s2)
    assert_same_bits(q, s, q_ref, s_ref)
    assert_same_bits(q2, s2, q2_ref, s2_ref)
    assert amax == s_ref.amax()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
def test_quantize_experts_replays_in_a_cuda_graph(gpu_backend):
    """Without the finite check (its host read cannot be captured) a call captures into a graph
    and each replay quantizes whatever the input buffers hold then."""
    w1, w3 = (torch.randn(4, 192, 260, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w2 = torch.randn(4, 260, 192, device="cuda", dtype=torch.bfloat16)
    out = ExpertsFP8.empty(4, 260, 192, device="cuda")
    run = lambda: quantize_experts(w1, w3, w2, out=out, check_finite=False, backend=gpu_backend)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for scale in (1e-3, 40.0):
        for w in (w1, w3, w2):
            w.copy_(torch.randn_like(w) * scale)
        for _, t in out.items():  # poison: a replay that writes nothing cannot pass
            if t.dtype == torch.float8_e4m3fn:
                t.view(torch.uint8).fill_(0xFF)
            else:
                t.fill_(float("nan"))
        graph.replay()
        ref = quantize_experts_ref(w1, w3, w2)
        assert_same_bits(out.w13, out.w13_scale_inv, ref[0], ref[1])
        assert_same_bits(out.w2, out.w2_scale_inv, ref[2], ref[3])

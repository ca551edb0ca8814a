"""Where the host time of a quantize_experts call goes, per GPU backend (GPU only).

python bench/scripts/host_overhead.py
Prints microseconds per call: back-to-back calls (the host's cost, or the GPU's when it is the
slower), the same with a device sync after each call (latency), for a tiny layer (E=1,
128x128: pure overhead) and E=8 GLM-5 experts; then the pieces: the Python argument checks
alone (launchers replaced by no-ops), the flag's read (and what allocating it per call cost),
one raw launch per backend: the Triton one both direct (its cached compiled kernel) and through
triton's JIT front end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import glm_fp8
from glm_fp8.kernels import backends, triton_quantize
from glm_fp8.kernels.quantize import ExpertsFP8
from glm_fp8.kernels.triton_quantize import launch_triton


def per_call_us(fn: Callable[[], object], n: int = 300, sync_each: bool = False) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def layer(e: int, i: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExpertsFP8]:
    w1 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    return w1, torch.randn_like(w1) * 0.02, w2, ExpertsFP8.empty(e, h, i, "cuda")


def main() -> None:
    from tabulate import tabulate

    gpu_backends = [b for b in backends.available_backends("cuda") if b != "torch"]
    cases = {"tiny": layer(1, 128, 128), "e8": layer(8, 2048, 6144)}
    rows = []
    for b in gpu_backends:
        for name, (w1, w3, w2, out) in cases.items():
            for check in (False, True):
                fn = lambda: glm_fp8.quantize_experts(w1, w3, w2, out=out, check_finite=check, backend=b)  # noqa: E731
                rows.append([b, name, check, per_call_us(fn), per_call_us(fn, sync_each=True)])
    headers = ["backend", "layer", "check_finite", "us/call back to back", "us/call synced"]
    print(tabulate(rows, headers, "github"))

    w1, w3, w2, out = cases["tiny"]
    pieces = []
    saved = dict(backends.LAUNCHERS)
    backends.LAUNCHERS["cuda"] = lambda *a: None
    for check in (False, True):
        fn = lambda: glm_fp8.quantize_experts(w1, w3, w2, out=out, check_finite=check, backend="cuda")  # noqa: E731
        pieces.append([f"argument checks and planning, no launch, check_finite={check}", per_call_us(fn)])
    backends.LAUNCHERS.update(saved)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    pieces.append(
        [
            "torch.zeros(1, int32) on the GPU (the flag, when it was per call)",
            per_call_us(lambda: torch.zeros_like(flag)),
        ]
    )
    pieces.append(["flag.item() (copy back + sync)", per_call_us(flag.item)])
    srcs, q, s = [w1, w3], out.w13, out.w13_scale_inv
    if "cuda" in gpu_backends:
        op = torch.ops.glm_fp8.quantize_blockwise_
        one_op = lambda: op([q], [s], srcs, [2], False, None)  # noqa: E731
        pieces.append(["one torch.ops.glm_fp8 call", per_call_us(one_op)])
        op_read = lambda: (op([q], [s], srcs, [2], False, flag), flag.item())  # noqa: E731
        pieces.append(["one torch.ops.glm_fp8 call with the flag, then its read", per_call_us(op_read)])
    one_launch = lambda: launch_triton(srcs, q, s, False, None)  # noqa: E731
    pieces.append(["one Triton launch, direct", per_call_us(one_launch)])
    pieces.append(
        [
            "one Triton launch with the flag, direct",
            per_call_us(lambda: launch_triton(srcs, q, s, False, flag)),
        ]
    )
    launch_read = lambda: (launch_triton(srcs, q, s, False, flag), flag.item())  # noqa: E731
    pieces.append(["one Triton launch with the flag, then its read", per_call_us(launch_read)])
    direct, triton_quantize._direct_launch = triton_quantize._direct_launch, False
    pieces.append(["one Triton launch, JIT front end", per_call_us(one_launch)])
    triton_quantize._direct_launch = direct
    print(tabulate(pieces, ["piece", "us/call"], "github"))
    print(f"compiled Triton kernels kept for direct launches: {len(triton_quantize._compiled_kernels)}")


if __name__ == "__main__":
    main()

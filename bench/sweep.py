"""Launch-config sweep of the fused kernel on GLM-5 routed experts (GPU only).

python bench/sweep.py [--dtype bf16 fp32] [--experts 256]
Prints, per config, ms and the share of a device-to-device copy's bandwidth, both measured here.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from glm_fp8 import ExpertsFP8, LaunchConfig, quantize_experts
from glm_fp8.bench import GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE, _experts_out_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--experts", type=int, default=256)
    args = p.parse_args()
    e, h, i = args.experts, GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE
    from tabulate import tabulate

    rows = []
    for name in args.dtype:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        w1 = torch.randn(e, i, h, device="cuda", dtype=dtype) * 0.02
        w3 = torch.randn(e, i, h, device="cuda", dtype=dtype) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", dtype=dtype) * 0.02
        out = ExpertsFP8.empty(e, h, i)
        in_bytes = 3 * w1.numel() * w1.element_size()
        dst = [torch.empty_like(t) for t in (w1, w3, w2)]
        copy_ms = triton.testing.do_bench(
            lambda: [d.copy_(s) for d, s in zip(dst, (w1, w3, w2))], return_mode="median"
        )
        dst = None
        copy_gbps = 2 * in_bytes / copy_ms / 1e6
        ideal = in_bytes + _experts_out_bytes(e, h, i)
        configs = [LaunchConfig(cb_per_prog=cb, num_warps=w) for cb, w in itertools.product([1, 2], [4, 8])]
        configs += [
            LaunchConfig(programs_per_sm=p, num_warps=w, num_stages=st)
            for p, w, st in itertools.product([2, 4, 8], [4, 8], [1, 2])
        ]
        for cfg in configs:
            ms = triton.testing.do_bench(
                lambda: quantize_experts(w1, w3, w2, out=out, config=cfg, check_finite=False),
                return_mode="median",
            )
            gbps = ideal / ms / 1e6
            mode = (
                f"persistent {cfg.programs_per_sm}/SM x{cfg.num_stages}"
                if cfg.programs_per_sm
                else f"grid {cfg.cb_per_prog}/prog"
            )
            rows.append([name, mode, cfg.num_warps, f"{ms:.3f}", f"{gbps:.0f}", f"{gbps / copy_gbps:.3f}"])
        rows.append([name, "copy", "", f"{copy_ms:.3f}", f"{copy_gbps:.0f}", "1.000"])
        w1 = w3 = w2 = out = None  # free before the next dtype
        torch.cuda.empty_cache()
    print(tabulate(rows, ["dtype", "tiles", "warps", "ms", "GB/s", "share"]))


if __name__ == "__main__":
    main()

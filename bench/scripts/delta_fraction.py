"""How much of the FP8 weights changes per RL step: real AdamW steps on a GLM-5-shaped MoE layer.

    python3 bench/scripts/delta_fraction.py [--device cuda] [--steps 20] [--json out.json]
    python3 bench/scripts/delta_fraction.py --device cpu --tiny --steps 2     # a seconds-long check

A student MoE layer (16 experts, hidden 6144, moe intermediate 2048, a router, top-2 routing,
SwiGLU experts; ``--tiny``: 4 experts, 256, 128) is trained towards a fixed random teacher layer
of the same shape on random inputs (MSE on the layer's output) with ``torch.optim.AdamW``, its
masters in bf16 or fp32 (the parameters' dtype; matmuls under bf16 autocast on CUDA). After each
step its experts are quantized as vLLM holds them (w13 = [w1; w3] and w2, 128x128 blocks, fp32
and ue8m0 scales) and compared with the previous step's bytes. Per step: the fraction of e4m3
bytes and of scales that changed, and the wire bytes / dense bytes of each candidate encoding
(docs/delta.md#encoding):

- ``naive``: a 4-byte index and a 1-byte value per changed byte;
- ``block``: glm_fp8.kernels.delta's, an int32 count per block, then an int16 in-block offset and a
  uint8 value per change, a block whose listing would cost more than the block sent whole;
- ``bitmap``: a bit per block (changed or not), then a 2 KiB bitmap and the values of each
  changed block.

Every encoding carries the changed scales as (int32 index, float32 value) pairs. Dense bytes are
the fp8 bytes plus 4 bytes per scale. ``--quantizer kernel`` runs ``glm_fp8.kernels.delta.
quantize_compare`` (the Triton kernel) instead of the reference and checks it against the
reference's bytes at every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

from glm_fp8.kernels.reference import delta_block_sizes, quantize_concat_ref

SHAPES = {
    "glm5": dict(experts=16, hidden=6144, inter=2048, tokens=4096),
    "small": dict(experts=8, hidden=1024, inter=512, tokens=512),  # CPU figures (docs/delta.md)
    "tiny": dict(experts=4, hidden=256, inter=128, tokens=64),
}
ENCODINGS = ("naive", "block", "bitmap")
FMTS = ("fp32", "ue8m0")


class MoE(torch.nn.Module):
    """Router + top-2 softmax-weighted SwiGLU experts; w1, w3 [E, I, H], w2 [E, H, I] as vLLM stacks."""

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype, device, gen) -> None:
        super().__init__()

        def init(*shape: int) -> torch.nn.Parameter:
            w = torch.randn(shape, device=device, generator=gen) * 0.02  # initializer_range
            return torch.nn.Parameter(w.to(dtype))

        self.router = init(experts, hidden)
        self.w1, self.w3, self.w2 = (
            init(experts, inter, hidden),
            init(experts, inter, hidden),
            init(experts, hidden, inter),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax((x @ self.router.t()).float(), dim=-1)
        top_p, top_e = probs.topk(2, dim=-1)
        top_p = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = (top_e == e).nonzero(as_tuple=True)
            if len(tok) == 0:
                continue
            h = x[tok]
            y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
            out = out.index_add(0, tok, y * top_p[tok, slot, None])
        return out


def _block_counts(q_new: torch.Tensor, q_old: torch.Tensor) -> torch.Tensor:
    """Changed bytes per 128x128 block, int64, flat block order."""
    changed = (q_new.view(torch.uint8) != q_old.view(torch.uint8)).to(torch.int32)
    e, r, c = changed.shape
    pr, pc = -r % 128, -c % 128
    changed = F.pad(changed, (0, pc, 0, pr))
    return changed.view(e, (r + pr) // 128, 128, (c + pc) // 128, 128).sum((2, 4)).flatten().long()


def _wire(counts: torch.Tensor, sizes: torch.Tensor, scales_changed: int) -> dict[str, int]:
    dense = 3 * counts > sizes
    scale_bytes = 8 * scales_changed
    return {
        "naive": int(5 * counts.sum()) + scale_bytes,
        "block": 4 * len(counts) + int(torch.where(dense, sizes, 3 * counts).sum()) + scale_bytes,
        "bitmap": -(-len(counts) // 8) + int(((counts > 0) * (2048 + counts)).sum()) + scale_bytes,
    }


class Tracker:
    """The previous step's fp8 bytes and scales of w13 and w2 for one scale format, and the stats."""

    def __init__(self, fmt: str, quantizer: str) -> None:
        self.fmt, self.quantizer, self.kept = fmt, quantizer, {}

    def step(self, tensors: dict[str, list[torch.Tensor]]) -> dict | None:
        tot = {"bytes": 0, "changed": 0, "scales": 0, "scales_changed": 0, "dense": 0}
        wire = dict.fromkeys(ENCODINGS, 0)
        first = not self.kept
        for name, srcs in tensors.items():
            srcs = [s.detach() for s in srcs]
            q, s = quantize_concat_ref(srcs, self.fmt)
            if first:
                self.kept[name] = (q, s)
                continue
            kq, ks = self.kept[name]
            if self.quantizer == "kernel":
                from glm_fp8.kernels.delta import quantize_compare

                old = kq.clone()
                d = quantize_compare(srcs, kq, ks, scale_fmt=self.fmt)
                if not (torch.equal(kq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ks, s)):
                    raise SystemExit(f"{name}: the kernel's kept copy differs from the reference's bytes")
                counts, sch = d.counts.long(), d.scale_index.numel()
                if not torch.equal(counts, _block_counts(q, old)):
                    raise SystemExit(f"{name}: the kernel's counts differ from the reference's")
            else:
                counts = _block_counts(q, kq)
                sch = int((ks.view(torch.int32) != s.view(torch.int32)).sum())
                self.kept[name] = (q, s)
            sizes = delta_block_sizes(q.shape, q.device)
            for k, v in _wire(counts, sizes, sch).items():
                wire[k] += v
            tot["bytes"] += q.numel()
            tot["changed"] += int(counts.sum())
            tot["scales"] += s.numel()
            tot["scales_changed"] += sch
            tot["dense"] += q.numel() + 4 * s.numel()
        if first:
            return None
        out = {
            "bytes_changed": tot["changed"] / tot["bytes"],
            "scales_changed": tot["scales_changed"] / tot["scales"],
        }
        out.update({f"wire_{k}": v / tot["dense"] for k, v in wire.items()})
        return out


def run(master: torch.dtype, lr: float, args, shape: dict, device: torch.device) -> dict[str, list[dict]]:
    gen = torch.Generator(device).manual_seed(args.seed)
    dims = (shape["experts"], shape["hidden"], shape["inter"])
    teacher = MoE(*dims, torch.bfloat16 if device.type == "cuda" else torch.float32, device, gen)
    student = MoE(*dims, master, device, gen)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    trackers = {fmt: Tracker(fmt, args.quantizer) for fmt in FMTS}
    steps: dict[str, list[dict]] = {fmt: [] for fmt in FMTS}

    def observe() -> None:
        experts = {"w13": [student.w1, student.w3], "w2": [student.w2]}
        for fmt, tr in trackers.items():
            row = tr.step(experts)
            if row is not None:
                steps[fmt].append(row)

    observe()
    autocast = (
        torch.autocast("cuda", torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    for _ in range(args.steps):
        x = torch.randn(shape["tokens"], shape["hidden"], device=device, generator=gen)
        with autocast:
            with torch.no_grad():
                target = teacher(x.to(teacher.w1.dtype)).float()
            loss = F.mse_loss(student(x.to(master)).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        observe()
    return steps


def _stats(values: list[float]) -> str:
    return f"{100 * statistics.median(values):.3f} / {100 * max(values):.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=sorted(SHAPES), default="glm5")
    p.add_argument("--tiny", action="store_true", help="the tiny shapes (same as --model tiny)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    p.add_argument("--masters", nargs="+", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    p.add_argument("--quantizer", choices=["ref", "kernel"], default="ref")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every step's figures here")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps: expected at least 1, got {args.steps}")
    shape = SHAPES["tiny" if args.tiny else args.model]
    device = torch.device(args.device)
    rows, results = [], []
    t0 = time.perf_counter()
    for master in args.masters:
        for lr in args.lrs:
            t = time.perf_counter()
            steps = run(torch.bfloat16 if master == "bf16" else torch.float32, lr, args, shape, device)
            print(
                f"masters {master}, lr {lr:g}: {args.steps} steps in {time.perf_counter() - t:.1f} s",
                flush=True,
            )
            for fmt, per_step in steps.items():
                results.append({"master": master, "lr": lr, "scale_fmt": fmt, "steps": per_step})
                col = {k: [s[k] for s in per_step] for k in per_step[0]}
                figures = ["bytes_changed", "scales_changed", *(f"wire_{k}" for k in ENCODINGS)]
                rows.append([master, f"{lr:g}", fmt, *(_stats(col[k]) for k in figures)])
    headers = [
        "master",
        "lr",
        "scales",
        "e4m3 changed %",
        "scales changed %",
        *(f"wire/dense {k} %" for k in ENCODINGS),
    ]
    print(f"{shape} steps {args.steps}, median / worst step, {time.perf_counter() - t0:.1f} s")
    print(tabulate(rows, headers, "github"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": shape, "steps": args.steps, "device": str(device), "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()

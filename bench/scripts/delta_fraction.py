"""How much of the FP8 weights changes per RL step: real AdamW steps on a GLM-5-shaped MoE layer.

    python3 bench/scripts/delta_fraction.py [--device cuda] [--steps 20] [--json out.json]
    python3 bench/scripts/delta_fraction.py --device cpu --tiny --steps 2     # a seconds-long check

A student MoE layer (16 experts, hidden 6144, moe intermediate 2048, a router, top-2 routing,
SwiGLU experts; ``--model glm5-2``: 2 such experts and 512 tokens a step, a CPU's run; ``--tiny``:
4 experts, 256, 128) is trained towards a fixed random teacher layer
of the same shape on random inputs (MSE on the layer's output) with ``torch.optim.AdamW``, its
masters in bf16 or fp32 (the parameters' dtype; matmuls under bf16 autocast on CUDA). After each
step its experts are quantized as vLLM holds them (w13 = [w1; w3] and w2, 128x128 blocks, fp32
and ue8m0 scales) and compared with the previous step's bytes. Per step: the fraction of e4m3
bytes, of scales and of bf16 elements that changed, and the wire bytes of each encoding of the
same change, over the dense FP8 update's bytes (fp8 bytes plus 4 per scale; docs/delta.md#beside-the-field):

- ``glm_fp8``: what glm_fp8's delta update sends, ``glm_fp8.kernels.delta.compare_bytes`` of the
  layer's expert bytes as one transfer segment (w13, its scales, w2, its scales) against the
  previous step's: per 16 KiB block an int32 count, then an int16 offset and a uint8 value per
  changed byte (a block whose listing costs more goes whole);
- ``sparse_nccl``: vLLM 0.34's ``sparse_nccl`` backend on the FP8 checkpoint (each expert's
  ``gate_proj`` / ``up_proj`` / ``down_proj`` weight and ``weight_scale_inv``): an int32 flat index
  and the value in the tensor's dtype per changed element (slime's ``indices`` encoding alike);
- ``slime_deltas``: slime's ``deltas`` encoding of the same tensors: the gaps between changed
  positions as uint16 (uint32 for a tensor with a gap over 65535) and the values;
- ``slime_deltas_zstd``: that, compressed by zstd at level 1 (slime's ``deltas_zstd``);
- ``xor_zstd``: the FP8 checkpoint's new bytes XOR its old ones, each tensor compressed by zstd at
  level 1 (SkyRL's and miles' checkpoint deltas);
- ``bf16_sparse_nccl``: for scale, ``sparse_nccl`` on the bf16 checkpoint of the same weights,
  which a bf16 engine would take (4 + 2 bytes per changed element).

zstd is the ``zstandard`` package (the ``test`` extra); its compression and decompression times
on this host are printed beside the table. ``--quantizer kernel`` runs ``glm_fp8.kernels.delta.
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
import zstandard
from field import ZSTD_LEVEL, changed, checkpoint_tensors, slime_deltas
from tabulate import tabulate

from glm_fp8.kernels.delta import compare_bytes
from glm_fp8.kernels.reference import quantize_concat_ref

SHAPES = {
    "glm5": dict(experts=16, hidden=6144, inter=2048, tokens=4096),
    # GLM-5's expert shape on a CPU: two experts, fewer tokens (docs/delta.md#beside-the-field)
    "glm5-2": dict(experts=2, hidden=6144, inter=2048, tokens=512),
    "small": dict(experts=8, hidden=1024, inter=512, tokens=512),
    "tiny": dict(experts=4, hidden=256, inter=128, tokens=64),
}
ENCODINGS = ("glm_fp8", "sparse_nccl", "slime_deltas", "slime_deltas_zstd", "xor_zstd", "bf16_sparse_nccl")
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


class Codec:
    """zstd at ``ZSTD_LEVEL`` (one thread), with the seconds it spent and the bytes it took in."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()
        self.seconds = {"compress": 0.0, "decompress": 0.0}
        self.nbytes = 0

    def size(self, data: bytes) -> int:
        """Compressed size of ``data``, checked by decompressing it."""
        if not data:
            return 0
        t = time.perf_counter()
        packed = self.compressor.compress(data)
        self.seconds["compress"] += time.perf_counter() - t
        t = time.perf_counter()
        if self.decompressor.decompress(packed) != data:
            raise SystemExit("zstd did not give back the bytes it compressed")
        self.seconds["decompress"] += time.perf_counter() - t
        self.nbytes += len(data)
        return len(packed)


def _segment(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes one after the other, zero-padded to 128-byte rows, as uint8 [rows, 128]:
    how a transfer segment's bytes are compared (docs/delta.md#in-the-transfer)."""
    flat = torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])
    return torch.nn.functional.pad(flat, (0, -len(flat) % 128)).view(-1, 128)


class Tracker:
    """The previous step's fp8 bytes and scales of w13 and w2 for one scale format, the bf16
    checkpoint's and the segment glm_fp8 keeps, and the stats."""

    def __init__(self, fmt: str, quantizer: str, codec: Codec) -> None:
        self.fmt, self.quantizer, self.codec, self.kept = fmt, quantizer, codec, {}
        self.segment = None

    def step(self, tensors: dict[str, list[torch.Tensor]]) -> dict | None:
        tot = dict.fromkeys(
            ("bytes", "changed", "scales", "scales_changed", "bf16", "bf16_changed", "dense"), 0
        )
        wire = dict.fromkeys(ENCODINGS, 0)
        first = not self.kept
        quantized = []
        for name, srcs in tensors.items():
            srcs = [s.detach() for s in srcs]
            q, s = quantize_concat_ref(srcs, self.fmt)
            w16 = torch.cat(srcs, dim=-2).to(torch.bfloat16)
            quantized += [q, s]
            if first:
                self.kept[name] = (q, s, w16)
                continue
            kq, ks, k16 = self.kept[name]
            if self.quantizer == "kernel":
                from glm_fp8.kernels.delta import quantize_compare

                old, old_s = kq.clone(), ks.clone()
                d = quantize_compare(srcs, kq, ks, scale_fmt=self.fmt)
                if not (torch.equal(kq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ks, s)):
                    raise SystemExit(f"{name}: the kernel's kept copy differs from the reference's bytes")
                if d.changed != int(changed(q, old).sum()):
                    raise SystemExit(f"{name}: the kernel's counts differ from the reference's")
                kq, ks = old, old_s
            cq, cs, c16 = changed(q, kq), changed(s, ks), changed(w16, k16)
            n, ns, n16 = int(cq.sum()), int(cs.sum()), int(c16.sum())
            self.kept[name] = (q, s, w16)
            wire["sparse_nccl"] += 5 * n + 8 * ns
            wire["bf16_sparse_nccl"] += 6 * n16
            deltas = b"".join(
                slime_deltas(c, t).data
                for c, t in [
                    *zip(checkpoint_tensors(name, cq), checkpoint_tensors(name, q)),
                    *zip(checkpoint_tensors(name, cs), checkpoint_tensors(name, s)),
                ]
            )
            wire["slime_deltas"] += len(deltas)
            wire["slime_deltas_zstd"] += self.codec.size(deltas)
            for new, old in [(q, kq), (s, ks)]:
                for a, b in zip(checkpoint_tensors(name, new), checkpoint_tensors(name, old)):
                    xor = a.contiguous().view(torch.uint8) ^ b.contiguous().view(torch.uint8)
                    wire["xor_zstd"] += self.codec.size(xor.cpu().numpy().tobytes())
            tot["bytes"] += q.numel()
            tot["changed"] += n
            tot["scales"] += s.numel()
            tot["scales_changed"] += ns
            tot["bf16"] += w16.numel()
            tot["bf16_changed"] += n16
            tot["dense"] += q.numel() + 4 * s.numel()
        segment = _segment(quantized)
        if first:
            self.segment = segment
            return None
        # the delta kernels' torch backend on a CPU: the interpreter would take minutes at GLM-5's shape
        backend = None if segment.is_cuda else "torch"
        wire["glm_fp8"] = compare_bytes(segment, self.segment, backend=backend).nbytes
        out = {
            "bytes_changed": tot["changed"] / tot["bytes"],
            "scales_changed": tot["scales_changed"] / tot["scales"],
            "bf16_changed": tot["bf16_changed"] / tot["bf16"],
        }
        out.update({f"wire_{k}": v / tot["dense"] for k, v in wire.items()})
        return out


def run(
    master: torch.dtype, lr: float, args, shape: dict, device: torch.device, codec: Codec
) -> dict[str, list[dict]]:
    gen = torch.Generator(device).manual_seed(args.seed)
    dims = (shape["experts"], shape["hidden"], shape["inter"])
    teacher = MoE(*dims, torch.bfloat16 if device.type == "cuda" else torch.float32, device, gen)
    student = MoE(*dims, master, device, gen)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    trackers = {fmt: Tracker(fmt, args.quantizer, codec) for fmt in FMTS}
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
    codec = Codec()
    t0 = time.perf_counter()
    for master in args.masters:
        for lr in args.lrs:
            t = time.perf_counter()
            steps = run(torch.bfloat16 if master == "bf16" else torch.float32, lr, args, shape, device, codec)
            print(
                f"masters {master}, lr {lr:g}: {args.steps} steps in {time.perf_counter() - t:.1f} s",
                flush=True,
            )
            for fmt, per_step in steps.items():
                results.append({"master": master, "lr": lr, "scale_fmt": fmt, "steps": per_step})
                col = {k: [s[k] for s in per_step] for k in per_step[0]}
                figures = [
                    "bytes_changed",
                    "scales_changed",
                    "bf16_changed",
                    *(f"wire_{k}" for k in ENCODINGS),
                ]
                rows.append([master, f"{lr:g}", fmt, *(_stats(col[k]) for k in figures)])
    headers = [
        "master",
        "lr",
        "scales",
        "e4m3 changed %",
        "scales changed %",
        "bf16 changed %",
        *(f"{k} %" for k in ENCODINGS),
    ]
    print(f"{shape} steps {args.steps}, median / worst step, {time.perf_counter() - t0:.1f} s")
    print("encodings: wire bytes / the dense FP8 update's bytes, %")
    print(tabulate(rows, headers, "github"))
    mb = codec.nbytes / 1e6
    print(
        f"zstd level {ZSTD_LEVEL}, one thread, on this host: {mb:.0f} MB in, compressed at "
        f"{mb / max(codec.seconds['compress'], 1e-9):.0f} MB/s, decompressed at "
        f"{mb / max(codec.seconds['decompress'], 1e-9):.0f} MB/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": shape, "steps": args.steps, "device": str(device), "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()

"""Each encoding of one FP8 change, timed on both ends: the trainer's encode, the engine's apply.

    python3 bench/scripts/delta_apply.py [--device cuda] [--experts 32] [--lrs 1e-6 1e-5] [--step adam]
    python3 bench/scripts/delta_apply.py --device cpu --model tiny     # a check, seconds

An engine rank's experts of one GLM-5 MoE layer (``--experts``, default 32: 256 over EP 8; hidden
6144, moe intermediate 2048; ``--model tiny``: 2 experts, hidden 320, intermediate 256, partial blocks)
as vLLM holds them in FP8: w13 = [w1; w3] and w2, e4m3 with float32 128x128 block scales. bf16
masters take one stand-in trainer step (bench/scripts/standin.py: ``adam``, Adam's step once warm,
or ``sign``, its first) at each ``--lrs``; the change from the old checkpoint to the new one is
then encoded each way of docs/delta.md#beside-the-field and applied to a copy of the old one:

- ``dense``: the new bytes and scales copied over the old (a device-to-device copy: the floor of a
  dense landing, and every ratio's denominator);
- ``glm_fp8``: ``quantize_compare`` from the masters against the kept copy (encode), then
  ``apply_delta`` (engine; its checks included);
- ``sparse_nccl``: vLLM 0.34's ``load_checkpoint_weight_patches`` as its ops run, per changed
  checkpoint tensor (each expert's gate, up and down weight and scale): the batch validation,
  a NaN-filled checkpoint-shaped tensor, ``index_copy_`` of the values (on its bytes: torch has no
  ``index_copy_`` of e4m3) and the loader's ``where(isnan(src), dst, src, out=dst)``, without
  the model loader's own Python; encode: the changed positions and their values;
- ``slime_deltas``: the gaps between changed positions (uint16, uint32 past 65535) and the values,
  decoded on the device (a cumulative sum, one scatter);
- ``slime_deltas_zstd``: that through zstd level 1, decompressed on the host (one thread), then
  copied to the device and decoded;
- ``xor_zstd``: each tensor's new bytes XOR its old ones through zstd level 1 (compressed on the
  host), decompressed on the host, copied to the device and XORed into the tensor (the GPU XOR
  apply of miles' receiver).

Every encode from the new masters: the others quantize first (``quantize_blockwise``, timed once
and added; each encode runs once untimed first). Every apply is checked bit for bit against the
new checkpoint, the reference quantization of the new masters. Times are medians of ``--repeats``,
each after the device's queue drained; ``peak MiB``: the most the apply allocated on the device
above what was there before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import zstandard
from field import ZSTD_LEVEL, checkpoint_tensors, slime_deltas
from standin import STEPS, trainer_step
from tabulate import tabulate

from glm_fp8 import quantize_blockwise
from glm_fp8.kernels.delta import BlockDelta, apply_delta, quantize_compare
from glm_fp8.kernels.reference import quantize_concat_ref

SHAPES = {
    "glm5": dict(hidden=6144, inter=2048),
    "tiny": dict(hidden=320, inter=256),
}
ENCODINGS = ("dense", "glm_fp8", "sparse_nccl", "slime_deltas", "slime_deltas_zstd", "xor_zstd")


class Checkpoint:
    """One engine rank's FP8 experts: w13 and w2 (e4m3) with their float32 scales."""

    def __init__(self, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor):
        self.q13, self.s13, self.q2, self.s2 = q13, s13, q2, s2

    def tensors(self) -> list[torch.Tensor]:
        return [self.q13, self.s13, self.q2, self.s2]

    def clone(self) -> Checkpoint:
        return Checkpoint(*(t.clone() for t in self.tensors()))

    def load(self, other: Checkpoint) -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)

    def equals(self, other: Checkpoint) -> bool:
        return all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(self.tensors(), other.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def checkpoint_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The checkpoint's tensors as views of these, each ``(weight, weight_scale_inv)``: every
        expert's gate_proj and up_proj (w13's halves, each of whole scale rows: the intermediate
        size is a multiple of 128), then every expert's down_proj (w2)."""
        weights = checkpoint_tensors("w13", self.q13) + checkpoint_tensors("w2", self.q2)
        scales = checkpoint_tensors("w13", self.s13) + checkpoint_tensors("w2", self.s2)
        return list(zip(weights, scales))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view, flat: e4m3 as its bytes (uint8), float32 scales as they are (a checkpoint
    tensor is a contiguous view of its stack)."""
    return t.view(-1).view(torch.uint8) if t.element_size() == 1 else t.view(-1)


def quantize(masters: dict[str, torch.Tensor], kernel: bool, backend: str | None) -> Checkpoint:
    """The FP8 checkpoint of the masters: w13 from [w1; w3], w2."""
    if kernel:
        q13, s13 = quantize_blockwise([masters["w1"], masters["w3"]], backend=backend)
        q2, s2 = quantize_blockwise(masters["w2"], backend=backend)
    else:
        q13, s13 = quantize_concat_ref([masters["w1"], masters["w3"]])
        q2, s2 = quantize_concat_ref([masters["w2"]])
    return Checkpoint(q13, s13, q2, s2)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, out


# --- the encodings: encode(old, new) -> wire; apply(wire, engine) ---


def sparse_encode(old: Checkpoint, new: Checkpoint) -> list:
    """vLLM sparse_nccl's patches: per changed checkpoint tensor (``(i, j)``: the ``i``-th of
    ``checkpoint_tensors``, its weight or its scale) its flat int32 indices and new values."""
    patches = []
    for i, (o_pair, n_pair) in enumerate(zip(old.checkpoint_tensors(), new.checkpoint_tensors())):
        for j, (o, n) in enumerate(zip(o_pair, n_pair)):
            idx = (_flat(n) != _flat(o)).nonzero().flatten()
            if idx.numel():
                patches.append((i, j, idx.to(torch.int32), _flat(n)[idx]))
    return patches


def sparse_validate(patches: list, numels: dict, device: torch.device) -> None:
    """vLLM 0.34's check of a batch of sparse patches (``_sparse_batch_is_invalid``'s ops on the
    batch's values and indices; strictly increasing indices, so no sort): one host read."""
    if not patches:
        return
    for dtype in {p[3].dtype for p in patches}:
        batch = [p for p in patches if p[3].dtype == dtype]
        values = torch.cat([p[3] for p in batch])
        invalid = torch.isnan(values.view(torch.float8_e4m3fn) if dtype == torch.uint8 else values).any()
        indices = torch.cat([p[2] for p in batch])
        lengths = torch.tensor([p[2].numel() for p in batch], device=device)
        ends = lengths.cumsum(0)
        not_increasing = indices[1:] <= indices[:-1]
        not_increasing[ends[:-1] - 1] = False
        if bool(not_increasing.any()):
            raise SystemExit("sparse_nccl: indices not increasing")
        lowest, highest = indices[ends - lengths], indices[ends - 1]
        limits = torch.tensor([numels[p[0], p[1]] for p in batch], device=device)
        invalid = invalid | (lowest < 0).any() | (highest >= limits).any()
        if bool(invalid):
            raise SystemExit("sparse_nccl: an invalid patch")


def sparse_apply(patches: list, engine: Checkpoint) -> None:
    """Stage each patch as vLLM does (NaN-filled, ``index_copy_``), then the loader's masked copy
    into the engine's tensor."""
    tensors = engine.checkpoint_tensors()
    numels = {(i, j): t.numel() for i, pair in enumerate(tensors) for j, t in enumerate(pair)}
    sparse_validate(patches, numels, engine.q13.device)
    for i, j, idx, values in patches:
        dst = tensors[i][j]
        staged = torch.full((dst.numel(),), float("nan"), dtype=dst.dtype, device=dst.device)
        target = staged.view(torch.uint8) if dst.element_size() == 1 else staged
        target.index_copy_(0, idx.long(), values)
        src = staged.view(dst.shape)
        torch.where(torch.isnan(src), dst, src, out=dst)


def deltas_encode(old: Checkpoint, new: Checkpoint) -> list:
    """slime's ``deltas`` of each changed checkpoint tensor (``(i, j)`` as ``sparse_encode``'s), as
    host bytes (``field.slime_deltas``)."""
    out = []
    for i, (o_pair, n_pair) in enumerate(zip(old.checkpoint_tensors(), new.checkpoint_tensors())):
        for j, (o, n) in enumerate(zip(o_pair, n_pair)):
            d = slime_deltas(_flat(n) != _flat(o), _flat(n))
            if d.count:
                out.append((i, j, d))
    return out


def deltas_apply(wire: list, engine: Checkpoint, decompress=None, wire_on_device=None) -> None:
    """Decode slime's ``deltas`` on the device: the gaps' cumulative sum is the positions; the
    values go there. ``decompress`` (host) first for ``deltas_zstd``."""
    tensors = engine.checkpoint_tensors()
    device = engine.q13.device
    for k, (i, j, d) in enumerate(wire):
        n, wide = d.count, d.wide
        if decompress is not None:
            raw = decompress(d.data)
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        else:
            buf = wire_on_device[k]
        dst = _flat(tensors[i][j])
        gw = 4 if wide else 2
        gaps = buf[: n * gw].view(torch.int32 if wide else torch.int16).long()
        if not wide:
            gaps &= 0xFFFF
        pos = gaps.cumsum(0)
        values = buf[n * gw :]
        if dst.element_size() > 1:  # float32 scales: a view of them starts at a multiple of 4 bytes
            if values.storage_offset() % dst.element_size():
                values = values.clone()
            values = values.view(dst.dtype)
        dst[pos] = values


def xor_encode(old: Checkpoint, new: Checkpoint, compress) -> list[bytes]:
    """Each checkpoint tensor's new bytes XOR its old ones, compressed on the host."""
    out = []
    for (ow, os_), (nw, ns) in zip(old.checkpoint_tensors(), new.checkpoint_tensors()):
        for o, n in ((ow, nw), (os_, ns)):
            x = _bytes(n).view(-1) ^ _bytes(o).view(-1)
            out.append(compress(x.cpu().numpy().tobytes()))
    return out


def xor_apply(wire: list[bytes], engine: Checkpoint, decompress) -> None:
    device = engine.q13.device
    dsts = [t for pair in engine.checkpoint_tensors() for t in pair]
    for data, dst in zip(wire, dsts):
        x = torch.frombuffer(bytearray(decompress(data)), dtype=torch.uint8).to(device)
        _bytes(dst).view(-1).bitwise_xor_(x)


def glm_apply(wire: tuple[BlockDelta, BlockDelta], engine: Checkpoint, backend: str | None) -> None:
    apply_delta(wire[0], engine.q13, engine.s13, backend=backend)
    apply_delta(wire[1], engine.q2, engine.s2, backend=backend)


def wire_nbytes(name: str, wire) -> int:
    if name == "dense":
        return wire
    if name == "glm_fp8":
        return sum(d.nbytes for d in wire)
    if name == "sparse_nccl":
        return sum(idx.numel() * 4 + v.numel() * v.element_size() for _, _, idx, v in wire)
    if name in ("slime_deltas", "slime_deltas_zstd"):
        return sum(len(d.data) for _, _, d in wire)
    return sum(len(w) for w in wire)


def run_lr(args, lr: float, device: torch.device, gen: torch.Generator) -> list[dict]:
    shape = SHAPES[args.model]
    e, h, i = args.experts, shape["hidden"], shape["inter"]
    backend = "torch" if device.type == "cpu" else None  # the kernels' reference on a CPU
    kernel = device.type == "cuda"

    def init(*dims: int) -> torch.Tensor:
        return torch.randn(dims, device=device, generator=gen) * 0.02

    shadow = {"w1": init(e, i, h), "w3": init(e, i, h), "w2": init(e, h, i)}
    masters = {k: v.to(torch.bfloat16) for k, v in shadow.items()}
    old = quantize(masters, kernel, backend)
    trainer_step(shadow, masters, lr, gen, args.step)
    new = quantize_ref(masters)  # the expected bytes: the reference, on the trainer's own tensors
    zc, zd = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    t_quant = statistics.median(
        timed(lambda: quantize(masters, kernel, backend), device)[0] for _ in range(3)
    )
    engine = old.clone()
    rows = []

    kept = old.clone()  # the sender's kept copy of what the engine holds

    def glm_encode():
        d13 = quantize_compare([masters["w1"], masters["w3"]], kept.q13, kept.s13, backend=backend)
        d2 = quantize_compare(masters["w2"], kept.q2, kept.s2, backend=backend)
        return d13, d2

    host_zstd = {"slime_deltas_zstd": 0.0, "xor_zstd": 0.0}

    def zdecompress(name):
        def f(data: bytes) -> bytes:
            t = time.perf_counter()
            raw = zd.decompress(data)
            host_zstd[name] += time.perf_counter() - t
            return raw

        return f

    encoders = {
        "dense": (lambda: new.nbytes, 0.0),
        "glm_fp8": (glm_encode, 0.0),
        "sparse_nccl": (lambda: sparse_encode(old, new), t_quant),
        "slime_deltas": (lambda: deltas_encode(old, new), t_quant),
        "slime_deltas_zstd": (
            lambda: [(a, b, replace(d, data=zc.compress(d.data))) for a, b, d in deltas_encode(old, new)],
            t_quant,
        ),
        "xor_zstd": (lambda: xor_encode(old, new, zc.compress), t_quant),
    }
    for name in ENCODINGS:
        encode, extra = encoders[name]
        encode()  # untimed: the kernels' first use compiles them
        kept.load(old)
        t_enc, wire = timed(encode, device)
        on_device = None
        if name == "slime_deltas":  # the wire as the engine holds it: on the device
            on_device = [
                torch.frombuffer(bytearray(d.data), dtype=torch.uint8).to(device) for _, _, d in wire
            ]
        apply = {
            "dense": lambda: engine.load(new),
            "glm_fp8": lambda: glm_apply(wire, engine, backend),
            "sparse_nccl": lambda: sparse_apply(wire, engine),
            "slime_deltas": lambda: deltas_apply(wire, engine, wire_on_device=on_device),
            "slime_deltas_zstd": lambda: deltas_apply(wire, engine, decompress=zdecompress(name)),
            "xor_zstd": lambda: xor_apply(wire, engine, zdecompress(name)),
        }[name]
        times, host, peaks, exact = [], [], [], True
        for _ in range(args.repeats):
            engine.load(old)
            for k in host_zstd:
                host_zstd[k] = 0.0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t, _ = timed(apply, device)
            times.append(t)
            host.append(host_zstd.get(name, 0.0))
            if device.type == "cuda":
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / 2**20)
            exact = exact and engine.equals(new)
        rows.append(
            {
                "lr": lr,
                "encoding": name,
                "wire_bytes": wire_nbytes(name, wire),
                "dense_bytes": new.nbytes,
                "encode_s": t_enc + extra,
                "apply_s": statistics.median(times),
                "apply_host_zstd_s": statistics.median(host),
                "apply_peak_mib": max(peaks) if peaks else None,
                "exact": exact,
            }
        )
    changed = int(
        sum(((_bytes(a) != _bytes(b)).sum() for a, b in zip(old.tensors()[::2], new.tensors()[::2])))
    )
    for r in rows:
        r["e4m3_changed"] = changed / (new.q13.numel() + new.q2.numel())
    return rows


def quantize_ref(masters: dict[str, torch.Tensor]) -> Checkpoint:
    """The reference per expert (its float32 temporaries one expert at a time)."""
    parts = [
        (
            *quantize_concat_ref([masters["w1"][x], masters["w3"][x]]),
            *quantize_concat_ref([masters["w2"][x]]),
        )
        for x in range(masters["w1"].shape[0])
    ]
    return Checkpoint(*(torch.stack([p[k] for p in parts]) for k in range(4)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--experts", type=int, default=None, help="experts of the engine rank (default 32; --model tiny: 2)"
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="glm5", help="tiny: a check, seconds")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--step", choices=STEPS, default="adam", help="the stand-in trainer step (standin.py)")
    p.add_argument("--repeats", type=int, default=5, help="applies timed per encoding (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    if args.experts is None:
        args.experts = 2 if args.model == "tiny" else 32
    if args.experts < 1 or args.repeats < 1:
        p.error("--experts and --repeats: expected at least 1")
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(args.seed)
    rows = []
    for lr in args.lrs:
        rows += run_lr(args, lr, device, gen)
    dense = {r["lr"]: r for r in rows if r["encoding"] == "dense"}
    table = []
    for r in rows:
        d = dense[r["lr"]]
        table.append(
            [
                f"{r['lr']:g}",
                r["encoding"],
                f"{100 * r['wire_bytes'] / r['dense_bytes']:.3f}",
                "-" if r["encoding"] == "dense" else f"{1e3 * r['encode_s']:.2f}",
                f"{1e3 * r['apply_s']:.2f}",
                f"{r['apply_s'] / d['apply_s']:.2f}",
                f"{1e3 * r['apply_host_zstd_s']:.2f}",
                "-" if r["apply_peak_mib"] is None else f"{r['apply_peak_mib']:.1f}",
                "yes" if r["exact"] else "NO",
            ]
        )
    shape = SHAPES[args.model]
    print(
        f"{args.experts} experts, hidden {shape['hidden']}, intermediate {shape['inter']}, {args.step} step, "
        f"{device}; e4m3 changed %: "
        + ", ".join(f"lr {lr:g} {100 * d['e4m3_changed']:.3f}" for lr, d in dense.items())
    )
    headers = [
        "lr",
        "encoding",
        "wire / dense %",
        "encode ms",
        "apply ms",
        "apply / dense",
        "of it zstd (host) ms",
        "apply peak MiB",
        "exact",
    ]
    print(tabulate(table, headers, "github"))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "device": str(device), "rows": rows}, indent=1)
        )
    if not all(r["exact"] for r in rows):
        raise SystemExit("an encoding's apply did not land the new checkpoint exactly")


if __name__ == "__main__":
    main()

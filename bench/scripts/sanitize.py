"""A small workload for compute-sanitizer (memcheck, racecheck): every GPU backend on partial
blocks, straddling sources, strided and misaligned views, 2-D and 3-D, both scale formats,
and the non-finite flag; the message checksum's kernel; the delta kernels (compare, offsets,
pack, check, apply) on sparse, dense and empty blocks. Exits non-zero if any result differs
from the reference.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/scripts/sanitize.py [cuda] [triton]

(backends named: only those; none: every GPU backend).
"""

from __future__ import annotations

import torch

from glm_fp8 import NonFiniteError, available_backends, quantize_blockwise, quantize_experts
from glm_fp8.kernels.checksum import checksum_torch
from glm_fp8.kernels.delta import apply_delta, quantize_compare
from glm_fp8.kernels.reference import quantize_concat_ref, quantize_experts_ref
from glm_fp8.transfer.delta.segments import SegmentDelta
from glm_fp8.transfer.delta.wire import counts_numel, pack_bytes_delta
from glm_fp8.transfer.wire import checksum_scratch, message_checksum


def _cases(device: torch.device):
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(3, 300, 272, device=device, generator=g)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = x.to(dtype)
        name = str(dtype).removeprefix("torch.")
        yield f"{name} aligned rows, partial chunk", [b[:, :, :261]]
        yield f"{name} 4 sources", [b[:, :100], b[:, 100:140], b[:, 140:141], b[:, 141:]]
        yield f"{name} misaligned rows", [b[:, :, 1:]]
        yield f"{name} transposed", [b.transpose(1, 2)[:, :200], b.transpose(1, 2)[:, 200:]]
        yield f"{name} 2-D", [b[0, :130], b[1, :7]]
        yield f"{name} whole stack", [b]


def _delta_failures(device: torch.device) -> int:
    """The delta kernels (Triton, their only GPU backend) against the torch backend: a step's
    quantize_compare and apply_delta on an expert stack with partial blocks, then a transfer
    segment's pack_bytes_delta (the comparison 8 bytes a lane with the segment's checksum, offsets,
    pack) with sparse, dense and empty blocks."""
    failures = 0
    g = torch.Generator(device).manual_seed(1)
    old = torch.randn(3, 300, 272, device=device, generator=g).to(torch.bfloat16)
    moved = torch.rand(old.shape, device=device, generator=g) < 0.01
    new = torch.where(moved, old * 1.05, old)
    new[1, :128, :128] = -old[1, :128, :128]  # a dense block
    q_old, s_old = quantize_concat_ref([old], "fp32")
    q_new, s_new = quantize_concat_ref([new], "fp32")
    kept_q, kept_s = q_old.clone(), s_old.clone()
    d = quantize_compare(new, kept_q, kept_s, backend="triton")
    engine_q, engine_s = q_old.clone(), s_old.clone()
    apply_delta(d, engine_q, engine_s, backend="triton")
    for what, a, b in (("kept", kept_q, q_new), ("engine", engine_q, q_new)):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            failures += 1
            print(f"FAIL delta: the {what} bytes differ from the new quantization")
    if not torch.equal(engine_s.view(torch.int32), s_new.view(torch.int32)):
        failures += 1
        print("FAIL delta: the engine's scales differ from the new quantization")
    n = 128 * 257 + 64
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)
    flip = torch.rand(n, device=device, generator=g) < 0.2
    b = torch.where(flip, a ^ 0x5A, a)
    b[: 128 * 128] ^= 0x11  # a dense block
    sd = SegmentDelta.of_nbytes(n)
    got = []
    for backend in ("torch", "triton"):
        kept = a.clone()
        counts = torch.full((counts_numel(sd.pieces),), -7, dtype=torch.int32, device=device)
        length = torch.full((1,), -1, dtype=torch.int64, device=device)
        payload = torch.full((sd.bound,), 0xFF, dtype=torch.uint8, device=device)
        checksum = torch.full((1,), -3, dtype=torch.int64, device=device)
        pack_bytes_delta(
            sd.views(b),
            sd.views(kept),
            sd.pieces,
            counts,
            length,
            payload,
            backend=backend,
            checksum=checksum,
        )
        got.append((kept, counts, payload[: int(length)], checksum))
    if any(not torch.equal(x, y) for x, y in zip(*got)) or not torch.equal(got[1][0], b):
        failures += 1
        print("FAIL delta: pack_bytes_delta differs from the torch backend")
    print("delta: checked")
    return failures


def main(only: list[str]) -> int:
    device = torch.device("cuda")
    failures = 0
    for backend in [b for b in available_backends(device) if b != "torch" and (not only or b in only)]:
        for name, sources in _cases(device):
            for fmt in ("fp32", "ue8m0"):
                for offset in (0, 3):  # aligned and misaligned outputs
                    q_ref, s_ref = quantize_concat_ref(sources, fmt)
                    big = torch.full((q_ref.numel() + offset,), 0xFF, dtype=torch.uint8, device=device)
                    out = big[offset:].view(torch.float8_e4m3fn).view(q_ref.shape)
                    q, s = quantize_blockwise(sources, out=out, scale_fmt=fmt, backend=backend)
                    bad_q = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
                    bad_s = (s.view(torch.int32) != s_ref.view(torch.int32)).nonzero()
                    if len(bad_q) or len(bad_s):
                        failures += 1
                        at = bad_q[0].tolist() if len(bad_q) else None
                        got = int(q.view(torch.uint8)[tuple(at)]) if at else None
                        want = int(q_ref.view(torch.uint8)[tuple(at)]) if at else None
                        print(
                            f"FAIL {backend} {name} {fmt} out+{offset}: {len(bad_q)} bytes, "
                            f"{len(bad_s)} scales; first byte {at}: {got} != {want}"
                        )
        # quantize_experts: w13 and w2 as one grid on the CUDA backend (jobs of unequal size).
        w1, w3 = (torch.randn(3, 136, 200, device=device, dtype=torch.bfloat16) for _ in range(2))
        w2 = torch.randn(3, 200, 136, device=device, dtype=torch.bfloat16)
        got = quantize_experts(w1, w3, w2, backend=backend)
        for (_, g), want in zip(got.items(), quantize_experts_ref(w1, w3, w2)):
            if not torch.equal(g.view(torch.uint8), want.contiguous().view(torch.uint8)):
                failures += 1
                print(f"FAIL {backend} quantize_experts: {tuple(want.shape)} differs")
        bad = torch.randn(2, 200, 200, device=device)
        bad[1, 150, 7] = float("nan")
        try:
            quantize_blockwise(bad, backend=backend)
            failures += 1
        except NonFiniteError:
            pass
        print(f"{backend}: checked")
    # The message checksum's kernel: partial last rows, one word, a view at an offset.
    raw = torch.randint(0, 256, (8 * (2 * 4096 + 3) + 24,), dtype=torch.uint8, device=device)
    for data in (raw[24:], raw[:8], raw[8 : 8 + 8 * 4096]):
        got = int(message_checksum(data, checksum_scratch(data.numel(), device)))
        if got != int(checksum_torch(data.view(torch.int64))):
            failures += 1
            print(f"FAIL checksum of {data.numel()} bytes")
    print("checksum: checked")
    if not only or "triton" in only:
        failures += _delta_failures(device)
    torch.cuda.synchronize()
    print(f"failures: {failures}")
    return int(failures > 0)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))

"""How fast a delta step reads a kept copy in pinned host memory in place (``DeltaOptions(kept="host")``),
beside the copy engine moving the same bytes (GPU only).

    python3 bench/scripts/host_read.py [--mib 320] [--repeats 5]

A segment of ``--mib`` MiB (random bytes, 0.2 % of them changed between two versions) goes
through the sender's own packing (``pack_bytes_delta``: the comparison, the offsets and the
pack) with its kept copy on the GPU and in pinned host memory through ``device_alias``; the
copy engine moves the same bytes host to device, device to host and device to device. Then the
host-kept packing again while a device-to-host copy of the same size runs on another stream (what
the one-GPU stand-in link does beside it in ``pipeline.py``). Prints each one's milliseconds
(median of ``--repeats``) and GB/s, and the in-place read's speed as a fraction of the copy
engine's host-to-device copy in the same run. A host-kept delta step is bound by that read
(docs/delta.md#in-the-transfer); its speed depends on where the pinned memory lies against the GPU
(``nvidia-smi topo -m`` names the GPU's NUMA node).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from glm_fp8.transfer.delta.segments import SegmentDelta
from glm_fp8.transfer.delta.send import device_alias
from glm_fp8.transfer.delta.wire import counts_numel, pack_bytes_delta


def timed_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` between CUDA events on the current stream (after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mib", type=int, default=320, help="segment size (a GLM-5 layer's share of sender 0: ~320)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_read.py: needs a CUDA device (pinned host memory mapped into it)")
    dev = torch.device("cuda")
    n = args.mib * 2**20
    g = torch.Generator(dev).manual_seed(0)
    versions = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)]
    flip = torch.rand(n, device=dev, generator=g) < 0.002
    versions.append(torch.where(flip, versions[0] ^ 0x5A, versions[0]))
    sd = SegmentDelta.of_nbytes(n)
    counts = torch.empty(counts_numel(sd.pieces), dtype=torch.int32, device=dev)
    length = torch.empty(1, dtype=torch.int64, device=dev)
    payload = torch.empty(sd.bound, dtype=torch.uint8, device=dev)
    kept_gpu = versions[0].clone()
    host = versions[0].cpu().pin_memory()
    kept_host = device_alias(host, dev)
    other = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu_buf = versions[0].clone()

    def pack(kept: torch.Tensor):
        turn = [0]  # what ``kept`` holds: versions alternate, so every call finds the same 0.2 % changed

        def run():
            turn[0] ^= 1
            pack_bytes_delta(sd.views(versions[turn[0]]), sd.views(kept), sd.pieces, counts, length, payload)

        return run

    side = torch.cuda.Stream()

    pack_host = pack(kept_host)

    def pack_beside_d2h():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other.copy_(gpu_buf, non_blocking=True)
        pack_host()
        torch.cuda.current_stream().wait_stream(side)

    rows = [
        (
            "copy engine, host to device",
            timed_ms(lambda: gpu_buf.copy_(host, non_blocking=True), args.repeats),
        ),
        (
            "copy engine, device to host",
            timed_ms(lambda: other.copy_(gpu_buf, non_blocking=True), args.repeats),
        ),
        ("copy engine, device to device", timed_ms(lambda: gpu_buf.copy_(versions[0]), args.repeats)),
        ("pack_bytes_delta, kept on the GPU", timed_ms(pack(kept_gpu), args.repeats)),
        ("pack_bytes_delta, kept in host memory", timed_ms(pack_host, args.repeats)),
        ("the same beside a device-to-host copy", timed_ms(pack_beside_d2h, args.repeats)),
    ]
    h2d = rows[0][1]
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: a segment of {args.mib} MiB, {len(sd.pieces)} pieces, 0.2 % of its bytes changed")
    print(f"{'what':42} {'ms (median)':>12} {'GB/s of the segment':>20} {'h2d copy / this':>16}")
    for what, ms in rows:
        print(f"{what:42} {ms:12.3f} {n / ms / 1e6:20.1f} {h2d / ms:16.3f}")


if __name__ == "__main__":
    main()

"""A delta step's kernels on one segment, each beside a device-to-device copy of the same bytes
(GPU only).

    python3 bench/scripts/delta_kernels.py [--mib 320] [--repeats 10] [--pack-warps 2 4 8]
    TRITON_INTERPRET=1 python3 bench/scripts/delta_kernels.py --device cpu --mib 0.25  # the checks alone

A segment of ``--mib`` MiB (random bytes; two versions 0.2 % of whose bytes differ, taken in
turn, so that every call finds the same changes) with its kept copy on the GPU, through:

- the checksum pass a dense segment takes (``message_checksum``);
- the comparison byte by byte (``launch_compare_bytes``), and 8 bytes a lane with the checksum's
  terms (``launch_compare_words``, what ``pack_bytes_delta`` runs on a segment's pieces);
- the offsets (``launch_offsets``) and the pack (``launch_pack``) at each ``--pack-warps``;
- the sender's whole sequence before the word comparison (checksum pass, byte comparison, offsets,
  pack) and now (``pack_bytes_delta`` with its checksum).

Prints each one's milliseconds (median of ``--repeats``, CUDA events), GB/s of the segment, and
its time over the device copy's (which reads and writes the segment once: a comparison reads it
twice). Checks first, into poisoned outputs: the word comparison's bitmap, counts and kept copy
equal the byte comparison's, its checksum equals ``message_checksum``'s, and ``pack_bytes_delta``'s
counts, length and payload equal those of the byte path. Then the peak memory ``pack_bytes_delta``
allocated beside its planned scratch (``COMPARE_SCRATCH_PER_BLOCK``).
"""

from __future__ import annotations

import argparse

import torch
from host_read import timed_ms

from glm_fp8.kernels import triton_delta
from glm_fp8.planning.update_delta import COMPARE_SCRATCH_PER_BLOCK
from glm_fp8.transfer.delta.segments import SegmentDelta
from glm_fp8.transfer.delta.wire import ALIGN, counts_numel, pack_bytes_delta
from glm_fp8.transfer.wire import checksum_scratch, message_checksum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mib", type=float, default=320, help="segment size (a GLM-5 layer's share of sender 0: ~320)"
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pack-warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument(
        "--device", default="cuda", help="cuda; or cpu under TRITON_INTERPRET=1: the checks alone"
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    n = int(args.mib * 2**20)
    if n % (128 * 128):
        raise SystemExit("--mib: whole 16 KiB blocks expected")
    g = torch.Generator(dev).manual_seed(0)
    versions = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)]
    flip = torch.rand(n, device=dev, generator=g) < 0.002
    versions.append(
        torch.where(flip, versions[0] ^ torch.randint_like(versions[0], 1, 256, generator=g), versions[0])
    )
    del flip
    sd = SegmentDelta.of_nbytes(n)
    (piece,) = sd.pieces
    blocks = piece.blocks
    rows = (n // 128, 128)
    kept = versions[0].clone()
    copy_out = torch.empty_like(kept)
    scratch = checksum_scratch(n, dev)
    bits = torch.empty(blocks * triton_delta.BITMAP_WORDS, dtype=torch.int16, device=dev)
    counts = torch.empty(counts_numel(sd.pieces), dtype=torch.int32, device=dev)
    sums = torch.empty(blocks, dtype=torch.int64, device=dev)
    offsets = torch.empty(2, blocks, dtype=torch.int64, device=dev)
    length = torch.empty(1, dtype=torch.int64, device=dev)
    checksum = torch.empty(1, dtype=torch.int64, device=dev)
    payload = torch.empty(sd.bound, dtype=torch.uint8, device=dev)
    positions = payload[: payload.numel() // 2 * 2].view(torch.int16)
    turn = [0]  # the version ``kept`` holds

    def next_new() -> torch.Tensor:
        turn[0] ^= 1
        return versions[turn[0]]

    def compare_bytes() -> None:
        triton_delta.launch_compare_bytes(
            next_new().view(1, *rows), kept.view(1, *rows), bits, counts[:blocks]
        )

    def compare_words() -> None:
        triton_delta.launch_compare_words(
            next_new().view(rows), kept.view(rows), bits, counts[:blocks], sums, 0
        )

    def offsets_and_pack(warps: int):
        def run() -> None:
            length.zero_()
            triton_delta.launch_offsets((1, *rows), counts[:blocks], offsets[0], offsets[1], length, ALIGN)
            wire = triton_delta.Wire(counts[:blocks], offsets[0], offsets[1], positions, payload)
            triton_delta.launch_pack(versions[turn[0]].view(1, *rows), bits, wire, num_warps=warps)

        return run

    def before() -> None:  # the sender's sequence with a checksum pass and the byte comparison
        new = next_new()
        message_checksum(new, scratch)
        triton_delta.launch_compare_bytes(new.view(1, *rows), kept.view(1, *rows), bits, counts[:blocks])
        offsets_and_pack(8)()

    def now() -> None:
        new = next_new()
        pack_bytes_delta(sd.views(new), sd.views(kept), sd.pieces, counts, length, payload, checksum=checksum)

    # Checks, into poisoned outputs, each from the same kept copy: the byte path, the word
    # comparison alone (its bitmap), pack_bytes_delta (its own bitmap inside).
    results = []
    for path in ("bytes", "words", "pack_bytes_delta"):
        kept.copy_(versions[0])
        turn[0] = 0
        for t in (bits, counts, sums, payload, length, checksum):
            t.fill_(0xFF if t.dtype == torch.uint8 else -1)
        {"bytes": before, "words": compare_words, "pack_bytes_delta": now}[path]()
        length_now = int(length) if path != "words" else -1
        payload_now = payload[: max(length_now, 0)].clone()
        results.append((bits.clone(), counts[:blocks].clone(), length_now, payload_now, kept.clone()))
    (
        (bits_b, counts_b, length_b, payload_b, _),
        (bits_w, counts_w, *_),
        (_, counts_p, length_p, payload_p, _),
    ) = results
    same = torch.equal(bits_b, bits_w) and torch.equal(counts_b, counts_w) and torch.equal(counts_b, counts_p)
    same = same and length_b == length_p and torch.equal(payload_b, payload_p) and int(counts[blocks]) == 0
    same = same and all(torch.equal(r[4], versions[1]) for r in results)
    same = same and int(checksum) == int(message_checksum(versions[1], scratch))
    changed = int(counts[:blocks].sum())
    print(f"segment {args.mib} MiB, {blocks} blocks, {changed} bytes changed ({100 * changed / n:.3f} %)")
    print(f"check: word path == byte path (bitmap, counts, length, payload, kept copy, checksum): {same}")
    if not same:
        raise SystemExit("delta_kernels.py: the word path differs from the byte path")
    if dev.type != "cuda":
        return  # timings and peak memory need CUDA events and the caching allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    now()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    planned = COMPARE_SCRATCH_PER_BLOCK * blocks
    print(f"pack_bytes_delta's allocations: peak {peak} bytes, planned scratch {planned}")

    rows_out = [("device copy", timed_ms(lambda: copy_out.copy_(kept), args.repeats))]
    rows_out.append(("checksum pass", timed_ms(lambda: message_checksum(kept, scratch), args.repeats)))
    rows_out.append(("compare, byte a lane", timed_ms(compare_bytes, args.repeats)))
    rows_out.append(("compare, 8 bytes a lane + checksum terms", timed_ms(compare_words, args.repeats)))
    for w in args.pack_warps:
        rows_out.append((f"offsets + pack, {w} warps", timed_ms(offsets_and_pack(w), args.repeats)))
    rows_out.append(("before: checksum + byte compare + offsets + pack", timed_ms(before, args.repeats)))
    rows_out.append(("now: pack_bytes_delta with its checksum", timed_ms(now, args.repeats)))
    copy_ms = rows_out[0][1]
    print("| what | ms | GB/s of the segment | / device copy |\n|---|---|---|---|")
    for what, ms in rows_out:
        print(f"| {what} | {ms:.3f} | {n / ms / 1e6:.1f} | {ms / copy_ms:.3f} |")


if __name__ == "__main__":
    main()

"""A delta segment on the wire (glm_fp8.transfer.delta.wire): what the sender packs, the receiver
unpacks into deltas that, applied to the engine's old bytes, give exactly the new quantization;
lengths come from the checked counts only, and never exceed the bound a receiver sizes from the plan."""

import pytest
import torch
from conftest import BACKENDS

from glm_fp8.kernels.delta import apply_delta, compare_bytes, quantize_compare
from glm_fp8.kernels.quantize import quantize_blockwise
from glm_fp8.kernels.reference import delta_block_sizes
from glm_fp8.transfer.delta.segments import SegmentDelta
from glm_fp8.transfer.delta.send import device_alias
from glm_fp8.transfer.delta.wire import (
    ALIGN,
    DeltaPiece,
    counts_numel,
    pack_bytes_delta,
    pack_delta,
    payload_bound,
    payload_layout,
    unpack_delta,
)
from glm_fp8.transfer.wire import message_checksum


def _step(shape, fraction, seed, scale=1.0):
    """Old and new fp32 weights at magnitude ``scale``: ``fraction`` of the elements moved by ~2 %
    (a fraction of 1: by ~30 %, so that most bytes change and blocks go dense)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g) * scale
    moved = torch.rand(shape, generator=g) < fraction
    rel = 0.3 if fraction == 1 else 0.02
    new = torch.where(moved, old * (1 + rel * torch.randn(shape, generator=g)), old)
    return old, new


def _segment(specs, seed=0):
    """Per piece: the engine's old (q, s), the sender's delta, the new reference (q, s)."""
    out = []
    for k, (shape, fraction, scale) in enumerate(specs):
        old, new = _step(shape, fraction, seed + k, scale)
        kept_q, kept_s = quantize_blockwise(old)
        engine = (kept_q.clone(), kept_s.clone())
        d = quantize_compare(new, kept_q, kept_s, backend="torch")
        out.append((engine, d, quantize_blockwise(new)))
    return out


SPECS = [
    ((3, 256, 384), 0.002, 1.0),  # an expert stack, a few changes a block
    ((200, 130), 1.0, 1e-3),  # partial edge blocks, every weight moved: dense blocks
    ((1, 128, 128), 0.0, 1e2),  # no change
    ((0, 256, 128), 0.1, 1.0),  # E = 0
]


def test_a_packed_segment_applied_gives_the_new_quantization():
    """pack -> unpack -> apply on the engine's old bytes == quantize_blockwise(new), bit for bit,
    for every piece; the payload fits the plan's bound; counts are a plan-sized message."""
    seg = _segment(SPECS)
    pieces = [DeltaPiece(tuple(shape)) for shape, _, _ in SPECS]
    counts = torch.full((counts_numel(pieces),), -7, dtype=torch.int32)
    payload = torch.full((payload_bound(pieces),), 0xFF, dtype=torch.uint8)
    n = pack_delta([d for _, d, _ in seg], pieces, counts, payload)
    assert n <= payload_bound(pieces) and n < sum(p.dense_nbytes for p in pieces)
    for (engine, _, (want_q, want_s)), got in zip(seg, unpack_delta(counts, payload[:n].clone(), pieces)):
        apply_delta(got, engine[0], engine[1], backend="torch")
        assert torch.equal(engine[0].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(engine[1].view(torch.int32), want_s.view(torch.int32))


def test_a_passthrough_piece_round_trips():
    """Bytes of a bf16 passthrough piece (no scales) travel the same way."""
    old = torch.randn(64, 96).to(torch.bfloat16)
    new = old.clone()
    new[3, 5:9] += 1
    kept = old.clone()
    d = compare_bytes(new, kept)
    piece = DeltaPiece(tuple(d.shape), scaled=False)
    counts = torch.empty(counts_numel([piece]), dtype=torch.int32)
    payload = torch.empty(payload_bound([piece]), dtype=torch.uint8)
    n = pack_delta([d], [piece], counts, payload)
    (got,) = unpack_delta(counts, payload[:n], [piece])
    engine = old.clone()
    apply_delta(got, engine.view(torch.uint8).view(torch.float8_e4m3fn).view(d.shape), None, backend="torch")
    assert torch.equal(engine.view(torch.uint8), new.view(torch.uint8))


@pytest.mark.parametrize("shape", [(300, 260), (2, 128, 256), (5, 7)])
def test_the_bound_holds_for_the_largest_counts(shape):
    """Every block at the largest sparse count (v // 3) or dense, every scale changed: the layout
    stays within payload_bound."""
    piece = DeltaPiece(shape)
    v = delta_block_sizes(shape)
    for per_block in (v // 3, v):
        counts = torch.cat([per_block, torch.tensor([piece.blocks])]).to(torch.int32)
        _, total = payload_layout(counts, [piece])
        assert total <= payload_bound([piece])


def test_counts_that_do_not_belong_are_refused_before_any_read():
    pieces = [DeltaPiece((256, 256)), DeltaPiece((130, 64))]
    good = torch.zeros(counts_numel(pieces), dtype=torch.int32)
    payload_layout(good, pieces)
    too_many = good.clone()
    too_many[5] = 128 * 64 + 1
    with pytest.raises(ValueError, match="piece 1 .* changes in block 0"):
        payload_layout(too_many, pieces)
    negative = good.clone()
    negative[0] = -1
    with pytest.raises(ValueError, match="piece 0"):
        payload_layout(negative, pieces)
    scales = good.clone()
    scales[4] = 5  # piece 0 has 4 blocks
    with pytest.raises(ValueError, match="piece 0 .* 5 changed scales"):
        payload_layout(scales, pieces)
    with pytest.raises(ValueError, match=r"expected int32 \[8\]"):
        payload_layout(good[:-1], pieces)
    with pytest.raises(ValueError, match="at least"):
        one_change = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32)
        unpack_delta(one_change, torch.zeros(2, dtype=torch.uint8), pieces)


def test_an_empty_segment():
    assert counts_numel([]) == 0 == payload_bound([])
    assert unpack_delta(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.uint8), []) == []


def _byte_step(nbytes, fraction, seed):
    """A segment's kept bytes and its new bytes with ``fraction`` of them redrawn (random data)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    moved = torch.rand(nbytes, generator=g) < fraction
    new = old.clone()
    new[moved] = torch.randint(0, 256, (int(moved.sum()),), dtype=torch.uint8, generator=g)
    return old, new


@pytest.mark.parametrize(
    "nbytes, fraction",
    [
        (128 * 300, 0.01),  # a few changes a block, a partial last block
        (128 * 128 * 2, 0.34),  # around the dense threshold
        (128 * 257 + 64, 0.6),  # mostly dense, and a tail piece [1, 64]
        (128 * 129, 0.0),  # nothing changed: an empty payload
        (50, 1.0),  # a tail piece alone
        (0, 0.5),  # no piece
    ],
)
@pytest.mark.parametrize("kept_in", ["device", "pinned host"])
def test_a_segment_packed_on_the_device_equals_the_reference(device, nbytes, fraction, kept_in):
    """``pack_bytes_delta`` on the device (Triton: no host read; offsets and the length computed
    by the offsets kernel) writes the counts, the payload's fields and its length exactly as the
    torch reference (``compare_bytes`` on the CPU, then ``pack_delta``), into poisoned outputs, and
    moves the kept copy to the new bytes; on a GPU also with the kept copy in pinned host memory,
    which the kernels read and write in place through its ``device_alias`` (``kept="host"``)."""
    if "triton" not in BACKENDS:
        pytest.skip("Triton does not run here")
    if kept_in == "pinned host" and device.type != "cuda":
        pytest.skip("host memory mapped into a GPU's address space: a CUDA device")
    old, new = _byte_step(nbytes, fraction, seed=nbytes)
    sd = SegmentDelta.of_nbytes(nbytes)
    got = []
    for backend, dev in (("torch", torch.device("cpu")), ("triton", device)):
        kept, fresh = old.to(dev, copy=True), new.to(dev, copy=True)
        if backend == "triton" and kept_in == "pinned host":
            host = old.clone().pin_memory()
            kept = device_alias(host, dev)
        counts = torch.full((counts_numel(sd.pieces),), -7, dtype=torch.int32, device=dev)
        length = torch.full((1,), -1, dtype=torch.int64, device=dev)
        payload = torch.full((max(sd.bound, 2),), 0xFF, dtype=torch.uint8, device=dev)
        checksum = torch.full((1,), -3, dtype=torch.int64, device=dev)
        args = (sd.views(fresh), sd.views(kept), sd.pieces, counts, length, payload)
        if nbytes % 8:  # the checksum is of whole words: refused before anything is written
            with pytest.raises(ValueError, match="8-byte words"):
                pack_bytes_delta(*args, backend=backend, checksum=checksum)
            assert int(length) == -1 and int(checksum) == -3 and torch.equal(kept.cpu(), old)
            checksum = None
        pack_bytes_delta(*args, backend=backend, checksum=checksum)
        if checksum is not None:  # the comparison's checksum is the segment's data bytes' own
            assert int(checksum) == int(message_checksum(new, torch.empty(1, dtype=torch.int64)))
        if backend == "triton" and kept_in == "pinned host":
            torch.cuda.synchronize(dev)
            assert torch.equal(host, new)  # written in host memory, in place
        else:
            assert torch.equal(kept.cpu(), new), backend
        deltas = unpack_delta(counts.cpu(), payload.cpu(), sd.pieces)
        got.append((counts.cpu(), int(length), [(d.counts, d.positions, d.values) for d in deltas]))
    (ref_counts, ref_n, ref), (counts, n, out) = got
    assert n == ref_n <= sd.bound and (n == 0) == (fraction == 0 or nbytes == 0)
    assert torch.equal(counts, ref_counts)
    for a, b in zip(ref, out):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_the_offsets_kernels_over_many_chunks(device):
    """``launch_offsets`` on a piece of several of its kernels' chunks (4,800 blocks, partial edge
    blocks, sparse, dense and empty blocks) at a payload already 48 bytes long: each block's start
    of positions and of values and the moved length equal the wire's layout (``payload_layout``),
    into poisoned outputs."""
    if "triton" not in BACKENDS:
        pytest.skip("Triton does not run here")
    from glm_fp8.kernels import triton_delta

    shape = (5, 1000, 3000)  # 8 x 24 blocks an expert
    piece = DeltaPiece(shape, scaled=False)
    v = delta_block_sizes(shape)
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, 4, v.shape, generator=g)
    counts = torch.where(pick == 0, 0, torch.where(pick == 1, v, torch.randint(1, 400, v.shape, generator=g)))
    counts = torch.minimum(counts, v).to(torch.int32)
    msg = torch.cat([counts, torch.zeros(1, dtype=torch.int32)])
    (lay,), total = payload_layout(msg, [piece])
    base = 3 * ALIGN  # the earlier pieces' fields, each padded to ALIGN
    pos_at, val_at = lay.fields[0][0] + base, lay.fields[1][0] + base
    dense = 3 * counts.long() > v
    n_pos = torch.where(dense, 0, counts.long())
    n_val = torch.where(dense, v, counts.long())
    want_p = pos_at // 2 + n_pos.cumsum(0) - n_pos
    want_v = val_at + n_val.cumsum(0) - n_val
    offsets = torch.full((2, len(v)), -5, dtype=torch.int64, device=device)
    length = torch.tensor([base], dtype=torch.int64, device=device)
    triton_delta.launch_offsets(shape, counts.to(device), offsets[0], offsets[1], length, ALIGN)
    assert torch.equal(offsets[0].cpu(), want_p)
    assert torch.equal(offsets[1].cpu(), want_v)
    assert int(length) == base + total


def test_a_checksum_of_pieces_out_of_block_order_is_refused_before_any_write(device):
    """With the Triton kernels a checksum is taken by the comparison 8 bytes a lane: two pieces,
    the second not in block order (every other byte), are refused before the first is compared."""
    if "triton" not in BACKENDS:
        pytest.skip("Triton does not run here")
    old, new = _byte_step(128 * 256, 0.01, seed=4)
    old, new = old.to(device), new.to(device)
    kept = old.clone()
    strided = torch.zeros(2 * 128, dtype=torch.uint8, device=device)[::2].view(1, 128)
    pieces = [DeltaPiece((256, 128), scaled=False), DeltaPiece((1, 128), scaled=False)]
    counts = torch.full((counts_numel(pieces),), -7, dtype=torch.int32, device=device)
    length = torch.full((1,), -1, dtype=torch.int64, device=device)
    payload = torch.full((payload_bound(pieces),), 0xFF, dtype=torch.uint8, device=device)
    checksum = torch.full((1,), -3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="block order"):
        pack_bytes_delta(
            [new.view(256, 128), strided],
            [kept.view(256, 128), strided.clone()],
            pieces,
            counts,
            length,
            payload,
            backend="triton",
            checksum=checksum,
        )
    assert torch.equal(kept, old) and int(length) == -1 and int(checksum) == -3
    assert bool((counts == -7).all()) and bool((payload == 0xFF).all())

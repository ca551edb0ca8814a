"""FP8 delta updates (glm_fp8.kernels.delta) against the reference, bit for bit, on every backend here.

Invariant: for kept bytes and scales ``(kq, ks)`` and new sources ``x``,
``d = quantize_compare(x, kq, ks)`` equals ``delta_encode_ref((kq, ks), quantize_concat_ref(x))``
in every tensor (counts, sorted positions, values, changed scales), leaves ``(kq, ks)`` holding
exactly ``quantize_concat_ref(x)``, and ``apply_delta(d, q, s)`` on an engine holding the old
``(kq, ks)`` makes it hold exactly the same, touching no byte outside its parameter view. The
kernels' buffers come poisoned (0xFF bytes), so an unwritten element cannot pass.
"""

import pytest
import torch
from conftest import BACKENDS, backend_id, poisoned_f32, poisoned_fp8

import glm_fp8.kernels.delta as delta_mod
from glm_fp8 import NonFiniteError
from glm_fp8.kernels.delta import BlockDelta, apply_delta, compare_bytes, quantize_compare
from glm_fp8.kernels.delta_cut import cut_delta
from glm_fp8.kernels.reference import (
    delta_apply_ref,
    delta_block_sizes,
    delta_encode_ref,
    quantize_concat_ref,
)

DELTA_BACKENDS = ["triton", "torch"] if "triton" in BACKENDS else ["torch"]


@pytest.fixture(params=DELTA_BACKENDS, ids=backend_id)
def dbackend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    def poisoned(*shape, dtype, device):
        return torch.full(shape, -1, dtype=dtype, device=device)

    monkeypatch.setattr(delta_mod, "_empty", poisoned)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    return (
        t.view(torch.int32)
        if t.dtype == torch.float32
        else t.view(torch.uint8)
        if t.element_size() == 1
        else t
    )


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    diff = (_bits(a) != _bits(b)).nonzero()
    assert len(diff) == 0, f"{what}: {len(diff)} elements differ, first at {diff[0].tolist()}"


def _views(q: torch.Tensor, s: torch.Tensor):
    """q and s copied into row-and-column slices of larger poisoned buffers (how an engine's
    parameter views, or a sender's kept copy inside one buffer, look), and a snapshot of the buffers."""
    big_q = poisoned_fp8((*q.shape[:-2], q.shape[-2] + 7, q.shape[-1] + 3), q.device)
    big_s = poisoned_f32((*s.shape[:-2], s.shape[-2] + 2, s.shape[-1] + 1), s.device)
    vq, vs = (
        big_q[..., 3 : 3 + q.shape[-2], 1 : 1 + q.shape[-1]],
        big_s[..., 1 : 1 + s.shape[-2], : s.shape[-1]],
    )
    vq.copy_(q)
    vs.copy_(s)
    return (vq, vs), (big_q, big_s, big_q.clone(), big_s.clone())


def _untouched_outside(views, buffers, what: str) -> None:
    vq, vs = views
    big_q, big_s, before_q, before_s = buffers
    vq.copy_(before_q[..., 3 : 3 + vq.shape[-2], 1 : 1 + vq.shape[-1]])
    vs.copy_(before_s[..., 1 : 1 + vs.shape[-2], : vs.shape[-1]])
    _same(big_q, before_q, f"{what}: bytes outside the view")
    _same(big_s, before_s, f"{what}: scales outside the view")


def _check(sources, prev_q, prev_s, scale_fmt="fp32", backend=None) -> BlockDelta:
    sources = sources if isinstance(sources, (list, tuple)) else [sources]
    q_new, s_new = quantize_concat_ref(sources, scale_fmt)
    ref = delta_encode_ref(prev_q, prev_s, q_new, s_new)
    kept, kept_buffers = _views(prev_q, prev_s)
    d = quantize_compare(sources, *kept, scale_fmt=scale_fmt, backend=backend)
    for name, got, want in zip(
        ("counts", "positions", "values", "scale_index", "scale_values"), d.tensors(), ref
    ):
        _same(got, want, name)
    _same(kept[0], q_new, "kept")
    _same(kept[1], s_new, "kept_scale")
    _untouched_outside(kept, kept_buffers, "kept")
    engine, engine_buffers = _views(prev_q, prev_s)
    apply_delta(d, *engine, backend=backend)
    _same(engine[0], q_new, "engine q")
    _same(engine[1], s_new, "engine scale")
    _untouched_outside(engine, engine_buffers, "engine")
    rq, rs = delta_apply_ref(prev_q, prev_s, *ref)
    _same(rq, q_new, "delta_apply_ref q")
    _same(rs, s_new, "delta_apply_ref scale")
    return d


@pytest.mark.parametrize(
    "dtype, scale_fmt, magnitude",
    [
        (torch.bfloat16, "fp32", 1e-3),
        (torch.float32, "ue8m0", 1.0),
        (torch.bfloat16, "ue8m0", 1e3),
        (torch.float32, "fp32", 1e3),
    ],
)
def test_adamw_like_step_two_sources(device, dtype, scale_fmt, magnitude, dbackend):
    # rows 100 + 90: row block 0 straddles the sources; 260 columns end in a partial block.
    a = torch.randn(2, 100, 260, device=device) * magnitude
    b = torch.randn(2, 90, 260, device=device) * magnitude * 3
    prev_q, prev_s = quantize_concat_ref([a.to(dtype), b.to(dtype)], scale_fmt)
    # An AdamW step moves each weight by about lr; relative 3e-5 changes a few of these 99k bytes,
    # relative 1e-6 (lr 1e-6 on weights near 1) almost none. A bf16 master moves by whole ulps.
    for step in (1e-6, 3e-5) if dtype == torch.float32 else (2e-3,):
        new = [(t * (1 + step * torch.randn_like(t))).to(dtype) for t in (a, b)]
        d = _check(new, prev_q, prev_s, scale_fmt, dbackend)
        assert d.changed < 0.05 * prev_q.numel()
    assert d.changed > 0


def test_unrelated_weights_dense_and_sparse_blocks(device, dbackend):
    x = torch.randn(3, 140, 300, device=device)
    prev_q, prev_s = quantize_concat_ref([torch.randn_like(x)])
    x[1, :128, :128] = 0.0  # a zero block
    x[2, 128:, 256:] = -0.0  # a partial block of negative zeros
    d = _check(x, prev_q, prev_s, backend=dbackend)
    assert (3 * d.counts.long() > 128 * 128 // 2).any()  # dense blocks are in it


def test_every_byte_of_a_block_changes(device, dbackend):
    x = torch.randn(256, 200, device=device, dtype=torch.bfloat16)
    prev_q, prev_s = quantize_concat_ref([x])
    y = x.clone()
    y[128:, :128] = -y[128:, :128]  # every sign bit flips; the scale stays
    y[:128, 128:] += 1e-2 * torch.randn(128, 72, device=device, dtype=torch.bfloat16)
    d = _check(y, prev_q, prev_s, backend=dbackend)
    assert d.counts.tolist()[2] == 128 * 128 and d.scale_index.numel() <= 1


def test_unchanged_empty_and_single_expert(device, dbackend):
    x = torch.randn(1, 130, 129, device=device)
    prev_q, prev_s = quantize_concat_ref([x])
    d = _check(x, prev_q, prev_s, backend=dbackend)
    assert d.changed == 0 and d.positions.numel() == d.values.numel() == d.scale_index.numel() == 0
    assert d.nbytes == 4 * 4 and d.dense_nbytes == 130 * 129 + 4 * 4
    e0 = torch.randn(0, 200, 64, device=device)
    q0, s0 = quantize_concat_ref([e0])
    d = _check(e0, q0, s0, backend=dbackend)
    assert d.counts.numel() == 0


def test_repeated_updates_keep_sender_and_engine_equal(device, dbackend):
    """Six steps of deltas: the kept copy and the engine stay the dense update's bytes."""
    w = torch.randn(2, 150, 140, device=device)
    kq, ks = quantize_concat_ref([w], "ue8m0")
    eq, es = kq.clone(), ks.clone()
    for k in range(6):
        w = w + (1e-3 if k % 3 else 1e-1) * torch.randn_like(w)
        d = quantize_compare(w, kq, ks, scale_fmt="ue8m0", backend=dbackend)
        apply_delta(d, eq, es, backend=dbackend)
    q, s = quantize_concat_ref([w], "ue8m0")
    for got in (kq, eq):
        _same(got, q, "bytes after 6 updates")
    for got in (ks, es):
        _same(got, s, "scales after 6 updates")


def test_non_finite_source_is_named(device, dbackend):
    x = torch.randn(2, 130, 140, device=device)
    kq, ks = quantize_concat_ref([x])
    x[1, 129, 3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"sources\[1\]") as err:
        quantize_compare([x[:, :100], x[:, 100:]], kq.clone(), ks.clone(), backend=dbackend)
    assert err.value.source == "sources[1]"
    if dbackend == "torch":  # transactional: nothing written
        k2, s2 = kq.clone(), ks.clone()
        with pytest.raises(NonFiniteError):
            quantize_compare(x, k2, s2, backend=dbackend)
        _same(k2, kq, "kept after a refused call")


def test_arguments_checked_before_any_write(device, dbackend):
    x = torch.randn(130, 140, device=device)
    kq, ks = quantize_concat_ref([x])
    with pytest.raises(ValueError, match="kept: expected shape"):
        quantize_compare(x, kq[:, :100], ks, backend=dbackend)
    with pytest.raises(TypeError, match="kept: expected dtype"):
        quantize_compare(x, kq.view(torch.uint8), ks, backend=dbackend)
    with pytest.raises(ValueError, match="kept_scale: expected shape"):
        quantize_compare(x, kq, ks[:1], backend=dbackend)
    d = quantize_compare(x * (1 + 1e-2 * torch.randn_like(x)), kq.clone(), ks.clone(), backend=dbackend)
    assert d.positions.numel() and d.scale_index.numel()
    eq, es = kq.clone(), ks.clone()
    bad = [
        (
            BlockDelta(d.shape, d.counts, d.positions[:-1], d.values, d.scale_index, d.scale_values),
            "call for",
        ),
        (
            BlockDelta(d.shape, d.counts, d.positions, d.values, d.scale_index + 100, d.scale_values),
            "scale_index",
        ),
        (
            BlockDelta(d.shape, d.counts.long(), d.positions, d.values, d.scale_index, d.scale_values),
            "counts",
        ),
        (
            BlockDelta(
                d.shape, d.counts, d.positions.clone().fill_(16383), d.values, d.scale_index, d.scale_values
            ),
            "positions",
        ),
        (
            BlockDelta(
                d.shape, d.counts, d.positions.clone().fill_(-1), d.values, d.scale_index, d.scale_values
            ),
            "positions",
        ),
    ]
    for wrong, match in bad:
        with pytest.raises(ValueError, match=match):
            apply_delta(wrong, eq, es, backend=dbackend)
    with pytest.raises(ValueError, match="q: expected shape"):
        apply_delta(d, eq[:129], es, backend=dbackend)
    with pytest.raises(ValueError, match="scale: expected shape"):
        apply_delta(d, eq, es[:1], backend=dbackend)
    _same(eq, kq, "engine after refused deltas")
    _same(es, ks, "engine scales after refused deltas")


def test_passthrough_bytes(device, dbackend):
    new = torch.randn(3, 70, device=device, dtype=torch.bfloat16)
    kept = new.clone()
    kept[1, 5] += 1.0
    engine = kept.clone()
    d = compare_bytes(new, kept)
    assert torch.equal(kept, new) and 1 <= d.changed <= 2 and d.scale_index.numel() == 0
    rows = engine.view(torch.uint8).view(torch.float8_e4m3fn)
    apply_delta(d, rows, None, backend=dbackend)
    assert torch.equal(engine, new)


@pytest.mark.parametrize(
    "shape, dtype, moved",
    [
        ((300, 256), torch.uint8, 1e-3),  # whole 128-byte rows, partial row blocks
        ((3, 70), torch.bfloat16, 0.05),  # a passthrough entry: one partial block
        ((257, 384), torch.uint8, 0.5),  # dense blocks beside sparse ones
        ((5000,), torch.uint8, 0.01),  # one row of bytes: a tail segment piece
        ((129, 128), torch.uint8, 0.0),  # nothing changed
        ((0, 128), torch.uint8, 0.1),  # empty
    ],
)
def test_compare_bytes_equals_the_reference(device, dbackend, shape, dtype, moved):
    """compare_bytes on converted bytes (a transfer segment's rows, a passthrough entry): every
    field equal to delta_encode_ref of the two byte views, kept moved to new and nothing beside it
    written, new untouched; apply_delta of it rebuilds new from the old bytes."""
    gen = torch.Generator(device=device).manual_seed(sum(shape) + int(moved * 1e4))
    raw = (*shape[:-1], shape[-1] * dtype.itemsize)  # the bytes of a tensor of this shape and dtype
    old = torch.randint(0, 256, raw, dtype=torch.uint8, device=device, generator=gen)
    flip = torch.rand(raw, device=device, generator=gen) < moved
    xor = torch.randint(1, 256, raw, dtype=torch.uint8, device=device, generator=gen)
    old, new = old.view(dtype), torch.where(flip, old ^ xor, old).view(dtype)
    buf = torch.full((old.nbytes + 64,), 0xA5, dtype=torch.uint8, device=device)
    kept = buf[32 : 32 + old.nbytes].view(dtype).view(shape)
    kept.copy_(old)
    before, new_before = buf.clone(), new.clone()
    d = compare_bytes(new, kept, backend=dbackend)
    rows, cols = (shape[0], raw[-1]) if len(shape) > 1 else (1, raw[0])
    as_rows = lambda t: t.view(torch.uint8).reshape(rows, cols).view(torch.float8_e4m3fn)  # noqa: E731
    no_scale = torch.zeros(((rows + 127) // 128, (as_rows(new).shape[1] + 127) // 128), device=device)
    want = delta_encode_ref(as_rows(old), no_scale, as_rows(new), no_scale)
    for field, w in zip(("counts", "positions", "values"), want[:3]):
        _same(getattr(d, field), w, f"compare_bytes {field}")
    assert d.scale_index.numel() == 0 and d.shape == tuple(as_rows(new).shape)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 - random bytes: bf16 NaNs among them
    _same(u8(kept), u8(new), "kept after compare_bytes")
    _same(u8(new), u8(new_before), "new (read only)")
    _same(buf[:32], before[:32], "bytes before kept")
    _same(buf[32 + kept.nbytes :], before[32 + kept.nbytes :], "bytes after kept")
    engine = old.clone()
    apply_delta(d, as_rows(engine), None, backend=dbackend)
    _same(u8(engine), u8(new), "engine after apply_delta")


def _random_cut(gen: torch.Generator, n: int, block: int = 128) -> tuple[int, int]:
    """A random (start, stop) of whole blocks of n rows, columns (or experts, block=1), not empty
    unless n is 0; it may end in the partial edge block."""
    nb = -(-n // block)
    lo = int(torch.randint(0, max(nb, 1), (), generator=gen))
    hi = int(torch.randint(min(lo + 1, nb), nb + 1, (), generator=gen))
    return lo * block, min(hi * block, n)


@pytest.mark.parametrize(
    "shape, change",
    [((2, 300, 260), "step"), ((1, 130, 129), "unrelated"), ((0, 200, 64), "step"), ((256, 200), "step")],
)
def test_cut_delta_is_the_delta_of_the_cut(device, shape, change, dbackend):
    """The cut of an entry's delta is the delta of the two states' cut views, bit for bit, and applied
    to the engine's view of the cut it writes there what the whole delta writes, nothing elsewhere."""
    x = torch.randn(shape, device=device)
    prev_q, prev_s = quantize_concat_ref([x])
    y = torch.randn_like(x)  # "unrelated": every block dense
    if change == "step":
        y = x * (1 + 1e-2 * torch.randn_like(x))  # sparse blocks; every float32 scale changes
        y[..., :128, 128:256] = torch.randn_like(y[..., :128, 128:256])  # dense blocks
        y[..., 128:, :128] = x[..., 128:, :128]  # blocks without a change
    new_q, new_s = quantize_concat_ref([y])
    whole = BlockDelta(tuple(shape), *delta_encode_ref(prev_q, prev_s, new_q, new_s))
    dense = 3 * whole.counts.long().cpu() > delta_block_sizes(shape)
    assert dense.all() if change == "unrelated" else (dense.any() and not dense.all()) or not len(dense)
    full_q, full_s = prev_q.clone(), prev_s.clone()
    apply_delta(whole, full_q, full_s, backend=dbackend)
    e, r, c = shape if len(shape) == 3 else (1, *shape)
    gen = torch.Generator().manual_seed(r * c)
    # All; the blocks without a change; empty cuts (no experts, no rows); then random cuts.
    cuts = [((0, e), (0, r), (0, c)), ((0, e), (128, r), (0, min(c, 128)))]
    cuts += [((e, e), (0, r), (0, c)), ((0, e), (128, 128), (0, c))]
    cuts += [(_random_cut(gen, e, 1), _random_cut(gen, r), _random_cut(gen, c)) for _ in range(6)]
    for k, ((e0, e1), (r0, r1), (c0, c1)) in enumerate(cuts):
        sl = (slice(e0, e1), slice(r0, r1), slice(c0, c1))[3 - len(shape) :]
        sl_s = (slice(e0, e1), slice(r0 // 128, -(-r1 // 128)), slice(c0 // 128, -(-c1 // 128)))
        sl_s = sl_s[3 - len(shape) :]
        what = f"cut {k} {sl}"
        d = cut_delta(whole, experts=(e0, e1) if len(shape) == 3 else None, rows=(r0, r1), cols=(c0, c1))
        assert d.shape == tuple(prev_q[sl].shape), what
        want = delta_encode_ref(prev_q[sl], prev_s[sl_s], new_q[sl], new_s[sl_s])
        for name, got, ref in zip(
            ("counts", "positions", "values", "scale_index", "scale_values"), d.tensors(), want
        ):
            _same(got, ref, f"{what}: {name}")
        if k == 1 and change == "step":
            assert d.counts.numel() == e * (-(-r // 128) - 1), what
            assert d.changed == 0 and d.scale_index.numel() == 0, what
        engine_q, engine_s = prev_q.clone(), prev_s.clone()
        apply_delta(d, engine_q[sl], engine_s[sl_s], backend=dbackend)
        want_q, want_s = prev_q.clone(), prev_s.clone()
        want_q[sl], want_s[sl_s] = full_q[sl], full_s[sl_s]
        _same(engine_q, want_q, f"{what}: engine bytes")
        _same(engine_s, want_s, f"{what}: engine scales")


def test_cut_delta_refuses_a_cut_off_the_blocks(device):
    """A cut out of range, not of whole blocks, or of a delta that does not fit its shape: a ValueError
    naming the argument."""
    x = torch.randn(2, 300, 260, device=device)
    q, s = quantize_concat_ref([x])
    new_q, new_s = quantize_concat_ref([x * (1 + 1e-2 * torch.randn_like(x))])
    d = BlockDelta((2, 300, 260), *delta_encode_ref(q, s, new_q, new_s))
    assert d.positions.numel() and d.scale_index.numel()
    wrong = [
        (dict(rows=(100, 256)), r"^rows: expected whole 128x128 blocks \(start a multiple of 128"),
        (dict(rows=(0, 200)), r"^rows: expected whole 128x128 blocks .* got \(0, 200\)"),
        (dict(cols=(0, 384)), r"^cols\[1\]: expected an integer in \[0, 260\] \(the entry has 260 columns\)"),
        (dict(experts=(1, 3)), r"^experts\[1\]: expected an integer in \[1, 2\]"),
        (dict(experts=(2, 1)), r"^experts\[1\]: expected an integer in \[2, 2\]"),
        (dict(rows=(128,)), r"^rows: expected None or \(start, stop\)"),
        (dict(cols=(0.0, 128)), r"^cols\[0\]: expected an integer"),
    ]
    for kwargs, match in wrong:
        with pytest.raises(ValueError, match=match):
            cut_delta(d, **kwargs)
    flat = BlockDelta((300, 260), *delta_encode_ref(q[0], s[0], q[1], s[1]))
    with pytest.raises(ValueError, match=r"^experts: expected None for a 2-D entry"):
        cut_delta(flat, experts=(0, 1))
    with pytest.raises(ValueError, match=r"^delta.counts: expected \(12,\)"):
        cut_delta(BlockDelta((2, 300, 256), *d.tensors()), experts=(0, 1))
    short = BlockDelta(d.shape, d.counts, d.positions[:-1], d.values, d.scale_index, d.scale_values)
    with pytest.raises(ValueError, match=r"^delta: not a delta of a \[2, 300, 260\] entry"):
        cut_delta(short, rows=(0, 128))


def _patterned(shape: tuple[int, int], pattern: str, gen: torch.Generator) -> torch.Tensor:
    """Which bytes of a [R, C] byte tensor change, as the pack kernel's word-by-word ranking sees
    them: whole 16-byte words, a block's first and last bytes, every other byte, a block just at the
    dense threshold (v // 3 changes: still sparse) and just over it."""
    r, c = shape
    m = torch.zeros(shape, dtype=torch.bool)
    if pattern == "full words":
        m[5, :128] = True  # a row of block 0: 8 words of 16 set bits
        m[130:140, 16:32] = True  # one word in each of 10 rows of block 1's rows
    elif pattern == "first and last":
        m[0, 0] = m[127, 127] = m[128, 128] = m[r - 1, c - 1] = True
    elif pattern == "every other":
        k = torch.arange(128 * 128).view(128, 128)
        m[:128, :128] = k % 2 == 0  # 8,192 of 16,384: dense
        m[128:256, :128] = k % 7 == 0  # sparse, every word touched
    elif pattern == "threshold":
        v = 128 * 128
        for b, n in ((0, v // 3), (1, v // 3 + 1)):  # sparse at v // 3, dense one past it
            block = torch.zeros(v, dtype=torch.bool)
            block[torch.randperm(v, generator=gen)[:n]] = True
            m[b * 128 : (b + 1) * 128, :128] = block.view(128, 128)
    return m


@pytest.mark.parametrize("pattern", ["full words", "first and last", "every other", "threshold"])
def test_compare_bytes_change_patterns(device, dbackend, pattern):
    """Structured changes through compare_bytes (the bitmap, the offsets and the word-by-word pack)
    equal delta_encode_ref field for field: words with every bit set, the first and the last byte
    of blocks and of a partial edge block, a block at the dense threshold and one past it."""
    shape = (300, 260)
    gen = torch.Generator().manual_seed(7)
    old = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    m = _patterned(shape, pattern, gen)
    new = torch.where(m, old ^ torch.randint(1, 256, shape, dtype=torch.uint8, generator=gen), old)
    old, new = old.to(device), new.to(device)
    kept = old.clone()
    d = compare_bytes(new, kept, backend=dbackend)
    f8 = lambda t: t.view(torch.float8_e4m3fn)  # noqa: E731
    no_scale = torch.zeros((3, 3), device=device)
    want = delta_encode_ref(f8(old), no_scale, f8(new), no_scale)
    for field, w in zip(("counts", "positions", "values"), want[:3]):
        _same(getattr(d, field), w, f"compare_bytes {field}")
    _same(kept, new, "kept after compare_bytes")
    assert int(d.counts.sum()) == int(m.sum())


@pytest.mark.parametrize("pattern", ["full words", "first and last", "every other", "threshold"])
@pytest.mark.parametrize("xor", ["random", "top bit", "low bit", "all bits"])
@pytest.mark.parametrize("rows", [300, 256, 1])
def test_compare_words_equals_compare_bytes(device, pattern, xor, rows):
    """The comparison 8 bytes a lane (``delta_words_kernel``: per-byte flags from a word's XOR)
    gives the byte kernel's bitmap, counts and kept copy, and each block's checksum terms sum to
    the new bytes' checksum; changes of the top bit alone (the word's sign bit in its last byte),
    of the low bit alone and of every bit; into poisoned outputs."""
    if "triton" not in BACKENDS:
        pytest.skip("Triton does not run here")
    from glm_fp8.kernels import triton_delta
    from glm_fp8.kernels.checksum import checksum_torch

    shape = (rows, 128)
    gen = torch.Generator().manual_seed(11)
    old = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    m = _patterned((max(rows, 256), 256), pattern, gen)[:rows, :128] | (
        torch.rand(shape, generator=gen) < 0.5
    ) * (rows == 1)
    m[rows - 1, 127] = True  # the last byte of the last (partial) block
    flip = {
        "random": torch.randint(1, 256, shape, dtype=torch.uint8, generator=gen),
        "top bit": torch.full(shape, 0x80, dtype=torch.uint8),
        "low bit": torch.ones(shape, dtype=torch.uint8),
        "all bits": torch.full(shape, 0xFF, dtype=torch.uint8),
    }[xor]
    new = torch.where(m, old ^ flip, old).to(device)
    blocks = -(-rows // 128)
    outs = []
    for kernel in ("bytes", "words"):
        kept = old.to(device, copy=True)
        bits = torch.full((blocks * triton_delta.BITMAP_WORDS,), -7, dtype=torch.int16, device=device)
        counts = torch.full((blocks,), -7, dtype=torch.int32, device=device)
        if kernel == "bytes":
            triton_delta.launch_compare_bytes(new.view(1, *shape), kept.view(1, *shape), bits, counts)
        else:
            assert triton_delta.words_fit(new, kept)
            sums = torch.full((blocks,), -7, dtype=torch.int64, device=device)
            triton_delta.launch_compare_words(new, kept, bits, counts, sums, 3)
            want = checksum_torch(new.cpu().view(-1).view(torch.int64), 3)
            assert int(sums.sum()) == int(want)
        outs.append((bits.cpu(), counts.cpu(), kept.cpu()))
    for a, b, what in zip(*outs, ("bits", "counts", "kept")):
        _same(b, a, what)
    assert int(outs[1][1].sum()) == int(m.sum())

"""The delta mode of the update-time model (docs/update_time.md#delta-updates): the bytes
a delta update puts on the wire, what a sender keeps of what it last sent, and what an engine
rank's receiver holds, for ``glm_fp8.planning.update_time.predict(..., delta=Delta(...))``.

The encoding is docs/delta.md's (per quantized entry, its 128x128 blocks): an int32 count per
block; a block with ``3 n > v`` (``n`` of its ``v`` valid positions changed) goes dense (its ``v``
bytes), any other 3 bytes per change (int16 offset, uint8 value); each changed scale an (int32
index, float32 value) pair. The model spreads the changes uniformly (every block holds
``fraction`` of its positions changed: the measured case, nearly every block has a few), so a
quantized entry of ``elements`` e4m3 bytes in ``blocks`` blocks costs

    4 * blocks + min(3 * fraction, 1) * elements + 8 * scales_changed * blocks

(at ``fraction`` > 1/3 every block is dense; at 1/3 both cost ``v``). Passthrough entries (bf16 and
fp32 copies: norms, the router, the indexer's projection, embeddings, heads, ``eh_proj``) go dense
unless ``Delta.passthrough`` says what fraction of their bytes change; then they take
``compare_bytes``' encoding (the same blocks over their bytes seen as uint8 [rows, row bytes], no
scales). A segment keeps its framing (each piece aligned, its checksum word), as a dense one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core.numerics import BLOCK
from glm_fp8.core.vocab import KEPT_COPIES, KeptCopy, check_choice
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.delta.segments import LayerSizes, SegmentDelta
from glm_fp8.transfer.routes import TransferPlan

COUNT_BYTES = 4  # int32 per block
CHANGE_BYTES = 3  # int16 offset + uint8 value per change of a sparse block
SCALE_PAIR_BYTES = 8  # int32 index + float32 value per changed scale
# The sender's comparison scratch per block of the piece it compares
# (glm_fp8.transfer.delta.wire.pack_bytes_delta): a 2 KiB bitmap, two int64 offsets and an int64
# part of the segment's checksum (its counts go straight into the counts message), freed on
# return; not counted, the checksum's sum (a scalar) and the offsets kernels' two int64
# totals per 1,024 blocks (one allocation of the caching allocator's smallest size, 512 bytes, up to
# 31,744 blocks); apply_delta's: two int64 offsets and its offset check's int32 count
# (delta_check_kernel) per block.
COMPARE_SCRATCH_PER_BLOCK = 2048 + 24
APPLY_SCRATCH_PER_BLOCK = 16 + 4
# Measured on one H200 (bench/RESULTS.md, protocol v3): a device-to-host copy into pinned memory
# (the one-GPU stand-in link's) at 55.3 GB/s. Kept in host memory, a delta step's comparison reads
# the layer's kept copy once over PCIe, in place (glm_fp8.transfer.delta.send.device_alias), and
# writes back only its changed bytes; taken at that rate.
HOST_COPY_BYTES_PER_S = 55.3e9


def _fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
        raise ValueError(
            f"Delta.{name}: expected a number in [0, 1] (a fraction: 0.0012 for 0.12 %), got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Delta:
    """A delta update to predict: ``fraction`` of the e4m3 bytes changed since the last update
    (the measured median steps, bench/RESULTS.md: 0.0012 at lr 1e-6, 0.0031 at 3e-6, 0.0090 at 1e-5);
    ``scales_changed``: the fraction of block scales changed (1: float32 scales from float32
    masters, which nearly all change, the default; 0: UE8M0 scales, which never did);
    ``kept``: where each sender keeps what it last sent, "gpu" or "host" (pinned, read and written
    in place by the comparison, nothing of it on the GPU); ``passthrough``: the fraction of the
    passthrough entries' bytes changed, None to send them dense (the default: not measured)."""

    fraction: float
    scales_changed: float = 1.0
    kept: KeptCopy = "gpu"
    passthrough: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", _fraction("fraction", self.fraction))
        object.__setattr__(self, "scales_changed", _fraction("scales_changed", self.scales_changed))
        if self.passthrough is not None:
            object.__setattr__(self, "passthrough", _fraction("passthrough", self.passthrough))
        check_choice("Delta.kept", self.kept, KEPT_COPIES)


def as_delta(delta: Delta | float | None) -> Delta | None:
    """``delta`` as a ``Delta`` (a bare number is its ``fraction``), or None."""
    return delta if delta is None or isinstance(delta, Delta) else Delta(delta)


def blocks(shape: Sequence[int]) -> int:
    """128x128 blocks of a quantized entry [(E,) R, C] (partial blocks at the edges count)."""
    *experts, rows, cols = shape
    return math.prod(experts) * -(-rows // BLOCK) * -(-cols // BLOCK)


def entry_bytes(shape: Sequence[int], delta: Delta) -> float:
    """Expected wire bytes of one quantized entry [(E,) R, C] with its scales (the formula of the
    module's docstring); dense, the same entry is ``E R C + 4 blocks``."""
    changes = min(CHANGE_BYTES * delta.fraction, 1.0) * math.prod(shape)
    return (COUNT_BYTES + SCALE_PAIR_BYTES * delta.scales_changed) * blocks(shape) + changes


def _byte_blocks(shape: Sequence[int], itemsize: int) -> int:
    """``compare_bytes``' blocks: the tensor's bytes as uint8 [rows, row bytes]."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return -(-rows // BLOCK) * -(-(shape[-1] * itemsize if shape else itemsize) // BLOCK)


def piece_bytes(op: str, dtype: torch.dtype, shape: Sequence[int], nbytes: int, delta: Delta) -> float:
    """Expected delta bytes of one entry (or an engine rank's piece of one) of plan op ``op``: its
    e4m3 bytes' changes; for a scale entry its blocks' counts and changed scales; a passthrough
    entry dense (``delta.passthrough`` None) or in ``compare_bytes``' encoding."""
    if dtype == torch.float8_e4m3fn:
        return min(CHANGE_BYTES * delta.fraction, 1.0) * nbytes
    if op == "scale":  # one scale per block (Blackwell packs four UE8M0 scales in an int32)
        n = math.prod(shape) * (4 if dtype == torch.int32 else 1)
        return (COUNT_BYTES + SCALE_PAIR_BYTES * delta.scales_changed) * n
    if delta.passthrough is None:
        return float(nbytes)
    n = _byte_blocks(shape, dtype.itemsize)
    return COUNT_BYTES * n + min(CHANGE_BYTES * delta.passthrough, 1.0) * nbytes


def plan_bytes(plan: LayerPlan, delta: Delta) -> float:
    """Expected delta bytes of a whole layer buffer (its alignment as dense)."""
    extra = sum(piece_bytes(e.op, e.dtype, e.shape, e.nbytes, delta) - e.nbytes for e in plan.entries)
    return plan.nbytes + extra


@dataclass(frozen=True)
class DeltaTraffic:
    """A transfer plan's delta bytes: each sender's NIC bytes (a point-to-point segment once per
    rank of its class, a group broadcast once) and each engine (link) rank's received bytes (its
    segments as sent); ``steps_sent`` and ``steps_received``: the same per step (layer)."""

    sent: tuple[int, ...]
    received: dict[int, int]
    steps_sent: tuple[tuple[int, ...], ...] = ()
    steps_received: tuple[dict[int, int], ...] = ()


def traffic(tp: TransferPlan, plans: Sequence[LayerPlan], delta: Delta) -> DeltaTraffic:
    """``DeltaTraffic`` of ``tp`` (``plans``: the update's layer plans, in ``tp.layers``' order)."""
    steps_sent: list[list[float]] = []
    steps_received: list[dict[int, float]] = []
    ops_cache: dict[tuple, dict] = {}
    for lay, plan in zip(tp.layers, plans):
        key = (id(plan), lay.layer_idx)
        if key not in ops_cache:
            prefix = layer_prefix(lay.layer_idx)
            ops_cache[key] = {prefix + e.name: e.op for e in plan.entries}
        ops = ops_cache[key]
        wire = [0.0] * len(lay.classes)  # a class's segments as sent
        sent = [0.0] * len(tp.senders)
        for s in lay.segments:
            n = s.nbytes + sum(
                piece_bytes(ops[p.name], p.dtype, p.shape, p.nbytes, delta) - p.nbytes for p in s.pieces
            )
            wire[s.cls] += n
            sent[s.sender] += n * lay.messages(s)
        received: dict[int, float] = {}
        for k, ranks in enumerate(lay.classes):
            for r in ranks:
                received[r] = received.get(r, 0.0) + wire[k]
        steps_sent.append(sent)
        steps_received.append(received)
    total: dict[int, float] = {}
    for step in steps_received:
        for r, n in step.items():
            total[r] = total.get(r, 0.0) + n
    # expected bytes, to whole bytes
    return DeltaTraffic(
        tuple(round(sum(step[t] for step in steps_sent)) for t in range(len(tp.senders))),
        {r: round(n) for r, n in total.items()},
        tuple(tuple(round(n) for n in step) for step in steps_sent),
        tuple({r: round(n) for r, n in step.items()} for step in steps_received),
    )


def _segments(lay, rank: int) -> list[SegmentDelta]:
    """The delta pieces of every segment engine (link) rank ``rank`` receives of ``lay``."""
    return [SegmentDelta.of(s) for s in lay.segments if rank in lay.classes[s.cls]]


def _piece_blocks(segs: Iterable[SegmentDelta]) -> int:
    """The most 128x128 blocks of one delta piece (a segment's bytes as uint8 [rows, 128])."""
    return max((p.blocks for d in segs for p in d.pieces), default=0)


def receiver_bytes(tp: TransferPlan, rank: int, ring: int = 2) -> int:
    """Engine rank ``rank``'s receiver in a delta update (``glm_fp8.transfer.delta.receive``): the
    dense receiver (``TransferPlan.receiver_bytes``: a delta layer is rebuilt in a dense ring slot
    and checked there), plus its largest layer's counts messages and payload bounds (one buffer
    each, kept: sized from the plan, never from what changes) and ``apply_delta``'s offsets for
    its largest piece."""
    layers = [_segments(lay, rank) for lay in tp.layers]
    sizes = [LayerSizes.of(segs) for segs in layers]  # what ReceiverDelta allocates from
    messages = max((x.messages for x in sizes), default=0)
    bounds = max((x.bounds for x in sizes), default=0)
    apply = APPLY_SCRATCH_PER_BLOCK * max((_piece_blocks(segs) for segs in layers), default=0)
    return tp.receiver_bytes(rank, ring) + messages + bounds + apply


@dataclass(frozen=True)
class SenderShare:
    """One sender's side of a delta update (``glm_fp8.transfer.delta.send``): ``kept`` (its copy of
    what it last sent: every data byte of its segments, on the GPU or in host memory), ``scratch``
    (``pack_bytes_delta``'s for its largest piece), ``buffers`` (a counts message and payload bound
    per segment of its largest layer, one per conversion ring slot) and ``converted`` (its
    seconds of conversion over the update, at ``per_byte`` s a kernel-format byte and at least
    ``per_layer`` s a layer it converts any of)."""

    kept: int
    scratch: int
    buffers: int
    converted: float


def sender_share(
    tp: TransferPlan,
    sender: int,
    layer_plans: Sequence[LayerPlan],
    delta: Delta,
    per_byte: float,
    per_layer: float,
    ring: int = 2,
) -> SenderShare:
    """``SenderShare`` of sender ``sender`` (its index in ``tp.senders``), which converts
    ``layer_plans`` (its part of each layer), with a conversion ring of ``ring`` slots."""
    segs = [[SegmentDelta.of(s) for s in lay.of_sender(sender)] for lay in tp.layers]
    sizes = [LayerSizes.of(layer) for layer in segs]  # what SenderDelta allocates from
    kept = [x.data for x in sizes]
    scratch = COMPARE_SCRATCH_PER_BLOCK * max((_piece_blocks(layer) for layer in segs), default=0)
    per_slot = max((x.messages + x.bounds for x in sizes), default=0)
    buffers = min(ring, len(segs)) * per_slot
    converted = sum(max(per_byte * p.nbytes, per_layer) for p in layer_plans if p.nbytes)
    return SenderShare(sum(kept), scratch, buffers, converted)


__all__ = [
    "APPLY_SCRATCH_PER_BLOCK",
    "COMPARE_SCRATCH_PER_BLOCK",
    "HOST_COPY_BYTES_PER_S",
    "Delta",
    "DeltaTraffic",
    "SenderShare",
    "as_delta",
    "blocks",
    "entry_bytes",
    "piece_bytes",
    "plan_bytes",
    "receiver_bytes",
    "sender_share",
    "traffic",
]

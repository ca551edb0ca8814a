"""The wire format of a weight update, and the link adapters that carry it.

Wire protocol (version 2), broadcasts from ``src`` and all-reduce (MAX) votes of every rank:

1. Prelude ``int64[4]`` = ``[MAGIC, VERSION, manifest bytes, 0]``; vote. A receiver refuses a
   wrong magic or version, or a length outside ``(0, max_manifest_bytes]``, before it
   allocates anything from that length.
2. The manifest, UTF-8 JSON (data only, no pickle): ``{"format", "version", "mode",
   "checksum", "layers": [{"layer": i, "nbytes": n, "scale_fmt": "fp32" | "ue8m0", "entries":
   [{name, dtype, shape, offset, nbytes}]}]}``, the non-layer tensors (if sent) last as layer
   -1; vote. A receiver refuses a manifest that differs from what it expects, and
   refuses here too when its own parameters failed their checks.
3. Per announced layer: header ``int64[8]`` = ``[MAGIC, DATA, layer index, position, nbytes,
   checksum, 0, 0]``; vote (a receiver refuses a header whose fields disagree with the
   manifest, before it receives a byte of the layer); the layer buffer ``uint8[nbytes]`` as
   ``glm_fp8.convert`` laid it out; vote (a receiver whose checksum of what arrived differs
   refuses). A receiver hands a layer to its consumer only after that last vote passed.
4. A last header COMPLETE (position = number of layers); vote (a consumer that failed on the
   last layer refuses here). Or, at any header, ABORT with a reason code: the sender failed.

Scatter mode sends each class of engine ranks its region by a broadcast in the class's own
group. With many senders (docs/layouts.md#many-senders) every trainer rank takes part in the
prelude, manifest, headers and votes (``src`` leads), and each step (a layer, then COMPLETE) is
queued whole with no host wait: the header, the layer's bytes as point-to-point segments
(``Comm.exchange``) from every sender to the engine ranks, each ending in its checksum word,
then one vote carrying every check of the step, each decided on the device (an engine rank's
header and checksums; a sender's own failure or non-finite weights, ``SENDER_FAILED``, never an
ABORT header). A rank reads that vote only after it queued the next step, so a failed vote
stops every rank one step later; an engine rank hands a layer out only after its vote passed.

A vote is an ``int64[1]`` all-reduce with MAX: every rank contributes 0 or a refusal code
``reason * 2**20 + rank`` (never negative), so no rank's value can hide another's refusal, and
every rank leaves the update at the same step with an error naming the highest refusal. A
receiver whose consumer fails (a parameter copy raises, the loop is left early) refuses at its
next vote. Only a dead or silent peer is left to the process group's timeout.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence

import torch

from glm_fp8.plan import LayerPlan

PROTOCOL_VERSION = 2
MAGIC = int.from_bytes(b"glm_fp8\x02", "little")  # first word of the prelude and of every header
DATA, COMPLETE, ABORT = 1, 2, 3
STATUSES = {DATA: "DATA", COMPLETE: "COMPLETE", ABORT: "ABORT"}
MAX_MANIFEST_BYTES = 64 << 20  # default cap; a GLM-5 manifest is about 0.26 MiB
HEADER_WORDS = 8

# Refusal reasons, in increasing precedence (a vote's MAX reports the highest).
(REFUSED_PRELUDE, REFUSED_MANIFEST, REFUSED_PARAMS, REFUSED_HEADER, BAD_CHECKSUM, CONSUMER_FAILED,
 SENDER_FAILED) = range(1, 8)  # fmt: skip
REFUSAL_REASONS = {
    REFUSED_PRELUDE: "refused the manifest's prelude (magic, version or length)",
    REFUSED_MANIFEST: "refused the manifest",
    REFUSED_PARAMS: "refused its parameters (name, shape, dtype, device or requires_grad) or its layout",
    REFUSED_HEADER: "refused a layer header that disagrees with the manifest",
    BAD_CHECKSUM: "received a layer whose checksum differs from the sender's",
    CONSUMER_FAILED: "failed while landing a layer in its parameters",
    SENDER_FAILED: "(a sender) failed: a layer other than announced, a bad state dict or non-finite weights",
}
# Why the sender aborted (the header's reason word).
ABORT_ERROR, ABORT_ORDER = 1, 2
ABORT_REASONS = {
    ABORT_ERROR: "the sender hit an error",
    ABORT_ORDER: "the sender was handed a layer other than announced",
}
_RANK_BITS = 20


def refusal_code(reason: int, rank: int) -> int:
    return (reason << _RANK_BITS) + (rank & ((1 << _RANK_BITS) - 1))


def refusal_reason(code: int) -> int:
    return code >> _RANK_BITS


def describe_refusal(code: int) -> str:
    reason, rank = code >> _RANK_BITS, code & ((1 << _RANK_BITS) - 1)
    return f"rank {rank} {REFUSAL_REASONS.get(reason, f'refused (unknown reason {reason})')}"


class UpdateAborted(RuntimeError):
    """The weight update did not complete; parameters may hold a mix of old and new layers."""


class ManifestMismatch(ValueError):
    """The sender's manifest differs from what this receiver expects; nothing was touched."""


class ReceiverRefused(RuntimeError):
    """A receiver refused a step of the update (its reason is in the message); every rank stopped."""


class LayerOrderError(ValueError):
    """``broadcast_model`` was handed a layer other than the one the manifest announced next."""


def header_words(status: int, layer_idx: int, pos: int, nbytes: int = 0, reason: int = 0) -> list[int]:
    """A layer header's ``HEADER_WORDS`` words; the checksum word (5) is filled on the device."""
    return [MAGIC, status, layer_idx, pos, nbytes, 0, reason, 0]


def manifest_of(
    plans: Sequence[LayerPlan], layer_ids: Sequence[int], mode: str, checksum: bool = False
) -> dict:
    return {
        "format": "glm_fp8",
        "version": PROTOCOL_VERSION,
        "mode": mode,
        "checksum": checksum,
        "layers": [
            {"layer": i, "nbytes": p.nbytes, "scale_fmt": p.scale_fmt, "entries": p.manifest()}
            for i, p in zip(layer_ids, plans)
        ],
    }


def decode_manifest(raw: torch.Tensor) -> object:
    """JSON from a contiguous CPU uint8 tensor, read in place (no numpy needed)."""
    text = ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestMismatch(f"manifest: not valid UTF-8 JSON ({exc})") from exc


CHECKSUM_ROW_BYTES = 32 << 10


def checksum_scratch(max_nbytes: int, device: torch.device) -> torch.Tensor:
    """int64 [2, rows]: row sums and their weights 1..rows for ``layer_checksum``."""
    rows = -(-max_nbytes // CHECKSUM_ROW_BYTES)
    scratch = torch.empty(2, max(rows, 1), dtype=torch.int64, device=device)
    torch.arange(1, scratch.shape[1] + 1, out=scratch[1])
    return scratch


def layer_checksum(buf: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """An int64 device scalar over a layer buffer (``nbytes % 8 == 0``): the sum over 32 KiB
    rows r of ``(r + 1) * (wrapping int64 sum of the row's words)``. It catches a short or
    stale message, lost or misplaced rows and flipped bits; it reads the buffer once and
    allocates only its result (the row sums live in ``scratch``). Wrapping int64 arithmetic is
    exact in any order, so every device computes the same value."""
    words = buf.view(torch.int64)
    per_row = CHECKSUM_ROW_BYTES // 8
    full, tail = divmod(words.numel(), per_row)
    sums = scratch[0, : full + (tail > 0)]
    if full:
        torch.sum(words[: full * per_row].view(full, per_row), dim=1, out=sums[:full])
    if tail:
        torch.sum(words[full * per_row :], dim=0, keepdim=True, out=sums[full:])
    sums.mul_(scratch[1, : sums.numel()])
    return sums.sum()


class Comm:
    """Adapter over a ``torch.distributed`` ProcessGroup (or the default group: None), or any
    object with ``broadcast(tensor, src)`` and ``all_reduce(tensor, op=...)`` such as vLLM's
    PyNcclCommunicator."""

    def __init__(self, comm: object | None):
        self.comm = comm
        if hasattr(comm, "all_reduce_max"):
            self.all_reduce_max = comm.all_reduce_max  # type: ignore[method-assign]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.comm is None or is_process_group(self.comm):
            import torch.distributed as dist

            dist.broadcast(tensor, src, group=self.comm)
        else:
            self.comm.broadcast(tensor, src)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Every rank's vote, the maximum in place."""
        import torch.distributed as dist

        if self.comm is None or is_process_group(self.comm):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.comm)
        elif hasattr(self.comm, "all_reduce"):
            out = self.comm.all_reduce(tensor, op=dist.ReduceOp.MAX)
            if out is not None and out is not tensor:
                tensor.copy_(out)
        else:
            raise TypeError(f"comm: {type(self.comm).__name__} has no all_reduce for the votes")

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        """Point-to-point messages of one step (many senders), ``(tensor, peer link rank)``
        each, posted together and waited for: every rank posts all of its own, so no order
        between peers can deadlock."""
        if self.comm is None or is_process_group(self.comm):
            import torch.distributed as dist

            glob = (lambda r: r) if self.comm is None else (lambda r: dist.get_global_rank(self.comm, r))
            ops = [dist.P2POp(dist.isend, t, glob(r), self.comm) for t, r in sends]
            ops += [dist.P2POp(dist.irecv, t, glob(r), self.comm) for t, r in recvs]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        elif hasattr(self.comm, "exchange"):
            self.comm.exchange(sends, recvs)
        else:
            raise TypeError(f"comm: {type(self.comm).__name__} has no point-to-point exchange (many senders "
                            "need a torch.distributed ProcessGroup)")  # fmt: skip


def is_process_group(obj: object) -> bool:
    import torch.distributed as dist

    return isinstance(obj, dist.ProcessGroup)


class HostSinkComm:
    """Stand-in communicator for one-GPU benchmarks and tests: a "broadcast" from this rank is
    a device-to-host copy into pinned memory on the current stream, about the speed of one
    inter-node link. ``keep=True`` keeps a copy of every message for checking. ``rank``: the
    link rank this process plays (many senders: which sender's share it sends)."""

    def __init__(self, keep: bool = False, rank: int = 0):
        self.keep = keep
        self.rank = rank
        self.sent: list[torch.Tensor] = []
        self._pinned: dict[int, torch.Tensor] = {}

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.keep:
            dst = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self.sent.append(dst)
        else:
            dst = self._pinned.get(tensor.nbytes)
            if dst is None:
                dst = self._pinned[tensor.nbytes] = torch.empty(
                    tensor.nbytes, dtype=torch.uint8, pin_memory=tensor.is_cuda
                )
            dst = dst.view(tensor.dtype).view(tensor.shape)
        dst.copy_(tensor, non_blocking=True)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        return None  # no receivers to refuse

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        """Many senders' messages: each send is a device-to-host copy, as ``broadcast``."""
        if recvs:
            raise ValueError("HostSinkComm: a sink only sends; it has nothing to receive")
        for t, _ in sends:
            self.broadcast(t, 0)

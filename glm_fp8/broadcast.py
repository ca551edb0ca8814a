"""Pipelined weight broadcast: a sender that converts layer i+1 while layer i is on the wire,
and a receiver that lands layer buffers in the inference engine's parameters.

Wire protocol (version 2), broadcasts from ``src`` and all-reduce (MAX) votes of every rank:

1. Prelude ``int64[4]`` = ``[MAGIC, VERSION, manifest bytes, 0]``; vote. A receiver refuses a
   wrong magic or version, or a length outside ``(0, max_manifest_bytes]``, before it
   allocates anything from that length.
2. The manifest, UTF-8 JSON (data only, no pickle): ``{"format", "version", "mode",
   "checksum", "layers": [{"layer": i, "nbytes": n, "entries": [{name, dtype, shape, offset,
   nbytes}]}]}``; vote. A receiver refuses a manifest that differs from what it expects, and
   refuses here too when its own parameters failed their checks.
3. Per announced layer: header ``int64[8]`` = ``[MAGIC, DATA, layer index, position, nbytes,
   checksum, 0, 0]``; vote (a receiver refuses a header whose fields disagree with the
   manifest, before it receives a byte of the layer); the layer buffer ``uint8[nbytes]`` as
   ``glm_fp8.convert`` laid it out; vote (a receiver whose checksum of what arrived differs
   refuses). A receiver hands a layer to its consumer only after that last vote passed.
4. A last header COMPLETE (position = number of layers); vote (a consumer that failed on the
   last layer refuses here). Or, at any header, ABORT with a reason code: the sender failed.

A vote is an ``int64[1]`` all-reduce with MAX: every rank contributes 0 or a refusal code
``reason * 2**20 + rank`` (never negative), so no rank's value can hide another's refusal, and
every rank leaves the update at the same step with an error naming the first reason. A
receiver whose consumer fails (a parameter copy raises, the loop is left early) refuses at its
next vote. Only a dead or silent peer is left to the process group's timeout.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.convert import _check_layer, convert_layer, fill_layer, layer_prefix, strip_layer
from glm_fp8.gather import full_value
from glm_fp8.plan import LayerPlan, plan_from_config
from glm_fp8.quantize import NonFiniteError, quantize_blockwise
from glm_fp8.reference import ceil_blocks

PROTOCOL_VERSION = 2
MAGIC = int.from_bytes(b"glm_fp8\x02", "little")  # first word of the prelude and of every header
DATA, COMPLETE, ABORT = 1, 2, 3
STATUSES = {DATA: "DATA", COMPLETE: "COMPLETE", ABORT: "ABORT"}
MAX_MANIFEST_BYTES = 64 << 20  # default cap; a GLM-5 manifest is about 0.2 MiB
HEADER_WORDS = 8

# Refusal reasons, in increasing precedence (a vote's MAX reports the highest).
REFUSED_PRELUDE, REFUSED_MANIFEST, REFUSED_PARAMS, REFUSED_HEADER, BAD_CHECKSUM, CONSUMER_FAILED = range(1, 7)
_REASONS = {
    REFUSED_PRELUDE: "refused the manifest's prelude (magic, version or length)",
    REFUSED_MANIFEST: "refused the manifest",
    REFUSED_PARAMS: "refused its parameters (name, shape, dtype, device or requires_grad)",
    REFUSED_HEADER: "refused a layer header that disagrees with the manifest",
    BAD_CHECKSUM: "received a layer whose checksum differs from the sender's",
    CONSUMER_FAILED: "failed while landing a layer in its parameters",
}
# Why the sender aborted (the header's reason word).
ABORT_ERROR, ABORT_ORDER = 1, 2
_ABORTS = {
    ABORT_ERROR: "the sender hit an error",
    ABORT_ORDER: "the sender was handed a layer other than announced",
}
_RANK_BITS = 20


def refusal_code(reason: int, rank: int) -> int:
    return (reason << _RANK_BITS) + (rank & ((1 << _RANK_BITS) - 1))


def describe_refusal(code: int) -> str:
    reason, rank = code >> _RANK_BITS, code & ((1 << _RANK_BITS) - 1)
    return f"rank {rank} {_REASONS.get(reason, f'refused (unknown reason {reason})')}"


class HostSinkComm:
    """Stand-in communicator for one-GPU benchmarks and tests: a "broadcast" from this rank is
    a device-to-host copy into pinned memory on the current stream, about the speed of one
    inter-node link. ``keep=True`` keeps a copy of every message for checking."""

    def __init__(self, keep: bool = False):
        self.keep = keep
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


class UpdateAborted(RuntimeError):
    """The weight update did not complete; parameters may hold a mix of old and new layers."""


class ManifestMismatch(ValueError):
    """The sender's manifest differs from what this receiver expects; nothing was touched."""


class ReceiverRefused(RuntimeError):
    """A receiver refused a step of the update (its reason is in the message); every rank stopped."""


class Comm:
    """Adapter over a ``torch.distributed`` ProcessGroup (or the default group: None), or any
    object with ``broadcast(tensor, src)`` and ``all_reduce(tensor, op=...)`` such as vLLM's
    PyNcclCommunicator."""

    def __init__(self, comm: object | None):
        self.comm = comm
        if hasattr(comm, "all_reduce_max"):
            self.all_reduce_max = comm.all_reduce_max  # type: ignore[method-assign]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.comm is None or _is_process_group(self.comm):
            import torch.distributed as dist

            dist.broadcast(tensor, src, group=self.comm)
        else:
            self.comm.broadcast(tensor, src)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Every rank's vote, the maximum in place."""
        import torch.distributed as dist

        if self.comm is None or _is_process_group(self.comm):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.comm)
        elif hasattr(self.comm, "all_reduce"):
            out = self.comm.all_reduce(tensor, op=dist.ReduceOp.MAX)
            if out is not None and out is not tensor:
                tensor.copy_(out)
        else:
            raise TypeError(f"comm: {type(self.comm).__name__} has no all_reduce for the votes")


def _is_process_group(obj: object) -> bool:
    import torch.distributed as dist

    return isinstance(obj, dist.ProcessGroup)


def _my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def plans_for(config: Mapping, mode: str = "fp8", target: str = "hopper") -> list[LayerPlan]:
    """One plan per decoder layer of a model config (dense and sparse layers differ)."""
    cache: dict[bool, LayerPlan] = {}
    dense_until = config.get("first_k_dense_replace", 0)
    out = []
    for i in range(config["num_hidden_layers"]):
        sparse = i >= dense_until
        if sparse not in cache:
            cache[sparse] = plan_from_config(config, i, target=target, quantize=mode == "fp8")
        out.append(cache[sparse])
    return out


def manifest_of(
    plans: Sequence[LayerPlan], layer_ids: Sequence[int], mode: str, checksum: bool = False
) -> dict:
    return {
        "format": "glm_fp8",
        "version": PROTOCOL_VERSION,
        "mode": mode,
        "checksum": checksum,
        "layers": [
            {"layer": i, "nbytes": p.nbytes, "entries": p.manifest()} for i, p in zip(layer_ids, plans)
        ],
    }


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


@dataclass
class LayerStats:
    layer: int
    nbytes: int
    seconds: float


@dataclass
class UpdateStats:
    layers: list[LayerStats] = field(default_factory=list)
    seconds: float = 0.0
    peak_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


class _Ring:
    """Preallocated layer buffers; a slot is reused only once its last broadcast finished."""

    def __init__(self, size: int, nbytes: int, device: torch.device):
        if size < 1:
            raise ValueError(f"ring: expected at least 1 slot, got {size}")
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(size)]
        cuda = device.type == "cuda"
        self.free = [torch.cuda.Event() if cuda else None for _ in range(size)]
        self.used = [False] * size
        self.scratch = checksum_scratch(nbytes, device)

    def slot(self, k: int, nbytes: int) -> tuple[torch.Tensor, object]:
        i = k % len(self.slots)
        return self.slots[i][:nbytes], i


def _setup_endpoint(obj, comm, src, config, plans, layer_ids, ring, mode, device) -> None:
    """What sender and receiver share: the link, the per-layer plans, the device and the ring."""
    if mode not in ("fp8", "bf16"):
        raise ValueError(f"mode: expected 'fp8' or 'bf16', got {mode!r}")
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    obj.comm, obj.src, obj.mode = Comm(comm), src, mode
    all_plans = list(plans) if plans is not None else plans_for(config, mode)
    if layer_ids is None:
        obj.layer_ids = list(range(len(all_plans)))
    else:
        obj.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in obj.layer_ids if not 0 <= i < len(all_plans)]
        if bad:
            last = len(all_plans) - 1
            raise ValueError(f"layer_ids: layer {bad[0]} is not a layer of the model (0..{last})")
        if len(set(obj.layer_ids)) != len(obj.layer_ids):
            raise ValueError(f"layer_ids: expected distinct layers, got {obj.layer_ids}")
    if not obj.layer_ids:
        raise ValueError("layer_ids: expected at least one layer")
    obj.plans = [all_plans[i] for i in obj.layer_ids]
    obj.device = torch.device(device) if device else _default_device()
    obj.ring = _Ring(ring, max(p.nbytes for p in obj.plans), obj.device)
    obj.vote_buf = torch.zeros(1, dtype=torch.int64, device=obj.device)


def _vote(obj, code: int) -> int:
    """Contribute ``code`` (0: fine) to an all-reduce MAX on the link; every rank's maximum."""
    obj.vote_buf.fill_(max(0, code))
    obj.comm.all_reduce_max(obj.vote_buf)
    return int(obj.vote_buf.item())


class LayerOrderError(ValueError):
    """``broadcast_model`` was handed a layer other than the one the manifest announced next."""


class Broadcaster:
    """Sender: converts layers into a ring of buffers and broadcasts them, pipelined.

    Args:
        comm: ProcessGroup, None (default group) or an object with ``broadcast(tensor, src)``
            and ``all_reduce(tensor, op=...)`` (vLLM's PyNcclCommunicator).
        src: rank that sends (this process).
        config / plans: the model config (plans for every layer are built from it) or one
            ``LayerPlan`` per layer; the manifest needs them before the first layer is sent.
        layer_ids: the layers this update sends, in order (default: every decoder layer);
            receivers must expect the same list. ``broadcast_model`` must be handed exactly
            these layers in this order.
        ring: layer buffers (default 2: convert i+1 while i is sent; 1 serializes).
        mode: "fp8" ships kernel-format fp8 entries; "bf16" ships unquantized kernel-format
            entries for receivers that quantize on receive (half the sender's work, twice the
            bytes).
        gather: how DTensor inputs are collected: "auto", "full", "chunked" or
            "quantize_then_gather" (see ``collect_layer``). The other trainer ranks run
            ``contribute_shards`` with the same arguments.
        chunk_experts: experts per chunk for "chunked".
        gather_dtype: DTensor inputs are cast to this dtype before they travel (None: keep
            theirs).
        checksum: send a checksum of every layer (``layer_checksum``, one read of the layer
            buffer on each side) that receivers verify before they hand the layer out.
        device: where conversion runs (default: the current CUDA device, else CPU).
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        *,
        config: Mapping | None = None,
        plans: Sequence[LayerPlan] | None = None,
        layer_ids: Sequence[int] | None = None,
        ring: int = 2,
        mode: str = "fp8",
        gather: str = "auto",
        chunk_experts: int = 8,
        gather_dtype: torch.dtype | None = torch.bfloat16,
        checksum: bool = True,
        device: torch.device | str | None = None,
    ):
        _setup_endpoint(self, comm, src, config, plans, layer_ids, ring, mode, device)
        if gather not in GATHERS:
            raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
        if chunk_experts < 1:
            raise ValueError(f"chunk_experts: expected at least 1, got {chunk_experts}")
        self.checksum = bool(checksum)
        self.collect_args = dict(mode=mode, gather=gather, chunk_experts=chunk_experts, sender=_my_rank(),
                                 gather_dtype=gather_dtype, device=self.device)  # fmt: skip
        cuda = self.device.type == "cuda"
        self.convert_stream = torch.cuda.Stream(self.device) if cuda else None
        self.comm_stream = torch.cuda.Stream(self.device) if cuda else None
        self.post_vote = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pending = False  # the receivers' vote on the last layer sent, not read yet

    def broadcast_model(self, layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]]) -> UpdateStats:
        """Send every layer of ``layers`` (``(layer_idx, state_dict)`` in the announced order).

        Raises (and every receiver raises ``UpdateAborted`` at the same step) on any error: a
        layer other than announced (``LayerOrderError``, before any byte of it is sent),
        non-finite weights, a bad state dict, or a receiver's refusal (``ManifestMismatch``
        before the first layer, ``ReceiverRefused`` after it).
        """
        stats = UpdateStats()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self._pending = False
        self._send_manifest()
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        try:
            count = 0
            for pos, (layer_idx, sd) in enumerate(layers):
                if pos >= len(self.plans):
                    raise LayerOrderError(
                        f"layers: got layer {layer_idx} after the {len(self.plans)} the manifest announced"
                    )
                if layer_idx != self.layer_ids[pos]:
                    raise LayerOrderError(
                        f"layers: got layer {layer_idx} at position {pos}; the manifest announced layer "
                        f"{self.layer_ids[pos]} there (announced order: {self.layer_ids})"
                    )
                t_layer = time.perf_counter()
                self._send_layer(pos, layer_idx, sd, header)
                stats.layers.append(
                    LayerStats(layer_idx, self.plans[pos].nbytes, time.perf_counter() - t_layer)
                )
                count += 1
            if count != len(self.plans):
                raise LayerOrderError(f"layers: got {count}, the manifest announced {len(self.plans)}")
        except ReceiverRefused:
            raise  # every rank stopped at that vote: nothing more to send
        except BaseException as exc:
            self._abort(header, ABORT_ORDER if isinstance(exc, LayerOrderError) else ABORT_ERROR, exc)
            raise
        self._resolve_pending()
        self._send_header(header, COMPLETE, -1, len(self.plans), 0)
        code = self._vote(0)
        if code:
            raise ReceiverRefused(f"{describe_refusal(code)}; the update did not complete")
        self._sync()
        stats.seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return stats

    def _send_manifest(self) -> None:
        manifest = manifest_of(self.plans, self.layer_ids, self.mode, self.checksum)
        payload = json.dumps(manifest).encode()
        prelude = torch.tensor([MAGIC, PROTOCOL_VERSION, len(payload), 0], dtype=torch.int64)
        self.comm.broadcast(prelude.to(self.device), self.src)
        code = self._vote(0)
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.comm.broadcast(data, self.src)
        code = self._vote(0)
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")

    def _vote(self, code: int) -> int:
        with _on(self.comm_stream):
            return _vote(self, code)

    def _resolve_pending(self) -> None:
        """Read the receivers' verdict on the last layer sent (queued behind its data)."""
        if self._pending:
            self._pending = False
            code = int(self.post_vote.item())
            if code:
                raise ReceiverRefused(f"{describe_refusal(code)}; the update was stopped")

    def _abort(self, header: torch.Tensor, reason: int, exc: BaseException) -> None:
        try:
            self._resolve_pending()
        except ReceiverRefused as refused:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(and before that: {refused})")
            return  # the receivers already left at that vote: an ABORT header would find no one
        self._send_header(header, ABORT, -1, -1, reason)

    def _send_header(self, header: torch.Tensor, status: int, layer_idx: int, pos: int, word: int,
                     nbytes: int = 0, checksum: torch.Tensor | None = None) -> None:  # fmt: skip
        """``word``: the abort reason (ABORT headers)."""
        with _on(self.comm_stream):
            header.copy_(torch.tensor([MAGIC, status, layer_idx, pos, nbytes, 0, word, 0], dtype=torch.int64))
            if checksum is not None:
                header[5].copy_(checksum)
            self.comm.broadcast(header, self.src)

    def _send_layer(self, pos: int, layer_idx: int, sd: Mapping[str, torch.Tensor], header) -> None:
        plan = self.plans[pos]
        buf, slot = self.ring.slot(pos, plan.nbytes)
        caller = torch.cuda.current_stream(self.device) if self.convert_stream is not None else None
        checksum = None
        with _on(self.convert_stream):
            if caller is not None:
                # The layer may have just been written on the caller's stream.
                self.convert_stream.wait_stream(caller)
            if self.ring.used[slot] and self.ring.free[slot] is not None:
                # The slot's previous broadcast must finish before we overwrite it.
                self.convert_stream.wait_event(self.ring.free[slot])
            # The finite check is this loop's only host wait per layer; the previous layer keeps
            # the wire busy meanwhile.
            collect_layer(plan, strip_layer(sd, layer_idx), layer_idx, buf, **self.collect_args)
            if self.checksum:
                checksum = layer_checksum(buf, self.ring.scratch)
            ready = None
            if self.convert_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.convert_stream)
        if caller is not None:
            # The caller may free or overwrite its tensors once we move on: order that after
            # the kernels that read them (the wire, on its own stream, is not waited for).
            caller.wait_event(ready)
        self._resolve_pending()
        if ready is not None:
            self.comm_stream.wait_event(ready)
        self._send_header(header, DATA, layer_idx, pos, 0, plan.nbytes, checksum)
        # Every receiver checked the header against the manifest. This host read waits for the
        # previous layer's data to leave, which the ring waits for anyway.
        code = self._vote(0)
        if code:
            raise ReceiverRefused(f"{describe_refusal(code)} (layer {layer_idx}); the update was stopped")
        with _on(self.comm_stream):
            self.comm.broadcast(buf, self.src)
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(self.comm_stream)
            # The receivers' verdict on what arrived; read before the next header goes out.
            self.post_vote.zero_()
            self.comm.all_reduce_max(self.post_vote)
        self._pending = True
        self.ring.used[slot] = True

    def _sync(self) -> None:
        if self.comm_stream is not None:
            self.comm_stream.synchronize()


GATHERS = ("auto", "full", "chunked", "quantize_then_gather")


def contribute_shards(
    layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    *,
    config: Mapping | None = None,
    plans: Sequence[LayerPlan] | None = None,
    sender: int = 0,
    gather: str = "auto",
    chunk_experts: int = 8,
    gather_dtype: torch.dtype | None = torch.bfloat16,
    device: torch.device | str | None = None,
) -> None:
    """What every trainer rank except the sender runs, with the same arguments as the sender's
    ``Broadcaster``: its part of each layer's DTensor gathers (collective over the mesh)."""
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    plans = list(plans) if plans is not None else plans_for(config)
    dev = torch.device(device) if device else _default_device()
    for pos, (layer_idx, sd) in enumerate(layers):
        collect_layer(
            plans[pos], strip_layer(sd, layer_idx), layer_idx, None, mode="fp8", gather=gather,
            chunk_experts=chunk_experts, gather_dtype=gather_dtype, sender=sender, device=dev,
        )  # fmt: skip


def collect_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    layer_idx: int,
    buf: torch.Tensor | None,
    *,
    mode: str,
    gather: str,
    chunk_experts: int,
    gather_dtype: torch.dtype | None,
    sender: int,
    device: torch.device,
) -> None:
    """Gather (if sharded) and convert one layer into ``buf`` on the sender (``buf`` given);
    on the other trainer ranks only take part in the gathers. Every trainer rank calls it with
    the same layer, so the collectives match.

    gather: "full" (``full_tensor()`` per tensor, as prime-rl), "chunked" (expert stacks
    ``chunk_experts`` at a time into a reusable buffer: the whole gathered stack never exists),
    "quantize_then_gather" (each rank quantizes the experts it holds; only fp8 bytes and scales
    travel), or "auto" (the last that the sharding allows). Plain tensors are used as they are.
    """
    from glm_fp8.gather import gather_rows, move, shard_layout

    sending = buf is not None
    prefix = layer_prefix(layer_idx)
    strategy = _choose_gather(plan, layer, gather, mode, prefix)
    if strategy == "full":
        gathered = {k: full_value(t, gather_dtype) for k, t in layer.items()}
        if sending:
            gathered = {k: t.to(device) for k, t in gathered.items()}
            # The finite check covers every entry, passthrough ones included: one host read.
            convert_layer(gathered, layer_idx, out=buf, plan=plan, check_finite=True)
        return
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    stacked = {s for e in stacks for s in e.sources}
    rest = {k: full_value(t, gather_dtype) for k, t in layer.items() if k not in stacked}
    views: dict[str, torch.Tensor] = {}
    if sending:
        rest = {k: t.to(device) for k, t in rest.items()}
        _check_layer(plan, {**rest, **{k: layer[k] for k in stacked}}, prefix)
        names = {e.name for e in plan.entries if e.op != "scale" and e not in stacks}
        views = fill_layer(rest, plan, buf, "", check_finite=False, only=names)
    me = torch.distributed.get_rank()
    for e in stacks:
        srcs = [layer[s] for s in e.sources]
        q, sc = (views[e.name], views[e.name + "_scale_inv"]) if sending else (None, None)
        if strategy == "chunked":
            n = e.shape[0]
            size = min(chunk_experts, n)
            chunks = [
                torch.empty((size, *t.shape[1:]), dtype=gather_dtype or t.dtype, device=device)
                if sending
                else None
                for t in srcs
            ]
            for a in range(0, n, chunk_experts):
                b = min(n, a + chunk_experts)
                got = [gather_rows(t, a, b, sender, c[: b - a] if sending else None, gather_dtype)
                       for t, c in zip(srcs, chunks)]  # fmt: skip
                if sending:
                    quantize_blockwise(got, out=q[a:b], scale_out=sc[a:b], check_finite=False)
            continue
        layout = shard_layout(srcs[0])
        lo, hi = layout.owned(me)
        local = [t.to_local() if gather_dtype is None else t.to_local().to(gather_dtype) for t in srcs]
        q_own = s_own = None
        if hi > lo:
            if sending:
                quantize_blockwise(local, out=q[lo:hi], scale_out=sc[lo:hi], check_finite=False)
            else:
                q_own, s_own = quantize_blockwise(local, check_finite=False)
        for owner, (olo, ohi) in zip(layout.ranks, layout.bounds):
            if ohi > olo and owner != sender:  # the sender quantized its own in place
                mine = me == owner
                q_to = q[olo:ohi].view(torch.uint8) if sending else None
                move(q_own.view(torch.uint8) if mine else None, q_to, owner, sender, layout.group)
                move(s_own if mine else None, sc[olo:ohi] if sending else None, owner, sender, layout.group)
    if sending:
        _check_finite_entries(plan, buf, layer_idx, ("scale", "copy", "concat"))


def _choose_gather(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], gather: str, mode: str, prefix: str
) -> str:
    from torch.distributed.tensor import DTensor

    from glm_fp8.gather import shard_layout

    if gather not in GATHERS:
        raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
    sharded = any(isinstance(t, DTensor) for t in layer.values())
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    if gather == "full" or not sharded or not stacks:
        return "full"
    why = None
    if mode != "fp8" or plan.target != "hopper":
        why = f"mode {mode!r} / target {plan.target!r} (piecewise gathers need fp8 for Hopper)"
    layouts = {s: shard_layout(layer[s]) for e in stacks for s in e.sources}
    bad = [s for s, lay in layouts.items() if lay is None]
    if why is None and bad:
        why = f"{prefix}{bad[0]} is not a DTensor on a 1-D mesh with one Shard/Replicate placement"
    if why is not None:
        if gather == "auto":
            return "full"
        raise ValueError(f"gather={gather!r}: {why}")
    whole = [lay for lay in layouts.values()]
    can_qtg = all(lay.dim == 0 and lay.bounds == whole[0].bounds and lay.ranks == whole[0].ranks
                  for lay in whole)  # fmt: skip
    if gather == "quantize_then_gather" and not can_qtg:
        raise ValueError(
            "gather='quantize_then_gather': the expert stacks must be sharded on the expert dim "
            "(Shard(0)) alike, so that every rank holds whole experts"
        )
    if gather == "auto":
        return "quantize_then_gather" if can_qtg else "chunked"
    return gather


def _check_finite_entries(plan: LayerPlan, buf: torch.Tensor, layer_idx: int, ops: tuple[str, ...]) -> None:
    """Raise if an entry whose op is in ``ops`` holds NaN/Inf: max |x| of every such entry in one
    multi-tensor reduction, one host read; no temporary beyond a float per entry."""
    floating = [(e.name, e.view(buf)) for e in plan.entries if e.op in ops and e.dtype.is_floating_point]
    norms = torch._foreach_norm([v for _, v in floating], float("inf")) if floating else []
    if norms and not bool(torch.isfinite(torch.stack(norms)).all()):
        bad = next(n for (n, _), m in zip(floating, norms) if not torch.isfinite(m))
        bad = bad.removesuffix("_scale_inv")
        raise NonFiniteError(
            f"{layer_prefix(layer_idx)}{bad}: NaN or Inf in its sources; the update was aborted",
            source=layer_prefix(layer_idx) + bad, expert=None, block=(-1, -1),
        )  # fmt: skip


class Receiver:
    """Inference side: receives layer buffers into its own ring and hands out named views.

    Args:
        comm, src: as for ``Broadcaster``.
        config / plans, layer_ids: what this engine expects; a manifest that differs is refused
            before any parameter is touched.
        ring: receive buffers (2: receive layer i+1 while layer i is copied out).
        mode: must match the sender's. "bf16" quantizes on receive (``load_into``).
        max_manifest_bytes: the longest manifest accepted (default 64 MiB); a longer announced
            length is refused before anything is allocated from it.
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        *,
        config: Mapping | None = None,
        plans: Sequence[LayerPlan] | None = None,
        layer_ids: Sequence[int] | None = None,
        ring: int = 2,
        mode: str = "fp8",
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        device: torch.device | str | None = None,
    ):
        _setup_endpoint(self, comm, src, config, plans, layer_ids, ring, mode, device)
        if max_manifest_bytes < 1:
            raise ValueError(f"max_manifest_bytes: expected at least 1, got {max_manifest_bytes}")
        self.max_manifest_bytes = int(max_manifest_bytes)
        self.recv_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.expected = manifest_of(self.plans, self.layer_ids, mode)
        self.rank = _my_rank()
        self._params_error: Exception | None = None

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, view)`` for every entry of every layer. A view stays valid until the
        layer after the next one is received (ring of 2). Raises ``UpdateAborted`` when the
        sender aborts, any rank refuses or the link fails, ``ManifestMismatch`` before anything
        is yielded."""
        for _, views in self.receive_layers():
            yield from views

    def receive_layers(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """Yield ``(layer_idx, [(name, view), ...])`` per layer, each only after every rank
        voted that it arrived intact. If the consumer raises while handling a layer (or stops
        iterating early), this receiver refuses at the next vote, so every rank stops there."""
        checksum = self._recv_manifest()
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        for pos, plan in enumerate(self.plans):
            layer_idx = self.layer_ids[pos]
            self._recv_header(header, pos, DATA, layer_idx, plan.nbytes)
            buf, slot = self.ring.slot(pos, plan.nbytes)
            code = 0
            try:
                with _on(self.recv_stream):
                    if self.ring.used[slot] and self.ring.free[slot] is not None:
                        # Wait until what the consumer queued on this slot's last layer is done.
                        self.recv_stream.wait_event(self.ring.free[slot])
                    self.comm.broadcast(buf, self.src)
                    if checksum:
                        got = layer_checksum(buf, self.ring.scratch)
                        bad = int((got != header[5]).item())
                        code = refusal_code(BAD_CHECKSUM, self.rank) if bad else 0
                if self.recv_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.recv_stream)
            except Exception as exc:
                raise UpdateAborted(f"receiving layer {layer_idx} failed: {exc}") from exc
            verdict = self._vote(code)
            if code:
                raise UpdateAborted(
                    f"layer {layer_idx}: the checksum of the {plan.nbytes} bytes received differs from "
                    "the sender's (a short, long or corrupted message); every rank was stopped"
                )
            if verdict:
                raise UpdateAborted(
                    f"{describe_refusal(verdict)} (layer {layer_idx}); the update was stopped"
                )
            prefix = layer_prefix(layer_idx)
            try:
                yield layer_idx, [(prefix + name, view) for name, view in plan.views(buf)]
            except BaseException:
                # The consumer failed on this layer (or stopped early): stop every rank at the
                # next vote, then let the consumer's error through.
                self._refuse_next_step(header, pos + 1)
                raise
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(torch.cuda.current_stream(self.device))
            self.ring.used[slot] = True
        self._recv_header(header, len(self.plans), COMPLETE, -1, 0)

    def load_into(self, params: Mapping[str, torch.Tensor]) -> UpdateStats:
        """Copy (fp8 mode) or quantize (bf16 mode) every received entry into ``params``.

        Every name, shape, dtype, device and ``requires_grad`` is checked against ``params``
        before the first byte is received; a failed check is voted on with the manifest, so
        every rank stops there. Raises ``UpdateAborted`` if the update did not complete
        (``params`` then hold a mix of layers and must not be served as the new weights).
        """
        self._params_error = self._check_params(params)
        stats = UpdateStats()
        t0 = time.perf_counter()
        layers = self.receive_layers()
        try:
            for layer_idx, views in layers:
                t = time.perf_counter()
                try:
                    for name, view in views:
                        if self.mode == "bf16" and name + "_scale_inv" in params:
                            quantize_blockwise(view, out=params[name], scale_out=params[name + "_scale_inv"],
                                               check_finite=False)  # fmt: skip
                        else:
                            params[name].copy_(view, non_blocking=True)
                except BaseException as exc:
                    layers.throw(exc)  # refuses at the next vote, then re-raises exc
                pos = self.layer_ids.index(layer_idx)
                stats.layers.append(LayerStats(layer_idx, self.plans[pos].nbytes, time.perf_counter() - t))
        finally:
            self._params_error = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _check_params(self, params: Mapping[str, torch.Tensor]) -> Exception | None:
        """The first problem with ``params`` as an exception (not raised), or None."""
        try:
            for layer_idx, plan in zip(self.layer_ids, self.plans):
                prefix = layer_prefix(layer_idx)
                for e in plan.entries:
                    name = prefix + e.name
                    if name not in params:
                        raise KeyError(f"params: missing {name!r} ({e.dtype}, {tuple(e.shape)})")
                    p = params[name]
                    want_dtype = e.dtype if self.mode == "fp8" else _quantized_dtype(e, params, name)
                    _check_param(name, p, want_dtype, tuple(e.shape), self.device)
                    if want_dtype == torch.float8_e4m3fn and self.mode == "bf16":
                        nb = tuple(e.shape[:-2]) + (ceil_blocks(e.shape[-2]), ceil_blocks(e.shape[-1]))
                        _check_param(name + "_scale_inv", params[name + "_scale_inv"], torch.float32, nb,
                                     self.device)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported at the manifest vote, then raised
            return exc
        return None

    def _vote(self, code: int) -> int:
        try:
            with _on(self.recv_stream):
                return _vote(self, code)
        except Exception as exc:
            raise UpdateAborted(f"the link failed during a vote: {exc}") from exc

    def _recv_manifest(self) -> bool:
        """The prelude and the manifest, each followed by a vote; returns whether layers carry
        checksums. Nothing is allocated from a length before it was checked."""
        prelude = torch.empty(4, dtype=torch.int64, device=self.device)
        try:
            self.comm.broadcast(prelude, self.src)
            magic, version, n, _ = prelude.tolist()
        except Exception as exc:
            raise UpdateAborted(f"receiving the manifest failed: {exc}") from exc
        refused = None
        if magic != MAGIC or version != PROTOCOL_VERSION:
            refused = ManifestMismatch(
                f"manifest prelude: expected magic {MAGIC:#x} and version {PROTOCOL_VERSION}, got {magic:#x} "
                f"and {version} (a sender of another glm_fp8 version, or not glm_fp8)"
            )
        elif not 0 < n <= self.max_manifest_bytes:
            refused = ManifestMismatch(
                f"manifest length: expected 1 to {self.max_manifest_bytes} bytes (max_manifest_bytes), "
                f"got {n}"
            )
        verdict = self._vote(refusal_code(REFUSED_PRELUDE, self.rank) if refused else 0)
        if refused is not None:
            raise refused
        if verdict:
            raise UpdateAborted(f"{describe_refusal(verdict)}; nothing was sent")
        data = torch.empty(n, dtype=torch.uint8, device=self.device)
        try:
            self.comm.broadcast(data, self.src)
            raw = data.cpu()
        except Exception as exc:
            raise UpdateAborted(f"receiving the manifest failed: {exc}") from exc
        manifest = None
        try:
            manifest = _decode_manifest(raw)
            self._check_manifest(manifest)
            refused = self._params_error
            code = refusal_code(REFUSED_PARAMS, self.rank) if refused else 0
        except ManifestMismatch as exc:
            refused, code = exc, refusal_code(REFUSED_MANIFEST, self.rank)
        verdict = self._vote(code)
        if refused is not None:
            raise refused
        if verdict:
            raise UpdateAborted(f"{describe_refusal(verdict)}; nothing was sent")
        return bool(manifest["checksum"])

    def _check_manifest(self, got: object) -> None:
        want = self.expected
        if not isinstance(got, dict):
            raise ManifestMismatch(f"manifest: expected a JSON object, got {type(got).__name__}")
        for key in ("format", "version", "mode"):
            if got.get(key) != want[key]:
                raise ManifestMismatch(f"manifest: expected {key}={want[key]!r}, got {got.get(key)!r}")
        if not isinstance(got.get("checksum"), bool):
            raise ManifestMismatch(f"manifest: expected checksum true or false, got {got.get('checksum')!r}")
        layers = got.get("layers")
        if not isinstance(layers, list) or len(layers) != len(want["layers"]):
            n = len(layers) if isinstance(layers, list) else layers
            raise ManifestMismatch(f"manifest: expected {len(want['layers'])} layers, got {n}")
        for g, w in zip(layers, want["layers"]):
            if g != w:
                if isinstance(g, dict) and g.get("layer") != w["layer"]:
                    raise ManifestMismatch(
                        f"manifest: expected layers {self.layer_ids} in this order, got layer "
                        f"{g.get('layer')!r} where {w['layer']} was expected"
                    )
                ge = {e.get("name"): e for e in g.get("entries", [])} if isinstance(g, dict) else {}
                for e in w["entries"]:
                    if ge.get(e["name"]) != e:
                        raise ManifestMismatch(
                            f"manifest: layer {w['layer']} entry {e['name']}: expected {e}, "
                            f"got {ge.get(e['name'])}"
                        )
                raise ManifestMismatch(f"manifest: layer {w['layer']}: expected {w}, got {g}")

    def _recv_header(self, header: torch.Tensor, pos: int, status: int, layer_idx: int, nbytes: int) -> None:
        """Receive the header at ``pos`` and vote on it: it must say ``status`` for this layer
        and byte count (from the manifest). An ABORT ends the update without a vote."""
        try:
            with _on(self.recv_stream):  # read it on the stream that received it
                self.comm.broadcast(header, self.src)
                got = header.tolist()
        except Exception as exc:
            raise UpdateAborted(f"the link to the sender failed: {exc}") from exc
        where = f"before layer {layer_idx}" if status == DATA else "after the last layer"
        if got[0] == MAGIC and got[1] == ABORT:
            why = _ABORTS.get(got[6], f"reason {got[6]}")
            raise UpdateAborted(f"the sender aborted the update {where}: {why}")
        want = [MAGIC, status, layer_idx, pos, nbytes]
        problem = None
        if got[:5] != want:
            names = ("magic", "status", "layer", "position", "nbytes")
            k = next(i for i in range(5) if got[i] != want[i])
            show = (lambda v: STATUSES.get(v, v)) if k == 1 else (lambda v: v)
            problem = UpdateAborted(
                f"layer header {where}: expected {names[k]} {show(want[k])} (the manifest's), got "
                f"{show(got[k])}; refused before receiving anything of it, every rank was stopped"
            )
        verdict = self._vote(refusal_code(REFUSED_HEADER, self.rank) if problem else 0)
        if problem is not None:
            raise problem
        if verdict:
            raise UpdateAborted(f"{describe_refusal(verdict)} ({where}); the update was stopped")

    def _refuse_next_step(self, header: torch.Tensor, pos: int) -> None:
        """After a local failure: take part in the next header and refuse at its vote, so every
        rank stops there instead of waiting for a timeout."""
        try:
            with _on(self.recv_stream):
                self.comm.broadcast(header, self.src)
                status = int(header[1].item())
            if status != ABORT:
                self._vote(refusal_code(CONSUMER_FAILED, self.rank))
        except Exception:  # noqa: BLE001 - the link is gone too; the local error is what matters
            pass


def _decode_manifest(raw: torch.Tensor) -> object:
    """JSON from a contiguous CPU uint8 tensor, read in place (no numpy needed)."""
    text = ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestMismatch(f"manifest: not valid UTF-8 JSON ({exc})") from exc


def _check_param(
    name: str, p: object, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params[{name!r}]: expected a torch.Tensor, got {type(p).__name__}")
    if tuple(p.shape) != shape or p.dtype != dtype:
        raise ValueError(f"params[{name!r}]: expected {dtype} {shape}, got {p.dtype} {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"params[{name!r}]: expected device {device} (the receiver's), got {p.device}")
    if p.requires_grad:
        raise ValueError(
            f"params[{name!r}]: requires grad; an in-place update needs plain tensors (pass "
            "p.detach() or the module's parameters under torch.no_grad() as .data)"
        )


def _quantized_dtype(e, params: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """bf16 mode: a quantizable entry lands in an fp8 parameter that has a scale beside it."""
    if name + "_scale_inv" in params:
        return torch.float8_e4m3fn
    return e.dtype


class _on:
    """``torch.cuda.stream(s)`` when ``s`` is a stream, a no-op on the CPU."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

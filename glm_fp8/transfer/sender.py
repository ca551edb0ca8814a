"""The sending trainer rank: converts layer i+1 into a ring slot while layer i is on the wire
(protocol: ``glm_fp8.transfer.wire``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.models import REST
from glm_fp8.plan import LayerPlan, layer_prefix, strip_layer
from glm_fp8.transfer.endpoint import Endpoint, LayerStats, Ring, UpdateStats, my_rank, on_stream
from glm_fp8.transfer.gather import GATHERS, collect_layer
from glm_fp8.transfer.scatter import pack_regions
from glm_fp8.transfer.wire import (
    ABORT,
    ABORT_ERROR,
    ABORT_ORDER,
    COMPLETE,
    DATA,
    HEADER_WORDS,
    MAGIC,
    PROTOCOL_VERSION,
    LayerOrderError,
    ManifestMismatch,
    ReceiverRefused,
    describe_refusal,
    header_words,
    layer_checksum,
)


class Broadcaster(Endpoint):
    """Sender: converts layers into a ring of buffers and broadcasts them, pipelined.

    Args:
        comm: ProcessGroup, None (default group) or an object with ``broadcast(tensor, src)``
            and ``all_reduce(tensor, op=...)`` (vLLM's PyNcclCommunicator).
        src: rank that sends (this process).
        config / plans: the model config (plans for every layer are built from it) or one
            ``LayerPlan`` per layer; the manifest needs them before the first layer is sent.
        layer_ids: the layers this update sends, in order (default: every decoder layer;
            ``glm_fp8.plan.model_layer_ids(config)`` adds the MTP layer); receivers must expect
            the same list. ``broadcast_model`` must be handed exactly these layers in this order.
        rest: the update also carries the non-layer tensors (``model.embed_tokens.weight``,
            ``model.norm.weight``, ``lm_head.weight``), sent after the last layer.
        scale_fmt: "fp32" (default) or "ue8m0": power-of-two block scales, for engines whose
            DeepGEMM kernels require them (vLLM on Hopper with DeepGEMM; Blackwell always).
        engines: scatter mode: the ``EngineLayout`` of every rank of the link (None at ``src``),
            the same list on every rank. Each layer is converted whole, then every class of
            ranks that hold the same shard gets only those bytes (``glm_fp8.transfer.scatter``);
            ``scatter.bytes_per_rank()`` says how many. Needs a ProcessGroup link.
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
        rest: bool = False,
        scale_fmt: str | None = None,
        engines: Sequence[EngineLayout | None] | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(comm, src, config=config, plans=plans, layer_ids=layer_ids, ring=ring, mode=mode,
                         device=device, rest=rest, scale_fmt=scale_fmt, engines=engines)  # fmt: skip
        if gather not in GATHERS:
            raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
        if chunk_experts < 1:
            raise ValueError(f"chunk_experts: expected at least 1, got {chunk_experts}")
        self.checksum = bool(checksum)
        self.collect_args = dict(mode=mode, gather=gather, chunk_experts=chunk_experts, sender=my_rank(),
                                 gather_dtype=gather_dtype, device=self.device)  # fmt: skip
        cuda = self.device.type == "cuda"
        if self.scatter is not None:
            # The classes' regions of one layer, side by side: one ring of them.
            self.pack_ring = Ring(ring, max(s.nbytes for s in self.scatter.layers), self.device)
        self.convert_stream = torch.cuda.Stream(self.device) if cuda else None
        self.comm_stream = torch.cuda.Stream(self.device) if cuda else None
        self.link_stream = self.comm_stream
        self.post_vote = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pending = False  # the receivers' vote on the last layer sent, not read yet

    def broadcast_model(
        self,
        layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
        rest: Mapping[str, torch.Tensor] | None = None,
    ) -> UpdateStats:
        """Send every layer of ``layers`` (``(layer_idx, state_dict)`` in the announced order),
        then ``rest`` (the non-layer tensors under their full names) when the update announced
        them (``rest=True`` at construction).

        Raises (and every receiver raises ``UpdateAborted`` at the same step) on any error: a
        layer other than announced, or ``rest`` missing or unannounced (``LayerOrderError``,
        before any byte of it is sent), non-finite weights, a bad state dict, or a receiver's
        refusal (``ManifestMismatch`` before the first layer, ``ReceiverRefused`` after it).
        """
        stats = UpdateStats()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self._pending = False
        self._send_manifest()
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        n_layers = len(self.plans) - self.rest
        try:
            if self.rest != (rest is not None):
                raise LayerOrderError(
                    "rest: the manifest announced the non-layer tensors, none were given" if self.rest else
                    "rest: given, but this Broadcaster was built without rest=True (not in the manifest)"
                )  # fmt: skip
            count = 0
            for pos, (layer_idx, sd) in enumerate(layers):
                if pos >= n_layers:
                    raise LayerOrderError(
                        f"layers: got layer {layer_idx} after the {n_layers} the manifest announced"
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
            if count != n_layers:
                raise LayerOrderError(f"layers: got {count}, the manifest announced {n_layers}")
            if self.rest:
                t_layer = time.perf_counter()
                self._send_layer(n_layers, REST, rest, header)
                stats.layers.append(LayerStats(REST, self.plans[-1].nbytes, time.perf_counter() - t_layer))
        except ReceiverRefused:
            raise  # every rank stopped at that vote: nothing more to send
        except BaseException as exc:
            self._abort(header, ABORT_ORDER if isinstance(exc, LayerOrderError) else ABORT_ERROR, exc)
            raise
        self._resolve_pending()
        self._send_header(header, COMPLETE, -1, len(self.plans), 0)
        code = self.vote(0)
        if code:
            raise ReceiverRefused(f"{describe_refusal(code)}; the update did not complete")
        self._sync()
        stats.seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return stats

    def _send_manifest(self) -> None:
        manifest = self.manifest(self.checksum)
        payload = json.dumps(manifest).encode()
        prelude = torch.tensor([MAGIC, PROTOCOL_VERSION, len(payload), 0], dtype=torch.int64)
        self.comm.broadcast(prelude.to(self.device), self.src)
        code = self.vote(0)
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.comm.broadcast(data, self.src)
        code = self.vote(0)
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")

    def _resolve_pending(self) -> None:
        """Read the receivers' verdict on the last layer sent (queued behind its data)."""
        if self._pending:
            self._pending = False
            with on_stream(self.comm_stream):  # the stream the vote was reduced on
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
        with on_stream(self.comm_stream):
            header.copy_(torch.tensor(header_words(status, layer_idx, pos, nbytes, word), dtype=torch.int64))
            if checksum is not None:
                header[5].copy_(checksum)
            self.comm.broadcast(header, self.src)

    def _send_layer(self, pos: int, layer_idx: int, sd: Mapping[str, torch.Tensor], header) -> None:
        plan = self.plans[pos]
        buf, slot = self.ring.slot(pos, plan.nbytes)
        caller = torch.cuda.current_stream(self.device) if self.convert_stream is not None else None
        checksum = None
        regions: list[torch.Tensor] = []
        with on_stream(self.convert_stream):
            if caller is not None:
                # The layer may have just been written on the caller's stream.
                self.convert_stream.wait_stream(caller)
            if self.ring.used[slot] and self.ring.free[slot] is not None:
                # The slot's previous broadcast must finish before we overwrite it.
                self.convert_stream.wait_event(self.ring.free[slot])
            # The finite check is this loop's only host wait per layer; the previous layer keeps
            # the wire busy meanwhile.
            collect_layer(plan, strip_layer(sd, layer_idx), layer_idx, buf, **self.collect_args)
            if self.scatter is not None:
                regions = self._pack(pos, layer_idx, buf)
            elif self.checksum:
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
        self._send_header(header, DATA, layer_idx, pos, 0, self.wire_nbytes(pos), checksum)
        # Every receiver checked the header against the manifest. This host read waits for the
        # previous layer's data to leave, which the ring waits for anyway.
        code = self.vote(0)
        if code:
            raise ReceiverRefused(f"{describe_refusal(code)} (layer {layer_idx}); the update was stopped")
        with on_stream(self.comm_stream):
            if self.scatter is None:
                self.comm.broadcast(buf, self.src)
                if self.ring.free[slot] is not None:
                    self.ring.free[slot].record(self.comm_stream)
            else:
                self._send_regions(pos, regions)
            # The receivers' verdict on what arrived; read before the next header goes out.
            self.post_vote.zero_()
            self.comm.all_reduce_max(self.post_vote)
        self._pending = True
        self.ring.used[slot] = True

    def _pack(self, pos: int, layer_idx: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """Cut every class's region of the layer out of ``buf`` into the pack ring (on the
        convert stream), each followed by its checksum."""
        layer = self.scatter.layers[pos]
        packed, slot = self.pack_ring.slot(pos, layer.nbytes)
        if self.pack_ring.used[slot] and self.pack_ring.free[slot] is not None:
            self.convert_stream.wait_event(self.pack_ring.free[slot])
        full = {layer_prefix(layer_idx) + name: view for name, view in self.plans[pos].views(buf)}
        self._pack_slot = slot
        return pack_regions(layer, full, packed, self.pack_ring.scratch)

    def _send_regions(self, pos: int, regions: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for ranks, region in zip(self.scatter.layers[pos].classes, regions):
            dist.broadcast(region, self.scatter.src_global, group=self.scatter.groups[ranks])
        if self.pack_ring.free[self._pack_slot] is not None:
            self.pack_ring.free[self._pack_slot].record(self.comm_stream)
        self.pack_ring.used[self._pack_slot] = True

    def _sync(self) -> None:
        if self.comm_stream is not None:
            self.comm_stream.synchronize()

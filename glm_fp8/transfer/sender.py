"""The sending trainer rank: converts layer i+1 into a ring slot while layer i is on the wire
(protocol: ``glm_fp8.transfer.wire``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from glm_fp8.convert import entry_norms, raise_if_non_finite
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.models import REST
from glm_fp8.plan import LayerPlan, layer_prefix, strip_layer
from glm_fp8.transfer.endpoint import (
    Endpoint,
    LayerStats,
    Ring,
    StepVotes,
    UpdateStats,
    link_rank,
    my_rank,
    on_stream,
)
from glm_fp8.transfer.gather import GATHERS, check_own_layer, collect_layer, collect_own
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
    REFUSED_MANIFEST,
    SENDER_FAILED,
    LayerOrderError,
    ManifestMismatch,
    ReceiverRefused,
    UpdateAborted,
    describe_refusal,
    header_words,
    layer_checksum,
    refusal_code,
    refusal_reason,
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
        senders: many senders (with ``engines``, None at every sender): the link ranks of every
            trainer rank, in the order of the expert chunks they hold. Every one of them builds a
            Broadcaster with the same arguments and calls ``broadcast_model`` with its own
            (sharded) state dicts; each converts and sends its own experts and the entries it
            owns (``routes``, a ``glm_fp8.engine.routes.TransferPlan``), ``src`` leads the steps.
            Any sender's failure is its vote on that layer; every rank stops one layer later
            (votes are read after the next layer was queued: docs/layouts.md#many-senders).
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
        senders: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ):
        if senders is not None:
            self.me = _sender_index(comm, senders)
        super().__init__(comm, src, config=config, plans=plans, layer_ids=layer_ids, ring=ring, mode=mode,
                         device=device, rest=rest, scale_fmt=scale_fmt, engines=engines,
                         senders=senders)  # fmt: skip
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
        if self.routes is not None:
            # This sender's segments of one layer, side by side (the ring holds its converted share).
            self.pack_ring = Ring(ring, self.routes.sender_buffers(self.me)[1], self.device)
            import torch.distributed as dist

            glob = [r if comm is None or not dist.is_initialized() else dist.get_global_rank(comm, r)
                    for r in self.routes.senders]  # fmt: skip
            self.senders_global = glob
            self.is_src = self.link_rank == src
            self._headers = self.header_table()
            self._header_in = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._step_checks: list[tuple | None] = [None, None]  # (layer, norms, NaN/Inf flag)
            self._ready: torch.cuda.Event | None = None
            self.step_votes = StepVotes(self.comm, self.device)
        self.convert_stream = torch.cuda.Stream(self.device) if cuda else None
        self.comm_stream = torch.cuda.Stream(self.device) if cuda else None
        self.link_stream = self.comm_stream
        self.post_vote = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pending = False  # the receivers' vote on the last layer sent, not read yet
        self._manifest_payload: bytes | None = None

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
        if self.routes is not None:
            self._broadcast_many(layers, rest, stats)
        else:
            self._broadcast_one(layers, rest, stats)
        self._sync()
        stats.seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return stats

    def _rest_error(self, rest: Mapping[str, torch.Tensor] | None) -> LayerOrderError | None:
        if self.rest == (rest is not None):
            return None
        return LayerOrderError(
            "rest: the manifest announced the non-layer tensors, none were given" if self.rest else
            "rest: given, but this Broadcaster was built without rest=True (not in the manifest)"
        )  # fmt: skip

    def _order_error(self, pos: int, layer_idx: int) -> LayerOrderError | None:
        """The error when ``layers`` hands ``layer_idx`` at position ``pos``, else None."""
        n_layers = len(self.plans) - self.rest
        if pos >= n_layers:
            return LayerOrderError(
                f"layers: got layer {layer_idx} after the {n_layers} the manifest announced"
            )
        if layer_idx != self.layer_ids[pos]:
            return LayerOrderError(
                f"layers: got layer {layer_idx} at position {pos}; the manifest announced layer "
                f"{self.layer_ids[pos]} there (announced order: {self.layer_ids})"
            )
        return None

    def _broadcast_one(
        self,
        layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
        rest: Mapping[str, torch.Tensor] | None,
        stats: UpdateStats,
    ) -> None:
        """This rank sends the whole update; on any error an ABORT header stops the receivers."""
        self._send_manifest()
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        n_layers = len(self.plans) - self.rest
        try:
            if (err := self._rest_error(rest)) is not None:
                raise err
            count = 0
            for pos, (layer_idx, sd) in enumerate(layers):
                if (err := self._order_error(pos, layer_idx)) is not None:
                    raise err
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

    def _slot_nbytes(self) -> int:
        if self.routes is not None:
            return self.routes.sender_buffers(self.me)[0]
        return super()._slot_nbytes()

    # --- many senders --------------------------------------------------------------------------

    def _broadcast_many(
        self,
        layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
        rest: Mapping[str, torch.Tensor] | None,
        stats: UpdateStats,
    ) -> None:
        """Every sender runs the same steps (one per announced layer, then COMPLETE), whatever
        its ``layers`` yield: a step's own problem becomes its vote, so the senders never fall out
        of step. Per layer: check it (every sender alike), the senders' vote (all gather or none),
        gather and convert this sender's share into a ring slot and pack its segments; queue,
        with no host wait, the leader's header, the messages and every rank's vote on them; then
        read the previous layer's vote. The link thus always holds the next layer while the host
        waits. A failed vote is read one step late: every rank has queued that next step and
        raises once it is done. COMPLETE is voted after the last layer's verdict was read."""
        self._many_manifest()
        it = iter(layers)
        n = len(self.plans)
        failed: BaseException | None = None
        # Set on every sender alike by the senders' vote: from then on none pulls ``layers``
        # (the caller's iterator may run collectives of the senders, a full_tensor() say).
        stop = False
        for pos in range(n):
            t_layer = time.perf_counter()
            err: BaseException | None = None
            item = None
            self._ready = None
            self._step_checks[pos % 2] = None
            if not stop:
                try:
                    item = self._next_item(it, pos, rest)
                    check_own_layer(self.plans[pos], strip_layer(item[1], item[0]), item[0],
                                    self.senders_global, self.routes.bounds)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                    err = exc
            mine = err if err is not None else failed
            peers_failed = self._senders_vote(mine)
            stop = stop or mine is not None or peers_failed
            if item is not None and mine is None and not peers_failed:
                try:
                    self._convert_own(pos, *item)
                except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                    err = exc
            failed = err if failed is None else failed
            # A step that did not convert still sends (its slot's stale bytes): every rank queued
            # its messages, and its vote refuses them.
            self._post_step(pos, failed)
            if pos:
                self._settle_step(pos - 1, failed)
            stats.layers.append(LayerStats(self.layer_ids[pos], self.plans[pos].nbytes,
                                           time.perf_counter() - t_layer))  # fmt: skip
        self._settle_step(n - 1, failed)
        self._ready, self._step_checks[n % 2] = None, None
        if not stop:
            try:
                self._next_item(it, n, rest)  # a layer past the announced ones
            except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                failed = exc
        self._post_step(n, failed)
        self._settle_step(n, failed)

    def _post_step(self, pos: int, failed: BaseException | None) -> None:
        """Queue step ``pos`` on the link stream: the leader's header, this sender's messages
        (none at COMPLETE) and its vote, SENDER_FAILED when ``failed`` or its share holds
        NaN/Inf (decided on the device). No host wait."""
        code = refusal_code(SENDER_FAILED, my_rank())
        checks = self._step_checks[pos % 2]
        flags = [(checks[2], code)] if checks is not None and checks[2] is not None else []
        with on_stream(self.comm_stream):
            if self._ready is not None:
                self.comm_stream.wait_event(self._ready)
            self.comm.broadcast(self._headers[pos] if self.is_src else self._header_in, self.src)
            if pos < len(self.plans):
                routes = self.routes.layers[pos]
                slot = pos % len(self.pack_ring.slots)
                packed = self.pack_ring.slots[slot]
                sends = [(packed[s.send_offset : s.send_offset + s.nbytes], r)
                         for s in routes.of_sender(self.me) for r in routes.classes[s.cls]]  # fmt: skip
                self.comm.exchange(sends, [])
                if self.pack_ring.free[slot] is not None:
                    self.pack_ring.free[slot].record(self.comm_stream)
                self.pack_ring.used[slot] = True
            self.step_votes.post(pos, code if failed is not None else 0, flags)

    def _settle_step(self, pos: int, failed: BaseException | None) -> None:
        """Read step ``pos``'s vote; when a rank refused, wait for the step queued after it (every
        rank queued it), then raise: this sender's own error first, else one naming the rank."""
        verdict = self.step_votes.read(pos)
        if not verdict:
            return
        self._sync()
        if failed is not None:
            raise failed
        checks = self._step_checks[pos % 2]
        if checks is not None and checks[2] is not None and bool(checks[2]):
            raise_if_non_finite(checks[1], checks[0])
        if refusal_reason(verdict) == SENDER_FAILED:
            raise UpdateAborted(f"{describe_refusal(verdict)} (step {pos}); every rank was stopped")
        where = (
            "the update did not complete" if pos == len(self.plans)
            else f"layer {self.layer_ids[pos]}; the update was stopped"
        )  # fmt: skip
        raise ReceiverRefused(f"{describe_refusal(verdict)} ({where})")

    def _next_item(self, it, pos: int, rest: Mapping[str, torch.Tensor] | None):
        """The ``(layer_idx, state dict)`` of step ``pos`` (None at the COMPLETE step), or a
        ``LayerOrderError`` when ``layers`` / ``rest`` disagree with the manifest."""
        n_layers = len(self.plans) - self.rest
        if pos == 0 and (err := self._rest_error(rest)) is not None:
            raise err
        if pos < n_layers:
            got = next(it, None)
            if got is None:
                raise LayerOrderError(f"layers: got {pos}, the manifest announced {n_layers}")
            if (err := self._order_error(pos, got[0])) is not None:
                raise err
            return got
        if pos == n_layers and self.rest:
            return REST, rest
        extra = next(it, None)
        if extra is not None:
            raise self._order_error(n_layers, extra[0])
        return None

    def _senders_vote(self, err: BaseException | None) -> bool:
        """The senders' own vote before any gather (their group, not the link): True when
        another sender failed its checks, so that no sender waits in a gather for it."""
        if self.trainer_group is None:
            return False
        import torch.distributed as dist

        flag = torch.tensor([int(err is not None)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.trainer_group)
        return bool(flag.item()) and err is None

    def _convert_own(self, pos: int, layer_idx: int, sd: Mapping[str, torch.Tensor]) -> None:
        """Gather, convert and pack this sender's share of the layer at ``pos`` (convert stream)."""
        routes = self.routes.layers[pos]
        buf, _ = self.ring.slot(pos, routes.local_plans[self.me].nbytes)
        packed, slot = self.pack_ring.slot(pos, routes.send_nbytes[self.me])
        caller = torch.cuda.current_stream(self.device) if self.convert_stream is not None else None
        with on_stream(self.convert_stream):
            if caller is not None:
                self.convert_stream.wait_stream(caller)
            if self.pack_ring.used[slot] and self.pack_ring.free[slot] is not None:
                self.convert_stream.wait_event(self.pack_ring.free[slot])
            local = routes.local_plans[self.me]
            views = collect_own(
                routes, self.me, self.plans[pos], strip_layer(sd, layer_idx), buf,
                senders=self.senders_global, gather_dtype=self.collect_args["gather_dtype"],
                device=self.device, check_finite=False,
            )  # fmt: skip
            # NaN/Inf shows in the scales and passthrough entries: decided on the device, voted
            # with the messages; the host reads the entries' norms only when that vote fails.
            norms = entry_norms(local, buf[: local.nbytes]) if views else ([], None)
            bad = None if norms[1] is None else ~torch.isfinite(norms[1]).all()
            self._step_checks[pos % 2] = (layer_idx, norms, bad)
            mine = routes.of_sender(self.me)
            pack_regions(mine, [s.send_offset for s in mine], views, packed, self.pack_ring.scratch,
                         routes.starts(self.me))  # fmt: skip
            self._ready = None
            if self.convert_stream is not None:
                self._ready = torch.cuda.Event()
                self._ready.record(self.convert_stream)
        if caller is not None:
            caller.wait_event(self._ready)

    def _many_manifest(self) -> None:
        """The leader sends the prelude and the manifest as ``_send_manifest``; every other sender
        receives them too and refuses one that differs from its own."""
        if self.is_src:
            self._send_manifest()
            return
        payload = self._payload()
        prelude = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.comm.broadcast(prelude, self.src)
        same = prelude.tolist()[2] == len(payload)
        code = self.vote(0 if same else refusal_code(REFUSED_MANIFEST, my_rank()))
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")
        data = torch.empty(len(payload), dtype=torch.uint8, device=self.device)
        self.comm.broadcast(data, self.src)
        same = torch.equal(data.cpu(), torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        code = self.vote(0 if same else refusal_code(REFUSED_MANIFEST, my_rank()))
        if code:
            raise ManifestMismatch(f"{describe_refusal(code)}; nothing was sent")

    def _payload(self) -> bytes:
        """The manifest as sent: the same for every update of this Broadcaster, built once."""
        if self._manifest_payload is None:
            self._manifest_payload = json.dumps(self.manifest(self.checksum)).encode()
        return self._manifest_payload

    def _send_manifest(self) -> None:
        payload = self._payload()
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
        return pack_regions(layer.packs, layer.offsets, full, packed, self.pack_ring.scratch)

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


def _sender_index(comm: object | None, senders: Sequence[int]) -> int:
    me = link_rank(comm)
    if me not in list(senders):
        raise ValueError(f"senders: this process (link rank {me}) is not one of the senders {list(senders)}; "
                         "engine ranks build a Receiver")  # fmt: skip
    return list(senders).index(me)

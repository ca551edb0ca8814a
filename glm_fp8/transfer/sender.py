"""A sending trainer rank: converts its share of layer i+1 while layer i is on the wire, and runs
the update's steps (protocol: ``glm_fp8.transfer.wire``; routes: ``glm_fp8.transfer.routes``)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from glm_fp8.core.errors import ManifestMismatch, ReceiverRefused, UpdateAborted
from glm_fp8.kernels.convert import entry_norms, raise_if_non_finite
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.trainer_layouts import layer_prefix, strip_layer
from glm_fp8.transfer.delta.send import SenderDelta
from glm_fp8.transfer.endpoint import (
    Endpoint,
    LayerStats,
    Ring,
    UpdateStats,
    my_rank,
    on_stream,
    pack_segments,
)
from glm_fp8.transfer.gather import collect_layer, trainer_view
from glm_fp8.transfer.graphs import LayerGraphs, tensor_key, tensors_key
from glm_fp8.transfer.options import DeltaOptions, SendOptions, device_of
from glm_fp8.transfer.share import check_own_layer, convert_own, own_inputs
from glm_fp8.transfer.trainer_input import layers_arg, next_item
from glm_fp8.transfer.votes import refusal_is_voted
from glm_fp8.transfer.wire import (
    HEADER_WORDS,
    MAX_MANIFEST_BYTES,
    REFUSED_MANIFEST,
    RESEND_DENSE,
    SENDER_FAILED,
    checksum_scratch,
    describe_refusal,
    refusal_code,
    refusal_reason,
)


class Sender(Endpoint):
    """A trainer rank that sends: converts layers into a ring of buffers and sends them, pipelined.

    Args:
        comm: the link: a ProcessGroup, None (the default group), a ``glm_fp8.transfer.link.Link``
            or an object like vLLM's PyNcclCommunicator (``broadcast``, ``all_reduce``, ``send``,
            ``recv``, ``group_start``/``group_end``, ``rank``, ``world_size``).
        src: the link rank that leads (sends the manifest and the headers); a sender.
        options: a ``SendOptions`` (``glm_fp8.transfer.options``: every field and its default), a
            mapping of its fields, or None; ``**fields`` as keywords on top of it
            (``Sender(comm, 0, config=config, ring=3)``). What every rank passes alike (config or
            plans, layer_ids, rest, scale_fmt, engines, senders, wire, checksum) must agree across
            the link, or the manifest vote refuses the update before anything is sent.
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        options: SendOptions | Mapping | None = None,
        **fields: object,
    ):
        with refusal_is_voted(comm, src, device_of(options, fields)):  # a refusal here reaches every rank
            opts = SendOptions.of(options, fields)
            super().__init__(comm, src, opts)
            if self.rank not in self.senders:
                raise ValueError(
                    f"senders: this process (link rank {self.rank}) is not one of the senders "
                    f"{list(self.senders)}; engine ranks build a Receiver"
                )
            self.me = self.senders.index(self.rank)
            # The senders' ranks in the trainer's default group, where their DTensors live.
            self.senders_global = [self.link.global_rank(r) for r in self.senders]
            self.collect_args = dict(
                wire=opts.wire,
                gather=opts.gather,
                chunk_experts=opts.chunk_experts,
                gather_dtype=opts.gather_dtype,
                device=self.device,
            )
            conv, send = self.routes.sender_buffers(self.me)
            self.conv_ring = Ring(opts.ring, conv, self.device)
            self.send_ring = Ring(opts.ring, send, self.device) if send else None
            self.scratch = checksum_scratch(max(conv, send), self.device)
            cuda = self.device.type == "cuda"
            self.convert_stream = torch.cuda.Stream(self.device) if cuda else None
            self.link_stream = torch.cuda.Stream(self.device) if cuda else None
            self._header_in = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
            # per step converted, until read: (layer, the plan converted, its entries' norms, NaN/Inf
            # flag on the device), and the event the link waits for (CUDA)
            self._checks: dict[int, tuple] = {}
            self._ready: dict[int, torch.cuda.Event] = {}
            self.delta: SenderDelta | None = None
            self.graphs = LayerGraphs(self.device, enabled=False)
            if opts.delta is not None:
                self.attach_delta(opts.delta)

    def attach_delta(self, options: DeltaOptions) -> SenderDelta:
        """A new delta state (nothing kept: the next update is dense for every layer) and, per
        ``options.graphs``, new layer graphs; what ``delta=`` builds at construction."""
        self.delta = SenderDelta(
            self.side(),
            options,
            me=self.me,
            conv_ring=self.conv_ring,
            send_ring=self.send_ring,
            convert_stream=self.convert_stream,
            scratch=self.scratch,
        )
        self.graphs = LayerGraphs(self.device, enabled=options.graphs)
        return self.delta

    def send_model(
        self,
        layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
        rest: Mapping[str, torch.Tensor] | None = None,
    ) -> UpdateStats:
        """Send this rank's share of every layer of ``layers`` (``(layer_idx, state_dict)`` in the
        announced order), then of ``rest`` (the non-layer tensors under their full names) when the
        update announced them (``rest=True`` at construction).

        Raises, and every other rank raises ``UpdateAborted`` one step later, on any error: a layer
        other than announced or ``rest`` missing or unannounced (``LayerOrderError``), non-finite
        weights (``NonFiniteError``), a bad state dict; ``ManifestMismatch`` when a rank refused the
        manifest (nothing was sent), ``ReceiverRefused`` when an engine rank refused a step.

        Python's cycle collector is paused for the call (``cycle_collector_paused``).
        """
        stats = UpdateStats()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        with cycle_collector_paused():
            self.agree(self._check_manifest, MAX_MANIFEST_BYTES)
            if self.delta is not None:
                self.delta.begin()
            self._steps(layers, rest, stats)
            self._sync()
        stats.seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return stats

    def _check_manifest(self, got: bytes) -> tuple[Exception | None, int]:
        if got == self.payload():
            return None, 0
        return ManifestMismatch(
            f"manifest: link rank {self.rank}'s differs from the leader's (rank {self.src}); every sender "
            "needs the same config, layer_ids, rest, scale_fmt, wire, checksum, engines and senders"
        ), REFUSED_MANIFEST

    def _steps(self, layers, rest, stats: UpdateStats) -> None:
        """Every sender runs the same steps (``TransferPlan.steps``: one announced layer each, or
        several with ``step_layers``; then COMPLETE), whatever its ``layers`` yield: a layer's own
        problem becomes its step's vote, so the senders never fall out of step. Per layer: take and
        check it; with several senders their vote before any gather (all gather or none); gather,
        convert and pack this sender's share. After a step's last layer: queue, with no host wait,
        the leader's header, the step's segments and every rank's vote on them; then read the
        previous step's vote. The link thus always holds the next step while the host waits, and a
        failed vote is read one step late: every rank has queued that next step and raises once it
        is done. A delta update (one layer a step) queues each step after the next layer's
        conversion (its payloads' lengths are read then, while the GPU converts the next layer),
        with the error of either step in its vote. Then each layer an engine rank voted
        RESEND_DENSE (delta) goes again, dense, from the kept copy; COMPLETE is voted last."""
        n, steps = len(self.plans), self.routes.steps
        last = {step[-1]: g for g, step in enumerate(steps)}  # a step is queued after its last layer
        self._ready.clear()  # what a failed update left
        self._checks.clear()
        failed: BaseException | None = None
        stop = False  # set alike on every sender by their vote: from then on none pulls ``layers``
        try:
            it = iter(layers_arg(layers))
        except Exception as exc:  # noqa: BLE001 - voted at the first step, raised at its verdict
            it, failed, stop = iter(()), exc, True
        lag = int(self.delta is not None)  # a delta step is queued after the next conversion
        for pos in range(n):
            t_layer = time.perf_counter()
            err: BaseException | None = None
            item = None
            if not stop:
                try:
                    layer_idx, sd = next_item(it, pos, rest, self.layer_ids, n - self.rest, self.rest)
                    plan, layer = trainer_view(self.plans[pos], strip_layer(sd, layer_idx), layer_idx)
                    if len(self.senders) > 1:
                        holders = self.routes.holders[pos] if self.routes.holders else None
                        lay = self.routes.layers[pos]
                        check_own_layer(plan, layer, lay, holders, self.me, self.senders_global)
                    item = (layer_idx, plan, layer)
                except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                    err = exc
            mine = err if err is not None else failed
            peers_failed = self._senders_vote(mine)
            stop = stop or mine is not None or peers_failed
            if item is not None and mine is None and not peers_failed:
                try:
                    self._convert(pos, *item)
                except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                    err = exc
            failed = err if failed is None else failed
            if pos in last and last[pos] >= lag:
                self._advance(last[pos] - lag, failed)
            stats.layers.append(
                LayerStats(self.layer_ids[pos], 0, time.perf_counter() - t_layer, self.plans[pos].nbytes)
            )
        for g in range(max(len(steps) - lag, 0), len(steps)):
            self._advance(g, failed)
        self._settle_step(len(steps) - 1, failed)
        for pos, st in enumerate(stats.layers):
            lay = self.routes.layers[pos]
            st.nbytes = self.delta.sent_nbytes(pos) if self.delta else lay.sent_nbytes(self.me)
            dense = lay.delivered_nbytes(self.me)
            st.delivered_nbytes = self.delta.delivered_nbytes(pos) if self.delta else dense
        for pos in self.delta.resends() if self.delta is not None else ():  # every rank read the votes
            # (a delta update's steps are its layers: step ``pos`` carries the layer at ``pos``)
            t_layer = time.perf_counter()
            self._ready[pos] = self.delta.restore(pos)
            self._post_step(pos, None)
            self._settle_step(pos, None)
            stats.layers[pos].nbytes += self.routes.layers[pos].sent_nbytes(self.me)
            stats.layers[pos].delivered_nbytes += self.routes.layers[pos].delivered_nbytes(self.me)
            stats.layers[pos].seconds += time.perf_counter() - t_layer
        if not stop:
            try:
                next_item(it, n, rest, self.layer_ids, n - self.rest, self.rest)  # a layer past the announced
            except Exception as exc:  # noqa: BLE001 - voted on below, raised at its verdict
                failed = exc
        self._post_step(len(steps), failed)
        self._settle_step(len(steps), failed)

    def _advance(self, step: int, failed: BaseException | None) -> None:
        """Queue step ``step`` (a step that did not convert still sends its slot's stale bytes: every
        rank queued its messages, and its vote refuses them), then read step ``step - 1``'s vote."""
        self._post_step(step, failed)
        if step:
            self._settle_step(step - 1, failed)

    def _senders_vote(self, err: BaseException | None) -> bool:
        """With several senders, their own vote before any gather (their group, not the whole link):
        True when another sender failed its checks, so that none waits in a gather for it."""
        if len(self.senders) < 2 or self.link.stand_in:
            return False
        flag = torch.tensor([int(err is not None)], dtype=torch.int64, device=self.device)
        self.link.group_all_reduce_max(flag, tuple(sorted(self.senders)))
        return bool(flag.item()) and err is None

    def _convert(self, pos: int, layer_idx: int, plan: LayerPlan, layer: dict[str, torch.Tensor]) -> None:
        """Gather, convert and pack this sender's share of the layer at ``pos`` (convert stream);
        ``plan`` and ``layer`` as ``trainer_view`` gives them. In a delta update the kernels after
        the gathers are captured and replayed as one CUDA graph where they can be
        (``_layer_kernels``, ``glm_fp8.transfer.graphs``)."""
        lay = self.routes.layers[pos]
        step = self.routes.step_of(pos)
        conv_base, send_base = self.routes.sender_bases(self.me, pos)
        buf, ci = self.conv_ring.slot(step)
        buf = buf[conv_base:]  # this layer's region of the step's slot
        out = None
        caller = torch.cuda.current_stream(self.device) if self.convert_stream is not None else None
        with on_stream(self.convert_stream):
            if caller is not None:
                self.convert_stream.wait_stream(caller)  # the layer may have just been written there
            self.conv_ring.wait_free(ci, self.convert_stream)
            if any(not s.direct for s in lay.of_sender(self.me)):
                out, pi = self.send_ring.slot(step)
                out = out[send_base:]
                self.send_ring.wait_free(pi, self.convert_stream)
            inputs = None  # what the kernels read, when known before them: the graph's key
            if len(self.senders) == 1:
                if self.graphs.enabled:
                    from torch.distributed.tensor import DTensor

                    if not any(isinstance(x, DTensor) for x in layer.values()):
                        inputs = layer  # plain tensors, no gather: collect_layer queues kernels only

                def convert() -> tuple[LayerPlan, dict[str, torch.Tensor]]:
                    views = collect_layer(
                        plan,
                        layer,
                        layer_idx,
                        buf[: plan.nbytes],
                        sender=my_rank(),
                        check_finite=False,
                        **self.collect_args,
                    )
                    return plan, views
            else:
                local, inputs = own_inputs(  # the gathers, if any: never captured
                    lay,
                    self.me,
                    plan,
                    layer,
                    senders=self.senders_global,
                    gather_dtype=self.collect_args["gather_dtype"],
                    device=self.device,
                    holders=self.routes.holders[pos] if self.routes.holders else None,
                )

                def convert() -> tuple[LayerPlan, dict[str, torch.Tensor]]:
                    prefix = layer_prefix(layer_idx)
                    return local, convert_own(local, inputs, prefix, buf, check_finite=False)

            key = None  # built only where a graph may be captured: the default path skips it
            if (
                self.graphs.enabled
                and self.delta is not None
                and inputs is not None
                and all(x.device == buf.device for x in inputs.values())
            ):
                key = (ci, tensors_key(inputs.items()), tensor_key(buf), out is not None and tensor_key(out))
                key += self.delta.graph_key(pos)
            if self.delta is not None:
                self.delta.begin_layer(pos)
            local, norms, bad, compared = self.graphs.run(
                pos, key, lambda: self._layer_kernels(pos, convert, buf, out)
            )
            self._checks[pos] = (layer_idx, local, norms, bad)
            if self.delta is not None:
                self.delta.compared(pos, compared)
            if self.convert_stream is not None:
                ready = self._ready[pos] = torch.cuda.Event()
                ready.record(self.convert_stream)
        if caller is not None:
            # The caller may free or overwrite its tensors once we move on: order that after the
            # kernels that read them (the wire, on its own stream, is not waited for).
            caller.wait_event(ready)

    def _layer_kernels(self, pos: int, convert, buf: torch.Tensor, out: torch.Tensor | None) -> tuple:
        """The layer's kernels after its gathers, on the current stream with no host read (what
        ``LayerGraphs`` may capture): ``convert()``, the entries' norms, the checksum words, the
        packed segments and, in a delta update, the comparison. Returns the plan converted, its
        norms and NaN/Inf flag, and what ``SenderDelta.compared`` takes."""
        lay = self.routes.layers[pos]
        local, views = convert()
        # NaN/Inf shows in the scales and passthrough entries: decided on the device and voted
        # with the segments; the host reads the entries' norms only when that vote fails.
        norms = entry_norms(local, buf[: local.nbytes]) if views else ([], None)
        bad = None if norms[1] is None else ~torch.isfinite(norms[1]).all()
        mine = lay.of_sender(self.me)
        packed = [s for s in mine if not s.direct]
        if self.delta is not None:  # before the checksums: both ends hold zeros between pieces
            self.delta.zero_gaps(pos, buf, out)
        if packed:
            pack_segments(packed, [s.send_offset for s in packed], views, out, lay.starts(self.me))
        # A segment every rank takes as a delta needs no checksum pass: the comparison takes it.
        for s in mine:
            if self.checksum and (self.delta is None or self.delta.needs_seal(pos, s)):
                s.seal(s.source(buf, out), self.scratch)
        compared = self.delta.compare(pos, buf, out) if self.delta is not None else None
        return local, norms, bad, compared

    def _post_step(self, step: int, failed: BaseException | None) -> None:
        """Queue step ``step`` on the link stream: the leader's header, this sender's segments of
        the step's layers (none at COMPLETE) and its vote, SENDER_FAILED when ``failed`` or its
        share holds NaN/Inf (decided on the device). No host wait."""
        code = refusal_code(SENDER_FAILED, self.rank)
        positions = self.routes.steps[step] if step < len(self.routes.steps) else ()
        checks = [self._checks.get(pos) for pos in positions]
        flags = [(c[3], code) for c in checks if c is not None and c[3] is not None]
        with on_stream(self.link_stream):
            for pos in positions:
                ready = self._ready.pop(pos, None)
                if ready is not None:
                    self.link_stream.wait_event(ready)
            header = self._headers[self.header_row(step)]
            self.link.broadcast(header if self.rank == self.src else self._header_in, self.src)
            if positions:
                self._send_segments(step)
            self.step_votes.post(self.link, step, code if failed is not None else 0, flags)

    def _send_segments(self, step: int) -> None:
        """This sender's segments of every layer of step ``step``: the group broadcasts layer by
        layer, then one exchange of the point-to-point ones (routes' order, on every rank)."""
        conv_slot, ci = self.conv_ring.slot(step)
        send_slot, pi = self.send_ring.slot(step) if self.send_ring is not None else (None, 0)
        sends, dense = [], False
        for pos in self.routes.steps[step]:
            lay = self.routes.layers[pos]
            conv_base, send_base = self.routes.sender_bases(self.me, pos)
            conv = conv_slot[conv_base:]
            out = None if send_slot is None else send_slot[send_base:]
            if self.delta is not None and self.delta.is_delta[pos]:  # one layer a step
                self.delta.send(pos, conv, out)
                continue
            dense = True
            for s in lay.of_sender(self.me):
                data = s.source(conv, out)
                if s.group is not None:  # in class order, before the exchange
                    self.link.group_broadcast(data, self.rank, s.group)
                else:
                    sends += [(data, r) for r in lay.classes[s.cls]]
        if dense:
            self.link.exchange(sends, [])
        self.conv_ring.release(ci, self.link_stream)
        if self.send_ring is not None:
            self.send_ring.release(pi, self.link_stream)

    def _settle_step(self, step: int, failed: BaseException | None) -> None:
        """Read step ``step``'s vote; when a rank refused, wait for the step queued after it (every
        rank queued it), then raise: this sender's own error first, else one naming the rank."""
        verdict = self.step_votes.read(step)
        positions = self.routes.steps[step] if step < len(self.routes.steps) else ()
        checks = [c for c in (self._checks.pop(pos, None) for pos in positions) if c is not None]
        if not verdict:
            return
        if refusal_reason(verdict) == RESEND_DENSE:  # sent again, dense, after the last layer
            self.delta.resend(positions[0])  # a delta update's steps are its layers
            return
        self._sync()
        if failed is not None:
            raise failed
        for c in checks:
            if c[3] is not None and bool(c[3]):
                layer_idx, local, norms = c[:3]
                raise_if_non_finite(norms, layer_idx, local, "every rank was stopped")
        where = self.step_name(step)
        if refusal_reason(verdict) == SENDER_FAILED:
            raise UpdateAborted(f"{describe_refusal(verdict)} ({where}); every rank was stopped")
        raise ReceiverRefused(f"{describe_refusal(verdict)} ({where}); the update was stopped")

    def _sync(self) -> None:
        for stream in (self.convert_stream, self.link_stream):
            if stream is not None:
                stream.synchronize()


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Python's cycle collector off for an update, restored after. A full collection of a trainer
    process's heap takes tens of milliseconds (65 ms for the objects of an 80-layer GLM-5 transfer
    plan, on one CI core): a host stall that a delta update, bound by the host and not the link,
    cannot hide. Reference counting still frees what the update drops; cycles wait for the next
    collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

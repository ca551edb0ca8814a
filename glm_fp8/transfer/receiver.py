"""A receiving engine rank: lands each layer of an update in its parameters, only after every rank
voted that it arrived intact (protocol: ``glm_fp8.transfer.wire``; routes: ``glm_fp8.transfer.routes``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from glm_fp8.core.errors import ManifestMismatch, UpdateAborted
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.specs import EngineParam, engine_params
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.delta.receive import ReceiverDelta, Unland, check_receiver_delta
from glm_fp8.transfer.endpoint import (
    Endpoint,
    LayerStats,
    Ring,
    UpdateStats,
    checksums_bad,
    on_stream,
    segment_views,
)
from glm_fp8.transfer.land import WIDENING, check_params, expected_params, land_layer, zero_padding
from glm_fp8.transfer.options import ReceiveOptions, device_of
from glm_fp8.transfer.pack import FULL
from glm_fp8.transfer.votes import refusal_is_voted
from glm_fp8.transfer.wire import (
    BAD_CHECKSUM,
    CONSUMER_FAILED,
    HEADER_WORDS,
    REFUSED_HEADER,
    REFUSED_MANIFEST,
    REFUSED_PARAMS,
    RESEND_DENSE,
    checksum_scratch,
    compare_manifest,
    decode_manifest,
    describe_refusal,
    header_error,
    link_failure,
    refusal_code,
    refusal_reason,
)


class Receiver(Endpoint):
    """An engine rank: receives its segments of every layer into a ring and lands them.

    Args:
        comm, src: as for ``Sender``, the same on every rank.
        options: a ``ReceiveOptions`` (``glm_fp8.transfer.options``: every field and its default),
            a mapping of its fields, or None; ``**fields`` as keywords on top of it
            (``Receiver(comm, 0, config=config, layout=layout)``). What every rank passes alike
            must agree with the senders', or the manifest is refused before any parameter is
            touched. A ``layout`` vLLM refuses is refused at the first vote (every rank stops
            there; this one raises the ValueError).
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        options: ReceiveOptions | Mapping | None = None,
        **fields: object,
    ):
        with refusal_is_voted(comm, src, device_of(options, fields)):  # a refusal here reaches every rank
            opts = ReceiveOptions.of(options, fields)
            super().__init__(comm, src, opts)
            layout, delta = opts.layout, opts.delta
            if self.rank in self.senders:
                raise ValueError(f"senders: this process (link rank {self.rank}) is a sender; build a Sender")
            entry = self.routes.engines[self.rank]
            self.full = entry == FULL
            self.layout = layout
            self.max_manifest_bytes = int(opts.max_manifest_bytes)
            self.targets: dict[str, EngineParam] | None = None  # kernel-format name -> engine parameter
            # A layout other than this rank's entry of engines, or one vLLM refuses: raised by load_into
            # after every rank voted on it, so that the senders and the other engine ranks stop too
            # instead of waiting for this rank until the transport's timeout.
            self._layout_error: ValueError | None = None
            if not self.full and entry != layout:
                self._layout_error = ValueError(
                    f"layout: expected engines[{self.rank}] (this rank's entry), which is {entry}; "
                    f"got {layout}"
                )
            elif layout is not None and self.full and len(self.senders) > 1:
                self._layout_error = ValueError(
                    f"engines[{self.rank}]: 'full' with a layout needs one sender; with many senders give "
                    "this rank's EngineLayout, so that it receives only its shard"
                )
            elif layout is not None:
                try:
                    self.targets = self._targets(layout)
                except ValueError as exc:
                    self._layout_error = exc
            # This rank's segments per layer (from each of its classes), where each lies in its buffer,
            # and where that buffer lies in its step's ring slot.
            self.mine = [lay.of_rank(self.rank) for lay in self.routes.layers]
            self.bases = [self.routes.receive_base(self.rank, pos) for pos in range(len(self.plans))]
            self.ring = Ring(opts.ring, self.routes.receive_slot(self.rank), self.device)
            self.scratch = checksum_scratch(self.routes.receive_slot(self.rank), self.device)
            self.link_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._header_bufs = torch.empty(2, HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._flags: list[tuple] = [(None, None), (None, None)]
            self._params_error: Exception | None = None
            self._sums = True
            self.delta = None
            if delta:
                check_receiver_delta(
                    wire=self.wire,
                    checksum=self.checksum,
                    full=self.full,
                    layout=self.layout,
                    rank=self.rank,
                    layer_ids=self.layer_ids,
                    plans=self.plans,
                    targets=self.targets,
                )
                self.delta = ReceiverDelta(
                    self.side(),
                    layer_ids=self.layer_ids,
                    plans=self.plans,
                    mine=self.mine,
                    targets=self.targets,
                    scratch=self.scratch,
                )

    def _targets(self, layout: EngineLayout) -> dict[str, EngineParam]:
        """The engine parameter of every entry this rank holds, by kernel-format name (an entry of
        the indexer form it does not hold has none: ``EngineLayout.holds``)."""
        targets = {p.kernel_name: p for p in engine_params(self.config, layout).values()}
        for layer_idx, plan in zip(self.layer_ids, self.plans):
            for e in plan.entries:
                if not layout.holds(self.config, layer_prefix(layer_idx) + e.name):
                    continue
                p = targets[layer_prefix(layer_idx) + e.name]
                if p.dtype != e.dtype and (p.dtype, e.dtype) not in WIDENING:
                    raise ValueError(f"{p.name}: the engine holds {p.dtype}, the wire carries {e.dtype}")
        return targets

    # --- the manifest -------------------------------------------------------------------------------

    def _check(self, got: bytes) -> tuple[Exception | None, int]:
        try:
            manifest = decode_manifest(got)
            compare_manifest(manifest, self.manifest(), self.layer_ids, require_checksum=self.checksum)
            want, got = self.delta is not None, manifest.get("delta", False)
            if got != want:
                raise ManifestMismatch(
                    f"manifest: expected delta={want} (this Receiver's), got {got!r} "
                    "(the Sender's delta=); both ends need the same"
                )
        except ManifestMismatch as exc:
            return exc, REFUSED_MANIFEST
        self._sums = bool(manifest["checksum"])
        return self._layout_error or self._params_error, REFUSED_PARAMS

    # --- the steps ----------------------------------------------------------------------------------

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, view)`` for every entry of every layer (see ``receive_layers``)."""
        for _, views in self.receive_layers():
            yield from views

    def receive_layers(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """Yield ``(layer_idx, [(name, view), ...])`` per layer, each only after every rank voted that
        it arrived intact: whole kernel-format entries ("full" rank) or this rank's cut of each
        (scatter). A view stays valid until the next item is asked for. If the consumer raises
        while handling a layer, or stops early, this rank refuses at the next vote, so every rank
        stops there. Not with many senders, where an entry arrives in pieces: use ``load_into``."""
        if len(self.senders) > 1 or self.delta is not None:
            raise TypeError(
                "receive_layers: with several senders an entry arrives in pieces from several trainer "
                "ranks, and a delta update rebuilds each layer from the parameters; use load_into(params)"
            )
        return self._whole_layers()

    def _whole_layers(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        steps = self._steps()
        for layer_idx, views in steps:
            try:
                yield layer_idx, [(name, view) for name, view, _ in views]
            except BaseException as exc:
                steps.throw(exc)  # refuses at the next vote, then re-raises exc

    def _steps(self) -> Iterator[tuple[int, list[tuple]]]:
        """The update's steps (``TransferPlan.steps``: one layer each, or several with
        ``step_layers``), pipelined; each item is ``(layer_idx, [(name, view, rows)])``, ``rows``
        the range of the full entry's dim 0 a piece covers (None: all this rank holds). Per step,
        queued with no host wait: the header, this rank's segments of its layers and every rank's
        vote (this rank's header and checksum checks, decided on the device). Then the previous
        step's vote is read, and its layers handed out one by one only if it passed: the next step
        is on the link meanwhile. A consumer's failure is this rank's vote at the next step it
        queues. Each layer voted RESEND_DENSE (delta, one layer a step) is then received again,
        dense; COMPLETE is voted last."""
        self.agree(self._check, self.max_manifest_bytes)
        if self.delta is not None:
            self.delta.begin()
        n = len(self.routes.steps)
        failure: BaseException | None = None
        # (the step queued, the step whose vote is read and whose layers are handed out); a resent
        # layer's step is both at once, added when the last step's vote was read, by every rank
        # (they read the same votes; this rank's failure, if any, is then voted at the first).
        order = [(g, g - 1) for g in range(n)] + [(None, n - 1)]
        for post, g in order:
            if post is not None:
                self._post_step(post, failure)
            if g < 0:
                continue
            resend = self._settle_step(g, failure)
            if post is None and self.delta is not None:
                order += [(r, r) for r in self.delta.resends()]  # a delta update's steps are its layers
            if resend or failure is not None:
                continue
            # No stream wait: reading this step's vote waited for everything queued before it on
            # the link stream, its bytes included. The consumer's error (GeneratorExit too, when it
            # stops early) is caught here, not in a helper generator, so that the steps go on to
            # the vote that stops every rank.
            for pos in self.routes.steps[g]:
                views, slot = self.segment_views(pos)
                try:
                    yield self.layer_ids[pos], views
                except BaseException as exc:  # noqa: BLE001 - voted on at the next step, then raised
                    failure = exc
                    break
            self.ring.release(slot, torch.cuda.current_stream(self.device) if self.link_stream else None)
        self._post_step(n, failure)
        self._settle_step(n, failure)

    def _post_step(self, step: int, failure: BaseException | None) -> None:
        """Queue step ``step`` on the link stream: the header, this rank's segments of its layers
        (none at COMPLETE) and its vote."""
        i = step % 2
        header = self._header_bufs[i]
        try:
            with on_stream(self.link_stream):
                self.link.broadcast(header, self.src)
                header_bad = (header[:5] != self._headers[self.header_row(step), :5]).any()
                sum_bad = self._receive_segments(step) if step < len(self.routes.steps) else None
                self._flags[i] = (header_bad, sum_bad)
                flags = [(header_bad, refusal_code(REFUSED_HEADER, self.rank))]
                if sum_bad is not None:  # a delta layer that differs is resent dense, not refused
                    pos = self.routes.steps[step][0]
                    delta = self.delta is not None and self.delta.is_delta[pos]
                    why = RESEND_DENSE if delta else BAD_CHECKSUM
                    flags.append((sum_bad, refusal_code(why, self.rank)))
                code = refusal_code(CONSUMER_FAILED, self.rank) if failure is not None else 0
                self.step_votes.post(self.link, step, code, flags)
        except Exception as exc:
            raise link_failure(f"receiving {self.step_name(step)} failed", exc) from exc

    def _receive_segments(self, step: int) -> torch.Tensor | None:
        """Receive this rank's segments of the layers of step ``step`` into its ring slot, each
        layer's at its base, in the order every rank posts them (``glm_fp8.transfer.routes``,
        "Order"): layer by layer, the group broadcasts of its classes in class order, each class's
        in sender order, then one exchange for the point-to-point ones of the whole step; a device
        boolean, set when a checksum differs (None: nothing checked)."""
        positions = self.routes.steps[step]
        slot_buf, slot = self.ring.slot(step)
        self.ring.wait_free(slot, self.link_stream)  # the consumer's copies out of its last step
        if self.delta is not None and self.delta.is_delta[positions[0]]:  # one layer a step
            return self.delta.receive(positions[0], slot_buf[self.bases[positions[0]] :])
        recvs = []
        for pos in positions:
            buf = slot_buf[self.bases[pos] :]
            for s in self.mine[pos]:
                data = buf[s.recv_offset : s.recv_offset + s.nbytes]
                if s.group is not None:
                    self.link.group_broadcast(data, self.senders[s.sender], s.group)
                else:
                    recvs.append((data, self.senders[s.sender]))
        self.link.exchange([], recvs)
        if not self._sums:
            return None
        bad = [checksums_bad(slot_buf[self.bases[pos] :], self.mine[pos], self.scratch) for pos in positions]
        bad = [b for b in bad if b is not None]
        return torch.stack(bad).any() if bad else None

    def _settle_step(self, step: int, failure: BaseException | None) -> bool:
        """Read step ``step``'s vote: True when its layer is to be resent dense (RESEND_DENSE);
        when a rank refused, wait for the step queued after it (every rank queued it), then raise:
        the consumer's error, else what this rank found, else an ``UpdateAborted`` naming the rank
        that refused."""
        verdict = self.step_votes.read(step)
        if not verdict:
            return False
        if refusal_reason(verdict) == RESEND_DENSE:
            self.delta.resend(self.routes.steps[step][0])  # a delta update's steps are its layers
            return True
        if self.link_stream is not None:
            self.link_stream.synchronize()
        if failure is not None:
            raise failure
        where = self.step_name(step)
        header_bad, sum_bad = (f is not None and bool(f) for f in self._flags[step % 2])
        # This rank's own finding when it refused for the reason every rank stops for (the vote's
        # maximum may name another rank that found the same).
        mine = BAD_CHECKSUM if sum_bad else REFUSED_HEADER if header_bad else None
        if mine == refusal_reason(verdict) == REFUSED_HEADER:
            expected = self._headers[self.header_row(step)].tolist()
            raise header_error(self._header_bufs[step % 2].tolist(), expected, where)
        if mine == refusal_reason(verdict) == BAD_CHECKSUM:
            pos = self.routes.steps[step][0]
            why = self.delta.why_bad(pos) if self.delta is not None else "a short, long or corrupted message"
            raise UpdateAborted(
                f"{where}: the checksum of a segment received differs from its sender's ({why}); every rank "
                "was stopped"
            )
        raise UpdateAborted(f"{describe_refusal(verdict)} ({where}); the update was stopped")

    def segment_views(self, pos: int, segments: Sequence | None = None) -> tuple[list[tuple], int]:
        """The views of this rank's segments of the layer at ``pos`` (or of ``segments``, some of
        them), in the plan's entry order (``segment_views``), and its step's ring slot."""
        buf, slot = self.ring.slot(self.routes.step_of(pos))
        views = segment_views(
            buf[self.bases[pos] :],
            self.layer_ids[pos],
            self.plans[pos],
            self.mine[pos] if segments is None else segments,
        )
        return views, slot

    # --- landing ------------------------------------------------------------------------------------

    def load_into(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        aliases: Mapping[str, str] | None = None,
        unland: Unland | None = None,
        refusal: Exception | None = None,
    ) -> UpdateStats:
        """Copy (wire 'fp8') or quantize (wire 'bf16': into an fp8 parameter with a ``_scale_inv`` beside
        it, else copied) every received entry into ``params``. ``aliases``: parameter names that
        hold the very tensor of another (alias -> name); they are not written. ``unland(name, dst,
        src)`` (delta): writes into ``dst`` what landed in ``src``, a region of parameter ``name``
        the engine rewrote after landing, and returns True (False: not rewritten, copied as it is;
        ``glm_fp8.engine.postload.postload_inverse``).

        Every name, shape, dtype, device, ``requires_grad`` and aliasing is checked before the first
        byte is received; a failed check is voted on with the manifest, so every rank stops there.
        ``refusal``: a problem the caller found with this rank's engine (its model, its layout),
        voted on and raised alike, in place of the check of ``params``. Raises ``UpdateAborted`` if
        the update did not complete (``params`` then hold a mix of layers and must not be served as
        the new weights)."""
        aliases = dict(aliases or {})
        if self._layout_error is None:
            self._params_error = refusal or self._check_params(params, aliases)
        if self.delta is not None:
            self.delta.params, self.delta.aliases, self.delta.unland = params, aliases, unland
        stats = UpdateStats()
        t0 = time.perf_counter()
        layers = self._steps()
        try:
            for layer_idx, views in layers:
                t = time.perf_counter()
                pos = self.layer_ids.index(layer_idx)
                try:
                    self._land(pos, views, params, aliases)
                except BaseException as exc:
                    layers.throw(exc)  # refuses at the next vote, then re-raises exc
                got = sum(s.nbytes for s in self.mine[pos])  # what arrived, without the buffer's padding
                got = self.delta.received_nbytes(pos) if self.delta is not None else got
                seconds = time.perf_counter() - t
                stats.layers.append(LayerStats(layer_idx, got, seconds, self.plans[pos].nbytes, got))
        finally:
            self._params_error = None
        stats.layers.sort(key=lambda s: self.layer_ids.index(s.layer))  # a resent layer lands last
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _check_params(
        self, params: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
    ) -> Exception | None:
        """The first problem with ``params`` as an exception (not raised), or None."""
        try:
            bf16 = params if self.wire == "bf16" else None
            check_params(
                params, expected_params(self.layer_ids, self.plans, self.targets, bf16), self.device, aliases
            )
        except Exception as exc:  # noqa: BLE001 - reported at the manifest vote, then raised
            return exc
        return None

    def _land(self, pos: int, views, params: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
        fmt = self.plans[pos].scale_fmt if self.wire == "bf16" else None
        if self.delta is not None:
            self.delta.writing(pos)
        land_layer(views, params, self.targets, aliases, full=self.full, quantize_fmt=fmt)
        if len(self.senders) > 1 and self.targets is not None:
            # A padded parameter's rows past V, which no sender sends (a rank may hold nothing but
            # padding and receive no piece of it).
            prefix = layer_prefix(self.layer_ids[pos])
            for e in self.plans[pos].entries:
                target = self.targets.get(prefix + e.name)  # None: an entry this rank does not hold
                if target is not None and target.shard.pad and target.name not in aliases:
                    zero_padding(params[target.name], target)
        if self.delta is not None:
            self.delta.landed(pos)

"""The receiving engine rank: lands the layers of an update in its parameters, each only after
every rank voted that it arrived intact (protocol: ``glm_fp8.transfer.wire``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from glm_fp8.engine.layout import EngineLayout, copy_shard_into
from glm_fp8.engine.specs import EngineParam, engine_params
from glm_fp8.numerics import blocks_shape
from glm_fp8.plan import LayerPlan, layer_prefix
from glm_fp8.quantize import quantize_blockwise
from glm_fp8.transfer.endpoint import (
    Endpoint,
    LayerStats,
    StepVotes,
    UpdateStats,
    link_rank,
    my_rank,
    on_stream,
)
from glm_fp8.transfer.wire import (
    ABORT,
    ABORT_REASONS,
    BAD_CHECKSUM,
    COMPLETE,
    CONSUMER_FAILED,
    DATA,
    HEADER_WORDS,
    MAGIC,
    MAX_MANIFEST_BYTES,
    PROTOCOL_VERSION,
    REFUSED_HEADER,
    REFUSED_MANIFEST,
    REFUSED_PARAMS,
    REFUSED_PRELUDE,
    STATUSES,
    ManifestMismatch,
    UpdateAborted,
    decode_manifest,
    describe_refusal,
    layer_checksum,
    refusal_code,
    refusal_reason,
)


class Receiver(Endpoint):
    """Inference side: receives layer buffers into its own ring and hands out named views.

    Args:
        comm, src: as for ``Broadcaster``.
        config / plans, layer_ids, rest, scale_fmt: what this engine expects (as for
            ``Broadcaster``); a manifest that differs is refused before any parameter is touched.
        ring: receive buffers (2: receive layer i+1 while layer i is copied out; at least 2
            with ``senders``, where layer i waits for its vote while layer i+1 arrives).
        mode: must match the sender's. "bf16" quantizes on receive (``load_into``).
        max_manifest_bytes: the longest manifest accepted (default 64 MiB); a longer announced
            length is refused before anything is allocated from it.
        layout: this engine rank's ``EngineLayout`` (needs ``config``): ``load_into`` then lands
            each entry's shard under vLLM's name and dtype (``glm_fp8.engine.engine_params``),
            copied out of the received layer buffer part by part, with no full-size temporary.
            A layout vLLM refuses is refused at ``load_into``'s first vote (every rank stops
            there; this one raises the ValueError). None: full-size parameters under the
            kernel-format names.
        engines: scatter mode (one sender), the same list as the sender's: this rank receives
            only its shard's bytes.
        senders: many senders (with ``engines``), the same list as the senders': this rank
            receives its shard from every trainer rank that holds a part of it
            (``glm_fp8.engine.routes``); use ``load_into``. Each layer's vote is read after
            the next layer was queued (docs/layouts.md#many-senders).
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
        layout: EngineLayout | None = None,
        rest: bool = False,
        scale_fmt: str | None = None,
        engines: Sequence[EngineLayout | None] | None = None,
        senders: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ):
        self.link_rank = link_rank(comm)
        if engines is not None:
            if layout is None:
                raise ValueError("engines: scatter mode needs this rank's layout= too")
            if not 0 <= self.link_rank < len(engines) or engines[self.link_rank] != layout:
                mine = engines[self.link_rank] if 0 <= self.link_rank < len(engines) else None
                raise ValueError(f"layout: expected engines[{self.link_rank}] (this rank's entry), which is "
                                 f"{mine}; got {layout}")  # fmt: skip
        super().__init__(comm, src, config=config, plans=plans, layer_ids=layer_ids, ring=ring, mode=mode,
                         device=device, rest=rest, scale_fmt=scale_fmt, engines=engines,
                         senders=senders)  # fmt: skip
        self.layout = layout
        self.targets: dict[str, EngineParam] | None = None  # kernel-format name -> engine parameter
        self._layout_error: ValueError | None = None
        if layout is not None:
            if not isinstance(layout, EngineLayout):
                raise TypeError(f"layout: expected an EngineLayout or None, got {type(layout).__name__}")
            if config is None:
                raise ValueError("layout: needs config= (the engine's sharding rules read the model config)")
            if mode != "fp8":
                raise ValueError(
                    "layout: a sharded engine receives mode='fp8' only (quantizing a bf16 shard on "
                    "receive is not supported yet); use layout=None for mode='bf16'"
                )
            try:
                self.targets = self._targets(config, layout)
            except ValueError as exc:
                # A layout vLLM refuses: raised by load_into after every rank voted on it, so
                # that the sender and the other engine ranks stop too instead of timing out.
                self._layout_error = exc
        if max_manifest_bytes < 1:
            raise ValueError(f"max_manifest_bytes: expected at least 1, got {max_manifest_bytes}")
        self.max_manifest_bytes = int(max_manifest_bytes)
        self.recv_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.link_stream = self.recv_stream
        self.expected = self.manifest(False)
        self.rank = my_rank()
        self._params_error: Exception | None = None
        if self.routes is not None:
            if ring < 2:
                raise ValueError(f"ring: many senders need at least 2 receive buffers (a layer waits for its "
                                 f"vote while the next one arrives), got {ring}")  # fmt: skip
            self.step_votes = StepVotes(self.comm, self.device)
            self._headers = self.header_table()
            self._header_bufs = torch.empty(2, HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._step_flags: list[tuple] = [(None, None), (None, None)]

    def _targets(self, config: Mapping, layout: EngineLayout) -> dict[str, EngineParam]:
        targets = {p.kernel_name: p for p in engine_params(config, layout).values()}
        for layer_idx, plan in zip(self.layer_ids, self.plans):
            for e in plan.entries:
                p = targets[layer_prefix(layer_idx) + e.name]
                if p.dtype != e.dtype and (p.dtype, e.dtype) not in _WIDENING:
                    raise ValueError(f"{p.name}: the engine holds {p.dtype}, the wire carries {e.dtype}")
        return targets

    def _slot_nbytes(self) -> int:
        if self.routes is not None:
            return max(lay.recv_nbytes[self.routes.class_of(pos, self.link_rank)]
                       for pos, lay in enumerate(self.routes.layers))  # fmt: skip
        if self.scatter is None:
            return super()._slot_nbytes()
        return max(s.packs[self.scatter.my_class(pos, self.link_rank)].nbytes
                   for pos, s in enumerate(self.scatter.layers))  # fmt: skip

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
        iterating early), this receiver refuses at the next vote, so every rank stops there.
        Not with many senders, where an expert stack arrives in pieces: use ``load_into``."""
        if self.routes is not None:
            raise TypeError("receive_layers: with senders= an expert stack arrives in pieces from several "
                            "trainer ranks; use load_into(params), which lands each piece")  # fmt: skip
        return self._layers(pieces=False)

    def _layers(self, pieces: bool) -> Iterator[tuple[int, list[tuple]]]:
        """``receive_layers`` (one sender); with ``pieces`` each item is ``(name, view, None)``
        as ``_layers_many`` yields them."""
        checksum = self._recv_manifest()
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        for pos, plan in enumerate(self.plans):
            layer_idx = self.layer_ids[pos]
            self._recv_header(header, pos, DATA, layer_idx, self.wire_nbytes(pos))
            pack = None
            if self.scatter is not None:
                k = self.scatter.my_class(pos, self.link_rank)
                pack, group = self.scatter.layers[pos].packs[k], self.scatter.layers[pos].classes[k]
                nbytes = pack.nbytes
            else:
                nbytes = plan.nbytes
            buf, slot = self.ring.slot(pos, nbytes)
            bad = False
            try:
                with on_stream(self.recv_stream):
                    if self.ring.used[slot] and self.ring.free[slot] is not None:
                        # Wait until what the consumer queued on this slot's last layer is done.
                        self.recv_stream.wait_event(self.ring.free[slot])
                    if pack is None:
                        self.comm.broadcast(buf, self.src)
                        if checksum:
                            bad = bool((layer_checksum(buf, self.ring.scratch) != header[5]).item())
                    else:
                        dist.broadcast(buf, self.scatter.src_global, group=self.scatter.groups[group])
                        got = layer_checksum(buf[: pack.data_nbytes], self.ring.scratch)
                        bad = bool((got != pack.checksum_word(buf)).item())
                if self.recv_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.recv_stream)
            except Exception as exc:
                raise UpdateAborted(f"receiving layer {layer_idx} failed: {exc}") from exc
            refused = UpdateAborted(
                f"layer {layer_idx}: the checksum of the {nbytes} bytes received differs from "
                "the sender's (a short, long or corrupted message); every rank was stopped"
            ) if bad else None  # fmt: skip
            self._settle(refused, BAD_CHECKSUM, f" (layer {layer_idx}); the update was stopped")
            prefix = layer_prefix(layer_idx)
            if pack is None:
                views = [(prefix + name, view, None) for name, view in plan.views(buf)]
            else:
                views = [(name, view, None) for name, view in pack.views(buf)]
            if not pieces:
                views = [(name, view) for name, view, _ in views]
            try:
                yield layer_idx, views
            except BaseException:
                # The consumer failed on this layer (or stopped early): stop every rank at the
                # next vote, then let the consumer's error through.
                self._refuse_next_step(header, pos + 1)
                raise
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(torch.cuda.current_stream(self.device))
            self.ring.used[slot] = True
        self._recv_header(header, len(self.plans), COMPLETE, -1, 0)

    # --- many senders --------------------------------------------------------------------------

    def _layers_many(self) -> Iterator[tuple[int, list[tuple]]]:
        """``_layers`` with many senders, pipelined; each item is ``(layer_idx, [(name, view,
        rows)])``, ``rows`` the range of the full entry's dim 0 a piece covers (None: all the rank
        holds). Per layer, queued with no host wait: the header, this rank's segments from their
        senders and every rank's vote (this rank's header and checksum checks, decided on the
        device). Then the previous layer's vote is read, and that layer handed out only if it
        passed: the next layer is on the link meanwhile. A failed vote is read one step late:
        every rank has queued the step after it, and raises once that is done. A consumer's
        failure is this rank's vote at the next step it queues; COMPLETE is voted after the
        last layer was handed out."""
        self._recv_manifest()
        n = len(self.plans)
        failure: BaseException | None = None
        for pos in range(n):
            self._post_step(pos, failure)
            if pos:
                self._settle_step(pos - 1, failure)
                if failure is None:
                    failure = yield from self._hand_out(pos - 1)
        self._settle_step(n - 1, failure)
        if failure is None:
            failure = yield from self._hand_out(n - 1)
        self._post_step(n, failure)
        self._settle_step(n, failure)

    def _segments(self, pos: int) -> tuple[list, torch.Tensor, int]:
        """This rank's segments of the layer at ``pos``, its ring slot's buffer for them, the slot."""
        lay = self.routes.layers[pos]
        k = self.routes.class_of(pos, self.link_rank)
        buf, slot = self.ring.slot(pos, lay.recv_nbytes[k])
        return lay.of_class(k), buf, slot

    def _post_step(self, pos: int, failure: BaseException | None) -> None:
        """Queue step ``pos`` on the receive stream: the header, this rank's segments (none at
        COMPLETE, ``pos`` = number of layers) and its vote."""
        i = pos % 2
        header = self._header_bufs[i]
        where = f"layer {self.layer_ids[pos]}" if pos < len(self.plans) else "the last header"
        try:
            with on_stream(self.recv_stream):
                self.comm.broadcast(header, self.src)
                header_bad = (header[:5] != self._headers[pos, :5]).any()
                sum_bad = None
                if pos < len(self.plans):
                    segments, buf, slot = self._segments(pos)
                    if self.ring.used[slot] and self.ring.free[slot] is not None:
                        # Wait until what the consumer queued on this slot's last layer is done.
                        self.recv_stream.wait_event(self.ring.free[slot])
                    sum_bad = self._recv_segments(buf, segments)
                self._step_flags[i] = (header_bad, sum_bad)
                flags = [(header_bad, refusal_code(REFUSED_HEADER, self.rank))]
                flags += [(sum_bad, refusal_code(BAD_CHECKSUM, self.rank))] if sum_bad is not None else []
                code = refusal_code(CONSUMER_FAILED, self.rank) if failure is not None else 0
                self.step_votes.post(pos, code, flags)
        except Exception as exc:
            raise UpdateAborted(f"receiving {where} failed: {exc}") from exc

    def _settle_step(self, pos: int, failure: BaseException | None) -> None:
        """Read step ``pos``'s vote; when a rank refused, wait for the step queued after it (every
        rank queued it), then raise: the consumer's error, else what this rank found, else an
        ``UpdateAborted`` naming the rank that refused."""
        verdict = self.step_votes.read(pos)
        if not verdict:
            return
        if self.recv_stream is not None:
            self.recv_stream.synchronize()
        if failure is not None:
            raise failure
        last = pos == len(self.plans)
        layer_idx = -1 if last else self.layer_ids[pos]
        header_bad, sum_bad = self._step_flags[pos % 2]
        if verdict != refusal_code(refusal_reason(verdict), self.rank):
            header_bad = sum_bad = None  # another rank's refusal ranks higher: a sender that failed
        if header_bad is not None and bool(header_bad):
            status, nbytes = (COMPLETE, 0) if last else (DATA, self.wire_nbytes(pos))
            got = self._header_bufs[pos % 2].tolist()
            raise self._header_problem(got, pos, status, layer_idx, nbytes, "its segments were refused")
        if sum_bad is not None and bool(sum_bad):
            raise UpdateAborted(
                f"layer {layer_idx}: the checksum of a segment received differs from its sender's (a "
                "short, long or corrupted message); every rank was stopped"
            )
        where = "after the last layer" if last else f"layer {layer_idx}"
        raise UpdateAborted(f"{describe_refusal(verdict)} ({where}); the update was stopped")

    def _hand_out(self, pos: int):
        """Yield the layer at ``pos`` (its vote passed) to the consumer; return the consumer's
        error, if it raised one into this generator, else None."""
        # No stream wait: reading this layer's vote waited for everything queued before it on
        # the receive stream, this layer's bytes included.
        segments, buf, slot = self._segments(pos)
        views = [(p.name, p.view(buf[s.recv_offset : s.recv_offset + s.nbytes]), p.rows)
                 for s in segments for p in s.pieces]  # fmt: skip
        try:
            yield self.layer_ids[pos], views
        except BaseException as exc:  # noqa: BLE001 - voted on at the next step, then raised
            return exc
        finally:
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(torch.cuda.current_stream(self.device))
            self.ring.used[slot] = True
        return None

    def _recv_segments(self, buf: torch.Tensor, segments) -> torch.Tensor | None:
        """Receive this rank's segments of a layer from their senders into ``buf``; a device
        boolean, set when a checksum differs (None: no segment)."""
        msgs = [
            (buf[s.recv_offset : s.recv_offset + s.nbytes], self.routes.senders[s.sender]) for s in segments
        ]
        self.comm.exchange([], msgs)
        bad = [layer_checksum(m[: s.data_nbytes], self.ring.scratch) != s.checksum_word(m)
               for s, (m, _) in zip(segments, msgs)]  # fmt: skip
        return torch.stack(bad).any() if bad else None

    def load_into(self, params: Mapping[str, torch.Tensor]) -> UpdateStats:
        """Copy (fp8 mode) or quantize (bf16 mode) every received entry into ``params``.

        Every name, shape, dtype, device and ``requires_grad`` is checked against ``params``
        before the first byte is received; a failed check is voted on with the manifest, so
        every rank stops there. Raises ``UpdateAborted`` if the update did not complete
        (``params`` then hold a mix of layers and must not be served as the new weights).
        """
        self._params_error = self._layout_error or self._check_params(params)
        stats = UpdateStats()
        t0 = time.perf_counter()
        layers = self._layers_many() if self.routes is not None else self._layers(pieces=True)
        try:
            for layer_idx, views in layers:
                t = time.perf_counter()
                pos = self.layer_ids.index(layer_idx)
                fmt = self.plans[pos].scale_fmt
                try:
                    for name, view, rows in views:
                        if self.scatter is not None or self.routes is not None:
                            _land_piece(params[self.targets[name].name], view, self.targets[name], rows)
                        elif self.targets is not None:
                            _land_shard(params[self.targets[name].name], view, self.targets[name])
                        elif self.mode == "bf16" and name + "_scale_inv" in params:
                            quantize_blockwise(view, out=params[name], scale_out=params[name + "_scale_inv"],
                                               scale_fmt=fmt, check_finite=False)  # fmt: skip
                        else:
                            params[name].copy_(view, non_blocking=True)
                    if self.routes is not None:
                        # A padded parameter's rows past V, which no sender sends (a rank may
                        # hold nothing but padding and receive no piece of it).
                        prefix = layer_prefix(layer_idx)
                        for e in self.plans[pos].entries:
                            target = self.targets[prefix + e.name]
                            if target.shard.pad:
                                _zero_padding(params[target.name], target)
                except BaseException as exc:
                    layers.throw(exc)  # refuses at the next vote, then re-raises exc
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
                    if self.targets is not None:
                        t = self.targets[name]
                        if t.name not in params:
                            raise KeyError(f"params: missing {t.name!r} ({t.dtype}, {t.shape}; vLLM's name)")
                        check_param(t.name, params[t.name], t.dtype, tuple(t.shape), self.device)
                        continue
                    if name not in params:
                        raise KeyError(f"params: missing {name!r} ({e.dtype}, {tuple(e.shape)})")
                    p = params[name]
                    want_dtype = e.dtype if self.mode == "fp8" else quantized_dtype(e, params, name)
                    check_param(name, p, want_dtype, tuple(e.shape), self.device)
                    if want_dtype == torch.float8_e4m3fn and self.mode == "bf16":
                        nb = blocks_shape(e.shape[-2], e.shape[-1], *e.shape[:-2])
                        check_param(name + "_scale_inv", params[name + "_scale_inv"], torch.float32, nb,
                                     self.device)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported at the manifest vote, then raised
            return exc
        return None

    def vote(self, code: int) -> int:
        try:
            return super().vote(code)
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
        self._settle(refused, REFUSED_PRELUDE, "; nothing was sent")
        data = torch.empty(n, dtype=torch.uint8, device=self.device)
        try:
            self.comm.broadcast(data, self.src)
            raw = data.cpu()
        except Exception as exc:
            raise UpdateAborted(f"receiving the manifest failed: {exc}") from exc
        manifest = None
        try:
            manifest = decode_manifest(raw)
            self._check_manifest(manifest)
            refused, reason = self._params_error, REFUSED_PARAMS
        except ManifestMismatch as exc:
            refused, reason = exc, REFUSED_MANIFEST
        self._settle(refused, reason, "; nothing was sent")
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
        if got.get("scatter") != want.get("scatter"):
            engines = [
                (m or {}).get("engines") if isinstance(m, dict) else m
                for m in (want.get("scatter"), got.get("scatter"))
            ]
            raise ManifestMismatch(
                "manifest: the scatter plan differs (engines= must be the same list on every rank): "
                f"expected engines {engines[0]}, got {engines[1]}"
            )
        layers = got.get("layers")
        if not isinstance(layers, list) or len(layers) != len(want["layers"]):
            n = len(layers) if isinstance(layers, list) else layers
            raise ManifestMismatch(f"manifest: expected {len(want['layers'])} layers, got {n}")
        for g, w in zip(layers, want["layers"]):
            if g != w:
                if isinstance(g, dict) and g.get("layer") != w["layer"]:
                    raise ManifestMismatch(
                        f"manifest: expected layers {self.layer_ids} in this order (-1: the non-layer "
                        f"tensors), got layer {g.get('layer')!r} where {w['layer']} was expected"
                    )
                if isinstance(g, dict) and g.get("scale_fmt") != w["scale_fmt"]:
                    raise ManifestMismatch(
                        f"manifest: layer {w['layer']}: expected scale_fmt {w['scale_fmt']!r} (this "
                        f"receiver's), got {g.get('scale_fmt')!r}; sender and receivers need the same one"
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
            with on_stream(self.recv_stream):  # read it on the stream that received it
                self.comm.broadcast(header, self.src)
                got = header.tolist()
        except Exception as exc:
            raise UpdateAborted(f"the link to the sender failed: {exc}") from exc
        where = f"before layer {layer_idx}" if status == DATA else "after the last layer"
        if got[0] == MAGIC and got[1] == ABORT:
            why = ABORT_REASONS.get(got[6], f"reason {got[6]}")
            raise UpdateAborted(f"the sender aborted the update {where}: {why}")
        refused = "refused before receiving anything of it"
        problem = self._header_problem(got, pos, status, layer_idx, nbytes, refused)
        self._settle(problem, REFUSED_HEADER, f" ({where}); the update was stopped")

    @staticmethod
    def _header_problem(
        got: list[int], pos: int, status: int, layer_idx: int, nbytes: int, refused: str
    ) -> UpdateAborted | None:
        """The error for a header ``got`` other than the manifest's (``refused``: what became of
        the layer's bytes), else None."""
        want = [MAGIC, status, layer_idx, pos, nbytes]
        if got[:5] == want:
            return None
        where = f"before layer {layer_idx}" if status == DATA else "after the last layer"
        names = ("magic", "status", "layer", "position", "nbytes")
        k = next(i for i in range(5) if got[i] != want[i])
        show = (lambda v: STATUSES.get(v, v)) if k == 1 else (lambda v: v)
        return UpdateAborted(
            f"layer header {where}: expected {names[k]} {show(want[k])} (the manifest's), got "
            f"{show(got[k])}; {refused}, every rank was stopped"
        )

    def _settle(self, refused: Exception | None, reason: int, context: str) -> None:
        """One vote: this rank refuses for ``reason`` when ``refused`` holds its error (then
        raises it), and raises ``UpdateAborted`` naming another rank's refusal (``context``
        appended) when one refused; returns when every rank voted 0."""
        verdict = self.vote(refusal_code(reason, self.rank) if refused is not None else 0)
        if refused is not None:
            raise refused
        if verdict:
            raise UpdateAborted(f"{describe_refusal(verdict)}{context}")

    def _refuse_next_step(self, header: torch.Tensor, pos: int) -> None:
        """After a local failure: take part in the next header and refuse at its vote, so every
        rank stops there instead of waiting for a timeout."""
        try:
            with on_stream(self.recv_stream):
                self.comm.broadcast(header, self.src)
                status = int(header[1].item())
            if status != ABORT:
                self.vote(refusal_code(CONSUMER_FAILED, self.rank))
        except Exception:  # noqa: BLE001 - the link is gone too; the local error is what matters
            pass


def check_param(
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


def quantized_dtype(e, params: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """bf16 mode: a quantizable entry lands in an fp8 parameter that has a scale beside it."""
    if name + "_scale_inv" in params:
        return torch.float8_e4m3fn
    return e.dtype


# (engine dtype, wire dtype) pairs a landing converts exactly: vLLM keeps a few small tensors
# (indexer.k_norm, e_score_correction_bias) in float32 while the trainer sends bf16.
_WIDENING = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)}


def _land_shard(dst: torch.Tensor, view: torch.Tensor, target: EngineParam) -> None:
    """Copy this rank's cut of a received entry into its engine parameter (no full-size
    temporary; a widening entry is one small 1-D tensor, converted whole)."""
    if dst.dtype != view.dtype:
        view = view.to(dst.dtype)
    copy_shard_into(dst, view, target.shard)


def _land_piece(
    dst: torch.Tensor, view: torch.Tensor, target: EngineParam, rows: tuple[int, int] | None = None
) -> None:
    """Scatter mode: ``view`` is already this rank's cut without its padding rows; those are
    zeroed here. Many senders: ``rows`` [a, b) of the full entry's dim 0 (experts, vocabulary
    rows), cut along its other dims, land at the rank's rows for them (padding rows: see
    ``_zero_padding``)."""
    shard = target.shard
    if rows is not None:
        cuts_rows = shard.cuts_rows(dst.dim())
        dst = dst.narrow(0, rows[0] - (shard.parts[0][0] if cuts_rows else 0), rows[1] - rows[0])
        if cuts_rows:  # the rank's own rows, whole
            dst.copy_(view)
            return
    if shard.kind == "replicated":
        dst.copy_(view)
        return
    dst.narrow(shard.dim, 0, shard.length - shard.pad).copy_(view)
    if rows is None:
        _zero_padding(dst, target)


def _zero_padding(dst: torch.Tensor, target: EngineParam) -> None:
    """Zero a padded parameter's padding rows (vocabulary rows past V)."""
    shard = target.shard
    if shard.pad:
        dst.narrow(shard.dim, shard.length - shard.pad, shard.pad).zero_()

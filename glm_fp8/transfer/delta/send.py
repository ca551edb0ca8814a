"""The sender's side of a delta update (docs/delta.md#in-the-transfer): its kept copy of every
segment it last sent, the versions exchange, and per layer either today's dense segments or, for
each segment, its counts message and payload (``glm_fp8.transfer.delta.segments``)."""

from __future__ import annotations

import time

import torch

from glm_fp8.transfer.delta.segments import LayerSizes, SegmentDelta, delta_to, exchange_versions, zero_gaps
from glm_fp8.transfer.delta.versions import NONE, KeptVersions
from glm_fp8.transfer.delta.wire import pack_bytes_delta
from glm_fp8.transfer.endpoint import Ring, Side, on_stream
from glm_fp8.transfer.options import DeltaOptions
from glm_fp8.transfer.routes import Segment


class SenderDelta:
    """A sender's delta state across updates: per (layer position, its segment) the bytes it last
    sent (``kept``, persistent: the sender's whole share), their versions, the update counter.

    The ``Sender`` owns one and calls it at fixed points of each update (``begin``; per layer
    ``begin_layer``, ``zero_gaps``, ``compare``, ``compared``, ``send``; ``resend`` / ``resends`` /
    ``restore`` for a layer to send again, dense). It is given what it uses of the sender at
    construction: the sender's ``Side``, its index among the senders (``me``), its two rings (the
    conversion slots and the send slots, whose buffers the dense segments are read from), its
    conversion stream and checksum scratch.
    """

    def __init__(
        self,
        side: Side,
        options: DeltaOptions,
        *,
        me: int,
        conv_ring: Ring,
        send_ring: Ring | None,
        convert_stream: torch.cuda.Stream | None,
        scratch: torch.Tensor,
    ):
        self.side, self.options, self.me = side, options, me
        self.conv_ring, self.send_ring = conv_ring, send_ring
        self.convert_stream, self.scratch = convert_stream, scratch
        n = len(side.routes.layers)
        self.versions = KeptVersions(n)
        # Update numbers start at the clock, so that a rebuilt Sender never reuses one an engine
        # rank may still hold from its predecessor; the senders agree on the largest proposed.
        self.proposal, self.count, self.update = time.time_ns(), 0, NONE
        self.segs = [[SegmentDelta.of(seg) for seg in lay.of_sender(me)] for lay in side.routes.layers]
        self.kept: list[list[torch.Tensor] | None] = [None] * n
        # Kept in pinned host memory on a GPU: the comparison reads it and writes its changed bytes
        # in place, through the device's mapping of that memory (``device_alias``), so only the
        # old bytes cross PCIe, once, and the few changed ones back.
        self.host = options.kept == "host" and side.device.type == "cuda"
        sizes = [LayerSizes.of(segs) for segs in self.segs]
        # The Triton kernels run on the CPU only under the interpreter (a test tool): the torch path there.
        self.backend = "torch" if side.device.type == "cpu" else None
        self.is_delta = [False] * n  # some engine rank takes the layer as a delta
        self.fresh: list[frozenset[int]] = [frozenset()] * n  # which ones (delta.segments.delta_layers)
        self.buf_nbytes = max((x.messages + x.bounds for x in sizes), default=0)
        self.bufs: list[torch.Tensor | None] = [None] * conv_ring.size
        self.lengths_host: list[torch.Tensor | None] = [None] * conv_ring.size
        self.ready: dict[int, tuple[list, tuple]] = {}  # per layer: messages, their lengths
        self.sent: dict[int, int] = {}
        self.delivered: dict[int, int] = {}
        self.resent: set[int] = set()

    def begin(self) -> None:
        """Before the first layer: the versions exchange, every layer's step (delta or dense)."""
        self.count += 1
        resync = self.options.resync_every is not None and (self.count - 1) % self.options.resync_every == 0
        row = [NONE if resync else k for k in self.versions.kept] + [self.proposal]
        self.update, self.fresh = exchange_versions(self.side, row)
        self.is_delta = [bool(f) for f in self.fresh]
        self.proposal = max(self.proposal, self.update + 1)
        self.ready.clear()
        self.sent.clear()
        self.delivered.clear()
        self.resent.clear()

    def resend(self, pos: int) -> None:
        """Layer ``pos``'s vote was RESEND_DENSE: an engine rank's rebuilt and changed segment
        differed from its checksum; the layer goes again, dense, after the last layer."""
        self.resent.add(pos)

    def resends(self) -> list[int]:
        """The layers to send again, dense (in order): from now on their steps are dense ones."""
        for pos in self.resent:
            self.is_delta[pos], self.fresh[pos] = False, frozenset()
        return sorted(self.resent)

    def restore(self, pos: int) -> torch.cuda.Event | None:
        """Before resending ``pos`` dense: its segments' data bytes from the kept copy (which this
        update's comparison moved to the new bytes: the dense segments' own) and their checksum
        words, into the ring slots the dense send reads (conversion stream; its event, on CUDA)."""
        s = self
        conv, ci = s.conv_ring.slot(pos)
        out, pi = s.send_ring.slot(pos) if s.send_ring is not None else (None, 0)
        with on_stream(s.convert_stream):
            s.conv_ring.wait_free(ci, s.convert_stream)
            if out is not None:
                s.send_ring.wait_free(pi, s.convert_stream)
            for seg, kept in zip(self.side.routes.layers[pos].of_sender(self.me), self.kept[pos]):
                region = seg.source(conv, out)
                region[: kept.numel()].copy_(kept, non_blocking=True)
                seg.seal(region, s.scratch)
            if s.convert_stream is None:
                return None
            ready = torch.cuda.Event()
            ready.record(s.convert_stream)
            return ready

    def zero_gaps(self, pos: int, conv: torch.Tensor, out: torch.Tensor | None) -> None:
        """Zero the bytes between pieces of this sender's segments of ``pos``, before their
        checksums are taken (both ends then hold zeros there)."""
        for seg in self.side.routes.layers[pos].of_sender(self.me):
            zero_gaps(seg.source(conv, out), seg)

    def graph_key(self, pos: int) -> tuple:
        """What of this update decides which kernels ``compare`` queues for ``pos`` (its buffers
        stay where they were first allocated): a key part for ``glm_fp8.transfer.graphs``."""
        return self.is_delta[pos], self.fresh[pos]

    def needs_seal(self, pos: int, seg: Segment) -> bool:
        """Whether ``seg`` of ``pos`` needs its checksum word in its ring slot: some rank takes it
        dense. A segment that every rank of its class takes as a delta travels as its counts
        message, whose checksum word ``compare`` takes as it reads the bytes (no pass of its own)."""
        if not self.is_delta[pos]:
            return True
        lay = self.side.routes.layers[pos]
        return len(delta_to(lay, seg, self.fresh[pos])) < len(lay.classes[seg.cls])

    def begin_layer(self, pos: int) -> None:
        """Before ``pos``'s kernels: its kept copy is about to change; no version until ``compared``."""
        self.versions.kept[pos] = NONE

    def compare(self, pos: int, conv: torch.Tensor, out: torch.Tensor | None) -> tuple | None:
        """After the layer was converted and packed (checksum words written): a delta step packs
        the changes of each segment some rank takes as a delta against the kept copy (which
        ``pack_bytes_delta`` moves to the new bytes), queued behind the conversion with no host
        read; the other segments, and every segment of a dense step, copy the new bytes into the
        kept copy. Kernels only (a sender may capture them: ``glm_fp8.transfer.graphs``); returns
        what ``compared`` takes."""
        lay = self.side.routes.layers[pos]
        segs = lay.of_sender(self.me)
        datas = [seg.source(conv, out) for seg in segs]
        if self.kept[pos] is None:
            self.kept[pos] = [self.new_kept(seg.data_nbytes) for seg in segs]
        kept = self.kept[pos]
        if not self.is_delta[pos]:
            for k, data in zip(kept, datas):
                k.copy_(data[: k.numel()], non_blocking=True)
            return None
        buf = self._buf(pos)
        at, msgs, lengths = 0, [], []
        for seg, sd, data, k in zip(segs, self.segs[pos], datas, kept):
            msg = buf[at : at + sd.message_nbytes]
            payload = buf[at + sd.message_nbytes : at + sd.message_nbytes + sd.bound]
            at += sd.message_nbytes + sd.bound
            if not delta_to(lay, seg, self.fresh[pos]):  # every rank of it takes it dense
                k.copy_(data[: k.numel()], non_blocking=True)
                msgs.append((msg, None))
                continue
            words = sd.words(msg)
            # No host read here: the lengths are read once for the layer, when it is sent. The
            # new segment's checksum word comes from the comparison's read of its bytes.
            pack_bytes_delta(
                sd.views(data),
                sd.views(device_alias(k, data.device) if self.host else k),
                sd.pieces,
                sd.counts(msg),
                words[:1],
                payload,
                backend=self.backend,
                checksum=words[1:],
            )
            msgs.append((msg, payload))
            lengths.append(words[:1])
        return msgs, (torch.cat(lengths) if lengths else None)

    def compared(self, pos: int, result: tuple | None) -> None:
        """After ``compare``'s kernels were queued (run or replayed), with what it returned: the
        kept copy's version, and a delta step's messages and their lengths on their way to the host."""
        self.versions.compared(pos, self.update)
        if result is not None:
            msgs, lengths = result
            self.ready[pos] = (msgs, self._lengths(pos, lengths))

    def _lengths(self, pos: int, lengths: torch.Tensor | None) -> tuple[torch.Tensor | None, object]:
        """The layer's payload lengths (int64, one per delta segment, on the device) on their way to
        the host: a pinned buffer of the ring slot's and the event that tells they are there (CUDA)."""
        if lengths is None or self.convert_stream is None:
            return lengths, None
        i = pos % len(self.lengths_host)
        if self.lengths_host[i] is None:
            n = max(len(segs) for segs in self.segs)
            self.lengths_host[i] = torch.empty(n, dtype=torch.int64, pin_memory=True)
        host = self.lengths_host[i][: lengths.numel()]
        host.copy_(lengths, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.convert_stream)
        return host, event

    def new_kept(self, nbytes: int) -> torch.Tensor:
        if not self.host:  # on the device (kept="gpu", or any copy of a sender on the CPU)
            return torch.empty(nbytes, dtype=torch.uint8, device=self.side.device)
        # Pinned: mapped into the device's address space (the comparison reads and writes it in
        # place), and a dense layer's bytes copied into it asynchronously.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _buf(self, pos: int) -> torch.Tensor:
        i = pos % len(self.bufs)
        if self.bufs[i] is None:
            self.bufs[i] = torch.empty(self.buf_nbytes, dtype=torch.uint8, device=self.side.device)
        return self.bufs[i]

    def send(self, pos: int, conv: torch.Tensor, out: torch.Tensor | None) -> None:
        """Post a delta step's messages (link stream) as the dense segments travel: to each rank
        that takes a segment as a delta (``delta_to``) its counts message, then its payload (none
        when empty), to the others the dense segment (``conv`` / ``out``: the ring slots); the
        group broadcasts in class order (every counts message or dense segment, then the payloads),
        then one exchange of the counts messages and dense segments and one of the payloads. A
        step that did not convert sends no change and its stale checksum word: its vote refuses
        it."""
        s = self.side
        lay = s.routes.layers[pos]
        msgs, (lengths, event) = self.ready.pop(pos, (None, (None, None)))
        if msgs is None:
            msgs = []
            for sd in self.segs[pos]:
                msg = torch.zeros(sd.message_nbytes, dtype=torch.uint8, device=s.device)
                msgs.append((msg, msg[:0]))
        else:
            if event is not None:
                event.synchronize()  # the layer's one host read: its payloads' lengths
            ns = iter(lengths.tolist() if lengths is not None else ())
            msgs = [(msg, msg[:0] if payload is None else payload[: next(ns)]) for msg, payload in msgs]
        first, payloads, group_payloads, sent, delivered = [], [], [], 0, 0
        for seg, (msg, payload) in zip(lay.of_sender(self.me), msgs):
            to = delta_to(lay, seg, self.fresh[pos])
            data = seg.source(conv, out)
            if seg.group is not None:
                part = msg if to else data
                s.link.group_broadcast(part, s.rank, seg.group)
                sent += part.numel()
                delivered += part.numel() * (len(seg.group) - 1)
                group_payloads += [(payload, seg.group)] if to and payload.numel() else []
                continue
            for r in lay.classes[seg.cls]:
                first.append((msg if r in to else data, r))
                payloads += [(payload, r)] if r in to and payload.numel() else []
                n = msg.numel() + payload.numel() if r in to else data.numel()
                sent, delivered = sent + n, delivered + n
        for payload, group in group_payloads:  # after every counts message: a receiver reads them at once
            s.link.group_broadcast(payload, s.rank, group)
            sent += payload.numel()
            delivered += payload.numel() * (len(group) - 1)
        s.link.exchange(first, [])
        s.link.exchange(payloads, [])
        self.sent[pos], self.delivered[pos] = sent, delivered

    def sent_nbytes(self, pos: int) -> int:
        """What this sender put on the link for ``pos``: its delta messages, or the dense segments."""
        return self.sent[pos] if pos in self.sent else self.side.routes.layers[pos].sent_nbytes(self.me)

    def delivered_nbytes(self, pos: int) -> int:
        """What the engine ranks received of this sender for ``pos`` (a group broadcast once per
        receiving rank): its delta messages, or the dense segments."""
        if pos in self.delivered:
            return self.delivered[pos]
        return self.side.routes.layers[pos].delivered_nbytes(self.me)


class _CudaArray:
    """The CUDA array interface (version 3) of ``nbytes`` bytes at ``ptr``: what ``torch.as_tensor``
    makes a CUDA tensor of, without a copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned, uint8, contiguous) as a tensor of the CUDA ``device`` at the same bytes: under
    unified addressing CUDA maps pinned host memory into every device's address space, so a kernel
    given the alias reads and writes host memory in place, over PCIe (Triton's launcher asks the
    driver for each pointer's device address). The alias does not own the memory: ``host`` must
    outlive every kernel queued on it."""
    if host.numel() == 0 and host.dtype == torch.uint8:  # no bytes, no pinned allocation to map
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not host.is_pinned() or host.dtype != torch.uint8 or not host.is_contiguous():
        raise ValueError(
            f"device_alias: expected a pinned contiguous uint8 tensor, got {host.dtype} {host.device}"
        )
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(host.data_ptr(), host.numel()), device=device)


__all__ = ["SenderDelta", "device_alias"]

"""An engine rank's side of a delta update (docs/delta.md#in-the-transfer): the versions it holds,
and per delta layer its segments rebuilt from its parameters (the inverse of landing), the
sender's changes applied, the sender's checksum word written, so that the checksum check of a
dense segment proves the result exact before anything lands (``glm_fp8.transfer.delta.segments``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from glm_fp8.core.errors import UpdateAborted
from glm_fp8.engine.specs import EngineParam
from glm_fp8.kernels.delta import apply_delta
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.delta.segments import LayerSizes, SegmentDelta, delta_to, exchange_versions, zero_gaps
from glm_fp8.transfer.delta.versions import NONE, HeldVersions
from glm_fp8.transfer.delta.wire import payload_layout, unpack_delta
from glm_fp8.transfer.endpoint import Side, checksums_bad, segment_views
from glm_fp8.transfer.land import full_region, piece_region
from glm_fp8.transfer.pack import ShardPack

# load_into's ``unland(name, dst, src)``: ``dst`` <- what landed in ``src``, a region of parameter
# ``name`` the engine rewrote after landing; False: not rewritten (glm_fp8.engine.postload).
Unland = Callable[[str, torch.Tensor, torch.Tensor], bool]


def check_receiver_delta(
    *,
    wire: str,
    checksum: bool,
    full: bool,
    layout: object,
    rank: int,
    layer_ids: Sequence[int],
    plans: Sequence[LayerPlan],
    targets: Mapping[str, EngineParam] | None,
) -> None:
    """Delta is built where landing is a plain byte copy of what arrives, so that the old segment
    can be rebuilt from the parameters: kernel-format parameters, or an engine layout that receives
    its own cut pieces (scatter). Raises ValueError naming what converts, otherwise."""
    if wire != "fp8":
        raise ValueError(
            f"delta: needs wire='fp8' (got {wire!r}); with 'bf16' this rank quantizes on "
            "receive, so its parameters are not the bytes that arrived"
        )
    if not checksum:
        raise ValueError("delta: needs checksum=True: the checksum is what proves each rebuilt segment exact")
    if full and layout is not None:
        raise ValueError(
            f"delta: engines[{rank}] is 'full' with a layout: landing cuts this rank's shard from whole "
            "entries, so its parameters do not hold the bytes that arrived; give this rank's EngineLayout "
            "in engines (it then receives only its shard) or use layout=None"
        )
    for layer_idx, plan in zip(layer_ids, plans):
        for e in plan.entries if targets is not None else ():
            p = targets.get(layer_prefix(layer_idx) + e.name)  # None: an entry this rank does not hold
            if p is not None and p.dtype != e.dtype:
                raise ValueError(
                    f"delta: {p.name} lands widened ({e.dtype} on the wire, {p.dtype} in the engine), so "
                    "its parameter does not hold the bytes that arrived; send it in the engine's dtype"
                )


class ReceiverDelta:
    """An engine rank's delta state across updates: the versions it holds (``held``: none for a
    new Receiver, so a restarted rank gets every layer dense), this update's number and steps.

    The ``Receiver`` owns one and calls it at fixed points of each update (``begin``; per layer
    ``receive`` for a delta step, ``writing`` / ``landed`` around landing; ``resend`` / ``resends``
    for a layer to take again, dense); ``load_into`` hands it the parameters (``params``,
    ``aliases``, ``unland``). It is given what it uses of the receiver at construction: the
    receiver's ``Side``, the update's layers and their plans, this rank's segments of each layer
    (``mine``), the landing targets (None: kernel-format parameters) and the checksum scratch."""

    def __init__(
        self,
        side: Side,
        *,
        layer_ids: Sequence[int],
        plans: Sequence[LayerPlan],
        mine: Sequence[Sequence[ShardPack]],
        targets: Mapping[str, EngineParam] | None,
        scratch: torch.Tensor,
    ):
        self.side, self.layer_ids, self.plans = side, layer_ids, plans
        self.mine, self.targets, self.scratch = mine, targets, scratch
        n = len(mine)
        self.held = HeldVersions(n)
        self.update, self.is_delta = NONE, [False] * n  # this rank takes deltas of it
        self.fresh: list[frozenset[int]] = [frozenset()] * n  # delta.segments.delta_layers
        self.segs = [[SegmentDelta.of(seg) for seg in segs] for segs in mine]
        sizes = [LayerSizes.of(segs) for segs in self.segs]
        self.msg_nbytes = max((x.messages for x in sizes), default=0)
        self.payload_nbytes = max((x.bounds for x in sizes), default=0)
        self.bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.params: Mapping[str, torch.Tensor] | None = None
        self.aliases: Mapping[str, str] = {}
        self.unland: Unland | None = None  # load_into's
        self.got: dict[int, int] = {}
        self.resent: dict[int, int] = {}  # layer position -> the bytes its delta step took
        # Layers this rank takes dense from then on: an alias whose rebuild differed, a rebuild that raised.
        self.dense_only: set[int] = set()
        # The Triton kernels run on the CPU only under the interpreter (a test tool): the torch path there.
        self.backend = "torch" if side.device.type == "cpu" else None

    def begin(self) -> None:
        """Before the first layer: the versions exchange, every layer's step (delta or dense)."""
        self.update, self.fresh = exchange_versions(self.side, [*self.row(), NONE])
        self.is_delta = [self.side.rank in f for f in self.fresh]
        self.got.clear()
        self.resent.clear()

    def resend(self, pos: int) -> None:
        """Layer ``pos``'s vote was RESEND_DENSE: some engine rank's rebuilt and changed segment
        differs from its sender's checksum; every rank takes the layer again, dense, before COMPLETE."""
        self.resent[pos] = self.got.pop(pos, 0)
        if self.aliased(pos):
            self.dense_only.add(pos)

    def resends(self) -> list[int]:
        """The layers to receive again, dense (in order): from now on their steps are dense ones."""
        for pos in self.resent:
            self.is_delta[pos], self.fresh[pos] = False, frozenset()
        return sorted(self.resent)

    def row(self) -> list[int]:
        """The held versions as this rank votes them. A layer with an aliased parameter
        (``load_into``'s ``aliases``: landing skips it, it holds another parameter's bytes, e.g. the
        MTP drafter's ``shared_head.head``, the target's ``lm_head``) is rebuilt from that parameter,
        which is exact where the trainer ties the two; once such a layer's rebuild differed (untied,
        or the other parameter updated apart) it votes ``NONE`` for it: dense from then on; so does
        a layer whose rebuild raised."""
        row = list(self.held.held)
        for pos in self.dense_only:
            row[pos] = NONE
        return row

    def aliased(self, pos: int) -> bool:
        """Whether a parameter this rank lands layer ``pos`` into is an alias of another."""
        names = {p.name for s in self.mine[pos] for p in s.pieces}
        if self.targets is not None:
            names = {self.targets[n].name for n in names}
        return bool(names & set(self.aliases))

    def writing(self, pos: int) -> None:
        self.held.writing(pos)

    def landed(self, pos: int) -> None:
        """Layer ``pos`` landed after its vote passed: this rank holds this update of it."""
        self.held.holds(pos, self.update)

    def why_bad(self, pos: int) -> str:
        """Why a segment of ``pos`` may have failed its checksum, for the error."""
        if pos in self.resent:
            return "a delta layer resent dense after its rebuilt bytes differed: a corrupted message"
        return "a short, long or corrupted message"

    def received_nbytes(self, pos: int) -> int:
        """What this rank took off the link for ``pos``: its delta messages, or its dense segments
        (and the delta messages before them, for a resent layer)."""
        if pos in self.got:
            return self.got[pos]
        return sum(s.nbytes for s in self.mine[pos]) + self.resent.get(pos, 0)

    def receive(self, pos: int, buf: torch.Tensor) -> torch.Tensor | None:
        """Receive a layer this rank takes deltas of into ``buf`` (its ring slot): the segments it
        takes as deltas (``delta_to``; the others arrive dense, as in a dense step) rebuilt from the
        parameters; then, in the order the sender posts them, each delta segment's counts message
        and payload; apply them, write the sender's checksum words and check every segment as a
        dense layer's. A device boolean: some segment's checksum differs, or its counts failed
        their check (its payload was taken, within the plan's bound, and dropped); None: nothing to
        check."""
        r = self.side
        lay, segs, sds = r.routes.layers[pos], self.mine[pos], self.segs[pos]
        if self.bufs is None:
            self.bufs = (
                torch.empty(self.msg_nbytes, dtype=torch.uint8, device=r.device),
                torch.empty(self.payload_nbytes, dtype=torch.uint8, device=r.device),
            )
        items, a, b = [], 0, 0
        for seg, sd in zip(segs, sds):
            delta = r.rank in delta_to(lay, seg, self.fresh[pos])
            region = buf[seg.recv_offset : seg.recv_offset + seg.nbytes]
            items.append(
                (
                    seg,
                    sd,
                    delta,
                    region,
                    self.bufs[0][a : a + sd.message_nbytes],
                    self.bufs[1][b : b + sd.bound],
                    a,
                )
            )
            a, b = a + sd.message_nbytes, b + sd.bound
        bad, got = [], 0
        try:
            self._rebuild(pos, buf, [it[0] for it in items if it[2]])
        except UpdateAborted:
            raise
        except Exception as exc:  # noqa: BLE001 - the link stays in step; the layer is resent dense
            warnings.warn(
                f"delta: rebuilding layer {lay.layer_idx} from the parameters failed ({exc}); "
                "it is resent dense, and taken dense from then on",
                stacklevel=2,
            )
            self.dense_only.add(pos)
            bad.append(torch.tensor(True, device=buf.device))
        # Every counts message (or dense segment) first, then the payloads, as the senders post
        # them: the payloads' lengths are read together, with one wait.
        groups = [it for it in items if it[0].group is not None]
        for seg, _, delta, region, msg, _, _ in groups:
            r.link.group_broadcast(msg if delta else region, r.senders[seg.sender], seg.group)
        lengths = self._lengths(groups)
        for (seg, *_, pay, _), (n, _) in zip(groups, lengths):
            if n:
                r.link.group_broadcast(pay[:n], r.senders[seg.sender], seg.group)
        p2p = [it for it in items if it[0].group is None]
        r.link.exchange(
            [],
            [(msg if delta else region, r.senders[seg.sender]) for seg, _, delta, region, msg, _, _ in p2p],
        )
        p2p_lengths = self._lengths(p2p)
        sizes = zip(p2p, p2p_lengths)
        r.link.exchange([], [(it[5][:n], r.senders[it[0].sender]) for it, (n, _) in sizes if n])
        for (seg, sd, delta, region, msg, pay, _), (n, layout) in zip(groups + p2p, lengths + p2p_lengths):
            if delta:
                bad.append(self._apply(seg, sd, region, msg, pay[:n], layout))
            got += msg.numel() + n if delta else seg.nbytes
        self.got[pos] = got
        sums = checksums_bad(buf, segs, self.scratch)
        bad += [sums] if sums is not None else []
        return torch.stack(bad).any() if bad else None

    def _lengths(self, items: list) -> list[tuple[int, tuple | None]]:
        """``_length`` of each received item (0 where it came dense), from one host read of the
        counts messages' buffer over the items' counts messages."""
        spans = [(at, at + msg.numel()) for _, _, delta, _, msg, _, at in items if delta]
        if not spans:
            return [(0, None)] * len(items)
        lo = min(a for a, _ in spans)
        host = self.bufs[0][lo : max(b for _, b in spans)].cpu()
        return [
            self._length(sd, msg, host[at - lo : at - lo + msg.numel()]) if delta else (0, None)
            for _, sd, delta, _, msg, _, at in items
        ]

    def _length(self, sd: SegmentDelta, msg: torch.Tensor, host: torch.Tensor) -> tuple[int, tuple | None]:
        """The payload's bytes from the checked counts (``msg``; ``host``: its bytes read), and their
        ``payload_layout`` (None: they failed). Counts that fail, or disagree with the length the
        sender wrote: that length when within the plan's bound (taken and dropped; the vote refuses
        the layer), else the link cannot stay in step: raise."""
        announced = int(sd.words(host)[0])
        try:
            layout = payload_layout(sd.counts(msg), sd.pieces, host=sd.counts(host))
        except ValueError:
            layout = None
        if layout is not None and layout[1] == announced:
            return announced, layout
        if 0 <= announced <= sd.bound:
            return announced, None
        raise UpdateAborted(
            f"a delta segment's counts are invalid and announce {announced} payload bytes, expected 0 to "
            f"{sd.bound} (the plan's bound): a corrupted message; the link is out of step"
        )

    def _apply(
        self,
        seg,
        sd: SegmentDelta,
        region: torch.Tensor,
        msg: torch.Tensor,
        payload: torch.Tensor,
        layout: tuple | None,
    ) -> torch.Tensor:
        if layout is not None:
            deltas = unpack_delta(sd.counts(msg), payload, sd.pieces, layout)
            for d, view in zip(deltas, sd.views(region[: seg.data_nbytes])):
                apply_delta(d, view.view(torch.float8_e4m3fn), None, backend=self.backend)
        seg.checksum_word(region).copy_(sd.words(msg)[1])
        return torch.tensor(layout is None, device=region.device)

    def _rebuild(self, pos: int, buf: torch.Tensor, segs) -> None:
        """Segments ``segs`` of ``pos`` as the sender last sent them, from this rank's parameters:
        each piece view <- its parameter region (``glm_fp8.transfer.land``'s copies, the other way;
        through ``unland`` where the engine rewrote it after landing), the bytes between pieces
        zero."""
        params = self.params
        if params is None:
            raise UpdateAborted("delta: a delta layer arrived outside load_into (it needs the parameters)")
        for seg in segs:
            zero_gaps(buf[seg.recv_offset :], seg)
        for name, view, rows in segment_views(buf, self.layer_ids[pos], self.plans[pos], segs):
            if self.targets is None:
                param, src = name, full_region(params[name], rows)
            else:
                param = self.targets[name].name
                src = piece_region(params[param], self.targets[name], rows)
            if self.unland is None or not self.unland(param, view, src):
                view.copy_(src)


__all__ = ["ReceiverDelta", "Unland", "check_receiver_delta"]

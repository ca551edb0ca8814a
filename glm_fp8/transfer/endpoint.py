"""What every rank of an update shares (``Sender`` and ``Receiver`` both are an ``Endpoint``):
the link, the update's layers and plans, the transfer plan, the device, the rings, the manifest
vote and the step votes (protocol: ``glm_fp8.transfer.wire``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.core.errors import ManifestMismatch, UpdateAborted
from glm_fp8.engine.sglang import update_indexer_form
from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, mtp_layer_index
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.plans import plans_for_model
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.link import Link, as_link
from glm_fp8.transfer.options import UpdateOptions
from glm_fp8.transfer.pack import FULL, ShardPack
from glm_fp8.transfer.routes import TransferPlan, transfer_plan
from glm_fp8.transfer.votes import (
    StepVotes,
    default_device,
    explain_refusal,
    host_bytes,
    resolve_device,
)
from glm_fp8.transfer.wire import (
    COMPLETE,
    DATA,
    MAGIC,
    PROTOCOL_VERSION,
    REFUSED_PRELUDE,
    describe_refusal,
    encode_manifest,
    header_words,
    link_failure,
    manifest_of,
    message_checksum,
    refusal_code,
)

# Ring slots: 2 overlap conversion (or arrival) with the wire; more only cost memory. The bound keeps
# a typo (ring=10**6) from allocating until the device is out of memory, one layer slot at a time.


@dataclass
class LayerStats:
    """One step of an update as this rank saw it: ``layer`` (-1: the non-layer tensors), ``nbytes``
    this rank put on the link (a sender: each point-to-point segment once per receiving rank, a
    group broadcast once) or took off it (an engine rank: its segments), ``seconds`` the step
    took on the host, ``layer_nbytes`` the whole converted layer (``LayerPlan.nbytes``),
    ``delivered_nbytes`` (a sender) what the engine ranks received of its sends, a group broadcast
    once per receiving rank: what the receivers' NICs take in, where ``nbytes`` is what the
    sender's puts out (an engine rank: its ``nbytes``)."""

    layer: int
    nbytes: int
    seconds: float
    layer_nbytes: int = 0
    delivered_nbytes: int = 0


@dataclass
class UpdateStats:
    """What ``send_model`` / ``load_into`` return: every step's ``LayerStats``, the wall
    ``seconds`` of the whole call and, for a sender on CUDA, ``peak_bytes``: the most the call
    allocated above what was allocated when it began (``torch.cuda.max_memory_allocated``; None
    elsewhere)."""

    layers: list[LayerStats] = field(default_factory=list)
    seconds: float = 0.0
    peak_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        """The bytes this rank sent (a sender: put on the link, a group broadcast once) or received
        (an engine rank) in the update."""
        return sum(s.nbytes for s in self.layers)

    @property
    def delivered_nbytes(self) -> int:
        """The bytes the engine ranks received of this rank's sends (a group broadcast once per
        receiving rank); an engine rank: what it received."""
        return sum(s.delivered_nbytes for s in self.layers)


class Ring:
    """Buffers of ``nbytes``, each allocated on its first use and kept until ``release``; a slot
    is reused only once the work last queued on it finished (``free[i]``, recorded by whoever used
    it last). An update of one layer allocates one slot."""

    def __init__(self, size: int, nbytes: int, device: torch.device):
        if size < 1:
            raise ValueError(f"ring: expected at least 1 slot, got {size}")
        self.size, self.nbytes, self.device = size, nbytes, device
        self.slots: list[torch.Tensor | None] = [None] * size
        self.free = [torch.cuda.Event() if device.type == "cuda" else None for _ in range(size)]
        self.used = [False] * size

    def slot(self, pos: int) -> tuple[torch.Tensor, int]:
        i = pos % self.size
        if self.slots[i] is None:
            self.slots[i] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return self.slots[i], i

    def wait_free(self, i: int, stream: torch.cuda.Stream | None) -> None:
        """Order ``stream`` after the last use of slot ``i``."""
        if self.used[i] and self.free[i] is not None:
            stream.wait_event(self.free[i])

    def release(self, i: int, stream: torch.cuda.Stream | None) -> None:
        """Slot ``i`` is free once what ``stream`` queued so far is done."""
        if self.free[i] is not None:
            self.free[i].record(stream)
        self.used[i] = True

    def drop(self) -> None:
        """Give every buffer back (after the work queued on them finished); the next use allocates."""
        for event in self.free:
            if event is not None:
                event.synchronize()
        self.slots = [None] * self.size
        self.used = [False] * self.size


@dataclass(frozen=True)
class Side:
    """What an endpoint's collaborators (the delta sender and receiver, ``glm_fp8.transfer.delta``)
    use of the endpoint they serve: its link and rank there, the transfer plan, the device and the
    link's stream (None on the CPU). Handed to them explicitly: they hold no reference to the
    endpoint and read nothing else of it."""

    link: Link
    rank: int
    routes: TransferPlan
    device: torch.device
    link_stream: torch.cuda.Stream | None

    @property
    def senders(self) -> list[int]:
        return self.routes.senders


class Endpoint:
    """The shared setup of ``Sender`` and ``Receiver``.

    ``layer_ids`` (default: every decoder layer; ``glm_fp8.model.families.model_layer_ids`` adds the MTP
    layer) are the update's layers in order, then ``REST`` (-1: the embeddings, final norm and
    lm_head, which travel last) when ``rest``; ``plans[k]`` is the plan of ``layer_ids[k]``.
    ``senders``: the link ranks that send (default ``[src]``: one sender); ``engines``: one entry per
    link rank, None at each sender, else the rank's ``EngineLayout`` (it receives only its shard)
    or ``"full"`` (every entry whole); default: every other rank "full" (a full broadcast). Both
    make the transfer plan (``glm_fp8.transfer.routes``), which every rank builds alike and agrees on
    at the manifest vote. ``link_stream`` is the stream the link's work runs on (None on the CPU).
    """

    link_stream: torch.cuda.Stream | None = None

    def __init__(self, comm: object | None, src: int, options: UpdateOptions):
        self.options = options
        config, plans, layer_ids, rest = options.config, options.plans, options.layer_ids, options.rest
        wire, checksum, scale_fmt, device = options.wire, options.checksum, options.scale_fmt, options.device
        senders, engines = options.senders, options.engines
        self.wire, self.checksum = wire, checksum
        self.config = as_config(config) if config is not None else None
        # the indexer as the engine ranks hold it (SGLang may hold it split: docs/sglang.md)
        self.indexer_form = update_indexer_form(self.config, engines)
        self._layers(plans, layer_ids, rest, scale_fmt)
        self.device = resolve_device(device) if device else default_device()
        self.link = as_link(comm)
        self.rank = self.link.rank
        self.src = check_int("src", src, 0, self.link.size - 1, f" (a rank of the link of {self.link.size})")
        senders = (
            [self.src]
            if senders is None
            else [check_int(f"senders[{k}]", s, 0, self.link.size - 1) for k, s in enumerate(senders)]
        )
        if self.src not in senders:
            raise ValueError(f"src: expected one of the senders {senders} (it leads), got {self.src}")
        if engines is None:
            engines = [None if r in senders else FULL for r in range(self.link.size)]
        elif len(engines) != self.link.size:
            raise ValueError(
                f"engines: expected one entry per rank of the link ({self.link.size}), got {len(engines)}"
            )
        if wire != "fp8" and (len(senders) > 1 or any(e not in (None, FULL) for e in engines)):
            raise ValueError("wire: engine layouts and many senders need wire='fp8'")
        self.routes: TransferPlan = transfer_plan(
            self.config,
            self.plans,
            self.layer_ids,
            engines,
            senders,
            groups=self.link.groups_supported,
            holders=None if options.holders is None else self._holders(options.holders, senders),
            step_layers=options.step_layers,
        )
        self.senders = self.routes.senders
        self.step_votes = StepVotes(self.device)
        self.vote_buf = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._headers = self.header_table()
        self._payload: bytes | None = None

    def _holders(self, holders: Mapping, senders: list[int]) -> list:
        """``holders`` (link ranks, by layer index) as the transfer plan takes them: per layer of
        the update, sender indices. ValueError for a rank that is not a sender, a layer or an entry
        that is not in the update."""
        if len(senders) < 2:
            raise ValueError("holders: needs several senders (one sender holds every layer)")
        known = set(self.layer_ids)  # REST included when the update carries it
        bad = sorted(set(holders) - known)
        if bad:
            raise ValueError(f"holders: layer {bad[0]} is not in the update (its layers: {sorted(known)})")

        def index(where: str, ranks) -> tuple[int, ...]:
            out = []
            for r in ranks:
                if r not in senders:
                    raise ValueError(f"{where}: link rank {r} is not a sender (senders: {senders})")
                out.append(senders.index(r))
            return tuple(out)

        per_layer = []
        for idx, plan in zip(self.layer_ids, self.plans):
            held = holders.get(idx)
            if held is None:
                per_layer.append(None)
            elif isinstance(held, Mapping):
                names = {e.name for e in plan.entries}
                for name in held:
                    if name not in names:
                        raise ValueError(
                            f"holders[{idx}][{name!r}]: not an entry of that layer's plan "
                            f"(its entries: {sorted(names)})"
                        )
                # every entry named: a scale goes with its weight (one job writes both), an entry
                # not named is every sender's
                full, last = {}, tuple(range(len(senders)))
                for e in plan.entries:
                    if e.name in held:
                        full[e.name] = index(f"holders[{idx}][{e.name!r}]", held[e.name])
                    else:
                        full[e.name] = last if e.op == "scale" else tuple(range(len(senders)))
                    last = full[e.name]
                per_layer.append(full)
            else:
                per_layer.append(index(f"holders[{idx}]", held))
        return per_layer

    def side(self) -> Side:
        """This endpoint as its collaborators see it (``Side``)."""
        return Side(self.link, self.rank, self.routes, self.device, self.link_stream)

    def _layers(self, plans, layer_ids, rest: bool, scale_fmt: str | None) -> None:
        config = self.config
        if plans is not None:
            known, mtp = list(range(len(plans))), None
        else:
            mtp = mtp_layer_index(config)
            known = list(range(config["num_hidden_layers"])) + ([mtp] if mtp is not None else [])
        if layer_ids is None:
            self.layer_ids = list(range(len(plans) if plans is not None else config["num_hidden_layers"]))
        else:
            self.layer_ids = [check_int(f"layer_ids[{k}]", i, 0) for k, i in enumerate(layer_ids)]
            bad = [i for i in self.layer_ids if i not in known]
            if bad:
                raise ValueError(
                    f"layer_ids: layer {bad[0]} is not a layer of the model ({known[0]}..{known[-1]}"
                    f"{', the last the MTP layer' if mtp is not None else ''})"
                )
            if len(set(self.layer_ids)) != len(self.layer_ids):
                raise ValueError(f"layer_ids: expected distinct layers, got {self.layer_ids}")
        if not self.layer_ids:
            raise ValueError("layer_ids: expected at least one layer")
        self.rest = bool(rest)
        if self.rest:
            self.layer_ids.append(REST)
        if plans is not None:
            self.plans = [plans[i] for i in self.layer_ids]
        else:
            self.plans = plans_for_model(
                config,
                self.wire,
                layer_ids=self.layer_ids,
                scale_fmt=scale_fmt,
                indexer_form=self.indexer_form,
            )

    def _rings(self) -> list[Ring]:
        names = ("ring", "conv_ring", "send_ring")
        return [r for r in (getattr(self, n, None) for n in names) if r is not None]

    def release(self) -> None:
        """Give the ring buffers back once the work queued on them finished (between updates: the
        next update allocates them again; plans and groups are kept)."""
        for ring in self._rings():
            ring.drop()

    @property
    def held_nbytes(self) -> int:
        """The bytes of ring buffers this endpoint holds now (0 after ``release``)."""
        return sum(ring.nbytes for ring in self._rings() for slot in ring.slots if slot is not None)

    # --- what every rank agrees on ----------------------------------------------------------------

    def manifest(self) -> dict:
        m = manifest_of(self.plans, self.layer_ids, self.wire, self.checksum)
        m["plan"] = self.routes.manifest()
        if getattr(self, "delta", None) is not None:  # a delta update (Sender / Receiver delta=)
            m["delta"] = True
        return m

    def payload(self) -> bytes:
        """The manifest as sent: the same for every update of this endpoint, built once."""
        if self._payload is None:
            self._payload = encode_manifest(self.manifest())
        return self._payload

    def header_table(self) -> torch.Tensor:
        """int64 [layers + 1, 8] on the device: every layer's header (the announced layers' DATA
        headers, then COMPLETE); a step's header is its first layer's (``header_row``). The leader
        sends its rows, the others compare what arrives with theirs, with no host round trip."""
        rows = [
            header_words(DATA, i, pos, lay.wire_nbytes)
            for pos, (i, lay) in enumerate(zip(self.layer_ids, self.routes.layers))
        ]
        rows.append(header_words(COMPLETE, -1, len(self.plans)))
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def header_row(self, step: int) -> int:
        """The row of ``header_table`` that step ``step`` sends (COMPLETE after the last step)."""
        steps = self.routes.steps
        return steps[step][0] if step < len(steps) else len(self.plans)

    def step_name(self, step: int) -> str:
        """How messages name step ``step``: its layer (or layers), or the last step."""
        steps = self.routes.steps
        if step >= len(steps):
            return "after the last layer"
        names = [layer_name(pos, self.layer_ids) for pos in steps[step]]
        return names[0] if len(names) == 1 else f"the step of {', '.join(names)}"

    def vote(self, code: int) -> int:
        """Contribute ``code`` (0: fine; never negative) to an all-reduce MAX on the link and return
        every rank's maximum (a host read)."""
        try:
            with on_stream(self.link_stream):
                self.vote_buf.fill_(max(0, code))
                self.link.all_reduce_max(self.vote_buf)
                verdict = int(self.vote_buf.item())
                self.link.check()  # an aborted transport delivers garbage: a lost rank says why
                return verdict
        except Exception as exc:
            raise link_failure("the link failed during a vote", exc) from exc

    def agree(self, check: Callable[[bytes], tuple[Exception | None, int]], max_bytes: int) -> None:
        """The prelude and the manifest from the leader, each followed by a vote; ``check(payload)``
        returns this rank's refusal of the leader's manifest (``(None, 0)`` when it agrees; the
        leader's returns its own problems). Nothing is allocated from an announced length before it
        was checked. Then every rank makes the plan's groups: no group exists before every rank
        agreed on the plan, so no rank can wait in a group another will not make."""
        ours = self.payload()
        leader = self.rank == self.src
        try:
            with on_stream(self.link_stream):
                prelude = torch.tensor([MAGIC, PROTOCOL_VERSION, len(ours), 0], dtype=torch.int64)
                prelude = (
                    prelude.to(self.device)
                    if leader
                    else torch.zeros(4, dtype=torch.int64, device=self.device)
                )
                self.link.broadcast(prelude, self.src)
                magic, version, n, refusing = prelude.tolist()
        except Exception as exc:
            raise link_failure("receiving the manifest failed", exc) from exc
        refused = None
        if magic == MAGIC and version == PROTOCOL_VERSION and refusing:
            pass  # the leader refused its own arguments: its vote says why
        elif magic != MAGIC or version != PROTOCOL_VERSION:
            refused = ManifestMismatch(
                f"manifest prelude: expected magic {MAGIC:#x} and version {PROTOCOL_VERSION}, got {magic:#x} "
                f"and {version} (a sender of another glm_fp8 version, or not glm_fp8)"
            )
        elif not 0 < n <= max_bytes:
            refused = ManifestMismatch(
                f"manifest length: expected 1 to {max_bytes} bytes (max_manifest_bytes), got {n}"
            )
        self._settle_manifest(refused, REFUSED_PRELUDE)
        try:
            with on_stream(self.link_stream):
                data = (
                    torch.frombuffer(bytearray(ours), dtype=torch.uint8).to(self.device)
                    if leader
                    else torch.empty(n, dtype=torch.uint8, device=self.device)
                )
                self.link.broadcast(data, self.src)
                got = ours if leader else host_bytes(data)
        except Exception as exc:
            raise link_failure("receiving the manifest failed", exc) from exc
        self._settle_manifest(*check(got))
        self.link.make_groups(self.routes.groups())

    def _settle_manifest(self, refused: Exception | None, reason: int) -> None:
        verdict = self.vote(refusal_code(reason, self.rank) if refused is not None else 0)
        if not verdict:
            return
        try:
            with on_stream(self.link_stream):
                why = explain_refusal(self.link, verdict, refused, self.device)
        except Exception as exc:
            raise link_failure(f"{describe_refusal(verdict)}; the link failed after that vote", exc) from exc
        if refused is not None:
            raise refused
        error = ManifestMismatch if self.rank in self.senders else UpdateAborted
        raise error(f"{describe_refusal(verdict)}: {why}; nothing was sent")

    # --- segments ---------------------------------------------------------------------------------


def checksums_bad(
    buf: torch.Tensor, segments: Sequence[ShardPack], scratch: torch.Tensor
) -> torch.Tensor | None:
    """A device boolean: some of ``segments`` (received into ``buf``) has a checksum other than its
    word (None: none to check). ``scratch``: ``checksum_scratch`` of the largest."""
    bad = [
        message_checksum(buf[s.recv_offset : s.recv_offset + s.data_nbytes], scratch)
        != s.checksum_word(buf[s.recv_offset : s.recv_offset + s.nbytes])
        for s in segments
    ]
    return torch.stack(bad).any() if bad else None


def segment_views(
    buf: torch.Tensor, layer_idx: int, plan: LayerPlan, segments: Sequence[ShardPack]
) -> list[tuple[str, torch.Tensor, tuple[int, int] | None]]:
    """The entry views of ``segments`` of layer ``layer_idx`` received into ``buf`` (a ring slot),
    in ``plan``'s entry order: (the entry's prefixed name, its view, the rows it holds or None for
    the whole entry)."""
    prefix = layer_prefix(layer_idx)
    views = []
    for s in segments:
        region = buf[s.recv_offset : s.recv_offset + s.nbytes]
        # Where the sender sent it from (``direct``) does not matter here: its pieces say it all.
        views += [(p.name, p.view(region), p.rows) for p in s.pieces]
    order = {prefix + e.name: k for k, e in enumerate(plan.entries)}
    views.sort(key=lambda v: order[v[0]])  # stable: a split entry's pieces stay in sender order
    return views


def pack_segments(
    segments: Sequence[ShardPack],
    offsets: Sequence[int],
    full: Mapping[str, torch.Tensor],
    packed: torch.Tensor,
    starts: Mapping[str, int] | None = None,
) -> None:
    """Cut each of ``segments`` out of the entry views ``full`` (by prefixed name; ``starts``: see
    ``ShardPack.pack_into``) into ``packed`` at ``offsets``; their checksum words are the caller's
    (``ShardPack.seal``: a segment that travels only as a delta needs none)."""
    for seg, offset in zip(segments, offsets):
        seg.pack_into(full, packed[offset : offset + seg.nbytes], starts)


def layer_name(pos: int, layer_ids: Sequence[int]) -> str:
    """How messages name the layer at ``pos``: a layer or the non-layer tensors."""
    return "the non-layer tensors" if layer_ids[pos] == REST else f"layer {layer_ids[pos]}"


def my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def on_stream(stream: torch.cuda.Stream | None):
    """``torch.cuda.stream(stream)``, or a no-op on the CPU (``stream`` None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

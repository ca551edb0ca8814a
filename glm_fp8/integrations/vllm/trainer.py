"""The trainer side of glm_fp8's vLLM weight-transfer backend, without vLLM (docs/vllm.md#the-backend):
``TrainerOptions`` (what ``GlmFp8TrainerInitInfo`` carries; ``trainer_options``, re-exported here)
and ``TrainerSide``, which every trainer rank builds at init and calls each step (what it reads
each step: ``trainer_source``). It drives the engine through any object with vLLM's
``VLLMWeightSyncClient`` methods (``LLM``, ``AsyncLLM``, the HTTP routes; rank 0 only).

At init the senders open the link (a TCP store served by trainer rank 0 and a process group of
its own) while rank 0 sends every engine worker the ``SyncInit``; every engine rank then tells
every rank of the link its layout and needs, and all of them derive the same transfer plan. Each
step is one update per session: the target's decoder layers and non-layer tensors, then the MTP
layer in vLLM's draft session when both sides have one; rank 0 calls ``start``, ``update`` (while
every sender sends) and ``finish``.
"""

from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from glm_fp8.config import as_config
from glm_fp8.integrations.vllm.sources import WeightSourceLayers
from glm_fp8.integrations.vllm.sync import (
    SyncInit,
    SyncUpdate,
    auto_mode,
    clear_gate,
    fleet_layouts,
    fleet_mtp,
    fleet_scale_fmt,
    gate_reads,
    open_gate,
    poll_ready,
    publish_trainer_init,
    read_fleet,
    read_trainer_init,
    session_layers,
    wait_gate,
)
from glm_fp8.integrations.vllm.trainer_options import _DTYPES, TrainerOptions
from glm_fp8.integrations.vllm.trainer_source import contribute, trainer_source
from glm_fp8.models import mtp_layer_index
from glm_fp8.transfer.link import StoreLink
from glm_fp8.transfer.sender import Broadcaster


class TrainerSide:
    """One trainer rank's end of the backend; see the module docstring. Build with ``connect``."""

    def __init__(self, opts: TrainerOptions, client: object, source: object, device: torch.device):
        opts.check()
        self.opts, self.client, self.device = opts, client, device
        self.rank = int(opts.rank)
        self.config = as_config(opts.config)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.trainer_ranks = int(opts.trainer_ranks) if opts.trainer_ranks is not None else world
        if self.rank >= self.trainer_ranks:
            raise ValueError(
                f"init_info.rank: expected a trainer rank below trainer_ranks={self.trainer_ranks}, "
                f"got {self.rank}"
            )
        self.source = trainer_source(
            source, self.config, rank=self.rank, trainer_ranks=self.trainer_ranks, device=device
        )
        self.mode = self._mode()
        self.senders = self.trainer_ranks if self.mode == "senders" else 1
        backend = (
            opts.link_backend
            if opts.link_backend != "auto"
            else ("nccl" if device.type == "cuda" else "gloo")
        )
        # draft="auto" is decided by the rank that holds the client (rank 0): whether the client can
        # open vLLM's draft session. The other ranks take rank 0's decision at connect(); what they
        # hold until then is provisional.
        draft = opts.draft
        if draft == "auto":
            draft = "session" if self.source.mtp and self._client_drafts() else "none"
            if self.rank == 0 and self.source.mtp and draft == "none":
                # vLLM's HTTP and Ray clients have no draft session: say so rather than leave the
                # drafter on its old weights without a word.
                warnings.warn(
                    f"init_info.draft='auto': the source holds the MTP layer but "
                    f"{type(client).__name__} has no start_draft_weight_update, so it is not sent; "
                    "wrap AsyncLLM's start_draft_weight_update in the client, or pass draft='none' "
                    "to silence this",
                    stacklevel=2,
                )
        if draft != "none" and not self.source.mtp:
            raise ValueError(
                f"init_info.draft: {draft!r} sends the MTP layer, which the source does not hold"
            )
        self.init = SyncInit(
            master_address=opts.master_address,
            master_port=int(opts.master_port),  # checked integral (numpy / torch ints too): JSON-able
            world_size=self.senders + int(opts.engine_ranks),
            senders=self.senders,
            mode=self.mode,
            link_backend=backend,
            layer_ids=list(self.source.layer_ids),
            rest=self.source.rest,
            draft=draft,
            scale_fmt=opts.scale_fmt,
            checksum=opts.checksum,
            ring=int(opts.ring),
            timeout_s=float(opts.timeout_s),
        )
        self.init.check()
        self.link: StoreLink | None = None
        self.store = None  # the link's TCP store (a client of it on a rank off the link)
        self.state = "built"  # then "connected", then "shut down"
        self.steps = 0
        self._senders_cache: dict[str, Broadcaster] = {}
        self._gates: list[tuple[int, str]] = []  # updates whose "go" keys rank 0 still holds

    def _client_drafts(self) -> bool:
        return callable(getattr(self.client, "start_draft_weight_update", None))

    def _mode(self) -> str:
        mode = self.opts.mode
        whole = self.source.experts_whole and self.trainer_ranks > 1
        if mode == "auto":
            return auto_mode(self.trainer_ranks, self.source.experts_whole)[0]
        if mode == "senders" and not whole:
            raise ValueError(
                "init_info.mode: 'senders' needs every trainer rank to hold whole experts (each expert stack "
                f"Shard(0) over the {self.trainer_ranks} trainer ranks in order); the source does not"
            )
        return mode

    @property
    def on_link(self) -> bool:
        return self.rank < self.senders

    def connect(self) -> TrainerSide:
        """Open the link and learn the engines (rank 0 sends them the init meanwhile). Every other
        trainer rank then takes rank 0's ``SyncInit`` (its ``draft`` decision) through the link's
        store; a rank off the link (one sender) connects to the store only."""
        if self.state != "built":
            raise RuntimeError(f"connect(): this trainer side is {self.state} already; build a new one")
        if self.mode == "senders" and isinstance(self.source, WeightSourceLayers):
            self.source.local = True  # each rank reads its own pieces: iter_local
        if not self.on_link:
            self.store = dist.TCPStore(
                self.init.master_address,
                self.init.master_port,
                is_master=False,
                timeout=timedelta(seconds=self.init.timeout_s),
            )
            self._adopt(read_trainer_init(self.store))
            self.state = "connected"
            return self
        error: list[BaseException] = []
        rpc = None
        if self.rank == 0:
            rpc = threading.Thread(
                target=_capture,
                args=(error, self.client.init_weight_transfer_engine, self.init.to_dict()),
                daemon=True,
            )
            rpc.start()
        try:
            self.link = StoreLink(
                self.init.master_address,
                self.init.master_port,
                self.rank,
                self.init.world_size,
                backend=self.init.link_backend,
                timeout=timedelta(seconds=self.init.timeout_s),
                device=self.device,
            )
            self.store = self.link.store
            if self.rank == 0:
                publish_trainer_init(self.store, self.init)
            else:
                self._adopt(read_trainer_init(self.store))
            self.fleet = read_fleet(self.store, range(self.senders, self.init.world_size))
        except BaseException as exc:
            if rpc is not None:
                rpc.join(self.init.timeout_s)
                if error and hasattr(exc, "add_note"):
                    exc.add_note(f"the engine's init raised: {type(error[0]).__name__}: {error[0]}")
            raise
        if rpc is not None:
            rpc.join(self.init.timeout_s)
        if error:
            raise error[0]
        self.engines = fleet_layouts(self.fleet, self.senders) if self.mode != "broadcast" else None
        self.scale_fmt = fleet_scale_fmt(self.fleet, self.init.scale_fmt)
        if self.init.draft != "none" and fleet_mtp(self.fleet) != self.mtp:
            raise ValueError(
                f"init_info.draft: {self.init.draft!r} sends the MTP layer, and the engines run no "
                "MTP drafter (speculative decoding off); pass draft='none'"
            )
        self.state = "connected"
        return self

    def _adopt(self, leader: SyncInit) -> None:
        """Take trainer rank 0's init: its ``draft`` where this rank left it to "auto" (only rank 0
        holds the client that decides), every other field as this rank derived it."""
        mine = self.init.to_dict()
        theirs = leader.to_dict()
        if self.opts.draft == "auto":
            mine["draft"] = theirs["draft"]
        for key, value in theirs.items():
            if mine[key] != value:
                raise ValueError(
                    f"init_info.{key}: trainer rank {self.rank} has {mine[key]!r}, trainer rank 0 "
                    f"{value!r}; every trainer rank needs the same init info and source layers"
                )
        self.init = leader

    @property
    def mtp(self) -> int | None:
        return mtp_layer_index(self.config)

    def sessions(self) -> list[str]:
        """This step's updates, the same on every trainer rank."""
        if self.init.draft == "stream":
            return ["stream"]
        return ["target"] + (["draft"] if self.init.draft == "session" else [])

    def _broadcaster(self, session: str) -> Broadcaster:
        if session not in self._senders_cache:
            ids, rest = session_layers(self.init, session, self.mtp)
            self._senders_cache[session] = Broadcaster(
                self.link,
                0,
                config=self.config,
                layer_ids=ids,
                rest=rest,
                ring=self.init.ring,
                gather=self.opts.gather,
                gather_dtype=_DTYPES[self.opts.gather_dtype],
                checksum=self.init.checksum,
                scale_fmt=self.scale_fmt,
                engines=self.engines,
                senders=list(range(self.senders)),
                device=self.device,
            )
        return self._senders_cache[session]

    def send(self) -> list[dict]:
        """One step: every session's update (on every trainer rank). Returns one dict per session,
        what this rank did in it: ``session``, ``seconds`` (this rank's wall time), ``bytes`` (what
        this rank put on the link: a sender's segments, each once per receiving rank, a group
        broadcast once; 0 on a rank off the link, which only takes part in the sender's gathers),
        ``sender`` (this rank is on the link), ``update_bytes`` (the whole converted update, every
        engine's shard together; None off the link). Raises what a ``Broadcaster`` raises (an engine
        rank's refusal names it), with the engine's own error as a note on rank 0; a refusal known
        before the transfer (a worker outside a session, the client's error) on every rank at once."""
        if self.state != "connected":
            raise RuntimeError(
                "send(): this trainer engine was shut down (shutdown()); build a new one with trainer_init"
                if self.state == "shut down"
                else "send(): the link is not open; call connect() first (trainer_init does)"
            )
        self.steps += 1
        self.source.begin_step()
        out = []
        for session in self.sessions():
            t0 = time.perf_counter()
            ids, rest = session_layers(self.init, session, self.mtp)
            layers, rest_map = self.source.session(ids, rest)
            if not self.on_link:
                wait_gate(self.store, self.steps, session)
                self._contribute(layers, rest_map, ids)
                out.append(
                    {"session": session, "seconds": time.perf_counter() - t0, "bytes": 0, "sender": False,
                     "update_bytes": None}
                )  # fmt: skip
                continue
            out.append(self._update(session, layers, rest_map))
        self.source.drain()
        return out

    def _contribute(self, layers, rest_map, ids) -> None:
        """A trainer rank off the link (one sender): its part of the sender's gathers."""
        gather, gather_dtype = self.opts.gather, _DTYPES[self.opts.gather_dtype]
        contribute(self.source, layers, rest_map, ids, config=self.config, gather=gather,
                   gather_dtype=gather_dtype, device=self.device)  # fmt: skip

    def _update(self, session: str, layers, rest_map) -> dict:
        step = self.steps
        if self.rank != 0:
            wait_gate(self.store, step, session)
            stats = self._broadcaster(session).broadcast_model(layers, rest=rest_map)
            return _stats(session, stats)
        self._prune_gates()
        error: list[BaseException] = []
        rpc = None
        try:
            client = self.client
            (client.start_draft_weight_update if session == "draft" else client.start_weight_update)()
            rpc = threading.Thread(
                target=_capture,
                args=(error, self.client.update_weights, SyncUpdate(session, step).to_dict()),
                daemon=True,
            )
            rpc.start()
            self._wait_ready(step, session, rpc, error)
        except BaseException as exc:
            # Every other rank waits at the gate: it raises this at once, and nothing moves.
            open_gate(self.store, step, session, f"trainer rank 0: {type(exc).__name__}: {exc}")
            if rpc is not None:
                rpc.join(self.init.timeout_s)
            raise
        open_gate(self.store, step, session, None)
        self._gates.append((step, session))
        try:
            stats = self._broadcaster(session).broadcast_model(layers, rest=rest_map)
        except BaseException as exc:
            rpc.join(self.init.timeout_s)
            if error and hasattr(exc, "add_note"):
                exc.add_note(f"the engine's update_weights raised: {type(error[0]).__name__}: {error[0]}")
            raise
        rpc.join(self.init.timeout_s)
        if error:
            raise error[0]
        self.client.finish_weight_update()
        return _stats(session, stats)

    def _wait_ready(self, step: int, session: str, rpc: threading.Thread, error: list) -> None:
        """Until every engine worker said it is ready for this update: raise the first refusal,
        or the client call's error when it ended before every worker was ready (vLLM's own
        refusals come that way: "start_weight_update must be called before update_weights")."""
        engines = range(self.senders, self.init.world_size)
        deadline = time.monotonic() + self.init.timeout_s
        pause = 0.001
        while True:
            said, refusal = poll_ready(self.store, step, session, engines)
            if said:
                if refusal is not None:
                    raise RuntimeError(refusal)
                return
            if not rpc.is_alive() and error:
                raise RuntimeError(
                    f"the engine's update_weights raised before the transfer: {type(error[0]).__name__}: "
                    f"{error[0]}"
                ) from error[0]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"update {step} ({session} session): not every engine worker was ready within "
                    f"init_info.timeout_s={self.init.timeout_s:g} s (the client's update_weights "
                    f"{'is still running' if rpc.is_alive() else 'returned'})"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _prune_gates(self) -> None:
        """Drop the keys of earlier updates that every other rank has read (rank 0)."""
        readers = self.init.world_size - self.senders + self.trainer_ranks - 1
        keep = []
        for step, session in self._gates:
            if gate_reads(self.store, step, session) >= readers:
                clear_gate(self.store, step, session, range(self.senders, self.init.world_size))
            else:
                keep.append((step, session))
        self._gates = keep

    def shutdown(self) -> None:
        """Close the link (or this rank's store client); ``send()`` then refuses."""
        self._senders_cache.clear()
        if self.link is not None:
            self.link.close()
            self.link = None
        self.store = None
        self.state = "shut down"


def _stats(session: str, stats) -> dict:
    """What ``send()`` returns for one session on a rank of the link (see ``TrainerSide.send``)."""
    return {
        "session": session,
        "seconds": stats.seconds,
        "bytes": stats.nbytes,
        "sender": True,
        "update_bytes": sum(s.layer_nbytes for s in stats.layers),
    }


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
        errors.append(exc)


__all__ = ["TrainerOptions", "TrainerSide"]

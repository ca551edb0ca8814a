"""The trainer side of glm_fp8's vLLM weight-transfer backend, without vLLM (docs/vllm.md#the-backend):
``TrainerSide``, which every trainer rank builds at init and calls each step (its options, what
``GlmFp8TrainerInitInfo`` carries: ``trainer_options``; what it reads each step:
``trainer_source``). It drives each vLLM server through a client with vLLM's
``VLLMWeightSyncClient`` methods (``clients``: ``LLM``, ``AsyncLLM``, HTTP, Ray; rank 0 only), one
or several servers on one link (a fleet: ``trainer_fleet``, ``fleet_link``; docs/vllm.md#fleet).

At init the senders open the link (a TCP store served by trainer rank 0 and a process group of
its own) while rank 0 sends every engine worker the ``SyncInit``; every engine rank then tells
every rank of the link its layout and needs, and all of them derive the same transfer plan. Each
step is one update per session: the target's decoder layers and non-layer tensors, then the MTP
layer in vLLM's draft session when both sides have one; rank 0 calls ``start``, ``update`` (while
every sender sends) and ``finish``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

from glm_fp8.core.errors import GlmFp8Error, LinkLost, ReceiverRefused
from glm_fp8.integrations.vllm.fleet_link import (
    FleetCall,
    generation_store,
    name_ranks,
    open_link,
    open_store,
    publish_failure,
    read_failure,
    start_sessions,
    wait_ready,
)
from glm_fp8.integrations.vllm.gate import GatherGate, gather_go, open_gate, wait_gate
from glm_fp8.integrations.vllm.sources import WeightSourceLayers
from glm_fp8.integrations.vllm.sync import (
    SyncInit,
    SyncUpdate,
    fleet_layouts,
    fleet_scale_fmt,
    publish_trainer_init,
    read_fleet,
    read_trainer_init,
    session_holders,
    session_layers,
)
from glm_fp8.integrations.vllm.trainer_fleet import FleetMembership, draft_decision
from glm_fp8.integrations.vllm.trainer_options import GATHER_DTYPES, TrainerOptions, delta_options
from glm_fp8.integrations.vllm.trainer_source import contribute, trainer_source
from glm_fp8.model.config import as_config
from glm_fp8.model.families import mtp_layer_index
from glm_fp8.transfer.delta.carry import KeptCopy, adopt_kept, detach_each
from glm_fp8.transfer.link import StoreLink
from glm_fp8.transfer.options import holders_pairs
from glm_fp8.transfer.sender import Sender
from glm_fp8.transfer.topology import choose_mode

# How long trainer rank 0 waits, after a failed transfer whose error does not say why (an engine
# rank refused; a transport failed with no rank to name), for the servers' update_weights to say
# why (a dead server's client answers at once; the others once their link broke), before raising.
FAILURE_WAIT_S = 10.0
# ... and after an error that says why itself (the trainer's own fault, a lost rank named): only
# for the servers' accounts as a note.
OWN_FAULT_WAIT_S = 1.0


def says_why(exc: BaseException) -> bool:
    """``exc`` (from a sender's ``send_model``) names its cause without the servers' account: the
    trainer's own fault (a bad or non-finite layer, another sender's, a refused manifest) or a
    lost rank; not an engine rank's refusal (its reason is the server's) nor a bare transport error."""
    if isinstance(exc, LinkLost):
        return exc.rank is not None
    if isinstance(exc, ReceiverRefused):
        return False
    return isinstance(exc, (GlmFp8Error, ValueError, TypeError))


class TrainerSide(FleetMembership):
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
        self.servers = opts.servers(client)
        # One server without names: its messages and init as before the fleet (no server names).
        self.named = isinstance(opts.engine_ranks, (list, tuple)) or opts.server_names is not None
        self.source = trainer_source(
            source, self.config, rank=self.rank, trainer_ranks=self.trainer_ranks, device=device
        )
        # A Megatron-Core source with many senders names the trainer ranks that send (sender k is
        # link rank k); else trainer ranks 0..S-1 are the link's senders.
        self.mode = self._mode()
        megatron = hasattr(self.source, "send_whole")
        if megatron and self.mode != "senders":
            self.source.send_whole(self.rank)
        self.sending = list(self.source.senders) if megatron and self.mode == "senders" else None
        if self.sending is not None:
            self.senders = len(self.sending)
        else:
            self.senders = self.trainer_ranks if self.mode == "senders" else 1
        self.backend = (
            opts.link_backend
            if opts.link_backend != "auto"
            else ("nccl" if device.type == "cuda" else "gloo")
        )
        self.init = self._make_init(0)
        self.link: StoreLink | None = None
        self.store = None  # this generation's view of the trainer's TCP store
        self._root = None  # the store itself: served by trainer rank 0 for the engine's life
        self.state = "built"  # then "connected", then "shut down"
        self.steps = 0
        self._senders_cache: dict[str, Sender] = {}
        self._kept: dict[str, KeptCopy] = {}  # delta: each session's kept copy, off a dropped link
        # updates whose "go" keys rank 0 still holds: (step, session, GatherGate steps)
        self._gates: list[tuple[int, str, int]] = []

    def _make_init(self, generation: int) -> SyncInit:
        """The fleet's ``SyncInit`` (each server gets it with its ``rank_offset``); ``draft`` decided
        per server by rank 0 (``draft_decision``), provisional on the other ranks until connect."""
        draft = draft_decision(self.opts.draft, self.source.mtp, self.servers, self.rank)
        if draft != "none" and not self.source.mtp:
            raise ValueError(
                f"init_info.draft: {draft!r} sends the MTP layer, which the source does not hold"
            )
        at, servers = self.senders, []
        for s in self.servers:
            servers.append([s.name, at, int(s.engine_ranks)])
            at += int(s.engine_ranks)
        init = SyncInit(
            master_address=self.opts.master_address,
            master_port=int(self.opts.master_port),  # checked integral (numpy / torch ints too): JSON-able
            world_size=at,
            senders=self.senders,
            mode=self.mode,
            link_backend=self.backend,
            # steps of several layers carry one of each pipeline stage: the stages' layers in turn
            layer_ids=list(
                self.source.stage_layer_ids
                if self.opts.step_layers > 1 and self.sending is not None
                else self.source.layer_ids
            ),
            rest=self.source.rest,
            draft=draft,
            scale_fmt=self.opts.scale_fmt,
            checksum=self.opts.checksum,
            ring=int(self.opts.ring),
            step_layers=int(self.opts.step_layers),
            timeout_s=float(self.opts.timeout_s),
            servers=servers if self.named else None,
            generation=generation,
            delta=self.opts.delta,  # "auto" that picked the full broadcast is refused here
            holders=holders_pairs(self.source.holders) if self.sending is not None else None,
        )
        init.check()
        return init

    def _mode(self) -> str:
        mode = self.opts.mode
        if hasattr(self.source, "send_whole"):  # Megatron-Core: its stages' ranks send their own layers
            return "senders" if mode == "auto" else mode  # or, in a one-sender mode, rank 0 every layer
        whole = self.source.experts_whole and self.trainer_ranks > 1
        if mode == "auto":
            return choose_mode(self.trainer_ranks, self.source.experts_whole)[0]
        if mode == "senders" and not whole:
            raise ValueError(
                "init_info.mode: 'senders' needs every trainer rank to hold whole experts (each expert stack "
                f"Shard(0) over the {self.trainer_ranks} trainer ranks in order); the source does not"
            )
        return mode

    @property
    def on_link(self) -> bool:
        return self.rank in self.sending if self.sending is not None else self.rank < self.senders

    @property
    def link_rank(self) -> int:
        return self.sending.index(self.rank) if self.sending is not None else self.rank

    def connect(self) -> TrainerSide:
        """Open the link and learn the engines (rank 0 sends every server the init meanwhile, each
        with its ``rank_offset``, in parallel). Every other trainer rank then takes rank 0's
        ``SyncInit`` (its ``draft`` decision) through the link's store; a rank off the link (one
        sender) reads the store only."""
        if self.state != "built":
            raise RuntimeError(f"connect(): this trainer side is {self.state} already; build a new one")
        if self.mode == "senders" and isinstance(self.source, WeightSourceLayers):
            self.source.local = True  # each rank reads its own pieces: iter_local
        if self._root is None:
            self._root = open_store(
                self.init.master_address,
                self.init.master_port,
                master=self.rank == 0,
                timeout_s=self.init.timeout_s,
            )
        self.store = generation_store(self._root, self.init.generation)
        if not self.on_link:
            self._adopt(read_trainer_init(self.store))
            self._learn_fleet()
            self.state = "connected"
            return self
        call = None
        if self.rank == 0:
            inits = [(replace(self.init, rank_offset=o).to_dict(),) for _, o, _ in self.init.fleet()]
            call = FleetCall(self.servers, "init_weight_transfer_engine", inits)
        try:
            self.link = open_link(
                self.init, self.link_rank, self.device, self.store, global_ranks=self.sending
            )
            if self.rank == 0:
                publish_trainer_init(self.store, self.init)
            else:
                self._adopt(read_trainer_init(self.store))
            self._learn_fleet()
        except BaseException as exc:
            if call is not None:
                err = call.join(self.init.timeout_s).error(self.init)
                if err is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"the engine's init raised: {err}")
            raise
        if call is not None:
            call.wait(self.init.timeout_s, self.init)
        self.state = "connected"
        return self

    def _learn_fleet(self) -> None:
        """Every engine rank's layout and needs; the MTP layer only where every server runs a
        drafter (draft="auto" drops it otherwise, with a warning naming the servers)."""
        self.fleet = read_fleet(
            self.store, range(self.senders, self.init.world_size), name=self.init.rank_name
        )
        self.engines = fleet_layouts(self.fleet, self.senders) if self.mode != "broadcast" else None
        self.scale_fmt = fleet_scale_fmt(self.fleet, self.init.scale_fmt)
        if self.init.draft == "none":
            return
        bare = [
            name or "the engine"
            for name, first, n in self.init.fleet()
            if any(self.fleet[r].get("mtp") != self.mtp for r in range(first, first + n))
        ]
        if not bare:
            return
        if self.opts.draft != "auto":
            raise ValueError(
                f"init_info.draft: {self.init.draft!r} sends the MTP layer, and {bare} run(s) no MTP "
                "drafter (speculative decoding off); pass draft='none'"
            )
        if self.rank == 0:
            warnings.warn(
                f"init_info.draft='auto': {bare} run(s) no MTP drafter; the MTP layer is not sent",
                stacklevel=3,
            )
        self.init = replace(self.init, draft="none")

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
                    f"{value!r}; every trainer rank needs the same init info, source layers and servers"
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

    def _sender(self, session: str) -> Sender:
        if session not in self._senders_cache:
            ids, rest = session_layers(self.init, session, self.mtp)
            self._senders_cache[session] = Sender(
                self.link,
                0,
                config=self.config,
                layer_ids=ids,
                rest=rest,
                ring=self.init.ring,
                step_layers=self.init.step_layers,
                gather=self.opts.gather,
                gather_dtype=GATHER_DTYPES[self.opts.gather_dtype],
                checksum=self.init.checksum,
                scale_fmt=self.scale_fmt,
                engines=self.engines,
                senders=list(range(self.senders)),
                holders=session_holders(self.init, ids, rest),
                device=self.device,
                delta=delta_options(self.opts),  # kept with this Sender: per session, per link
            )
            if session in self._kept:  # a rebuilt fleet: deltas go on where the ranks still hold them
                adopt_kept(self._senders_cache[session], self._kept.pop(session))
        return self._senders_cache[session]

    def send(self) -> list[dict]:
        """One step: every session's update (on every trainer rank), to every server. Returns one
        dict per session, what this rank did in it: ``session``, ``seconds`` (this rank's wall
        time), ``bytes`` (what this rank put on the link: a sender's segments, each once per
        receiving rank, a group broadcast once; 0 on a rank off the link, which only takes part in
        the sender's gathers), ``delivered_bytes`` (what the engine ranks received of this rank's
        sends: a group broadcast once per receiving rank, so a full broadcast counts every
        receiver's copy, as scatter does), ``sender`` (this rank is on the link), ``update_bytes`` (the whole
        converted update, every engine's shard together; None off the link). Raises what a
        ``Sender`` raises (an engine rank's refusal names it, and a note its server), with
        the engines' own errors as a note (naming each server); a refusal known before the
        transfer (a worker outside a session, a client's error) on every rank at once. A rank off
        the link returns once rank 0 says the update landed, and raises what failed otherwise."""
        if self.state == "broken":
            raise RuntimeError(
                f"send(): {self.broken}; call engine.remove_server(name) for a server that is gone, "
                "replace_server(name, VllmServer(...)) for a restarted one, or set_fleet(engine.servers), on "
                "every trainer rank, to rebuild it"
            )
        if self.state != "connected":
            raise RuntimeError(
                "send(): this trainer engine was shut down (shutdown()); build a new one with trainer_init"
                if self.state == "shut down"
                else "send(): the link is not open; call connect() first (trainer_init does)"
            )
        self.steps += 1
        self.source.begin_step()
        out, sessions = [], self.sessions()
        self._kept = {s: k for s, k in self._kept.items() if s in sessions}  # a session gone: freed
        for session in sessions:
            t0 = time.perf_counter()
            ids, rest = session_layers(self.init, session, self.mtp)
            layers, rest_map = self.source.session(ids, rest)
            if not self.on_link:
                wait_gate(self.store, self.steps, session)
                if self.sending is None:  # one sender's gathers; a Megatron replica sends nothing
                    self._contribute(layers, rest_map, ids, gather_go(self.store, self.steps, session))
                self._await_outcome(self.steps, session)
                out.append(
                    {
                        "session": session,
                        "seconds": time.perf_counter() - t0,
                        "bytes": 0,
                        "sender": False,
                        "delivered_bytes": 0,
                        "update_bytes": None,
                    }
                )
                continue
            out.append(self._update(session, layers, rest_map, len(ids)))
        self.source.drain()
        return out

    def _contribute(self, layers, rest_map, ids, go) -> None:
        """A trainer rank off the link (one sender): its part of the sender's gathers, each step's
        once rank 0 said it gathers it too (``go``)."""
        contribute(
            self.source,
            layers,
            rest_map,
            ids,
            config=self.config,
            gather=self.opts.gather,
            gather_dtype=GATHER_DTYPES[self.opts.gather_dtype],
            device=self.device,
            go=go,
        )

    def _update(self, session: str, layers, rest_map, n_layers: int) -> dict:
        step, timeout = self.steps, self.init.timeout_s
        if self.rank != 0:
            wait_gate(self.store, step, session)
            try:
                return _stats(session, self._sender(session).send_model(layers, rest=rest_map))
            except BaseException as exc:
                name_ranks(exc, self.init)
                if not says_why(exc):  # the servers' account, as rank 0 hears it from their clients
                    said = read_failure(self.store, step, session, FAILURE_WAIT_S + 5)
                    if said is not None and hasattr(exc, "add_note"):
                        exc.add_note(f"trainer rank 0: {said}")
                self._broke(exc, step, session)
                raise
        self._prune_gates()
        call = None
        try:
            start_sessions(self.servers, self.init, draft=session == "draft")
            # A server that dies mid-transfer fails its client at once, while this rank may stay
            # blocked on a live peer (another trainer rank, which failed at once on the dead one)
            # until that peer drops its link: say which server at once, for the ranks that wait
            # for this account before raising.
            store, init = self.store, self.init
            call = FleetCall(
                self.servers,
                "update_weights",
                [(SyncUpdate(session, step).to_dict(),)] * len(self.servers),
                on_failure=lambda c: publish_failure(store, step, session, str(c.error(init))),
            )
            wait_ready(self.store, step, session, self.init, call)
        except BaseException as exc:
            # Every other rank waits at the gate: it raises this at once, and nothing moves.
            open_gate(self.store, step, session, f"trainer rank 0: {type(exc).__name__}: {exc}")
            if call is not None:
                call.join(timeout)
            raise
        gate = None
        if self._off_link and self.sending is None:  # their gathers step by step with this rank's
            gate = GatherGate(self.store, step, session, n_layers, rest_map is not None)
            layers, rest_map = gate.layers(layers), gate.rest(rest_map)
        open_gate(self.store, step, session, None)
        self._gates.append((step, session, gate.steps if gate is not None else 0))
        try:
            stats = self._sender(session).send_model(layers, rest=rest_map)
        except BaseException as exc:
            if gate is not None:
                gate.close()
            own = says_why(exc)  # else the servers' update_weights say why: wait for them
            wait = min(timeout, OWN_FAULT_WAIT_S if own else FAILURE_WAIT_S)
            err = call.join_first(wait).error(self.init)
            names = name_ranks(exc, self.init)
            if err is None and not own:
                late = [s.name for s, t in zip(self.servers, call.threads) if t.is_alive()]
                err = RuntimeError(
                    f"no server's update_weights said why within {wait:g} s; still running on {late}"
                )
            if err is not None and hasattr(exc, "add_note"):
                exc.add_note(f"the engine's update_weights raised: {err}")
            # This rank's own error first: a trainer's NaN is the trainer's, whatever the servers say.
            said = f"{type(exc).__name__}: {exc}"
            if err is not None and not own:
                said += f"; the servers said: {err}"
            publish_failure(self.store, step, session, f"{said} (the link names {names})" if names else said)
            self._broke(exc, step, session)
            self._publish_outcome(step, session, exc, said)
            raise
        if gate is not None:
            gate.close()
        try:
            call.wait(timeout, self.init)
            FleetCall(self.servers, "finish_weight_update").wait(timeout, self.init)
        except BaseException as exc:
            self._publish_outcome(step, session, exc, f"{type(exc).__name__}: {exc}")
            raise
        self._publish_outcome(step, session, None, None)
        return _stats(session, stats)

    def _drop_link(self, keep: bool = True) -> None:
        """Close the link; with ``keep`` each delta session's kept copy stays for the next link's
        sender (``glm_fp8.transfer.delta.carry``: the servers that stay take deltas, new or
        restarted ones dense), beside what an earlier drop kept and no update took yet (two fleet
        changes in a row)."""
        senders, self._senders_cache, self._gates = self._senders_cache, {}, []
        if self.link is not None:
            self.link.close()
            self.link = None
        self.store = None
        self._kept = {**self._kept, **detach_each(senders)} if keep else {}

    def shutdown(self) -> None:
        """Close the link and the store (this rank's end); ``send()`` then refuses."""
        self._drop_link(keep=False)
        self._root = None
        self.state = "shut down"


def _stats(session: str, stats) -> dict:
    """What ``send()`` returns for one session on a rank of the link (see ``TrainerSide.send``)."""
    return {
        "session": session,
        "seconds": stats.seconds,
        "bytes": stats.nbytes,
        "sender": True,
        "delivered_bytes": stats.delivered_nbytes,
        "update_bytes": sum(s.layer_nbytes for s in stats.layers),
    }


__all__ = ["TrainerSide"]

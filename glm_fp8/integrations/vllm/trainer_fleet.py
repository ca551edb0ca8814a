"""The trainer side's fleet (docs/vllm.md#fleet): the servers of one update, the draft session
decided per server, and membership changes between updates (``FleetMembership``, mixed into
``TrainerSide``): ``set_fleet``, ``add_server``, ``remove_server``, ``replace_server``.

A change rebuilds the link (a process group cannot shrink or grow): the next generation of the
fleet gets the servers' workers at new link ranks, every server (the remaining ones too) re-runs
``init_weight_transfer_engine`` through its client, whose worker engine tears its old link down
first, and the next ``send_weights()`` is a whole update for every server, as every update is.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from glm_fp8.core.errors import LinkLost, UpdateAborted
from glm_fp8.integrations.vllm.clients import VllmServer, client_kind, draft_starter
from glm_fp8.integrations.vllm.fleet_link import FleetCall, link_broke
from glm_fp8.integrations.vllm.gate import (
    clear_gate,
    gate_reads,
    outcome_reads,
    publish_outcome,
    wait_outcome,
)

# How long trainer rank 0 waits for a removed server to release its link before going on without
# its answer (a dead server never answers).
RELEASE_WAIT_S = 10.0


def check_servers(servers: Sequence[VllmServer], what: str = "servers") -> list[VllmServer]:
    """A fleet as given to ``set_fleet``: ``VllmServer`` objects, each checked, names unique."""
    if isinstance(servers, VllmServer) or not isinstance(servers, (list, tuple)) or not servers:
        raise ValueError(
            f"{what}: expected a non-empty list of VllmServer(name, engine_ranks, client), got {servers!r}"
        )
    out = []
    for k, server in enumerate(servers):
        if not isinstance(server, VllmServer):
            raise ValueError(
                f"{what}[{k}]: expected a glm_fp8.integrations.vllm.VllmServer(name, engine_ranks, client), "
                f"got {type(server).__name__}"
            )
        out.append(server.check(f"{what}[{k}]"))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: each server needs a name of its own, got {names}")
    return out


def draft_decision(draft: str, mtp: bool, servers: Sequence[VllmServer], rank: int) -> str:
    """The draft session per server (trainer rank 0 holds the clients; the other ranks take its
    decision at connect): ``"session"`` when the source holds the MTP layer and every server's
    client can open vLLM's draft session; under ``draft="auto"`` otherwise ``"none"``, with a
    warning naming each server that cannot and its client kind; an explicit ``"session"`` that a
    server's client cannot open is refused naming it."""
    if draft not in ("auto", "session") or not mtp or rank != 0:
        return draft if draft != "auto" else ("session" if mtp else "none")
    cannot = [(s, why) for s in servers for fn, why in [draft_starter(s.client)] if fn is None]
    if not cannot:
        return "session"
    words = "; ".join(f"server {s.name!r} ({client_kind(s.client)}): {why}" for s, why in cannot)
    if draft == "session":
        raise ValueError(
            f"init_info.draft: 'session' sends the MTP layer in vLLM's draft session, which a client "
            f"cannot open: {words}; pass draft='none' (or 'stream' with the worker extension)"
        )
    # vLLM's HTTP and Ray clients have no draft method: draft_starter adapts them; anything else
    # is said rather than leaving the drafters on their old weights without a word.
    warnings.warn(
        f"init_info.draft='auto': the source holds the MTP layer, but not every server can open a draft "
        f"session, so it is not sent: {words}; wrap the client's start_draft_weight_update (AsyncLLM: "
        "glm_fp8.integrations.vllm.clients.AsyncLLMClient), or pass draft='none' to silence this",
        stacklevel=4,
    )
    return "none"


def release_servers(servers: Sequence[VllmServer], timeout_s: float) -> None:
    """Ask removed servers to leave the link (``shutdown_weight_transfer_engine``, which vLLM's
    clients have), without waiting long for one that died; what fails is only a warning."""
    with_release = [
        s for s in servers if callable(getattr(s.client, "shutdown_weight_transfer_engine", None))
    ]
    if not with_release:
        return
    call = FleetCall(with_release, "shutdown_weight_transfer_engine").join(min(timeout_s, RELEASE_WAIT_S))
    err = call.error()
    if err is not None:
        warnings.warn(f"removing servers: {err} (the server goes anyway)", stacklevel=4)


class FleetMembership:
    """``TrainerSide``'s membership changes: call them on every trainer rank alike, between
    updates (trainer rank 0 with the clients; the other ranks may pass ``client=None``)."""

    servers: list[VllmServer]

    @property
    def server_names(self) -> list[str]:
        return [s.name for s in self.servers]

    def set_fleet(self, servers: Sequence[VllmServer]) -> None:
        """Make ``servers`` the fleet: a server gone from it is asked to leave its link, the link
        is rebuilt with the new membership (a new generation: every server re-runs its init, at
        its new link ranks), and the next ``send_weights()`` sends every server a whole update
        (every update is whole: a new or restarted server gets all of it before it serves what
        the trainer sent). Raises what the new init raises, naming the server."""
        if self.state not in ("connected", "broken"):
            raise RuntimeError(
                f"set_fleet(): this trainer side is {self.state}; membership changes need a connected one"
            )
        new = check_servers(servers)
        if self.rank == 0:
            names = {s.name for s in new}
            release_servers([s for s in self.servers if s.name not in names], self.init.timeout_s)
        self._rebuild(new)

    def add_server(self, server: VllmServer) -> None:
        """``set_fleet(servers + [server])``: the new server's workers join the rebuilt link last."""
        self.set_fleet([*self.servers, server])

    def remove_server(self, name: str) -> None:
        """``set_fleet`` without the server ``name`` (a server that died or keeps failing: the link is
        rebuilt with the remaining servers, since a process group cannot shrink)."""
        self._index(name)
        self.set_fleet([s for s in self.servers if s.name != name])

    def replace_server(self, name: str, server: VllmServer) -> None:
        """``set_fleet`` with ``server`` in the place of ``name`` (a restarted server: its new
        workers get a whole update at the next ``send_weights()``)."""
        k = self._index(name)
        self.set_fleet([*self.servers[:k], server, *self.servers[k + 1 :]])

    def _rebuild(self, servers: list[VllmServer]) -> None:
        """The next generation of the link, with ``servers`` (``FleetMembership.set_fleet``)."""
        self._drop_link()
        self.servers, self.named = servers, True
        self.init = self._make_init(self.init.generation + 1)
        self.state = "built"
        try:
            self.connect()
        except BaseException as exc:  # another set_fleet may still succeed: the store is whole
            self.state, self.broken = "broken", f"the fleet change to {self.server_names} failed ({exc})"
            raise

    def _broke(self, exc: BaseException, step: int, session: str, broken: bool | None = None) -> None:
        """After a transfer failed: if the link itself failed (a peer gone; ``broken``, else decided
        from ``exc``), it cannot carry another update; ``send()`` refuses until a membership change
        rebuilds it."""
        if link_broke(exc) if broken is None else broken:
            self.state = "broken"
            self.broken = f"update {step} ({session} session) broke the link: {type(exc).__name__}"
            if hasattr(exc, "add_note"):
                exc.add_note(
                    "the link is broken: send_weights() refuses until engine.remove_server(name), "
                    "replace_server(...) or set_fleet(...) rebuilds it (on every trainer rank)"
                )

    @property
    def _off_link(self) -> int:
        """Trainer ranks off the link (one sender: every rank but 0), which wait for each outcome."""
        return self.trainer_ranks - self.senders

    def _publish_outcome(self, step: int, session: str, exc: BaseException | None, why: str | None) -> None:
        """Rank 0: update ``step``'s outcome for the ranks off the link (none with many senders)."""
        if self._off_link:
            publish_outcome(self.store, step, session, why, broken=exc is not None and link_broke(exc))

    def _await_outcome(self, step: int, session: str) -> None:
        """A rank off the link, after its part of the gathers: raise as the link's ranks did when the
        update failed (naming the server, as rank 0 learned it), and refuse the next one as they do
        when the link broke."""
        why, broken = wait_outcome(self.store, step, session)
        if why is None:
            return
        error = LinkLost if broken else UpdateAborted  # the link's ranks raised a LinkLost too
        exc = error(f"update {step} ({session} session) failed on the link: trainer rank 0: {why}")
        self._broke(exc, step, session, broken)
        raise exc

    def _prune_gates(self) -> None:
        """Drop the keys of earlier updates that every other rank has read (rank 0)."""
        readers = self.init.world_size - self.senders + self.trainer_ranks - 1
        keep = []
        for step, session, gathers in self._gates:
            if gate_reads(self.store, step, session) >= readers and (
                outcome_reads(self.store, step, session) >= self._off_link
            ):
                clear_gate(self.store, step, session, range(self.senders, self.init.world_size), gathers)
            else:
                keep.append((step, session, gathers))
        self._gates = keep

    def _index(self, name: str) -> int:
        names = self.server_names
        if name not in names:
            raise ValueError(f"server name {name!r}: not a server of this fleet {names}")
        return names.index(name)


__all__ = ["FleetMembership", "check_servers", "draft_decision", "release_servers"]

"""A fleet of vLLM servers behind one trainer engine (docs/vllm.md#fleet), without vLLM: trainer
rank 0's calls to every server's client in parallel (``FleetCall``: each client's
``update_weights`` blocks until its workers have received), errors that name the server, and the
link of one generation of the fleet (``open_store``; ``open_link``: a ``StoreLink`` over one
generation's keys of the store).

Membership changes rebuild the link (a process group cannot shrink or grow): trainer rank 0
serves one TCP store for the trainer's life, and each generation of the fleet keys everything it
writes there (the link's rendezvous, the fleet's descriptions, the gates) under its own prefix.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from glm_fp8.core.errors import GlmFp8Error, LinkLost
from glm_fp8.integrations.vllm.clients import VllmServer, client_kind, draft_starter
from glm_fp8.integrations.vllm.gate import poll_ready
from glm_fp8.integrations.vllm.sync import SyncInit
from glm_fp8.transfer.link import StoreLink


def open_store(host: str, port: int, *, master: bool, timeout_s: float) -> dist.TCPStore:
    """Trainer rank 0's store (``master``: it serves it, for the trainer engine's life, whatever the
    fleet), or a client of it; nobody waits for a fixed number of clients."""
    return dist.TCPStore(host, port, None, master, timedelta(seconds=timeout_s), wait_for_workers=False)


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """Generation ``generation``'s view of the store: a rebuilt link never reads an older one's keys."""
    return dist.PrefixStore(f"glm_fp8/gen/{generation}/", store)


def open_link(
    info: SyncInit,
    rank: int,
    device: torch.device,
    store: dist.Store | None = None,
    global_ranks: list[int] | None = None,
) -> StoreLink:
    """This rank's link of ``info``'s generation (``store``: the trainer's store, a generation's view
    of it; a client of the trainer's store is opened when None). A rank lost mid-update is named
    by its server, with what to call next (``lost_advice``). ``global_ranks``: the senders' trainer
    ranks, when they are not link ranks 0..S-1 (a Megatron trainer's)."""
    if store is None:
        store = open_store(info.master_address, info.master_port, master=False, timeout_s=info.timeout_s)
        store = generation_store(store, info.generation)
    return StoreLink.over_store(
        store,
        rank,
        info.world_size,
        backend=info.link_backend,
        timeout=info.timeout,
        device=device,
        describe=info.rank_name,
        advice=lambda r: lost_advice(info, r),
        global_ranks=global_ranks,
    )


def link_broke(exc: BaseException) -> bool:
    """``exc`` (from a transfer) says the link itself failed (a rank lost: ``LinkLost``; gloo's
    "Connection closed by peer", NCCL's errors), not a refusal voted by every rank (after which
    the link is whole)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, LinkLost) or not isinstance(seen, GlmFp8Error):
            return True
        seen = seen.__cause__
    return False


def server_of(init: SyncInit, rank: int) -> str | None:
    """The name of the server whose worker is link rank ``rank`` (None: a sender, or one nameless
    engine)."""
    for name, first, workers in init.fleet():
        if first <= rank < first + workers:
            return name or None
    return None


def lost_advice(init: SyncInit, rank: int | None) -> str:
    """What to call once link rank ``rank`` is lost (None: a transport failure with no rank to name)."""
    if rank is None:
        return (
            "; the link is broken: engine.set_fleet(engine.servers) on every trainer rank rebuilds it "
            "(remove_server(name) for a server that is gone)"
        )
    if rank < init.senders:
        return (
            "; a trainer rank is gone: the trainer must be restarted (every trainer rank), and its "
            "trainer_init re-runs every server's init_weight_transfer_engine"
        )
    name = server_of(init, rank)
    if name is None:  # one engine without a name: the link is rebuilt with it once it is back
        return remove_hint(init, ["the engine"])
    restarted = f", or engine.replace_server({name!r}, VllmServer(...)) once it is restarted"
    return remove_hint(init, [name]) + restarted


def remove_hint(init: SyncInit, names: Sequence[str]) -> str:
    """What to call to go on without the servers ``names``."""
    if not names:
        return ""
    if init.servers is None:  # one vLLM engine: the link is rebuilt with the same (restarted) engine
        return "; once the engine is back, engine.set_fleet(engine.servers) on every trainer rank rebuilds it"
    calls = " and ".join(f"engine.remove_server({n!r})" for n in names)
    return (
        f"; if it is gone, call {calls} on every trainer rank (a process group cannot shrink: that "
        "rebuilds the link with the remaining servers, which re-run their init), then send_weights()"
    )


_RANK = re.compile(r"\brank (\d+)\b")


def name_ranks(exc: BaseException, init: SyncInit) -> list[str]:
    """The servers of the engine ranks ``exc``'s message names (the transfer layer names link
    ranks); adds a note saying which server each is, and what to call without it."""
    ranks = sorted({int(r) for r in _RANK.findall(str(exc)) if int(r) >= init.senders})
    if not ranks or not hasattr(exc, "add_note"):
        return []
    names = list(dict.fromkeys(n for n in (server_of(init, r) for r in ranks) if n is not None))
    exc.add_note("; ".join(f"link rank {r} is {init.rank_name(r)}" for r in ranks) + remove_hint(init, names))
    return names


class FleetCall:
    """One client method called on every server at once, each in a thread of its own; each
    failure is kept with when it came, the first first (a dead server's client fails before the
    servers whose link broke with it); ``on_failure(call)`` runs in the thread of the first failure,
    at once (what it raises is dropped)."""

    def __init__(
        self,
        servers: Sequence[VllmServer],
        method: str,
        args: Sequence[tuple] | None = None,
        calls=None,
        on_failure: Callable[[FleetCall], None] | None = None,
    ):
        self.servers, self.method, self.on_failure = list(servers), method, on_failure
        self.failures: list[tuple[float, int, BaseException]] = []
        self._lock = threading.Lock()
        self.threads = []
        for k, server in enumerate(self.servers):
            fn = calls[k] if calls is not None else getattr(server.client, method)
            thread = threading.Thread(target=self._run, args=(k, fn, *(args[k] if args else ())), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, k: int, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            with self._lock:
                first = not self.failures
                self.failures.append((time.monotonic(), k, exc))
            if first and self.on_failure is not None:
                try:
                    self.on_failure(self)
                except Exception:  # noqa: BLE001 - an early account only; the caller still raises
                    pass

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float) -> FleetCall:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self

    def join_first(self, timeout_s: float, grace_s: float = 0.5) -> FleetCall:
        """Wait until a call failed (then ``grace_s`` more, for the failures it caused, which come
        after it) or every call returned, up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and not self.failures and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.failures:
            self.join(min(grace_s, max(0.0, deadline - time.monotonic())))
        return self

    def failed(self) -> list[tuple[int, BaseException]]:
        with self._lock:
            return [(k, exc) for _, k, exc in sorted(self.failures, key=lambda f: f[0])]

    def error(self, init: SyncInit | None = None) -> RuntimeError | None:
        """The failures as one error naming each server (the first to fail first), or None."""
        failed = self.failed()
        if not failed:
            return None
        parts = [
            f"server {self.servers[k].name!r} #{k} ({client_kind(self.servers[k].client)}): its "
            f"{self.method} raised {type(exc).__name__}: {exc}"
            for k, exc in failed
        ]
        text = parts[0] + (f" (then: {'; '.join(parts[1:])})" if len(parts) > 1 else "")
        hint = remove_hint(init, [self.servers[failed[0][0]].name]) if init is not None else ""
        err = RuntimeError(text + hint)
        err.servers = [self.servers[k].name for k, _ in failed]
        return err

    def wait(self, timeout_s: float, init: SyncInit | None = None) -> None:
        """Join every call; raise the failures, naming each server."""
        self.join(timeout_s)
        err = self.error(init)
        if err is not None:
            raise err
        if self.alive():
            late = [s.name for s, t in zip(self.servers, self.threads) if t.is_alive()]
            raise TimeoutError(
                f"{self.method}: server(s) {late} did not answer within init_info.timeout_s={timeout_s:g} s"
                + remove_hint(init, late)
            )


def start_sessions(servers: Sequence[VllmServer], init: SyncInit, draft: bool) -> None:
    """Trainer rank 0: open the session (vLLM's draft session when ``draft``) on every server at
    once. If one fails, the servers that opened theirs are finished again (nothing moved; vLLM
    would refuse their next start), and the failure is raised naming the server."""
    calls = [draft_starter(s.client)[0] for s in servers] if draft else None
    call = FleetCall(servers, "start_weight_update", calls=calls).join(init.timeout_s)
    err = call.error(init)
    if err is None and not call.alive():
        return
    failed = {k for k, _ in call.failed()} | {k for k, t in enumerate(call.threads) if t.is_alive()}
    opened = [s for k, s in enumerate(servers) if k not in failed]
    FleetCall(opened, "finish_weight_update").join(min(init.timeout_s, 30.0))
    call.wait(0.0, init)


def wait_ready(store, step: int, session: str, init: SyncInit, call: FleetCall) -> None:
    """Trainer rank 0, before the gate: until every engine worker said it is ready for this update.
    Raises the first refusal, or a client call's error as soon as one failed (vLLM's own refusals
    come that way: "start_weight_update must be called before update_weights"; so does a dead
    server's), naming the server."""
    engines = range(init.senders, init.world_size)
    deadline = time.monotonic() + init.timeout_s
    pause = 0.001
    while True:
        said, refusal = poll_ready(store, step, session, engines, name=init.rank_name)
        if said:
            if refusal is not None:
                raise RuntimeError(refusal)
            return
        err = call.error(init)
        if err is not None:
            raise RuntimeError(f"the engine's update_weights raised before the transfer: {err}") from err
        if time.monotonic() > deadline:
            running = [s.name for s, t in zip(call.servers, call.threads) if t.is_alive()]
            raise TimeoutError(
                f"update {step} ({session} session): not every engine worker was ready within "
                f"init_info.timeout_s={init.timeout_s:g} s (update_weights still running on {running})"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


# --- what rank 0 learned of a failed update, for the other trainer ranks ----------------------------


def _failure_key(step: int, session: str) -> str:
    return f"glm_fp8/failed/{step}/{session}"


def publish_failure(store, step: int, session: str, text: str) -> None:
    """Trainer rank 0: what its clients said of a failed update (naming the servers)."""
    store.set(_failure_key(step, session), text)


def read_failure(store, step: int, session: str, wait_s: float) -> str | None:
    """Rank 0's account of a failed update, waiting up to ``wait_s``; None if it has none."""
    deadline = time.monotonic() + wait_s
    key = _failure_key(step, session)
    while True:
        if store.check([key]):
            return store.get(key).decode()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


__all__ = [
    "FleetCall",
    "generation_store",
    "link_broke",
    "lost_advice",
    "name_ranks",
    "open_link",
    "open_store",
    "publish_failure",
    "read_failure",
    "remove_hint",
    "server_of",
    "start_sessions",
    "wait_ready",
]

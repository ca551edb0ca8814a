"""Liveness of a link's ranks, independent of its transport (docs/layouts.md#a-rank-that-dies).

A transport learns of a dead peer only where it talks to that peer: a gloo rank that waits on a
live peer, which itself stopped when the dead one's connection closed, waits for the transport's
timeout (minutes), and NCCL kernels spin. So every rank of a link that has a store (``StoreLink``,
``TorchLink``) runs a ``Liveness``: a daemon thread that every ``beat_s`` counts up its own rank's
beat in the store and reads every other rank's; a rank whose beat stood still for ``lease_s`` is
lost. The first rank to find it writes the fault once (compare-and-set), naming the rank, and every
rank reads that same text within a beat; the link's waits then raise ``LinkLost`` with it, and
its next operations too. A rank that closes its link says so, and is never called lost.

The thread talks to the store over a connection of its own (``Store.clone``): the caller's may be
blocked in a wait of its own (a gate, an outcome), which would otherwise stop the beats.

Costs: per rank, three store requests a beat (its beat, the fault key, every rank's beat in one
``multi_get``), and one thread that sleeps between them.
"""

from __future__ import annotations

import atexit
import math
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from glm_fp8.core.errors import LinkLost

#: Seconds a rank's beat may stand still before the rank is lost. Long enough for a process
#: starved of CPU (2 cores, many processes, Triton's interpreter) to beat; short enough that every
#: rank stops within seconds of a death.
DEFAULT_LEASE_S = 5.0
_FAULT = "fault"
_GONE = -1  # the beat of a rank that closed its end of the link


def _no_advice(rank: int | None) -> str:
    return "; the link cannot carry another update: build a new one without that rank"


class Liveness:
    """The beat of this rank and the watch over every other of a link (see the module docstring).

    Args:
        store: the link's store (its keys go under ``prefix``); cloned for the thread.
        rank / size: this rank and the link's size.
        lease_s: seconds without a beat before a rank is lost.
        describe: link rank -> its name in messages (default "link rank r").
        advice: link rank (None: unknown) -> what the caller should do, appended to the message.
        store_rank: the link rank whose process serves the store (None: not on the link): when the
            store stops answering, that rank is the one lost.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        describe: Callable[[int], str] | None = None,
        advice: Callable[[int | None], str] | None = None,
        store_rank: int | None = 0,
        prefix: str = "glm_fp8/alive/",
    ):
        if not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) or lease_s <= 0:
            raise ValueError(f"lease_s: expected a positive number of seconds, got {lease_s!r}")
        self.rank, self.size, self.lease_s = rank, size, float(lease_s)
        self.beat_s = min(0.5, self.lease_s / 4)
        self.describe = describe or (lambda r: f"link rank {r}")
        self.advice = advice or _no_advice
        self.store_rank = store_rank
        self.store = dist.PrefixStore(prefix, store.clone())
        self._lock = threading.Lock()  # one request at a time on the clone: the thread's, the caller's
        self._lost: LinkLost | None = None
        self._on_lost: list[Callable[[], None]] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        with self._lock:
            self.store.add(self._key(rank), 1)  # before the rendezvous: once the link is up, all exist
        _OPEN.add(self)

    @staticmethod
    def _key(rank: int) -> str:
        return f"beat/{rank}"

    def start(self) -> Liveness:
        """Beat and watch, in a daemon thread, until ``close``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"glm_fp8-liveness-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def on_lost(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (in the watching thread) once a rank is lost: e.g. abort NCCL communicators,
        whose kernels would otherwise wait for the lost rank forever."""
        self._on_lost.append(fn)

    @property
    def lost(self) -> LinkLost | None:
        """The fault, once known (a rank lost, the store gone, a transport failure); else None."""
        return self._lost

    def check(self) -> None:
        """Raise ``LinkLost`` if the link has lost a rank (a new exception each time)."""
        lost = self._lost
        if lost is not None:
            raise LinkLost(str(lost), lost.rank)

    def wait(self, work) -> None:
        """Wait for a gloo ``work``, raising ``LinkLost`` as soon as the link lost a rank; a transport
        error is pinned on the lost rank (``blame``). The work is waited for in a thread of its own
        (abandoned, blocked until the transport's timeout, once the link is lost): gloo's wait with
        a timeout breaks the connection of a point-to-point message it times out on. The caller's
        current CUDA stream is ordered after the work as by ``work.wait()`` in its own thread."""
        self.check()
        done, failed = threading.Event(), []
        # A gloo work on CUDA tensors orders the waiting thread's *current* stream after its copies
        # back to the device, and the current stream is per thread: the thread waits under the
        # caller's, so the caller's stream reads the tensors only once they arrived.
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

        def run() -> None:
            try:
                if stream is None:
                    work.wait()
                else:
                    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                        work.wait()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="glm_fp8-link-wait", daemon=True).start()
        while not done.wait(self.beat_s):
            self.check()
        if failed:
            raise self.blame(failed[0]) from failed[0]

    def blame(self, exc: BaseException) -> LinkLost:
        """A ``LinkLost`` for the transport error ``exc``: a peer that died closes its connections at
        once, but is found lost only after ``lease_s``; wait that long for the rank to name. If every
        rank still beats, the fault is this rank's transport: published, so the others stop too."""
        deadline = time.monotonic() + self.lease_s + 3 * self.beat_s
        while self._lost is None and time.monotonic() < deadline and not self._closed.is_set():
            time.sleep(self.beat_s / 4)
        if self._lost is None:
            self.report(
                None, f"its transport failed on {self.describe(self.rank)}: {type(exc).__name__}: {exc}"
            )
        return LinkLost(str(self._lost), self._lost.rank)

    def report(self, rank: int | None, why: str) -> None:
        """Publish the link's fault (``rank`` lost, or None: unknown), unless another rank did first:
        every rank then reads the first one."""
        who = f"{self.describe(rank)} is lost: " if rank is not None else "the link failed: "
        text = f"{who}{why}{self.advice(rank)}"
        payload = f"{'' if rank is None else rank}\n{text}"
        try:
            with self._lock:
                payload = self.store.compare_set(_FAULT, "", payload).decode()
        except Exception:  # noqa: BLE001 - the store is gone too: this rank's account stands
            pass
        self._set_lost(payload)

    def _set_lost(self, payload: str) -> None:
        if self._lost is not None:
            return
        head, _, text = payload.partition("\n")
        self._lost = LinkLost(text, int(head) if head else None)
        for fn in self._on_lost:
            try:
                fn()
            except Exception:  # noqa: BLE001 - tearing down a transport that is broken already
                pass

    def _run(self) -> None:
        others = [r for r in range(self.size) if r != self.rank]
        keys = [self._key(r) for r in others]
        seen: dict[int, tuple[int, float]] = {}
        ready = False
        last = time.monotonic()
        while not self._closed.wait(self.beat_s):
            now = time.monotonic()
            if now - last > self.lease_s / 2:  # this thread itself was held up: judge no one on it
                seen = {r: (c, now) for r, (c, _) in seen.items()}
            last = now
            try:
                with self._lock:
                    self.store.add(self._key(self.rank), 1)
                    fault = self.store.get(_FAULT).decode() if self.store.check([_FAULT]) else None
                    ready = ready or self.store.check(keys)
                    counts = [int(c) for c in self.store.multi_get(keys)] if ready else []
            except Exception as exc:  # noqa: BLE001 - the store's server is gone
                if self._closed.is_set():
                    return
                why = f"the link's store stopped answering ({type(exc).__name__}: {exc})"
                if self.store_rank is not None:
                    why += "; its process serves the store"
                self.report(self.store_rank, why)  # it cannot publish: the account stays this rank's
                return
            if fault is not None:
                self._set_lost(fault)
                continue
            for r, c in zip(others, counts):
                if c == _GONE:
                    seen.pop(r, None)
                    continue
                before = seen.get(r)
                if before is None or before[0] != c:
                    seen[r] = (c, now)
                elif now - before[1] > self.lease_s and self._lost is None:
                    self.report(r, f"no heartbeat for {now - before[1]:.1f} s (its process died or hangs)")

    def close(self, leave: bool = True) -> None:
        """Stop beating; ``leave``: say this rank left its link on purpose (it is never called lost).
        A process that exits without closing its link is lost to the ranks still on it."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.beat_s + 1)
        if leave:
            try:
                with self._lock:
                    self.store.set(self._key(self.rank), str(_GONE))
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass
        _OPEN.discard(self)


_OPEN: weakref.WeakSet[Liveness] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    """At exit: no thread left in a store request while the interpreter goes. The ranks are not
    said to leave: a process that exits while its peers still wait on it (an error it raised) is
    lost to them."""
    for liveness in list(_OPEN):
        liveness.close(leave=False)


__all__ = ["DEFAULT_LEASE_S", "Liveness"]

"""The gate of glm_fp8's vLLM backend (docs/vllm.md#what-a-step-does): every update's go / no-go,
through the link's TCP store, before the link is used, and its outcome for the trainer ranks off
the link. Part of the handshake (``glm_fp8.integrations.vllm.sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

# A refusal known before the transfer (a worker outside a session, vLLM's own "start_weight_update
# must be called before update_weights", a client call that raised) would otherwise leave the
# ranks that did enter the transfer waiting for the others until the link's timeout, and the link
# broken for the next update. So no rank enters it before trainer rank 0 opened the gate: each
# engine worker says it is ready (or why not) under the update's key, and rank 0 writes "go" once
# every worker is ready, or the first refusal (a worker's, or its client call's error) for every
# rank to raise at once.

GO = "go"


def _gate_key(step: int, session: str, what: str) -> str:
    return f"glm_fp8/gate/{step}/{session}/{what}"


def publish_ready(store, step: int, session: str, rank: int, refusal: str | None) -> None:
    """Engine rank ``rank`` is ready for update ``step`` (``refusal`` None), or why it is not."""
    store.set(_gate_key(step, session, f"ready/{rank}"), refusal or "")


def poll_ready(store, step: int, session: str, ranks: Sequence[int], name=None) -> tuple[bool, str | None]:
    """(every rank said, the first refusal among them, naming its rank: ``name(rank)``, its server
    too), without waiting."""
    keys = [_gate_key(step, session, f"ready/{r}") for r in ranks]
    if not store.check(keys):
        return False, None
    for r, key in zip(ranks, keys):
        said = store.get(key).decode()
        if said:
            who = name(r) if name is not None else f"engine rank {r}"
            return True, f"{who} refused the update: {said}"
    return True, None


def open_gate(store, step: int, session: str, verdict: str | None) -> None:
    """Trainer rank 0's verdict on update ``step``: None, every rank goes; else why none does."""
    store.set(_gate_key(step, session, "verdict"), GO if verdict is None else verdict)


def wait_gate(store, step: int, session: str) -> None:
    """Wait for rank 0's verdict (up to the store's timeout); raise it, naming the update, unless
    it is "go"."""
    verdict = store.get(_gate_key(step, session, "verdict")).decode()
    if verdict != GO:
        raise RuntimeError(f"update {step} ({session} session) stopped before any byte moved: {verdict}")
    store.add(_gate_key(step, session, "read"), 1)


def gate_reads(store, step: int, session: str) -> int:
    """How many ranks read update ``step``'s "go" (its keys can go once every reader has)."""
    return int(store.add(_gate_key(step, session, "read"), 0))


# With one sender, the trainer ranks off the link take part in its gathers only, and would return
# from an update that then failed on the link as if it had landed: rank 0 therefore ends every
# update with its outcome, which those ranks wait for, so that every trainer rank raises alike.
OK = "ok"
BROKEN = "broken: "  # the outcome's prefix when the link itself failed (a server gone)


def publish_outcome(store, step: int, session: str, failure: str | None, broken: bool = False) -> None:
    """Trainer rank 0's outcome of update ``step``: None, it landed on every server; else why not
    (``broken``: the link failed and a membership change must rebuild it)."""
    text = OK if failure is None else (BROKEN if broken else "") + failure
    store.set(_gate_key(step, session, "outcome"), text)


def wait_outcome(store, step: int, session: str) -> tuple[str | None, bool]:
    """Wait for rank 0's outcome of update ``step`` (up to the store's timeout): (None, False) when
    it landed, else (why, whether the link broke)."""
    text = store.get(_gate_key(step, session, "outcome")).decode()
    store.add(_gate_key(step, session, "outcome_read"), 1)
    if text == OK:
        return None, False
    return text.removeprefix(BROKEN), text.startswith(BROKEN)


def outcome_reads(store, step: int, session: str) -> int:
    """How many ranks read update ``step``'s outcome."""
    return int(store.add(_gate_key(step, session, "outcome_read"), 0))


def clear_gate(store, step: int, session: str, ranks: Sequence[int], gathers: int = 0) -> None:
    """Drop an update's keys once every rank is past them (``gathers``: its ``GatherGate`` steps)."""
    for what in ("verdict", "read", "outcome", "outcome_read"):
        store.delete_key(_gate_key(step, session, what))
    for r in ranks:
        store.delete_key(_gate_key(step, session, f"ready/{r}"))
    for pos in range(gathers):
        store.delete_key(_gate_key(step, session, f"gather/{pos}"))


# With one sender, the trainer ranks off the link take part in its gathers (collectives over the
# trainer's mesh), step by step. Were they to run ahead, an update that fails partway would leave
# them inside a gather that rank 0 never enters (rank 0 stops pulling layers at the failed vote), and
# the trainer's own process group stuck. So rank 0 says "go" for each step just before it gathers
# it, and "stop" for every step it will not gather once the update ended; a rank off the link runs
# a step's gathers only after its "go" (a blocking read of the store, no polling): every trainer
# rank then runs the same gathers, the update fails or lands, and the next one starts clean.
STOP = "stop"


class GatherGate:
    """Rank 0's side: its layers (``layers``) and non-layer tensors (``rest``) as the sender reads
    them, each step announced before its gathers run; ``close`` ends the update's steps."""

    def __init__(self, store, step: int, session: str, n_layers: int, rest: bool):
        self.store, self.step, self.session = store, step, session
        self.n_layers, self.steps = n_layers, n_layers + int(rest)
        self.said = 0  # steps announced so far

    def _go(self, pos: int) -> None:
        if pos == self.said and pos < self.steps:
            self.store.set(_gate_key(self.step, self.session, f"gather/{pos}"), GO)
            self.said += 1

    def layers(self, layers: Iterable) -> Iterator:
        it = iter(layers)
        for pos in range(self.n_layers):
            self._go(pos)
            item = next(it, None)  # a source's own gathers run here (vLLM's iter_full)
            if item is None:
                return
            yield item
        yield from it  # past the announced layers: the sender refuses it

    def rest(self, rest: Mapping | None) -> Mapping | None:
        return None if rest is None else _Announced(rest, lambda: self._go(self.n_layers))

    def close(self) -> None:
        """Every step not announced: "stop" (the ranks off the link gather no further)."""
        for pos in range(self.said, self.steps):
            self.store.set(_gate_key(self.step, self.session, f"gather/{pos}"), STOP)
        self.said = self.steps


def gather_go(store, step: int, session: str) -> Callable[[int], bool]:
    """A rank off the link: ``go(pos)`` waits for rank 0's word on step ``pos``'s gathers (up to the
    store's timeout): True to run them, False once the update ended before them."""
    return lambda pos: store.get(_gate_key(step, session, f"gather/{pos}")).decode() == GO


class _Announced(Mapping):
    """A mapping whose first read says "go" first (the non-layer tensors: gathered when read)."""

    def __init__(self, data: Mapping, go: Callable[[], None]):
        self._data, self._go = data, go

    def _read(self) -> Mapping:
        self._go()
        return self._data

    def __getitem__(self, key):
        return self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


__all__ = [
    "GO",
    "STOP",
    "GatherGate",
    "gather_go",
    "clear_gate",
    "gate_reads",
    "open_gate",
    "outcome_reads",
    "poll_ready",
    "publish_outcome",
    "publish_ready",
    "wait_gate",
    "wait_outcome",
]

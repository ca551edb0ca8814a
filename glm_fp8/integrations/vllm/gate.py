"""The gate of glm_fp8's vLLM backend (docs/vllm.md#what-a-step-does): every update's go / no-go,
through the link's TCP store, before the link is used, and its outcome for the trainer ranks off
the link. Re-exported by
``glm_fp8.integrations.vllm.sync``, the handshake it is part of.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def clear_gate(store, step: int, session: str, ranks: Sequence[int]) -> None:
    """Drop an update's keys once every rank is past them."""
    for what in ("verdict", "read", "outcome", "outcome_read"):
        store.delete_key(_gate_key(step, session, what))
    for r in ranks:
        store.delete_key(_gate_key(step, session, f"ready/{r}"))


__all__ = [
    "GO",
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

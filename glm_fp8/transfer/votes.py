"""The votes of an update (protocol: ``glm_fp8.transfer.wire``): the pipelined step votes, read one
step late, and how a refusal reaches every rank with its reason, a refusing constructor's
included."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.transfer.link import Link, as_link
from glm_fp8.transfer.wire import (
    MAGIC,
    PROTOCOL_VERSION,
    REASON_BYTES,
    REFUSED_ARGUMENTS,
    refusal_code,
    refusal_rank,
)


class StepVotes:
    """The votes of a pipelined update, read one step late: a step's vote is queued on the link's
    stream behind its messages and copied to host memory there, and the host reads it only after
    it queued the next step, so the link always has a layer to carry (a host read waits for that
    vote's copy only). Two in flight at most: step k's vote is read before step k + 2 is queued."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.votes = torch.zeros(2, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.link: Link | None = None  # the link of the last vote posted

    def post(self, link: Link, step: int, code: int, flags: Sequence[tuple[torch.Tensor, int]] = ()) -> None:
        """Queue step ``step``'s vote on the current stream: ``code`` (0: fine), raised to ``c`` for
        each ``(flag, c)`` whose device boolean ``flag`` is set (a check decided on the device),
        all-reduced MAX over the link."""
        i = step % 2
        self.link = link
        buf = self.votes[i : i + 1]
        buf.fill_(max(0, code))
        for flag, c in flags:
            torch.maximum(buf, flag.reshape(1).to(torch.int64) * c, out=buf)
        link.all_reduce_max(buf)
        self.host[i : i + 1].copy_(buf, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()

    def read(self, step: int) -> int:
        """Every rank's maximum at step ``step`` (waits for that vote only)."""
        i = step % 2
        if self.events[i] is not None:
            self.events[i].synchronize()
        verdict = int(self.host[i])
        self.link.check()  # an aborted transport delivers garbage: a lost rank says why
        return verdict


def explain_refusal(link: Link, verdict: int, own: BaseException | None, device: torch.device) -> str:
    """After a refused prelude or manifest vote: the rank ``verdict`` names broadcasts why
    (``own``, its refusal), ``REASON_BYTES`` of UTF-8, and every rank returns that text."""
    who = refusal_rank(verdict)
    if link.stand_in or not 0 <= who < link.size:
        return str(own) if own is not None else "no reason given"
    buf = torch.zeros(REASON_BYTES, dtype=torch.uint8, device=device)
    if link.rank == who:
        raw = (str(own) if own is not None else "no reason given").encode("utf-8")[:REASON_BYTES]
        if raw:
            buf[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    link.broadcast(buf, who)
    return host_bytes(buf).rstrip(b"\0").decode("utf-8", "replace")


def refuse_agreement(comm: object | None, src: object, device: object, error: BaseException) -> None:
    """A rank whose endpoint refused its own arguments (``error``) still takes part in the first
    vote of the update the other ranks start, and votes ``REFUSED_ARGUMENTS``: every rank then
    stops there with an error naming this rank and ``error``'s message, instead of waiting for it
    until the transport's timeout. Does nothing where this rank cannot reach the link (``comm`` or
    ``src`` themselves refused) or the link is a stand-in with no peers. Blocks until the leader
    starts the update (its ``send_model``): a constructor that refuses is not left alone."""
    try:
        link = as_link(comm)
        root = check_int("src", src, 0, link.size - 1)
        dev = resolve_device(device) if isinstance(device, (str, torch.device)) else default_device()
        torch.empty(0, device=dev)
    except Exception:  # noqa: BLE001 - the caller raises ``error``; there is no link to tell
        return
    if link.stand_in or link.size < 2:
        return
    try:
        leader = link.rank == root
        words = [MAGIC, PROTOCOL_VERSION, 0, 1] if leader else [0, 0, 0, 0]
        prelude = torch.tensor(words, dtype=torch.int64).to(dev)
        link.broadcast(prelude, root)
        vote = torch.tensor([refusal_code(REFUSED_ARGUMENTS, link.rank)], dtype=torch.int64).to(dev)
        link.all_reduce_max(vote)
        explain_refusal(link, int(vote.item()), error, dev)
    except Exception as exc:  # noqa: BLE001 - ``error`` is what the caller raises
        if hasattr(error, "add_note"):
            error.add_note(f"(telling the other ranks of the link failed: {exc})")


@contextlib.contextmanager
def refusal_is_voted(comm: object | None, src: object, device: object) -> Iterator[None]:
    """Around an endpoint's constructor: an error raised in it is voted (``refuse_agreement``)
    before it propagates."""
    try:
        yield
    except Exception as exc:
        refuse_agreement(comm, src, device, exc)
        raise


def host_bytes(data: torch.Tensor) -> bytes:
    import ctypes

    raw = data.cpu()
    return ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, as a tensor made there
    reports it (``cuda:0``), so that a parameter's device compares equal to the endpoint's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""How a segment of the transfer plan travels (``glm_fp8.transfer.routes``, docs/layouts.md,
"Delivery"): one broadcast in a group of link ranks (its sender's and its class's), or point to
point to each rank of its class; and the rule that chooses, per mode.

- One sender (full broadcast, scatter): a class of several ranks gets a group broadcast where the
  link can make groups; a class that is every other rank always does (the link's own broadcast).
  One communicator per class, and the sender's NIC carries each class's bytes once.
- Many senders: a group per (sender, class of several ranks), up to senders x classes
  communicators, each with its own buffers on every member, made at the first update. They are
  taken only where they shorten the update (``sender_groups_pay``): where the senders' NICs bound
  it, and no rank would be in more than ``MAX_GROUPS_PER_RANK`` groups; where an engine rank's
  NIC bounds it, point to point costs no time and no communicator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Many senders take group broadcasts only where they cut the busiest NIC's bytes by more than this
# fraction: below it the gain is within what the update-time model leaves out (per-message
# latency, stragglers; its pipeline factor alone is 1.01), and does not pay for the communicators.
# GLM-5 (plan counts): 32 trainer GPUs into 4 x EP 8 gain 0.9 % (91.06 -> 90.28 GiB): point to point
# stays; 8 trainer GPUs into the same servers 4.0x (361.71 -> 90.43 GiB): groups.
GROUP_MIN_GAIN = 0.05
# ... and only where no link rank would be in more groups than this. Each group is a communicator
# with its own buffers on every member (NCCL: per channel and peer, a few MiB per protocol: tens to
# hundreds of MiB a communicator, not measured here), taken from the engine's KV cache on a vLLM
# rank. GLM-5 (plan counts): 8 trainer GPUs into 4 x EP 8 need 8 a rank: groups; prime-rl's GLM-5.2
# fleet would need up to 256 a decode rank: point to point.
MAX_GROUPS_PER_RANK = 16


def sender_groups_pay(
    p2p_sent: Sequence[int],
    group_sent: Sequence[int],
    received: Iterable[int],
    groups: Iterable[tuple[int, ...]] = (),
    *,
    min_gain: float = GROUP_MIN_GAIN,
    max_groups: int = MAX_GROUPS_PER_RANK,
) -> bool:
    """Whether many senders should send each segment to a class of several ranks as one group
    broadcast. ``p2p_sent``: each sender's bytes point to point (a segment once per rank of its
    class); ``group_sent``: the same with group broadcasts (a segment once); ``received``: each
    engine rank's bytes, the same either way. An update takes its busiest NIC's bytes over its
    rate (every GPU one full-duplex link: a sender's out, an engine rank's in), so groups pay
    where the senders' NICs bound it: True when the busiest NIC with point to point carries more
    than ``1 + min_gain`` times the busiest with groups. Where an engine rank's NIC bounds the
    update, groups would not shorten it and would still cost senders x classes communicators.
    ``groups``: the groups it would make; False when a link rank would be in more than
    ``max_groups`` of them (their buffers)."""
    members: dict[int, int] = {}
    for g in groups:
        for r in g:
            members[r] = members.get(r, 0) + 1
    if max(members.values(), default=0) > max_groups:
        return False
    engine = max(received, default=0)
    with_p2p = max(max(p2p_sent, default=0), engine)
    with_groups = max(max(group_sent, default=0), engine)
    return with_p2p > (1 + min_gain) * with_groups


def class_groups(
    sender: int, classes: Sequence[tuple[int, ...]], link_size: int, groups: bool
) -> tuple[tuple[int, ...] | None, ...]:
    """One sender's group per class (sorted link ranks; None: point to point): a class of several
    ranks where the link makes groups (``groups``), and a class that is every other rank of the
    link (the link itself, which any link can do)."""
    shared = lambda ranks: (groups and len(ranks) > 1) or len(ranks) + 1 == link_size  # noqa: E731
    return tuple(tuple(sorted((sender, *ranks))) if shared(ranks) else None for ranks in classes)


def choose_mode(trainer_ranks: int, experts_whole: bool) -> tuple[str, str]:
    """The transfer mode ``mode="auto"`` picks (the vLLM backend's ``TrainerSide``, ``glm-fp8 plan``)
    and why, in a few words: many senders ("senders") when there are several trainer ranks and each
    holds whole experts (every expert stack ``Shard(0)`` over the ranks in order), else "scatter"."""
    if trainer_ranks > 1 and experts_whole:
        return "senders", (
            f"each of the {trainer_ranks} trainer ranks holds whole experts, so each "
            "quantizes and sends its own"
        )
    if trainer_ranks <= 1:
        return "scatter", "one trainer rank: it sends each engine rank its shard"
    return "scatter", (
        "the trainer's shards split experts: one rank gathers each layer and sends each engine rank its shard"
    )


__all__ = ["choose_mode", "GROUP_MIN_GAIN", "MAX_GROUPS_PER_RANK", "class_groups", "sender_groups_pay"]

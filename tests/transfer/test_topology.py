"""Which topology many senders take (``glm_fp8.transfer.topology.sender_groups_pay``), from plan
counts only (no processes, no link).

Invariant: many senders send a segment to a class of several ranks as one group broadcast per
(sender, class) exactly where the busiest NIC with point-to-point messages carries more than
``1 + GROUP_MIN_GAIN`` times the busiest with group broadcasts (the senders' NICs bound the
update) and no link rank would be in more than ``MAX_GROUPS_PER_RANK`` groups; elsewhere, and on
a link that cannot make groups, every segment goes point to point.
GLM-5 into 4 servers of EP 8 (plan counts, not measurements): 8 trainer GPUs take groups (a
sender's NIC 361.71 -> 90.43 GiB), 32 and 64 keep point to point (32: 91.06 GiB against an engine
rank's 90.28, a 0.9 % gain; 64: the engine ranks' NICs bound the update).
"""

import dataclasses

from glm_fp8.engine import EngineLayout
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.plans import plans_for_model
from glm_fp8.model.presets import PRESETS
from glm_fp8.transfer.routes import TransferPlan, transfer_plan
from glm_fp8.transfer.topology import GROUP_MIN_GAIN, MAX_GROUPS_PER_RANK, sender_groups_pay

GIB = 2**30


def test_the_rule_on_byte_counts():
    pay = sender_groups_pay
    # each sender's share to 4 replicas against an engine rank's region: the senders' NICs bound
    assert pay([400, 390], [100, 98], [100, 100])
    # an engine rank's NIC bounds the update either way: no group would shorten it
    assert not pay([80, 80], [20, 20], [100, 100])
    # a gain of at most GROUP_MIN_GAIN (5 %) does not pay for the communicators
    assert GROUP_MIN_GAIN == 0.05
    assert not pay([105, 100], [26, 25], [100]) and pay([106, 100], [26, 25], [100])
    assert pay([105, 100], [26, 25], [100], min_gain=0.01)
    # with groups a sender may become the busiest NIC: compared with that, not with the engines
    assert not pay([104, 100], [103, 100], [60])
    # only classes of one rank: a group would carry the same bytes
    assert not pay([300, 200], [300, 200], [100])
    # no link rank in more than MAX_GROUPS_PER_RANK groups (each a communicator with its buffers)
    assert MAX_GROUPS_PER_RANK == 16
    many = [(s, 100, 101) for s in range(16)]  # ranks 100 and 101 in 16 groups each
    assert pay([400, 390], [100, 98], [100, 100], many)
    assert not pay([400, 390], [100, 98], [100, 100], [*many, (16, 100, 101)])


def _point_to_point(tp: TransferPlan) -> TransferPlan:
    return dataclasses.replace(
        tp,
        layers=tuple(
            dataclasses.replace(lay, segments=tuple(dataclasses.replace(s, group=None) for s in lay.segments))
            for lay in tp.layers
        ),
    )


def test_glm5_into_four_ep8_servers_takes_groups_only_where_the_senders_nics_bound_it():
    glm5 = PRESETS["glm-5"]
    ids = [*model_layer_ids(glm5), REST]
    plans = plans_for_model(glm5, "fp8", layer_ids=ids)
    servers = [lay for _ in range(4) for lay in EngineLayout.all_ranks(8, 1, True)]
    # (trainer GPUs, groups, busiest sender point to point, with the rule) in GiB: plan counts
    for t, groups, p2p_gib, sent_gib in (
        (8, True, 364.83, 91.21),
        (32, False, 90.4, 90.4),
        (64, False, None, None),
    ):
        engines = [None] * t + servers
        tp = transfer_plan(glm5, plans, ids, engines, range(t))
        p2p = _point_to_point(tp)
        once = [sum(s.nbytes for lay in tp.layers for s in lay.of_sender(k)) for k in range(t)]
        received = p2p.received_bytes()
        assert round(max(received.values()) / GIB, 2) == 90.28  # an engine rank's, the same either way
        assert sender_groups_pay(p2p.sent_bytes(), once, received.values()) == groups, t
        multi = [(lay, s) for lay in tp.layers for s in lay.segments if len(lay.classes[s.cls]) > 1]
        assert multi and all(len(lay.classes[s.cls]) == 4 for lay, s in multi)  # one rank per server
        if not groups:
            assert tp == p2p and tp.groups() == [tuple(range(t))], t  # the senders' own group only
            if p2p_gib is None:  # the engine ranks' NICs bound the update
                assert max(tp.sent_bytes()) < max(received.values())
            else:
                assert round(max(tp.sent_bytes()) / GIB, 2) == p2p_gib
            continue
        # one group broadcast per (sender, class): that sender's link rank and the class's 4 ranks
        assert all(s.group == tuple(sorted((s.sender, *lay.classes[s.cls]))) for lay, s in multi)
        assert round(max(p2p.sent_bytes()) / GIB, 2) == p2p_gib
        assert round(max(tp.sent_bytes()) / GIB, 2) == sent_gib and tp.sent_bytes() == once
        assert len(tp.groups()) == t * 8 + 1 and tp.groups()[-1] == tuple(range(t))
        assert tp.messages_per_layer() * 4 == p2p.messages_per_layer() == 256
        assert all(seg[3] is not None for lay in tp.manifest()["layers"] for seg in lay)  # agreed on
        # a link that cannot make groups: point to point, whatever it costs the senders' NICs
        assert transfer_plan(glm5, plans, ids, engines, range(t), groups=False) == p2p

"""One protocol for every mode: what must agree across ranks is agreed by the manifest vote, before
any collective that a disagreement could leave waiting, and groups made for one update serve
endpoints rebuilt on one side and reused on the other.

Invariant: a rank whose engines list, layout or checksum requirement differs from the others'
stops every rank at the manifest vote with an error naming it (within seconds, never the
transport's timeout); after a failed update, rebuilt receivers against a reused sender land the
next update bit for bit. Scatter into TP=2 x DP=2 (two classes of two replicas, each served by
one group broadcast from the sender) over gloo on the CPU, a tiny GLM-5.
"""

import time

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch, synthetic_layer

WHOLE = model_layer_ids(TINY_GLM5)
FAST = 80.0  # seconds a whole test may take, process start included; the transport's timeout is 120


def _layouts():
    from glm_fp8.engine import EngineLayout

    return EngineLayout.all_ranks(2, 2, False)  # TP=2 x DP=2, no EP: ranks r and r + 2 are replicas


def _params(layout):
    from glm_fp8.testing import poisoned_engine_params

    return poisoned_engine_params(TINY_GLM5, layout, 0x5A)


def _check_landed(layout, params):
    from glm_fp8.testing import reference_engine_params

    for name, ref in reference_engine_params(TINY_GLM5, layout, [*WHOLE, REST]).items():
        assert torch.equal(params[name].contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), (
            name
        )


def _update(sender, rest):
    return sender.send_model(((i, synthetic_layer(TINY_GLM5, i)) for i in WHOLE), rest=rest)


def _scatter_rank(rank, world, fault):
    from glm_fp8.transfer import Receiver, Sender

    engines = [None, *_layouts()]
    kw = dict(config=TINY_GLM5, layer_ids=WHOLE, rest=True, device="cpu", engines=engines)
    t0 = time.monotonic()
    try:
        if rank == 0:
            sender = Sender(None, 0, checksum=fault != "no_checksum", **kw)
            rest = synthetic_layer(TINY_GLM5, REST)
            if fault == "rebuilt":
                try:
                    _update(sender, rest)
                except Exception as exc:  # noqa: BLE001 - the first update fails on purpose
                    first = type(exc).__name__
                _update(sender, rest)  # the same Sender, against rebuilt receivers
                return first
            _update(sender, rest)
            return "sent"
        layout = engines[rank]
        if fault == "engines" and rank == 3:
            kw["engines"] = [None, *reversed(_layouts())]
        if fault == "layout" and rank == 2:
            layout = engines[1]  # another rank's layout
        params = _params(layout)
        if fault == "rebuilt":
            receiver = Receiver(None, 0, layout=layout, **kw)
            if rank == 4:  # its consumer fails on the first update
                receiver._check_params = lambda p, a: None
                broken = dict(params, **{"lm_head.weight": params["lm_head.weight"][:1]})
                with pytest.raises(RuntimeError):
                    receiver.load_into(broken)
            else:
                with pytest.raises(Exception, match="rank 4 failed while landing"):
                    receiver.load_into(params)
            params = _params(layout)
        Receiver(None, 0, layout=layout, **kw).load_into(params)  # a new Receiver
        _check_landed(layout, params)
        return "landed"
    finally:
        assert time.monotonic() - t0 < FAST


def test_a_rank_with_another_engines_list_stops_every_rank_at_the_manifest_vote():
    t0 = time.monotonic()
    results = launch(5, _scatter_rank, ("engines",), timeout_s=120)
    assert time.monotonic() - t0 < FAST + 20
    assert results[0][0] == "ManifestMismatch" and "rank 3 refused the manifest" in results[0][1], results
    assert results[3][0] == "ManifestMismatch" and "the transfer plan differs" in results[3][1], results
    for r in (1, 2, 4):
        assert results[r][0] == "UpdateAborted" and "rank 3 refused the manifest" in results[r][1], results


def test_a_rank_with_another_ranks_layout_stops_every_rank_at_the_manifest_vote():
    results = launch(5, _scatter_rank, ("layout",), timeout_s=120)
    assert results[0][0] == "ManifestMismatch" and "rank 2 refused its parameters" in results[0][1], results
    assert results[2][0] == "ValueError" and "engines[2]" in results[2][1], results
    for r in (1, 3, 4):
        assert results[r][0] == "UpdateAborted" and "rank 2 refused its parameters" in results[r][1], results


@pytest.mark.slow
def test_rebuilt_receivers_against_a_reused_sender_land_the_next_update():
    """The first update fails (an engine rank's consumer); every engine rank builds a new
    Receiver, the sender keeps its Sender: the groups made for the first update serve the
    second, which lands every byte."""
    results = launch(5, _scatter_rank, ("rebuilt",), timeout_s=120)
    assert results[0] == ("ok", "ReceiverRefused"), results
    assert all(results[r] == ("ok", "landed") for r in range(1, 5)), results


def test_a_receiver_that_requires_checksums_refuses_a_sender_that_sends_none():
    results = launch(5, _scatter_rank, ("no_checksum",), timeout_s=120)
    assert results[0][0] == "ManifestMismatch" and "refused the manifest" in results[0][1], results
    refusing = [r for r in range(1, 5) if results[r][0] == "ManifestMismatch"]
    assert refusing, results
    for r in refusing:
        assert "requires checksums" in results[r][1], results


def _optional_checksum_rank(rank, world):
    from glm_fp8.transfer import Receiver, Sender

    kw = dict(config=TINY_GLM5, layer_ids=[0, 2], device="cpu")
    if rank == 0:
        Sender(None, 0, checksum=False, **kw).send_model((i, synthetic_layer(TINY_GLM5, i)) for i in (0, 2))
        return "sent"
    return sum(1 for _ in Receiver(None, 0, checksum=False, **kw).receive())


def test_a_receiver_that_does_not_require_checksums_accepts_an_update_without():
    results = launch(2, _optional_checksum_rank, timeout_s=60)
    assert results[0] == ("ok", "sent") and results[1][0] == "ok" and results[1][1] > 0, results

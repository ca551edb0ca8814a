"""Every rank agrees before anything moves, and a refusal anywhere reaches every rank at once.

Invariant: a rank whose own constructor refuses its arguments still takes part in the update's
first vote and votes no, so every other rank raises within seconds an error that names that rank
and what it refused (never the transport's timeout, never "Connection closed by peer"); the
engine layouts are checked as a whole; numeric arguments are integers in range, checked before
anything is allocated from them. Multi-rank cases run in spawned processes over gloo.
"""

import time

import pytest
import torch

from glm_fp8.engine import EngineLayout
from glm_fp8.model.presets import SMALL_GLM5, TINY_GLM5
from glm_fp8.testing import launch, synthetic_layer
from glm_fp8.transfer import HostSinkComm, Receiver, Sender

CONFIG = {**SMALL_GLM5, "num_hidden_layers": 3}
FAST = 60.0  # seconds for a whole 3-process case, process start included; the transport waits 120


def _refusing_rank(rank, world, how):
    """The rank's outcome and the seconds from its constructor to its return or raise."""
    t0 = time.monotonic()
    try:
        out = _refusing_rank_run(rank, how)
    except Exception as exc:  # noqa: BLE001 - reported with its class, as launch does
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", out, time.monotonic() - t0


def _refusing_rank_run(rank, how):
    from glm_fp8.transfer import Receiver, Sender

    kw = dict(config=CONFIG, device="cpu")
    if rank == 0:
        if how == "leader_ring":
            kw["ring"] = 0
        sender = Sender(None, 0, **kw)
        if how == "module_layers":  # a whole model where (layer_idx, state_dict) pairs belong
            sender.send_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        else:
            sender.send_model((i, synthetic_layer(CONFIG, i)) for i in range(3))
        return "sent"
    if how == "engines_short" and rank == 2:
        kw["engines"] = [None, "full"]  # one entry short of the link's 3
    if how == "receiver_is_sender" and rank == 1:
        kw["senders"] = [0, 1]
    for _ in Receiver(None, 0, **kw).receive_layers():
        pass
    return "received"


@pytest.mark.parametrize(
    "how, culprit, error, says",
    [
        ("engines_short", 2, "ValueError", "engines: expected one entry per rank of the link (3), got 2"),
        ("leader_ring", 0, "ValueError", "ring: expected an integer in [1, 16]"),
        ("receiver_is_sender", 1, "ValueError", "this process (link rank 1) is a sender"),
        ("module_layers", 0, "TypeError", "layers: expected an iterable of (layer_idx, state_dict) pairs"),
    ],
)
def test_a_rank_refusing_its_own_arguments_stops_every_rank_naming_it(how, culprit, error, says):
    t0 = time.monotonic()
    launched = launch(3, _refusing_rank, (how,), timeout_s=120.0)
    assert time.monotonic() - t0 < FAST, "a rank waited for the transport's timeout"
    assert all(status == "ok" for status, _ in launched.values()), launched
    results = {r: out[:2] for r, (_, out) in launched.items()}
    # Every rank, the culprit too, raises as soon as the refusal is delivered: within seconds of
    # its own constructor, never after the link's timeout (120 s here).
    slow = {r: round(out[2], 1) for r, (_, out) in launched.items() if out[2] > 10.0}
    assert not slow, f"ranks that took over 10 s to raise: {slow}"
    assert results[culprit][0] == error and says in results[culprit][1], results[culprit]
    for r in {0, 1, 2} - {culprit}:
        status, msg = results[r]
        assert status in ("ManifestMismatch", "UpdateAborted"), results[r]
        assert f"rank {culprit}" in msg, results[r]
        if how != "module_layers":  # refused at the prelude: every rank reads the culprit's reason
            assert "refused its own arguments" in msg and says in msg, results[r]


def test_engine_layouts_are_checked_as_a_whole():
    from glm_fp8.transfer.pack import check_replicas

    tp2 = [EngineLayout(tp_size=2, tp_rank=r) for r in range(2)]
    check_replicas([None, *tp2])
    check_replicas([None, *tp2, *tp2])  # two replicas of one layout
    check_replicas([None, *tp2, *EngineLayout.all_ranks(1, 2, True)])  # two servers, two layouts
    with pytest.raises(
        ValueError,
        match=r"tp_rank 1, dp_rank 0 is held by no rank, tp_rank 0, dp_rank 0 "
        r"by ranks \[1, 2\]",
    ):
        check_replicas([None, tp2[0], tp2[0]])
    with pytest.raises(ValueError, match="do not form whole replicas"):
        check_replicas([None, *tp2, tp2[1]])
    # Every rank refuses the same list, each in its constructor (here a stand-in link of 3).
    with pytest.raises(ValueError, match="do not form whole replicas"):
        Sender(HostSinkComm(size=3), 0, config=TINY_GLM5, engines=[None, tp2[0], tp2[0]], device="cpu")


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"layer_ids": [1.9]}, r"layer_ids\[0\]: expected an integer >= 0, got 1.9"),
        ({"layer_ids": [True]}, r"layer_ids\[0\]: expected an integer >= 0, got True"),
        ({"layer_ids": 3}, "layer_ids: expected a list of layer indices, got int"),
        ({"src": 0.0}, r"src: expected an integer in \[0, 1\]"),
        ({"src": 5}, r"src: expected an integer in \[0, 1\] \(a rank of the link of 2\), got 5"),
        ({"ring": 10**12}, r"ring: expected an integer in \[1, 16\]"),
        ({"ring": 2.0}, r"ring: expected an integer in \[1, 16\]"),
        ({"senders": [0.5]}, r"senders\[0\]: expected an integer in \[0, 1\]"),
        ({"engines": "full"}, "engines: expected a list of one entry per link rank, got str"),
        ({"checksum": "yes"}, "checksum: expected True or False"),
        ({"chunk_experts": 1.5}, "chunk_experts: expected an integer >= 1"),
    ],
)
def test_numbers_are_integers_in_range_before_anything_is_allocated(kw, says):
    with pytest.raises(ValueError, match=says):
        Sender(HostSinkComm(), **{"config": TINY_GLM5, "device": "cpu", **kw})


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"ring": 1}, r"ring: expected an integer in \[2, 16\]"),
        ({"ring": 10**12}, r"ring: expected an integer in \[2, 16\]"),
        ({"max_manifest_bytes": 2.5}, "max_manifest_bytes: expected an integer"),
    ],
)
def test_receiver_numbers_are_checked(kw, says):
    with pytest.raises(ValueError, match=says):
        Receiver(HostSinkComm(rank=1), 0, config=TINY_GLM5, device="cpu", **kw)


class _PretrainedConfigLike:
    """What transformers' ``PretrainedConfig`` offers glm_fp8: ``to_dict()``."""

    def __init__(self, d):
        self._d = dict(d)

    def to_dict(self):
        return dict(self._d)


def test_endpoints_take_a_config_as_a_dict_an_hf_config_or_a_path(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_GLM5))
    payloads = {
        Sender(HostSinkComm(), config=form, device="cpu").payload()
        for form in (TINY_GLM5, _PretrainedConfigLike(TINY_GLM5), str(path), tmp_path)
    }
    assert len(payloads) == 1  # the same manifest from every form
    with pytest.raises(TypeError, match="config: expected a dict, an object with to_dict()"):
        Sender(HostSinkComm(), config=42, device="cpu")


def test_stats_count_the_bytes_this_rank_sent():
    """A single sender into two TP ranks of distinct shards: ``UpdateStats.nbytes`` is what it put
    on the link (each rank's segment once), not the layer's size; ``layer_nbytes`` is that."""
    link = HostSinkComm(keep=True, size=3)
    engines = [None, *(EngineLayout(tp_size=2, tp_rank=r) for r in range(2))]
    sender = Sender(link, 0, config=TINY_GLM5, layer_ids=[0], engines=engines, device="cpu")
    stats = sender.send_model([(0, synthetic_layer(TINY_GLM5, 0))])
    uint8 = sum(t.numel() for t in link.sent if t.dtype == torch.uint8)  # the manifest, the segments
    sent = uint8 - len(sender.payload())
    assert stats.nbytes == sent == sender.routes.sent_bytes()[0]
    assert stats.layers[0].layer_nbytes == sender.plans[0].nbytes != stats.nbytes

"""SGLang servers in a fleet and in ``glm-fp8 plan`` (docs/sglang.md#plan).

Invariant: a ``Server`` with ``engine="sglang"`` has ``tp`` ranks (its attention DP splits its TP
group), each placed by ``SGLangLayout.from_sglang``; SGLang's flags on a vLLM server, and SGLang
layouts glm_fp8 does not model, are refused naming the flag; ``glm-fp8 plan --server`` takes an
SGLang server and predicts its update; an SGLang rank under attention DP (attention whole on
every rank) receives more than a vLLM rank of the same GPUs whose attention is split by TP.
"""

import argparse
import dataclasses
import json

import pytest

from glm_fp8.cli.args import server_spec
from glm_fp8.cli.main import main
from glm_fp8.engine import SGLangLayout
from glm_fp8.model.presets import PRESETS, TINY_GLM5
from glm_fp8.planning.fleet import Fleet, Server, fleet_preset
from glm_fp8.planning.update_time import predict
from glm_fp8.transfer.pack import update_bytes

CONFIG = {**TINY_GLM5, "indexer_rope_interleave": True}


def test_an_sglang_server_has_tp_ranks_placed_as_sglang_places_them():
    s = Server(4, 2, True, 3, engine="sglang", moe_dense_tp_size=1, moe_a2a_backend="deepep")
    assert s.ranks == 4
    assert s.layouts() == SGLangLayout.all_sglang_ranks(
        4, attn_dp_size=2, ep_size=4, moe_dense_tp_size=1, moe_a2a_backend="deepep"
    )
    assert s.describe() == "SGLang TP 4 (attention DP 2), EP 4 (moe_dense_tp_size 1, a2a deepep)"
    fleet = Fleet(8, servers=(s, Server(2)))
    assert fleet.engine_ranks == 3 * 4 + 2
    assert fleet.engine_tp is None  # no one vLLM layout to read


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=8, engine="tgi"), "Server.engine"),
        (dict(tp=8, moe_a2a_backend="deepep"), "SGLang's flags"),
        (dict(tp=8, dp=3, engine="sglang"), "attn_dp_size 3 does not divide tp_size 8"),
        (dict(tp=8, engine="sglang", moe_dense_tp_size=4), "moe_dense_tp_size 4"),
    ],
)
def test_servers_refused_naming_the_setting(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Server(**kwargs)


def test_the_cli_reads_an_sglang_server():
    s = server_spec("engine=sglang,tp=64,dp=8,ep,dense_tp=1,a2a=deepep,replicas=2,name=rollout")
    assert (s.engine, s.tp, s.dp, s.ep, s.replicas, s.moe_dense_tp_size, s.moe_a2a_backend) == (
        "sglang",
        64,
        8,
        True,
        2,
        1,
        "deepep",
    )
    for text, words in [
        ("tp=8,a2a=deepep", "add engine=sglang"),
        ("engine=sglang,tp=8,ep=4", "ep=4 with tp=8"),
        ("engine=trt,tp=8", "expected one of vllm, sglang"),
        ("engine=sglang,tp=8,dense_tp=2", "dense_tp"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            server_spec(text)


def test_attention_dp_ranks_receive_whole_attention():
    sglang = Server(2, 2, True, engine="sglang").layouts()  # attention TP 1: attention whole on each
    vllm = Server(2, 1, True).layouts()  # TP 2: attention split two ways
    decoder = list(range(CONFIG["num_hidden_layers"]))  # the MTP layer is vLLM's drafter's alone
    _, s_bytes = update_bytes(CONFIG, sglang, layer_ids=decoder)
    _, v_bytes = update_bytes(CONFIG, vllm, layer_ids=decoder)
    assert min(s_bytes) > max(v_bytes)
    mtp = [CONFIG["num_hidden_layers"]]
    assert update_bytes(CONFIG, sglang, layer_ids=mtp, rest=False)[1] == [0, 0]  # SGLang's drafter: its own
    assert min(update_bytes(CONFIG, vllm, layer_ids=mtp, rest=False)[1]) > 0


def test_an_sglang_ranks_drafter_update_is_planned_in_its_drafters_layout(capsys):
    """The plan's "draft session" of an SGLang rank is its drafter's update: the MTP layer's bytes
    as ``SGLangLayout.drafter_layout`` holds them (a decoder layer's cut, its own entries whole,
    no head), in every mode's figure, said as the drafter's update in the text."""
    from glm_fp8.planning.deployment import engine_extra

    server = Server(2, 2, True, engine="sglang")
    layouts = server.layouts()
    mtp = CONFIG["num_hidden_layers"]
    drafters = [lay.drafter_layout for lay in layouts]
    _, want = update_bytes(CONFIG, drafters, layer_ids=[mtp], rest=False)
    extra = engine_extra(CONFIG, layouts)
    assert all(0 < w <= e[3] < w + 2**20 for w, e in zip(want, extra)), (want, extra)
    assert main(["plan", "--server", "engine=sglang,tp=8,ep", "--trainer-gpus", "32"]) == 0
    out = capsys.readouterr().out
    assert "GiB in its drafter's update" in out and "in the draft session," not in out, out


def test_the_miles_shaped_sglang_preset_plans_an_update():
    fleet = fleet_preset("miles-glm-5-sglang")
    (server,) = fleet.servers
    assert server.engine == "sglang" and server.ranks == 64 and server.replicas == 2
    assert PRESETS["glm-5.2"]["indexer_rope_interleave"] is True  # SGLang fuses its indexer as vLLM does
    assert "indexer_rope_interleave" not in PRESETS["glm-5"]  # SGLang holds GLM-5's split
    assert fleet.trainer is not None and fleet.trainer_gpus == 128


def test_miles_glm5_sglang_fleet_predicts_beside_their_measured_times(capsys):
    """miles' GLM-5 trainer into two SGLang servers of 64 GPUs (they measured 58.3 s with an NCCL
    broadcast, 8.48 s with RDMA P2P): auto picks many senders, predicted as docs/sglang.md#plan
    quotes it (6.85 s with attention DP 64; 3.40 s with attention DP 8, attention split eight ways),
    every strategy slower than it."""
    assert main(["plan", "--fleet", "miles-glm-5-sglang", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by = {p["strategy"]: p for p in report["update"]["strategies"]}
    assert report["summary"]["auto_mode"] == "senders"
    assert round(by["fp8 many senders"]["seconds"], 2) == 6.85
    assert round(by["bf16 broadcast"]["seconds"], 2) == 60.51
    assert by["fp8 many senders"]["seconds"] < by["fp8 scatter"]["seconds"] < by["bf16 broadcast"]["seconds"]
    # The drafter's update (the MTP layer into SGLang's draft model): its receiver's ring, one slot
    # of the MTP layer as the drafter's layout holds it, the target's given back before it.
    (srv,) = report["summary"]["servers"]
    assert srv["engine"] == "sglang" and 0 < srv["draft_session_bytes"] < srv["target_session_bytes"], srv
    fleet = fleet_preset("miles-glm-5-sglang")
    (server,) = fleet.servers
    dp8 = dataclasses.replace(fleet, servers=(dataclasses.replace(server, dp=8),))
    preds = {p.strategy: p for p in predict(PRESETS["glm-5"], dp8)}
    assert round(preds["fp8 many senders"].seconds, 2) == 3.40

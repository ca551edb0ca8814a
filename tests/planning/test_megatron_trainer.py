"""A Megatron-Core trainer in the plan (``MegatronTrainer``, ``glm-fp8 plan --trainer``): its
senders are each pipeline stage's expert-parallel ranks (expert-data-parallel rank 0), each stage
holds its layers; the many senders' transfer plan sends every layer from its stage's senders only,
and miles' GLM-5 deployment is a named fleet."""

import json

import pytest
import torch

from glm_fp8.cli.main import main
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import PRESETS, TINY_GLM5
from glm_fp8.planning.fleet import Fleet, MegatronTrainer, Server, fleet_preset
from glm_fp8.planning.update_time import many_senders_plan, predict


def test_parse_and_check():
    m = MegatronTrainer.parse("megatron:tp4,pp8,cp2,ep16")
    assert (m.tp, m.pp, m.cp, m.ep, m.senders) == (4, 8, 2, 16, 128)
    assert MegatronTrainer.parse("megatron:pp2") == MegatronTrainer(pp=2)
    m.check(128)
    for text in ("fsdp:tp2", "megatron:", "megatron:tp2,tp2", "megatron:xx3", "megatron:tp0"):
        with pytest.raises(ValueError):
            MegatronTrainer.parse(text)
    with pytest.raises(ValueError, match="not a multiple of TP 4 x PP 8 x CP 2"):
        m.check(96)
    wide = MegatronTrainer(tp=4, pp=8)  # EP 1, DP 4: each stage's expert rank and its TP group send
    wide.check(32)
    assert (wide.stage_senders, wide.senders) == (4, 32)
    with pytest.raises(ValueError, match="Fleet.trainer"):
        Fleet(8, trainer=object())


def test_expert_tensor_parallelism_sends_each_expert_from_its_etp_groups_first_rank():
    """TP 2, ETP 2, EP 2 on 8 GPUs (PP 1, DP 4, expert-data-parallel 2): the 4 ranks of
    expert-data-parallel rank 0 send, the experts from each ETP group's first rank (0 and 2, in
    expert order), the other entries from all 4; parsed and described with ``etpN``."""
    m = MegatronTrainer.parse("megatron:tp2,ep2,etp2")
    assert (m.tp, m.ep, m.etp, m.stage_senders, m.senders) == (2, 2, 2, 4, 4)
    assert m.describe() == "megatron:tp2,pp1,cp1,ep2,etp2"
    assert MegatronTrainer.parse(m.describe()) == m
    m.check(8)
    with pytest.raises(ValueError, match="not a multiple of PP 1 x EP 2 x ETP 2"):
        m.check(6)
    held = m.holders(TINY_GLM5, [0, 2])
    assert held[0] == (0, 1, 2, 3)  # a dense layer: no experts
    experts = {n: h for n, h in held[1].items() if "experts.w" in n}
    assert experts and set(experts.values()) == {(0, 2)}
    assert {h for n, h in held[1].items() if n not in experts} == {(0, 1, 2, 3)}
    tp = many_senders_plan(TINY_GLM5, Fleet(8, servers=(Server(tp=2),), trainer=m))
    assert tp.senders == (0, 1, 2, 3)
    for lay in tp.layers:
        for name, rows in lay.splits.items():
            if "experts.w" in name:  # ETP ranks 1 and 3 send no expert rows
                assert rows[1] == rows[3] == (0, 0) and rows[0][1] > 0 and rows[2][1] > 0, (name, rows)


def test_the_etp_gather_of_each_senders_experts_is_timed():
    """GLM-5 from 128 GPUs (TP 4, PP 8, EP 8) into 4 servers of EP 8, ETP 1 against ETP 2: with
    ETP 2 each sender of experts gathers the other half of its experts' bf16 rows, beside the TP
    gathers of the other entries: at least 10 layers (a full stage) of 32 experts, half of each,
    in the plan's gathered bytes."""
    import torch

    config = PRESETS["glm-5"]
    expert = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2  # gate, up, down in bf16
    half_a_stage = 10 * (config["n_routed_experts"] // 8) * expert // 2
    gathered = {}
    for etp in (1, 2):
        trainer = MegatronTrainer(tp=4, pp=8, ep=8, etp=etp)
        fleet = Fleet(128, servers=(Server(tp=8, ep=True, replicas=4),), trainer=trainer)
        preds = {p.strategy: p for p in predict(config, fleet, master_dtype=torch.bfloat16)}
        gathered[etp] = preds["fp8 many senders"].gathered
    assert gathered[2] >= half_a_stage > 4 * gathered[1], (half_a_stage, gathered)


def test_each_layer_goes_from_its_stage():
    """PP 2 x EP 2 on 8 GPUs (TP 2, DP 2): 4 senders; layers 0-1 from senders 0-1, layers 2-3 and
    the MTP layer from senders 2-3; the embeddings from stage 0's TP group, the head from the last
    stage's; no sender sends a byte of a layer it does not hold."""
    trainer = MegatronTrainer(tp=2, pp=2, ep=2)
    fleet = Fleet(8, servers=(Server(tp=2),), trainer=trainer)
    tp = many_senders_plan(TINY_GLM5, fleet)
    assert tp.senders == (0, 1, 2, 3)
    ids = [*model_layer_ids(TINY_GLM5), REST]
    for pos, i in enumerate(ids):
        lay = tp.layers[pos]
        stage = (0, 1) if i in (0, 1) else (2, 3)
        if i == REST:
            embed, head = "model.embed_tokens.weight", "lm_head.weight"
            assert lay.owners.get(embed, 0) in (0, 1) and lay.owners.get(head, 2) in (2, 3)
            continue
        assert all(lay.sent_nbytes(t) == 0 for t in range(4) if t not in stage), i
        assert set(lay.owners.values()) <= set(stage), (i, lay.owners)
    assert sum(tp.sent_bytes()) > 0


def test_a_tp_group_wider_than_ep_sends_its_share_of_the_rest():
    """TP 2, EP 1, DP 2 on 4 GPUs: each stage's expert rank (expert-data-parallel rank 0) and its TP
    group's other rank send: the experts from the first, the other entries from either."""
    trainer = MegatronTrainer(tp=2)
    fleet = Fleet(4, servers=(Server(tp=2),), trainer=trainer)
    tp = many_senders_plan(TINY_GLM5, fleet)
    assert tp.senders == (0, 1)
    for lay in tp.layers:
        for name, rows in lay.splits.items():
            if "experts.w" in name:
                assert rows[1] == (0, 0) and rows[0][1] > 0, (name, rows)


def test_miles_glm5_fleet_predicts_beside_their_measured_times(capsys):
    """miles' GLM-5 deployment (they measured 58.3 s with an NCCL broadcast, 8.48 s with RDMA P2P):
    128 senders, each sending its stage's layers' own experts; every mode predicted, the NIC bytes
    of each sender said."""
    fleet = fleet_preset("miles-glm-5")
    assert fleet.trainer == MegatronTrainer(tp=4, pp=8, cp=2, ep=16) and fleet.trainer_gpus == 128
    main(["plan", "--fleet", "miles-glm-5", "--master-dtype", "bf16", "--json"])
    report = json.loads(capsys.readouterr().out)
    strategies = {p["strategy"]: p for p in report["update"]["strategies"]}
    many = strategies["fp8 many senders"]
    assert many["senders"] == 128
    assert report["summary"]["auto_mode"] == "senders"
    assert len(report["summary"]["sender_bytes"]) == 128 and min(report["summary"]["sender_bytes"]) > 0
    assert many["seconds"] < strategies["fp8 scatter"]["seconds"] < strategies["bf16 broadcast"]["seconds"]
    # TP-split tensors are gathered onto their owners (docs/trainers.md#tp-pieces-or-gathered): in the
    # other direction of a sender's NIC, under 1/40 of what any listed sender sends, so never the bound.
    rows = report["update"]["transfer_plan"]["rows"]
    assert rows and all(0 < 40 * r["gathered_bytes"] < r["sent_bytes"] for r in rows), rows
    main(["plan", "--fleet", "miles-glm-5", "--master-dtype", "bf16"])
    assert "Megatron-Core TP 4 x PP 8 x CP 2, EP 16: 128 senders" in capsys.readouterr().out
    # The same trainer into 4 servers of EP 8 (one node each): every rank of a server receives
    # the whole model's experts once between them.
    four = Fleet(128, servers=(Server(tp=8, ep=True, replicas=4),), trainer=fleet.trainer)
    preds = {p.strategy: p for p in predict(PRESETS["glm-5"], four)}
    assert preds["fp8 many senders"].senders == 128


def test_cli_refuses_a_bad_trainer(capsys):
    for argv, match in (
        (["--trainer", "megatron:tp4,pp8"], "needs --trainer-gpus"),
        (["--trainer-gpus", "100", "--trainer", "megatron:tp4,pp8"], "not a multiple"),
        (["--trainer-gpus", "64", "--trainer", "megatron:tq4"], "expected one of tpN"),
        (["--trainer-gpus", "64", "--trainer", "megatron:tp4,ep3"], "not a multiple of PP 1 x EP 3"),
    ):
        with pytest.raises(SystemExit):
            main(["plan", *argv])
        assert match in capsys.readouterr().err


def test_uneven_pipeline_stages_as_megatron_splits_them():
    """``firstN`` / ``lastN`` (Megatron's --decoder-first/last-pipeline-num-layers): the first and
    last stages hold that many decoder layers, the others the rest evenly; a split Megatron-Core
    would refuse is refused, naming the trainer."""
    m = MegatronTrainer.parse("megatron:tp4,pp8,cp2,ep16,first9,last9")
    assert (m.first, m.last) == (9, 9) and m.describe() == "megatron:tp4,pp8,cp2,ep16,first9,last9"
    assert m.stage_layers(78) == [9, 10, 10, 10, 10, 10, 10, 9]
    assert MegatronTrainer(pp=4, first=3).stage_layers(12) == [3, 3, 3, 3]
    assert MegatronTrainer(pp=3, last=2).stage_layers(8) == [3, 3, 2]
    assert MegatronTrainer(pp=8).stage_layers(78) == [10] * 7 + [8]  # neither given: torch.chunk's
    for bad, n in ((MegatronTrainer(pp=8, first=9, last=8), 78), (MegatronTrainer(pp=2, first=3, last=3), 7)):
        with pytest.raises(ValueError, match="which Megatron-Core splits evenly"):
            bad.stage_layers(n)
    with pytest.raises(ValueError, match="need PP > 1"):
        MegatronTrainer(first=2)
    for text in ("megatron:pp2,first", "megatron:pp2,first2,first3", "megatron:pp2,middle3"):
        with pytest.raises(ValueError, match="expected one of"):
            MegatronTrainer.parse(text)
    # each layer goes from the stage that holds it: 9 on the first stage, then 10 a stage
    holders = m.holders(PRESETS["glm-5"], list(range(78)))
    stage = m.stage_senders
    assert holders[8] == tuple(range(stage)) and holders[9] == tuple(range(stage, 2 * stage))
    assert holders[77] == tuple(range(7 * stage, 8 * stage)) == holders[69] != holders[68]


def test_cli_refuses_an_uneven_split_megatron_would_refuse(capsys):
    args = ["plan", "--model", "glm-5", "--trainer-gpus", "128", "--server", "tp=8,dp=8,ep,replicas=2"]
    assert main([*args, "--trainer", "megatron:tp4,pp8,cp2,ep16,first9,last9"]) == 0
    assert "the first stage 9 layers, the last stage 9 layers" in capsys.readouterr().out.replace("\n  ", " ")
    with pytest.raises(SystemExit):
        main([*args, "--trainer", "megatron:tp4,pp8,cp2,ep16,first9,last8"])
    assert (
        "trainer: megatron:tp4,pp8,cp2,ep16,first9,last8: 78 decoder layers leave 61"
        in capsys.readouterr().err
    )


def test_steps_of_a_layer_of_each_stage_shorten_the_plan_and_cost_receive_buffers():
    """miles' trainer in steps of 8 layers, one of each stage (``,step8``): the 8 stages send at
    once, so the update takes about the busiest NIC's time instead of the sum of each stage's turns;
    each server rank's ring slot holds a whole step. A delta update is planned one layer a step."""
    import dataclasses

    fleet = fleet_preset("miles-glm-5")
    stepped = dataclasses.replace(fleet, trainer=dataclasses.replace(fleet.trainer, step_layers=8))
    one, eight = (
        {p.strategy: p for p in predict(PRESETS["glm-5"], f, master_dtype=torch.bfloat16)}["fp8 many senders"]
        for f in (fleet, stepped)
    )
    assert eight.seconds < one.seconds / 3, (one.seconds, eight.seconds)
    assert eight.sender_bytes == one.sender_bytes  # the same bytes from the same ranks
    assert all(b.extra > 3 * a.extra for a, b in zip(one.servers, eight.servers))
    tp = many_senders_plan(PRESETS["glm-5"], stepped, master_dtype=torch.bfloat16)
    assert len(tp.steps) == 11 and max(map(len, tp.steps)) == 8  # 78 layers and the MTP layer, 8 stages
    with pytest.raises(ValueError, match="delta: a delta update carries one layer a step"):
        predict(PRESETS["glm-5"], stepped, delta=0.01)

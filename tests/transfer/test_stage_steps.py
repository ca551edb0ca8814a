"""Steps of several layers (``step_layers``): a pipeline-parallel trainer's stages send at once.

Invariant: consecutive layers held by disjoint senders share a step (``plan_steps``), at most
``step_layers`` of them; each rank's ring slot holds its buffers of a step's layers side by side;
after ``load_into`` every engine byte equals the reference conversion of the trainer's own tensors,
exactly as with one layer a step, in fewer steps; a NaN in a step's second layer stops every rank
at that step, the sender that holds it naming the layer. Four trainer ranks in two stages of two
(FSDP2-style DTensors over each stage's mesh) update two engine ranks (DP 2 with EP 2) of a tiny
GLM-5 over gloo.
"""

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.planning.fleet import MegatronTrainer
from glm_fp8.testing import launch
from glm_fp8.transfer.routes import plan_steps, stage_order

# Stage 0 holds layers 0 (dense) and 2 (sparse) and the embeddings; stage 1 layers 1 (dense), 3
# (sparse), the MTP layer 4, the final norm and the head: every step of two layers has one of each.
STAGE = {0: 0, 2: 0, 1: 1, 3: 1, 4: 1}
IDS = stage_order(model_layer_ids(TINY_GLM5), STAGE)
HOLDERS = {
    **{i: [0, 1] if STAGE[i] == 0 else [2, 3] for i in IDS},
    REST: {"model.embed_tokens.weight": [0, 1], "model.norm.weight": [2], "lm_head.weight": [2, 3]},
}


def test_layers_of_disjoint_holders_share_a_step_up_to_step_layers():
    held = [(0, 1), (2, 3), (0, 1), (2, 3), (2, 3), {"a": (0, 1), "b": (2,)}]
    assert plan_steps(held, 6, 4, 1) == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert plan_steps(held, 6, 4, 2) == ((0, 1), (2, 3), (4,), (5,))
    assert plan_steps(held, 6, 4, 8) == ((0, 1), (2, 3), (4,), (5,))  # a shared holder starts a step
    assert plan_steps(None, 3, 4, 8) == ((0,), (1,), (2,))  # every sender holds every layer
    assert plan_steps([(0,), None, (1,)], 3, 2, 8) == ((0,), (1,), (2,))


def test_stage_order_takes_one_layer_of_each_stage_in_turn():
    stage_of = {i: i // 3 for i in range(8)}  # stages of 3, 3 and 2 layers
    assert stage_order([*range(8), REST], stage_of) == [0, 3, 6, 1, 4, 7, 2, 5, REST]
    trainer = MegatronTrainer(pp=4, ep=2, step_layers=4)
    cfg = dict(TINY_GLM5, num_hidden_layers=8)
    assert trainer.update_order(cfg, [*range(8), REST]) == [0, 2, 4, 6, 1, 3, 5, 7, REST]
    assert MegatronTrainer(pp=4).update_order(cfg, [*range(8)]) == list(range(8))  # one layer a step
    assert MegatronTrainer.parse("megatron:pp4,ep2,step4") == trainer
    assert trainer.describe() == "megatron:tp1,pp4,cp1,ep2,step4"


def test_a_delta_update_carries_one_layer_a_step():
    from glm_fp8.transfer import DeltaOptions, ReceiveOptions, SendOptions

    held = {0: [0], 1: [1]}
    with pytest.raises(ValueError, match="delta: a delta update carries one layer a step; got step_layers=2"):
        SendOptions(config=TINY_GLM5, step_layers=2, holders=held, delta=DeltaOptions())
    with pytest.raises(ValueError, match="delta: a delta update carries one layer a step"):
        ReceiveOptions(config=TINY_GLM5, step_layers=2, holders=held, delta=True)
    with pytest.raises(ValueError, match=r"step_layers: expected an integer in \[1, 64\]"):
        SendOptions(config=TINY_GLM5, step_layers=0)
    # without holders every sender holds every layer: steps of several would carry one, so refused
    with pytest.raises(ValueError, match="step_layers: 2 needs holders"):
        SendOptions(config=TINY_GLM5, step_layers=2)
    with pytest.raises(ValueError, match="MegatronTrainer.step_layers: steps of 4 layers carry one of each"):
        MegatronTrainer(ep=2, step_layers=4)


def _rank(rank, world, step_layers, fault=None):
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.engine import EngineLayout
    from glm_fp8.testing import poisoned_engine_params, reference_engine_params, sharded_layer
    from glm_fp8.transfer import Receiver, Sender

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("pp", "dp"))
    layouts = [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]
    kw = dict(
        config=TINY_GLM5,
        layer_ids=IDS,
        rest=True,
        device="cpu",
        engines=[None] * 4 + layouts,
        senders=[0, 1, 2, 3],
        holders=HOLDERS,
        step_layers=step_layers,
    )
    if rank < 4:
        stage, stage_mesh = rank // 2, mesh["dp"]
        sender = Sender(None, 0, **kw)

        def layers():
            for i in IDS:
                if STAGE[i] != stage:
                    yield i, {}
                    continue
                sd = sharded_layer(TINY_GLM5, i, stage_mesh)
                if fault == "nan" and i == 3 and rank == 3:  # the second layer of the second step
                    sd["model.layers.3.mlp.experts.w1"].to_local()[0, 3, 5] = float("nan")
                yield i, sd

        full = sharded_layer(TINY_GLM5, REST, stage_mesh)
        held = [k for k, ranks in HOLDERS[REST].items() if rank in ranks]
        stats = sender.send_model(layers(), rest={k: full[k] for k in held})
        return sender.routes.steps, stats.nbytes, sender.routes.sent_bytes()[sender.me]
    layout = layouts[rank - 4]
    params = poisoned_engine_params(TINY_GLM5, layout)
    receiver = Receiver(None, 0, layout=layout, **kw)
    assert receiver.ring.nbytes == receiver.routes.receive_slot(rank)
    receiver.load_into(params)
    want = reference_engine_params(TINY_GLM5, layout, [*IDS, REST])
    assert set(want) == set(params)  # every parameter is part of the update
    bad = [
        n for n, ref in want.items() if not torch.equal(params[n].view(torch.uint8), ref.view(torch.uint8))
    ]
    return bad, receiver.ring.nbytes


@pytest.mark.parametrize("step_layers", [1, 2])
def test_every_engine_byte_equals_the_reference_in_steps_of_each_stages_layers(step_layers):
    results = launch(6, _rank, (step_layers,), timeout_s=150)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    for r in range(4):
        steps, sent, planned = results[r][1]
        assert sent == planned > 0
        want = ((0, 1), (2, 3), (4,), (5,)) if step_layers == 2 else tuple((p,) for p in range(6))
        assert steps == want  # layers 0 and 1, 2 and 3 (one of each stage), the MTP layer, the rest
    for r in (4, 5):
        differ, _ = results[r][1]
        assert differ == [], differ


def test_a_step_of_two_layers_takes_one_slot_of_both_on_each_engine_rank():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.transfer.routes import side_by_side, transfer_plan

    layouts = [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]
    ids = [*IDS, REST]
    plans = plans_for_model(TINY_GLM5, "fp8", layer_ids=ids)
    holders = [
        tuple(HOLDERS[i]) if i != REST else {k: tuple(v) for k, v in HOLDERS[REST].items()} for i in ids
    ]
    holders[-1] = {e.name: holders[-1].get(e.name, (0, 1, 2, 3)) for e in plans[-1].entries}
    one, two = (
        transfer_plan(TINY_GLM5, plans, ids, [None] * 4 + layouts, range(4), holders=holders, step_layers=k)
        for k in (1, 2)
    )
    for rank in (4, 5):
        sizes = [lay.rank_nbytes(rank) for lay in two.layers]
        assert two.receive_slot(rank) == max(side_by_side(sizes[0:2]), side_by_side(sizes[2:4]), *sizes[4:])
        assert two.receive_base(rank, 1) == -(-sizes[0] // 256) * 256  # after layer 0's, aligned
        assert two.receive_slot(rank) > one.receive_slot(rank) == max(sizes)
        assert two.received_bytes() == one.received_bytes()  # the same bytes, in fewer steps
    assert len(two.steps_sent()) == 4 and len(one.steps_sent()) == 6
    assert [sum(s) for s in two.steps_sent()] == [
        sum(one.steps_sent()[0]) + sum(one.steps_sent()[1]),
        sum(one.steps_sent()[2]) + sum(one.steps_sent()[3]),
        sum(one.steps_sent()[4]),
        sum(one.steps_sent()[5]),
    ]


def test_a_nan_in_a_steps_second_layer_stops_every_rank_at_that_step():
    results = launch(6, _rank, (2, "nan"), timeout_s=150)
    assert results[3][0] == "NonFiniteError", results[3]
    assert str(results[3][1]).startswith("model.layers.3.mlp.experts.w13_weight: NaN or Inf"), results[3]
    for r in (0, 1, 2, 4, 5):
        status, msg = results[r]
        assert status == "UpdateAborted", (r, results[r])
        assert "the step of layer 2, layer 3" in str(msg), (r, msg)

"""Megatron-Core's own ``GPTModel`` sends through glm_fp8: every sending rank its own share.

A tiny GLM-5 (``TINY_GLM5``: MLA with the DSA indexer, two dense and two MoE layers of 4
routed experts with a shared expert and ``expert_bias``, one MTP layer) is built by Megatron-Core
0.19 on gloo ranks, over TP 2 x EP 2 (4 ranks: DP 2, so only expert-data-parallel rank 0 sends),
over PP 2 (each stage its layers), over TP 2 with EP 1 (DP 2: the expert rank of
expert-data-parallel rank 0 sends the experts, its TP group's other rank its share of the rest)
and over TP 2 with expert tensor parallelism 2 (each expert's rows on two ranks).
``MegatronSource`` hands each rank's tensors to a ``Sender`` of many senders (``holders``: the
stages), and two engine ranks land their shards of it (TP 2, or EP 2: the vLLM parameters
``glm_fp8.engine.engine_params`` models).

Invariant: every engine byte equals the reference conversion of the checkpoint that an
independent path builds from the same Megatron tensors: this test's own name table, TP shards
joined along Megatron's ``partition_dim``, fc1's per-shard [gate_i; up_i] reordered, experts
numbered ``ep_rank * E / EP + j``, ETP pieces joined alike, and stacked in prime-rl's layout.
With a delta (TP 2 x EP 2): a first update, a small step, then its delta, after which the engine
holds the new weights' bytes.

What Megatron-Core cannot build on a CPU, and how the model is built instead:
``glm_fp8.integrations.megatron_cpu`` (Megatron's local specs, its DSA attention over local
linears; Transformer Engine's names are mapped by the same table but not built here).
"""

import io
import json
from datetime import timedelta

import pytest
import torch

from glm_fp8.model.families import REST
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_ports, launch

megatron = pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")

CONFIG = TINY_GLM5
E, H = CONFIG["n_routed_experts"], CONFIG["hidden_size"]


def _build(tp: int, pp: int, ep: int, vocab: int, etp: int = 1):
    """Megatron-Core's GPTModel for ``CONFIG`` on this rank (local specs), weights in bfloat16."""
    from glm_fp8.integrations.megatron_cpu import tiny_glm5_gpt_model

    return tiny_glm5_gpt_model(CONFIG, tp=tp, pp=pp, ep=ep, etp=etp, vocab=vocab)


# The checkpoint's names (prime-rl's layout) of Megatron's tensors: this test's own table.
OWN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.core_attention.indexer.linear_wq_b.weight": "self_attn.indexer.wq_b.weight",
    "self_attention.core_attention.indexer.linear_wk.weight": "self_attn.indexer.wk.weight",
    "self_attention.core_attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attention.core_attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "self_attention.core_attention.indexer.linear_weights_proj.weight": (
        "self_attn.indexer.weights_proj.weight"
    ),
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.router.gate.weight",
    "mlp.router.expert_bias": "mlp.expert_bias",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}


def _rank(rank, world, *args):
    """``_update``'s result as bytes: tensors in a queue's message are shared memory that a process
    which has ended no longer serves."""
    buf = io.BytesIO()
    torch.save(_update(rank, world, *args), buf)
    return buf.getvalue()


def _step(model) -> None:
    """A small training step's change: a few elements of every weight move (the same ones on each
    rank that holds a copy), so that a delta update has something, not everything, to send."""
    with torch.no_grad():
        for name, t in model.named_parameters():
            g = torch.Generator().manual_seed(sum(map(ord, name)) + 1)
            flat = t.view(-1)
            idx = torch.randint(flat.numel(), (3,), generator=g)
            flat[idx] += (flat[idx].abs() + 1e-2).to(flat.dtype) * 0.5


def _update(rank, world, trainers, tp, pp, ep, vocab, layouts, delta, ports, etp=1, step_layers=1):
    import torch.distributed as dist

    from glm_fp8.integrations.megatron import MegatronSource
    from glm_fp8.testing import poisoned_engine_params
    from glm_fp8.transfer import DeltaOptions, Receiver, Sender
    from glm_fp8.transfer.link import StoreLink

    dist.destroy_process_group()  # the launcher's world holds the engine ranks too: Megatron's holds trainers
    coord = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=timedelta(seconds=120))
    n_engines = len(layouts)
    if rank < trainers:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=trainers
        )
        model = _build(tp, pp, ep, vocab, etp)
        source = MegatronSource(model, CONFIG)
        planned = None
        if rank == 0:
            order = source.stage_layer_ids if step_layers > 1 else source.layer_ids
            coord.set(
                "plan",
                json.dumps(
                    {"senders": source.senders, "holders": list(source.holders.items()), "order": order}
                ),
            )
            planned = _planned_holders(source, tp, pp, ep, etp)
        from megatron.core import parallel_state as ps

        place = dict(
            offset=ps.get_pipeline_model_parallel_rank() * CONFIG["num_hidden_layers"] // pp,  # an even split
            tp=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_rank(),
        )
        if not source.is_sender:
            list(source.layers()), source.rest()  # a replica: nothing to send, nothing gathered from it
            return "replica", place, _local(model)
    plan = json.loads(coord.get("plan"))
    senders, holders, order = plan["senders"], {int(k): v for k, v in plan["holders"]}, plan["order"]
    n_senders = len(senders)
    link_rank = source.link_rank if rank < trainers else n_senders + rank - trainers
    link = StoreLink(
        "127.0.0.1",
        ports[2],
        link_rank,
        n_senders + n_engines,
        backend="gloo",
        timeout=timedelta(seconds=120),
        global_ranks=senders,  # the senders' trainer ranks, where their TP groups' DTensors live
    )
    kw = dict(
        config=CONFIG,
        layer_ids=order,  # every decoder layer and the MTP layer; with steps of several, stages in turn
        rest=True,
        device="cpu",
        engines=[None] * n_senders + list(layouts),
        senders=list(range(n_senders)),
        holders=holders,
        step_layers=step_layers,
    )
    if rank < trainers:
        sender = Sender(link, 0, delta=DeltaOptions() if delta else None, **kw)
        sent = [sender.send_model(source.layers(order), rest=source.rest()).nbytes]
        if step_layers > 1:  # a step carries one layer of each stage (the last, the MTP layer and the rest)
            assert len(sender.routes.steps) < len(order) + 1, sender.routes.steps
            assert max(map(len, sender.routes.steps)) == step_layers, sender.routes.steps
        if delta:  # a step, then its delta: the engine must end with the new weights' bytes
            _step(model)
            sent.append(sender.send_model(source.layers(order), rest=source.rest()).nbytes)
        return "sender", place, _local(model), sent, planned
    layout = layouts[rank - trainers]
    params = poisoned_engine_params(CONFIG, layout, 0x5A)  # what no update wrote shows
    receiver = Receiver(link, 0, layout=layout, delta=delta, **kw)
    for _ in range(2 if delta else 1):
        receiver.load_into(params)
    return "engine", layout, params


def _planned_holders(source, tp: int, pp: int, ep: int, etp: int) -> tuple[int, int]:
    """The plan's senders and holders for this trainer (``glm_fp8.planning.fleet.MegatronTrainer``,
    what ``glm-fp8 plan --trainer`` predicts from) against what ``MegatronSource`` read from
    Megatron's own parallel state: (senders the plan counts, layers whose holders differ)."""
    from glm_fp8.planning.fleet import MegatronTrainer

    trainer = MegatronTrainer(tp=tp, pp=pp, ep=ep, etp=etp)
    ids = list(source.holders)
    norm = lambda h: {k: tuple(v) for k, v in h.items()} if isinstance(h, dict) else tuple(h)  # noqa: E731
    differ = [i for i, h in zip(ids, trainer.holders(CONFIG, ids)) if norm(h) != norm(source.holders[i])]
    return trainer.senders - len(source.senders), len(differ)


def _local(model) -> dict:
    """This rank's Megatron tensors as they are now, with how Megatron splits them over TP."""
    local = {}
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")]  # not routing stats
    for name, t in [*model.named_parameters(), *buffers]:
        local[name] = (
            t.detach().clone(),
            getattr(t, "partition_dim", None),
            getattr(t, "tensor_model_parallel", False),
        )
    return local


def _join_expert(parts: dict, fc: int) -> torch.Tensor:
    """One expert's tensor from its expert tensor-parallel pieces: fc1's [gate_i; up_i] as all
    gates then all ups, fc2 joined along its columns."""
    shards = [parts[r] for r in sorted(parts)]
    if len(shards) == 1:
        return shards[0]
    if fc == 1:
        halves = [x.chunk(2) for x in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=1)


def _checkpoint(results, tp: int):
    """The checkpoint, by layer (prime-rl's names), joined from the senders' Megatron tensors."""
    n = CONFIG["num_hidden_layers"]
    pieces: dict[str, dict] = {}  # Megatron name -> {tp rank: tensor} and its partition dim
    # (layer, global expert, fc) -> {expert tensor-parallel rank: its rows}
    experts: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
    e_local = None
    for status, res in results.values():
        assert status == "ok", res
        if res[0] != "sender":
            continue
        place, local = res[1], res[2]
        for name, (t, dim, split) in local.items():
            if ".local_experts." in name:
                parts = name.split(".")
                layer = n if name.startswith("mtp.") else place["offset"] + int(parts[2])
                j = int(parts[parts.index("local_experts") + 1])
                e_local = len(
                    {
                        k
                        for k in local
                        if k.startswith(name.split("local_experts.")[0] + "local_experts.")
                        and k.endswith("linear_fc2.weight")
                    }
                )
                key = (layer, place["ep"] * e_local + j, int(name[-8]))
                experts.setdefault(key, {})[place.get("etp", 0)] = t
                continue
            if name.startswith("decoder.layers."):  # the stage's own numbering, from 0
                parts = name.split(".")
                name = ".".join([*parts[:2], str(place["offset"] + int(parts[2])), *parts[3:]])
            pieces.setdefault(name, {"dim": dim if split else None, "tp": {}})["tp"][place["tp"]] = t
    full = {}
    for name, p in pieces.items():
        shards = [p["tp"][r] for r in sorted(p["tp"])]
        if p["dim"] is None or len(shards) == 1:
            full[name] = shards[0]
        elif name.endswith("linear_fc1.weight"):  # each shard [gate_i; up_i]: all gates, then all ups
            halves = [s.chunk(2) for s in shards]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            full[name] = torch.cat(shards, dim=p["dim"])
    layers = {i: {} for i in [*range(n), n, REST]}
    for name, t in full.items():
        if name.startswith("decoder.layers."):
            i, short = int(name.split(".")[2]), name.split(".", 3)[3]
        elif name.startswith("mtp.layers.0."):
            i, short = n, name[len("mtp.layers.0.") :].removeprefix("mtp_model_layer.")
        else:
            rest = {
                "embedding.word_embeddings.weight": "model.embed_tokens.weight",
                "decoder.final_layernorm.weight": "model.norm.weight",
                "output_layer.weight": "lm_head.weight",
            }
            layers[REST][rest[name]] = t[: CONFIG["vocab_size"]] if t.shape[0] > H else t
            continue
        if short in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            gate, up = t.chunk(2)
            if "shared" in short:
                layers[i]["mlp.shared_expert.w1"], layers[i]["mlp.shared_expert.w3"] = gate[None], up[None]
            else:
                layers[i]["mlp.gate_proj.weight"], layers[i]["mlp.up_proj.weight"] = gate, up
        elif short == "mlp.shared_experts.linear_fc2.weight":
            layers[i]["mlp.shared_expert.w2"] = t[None]
        else:
            layers[i][OWN[short]] = t
    layers[n]["shared_head.head.weight"] = layers[REST]["lm_head.weight"]
    for i in range(n + 1):
        if (i, 0, 1) in experts:
            fc1 = torch.stack([_join_expert(experts[(i, g, 1)], 1) for g in range(E)])
            layers[i]["mlp.experts.w1"], layers[i]["mlp.experts.w3"] = fc1.chunk(2, dim=1)
            layers[i]["mlp.experts.w2"] = torch.stack([_join_expert(experts[(i, g, 2)], 2) for g in range(E)])
    return layers


def _engine_layouts(name: str):
    from glm_fp8.engine import EngineLayout

    if name == "tp2":
        return [EngineLayout(tp_size=2, tp_rank=r) for r in range(2)]
    return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]  # ep2


def _launched(fn, trainers: int, layouts, args: tuple) -> dict:
    """``fn`` on the trainer ranks and the engine ranks; each rank's result read back."""
    results = launch(trainers + len(layouts), fn, args, timeout_s=240)
    assert all(status == "ok" for status, _ in results.values()), results
    return {
        r: (status, torch.load(io.BytesIO(res), weights_only=False)) for r, (status, res) in results.items()
    }


def _check_engines(results, trainers: int, layouts, tp: int) -> None:
    """Every engine rank's parameters hold, byte for byte, the reference conversion of the
    checkpoint joined from the Megatron ranks' own tensors (``_checkpoint``)."""
    from glm_fp8.testing import reference_engine_params

    layers = _checkpoint(results, tp)
    ids = [*range(CONFIG["num_hidden_layers"] + 1), REST]
    for r, layout in enumerate(layouts):
        params = results[trainers + r][1][2]
        want = reference_engine_params(CONFIG, layout, ids, layer=lambda i: layers[i])
        assert set(want) == set(params)
        for name, ref in want.items():
            got = params[name]
            assert got.dtype == ref.dtype and got.shape == ref.shape, name
            assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8)), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(trainers=4, tp=2, pp=1, ep=2, vocab=1000, engine="tp2"), id="tp2 x ep2 into tp2"),
        pytest.param(
            dict(trainers=2, tp=1, pp=2, ep=1, vocab=1024, engine="ep2"), id="pp2, padded vocab, into ep2"
        ),
        pytest.param(
            dict(trainers=4, tp=2, pp=1, ep=1, vocab=1000, engine="ep2"), id="tp2 wider than ep1, into ep2"
        ),
        pytest.param(
            dict(trainers=2, tp=2, pp=1, ep=1, etp=2, vocab=1000, engine="tp2"), id="tp2, etp2, into tp2"
        ),
        pytest.param(
            dict(trainers=4, tp=2, pp=2, ep=1, vocab=1000, engine="ep2", step_layers=2),
            id="tp2 x pp2 in steps of a layer of each stage, into ep2",
        ),
    ],
)
def test_megatron_model_lands_exactly(case):
    layouts = _engine_layouts(case["engine"])
    trainers = case["trainers"]
    ports = free_ports(3)
    delta = case.get("delta", False)
    args = (
        trainers,
        case["tp"],
        case["pp"],
        case["ep"],
        case["vocab"],
        layouts,
        delta,
        ports,
        case.get("etp", 1),
        case.get("step_layers", 1),
    )
    results = _launched(_rank, trainers, layouts, args)
    _check_engines(results, trainers, layouts, case["tp"])
    # the plan's trainer model sends from the ranks, and each layer from the holders, Megatron's has
    assert results[0][1][4] == (0, 0), results[0][1][4]
    if case.get("etp", 1) > 1:  # Megatron split each expert's rows over the two ranks
        assert sorted(results[r][1][1]["etp"] for r in range(trainers)) == [0, 1]
        fc1 = [
            t for n, (t, _, _) in results[0][1][2].items() if n.endswith("local_experts.0.linear_fc1.weight")
        ]
        assert fc1 and fc1[0].shape[0] == CONFIG["moe_intermediate_size"]  # 2 I / ETP rows: half of each
    if (
        case["trainers"] == 4 and case["pp"] == 1
    ):  # DP 2: the replicas sent nothing (with EP 1 rank 1 sends its TP shards)
        assert [results[r][1][0] for r in range(4)] == ["sender", "sender", "replica", "replica"]
    if delta:  # the step's update went as a delta: a small part of the dense one's bytes
        for r in range(trainers):
            if results[r][1][0] == "sender":
                dense, changed = results[r][1][3]
                assert 0 < changed * 4 < dense, (r, dense, changed)


def _one_sender_rank(rank, world, *args):
    buf = io.BytesIO()
    torch.save(_one_sender(rank, world, *args), buf)
    return buf.getvalue()


def _one_sender(rank, world, trainers, tp, pp, ep, vocab, layouts, ports, mode):
    """The one-sender modes: trainer rank 0 is the link's only sender, handed every layer whole
    (``MegatronSource.whole_layers``); the other trainer ranks contribute their pieces
    (``contribute_whole``); the engine ranks scatter (their layouts) or broadcast ("full")."""
    import torch.distributed as dist

    from glm_fp8.integrations.megatron import MegatronSource
    from glm_fp8.testing import poisoned_engine_params
    from glm_fp8.transfer import Receiver, Sender
    from glm_fp8.transfer.link import StoreLink
    from glm_fp8.transfer.pack import FULL

    dist.destroy_process_group()  # the launcher's world holds the engine ranks too: Megatron's holds trainers
    if rank < trainers:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=trainers
        )
        model = _build(tp, pp, ep, vocab)
        source = MegatronSource(model, CONFIG)
        from megatron.core import parallel_state as ps

        place = dict(
            offset=ps.get_pipeline_model_parallel_rank() * CONFIG["num_hidden_layers"] // pp,
            tp=ps.get_tensor_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
        )
        kind = "sender" if source.is_sender else "replica"  # the Megatron ranks whose tensors count
        if rank > 0:
            source.contribute_whole()
            return kind, place, _local(model)
    link = StoreLink(
        "127.0.0.1",
        ports[2],
        0 if rank == 0 else 1 + rank - trainers,
        1 + len(layouts),
        backend="gloo",
        timeout=timedelta(seconds=120),
    )
    kw = dict(
        config=CONFIG,
        layer_ids=[*range(CONFIG["num_hidden_layers"]), CONFIG["num_hidden_layers"]],
        rest=True,
        device="cpu",
        engines=[None] + (list(layouts) if mode == "scatter" else [FULL] * len(layouts)),
    )
    if rank == 0:
        stats = Sender(link, 0, **kw).send_model(source.whole_layers(), rest=source.whole_rest())
        return kind, place, _local(model), [stats.nbytes], None
    layout = layouts[rank - trainers]
    params = poisoned_engine_params(CONFIG, layout, 0x5A)  # what no update wrote shows
    Receiver(link, 0, layout=layout, **kw).load_into(params)
    return "engine", layout, params


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            dict(trainers=4, tp=2, pp=2, ep=1, engine="ep2", mode="scatter"), id="tp2 x pp2, scatter into ep2"
        ),
        # One rank a stage: two sending ranks of a stage would hold the shared expert apart here
        # (the tiny model's data-parallel replicas are not synchronized, as DDP's are at start).
        pytest.param(
            dict(trainers=2, tp=1, pp=2, ep=1, engine="tp2", mode="broadcast"), id="pp2, broadcast to tp2"
        ),
    ],
)
def test_megatron_model_lands_exactly_from_one_sender(case):
    """The one-sender modes from a Megatron-Core model: every layer's pieces, across pipeline
    stages, TP and EP ranks, gathered onto trainer rank 0, which converts and sends it; every
    engine byte equals the reference of the checkpoint joined from the Megatron ranks' tensors."""
    layouts = _engine_layouts(case["engine"])
    trainers = case["trainers"]
    args = (trainers, case["tp"], case["pp"], case["ep"], 1000, layouts, free_ports(3), case["mode"])
    results = _launched(_one_sender_rank, trainers, layouts, args)
    _check_engines(results, trainers, layouts, case["tp"])
    assert results[0][1][3][0] > 0


# --- through vLLM's weight-transfer API (what vime calls) ------------------------------------------


def _megatron_rank(rank: int, trainers: int, port: int, config: dict, pp: int = 1):
    """A trainer rank of the vLLM tests: the trainers' own default group, Megatron's tiny GLM-5 over
    TP 2 x EP 2 (DP 2 on 4 ranks) or TP 2 x PP 2 (``pp`` 2), its ``MegatronSource``, and where it
    sits."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from glm_fp8.integrations.megatron import MegatronSource

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=trainers)
    model = _build(2, pp, 2 if pp == 1 else 1, config["vocab_size"])
    source = MegatronSource(model, config)
    place = dict(
        offset=ps.get_pipeline_model_parallel_rank() * config["num_hidden_layers"] // pp,  # an even split
        tp=ps.get_tensor_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
    )
    return model, source, place


def _trainer_init(
    rank,
    world,
    trainers,
    port,
    boxes,
    source,
    config,
    timeout_s,
    delta=False,
    step_layers=1,
    mode="auto",
    servers=None,
):
    """vLLM's ``WeightTransferTrainerFactory.trainer_init`` on a trainer rank, ``source=`` its
    ``MegatronSource``, ``mode`` ("auto": many senders); rank 0 holds the client of the workers'
    queues (``servers``: a fleet, each server's worker count: a client per server)."""
    from test_vllm_backend import QueueClient
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from glm_fp8.integrations.vllm.backend import GlmFp8TrainerInitInfo

    fleet = {} if servers is None else dict(server_names=[f"s{k}" for k in range(len(servers))])
    info = GlmFp8TrainerInitInfo(
        "127.0.0.1",
        port,
        engine_ranks=world - trainers if servers is None else list(servers),
        config=config,
        mode=mode,
        **fleet,
        trainer_ranks=trainers,
        timeout_s=timeout_s,
        rank=rank,
        delta=delta,
        step_layers=step_layers,
    )
    client = None
    if rank == 0:
        cuts = [sum(servers[:k]) for k in range(len(servers) + 1)] if servers is not None else None
        client = (
            QueueClient(boxes)
            if servers is None
            else [QueueClient(boxes[a:b]) for a, b in zip(cuts, cuts[1:])]
        )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _vllm_rank(rank, world, trainers, port, boxes, ports, case):
    buf = io.BytesIO()
    torch.save(_vllm_update(rank, world, trainers, port, boxes, ports, case), buf)
    return buf.getvalue()


def _vllm_update(rank, world, trainers, port, boxes, ports, case):
    """A Megatron trainer rank calling vLLM's ``WeightTransferTrainerFactory.trainer_init`` with
    ``source=`` its ``MegatronSource`` and ``send_weights()`` for two steps (``case`` "delta": the
    second a delta; "steps": TP 2 x PP 2 in steps of a layer of each stage; "scatter" /
    "broadcast": one sender, the second a delta with "scatter"); or an engine worker built and driven as vLLM
    0.34's ``Worker`` drives its engine (test_vllm_backend_real.py)."""
    import torch.distributed as dist

    dist.destroy_process_group()  # the launcher's world holds the engine workers too
    if rank < trainers:
        try:
            pp, steps = (2, 2) if case == "steps" else (1, 1)
            model, source, place = _megatron_rank(rank, trainers, ports[1], CONFIG, pp)
            refused = None
            if case == "scatter" and rank == 0:  # one sender: init_info.rank must be the group's rank
                from glm_fp8.integrations.vllm.trainer import TrainerSide
                from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

                opts = TrainerOptions(
                    "127.0.0.1", port, engine_ranks=2, config=CONFIG, mode="scatter", rank=1, trainer_ranks=4
                )
                try:
                    TrainerSide(opts, None, source, torch.device("cpu"))
                except ValueError as exc:
                    refused = str(exc)
            engine = _trainer_init(
                rank,
                world,
                trainers,
                port,
                boxes,
                source,
                CONFIG,
                60,
                delta=case in ("delta", "scatter", "fleet"),
                step_layers=steps,
                mode=case if case in ("scatter", "broadcast") else "auto",
                servers=[2, 2] if case == "fleet" else None,
            )
            out = []
            for step in range(2):
                if step:
                    _step(model)
                out.append([(o["session"], o["bytes"], o["sender"]) for o in engine.send_weights()])
            engine.shutdown()
            kind = "sender" if source.is_sender else "replica"
            return kind, place, _local(model), out, engine.side.mode, refused
        finally:
            if rank == 0:
                for inbox, _ in boxes:
                    inbox.put(("stop", ()))
    import vllm.distributed.parallel_state as parallel_state
    from test_vllm_backend import _layouts
    from test_vllm_backend_real import VllmWorker, _Group, _serve, _vllm_config
    from test_vllm_worker import _engine

    import glm_fp8.integrations.vllm as integ

    integ.register()
    r = rank - trainers
    # "fleet": a server of EP 2 (workers 0, 1), then one of TP 2 (workers 2, 3)
    layout = _layouts("ep2")[r] if r < 2 else _layouts("tp2")[r - 2]
    parallel_state.get_tp_group = lambda: _Group(layout.tp_rank)
    parallel_state.get_dp_group = lambda: _Group(layout.dp_rank)
    target, drafter = _engine(layout)
    worker = VllmWorker(_vllm_config(layout, CONFIG, mtp=True), target, drafter, torch.device("cpu"))
    log: list[str] = []
    _serve(worker, *boxes[r], log)
    updater = worker.engine.side.updater
    params = {
        n: p.detach().clone() for n, p in updater.engine.params.items() if n not in updater.engine.aliases
    }
    return "engine", layout, params, log, worker.updates


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "delta", "steps", "scatter", "broadcast", "fleet"])
def test_megatron_through_vllms_weight_transfer_api(case):
    """vime's path: a Megatron-Core trainer (TP 2 x EP 2 on 4 ranks, DP 2) updates a vLLM server
    (EP 2) through vLLM 0.34's weight-transfer API with glm_fp8's backend and ``source=`` its
    ``MegatronSource``: mode "auto" picks many senders, the two senders send (the replicas put
    nothing on the link), the MTP layer goes in vLLM's draft session, and after a training step's
    second update (a delta, with ``delta=True``) every engine parameter equals the reference of the
    new weights, as vLLM's FlashInfer MoE backend stores it. "steps": TP 2 x PP 2, every rank a
    sender, ``step_layers=2``: each step of the target session carries a layer of each stage.
    "scatter" / "broadcast": the one-sender modes, trainer rank 0 the only sender, every layer
    gathered onto it whole as it sends (the other three ranks take part in the gathers and put
    nothing on the link), the second update a delta with "scatter" (a broadcast has no delta).
    "fleet": two servers of two layouts (EP 2, TP 2) in one update, the second a delta."""
    delta = case in ("delta", "scatter", "fleet")
    one = case in ("scatter", "broadcast")
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import torch.multiprocessing as mp
    from test_vllm_worker import _vllm_swap_w13_to_w31

    from glm_fp8.testing import reference_engine_params

    ctx = mp.get_context("spawn")
    trainers, engines = 4, 4 if case == "fleet" else 2
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(engines)]
    *ports, port = free_ports(3)
    results = launch(trainers + engines, _vllm_rank, (trainers, port, boxes, ports, case), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    results = {
        r: (status, torch.load(io.BytesIO(res), weights_only=False)) for r, (status, res) in results.items()
    }
    kinds = [results[r][1][0] for r in range(trainers)]
    assert kinds == ["sender"] * 4 if case == "steps" else ["sender", "sender", "replica", "replica"], kinds
    assert all(results[r][1][4] == (case if one else "senders") for r in range(trainers))
    if case == "scatter":  # a trainer rank other than its rank in the default group: refused, naming both
        refused = results[0][1][5]
        assert refused and "init_info.rank: 1" in refused and "rank 0 of torch.distributed" in refused, (
            refused
        )
    for r in range(trainers):
        for step in results[r][1][3]:
            sessions = [s for s, _, _ in step]
            assert sessions == ["target", "draft"], sessions
            if case == "steps":  # every rank sends its stage's share; the MTP layer is the last stage's
                assert step[0][1] > 0 and (step[1][1] > 0) == (r >= 2), (r, step)
            else:
                on_link = r == 0 if one else r < 2
                assert all((n > 0) == on_link and on == on_link for _, n, on in step), (r, step)
    if delta:  # the second step's target update is a delta: a small part of the first's bytes
        for r in range(1 if one else 2):
            first, second = results[r][1][3][0][0][1], results[r][1][3][1][0][1]
            assert 0 < second * 4 < first, (r, first, second)
    layers = _checkpoint(results, 2)
    ids = [*range(CONFIG["num_hidden_layers"] + 1), REST]
    for r in range(engines):
        _, layout, params, log, updates = results[trainers + r][1]
        assert log == [], log
        want = reference_engine_params(CONFIG, layout, ids, layer=lambda i: layers[i])
        for name in list(want):
            if "routed_experts.w13_weight" in name:
                want[name] = _vllm_swap_w13_to_w31(want[name])
            if "routed_experts.w" in name and name.endswith("_scale_inv"):
                want[name] = want[name].clamp(min=1e-10)
        bad = [
            n
            for n, w in want.items()
            if n in params
            and not torch.equal(params[n].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        ]
        assert bad == [] and len(set(want) & set(params)) > 50, (bad[:5], len(params))


# --- into vLLM 0.34's own GLM-5 model classes ------------------------------------------------------


def _hf_layer(layer_idx: int, layer: dict) -> dict:
    """A layer of ``_checkpoint`` (prime-rl's names, short) in Hugging Face's module names, prefixed:
    what test_vllm_model_real.py's checkpoint writer takes (it splits the stacked experts)."""
    if layer_idx == REST:
        return dict(layer)
    out, prefix = {}, f"model.layers.{layer_idx}."
    for name, t in layer.items():
        if name == "mlp.experts.w1":
            out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([t, layer["mlp.experts.w3"]], dim=1)
        elif name == "mlp.experts.w2":
            out[prefix + "mlp.experts.down_proj"] = t
        elif name == "mlp.experts.w3":
            continue
        elif name.startswith("mlp.shared_expert.w"):
            which = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}[name[-1]]
            out[prefix + f"mlp.shared_experts.{which}.weight"] = t[0]
        else:
            names = {
                "mlp.router.gate.weight": "mlp.gate.weight",
                "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
            }
            out[prefix + names.get(name, name)] = t
    return out


def _vllm_model_rank(rank, world, trainers, port, vllm_port, boxes, ports, tmp, case):
    buf = io.BytesIO()
    torch.save(_vllm_model_update(rank, world, trainers, port, vllm_port, boxes, ports, tmp, case), buf)
    return buf.getvalue()


def _vllm_model_update(rank, world, trainers, port, vllm_port, boxes, ports, tmp, case):
    """Trainer ranks: Megatron's model (TP 2 x EP 2) saves its tensors for the engines' reference,
    then updates through vLLM's API with ``source=`` its ``MegatronSource``. Engine workers: vLLM's
    own GLM-5 model and MTP drafter, the reference loaded by vLLM's ``load_weights`` from a block-FP8
    checkpoint this test builds from those tensors (test_vllm_model_real.py's harness)."""
    import os
    import time

    import torch.distributed as dist
    import vllm_standin

    vllm_standin.install()
    from test_vllm_model_real import CONFIG as VLLM_CONFIG

    config = {**VLLM_CONFIG, "num_nextn_predict_layers": 1}
    if rank < trainers:
        dist.destroy_process_group()
        try:
            pp = 2 if case.startswith("pp2") else 1
            model, source, place = _megatron_rank(rank, trainers, ports[1], config, pp)
            kind = "sender" if source.is_sender else "replica"
            path = os.path.join(tmp, f"trainer{rank}.pt")
            torch.save((kind, place, _local(model)), path + ".part")
            os.replace(path + ".part", path)  # whole when the engines see it
            engine = _trainer_init(rank, world, trainers, port, boxes, source, config, 120)
            out = [(o["session"], o["bytes"]) for o in engine.send_weights()]
            engine.shutdown()
            return kind, out
        finally:
            if rank == 0:
                for inbox, _ in boxes:
                    inbox.put(("stop", ()))
    from test_vllm_model_real import _engine

    paths = [os.path.join(tmp, f"trainer{r}.pt") for r in range(trainers)]
    deadline = time.monotonic() + 180
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.5)
    saved = {r: ("ok", torch.load(p, weights_only=False)) for r, p in enumerate(paths)}
    layers = _checkpoint(saved, 2)
    weights = lambda i: _hf_layer(i, layers[i])  # noqa: E731
    return _engine(
        rank - trainers,
        world - trainers,
        vllm_port,
        boxes,
        case.removeprefix("pp2-"),
        config,
        tmp,
        torch.bfloat16,
        weights=weights,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ep2", "tp2", "pp2-ep2"])
def test_megatron_update_lands_in_vllms_glm5_model_as_vllms_own_load(case, tmp_path):
    """The issue's measure: Megatron-Core's tiny GLM-5 over TP 2 x EP 2 (DP 2) updates vLLM 0.34's own
    ``GlmMoeDsaForCausalLM`` and its MTP drafter at EP 2 and at TP 2 through vLLM's weight-transfer API
    ("pp2-ep2": over TP 2 x PP 2, every rank sending its stage's layers, into EP 2); every
    parameter of both (MLA's rebuilt ``W_UK_T`` / ``W_UV`` too) then holds the bytes vLLM's own
    ``load_weights`` gives them from a block-FP8 checkpoint that this test builds from the same
    Megatron tensors by its own table (no glm_fp8 conversion in the expected bytes but the
    reference quantizer writing that checkpoint)."""
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import json
    import os

    import torch.multiprocessing as mp
    from test_vllm_model_real import CONFIG as VLLM_CONFIG

    ctx = mp.get_context("spawn")
    trainers, engines = 4, 2
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(engines)]
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({**VLLM_CONFIG, "num_nextn_predict_layers": 1}, f)
    *ports, port, vllm_port = free_ports(4)
    args = (trainers, port, vllm_port, boxes, ports, str(tmp_path), case)
    results = launch(trainers + engines, _vllm_model_rank, args, timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    results = {r: torch.load(io.BytesIO(res), weights_only=False) for r, (_, res) in results.items()}
    kinds = ["sender"] * 4 if case.startswith("pp2") else ["sender", "sender", "replica", "replica"]
    assert [results[r][0] for r in range(trainers)] == kinds
    for r in range(trainers):
        assert [s for s, _ in results[r][1]] == ["target", "draft"], results[r]
    for r in range(trainers, trainers + engines):
        out = results[r]
        assert out["log"] == [] and out["updater_layout"], out
        assert out["spec_mismatch"] == [], out
        assert out["unloaded"] == [] and out["poisoned"] == [], out
        assert out["params"] > 120 and out["differ"] == [], out
        assert out["absorbed"] == VLLM_CONFIG["num_hidden_layers"] + 1, out
        assert [into for _, into in out["updates"]] == ["target", "drafter"], out

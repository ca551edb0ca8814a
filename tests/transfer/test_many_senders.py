"""Many senders: every trainer rank converts and sends its own share of the update (its whole
experts of every stack, and the entries it owns) straight to the engine ranks that hold them.

Invariant: after ``load_into(params)`` on every engine rank, each ``params[n]`` equals the
reference conversion cut by the rank's shard, bit for bit (``glm_fp8.testing
.reference_engine_params``), exactly as with one sender; every parameter is written; a sender
sends only its own experts' bytes and the entries it owns, and the engine ranks receive exactly
their shard. Any rank's failure (a sender's bad layer, non-finite weights, a layer out of order,
a receiver's consumer) stops every rank at the same step, with the failing rank named. Trainer
ranks hold FSDP2-style DTensors (``Shard(0)``) on a gloo CPU mesh; a whole tiny GLM-5 (two
dense and two sparse layers, 4 experts, the MTP layer, embeddings and head).
"""

import math

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch

FILL = 0x5A
WHOLE = model_layer_ids(TINY_GLM5)


def _layouts(case: str, n: int):
    from glm_fp8.engine import EngineLayout

    if case == "tp2":
        return [EngineLayout(tp_size=2, tp_rank=r) for r in range(n)]
    if case == "ep2":
        return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(n)]
    if case == "ep4":
        return EngineLayout.all_ranks(1, 4, True)
    return [EngineLayout(tp_size=2, tp_rank=r % 2, dp_size=2, dp_rank=r // 2) for r in range(n)]  # tp2 x dp2


def _rank(rank, world, n_senders, case, fault=None):
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.testing import poisoned_engine_params, reference_engine_params, sharded_layer
    from glm_fp8.transfer import Receiver, Sender

    if fault in ("split", "split_replicated"):
        import glm_fp8.transfer.owners as owners

        owners.SPLIT_MIN_BYTES = 0  # split every passthrough matrix by rows, as GLM-5's largest are
    mesh = DeviceMesh("cpu", torch.arange(n_senders))  # every rank creates its groups
    layouts = _layouts(case, world - n_senders)
    engines = [None] * n_senders + layouts
    kw = dict(
        config=TINY_GLM5,
        layer_ids=WHOLE,
        rest=True,
        device="cpu",
        engines=engines,
        senders=list(range(n_senders)),
    )
    if rank < n_senders:
        other = {"scale_fmt": "ue8m0"} if fault == "manifest" and rank == 1 else {}  # another manifest
        sender = Sender(None, 0, **kw, **other)

        def layers():
            for i in WHOLE:
                sd = sharded_layer(TINY_GLM5, i, mesh)
                if fault == "shard1" and i == 2:  # experts split along I: no sender holds a whole one
                    from torch.distributed.tensor import Shard, distribute_tensor

                    for k in [k for k in sd if ".mlp.experts." in k]:
                        sd[k] = distribute_tensor(sd[k].full_tensor(), mesh, [Shard(1)])
                if fault == "nan" and i == 2 and rank == n_senders - 1:
                    sd["model.layers.2.mlp.experts.w1"].to_local()[0, 3, 5] = float("nan")
                if fault == "order" and i == 3 and rank == 1:
                    i = 4  # the wrong index only: building layer 4 here would be a collective of its own
                yield i, sd

        rest = sharded_layer(TINY_GLM5, REST, mesh)
        if fault == "split_replicated":  # rows not where the split wants them: gathered row by row
            from torch.distributed.tensor import Replicate, distribute_tensor

            name = "model.embed_tokens.weight"
            rest[name] = distribute_tensor(rest[name].full_tensor(), mesh, [Replicate()])
        if fault == "checksum":  # refused at layer 2 (below); then the next update, on the same group
            first = _first_update(lambda: sender.send_model(layers(), rest=rest))
        stats = sender.send_model(layers(), rest=rest)
        routes = sender.routes
        if fault == "checksum":
            return first
        if fault in ("split", "split_replicated"):  # the patch above reached the plan: vocabulary split
            assert "model.embed_tokens.weight" in routes.layers[-1].splits, list(routes.layers[-1].splits)
        assert stats.nbytes == routes.sent_bytes()[sender.me]
        delivered = sum(lay.delivered_nbytes(sender.me) for lay in routes.layers)
        return stats.nbytes, delivered, routes.received_bytes()
    layout = layouts[rank - n_senders]
    params = poisoned_engine_params(TINY_GLM5, layout, FILL)
    receiver = Receiver(None, 0, layout=layout, **kw)
    if fault in ("consumer", "consumer_last") and rank == world - 1:
        # the landing of a middle layer, or of the last (the non-layer tensors, voted at COMPLETE)
        name = "model.layers.3.mlp.experts.routed_experts.w2_weight"
        name = "lm_head.weight" if fault == "consumer_last" else name
        params[name] = params[name][:, :1]
        receiver._check_params = lambda p, a: None  # a consumer that breaks mid-update, not at the check
    assert receiver.ring.nbytes == max(
        lay.recv_nbytes[receiver.routes.class_of(pos, rank)] for pos, lay in enumerate(receiver.routes.layers)
    )
    if fault == "checksum":
        exchange = receiver.link.exchange
        if rank == world - 1:  # one bit of its third layer's (layer 2's) first message flips on the wire
            calls = []

            def corrupted(sends, recvs):
                exchange(sends, recvs)
                calls.append(1)
                if len(calls) == 3:
                    recvs[0][0][0] ^= 0x10

            receiver.link.exchange = corrupted
        first = _first_update(lambda: receiver.load_into(params))
        receiver.link.exchange = exchange
    receiver.load_into(params)
    want = reference_engine_params(TINY_GLM5, layout, [*WHOLE, REST])
    assert set(want) == set(params)  # every parameter is part of the update
    for name, ref in want.items():
        got = params[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name
    if fault == "checksum":
        return first
    return sum(p.nbytes for p in params.values())


def _first_update(update) -> tuple[str, str]:
    try:
        update()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize(
    "n_senders, case, engines",
    [(2, "tp2", 2), (2, "ep2", 2), (3, "tp2", 2), (4, "ep4", 4), (4, "tp2xdp2", 4)],
)
def test_every_engine_byte_equals_the_reference_from_many_senders(n_senders, case, engines):
    """3 senders over 4 experts hold 2, 2 and 0 (torch.chunk): the last sends only what it owns."""
    world = n_senders + engines
    results = launch(world, _rank, (n_senders, case), timeout_s=150)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    sent = [results[t][1][1] for t in range(n_senders)]  # delivered
    received = results[0][1][2]
    # What the senders deliver (a group broadcast once per receiving rank) is what the engine ranks
    # receive (their buffers also hold the alignment between segments), and each receives about
    # its shard (its parameters, less vLLM's float32 widenings, plus alignment and checksum words).
    slack = (world - n_senders) * len(WHOLE + [REST]) * n_senders * 256
    assert 0 <= sum(received.values()) - sum(sent) < slack
    for r in range(n_senders, world):
        held = results[r][1]
        assert held * 0.5 < received[r] < held + len(WHOLE + [REST]) * n_senders * 24 * 256, (r, received[r])
    assert min(sent) > 0


@pytest.mark.parametrize(
    "n_senders, case, fault",
    [(3, "tp2", "split"), (2, "ep2", "split"), (2, "tp2", "split_replicated")],
)
def test_large_passthrough_matrices_split_by_rows_land_exactly(n_senders, case, fault):
    """Every passthrough matrix split by rows over the senders (in GLM-5 only those of 64 MiB
    or more: embeddings, heads, eh_proj): 3 senders cut the 1000-row vocabulary at 334 and 668,
    across TP=2's cut at 512 and its 24 zero padding rows; a replicated embedding is gathered
    row range by row range; every byte still equals the reference."""
    results = launch(n_senders + 2, _rank, (n_senders, case, fault), timeout_s=150)
    assert all(v[0] == "ok" for v in results.values()), results


IDS = [0, 2]  # a dense layer (attention, indexer wq_b, dense MLP) and a sparse one (shared, routed experts)


def _modes_rank(rank, world, dtypes):
    """Ranks 0 and 1 train (FSDP2-style DTensors on one mesh), ranks 2 and 3 are a TP=2 engine.
    For each dtype the same trainer updates the engine in every mode, with the default
    ``gather_dtype``: broadcast and scatter from rank 0 (rank 1 takes part in its gathers), then
    many senders; for fp32, also many senders with the bf16 gather opt-in. An engine rank returns,
    per run, each parameter's digest and the parameters that differ from the reference of the
    trainer's own tensors (``glm_fp8.kernels.reference``, nothing cast)."""
    import hashlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.engine import engine_params
    from glm_fp8.testing import reference_engine_params, sharded_layer
    from glm_fp8.transfer import Receiver, Sender, contribute_shards

    mesh = DeviceMesh("cpu", torch.arange(2))
    one = dist.new_group([0, 2, 3])  # one sender's link (every rank creates the groups)
    layouts = _layouts("tp2", 2)
    kw = dict(config=TINY_GLM5, layer_ids=IDS, device="cpu")
    out = {}
    for dtype in dtypes:
        runs = [
            ("broadcast", one, None, [0], None),
            ("scatter", one, [None, *layouts], [0], None),
            ("many senders", None, [None, None, *layouts], [0, 1], None),
        ]
        if dtype == torch.float32:
            runs.append(("bf16 gather", None, [None, None, *layouts], [0, 1], torch.bfloat16))
        if rank >= 2:
            layout = layouts[rank - 2]
            want = reference_engine_params(TINY_GLM5, layout, IDS, dtype=dtype)
            opt_in = reference_engine_params(
                TINY_GLM5, layout, IDS, dtype=dtype, gathered_dtype=torch.bfloat16
            )
        for mode, link, engines, senders, gather_dtype in runs:
            if rank < 2:
                layers = ((i, sharded_layer(TINY_GLM5, i, mesh, dtype)) for i in IDS)
                if rank in senders:
                    Sender(
                        link, 0, engines=engines, senders=senders, gather_dtype=gather_dtype, **kw
                    ).send_model(layers)
                else:
                    contribute_shards(layers, sender=0, gather_dtype=gather_dtype, **kw)
                continue
            params = {}
            for name, p in engine_params(TINY_GLM5, layout).items():
                if name in want:
                    params[name] = torch.empty(p.shape, dtype=p.dtype)
                    params[name].view(torch.uint8).fill_(FILL)
            Receiver(link, 0, layout=layout, engines=engines, senders=senders, **kw).load_into(params)
            bits = {n: t.contiguous().view(torch.uint8) for n, t in params.items()}
            ref = opt_in if gather_dtype is not None else want
            out[str(dtype), mode] = {
                "digests": {n: hashlib.sha256(b.numpy().tobytes()).hexdigest() for n, b in bits.items()},
                "differ": sorted(n for n, w in want.items() if not _same_bytes(params[n], w)),
                "as_modelled": all(_same_bytes(params[n], w) for n, w in ref.items()),
            }
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.slow
def test_every_mode_lands_the_trainers_own_bytes():
    """fp32 masters (and bf16 ones, the control): broadcast, scatter and many senders land the same
    bytes on every engine rank, and those are the reference's from the trainer's own tensors, never
    cast first: every FP8 entry (attention, indexer wq_b, dense MLP, shared and routed experts) and
    the float32 routing bias. The bf16 gather is an opt-in: with it the gathered entries' bytes
    differ (the routed experts, quantized where held, do not)."""
    results = launch(4, _modes_rank, ((torch.float32, torch.bfloat16),), timeout_s=300)
    assert all(v[0] == "ok" for v in results.values()), results
    for r in (2, 3):
        runs = results[r][1]
        for dtype in ("torch.float32", "torch.bfloat16"):
            modes = {m: runs[dtype, m] for m in ("broadcast", "scatter", "many senders")}
            for mode, run in modes.items():
                assert run["differ"] == [] and run["as_modelled"], (r, dtype, mode, run["differ"])
                assert run["digests"] == modes["broadcast"]["digests"], (r, dtype, mode)
        opt_in = runs["torch.float32", "bf16 gather"]
        assert opt_in["as_modelled"], r
        differ = opt_in["differ"]
        assert any(".self_attn.o_proj." in n for n in differ) and any(".indexer.wq_b." in n for n in differ)
        assert any(".shared_experts." in n for n in differ) and any("layers.0.mlp." in n for n in differ)
        assert not any(".routed_experts." in n or "e_score_correction_bias" in n for n in differ), differ


@pytest.mark.parametrize(
    "fault, culprit, why",
    [
        ("nan", 1, "NonFiniteError"),  # the last sender's own expert: found after its gathers
        ("order", 1, "LayerOrderError"),  # one sender handed layer 4 where layer 3 was announced
        ("consumer", 3, "RuntimeError"),  # an engine rank's landing fails mid-update
        ("consumer_last", 3, "RuntimeError"),  # ... or on the last step's tensors (lm_head)
    ],
)
def test_any_ranks_failure_stops_every_rank_at_the_same_step(fault, culprit, why):
    results = launch(4, _rank, (2, "tp2", fault), timeout_s=60)
    assert results[culprit][0] == why, results
    for r, (status, msg) in results.items():
        if r == culprit:
            continue
        assert status in ("UpdateAborted", "ReceiverRefused"), (r, status, msg)
        assert f"rank {culprit} " in msg, (r, msg)


def test_the_plan_balances_senders_and_covers_every_byte():
    """Every piece of every class's shard comes from exactly one sender, a split entry's rows
    (experts, vocabulary rows) from the sender that holds them; senders' bytes stay within 2 GiB
    of each other."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.transfer.owners import owner_in
    from glm_fp8.transfer.pack import layer_scatter
    from glm_fp8.transfer.routes import transfer_plan

    cfg = PRESETS["glm-5"]
    ids = model_layer_ids(cfg) + [REST]
    plans = plans_for_model(cfg, "fp8", layer_ids=ids)
    engines = [None] * 32 + [lay for _ in range(4) for lay in EngineLayout.all_ranks(8, 1, True)]
    tp = transfer_plan(cfg, plans, ids, engines, range(32))
    assert tp.bounds == tuple((8 * t, 8 * t + 8) for t in range(32))
    for pos in (0, 3, len(ids) - 2, len(ids) - 1):  # dense, sparse, MTP, the non-layer tensors
        full = layer_scatter(plans[pos], ids[pos], cfg, engines)
        lay = tp.layers[pos]
        assert lay.classes == full.classes
        for k, pack in enumerate(full.packs):
            got: dict[str, int] = {}
            for seg in lay.of_class(k):
                for p in seg.pieces:
                    got[p.name] = got.get(p.name, 0) + p.nbytes
                    if p.rows is not None:  # experts, or rows of a large passthrough matrix
                        lo, hi = lay.splits[p.name][seg.sender]
                        assert lo <= p.rows[0] < p.rows[1] <= hi
                    else:
                        assert owner_in(lay.owners, p.name, k) == seg.sender
            assert got == {p.name: p.nbytes for p in pack.pieces}
    sent = tp.sent_bytes()
    received = tp.received_bytes()
    assert 0 <= sum(received.values()) - sum(sent) < 32 * len(ids) * 32 * 256
    # Greedy's bound per step: each class's pieces of a large entry placed apart (owners.Owner);
    # the embeddings, heads and eh_proj are split by rows over every sender.
    assert all(name not in lay.owners for lay in tp.layers for name in lay.splits)
    assert tp.layers[-1].splits.keys() == {"model.embed_tokens.weight", "lm_head.weight"}
    assert max(sent) - min(sent) < 2 * 2**30
    # EP=8: every rank its 32 experts, each in segments of its own (alignment and checksums)
    assert max(received.values()) - min(received.values()) < len(ids) * 32 * (256 + 8)
    assert math.isclose(max(received.values()) / 2**30, 90.28, abs_tol=0.01)


def test_a_senders_experts_leave_from_its_conversion_buffer():
    """32 senders into 4 x EP 8 (GLM-5), a sparse layer: each sender's largest segment (its experts,
    with the entries it owns for their class) lies last in its conversion buffer, as it travels, so
    it is direct: sent from there, never copied into the send buffer, which holds only the other
    segments. Where a piece of it is a tensor-parallel cut of an entry (attention's kv_b_proj for an
    engine of TP 8) it cannot lie there and is packed; one direct segment a sender at most."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.transfer.routes import transfer_plan

    cfg = PRESETS["glm-5"]
    ids = [3]  # a sparse layer
    plans = plans_for_model(cfg, "fp8", layer_ids=ids)
    engines = [None] * 32 + [lay for _ in range(4) for lay in EngineLayout.all_ranks(8, 1, True)]
    lay = transfer_plan(cfg, plans, ids, engines, range(32)).layers[0]
    directs = 0
    for t in range(32):
        mine = lay.of_sender(t)
        top = max(mine, key=lambda s: s.nbytes)
        assert any("experts" in p.name for p in top.pieces)
        packed = [s for s in mine if not s.direct]
        assert lay.send_nbytes[t] == sum(-(-s.nbytes // 256) * 256 for s in packed)
        if not top.direct:
            assert any(p.shard.kind != "replicated" for p in top.pieces), (t, top)
            continue
        directs += 1
        assert [s for s in mine if s.direct] == [top]
        assert top.conv_offset + top.data_nbytes == lay.local_plans[t].nbytes  # last in its buffer
        assert lay.send_nbytes[t] < top.nbytes  # the experts take no room there
    assert directs >= 24, directs
    # The whole model (docs/delta.md quotes it): the share of segment bytes sent from conversion buffers.
    ids = model_layer_ids(cfg) + [REST]
    tp = transfer_plan(cfg, plans_for_model(cfg, "fp8", layer_ids=ids), ids, engines, range(32))
    segs = [s for lay in tp.layers for s in lay.segments]
    share = sum(s.nbytes for s in segs if s.direct) / sum(s.nbytes for s in segs)
    assert math.isclose(share, 0.81, abs_tol=0.005), share


def test_a_sender_with_another_manifest_is_refused_before_anything_is_sent():
    results = launch(4, _rank, (2, "tp2", "manifest"), timeout_s=60)
    assert results[1][0] == "ManifestMismatch" and "differs from the leader's" in results[1][1], results
    assert results[0][0] == "ManifestMismatch" and "rank 1 refused the manifest" in results[0][1], results
    for r in (2, 3):
        assert results[r][0] == "UpdateAborted" and "rank 1 refused the manifest" in results[r][1], results


def test_expert_stacks_split_inside_experts_are_refused_naming_the_tensor():
    """Shard(1) expert stacks: no sender holds whole experts; every sender refuses at that
    layer before any gather, naming the tensor, and every engine rank stops there."""
    results = launch(4, _rank, (2, "tp2", "shard1"), timeout_s=60)
    for r in (0, 1):
        status, msg = results[r]
        assert status == "ValueError" and "model.layers.2.mlp.experts.w1: many senders need" in msg, results
    for r in (2, 3):
        assert results[r][0] == "UpdateAborted" and "(a sender) failed" in results[r][1], results


def test_bad_many_senders_arguments_are_refused():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer import HostSinkComm, Receiver, Sender

    engines = [None, None, EngineLayout(tp_size=2, tp_rank=0), EngineLayout(tp_size=2, tp_rank=1)]
    kw = dict(config=TINY_GLM5, device="cpu")
    link = lambda rank=0: HostSinkComm(rank=rank, size=4)  # noqa: E731
    with pytest.raises(ValueError, match="engines: no rank of the link receives"):
        Sender(HostSinkComm(size=2), 0, senders=[0, 1], **kw)
    with pytest.raises(ValueError, match=r"src: expected one of the senders \[0, 1\]"):
        Sender(link(), 2, senders=[0, 1], engines=engines, **kw)
    with pytest.raises(ValueError, match=r"this process \(link rank 3\) is not one of the senders"):
        Sender(link(3), 0, senders=[0, 1], engines=engines, **kw)
    with pytest.raises(ValueError, match=r"engines\[1\]: expected None \(a sender\)"):
        Sender(link(), 0, senders=[0, 1], engines=[None, *engines[2:], None], **kw)
    with pytest.raises(ValueError, match=r"engines: expected one entry per rank of the link \(4\), got 3"):
        Sender(link(), 0, senders=[0, 1], engines=engines[:3], **kw)
    receiver = Receiver(link(2), 0, senders=[0, 1], engines=engines, layout=engines[2], **kw)
    with pytest.raises(TypeError, match="receive_layers: with several senders an entry arrives in pieces"):
        receiver.receive_layers()
    with pytest.raises(ValueError, match=r"ring: expected an integer in \[2, \d+\] buffers"):
        Receiver(link(2), 0, senders=[0, 1], engines=engines, layout=engines[2], ring=1, **kw)


def test_a_sender_queues_the_next_layer_before_it_waits_for_a_vote():
    """A sender's only host wait per layer, reading the previous layer's vote, comes after it
    queued the next layer's messages, so the link always holds a layer while the host waits:
    send 0, send 1, read 0, send 2, read 1, ..., then the last layer's vote and COMPLETE's.
    (Sender 1 of 2 into TP=2 through the stand-in link, on the CPU; it leads, as a stand-in
    has no peers.)"""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.testing import synthetic_layer
    from glm_fp8.transfer import HostSinkComm, Sender

    config = {**TINY_GLM5, "num_nextn_predict_layers": 0}
    n = config["num_hidden_layers"]
    sink = HostSinkComm(rank=1, size=4)
    engines = [None, None, *EngineLayout.all_ranks(2, 1, False)]
    sender = Sender(sink, 1, config=config, engines=engines, senders=[0, 1], device="cpu")
    events = []
    exchange, read = sink.exchange, sender.step_votes.read

    def logged_exchange(sends, recvs):
        events.append(f"send {sum(e.startswith('send') for e in events)}")
        exchange(sends, recvs)

    def logged_read(step):
        events.append(f"read {step}")
        return read(step)

    sink.exchange, sender.step_votes.read = logged_exchange, logged_read
    sender.send_model((i, synthetic_layer(config, i)) for i in range(n))
    want = ["send 0"] + [e for k in range(1, n) for e in (f"send {k}", f"read {k - 1}")]
    assert events == want + [f"read {n - 1}", f"read {n}"]


@pytest.mark.slow
def test_a_refused_layer_stops_every_rank_and_the_next_update_lands():
    """An engine rank refuses layer 2 at its checksum vote: every rank stops at that vote (the
    senders raise ReceiverRefused, the other engine rank UpdateAborted, both naming rank 3), no
    collective is left half matched, and the next update on the same group lands every byte
    (checked in ``_rank``)."""
    results = launch(4, _rank, (2, "tp2", "checksum"), timeout_s=60)
    assert all(status == "ok" for status, _ in results.values()), results
    first = {r: v for r, (_, v) in results.items()}
    assert first[3][0] == "UpdateAborted" and "checksum" in first[3][1], first[3]
    for r in (0, 1, 2):
        assert first[r][0] == ("ReceiverRefused" if r < 2 else "UpdateAborted"), (r, first[r])
        assert "rank 3 " in first[r][1] and "checksum" in first[r][1], (r, first[r])

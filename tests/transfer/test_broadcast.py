"""Multi-process broadcast over gloo (CPU) or NCCL: every received byte equals the reference,
and every fault ends the update with an error on every rank within the timeout.

Ranks run in spawned processes (glm_fp8.cli.demo.launch); rank 0 sends, the others receive.
"""

import os
import time

import pytest
import torch

from glm_fp8.cli.demo import demo_rank
from glm_fp8.model.presets import SMALL_GLM5
from glm_fp8.testing import launch, sent_layer_mismatches, synthetic_layer
from glm_fp8.transfer.link import Link

CONFIG = {**SMALL_GLM5, "num_hidden_layers": 3}
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where receivers land the weights


def _ok(results):
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 3])
def test_every_received_byte_matches_the_reference(world):
    results = launch(world, demo_rank, (SMALL_GLM5, 3, 2, "fp8"), timeout_s=120)
    _ok(results)
    for r in range(1, world):
        assert results[r][1]["bytes_checked"] > 0 and results[r][1]["bytes_mismatched"] == 0


def test_ring_of_one_and_the_bf16_wire_format():
    _ok(launch(2, demo_rank, (SMALL_GLM5, 2, 1, "fp8"), timeout_s=120))
    results = launch(2, demo_rank, (SMALL_GLM5, 2, 2, "bf16"), timeout_s=120)
    _ok(results)
    assert results[1][1]["bytes_mismatched"] == 0


def _load_into_rank(rank, world, wire):
    """Receivers land the update in fp8 parameters (wire 'bf16': they quantize on receive)."""
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.transfer import Receiver, Sender

    if rank == 0:
        Sender(None, 0, config=CONFIG, wire=wire).send_model(
            (i, synthetic_layer(CONFIG, i)) for i in range(3)
        )
        return None
    fp8_plans = [plan_from_config(CONFIG, i) for i in range(3)]
    params = {}
    for i, p in enumerate(fp8_plans):
        for n, v in p.views(torch.zeros(p.nbytes, dtype=torch.uint8)):
            filler = torch.full_like(v.contiguous().view(torch.uint8), 7, device=DEV)
            params[f"model.layers.{i}.{n}"] = filler.view(v.dtype)
    Receiver(None, 0, config=CONFIG, wire=wire).load_into(params)
    for i, plan in enumerate(fp8_plans):
        layer = {k.removeprefix(f"model.layers.{i}."): t for k, t in synthetic_layer(CONFIG, i).items()}
        for name, ref in convert_layer_ref(layer, i, plan).items():
            got = params[name].cpu()
            assert torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name
    return len(params)


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_load_into_parameters(wire):
    results = launch(2, _load_into_rank, (wire,), timeout_s=120)
    _ok(results)
    assert results[1][1] > 0


def _mismatch_rank(rank, world):
    from glm_fp8.transfer import Receiver, Sender

    if rank == 0:
        Sender(None, 0, config=CONFIG).send_model((i, synthetic_layer(CONFIG, i)) for i in range(3))
    elif rank == 1:
        list(Receiver(None, 0, config={**CONFIG, "n_routed_experts": 12}).receive())
    else:
        list(Receiver(None, 0, config=CONFIG).receive())


def test_manifest_mismatch_stops_every_rank_before_any_layer():
    results = launch(3, _mismatch_rank, timeout_s=60)
    assert results[0][0] == "ManifestMismatch" and "refused the manifest" in results[0][1]
    assert results[1][0] == "ManifestMismatch" and "mlp.router" not in results[1][1]
    assert "mlp.gate.weight" in results[1][1] or "entry" in results[1][1]
    assert results[2][0] == "UpdateAborted" and "rank 1 refused the manifest" in results[2][1]


def _nan_rank(rank, world):
    from glm_fp8.transfer import Receiver, Sender

    if rank == 0:

        def layers():
            for i in range(3):
                sd = synthetic_layer(CONFIG, i)
                if i == 1:
                    sd["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
                yield i, sd

        Sender(None, 0, config=CONFIG).send_model(layers())
    else:
        return sum(1 for _ in Receiver(None, 0, config=CONFIG).receive())


def test_nan_weights_abort_the_update_on_every_rank():
    results = launch(3, _nan_rank, timeout_s=60)
    assert results[0][0] == "NonFiniteError" and "self_attn.o_proj.weight" in results[0][1]
    for r in (1, 2):
        status, msg = results[r]
        assert status == "UpdateAborted" and "rank 0 (a sender) failed" in msg and "(layer 1)" in msg


def _dying_sender_rank(rank, world, how):
    from glm_fp8.transfer import Receiver, Sender

    if rank == 0:

        def layers():
            yield 0, synthetic_layer(CONFIG, 0)
            if how == "killed":
                os._exit(3)  # a peer that dies mid-update, no goodbye
            time.sleep(12)  # longer than the 6 s process-group timeout
            yield 1, synthetic_layer(CONFIG, 1)

        Sender(None, 0, config=CONFIG).send_model(layers())
    else:
        t0 = time.monotonic()
        try:
            list(Receiver(None, 0, config=CONFIG).receive())
        finally:
            print(f"receiver {rank} ended after {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("how", ["killed", "timeout"])
def test_dead_or_silent_sender_ends_receivers_with_an_error(how):
    t0 = time.monotonic()
    results = launch(3, _dying_sender_rank, (how,), timeout_s=6)
    for r in (1, 2):
        # LinkLost, an UpdateAborted: the dead sender named (it served the store); a silent one,
        # alive and beating, ends at the transport's timeout, published as the link's fault
        assert results[r][0] == "LinkLost", results[r]
        said = "link rank 0 is lost" if how == "killed" else "the link failed: its transport failed"
        assert said in results[r][1], results[r]
    assert time.monotonic() - t0 < 60  # nothing hangs past the timeout (plus process start)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream ordering needs a GPU (run on the H200)")
@pytest.mark.parametrize("ring", [1, 2])
def test_streams_single_gpu_with_poisoned_released_inputs(ring):
    """Each layer's inputs are overwritten with NaN on the caller's stream as soon as the
    broadcaster asks for the next layer; every byte that reached the wire must still be right
    (no read after release, no slot reused before its send finished)."""
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.transfer import HostSinkComm, Sender

    config = {**SMALL_GLM5, "num_hidden_layers": 5}
    sink = HostSinkComm(keep=True)
    sender = Sender(sink, 0, config=config, ring=ring, device="cuda")

    def layers():
        prev = None
        for i in range(5):
            if prev is not None:
                for t in prev.values():
                    t.fill_(float("nan"))
            prev = {k: v.cuda() for k, v in synthetic_layer(config, i).items()}
            yield i, prev

    sender.send_model(layers())
    torch.cuda.synchronize()
    msgs = sink.sent[2:]  # after the manifest length and bytes: (header, buffer) per layer
    assert len(msgs) == 2 * 5 + 1 and msgs[-1][1].item() == 2  # header [MAGIC, COMPLETE, ...]
    for i in range(5):
        plan = plan_from_config(config, i)
        layer = {k.removeprefix(f"model.layers.{i}."): t for k, t in synthetic_layer(config, i).items()}
        want = convert_layer_ref(layer, i, plan)
        for name, view in plan.views(msgs[2 * i + 1]):
            ref = want[f"model.layers.{i}.{name}"]
            assert torch.equal(view.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name


def _many_senders_sink(fault: str | None):
    """Sender 1 of 2 into TP=2 on the GPU, its messages kept by a HostSinkComm; the caller
    overwrites each layer's inputs with NaN as soon as the sender asks for the next one."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.model.presets import TINY_GLM5
    from glm_fp8.transfer import HostSinkComm, Sender

    config = {**TINY_GLM5, "num_nextn_predict_layers": 0}
    n = config["num_hidden_layers"]
    sink = HostSinkComm(keep=True, rank=1, size=4)
    engines = [None, None, *EngineLayout.all_ranks(2, 1, False)]
    # src=1: the sender leads, as a stand-in link has no peers to take the manifest from it
    sender = Sender(sink, 1, config=config, engines=engines, senders=[0, 1], device="cuda")

    def layers():
        prev = None
        for i in range(n):
            if prev is not None:
                for t in prev.values():
                    t.fill_(float("nan"))
            prev = {k: v.cuda() for k, v in synthetic_layer(config, i).items()}
            if fault == "nan" and i == 2:  # one of sender 1's own experts (torch.chunk: experts 2, 3)
                prev["model.layers.2.mlp.experts.w2"][3, 1, 7] = float("inf")
            yield i, prev

    return config, n, sink, sender, layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream ordering needs a GPU (run on the H200)")
def test_many_senders_streams_single_gpu_with_poisoned_released_inputs():
    """One of many senders on the GPU: every message of every layer equals the reference cut by
    its pieces' shards and rows, though each layer's inputs turn to NaN once the next is asked
    for (no read after release, and the finite check, decided on the device and voted with the
    layer's messages, sees the layer as converted); a header per layer, then COMPLETE, close the
    update."""
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import layer_prefix
    from glm_fp8.transfer.wire import COMPLETE, DATA, MAGIC

    config, n, sink, sender, layers = _many_senders_sink(None)
    sender.send_model(layers())
    torch.cuda.synchronize()
    msgs = iter(sink.sent[2:])  # after the prelude and the manifest
    checked = 0
    for i, lay in enumerate(sender.routes.layers):
        assert next(msgs)[:5].tolist() == [MAGIC, DATA, i, i, lay.wire_nbytes]
        layer = {k.removeprefix(layer_prefix(i)): t for k, t in synthetic_layer(config, i).items()}
        ref = convert_layer_ref(layer, i, plan_from_config(config, i))
        got, _, bad = sent_layer_mismatches(lay, sender.me, msgs, ref)
        assert not bad, (i, bad)
        checked += got
    assert next(msgs)[:4].tolist() == [MAGIC, COMPLETE, -1, n] and next(msgs, None) is None
    assert checked > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200)")
def test_many_senders_non_finite_share_is_raised_by_its_sender_on_the_gpu():
    """An Inf in one of the sender's own experts: its finite check, decided on the device, is the
    sender's vote on that layer's messages; that vote stops the update (read one step late), and
    the sender raises NonFiniteError naming the entry."""
    from glm_fp8 import NonFiniteError

    _, _, sink, sender, layers = _many_senders_sink("nan")
    with pytest.raises(NonFiniteError, match=r"model\.layers\.2\.mlp\.experts"):
        sender.send_model(layers())


class _Recorder(Link):
    """A sender's stand-in link that keeps, on the host, what it broadcast and what it sent to
    each peer, for ``_Replay`` to hand an engine rank."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.broadcasts: list[torch.Tensor] = []
        self.sent: dict[int, list[torch.Tensor]] = {}

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcasts.append(tensor.cpu().clone())

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        return None

    def exchange(self, sends, recvs) -> None:
        for t, peer in sends:
            self.sent.setdefault(peer, []).append(t.cpu().clone())

    def make_groups(self, groups) -> None:
        return None

    def group_all_reduce_max(self, tensor: torch.Tensor, ranks) -> None:
        return None


class _Replay(Link):
    """An engine rank's stand-in link: broadcasts come from the leader's recording, each
    sender's messages from its own, copied onto the device on the current stream."""

    def __init__(self, rank: int, recorders: dict[int, _Recorder], src: int):
        self.rank, self.size = rank, recorders[src].size
        self.broadcasts = iter(recorders[src].broadcasts)
        self.msgs = {s: iter(r.sent.get(rank, [])) for s, r in recorders.items()}

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        tensor.copy_(next(self.broadcasts).to(tensor.device), non_blocking=True)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        return None

    def exchange(self, sends, recvs) -> None:
        for t, peer in recvs:
            t.copy_(next(self.msgs[peer]).to(t.device), non_blocking=True)

    def make_groups(self, groups) -> None:
        return None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream ordering needs a GPU (run on the H200)")
def test_many_senders_engine_rank_pipelines_on_the_gpu_behind_a_slow_consumer(monkeypatch):
    """An engine rank of many senders on the GPU (its link replays what two senders sent it):
    every parameter equals the reference cut by its shard, bit for bit, though its receive ring
    starts as 0xFF and every landing first spins the GPU for a while, so that the next layers
    arrive while the consumer still reads a slot: a layer is handed out only once its own
    bytes landed, and a slot is received into only after the consumer's copies from it; the
    parameters outside the update (embeddings, norm, head) are left as they were."""
    import glm_fp8.transfer.land as land_mod
    from glm_fp8.engine import EngineLayout, engine_params
    from glm_fp8.model.presets import TINY_GLM5
    from glm_fp8.testing import reference_engine_params
    from glm_fp8.transfer import Receiver, Sender

    config = {**TINY_GLM5, "num_nextn_predict_layers": 0}
    n = config["num_hidden_layers"]
    engines = [None, None, *EngineLayout.all_ranks(2, 1, False)]
    kw = dict(config=config, engines=engines, senders=[0, 1], device="cuda")
    recorders = {}
    for t in (0, 1):  # each leads its own recording: a stand-in link has no peers
        recorders[t] = _Recorder(t, len(engines))
        Sender(recorders[t], t, **kw).send_model(
            (i, {k: v.cuda() for k, v in synthetic_layer(config, i).items()}) for i in range(n)
        )
    layout = engines[2]
    receiver = Receiver(_Replay(2, recorders, 0), 0, layout=layout, **kw)
    for i in range(receiver.ring.size):
        receiver.ring.slot(i)[0].fill_(0xFF)
    params = {}
    for name, p in engine_params(config, layout).items():
        params[name] = torch.empty(p.shape, dtype=p.dtype, device="cuda")
        params[name].view(torch.uint8).fill_(0x5A)
    land = land_mod.land_piece

    def slow_land(*args, **kwargs):
        torch.cuda._sleep(2_000_000)  # about a millisecond of GPU time before each piece lands
        land(*args, **kwargs)

    monkeypatch.setattr(land_mod, "land_piece", slow_land)
    receiver.load_into(params)
    want = reference_engine_params(config, layout, list(range(n)))
    assert set(want) == {name for name in params if name.startswith("model.layers.")}
    for name, ref in want.items():
        got = params[name].cpu()
        assert torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name
    for name in set(params) - set(want):  # the non-layer tensors: not part of this update
        assert bool((params[name].view(torch.uint8) == 0x5A).all()), name

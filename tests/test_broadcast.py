"""Multi-process broadcast over gloo (CPU) or NCCL: every received byte equals the reference,
and every fault ends the update with an error on every rank within the timeout.

Ranks run in spawned processes (glm_fp8.demo.launch); rank 0 sends, the others receive.
"""

import os
import time

import pytest
import torch

from glm_fp8.demo import demo_rank
from glm_fp8.models import SMALL_GLM5
from glm_fp8.testing import launch, synthetic_layer

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


def test_ring_of_one_and_bf16_mode():
    _ok(launch(2, demo_rank, (SMALL_GLM5, 2, 1, "fp8"), timeout_s=120))
    results = launch(2, demo_rank, (SMALL_GLM5, 2, 2, "bf16"), timeout_s=120)
    _ok(results)
    assert results[1][1]["bytes_mismatched"] == 0


def _load_into_rank(rank, world, mode):
    """Receivers land the update in fp8 parameters (bf16 mode quantizes on receive)."""
    from glm_fp8.plan import plan_from_config
    from glm_fp8.reference import convert_layer_ref
    from glm_fp8.transfer import Broadcaster, Receiver

    if rank == 0:
        Broadcaster(None, 0, config=CONFIG, mode=mode).broadcast_model(
            (i, synthetic_layer(CONFIG, i)) for i in range(3)
        )
        return None
    fp8_plans = [plan_from_config(CONFIG, i) for i in range(3)]
    params = {}
    for i, p in enumerate(fp8_plans):
        for n, v in p.views(torch.zeros(p.nbytes, dtype=torch.uint8)):
            filler = torch.full_like(v.contiguous().view(torch.uint8), 7, device=DEV)
            params[f"model.layers.{i}.{n}"] = filler.view(v.dtype)
    Receiver(None, 0, config=CONFIG, mode=mode).load_into(params)
    for i, plan in enumerate(fp8_plans):
        layer = {k.removeprefix(f"model.layers.{i}."): t for k, t in synthetic_layer(CONFIG, i).items()}
        for name, ref in convert_layer_ref(layer, i, plan).items():
            got = params[name].cpu()
            assert torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name
    return len(params)


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_load_into_parameters(mode):
    results = launch(2, _load_into_rank, (mode,), timeout_s=120)
    _ok(results)
    assert results[1][1] > 0


def _mismatch_rank(rank, world):
    from glm_fp8.transfer import Broadcaster, Receiver

    if rank == 0:
        Broadcaster(None, 0, config=CONFIG).broadcast_model((i, synthetic_layer(CONFIG, i)) for i in range(3))
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
    from glm_fp8.transfer import Broadcaster, Receiver

    if rank == 0:

        def layers():
            for i in range(3):
                sd = synthetic_layer(CONFIG, i)
                if i == 1:
                    sd["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
                yield i, sd

        Broadcaster(None, 0, config=CONFIG).broadcast_model(layers())
    else:
        return sum(1 for _ in Receiver(None, 0, config=CONFIG).receive())


def test_nan_weights_abort_the_update_on_every_rank():
    results = launch(3, _nan_rank, timeout_s=60)
    assert results[0][0] == "NonFiniteError" and "self_attn.o_proj.weight" in results[0][1]
    for r in (1, 2):
        assert results[r][0] == "UpdateAborted" and "aborted the update before layer 1" in results[r][1]


def _dying_sender_rank(rank, world, how):
    from glm_fp8.transfer import Broadcaster, Receiver

    if rank == 0:

        def layers():
            yield 0, synthetic_layer(CONFIG, 0)
            if how == "killed":
                os._exit(3)  # a peer that dies mid-update, no goodbye
            time.sleep(12)  # longer than the 6 s process-group timeout
            yield 1, synthetic_layer(CONFIG, 1)

        Broadcaster(None, 0, config=CONFIG).broadcast_model(layers())
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
        assert results[r][0] == "UpdateAborted", results[r]
    assert time.monotonic() - t0 < 60  # nothing hangs past the timeout (plus process start)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream ordering needs a GPU (run on the H200)")
@pytest.mark.parametrize("ring", [1, 2])
def test_streams_single_gpu_with_poisoned_released_inputs(ring):
    """Each layer's inputs are overwritten with NaN on the caller's stream as soon as the
    broadcaster asks for the next layer; every byte that reached the wire must still be right
    (no read after release, no slot reused before its send finished)."""
    from glm_fp8.plan import plan_from_config
    from glm_fp8.reference import convert_layer_ref
    from glm_fp8.transfer import Broadcaster, HostSinkComm

    config = {**SMALL_GLM5, "num_hidden_layers": 5}
    sink = HostSinkComm(keep=True)
    sender = Broadcaster(sink, 0, config=config, ring=ring, device="cuda")

    def layers():
        prev = None
        for i in range(5):
            if prev is not None:
                for t in prev.values():
                    t.fill_(float("nan"))
            prev = {k: v.cuda() for k, v in synthetic_layer(config, i).items()}
            yield i, prev

    sender.broadcast_model(layers())
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

"""A delta sender's layers captured as CUDA graphs and replayed (glm_fp8.transfer.graphs,
docs/delta.md#graphs): ``LayerGraphs``' rules (run, then capture, then replay while the key holds;
a new key runs as it is; a kernel that cannot be captured turns the graphs off and runs as it is),
and a sender whose trainer tensors stay where they are, updated in place step after step, into
two engine ranks over gloo: every engine byte equals the reference after every update, a tensor
that moved is read where it now is, and a NaN written in place into a replayed layer stops the
update naming it. On the GPU (bench/gpu_run.sh's GPU_TESTS) the graphs are captured and replayed;
on the CPU they are off and the same updates run kernel by kernel."""

import pytest
import torch

from glm_fp8.engine import EngineLayout
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch, moved_layer, reference_engine_params
from glm_fp8.transfer.graphs import LayerGraphs, tensor_key, tensors_key

CUDA = torch.cuda.is_available()
CONFIG = {**TINY_GLM5, "num_nextn_predict_layers": 0}
IDS = list(range(CONFIG["num_hidden_layers"]))
MOVED = 6  # at this update one tensor of layer MOVED_LAYER is a new tensor (another address)
NAN = 7  # a NaN written in place into layer NAN_LAYER
MOVED_LAYER, NAN_LAYER = 1, 2


def test_graphs_are_off_on_the_cpu():
    graphs = LayerGraphs(torch.device("cpu"))
    calls = []
    for _ in range(3):
        assert graphs.run(0, ("same",), lambda: calls.append(1) or len(calls)) == len(calls)
    assert not graphs.enabled and len(calls) == 3 and graphs.captures == graphs.replays == 0


def test_tensor_key_tells_a_view_from_its_base():
    x = torch.arange(12.0).view(3, 4)
    assert tensor_key(x) == tensor_key(x.view(3, 4))
    assert tensor_key(x[1:]) != tensor_key(x[:2])  # another address
    assert tensor_key(x.t()) != tensor_key(x.view(4, 3))  # another layout
    assert tensor_key(x.to(torch.float64)) != tensor_key(x)
    assert tensors_key([("b", x), ("a", None)]) == tensors_key([("a", None), ("b", x)])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU (bench/gpu_run.sh runs this on the H200)")
def test_graphs_run_then_capture_then_replay():
    graphs = LayerGraphs(torch.device("cuda"))
    src = torch.randn(1000, device="cuda")
    out = torch.empty_like(src)
    calls = []

    def work():
        calls.append(1)
        torch.mul(src, 2, out=out)
        return out.sum()  # allocated in the graph's pool, rewritten by each replay

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        total = graphs.run(0, ("k", tensor_key(src)), work)  # runs
        assert graphs.run(0, ("k", tensor_key(src)), work) is not total  # captured, then replayed
        assert graphs.captures == 1 and len(calls) == 2
        captured = graphs.run(0, ("k", tensor_key(src)), work)
        src.add_(1)  # in place: the replay reads the new values
        again = graphs.run(0, ("k", tensor_key(src)), work)
        assert again is captured and len(calls) == 2 and graphs.replays == 2
        stream.synchronize()
        assert torch.equal(out, src * 2) and torch.allclose(again, (src * 2).sum())
        other = torch.randn(1000, device="cuda")
        graphs.run(0, ("k", tensor_key(other)), work)  # another key: run as it is
        assert len(calls) == 3 and graphs.captures == 1

        def not_capturable():
            return int(src.sum().item())  # a host read

        want = int(src.sum().item())
        assert graphs.run(1, ("x",), not_capturable) == want
        assert graphs.run(1, ("x",), not_capturable) == want  # the capture fails: run as it is
    assert not graphs.enabled and graphs.failed is not None
    # the process's random ops on the GPU still work (the trainer's dropout, its init)
    assert torch.randn(8, device="cuda").isfinite().all()
    assert graphs.run(0, ("k", tensor_key(src)), work) is not captured  # off for good


def _layer(step: int, layer_idx: int, nan: bool = False) -> dict[str, torch.Tensor]:
    sd = moved_layer(CONFIG, layer_idx, step)
    if nan and layer_idx == NAN_LAYER:
        sd[f"model.layers.{layer_idx}.self_attn.o_proj.weight"][3, 5] = float("nan")
    return sd


def _rank(rank, world, kept):
    from glm_fp8.transfer import Receiver, Sender
    from glm_fp8.transfer.options import DeltaOptions

    dev = "cuda" if CUDA else "cpu"
    if CUDA:  # every rank on the one GPU (gloo stages point-to-point messages through the host)
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    layouts = EngineLayout.all_ranks(2)
    kw = dict(config=CONFIG, layer_ids=IDS, engines=[None, *layouts], device=dev)
    out = []
    if rank == 0:
        sender = Sender(None, 0, delta=DeltaOptions(graphs=True, kept=kept), **kw)
        # The trainer's tensors, allocated once and written in place at every step, as an
        # optimizer does: the graphs read them where they are.
        held = {i: {k: t.to(dev) for k, t in _layer(0, i).items()} for i in IDS}
        for step in range(NAN + 2):
            for i in IDS:
                for k, t in _layer(step, i, nan=step == NAN).items():
                    held[i][k].copy_(t)
            if step == MOVED:  # the trainer hands a new tensor (another address) for one weight
                k = next(k for k in held[MOVED_LAYER] if k.endswith("o_proj.weight"))
                held[MOVED_LAYER][k] = held[MOVED_LAYER][k].clone()
            try:
                sender.send_model((i, held[i]) for i in IDS)
                out.append(("ok", sender.graphs.captures, sender.graphs.replays))
            except Exception as exc:  # noqa: BLE001 - compared by the test
                out.append((type(exc).__name__, str(exc)))
        return out, sender.graphs.enabled, sender.graphs.failed
    layout = layouts[rank - 1]
    recv = Receiver(None, 0, layout=layout, delta=True, **kw)
    want = reference_engine_params(CONFIG, layout, IDS, layer=lambda i: _layer(0, i))
    params = {n: torch.empty(w.shape, dtype=w.dtype, device=dev) for n, w in want.items()}
    for p in params.values():
        p.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype: unwritten bytes show
    for step in range(NAN + 2):
        try:
            recv.load_into(params)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out.append((type(exc).__name__, str(exc)))
            continue
        want = reference_engine_params(CONFIG, layout, IDS, layer=lambda i, s=step: _layer(s, i))
        same = {
            n: torch.equal(params[n].cpu().view(torch.uint8), w.view(torch.uint8)) for n, w in want.items()
        }
        out.append(("ok", [n for n, ok in same.items() if not ok]))
    return out, None, None


@pytest.mark.slow
@pytest.mark.parametrize("kept", ["gpu", "host"])  # on a GPU, "host": the kernels in host memory, captured
def test_replayed_layers_land_exactly_the_reference_bytes(kept):
    results = launch(3, _rank, (kept,), timeout_s=180)
    assert all(status == "ok" for status, _ in results.values()), results
    sender, enabled, failed = results[0][1]
    assert failed is None
    for r in (1, 2):
        engine = results[r][1][0]
        for step, got in enumerate(engine):
            if step == NAN:
                assert got[0] == "UpdateAborted" and f"layer {NAN_LAYER}" in got[1], got
            else:
                assert got == ("ok", []), (step, got)
    assert sender[NAN][0] == "NonFiniteError" and "o_proj" in sender[NAN][1], sender[NAN]
    ok = [s for s in sender if s[0] == "ok"]
    assert len(ok) == NAN + 1
    if not CUDA:
        assert not enabled and ok[-1][1:] == (0, 0)
        return
    n = len(IDS)
    assert enabled
    # update 0 is dense, 1 the first delta (a new key), 2 captures each layer, then they replay
    assert [s[1:] for s in sender[2:6]] == [(n, 0), (n, n), (n, 2 * n), (n, 3 * n)], sender
    # the moved tensor: its layer runs as it is (a new key), every other layer replays
    assert sender[MOVED][1:] == (n, 4 * n - 1), sender

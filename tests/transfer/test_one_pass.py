"""One pass per layer on the sender (issue #31).

Invariant: a layer that enters ``Sender.send_model`` has its names stripped
(``strip_layer``), its plan adapted to its trainer layout (``adapt_plan``) and its keys checked
(``check_adapted_keys``) exactly once on the sender, whatever the path below (one sender's full
gather, a sharded layer's "chunked" and "quantize_then_gather" gathers, one of many senders); the
inner calls take the adapted plan and do not re-check. And the bytes that leave the sender still
equal the reference conversion.

Everything runs in this process through the stand-in link (``HostSinkComm`` keeps each message);
the sharded layers are DTensors on a one-rank gloo mesh.
"""

import re
import sys
from collections import Counter

import pytest
import torch

import glm_fp8.kernels.convert
import glm_fp8.model.trainer_layouts
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.families import HF, PRIME_RL
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.testing import sent_layer_mismatches, sharded_layer, synthetic_layer
from glm_fp8.transfer import HostSinkComm, Sender

CONFIG = {**TINY_GLM5, "num_nextn_predict_layers": 0}
IDS = [1, 2]  # a dense layer and a sparse one (shared and routed experts)
COUNTED = [
    (glm_fp8.model.trainer_layouts, "strip_layer", lambda a, kw: layer_prefix(a[1])),
    (glm_fp8.model.trainer_layouts, "adapt_plan", lambda a, kw: kw.get("prefix", "")),
    (glm_fp8.kernels.convert, "check_adapted_keys", lambda a, kw: a[2]),
]


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of each counted function's calls by (function, layer prefix). Modules import these
    by name, so every glm_fp8 module attribute bound to the original is replaced by the counter."""
    counts: Counter = Counter()
    for home, name, layer_of in COUNTED:
        original = getattr(home, name)

        def counted(*args, _f=original, _name=name, _layer_of=layer_of, **kwargs):
            counts[_name, _layer_of(args, kwargs)] += 1
            return _f(*args, **kwargs)

        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("glm_fp8") and getattr(mod, name, None) is original:
                monkeypatch.setattr(mod, name, counted)
    return counts


def _once_per_layer(counts: Counter) -> None:
    want = {(name, layer_prefix(i)): 1 for _, name, _ in COUNTED for i in IDS}
    assert dict(counts) == want


def _reference(i: int, bias_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    held = synthetic_layer(CONFIG, i, bias_dtype=bias_dtype)  # every layout holds the same values
    layer = {k.removeprefix(layer_prefix(i)): t for k, t in held.items()}
    return convert_layer_ref(layer, i, plan_from_config(CONFIG, i))


def _check_single_sender_bytes(sink: HostSinkComm, bias_dtype: torch.dtype | None = None) -> None:
    msgs = sink.sent[2:]  # after the manifest's length and bytes: (header, buffer) per layer, COMPLETE
    assert len(msgs) == 2 * len(IDS) + 1
    for pos, i in enumerate(IDS):
        want = _reference(i, bias_dtype)
        for name, view in plan_from_config(CONFIG, i).views(msgs[2 * pos + 1]):
            ref = want[layer_prefix(i) + name]
            assert torch.equal(view.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("layout", [PRIME_RL, HF])
def test_one_sender_full_gather_adapts_and_checks_each_layer_once(calls, layout):
    """Plain tensors (gathered whole), in prime-rl's names and in transformers' (a relayout)."""
    sink = HostSinkComm(keep=True)
    sender = Sender(sink, 0, config=CONFIG, layer_ids=IDS, device="cpu")
    calls.clear()  # the constructor's plans are not the layers' pass
    sender.send_model((i, synthetic_layer(CONFIG, i, layout=layout)) for i in IDS)
    _once_per_layer(calls)
    _check_single_sender_bytes(sink, torch.float32 if layout == HF else None)  # transformers' fp32 bias


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group in this process and a CPU mesh on it (DTensors need one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.arange(1))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gather", ["chunked", "quantize_then_gather"])
def test_sharded_gathers_adapt_and_check_each_layer_once(calls, one_rank_mesh, gather):
    """DTensor layers collected piece by piece: the whole layer is checked once, then the rest
    converted and the expert stacks quantized chunk by chunk (or where held) without a re-check."""
    sink = HostSinkComm(keep=True)
    sender = Sender(sink, 0, config=CONFIG, layer_ids=IDS, gather=gather, chunk_experts=3, device="cpu")
    calls.clear()
    sender.send_model((i, sharded_layer(CONFIG, i, one_rank_mesh)) for i in IDS)
    _once_per_layer(calls)
    _check_single_sender_bytes(sink)


def test_one_of_many_senders_adapts_and_checks_each_layer_once(calls):
    """Sender 1 of 2 into TP=2 (it leads, as a stand-in link has no peers): its per-sender plan is
    cut from the adapted one, its share converted without a second adaptation or key check; every
    piece it sends equals the reference cut by the piece's rows and shard."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer.wire import COMPLETE, DATA, MAGIC

    sink = HostSinkComm(keep=True, rank=1, size=4)
    engines = [None, None, *EngineLayout.all_ranks(2, 1, False)]
    sender = Sender(sink, 1, config=CONFIG, layer_ids=IDS, engines=engines, senders=[0, 1], device="cpu")
    calls.clear()
    sender.send_model((i, synthetic_layer(CONFIG, i)) for i in IDS)
    _once_per_layer(calls)
    msgs = iter(sink.sent[2:])  # after the prelude and the manifest
    checked = 0
    for pos, (i, lay) in enumerate(zip(IDS, sender.routes.layers)):
        assert next(msgs)[:5].tolist() == [MAGIC, DATA, i, pos, lay.wire_nbytes]
        ref = _reference(i)
        got, _, bad = sent_layer_mismatches(lay, sender.me, msgs, ref)
        assert not bad, (i, bad)
        checked += got
    assert next(msgs)[:4].tolist() == [MAGIC, COMPLETE, -1, len(IDS)] and next(msgs, None) is None
    assert checked > 0


def test_many_senders_check_every_sources_dtype_before_any_gather():
    """The one check of a layer on each of many senders covers every source's dtype, not only
    those of the entries the sender owns: a sender refuses an integer norm that only the other
    sender converts, before any gather, so that all senders refuse alike."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer.owners import converters

    engines = [None, None, *EngineLayout.all_ranks(2, 1, False)]

    def sender(me):
        return Sender(
            HostSinkComm(rank=me, size=4),
            me,
            config=CONFIG,
            layer_ids=IDS,
            engines=engines,
            senders=[0, 1],
            device="cpu",
        )

    owners = sender(0).routes.layers[IDS.index(2)].owners
    norm = next(n for n in sorted(owners) if n.endswith("norm.weight") and len(converters(owners, n)) == 1)
    (other,) = converters(owners, norm)
    me = 1 - other  # this sender does not convert the norm, yet refuses it

    def layers():
        for i in IDS:
            sd = synthetic_layer(CONFIG, i)
            if i == 2:
                sd[norm] = torch.ones(sd[norm].shape, dtype=torch.int64)
            yield i, sd

    with pytest.raises(TypeError, match=re.escape(norm) + ": expected a floating dtype"):
        sender(me).send_model(layers())


@pytest.mark.parametrize("enabled", [True, False])
def test_an_update_pauses_the_cycle_collector_and_restores_it(enabled):
    """``send_model`` runs with Python's cycle collector off (a full collection stalls the host
    for tens of ms) and leaves it as it found it, after an error too."""
    import gc

    from glm_fp8.transfer.sender import cycle_collector_paused

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError, match="inside"), cycle_collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_segment_sent_from_inside_the_conversion_buffer_is_the_reference():
    """Sender 1 of 3 into a server of EP 2 and one of TP 2: its largest segment of a layer (the
    experts' class, with the entries it owns for that class) lies last in its conversion buffer,
    after entries it sends to other classes (``Segment.conv_offset`` > 0), its plan reordered for
    it in the sparse layer, and leaves from there (direct); every piece it sends, that segment's
    included, equals the reference."""
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer.owners import sender_plan
    from glm_fp8.transfer.wire import COMPLETE, DATA, MAGIC

    ep2 = [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]
    engines = [None] * 3 + ep2 + EngineLayout.all_ranks(2, 1, False)
    sink = HostSinkComm(keep=True, rank=1, size=len(engines))
    sender = Sender(sink, 1, config=CONFIG, layer_ids=IDS, engines=engines, senders=[0, 1, 2], device="cpu")
    lays = sender.routes.layers
    inside = [s for lay in lays for s in lay.of_sender(1) if s.direct and s.conv_offset > 0]
    assert inside, "no segment of sender 1 lies inside its conversion buffer: the test covers nothing"
    in_order = [
        sender_plan(p, layer_prefix(lay.layer_idx), lay.splits, lay.owners, 1)
        for p, lay in zip(sender.plans, lays)
    ]
    assert any(
        [e.name for e in a.entries] != [e.name for e in lay.local_plans[1].entries]
        for a, lay in zip(in_order, lays)
    ), "sender 1's plans keep the layer's order: the test covers no reordered share"
    sender.send_model((i, synthetic_layer(CONFIG, i)) for i in IDS)
    msgs = iter(sink.sent[2:])  # after the prelude and the manifest
    checked = 0
    for pos, (i, lay) in enumerate(zip(IDS, lays)):
        assert next(msgs)[:5].tolist() == [MAGIC, DATA, i, pos, lay.wire_nbytes]
        got, differ, bad = sent_layer_mismatches(lay, sender.me, msgs, _reference(i))
        assert not bad and differ == 0, (i, bad)
        checked += got
    assert next(msgs)[:4].tolist() == [MAGIC, COMPLETE, -1, len(IDS)] and next(msgs, None) is None
    assert checked >= sum(s.data_nbytes for s in inside) // 2

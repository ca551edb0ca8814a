"""One GLM-5 update into vLLM ranks and SGLang ranks together, which hold the DSA indexer two ways
(docs/sglang.md#indexer-forms): vLLM 0.34 its ``wk`` and ``weights_proj`` fused into the bf16
``wk_weights_proj``, SGLang 0.5.23 (a config without ``indexer_rope_interleave: true``, as GLM-5's)
``wk`` block-FP8 and ``weights_proj`` bf16.

Invariant: with a vLLM server at TP 2 and an SGLang server at TP 2 on one link, from one sender
(scatter) and from two FSDP2 senders, the update's plans carry both forms ("both": the fused entry
and the split ones, each converted once per sender), every engine rank receives only the form it
holds (the MTP layer, which only vLLM's ranks hold: SGLang's drafter is a model of its own, only to
them), and every parameter of every rank equals the reference conversion of the trainer's own
tensors in that rank's form, cut by its shard, bit for bit (parameters start as 0x5A: an unwritten
byte shows).
"""

import pytest
import torch

from glm_fp8.model.families import (
    FUSED_INDEXER,
    REST,
    SPLIT_INDEXER,
    indexer_entry_form,
    model_layer_ids,
    mtp_layer_index,
)
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch

FILL = 0x5A
MTP = mtp_layer_index(TINY_GLM5)
IDS = model_layer_ids(TINY_GLM5)  # the MTP layer too: the vLLM ranks' drafter's, nothing of it SGLang's
SPLIT = {r.out for r in SPLIT_INDEXER} | {SPLIT_INDEXER[0].out + "_scale_inv"}  # wk is block-FP8


def _layouts():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.engine.sglang import SGLangLayout

    return [*EngineLayout.all_ranks(2), *SGLangLayout.all_sglang_ranks(2)]


def _rank(rank, world, n_senders):
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.testing import (
        poisoned_engine_params,
        reference_engine_params,
        sharded_layer,
        synthetic_layer,
    )
    from glm_fp8.transfer import Receiver, Sender

    mesh = DeviceMesh("cpu", torch.arange(n_senders)) if n_senders > 1 else None
    layouts = _layouts()
    kw = dict(
        config=TINY_GLM5,
        layer_ids=IDS,
        rest=True,
        device="cpu",
        engines=[None] * n_senders + layouts,
        senders=list(range(n_senders)),
    )
    if rank < n_senders:
        sender = Sender(None, 0, **kw)

        def layer(i):
            return synthetic_layer(TINY_GLM5, i) if mesh is None else sharded_layer(TINY_GLM5, i, mesh)

        stats = sender.send_model(((i, layer(i)) for i in IDS), rest=layer(REST))
        names = {e.name for plan in sender.plans for e in plan.entries}
        return sender.indexer_form, sorted(n for n in names if indexer_entry_form(n)), stats.nbytes
    layout = layouts[rank - n_senders]
    params = poisoned_engine_params(TINY_GLM5, layout, FILL)
    receiver = Receiver(None, 0, layout=layout, **kw)
    receiver.load_into(params)
    want = reference_engine_params(TINY_GLM5, layout, [*IDS, REST])
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    arrived = {p.name for segs in receiver.mine for s in segs for p in s.pieces}
    received = {n.split(".", 3)[-1] for n in arrived}
    return {
        "engine": layout.engine,
        "form": layout.indexer_form(TINY_GLM5),
        "indexer": sorted(n for n in received if indexer_entry_form(n)),
        "differ": sorted(n for n, t in want.items() if not same(params[n], t)),
        "unlisted": sorted(set(params) - set(want)),  # every parameter is in the reference
        "mtp": sum(n.startswith(f"model.layers.{MTP}.") for n in arrived),
    }


@pytest.mark.slow
@pytest.mark.parametrize("n_senders", [1, 2], ids=["scatter", "two-senders"])
def test_vllm_and_sglang_ranks_each_take_their_own_indexer_form_in_one_update(n_senders):
    results = launch(n_senders + 4, _rank, (n_senders,), timeout_s=180)
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
    for t in range(n_senders):
        form, names, sent = results[t][1]
        assert form == "both" and sent > 0, results[t]
        assert names == sorted({FUSED_INDEXER, *SPLIT}), names  # each form converted, once per sender
    engines = [results[r][1] for r in range(n_senders, n_senders + 4)]
    assert [e["engine"] for e in engines] == ["vllm", "vllm", "sglang", "sglang"]
    for e in engines:
        assert e["differ"] == [] and e["unlisted"] == [], e
        own = [FUSED_INDEXER] if e["form"] == "fused" else sorted(SPLIT)
        assert e["form"] == ("fused" if e["engine"] == "vllm" else "split"), e
        assert e["indexer"] == own, e  # nothing of the other form arrived
        assert (e["mtp"] > 0) == (e["engine"] == "vllm"), e  # the MTP layer to vLLM's ranks only

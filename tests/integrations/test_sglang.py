"""glm_fp8's SGLang loader without SGLang: its payload and its checks (glm_fp8.integrations.sglang).

Invariant: an ``SGLangUpdate`` survives the call's payload (an empty tensor, the update in its
name) unchanged, its layouts with their engine; a payload of any other shape is refused naming what
was expected; a model whose parameters are not exactly what glm_fp8 lands at the rank's layout (a
missing, extra or reshaped parameter) is refused naming the parameter, before any link is opened; a
shared expert SGLang fused into the routed experts' stacks is landed in their last slot (views of
the stacks), and refused naming the flag where SGLang fuses it otherwise (under EP); on Blackwell, a
scale SGLang packed for DeepGEMM lands in the checkpoint's format and goes back to the model only
after the landing, and experts in FlashInfer TRT-LLM's order get their halves swapped. The loader run
by SGLang's own session code is in tests/integrations/test_sglang_real.py.
"""

from types import SimpleNamespace

import pytest
import torch

from glm_fp8.core.errors import EngineNotSupported
from glm_fp8.engine import EngineLayout, SGLangLayout, engine_param_specs
from glm_fp8.integrations.sglang import PAYLOAD, SGLangUpdate, sglang_landing
from glm_fp8.model.layer_plan import packed_ue8m0_shape
from glm_fp8.model.presets import TINY_GLM5

CONFIG = {**TINY_GLM5, "indexer_rope_interleave": True, "num_nextn_predict_layers": 0}
LAYOUTS = SGLangLayout.all_sglang_ranks(2, attn_dp_size=2, ep_size=2)


def _update(**kw):
    fields = dict(
        host="127.0.0.1",
        port=29501,
        rank_offset=1,
        world_size=4,
        config=CONFIG,
        layer_ids=[0, 1, 2, 3],
        engines=[None, *LAYOUTS, EngineLayout(tp_size=2, tp_rank=1)],
    )
    return SGLangUpdate(**{**fields, **kw})


def test_the_payload_round_trips_with_every_layout_and_its_engine():
    update = _update(delta=True, timeout_s=30.0)
    back = SGLangUpdate.from_named_tensors(update.named_tensors())
    assert back.engines == list(update.engines)
    assert [type(x) for x in back.engines] == [type(None), SGLangLayout, SGLangLayout, EngineLayout]
    assert (back.host, back.port, back.rank_offset, back.world_size, back.delta) == (
        "127.0.0.1",
        29501,
        1,
        4,
        True,
    )
    assert back.config == CONFIG and list(back.layer_ids) == [0, 1, 2, 3]
    assert back.holders is None and back.step_layers == 1


def test_a_pipeline_trainers_holders_and_steps_round_trip():
    """A Megatron-Core trainer's stages (``MegatronSource.holders``: by layer, or by entry for the
    non-layer tensors) and its steps of several layers reach every SGLang rank's receiver as sent."""
    holders = {0: [0], 1: [0], 2: [0], 3: [0], -1: {"model.embed_tokens.weight": [0], "lm_head.weight": [0]}}
    update = _update(senders=[0], holders=holders, step_layers=2)
    back = SGLangUpdate.from_named_tensors(update.named_tensors())
    assert back.holders == holders and back.step_layers == 2
    assert back.to_json() == update.to_json()  # the loader keys its receivers by it


@pytest.mark.parametrize(
    "named, words",
    [
        ([("weights", torch.zeros(3, dtype=torch.uint8))], "expected one tensor named"),
        ([(PAYLOAD + "{}", torch.empty(0)), (PAYLOAD + "{}", torch.empty(0))], "expected one tensor named"),
        ([(PAYLOAD + "{not json", torch.empty(0))], "is not one"),
        ([(PAYLOAD + '{"host": "h"}', torch.empty(0))], "is not one"),
    ],
)
def test_a_payload_of_another_shape_is_refused(named, words):
    with pytest.raises(ValueError, match=words):
        SGLangUpdate.from_named_tensors(named)


class _Model(torch.nn.Module):
    """Parameters under SGLang's names, as engine_param_specs lists them (and the KV-cache scales);
    ``fused``: the shared expert as the routed experts' last, as SGLang fuses it."""

    def __init__(self, layout, drop=None, reshape=None, extra=None, fused=False, config=CONFIG):
        super().__init__()
        specs = engine_param_specs(config, layout)
        for name, (shape, dtype) in specs.items():
            if name == drop or (fused and ".shared_experts." in name):
                continue
            if name == reshape or (fused and ".mlp.experts.w" in name):
                shape = (shape[0] + 1, *shape[1:])
            self.register_parameter(
                name.replace(".", "__"), torch.nn.Parameter(torch.empty(shape, dtype=dtype), False)
            )
        self.register_parameter("kv__k_scale", torch.nn.Parameter(torch.ones(()), False))
        if extra:
            self.register_parameter(extra, torch.nn.Parameter(torch.empty(2), False))
        if fused:
            self.shared_experts_config = SimpleNamespace(num_fused_shared_experts=1)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace("__", "."), p

    def named_modules(self, *args, **kwargs):
        for name, m in super().named_modules(*args, **kwargs):
            yield name.replace("__", "."), m


def _blackwell_model(layout, trtllm=False, ue8m0=True):
    """A model as SGLang leaves it on Blackwell after its own load (``process_weights_after_loading``
    with DeepGEMM): every block-FP8 scale but the routed experts' packed as DeepGEMM's UE8M0 int32
    (``format_ue8m0``), with bytes in it (``ue8m0``); ``trtllm``: the routed experts run with FlashInfer
    TRT-LLM."""
    model = _Model(layout)
    held = dict(model.named_parameters())
    for name in list(held):
        if ue8m0 and name.endswith("weight_scale_inv") and ".mlp.experts." not in name:
            weight = held[name.removesuffix("_scale_inv")]
            packed = torch.nn.Parameter(
                torch.randint(0, 2**20, packed_ue8m0_shape(tuple(weight.shape)), dtype=torch.int32), False
            )
            packed.format_ue8m0 = True
            model.register_parameter(name.replace(".", "__"), packed)
    if trtllm:
        experts = [n.removesuffix(".w13_weight") for n in held if n.endswith("mlp.experts.w13_weight")]
        for name in experts:  # SGLang's FusedMoE modules, as far as the landing reads them
            module = torch.nn.Module()
            module.use_flashinfer_trtllm_moe = True
            model.add_module(name.replace(".", "__"), module)
    return model


def test_blackwells_packed_scales_land_in_the_checkpoints_format_and_are_requantized_in_place():
    """On Blackwell each packed UE8M0 scale lands in a float32 tensor of the checkpoint's shape
    (poisoned: NaN); ``finish()`` then runs the post-load step with those scales in the parameters
    (``format_ue8m0`` False), puts the packed storage back and copies the requantization's results
    into the weights and packed scales in place: no parameter moves (SGLang's CUDA graphs read them
    where they were captured). The requantization here is a marker, not SGLang's: the real one is
    tested against SGLang's own load in test_sglang_real.py."""
    lay = LAYOUTS[1]
    model = _blackwell_model(lay)
    landing = sglang_landing(model, CONFIG, lay)
    name = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
    held = dict(model.named_parameters())
    param, weight = held[name], held[name.removesuffix("_scale_inv")]
    where = {n: p.data_ptr() for n, p in held.items()}
    staged = landing.params[name]
    assert (tuple(staged.shape), staged.dtype) == engine_param_specs(CONFIG, lay)[name]
    assert staged.isnan().all() and param.dtype == torch.int32
    assert len(landing.restore) >= 10 and not landing.swap
    assert "UE8M0 requantization" in landing.converts
    for _, _, scales in landing.restore:  # the update's bytes
        scales.fill_(0.5)
    seen = []

    def post_load(m):
        seen.append((param.dtype, param.format_ue8m0, float(param.data.reshape(-1)[0])))

    def requantize(w, s):  # a marker: every weight byte 3, every packed word its scale's first value
        return torch.full_like(w.view(torch.uint8), 3).view(w.dtype), torch.full(
            packed_ue8m0_shape(tuple(w.shape)), int(s.reshape(-1)[0] * 4), dtype=torch.int32
        )

    landing.finish(model, post_load, requantize)
    assert seen == [(torch.float32, False, 0.5)]  # the post-load step saw the checkpoint's scales
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
    assert param.dtype == torch.int32 and param.format_ue8m0 is True and bool((param == 2).all())
    assert bool((weight.view(torch.uint8) == 3).all())


def test_a_packed_scale_of_another_shape_is_refused_naming_it():
    lay = LAYOUTS[1]
    model = _blackwell_model(lay)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    odd = torch.nn.Parameter(torch.zeros(3, 1, dtype=torch.int32), False)
    odd.format_ue8m0 = True
    model.register_parameter(name.replace(".", "__"), odd)
    with pytest.raises(EngineNotSupported, match=f"{name}: SGLang marks it UE8M0"):
        sglang_landing(model, CONFIG, lay)


def test_bytes_sglang_shuffled_for_aiter_are_refused_naming_the_parameter():
    """ROCm's AITER kernels take their fp8 bytes shuffled in place (same shape and dtype, marked
    ``is_shuffled``): landing the checkpoint's order there would be silently wrong."""
    model = _Model(LAYOUTS[1])
    name = "model.layers.2.mlp.experts.w2_weight"
    dict(model.named_parameters())[name].is_shuffled = True
    with pytest.raises(EngineNotSupported, match=f"{name}: SGLang shuffled its bytes for AITER"):
        sglang_landing(model, CONFIG, LAYOUTS[1])


def test_trtllm_experts_get_their_w13_halves_swapped_after_landing():
    """FlashInfer TRT-LLM's routed experts hold w13 as [w3; w1] (SGLang's loader swaps the shards):
    glm_fp8 lands [w1; w3] and ``finish()`` swaps the halves, scales alike."""
    lay = LAYOUTS[1]
    model = _blackwell_model(lay, trtllm=True, ue8m0=False)
    landing = sglang_landing(model, CONFIG, lay)
    assert len(landing.swap) == CONFIG["num_hidden_layers"] - CONFIG["first_k_dense_replace"]
    assert landing.converts == f"FlashInfer TRT-LLM's [w3; w1] order of {len(landing.swap)} expert stacks"
    w13, scale = landing.swap[0]
    w13.view(torch.uint8).copy_(torch.randint(0, 256, w13.shape, dtype=torch.uint8))
    scale.copy_(torch.rand(scale.shape))
    before_w, before_s = w13.clone(), scale.clone()
    landing.finish(model, lambda m: None, None)  # nothing to requantize: no packed scale
    half, blocks = w13.shape[1] // 2, scale.shape[1] // 2
    assert torch.equal(w13[:, :half].view(torch.uint8), before_w[:, half:].view(torch.uint8))
    assert torch.equal(w13[:, half:].view(torch.uint8), before_w[:, :half].view(torch.uint8))
    assert torch.equal(scale[:, :blocks], before_s[:, blocks:]) and torch.equal(
        scale[:, blocks:], before_s[:, :blocks]
    )


def test_a_model_that_holds_what_glm_fp8_lands_passes():
    sglang_landing(_Model(LAYOUTS[1]), CONFIG, LAYOUTS[1])


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            dict(drop="model.layers.2.mlp.experts.w13_weight"),
            "model.layers.2.mlp.experts.w13_weight: SGLang's",
        ),
        (dict(reshape="lm_head.weight"), "lm_head.weight: SGLang's model holds"),
        (dict(extra="surprise"), "surprise: SGLang's model holds"),
    ],
)
def test_a_model_that_holds_anything_else_is_refused_naming_the_parameter(kw, words):
    with pytest.raises(EngineNotSupported, match=words):
        sglang_landing(_Model(LAYOUTS[1], **kw), CONFIG, LAYOUTS[1])


def test_a_fused_shared_expert_lands_in_the_routed_experts_last_slot():
    tp2 = SGLangLayout.from_sglang(2, 1)
    model = _Model(tp2, fused=True)
    params = sglang_landing(model, CONFIG, tp2).params
    held = dict(model.named_parameters())
    for stack, shared in [
        ("model.layers.2.mlp.experts.w13_weight", "model.layers.2.mlp.shared_experts.gate_up_proj.weight"),
        (
            "model.layers.2.mlp.experts.w2_weight_scale_inv",
            "model.layers.2.mlp.shared_experts.down_proj.weight_scale_inv",
        ),
    ]:
        assert params[stack].data_ptr() == held[stack].data_ptr()
        assert params[stack].shape[0] == CONFIG["n_routed_experts"]
        assert params[shared].data_ptr() == held[stack][-1].data_ptr()


def test_a_fused_shared_expert_under_ep_is_refused_naming_the_flag():
    model = _Model(LAYOUTS[0], fused=True)
    with pytest.raises(EngineNotSupported, match="--disable-shared-experts-fusion"):
        sglang_landing(model, CONFIG, LAYOUTS[0])


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(host=""), "SGLangUpdate.host"),
        (dict(port=0), "SGLangUpdate.port"),
        (dict(port="29501"), "SGLangUpdate.port"),
        (dict(rank_offset=5), "SGLangUpdate.rank_offset"),
        (dict(world_size=3), "SGLangUpdate.engines: expected one entry per link rank"),
        (dict(layer_ids=[0, -1]), "layer_ids"),
        (dict(delta=1), "SGLangUpdate.delta"),
        (dict(timeout_s=0), "SGLangUpdate.timeout_s"),
        (dict(engines=[None, "full", LAYOUTS[1], None]), "engines\\[1\\]"),
        (dict(holders={0: []}), r"SGLangUpdate.holders\[0\]: expected at least one link rank"),
        (dict(step_layers=0), "SGLangUpdate.step_layers"),
        (dict(step_layers=2, delta=True, holders={0: [0]}), "a delta update carries one layer a step"),
        (dict(step_layers=2), "SGLangUpdate.step_layers: 2 needs holders"),
    ],
)
def test_an_update_with_a_bad_field_is_refused_naming_it(kw, words):
    fields = dict(
        host="127.0.0.1",
        port=29501,
        rank_offset=1,
        world_size=4,
        config=CONFIG,
        layer_ids=[0, 1],
        engines=[None, *LAYOUTS, EngineLayout(tp_size=2, tp_rank=1)],
    )
    with pytest.raises(ValueError, match=words):
        SGLangUpdate(**{**fields, **kw})


def test_the_http_payload_is_the_update_once_per_tp_rank_of_the_server():
    """``serialized_named_tensors()``: base64 of the payload as torch's ForkingPickler pickles it
    (SGLang's MultiprocessingSerializer), one per TP rank of the server at ``rank_offset``; it
    unpickles to the same update."""
    import base64
    import pickle

    update = _update()
    texts = update.serialized_named_tensors()
    assert len(texts) == update.server_ranks() == 2 and texts[0] == texts[1]
    back = SGLangUpdate.from_named_tensors(pickle.loads(base64.b64decode(texts[0])))
    assert back == update or back.to_json() == update.to_json()


def test_an_update_call_refuses_an_update_whose_server_ranks_are_not_one_sglang_server():
    from glm_fp8.integrations.sglang import SGLangHttpClient, SGLangUpdateCall

    client = SGLangHttpClient("http://127.0.0.1:1")
    bad = _update(rank_offset=2)  # TP rank 1 of the server, then a vLLM rank
    with pytest.raises(ValueError, match=r"engines\[2\]: expected the server's TP rank 0 of 2"):
        SGLangUpdateCall(client, bad)
    with pytest.raises(ValueError, match="pause: expected None or one of"):
        SGLangUpdateCall(client, _update(), pause="stop")
    with pytest.raises(ValueError, match="SGLangHttpClient.url: expected http://host:port"):
        SGLangHttpClient("127.0.0.1:30000")


def test_an_unreachable_server_fails_the_call_at_once_naming_it():
    """Nothing listens at the URL: the call fails in the caller's thread (before any sender waits),
    naming the server and its route."""
    from glm_fp8.core.errors import EngineCallFailed
    from glm_fp8.integrations.sglang import SGLangHttpClient, SGLangUpdateCall
    from glm_fp8.testing import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineCallFailed, match=rf"SGLang server {url}: POST /pause_generation got no answer"):
        SGLangUpdateCall(SGLangHttpClient(url, timeout_s=5), _update())


def _server(answers: dict):
    """A local HTTP server answering each route with ``answers[route]`` (status, JSON), recording
    the routes and bodies it was sent."""
    import http.server
    import json
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            route = self.path.strip("/")
            seen.append((route, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            status, body = answers[route]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_a_refused_update_call_ends_the_session_publishes_the_fault_and_stays_paused():
    """SGLang refuses the update call (HTTP 400, as its routes answer ``success: false``): the
    session is ended, ``join`` raises with SGLang's message, the fault is published on the link
    (some rank never ran the loader: no sender waits for it), and generation is not resumed. A
    landed update's ``finish`` resumes it; the payload goes once per TP rank with glm_fp8's loader."""
    from glm_fp8.core.errors import EngineCallFailed
    from glm_fp8.integrations.sglang import LOADER, SGLangHttpClient, SGLangUpdateCall

    ok = (200, {"success": True, "message": "ok"})
    answers = {"pause_generation": ok, "begin_weight_update": ok, "end_weight_update": ok}
    answers["continue_generation"] = ok
    answers["update_weights_from_tensor"] = (400, {"success": False, "message": "not between begin and end"})
    server, seen = _server(answers)
    client = SGLangHttpClient(f"http://127.0.0.1:{server.server_address[1]}", api_key="k", timeout_s=10)
    reported = []
    link = SimpleNamespace(liveness=SimpleNamespace(report=lambda rank, why: reported.append((rank, why))))
    call = SGLangUpdateCall(client, _update(), weight_version="7", link=link)
    with pytest.raises(EngineCallFailed, match="update_weights_from_tensor answered 400: not between begin"):
        call.join(30)
    routes = [r for r, _ in seen]
    assert routes == [
        "pause_generation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ]
    assert len(reported) == 1 and "generation stays paused" in reported[0][1], reported
    body = seen[2][1]
    assert (
        body["load_format"] == LOADER
        and body["weight_version"] == "7"
        and len(body["serialized_named_tensors"]) == 2
    )
    assert seen[0][1] == {"mode": "retract"} and seen[1][1] == {"selector": "target"}

    answers["update_weights_from_tensor"] = ok
    seen.clear()
    call = SGLangUpdateCall(client, _update(), link=link)
    assert call.finish(30) == "ok" and [r for r, _ in seen][-2:] == [
        "end_weight_update",
        "continue_generation",
    ]
    assert len(reported) == 1
    server.shutdown()


def _start_rank(rank, world, fail_second):
    """Trainer rank 0 starts the update of two servers (the second's session refused when
    ``fail_second``); rank 1 passes none: each rank's outcome, and the routes each server saw."""
    from glm_fp8.core.errors import EngineCallFailed
    from glm_fp8.integrations.sglang import SGLangHttpClient, start_update

    servers, seen = None, []
    if rank == 0:
        ok = (200, {"success": True, "message": "ok"})
        routes = (
            "pause_generation",
            "begin_weight_update",
            "update_weights_from_tensor",
            "end_weight_update",
        )
        answers = [{r: ok for r in (*routes, "continue_generation")} for _ in range(2)]
        if fail_second:
            answers[1]["begin_weight_update"] = (400, {"success": False, "message": "a session is open"})
        made = [_server(a) for a in answers]
        seen = [s for _, s in made]
        servers = [
            (SGLangHttpClient(f"http://127.0.0.1:{srv.server_address[1]}"), _update()) for srv, _ in made
        ]
    try:
        calls = start_update(servers, weight_version="3")
        out = ("ok", len(calls), [c.finish(30) for c in calls])
    except EngineCallFailed as exc:
        out = ("EngineCallFailed", str(exc), None)
    return out, [[r for r, _ in s] for s in seen]


@pytest.mark.parametrize("fail_second", [False, True], ids=["started", "refused"])
def test_start_update_tells_every_trainer_rank_before_any_waits(fail_second):
    """``start_update`` over two trainer ranks and two servers: rank 0 opens both sessions, then
    launches both calls; rank 1 learns the outcome from rank 0. When the second server refuses its
    session, both ranks raise at once naming it, and the first server's session is ended and
    generation resumed (nothing moved), its update never called."""
    from glm_fp8.testing import launch

    results = launch(2, _start_rank, (fail_second,), timeout_s=60)
    (out0, seen), (out1, _) = results[0][1], results[1][1]
    assert results[0][0] == results[1][0] == "ok", results
    pause, begin, update, end, resume = (
        "pause_generation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "continue_generation",
    )
    if not fail_second:
        assert out0 == ("ok", 2, ["ok", "ok"]) and out1 == ("ok", 0, []), (out0, out1)
        assert seen == [[pause, begin, update, end, resume]] * 2, seen
        return
    assert out0[0] == out1[0] == "EngineCallFailed", (out0, out1)
    assert "begin_weight_update answered 400: a session is open" in out0[1], out0
    assert out1[1].startswith("trainer rank 0: EngineCallFailed: ") and "a session is open" in out1[1], out1
    assert seen == [[pause, begin, end, resume], [pause, begin]], seen


MTP_CONFIG = {**CONFIG, "num_nextn_predict_layers": 1}  # layer 4: the MTP layer


def _drafter_update(**kw):
    fields = dict(layer_ids=[0, 1, 2, 3], engines=[None, *LAYOUTS], world_size=3, config=MTP_CONFIG)
    return _update(drafter=True, **{**fields, **kw})


def test_the_drafters_update_carries_the_mtp_layer_into_each_ranks_drafter():
    """``drafter=True``: the update after the target's, on the same link, is the MTP layer alone
    into each SGLang rank's drafter (its decoder cut as a target layer is on that rank), and it
    survives the payload as the target's does."""
    from glm_fp8.integrations.sglang.client import selector_of

    update = _drafter_update(holders={i: [0] for i in range(5)})
    draft = update.drafter_update()
    assert list(draft.layer_ids) == [4] and not draft.rest and not draft.drafter
    assert draft.engines == [None, *(lay.drafter_layout for lay in LAYOUTS)]
    assert draft.holders == {4: [0]} and (draft.host, draft.port, draft.world_size) == ("127.0.0.1", 29501, 3)
    back = SGLangUpdate.from_named_tensors(update.named_tensors())
    assert back.drafter and back.drafter_update() == SGLangUpdate.from_json(draft.to_json())
    assert (selector_of(update), selector_of(draft), selector_of(_update())) == ("all", "target", "target")


def test_a_drafters_parameters_are_its_mtp_layer_under_its_names():
    """SGLang's ``DeepseekModelNextN``: the decoder layer's entries under ``model.decoder.`` (its shards
    a target layer's at the same rank), ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``
    under ``model.``, no ``shared_head.head`` (the target's ``lm_head``) and no embeddings; the
    target's layout holds nothing of the MTP layer."""
    for lay in LAYOUTS:
        draft = engine_param_specs(MTP_CONFIG, lay.drafter_layout)
        target = engine_param_specs(MTP_CONFIG, lay)
        assert not any(".layers.4." in n for n in target)
        own = {
            "model.enorm.weight",
            "model.hnorm.weight",
            "model.eh_proj.weight",
            "model.shared_head.norm.weight",
        }
        assert own <= set(draft) and not any("shared_head.head" in n or "embed_tokens" in n for n in draft)
        for name, spec in draft.items():
            if name not in own:
                assert name.startswith("model.decoder.")
                assert target["model.layers.3." + name.removeprefix("model.decoder.")] == spec, name
        assert draft["model.eh_proj.weight"] == ((256, 512), torch.bfloat16)
        assert lay.drafter_layout.holds(MTP_CONFIG, "model.layers.4.mlp.experts.w13_weight")
        assert not lay.drafter_layout.holds(MTP_CONFIG, "model.layers.4.shared_head.head.weight")
        assert not lay.holds(MTP_CONFIG, "model.layers.4.mlp.experts.w13_weight")


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(config=CONFIG), "no MTP layer"),
        (dict(layer_ids=[0, 1, 2, 3, 4]), "holds the MTP layer 4"),
        (dict(engines=[None, EngineLayout(tp_size=2, tp_rank=1), LAYOUTS[1]]), r"engines\[1\]"),
        (dict(engines=[None, LAYOUTS[0].drafter_layout, LAYOUTS[1]]), r"engines\[1\]"),
    ],
)
def test_a_drafters_update_is_refused_where_it_cannot_reach_each_drafter(kw, words):
    with pytest.raises(ValueError, match=words):
        _drafter_update(**kw)
    with pytest.raises(ValueError, match="drafter=False"):
        _update().drafter_update()


def test_a_drafter_lands_its_mtp_layer_and_leaves_the_targets_embeddings_and_head():
    """SGLang's drafter holds the target's ``model.embed_tokens`` and ``lm_head`` (shared by its draft
    worker): its landing lists neither, and whatever else it holds must be what glm_fp8 lands."""
    from glm_fp8.integrations.sglang.loader import DRAFTER_TARGETS, is_drafter

    lay = LAYOUTS[0].drafter_layout
    model = _Model(lay, config=MTP_CONFIG)
    for name in DRAFTER_TARGETS:  # the target's, as set_embed_and_head leaves them in the drafter
        model.register_parameter(name.replace(".", "__"), torch.nn.Parameter(torch.empty(3, 2), False))
    params = sglang_landing(model, MTP_CONFIG, lay).params
    assert set(params) == set(engine_param_specs(MTP_CONFIG, lay))
    assert not is_drafter(model) and is_drafter(SimpleNamespace(model=SimpleNamespace(decoder=None)))
    with pytest.raises(EngineNotSupported, match="model.decoder.mlp.experts.w13_weight: SGLang's"):
        sglang_landing(
            _Model(lay, drop="model.decoder.mlp.experts.w13_weight", config=MTP_CONFIG), MTP_CONFIG, lay
        )

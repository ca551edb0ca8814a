"""Layer converter against the eager composition (torch.cat, then the reference quantizer).

Invariant: every entry of ``convert_layer`` equals ``convert_layer_ref`` bit for bit (fp8 as
uint8, scales and passthrough exactly), in the plan's order, as views of one buffer; a bad
state dict raises naming the key before a byte of the buffer is written.
"""

import pytest
import torch

from glm_fp8.integrations.prime_rl import convert_tt_layer_to_vllm_kernel
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.layer_plan import ALIGN
from glm_fp8.model.plans import plan_from_config, plan_from_state_dict
from glm_fp8.model.presets import PRESETS, SMALL_CONFIGS

SMALL = SMALL_CONFIGS  # sizes not multiples of 128: blocks straddle every concatenation


def make_layer(config, layer_idx, device, dtype=torch.bfloat16, prefix=True):
    plan = plan_from_config(config, layer_idx, dtype=dtype)
    p = f"model.layers.{layer_idx}." if prefix else ""
    return {
        p + k: (torch.randn(shape, device=device) * 0.05).to(dtype) for k, (shape, _) in plan.inputs.items()
    }


def _short(sd, layer_idx):
    p = f"model.layers.{layer_idx}."
    return {k.removeprefix(p): t for k, t in sd.items()}


def assert_entries_equal(got, want):
    assert list(got) == list(want)
    for name, g in got.items():
        w = want[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        gb, wb = g.cpu().contiguous(), w.cpu().contiguous()
        if g.dtype == torch.float8_e4m3fn:
            gb, wb = gb.view(torch.uint8), wb.view(torch.uint8)
        elif g.is_floating_point():  # compare bit patterns: -0.0 and NaN payloads count
            as_int = torch.int16 if g.element_size() == 2 else torch.int32
            gb, wb = gb.view(as_int), wb.view(as_int)
        assert torch.equal(gb, wb), f"{name}: {(gb != wb).sum().item()} elements differ"


@pytest.mark.parametrize("model", ["glm-5", "glm-4.5"])
@pytest.mark.parametrize("layer_idx", [0, 2], ids=["dense", "sparse"])
@pytest.mark.parametrize("target", ["hopper", "blackwell"])
def test_layer_matches_eager_composition(device, model, layer_idx, target):
    sd = make_layer(SMALL[model], layer_idx, device)
    plan = plan_from_config(SMALL[model], layer_idx, target=target)
    buf = torch.full((plan.nbytes,), 0xFF, dtype=torch.uint8, device=device)
    got = convert_layer(sd, layer_idx, out=buf, plan=plan)
    want = convert_layer_ref(_short(sd, layer_idx), layer_idx, plan)
    assert_entries_equal(got, want)
    for v in got.values():  # every entry is a view of the one buffer
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_plan_layout_is_packed_and_aligned():
    for model, config in SMALL.items():
        for layer_idx in (0, 2):
            plan = plan_from_config(config, layer_idx)
            end = 0
            for e in plan.entries:
                assert e.offset % ALIGN == 0 and e.offset >= end, (model, e.name)
                end = e.offset + e.nbytes
            assert plan.nbytes >= end and plan.nbytes - end < ALIGN
            names = [e.name for e in plan.entries]
            for i, e in enumerate(plan.entries):  # a scale follows its quantized weight
                if e.op == "quantize":
                    assert names[i + 1] == e.name + "_scale_inv"


def test_glm5_full_size_plan_matches_the_spec():
    sparse, dense = plan_from_config(PRESETS["glm-5"], 3), plan_from_config(PRESETS["glm-5"], 0)
    shapes = {e.name: e.shape for e in sparse.entries}
    assert shapes["self_attn.fused_qkv_a_proj.weight"] == (2624, 6144)
    assert shapes["self_attn.kv_b_proj.weight"] == (28672, 512)
    assert shapes["mlp.experts.w13_weight"] == (256, 4096, 6144)
    assert shapes["mlp.experts.w13_weight_scale_inv"] == (256, 32, 48)
    assert shapes["mlp.shared_experts.gate_up_proj.weight"] == (4096, 6144)
    assert shapes["self_attn.indexer.wk_weights_proj.weight"] == (160, 6144)
    assert {e.name: e.shape for e in dense.entries}["mlp.gate_up_proj.weight"] == (24576, 6144)
    assert 9.2 < sparse.nbytes / 2**30 < 9.4  # "about 9.3 GiB in this format"
    bw = plan_from_config(PRESETS["glm-5"], 3, target="blackwell")
    scale = {e.name: e for e in bw.entries}["mlp.experts.w13_weight_scale_inv"]
    assert scale.shape == (256, 4096, 12) and scale.dtype == torch.int32
    v = scale.view(torch.empty(bw.nbytes, dtype=torch.uint8, device="meta"))
    assert v.stride() == (12 * 4096, 1, 4096)  # DeepGEMM's MN-major, TMA-aligned layout


@pytest.mark.parametrize("quantize_fp8", [True, False])
def test_prime_rl_compat(device, quantize_fp8):
    sd = make_layer(SMALL["glm-5"], 2, device)
    got = convert_tt_layer_to_vllm_kernel(sd, 2, quantize_fp8=quantize_fp8)
    plan = plan_from_state_dict(_short(sd, 2), quantize=quantize_fp8)
    assert_entries_equal(got, convert_layer_ref(_short(sd, 2), 2, plan))
    assert any(k.endswith("_scale_inv") for k in got) == quantize_fp8


def test_inferred_plan_keeps_passthrough_dtypes_and_short_keys(device):
    sd = make_layer(SMALL["glm-4.5"], 2, device, prefix=False)
    sd["mlp.router.gate.weight"] = sd["mlp.router.gate.weight"].float()
    sd["mlp.shared_expert.w1"] = sd["mlp.shared_expert.w1"][0]  # [I, H] instead of [1, I, H]
    got = convert_layer(sd, 2)
    assert got["model.layers.2.mlp.gate.weight"].dtype == torch.float32
    assert_entries_equal(got, convert_layer_ref(sd, 2, plan_from_state_dict(sd)))


def _cast(key, dtype):
    def mutate(sd):
        sd["model.layers.2." + key] = sd["model.layers.2." + key].to(dtype)

    return mutate


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (
            lambda sd: sd.pop("model.layers.2.mlp.experts.w3"),
            KeyError,
            r"model.layers.2.mlp.experts.w3: missing; expected a tensor of shape \(3, 72, 200\)",
        ),
        (
            lambda sd: sd.__setitem__("model.layers.2.mlp.foo", torch.zeros(1)),
            KeyError,
            "model.layers.2.mlp.foo: unexpected key",
        ),
        (
            lambda sd: sd.__setitem__("model.layers.2.self_attn.o_proj.weight", torch.zeros(200, 79)),
            ValueError,
            r"model.layers.2.self_attn.o_proj.weight: expected shape \(200, 80\), got \(200, 79\)",
        ),
        (
            _cast("input_layernorm.weight", torch.int64),
            TypeError,
            r"model.layers.2.input_layernorm.weight: expected a floating dtype .* got torch.int64",
        ),
        (
            _cast("mlp.experts.w1", torch.float64),
            TypeError,
            r"model.layers.2.mlp.experts.w1: expected dtype bfloat16, float16 or float32",
        ),
    ],
)
def test_bad_state_dict_is_refused_before_writing(device, mutate, exc, match):
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    mutate(sd)
    sd = {k: v.to(device) for k, v in sd.items()}
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(exc, match=match):
        convert_layer(sd, 2, out=buf, plan=plan)
    assert (buf == 0xAB).all()


def test_wrong_buffer_and_target_are_refused(device):
    sd = make_layer(SMALL["glm-5"], 0, device)
    plan = plan_from_config(SMALL["glm-5"], 0)
    with pytest.raises(ValueError, match=rf"out: expected shape \({plan.nbytes},\)"):
        convert_layer(sd, 0, out=torch.empty(plan.nbytes - 1, dtype=torch.uint8, device=device), plan=plan)
    with pytest.raises(ValueError, match="target: expected 'hopper'"):
        convert_layer(sd, 0, plan=plan, target="blackwell")
    with pytest.raises(
        KeyError,
        match=r"model\.layers\.0\.input_layernorm\.weight: a key of another layer, "
        r"but layer_idx=1",
    ):
        convert_layer(sd, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a full GLM-5 layer needs the H200")
def test_full_size_glm5_sparse_layer_on_gpu():
    """Every entry of a real-size GLM-5 sparse layer equals the eager composition (experts
    compared one at a time to bound the reference's memory), and convert_layer allocates at
    most 64 MiB above its inputs and output buffer."""
    from glm_fp8.kernels.reference import quantize_blockwise_ref

    config = PRESETS["glm-5"]
    plan = plan_from_config(config, 3)
    sd = make_layer(config, 3, "cuda")
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    convert_layer(sd, 3, out=buf, plan=plan)  # compile first
    buf.fill_(0xFF)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = convert_layer(sd, 3, out=buf, plan=plan)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 64 << 20
    layer = _short(sd, 3)
    entries = {e.name: e for e in plan.entries}
    for e in plan.entries:
        if e.op == "scale":
            continue
        srcs = [layer[s].squeeze(0) if e.squeeze else layer[s] for s in e.sources]
        q = got[f"model.layers.3.{e.name}"]
        if e.op != "quantize":
            assert torch.equal(q, torch.cat(srcs, dim=-2 if q.dim() >= 2 else 0)), e.name
            continue
        s = got[f"model.layers.3.{e.name}_scale_inv"]
        assert entries[e.name + "_scale_inv"].shape == tuple(s.shape)
        for k in range(q.shape[0]) if q.dim() == 3 else [None]:
            pick = (lambda t: t[k]) if k is not None else (lambda t: t)  # noqa: B023
            q_ref, s_ref = quantize_blockwise_ref(torch.cat([pick(t) for t in srcs], dim=-2))
            assert torch.equal(pick(q).view(torch.uint8), q_ref.view(torch.uint8)), (e.name, k)
            assert torch.equal(pick(s), s_ref), (e.name, k)


@pytest.mark.parametrize(
    "op, entry", [("scale", "mlp.experts.w2_weight_scale_inv"), ("copy", "input_layernorm.weight")]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_layer_finite_check_finds_the_entry(device, op, entry, bad):
    """The broadcaster's layer-level check (one multi-tensor max |x|) names a non-finite
    entry of the kinds it is asked about and passes a clean buffer."""
    from glm_fp8.core.errors import NonFiniteError
    from glm_fp8.kernels.convert import check_finite_entries

    plan = plan_from_config(SMALL["glm-5"], 2)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    convert_layer(make_layer(SMALL["glm-5"], 2, device), 2, out=buf, plan=plan)
    check_finite_entries(plan, buf, 2, ("scale", "copy", "concat"))
    view = dict(plan.views(buf))[entry]
    view.view(-1)[view.numel() // 2] = bad
    name = entry.removesuffix("_scale_inv")
    with pytest.raises(NonFiniteError, match=rf"model\.layers\.2\.{name}: NaN or Inf"):
        check_finite_entries(plan, buf, 2, (op,))


# --- Hardening (item 5): buffers the plan's views cannot use; layer values without data ------


@pytest.mark.parametrize("shift", [1, 4, 8])
def test_misaligned_buffer_is_refused_before_writing(device, shift):
    """The plan views ``out`` as float32/int32/bf16 at 256-byte offsets: a buffer that starts off a
    16-byte boundary (1 byte: ``.view(float32)`` would fail; 4 or 8: vector accesses) is named."""
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    whole = torch.full((plan.nbytes + 16,), 0xAB, dtype=torch.uint8, device=device)
    assert whole.data_ptr() % 16 == 0
    buf = whole[shift : shift + plan.nbytes]
    match = (
        rf"^out: expected a buffer aligned to 16 bytes \(the plan's views need it\), got address "
        rf"{buf.data_ptr():#x} % 16 = {shift}$"
    )
    with pytest.raises(ValueError, match=match):
        convert_layer(sd, 2, out=buf, plan=plan)
    assert (whole == 0xAB).all()
    got = convert_layer(sd, 2, out=whole[16:], plan=plan)  # 16 bytes in: accepted
    assert_entries_equal(got, convert_layer_ref(_short(sd, 2), 2, plan))


def test_buffer_misaligned_within_its_storage_is_refused():
    """A storage that itself starts off 16 bytes (here a bytearray's) can give an aligned address
    at an offset ``.view(float32)`` refuses: named too, before anything is written."""
    sd = make_layer(SMALL["glm-5"], 0, "cpu")
    plan = plan_from_config(SMALL["glm-5"], 0)
    raw = bytearray(b"\xab" * (plan.nbytes + 32))
    shift = (1 - torch.frombuffer(raw, dtype=torch.uint8).data_ptr()) % 16
    storage = torch.frombuffer(raw, dtype=torch.uint8, offset=shift)  # starts at 1 mod 16
    buf = storage[15 : 15 + plan.nbytes]
    assert buf.data_ptr() % 16 == 0 and buf.storage_offset() == 15
    with pytest.raises(ValueError, match=r"^out: expected a buffer aligned to 16 bytes within its storage"):
        convert_layer(sd, 0, out=buf, plan=plan)
    assert raw == b"\xab" * len(raw)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (
            lambda t: t.to_sparse(),
            TypeError,
            r"^model.layers.2.input_layernorm.weight: expected a strided \(dense\) tensor, got layout "
            r"torch.sparse_coo$",
        ),
        (
            lambda t: t.to("meta"),
            ValueError,
            r"^model.layers.2.input_layernorm.weight: expected a tensor with data, got a meta tensor$",
        ),
        (
            lambda t: t.tolist(),
            TypeError,
            r"^model.layers.2.input_layernorm.weight: expected a torch.Tensor, got list$",
        ),
    ],
)
def test_layer_values_without_dense_data_are_refused(device, bad, exc, match):
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    key = "model.layers.2.input_layernorm.weight"
    sd[key] = bad(sd[key])
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(exc, match=match):
        convert_layer(sd, 2, out=buf, plan=plan)
    assert (buf == 0xAB).all()
    with pytest.raises(exc, match=match):  # the same without a buffer or a plan
        convert_layer(sd, 2, plan=plan)


def test_buffer_that_cannot_be_written_is_refused(device):
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    with torch.inference_mode():
        frozen = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="^out: expected a tensor writable outside inference mode"):
        convert_layer(sd, 2, out=frozen, plan=plan)
    assert (frozen == 0xAB).all()
    with torch.inference_mode():  # where torch allows the write, so do we
        got = convert_layer(sd, 2, out=frozen, plan=plan)
    assert_entries_equal(got, convert_layer_ref(_short(sd, 2), 2, plan))
    meta = torch.empty(plan.nbytes, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="^out: expected a tensor with data, got a meta tensor$"):
        convert_layer(sd, 2, out=meta, plan=plan)


# --- convert_layer's contract: checks before writes, only=, layer keys (item 5) --------------------


@pytest.mark.parametrize(
    "key", ["input_layernorm.weight", "mlp.expert_bias", "self_attn.indexer.k_norm.bias"]
)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nonfinite_passthrough_is_refused_before_writing(device, key, bad):
    """NaN/Inf in a passthrough tensor (a norm, the routing bias, k_norm's bias) is found before a
    byte of ``out`` is written, and named with its element."""
    from glm_fp8.core.errors import NonFiniteError

    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    name = "model.layers.2." + key
    sd[name][1] = bad
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(NonFiniteError, match=rf"^{name}: {bad} at {name}\[1\]; refusing to send it") as e:
        convert_layer(sd, 2, out=buf, plan=plan)
    assert e.value.source == name and e.value.block is None
    assert (buf == 0xAB).all()


def test_nonfinite_quantized_source_leaves_out_as_documented(device):
    """The fused kernels check while writing: after their NonFiniteError every entry has been
    written, the passthrough ones exact, and the block holding the NaN has a non-finite scale."""
    from glm_fp8.core.errors import NonFiniteError

    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    want = convert_layer_ref(_short(sd, 2), 2, plan)
    sd["model.layers.2.mlp.experts.w3"][1, 3, 130] = float("nan")  # expert 1, w13 row 75: block (0, 1)
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    match = r"model\.layers\.2\.mlp\.experts\.w3: nan at .*\[1, 3, 130\]"
    with pytest.raises(NonFiniteError, match=match) as e:
        convert_layer(sd, 2, out=buf, plan=plan)
    assert (e.value.expert, e.value.block) == (1, (0, 1))
    views = dict(plan.views(buf))
    for entry in plan.entries:
        if entry.op in ("copy", "concat"):
            w = want["model.layers.2." + entry.name]
            assert torch.equal(views[entry.name].cpu(), w.cpu()), entry.name
    scale = views["mlp.experts.w13_weight_scale_inv"]
    assert not torch.isfinite(scale[1, 0, 1]) and torch.isfinite(scale[0]).all()


def test_only_names_entries_of_the_plan(device):
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(
        ValueError,
        match=r"^only: 'mlp\.experts\.w13' is not an entry of this sparse layer's "
        r"plan \(entries: input_layernorm\.weight, ",
    ):
        convert_layer(sd, 2, out=buf, plan=plan, only={"input_layernorm.weight", "mlp.experts.w13"})
    with pytest.raises(TypeError, match=r"^only: expected a collection of entry names, got the str"):
        convert_layer(sd, 2, out=buf, plan=plan, only="input_layernorm.weight")
    assert (buf == 0xAB).all()


@pytest.mark.parametrize("check_finite", [True, False])
def test_only_without_quantized_entries(device, check_finite):
    """``only`` that selects passthrough entries only, a scale (its weight comes with it), or
    nothing: each writes exactly what it selects."""
    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    want = convert_layer_ref(_short(sd, 2), 2, plan)
    spans = {e.name: (e.offset, e.offset + e.nbytes) for e in plan.entries}
    for only, written in [
        (
            {"input_layernorm.weight", "mlp.gate.e_score_correction_bias"},
            {"input_layernorm.weight", "mlp.gate.e_score_correction_bias"},
        ),
        ({"mlp.experts.w2_weight_scale_inv"}, {"mlp.experts.w2_weight", "mlp.experts.w2_weight_scale_inv"}),
        (set(), set()),
    ]:
        buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
        needed = {s for e in plan.entries if e.name in written for s in e.sources}
        part = {k: t for k, t in sd.items() if k.removeprefix("model.layers.2.") in needed}
        got = convert_layer(part, 2, out=buf, plan=plan, only=only, check_finite=check_finite)
        for e in plan.entries:
            lo, hi = spans[e.name]
            if e.name in written:
                g, w = got["model.layers.2." + e.name], want["model.layers.2." + e.name]
                g, w = (g.view(torch.uint8), w.view(torch.uint8)) if e.op == "quantize" else (g, w)
                assert torch.equal(g.cpu(), w.cpu()), e.name
            else:
                assert (buf[lo:hi] == 0xAB).all(), e.name


def test_layer_keys_belong_to_the_layer(device):
    """Keys prefixed with this layer or short (taken as this layer's); a key of another layer, a
    name given both ways, or a decoder key among the non-layer tensors is refused naming it."""
    from glm_fp8.model.families import REST

    sd = make_layer(SMALL["glm-5"], 2, device)
    plan = plan_from_config(SMALL["glm-5"], 2)
    short = _short(sd, 2)
    got = convert_layer(short, 7, plan=plan)  # short names: this layer's, under its index
    assert list(got)[0] == "model.layers.7.input_layernorm.weight"
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    for layer_idx, bad, match in [
        (99, sd, r"model\.layers\.2\.input_layernorm\.weight: a key of another layer, but layer_idx=99"),
        (
            2,
            {**sd, "model.layers.20.input_layernorm.weight": sd["model.layers.2.input_layernorm.weight"]},
            r"model\.layers\.20\.input_layernorm\.weight: a key of another layer, but layer_idx=2",
        ),
        (
            2,
            {**sd, "input_layernorm.weight": short["input_layernorm.weight"]},
            r"input_layernorm\.weight: 'input_layernorm\.weight' is given twice",
        ),
        # What each index expects, and the index the key belongs to.
        (
            2,
            {"model.layers.20.input_layernorm.weight": short["input_layernorm.weight"]},
            r"but layer_idx=2 \(expected keys model\.layers\.2\.<name> or short names such as "
            r"input_layernorm\.weight\); pass it with layer_idx=20, its own layer",
        ),
        # REST (-1) is the non-layer tensors: said so, with their names, and no garbled prefix.
        (
            REST,
            {"model.layers.0.x": short["input_layernorm.weight"]},
            r"^.model\.layers\.0\.x: a decoder layer's key, but layer_idx=-1 \(REST: the non-layer tensors, "
            r"model\.embed_tokens\.weight, model\.norm\.weight, lm_head\.weight, under these full names\); "
            r"pass it with layer_idx=0, its own layer.$",
        ),  # the whole message (KeyError quotes it)
    ]:
        with pytest.raises(KeyError, match=match):
            convert_layer(bad, layer_idx, out=buf, plan=plan)
    assert (buf == 0xAB).all()


@pytest.mark.parametrize("layout", ["prime_rl", "hf", "hf_checkpoint"])
def test_a_layer_of_the_other_kind_is_named_as_such(device, layout):
    """A dense layer's tensors under a sparse layer's plan (or the reverse) say that the layer
    kinds differ, naming the user's own key (in their layout), not the first key of the plan's
    layout that is missing; nothing is written."""
    from glm_fp8.model.trainer_layouts import strip_layer
    from glm_fp8.testing import synthetic_layer

    config = SMALL["glm-5"]  # layer 0 dense, layers 1-2 sparse
    dense = strip_layer(synthetic_layer(config, 0, layout=layout), 0)
    sparse = strip_layer(synthetic_layer(config, 1, layout=layout), 1)
    router = "mlp.router.gate.weight" if layout == "prime_rl" else "mlp.gate.weight"  # the user's own name
    for layer_idx, layer, match in [
        (
            1,
            dense,
            r"model\.layers\.1\.mlp\.gate_proj\.weight: layer 1 is sparse \(MoE\) in this config but "
            r"the state dict holds a dense MLP; pass layer 1's own tensors \(its router and routed "
            r"experts: .*first_k_dense_replace",
        ),
        (
            0,
            sparse,
            rf"model\.layers\.0\.{router}: layer 0 is dense in this config but the state "
            r"dict holds a sparse \(MoE\) MLP; pass layer 0's own tensors \(a dense MLP: "
            r"mlp\.gate_proj\.weight",
        ),
        (
            3,
            dense,
            r"model\.layers\.3\.mlp\.gate_proj\.weight: layer 3 is the MTP layer, sparse \(MoE\), in "
            r"this config but the state dict holds a dense MLP",
        ),
    ]:
        plan = plan_from_config({**config, "num_nextn_predict_layers": 1, "vocab_size": 300}, layer_idx)
        buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
        with pytest.raises(KeyError, match=match):
            convert_layer({k: t.to(device) for k, t in layer.items()}, layer_idx, out=buf, plan=plan)
        assert (buf == 0xAB).all()

"""Trainers as they are: prime-rl stacks, Hugging Face modules and per-expert checkpoint names,
bf16 / fp32 masters, a float32 routing bias (docs/trainers.md).

Invariants: every trainer layout gives the same plan entries (the same manifest) and, for the
same values, the same kernel-format bytes as ``glm_fp8.kernels.reference.convert_layer_ref`` of
prime-rl's layout, bit for bit; quantized entries are quantized from the dtype the trainer
holds; passthrough entries of a config's plan are written in the engine's dtype (a float32 bias
bit for bit, a bf16 one widened exactly, a float32 norm rounded to nearest-even); tensors the
engine has no parameter for are left out with one warning; every shape, dtype and key mistake
of each layout is refused naming the key before a byte is written.
"""

import warnings

import pytest
import torch

import glm_fp8.model.plans
from glm_fp8.core.errors import NonFiniteError
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.plans import build_plan, plan_from_config, plans_for_model
from glm_fp8.model.presets import SMALL_CONFIGS, TINY_GLM5
from glm_fp8.model.trainer_layouts import (
    LAYOUTS,
    adapt_plan,
    relayout,
    source_rows,
    strip_layer,
    trainer_layout,
)
from glm_fp8.testing import synthetic_layer

BIAS = "mlp.gate.e_score_correction_bias"
FP32_BIAS = {"prime_rl": "mlp.expert_bias", "hf": BIAS, "hf_checkpoint": BIAS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, want, what=""):
    assert list(got) == list(want), what
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, (what, k)
        assert torch.equal(_bits(got[k]), _bits(w)), (what, k)


def _reference(config, i, master, bias_dtype=torch.float32, plan=None):
    """The oracle: prime-rl's tensors of the same values, the config's plan, the eager reference."""
    plan = plan or plan_from_config(config, i)
    layer = strip_layer(synthetic_layer(config, i, master, bias_dtype=bias_dtype), i)
    return convert_layer_ref({k: t for k, t in layer.items() if k in plan.inputs}, i, plan)


@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["glm-5", "glm-5.2"])
def test_every_layout_converts_to_the_reference(model, layout, master, device, monkeypatch):
    """GLM-5 and GLM-5.2 (layer 1 shares its indexer: a Hugging Face trainer still holds one,
    which is left out with one warning); a float32 routing bias lands bit for bit in float32."""
    config = SMALL_CONFIGS[model]
    monkeypatch.setattr(glm_fp8.model.plans, "_warned", set())
    warned = []
    for i in range(config["num_hidden_layers"]):
        plan = plan_from_config(config, i)
        sd = {k: t.to(device) for k, t in synthetic_layer(config, i, master, layout, torch.float32).items()}
        held_indexer = any(".indexer." in k for k in sd)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = convert_layer(sd, i, plan=plan)
        warned += [str(w.message) for w in record]
        _assert_same(got, _reference(config, i, master), (model, layout, i))
        if "/no-indexer" in plan.kind:
            assert held_indexer == (layout != "prime_rl")
        if plan.kind.startswith("sparse"):
            bias = got[f"model.layers.{i}.{BIAS}"]
            src = sd[f"model.layers.{i}.{FP32_BIAS[layout]}"]
            assert bias.dtype == torch.float32 and torch.equal(_bits(bias), _bits(src))
    shared_and_hf = model == "glm-5.2" and layout != "prime_rl"
    assert len(warned) == int(shared_and_hf)
    if shared_and_hf:
        assert "model.layers.1.self_attn.indexer." in warned[0] and "not sent" in warned[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_passthrough_dtypes_follow_the_engine(layout, device):
    """A bf16 bias is widened exactly to the engine's float32; a float32 master's norm is rounded
    to bf16 to nearest, ties to even, as vLLM's loader's copy_ does."""
    config = SMALL_CONFIGS["glm-5"]
    sd = synthetic_layer(config, 2, torch.float32, layout, bias_dtype=torch.bfloat16)
    sd = {k: t.to(device) for k, t in sd.items()}
    norm = "model.layers.2.input_layernorm.weight"
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20], dtype=torch.float32)
    sd[norm] = sd[norm].clone()
    sd[norm][: len(ties)] = ties.to(device)
    got = convert_layer(sd, 2, plan=plan_from_config(config, 2))
    assert got[norm].dtype == torch.bfloat16
    assert got[norm][:4].cpu().tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]  # ties to even, then above
    assert torch.equal(got[norm].cpu(), sd[norm].cpu().to(torch.bfloat16))
    bias = got[f"model.layers.2.{BIAS}"]
    src = sd[f"model.layers.2.{FP32_BIAS[layout]}"]
    assert src.dtype == torch.bfloat16 and bias.dtype == torch.float32
    assert torch.equal(bias.cpu(), src.cpu().float())


@pytest.mark.parametrize("model", sorted(SMALL_CONFIGS))
def test_layouts_share_one_manifest(model):
    """Every layout of every family's layers: the same entries, offsets and dtypes; a plan built
    from that layout's own tensor names is the relayout of the config's plan, sources included."""
    config = SMALL_CONFIGS[model]
    for i in model_layer_ids(config) + ([REST] if "vocab_size" in config else []):
        plan = plan_from_config(config, i)
        for layout in LAYOUTS:
            other = relayout(plan, layout)
            assert other.manifest() == plan.manifest() and other.nbytes == plan.nbytes, (model, i, layout)
            assert relayout(plan, layout) is other and relayout(other, "prime_rl") is plan  # cached
            fits = other if trainer_layout(other.inputs) == layout else plan  # common names fit any plan
            assert adapt_plan(plan, other.inputs) is fits and adapt_plan(other, other.inputs) is other
            built = build_plan(config["model_type"], other.inputs, model_dtype=torch.bfloat16)
            assert built.manifest() == plan.manifest(), (model, i, layout)
            assert [e.sources for e in built.entries] == [e.sources for e in other.entries]
            assert built.inputs == other.inputs and built.layout == trainer_layout(other.inputs)
            assert built.kind == plan.kind


def test_trainer_layout_is_told_from_the_names():
    assert trainer_layout(["input_layernorm.weight", "mlp.gate_proj.weight"]) == "prime_rl"  # dense
    assert trainer_layout(["model.embed_tokens.weight"]) == "prime_rl"
    assert trainer_layout(["mlp.experts.w1", "mlp.router.gate.weight"]) == "prime_rl"
    assert trainer_layout(["mlp.gate.weight", "mlp.shared_experts.up_proj.weight"]) == "hf"
    assert trainer_layout(["mlp.experts.gate_up_proj", "mlp.gate.weight"]) == "hf"
    assert trainer_layout(["mlp.gate.weight", "mlp.experts.7.down_proj.weight"]) == "hf_checkpoint"
    with pytest.raises(
        KeyError,
        match=r"mlp\.experts\.gate_up_proj: a hf name, but mlp\.experts\.w1 is a "
        r"prime_rl name; a layer's tensors follow one trainer layout",
    ):
        trainer_layout(["mlp.experts.w1", "mlp.experts.gate_up_proj"])
    with pytest.raises(
        KeyError,
        match=r"mlp\.experts\.3\.up_proj\.weight: a hf_checkpoint name, but "
        r"mlp\.experts\.gate_up_proj is a hf name",
    ):
        trainer_layout(["mlp.experts.gate_up_proj", "mlp.experts.3.up_proj.weight"])
    with pytest.raises(KeyError, match=r"mlp\.experts\.w13: not a tensor name of any trainer layout"):
        trainer_layout(["mlp.experts.w13"])


def test_per_expert_jobs_on_each_backend(backend, device):
    """hf_checkpoint: one job per expert and matrix (2E jobs in one group), on every backend."""
    config = {**SMALL_CONFIGS["glm-5"], "n_routed_experts": 5}
    plan = plan_from_config(config, 1)
    sd = {k: t.to(device) for k, t in synthetic_layer(config, 1, torch.float32, "hf_checkpoint").items()}
    assert sum(".experts." in k for k in sd) == 15
    _assert_same(convert_layer(sd, 1, plan=plan, backend=backend), _reference(config, 1, torch.float32))
    bw = plan_from_config(config, 1, target="blackwell")
    want = _reference(config, 1, torch.float32, plan=bw)
    _assert_same(convert_layer(sd, 1, plan=bw, backend=backend), want)


def _set(key, fn):
    def mutate(sd):
        sd[key] = fn(sd[key])

    return mutate


P = "model.layers.2."
# (layout, mutation, exception, message) for each shape, dtype and key mistake of each layout.
MISTAKES = [
    (
        "prime_rl",
        lambda sd: sd.pop(P + "mlp.experts.w3"),
        KeyError,
        r"mlp\.experts\.w3: missing; expected a tensor of shape \(3, 72, 200\)",
    ),
    (
        "prime_rl",
        _set(P + "mlp.experts.w1", lambda t: t.transpose(1, 2)),
        ValueError,
        r"mlp\.experts\.w1: expected shape \(3, 72, 200\), got \(3, 200, 72\)",
    ),
    (
        "prime_rl",
        _set(P + "mlp.expert_bias", lambda t: t.to(torch.int32)),
        TypeError,
        r"mlp\.expert_bias: expected a floating dtype .*got torch\.int32",
    ),
    (
        "hf",
        lambda sd: sd.pop(P + "mlp.experts.gate_up_proj"),
        KeyError,
        r"mlp\.experts\.gate_up_proj: missing; expected a tensor of shape \(3, 144, 200\)",
    ),
    (
        "hf",
        _set(P + "mlp.experts.gate_up_proj", lambda t: t[:, 1:]),
        ValueError,
        r"mlp\.experts\.gate_up_proj: expected shape \(3, 144, 200\), got \(3, 143, 200\)",
    ),
    (
        "hf",
        _set(P + "mlp.experts.down_proj", lambda t: t.double()),
        TypeError,
        r"mlp\.experts\.down_proj: expected dtype bfloat16, float16 or float32, got torch\.float64",
    ),
    (
        "hf",
        _set(P + "mlp.shared_experts.up_proj.weight", lambda t: t[None]),
        ValueError,
        r"mlp\.shared_experts\.up_proj\.weight: expected shape \(72, 200\), got \(1, 72, 200\)",
    ),
    (
        "hf",
        _set(P + BIAS, lambda t: t[:2]),
        ValueError,
        r"e_score_correction_bias: expected shape \(3,\), got \(2,\)",
    ),
    (
        "hf",
        lambda sd: sd.__setitem__(P + "mlp.experts.w1", sd[P + "mlp.experts.gate_up_proj"][:, :72]),
        KeyError,
        r"mlp\.experts\.w1: a prime_rl name, but .* is a hf.* name",
    ),
    (
        "hf_checkpoint",
        lambda sd: sd.pop(P + "mlp.experts.2.up_proj.weight"),
        KeyError,
        r"mlp\.experts\.2\.up_proj\.weight: missing; expected a tensor of shape \(72, 200\)",
    ),
    (
        "hf_checkpoint",
        lambda sd: sd.__setitem__(P + "mlp.experts.3.down_proj.weight", torch.zeros(200, 72)),
        KeyError,
        r"mlp\.experts\.3\.down_proj\.weight: unexpected key",
    ),
    (
        "hf_checkpoint",
        _set(P + "mlp.experts.1.down_proj.weight", lambda t: t.t()),
        ValueError,
        r"mlp\.experts\.1\.down_proj\.weight: expected shape \(200, 72\), got \(72, 200\)",
    ),
    (
        "hf_checkpoint",
        _set(P + "mlp.experts.0.gate_proj.weight", lambda t: t.half()),
        TypeError,
        r"mlp\.experts\.0\.up_proj\.weight: expected dtype torch\.float16 \(as .*mlp\.experts\.0\.gate_proj",
    ),
    (
        "hf_checkpoint",
        lambda sd: sd.__setitem__(P + "mlp.experts.gate_up_proj", torch.zeros(3, 144, 200)),
        KeyError,
        r"mlp\.experts\.gate_up_proj: a hf name, but .*mlp\.experts\.0\.gate_proj\.weight is a "
        r"hf_checkpoint name",
    ),
]


@pytest.mark.parametrize(
    "layout, mutate, exc, match", MISTAKES, ids=[f"{m[0]}-{k}" for k, m in enumerate(MISTAKES)]
)
def test_layout_mistakes_are_refused_before_writing(layout, mutate, exc, match, device):
    config = SMALL_CONFIGS["glm-5"]
    plan = plan_from_config(config, 2)
    sd = synthetic_layer(config, 2, torch.bfloat16, layout)
    mutate(sd)
    sd = {k: t.to(device) for k, t in sd.items()}
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    with pytest.raises(exc, match=r"model\.layers\.2\..*" + match if exc is not KeyError else match):
        convert_layer(sd, 2, out=buf, plan=plan)
    assert (buf == 0xAB).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_of_the_expert_stacks(layout, device):
    """A sender's experts [lo, hi): ``with_rows`` plans them (scales following), ``source_rows``
    gives their trainer tensors, and the conversion equals the reference's rows, bit for bit; the
    cut plan does not depend on the layout."""
    config = {**SMALL_CONFIGS["glm-5"], "n_routed_experts": 5}
    plan = plan_from_config(config, 2)
    sd = {k: t.to(device) for k, t in synthetic_layer(config, 2, torch.float32, layout).items()}
    layer = strip_layer(sd, 2)
    plan = adapt_plan(plan, layer)
    want = _reference(config, 2, torch.float32)
    stacks = ["mlp.experts.w13_weight", "mlp.experts.w2_weight"]
    for lo, hi in ((0, 2), (2, 5), (4, 4)):
        rows = {name: (lo, hi) for name in stacks}
        cut = plan.with_rows(rows)
        assert plan.with_rows(rows) is cut  # cached
        with_scales = {**rows, **{name + "_scale_inv": (lo, hi) for name in stacks}}
        assert plan.with_rows(with_scales).manifest() == cut.manifest()
        assert cut.manifest() == relayout(plan, "prime_rl").with_rows(rows).manifest()
        shapes = {e.name: e.shape for e in cut.entries}
        assert shapes["mlp.experts.w13_weight_scale_inv"] == (hi - lo, 2, 2)
        mine = cut.subset([n for e in cut.entries for n in (e.name,) if n.startswith("mlp.experts.")])
        inputs = {k: t for name in stacks for k, t in source_rows(plan, name, layer, lo, hi).items()}
        assert set(inputs) == set(mine.inputs)
        if layout == "hf_checkpoint":
            assert sorted(inputs) == sorted(
                f"mlp.experts.{j}.{p}_proj.weight" for j in range(lo, hi) for p in ("gate", "up", "down")
            )
        else:
            assert all(t._base is not None or t.numel() == 0 for t in inputs.values())  # views, no copies
        slot = torch.empty(mine.nbytes, dtype=torch.uint8, device=device)
        got = convert_layer(inputs, 2, plan=mine, out=slot)
        for name in mine.entries:
            key = "model.layers.2." + name.name
            assert torch.equal(_bits(got[key]), _bits(want[key][lo:hi])), (lo, hi, key)


def test_rows_of_the_embeddings_and_row_mistakes():
    config = TINY_GLM5
    rest = plan_from_config(config, REST)
    sd = synthetic_layer(config, REST, torch.float32)
    cut = rest.with_rows({"model.embed_tokens.weight": (10, 700)}).subset(["model.embed_tokens.weight"])
    got = convert_layer(source_rows(rest, "model.embed_tokens.weight", sd, 10, 700), REST, plan=cut)
    assert torch.equal(got["model.embed_tokens.weight"], sd["model.embed_tokens.weight"][10:700].bfloat16())
    plan = plan_from_config(config, 2)
    for rows, match in [
        (
            {"mlp.experts.w13_weight_scale_inv": (0, 1), "mlp.experts.w13_weight": (0, 2)},
            r"rows\['mlp\.experts\.w13_weight_scale_inv'\]: \(0, 1\), "
            r"but its weight 'mlp\.experts\.w13_weight' "
            r"has \(0, 2\); a scale follows its weight",
        ),
        ({"self_attn.indexer.wk_weights_proj.weight": (0, 1)}, r"only an expert stack .* got a concat entry"),
        (
            {"self_attn.o_proj.weight": (0, 1)},
            r"only an expert stack \(a 3-D entry\) .* got a quantize entry of shape \(256, 256\)",
        ),
        (
            {"mlp.experts.w2_weight": (1, 5)},
            r"rows\['mlp\.experts\.w2_weight'\]: expected \(lo, hi\) with 0 <= lo <= hi <= 4, got \(1, 5\)",
        ),
        ({"mlp.experts.w3": (0, 1)}, r"mlp\.experts\.w3: not an entry of this sparse layer's plan"),
    ]:
        with pytest.raises(ValueError, match=match):
            plan.with_rows(rows)
    with pytest.raises(KeyError, match=r"mlp\.experts\.w1: missing from the layer"):
        source_rows(plan, "mlp.experts.w13_weight", {}, 0, 1)


def test_the_mtp_layer_is_not_required():
    """A Hugging Face trainer does not model the MTP layer: its update lists the target only."""
    ids = model_layer_ids(TINY_GLM5, mtp=False)
    assert ids == [0, 1, 2, 3] and model_layer_ids(TINY_GLM5) == [0, 1, 2, 3, 4]
    plans = plans_for_model(TINY_GLM5, layer_ids=ids)
    assert [p.kind for p in plans] == ["dense", "dense", "sparse", "sparse"]


def test_nonfinite_in_a_layout_names_the_key(device):
    config = SMALL_CONFIGS["glm-5"]
    sd = {k: t.to(device) for k, t in synthetic_layer(config, 2, torch.float32, "hf_checkpoint").items()}
    sd["model.layers.2.mlp.experts.1.up_proj.weight"][5, 7] = float("nan")
    with pytest.raises(
        NonFiniteError,
        match=r"model\.layers\.2\.mlp\.experts\.1\.up_proj\.weight: nan at .*"
        r"\[5, 7\]",
    ):
        convert_layer(sd, 2, plan=plan_from_config(config, 2))


def test_reference_engine_params_reads_the_trainer_dtypes():
    """The engine-side reference that the transfer tests compare against is the eager reference
    of the trainer's own tensors, nothing cast: fp32 masters give fp32-quantized bytes in every
    entry, and a float32 bias lands exactly. ``gathered_dtype`` (a model of the bf16 gather
    opt-in only) casts the quantized entries' sources other than the routed-expert stacks."""
    from glm_fp8.engine import EngineLayout, engine_params
    from glm_fp8.testing import reference_engine_params

    layer = strip_layer(synthetic_layer(TINY_GLM5, 2, torch.float32), 2)
    own = reference_engine_params(TINY_GLM5, EngineLayout(), [2], dtype=torch.float32)
    opt_in = reference_engine_params(
        TINY_GLM5, EngineLayout(), [2], dtype=torch.float32, gathered_dtype=torch.bfloat16
    )
    want = convert_layer_ref(layer, 2, plan_from_config(TINY_GLM5, 2))
    targets = {p.kernel_name: p for p in engine_params(TINY_GLM5, EngineLayout()).values()}
    assert set(own) == {targets[k].name for k in want}
    for k, w in want.items():
        t = targets[k]
        assert torch.equal(_bits(own[t.name]), _bits(w.to(t.dtype))), k
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert own[bias].dtype == torch.float32 and torch.equal(_bits(own[bias]), _bits(layer["mlp.expert_bias"]))
    differ = {n for n in own if not torch.equal(_bits(own[n]), _bits(opt_in[n]))}
    cast = ("self_attn.o_proj", "self_attn.indexer.wq_b", "mlp.shared_experts.down_proj")
    assert {f"model.layers.2.{n}.weight" for n in cast} <= differ
    assert not any(".routed_experts." in n or "norm" in n or n == bias for n in differ), differ


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unquantized_plans_read_every_layout(layout, device):
    """bf16 mode: the expert stacks are row concatenations copied in the model dtype, per expert
    from per-expert sources, the same bytes as the reference."""
    config = SMALL_CONFIGS["glm-5"]
    plan = plan_from_config(config, 2, quantize=False)
    sd = {k: t.to(device) for k, t in synthetic_layer(config, 2, torch.float32, layout).items()}
    got = convert_layer(sd, 2, plan=plan)
    _assert_same(got, _reference(config, 2, torch.float32, plan=plan))
    assert got["model.layers.2.mlp.experts.w13_weight"].dtype == torch.bfloat16

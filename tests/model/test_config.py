"""Model configs as trainers hold them (docs/trainers.md#configs).

Invariants: a dict, an object with ``to_dict()`` (a transformers ``PretrainedConfig``) and a
config.json path give the same validated ``Config`` and the same plans everywhere a config is
taken; every config mistake (a required key missing, a wrong type, out of range, two keys that
disagree) is a ValueError ``config.<key>: ...`` naming the key, raised before anything else;
the routing bias is planned exactly when the engine builds it (``topk_method`` "noaux_tc").
"""

import json
import pickle
import warnings

import pytest
import torch

import glm_fp8.model.plans
from glm_fp8.engine import EngineLayout, engine_param_specs
from glm_fp8.integrations.prime_rl import convert_tt_layer_to_vllm_kernel
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.config import FAMILY_TRAITS, Config, as_config
from glm_fp8.model.families import FAMILIES, is_sparse_layer, layer_kind, layer_shapes, model_layer_ids
from glm_fp8.model.indexer import INDEXER_FAMILIES
from glm_fp8.model.plans import plan_from_config, plans_for_model
from glm_fp8.model.presets import PRESETS, SMALL_CONFIGS, SMALL_GLM5, TINY_GLM5, load_config
from glm_fp8.model.trainer_layouts import strip_layer
from glm_fp8.planning.memory import master_bytes_per_gpu
from glm_fp8.testing import synthetic_layer

GLM5 = SMALL_CONFIGS["glm-5"]  # 3 layers: 0 dense, 1-2 sparse
GLM45 = SMALL_CONFIGS["glm-4.5"]
QWEN3 = SMALL_CONFIGS["qwen3-moe"]

# Every int key the glm_moe_dsa family reads, required unless listed in _OPTIONAL.
_GLM5_INTS = [
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "n_routed_experts",
    "moe_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "intermediate_size",
    "vocab_size",
    "num_nextn_predict_layers",
]
_OPTIONAL = {"vocab_size", "num_nextn_predict_layers"}
_POSITIVE = set(_GLM5_INTS) - {"first_k_dense_replace", "num_nextn_predict_layers"}


def _without(config, key):
    return {k: v for k, v in config.items() if k != key}


def _rows():
    """(id, config, expected message) for every mistake of the table."""
    rows = []
    for key in sorted(set(_GLM5_INTS) - _OPTIONAL) + ["model_type"]:
        rows.append((f"missing-{key}", _without(GLM5, key), rf"^config\.{key}: missing; expected "))
    rows.append(
        (
            "missing-num_key_value_heads",
            _without(GLM45, "num_key_value_heads"),
            r"^config\.num_key_value_heads: missing",
        )
    )
    rows.append(("missing-num_experts", _without(QWEN3, "num_experts"), r"^config\.num_experts: missing"))
    for key in _GLM5_INTS:
        v = GLM5[key]
        for bad, kind in ((float(v), "float"), (True, "bool"), (str(v), "str")):
            want = rf"^config\.{key}: expected an integer in \[\d+, \d+\].*, got {bad!r} \({kind}\)$"
            rows.append((f"type-{key}-{kind}", {**GLM5, key: bad}, want))
    for key in sorted(_POSITIVE):
        for bad in (0, -3):
            want = rf"^config\.{key}: expected an integer in \[1, "
            rows.append((f"range-{key}-{bad}", {**GLM5, key: bad}, want))
    rows += [
        (
            "range-layers-1e9",
            {**GLM5, "num_hidden_layers": 10**9},
            r"^config\.num_hidden_layers: expected an integer in \[1, 4096\] \(the decoder layers\), "
            r"got 1000000000$",
        ),
        (
            "range-first_k-above-layers",
            {**GLM5, "first_k_dense_replace": 4},
            r"^config\.first_k_dense_replace: expected an integer in \[0, 3\]",
        ),
        (
            "range-first_k-negative",
            {**GLM5, "first_k_dense_replace": -1},
            r"^config\.first_k_dense_replace: expected an integer in \[0, 3\]",
        ),
        (
            "range-mtp-2",
            {**GLM5, "num_nextn_predict_layers": 2},
            r"^config\.num_nextn_predict_layers: expected an integer in \[0, 1\] \(MTP layers; only 0 or 1",
        ),
        (
            "range-shared-0",
            {**GLM5, "n_shared_experts": 0},
            r"^config\.n_shared_experts: expected an integer in \[1, 65536\] "
            r"\(this family always has a shared",
        ),
        (
            "range-experts-huge",
            {**GLM5, "n_routed_experts": 10**6},
            r"^config\.n_routed_experts: expected an int",
        ),
        (
            "range-index_topk_freq-0",
            {**GLM5, "index_topk_freq": 0},
            r"^config\.index_topk_freq: expected an int",
        ),
        ("range-moe_layer_freq-2", {**GLM5, "moe_layer_freq": 2}, r"^config\.moe_layer_freq: only 1"),
        (
            "type-tie-str",
            {**GLM5, "tie_word_embeddings": "no"},
            r"^config\.tie_word_embeddings: expected a bool",
        ),
        ("type-topk_method", {**GLM5, "topk_method": 1}, r"^config\.topk_method: expected a str"),
        ("type-model_type", {**GLM5, "model_type": ["glm_moe_dsa"]}, r"^config\.model_type: expected one of"),
        (
            "unknown-model_type",
            {**GLM5, "model_type": "llama"},
            r"^config\.model_type: expected one of .*'llama'",
        ),
        ("mla-q_lora-none", {**GLM5, "q_lora_rank": None}, r"^config\.q_lora_rank: MLA without a q LoRA"),
        ("mla-attention_bias", {**GLM5, "attention_bias": True}, r"^config\.attention_bias: expected False"),
        (
            "mlp_layer_types-disagree",
            {**GLM5, "mlp_layer_types": ["dense", "dense", "sparse"]},
            r"^config\.mlp_layer_types: layer 1 is 'dense', but first_k_dense_replace 1 makes it 'sparse'",
        ),
        (
            "mlp_layer_types-length",
            {**GLM5, "mlp_layer_types": ["dense", "sparse"]},
            r"^config\.mlp_layer_types: expected one entry per hidden layer \(3\), got 2$",
        ),
        (
            "mlp_layer_types-value",
            {**GLM5, "mlp_layer_types": ["dense", "moe", "sparse"]},
            r"^config\.mlp_layer_types: only 'dense' and 'sparse' are allowed, got \['moe'\]$",
        ),
        (
            "mlp_layer_types-str",
            {**GLM5, "mlp_layer_types": "dss"},
            r"^config\.mlp_layer_types: expected a list",
        ),
        (
            "indexer_types-length",
            {**GLM5, "indexer_types": ["full"] * 4},
            r"^config\.indexer_types: expected one entry per hidden layer \(3\), got 4$",
        ),
        (
            "indexer_types-value",
            {**GLM5, "indexer_types": ["full", "skip", "full"]},
            r"^config\.indexer_types: only 'full' and 'shared' are allowed",
        ),
        (
            "index_topk_pattern",
            {**GLM5, "index_topk_pattern": "FXF"},
            r"^config\.index_topk_pattern: expected a str",
        ),
        (
            "gqa-kv-divides",
            {**GLM45, "num_key_value_heads": 3},
            r"^config\.num_key_value_heads: expected a divisor of num_attention_heads \(4\), got 3$",
        ),
        (
            "gqa-head_dim",
            {**_without(GLM45, "head_dim"), "hidden_size": 202},
            r"^config\.head_dim: missing, and hidden_size 202 is not a multiple of num_attention_heads 4",
        ),
        (
            "qwen3-mlp_only_layers",
            {**QWEN3, "mlp_only_layers": [3]},
            r"^config\.mlp_only_layers: expected a list of layer indices in \[0, 2\]",
        ),
        (
            "qwen3-step-0",
            {**QWEN3, "decoder_sparse_step": 0},
            r"^config\.decoder_sparse_step: expected an int",
        ),
    ]
    return rows


ROWS = _rows()


@pytest.mark.parametrize("config, match", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_config_mistakes_are_named(config, match):
    """Each mistake raises ValueError naming the key, from as_config and from the entry points
    that take a config."""
    with pytest.raises(ValueError, match=match):
        as_config(config)
    with pytest.raises(ValueError, match=match):
        plans_for_model(config)


def test_config_of_the_wrong_kind_is_named():
    with pytest.raises(TypeError, match=r"^config: expected a dict, an object with to_dict\(\) .* got int$"):
        as_config(3)

    class Odd:
        def to_dict(self):
            return [1]

    with pytest.raises(ValueError, match=r"^config: Odd\.to_dict\(\) returned a list, expected a dict$"):
        as_config(Odd())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_and_small_configs_are_valid(name):
    for config in (PRESETS[name], SMALL_CONFIGS[name] if name in SMALL_CONFIGS else PRESETS[name]):
        assert as_config(config) == config
    for config in (SMALL_GLM5, TINY_GLM5, SMALL_CONFIGS["glm-5.2"]):
        assert as_config(config) == config


def test_family_traits_agree_with_the_rule_tables():
    """model/config.py's keys per family and model/families.py's tensors per family describe the
    same families."""
    assert set(FAMILY_TRAITS) == set(FAMILIES)
    assert INDEXER_FAMILIES == {t for t, f in FAMILY_TRAITS.items() if f.indexer}
    for t, (_, _, sparse) in FAMILIES.items():
        outs = {r.out for r in sparse}
        assert ("mlp.gate.e_score_correction_bias" in outs) == FAMILY_TRAITS[t].routing_bias, t
        assert ("mlp.shared_experts.down_proj.weight" in outs) == FAMILY_TRAITS[t].shared_experts, t


class HFLikeConfig:
    """What a transformers ``GlmMoeDsaConfig`` holds (configuration_glm_moe_dsa.py): attributes,
    derived ``mlp_layer_types`` / ``indexer_types`` / ``head_dim`` (= qk_rope_head_dim) /
    ``qk_head_dim``, undeclared config.json keys kept as attributes, all in ``to_dict()``."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        n = self.num_hidden_layers
        self.mlp_layer_types = ["dense"] * self.first_k_dense_replace + ["sparse"] * (
            n - self.first_k_dense_replace
        )
        if getattr(self, "indexer_types", None) is None:
            self.indexer_types = ["full"] * n
        self.head_dim = self.qk_rope_head_dim
        self.num_key_value_heads = self.num_attention_heads
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.layer_types = ["deepseek_sparse_attention"] * n

    def to_dict(self):
        return dict(self.__dict__)


def test_dict_object_and_path_give_the_same_config(tmp_path):
    as_dict = as_config(GLM5)
    obj = HFLikeConfig(**SMALL_CONFIGS["glm-5.2"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_CONFIGS["glm-5.2"]))
    forms = {"object": obj, "str": str(path), "PathLike": path, "directory": tmp_path}
    want = [p.manifest() for p in plans_for_model(SMALL_CONFIGS["glm-5.2"])]
    for name, form in forms.items():
        c = as_config(form)
        assert isinstance(c, Config) and c["topk_method"] == "noaux_tc", name
        assert [p.manifest() for p in plans_for_model(form)] == want, name
        assert layer_shapes(form, 1) == layer_shapes(SMALL_CONFIGS["glm-5.2"], 1), name
        assert model_layer_ids(form) == [0, 1, 2, 3], name
        assert master_bytes_per_gpu(form, 2) == master_bytes_per_gpu(SMALL_CONFIGS["glm-5.2"], 2), name
    assert load_config(config_path=path) == as_config(SMALL_CONFIGS["glm-5.2"])
    # a Config goes through as it is; it is read-only and survives pickling (spawned ranks)
    assert as_config(as_dict) is as_dict
    with pytest.raises(TypeError, match="Config is read-only"):
        as_dict["hidden_size"] = 1
    with pytest.raises(TypeError, match="Config is read-only"):
        as_dict.update(hidden_size=1)
    again = pickle.loads(pickle.dumps(as_dict))
    assert type(again) is Config and again == as_dict
    assert as_config({**as_dict, "num_hidden_layers": 2})["num_hidden_layers"] == 2


def test_engine_specs_and_testing_helpers_take_every_form(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_GLM5))
    obj = HFLikeConfig(**TINY_GLM5)
    want = engine_param_specs(TINY_GLM5, EngineLayout())
    for form in (path, str(path), obj):
        assert engine_param_specs(form, EngineLayout()) == want
        got = synthetic_layer(form, 2)
        for k, t in synthetic_layer(TINY_GLM5, 2).items():
            assert torch.equal(got[k], t), k


def test_unreadable_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"^config: cannot read '.*missing\.json': No such file"):
        as_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"^config: '.*bad\.json' is not JSON"):
        as_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"^config: '.*list\.json' holds a JSON list, expected an object"):
        as_config(tmp_path / "list.json")


def test_integer_scalars_of_numpy_and_torch_are_kept_as_plain_ints():
    """Config ints and an engine layout take what ``check_int`` takes (an integral scalar of numpy
    or torch) and keep the plain int, so plans and the JSON manifest never meet those types."""
    np = pytest.importorskip("numpy")
    c = as_config(
        {
            **GLM5,
            "hidden_size": np.int64(GLM5["hidden_size"]),
            "num_hidden_layers": torch.tensor(GLM5["num_hidden_layers"]),
        }
    )
    assert c == as_config(GLM5)
    assert type(c["hidden_size"]) is int and type(c["num_hidden_layers"]) is int
    layout = EngineLayout(tp_size=np.int64(2), tp_rank=torch.tensor(1))
    assert layout == EngineLayout(tp_size=2, tp_rank=1)
    assert type(layout.tp_size) is int and type(layout.tp_rank) is int
    with pytest.raises(ValueError, match=r"^config\.hidden_size: expected an integer in \[1, \d+\], got "):
        as_config({**GLM5, "hidden_size": np.float64(8.0)})


def test_multimodal_wrapper_gives_its_text_config():
    wrapped = {"model_type": "kimi_k25", "text_config": SMALL_CONFIGS["kimi-k2"]}
    assert as_config(wrapped) == SMALL_CONFIGS["kimi-k2"]


def test_mlp_layer_types_decide_without_first_k():
    """transformers' derived list alone decides dense vs sparse, per layer; without either key
    the family's dense layers are unknown: an error, not 0."""
    config = {**_without(GLM5, "first_k_dense_replace"), "mlp_layer_types": ["dense", "sparse", "dense"]}
    assert [is_sparse_layer(config, i) for i in range(3)] == [False, True, False]
    assert [p.kind for p in plans_for_model(config)] == ["dense", "sparse", "dense"]
    with pytest.raises(ValueError, match=r"^config\.first_k_dense_replace: missing"):
        layer_kind(_without(GLM5, "first_k_dense_replace"), 0)
    # with both, agreeing: accepted
    assert as_config({**GLM5, "mlp_layer_types": ["dense", "sparse", "sparse"]})


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_routing_bias_follows_topk_method(method, device, monkeypatch):
    """vLLM builds e_score_correction_bias only with topk_method "noaux_tc": without it the
    plans, the engine's parameters and the layer kinds have no bias, and a trainer's bias is left
    out (one warning) by the converter and the drop-in."""
    config = {**GLM5, "topk_method": method}
    plan = plan_from_config(config, 2)
    assert "mlp.gate.e_score_correction_bias" not in {e.name for e in plan.entries}
    assert plan.kind == "sparse/no-bias" and layer_kind(config, 2) == "sparse/no-bias"
    assert plan.manifest() == [
        m for m in plan_from_config(GLM5, 2).subset(e.name for e in plan.entries).manifest()
    ]  # the same entries, laid out without the bias
    tiny = {**TINY_GLM5, "topk_method": method}
    specs = engine_param_specs(tiny, EngineLayout())
    assert not any("e_score_correction_bias" in n for n in specs)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in engine_param_specs(TINY_GLM5, EngineLayout())
    sd = {k: v.to(device) for k, v in synthetic_layer(config, 2).items()}
    assert "model.layers.2.mlp.expert_bias" in sd  # trainers hold it whatever the config says
    monkeypatch.setattr(glm_fp8.model.plans, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = convert_layer(sd, 2, plan=plan)
        drop_in = convert_tt_layer_to_vllm_kernel(sd, 2, config=config)
    said = [str(w.message) for w in record]
    assert len(said) == 1 and "model.layers.2.mlp.expert_bias" in said[0] and "noaux_tc" in said[0]
    layer = {k: v for k, v in strip_layer(sd, 2).items() if k != "mlp.expert_bias"}
    want = convert_layer_ref(layer, 2, plan)
    assert list(got) == list(want) and list(drop_in) == list(want)
    for k, w in want.items():
        assert torch.equal(got[k].cpu().view(torch.uint8), w.cpu().view(torch.uint8)), k


def test_missing_topk_method_means_noaux_tc():
    plan = plan_from_config(_without(GLM5, "topk_method"), 2)
    assert "mlp.gate.e_score_correction_bias" in {e.name for e in plan.entries}

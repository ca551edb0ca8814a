"""The engine side: how a vLLM 0.34 worker of a given parallel layout holds each parameter
(docs/layouts.md, "Engine side (vLLM 0.34)"): ``EngineLayout`` (one rank's position, ``layout``),
``Shard`` / ``copy_shard_into`` (the cut of a kernel-format tensor), ``shard_for`` / ``ShardRules``
(which cut each entry gets, ``rules``), ``engine_param_specs`` / ``engine_name`` / ``engine_dtype``
(the rank's vLLM names, shapes and dtypes, ``specs``), and what vLLM derives after loading
(``postload``: MLA's ``W_UK_T`` / ``W_UV``, FlashInfer's w13 order, DeepGEMM's UE8M0 scales);
an SGLang 0.5.23 rank's layout and names (``sglang``: ``SGLangLayout``, ``sglang_name``).
Imports ``glm_fp8.core``, ``glm_fp8.model`` and the kernels' reference; nothing of the transfer."""

from glm_fp8.engine.layout import EngineLayout, Shard, copy_shard_into, take_shard
from glm_fp8.engine.rules import ShardRules, shard_for
from glm_fp8.engine.sglang import SGLangLayout, sglang_name
from glm_fp8.engine.specs import EngineParam, engine_dtype, engine_name, engine_param_specs, engine_params
from glm_fp8.model.families import mtp_layer_index

__all__ = [
    "EngineLayout",
    "EngineParam",
    "SGLangLayout",
    "Shard",
    "ShardRules",
    "copy_shard_into",
    "engine_dtype",
    "engine_name",
    "engine_param_specs",
    "engine_params",
    "mtp_layer_index",
    "shard_for",
    "sglang_name",
    "take_shard",
]

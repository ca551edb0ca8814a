"""The engine side: how a vLLM 0.34 worker of a given parallel layout holds each parameter
(docs/layouts.md, "Engine side (vLLM 0.34)"): ``EngineLayout`` (one rank's position), ``Shard`` /
``shard_for`` / ``copy_shard_into`` (the cut of a kernel-format tensor), ``engine_param_specs`` /
``engine_name`` / ``engine_dtype`` (the rank's vLLM names, shapes and dtypes)."""

from glm_fp8.engine.layout import EngineLayout, Shard, copy_shard_into, shard_for, take_shard
from glm_fp8.engine.specs import (
    EngineParam,
    engine_dtype,
    engine_name,
    engine_param_specs,
    engine_params,
    mtp_layer_index,
)

__all__ = [
    "EngineLayout",
    "EngineParam",
    "Shard",
    "copy_shard_into",
    "engine_dtype",
    "engine_name",
    "engine_param_specs",
    "engine_params",
    "mtp_layer_index",
    "shard_for",
    "take_shard",
]

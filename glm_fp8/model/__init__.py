"""What a model is to glm_fp8, before any tensor moves: its config (``config``; the presets and
small test configs it carries: ``presets``), its families' layers and the trainer tensors each
holds (``families``, ``indexer``), a layer's plan (``layer_plan``: the kernel-format entries and
their offsets in one buffer), the trainer layouts a layer may arrive in (``trainer_layouts``), and
plans built from a config or a state dict (``plans``). Imports only ``glm_fp8.core``."""

from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.layer_plan import LayerPlan, PlanEntry
from glm_fp8.model.plans import plan_from_config, plan_from_state_dict, plans_for_model
from glm_fp8.model.presets import PRESETS, SMALL_GLM5, TINY_GLM5, load_config
from glm_fp8.model.trainer_layouts import strip_layer

__all__ = [
    "PRESETS",
    "REST",
    "SMALL_GLM5",
    "TINY_GLM5",
    "LayerPlan",
    "PlanEntry",
    "as_config",
    "load_config",
    "model_layer_ids",
    "plan_from_config",
    "plan_from_state_dict",
    "plans_for_model",
    "strip_layer",
]

"""prime-rl integration: drop-ins for code written against prime-rl's conversion functions."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from glm_fp8.kernels.convert import convert_layer
from glm_fp8.model.config import as_config
from glm_fp8.model.families import layer_kind
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.plans import check_schedule, plan_from_state_dict, unsent_keys, warn_unsent
from glm_fp8.model.trainer_layouts import layer_prefix, strip_layer

_PLANS: dict[tuple, LayerPlan] = {}


def convert_tt_layer_to_vllm_kernel(
    state_dict: Mapping[str, torch.Tensor],
    layer_idx: int,
    quantize_fp8: bool = True,
    *,
    config: object = None,
) -> OrderedDict[str, torch.Tensor]:
    """prime-rl's signature: one trainer layer in kernel format, as views into one buffer.

    Same names, order, shapes, dtypes and bits as "torch.cat, then the reference quantizer"
    (``glm_fp8.kernels.reference.convert_layer_ref``). Plans are cached per layer shape. The buffer is
    allocated per call; use ``glm_fp8.kernels.convert.convert_layer(..., out=slot)`` to reuse one.

    The layer's entries follow its tensors (any trainer layout; passthrough entries in the
    tensors' dtypes): a layer without ``self_attn.indexer.*`` (an IndexShare "shared" layer)
    gets no indexer entries. Given the model ``config`` (anything ``glm_fp8.model.config.as_config``
    takes), tensors the engine has no parameter for (indexer tensors on a layer the schedule
    shares, a routing bias without ``topk_method`` "noaux_tc") are left out, said once per
    process, and a full layer without its indexer is refused (KeyError naming the layer's key)
    before anything is written.
    """
    layer = strip_layer(state_dict, layer_idx)
    if config is not None:
        c = as_config(config)
        unsent = unsent_keys(layer_kind(c, layer_idx), layer)
        warn_unsent(unsent, layer_prefix(layer_idx))
        layer = {k: t for k, t in layer.items() if k not in unsent}
        check_schedule(c, layer_idx, layer)
    key = (quantize_fp8, tuple(sorted((k, tuple(t.shape), t.dtype) for k, t in layer.items())))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = plan_from_state_dict(layer, quantize=quantize_fp8)
    return convert_layer(layer, layer_idx, plan=plan)

"""What a trainer rank hands ``Sender.send_model``: an iterable of ``(layer_idx, tensors)``
pairs, each a state dict or a module (its ``state_dict()``); anything else is refused with what
to pass instead, voted at the step it was found, so every rank stops there."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def layers_arg(layers: object) -> object:
    """``send_model``'s ``layers`` if it can be iterated for ``(layer_idx, state_dict)``
    pairs; a module (a whole model) or a mapping is refused, saying what to pass."""
    if isinstance(layers, torch.nn.Module):
        raise TypeError(
            f"layers: expected an iterable of (layer_idx, state_dict) pairs, got a {type(layers).__name__} "
            "module; pass its decoder layers, e.g. ((i, layer) for i, layer in "
            "enumerate(model.model.layers)) (a layer may be its module or its state_dict()), and the "
            "non-layer tensors as rest="
        )
    if isinstance(layers, (Mapping, str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(
            "layers: expected an iterable of (layer_idx, state_dict) pairs, got a "
            f"{type(layers).__name__}; for one layer pass [(layer_idx, state_dict)]"
        )
    return layers


def layer_item(item: object, pos: int, what: str = "layers") -> tuple[int, Mapping[str, torch.Tensor]]:
    """One ``(layer_idx, tensors)`` item of ``layers`` (``what``: the argument, for errors); a
    module stands for its ``state_dict()`` (parameters and buffers, e.g. the routing bias that
    transformers keeps as a buffer)."""
    if not (isinstance(item, tuple) and len(item) == 2):
        raise TypeError(
            f"{what}: item {pos}: expected a (layer_idx, state_dict) pair, got a {type(item).__name__}"
        )
    idx, sd = item
    if isinstance(sd, torch.nn.Module):
        sd = sd.state_dict()
    if not isinstance(sd, Mapping):
        raise TypeError(
            f"{what}: layer {idx}: expected a state dict (a mapping of names to tensors) or a module, "
            f"got a {type(sd).__name__}"
        )
    return idx, sd

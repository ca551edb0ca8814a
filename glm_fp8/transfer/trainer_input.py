"""What a trainer rank hands ``Sender.send_model``: an iterable of ``(layer_idx, tensors)``
pairs, each a state dict or a module (its ``state_dict()``); anything else is refused with what
to pass instead, voted at the step it was found, so every rank stops there; and the item of each
step, checked against the announced layers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from glm_fp8.core.errors import LayerOrderError
from glm_fp8.model.families import REST


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


def next_item(
    it: Iterator,
    pos: int,
    rest: Mapping[str, torch.Tensor] | None,
    layer_ids: Sequence[int],
    n_layers: int,
    has_rest: bool,
) -> tuple[int, Mapping[str, torch.Tensor]] | None:
    """The ``(layer_idx, state dict)`` of step ``pos`` from ``it`` (``layers``), the rest at the
    step after the ``n_layers`` announced ones (``has_rest``), None at COMPLETE; raises
    ``LayerOrderError`` when ``layers`` / ``rest`` disagree with the manifest (``layer_ids``)."""
    if pos == 0 and has_rest != (rest is not None):
        raise LayerOrderError(
            "rest: the manifest announced the non-layer tensors, none were given"
            if has_rest
            else "rest: given, but this Sender was built without rest=True (not in the manifest)"
        )
    if pos < n_layers:
        got = next(it, None)
        if got is None:
            raise LayerOrderError(f"layers: got {pos}, the manifest announced {n_layers}")
        got = layer_item(got, pos)
        if got[0] != layer_ids[pos]:
            raise LayerOrderError(
                f"layers: got layer {got[0]} at position {pos}; the manifest announced "
                f"layer {layer_ids[pos]} there (announced order: {layer_ids})"
            )
        return got
    if pos == n_layers and has_rest:
        return layer_item((REST, rest), pos, what="rest")
    extra = next(it, None)
    if extra is not None:
        raise LayerOrderError(f"layers: got layer {extra[0]} after the {n_layers} the manifest announced")
    return None

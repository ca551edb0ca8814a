"""``check_params``: what ``Receiver.load_into`` refuses of an engine rank's parameters before the
first byte arrives. Invariant: every parameter an update writes is its own memory (no two names
share a byte, no element appears twice in one tensor) unless declared in ``aliases=`` as the very
same tensor, and each refusal names the parameter. Written silently, such parameters would receive
one entry's bytes on top of another's."""

from __future__ import annotations

import pytest
import torch

from glm_fp8.transfer.land import Expected, check_params

CPU = torch.device("cpu")
EXPECTED = [
    Expected("a.weight", torch.bfloat16, (4, 8)),
    Expected("b.weight", torch.bfloat16, (4, 8)),
    Expected("head", torch.bfloat16, (2, 8)),
]


def _params():
    g = torch.Generator().manual_seed(0)
    return {e.name: torch.randn(e.shape, generator=g).to(e.dtype) for e in EXPECTED}


def test_own_tensors_pass():
    check_params(_params(), EXPECTED, CPU, {})


def _shared(p):
    p["b.weight"] = p["a.weight"]


def _overlapping_views(p):
    both = torch.zeros(6, 8, dtype=torch.bfloat16)
    p["a.weight"], p["b.weight"] = both[:4], both[2:]


def _expanded(p):
    p["a.weight"] = torch.zeros(1, 8, dtype=torch.bfloat16).expand(4, 8)


def _interleaved(p):
    # disjoint elements, but interleaved: refused too, as the check compares byte spans
    both = torch.zeros(4, 16, dtype=torch.bfloat16)
    p["a.weight"], p["b.weight"] = both[:, 0::2], both[:, 1::2]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_shared, r"params\['b\.weight'\]: shares memory with params\['a\.weight'\]"),
        (_overlapping_views, r"params\['b\.weight'\]: shares memory with params\['a\.weight'\]"),
        (_expanded, r"params\['a\.weight'\]: dimension 0 has stride 0"),
        (_interleaved, r"byte spans overlap"),
    ],
)
def test_parameters_sharing_memory_are_refused_naming_them(mutate, match):
    p = _params()
    mutate(p)
    with pytest.raises(ValueError, match=match):
        check_params(p, EXPECTED, CPU, {})


def test_a_declared_alias_must_be_the_same_tensor_and_is_not_counted_as_sharing():
    """vLLM's MTP drafter holds the target's lm_head as its ``shared_head.head``."""
    p = _params()
    p["b.weight"] = p["a.weight"]
    check_params(p, EXPECTED, CPU, {"b.weight": "a.weight"})
    p["b.weight"] = p["a.weight"].clone()
    with pytest.raises(ValueError, match=r"aliases: params\['b\.weight'\] is not the same tensor"):
        check_params(p, EXPECTED, CPU, {"b.weight": "a.weight"})
    del p["b.weight"]
    with pytest.raises(KeyError, match="both must be in params"):
        check_params(p, EXPECTED, CPU, {"b.weight": "a.weight"})


@pytest.mark.parametrize(
    "name, value, exc, match",
    [
        ("head", None, KeyError, r"params: missing 'head'"),
        ("head", torch.zeros(2, 8), ValueError, r"params\['head'\]: expected torch\.bfloat16 \(2, 8\)"),
        ("head", torch.zeros(2, 7, dtype=torch.bfloat16), ValueError, r"expected torch\.bfloat16"),
        ("head", [[0.0] * 8] * 2, TypeError, r"params\['head'\]: expected a torch\.Tensor"),
        ("head", torch.zeros(2, 8, dtype=torch.bfloat16, requires_grad=True), ValueError, "requires grad"),
    ],
)
def test_a_wrong_parameter_is_named(name, value, exc, match):
    p = _params()
    if value is None:
        del p[name]
    else:
        p[name] = value
    with pytest.raises(exc, match=match):
        check_params(p, EXPECTED, CPU, {})


def test_empty_parameters_share_nothing():
    """A zero-size parameter (an engine rank holding no rows of an entry) has no bytes to share."""
    expected = [Expected("x", torch.bfloat16, (0, 8)), Expected("y", torch.bfloat16, (0, 8))]
    empty = torch.zeros(0, 8, dtype=torch.bfloat16)
    check_params({"x": empty, "y": empty}, expected, CPU, {})

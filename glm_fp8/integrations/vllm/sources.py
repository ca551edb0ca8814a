"""What a trainer hands glm_fp8's vLLM backend each step: its layers, as ``(layer_idx, state_dict)``
(docs/vllm.md#sources). Two kinds, vLLM-free:

- ``LayerSource``: glm_fp8's own, a function that yields the layers asked for (each trainer rank
  its own, sharded or not, as ``Sender.send_model`` takes them) and one that gives the
  non-layer tensors;
- ``WeightSourceLayers``: vLLM's ``WeightSource`` (e.g. ``ModuleSource`` over a module of
  DTensors, or glm_fp8's ``ModuleStateSource``, which adds the module's persistent buffers), its
  tensors grouped into layers by name: ``iter_full()`` (full tensors, for one sender; every
  trainer rank iterates it, for the gathers) or ``iter_local()`` (each rank's own pieces, for many
  senders, made DTensors again from the source's placements). Its metadata is checked at init
  against every tensor the transfer plan needs, before anything moves (``check_metadata``).

Both serve the layers of a step session by session (the target's, then the MTP layer in vLLM's
draft session) from one pass over the source per step: a layer that comes before it is asked for
(the embeddings, which a module yields first; the MTP layer) is held until then.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from glm_fp8.core.numerics import INPUT_DTYPES
from glm_fp8.model.families import REST, REST_RULES, model_layer_ids, mtp_layer_index
from glm_fp8.model.plans import plan_from_config, unsent_keys
from glm_fp8.model.trainer_layouts import adapt_plan, layer_prefix, trainer_layout

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_REST_NAMES = frozenset(r.out for r in REST_RULES)
# Trainer tensors of the routed-expert stacks, in every layout: their placement decides many senders.
_EXPERT_STACK = re.compile(r"\.mlp\.experts\.(w1|w2|w3|gate_up_proj|down_proj)$")


@dataclass
class LayerSource:
    """glm_fp8's own source. ``layers(layer_ids)`` yields ``(layer_idx, state_dict)`` for exactly
    those layers in that order (names with or without the ``model.layers.{i}.`` prefix, any trainer
    layout, DTensors or plain tensors); ``rest()`` gives ``model.embed_tokens.weight``,
    ``model.norm.weight`` and ``lm_head.weight`` (None: the trainer sends no non-layer tensors).
    ``layer_ids``: the decoder layers the trainer holds (default: every one of the config's);
    ``mtp``: it holds the MTP layer too; ``experts_whole``: every trainer rank holds whole experts,
    ``torch.chunk`` over the trainer ranks in order (FSDP2 or expert parallel ``Shard(0)``), so each
    can send its own (many senders)."""

    layers: Callable[[Sequence[int]], Iterable[tuple[int, Mapping[str, torch.Tensor]]]]
    rest: Callable[[], Mapping[str, torch.Tensor]] | None = None
    layer_ids: Sequence[int] | None = None
    mtp: bool = False
    experts_whole: bool = False


def group_names(names: Sequence[str], config: Mapping) -> dict[int, list[str]]:
    """A model's parameter names by layer: ``model.layers.{i}.*`` under ``i`` (the MTP layer's
    index too), the non-layer tensors under ``REST``. ValueError naming a name of neither."""
    n_layers, mtp = config["num_hidden_layers"], mtp_layer_index(config)
    out: dict[int, list[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            idx = int(m.group(1))
            if idx >= n_layers and idx != mtp:
                raise ValueError(
                    f"source: {name}: layer {idx} is not a layer of the model (0..{n_layers - 1}"
                    f"{f', MTP {mtp}' if mtp is not None else ''})"
                )
            out.setdefault(idx, []).append(name)
        elif name in _REST_NAMES:
            out.setdefault(REST, []).append(name)
        else:
            raise ValueError(
                f"source: {name}: not a decoder-layer tensor (model.layers.<i>.*) nor one of "
                f"{sorted(_REST_NAMES)}; glm_fp8 cannot send it to the engine"
            )
    return out


class WeightSourceLayers:
    """vLLM's ``WeightSource`` as layers. ``local``: read ``iter_local()`` (many senders) instead of
    ``iter_full()`` (one sender). ``rank``: this trainer rank; ``trainer_ranks``: how many there are
    (the ranks of ``torch.distributed``'s default group). ``device``: where ``iter_local``'s
    DTensors are made (their mesh's device type)."""

    def __init__(
        self,
        source: object,
        config: Mapping,
        *,
        rank: int,
        trainer_ranks: int,
        local: bool,
        device: torch.device | str = "cpu",
    ):
        for attr in ("metadata", "iter_full", "iter_local"):
            if not hasattr(source, attr):
                raise TypeError(
                    f"source: expected a vLLM WeightSource (metadata, iter_full, iter_local) or a "
                    f"glm_fp8 LayerSource, got {type(source).__name__} without {attr!r}"
                )
        self.source, self.config, self.rank, self.local = source, config, rank, local
        self.metas = {m.name: m for m in source.metadata}
        self.groups = group_names(list(self.metas), config)
        mtp = mtp_layer_index(config)
        self.layer_ids = [i for i in model_layer_ids(config, mtp=False) if i in self.groups]
        self.mtp = mtp is not None and mtp in self.groups
        self.rest = REST in self.groups
        trainer_layout(
            [n.split(".", 3)[-1] for n in self.metas if _LAYER.match(n)] or ["input_layernorm.weight"]
        )
        check_metadata(source, self.metas, self.groups, config)
        self.experts_whole = self._experts_whole(trainer_ranks)
        self.device = torch.device(device)
        self._meshes: dict[tuple, object] = {}
        self._pass: Iterator | None = None
        self._held: dict[int, dict[str, torch.Tensor]] = {}

    def _experts_whole(self, trainer_ranks: int) -> bool:
        """Every expert stack is ``Shard(0)`` over all trainer ranks in order (whole experts each)."""
        stacks = [m for n, m in self.metas.items() if _EXPERT_STACK.search(n)]
        want = tuple(range(trainer_ranks))
        return (
            bool(stacks)
            and trainer_ranks > 1
            and all(
                m.owners == want
                and tuple(m.mesh_shape or ()) == (trainer_ranks,)
                and m.placements is not None
                and len(m.placements) == 1
                and getattr(m.placements[0], "dim", None) == 0
                for m in stacks
            )
        )

    def begin_step(self) -> None:
        """Start this step's one pass over the source."""
        self._pass = iter(self.source.iter_local() if self.local else self.source.iter_full())
        self._held = {}

    def drain(self) -> None:
        """Finish the pass (a rank that sends nothing still takes part in its gathers)."""
        for _ in self._pass or ():
            pass

    def _layer(self, idx: int) -> dict[str, torch.Tensor]:
        """Layer ``idx``'s tensors, from those held or the pass (holding what comes before it)."""
        want = set(self.groups[idx])
        got = self._held.pop(idx, {})
        while len(got) < len(want):
            name, t = next(self._pass)
            if self.local:
                t = self._as_dtensor(name, t)
            m = _LAYER.match(name)
            key = int(m.group(1)) if m else REST
            if key == idx:
                got[name] = t
            else:
                self._held.setdefault(key, {})[name] = t
        return got

    def session(self, layer_ids: Sequence[int], rest: bool) -> tuple[Iterator, Mapping | None]:
        def layers():
            for i in layer_ids:
                yield i, self._layer(i)

        return layers(), (LazyMapping(lambda: self._layer(REST)) if rest else None)

    def _as_dtensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``iter_local``'s piece as the DTensor it was cut from (its mesh made once per owners)."""
        m = self.metas[name]
        if m.owners is None or m.placements is None:
            return local
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        key = (tuple(m.owners), tuple(m.mesh_shape))
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh(self.device.type, torch.tensor(m.owners).reshape(m.mesh_shape))
        placements = [Shard(p.dim) if hasattr(p, "dim") else Replicate() for p in m.placements]
        return DTensor.from_local(
            local,
            self._meshes[key],
            placements,
            run_check=False,
            shape=torch.Size(m.shape),
            stride=torch.empty(m.shape, device="meta").stride(),
        )


def check_metadata(
    source: object, metas: Mapping[str, object], groups: Mapping[int, list[str]], config: Mapping
) -> None:
    """Every tensor the transfer plan needs of each layer the source holds (and of the non-layer
    tensors), by name, global shape and dtype, from the source's metadata alone: a missing or
    misshapen tensor is refused at init, naming it, before any engine is touched (an update would
    otherwise raise at that layer after the layers before it landed on every engine)."""
    for idx, names in groups.items():
        prefix = layer_prefix(idx)
        held = {n[len(prefix) :]: metas[n] for n in names}
        try:
            plan = adapt_plan(plan_from_config(config, idx), held, prefix=prefix)
        except KeyError as exc:  # a layer of the other kind, or names of two layouts
            raise ValueError(f"source: {exc.args[0]}") from None
        missing = [k for k in plan.inputs if k not in held]
        if missing:
            raise ValueError(_missing(source, prefix + missing[0], plan.inputs[missing[0]][0]))
        unsent = unsent_keys(plan.kind, held)
        extra = sorted(k for k in held if k not in plan.inputs and k not in unsent)
        if extra:
            raise ValueError(
                f"source: {prefix}{extra[0]}: unexpected tensor; the plan of this {plan.kind} layer "
                f"({plan.layout} trainer layout) has no entry for it"
            )
        for k, (shape, _) in plan.inputs.items():
            meta = held[k]
            if tuple(meta.shape) != tuple(shape):
                raise ValueError(
                    f"source: {prefix}{k}: expected global shape {tuple(shape)} (the config's), the "
                    f"source's metadata says {tuple(meta.shape)}"
                )
            if meta.dtype not in INPUT_DTYPES:
                raise ValueError(
                    f"source: {prefix}{k}: expected bfloat16, float16 or float32, the source's metadata "
                    f"says {meta.dtype}"
                )


def _missing(source: object, name: str, shape: tuple) -> str:
    head = f"source: {name}: missing from the source's metadata (expected shape {tuple(shape)}); "
    if type(source).__name__ == "ModuleSource":
        return head + (
            "vLLM's ModuleSource reads named_parameters() only, and a transformers model holds "
            "this tensor as a buffer (e_score_correction_bias is one): pass "
            "glm_fp8.integrations.vllm.ModuleStateSource(model), which reads its parameters and "
            "persistent buffers"
        )
    return head + (
        "every tensor of a layer the source holds must be in it (a module's buffers too: "
        "glm_fp8.integrations.vllm.ModuleStateSource(model) reads parameters and persistent buffers)"
    )


# --- a WeightSource over a module's parameters and persistent buffers ----------------------------


@dataclass(frozen=True)
class Shard:
    """vLLM's ``Shard``: this mesh axis splits tensor dim ``dim`` as ``torch.chunk`` does."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """vLLM's ``Replicate``: every coordinate along this mesh axis holds the whole tensor."""


@dataclass(frozen=True)
class TensorMeta:
    """vLLM's ``ParamMeta`` fields: name, dtype, global shape; ``owners`` (trainer ranks, None:
    every rank), ``mesh_shape``, ``placements`` (None: replicated)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple | None = None


class ModuleStateSource:
    """A ``WeightSource`` (vLLM 0.34's contract: ``metadata``, ``iter_full``, ``iter_local``, read
    exactly as vLLM's ``ModuleSource`` reads them) over a module's parameters **and persistent
    buffers**, in module order: what ``module.state_dict()`` holds. A Hugging Face transformers
    model keeps tensors the engine loads as buffers (GLM-5's and DeepSeek-V3's routing bias
    ``mlp.gate.e_score_correction_bias``, float32), which vLLM's ``ModuleSource`` never sends.

    ``module``: a ``torch.nn.Module`` (plain tensors, FSDP2 or DTensor parameters; buffers stay
    plain tensors under FSDP2, owned by every rank), or vLLM's ``ModuleSource`` (its module is
    read). Metadata reads global shapes and never gathers; shard the module first."""

    def __init__(self, module: object):
        inner = getattr(module, "_module", None)
        if not isinstance(module, torch.nn.Module) and isinstance(inner, torch.nn.Module):
            module = inner  # vLLM's ModuleSource(model)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"ModuleStateSource: expected a torch.nn.Module (or vLLM's ModuleSource of one), got "
                f"{type(module).__name__}"
            )
        self.module = module

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters, then persistent buffers, of each module in ``named_modules`` order; a tensor
        shared by two names (tied weights) once, under its first name, as ``named_parameters``."""
        seen: set[int] = set()
        for mod_name, mod in self.module.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            tensors = list(mod._parameters.items()) + [
                (n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set
            ]
            for name, t in tensors:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield prefix + name, t

    @cached_property
    def metadata(self) -> list[TensorMeta]:
        out = []
        for name, t in self._named():
            layout = _dtensor_layout(t)
            if layout is None:
                out.append(TensorMeta(name, t.dtype, tuple(t.shape)))
            else:
                out.append(TensorMeta(name, t.dtype, tuple(t.shape), *layout))
        return out

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named():
            if _is_member(t):
                yield name, t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named():
            if not _is_member(t):
                continue
            layout = _dtensor_layout(t)
            if layout is None:
                yield name, t
            elif layout[2] is None:  # not plain Shard / Replicate: declared replicated, sent whole
                yield name, t.full_tensor()
            else:
                yield name, t.to_local()


def _dtensor_layout(t: torch.Tensor) -> tuple[tuple, tuple, tuple | None] | None:
    """(owners, mesh_shape, placements) of a DTensor, None for a plain tensor; placements None when
    not plain ``Shard`` / ``Replicate`` or all ``Replicate`` (vLLM's ``_dtensor_layout`` and
    ``ParamMeta``'s normalisation)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return None
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    grid = mesh.mesh
    owners, shape = tuple(grid.flatten().tolist()), tuple(grid.shape)
    places: list = []
    for p in t.placements:
        if type(p) is TorchShard:
            places.append(Shard(p.dim))
        elif type(p) is TorchReplicate:
            places.append(Replicate())
        else:
            return owners, shape, None
    return owners, shape, None if all(isinstance(p, Replicate) for p in places) else tuple(places)


def _is_member(t: torch.Tensor) -> bool:
    mesh = getattr(t, "device_mesh", None)
    return mesh is None or mesh.get_coordinate() is not None


class LazyMapping(Mapping):
    """A mapping read on first use: the non-layer tensors, which a module yields around its layers
    (the embeddings first, the final norm and head last) and which travel after them."""

    def __init__(self, read: Callable[[], Mapping]):
        self._read, self._got = read, None

    def _data(self) -> Mapping:
        if self._got is None:
            self._got = dict(self._read())
        return self._got

    def __getitem__(self, key):
        return self._data()[key]

    def __iter__(self):
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())


__all__ = [
    "LayerSource",
    "LazyMapping",
    "ModuleStateSource",
    "WeightSourceLayers",
    "check_metadata",
    "group_names",
]

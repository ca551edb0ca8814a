"""What a ``Sender`` and a ``Receiver`` are built with, as typed options checked in one place.

``UpdateOptions`` holds what every rank of a link passes alike (the manifest vote refuses a rank
whose differs); ``SendOptions`` adds what only a sending trainer rank chooses, ``ReceiveOptions``
what only an engine rank does. ``Sender(comm, src, options)`` and ``Receiver(comm, src, options)``
take one, a mapping of its fields, or its fields as keywords (``Sender(comm, 0, config=c,
ring=3)``): one definition, one docstring per field, one check (``__post_init__``), whichever way
a caller passes them. What needs the link (a sender's rank, the engines list's length) is checked
when the endpoint has its link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.core.vocab import (
    GATHERS,
    KEPT_COPIES,
    SCALE_FORMATS,
    WIRE_FORMATS,
    Gather,
    KeptCopy,
    ScaleFormat,
    WireFormat,
    check_choice,
)
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.transfer.wire import MAX_MANIFEST_BYTES

MAX_RING = 16  # layer buffers an endpoint may keep
MAX_STEP_LAYERS = 64  # layers one step may carry (a bound on a typo, as MAX_RING)

Opts = TypeVar("Opts", bound="UpdateOptions")


@dataclass(frozen=True)
class DeltaOptions:
    """``SendOptions.delta``: send each layer as the changes of its segments' bytes since the
    update the engine ranks hold (docs/delta.md#in-the-transfer)."""

    resync_every: int | None = None
    """Every N-th update of this sender (its first included) is dense for every layer; None: only
    where the versions call for it."""
    kept: KeptCopy = "gpu"
    """Where the sender keeps what it last sent (its whole share): "gpu", or "host" (pinned host
    memory, nothing of it on the GPU: the comparison reads it over PCIe and writes its changed
    bytes back in place, through the GPU's mapping of that memory; on an H100 a delta update then
    took 0.358x of the dense one, against 0.101x kept on the GPU in the same run, bound by that
    read over PCIe: docs/delta.md#in-the-transfer)."""
    graphs: bool = True
    """On CUDA, capture each layer's kernels after its gathers (conversion, packing, comparison)
    as a CUDA graph once its tensors are where they were at the update before, and replay it
    while they stay there: one launch a layer instead of a few hundred (docs/delta.md#graphs).
    On an H100 it halved a GLM-5 layer's delta step (3.7 to 2.2 ms). False: queue them one by one
    at every update (a trainer whose kernels cannot be captured, or to compare)."""

    def __post_init__(self):
        r = self.resync_every
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"delta: resync_every expected None or an integer >= 1, got {r!r}")
        check_choice("delta.kept", self.kept, KEPT_COPIES)
        if not isinstance(self.graphs, bool):
            raise ValueError(f"delta.graphs: expected True or False, got {self.graphs!r}")


@dataclass(frozen=True, kw_only=True)
class UpdateOptions:
    """What every rank of the link passes alike, senders and engine ranks."""

    config: Mapping | None = None
    """The model config: plans for every layer are built from it. Exactly one of ``config`` and
    ``plans``; the manifest needs them before the first layer is sent."""
    plans: Sequence[LayerPlan] | None = None
    """One ``LayerPlan`` per layer of ``layer_ids``, instead of ``config``."""
    layer_ids: Sequence[int] | None = None
    """The layers of each update, in order (default: every decoder layer;
    ``glm_fp8.model.families.model_layer_ids(config)`` adds the MTP layer); ``send_model`` must be
    handed exactly these layers in this order."""
    rest: bool = False
    """Each update also carries the non-layer tensors (``model.embed_tokens.weight``,
    ``model.norm.weight``, ``lm_head.weight``), after the last layer. Needs ``config``."""
    scale_fmt: ScaleFormat | None = None
    """"fp32" (the default) or "ue8m0": power-of-two block scales, as vLLM's DeepGEMM kernels hold
    them (the default on Hopper in vLLM 0.34, and on Blackwell). Needs ``config``."""
    engines: Sequence[EngineLayout | str | None] | None = None
    """One entry per link rank: None at each sender, the rank's ``EngineLayout`` (it receives only
    its shard: scatter) or "full" (every entry whole). Default: every rank but the senders "full",
    a full broadcast."""
    senders: Sequence[int] | None = None
    """The link ranks that send, in the order of the expert chunks they hold (default: ``[src]``).
    With several, each converts and sends its own experts and the entries it owns
    (docs/layouts.md#the-transfer-plan)."""
    holders: Mapping[int, Sequence[int] | Mapping[str, Sequence[int]]] | None = None
    """Which senders hold which layers, for a trainer whose ranks hold different layers (pipeline
    stages: docs/trainers.md#megatron-core): layer index (``glm_fp8.model.families.REST``, -1, for
    the non-layer tensors) to the link ranks of the senders that hold it, in the order of the
    expert chunks they hold; or, for a layer whose entries are held apart (the embeddings on the
    first stage, the head on the last), kernel-format entry name to those link ranks. A layer's
    expert stacks (and its largest matrices) are divided among its holders, every other entry is
    owned by one of them; a sender hands ``send_model`` only what it holds (nothing of a layer it
    does not hold). Layers and entries not named: every sender holds them. Many senders only."""
    step_layers: int = 1
    """The most layers one step of the update carries. With more than 1, consecutive layers of
    ``layer_ids`` held by disjoint senders (``holders``: a pipeline-parallel trainer's stages,
    ordered one layer of each stage in turn by ``MegatronSource.stage_layer_ids``) share a step,
    so every stage's senders send at once instead of each stage in its own steps. Costs memory on
    the engine ranks: each ring slot holds a whole step (``TransferPlan.receiver_bytes``). A delta
    update carries one layer a step."""
    wire: WireFormat = "fp8"
    """The wire format: "fp8" ships kernel-format fp8 entries; "bf16" ships them unquantized, for
    receivers that quantize on receive (one sender, full broadcast only)."""
    checksum: bool = True
    """Every segment carries a checksum its receivers verify. A receiver with ``checksum=True``
    refuses an update without; with False it verifies them when they come."""
    ring: int = 2
    """Layer buffers: a sender converts layer i+1 while layer i is sent (1 serializes); an engine
    rank receives layer i+1 while layer i waits for its vote (at least 2)."""
    device: torch.device | str | None = None
    """Where conversion runs, the ring lives and parameters are expected (default: the current
    CUDA device, else the CPU)."""

    def __post_init__(self) -> None:
        check_choice("wire", self.wire, WIRE_FORMATS)
        if (self.config is None) == (self.plans is None):
            raise ValueError("config / plans: pass exactly one of them")
        check_choice("scale_fmt", self.scale_fmt, SCALE_FORMATS, also=(None,))
        if self.plans is not None and self.rest:
            raise ValueError("rest: needs config= (the non-layer tensors' plan is built from it)")
        if self.plans is not None and self.scale_fmt is not None:
            raise ValueError("scale_fmt: with plans=, the plans' own scale_fmt is used; pass config= instead")
        for key in ("rest", "checksum"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: expected True or False, got {getattr(self, key)!r}")
        if self.layer_ids is not None and (
            isinstance(self.layer_ids, (str, bytes)) or not isinstance(self.layer_ids, Iterable)
        ):
            raise ValueError(
                f"layer_ids: expected a list of layer indices, got {type(self.layer_ids).__name__}"
            )
        if self.senders is not None and (
            isinstance(self.senders, (str, bytes)) or not isinstance(self.senders, Iterable)
        ):
            raise ValueError(f"senders: expected a list of link ranks, got {type(self.senders).__name__}")
        if self.holders is not None:
            check_holders(self.holders)
        check_int("step_layers", self.step_layers, 1, MAX_STEP_LAYERS, " (layers a step carries)")
        if self.step_layers > 1 and self.holders is None:
            raise ValueError(
                f"step_layers: {self.step_layers} needs holders (layers held by disjoint senders: "
                "pipeline stages); without them every sender holds every layer and a step carries one"
            )
        if self.engines is not None and (
            isinstance(self.engines, (str, bytes)) or not isinstance(self.engines, Sequence)
        ):
            raise ValueError(
                f"engines: expected a list of one entry per link rank, got {type(self.engines).__name__}"
            )

    @classmethod
    def of(cls: type[Opts], options: Opts | Mapping | None, fields: Mapping) -> Opts:
        """The options a constructor was given: an instance, a mapping of fields, or None, with
        ``fields`` (its keyword arguments) on top. An unknown field is a ValueError that lists the
        known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        if options is None:
            given: dict = {}
        elif isinstance(options, cls):
            given = {f.name: getattr(options, f.name) for f in dataclasses.fields(cls)}
        elif isinstance(options, Mapping):
            given = dict(options)
        else:
            raise TypeError(
                f"options: expected a {cls.__name__}, a mapping of its fields or None, "
                f"got {type(options).__name__}"
            )
        given.update(fields)
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**given)


def check_holders(holders: object) -> None:
    """``holders``' shape (its ranks are checked against the senders once the link is known)."""
    if not isinstance(holders, Mapping):
        raise ValueError(
            f"holders: expected a mapping of layer index to link ranks, got {type(holders).__name__}"
        )
    for idx, held in holders.items():
        check_int("holders: a layer index", idx, -1)
        groups = held.items() if isinstance(held, Mapping) else [(None, held)]
        for name, ranks in groups:
            where = f"holders[{idx}]" + (f"[{name!r}]" if name is not None else "")
            if name is not None and not isinstance(name, str):
                raise ValueError(f"{where}: expected an entry name (str) as the key")
            if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
                raise ValueError(f"{where}: expected a list of link ranks, got {type(ranks).__name__}")
            ranks = list(ranks)
            if not ranks:
                raise ValueError(f"{where}: expected at least one link rank (a sender that holds it)")
            for k, r in enumerate(ranks):
                check_int(f"{where}[{k}]", r, 0)
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"{where}: a link rank is named twice in {ranks}")


def holders_of(pairs: object) -> dict:
    """``holders`` as JSON carries them (pairs: vLLM's ``SyncInit.holders``, ``SGLangUpdate``) as
    ``SendOptions.holders`` takes them: by layer index, link ranks or, per entry, a mapping."""
    if not isinstance(pairs, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs
    ):
        raise ValueError(f"holders: expected [[layer, link ranks], ...], got {pairs!r}")
    out: dict = {}
    for idx, held in pairs:
        if isinstance(held, (list, tuple)) and held and isinstance(held[0], (list, tuple)):
            held = {name: list(ranks) for name, ranks in held}
        out[idx] = held
    return out


def holders_pairs(holders: Mapping) -> list:
    """``SendOptions.holders`` as JSON carries them (``holders_of`` reads them back)."""
    return [
        [int(idx), [[k, list(v)] for k, v in h.items()] if isinstance(h, Mapping) else list(h)]
        for idx, h in holders.items()
    ]


def device_of(options: object, fields: Mapping) -> object:
    """The ``device`` an endpoint's constructor was given, before its options are checked: a
    refusal in the check is voted on that device."""
    if "device" in fields:
        return fields["device"]
    return options.get("device") if isinstance(options, Mapping) else getattr(options, "device", None)


@dataclass(frozen=True, kw_only=True)
class SendOptions(UpdateOptions):
    """A sending trainer rank's options: ``UpdateOptions`` and how it collects and sends."""

    gather: Gather = "auto"
    """How a single sender collects DTensor layers: "auto", "full", "chunked" or
    "quantize_then_gather" (``glm_fp8.transfer.gather.collect_layer``); the trainer ranks that do
    not send run ``contribute_shards`` with the same options."""
    chunk_experts: int = 8
    """Experts per chunk for ``gather="chunked"``."""
    gather_dtype: torch.dtype | None = None
    """None (default): every tensor is gathered and quantized in the trainer's dtype, so fp32
    masters give the checkpoint's bytes in every mode (their gathers move twice a bf16 gather's
    bytes). ``torch.bfloat16``: an opt-in that casts the sources of quantized entries before they
    are gathered; for fp32 masters those entries' bytes then differ from the checkpoint's
    (docs/trainers.md#gathers-of-float32-masters)."""
    delta: DeltaOptions | None = None
    """Send what changed since the update the engine ranks hold (needs wire "fp8" and checksums;
    the engine ranks build ``Receiver(delta=True)``; docs/delta.md#in-the-transfer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ring", self.ring, 1, MAX_RING, " (buffers of one layer each)")
        check_choice("gather", self.gather, GATHERS)
        check_int("chunk_experts", self.chunk_experts, 1)
        if self.gather_dtype is not None and not isinstance(self.gather_dtype, torch.dtype):
            raise TypeError(f"gather_dtype: expected a torch.dtype or None, got {self.gather_dtype!r}")
        if self.delta is None:
            return
        if not isinstance(self.delta, DeltaOptions):
            raise TypeError(f"delta: expected a DeltaOptions or None, got {type(self.delta).__name__}")
        if self.wire != "fp8":
            raise ValueError(
                f"delta: needs wire='fp8' (got {self.wire!r}); with 'bf16' the engine quantizes on receive"
            )
        if not self.checksum:
            raise ValueError(
                "delta: needs checksum=True: the checksum is what proves each rebuilt segment exact"
            )
        if self.step_layers != 1:
            raise ValueError(
                f"delta: a delta update carries one layer a step; got step_layers={self.step_layers}"
            )


@dataclass(frozen=True, kw_only=True)
class ReceiveOptions(UpdateOptions):
    """An engine rank's options: ``UpdateOptions`` and where it lands what arrives."""

    layout: EngineLayout | None = None
    """This engine rank's ``EngineLayout`` (needs ``config`` and wire "fp8"): ``load_into`` lands
    each entry's shard under vLLM's name and dtype (``glm_fp8.engine.specs.engine_params``), with
    no full-size temporary. With ``engines``, this rank's entry must be this layout (it receives
    only its shard) or "full" (it receives every entry whole and cuts its shard; one sender only).
    None: full-size parameters under the kernel-format names."""
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    """The longest manifest accepted; a longer announced length is refused before anything is
    allocated from it."""
    delta: bool = False
    """Take the layers a ``Sender`` with ``delta=DeltaOptions()`` sends as changes: each is rebuilt
    from the parameters, changed, checked and landed (``load_into`` only; landing must be a plain
    copy: kernel-format parameters, or this rank's layout in ``engines``; docs/delta.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is not None and not isinstance(self.layout, EngineLayout):
            raise TypeError(f"layout: expected an EngineLayout or None, got {type(self.layout).__name__}")
        check_int(
            "ring", self.ring, 2, MAX_RING, " buffers (a layer waits for its vote while the next one arrives)"
        )
        check_int("max_manifest_bytes", self.max_manifest_bytes, 1, 1 << 40)
        if self.layout is not None and (self.config is None or self.wire != "fp8"):
            raise ValueError(
                "layout: a sharded engine needs config= (its sharding rules read it) and "
                "wire='fp8'; use layout=None for wire='bf16'"
            )
        if not isinstance(self.delta, bool):
            raise ValueError(f"delta: expected True or False, got {self.delta!r}")
        if self.delta and self.step_layers != 1:
            raise ValueError(
                f"delta: a delta update carries one layer a step; got step_layers={self.step_layers}"
            )


__all__ = [
    "MAX_RING",
    "MAX_STEP_LAYERS",
    "check_holders",
    "holders_of",
    "holders_pairs",
    "device_of",
    "DeltaOptions",
    "ReceiveOptions",
    "SendOptions",
    "UpdateOptions",
]

"""The payload of an SGLang update: what every rank of a server needs to receive one
(``SGLangUpdate``), carried by ``update_weights_from_tensor`` as one empty tensor whose name holds
the update as JSON (docs/sglang.md#the-hook). The trainer's client builds it; each rank's loader
(``glm_fp8.integrations.sglang.loader``) reads it."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.sglang import SGLangLayout
from glm_fp8.model.families import mtp_layer_index
from glm_fp8.transfer.options import MAX_STEP_LAYERS, check_holders, holders_of, holders_pairs

LOADER = "glm_fp8.integrations.sglang.receive_update"  # --custom-weight-loader, and the load_format
PAYLOAD = "glm_fp8.update:"  # the name of the call's one named tensor starts so; the update follows


def _layout_dict(layout: EngineLayout | None) -> dict | None:
    return None if layout is None else {"engine": layout.engine, **dataclasses.asdict(layout)}


def _layout_of(words: Mapping | None) -> EngineLayout | None:
    if words is None:
        return None
    fields = dict(words)
    cls = SGLangLayout if fields.pop("engine") == "sglang" else EngineLayout
    return cls(**fields)


@dataclass(frozen=True)
class SGLangUpdate:
    """What every rank of an SGLang server needs to receive an update, as the payload of
    ``update_weights_from_tensor``.

    ``host``/``port``: the link's TCP store (trainer link rank 0 serves it); ``rank_offset``: this
    server's TP rank 0 on the link (its TP rank r is ``rank_offset + r``); ``world_size``: the link's
    ranks; ``config``: the model's HF config as a dict; ``layer_ids``, ``rest``, ``senders``,
    ``holders``, ``step_layers``, ``delta``: as the senders' ``Sender`` takes them (``holders``: a
    Megatron-Core trainer's pipeline stages, ``MegatronSource.holders``); ``engines``: every link
    rank's layout (None at a sender); ``timeout_s``: the link's timeout. ``drafter``: the servers
    run SGLang's MTP drafter (``--speculative-algorithm`` EAGLE on GLM-5's own MTP layer), which
    takes the MTP layer in a second update on the same link right after this one
    (``drafter_update``; docs/sglang.md#the-mtp-drafter); ``layer_ids`` then leaves the MTP layer
    out, and every engine rank of the link is an SGLang rank."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    config: Mapping
    layer_ids: Sequence[int]
    engines: Sequence[EngineLayout | None]
    senders: Sequence[int] = (0,)
    rest: bool = True
    delta: bool = False
    timeout_s: float = 600.0
    holders: Mapping | None = None
    step_layers: int = 1
    drafter: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"SGLangUpdate.host: expected a host name, got {self.host!r}")
        check_int("SGLangUpdate.port", self.port, 1, 65535)
        world = check_int("SGLangUpdate.world_size", self.world_size, 1)
        check_int(
            "SGLangUpdate.rank_offset", self.rank_offset, 0, world - 1, f" (a rank of the link of {world})"
        )
        if not isinstance(self.config, Mapping):
            raise ValueError(
                f"SGLangUpdate.config: expected the HF config as a dict, got {type(self.config).__name__}"
            )
        for k, i in enumerate(self.layer_ids):
            check_int(f"SGLangUpdate.layer_ids[{k}]", i, 0)
        if len(self.engines) != world:
            raise ValueError(
                f"SGLangUpdate.engines: expected one entry per link rank ({world}), got {len(self.engines)}"
            )
        for r, lay in enumerate(self.engines):
            if lay is not None and not isinstance(lay, EngineLayout):
                raise ValueError(f"SGLangUpdate.engines[{r}]: expected an EngineLayout or None, got {lay!r}")
        for flag in ("rest", "delta", "drafter"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"SGLangUpdate.{flag}: expected a bool, got {getattr(self, flag)!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 604800:
            raise ValueError(f"SGLangUpdate.timeout_s: expected seconds, 0 < timeout_s <= 604800, got {t!r}")
        if self.holders is not None:
            try:
                check_holders(self.holders)
            except ValueError as e:
                raise ValueError(f"SGLangUpdate.{e}") from None
        check_int(
            "SGLangUpdate.step_layers", self.step_layers, 1, MAX_STEP_LAYERS, " (layers a step carries)"
        )
        if self.step_layers > 1 and self.holders is None:
            raise ValueError(
                f"SGLangUpdate.step_layers: {self.step_layers} needs holders (a Megatron-Core trainer's "
                "pipeline stages); every sender holds every layer"
            )
        if self.delta and self.step_layers != 1:
            raise ValueError(
                f"SGLangUpdate.step_layers: {self.step_layers} with delta; a delta update carries one "
                "layer a step"
            )
        if self.drafter:
            self._check_drafter()

    def _check_drafter(self) -> None:
        mtp = mtp_layer_index(self.config)
        if mtp is None:
            raise ValueError(
                "SGLangUpdate.drafter: the config has no MTP layer (num_nextn_predict_layers 0): no drafter "
                "to update"
            )
        if mtp in self.layer_ids:
            raise ValueError(
                f"SGLangUpdate.layer_ids: holds the MTP layer {mtp}, which with drafter=True goes in the "
                "drafter's own update (drafter_update()); leave it out"
            )
        for r, lay in enumerate(self.engines):
            if lay is not None and not (isinstance(lay, SGLangLayout) and not lay.drafter):
                raise ValueError(
                    f"SGLangUpdate.engines[{r}]: {lay!r}; with drafter=True every engine rank of the link is "
                    "an SGLang rank's target model (the drafter's update reaches each of them)"
                )

    def drafter_update(self) -> SGLangUpdate:
        """The update after this one on the same link (``drafter``): the MTP layer alone, into each
        SGLang rank's drafter (``SGLangLayout.drafter_layout``), from the senders that hold it. The
        trainer's senders send it with a second ``Sender`` built from its fields, right after
        this update's ``send_model``."""
        if not self.drafter:
            raise ValueError("SGLangUpdate.drafter_update: this update has drafter=False")
        mtp = mtp_layer_index(self.config)
        holders = None
        if self.holders is not None and mtp in self.holders:
            holders = {mtp: self.holders[mtp]}
        return dataclasses.replace(
            self,
            layer_ids=[mtp],
            engines=[None if lay is None else lay.drafter_layout for lay in self.engines],
            rest=False,
            holders=holders,
            step_layers=1,
            drafter=False,
        )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["engines"] = [_layout_dict(lay) for lay in self.engines]
        data["config"] = dict(self.config)
        data["layer_ids"], data["senders"] = list(self.layer_ids), list(self.senders)
        data["holders"] = None if self.holders is None else holders_pairs(self.holders)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> SGLangUpdate:
        data = json.loads(text)
        data["engines"] = [_layout_of(x) for x in data["engines"]]
        if data.get("holders") is not None:
            data["holders"] = holders_of(data["holders"])
        return cls(**data)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The call's payload: one empty tensor, named ``PAYLOAD`` + this update as JSON. The update
        travels in the name: SGLang's clients serialize a tensor's bytes through shared memory,
        which a server on another host cannot read, and an empty tensor, or a name, by value."""
        return [(PAYLOAD + self.to_json(), torch.empty(0, dtype=torch.uint8))]

    def server_ranks(self) -> int:
        """This server's TP size, ``T`` (its ranks are link ranks ``rank_offset ..
        rank_offset + T - 1``), from its first rank's layout."""
        first = self.engines[self.rank_offset]
        if not isinstance(first, SGLangLayout):
            raise ValueError(
                f"SGLangUpdate.engines[{self.rank_offset}] (rank_offset): expected the SGLang server's TP "
                f"rank 0, an SGLangLayout, got {first!r}"
            )
        return first.whole_tp[0]

    def serialized_named_tensors(self) -> list[str]:
        """The call's ``serialized_named_tensors`` as SGLang's HTTP clients send them: the payload
        pickled by torch's ``ForkingPickler`` (SGLang's ``MultiprocessingSerializer``), base64, once
        per TP rank of the server (each rank reads its own). The empty tensor pickles by value: no
        shared memory, so a server on any host reads it."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(self.named_tensors())
        text = base64.b64encode(buf.getvalue()).decode("ascii")
        return [text] * self.server_ranks()

    @classmethod
    def from_named_tensors(cls, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> SGLangUpdate:
        names = [name for name, _ in named_tensors]
        if len(names) != 1 or not isinstance(names[0], str) or not names[0].startswith(PAYLOAD):
            shown = [n[:40] + "..." if isinstance(n, str) and len(n) > 40 else n for n in names]
            raise ValueError(
                f"named_tensors: expected one tensor named {PAYLOAD!r} + the update "
                f"(SGLangUpdate.named_tensors()), got {shown}"
            )
        try:
            return cls.from_json(names[0][len(PAYLOAD) :])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"named_tensors: the update in the tensor's name is not one: {e}") from None

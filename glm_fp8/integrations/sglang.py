"""glm_fp8 inside an SGLang 0.5.23 server, through its weight-update session (docs/sglang.md#the-hook).

SGLang 0.5.23 has no receiver plug-in. Its narrowest sanctioned path for bytes that arrive by other
means is a custom weight loader, run by ``update_weights_from_tensor`` inside a
``begin_weight_update`` / ``end_weight_update`` session on every TP rank of the server, in its
scheduler process, with the model. So the server starts with
``--custom-weight-loader glm_fp8.integrations.sglang.receive_update``, and one update is:

1. the trainer: ``pause_generation``, ``begin_weight_update`` (SGLang restores any in-place packing);
2. the trainer: ``update_weights_from_tensor(load_format=LOADER, named_tensors=update.named_tensors())``
   (returns when every rank has landed), while every trainer rank that sends runs its ``Sender``;
   each SGLang rank runs ``receive_update``: a ``Receiver`` over glm_fp8's link (the bytes travel
   there, never through the call) lands its shard in the model's own parameters, then SGLang's
   ``post_load_weights`` derives MLA's ``w_kc`` / ``w_vc`` (a session in which a loader ran counts
   as loaded, so ``end_weight_update`` would not);
3. the trainer: ``update_weight_version``, ``end_weight_update`` (SGLang's
   ``process_weights_after_loading``), ``continue_generation``.

``SGLangUpdate`` is the payload: the link's address and this server's ranks on it, and what every
rank must agree on (the config, the layers, the senders, every rank's layout). Each SGLang rank
reads its own layout from SGLang's runtime context (``sglang_rank_layout``) and checks that the
model holds exactly the parameters glm_fp8 lands (``landing_params``: a shared expert SGLang fused
into the routed experts' stacks is landed in its slot), before anything moves. The link and the
``Receiver`` stay open between updates (a delta update needs what the last one left).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.core.errors import EngineNotSupported
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.sglang import SGLangLayout, sglang_params
from glm_fp8.engine.specs import engine_param_specs
from glm_fp8.transfer.link import StoreLink
from glm_fp8.transfer.receiver import Receiver

LOADER = "glm_fp8.integrations.sglang.receive_update"  # --custom-weight-loader, and the load_format
PAYLOAD = "glm_fp8.update:"  # the name of the call's one named tensor starts so; the update follows
KV_SCALES = (".k_scale", ".v_scale")  # the KV cache's scales: not weights, never updated


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
    ``delta``: as the senders' ``Sender`` takes them; ``engines``: every link rank's layout (None at a
    sender); ``timeout_s``: the link's timeout."""

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
        for flag in ("rest", "delta"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"SGLangUpdate.{flag}: expected a bool, got {getattr(self, flag)!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 604800:
            raise ValueError(f"SGLangUpdate.timeout_s: expected seconds, 0 < timeout_s <= 604800, got {t!r}")

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["engines"] = [_layout_dict(lay) for lay in self.engines]
        data["config"] = dict(self.config)
        data["layer_ids"], data["senders"] = list(self.layer_ids), list(self.senders)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> SGLangUpdate:
        data = json.loads(text)
        data["engines"] = [_layout_of(x) for x in data["engines"]]
        return cls(**data)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The call's payload: one empty tensor, named ``PAYLOAD`` + this update as JSON. The update
        travels in the name: SGLang's clients serialize a tensor's bytes through shared memory,
        which a server on another host cannot read, and an empty tensor, or a name, by value."""
        return [(PAYLOAD + self.to_json(), torch.empty(0, dtype=torch.uint8))]

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


def sglang_rank_layout() -> SGLangLayout:
    """This process's layout, read from SGLang 0.5.23's runtime context (the scheduler's published
    ``ServerArgs``): its TP rank and size, attention DP, EP size, ``moe_dense_tp_size``,
    ``moe_a2a_backend``, ``enable_dp_lm_head`` and ``SGLANG_SHARED_EXPERT_TP1``. Raises
    ``EngineNotSupported`` for pipeline or attention context parallelism and for EPLB or
    redundant experts."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    p, moe = get_parallel(), get_exec().moe
    for what, size in (("pp_size", p.pp_size), ("attn_cp_size", p.attn_cp_size)):
        if size != 1:
            raise EngineNotSupported(f"SGLang {what} {size}: glm_fp8 models one stage, no attention CP")
    if getattr(moe, "enable_eplb", False) or getattr(moe, "ep_num_redundant_experts", 0):
        raise EngineNotSupported(
            "SGLang --enable-eplb / --ep-num-redundant-experts: its experts then move between ranks and "
            "repeat, which glm_fp8's expert placement does not follow (docs/sglang.md)"
        )
    return SGLangLayout.from_sglang(
        p.tp_size,
        p.tp_rank,
        attn_dp_size=p.attn_dp_size,
        ep_size=p.moe_ep_size,
        moe_dense_tp_size=p.moe_dense_tp_size,
        moe_a2a_backend=str(moe.moe_a2a_backend or "none"),
        enable_dp_lm_head=bool(p.enable_dp_lm_head),
        shared_expert_tp1=os.environ.get("SGLANG_SHARED_EXPERT_TP1", "").lower() in ("1", "true"),
    )


def landing_params(model: torch.nn.Module, config: Mapping, layout: SGLangLayout) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` an update lands in, by the names glm_fp8 lands (``sglang_params``:
    the shared expert SGLang fused into the routed experts' stacks under its own entry's name),
    checked against what glm_fp8 lands at ``layout`` (names, shapes, dtypes; the KV cache's scales
    aside): ``EngineNotSupported`` names the first parameter that differs."""
    fused = getattr(getattr(model, "shared_experts_config", None), "num_fused_shared_experts", 0)
    held = {n: p.data for n, p in model.named_parameters() if not n.endswith(KV_SCALES)}
    try:
        params = sglang_params(held, layout, fused)
    except ValueError as e:
        raise EngineNotSupported(str(e)) from None
    want = engine_param_specs(config, layout)
    for name in sorted(set(want) | set(params)):
        got = (tuple(params[name].shape), params[name].dtype) if name in params else None
        if want.get(name) != got:
            raise EngineNotSupported(
                f"{name}: SGLang's model holds {got}, glm_fp8 lands {want.get(name)} at {layout} "
                "(docs/sglang.md#layouts)"
            )
    return params


_RECEIVERS: dict[str, tuple[StoreLink, Receiver]] = {}  # per update's link and options, kept open


def receive_update(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (``LOADER``): land one glm_fp8 update in ``model``, this rank's
    shard of every parameter, then run SGLang's ``post_load_weights``. Every rank raises, and SGLang
    reports the call failed, if any rank or sender fails (glm_fp8's votes)."""
    from sglang.srt.model_loader.loader import post_load_weights

    update = SGLangUpdate.from_named_tensors(named_tensors)
    layout = sglang_rank_layout()
    key = update.to_json()
    params = landing_params(model, update.config, layout)  # every update: SGLang may re-allocate
    if key not in _RECEIVERS:
        device = next(model.parameters()).device
        rank = update.rank_offset + layout.moe_group_rank  # SGLang's TP rank
        link = StoreLink(
            update.host,
            update.port,
            rank,
            update.world_size,
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=update.timeout_s),
            device=device,
        )
        receiver = Receiver(
            link,
            0,
            config=update.config,
            layer_ids=list(update.layer_ids),
            rest=update.rest,
            device=device,
            engines=list(update.engines),
            senders=list(update.senders),
            layout=layout,
            delta=update.delta,
        )
        _RECEIVERS[key] = (link, receiver)
    _, receiver = _RECEIVERS[key]
    receiver.load_into(params)
    post_load_weights(model)


__all__ = ["LOADER", "PAYLOAD", "SGLangUpdate", "landing_params", "receive_update", "sglang_rank_layout"]

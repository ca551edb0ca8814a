"""A fleet of vLLM or SGLang servers behind one trainer: ``Server`` (one server's engine and parallel
layout, how many replicas of it run, its NIC) and ``Fleet`` (the trainer's GPUs and NIC, the servers), what
``glm_fp8.planning.update_time`` predicts an update for and ``glm-fp8 plan`` sizes (docs/update_time.md).

A vLLM server's ranks are TP x DP; with expert parallelism on, its EP size is TP x DP (vLLM's
rule: the whole flattened MoE group). The fleet's engine ranks, in link order after the trainer's:
server by server, replica by replica, each replica in vLLM's MoE-group order
(``EngineLayout.all_ranks``). Named fleets: ``glm_fp8.model.presets.FLEETS``, built by ``fleet_preset``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from glm_fp8.core.checks import check_int
from glm_fp8.core.vocab import ENGINES, check_choice
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.sglang import SGLangLayout
from glm_fp8.model.families import REST, mtp_layer_index
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import FLEETS
from glm_fp8.transfer.owners import stack_entries
from glm_fp8.transfer.routes import stage_order


def _check_gbps(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name}: expected a finite number > 0 (Gb/s per GPU), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Server:
    """One inference server: ``replicas`` (servers of this layout), ``name`` (None: "server K" by
    position in the fleet) and ``link_gbps`` (each of its GPUs' NIC; None: the fleet's ``link_gbps``);
    ``engine`` "vllm" (default) or "sglang", whose sizes mean:

    - vLLM 0.34: ``tp`` (``--tensor-parallel-size``), ``dp`` (``--data-parallel-size``), ``ep``
      (``--enable-expert-parallel``: experts split by EP over TP x DP ranks, else by MoE TP);
    - SGLang 0.5.23 (docs/sglang.md#layouts): ``tp`` (``--tp-size``: its ranks), ``dp`` (attention
      DP, ``--attn-dp-size``), ``ep`` (``--ep-size`` equal to ``--tp-size``, else 1),
      ``moe_dense_tp_size`` and ``moe_a2a_backend`` (its flags of those names).
    """

    tp: int
    dp: int = 1
    ep: bool = False
    replicas: int = 1
    name: str | None = None
    link_gbps: float | None = None
    engine: str = "vllm"
    moe_dense_tp_size: int | None = None
    moe_a2a_backend: str = "none"

    def __post_init__(self) -> None:
        for field in ("tp", "dp", "replicas"):
            # plain ints: a fleet is written as JSON (check_int takes numpy's and torch's too)
            object.__setattr__(self, field, check_int(f"Server.{field}", getattr(self, field), 1))
        if not isinstance(self.ep, bool):
            raise ValueError(
                f"Server.ep: expected True or False (vLLM's --enable-expert-parallel), got {self.ep!r}"
            )
        check_choice("Server.engine", self.engine, ENGINES)
        if self.engine == "vllm" and (self.moe_dense_tp_size is not None or self.moe_a2a_backend != "none"):
            raise ValueError(
                "Server.moe_dense_tp_size / moe_a2a_backend: SGLang's flags; set engine='sglang'"
            )
        if self.engine == "sglang":
            self._sglang(0)  # SGLang's refusals, naming the flag, when the server is described
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"Server.name: expected None or a non-empty string, got {self.name!r}")
        if self.link_gbps is not None:
            object.__setattr__(self, "link_gbps", _check_gbps("Server.link_gbps", self.link_gbps))

    @property
    def ranks(self) -> int:
        """One replica's ranks: TP x DP (vLLM), TP (SGLang, whose attention DP splits its TP group)."""
        return self.tp if self.engine == "sglang" else self.tp * self.dp

    def _sglang(self, rank: int) -> SGLangLayout:
        return SGLangLayout.from_sglang(
            self.tp,
            rank,
            attn_dp_size=self.dp,
            ep_size=self.tp if self.ep else 1,
            moe_dense_tp_size=self.moe_dense_tp_size,
            moe_a2a_backend=self.moe_a2a_backend,
        )

    def layouts(self) -> list[EngineLayout]:
        """One replica's ranks, in vLLM's MoE-group order (SGLang's TP-rank order)."""
        if self.engine == "sglang":
            return [self._sglang(r) for r in range(self.tp)]
        return EngineLayout.all_ranks(self.tp, self.dp, self.ep)

    def describe(self) -> str:
        """ "TP 8 x DP 4, EP 32", "TP 8 x DP 1, MoE TP 8" or "SGLang TP 64 (attention DP 8), EP 64"."""
        experts = f"EP {self.ranks}" if self.ep else f"MoE TP {self.ranks}"
        if self.engine == "sglang":
            attn = f" (attention DP {self.dp})" if self.dp > 1 else ""
            flags = [f"moe_dense_tp_size {self.moe_dense_tp_size}"] if self.moe_dense_tp_size else []
            flags += [f"a2a {self.moe_a2a_backend}"] if self.moe_a2a_backend != "none" else []
            return f"SGLang TP {self.tp}{attn}, {experts}" + (f" ({', '.join(flags)})" if flags else "")
        return f"TP {self.tp} x DP {self.dp}, {experts}"


@dataclass(frozen=True)
class MegatronTrainer:
    """A Megatron-Core trainer's parallel sizes (``glm-fp8 plan --trainer megatron:tp4,pp8,cp2,ep16``):
    tensor, pipeline, context, expert and expert tensor parallel (what
    ``glm_fp8.integrations.megatron.MegatronSource`` maps). Its senders are the ranks of
    expert-data-parallel rank 0 and the rest of their TP groups: each pipeline stage's first
    ``ep * etp`` ranks (Megatron's rank order tp-cp-ep-dp-pp, experts etp-ep-dp-pp). Of those, each
    expert tensor parallel group's first rank sends its stage's layers' own experts (the group
    gathers each expert's rows onto it); every sender sends the other entries it owns (with TP
    wider than EP x ETP, the TP groups' other ranks send their share of those only). ``first`` /
    ``last``: the decoder layers of the first and last stage (Megatron's
    ``decoder_first_pipeline_num_layers`` and ``decoder_last_pipeline_num_layers``), the other
    stages splitting the rest evenly, as Megatron requires; neither given, the layers are split as
    evenly as ``torch.chunk`` splits them. The MTP layer and the head are on the last stage, the
    embeddings on the first. ``step_layers`` (``stepN``) is glm_fp8's, not Megatron's: the most
    layers one step of the update carries, one of each stage in turn (``SendOptions.step_layers``)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    first: int | None = None
    last: int | None = None
    etp: int = 1
    step_layers: int = 1

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "cp", "ep", "etp", "step_layers"):
            object.__setattr__(self, field, check_int(f"MegatronTrainer.{field}", getattr(self, field), 1))
        for field in ("first", "last"):
            if getattr(self, field) is not None:
                object.__setattr__(
                    self, field, check_int(f"MegatronTrainer.{field}", getattr(self, field), 0)
                )
        if self.pp == 1 and (self.first is not None or self.last is not None):
            raise ValueError("MegatronTrainer.first/last: uneven pipeline stages need PP > 1, got PP 1")
        if self.pp == 1 and self.step_layers > 1:
            raise ValueError(
                f"MegatronTrainer.step_layers: steps of {self.step_layers} layers carry one of each "
                "pipeline stage; PP 1 has one"
            )

    @classmethod
    def parse(cls, text: str) -> MegatronTrainer:
        """``"megatron:tp4,pp8,cp2,ep16"`` (sizes not named are 1), with ``etpN`` for expert tensor
        parallelism, ``firstN`` / ``lastN`` for uneven pipeline stages
        (``"megatron:pp8,ep16,first9,last9"``) and ``stepN`` for steps of N layers."""
        kind, _, sizes = text.partition(":")
        if kind != "megatron" or not sizes:
            raise ValueError(
                "expected megatron:tpN,ppN,cpN,epN[,etpN][,firstN][,lastN][,stepN] "
                f"(e.g. megatron:tp4,pp8,cp2,ep16), got {text!r}"
            )
        given: dict[str, int] = {}
        names = {"step": "step_layers"}
        keys = ("first", "last", "step", "etp", "tp", "pp", "cp", "ep")  # "etp" before "ep" and "tp"
        for part in sizes.split(","):
            key = next((k for k in keys if part.startswith(k)), None)
            digits = part[len(key) :] if key is not None else ""
            if key is None or not digits.isdigit() or names.get(key, key) in given:
                raise ValueError(
                    f"{part!r}: expected one of tpN, ppN, cpN, epN, etpN, firstN, lastN, stepN once each, "
                    f"in {text!r}"
                )
            given[names.get(key, key)] = int(digits)
        return cls(**given)

    def describe(self) -> str:
        uneven = "".join(f",{k}{v}" for k, v in (("first", self.first), ("last", self.last)) if v is not None)
        etp = f",etp{self.etp}" if self.etp > 1 else ""
        step = f",step{self.step_layers}" if self.step_layers > 1 else ""
        return f"megatron:tp{self.tp},pp{self.pp},cp{self.cp},ep{self.ep}{etp}{uneven}{step}"

    def stage_layers(self, n: int) -> list[int]:
        """How many of ``n`` decoder layers each pipeline stage holds. ValueError where Megatron
        would refuse the split: the stages between the first and the last (or every stage but a
        given one) must divide the rest evenly."""
        if self.first is None and self.last is None:
            size = -(-n // self.pp)
            return [max(0, min(size, n - p * size)) for p in range(self.pp)]
        ends = [x for x in (self.first, self.last) if x is not None]
        middle = self.pp - len(ends)
        rest = n - sum(ends)
        if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
            raise ValueError(
                f"trainer: {self.describe()}: {n} decoder layers leave {rest} for {middle} other "
                "stage(s), which Megatron-Core splits evenly"
            )
        each = rest // middle if middle else 0
        sizes = [each] * self.pp
        if self.first is not None:
            sizes[0] = self.first
        if self.last is not None:
            sizes[-1] = self.last
        return sizes

    def check(self, gpus: int) -> None:
        """ValueError where ``gpus`` trainer GPUs cannot hold this layout, or where a sender's TP
        group would hold ranks that do not send."""
        if gpus % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"trainer: {gpus} GPUs are not a multiple of TP {self.tp} x PP {self.pp} x CP {self.cp}"
            )
        if gpus % (self.pp * self.ep * self.etp):
            raise ValueError(
                f"trainer: {gpus} GPUs are not a multiple of PP {self.pp} x EP {self.ep} x ETP {self.etp}"
            )

    @property
    def stage_senders(self) -> int:
        """A stage's senders: its first ``ep * etp`` ranks (expert-data-parallel rank 0) and the rest
        of their TP groups (TP wider than EP x ETP)."""
        return -(-(self.ep * self.etp) // self.tp) * self.tp

    def expert_senders(self, stage: tuple[int, ...]) -> tuple[int, ...]:
        """Of a stage's senders (in rank order), those that send its experts: each expert tensor
        parallel group's first rank, in expert order."""
        return stage[: self.ep * self.etp : self.etp]

    @property
    def senders(self) -> int:
        return self.pp * self.stage_senders

    def stage_of(self, config: object) -> dict[int, int]:
        """Each layer's pipeline stage (the MTP layer's: the last)."""
        out, start = {}, 0
        for p, count in enumerate(self.stage_layers(config["num_hidden_layers"])):
            out.update({i: p for i in range(start, start + count)})
            start += count
        mtp = mtp_layer_index(config)
        if mtp is not None:
            out[mtp] = self.pp - 1
        return out

    def update_order(self, config: object, layer_ids) -> list[int]:
        """``layer_ids`` in the order the update sends them: as given with one layer a step, else one
        of each stage in turn (``glm_fp8.transfer.routes.stage_order``)."""
        if self.step_layers == 1:
            return list(layer_ids)
        return stage_order(layer_ids, self.stage_of(config))

    def holders(self, config: object, layer_ids) -> list:
        """Per layer of ``layer_ids`` (``REST`` included), the senders (indices) that hold it:
        its stage's, in expert order; the non-layer tensors and the MTP layer's head per entry."""
        stage_of = self.stage_of(config)
        mtp = mtp_layer_index(config)
        s = self.stage_senders
        stage = lambda p: tuple(range(p * s, (p + 1) * s))  # noqa: E731
        group = lambda p: tuple(range(p * s, p * s + self.tp))  # noqa: E731 - a TP group of stage p
        out: list = []
        for i in layer_ids:
            if i == REST:
                out.append(
                    {
                        "model.embed_tokens.weight": group(0),
                        "model.norm.weight": group(self.pp - 1)[:1],
                        "lm_head.weight": group(self.pp - 1),
                    }
                )
            elif i == mtp:
                held = stage(self.pp - 1)
                plan = plan_from_config(config, i)
                stacks = {e.name for e in stack_entries(plan)}
                head = group(self.pp - 1)
                out.append(
                    {
                        e.name: head
                        if e.name == "shared_head.head.weight"
                        else (self.expert_senders(held) if e.name in stacks else held)
                        for e in plan.entries
                    }
                )
            elif s != self.ep:  # the experts from each ETP group's first rank, the rest from all
                held = stage(stage_of[i])
                stacks = {e.name for e in stack_entries(plan_from_config(config, i))}
                entries = plan_from_config(config, i).entries
                experts = self.expert_senders(held)
                out.append(
                    {e.name: experts if e.name in stacks else held for e in entries} if stacks else held
                )
            else:
                out.append(stage(stage_of[i]))
        return out


@dataclass(frozen=True)
class Fleet:
    """Trainer GPUs, the vLLM servers they update, and each GPU's NIC (``link_gbps``: every trainer
    GPU's, and every server GPU's where its ``Server.link_gbps`` is None).

    Two ways to give the servers: ``servers`` (a sequence of ``Server``, or mappings of its fields),
    or the one-layout form ``engines`` replicas of ``engine_tp`` x ``engine_dp`` (``engine_ep``),
    which means ``servers=(Server(engine_tp, engine_dp, engine_ep, engines),)`` (defaults: 1
    replica of TP 8 x DP 1 without EP). Not both. When every server has the same layout the
    ``engine_*`` fields read that layout (``engines``: all the replicas), else None.

    ``experts_whole``: the trainer's shards hold whole experts (FSDP2 or expert parallel,
    ``Shard(0)`` on the expert dim), so each rank can quantize and send its own experts (many
    senders); else the expert stacks are gathered like every other tensor and many senders do
    not apply.

    ``trainer``: a ``MegatronTrainer`` (its parallel sizes decide which GPUs send which layers with
    many senders), or None: every trainer GPU holds its share of every layer (FSDP2 / EP).
    """

    trainer_gpus: int
    engines: int | None = None
    engine_tp: int | None = None
    engine_dp: int | None = None
    engine_ep: bool | None = None
    link_gbps: float = 400.0
    experts_whole: bool = True
    servers: tuple[Server, ...] = ()
    trainer: MegatronTrainer | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer_gpus", check_int("Fleet.trainer_gpus", self.trainer_gpus, 1))
        if isinstance(self.trainer, str):
            object.__setattr__(self, "trainer", MegatronTrainer.parse(self.trainer))
        if self.trainer is not None:
            if not isinstance(self.trainer, MegatronTrainer):
                raise ValueError(f"Fleet.trainer: expected a MegatronTrainer or None, got {self.trainer!r}")
            self.trainer.check(self.trainer_gpus)
        object.__setattr__(self, "link_gbps", _check_gbps("Fleet.link_gbps", self.link_gbps))
        one = {"engines": self.engines, "engine_tp": self.engine_tp, "engine_dp": self.engine_dp}
        for k, v in one.items():
            if v is not None:
                one[k] = check_int(f"Fleet.{k}", v, 1)
        given = {**one, "engine_ep": None if self.engine_ep is None else bool(self.engine_ep)}
        if self.servers:
            if isinstance(self.servers, (str, bytes, Mapping)):
                raise ValueError(f"Fleet.servers: expected a sequence of Server, got {self.servers!r}")
            servers = tuple(s if isinstance(s, Server) else Server(**s) for s in self.servers)
        else:
            servers = (
                Server(
                    one["engine_tp"] or 8, one["engine_dp"] or 1, bool(self.engine_ep), one["engines"] or 1
                ),
            )
        names = [s.name for s in servers if s.name is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"Fleet.servers: expected distinct server names, got {names}")
        object.__setattr__(self, "servers", servers)
        # The one-layout view: what engines / engine_tp / engine_dp / engine_ep read (None when the
        # servers differ). Given alongside servers= (dataclasses.replace, a fleet read back from
        # JSON) they must agree with it.
        shapes = {(s.tp, s.dp, s.ep) for s in servers}
        vllm = all(s.engine == "vllm" for s in servers)  # the one-layout view is a vLLM layout's
        tp, dp, ep = next(iter(shapes)) if len(shapes) == 1 and vllm else (None, None, None)
        view = {
            "engines": sum(s.replicas for s in servers) if tp else None,
            "engine_tp": tp,
            "engine_dp": dp,
            "engine_ep": ep,
        }
        clash = [f"{k}={v!r}" for k, v in given.items() if v is not None and v != view[k]]
        if self.servers and clash:
            raise ValueError(
                f"Fleet.servers: given with {', '.join(clash)}, which the servers contradict; describe "
                "the servers with servers= or one layout with engines / engine_tp / engine_dp / "
                "engine_ep, not both"
            )
        for k, v in view.items():
            object.__setattr__(self, k, v)

    @property
    def link_bytes_per_s(self) -> float:
        """A trainer GPU's NIC, bytes/s."""
        return self.link_gbps * 1e9 / 8

    def server_link_bytes_per_s(self, k: int) -> float:
        """A GPU of server ``k``'s NIC, bytes/s."""
        return (self.servers[k].link_gbps or self.link_gbps) * 1e9 / 8

    def server_names(self) -> list[str]:
        return [s.name or f"server{k}" for k, s in enumerate(self.servers)]  # the vLLM backend's default too

    def layouts(self) -> list[EngineLayout]:
        """One replica of each server, server by server: every distinct engine rank (replicas hold
        the same shards). With one server: one engine's ranks."""
        return [lay for s in self.servers for lay in s.layouts()]

    def distinct_ranges(self) -> list[range]:
        """Each server's ranks in ``layouts()``."""
        out, start = [], 0
        for s in self.servers:
            out.append(range(start, start + s.ranks))
            start += s.ranks
        return out

    def engine_layouts(self) -> list[EngineLayout]:
        """Every engine rank of the fleet in link order: server by server, replica by replica."""
        return [lay for s in self.servers for _ in range(s.replicas) for lay in s.layouts()]

    def engine_ranges(self) -> list[range]:
        """Each server's ranks (all its replicas) in ``engine_layouts()``."""
        out, start = [], 0
        for s in self.servers:
            out.append(range(start, start + s.ranks * s.replicas))
            start += s.ranks * s.replicas
        return out

    @property
    def engine_ranks(self) -> int:
        """Every replica's ranks."""
        return sum(s.ranks * s.replicas for s in self.servers)


def fleet_preset(name: str, **overrides: object) -> Fleet:
    """The named fleet of ``glm_fp8.model.presets.FLEETS`` ("prime-rl-glm-5.2", "glm-5-4xep8"), its
    fields replaced by ``overrides`` (e.g. ``trainer_gpus=64``, ``link_gbps=200``)."""
    if name not in FLEETS:
        raise ValueError(f"fleet: expected one of {sorted(FLEETS)}, got {name!r}")
    spec = FLEETS[name]
    fleet = Fleet(
        spec["trainer_gpus"],
        link_gbps=spec["link_gbps"],
        servers=spec["servers"],
        trainer=spec.get("trainer"),
    )
    return replace(fleet, **overrides) if overrides else fleet


__all__ = ["Fleet", "MegatronTrainer", "Server", "fleet_preset"]

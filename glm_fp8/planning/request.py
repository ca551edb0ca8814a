"""What ``glm-fp8 plan`` is asked to size: ``PlanRequest`` (the deployment, the dtypes, the
target) with its bounds, checked before anything is built from it. The report from it:
``glm_fp8.planning.report.plan_report``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.core.errors import PlanArgumentError
from glm_fp8.core.vocab import SCALE_FORMATS, ScaleFormat, Target
from glm_fp8.planning.fleet import Fleet, MegatronTrainer, Server

# Bounds on the deployment, checked before anything is built from it. The transfer plan is
# computed sender by sender and engine rank by engine rank (about 0.02-0.05 s each on a CPU),
# so these keep ``glm-fp8 plan`` within about a minute; real fleets are far smaller.
MAX_TRAINER_GPUS = 1024
MAX_ENGINE_RANKS = 512  # one engine's TP x DP (vLLM's EP needs at most one rank per routed expert)
MAX_ENGINES = 256
MAX_ALL_ENGINE_RANKS = 4096  # every replica's ranks, each a destination of the many senders' plan

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GATHER_DTYPES = {"trainer": None, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PlanRequest:
    """What to size. ``trainer_gpus`` None: no deployment (layer kinds only, and the engine's
    ranks when ``engine_tp`` is given); with it, the servers are ``servers`` (a fleet of vLLM
    servers, each its own layout and replicas: ``glm_fp8.planning.fleet.Server``) or ``engines`` replicas
    of the ``engine_*`` layout, where ``engine_tp`` None means TP 8 (said in the summary); not
    both. ``link_gbps``: every trainer GPU's NIC, and a server GPU's unless its server says.
    ``master_dtype``: the dtype the trainer holds its masters in; ``gather_dtype``:
    None (no cast, the library's default) or the dtype tensors are cast to before they travel.
    ``trainer``: a Megatron-Core trainer's parallel sizes (``MegatronTrainer``), or None.
    ``target`` and ``scale_fmt`` as ``plan_from_config`` takes them; vLLM's sections use its
    Hopper layout, so ``target="blackwell"`` goes with no deployment and no engine."""

    target: Target = "hopper"
    scale_fmt: ScaleFormat | None = None
    master_dtype: torch.dtype = torch.float32
    gather_dtype: torch.dtype | None = None
    trainer_gpus: int | None = None
    engines: int = 1
    engine_tp: int | None = None
    engine_dp: int = 1
    engine_ep: bool = False
    link_gbps: float = 400.0
    experts_whole: bool = True
    gpu_gib: float = 139.0
    entries: bool = False
    servers: tuple[Server, ...] = ()
    trainer: MegatronTrainer | None = None

    def fleet(self) -> Fleet:
        """The deployment as the update-time model takes it (``trainer_gpus`` given)."""
        if self.servers:
            return Fleet(
                self.trainer_gpus,
                link_gbps=float(self.link_gbps),
                experts_whole=self.experts_whole,
                servers=self.servers,
                trainer=self.trainer,
            )
        return Fleet(
            self.trainer_gpus,
            self.engines,
            self.engine_tp or 8,
            self.engine_dp,
            self.engine_ep,
            float(self.link_gbps),
            self.experts_whole,
            trainer=self.trainer,
        )

    def check(self) -> None:
        """Refuse sizes out of bounds and combinations that mean nothing, before anything is
        built (``PlanArgumentError`` naming the field, the limit and why)."""
        limits = (
            ("trainer_gpus", MAX_TRAINER_GPUS, "the many senders' plan is computed per sender"),
            ("engines", MAX_ENGINES, "each replica is a destination of the many senders' plan"),
            ("engine_tp", MAX_ENGINE_RANKS, "each engine rank's shard is computed"),
            ("engine_dp", MAX_ENGINE_RANKS, "each engine rank's shard is computed"),
        )
        for name, limit, why in limits:
            value = getattr(self, name)
            if value is None and name in ("trainer_gpus", "engine_tp"):
                continue
            try:
                check_int(name, value, 1, limit, f" ({why})")
            except ValueError as e:  # the CLI names its option where check_int names the field
                raise PlanArgumentError(name, str(e).removeprefix(f"{name}: ")) from None
        tp = self.engine_tp or 8
        if tp * self.engine_dp > MAX_ENGINE_RANKS:
            raise PlanArgumentError(
                "engine_dp",
                f"TP {tp} x DP {self.engine_dp} = {tp * self.engine_dp} engine ranks; expected "
                f"at most {MAX_ENGINE_RANKS} (each engine rank's shard is computed)",
            )
        if self.trainer_gpus is not None and self.engines * tp * self.engine_dp > MAX_ALL_ENGINE_RANKS:
            raise PlanArgumentError(
                "engines",
                f"{self.engines} engines x {tp * self.engine_dp} ranks = "
                f"{self.engines * tp * self.engine_dp} engine ranks; expected at most "
                f"{MAX_ALL_ENGINE_RANKS} (each is a destination of the many senders' plan)",
            )
        self._check_servers()
        if self.trainer is not None:
            if not isinstance(self.trainer, MegatronTrainer) or self.trainer_gpus is None:
                raise PlanArgumentError(
                    "trainer", "expected a MegatronTrainer, with trainer_gpus (it describes the deployment)"
                )
            try:
                self.trainer.check(self.trainer_gpus)
            except ValueError as e:
                raise PlanArgumentError("trainer", str(e).removeprefix("trainer: ")) from None
        if not (
            isinstance(self.link_gbps, (int, float)) and math.isfinite(self.link_gbps) and self.link_gbps > 0
        ):
            raise PlanArgumentError("link_gbps", f"expected a finite number > 0, got {self.link_gbps!r}")
        if not (isinstance(self.gpu_gib, (int, float)) and math.isfinite(self.gpu_gib) and self.gpu_gib > 0):
            raise PlanArgumentError("gpu_gib", f"expected a finite number > 0, got {self.gpu_gib!r}")
        if self.master_dtype not in MASTER_DTYPES.values():
            raise PlanArgumentError(
                "master_dtype", f"expected torch.float32 or torch.bfloat16, got {self.master_dtype}"
            )
        if self.gather_dtype not in GATHER_DTYPES.values():
            raise PlanArgumentError(
                "gather_dtype", f"expected None, torch.float32 or torch.bfloat16, got {self.gather_dtype}"
            )
        if self.target not in ("hopper", "blackwell"):
            raise PlanArgumentError("target", f"expected 'hopper' or 'blackwell', got {self.target!r}")
        if self.scale_fmt not in (None, *SCALE_FORMATS):
            raise PlanArgumentError(
                "scale_fmt", f"expected None or one of {SCALE_FORMATS}, got {self.scale_fmt!r}"
            )
        if self.target == "blackwell" and self.scale_fmt == "fp32":
            raise PlanArgumentError(
                "scale_fmt", "'fp32' with target 'blackwell': Blackwell's packed scales are ue8m0 only"
            )
        if self.target == "blackwell" and (self.trainer_gpus is not None or self.engine_tp is not None):
            raise PlanArgumentError(
                "target",
                "'blackwell' is the kernel format of the layer table only: vLLM's weights "
                "(the engine and the update) are in Hopper's layout, with scale_fmt='ue8m0' for "
                "DeepGEMM's power-of-two scales; leave target at 'hopper'",
            )

    def _check_servers(self) -> None:
        """A fleet: servers of ``Server``, with a deployment, instead of the one-layout fields, and
        within the bounds the one-layout form has."""
        if not self.servers:
            return
        if not isinstance(self.servers, tuple) or not all(isinstance(s, Server) for s in self.servers):
            raise PlanArgumentError(
                "servers", f"expected a tuple of glm_fp8.planning.fleet.Server, got {self.servers!r}"
            )
        if self.trainer_gpus is None:
            raise PlanArgumentError("servers", "describe the deployment and need trainer_gpus")
        one = {
            "engines": self.engines != 1,
            "engine_tp": self.engine_tp is not None,
            "engine_dp": self.engine_dp != 1,
            "engine_ep": self.engine_ep,
        }
        given = [k for k, v in one.items() if v]
        if given:
            raise PlanArgumentError(
                "servers", f"given with {', '.join(given)}: give the servers or one engine layout, not both"
            )
        for k, s in enumerate(self.servers):
            if s.ranks > MAX_ENGINE_RANKS:
                raise PlanArgumentError(
                    "servers",
                    f"{s.name or f'server{k}'}: TP {s.tp} x DP {s.dp} = {s.ranks} ranks; expected at most "
                    f"{MAX_ENGINE_RANKS} (each engine rank's shard is computed)",
                )
        replicas = sum(s.replicas for s in self.servers)
        ranks = sum(s.replicas * s.ranks for s in self.servers)
        if replicas > MAX_ENGINES:
            raise PlanArgumentError(
                "servers",
                f"{replicas} servers in all; expected at most {MAX_ENGINES} (each replica is a "
                "destination of the many senders' plan)",
            )
        if ranks > MAX_ALL_ENGINE_RANKS:
            raise PlanArgumentError(
                "servers",
                f"{ranks} engine ranks in all; expected at most {MAX_ALL_ENGINE_RANKS} (each is a "
                "destination of the many senders' plan)",
            )
        try:
            self.fleet()
        except ValueError as e:  # duplicate names
            raise PlanArgumentError("servers", str(e).removeprefix("Fleet.servers: ")) from None


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


__all__ = [
    "GATHER_DTYPES",
    "MASTER_DTYPES",
    "MAX_ALL_ENGINE_RANKS",
    "MAX_ENGINES",
    "MAX_ENGINE_RANKS",
    "MAX_TRAINER_GPUS",
    "PlanRequest",
    "dtype_name",
]

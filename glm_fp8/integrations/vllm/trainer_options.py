"""What a trainer rank's side of the vLLM backend is given (docs/vllm.md#the-backend):
``TrainerOptions``, the fields of ``GlmFp8TrainerInitInfo``, and their checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from glm_fp8.core.checks import check_int, check_seconds
from glm_fp8.core.vocab import (
    DRAFTS,
    GATHERS,
    KEPT_COPIES,
    LINK_BACKENDS,
    TRANSFER_MODES,
    Draft,
    Gather,
    KeptCopy,
    LinkBackend,
    ScaleFormat,
    TransferMode,
    check_choice,
)
from glm_fp8.integrations.vllm.clients import VllmServer
from glm_fp8.integrations.vllm.sync import MAX_LINK_RANKS, check_delta
from glm_fp8.transfer.options import MAX_RING, MAX_STEP_LAYERS, DeltaOptions

GATHER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, None: None}


@dataclass
class TrainerOptions:
    """What the trainer side needs (``GlmFp8TrainerInitInfo`` has these fields, and ``rank``).

    - ``master_address``, ``master_port``: where trainer rank 0 serves the link's TCP store.
    - ``engine_ranks``: the engine workers (every GPU of the engine and its DP replicas); a fleet of
      several vLLM servers: a list, each server's (``client`` is then a list of their clients, in
      the same order, on trainer rank 0). ``server_names``: the servers' names, which errors use
      (default ``server0``, ``server1``...).
    - ``config``: the model's HF config (a dict, a transformers config object or a config.json path).
    - ``mode``: "auto" (default: many senders when every trainer rank holds whole experts, else
      scatter), "senders", "scatter" or "broadcast" (every engine rank receives every byte).
    - ``trainer_ranks``: the trainer's ranks (default: ``torch.distributed``'s world size, else 1).
    - ``link_backend``: "auto" (NCCL on CUDA, gloo on the CPU), "nccl" or "gloo".
    - ``draft``: "auto" (the MTP layer in vLLM's draft session when the trainer holds it and the
      client can start one), "session", "stream" (one update with it: ``GlmFp8WorkerExtension``)
      or "none" (the target only).
    - ``scale_fmt``: None (what the engines need: power-of-two scales where vLLM re-quantizes for
      DeepGEMM), "fp32" or "ue8m0"; ``checksum``, ``ring``: as ``Sender`` takes them.
    - ``gather``, ``gather_dtype``: how one sender collects DTensor layers (``Sender``).
      ``gather_dtype`` None (the default): no cast, every tensor travels and is quantized in the
      dtype the trainer holds (fp32 masters are quantized from fp32, as in every other mode, and
      land the bytes of a checkpoint quantized from them). "bfloat16" is an explicit opt-in that
      halves a gather's bytes for fp32 masters, and then the FP8 bytes of the gathered tensors
      differ from the checkpoint's quantization of the fp32 masters.
    - ``timeout_s``: the link's and the rendezvous' timeout.
    - ``step_layers``: the most layers one step of an update carries (``SendOptions.step_layers``):
      with a Megatron-Core source of several pipeline stages, one layer of each stage in turn, so
      every stage's ranks send at once; each engine worker's ring slot then holds a whole step.
      1 (default) with delta.
    - ``delta``: send each update as the bytes that changed since the update the engine ranks hold
      (exact: docs/delta.md#in-the-transfer); into engine layouts, so mode "scatter" or "senders"
      (or "auto"), not "broadcast". ``delta_resync_every``: every N-th update of a session (its
      first included) is dense; None: only where an engine rank holds nothing of it.
      ``delta_kept``: where each sender keeps what it last sent, "gpu" (default) or "host" (pinned
      host memory, read and written in place by the comparison; ``DeltaOptions.kept``).
    """

    master_address: str
    master_port: int
    engine_ranks: int | Sequence[int]
    config: object
    mode: TransferMode | Literal["auto"] = "auto"
    trainer_ranks: int | None = None
    link_backend: LinkBackend | Literal["auto"] = "auto"
    draft: Draft | Literal["auto"] = "auto"
    scale_fmt: ScaleFormat | None = None
    checksum: bool = True
    ring: int = 2
    gather: Gather = "auto"
    gather_dtype: str | None = None
    timeout_s: float = 600.0
    server_names: Sequence[str] | None = None
    delta: bool = False
    delta_resync_every: int | None = None
    delta_kept: KeptCopy = "gpu"
    step_layers: int = 1
    rank: int = field(kw_only=True)

    def check(self) -> None:
        """Every field's type and range, a ValueError naming it: before anything is sized or
        opened from them (an int is an int: 1.9 or True is refused, never truncated)."""
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"init_info.master_address: expected a host name, got {self.master_address!r}")
        check_int("init_info.master_port", self.master_port, 1, 65535, " (a TCP port)")
        self.servers(None)  # each server's workers and name
        if self.trainer_ranks is not None:
            check_int(
                "init_info.trainer_ranks",
                self.trainer_ranks,
                1,
                MAX_LINK_RANKS - 1,
                " (or None: torch.distributed's world size)",
            )
        check_int("init_info.rank", self.rank, 0, MAX_LINK_RANKS - 1, " (this trainer rank)")
        check_choice("init_info.mode", self.mode, TRANSFER_MODES, also=("auto",))
        check_choice("init_info.draft", self.draft, DRAFTS, also=("auto",))
        check_choice("init_info.link_backend", self.link_backend, LINK_BACKENDS, also=("auto",))
        check_choice("init_info.gather", self.gather, GATHERS)
        if self.gather_dtype not in GATHER_DTYPES:
            raise ValueError(
                f"init_info.gather_dtype: expected one of {list(GATHER_DTYPES)}, got {self.gather_dtype!r}"
            )
        if not isinstance(self.checksum, bool):
            raise ValueError(f"init_info.checksum: expected True or False, got {self.checksum!r}")
        check_int(
            "init_info.ring",
            self.ring,
            2,
            MAX_RING,
            " (layer buffers per rank: 2 overlap each layer with the wire)",
        )
        check_seconds("init_info.timeout_s", self.timeout_s)
        check_int("init_info.step_layers", self.step_layers, 1, MAX_STEP_LAYERS, " (layers a step carries)")
        self._check_delta()
        if self.delta and self.step_layers != 1:
            raise ValueError(
                f"init_info.step_layers: {self.step_layers} with delta=True; a delta update carries "
                "one layer a step"
            )

    def _check_delta(self) -> None:
        """Delta where it is built: each engine rank given its layout (scatter, many senders)."""
        if not isinstance(self.delta, bool):
            raise ValueError(f"init_info.delta: expected True or False, got {self.delta!r}")
        if self.delta_resync_every is not None:
            check_int(
                "init_info.delta_resync_every",
                self.delta_resync_every,
                1,
                None,
                " (every N-th update dense) or None",
            )
            if not self.delta:
                raise ValueError(
                    f"init_info.delta_resync_every: {self.delta_resync_every!r} without delta=True; "
                    "pass delta=True, or leave it None"
                )
        check_choice("init_info.delta_kept", self.delta_kept, KEPT_COPIES)
        if self.delta_kept != "gpu" and not self.delta:
            raise ValueError(f"init_info.delta_kept: {self.delta_kept!r} without delta=True; pass delta=True")
        if self.delta:
            check_delta(self.mode, self.checksum)

    def servers(self, client: object) -> list[VllmServer]:
        """The fleet: one ``VllmServer`` per entry of ``engine_ranks`` (an int: one server, ``client``
        its client), named by ``server_names``, each with its client from ``client`` (a list, in
        the same order; None on a trainer rank other than 0; ``...``: not checked)."""
        one = not isinstance(self.engine_ranks, (list, tuple))
        counts = [self.engine_ranks] if one else list(self.engine_ranks)
        if not counts:
            raise ValueError("init_info.engine_ranks: an empty list; expected each server's workers")
        names = self.server_names
        if names is None:
            names = [f"server{k}" for k in range(len(counts))]
        elif isinstance(names, str) or not isinstance(names, (list, tuple)) or len(names) != len(counts):
            raise ValueError(
                f"init_info.server_names: expected a list of {len(counts)} names (one per entry of "
                f"engine_ranks), got {names!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(
                f"init_info.server_names: each server needs a name of its own, got {list(names)}"
            )
        if client is None:
            clients = [None] * len(counts)
        elif one:
            clients = [client]
        elif isinstance(client, (list, tuple)) and len(client) == len(counts):
            clients = list(client)
        else:
            raise ValueError(
                f"client: engine_ranks lists {len(counts)} servers; expected a list of their "
                f"{len(counts)} clients in the same order, got {type(client).__name__}"
            )
        for k, (name, count) in enumerate(zip(names, counts)):
            check_int(
                "init_info.engine_ranks" + ("" if one else f"[{k}]"),
                count,
                1,
                MAX_LINK_RANKS - 1,
                " (the engine workers: every GPU of the engine and its DP replicas)",
            )
            if not isinstance(name, str) or not name:
                raise ValueError(f"init_info.server_names[{k}]: expected a non-empty string, got {name!r}")
        servers = [VllmServer(n, c, cl) for n, c, cl in zip(names, counts, clients)]
        total = sum(s.engine_ranks for s in servers)
        check_int(
            "init_info.engine_ranks",
            total,
            1,
            MAX_LINK_RANKS - 1,
            " (the engine workers of every server together)",
        )
        return servers


def delta_options(opts: TrainerOptions) -> DeltaOptions | None:
    """The ``Sender``'s ``delta=`` for these options (None: dense updates)."""
    if not opts.delta:
        return None
    every = opts.delta_resync_every  # checked integral: numpy / torch ints too
    return DeltaOptions(resync_every=None if every is None else int(every), kept=opts.delta_kept)


__all__ = ["GATHER_DTYPES", "TrainerOptions", "delta_options"]

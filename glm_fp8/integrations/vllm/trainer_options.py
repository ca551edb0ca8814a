"""What a trainer rank's side of the vLLM backend is given (docs/vllm.md#the-backend):
``TrainerOptions``, the fields of ``GlmFp8TrainerInitInfo``, and their checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm_fp8._checks import check_int, check_seconds
from glm_fp8.integrations.vllm.sync import DRAFTS, LINK_BACKENDS, MAX_LINK_RANKS, MAX_RING, MODES
from glm_fp8.transfer.gather import GATHERS

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, None: None}


@dataclass
class TrainerOptions:
    """What the trainer side needs (``GlmFp8TrainerInitInfo`` has these fields, and ``rank``).

    - ``master_address``, ``master_port``: where trainer rank 0 serves the link's TCP store.
    - ``engine_ranks``: the engine workers (every GPU of every engine and DP replica).
    - ``config``: the model's HF config (a dict, a transformers config object or a config.json path).
    - ``mode``: "auto" (default: many senders when every trainer rank holds whole experts, else
      scatter), "senders", "scatter" or "broadcast" (every engine rank receives every byte).
    - ``trainer_ranks``: the trainer's ranks (default: ``torch.distributed``'s world size, else 1).
    - ``link_backend``: "auto" (NCCL on CUDA, gloo on the CPU), "nccl" or "gloo".
    - ``draft``: "auto" (the MTP layer in vLLM's draft session when the trainer holds it and the
      client can start one), "session", "stream" (one update with it: ``GlmFp8WorkerExtension``)
      or "none" (the target only).
    - ``scale_fmt``: None (what the engines need: power-of-two scales where vLLM re-quantizes for
      DeepGEMM), "fp32" or "ue8m0"; ``checksum``, ``ring``: as ``Broadcaster`` takes them.
    - ``gather``, ``gather_dtype``: how one sender collects DTensor layers (``Broadcaster``).
      ``gather_dtype`` None (the default): no cast, every tensor travels and is quantized in the
      dtype the trainer holds (fp32 masters are quantized from fp32, as in every other mode, and
      land the bytes of a checkpoint quantized from them). "bfloat16" is an explicit opt-in that
      halves a gather's bytes for fp32 masters, and then the FP8 bytes of the gathered tensors
      differ from the checkpoint's quantization of the fp32 masters.
    - ``timeout_s``: the link's and the rendezvous' timeout.
    """

    master_address: str
    master_port: int
    engine_ranks: int
    config: object
    mode: str = "auto"
    trainer_ranks: int | None = None
    link_backend: str = "auto"
    draft: str = "auto"
    scale_fmt: str | None = None
    checksum: bool = True
    ring: int = 2
    gather: str = "auto"
    gather_dtype: str | None = None
    timeout_s: float = 600.0
    rank: int = field(kw_only=True)

    def check(self) -> None:
        """Every field's type and range, a ValueError naming it: before anything is sized or
        opened from them (an int is an int: 1.9 or True is refused, never truncated)."""
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"init_info.master_address: expected a host name, got {self.master_address!r}")
        check_int("init_info.master_port", self.master_port, 1, 65535, " (a TCP port)")
        check_int("init_info.engine_ranks", self.engine_ranks, 1, MAX_LINK_RANKS - 1,
                  " (the engine workers: every GPU of every engine and DP replica)")  # fmt: skip
        if self.trainer_ranks is not None:
            check_int("init_info.trainer_ranks", self.trainer_ranks, 1, MAX_LINK_RANKS - 1,
                      " (or None: torch.distributed's world size)")  # fmt: skip
        check_int("init_info.rank", self.rank, 0, MAX_LINK_RANKS - 1, " (this trainer rank)")
        if self.mode not in ("auto", *MODES):
            raise ValueError(f"init_info.mode: expected 'auto' or one of {MODES}, got {self.mode!r}")
        if self.draft not in ("auto", *DRAFTS):
            raise ValueError(f"init_info.draft: expected 'auto' or one of {DRAFTS}, got {self.draft!r}")
        if self.link_backend not in ("auto", *LINK_BACKENDS):
            raise ValueError(
                f"init_info.link_backend: expected 'auto' or one of {LINK_BACKENDS}, got "
                f"{self.link_backend!r}"
            )
        if self.gather not in GATHERS:
            raise ValueError(f"init_info.gather: expected one of {GATHERS}, got {self.gather!r}")
        if self.gather_dtype not in _DTYPES:
            raise ValueError(
                f"init_info.gather_dtype: expected one of {list(_DTYPES)}, got {self.gather_dtype!r}"
            )
        if not isinstance(self.checksum, bool):
            raise ValueError(f"init_info.checksum: expected True or False, got {self.checksum!r}")
        check_int("init_info.ring", self.ring, 2, MAX_RING,
                  " (layer buffers per rank: 2 overlap each layer with the wire)")  # fmt: skip
        check_seconds("init_info.timeout_s", self.timeout_s)


__all__ = ["TrainerOptions"]

"""Moved to ``glm_fp8.transfer.routes`` (the many senders' division: ``glm_fp8.transfer.owners``,
the ``engines`` check: ``glm_fp8.transfer.pack``); kept so old imports work. Nothing in glm_fp8
imports this module: ``glm_fp8.engine`` holds only how a vLLM rank holds its parameters."""

from glm_fp8.transfer.owners import SPLIT_MIN_BYTES, chunk_bounds, sender_plan, split_entries, stack_entries
from glm_fp8.transfer.pack import FULL, check_engines, check_replicas
from glm_fp8.transfer.routes import LayerRoutes, Segment, TransferPlan, describe, transfer_plan

__all__ = [
    "FULL",
    "LayerRoutes",
    "SPLIT_MIN_BYTES",
    "Segment",
    "TransferPlan",
    "check_engines",
    "check_replicas",
    "chunk_bounds",
    "describe",
    "sender_plan",
    "split_entries",
    "stack_entries",
    "transfer_plan",
]

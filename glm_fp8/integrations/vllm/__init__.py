"""vLLM 0.34 integration (docs/vllm.md): glm_fp8 as a vLLM weight-transfer backend named "glm_fp8",
and a worker extension over the same engine side.

- ``register()``: registers the backend's worker engine and trainer engine with vLLM's factories
  (``vllm.general_plugins`` entry point: every vLLM process calls it; importing
  ``glm_fp8.integrations.vllm.backend`` calls it too). The engine classes live in
  ``glm_fp8.integrations.vllm.backend``, the only module here that imports vLLM at import time.
- ``GlmFp8WorkerExtension`` (``--worker-extension-cls``): the same ``WorkerSide``, driven through
  ``collective_rpc`` by ``ExtensionClient``; it sees the MTP drafter from the start, so one update
  can carry the target and the drafter together (``draft="stream"``).

The pieces without vLLM: ``probe`` (what the worker was built with: its layout, its post-load
step), ``updater`` (its parameters, ``EngineUpdater``), ``sync`` (the handshake), ``worker``
(``WorkerSide``), ``trainer`` (``TrainerSide``), ``sources`` (``LayerSource``;
``ModuleStateSource``: a module's parameters and persistent buffers, which a transformers model
needs, as a vLLM ``WeightSource``), ``clients`` (``VllmServer``, one vLLM server of a fleet; clients for
every kind vLLM 0.34 has, draft sessions included), ``fleet_link`` and ``trainer_fleet`` (several servers
on one link, membership changes), ``gate`` (every update's go / no-go).
``plugin`` holds what vLLM's processes call (``register``, the worker extension).
"""

from glm_fp8.core.errors import EngineNotSupported
from glm_fp8.integrations.vllm.clients import AsyncLLMClient, LLMClient, VllmServer
from glm_fp8.integrations.vllm.plugin import (
    BACKEND,
    ExtensionClient,
    GlmFp8WorkerExtension,
    register,
    vllm_finalize,
    vllm_updater,
)
from glm_fp8.integrations.vllm.sources import LayerSource, ModuleStateSource
from glm_fp8.integrations.vllm.updater import EngineUpdater
from glm_fp8.integrations.vllm.worker import WorkerSide

__all__ = [
    "AsyncLLMClient",
    "BACKEND",
    "EngineNotSupported",
    "EngineUpdater",
    "ExtensionClient",
    "GlmFp8WorkerExtension",
    "LLMClient",
    "LayerSource",
    "ModuleStateSource",
    "VllmServer",
    "WorkerSide",
    "register",
    "vllm_finalize",
    "vllm_updater",
]

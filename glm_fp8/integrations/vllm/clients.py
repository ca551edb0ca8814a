"""The clients a glm_fp8 trainer engine drives, one per vLLM server (docs/vllm.md#fleet): vLLM's
``VLLMWeightSyncClient`` protocol (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``) and the draft session (``start_draft_weight_update``),
for every client kind vLLM 0.34 has, without importing vLLM:

- ``LLM`` (offline): ``LLMClient(llm)``; its methods take ``{"init_info": ...}`` /
  ``{"update_info": ...}`` (``entrypoints/rl/offline.py::RLOfflineMixin``), and it has
  ``start_draft_weight_update``.
- ``AsyncLLM``: ``AsyncLLMClient(engine, loop)``, its coroutines run on the loop that owns the
  engine (``v1/engine/async_llm.py``: ``start_draft_weight_update`` too).
- HTTP (``distributed/weight_transfer/clients.py::HTTPVLLMWeightSyncClient``): no draft method, but
  the server has the route (``entrypoints/rl/online/api_router.py``: ``POST
  /start_draft_weight_update``, with the other RL routes under ``VLLM_SERVER_DEV_MODE``), which
  ``draft_starter`` posts to through the client.
- Ray (``RayVLLMWeightSyncClient``): no draft method, but its handles are ``LLM`` / ``AsyncLLM``
  actors, which have one; ``draft_starter`` calls it on every handle.

``VllmServer`` is one member of a fleet: a name, its worker count, its client (trainer rank 0 only).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glm_fp8.core.checks import check_int
from glm_fp8.integrations.vllm.sync import MAX_LINK_RANKS


@dataclass
class VllmServer:
    """One vLLM server of a fleet, as the trainer engine drives it: ``name`` (unique; errors name
    it), ``engine_ranks`` (its workers: TP x DP, every GPU of the server and its DP replicas) and
    ``client`` (a ``VLLMWeightSyncClient`` of it; trainer rank 0 calls it, every other rank may pass
    None). Not ``glm_fp8.planning.fleet.Server``: a server's layout, as ``glm-fp8 plan`` models it."""

    name: str
    engine_ranks: int
    client: Any = None

    def check(self, what: str) -> VllmServer:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{what}.name: expected a non-empty string, got {self.name!r}")
        check_int(
            f"{what}.engine_ranks",
            self.engine_ranks,
            1,
            MAX_LINK_RANKS - 1,
            f" (server {self.name!r}'s workers: TP x DP)",
        )
        return self


def client_kind(client: object) -> str:
    """The client's kind in words, for messages: its class name."""
    return type(client).__name__


def draft_starter(client: object) -> tuple[Callable[[], None] | None, str]:
    """How to open vLLM's draft session through ``client``: ``(call, "")``, or ``(None, why not)``."""
    kind = client_kind(client)
    fn = getattr(client, "start_draft_weight_update", None)
    if callable(fn):
        if inspect.iscoroutinefunction(fn):
            return None, (
                f"{kind}.start_draft_weight_update is a coroutine (an AsyncLLM): pass "
                "glm_fp8.integrations.vllm.clients.AsyncLLMClient(engine, loop) instead"
            )
        return fn, ""
    post = getattr(client, "_post", None)
    if isinstance(getattr(client, "base_url", None), str) and callable(post):  # vLLM's HTTP client
        return (lambda: post("start_draft_weight_update")), ""
    handles = getattr(client, "handles", None)
    if isinstance(handles, list) and handles:  # vLLM's Ray client: LLM / AsyncLLM actors

        def start() -> None:  # as the client's own calls: every actor at once, then wait for all
            # Ray is imported wherever its actor handles exist; glm_fp8 does not depend on it.
            sys.modules["ray"].get([h.start_draft_weight_update.remote() for h in handles])

        return start, ""
    return None, (
        f"{kind} has no start_draft_weight_update (nor vLLM's HTTP client's base_url, nor its Ray "
        "client's handles)"
    )


class LLMClient:
    """vLLM's offline ``LLM`` as a ``VLLMWeightSyncClient`` (its methods take the request dicts)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class AsyncLLMClient:
    """vLLM's ``AsyncLLM`` as a ``VLLMWeightSyncClient``: each call runs the engine's coroutine on
    ``loop`` (the running loop that owns the engine) and waits for it, from the trainer's thread."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def start_draft_weight_update(self) -> None:
        self._run(self.engine.start_draft_weight_update())

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self.engine.shutdown_weight_transfer_engine())


__all__ = ["AsyncLLMClient", "LLMClient", "VllmServer", "client_kind", "draft_starter"]

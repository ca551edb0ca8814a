"""A sender's per-layer kernels captured as CUDA graphs and replayed (docs/delta.md#graphs).

Why: without them a delta step is bound by the host, not the GPU or the link. Converting, packing
and comparing a GLM-5 layer's share queues a few hundred kernels through a few thousand Python
calls (3.7 ms a layer on an H100; replayed, 1.2 ms, the GPU's own work: bench/RESULTS.md
R32, R36). The same layer at the same position queues the same kernels on the same tensors update
after update, so the sender captures them once and replays them: one launch a layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")


def tensor_key(x: torch.Tensor) -> tuple:
    """What a captured kernel depends on of a tensor: where its bytes are and how it is laid out
    (``data_ptr`` includes the storage offset)."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride(), x.device)


def tensors_key(named: Iterable[tuple[str, torch.Tensor | None]]) -> tuple:
    """``tensor_key`` of each tensor by name, in name order (None stays None)."""
    return tuple((k, None if x is None else tensor_key(x)) for k, x in sorted(named, key=lambda kx: kx[0]))


class LayerGraphs:
    """Per layer position, its kernels captured once as a CUDA graph, then replayed.

    ``run(pos, key, work)``: ``work()`` queues a layer's kernels on the current stream (no
    collective, no host read, no host-to-device copy from pageable memory) and returns what its
    caller keeps of them (views and small result tensors). ``key`` names everything the kernels
    read and write that may change between calls: every tensor by ``tensor_key`` (the trainer's
    tensors, the buffers written), and the choices that change which kernels run. The first call
    with a key runs ``work`` as it is; the next with the same key captures it and replays it;
    later calls with that key replay it and return the captured results, tensors that each replay
    rewrites. A call with another key runs ``work`` and drops the position's graph. A capture
    that fails (some kernel cannot be captured) turns the graphs off for good (``failed`` says
    why) and runs ``work`` as it is.

    Memory pools: graphs captured in position order share one pool, since they replay in that
    order on one stream: a graph's temporaries may reuse an earlier graph's, never its results,
    which stay referenced. A graph captured after a later position's (its key changed: a
    trainer tensor moved) gets a pool of its own: in the shared pool its results could take the
    memory of a later graph's temporaries, which that graph's replay rewrites before the host
    reads them (a layer's non-finite check and its lengths are read after the next layer's
    kernels).

    Off on the CPU. Memory: the shared pool holds what the captured kernels allocate (the
    comparison's bitmaps and offsets of the largest layer, and each position's small results), a
    private pool its one graph's, beside the caching allocator's blocks of the uncaptured calls.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled and device.type == "cuda"
        self.failed: str | None = None
        self.captures = self.replays = 0
        self._pool = None  # shared by the graphs captured in position order
        self._last = -1  # the last position captured into it
        self._graphs: dict[int, tuple[Hashable, torch.cuda.CUDAGraph, object]] = {}
        self._seen: dict[int, Hashable] = {}

    def run(self, pos: int, key: Hashable | None, work: Callable[[], T]) -> T:
        """``work()``'s results, from a replay of its graph where ``key`` allows (None: never)."""
        if not self.enabled or key is None:
            return work()
        held = self._graphs.get(pos)
        if held is not None and held[0] == key:
            held[1].replay()
            self.replays += 1
            return held[2]
        self._graphs.pop(pos, None)
        if self._seen.get(pos) != key:
            out = work()
            self._seen[pos] = key  # after it ran: a key whose work raised is never captured
            return out
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if pos > self._last:
            pool, self._last = self._pool, pos
        else:  # out of order: a pool of its own (see the class)
            pool = torch.cuda.graph_pool_handle()
        try:
            # thread_local: another thread's CUDA calls (an engine's, a trainer's) do not break it
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = work()
            finally:
                graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured: run as it is
            self.enabled, self.failed = False, f"{type(exc).__name__}: {exc}"
            self._graphs.clear()
            with contextlib.suppress(Exception):
                torch.cuda.current_stream().synchronize()
            _end_generator_capture()
            return work()
        graph.replay()
        self.captures += 1
        self._graphs[pos] = (key, graph, out)
        return out

    def clear(self) -> None:
        """Drop every graph (their pool's memory goes back once no result is referenced)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool, self._last = None, -1


def _end_generator_capture() -> None:
    """After a capture whose end failed. ``CUDAGraph.capture_end`` raises when the capture was
    invalidated (a kernel that cannot be captured) before it tells the CUDA generators the capture
    is over, so they stay marked as capturing, and torch raises at the process's next random op on
    the GPU ("Offset increment outside graph capture"): the trainer's, not only ours. An empty
    capture, begun and ended on a stream of its own, marks them not capturing again."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        graph.capture_end()


__all__ = ["LayerGraphs", "tensor_key", "tensors_key"]

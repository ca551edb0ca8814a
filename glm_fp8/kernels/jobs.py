"""The job layer every backend plugs into: a job is one validated concatenation of sources
and its outputs (``plan_job``); ``run_jobs`` runs a group of jobs on one backend of the
registry (``glm_fp8.kernels.backends.LAUNCHERS``) with one non-finite flag and one host read for all,
and names the first NaN/Inf it finds (``NonFiniteError``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core import checks
from glm_fp8.core.errors import NonFiniteError
from glm_fp8.core.numerics import BLOCK, MAX_SOURCES, blocks_shape
from glm_fp8.kernels import backends
from glm_fp8.kernels.triton_quantize import LaunchConfig


def as3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` [(E,) R, C] as [E, R, C] (a 2-D tensor is one expert)."""
    return t if t.dim() == 3 else t.unsqueeze(0)


def _raise_if_non_finite(
    named_sources: Sequence[tuple[str, torch.Tensor]], s: torch.Tensor, stacked: bool
) -> None:
    """Scales are non-finite exactly where a block holds NaN/Inf; name the first such source."""
    bad = ~torch.isfinite(s)
    if not bool(bad.any()):
        return
    idx = [int(i) for i in bad.nonzero()[0]]
    expert, (rb, cb) = (idx[0], idx[1:]) if stacked else (None, idx)
    rows = (rb * BLOCK, (rb + 1) * BLOCK)
    cols = slice(cb * BLOCK, (cb + 1) * BLOCK)
    start = 0
    for name, src in named_sources:
        lo, hi = max(rows[0], start), min(rows[1], start + src.shape[-2])
        if lo < hi:
            part = (src[expert] if stacked else src)[lo - start : hi - start, cols]
            bad_el = (~torch.isfinite(part)).nonzero()
            if len(bad_el):
                r, c = int(bad_el[0, 0]) + lo - start, int(bad_el[0, 1]) + cols.start
                value = float(part[bad_el[0, 0], bad_el[0, 1]])
                at = f"[{expert}, {r}, {c}]" if stacked else f"[{r}, {c}]"
                where = f"expert {expert}, " if stacked else ""
                raise NonFiniteError(
                    f"{name}: {value} at {name}{at} ({where}128x128 block {rb},{cb} of the "
                    "output); refusing to quantize. Pass check_finite=False to skip this check.",
                    source=name,
                    expert=expert,
                    block=(rb, cb),
                )
        start += src.shape[-2]
    raise AssertionError("non-finite scale without a non-finite input block")  # pragma: no cover


@dataclass(frozen=True)
class Job:
    """One validated launch: named sources (for messages) and the caller-facing outputs."""

    named_sources: tuple[tuple[str, torch.Tensor], ...]
    q: torch.Tensor
    s: torch.Tensor
    stacked: bool


def plan_job(
    named_sources: Sequence[tuple[str, torch.Tensor]],
    out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    out_name: str,
    scale_name: str,
    inputs_checked: bool = False,
) -> Job:
    """Check one concatenation and its outputs (allocating those not given). Launches nothing.
    ``inputs_checked``: the caller already ran check_input and check_same_device on them."""
    if not named_sources:
        raise ValueError("sources: expected at least one tensor, got none")
    if len(named_sources) > MAX_SOURCES:
        raise ValueError(
            f"sources: at most {MAX_SOURCES} tensors are concatenated in one call, got {len(named_sources)}"
        )
    if not inputs_checked:
        for name, t in named_sources:
            checks.check_input(name, t)
        checks.check_same_device(named_sources)
    first_name, first = named_sources[0]
    device = first.device
    for name, t in named_sources[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} (as {first_name}), got {t.dtype}")
        if t.dim() != first.dim():
            raise ValueError(
                f"{name}: expected a {first.dim()}-D tensor (as {first_name}), got shape {tuple(t.shape)}"
            )
        if t.shape[-1] != first.shape[-1]:
            raise ValueError(
                f"{name}: expected {first.shape[-1]} columns (as {first_name}), got shape {tuple(t.shape)}"
            )
        if t.dim() == 3 and t.shape[0] != first.shape[0]:
            raise ValueError(
                f"{name}: expected {first.shape[0]} experts (as {first_name}), got shape {tuple(t.shape)}"
            )
    stacked = first.dim() == 3
    rows = sum(t.shape[-2] for _, t in named_sources)
    cols = first.shape[-1]
    experts = first.shape[0] if stacked else None
    q_shape = (rows, cols) if experts is None else (experts, rows, cols)
    s_shape = blocks_shape(rows, cols, experts)
    if out is None:
        out = torch.empty(q_shape, dtype=torch.float8_e4m3fn, device=device)
    else:
        checks.check_out(out_name, out, q_shape, torch.float8_e4m3fn, device)
    if scale_out is None:
        scale_out = torch.empty(s_shape, dtype=torch.float32, device=device)
    else:
        checks.check_out(scale_name, scale_out, s_shape, torch.float32, device)
    return Job(tuple(named_sources), out, scale_out, stacked)


_flags = threading.local()


def nonfinite_flag(device: torch.device) -> torch.Tensor:
    """This thread's int32 flag on ``device``, zero between calls: allocated once, not per call
    (an allocation and a zeroing per call cost host time; bench/RESULTS.md). Per thread,
    because a call reads its flag only after its kernels ran."""
    flags = _flags.__dict__.setdefault("by_device", {})
    flag = flags.get(device)
    if flag is None:
        # A normal tensor even when the first call runs under torch.inference_mode(): an inference
        # tensor could not be reset by a later call outside it (seen on the H200).
        with torch.inference_mode(False):
            flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def run_jobs(
    jobs: Sequence[Job],
    scale_fmt: str,
    check_finite: bool,
    config: LaunchConfig | None,
    backend: str | None,
    also: Sequence[tuple[str, torch.Tensor]] = (),
) -> None:
    """Launch every job on one backend; with ``check_finite``, one flag and one sync for all.

    ``also``: named floating tensors (a layer's passthrough entries) whose NaN/Inf the same flag
    and the same host read report, so a whole layer costs one sync however it is made."""
    busy = [job for job in jobs if job.s.numel()]
    also = [(n, t) for n, t in also if t.numel() and t.is_floating_point()] if check_finite else []
    if not busy and not also:
        return
    device = busy[0].q.device if busy else also[0][1].device
    name = backends.resolve_backend(backend, device, config is not None) if busy else ""
    # Scales are >= 1e-12 and a NaN/Inf block gives a NaN/Inf scale, so the kernels set one
    # int32 flag; the slow search that names the element runs only when it is set.
    flag = nonfinite_flag(device) if check_finite else None
    ue8m0 = scale_fmt == "ue8m0"
    work = [([as3d(t) for _, t in job.named_sources], as3d(job.q), as3d(job.s)) for job in busy]
    try:
        if work:
            backends.LAUNCHERS[name](work, ue8m0, flag, config)
        if also:
            # max |x| of every tensor in one multi-tensor reduction: NaN/Inf survive it.
            norms = torch._foreach_norm([t for _, t in also], float("inf"))
            flag.bitwise_or_((~torch.isfinite(torch.stack([n.float() for n in norms]))).any().to(torch.int32))
        found = flag is not None and bool(flag.item())
    except BaseException:
        if flag is not None:
            flag.zero_()  # a kernel may have set it before the failure: keep the next call clean
        raise
    if found:
        flag.zero_()
        for job in busy:
            _raise_if_non_finite(job.named_sources, job.s, job.stacked)
        for name, t in also:
            _raise_if_non_finite_tensor(name, t)
        raise AssertionError("the finite flag was set, yet no input holds NaN/Inf")  # pragma: no cover


def check_finite_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise ``NonFiniteError`` naming the first NaN/Inf of the named floating tensors: max |x| of
    all of them in one multi-tensor reduction and one host read. For tensors checked before
    anything is written from them (a layer's passthrough entries)."""
    named = [(n, t) for n, t in named if t.numel() and t.is_floating_point()]
    if not named:
        return
    norms = torch._foreach_norm([t for _, t in named], float("inf"))
    if bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
        return
    for name, t in named:
        _raise_if_non_finite_tensor(name, t)
    raise AssertionError("a non-finite max without a non-finite element")  # pragma: no cover


def _raise_if_non_finite_tensor(name: str, t: torch.Tensor) -> None:
    """A passthrough tensor with NaN/Inf: name its first bad element."""
    bad = (~torch.isfinite(t)).nonzero()
    if len(bad):
        at = [int(i) for i in bad[0]]
        value = float(t[tuple(at)])
        raise NonFiniteError(
            f"{name}: {value} at {name}{at}; refusing to send it. Pass check_finite=False to skip "
            "this check.",
            source=name,
            expert=None,
            block=None,
        )

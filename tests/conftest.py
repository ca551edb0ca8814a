"""Shared fixtures. Without a GPU the Triton kernels run in Triton's CPU interpreter; the
switch must be set before glm_fp8 (and its @triton.jit functions) is imported."""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from glm_fp8.kernels.backends import available_backends  # noqa: E402

ON_GPU = torch.cuda.is_available()
# Every backend that runs here: the correctness suite runs once per backend.
BACKENDS = available_backends("cuda" if ON_GPU else "cpu")
GPU_BACKENDS = [b for b in BACKENDS if b in ("triton", "cuda")] if ON_GPU else []


# tests/ mirrors the package: a test in tests/<part>/ carries the marker <part> (registered in
# pyproject.toml), one at the top (the repository's: docs, packaging, the package's layering) "repo":
# `pytest -m transfer` runs one part, as `pytest tests/transfer` does.
PARTS = ("core", "model", "kernels", "engine", "transfer", "planning", "integrations", "cli")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        part = Path(str(item.fspath)).parent.name
        item.add_marker(getattr(pytest.mark, part if part in PARTS else "repo"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """``GLM_FP8_REQUIRE_VLLM=1`` (CI's run of the real-vLLM and real-Megatron-Core tests): a test
    skipped there fails the run, so that a framework that did not install or import cannot pass as
    green."""
    if not os.environ.get("GLM_FP8_REQUIRE_VLLM"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reporter.write_line(f"GLM_FP8_REQUIRE_VLLM: {len(skipped)} test(s) skipped; none may be", red=True)
        session.exitstatus = 1


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def backend_id(name: str) -> str:
    """A backend's test id. The "torch" backend runs the reference itself (``kernels/torch_ref.py``
    calls ``glm_fp8.kernels.reference``): a test of it against the reference checks its wrapping (the
    caller's output buffers, strides, checks, poisoned bytes left unwritten), not its arithmetic,
    and its id says so. The arithmetic's independent checks are the other backends' (Triton here,
    Triton and CUDA on a GPU) and the hand-computed bytes of tests/kernels/test_reference.py."""
    return "torch-is-the-reference" if name == "torch" else name


@pytest.fixture(params=BACKENDS, ids=backend_id)
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def poisoned_fp8(shape, device) -> torch.Tensor:
    """An fp8 buffer of 0xFF (NaN) bytes, so an unwritten byte fails any bitwise comparison."""
    return torch.full(shape, 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


def poisoned_f32(shape, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)


def assert_same_bits(q, s, q_ref, s_ref) -> None:
    """fp8 bytes compared as uint8, scales as float32 bit patterns."""
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    qb, qrb = q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8)
    diff = (qb != qrb).nonzero()
    assert len(diff) == 0, f"{len(diff)} fp8 bytes differ, first at {diff[0].tolist()}"
    sb, srb = s.cpu().view(torch.int32), s_ref.cpu().view(torch.int32)
    diff = (sb != srb).nonzero()
    assert len(diff) == 0, f"{len(diff)} scales differ, first at {diff[0].tolist()}"

"""Every exception class glm_fp8 defines, under one base, ``GlmFp8Error``.

Each class also derives from the builtin that says its kind: ``ValueError`` for an argument or
an input the library refuses, ``RuntimeError`` for an update that stopped or a backend that cannot
run, so ``except ValueError`` around a call catches a refused argument whatever raised it. One
condition, one class: the same refusal raises the same class wherever it is found. ``glm_fp8``
exports every class (``glm_fp8.LinkLost``).

This module imports nothing from glm_fp8: it is the bottom of the package's layers.
"""

from __future__ import annotations


class GlmFp8Error(Exception):
    """A failure glm_fp8 names with its own class: catching it catches every one of them (an update
    that aborted or was refused, manifests that disagree, non-finite weights, an engine or a plan
    request the library cannot serve). It does not catch the plain ``ValueError``/``TypeError``
    an argument check raises before anything runs (those name the argument), nor errors of torch,
    the link or vLLM underneath."""


# --- the transfer (glm_fp8.transfer.wire) ---------------------------------------------------------


class UpdateAborted(GlmFp8Error, RuntimeError):
    """The weight update did not complete; parameters may hold a mix of old and new layers."""


class LinkLost(UpdateAborted):
    """A rank of the link died, hangs, or its transport failed mid-update (``glm_fp8.transfer.liveness``):
    the link cannot carry another update and must be rebuilt without that rank. The message names
    the rank (its server, where the link knows it) and what to call next; ``rank`` is that link
    rank, None where no rank could be named (a transport error with every peer still beating)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class ManifestMismatch(GlmFp8Error, ValueError):
    """A rank's manifest (layers, entries or transfer plan) differs from the leader's, or it
    refused its prelude; nothing was sent and no parameter was touched."""


class ReceiverRefused(GlmFp8Error, RuntimeError):
    """An engine rank refused a step of the update (its reason is in the message); every rank stopped."""


class LayerOrderError(GlmFp8Error, ValueError):
    """``send_model`` was handed a layer other than the one the manifest announced next."""


# --- the conversion (glm_fp8.kernels.jobs) --------------------------------------------------------


class NonFiniteError(GlmFp8Error, ValueError):
    """A source holds NaN or Inf. ``source``, ``expert``, ``block`` say where (first found);
    ``block`` is None for a tensor that is passed through unquantized."""

    def __init__(self, message: str, source: str, expert: int | None, block: tuple[int, int] | None):
        super().__init__(message)
        self.source = source
        self.expert = expert
        self.block = block


# --- a vLLM worker (glm_fp8.integrations.vllm.probe, updater) -------------------------------------


class EngineNotSupported(GlmFp8Error, ValueError):
    """The engine holds its weights in a form glm_fp8 cannot update in place (the reason names
    the setting and the vLLM source it was read from)."""


class EngineCallFailed(GlmFp8Error, RuntimeError):
    """An engine server's API call failed: it answered an error, or did not answer (``answered``
    False: the server is unreachable or died). The message names the server, the call and the
    server's account (``glm_fp8.integrations.sglang.SGLangHttpClient``)."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


# --- sizing (glm_fp8.planning.report) -------------------------------------------------------------


class BackendUnavailable(GlmFp8Error, RuntimeError):
    """The backend asked for (``backend=``, ``$GLM_FP8_BACKEND``) cannot run the tensors at hand:
    the CUDA extension is not built, no CUDA device is visible, or the Triton kernels were asked
    to run on the CPU outside Triton's interpreter. The message names the backend and the device."""


class PlanArgumentError(GlmFp8Error, ValueError):
    """A request ``plan_report`` refuses; ``argument`` names the ``PlanRequest`` field."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message


__all__ = [
    "BackendUnavailable",
    "EngineCallFailed",
    "EngineNotSupported",
    "GlmFp8Error",
    "LayerOrderError",
    "LinkLost",
    "ManifestMismatch",
    "NonFiniteError",
    "PlanArgumentError",
    "ReceiverRefused",
    "UpdateAborted",
]

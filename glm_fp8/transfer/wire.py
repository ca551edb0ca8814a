"""The wire format of a weight update: the protocol's words, the manifest, the checksum, the
refusal codes (the errors every rank raises are ``glm_fp8.core.errors``';
docs/layouts.md#the-protocol).

Protocol version 5 (4 until a delta layer could be resent dense, 3 until scatter classes became per
piece and the manifest named the wire format ``wire``). One protocol for every mode: a transfer
plan (``glm_fp8.transfer.routes``) says which sender sends which bytes of each layer to which
engine ranks, one sender (the full broadcast, scatter) or many. Every rank of the link runs the same steps:

1. Prelude ``int64[4]`` = ``[MAGIC, VERSION, manifest bytes, refusing]`` from the leader ``src``
   (``refusing`` 1: the leader refused its own arguments, length 0, and votes why); vote.
   A rank refuses a wrong magic or version, or a length outside ``(0, max_manifest_bytes]``,
   before it allocates anything from that length.
2. The manifest, UTF-8 JSON (data only, no pickle), from the leader; vote. It carries every
   layer's entries and the whole transfer plan (senders, engine layouts, every segment), so this
   vote is where every rank agrees on everything that must agree: a rank whose own manifest
   differs refuses, and only then are the plan's process groups created.
3. One step per announced layer, then a last step COMPLETE: the leader's header ``int64[8]`` =
   ``[MAGIC, status, layer index, position, wire bytes, 0, 0, 0]``, the layer's segments (each
   the pieces a sender has for one class of engine ranks, then its checksum word; point to point,
   or one broadcast where a class of replicas shares a group with its single sender), then one
   vote that carries every check of the step, each decided on the device (an engine rank's header
   and checksums, a sender's own failure or non-finite weights). Steps are queued with no host
   wait; a rank reads a step's vote only after it queued the next step, so a failed vote stops
   every rank one step later, and an engine rank hands a layer out only after its vote passed.
   In a delta update (docs/delta.md) a layer whose vote is ``RESEND_DENSE`` is not handed out;
   after the last layer's vote, before COMPLETE, each such layer is a step again, dense, with
   the same header.

A vote is an ``int64[1]`` all-reduce with MAX: every rank contributes 0 or a refusal code
``reason * 2**20 + rank`` (never negative), so no rank's value can hide another's refusal and
every rank leaves the update at the same step with an error naming the highest refusal. When the
prelude or manifest vote fails, the rank it names then broadcasts its reason (``REASON_BYTES`` of
UTF-8 text), so every rank's error says why. A rank whose own constructor refused its arguments
still runs step 1: it takes the prelude (the leader sends one with word 3 set and length 0) and
votes ``REFUSED_ARGUMENTS``, so the others stop there naming it and the argument, instead of
waiting for it until the transport's timeout. Only a dead or silent peer is left to that timeout.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence

import torch

from glm_fp8.core.errors import LinkLost, ManifestMismatch, UpdateAborted
from glm_fp8.kernels.checksum import checksum_rows, checksum_torch, checksum_triton
from glm_fp8.model.layer_plan import LayerPlan

PROTOCOL_VERSION = 5
MAGIC = int.from_bytes(b"glm_fp8\x03", "little")  # first word of the prelude and of every header
DATA, COMPLETE = 1, 2
STATUSES = {DATA: "DATA", COMPLETE: "COMPLETE"}
MAX_MANIFEST_BYTES = 64 << 20  # default cap; a GLM-5 manifest is well under 1 MiB
HEADER_WORDS = 8
CHECKSUM_BYTES = 8

# Refusal reasons, in increasing precedence (a vote's MAX reports the highest). RESEND_DENSE, the
# lowest, is not a refusal: a delta layer an engine rank rebuilt and changed differs from its
# sender's checksum, and every rank takes that layer again, dense, before COMPLETE.
(
    RESEND_DENSE,
    REFUSED_PRELUDE,
    REFUSED_MANIFEST,
    REFUSED_PARAMS,
    REFUSED_HEADER,
    BAD_CHECKSUM,
    CONSUMER_FAILED,
    SENDER_FAILED,
    REFUSED_ARGUMENTS,
) = range(1, 10)
REFUSAL_REASONS = {
    RESEND_DENSE: "rebuilt a delta layer whose checksum differs from its sender's (resent dense)",
    REFUSED_PRELUDE: "refused the manifest's prelude (magic, version or length)",
    REFUSED_MANIFEST: "refused the manifest",
    REFUSED_PARAMS: "refused its parameters (name, shape, dtype, device, aliasing or requires_grad) or its "
    "layout",
    REFUSED_HEADER: "refused a layer header that disagrees with the manifest",
    BAD_CHECKSUM: "received a segment whose checksum differs from its sender's",
    CONSUMER_FAILED: "failed while landing a layer in its parameters",
    SENDER_FAILED: "(a sender) failed: a layer other than announced, a bad state dict or non-finite weights",
    # Voted only at the prelude, by a rank whose own constructor refused its arguments.
    REFUSED_ARGUMENTS: "refused its own arguments",
}
# After a refused prelude or manifest vote, the rank the verdict names broadcasts why, in this many
# bytes of UTF-8 (fixed, so that no length is announced by the refusing rank).
REASON_BYTES = 1024
_RANK_BITS = 20


def refusal_code(reason: int, rank: int) -> int:
    return (reason << _RANK_BITS) + (rank & ((1 << _RANK_BITS) - 1))


def refusal_reason(code: int) -> int:
    return code >> _RANK_BITS


def refusal_rank(code: int) -> int:
    return code & ((1 << _RANK_BITS) - 1)


def link_failure(where: str, exc: BaseException) -> UpdateAborted:
    """The error for a link operation that raised ``exc`` while doing ``where``: a ``LinkLost``
    (naming the lost rank) stays one; anything else becomes an ``UpdateAborted``."""
    if isinstance(exc, LinkLost):
        return LinkLost(f"{where}: {exc}", exc.rank)
    return UpdateAborted(f"{where}: {exc}")


def header_error(got: Sequence[int], want: Sequence[int], where: str) -> UpdateAborted:
    """The error of an engine rank that refused a step's header ``got`` (the manifest's: ``want``)."""
    names = ("magic", "status", "layer", "position", "nbytes")
    k = next(j for j in range(5) if got[j] != want[j])
    show = (lambda v: STATUSES.get(v, v)) if k == 1 else (lambda v: v)
    return UpdateAborted(
        f"header ({where}): expected {names[k]} {show(want[k])} (the manifest's), got "
        f"{show(got[k])}; its segments were refused, every rank was stopped"
    )


def describe_refusal(code: int) -> str:
    reason = refusal_reason(code)
    return f"rank {refusal_rank(code)} {REFUSAL_REASONS.get(reason, f'refused (unknown reason {reason})')}"


# The wire format: what the entries travel as (kernel-format fp8, or unquantized bf16 for receivers
# that quantize). "Mode" names how an update travels (broadcast, scatter, many senders).


def header_words(status: int, layer_idx: int, pos: int, nbytes: int = 0) -> list[int]:
    """A step's header: ``HEADER_WORDS`` words."""
    return [MAGIC, status, layer_idx, pos, nbytes, 0, 0, 0]


def manifest_of(plans: Sequence[LayerPlan], layer_ids: Sequence[int], wire: str, checksum: bool) -> dict:
    """The layers and entries of an update as data (the transfer plan is added by the caller)."""
    return {
        "format": "glm_fp8",
        "version": PROTOCOL_VERSION,
        "wire": wire,
        "checksum": checksum,
        "layers": [
            {"layer": i, "nbytes": p.nbytes, "scale_fmt": p.scale_fmt, "entries": p.manifest()}
            for i, p in zip(layer_ids, plans)
        ],
    }


def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":")).encode()


def decode_manifest(raw: torch.Tensor | bytes) -> object:
    """JSON from bytes or a contiguous CPU uint8 tensor, read in place (no numpy needed). Raises
    ``ManifestMismatch`` for bytes that are not UTF-8 JSON, nesting too deep for the parser
    included (so a receiver refuses it at the vote instead of leaving with a RecursionError)."""
    if isinstance(raw, (bytes, bytearray)):
        text = bytes(raw)
    else:
        text = ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestMismatch(f"manifest: not valid UTF-8 JSON ({type(exc).__name__}: {exc})") from exc


def compare_manifest(got: object, want: dict, layer_ids: Sequence[int], *, require_checksum: bool) -> None:
    """Raise ``ManifestMismatch`` naming the first difference between the leader's manifest ``got``
    (decoded JSON, any shape) and this rank's ``want``; ``require_checksum``: refuse one that
    carries no checksums."""
    if not isinstance(got, dict):
        raise ManifestMismatch(f"manifest: expected a JSON object, got {type(got).__name__}")
    for key in ("format", "version", "wire"):
        if got.get(key) != want[key]:
            raise ManifestMismatch(f"manifest: expected {key}={want[key]!r}, got {got.get(key)!r}")
    if not isinstance(got.get("checksum"), bool):
        raise ManifestMismatch(f"manifest: expected checksum true or false, got {got.get('checksum')!r}")
    if require_checksum and not got["checksum"]:
        raise ManifestMismatch(
            "manifest: this receiver requires checksums (Receiver(checksum=True)), the sender sends none "
            "(Sender(checksum=False))"
        )
    layers = got.get("layers")
    if not isinstance(layers, list) or len(layers) != len(want["layers"]):
        n = len(layers) if isinstance(layers, list) else layers
        raise ManifestMismatch(f"manifest: expected {len(want['layers'])} layers, got {n}")
    for g, w in zip(layers, want["layers"]):
        if g == w:
            continue
        if not isinstance(g, dict) or g.get("layer") != w["layer"]:
            where = g.get("layer") if isinstance(g, dict) else g
            raise ManifestMismatch(
                f"manifest: expected layers {list(layer_ids)} in this order (-1: the non-layer tensors), "
                f"got layer {where!r} where {w['layer']} was expected"
            )
        if g.get("scale_fmt") != w["scale_fmt"]:
            raise ManifestMismatch(
                f"manifest: layer {w['layer']}: expected scale_fmt {w['scale_fmt']!r} (this receiver's), "
                f"got {g.get('scale_fmt')!r}; sender and receivers need the same one"
            )
        ge = {e.get("name"): e for e in g.get("entries", []) if isinstance(e, dict)}
        for e in w["entries"]:
            if ge.get(e["name"]) != e:
                raise ManifestMismatch(
                    f"manifest: layer {w['layer']} entry {e['name']}: expected {e}, got {ge.get(e['name'])}"
                )
        raise ManifestMismatch(f"manifest: layer {w['layer']}: expected {w}, got {g}")
    if got.get("plan") != want["plan"]:
        plans = [
            m.get(k) if isinstance(m, dict) else m
            for m in (want["plan"], got.get("plan"))
            for k in ("senders", "engines")
        ]
        raise ManifestMismatch(
            "manifest: the transfer plan differs (senders= and engines= must be the same lists on every "
            f"rank): expected senders {plans[0]} and engines {plans[1]}, got senders {plans[2]} and "
            f"engines {plans[3]}"
        )


def checksum_scratch(max_nbytes: int, device: torch.device) -> torch.Tensor:
    """int64 scratch for ``message_checksum`` of messages up to ``max_nbytes`` on ``device``
    (one partial sum per 32 KiB; none needed on the CPU)."""
    rows = checksum_rows(max_nbytes) if torch.device(device).type == "cuda" else 1
    return torch.empty(rows, dtype=torch.int64, device=device)


def message_checksum(data: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The checksum (``glm_fp8.kernels.checksum``) of a uint8 message whose length is a multiple
    of 8, as an int64 device scalar: one read of the message, queued on the current stream."""
    if data.numel() % 8:
        raise ValueError(f"message_checksum: expected a multiple of 8 bytes, got {data.numel()}")
    words = data.view(torch.int64)
    return checksum_triton(words, scratch) if data.is_cuda else checksum_torch(words)


__all__ = [
    "BAD_CHECKSUM",
    "CHECKSUM_BYTES",
    "COMPLETE",
    "CONSUMER_FAILED",
    "DATA",
    "HEADER_WORDS",
    "MAGIC",
    "MAX_MANIFEST_BYTES",
    "PROTOCOL_VERSION",
    "REASON_BYTES",
    "REFUSED_ARGUMENTS",
    "REFUSED_HEADER",
    "REFUSED_MANIFEST",
    "REFUSED_PARAMS",
    "REFUSED_PRELUDE",
    "RESEND_DENSE",
    "SENDER_FAILED",
    "checksum_scratch",
    "compare_manifest",
    "decode_manifest",
    "describe_refusal",
    "header_error",
    "link_failure",
    "encode_manifest",
    "header_words",
    "manifest_of",
    "message_checksum",
    "refusal_code",
    "refusal_rank",
    "refusal_reason",
]

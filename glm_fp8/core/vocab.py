"""The package's string vocabularies, each defined once: a ``Literal`` type (what a signature
accepts) and the tuple of its values (what a message lists), checked by one function,
``check_choice``. Values stay plain strings, so they travel as they are in JSON (vLLM's
init info), in the CLI's options and in manifests. docs/map.md#words says what each word means.
"""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

# How an update travels: every engine rank receives every byte ("broadcast"), each its own shard
# from one sender ("scatter"), or from many senders, each trainer rank its own share ("senders").
TransferMode = Literal["broadcast", "scatter", "senders"]
TRANSFER_MODES: tuple[TransferMode, ...] = get_args(TransferMode)

# What the entries travel as: the kernel format, quantized by the sender ("fp8"), or unquantized,
# for receivers that quantize ("bf16").
WireFormat = Literal["fp8", "bf16"]
WIRE_FORMATS: tuple[WireFormat, ...] = get_args(WireFormat)

# The block scales: float32 ("fp32") or powers of two ("ue8m0", as DeepGEMM holds them).
ScaleFormat = Literal["fp32", "ue8m0"]
SCALE_FORMATS: tuple[ScaleFormat, ...] = get_args(ScaleFormat)

# Whose parameters an engine rank holds (their names and which group splits what).
Engine = Literal["vllm", "sglang"]
ENGINES: tuple[Engine, ...] = get_args(Engine)

# How a DSA indexer's wk and weights_proj travel: "fused" into one bf16 wk_weights_proj (vLLM; SGLang
# when the config interleaves the indexer's rotary), or "split": wk block-FP8, weights_proj as it is
# (SGLang otherwise); "both": each, for an update whose engine ranks hold it both ways (each rank
# receives only its own form).
IndexerForm = Literal["fused", "split", "both"]
INDEXER_FORMS: tuple[IndexerForm, ...] = get_args(IndexerForm)

# The GPU generation whose kernel layout the entries take (Blackwell packs UE8M0 scales).
Target = Literal["hopper", "blackwell"]
TARGETS: tuple[Target, ...] = get_args(Target)

# How a single sender collects DTensor layers (glm_fp8.transfer.gather.collect_layer).
Gather = Literal["auto", "full", "chunked", "quantize_then_gather"]
GATHERS: tuple[Gather, ...] = get_args(Gather)

# Where a delta sender keeps the copy of what the engine ranks hold.
KeptCopy = Literal["gpu", "host"]
KEPT_COPIES: tuple[KeptCopy, ...] = get_args(KeptCopy)

# How the vLLM backend updates an MTP drafter: in its own weight-update session ("session"), in
# the target's update ("stream"), or not at all ("none").
Draft = Literal["session", "stream", "none"]
DRAFTS: tuple[Draft, ...] = get_args(Draft)

# The torch.distributed backend of the vLLM backend's link.
LinkBackend = Literal["nccl", "gloo"]
LINK_BACKENDS: tuple[LinkBackend, ...] = get_args(LinkBackend)

# Which kernels run the quantization ("auto": the fastest that runs here).
Backend = Literal["auto", "triton", "cuda", "torch"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

W = TypeVar("W")


def check_choice(what: str, value: object, choices: tuple[W, ...], *, also: tuple = ()) -> W:
    """``value`` if it is one of ``choices`` (or of ``also``: "auto", None, ...), else a
    ValueError naming ``what`` (the argument or field) and every accepted value."""
    if value in choices or value in also:
        return value  # type: ignore[return-value]
    accepted = ", ".join(repr(v) for v in (*also, *choices))
    raise ValueError(f"{what}: expected one of {accepted}, got {value!r}")


__all__ = [
    "BACKENDS",
    "DRAFTS",
    "ENGINES",
    "GATHERS",
    "INDEXER_FORMS",
    "KEPT_COPIES",
    "LINK_BACKENDS",
    "SCALE_FORMATS",
    "TARGETS",
    "TRANSFER_MODES",
    "WIRE_FORMATS",
    "Backend",
    "Draft",
    "Engine",
    "Gather",
    "IndexerForm",
    "KeptCopy",
    "LinkBackend",
    "ScaleFormat",
    "Target",
    "TransferMode",
    "WireFormat",
    "check_choice",
]

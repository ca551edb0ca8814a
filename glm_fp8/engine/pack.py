"""Moved to ``glm_fp8.transfer.pack``; kept so old imports work. Nothing in glm_fp8 imports this
module: ``glm_fp8.engine`` holds only how a vLLM rank holds its parameters."""

from glm_fp8.transfer.pack import (
    CHECKSUM_BYTES,
    FULL,
    LayerScatter,
    ShardPack,
    ShardPiece,
    UpdateRegions,
    full_pack,
    layer_scatter,
    layout_words,
    scatter_classes,
    shard_pack,
    update_bytes,
    update_regions,
)

__all__ = [
    "CHECKSUM_BYTES",
    "FULL",
    "LayerScatter",
    "ShardPack",
    "ShardPiece",
    "UpdateRegions",
    "full_pack",
    "layer_scatter",
    "layout_words",
    "scatter_classes",
    "shard_pack",
    "update_bytes",
    "update_regions",
]

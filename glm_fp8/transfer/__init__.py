"""Weight updates on the wire: the format (``wire``), what both ends share (``endpoint``), the
sending trainer rank (``sender``), the receiving engine rank (``receiver``) and the collection
of sharded trainer weights (``gather``)."""

from glm_fp8.transfer.gather import contribute_shards
from glm_fp8.transfer.receiver import Receiver
from glm_fp8.transfer.sender import Broadcaster
from glm_fp8.transfer.wire import (
    HostSinkComm,
    LayerOrderError,
    ManifestMismatch,
    ReceiverRefused,
    UpdateAborted,
)

__all__ = [
    "Broadcaster",
    "HostSinkComm",
    "LayerOrderError",
    "ManifestMismatch",
    "Receiver",
    "ReceiverRefused",
    "UpdateAborted",
    "contribute_shards",
]

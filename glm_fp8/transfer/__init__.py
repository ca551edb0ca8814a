"""Weight updates on the wire: the format (``wire``), the link it travels on (``link``), what
every rank shares (``endpoint``), the sending trainer ranks (``sender``), the receiving engine ranks
(``receiver``, landing in ``land``) and the collection of sharded trainer weights (``gather``)."""

from glm_fp8.transfer.delta_send import DeltaOptions
from glm_fp8.transfer.gather import contribute_shards
from glm_fp8.transfer.link import HostSinkComm, Link, ObjectLink, StoreLink, TorchLink, as_link
from glm_fp8.transfer.receiver import Receiver
from glm_fp8.transfer.sender import Broadcaster, Sender
from glm_fp8.transfer.wire import (
    LayerOrderError,
    LinkLost,
    ManifestMismatch,
    ReceiverRefused,
    UpdateAborted,
)

__all__ = [
    "Broadcaster",
    "DeltaOptions",
    "HostSinkComm",
    "LayerOrderError",
    "Link",
    "LinkLost",
    "ManifestMismatch",
    "ObjectLink",
    "Receiver",
    "ReceiverRefused",
    "Sender",
    "StoreLink",
    "TorchLink",
    "UpdateAborted",
    "as_link",
    "contribute_shards",
]

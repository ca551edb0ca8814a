"""Weight updates on the wire, one protocol for every mode (docs/layouts.md#the-transfer-plan).

From the bottom: the protocol's words (``wire``), the link it travels on (``link``, watched by
``liveness``), an engine rank's share of a layer (``pack``), the senders' ownership (``owners``),
the transfer plan (``routes``) and how a segment travels (``topology``), the votes (``votes``),
what a trainer hands in (``trainer_input``), landing in an engine rank's parameters (``land``),
the options a sender and an engine rank are built with (``options``), what both ends share
(``endpoint``), the gathers of sharded trainer weights (``gather``, ``share``),
delta updates (``delta/``), a sender's layers captured as CUDA graphs (``graphs``), and on top the
two ends: ``Sender`` (``sender``) and ``Receiver`` (``receiver``)."""

from glm_fp8.transfer.gather import contribute_shards
from glm_fp8.transfer.link import HostSinkComm, Link, ObjectLink, StoreLink, TorchLink, as_link
from glm_fp8.transfer.options import DeltaOptions, ReceiveOptions, SendOptions, UpdateOptions
from glm_fp8.transfer.receiver import Receiver
from glm_fp8.transfer.sender import Sender

__all__ = [
    "DeltaOptions",
    "HostSinkComm",
    "Link",
    "ObjectLink",
    "ReceiveOptions",
    "Receiver",
    "SendOptions",
    "Sender",
    "StoreLink",
    "TorchLink",
    "UpdateOptions",
    "as_link",
    "contribute_shards",
]

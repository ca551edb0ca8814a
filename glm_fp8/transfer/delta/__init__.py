"""Delta updates on the wire (docs/delta.md): only the FP8 bytes and scales that changed since the
update every engine rank holds. The two messages of a delta segment, packed on the device
(``wire``); which update each rank holds (``versions``); what both ends derive alike from the
versions and the transfer plan (``segments``); the sender's collaborator (``send``: ``DeltaOptions``,
``SenderDelta``, the kept copy) and the engine's (``receive``: ``ReceiverDelta``: rebuild, check,
apply); delta state carried from one link to the next (``carry``). ``Sender`` and ``Receiver`` own
one collaborator each and call it through its methods."""

from glm_fp8.transfer.options import DeltaOptions

__all__ = ["DeltaOptions"]

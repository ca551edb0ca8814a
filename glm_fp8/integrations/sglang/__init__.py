"""glm_fp8 inside an SGLang 0.5.23 server, through its weight-update session (docs/sglang.md#the-hook).

SGLang 0.5.23 has no receiver plug-in. Its narrowest sanctioned path for bytes that arrive by other
means is a custom weight loader, run by ``update_weights_from_tensor`` inside a
``begin_weight_update`` / ``end_weight_update`` session on every TP rank of the server, in its
scheduler process, with the model. So the server starts with
``--custom-weight-loader glm_fp8.integrations.sglang.receive_update``, and one update is:

1. the trainer: ``pause_generation``, ``begin_weight_update`` (SGLang restores any in-place packing);
2. the trainer: ``update_weights_from_tensor(load_format=LOADER, ...)`` with the update as its
   payload (returns when every rank has landed), while every trainer rank that sends runs its
   ``Sender``; each SGLang rank runs ``receive_update``: a ``Receiver`` over glm_fp8's link (the
   bytes travel there, never through the call) lands its shard in the model's own parameters, then
   SGLang's ``post_load_weights`` derives MLA's ``w_kc`` / ``w_vc`` (a session in which a loader ran
   counts as loaded, so ``end_weight_update`` would not);
3. the trainer: ``end_weight_update`` (SGLang's ``process_weights_after_loading``),
   ``continue_generation``.

A speculative server's MTP drafter (``SGLangUpdate(drafter=True)``) takes the MTP layer in a second
update on the same link, inside the same call: SGLang runs the loader again, for the drafter
(docs/sglang.md#the-mtp-drafter).

The package by role:

- ``update``: ``SGLangUpdate``, the payload: the link's address and this server's ranks on it, and
  what every rank must agree on (the config, the layers, the senders, every rank's layout);
- ``loader``: the SGLang rank's side, ``receive_update`` (its layout, its model's parameters);
- ``client``: the trainer's side, ``SGLangHttpClient`` (the server's HTTP routes),
  ``SGLangUpdateCall`` (steps 1 to 3 from trainer rank 0, the update call in a thread, a failure
  reported on the link) and ``start_update`` (every server's, collective over the trainer's ranks).
"""

from glm_fp8.integrations.sglang.client import SGLangHttpClient, SGLangUpdateCall, start_update
from glm_fp8.integrations.sglang.loader import (
    KV_SCALES,
    SGLangLanding,
    receive_update,
    sglang_landing,
    sglang_rank_layout,
)
from glm_fp8.integrations.sglang.update import LOADER, PAYLOAD, SGLangUpdate

__all__ = [
    "KV_SCALES",
    "LOADER",
    "PAYLOAD",
    "SGLangHttpClient",
    "SGLangLanding",
    "SGLangUpdate",
    "SGLangUpdateCall",
    "receive_update",
    "sglang_landing",
    "sglang_rank_layout",
    "start_update",
]

"""Which ranks take a layer as a delta (glm_fp8.transfer.delta.versions, decided by
glm_fp8.transfer.delta.segments.delta_layers): a rank gets a delta only on the exact bytes it was
computed against; after a restart, a failed update or a bad checksum the layer goes dense, and a
failed update needs no rollback."""

import pytest
import torch

from glm_fp8.transfer.delta.segments import delta_layers, versions_row
from glm_fp8.transfer.delta.versions import NONE, HeldVersions, KeptVersions


def _dense(kept, engines, update) -> list[frozenset[int]]:
    """Per layer, the engine ranks that take ``update`` dense: the versions table of the sender
    (link rank 0: its kept versions, then the update it proposes) and each engine rank."""
    size = 1 + max(engines)
    rows = [versions_row(size, 0, [*kept.kept, update], "cpu")]
    rows += [versions_row(size, r, [*e.held, NONE], "cpu") for r, e in engines.items()]
    number, fresh = delta_layers(torch.stack(rows).amax(dim=0), [0], list(engines))
    assert number == update
    return [frozenset(engines) - f for f in fresh]


def _updates(kept, engines, update, *, fail_at=None, bad_checksum=()):
    """One update of every layer: the sender compares each layer (its kept copy moves), each engine
    rank marks it being written, then holds it, unless the update fails at layer ``fail_at`` (that
    layer half written, none after it) or its checksum differs (``bad_checksum``: (rank, pos) pairs).
    Returns the dense ranks per layer."""
    dense = _dense(kept, engines, update)
    for pos in range(len(kept.kept)):
        kept.compared(pos, update)
        for r, e in engines.items():
            e.writing(pos)
            if pos != fail_at and (r, pos) not in bad_checksum:
                e.holds(pos, update)
        if pos == fail_at:  # the sender had compared the next layer already (the pipeline)
            if pos + 1 < len(kept.kept):
                kept.compared(pos + 1, update)
            break
    return dense


def test_a_sequence_with_a_restart_and_a_failed_update():
    kept = KeptVersions(3)
    engines = {1: HeldVersions(3), 2: HeldVersions(3)}
    assert _updates(kept, engines, 0) == [frozenset({1, 2})] * 3  # no kept copy: dense
    assert _updates(kept, engines, 1) == [frozenset()] * 3  # both hold update 0: deltas
    engines[2] = HeldVersions(3)  # rank 2 restarted
    assert _updates(kept, engines, 2) == [frozenset({2})] * 3
    # Update 3 fails writing layer 1: the kept copy of layers 1 and 2 moved on, the engines' did not.
    _updates(kept, engines, 3, fail_at=1)
    assert engines[1].held == [3, NONE, 2] and kept.kept == [3, 3, 3]
    assert _updates(kept, engines, 4, bad_checksum={(1, 2)}) == [
        frozenset(),
        frozenset({1, 2}),
        frozenset({1, 2}),
    ]
    assert engines[1].held == [4, 4, NONE] and engines[2].held == [4, 4, 4]
    assert _updates(kept, engines, 5) == [frozenset(), frozenset(), frozenset({1})]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="update"):
        HeldVersions(1).holds(0, -2)
    with pytest.raises(ValueError, match="update"):
        KeptVersions(1).compared(0, True)
    assert HeldVersions(2).vector().tolist() == [NONE, NONE]

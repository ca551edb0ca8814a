"""A rank killed in the middle of an update (SIGKILL, no word to anyone) stops every other rank
within seconds, naming it, in every mode and over both kinds of link with a store.

Invariant: every surviving rank raises ``LinkLost`` naming the dead link rank within 10 s of the
kill, far below the transport's timeout (``PG_TIMEOUT``): the trainer's senders, the engine ranks
that talk to the dead one and those that do not (waiting on a live peer), and the ranks of a group
broadcast it was part of. Ranks run in forked processes over gloo; the dead one kills itself once
a layer has landed on it. ``liveness.py``'s own cases (a lease that expires, a rank that leaves on
purpose, a store that goes) are below, in one process.
"""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch

WHOLE = model_layer_ids(TINY_GLM5)
PG_TIMEOUT = 120.0  # the transport's: no rank may need it
WITHIN = 10.0  # seconds from the kill to every other rank's error


def _engines(case: str, n: int):
    from glm_fp8.engine import EngineLayout

    if case == "full":  # one class of replicas: a group broadcast spans every engine rank
        return ["full"] * n
    if case == "ep":
        return EngineLayout.all_ranks(1, n, True)
    return [EngineLayout(tp_size=2, tp_rank=r % 2, dp_size=n // 2, dp_rank=r // 2) for r in range(n)]


def _rank(rank, world, n_senders, case, link_kind, victim, port):
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.core.errors import LinkLost
    from glm_fp8.engine import engine_params
    from glm_fp8.testing import sharded_layer, synthetic_layer
    from glm_fp8.transfer import Receiver, Sender, StoreLink

    engines = _engines(case, world - n_senders)
    comm = None
    if link_kind == "store":  # a link of its own over a TCP store, as the vLLM backend's
        timeout = timedelta(seconds=PG_TIMEOUT)
        comm = StoreLink("127.0.0.1", port, rank, world, backend="gloo", timeout=timeout)
    mesh = DeviceMesh("cpu", torch.arange(n_senders)) if n_senders > 1 else None
    links = [None] * n_senders + engines
    kw = dict(
        config=TINY_GLM5,
        layer_ids=WHOLE,
        rest=True,
        device="cpu",
        engines=links,
        senders=list(range(n_senders)),
    )
    try:
        if rank < n_senders:
            sender = Sender(comm, 0, **kw)

            def make(i):
                return (
                    sharded_layer(TINY_GLM5, i, mesh) if mesh is not None else synthetic_layer(TINY_GLM5, i)
                )

            sender.send_model(((i, make(i)) for i in WHOLE), rest=make(REST))
            return "sent", None, None, None
        layout = engines[rank - n_senders]
        receiver = Receiver(comm, 0, layout=None if layout == "full" else layout, **kw)
        if layout == "full":  # whole entries, handed out layer by layer
            for k, _ in enumerate(receiver.receive_layers()):
                if k == 1 and rank == victim:  # a layer landed on it: now it dies, saying nothing
                    _die()
            return "loaded", None, None, None, None
        land = receiver._land

        def landed_then_killed(pos, *args):
            land(pos, *args)
            if pos == 1 and rank == victim:
                _die()

        receiver._land = landed_then_killed
        params = {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in engine_params(TINY_GLM5, layout).items()}
        receiver.load_into(params)
        return "loaded", None, None, None
    except LinkLost as exc:
        after = time.time() - float(_default_store().get("test/killed_at"))  # seconds since the kill
        if rank == 0:  # it serves the store: it stays up a beat or two, as a trainer that goes on
            time.sleep(1.5)
        return "LinkLost", str(exc), exc.rank, after
    finally:
        if comm is not None:
            comm.close()


def _default_store():
    return torch.distributed.distributed_c10d._get_default_store()


def _die() -> None:
    _default_store().set("test/killed_at", str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize(
    "n_senders, case, link_kind",
    [
        (1, "tp", "default"),  # one sender scattering into four engine ranks (TP 2 x DP 2)
        (1, "full", "default"),  # a group broadcast that spans the dead rank
        (2, "ep", "default"),  # many senders
        (1, "tp", "store"),  # a StoreLink, the vLLM backend's link
        (2, "ep", "store"),
    ],
)
@pytest.mark.slow
def test_a_rank_killed_mid_update_stops_every_rank_within_seconds_naming_it(n_senders, case, link_kind):
    from glm_fp8.testing import free_port

    world = n_senders + (3 if case == "full" else 4)
    victim = world - 1
    t0 = time.monotonic()
    results = launch(world, _rank, (n_senders, case, link_kind, victim, free_port()), timeout_s=PG_TIMEOUT)
    took = time.monotonic() - t0
    assert results[victim][0].startswith("exit"), results[victim]
    for r in range(world):
        if r == victim:
            continue
        status, out = results[r]
        assert status == "ok", (r, status, out)
        kind, text, lost, after = out
        assert kind == "LinkLost" and lost == victim and after < WITHIN, (r, out)
        assert f"link rank {victim} is lost" in text and "no heartbeat" in text, (r, text)
    # process start and the update's first layers included; the transport's timeout is 120 s
    assert took < 60, took
    print(f"after the kill: {sorted(round(results[r][1][3], 2) for r in range(world) if r != victim)} s")


# --- the watch itself, in one process -----------------------------------------------------------


def _store():
    from glm_fp8.testing import free_port

    return _serve_store(free_port())


def _serve_store(port: int, timeout_s: float = 10.0):
    """A TCP store this process serves, waiting for no client."""
    return torch.distributed.TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False
    )


def test_a_rank_whose_beat_stops_is_lost_after_the_lease_and_every_rank_reads_the_same_fault():
    from glm_fp8.core.errors import LinkLost
    from glm_fp8.transfer.liveness import Liveness

    store = _store()
    names = lambda r: f"engine rank {r} (server 'b')"  # noqa: E731
    a = Liveness(store, 0, 3, lease_s=1.0, describe=names, advice=lambda r: "; call remove_server('b')")
    b = Liveness(store, 1, 3, lease_s=1.0, describe=names)
    c = Liveness(store, 2, 3, lease_s=1.0, describe=names)
    for x in (a, b, c):
        x.start()
    time.sleep(1.5)
    assert a.lost is None and b.lost is None  # all beat
    c.close(leave=False)  # c's process is gone: no word
    t0 = time.monotonic()
    while (a.lost is None or b.lost is None) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert 0.5 < time.monotonic() - t0 < 3.0  # the lease, less the last beat's age
    assert str(a.lost) == str(b.lost)  # the first to find it wrote it; the other read it
    assert a.lost.rank == 2 and "engine rank 2 (server 'b') is lost: no heartbeat" in str(a.lost)
    with pytest.raises(LinkLost, match="engine rank 2"):
        b.check()
    a.close()
    b.close()


def test_a_rank_that_leaves_on_purpose_is_never_lost():
    from glm_fp8.transfer.liveness import Liveness

    store = _store()
    a, b = Liveness(store, 0, 2, lease_s=0.5).start(), Liveness(store, 1, 2, lease_s=0.5).start()
    time.sleep(0.5)
    b.close()
    time.sleep(1.5)
    assert a.lost is None
    a.close()


def test_a_wait_raises_at_the_fault_and_a_transport_error_is_pinned_on_the_lost_rank():
    from glm_fp8.core.errors import LinkLost
    from glm_fp8.transfer.liveness import Liveness

    class Never:  # a transport's work that waits for a peer that never comes
        def wait(self):
            time.sleep(3600)

    class Broken:  # the transport's own error: the peer's connection closed
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    store = _store()
    a, b = Liveness(store, 0, 2, lease_s=0.6).start(), Liveness(store, 1, 2, lease_s=0.6).start()
    time.sleep(0.5)
    b.close(leave=False)
    t0 = time.monotonic()
    with pytest.raises(LinkLost, match="link rank 1 is lost") as got:
        a.wait(Broken())  # the closed connection comes first; the lease then names the rank
    assert got.value.rank == 1 and isinstance(got.value.__cause__, RuntimeError)
    assert time.monotonic() - t0 < 3
    with pytest.raises(LinkLost, match="link rank 1 is lost"):
        a.wait(Never())  # after the fault: at once
    a.close()


def test_a_transport_error_with_every_rank_beating_is_published_for_every_rank():
    from glm_fp8.transfer.liveness import Liveness

    store = _store()
    a, b = Liveness(store, 0, 2, lease_s=0.4).start(), Liveness(store, 1, 2, lease_s=0.4).start()
    err = a.blame(RuntimeError("Connection reset"))
    assert err.rank is None and "transport failed on link rank 0" in str(err)
    t0 = time.monotonic()
    while b.lost is None and time.monotonic() - t0 < 3:
        time.sleep(0.05)
    assert b.lost is not None and str(b.lost) == str(err)
    a.close()
    b.close()


def test_a_store_that_stops_answering_loses_the_rank_that_serves_it():
    from glm_fp8.testing import free_port
    from glm_fp8.transfer.liveness import Liveness

    port = free_port()
    server = _serve_store(port, 5.0)
    client = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    b = Liveness(client, 1, 2, lease_s=0.4).start()
    del server  # the serving process's store goes (its process died)
    import gc

    gc.collect()
    t0 = time.monotonic()
    while b.lost is None and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert b.lost is not None and b.lost.rank == 0 and "store stopped answering" in str(b.lost), b.lost
    b.close()


def test_lease_is_checked():
    from glm_fp8.transfer.liveness import Liveness

    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match="lease_s"):
            Liveness(_store(), 0, 2, lease_s=bad)

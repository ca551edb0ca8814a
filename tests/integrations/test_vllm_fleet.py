"""A fleet: several vLLM servers of different layouts behind one glm_fp8 trainer engine, on one link
(docs/vllm.md#fleet), through test_vllm_backend.py's stand-in client and worker loop.

Invariants:
- One update reaches every server (TP 2, EP 2, DP 2 x EP 2), in every mode (one sender's
  broadcast and scatter, many senders): server k's workers sit at link ranks ``senders + the
  earlier servers' workers + their index``, and after each update every parameter of every
  server equals the reference conversion cut by its own layout, bit for bit (each worker's
  parameters are zeroed when a session starts, so each update must land all of them).
- Membership between updates: a server removed, then a new one added, each change rebuilding the
  link (the remaining server re-runs its init); the next update lands every byte on every member,
  the new server included.
- A server that dies in the middle of an update: every trainer rank raises within seconds, naming
  the server and what to call (``remove_server``), with many senders and with one (the rank off
  the link learns it from rank 0's outcome); after ``remove_server`` the next update lands on the
  remaining server.

- Delta across a fleet change: ``add_server`` rebuilds the link, and the server that stayed keeps
  taking deltas (its own pieces) while the new one takes its first update dense; every byte of
  every worker equals the reference of each step's weights.

No vLLM: the workers are ``WorkerSide`` over stand-in modules with vLLM's names (test_vllm_worker.py),
each server's driven through its own ``QueueClient``, as ``collective_rpc`` would.
"""

import os
import signal
import sys
import time

import pytest
import torch
from test_vllm_backend import NO_MTP, QueueClient, _expected, _layouts, _serve

from glm_fp8.model.families import REST
from glm_fp8.testing import free_port, launch, synthetic_layer

# (name, layouts case): three layouts, each server's workers in link order; c is DP 2 with EP 2 over
# the replicas (TP 1: vLLM's wide-EP shape), whose workers sit at dp_index * 1 + 0 in the server
MODES_FLEET = [("a", "tp2"), ("b", "ep2"), ("c", "dp2ep")]
# b dies in its second update; c joins after b is removed
MEMBERSHIP_FLEET = [("a", "tp2"), ("b", "ep2"), ("c", "tp2")]


def _server_layouts(case):
    """test_vllm_backend's layouts ("tp2", "ep2", "tp2xdp2"), and "dp2ep": DP 2 x EP 2, TP 1."""
    from glm_fp8.engine import EngineLayout

    return EngineLayout.all_ranks(1, 2, True) if case == "dp2ep" else _layouts(case)


def _workers(fleet):
    """Every worker of every server: (server index, its index in the server), in link order."""
    return [(k, i) for k, (_, case) in enumerate(fleet) for i in range(len(_server_layouts(case)))]


def _source(trainers, kind="layers", mesh_params=None, layer=None):
    """The trainer's weights: a ``LayerSource`` of plain tensors (``layer(i)``, default the synthetic
    layers); vLLM's ``ModuleSource`` over FSDP2 DTensors (its stand-in, read whole by one sender:
    ``full_tensor`` gathers on every trainer rank); or glm_fp8's ``ModuleStateSource`` over the
    same DTensors."""
    from test_vllm_backend import StandInModuleSource, _hf_like_module

    from glm_fp8.integrations.vllm.sources import LayerSource

    if kind == "module":
        return StandInModuleSource(mesh_params)
    if kind == "module_state":
        from glm_fp8.integrations.vllm import ModuleStateSource

        return ModuleStateSource(_hf_like_module(mesh_params))
    layer = layer or (lambda i: synthetic_layer(NO_MTP, i, torch.bfloat16))
    rest = lambda: synthetic_layer(NO_MTP, REST, torch.bfloat16)  # noqa: E731
    return LayerSource(lambda ids: ((i, layer(i)) for i in ids), rest=rest, experts_whole=trainers > 1)


def _trainer_side(rank, trainers, port, mode, servers, clients, source=None):
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

    options = TrainerOptions(
        "127.0.0.1",
        port,
        engine_ranks=[n for _, n in servers],
        config=NO_MTP,
        mode=mode,
        rank=rank,
        trainer_ranks=trainers,
        timeout_s=60,
        server_names=[s for s, _ in servers],
    )
    client = clients if rank == 0 else None
    source = _source(trainers) if source is None else source
    return TrainerSide(options, client, source, torch.device("cpu")).connect()


def _worker(rank, trainers, fleet, boxes, die_at):
    """One engine worker: the stand-in loop, zeroing its parameters at each session's start and
    comparing them with the reference at its end; ``die_at``: its update that kills the server."""
    from test_vllm_worker import _engine, _finalize

    from glm_fp8.integrations.vllm.probe import engine_postload_plan
    from glm_fp8.integrations.vllm.updater import EngineUpdater
    from glm_fp8.integrations.vllm.worker import WorkerSide

    k, i = _workers(fleet)[rank - trainers]
    layout = _server_layouts(fleet[k][1])[i]
    target, _ = _engine(layout)
    log, checks, updates = [], [], [0]

    def make():
        plan = engine_postload_plan(NO_MTP, target, None, deepgemm_e8m0=True)
        updater = EngineUpdater(target, None, NO_MTP, layout, plan, finalize=_finalize)
        real = updater.update

        def update(*args, **kwargs):
            updates[0] += 1
            if updates[0] == die_at:  # the whole server goes, in the middle of the transfer: killed
                os.kill(os.getpid(), signal.SIGKILL)  # by its PID, with no word to anyone
            return real(*args, **kwargs)

        updater.update = update
        return updater

    side = WorkerSide(make, lambda offset: offset + i, has_drafter=False, device=torch.device("cpu"))
    want = _expected(NO_MTP, layout, [*range(NO_MTP["num_hidden_layers"]), REST], torch.bfloat16, None)
    start, finish = side.start, side.finish

    def zeroed_start(drafter=None):
        start(drafter)
        for p in side.updater.engine.params.values():
            p.zero_()

    def checked_finish():
        finish()
        params = side.updater.engine.params
        same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
        checks.append((side.rank, [n for n, w in want.items() if not same(params[n], w)], len(want)))

    side.start, side.finish = zeroed_start, checked_finish
    _serve(side, None, *boxes[rank - trainers], log)
    return {"checks": checks, "log": log}


def _stop(boxes):
    for inbox, _ in boxes:
        inbox.put(("stop", ()))


# --- three servers of three layouts, one update in each mode --------------------------------------


def _port(rank, key):
    """A port for the next trainer engine, picked by rank 0 just before it is used (not minutes
    earlier, when another run on the machine may take it) and read by the other trainer ranks
    through the default group's store."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(f"fleet_test/port/{key}", str(free_port()))
    return int(store.get(f"fleet_test/port/{key}").decode())


def _modes_rank(rank, world, trainers, boxes):
    if rank >= trainers:
        return _worker(rank, trainers, MODES_FLEET, boxes, die_at=None)
    servers = [(name, len(_server_layouts(case))) for name, case in MODES_FLEET]
    at, clients = 0, []
    for _, n in servers:
        clients.append(QueueClient(boxes[at : at + n]))
        at += n
    from collections import Counter

    from glm_fp8.transfer.sender import Sender

    converted = Counter()  # layer -> conversions on this rank in the update
    real = Sender._convert

    def counting(self, pos, layer_idx, *args):
        converted[layer_idx] += 1
        return real(self, pos, layer_idx, *args)

    Sender._convert = counting
    out = []
    try:
        for mode in ("broadcast", "scatter", "senders"):
            side = _trainer_side(rank, trainers, _port(rank, mode), mode, servers, clients)
            converted.clear()
            (stats,) = side.send()
            once = sorted(set(converted.values())), len(converted)
            row = (side.mode, side.init.world_size, stats["bytes"], stats["update_bytes"], once)
            out.append((*row, stats["delivered_bytes"]))
            side.shutdown()
        return out
    finally:
        if rank == 0:
            _stop(boxes)


@pytest.mark.slow
def test_three_servers_of_three_layouts_get_every_byte_in_every_mode():
    """TP 2, EP 2 and DP 2 x EP 2 servers (6 workers) behind two trainer ranks: one update in each
    mode, each on a trainer engine of its own (the workers re-run their init for each)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    trainers, workers = 2, len(_workers(MODES_FLEET))
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(workers)]
    t0 = time.monotonic()
    results = launch(trainers + workers, _modes_rank, (trainers, boxes), timeout_s=240)
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
    for t in range(trainers):
        assert [m for m, *_ in results[t][1]] == ["broadcast", "scatter", "senders"], results[t]
        assert {w for _, w, *_ in results[t][1]} == {1 + workers, 2 + workers}, results[t]
    # one sender: rank 1 takes part in no link (broadcast, scatter); many senders: both send
    assert [row[2] > 0 for row in results[1][1]] == [False, False, True], results[1]
    # link bytes and delivered bytes: a full broadcast puts each byte on the link once and all six
    # workers take it in; scatter sends each worker its own shard (a class of replicas by a group
    # broadcast: delivered counts each replica's copy)
    broadcast, scatter, _ = results[0][1]
    assert broadcast[5] == 6 * broadcast[2] and scatter[5] >= scatter[2], (broadcast, scatter)
    assert scatter[5] < broadcast[5]  # each worker its shard: less reaches the NICs than a broadcast
    # each layer converted once per sender, whatever the three servers' layouts
    layers = NO_MTP["num_hidden_layers"] + 1  # and the non-layer tensors
    assert [row[4] for row in results[0][1]] == [([1], layers)] * 3, results[0]
    assert results[1][1][2][4] == ([1], layers), results[1]
    first = trainers + 0  # server a's first worker: link rank 1 with one sender, 2 with two
    assert [rank for rank, *_ in results[first][1]["checks"]] == [1, 1, 2]
    for r in range(trainers, trainers + workers):
        out = results[r][1]
        assert len(out["checks"]) == 3 and out["log"] == [], (r, out)
        for rank, bad, checked in out["checks"]:
            assert bad == [] and checked > 50, (r, rank, bad)
    print(f"three servers, three modes: {time.monotonic() - t0:.1f} s")


# --- membership: a server dies mid-update, is removed, a new one is added ------------------------


def _membership_rank(rank, world, trainers, boxes, mode, source):
    from test_vllm_backend import _module_params

    from glm_fp8.integrations.vllm.clients import VllmServer

    # every process makes the trainer mesh's group (torch.distributed's new_group is collective)
    mesh_params = _module_params(NO_MTP, trainers, "prime_rl", torch.bfloat16) if source != "layers" else None
    if rank >= trainers:
        return _worker(rank, trainers, MEMBERSHIP_FLEET, boxes, die_at=2 if rank in (4, 5) else None)
    a, b, c = boxes[0:2], boxes[2:4], boxes[4:6]
    out = []
    try:
        clients = [QueueClient(a), QueueClient(b)]
        weights = _source(trainers, source, mesh_params)
        side = _trainer_side(rank, trainers, _port(rank, mode), mode, [("a", 2), ("b", 2)], clients, weights)
        for step in range(4):
            if step == 2:
                try:  # the link broke with b: no update on it
                    side.send()
                except RuntimeError as exc:
                    out.append(("refused", str(exc)))
                t_remove = time.monotonic()
                side.remove_server("b")  # drops the broken link: none of its stuck waits holds it up
                removing = time.monotonic() - t_remove
            if step == 3:
                side.add_server(VllmServer("c", 2, QueueClient(c) if rank == 0 else None))
            t0 = time.monotonic()
            try:
                side.send()
                out.append(("ok", side.server_names, side.init.world_size))
            except Exception as exc:  # noqa: BLE001 - the test reads every rank's outcome
                text = str(exc) + " | " + " | ".join(getattr(exc, "__notes__", []))
                out.append((type(exc).__name__, text, time.monotonic() - t0))
        side.shutdown()
        return out + [removing]
    finally:
        if rank == 0:
            _stop(boxes)


@pytest.mark.parametrize(
    "mode, source",
    [
        ("senders", "layers"),
        ("broadcast", "layers"),
        ("scatter", "module"),  # vLLM's ModuleSource over DTensors: rank 1 runs full_tensor() gathers
        ("scatter", "module_state"),  # glm_fp8's ModuleStateSource over DTensors: the sender's gathers
    ],
)
@pytest.mark.slow
def test_a_server_killed_mid_update_is_named_on_every_rank_removed_and_replaced(mode, source):
    """Servers a (TP 2) and b (EP 2), two trainer ranks: both sending their own experts, or rank 0
    alone (rank 1 off the link: its part of the sender's gathers, then rank 0's outcome). Update 1
    lands on both; b's workers are killed by their PIDs in the middle of update 2, with no word to
    anyone (their client never answers): both trainer ranks raise ``LinkLost`` within 20 s of the
    update's start (a 5 s lease, on 2 loaded cores; the link's own timeout is 60 s), its
    message naming b's worker and remove_server, and refuse the next update; a's update_weights
    (the surviving server) raised naming b; ``remove_server("b")``: update 3 lands on a alone (its
    workers at the same link ranks, on a rebuilt link: the gathers of the failed update left
    nobody behind); ``add_server(c)`` (TP 2): update 4 lands on a and c."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    trainers, workers = 2, len(_workers(MEMBERSHIP_FLEET))
    senders = trainers if mode == "senders" else 1
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(workers)]
    results = launch(trainers + workers, _membership_rank, (trainers, boxes, mode, source), timeout_s=120)
    for t in range(trainers):
        status, out = results[t]
        assert status == "ok", (t, status, out)
        (s1, *_), (kind, text, seconds), refused, third, fourth, removing = out
        # the gloo operations left waiting for b end only at the link's timeout (60 s here), and a
        # gloo group's destructor waits for them: the old link is dropped beside, not in, the call
        assert removing < 20, (t, removing)
        assert (
            s1 == "ok" and third == ("ok", ["a"], senders + 2) and fourth == ("ok", ["a", "c"], senders + 4)
        ), out
        assert kind == "LinkLost" and seconds < 20, (t, kind, seconds, text)
        message = text.split(" | ")[0]  # the message itself, not its notes
        assert "(server 'b' #1, its worker" in message and "is lost: no heartbeat" in message, (t, text)
        assert "engine.remove_server('b')" in message, (t, text)
        assert refused[0] == "refused" and "broke the link" in refused[1], refused
    for r in (2, 3):  # a's workers: their update 2 raised, naming b
        assert any("server 'b' #1" in line and "is lost" in line for line in results[r][1]["log"]), results[r]
    for r in (4, 5):  # b's workers died
        assert results[r][0].startswith("exit"), results[r]
    link = [r - trainers + senders for r in range(trainers + workers)]  # each worker's link rank
    for r in (2, 3):  # a: updates 1, 3 and 4 landed whole (2 failed: no finish)
        status, out = results[r]
        assert status == "ok" and [rank for rank, *_ in out["checks"]] == [link[r]] * 3, (r, out)
        assert len(out["log"]) == 1, out["log"]  # update 2's error, and nothing else
        assert all(bad == [] for _, bad, _ in out["checks"]), (r, out)
    for r in (6, 7):  # c: update 4, after a's workers
        status, out = results[r]
        assert status == "ok" and [(rank, bad) for rank, bad, _ in out["checks"]] == [(link[r] - 2, [])], (
            r,
            out,
        )


# --- no process needed: the fleet's init info, its draft decision per client kind, its errors -----


class _HTTPClient:
    """vLLM 0.34's ``HTTPVLLMWeightSyncClient``: the four methods and ``_post``, no draft method
    (the server has the route, ``POST /start_draft_weight_update``)."""

    def __init__(self):
        self.base_url, self.posted = "http://decode-0:8000", []

    def _post(self, path, json=None):
        self.posted.append(path)

    def init_weight_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def update_weights(self, update_info): ...
    def finish_weight_update(self, weight_version=None): ...


class _RayClient(_HTTPClient):
    """vLLM 0.34's ``RayVLLMWeightSyncClient``: its ``handles`` are LLM / AsyncLLM actors."""

    def __init__(self):
        from types import SimpleNamespace

        self.started = []
        remote = SimpleNamespace(remote=lambda: self.started.append("draft") or "ref")
        self.handles = [SimpleNamespace(start_draft_weight_update=remote)] * 2


class _AsyncLLM(_HTTPClient):
    """An ``AsyncLLM`` passed as it is: its methods are coroutines."""

    def __init__(self):
        pass

    async def start_draft_weight_update(self): ...


def _side(client, **kw):
    from glm_fp8.integrations.vllm import LayerSource
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions
    from glm_fp8.model.presets import TINY_GLM5

    opts = dict(
        master_address="127.0.0.1",
        master_port=1,
        engine_ranks=[2, 4],
        config=TINY_GLM5,
        rank=0,
        server_names=["prefill", "decode"],
    )
    source = LayerSource(layers=lambda ids: iter(()), mtp=True)
    return TrainerSide(TrainerOptions(**{**opts, **kw}), client, source, torch.device("cpu"))


def test_the_draft_session_is_decided_per_server_for_every_client_kind():
    """vLLM's HTTP and Ray clients have no draft method: the draft session goes through the
    server's route / the actors' method; a client that cannot open one (an AsyncLLM passed as it
    is, a client without the method) is named with its kind: a warning under draft='auto' (the MTP
    layer is not sent), an error under draft='session'."""
    import warnings

    import pytest

    from glm_fp8.integrations.vllm.clients import LLMClient, draft_starter

    http = _HTTPClient()
    start, why = draft_starter(http)
    start()
    assert http.posted == ["start_draft_weight_update"] and why == ""
    ray, fake_ray = _RayClient(), type(sys)("ray")
    fake_ray.get = lambda refs: [r for r in refs]  # what the Ray client's own calls wait with
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "ray", fake_ray)
        draft_starter(ray)[0]()
    assert ray.started == ["draft", "draft"] and draft_starter(LLMClient(object()))[0] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _side([http, _RayClient()]).sessions() == ["target", "draft"]
    coroutine = r"server .decode. \(_AsyncLLM\): _AsyncLLM\.start_draft_weight_update is a coroutine.*Client"
    with pytest.warns(UserWarning, match=coroutine):
        side = _side([http, _AsyncLLM()])
    assert side.sessions() == ["target"] and side.init.draft == "none"
    bare = QueueClient([], draft=False)
    with pytest.raises(ValueError, match=r"server 'prefill' \(QueueClient\): QueueClient has no start_draft"):
        _side([bare, http], draft="session")


def test_fleet_init_info_is_checked_naming_the_field():
    import pytest

    from glm_fp8.integrations.vllm.sync import SyncInit

    side = _side(None, draft="none")
    init = side.init
    assert init.world_size == 7 and init.servers == [["prefill", 1, 2], ["decode", 3, 4]]
    assert init.rank_name(4) == "engine rank 4 (server 'decode' #1, its worker 1)"
    assert SyncInit.from_dict({**init.to_dict(), "rank_offset": 3}).rank_offset == 3
    for kw, match in [
        (dict(server_names=["a"]), r"init_info\.server_names: expected a list of 2 names"),
        (dict(server_names=["a", "a"]), r"init_info\.server_names: each server needs a name of its own"),
        (dict(engine_ranks=[2, 0]), r"init_info\.engine_ranks\[1\]: expected an integer in \[1, 65535\]"),
        (dict(engine_ranks=[]), r"init_info\.engine_ranks: an empty list"),
    ]:
        with pytest.raises(ValueError, match=match):
            _side(None, draft="none", **kw)
    with pytest.raises(ValueError, match=r"client: engine_ranks lists 2 servers; expected a list of their 2"):
        _side(_HTTPClient(), draft="none")
    for key, value, match in [
        ("rank_offset", 2, r"init_info\.rank_offset: 2 is no server's first link rank \[1, 3\]"),
        (
            "servers",
            [["prefill", 1, 2], ["decode", 4, 4]],
            r"init_info\.servers\[1\]\[1\]: expected an integer",
        ),
        (
            "servers",
            [["prefill", 1, 2], ["decode", 3, 3]],
            r"init_info\.servers: the servers' workers end at",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            SyncInit.from_dict({**init.to_dict(), key: value})


def test_membership_changes_are_refused_before_connect_and_name_unknown_servers():
    import pytest

    from glm_fp8.integrations.vllm.clients import VllmServer

    side = _side(None, draft="none")
    with pytest.raises(RuntimeError, match=r"set_fleet\(\): this trainer side is built"):
        side.add_server(VllmServer("extra", 2))
    side.state = "connected"  # what remove_server checks before anything moves
    with pytest.raises(
        ValueError, match=r"server name 'gone': not a server of this fleet \['prefill', 'decode'\]"
    ):
        side.remove_server("gone")
    with pytest.raises(ValueError, match=r"servers: each server needs a name of its own"):
        side.set_fleet([VllmServer("a", 2), VllmServer("a", 2)])
    with pytest.raises(ValueError, match=r"servers\[0\]\.engine_ranks: expected an integer"):
        side.set_fleet([VllmServer("a", 0)])


def test_a_worker_beyond_its_servers_declared_workers_is_refused_naming_the_server():
    """The trainer declared server 'decode' with 2 workers; its third worker (a TP 2 x DP 2 server
    declared as TP 2) refuses the init before it touches the link, naming the server."""
    import pytest

    from glm_fp8.integrations.vllm.sync import SyncInit
    from glm_fp8.integrations.vllm.worker import WorkerSide

    init = SyncInit(
        "127.0.0.1",
        1,
        world_size=5,
        senders=1,
        mode="scatter",
        link_backend="gloo",
        layer_ids=[0],
        servers=[["prefill", 1, 2], ["decode", 3, 2]],
        rank_offset=3,
    )
    side = WorkerSide(None, lambda offset: offset + 2, has_drafter=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"link rank 5, outside its server's ranks 3\.\.4 \(server 'decode'"):
        side.init(init.to_dict())


def test_a_server_that_cannot_start_its_session_is_named_and_the_others_are_closed_again():
    """vLLM refuses a start while a session is open: when server b's start fails (its server is
    gone), the servers that opened theirs are finished again, so that the next update can start."""
    import pytest

    from glm_fp8.integrations.vllm.clients import VllmServer
    from glm_fp8.integrations.vllm.fleet_link import start_sessions

    class Client(_HTTPClient):
        def __init__(self, fail):
            self.fail, self.calls = fail, []

        def start_weight_update(self):
            self.calls.append("start")
            if self.fail:
                raise ConnectionError("http://b:8000: connection refused")

        def finish_weight_update(self, weight_version=None):
            self.calls.append("finish")

    a, b = Client(False), Client(True)
    init = _side(None, draft="none").init
    named = r"server 'decode' #1 \(Client\): its start_weight_update raised ConnectionError.*remove_server\("
    with pytest.raises(RuntimeError, match=named):
        start_sessions([VllmServer("prefill", 2, a), VllmServer("decode", 4, b)], init, draft=False)
    assert a.calls == ["start", "finish"] and b.calls == ["start"]


def test_the_first_failing_server_is_reported_at_once_while_the_others_still_wait():
    """``FleetCall(on_failure=...)``: the first client call that fails runs the callback in its own
    thread, as it fails, while the other servers' calls still block (a dead server's client fails
    long before the servers whose link broke with it): what lets trainer rank 0 tell the other
    ranks which server died within seconds, not after the slow calls return."""
    import threading

    from glm_fp8.integrations.vllm.clients import VllmServer
    from glm_fp8.integrations.vllm.fleet_link import FleetCall

    release = threading.Event()
    seen = []

    def dies():
        raise ConnectionError("server gone")

    def waits():
        release.wait(30)

    def report(call):
        seen.append(([k for _, k, _ in call.failures], call.alive()))

    servers = [VllmServer("prefill", 2), VllmServer("decode", 4)]
    call = FleetCall(servers, "update_weights", calls=[waits, dies], on_failure=report)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [([1], True)]  # decode failed and was reported while prefill still waited
    release.set()
    call.join(10)
    assert not call.alive() and [k for _, k, _ in call.failures] == [1]


# --- delta across a fleet change: the servers that stay keep taking deltas -----------------------


def _delta_worker(rank, boxes, first_step):
    """A TRITON-backend worker (delta lands on it) that checks, after each update it takes, every
    parameter against the reference of the trainer's step then (its first: ``first_step``)."""
    from test_vllm_worker import _engine, _finalize

    from glm_fp8.integrations.vllm.probe import engine_postload_plan
    from glm_fp8.integrations.vllm.updater import EngineUpdater
    from glm_fp8.integrations.vllm.worker import WorkerSide
    from glm_fp8.kernels.backends import set_default_backend
    from glm_fp8.testing import moved_layer, reference_engine_params

    set_default_backend("torch")  # the transfer is under test, not the kernels (tests/kernels)
    k, i = _workers(DELTA_FLEET)[rank - 1]
    layout = _server_layouts(DELTA_FLEET[k][1])[i]
    target, _ = _engine(layout, "TRITON")
    make = lambda: EngineUpdater(  # noqa: E731
        target,
        None,
        NO_MTP,
        layout,
        engine_postload_plan(NO_MTP, target, None, deepgemm_e8m0=True),
        finalize=_finalize,
    )
    side, log, got = (
        WorkerSide(make, lambda offset: offset + i, has_drafter=False, device=torch.device("cpu")),
        [],
        [],
    )
    receive = side.receive

    def checked_receive(info):
        out = receive(info)
        step = first_step + len(got)
        want = reference_engine_params(
            NO_MTP,
            layout,
            [*range(NO_MTP["num_hidden_layers"]), REST],
            layer=lambda j: moved_layer(NO_MTP, j, step),
        )
        params = side.updater.engine.params
        same = {n: torch.equal(params[n].view(torch.uint8), w.view(torch.uint8)) for n, w in want.items()}
        got.append((out["bytes"], [n for n, ok in same.items() if not ok]))
        return out

    side.receive = checked_receive
    _serve(side, None, *boxes[rank - 1], log)
    return {"got": got, "log": log}


DELTA_FLEET = [("a", "tp2"), ("b", "ep2")]  # b joins after a's second update


def _delta_rank(rank, world, boxes):
    if rank > 0:
        return _delta_worker(rank, boxes, first_step=0 if rank <= 2 else 2)
    from glm_fp8.integrations.vllm.clients import VllmServer
    from glm_fp8.integrations.vllm.sources import LayerSource
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions
    from glm_fp8.kernels.backends import set_default_backend
    from glm_fp8.testing import moved_layer

    set_default_backend("torch")
    at = [0]
    layer = lambda i: moved_layer(NO_MTP, i, at[0])  # noqa: E731
    source = LayerSource(lambda ids: ((i, layer(i)) for i in ids), rest=lambda: layer(REST))
    options = TrainerOptions(
        "127.0.0.1",
        free_port(),
        engine_ranks=[2],
        server_names=["a"],
        config=NO_MTP,
        mode="scatter",
        rank=0,
        trainer_ranks=1,
        timeout_s=60,
        delta=True,
    )
    sent = []
    try:
        side = TrainerSide(options, [QueueClient(boxes[0:2])], source, torch.device("cpu")).connect()
        for step in range(4):
            at[0] = step
            if step == 2:  # two fleet changes before the next update: the state survives both
                side.add_server(VllmServer("b", 2, QueueClient(boxes[2:4])))
                side.set_fleet(side.servers)
            ((stats,),) = [side.send()]
            routes = side._sender("target").routes  # what a dense update on this link sends
            sent.append((stats["bytes"], sum(lay.sent_nbytes(0) for lay in routes.layers)))
        side.shutdown()
        return sent
    finally:
        _stop(boxes)


@pytest.mark.slow
def test_a_fleet_change_keeps_deltas_for_the_servers_that_stay():
    """delta=True, one sender scattering: server a (TP 2) takes updates 1 (dense) and 2 (a delta);
    ``add_server(b)`` (EP 2) rebuilds the link, then ``set_fleet`` again, and both ends carry their
    delta state over
    (glm_fp8.transfer.delta.carry): in update 3 a's workers take their own expert pieces as deltas
    and only what they share with b (attention, by group broadcast) dense, b everything dense; in
    update 4 every worker takes a delta. After every update every parameter of every worker equals
    the reference of that step's weights, bit for bit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(4)]
    results = launch(5, _delta_rank, (boxes,), timeout_s=120)
    assert all(status == "ok" for status, _ in results.values()), results
    sent = [b for b, _ in results[0][1]]
    assert sent[1] * 10 < sent[0] and sent[3] * 10 < sent[2], sent
    dense3 = results[0][1][2][1]  # what a dense update 3 would send a and b
    for r in (1, 2, 3, 4):
        out = results[r][1]
        assert out["log"] == [] and all(bad == [] for _, bad in out["got"]), (r, out)
        got = [b for b, _ in out["got"]]
        if r <= 2:  # a: dense, delta, its experts' deltas and the shared part dense, delta
            assert (
                len(got) == 4 and got[1] * 10 < got[0] and got[1] < got[2] < got[0] and got[3] * 10 < got[0]
            ), got
        else:  # b: dense, then a delta
            assert len(got) == 2 and got[1] * 10 < got[0], got
    assert sent[2] < dense3, (sent, dense3)
    a0, b0 = ([b for b, _ in results[r][1]["got"]] for r in (1, 3))
    print(f"fleet change with delta: sender {sent} bytes (dense update 3: {dense3}); a0 {a0}, b0 {b0}")


# --- a fault is attributed to its cause -----------------------------------------------------------


def _nan_rank(rank, world, trainers, boxes):
    if rank >= trainers:
        return _worker(rank, trainers, MEMBERSHIP_FLEET[:2], boxes, die_at=None)
    from glm_fp8.integrations.vllm import trainer

    # Waiting for the servers' accounts would now take a minute: far from the own fault's second,
    # whatever a loaded machine adds to the interpreter's kernels.
    trainer.FAILURE_WAIT_S = 60.0
    step, nan_at = [0], []

    def layer(i):
        sd = synthetic_layer(NO_MTP, i, torch.bfloat16)
        if step[0] == 0 and i == 1:  # the trainer's own weights: a NaN in its first update
            sd["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
            nan_at.append(time.monotonic())
        return sd

    source = _source(trainers, layer=layer)
    clients = [QueueClient(boxes[0:2]), QueueClient(boxes[2:4])]
    out = []
    try:
        servers = [("a", 2), ("b", 2)]
        side = _trainer_side(rank, trainers, _port(rank, "nan"), "scatter", servers, clients, source)
        for step[0] in range(2):
            t0 = time.monotonic()
            try:
                side.send()
                out.append(("ok", "", 0.0))
            except Exception as exc:  # noqa: BLE001 - the test reads every rank's outcome
                # From the NaN layer's making to the raise: the update's start (sessions, layer 0
                # in the interpreter) is no part of how long the failure took to stop this rank.
                out.append((type(exc).__name__, str(exc), time.monotonic() - (nan_at or [t0])[0]))
        side.shutdown()
        return out
    finally:
        if rank == 0:
            _stop(boxes)


def test_a_nan_in_the_trainer_is_the_trainers_on_every_trainer_rank_never_a_servers():
    """One sender (rank 1 off the link), two servers: a NaN in the trainer's layer 1 stops the
    update; rank 0 raises ``NonFiniteError`` naming the tensor, and rank 1's error names the same
    tensor first, not a server whose update_weights raised after it; neither waits for the
    servers' accounts (seconds from the NaN layer's making, not ``FAILURE_WAIT_S``, set to a
    minute here). The link stays whole: the next update lands on both servers."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    trainers, workers = 2, 4
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(workers)]
    results = launch(trainers + workers, _nan_rank, (trainers, boxes), timeout_s=120)
    for t in range(trainers):
        status, out = results[t]
        assert status == "ok", (t, status, out)
        (kind, text, seconds), landed = out
        assert landed[0] == "ok", (t, out)
        assert kind == ("NonFiniteError" if t == 0 else "UpdateAborted") and seconds < 30, (t, out)
        own = text if t == 0 else text.split("trainer rank 0: ", 1)[1]
        assert own.startswith("NonFiniteError: " if t else "") and "self_attn.o_proj.weight" in own, (t, text)
        assert "update_weights raised" not in text, (t, text)
    for r in range(trainers, trainers + workers):  # the second update landed whole everywhere
        status, out = results[r]
        assert status == "ok" and len(out["checks"]) == 1 and out["checks"][0][1] == [], (r, out)

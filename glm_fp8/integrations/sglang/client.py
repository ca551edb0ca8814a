"""The trainer's side of an SGLang update: the server's HTTP routes (``SGLangHttpClient``) and one
update's calls in a thread of trainer rank 0 (``SGLangUpdateCall``), while every sending rank runs
its ``Sender`` (docs/sglang.md#the-hook).

The routes are SGLang 0.5.23's (``entrypoints/http_server.py``): ``POST /pause_generation``,
``/begin_weight_update``, ``/update_weights_from_tensor``, ``/end_weight_update``,
``/continue_generation``; the session routes answer ``{"success", "message"}``, with HTTP 400 when
``success`` is false. Plain ``urllib``: no dependency.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from glm_fp8.core.checks import check_int
from glm_fp8.core.errors import EngineCallFailed
from glm_fp8.engine.sglang import SGLangLayout
from glm_fp8.integrations.sglang.update import LOADER, SGLangUpdate

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


@dataclass(frozen=True)
class SGLangHttpClient:
    """One SGLang server's HTTP API, the routes of a weight update.

    ``url``: the server's base URL (``http://host:30000``); ``api_key``: its ``--admin-api-key``
    (or ``--api-key`` where no admin key is set), sent as a bearer token; ``timeout_s``: how long
    one call may take (``update_weights_from_tensor`` lasts the whole transfer)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangHttpClient.url: expected http://host:port, got {self.url!r}")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ValueError(f"SGLangHttpClient.api_key: expected a string or None, got {self.api_key!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 604800:
            raise ValueError(
                f"SGLangHttpClient.timeout_s: expected seconds, 0 < timeout_s <= 604800, got {t!r}"
            )

    def post(self, route: str, body: dict) -> dict:
        """POST ``body`` as JSON to ``route``; the answer's JSON. Raises ``EngineCallFailed`` naming
        the server and the route when it answers an error status or ``"success": false``, or does
        not answer."""
        where = f"SGLang server {self.url}: POST /{route}"
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            f"{self.url.rstrip('/')}/{route}", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                text = reply.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise EngineCallFailed(f"{where} answered {exc.code}: {_message(text)}", answered=True) from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineCallFailed(f"{where} got no answer: {exc}", answered=False) from None
        try:
            answer = json.loads(text) if text else {}
        except ValueError:
            raise EngineCallFailed(f"{where} answered no JSON: {text[:200]!r}", answered=True) from None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineCallFailed(f"{where} failed: {_message(text)}", answered=True)
        return answer if isinstance(answer, dict) else {"answer": answer}

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop serving: ``retract`` (the running requests go back to the queue and are recomputed
        on the new weights after ``continue_generation``), ``abort`` or ``in_place``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode expected one of {PAUSE_MODES}, got {mode!r}")
        self.post("pause_generation", {"mode": mode})

    def begin_weight_update(self, selector: str = "target") -> str:
        """Open the weight-update session of the target model (``selector`` "target") or of the
        target and its drafter ("all"); SGLang restores any in-place packing."""
        return str(self.post("begin_weight_update", {"selector": selector}).get("message", ""))

    def update_weights_from_tensor(self, update: SGLangUpdate, weight_version: str | None = None) -> str:
        """Run glm_fp8's loader on every rank of the server with ``update`` as its payload; returns
        once every rank landed (or raises: any rank's or sender's failure fails it on every rank)."""
        body = {
            "serialized_named_tensors": update.serialized_named_tensors(),
            "load_format": LOADER,
            "flush_cache": True,
            "weight_version": weight_version,
            "selector": selector_of(update),
        }
        return str(self.post("update_weights_from_tensor", body).get("message", ""))

    def end_weight_update(self) -> str:
        """Close the session: SGLang's ``process_weights_after_loading``."""
        return str(self.post("end_weight_update", {}).get("message", ""))

    def continue_generation(self) -> None:
        self.post("continue_generation", {})


def selector_of(update: SGLangUpdate) -> str:
    """SGLang's runners an update's calls select: the target model, and with ``drafter`` its MTP
    drafter too ("all": SGLang then runs the loader for the target, then for the drafter)."""
    return "all" if update.drafter else "target"


def _message(text: str) -> str:
    try:
        answer = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(answer, dict):
        return str(answer.get("message") or answer.get("detail") or answer.get("error") or answer)[:2000]
    return str(answer)[:2000]


class SGLangUpdateCall:
    """One update of one SGLang server, from trainer rank 0: at construction
    ``pause_generation`` (unless ``pause`` is None) and ``begin_weight_update`` (either failing
    raises ``EngineCallFailed`` there, before any sender waits), then in a thread
    ``update_weights_from_tensor`` with ``update`` (it returns once every rank is done) and
    ``end_weight_update``. Meanwhile every sending trainer rank runs its ``Sender.send_model``;
    once it returned, ``finish()``: the calls' end, then ``continue_generation``.

    The update's outcome is ``send_model``'s: SGLang 0.5.23 stops its server when a custom loader
    raises, so glm_fp8's loader never does, and SGLang answers a failed update as a success. When
    ``send_model`` raised, call ``join()`` instead of ``finish()``: the session is ended and
    generation stays paused, the server's parameters holding a mix of two versions
    (docs/sglang.md#the-hook); the next update's ``finish()`` resumes it. A call that SGLang
    failed (pause, begin, a route it refused, no answer) raises from both, with the server's
    account. ``link``: this rank's link (a ``StoreLink``): when the update call fails (SGLang
    refused it, or no answer), some SGLang rank did not run glm_fp8's loader, so the fault is
    published on the link and every sender's waits end within a beat rather than at the
    transport's timeout.
    The SGLang ranks join the link inside their first call: for the first update, start the call,
    then build the link (its constructor waits for every rank) and set ``call.link``."""

    def __init__(
        self,
        client: SGLangHttpClient,
        update: SGLangUpdate,
        *,
        weight_version: str | None = None,
        pause: str | None = "retract",
        link: object | None = None,
        launch: bool = True,
    ):
        if not isinstance(client, SGLangHttpClient):
            raise ValueError(f"client: expected an SGLangHttpClient, got {type(client).__name__}")
        if not isinstance(update, SGLangUpdate):
            raise ValueError(f"update: expected an SGLangUpdate, got {type(update).__name__}")
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"pause: expected None or one of {PAUSE_MODES}, got {pause!r}")
        ranks = update.server_ranks()
        first = update.rank_offset
        check_int(
            "SGLangUpdate.rank_offset", first, 0, update.world_size - ranks, f" (a server of {ranks} ranks)"
        )
        for r in range(first, first + ranks):
            lay = update.engines[r]
            if not isinstance(lay, SGLangLayout) or lay.whole_tp != (ranks, r - first):
                raise ValueError(
                    f"SGLangUpdate.engines[{r}]: expected the server's TP rank {r - first} of {ranks} "
                    f"(an SGLangLayout), got {lay!r}"
                )
        self.client, self.update, self.weight_version = client, update, weight_version
        self.pause, self.link = pause, link
        self.message = ""
        self.error: EngineCallFailed | None = None
        # Here, in the caller's thread: a server that cannot take the update fails the call before
        # any sender waits for its ranks.
        if pause is not None:
            client.pause_generation(pause)
        try:
            client.begin_weight_update(selector_of(update))
        except EngineCallFailed as exc:
            if pause is not None:
                exc.add_note("generation stays paused: client.continue_generation() resumes it")
            raise
        self._thread = threading.Thread(target=self._run, name=f"glm_fp8-sglang {client.url}", daemon=True)
        if launch:
            self.launch()

    def launch(self) -> None:
        """Start the update call (constructed with ``launch=False``: once every server's session
        is open, ``start_update``)."""
        self._thread.start()

    def abandon(self) -> None:
        """Before ``launch``: end the session and resume generation (nothing moved); a failure of
        either is dropped (the caller is raising another)."""
        for call in (self.client.end_weight_update, self.client.continue_generation):
            with contextlib.suppress(EngineCallFailed):
                call()

    def _run(self) -> None:
        c, landed = self.client, False
        try:
            try:
                self.message = c.update_weights_from_tensor(self.update, self.weight_version)
            except EngineCallFailed:
                with contextlib.suppress(EngineCallFailed):  # the session closed; the update's error stands
                    c.end_weight_update()
                raise
            landed = True
            c.end_weight_update()
        except EngineCallFailed as exc:
            self.error = exc
            # glm_fp8's loader never raises: a failed update call means some rank did not run it,
            # and the senders would wait for that rank; after it, the senders are done.
            if not landed:
                self._report(exc)
        except BaseException as exc:  # noqa: BLE001 - handed to join()'s caller
            self.error = EngineCallFailed(
                f"SGLang server {c.url}: {type(exc).__name__}: {exc}", answered=False
            )
            self._report(self.error)

    def _report(self, exc: EngineCallFailed) -> None:
        liveness = getattr(self.link, "liveness", None)
        if liveness is not None:
            liveness.report(None, f"{exc}; generation stays paused")

    def finish(self, timeout_s: float | None = None) -> str:
        """After ``send_model`` returned (the update landed on every rank): ``join()``, then resume
        generation; the update call's message."""
        message = self.join(timeout_s)
        self.client.continue_generation()
        return message

    def join(self, timeout_s: float | None = None) -> str:
        """Wait for the calls (``timeout_s``: at most that long; default the client's); their last
        message, or raise ``EngineCallFailed`` (still running after ``timeout_s`` too)."""
        wait = self.client.timeout_s if timeout_s is None else timeout_s
        self._thread.join(wait)
        if self._thread.is_alive():
            raise EngineCallFailed(
                f"SGLang server {self.client.url}: the update's calls still run after {wait:g} s",
                answered=False,
            )
        if self.error is not None:
            raise self.error
        return self.message


def start_update(
    servers: Sequence[tuple[SGLangHttpClient, SGLangUpdate]] | None,
    *,
    weight_version: str | None = None,
    pause: str | None = "retract",
    link: object | None = None,
    group: object | None = None,
) -> list[SGLangUpdateCall]:
    """Start one update of every server of ``servers`` (``(client, update)`` pairs), collectively
    over the trainer's ranks of ``group`` (default: the default process group, where one is
    initialized): its rank 0 opens every server's session (``SGLangUpdateCall``, ``launch=False``),
    then launches their update calls; the other ranks pass ``servers=None``. Every rank learns the
    outcome before any builds its link or sends: a server that could not open its session raises
    ``EngineCallFailed`` on every rank (on the others naming trainer rank 0's account), and the
    servers already opened are closed and resumed (nothing moved). Returns rank 0's calls (``[]``
    on the others): ``finish()`` each after ``send_model`` returned, ``join()`` after it raised."""
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    calls: list[SGLangUpdateCall] = []
    error: BaseException | None = None
    if not shared or dist.get_rank(group) == 0:
        try:
            for client, update in servers or ():
                kw = dict(weight_version=weight_version, pause=pause, link=link, launch=False)
                calls.append(SGLangUpdateCall(client, update, **kw))
        except (EngineCallFailed, ValueError) as exc:
            error = exc
            for call in calls:
                call.abandon()
            calls = []
        for call in calls:
            call.launch()
    if shared:  # rank 0's outcome to every rank, before any of them waits on the link
        said = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(said, group=group, group_src=0)
        if error is None and said[0] is not None:
            raise EngineCallFailed(f"trainer rank 0: {said[0]}", answered=True)
    if error is not None:
        raise error
    return calls


__all__ = ["PAUSE_MODES", "SGLangHttpClient", "SGLangUpdateCall", "selector_of", "start_update"]

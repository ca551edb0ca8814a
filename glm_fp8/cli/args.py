"""The argparse ``type=`` parsers of ``glm-fp8``'s options: each turns an option's text into its
value or refuses it with argparse's error naming the option."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: ``check_int``'s contract on the option's text, an integer in
    [low, high] (``high`` None: no upper bound); ``why``: why the bound is there. argparse puts
    the option's name where check_int puts the argument's."""

    def parse(text: str) -> int:
        from glm_fp8.core.checks import check_int  # lazy, as the CLI's every glm_fp8 import

        try:
            value: object = int(text)
        except ValueError:
            value = text  # not a number: check_int refuses it, quoting the text
        try:
            return check_int("", value, low, high, f" ({why})" if why else "")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(": ")) from None

    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low``."""
    return int_in(low)


positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse ``type=``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type=``: a number in [0, 1] (a fraction, not a percentage)."""
    expected = "expected a fraction in [0, 1] (0.0012 for 0.12 %)"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not 0 <= value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{expected}, got {text}")
    return value


SERVER_KEYS = ("tp", "dp", "ep", "replicas", "name", "gbps", "engine", "dense_tp", "a2a")
SERVER_SYNTAX = (
    "KEY=VALUE[,KEY=VALUE...] with keys tp, dp (vLLM's sizes, default 1), ep (expert parallel: "
    "'ep' or ep=TPxDP), replicas (default 1), name, gbps (its GPUs' NIC, default --link-gbps); "
    "e.g. tp=8,dp=4,ep,replicas=2,name=prefill; engine=sglang for an SGLang server: tp its "
    "--tp-size, dp its attention DP, ep its --ep-size (ep or ep=TP), dense_tp its --moe-dense-tp-size "
    "(1), a2a its --moe-a2a-backend; e.g. engine=sglang,tp=64,dp=64,ep,dense_tp=1,a2a=deepep"
)


def server_spec(text: str):
    """An argparse ``type=`` for ``glm-fp8 plan --server``: ``SERVER_SYNTAX`` -> a
    ``glm_fp8.planning.fleet.Server``, or argparse's error naming what is wrong and what to write."""
    from glm_fp8.core.vocab import ENGINES  # lazy, as the CLI's every glm_fp8 import
    from glm_fp8.planning.fleet import Server
    from glm_fp8.planning.request import MAX_ENGINE_RANKS

    fields: dict[str, str | None] = {}
    for item in text.split(",") if text.strip() else []:
        key, eq, value = item.strip().partition("=")
        if key not in SERVER_KEYS:
            raise argparse.ArgumentTypeError(f"unknown key {key!r} in {text!r}; expected {SERVER_SYNTAX}")
        if key in fields:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        if (not eq and key != "ep") or (eq and not value.strip()):
            raise argparse.ArgumentTypeError(f"{key}: expected {key}=VALUE in {text!r}")
        fields[key] = value.strip() if eq else None
    if not fields:
        raise argparse.ArgumentTypeError(f"expected {SERVER_SYNTAX}, got {text!r}")
    ranks = f"at most {MAX_ENGINE_RANKS} ranks per server: each rank's shard is computed"
    sizes = {
        k: int_in(1, MAX_ENGINE_RANKS if k != "replicas" else None, ranks if k != "replicas" else "")
        for k in ("tp", "dp", "replicas")
    }
    got: dict[str, int] = {}
    for key, parse in sizes.items():
        try:
            got[key] = parse(fields.get(key) or "1")
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{key}: {e}") from None
    tp, dp = got["tp"], got["dp"]
    engine = fields.get("engine") or "vllm"
    if engine not in ENGINES:
        raise argparse.ArgumentTypeError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    sglang = engine == "sglang"
    if not sglang and ("dense_tp" in fields or "a2a" in fields):
        raise argparse.ArgumentTypeError(f"dense_tp, a2a: SGLang's flags; add engine=sglang in {text!r}")
    ep_size = tp if sglang else tp * dp  # SGLang's attention DP splits its TP group: its ranks are TP
    if not sglang and tp * dp > MAX_ENGINE_RANKS:
        raise argparse.ArgumentTypeError(f"TP {tp} x DP {dp} = {tp * dp} ranks; expected {ranks}")
    ep = "ep" in fields
    if sglang and fields.get("ep") is not None and fields["ep"] != str(ep_size):
        raise argparse.ArgumentTypeError(
            f"ep={fields['ep']} with tp={tp}: glm_fp8 models SGLang's --ep-size 1 or --tp-size; write "
            f"ep={tp} or ep (docs/sglang.md#layouts)"
        )
    if not sglang and fields.get("ep") is not None and fields["ep"] != str(tp * dp):
        raise argparse.ArgumentTypeError(
            f"ep={fields['ep']} with tp={tp}, dp={dp}: vLLM's expert-parallel size is TP x DP = {tp * dp} "
            f"(--enable-expert-parallel); write ep={tp * dp} or ep"
        )
    name = fields.get("name")
    if name is not None and not all(c.isalnum() or c in "_.-" for c in name):
        raise argparse.ArgumentTypeError(f"name: expected letters, digits, '_', '.' or '-', got {name!r}")
    gbps = None
    if fields.get("gbps") is not None:
        try:
            gbps = positive_float(fields["gbps"])
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"gbps: {e}") from None
    if not sglang:
        return Server(tp, dp, ep, got["replicas"], name, gbps)
    dense = fields.get("dense_tp")
    if dense is not None and dense != "1":
        raise argparse.ArgumentTypeError(
            f"dense_tp: expected 1 (SGLang's --moe-dense-tp-size 1), got {dense!r}"
        )
    try:
        return Server(
            tp,
            dp,
            ep,
            got["replicas"],
            name,
            gbps,
            engine="sglang",
            moe_dense_tp_size=1 if dense else None,
            moe_a2a_backend=fields.get("a2a") or "none",
        )
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


__all__ = [
    "SERVER_KEYS",
    "SERVER_SYNTAX",
    "fraction",
    "int_at_least",
    "int_in",
    "positive_float",
    "positive_int",
    "server_spec",
]

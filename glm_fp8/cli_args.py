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
        from glm_fp8._checks import check_int  # lazy, as the CLI's every glm_fp8 import

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


__all__ = ["int_at_least", "int_in", "positive_float", "positive_int"]

"""The plan outputs docs/ quotes are what ``glm-fp8 plan`` prints today: each block marked
``<!-- glm-fp8 plan ARGS -->`` is followed by a ```text block of that command's output, compared
here byte for byte, so a change to the model, the presets or the plan's text fails until the docs
are regenerated: ``python tests/test_docs_plans.py`` rewrites every such block."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- glm-fp8 plan (.*?) -->\n```text\n)(.*?)(```)", re.S)


def _plan_output(args: str) -> str:
    from glm_fp8.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *shlex.split(args)]) == 0
    return out.getvalue()


def _blocks() -> list[tuple[Path, str, str]]:
    """(doc, the command's arguments, the quoted output) of every marked block in docs/."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [(doc, m.group(2), m.group(3)) for doc in docs for m in BLOCK.finditer(doc.read_text())]


def test_docs_quote_at_least_the_two_deployments():
    quoted = {args for _, args, _ in _blocks()}
    assert {"--fleet glm-5-4xep8", "--fleet prime-rl-glm-5.2"} <= quoted, quoted


@pytest.mark.parametrize("doc, args, quoted", _blocks(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_quoted_plan_is_what_the_cli_prints(doc, args, quoted):
    assert quoted == _plan_output(args), (
        f"{doc.name}: the block of `glm-fp8 plan {args}` differs from the command's output; "
        "regenerate it: python tests/test_docs_plans.py"
    )


def regenerate() -> None:
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + _plan_output(m.group(2)) + m.group(4), text)
        if new != text:
            doc.write_text(new)
            print(f"regenerated {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    regenerate()

"""README.md's code runs as written: each block marked ``<!-- runnable: examples/x.py -->`` is that
example, byte for byte (CI runs every example, .ci/run); the vLLM trainer block, which needs vLLM
and GPUs, at least parses and passes only fields the init info has; every example is named in the
README; every relative link of the README and docs/ points at a file that exists."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(marker: str) -> list[tuple[str, str]]:
    """(marker argument, code) of each fenced block right after ``<!-- marker[: arg] -->``."""
    pattern = rf"<!-- {marker}(?::\s*(\S+))? -->\n```\w*\n(.*?)```"
    return re.findall(pattern, README, flags=re.S)


def test_runnable_blocks_are_the_examples_ci_runs():
    blocks = _blocks("runnable")
    assert blocks, "README.md has no runnable block"
    for path, code in blocks:
        assert path.startswith("examples/"), path
        assert code == (ROOT / path).read_text(), f"README's block differs from {path}"


def test_every_example_is_named_in_the_readme():
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert example.name in README, f"examples/{example.name} is not in README.md"


def test_ci_runs_every_example():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "examples/*.py" in ci


def test_the_vllm_trainer_block_uses_the_init_info_fields():
    from glm_fp8.integrations.vllm.trainer import TrainerOptions

    [(_, code)] = _blocks("vllm-trainer")
    tree = ast.parse(code)
    fields = {f.name for f in dataclasses.fields(TrainerOptions)} | {"rank"}
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "GlmFp8TrainerInitInfo"
    ]
    assert calls
    for call in calls:
        unknown = {k.arg for k in call.keywords} - fields
        assert not unknown, f"GlmFp8TrainerInitInfo has no field {sorted(unknown)}"
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    for module in modules:
        if module.startswith("glm_fp8"):
            assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module


def test_relative_links_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: link to {target} is broken"

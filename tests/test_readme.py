"""README.md's code runs as written: each block marked ``<!-- runnable: examples/x.py -->`` is that
example, byte for byte (CI runs every example, .ci/run); the vLLM trainer block, which needs vLLM
and GPUs, at least parses and passes only fields the init info has; every example is named in the
README; every relative link of the README and docs/ points at a file that exists, and a link's
#fragment at a heading of that file (GitHub's anchors); README's test command is what CI runs."""

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


def test_ci_runs_the_readme_test_command():
    """CI runs README's test command as written, and that command says why tests skip (-rs)."""
    [readme] = re.findall(r"&& (pytest [^\n]*)\n", README)
    ci = re.findall(r'^"\$BIN/pytest" ([^#\n]*?)\s*(?:#.*)?$', (ROOT / ".ci" / "run").read_text(), re.M)
    assert readme in [f"pytest {args}" for args in ci], (readme, ci)
    assert "-rs" in readme.split()


def _shell_command(text: str, program: str) -> list[str]:
    """The arguments of the first ``program ...`` command of a ```bash block, continuation lines
    joined."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip().startswith(program + " "):
                return line.split()
    raise AssertionError(f"no {program} command")


def test_the_vllm_serve_command_is_the_one_docs_vllm_md_shows():
    readme = _shell_command(README, "vllm serve")
    assert readme == _shell_command((ROOT / "docs" / "vllm.md").read_text(), "vllm serve")
    assert "--speculative-config" in readme  # the MTP drafter: the draft session updates it


def test_the_vllm_trainer_block_uses_the_init_info_fields():
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

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
            path = ROOT / module.replace(".", "/")
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), module


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
# A link's destination may start on the next line (CommonMark); titles are not used here.
_LINK = re.compile(r"\]\(\s*([^)\s]*)\s*\)")


def _links(doc: Path) -> list[tuple[str, str]]:
    """(path, fragment) of every relative markdown link of ``doc``, code blocks left out; path ""
    for a link within the file."""
    out = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, fragment = target.partition("#")
        out.append((path, fragment))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline code and links reduced to their text,
    lowercased, every character that is not a letter, digit, underscore, hyphen or space dropped,
    each space a hyphen (so "A / B" gives "a--b")."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render no text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every anchor GitHub renders for ``doc``: one per heading outside code blocks (a repeated
    slug gets -1, -2, ... in order), and explicit ``<a name|id="...">`` anchors."""
    text = _FENCE.sub("", doc.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        slug = github_slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_github_slug_rules():
    assert github_slug("Engine side (vLLM 0.34)") == "engine-side-vllm-034"
    assert github_slug("Schedule (IndexShare / IndexCache)") == "schedule-indexshare--indexcache"
    assert github_slug('With vLLM 0.34: the `"glm_fp8"` weight-transfer backend') == (
        "with-vllm-034-the-glm_fp8-weight-transfer-backend"
    )
    assert github_slug("Test helpers: `glm_fp8.testing`") == "test-helpers-glm_fp8testing"


def test_relative_links_resolve():
    """Every relative link of README.md, docs/ and bench/README.md points at a file that exists
    and, with a #fragment into a markdown file (or within the same one), at one of its headings."""
    broken = []
    for doc in DOCS:
        for path, fragment in _links(doc):
            target = (doc.parent / path) if path else doc
            where = f"{doc.relative_to(ROOT)}: link to {path}{'#' + fragment if fragment else ''}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{where}: {target.relative_to(ROOT)} has no such heading")
    assert not broken, "\n".join(broken)

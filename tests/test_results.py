"""README.md's measured figures are bench/RESULTS.md's current ones: each figure README quotes is read
from both files and compared, so a README that keeps a superseded figure (or a RESULTS.md whose rows
moved without README) fails here. Ranges README quotes are recomputed from RESULTS.md's tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "bench" / "RESULTS.md").read_text()

NUM = r"(\d+(?:\.\d+)?)"
ROW = r"\|[^|\n]*\| "  # a row of the Memory table, its "what" cell blank or not


def _one(pattern: str, text: str, where: str) -> tuple[float, ...]:
    """The numbers captured by ``pattern``'s single match in ``text``."""
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, f"{where}: expected one match of {pattern!r}, found {len(found)}"
    groups = found[0] if isinstance(found[0], tuple) else (found[0],)
    return tuple(float(g) for g in groups)


def _section(heading: str) -> str:
    """RESULTS.md from the line ``heading`` to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = RESULTS.index(heading + "\n")
    end = re.search(rf"^#{{1,{level}}} ", RESULTS[start + len(heading) :], re.M)
    return RESULTS[start : start + len(heading) + (end.start() if end else len(RESULTS))]


def _bold(rows: str) -> list[float]:
    """Every bold figure of ``rows`` (the tables' headline columns)."""
    return [float(x) for x in re.findall(r"\*\*(\d+\.\d+)\*\*", rows)]


def _rows(text: str, first_cells: str) -> str:
    """The table rows of ``text`` whose leading cells match ``first_cells``."""
    return "\n".join(re.findall(rf"^\| {first_cells} \|.*$", text, re.M))


# (what, README pattern, RESULTS pattern, order): the patterns capture the same numbers; ``order`` puts
# RESULTS.md's captures in README's order where the two name them in different orders.
PAIRS = [
    (
        "delta update time / dense, Adam's warm step at lr 1e-6 and 1e-5 (README's table)",
        rf"time {NUM}x / {NUM}x the dense update's",
        rf"^\| gpu \| adam \| 1e-6 \| [\d.]+ \| \*\*{NUM}\*\*[\s\S]*?"
        rf"^\| gpu \| adam \| 1e-5 \| [\d.]+ \| \*\*{NUM}\*\*",
        None,
    ),
    (
        "delta update wire / dense, Adam's warm step at lr 1e-6 and 1e-5 (README's table)",
        rf"wire {NUM} % / {NUM} % of its bytes",
        rf"^\| gpu \| adam \| 1e-6 \| [\d.]+ \| \*\*[\d.]+\*\* \| [\d.]+ \| \*\*{NUM}\*\*[\s\S]*?"
        rf"^\| gpu \| adam \| 1e-5 \| [\d.]+ \| \*\*[\d.]+\*\* \| [\d.]+ \| \*\*{NUM}\*\*",
        None,
    ),
    (
        "delta update at lr 1e-6, wire and time (README's vLLM section)",
        rf"moved {NUM} % of the dense bytes in {NUM}x the dense",
        rf"^\| gpu \| adam \| 1e-6 \| [\d.]+ \| \*\*{NUM}\*\* \| [\d.]+ \| \*\*{NUM}\*\*",
        (1, 0),
    ),
    (
        "delta sender's GPU memory, measured / predicted",
        rf"sender memory {NUM} / {NUM} GiB predicted",
        rf"^{ROW}kept on the GPU, 80 layers[^|]*\| {NUM} \| {NUM} \|",
        None,
    ),
    (
        "seeded quantize fuzz, the newest run: CUDA's cases, Triton's cases",
        r"CUDA (\d+) / (\d+), Triton (\d+) / (\d+)[^|]*\|$",
        r"^\| seeded quantize fuzz, every backend[^|]*\| H100 \| "
        r"Triton (\d+) of (\d+) cases[^|]*CUDA (\d+) of (\d+)",
        (2, 3, 0, 1),
    ),
    (
        "one sender scattering into a fleet of 2 x EP 8 + 2 x TP 8: total / link",
        rf"2 x EP 8 \+ 2 x TP 8\), 20 layers \| {NUM} of its link",
        rf"^\| one sender, scatter into 2 x EP 8 \+ 2 x TP 8 \|.*?\*\*{NUM}\*\*",
        None,
    ),
    (
        "sender memory, measured / predicted: broadcast, scatter, many senders (80 layers)",
        rf"{NUM} / {NUM} GiB \(broadcast\), {NUM} / {NUM} GiB \(scatter\), "
        rf"{NUM} / {NUM} GiB \(many senders\)",
        rf"^{ROW}full broadcast, bf16, 80 layers \| {NUM} \| {NUM} \|[\s\S]*?"
        rf"^{ROW}scatter into TP 8, bf16, 80 layers \| {NUM} \| {NUM} \|[\s\S]*?"
        rf"^{ROW}many senders, 32 into 4 x EP 8, sender 0, bf16, 80 layers \| {NUM} \| {NUM} \|",
        None,
    ),
    (
        "engine rank's extra memory, measured / predicted",
        rf"layers\); {NUM} / {NUM} GiB; every parameter bit-exact",
        rf"^{ROW}dense, TP 8 and EP 8, 16 layers \| {NUM} \| {NUM} \|",
        None,
    ),
]


@pytest.mark.parametrize(("what", "readme", "results", "order"), PAIRS, ids=[p[0] for p in PAIRS])
def test_readme_quotes_the_current_figure(what, readme, results, order):
    quoted = _one(readme, README, f"README.md ({what})")
    current = _one(results, RESULTS, f"bench/RESULTS.md ({what})")
    if order is not None:
        current = tuple(current[i] for i in order)
    assert quoted == current, f"{what}: README.md says {quoted}, bench/RESULTS.md {current}"


def _share_ranges() -> dict[tuple[str, str], tuple[float, float]]:
    """(backend, dtype) -> (lowest, highest) share of copy of GLM-5's E=256 experts over both timers:
    `glm-fp8 bench`'s table (checked and unchecked) and the launch-config sweep (short and sustained)."""
    shares: dict[tuple[str, str], list[float]] = {}
    bench = _section("## Kernels: `glm-fp8 bench`")
    for dtype in ("bf16", "fp32"):
        row = _rows(bench, rf"GLM-5 experts {dtype} E=256")
        triton, cuda = row.split("|")[3:5]
        for backend, cell in (("triton", triton), ("cuda", cuda)):
            found = re.findall(r", \**(\d\.\d+)", cell)
            shares.setdefault((backend, dtype), []).extend(float(x) for x in found)
    sweep = _section("## Triton launch-config sweep: `bench/scripts/sweep.py`")
    for dtype in ("bf16", "fp32"):
        for row in _rows(sweep, rf"{dtype} E=256, [a-z]+").splitlines():
            triton, cuda = row.split("|")[2:4]
            for backend, cell in (("triton", triton), ("cuda", cuda)):
                shares[(backend, dtype)].append(float(re.search(r"ms, (\d\.\d+)", cell).group(1)))
    assert all(len(v) == 4 for v in shares.values()), shares
    return {k: (min(v), max(v)) for k, v in shares.items()}


def test_readme_quotes_the_kernels_share_of_copy():
    ranges = _share_ranges()
    quoted = _one(
        rf"Triton: bf16 {NUM}-{NUM}, fp32 {NUM}-{NUM}; CUDA: bf16 {NUM}-{NUM}, fp32 {NUM}-{NUM}; 0 bytes",
        README,
        "README.md (the kernels' share of copy)",
    )
    current = tuple(
        x
        for key in [("triton", "bf16"), ("triton", "fp32"), ("cuda", "bf16"), ("cuda", "fp32")]
        for x in ranges[key]
    )
    assert quoted == current, f"README.md says {quoted}, bench/RESULTS.md's tables give {current}"
    overall = _one(rf"at\s+{NUM}-{NUM} of the GPU's copy bandwidth", README, "README.md (the kernels' range)")
    assert overall == (min(current), max(current)), (overall, current)


def test_readme_quotes_the_eager_reference():
    row = _rows(_section("## Kernels: `glm-fp8 bench`"), "eager reference, per expert")
    bf16, fp32 = (float(x) for x in re.findall(r"ms, (\d\.\d+)", row)[:2])
    assert _one(rf"reference per expert[^|]*\| {NUM}-{NUM}, 18 GiB", README, "README.md") == (bf16, fp32)


def test_readme_quotes_the_pipeline_factors():
    section = _section("## Transfer pipeline, dense: `bench/scripts/pipeline.py`")
    eighty = section[section.index("### 80 layers (H200)") : section.index("### 40 layers")]
    (broadcast,) = _bold(_rows(eighty, "full broadcast"))
    (scatter,) = _bold(_rows(eighty, "scatter into TP 8"))
    senders = _bold(_rows(eighty, r"many senders, 32 into 4 x EP 8"))
    assert len(senders) == 4, senders
    quoted = _one(
        rf"full broadcast {NUM}, scatter into TP 8 {NUM}, many senders \(32 into 4 x EP 8\) {NUM}-{NUM}; "
        rf"over 20 to 40 layers up to {NUM}",
        README,
        "README.md (the pipeline factors)",
    )
    current = (broadcast, scatter, min(senders), max(senders), max(_bold(section)))
    assert quoted == current, f"README.md says {quoted}, bench/RESULTS.md's tables give {current}"


def test_readme_quotes_the_engine_rank_factors():
    dense = _section("### Dense (H200)")
    factors = _bold(_rows(dense, r"[TE]P 8, rank 0"))
    assert len(factors) == 4, factors
    quoted = _one(rf"\| {NUM}-{NUM} \(runs of 8 to 16 layers\)", README, "README.md (the engine rank)")
    assert quoted == (min(factors), max(factors)), (quoted, factors)

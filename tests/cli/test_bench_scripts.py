"""The standalone benchmark scripts whose figures bench/RESULTS.md quotes still run, on a tiny
model on the CPU (``--device cpu --model tiny``), and their own byte checks pass: the sender's
first layer against the reference, the engine rank's every parameter. Nothing here is timed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "scripts" / script),
            "--device",
            "cpu",
            "--model",
            "tiny",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


DELTA_ARGS = "--delta-lr 1e-5 --delta-steps 1 --delta-step sign adam --profile 4".split()


@pytest.mark.parametrize(
    "args",
    [
        ("--mode", "broadcast"),
        # with delta updates after the dense row (#33), after both stand-in steps: their own rows,
        # their host profile and the kept copy's check
        ("--mode", "scatter", "--tp", "2", *DELTA_ARGS),
        ("--mode", "senders", "--tp", "2", "--ep", "--senders", "2", "--master", "bf16", "fp32"),
        # a fleet: servers of different layouts in one link (#32)
        ("--mode", "scatter", "--servers", "2xTP2", "EP2", "TP2xDP2"),
        ("--mode", "senders", "--senders", "2", "--servers", "TP2", "2xEP2"),
    ],
)
@pytest.mark.slow
def test_pipeline_script_checks_its_bytes(args):
    out = _run("pipeline.py", "--layers", "2", "--repeats", "1", *args)
    profile = [ln for ln in out.splitlines() if ln.startswith("prof| ")]
    out = "".join(ln + "\n" for ln in out.splitlines() if not ln.startswith("prof| "))
    assert bool(profile) == ("--profile" in args) and ("sender.py" in "".join(profile) or not profile), out
    checks = re.findall(r"\b(\d+)/(\d+)\s", out)
    assert checks, out
    assert all(int(checked) > 0 and int(differ) == 0 for checked, differ in checks), out
    if "broadcast" not in args:
        # The link carried the model's wire bytes plus the protocol's own words (prelude, votes).
        ratios = [float(r) for r in re.findall(r"\s(\d+\.\d{5})\s+\d+/\d+\s", out)]
        assert ratios and all(1 <= r < 1.05 for r in ratios), out
    if "--delta-lr" in args:
        # every layer went as a delta, on fewer bytes than the dense update; the kept copy of layer
        # 0 was checked against the reference of the final masters (above: N/0) beside the dense one
        rows = [ln for ln in out.split("delta updates", 1)[1].splitlines() if ln.startswith("scatter")]
        assert len(rows) == 2 and all(" 2 of 2 " in r for r in rows) and len(checks) == 2, out
        wires = [tuple(map(float, re.search(r"\s(\d+\.\d{3}) \((\d+\.\d{3})\)\s", r).groups())) for r in rows]
        assert all(0 < median <= most < 100 for median, most in wires), out
        # Adam's warm step moves a typical weight by a fifth of the sign step's lr: fewer changes
        assert " sign " in rows[0] and " adam " in rows[1] and wires[1][0] < wires[0][0], out


@pytest.mark.slow
def test_engine_rank_script_lands_every_parameter():
    # with delta updates after the dense ones (#33), in the same run: its own table
    out = _run("engine_rank.py", "--layers", "2", "--tp", "2", "--repeats", "1", "--delta")
    rows = re.findall(r"\b(\d+)/(\d+)\s*$", out, flags=re.M)
    # TP and EP, dense (every parameter equal to W0's reference) then delta (to W1's)
    assert len(rows) == 4, out
    assert all(int(a) == int(b) > 0 for a, b in rows), out
    # every layer went as a delta, W1 differs from W0, and the rank received under a tenth of the dense bytes
    deltas = re.findall(
        r"^(?:TP|EP)2 rank 0\s+2 of 2\s+(\d+\.\d+)\s+\d+\.\d+\s+(\d+\.\d+)\s",
        out.split("delta updates", 1)[1],
        flags=re.M,
    )
    assert len(deltas) == 2, out
    assert all(float(changed) > 0 and float(ratio) < 0.1 for changed, ratio in deltas), out


def test_delta_fraction_script_measures_real_adamw_steps(tmp_path):
    """The #33 measurement on tiny shapes, through the delta kernel (checked against the reference
    at every step): an AdamW step changes a few percent of the bytes at most, most fp32 scales of
    fp32 masters, no ue8m0 scale; glm_fp8's encoding is smaller than vLLM's sparse_nccl patches of
    the same FP8 change, and those of the bf16 weights than of the FP8 bytes."""
    out = _run(
        "delta_fraction.py",
        "--steps",
        "2",
        "--masters",
        "fp32",
        "--lrs",
        "1e-5",
        "--quantizer",
        "kernel",
        "--json",
        str(tmp_path / "delta.json"),
    )
    runs = {r["scale_fmt"]: r["steps"] for r in json.loads((tmp_path / "delta.json").read_text())["results"]}
    assert sorted(runs) == ["fp32", "ue8m0"] and all(len(s) == 2 for s in runs.values()), out
    for fmt, steps in runs.items():
        for s in steps:
            assert 0 < s["bytes_changed"] < 0.05, out
            assert s["scales_changed"] > 0.5 if fmt == "fp32" else s["scales_changed"] == 0.0, out
            assert 0 < s["wire_glm_fp8"] < s["wire_sparse_nccl"] < s["wire_bf16_sparse_nccl"], out
            assert 0 < s["wire_slime_deltas_zstd"] < s["wire_slime_deltas"] < s["wire_sparse_nccl"], out
            assert 0 < s["wire_xor_zstd"] < 1, out
    assert re.search(r"^\|\s*fp32\s*\|\s*1e-05\s*\|\s*ue8m0\s*\|", out, flags=re.M), out


def test_delta_apply_script_lands_every_encoding_exactly(tmp_path):
    """bench/scripts/delta_apply.py on tiny shapes (partial blocks): every encoding of the same
    change lands the new checkpoint bit for bit on the engine's copy of the old one; glm_fp8's wire
    is smaller than vLLM sparse_nccl's patches of that change and a sliver of the dense bytes."""
    out = _run("delta_apply.py", "--repeats", "2", "--json", str(tmp_path / "apply.json"))
    rows = json.loads((tmp_path / "apply.json").read_text())["rows"]
    names = ("dense", "glm_fp8", "sparse_nccl", "slime_deltas", "slime_deltas_zstd", "xor_zstd")
    assert [r["encoding"] for r in rows] == [*names, *names], out
    assert all(r["exact"] for r in rows), out
    for lr in (1e-6, 1e-5):
        wire = {r["encoding"]: r["wire_bytes"] / r["dense_bytes"] for r in rows if r["lr"] == lr}
        assert wire["dense"] == 1 and 0 < wire["glm_fp8"] < wire["sparse_nccl"] < 0.05, out
        assert 0 < wire["xor_zstd"] < 0.05 and 0 < wire["slime_deltas_zstd"] < 0.05, out
    assert re.search(r"^\|\s*1e-05\s*\|\s*xor_zstd\s*\|.*\|\s*yes\s*\|$", out, flags=re.M), out


def test_layer_path_goes_down_the_layers_as_docs_map_says(tmp_path):
    """bench/scripts/layer_path.py: no call climbs a layer on a dense or a delta layer's path, and
    the modules and layers each side enters are the "after" figures of docs/map.md's table."""
    out = tmp_path / "path.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "bench" / "scripts" / "layer_path.py")
    done = subprocess.run(
        [sys.executable, script, "--json", str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    table = (ROOT / "docs" / "map.md").read_text()
    for rank, side in (("0", "sender"), ("1", "engine rank")):
        for kind in ("dense", "delta"):
            s = got[rank][kind]
            assert s["up"] == 0, (kind, side, s["up_pairs"])
            row = re.search(rf"^\| {kind}, {side} \| \d+ -> (\d+) \| \d+ -> (\d+) \|", table, re.M)
            assert row, f"docs/map.md has no row for {kind}, {side}"
            assert (s["modules"], len(s["layers"])) == (int(row[1]), int(row[2])), (
                kind,
                side,
                s["module_list"],
            )


def test_delta_kernels_script_checks_the_word_path_against_the_byte_path():
    """bench/scripts/delta_kernels.py's checks on the CPU (no timings there): the comparison 8 bytes
    a lane and ``pack_bytes_delta`` against the byte comparison, its checksum against the pass's."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "bench" / "scripts" / "delta_kernels.py")
    done = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--mib", "0.25"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "byte path (bitmap, counts, length, payload, kept copy, checksum): True" in done.stdout, (
        done.stdout
    )

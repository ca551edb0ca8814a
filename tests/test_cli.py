"""``glm-fp8``: bad arguments are argparse errors (exit code 2, one ``error:`` line on stderr
naming the option), never tracebacks or silent passes; the CPU bench prints no bandwidth."""

import argparse
import json
import re

import pytest
import torch

from glm_fp8.backends import available_backends
from glm_fp8.cli import main

ON_GPU = torch.cuda.is_available()


def _usage_error(capsys, argv: list[str]) -> str:
    """Run ``glm-fp8 argv``; assert argparse's exit and return its one error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert err.rstrip("\n").splitlines()[-1] == errors[0]  # argparse: usage, then the error line
    assert errors[0].startswith(f"glm-fp8 {argv[0]}: error: argument "), errors[0]
    return errors[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["plan", "--nodes", "0"], r"--nodes: expected an integer >= 1, got 0"),
        (["plan", "--nodes", "-2"], r"--nodes: expected an integer >= 1, got -2"),
        (["plan", "--nodes", "two"], r"--nodes: expected an integer >= 1, got 'two'"),
        (["plan", "--gpus-per-node", "0"], r"--gpus-per-node: expected an integer >= 1, got 0"),
        (["plan", "--gpu-gib", "0"], r"--gpu-gib: expected a finite number > 0, got 0"),
        (["plan", "--gpu-gib", "-1.5"], r"--gpu-gib: expected a finite number > 0, got -1.5"),
        (["plan", "--gpu-gib", "nan"], r"--gpu-gib: expected a finite number > 0, got nan"),
        (["bench", "--rounds", "0"], r"--rounds: expected an integer >= 1, got 0"),
        (["bench", "--budget-ms", "0"], r"--budget-ms: expected a finite number > 0, got 0"),
        (["bench", "--budget-ms", "-5"], r"--budget-ms: expected a finite number > 0, got -5"),
        (["bench", "--budget-ms", "inf"], r"--budget-ms: expected a finite number > 0, got inf"),
        (["demo", "--layers", "0"], r"--layers: expected an integer >= 1, got 0"),
        (["demo", "--world", "1"], r"--world: expected an integer >= 2, got 1"),
        (["demo", "--ring", "0"], r"--ring: expected an integer >= 1, got 0"),
    ],
)
def test_range_errors(capsys, argv, expected):
    assert _usage_error(capsys, argv).endswith(expected)


def test_unknown_model_lists_presets(capsys):
    from glm_fp8.models import PRESETS

    line = _usage_error(capsys, ["plan", "--model", "nosuch"])
    assert "--model: unknown preset 'nosuch'" in line
    for name in PRESETS:
        assert name in line


def test_config_missing(capsys, tmp_path):
    path = tmp_path / "missing.json"
    line = _usage_error(capsys, ["plan", "--config", str(path)])
    assert "--config: cannot read" in line and "missing.json" in line and "No such file" in line


def test_config_not_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    line = _usage_error(capsys, ["plan", "--config", str(path)])
    assert "--config:" in line and "is not JSON" in line


def test_config_not_an_object(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([1, 2]))
    line = _usage_error(capsys, ["plan", "--config", str(path)])
    assert "--config:" in line and "JSON list, expected an object" in line


def test_config_without_fields(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    line = _usage_error(capsys, ["plan", "--config", str(path)])
    assert "--config: config.num_hidden_layers: missing; expected an int in [1, 4096]" in line


def test_config_from_a_file(capsys, tmp_path):
    from glm_fp8.models import PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["glm-4.5"]))
    assert main(["plan", "--config", str(path)]) == 0
    assert "glm4_moe: 92 layers" in capsys.readouterr().out


def test_unknown_case_names_the_cases(capsys):
    line = _usage_error(capsys, ["bench", "--case", "nosuchcase"])
    assert "--case: 'nosuchcase' matches no" in line
    assert ("glm5-experts-bf16" if ON_GPU else "small-qkv-bf16") in line


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_unavailable_backend(capsys, backend):
    device = "cuda" if ON_GPU else "cpu"
    if backend in available_backends(device):
        pytest.skip(f"backend {backend!r} is available on {device} here")
    line = _usage_error(capsys, ["bench", "--backend", backend])
    assert f"--backend: {backend!r} is not available on {device}" in line


def test_plan_glm5(capsys):
    assert main(["plan", "--model", "glm-5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("glm_moe_dsa: 78 layers")
    assert re.search(r"^layer kind\s+layers\s+indices\s+entries\s+kernel-format GiB", out, re.M)
    assert re.search(r"^dense\s+3\s+0-2\s", out, re.M) and re.search(r"^sparse\s+75\s+3-77\s", out, re.M)


def test_plan_glm52_counts_layer_kinds(capsys, tmp_path):
    """GLM-5.2's IndexShare schedule: 3 dense, 18 sparse with an indexer, 57 without; a layer
    without an indexer has 5 entries fewer (wq_b, its scale, wk_weights_proj, k_norm weight, bias)."""
    from glm_fp8.models import PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["glm-5.2"]))
    for argv in (["plan", "--model", "glm-5.2"], ["plan", "--config", str(path)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("glm_moe_dsa: 78 layers (3 dense, 57 sparse/no-indexer, 18 sparse)"), out
        found = re.findall(r"^(\S+)\s+(\d+)\s+.*?\s(\d+)\s+[\d.]+\s", out, re.M)
        rows = {m[0]: (int(m[1]), int(m[2])) for m in found}
        assert rows["dense"][0] == 3 and rows["sparse"][0] == 18 and rows["sparse/no-indexer"][0] == 57
        assert rows["sparse"][1] - rows["sparse/no-indexer"][1] == 5


def test_plan_nodes(capsys):
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "4", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "(8 GPUs, layers only)" in out and "fits 80 GiB" in out
    assert "fits: the fp32 master shards of the decoder layers plus one layer's conversion peak only" in out


def test_help_describes_the_tool_and_every_option_with_its_default(capsys):
    """``glm-fp8 --help`` says what the tool does and lists its subcommands; every option of every
    subcommand has a help text, and each one with a value default states it."""
    from glm_fp8.cli import _parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "weight updates from an RL trainer to a vLLM engine" in out
    assert "entry point" not in out
    for name in ("demo", "plan", "bench"):
        assert f"\n  {name} " in out
    _, sub = _parser()
    for name, p in sub.choices.items():
        assert p.description, name
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0]
            assert action.help, f"{name} {flag}: no help"
            if action.default not in (None, False):
                assert "(default: " in action.help or "(repeatable; default" in action.help, (
                    f"{name} {flag}: the help does not state the default {action.default!r}"
                )


def test_plan_engine_bytes(capsys):
    """GLM-5 into TP=8 or EP=8: every engine rank receives 90.28 of the 706.06 GiB in scatter mode;
    its receiver takes 2 of its largest layer buffers above its parameters: 3.07 GiB in one update
    (the MTP layer's 1.54 GiB the largest), 2.35 GiB in vLLM's target session and 1.54 GiB (one
    buffer: one layer) in the draft session; 22.24 GiB from a full broadcast."""
    for extra in ([], ["--engine-ep"]):
        assert main(["plan", "--engine-tp", "8", *extra]) == 0
        out = capsys.readouterr().out
        assert "into 8 engine ranks (TP 8 x DP 1" in out
        row = r"^0, 1, 2, 3, 4, 5, 6, 7\s+706\.06\s+90\.28\s+0\.128\s+22\.24\s+3\.07\s+2\.35 / 1\.54$"
        assert re.search(row, out, re.M), out


def test_plan_refuses_an_engine_layout_vllm_refuses(capsys):
    line = _usage_error(capsys, ["plan", "--engine-tp", "64"])
    assert "kv_b_proj.weight" in line and "multiple of 128" in line


@pytest.mark.skipif(ON_GPU, reason="the CPU output only")
def test_cpu_bench_prints_no_bandwidth(capsys):
    argv = ["bench", "--shapes", "small", "--case", "small-qkv", "--budget-ms", "50", "--no-compile"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    assert re.split(r"\s{2,}", lines[header])[-4:] == ["ms", "GB/s", "share of copy", "peak transient MiB"]
    rows = [line for line in lines[header + 2 :] if line.startswith("small-qkv")]
    assert {"glm_fp8", "copy", "eager reference"} <= {re.split(r"\s{2,}", r)[2] for r in rows}
    for row in rows:  # the copy row has an empty backend cell: index the columns from the right
        ms, gbps, share, _peak = re.split(r"\s{2,}", row)[-4:]
        assert float(ms) > 0, row  # the time is still shown
        assert gbps == "n/a (CPU)" and share == "n/a (CPU)", row
    assert any(line.startswith("note:") and "interpreter" in line for line in lines[header:])


def test_wall_seconds_is_the_median_of_its_runs():
    """The bench scripts' wall clock: ``runs`` calls, each synchronized (a no-op without a GPU)."""
    import time

    from glm_fp8.bench import wall_seconds

    calls = []
    sleeps = iter([0.001, 0.05, 0.02])
    t = wall_seconds(lambda: (calls.append(1), time.sleep(next(sleeps))), runs=3)
    assert len(calls) == 3 and 0.02 <= t < 0.05

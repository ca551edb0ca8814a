"""``glm-fp8``: bad arguments are argparse errors (exit code 2, one ``error:`` line on stderr
naming the option and a pointer to --help), never tracebacks or silent passes; the CPU bench prints
no bandwidth; ``-V`` prints the version; preset names are taken in any case."""

import argparse
import json
import re

import pytest
import torch

from glm_fp8.cli.main import main
from glm_fp8.kernels.backends import available_backends

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
    # the error line, then a pointer to --help: no usage block before it
    prog = f"glm-fp8 {argv[0]}" if argv and not argv[0].startswith("-") else "glm-fp8"
    assert err.splitlines() == [errors[0], f"see '{prog} --help'"], err
    assert errors[0].startswith(f"glm-fp8 {argv[0]}: error: argument "), errors[0]
    return errors[0]


_GPUS = "(at most 1024 trainer GPUs: the many senders' plan is computed per sender)"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["plan", "--nodes", "0"], f"--nodes: expected an integer in [1, 1024] {_GPUS}, got 0"),
        (["plan", "--nodes", "-2"], f"--nodes: expected an integer in [1, 1024] {_GPUS}, got -2"),
        (["plan", "--nodes", "two"], f"--nodes: expected an integer in [1, 1024] {_GPUS}, got 'two' (str)"),
        (
            ["plan", "--gpus-per-node", "0"],
            f"--gpus-per-node: expected an integer in [1, 1024] {_GPUS}, got 0",
        ),
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
    from glm_fp8.model.presets import PRESETS

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
    assert "--config: config.num_hidden_layers: missing; expected an integer in [1, 4096]" in line


def test_config_from_a_file(capsys, tmp_path):
    from glm_fp8.model.presets import PRESETS

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
    assert main(["plan", "--model", "glm-5", "--detail"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("glm_moe_dsa: 78 layers")
    assert re.search(r"^layer kind\s+layers\s+entries\s+kernel-format\s+gathered", out, re.M)
    assert re.search(r"^dense\s+3\s+21\s", out, re.M) and re.search(r"^sparse\s+75\s+27\s", out, re.M)
    assert "  dense: layers 0-2\n  sparse: layers 3-77\n" in out


def test_plan_glm52_counts_layer_kinds(capsys, tmp_path):
    """GLM-5.2's IndexShare schedule: 3 dense, 18 sparse with an indexer, 57 without; a layer
    without an indexer has 5 entries fewer (wq_b, its scale, wk_weights_proj, k_norm weight, bias)."""
    from glm_fp8.model.presets import PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["glm-5.2"]))
    for argv in (["plan", "--model", "glm-5.2"], ["plan", "--config", str(path)]):
        assert main([*argv, "--detail"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("glm_moe_dsa: 78 layers (3 dense, 57 sparse/no-indexer, 18 sparse)"), out
        found = re.findall(r"^(\S+)\s+(\d+)\s+(\d+)\s+[\d.]+\s", out, re.M)
        rows = {m[0]: (int(m[1]), int(m[2])) for m in found}
        assert rows["dense"][0] == 3 and rows["sparse"][0] == 18 and rows["sparse/no-indexer"][0] == 57
        assert rows["sparse"][1] - rows["sparse/no-indexer"][1] == 5


def test_plan_nodes(capsys):
    """--nodes x --gpus-per-node are the trainer's GPUs: the summary says whether the fp32 master
    shards and the busiest trainer rank's peak fit --gpu-gib; --detail has the fit per path."""
    assert (
        main(
            [
                "plan",
                "--model",
                "deepseek-v3",
                "--nodes",
                "2",
                "--gpus-per-node",
                "4",
                "--gpu-gib",
                "80",
                "--detail",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    flat = _flat(out)
    assert "deployment: 8 trainer GPUs -> 1 x server0 (TP 8 x DP 1) (TP 8 assumed: pass --engine-tp)" in flat
    assert re.search(
        r"a trainer GPU: [\d.]+ GiB of float32 master shards \+ [\d.]+ GiB peak = [\d.]+ GiB: "
        r"(fits|does NOT fit) 80 GiB",
        flat,
    )
    assert (
        "fit on a trainer GPU (8 GPUs, 80 GiB each): the float32 master shards of the decoder layers" in flat
    )
    assert re.search(r"^glm_fp8 \(one sender, whole layer\)\s+[\d.]+\s+[\d.]+\s+(yes|NO)$", out, re.M), out


def test_help_describes_the_tool_and_every_option_with_its_default(capsys):
    """``glm-fp8 --help`` says what the tool does and lists its subcommands; every option of every
    subcommand has a help text, and each one with a value default states it."""
    from glm_fp8.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "weight updates from an RL trainer to a vLLM engine" in out
    assert "entry point" not in out
    for name in ("demo", "plan", "bench"):
        assert f"\n  {name} " in out
    _, sub = build_parser()
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
    (the MTP layer's 1.54 GiB the largest), 2.35 GiB in the target session and 1.54 GiB (one
    buffer: one layer) in the draft session; 22.24 GiB from a full broadcast."""
    for extra in ([], ["--engine-ep"]):
        assert main(["plan", "--engine-tp", "8", *extra, "--detail"]) == 0
        out = capsys.readouterr().out
        assert "into 8 engine ranks (TP 8 x DP 1" in _flat(out)
        row = r"^0-7\s+706\.06\s+90\.28\s+0\.128\s+22\.24\s+3\.07\s+2\.35 / 1\.54$"
        assert re.search(row, out, re.M), out
        # the summary: an engine rank's extra memory per session, saying what it counts
        assert (
            "engine ranks (each of 8 per engine): 2.35 GiB in the target session, 1.54 GiB in the "
            in _flat(out)
        )
    # the same figures from Python (glm_fp8.planning.report, which the CLI only prints)
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.planning.report import plan_report
    from glm_fp8.planning.request import PlanRequest

    rows = plan_report(PRESETS["glm-5"], PlanRequest(engine_tp=8, engine_ep=True))["engine"]["rows"]
    assert [(r["ranks"], round(r["extra_target_session_bytes"] / 2**30, 2)) for r in rows] == [
        (list(range(8)), 2.35)
    ]


def test_plan_refuses_a_deployment_of_a_config_without_the_sizes_it_needs(capsys):
    """glm-4.5's preset has no vocab_size: the layer kinds are shown, a deployment is refused
    naming the config and the field."""
    assert main(["plan", "--model", "glm-4.5"]) == 0
    capsys.readouterr()
    line = _usage_error(capsys, ["plan", "--model", "glm-4.5", "--trainer-gpus", "8"])
    assert "--model 'glm-4.5': config.vocab_size: required for the non-layer tensors" in line


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

    from glm_fp8.cli.bench import wall_seconds

    calls = []
    sleeps = iter([0.001, 0.05, 0.02])
    t = wall_seconds(lambda: (calls.append(1), time.sleep(next(sleeps))), runs=3)
    assert len(calls) == 3 and 0.02 <= t < 0.05


# --- glm-fp8 plan: a summary first, the detail on request, JSON always, no ignored flags ---------

DEPLOYMENT = ["plan", "--trainer-gpus", "32", "--engines", "4", "--engine-tp", "8", "--engine-ep"]


def _flat(out: str) -> str:
    """The output with every run of whitespace one space: prose wrapped at 100 reads as one line."""
    return " ".join(out.split())


def _plan_text(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    out = capsys.readouterr().out
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= 100, f"{argv}: a line of {len(widest)} characters: {widest!r}"
    return out


def test_plan_summary_first_then_the_detail_on_request(capsys):
    """Without --detail: the model, the deployment, the mode auto picks and why, the predicted
    time, every rank's extra memory saying what it counts, the fit; no table. The figures are
    those of the tables --detail prints and of the JSON, which holds everything."""
    out = _plan_text(capsys, DEPLOYMENT)
    lines = out.splitlines()
    assert lines[0].startswith("glm_moe_dsa: 78 layers (3 dense, 75 sparse)")
    assert not any(line.startswith("---") for line in lines), out
    flat = _flat(out)
    # one line: the mode auto picks and its predicted time, then why
    assert (
        'mode="auto" picks many senders (mode="senders"), predicted 2.53 s for the whole model in one '
        "update (fp8 many senders): each of the 32 trainer ranks holds whole " in flat
    )
    assert "other strategies: bf16 broadcast 59.08 s, fp8 broadcast 15.98 s, fp8 scatter 15.98 s" in flat
    assert "an engine rank receives 90.28 GiB at most (fp8 many senders)" in flat
    assert re.search(
        r"each trainer rank sends the servers 90\.\d\d \(rank \d+\) to 90\.55 GiB \(rank 11\)", flat
    )
    m = re.search(
        r"trainer ranks 0-31 \(senders\): ([\d.]+) GiB at most: 2 conversion slots \+ 2 send "
        r"slots \+ one layer's gathered tensors it owns",
        flat,
    )
    assert m, out
    assert "engine ranks (each of 8 per engine): 2.35 GiB in the target session, 1.54 GiB in" in flat
    assert re.search(r"a trainer GPU: 86\.4 GiB of float32 master shards \+ [\d.]+ GiB peak", flat)
    assert "detail: --detail" in out

    detail = _plan_text(capsys, [*DEPLOYMENT, "--detail"])
    assert detail.startswith(out.split("\ndetail: --detail")[0])  # the same summary, then the tables
    assert re.search(r"^fp8 many senders\s+32\s+90\.6\s+90\.3\s+", detail, re.M), detail
    # Every sender peak is the same figure with the same label: the summary's, the strategy
    # table's and the transfer plan's largest.
    row = re.search(r"^fp8 many senders(?:\s+[\d.]+){5}\s+([\d.]+)$", detail, re.M)
    assert row and row.group(1) == m.group(1), detail
    assert re.search(
        rf"its largest: sender \d+, {re.escape(m.group(1))} GiB \(the summary's figure\)", _flat(detail)
    )
    assert "sender peak: 2 conversion slots + 2 send slots + one layer's gathered tensors;" in _flat(detail)

    assert main([*DEPLOYMENT, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    s = got["summary"]
    assert s["auto_mode"] == "senders" and round(s["predicted_seconds"], 2) == 2.53
    senders = got["update"]["strategies"][-1]
    assert (
        s["trainer_extra"][0]["bytes"]
        == senders["sender_peak"]
        == got["update"]["transfer_plan"]["max_peak_bytes"]
    )
    assert f"{senders['sender_peak'] / 2**30:.2f}" == m.group(1)
    assert got["assumptions"]["master_dtype"] == "float32" and got["assumptions"]["gather_dtype"] is None


def test_auto_mode_follows_the_trainer():
    from glm_fp8.planning.summary import auto_mode

    assert auto_mode(32, True)[0] == "senders"
    assert (
        auto_mode(32, False) == ("scatter", auto_mode(32, False)[1])
        and "split experts" in auto_mode(32, False)[1]
    )
    assert auto_mode(1, True)[0] == "scatter" and "one trainer rank" in auto_mode(1, True)[1]


def test_plan_experts_split_shows_every_strategy(capsys):
    """--experts-split: auto picks scatter; the many-senders row is still there, marked n/a with
    why, in the text and in the JSON; the scatter sender's peak says what it counts."""
    argv = [
        "plan",
        "--trainer-gpus",
        "16",
        "--experts-split",
        "--engine-tp",
        "4",
        "--engine-dp",
        "2",
        "--detail",
    ]
    out = _plan_text(capsys, argv)
    flat = _flat(out)
    picks = (
        r'mode="auto" picks scatter \(mode="scatter"\), predicted [\d.]+ s for the whole model in one update'
    )
    assert re.search(picks + r" \(fp8 scatter\): the trainer's shards split experts", flat)
    assert re.search(
        r"trainer rank 0 sends the servers [\d.]+ GiB; trainer ranks 1-15 send the servers nothing", flat
    )
    assert re.search(r"^fp8 many senders\s+-\s+-\s+-\s+-\s+n/a\s+-$", out, re.M), out
    assert "fp8 many senders: n/a: needs every trainer rank to hold whole experts" in flat
    assert re.search(
        r"trainer rank 0 \(sender\): [\d.]+ GiB at most: 2 conversion slots \+ 2 send slots", flat
    )
    assert re.search(r"trainer ranks 1-15 \(contributors\): [\d.]+ GiB at most: one layer's non-expert", flat)
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(p["strategy"], p["applicable"]) for p in got["update"]["strategies"]] == [
        ("bf16 broadcast", True),
        ("fp8 broadcast", True),
        ("fp8 scatter", True),
        ("fp8 many senders", False),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--detail", "--entries"],
        ["plan", "--model", "glm-5.2", "--nodes", "1", "--detail"],
        ["plan", "--model", "kimi-k2", "--engine-tp", "8", "--engine-dp", "2", "--engine-ep", "--detail"],
        ["plan", "--model", "qwen3-moe", "--trainer-gpus", "1", "--engine-tp", "4", "--detail", "--entries"],
        [
            "plan",
            "--trainer-gpus",
            "8",
            "--server",
            "tp=2,name=a",
            "--server",
            "tp=4,replicas=2,gbps=200",
            "--detail",
        ],
    ],
)
def test_plan_lines_fit_100_characters(capsys, argv):
    """Every line of every variant (the summary, each table, the legends) is at most 100 wide."""
    out = _plan_text(capsys, argv)
    assert out.startswith(("glm_moe_dsa", "kimi_k2", "deepseek_v3", "qwen3_moe")), out


def test_plan_json_is_always_json(capsys):
    """--json without a deployment: the model, the layer kinds, a summary that says what to pass."""
    assert main(["plan", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["summary"]["auto_mode"] is None and "--trainer-gpus" in got["summary"]["hint"]
    assert [k["kind"] for k in got["layer_kinds"]] == ["dense", "sparse"]
    assert got["update"] is None and got["engine"] is None and got["fits"] is None
    assert set(got["peak_counts"]) >= {"eager", "preallocated_stack", "glm_fp8", "gathered", "excludes"}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--engines", "4"], "--engines: describes the deployment and needs --trainer-gpus N (or --nodes)"),
        (["--link-gbps", "100"], "--link-gbps: describes the deployment and needs --trainer-gpus N"),
        (["--experts-split"], "--experts-split: describes the deployment and needs --trainer-gpus N"),
        (["--gpu-gib", "80"], "--gpu-gib: describes the deployment and needs --trainer-gpus N"),
        (["--engine-dp", "4"], "--engine-dp: needs --engine-tp (the engine's layout is TP x DP"),
        (["--engine-ep", "--trainer-gpus", "8"], "--engine-ep: needs --engine-tp"),
        (["--gpus-per-node", "4"], "--gpus-per-node: 4 needs --nodes"),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--trainer-gpus", "64"],
            "--trainer-gpus: 64 contradicts --nodes 2 x --gpus-per-node 8 = 16 trainer GPUs",
        ),
        (
            ["--target", "blackwell", "--engine-tp", "8"],
            "--target: 'blackwell' is the kernel format of the layer",
        ),
    ],
)
def test_plan_refuses_ignored_or_contradictory_flags(capsys, argv, expected):
    assert expected in _usage_error(capsys, ["plan", *argv])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--trainer-gpus", "1000000000"],
            "--trainer-gpus: expected an integer in [1, 1024] (at most 1024 trainer GPUs: the many senders' "
            "plan is computed per sender), got 1000000000",
        ),
        (["--trainer-gpus", "8", "--engines", "1000000000"], "--engines: expected an integer in [1, 256]"),
        (
            ["--engine-tp", "8", "--engine-dp", "1000"],
            "--engine-dp: expected an integer in [1, 512] (at most 512 ranks per engine: "
            "each rank's shard is computed), got 1000",
        ),
        (
            ["--engine-tp", "8", "--engine-dp", "128"],
            "--engine-dp: TP 8 x DP 128 = 1024 engine ranks; expected at most 512",
        ),
        (["--nodes", "1000"], "--nodes: 1000 x --gpus-per-node 8 = 8000 trainer GPUs; expected at most 1024"),
        (
            ["--trainer-gpus", "8", "--engines", "256", "--engine-tp", "8", "--engine-dp", "4"],
            "--engines: 256 engines x 32 ranks = 8192 engine ranks; expected at most 4096",
        ),
        (["--engine-tp", "8", "--engine-dp", "64"], "--engine-tp: 8 with engine_dp 64: "),
    ],
)
def test_plan_bounds_refuse_at_once(capsys, argv, expected):
    """Sizes that would exhaust memory or take minutes are refused before anything is built, with
    the limit and why; a layout vLLM refuses is refused from its first rank's shard."""
    import time

    start = time.perf_counter()
    line = _usage_error(capsys, ["plan", *argv])
    assert expected in line and "(" in line, line
    assert time.perf_counter() - start < 10


def test_plan_request_checks_bounds_for_python_callers():
    from glm_fp8.core.errors import PlanArgumentError
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.planning.report import plan_report
    from glm_fp8.planning.request import PlanRequest

    for field, value, limit in (
        ("trainer_gpus", 10**9, 1024),
        ("engines", 10**9, 256),
        ("engine_dp", 1000, 512),
    ):
        want = rf"^{field}: expected an integer in \[1, {limit}\] \(.+\), got {value}$"
        with pytest.raises(PlanArgumentError, match=want) as exc:
            plan_report(PRESETS["glm-5"], PlanRequest(**{"trainer_gpus": 8, field: value}))
        assert exc.value.argument == field


def test_plan_request_checks_servers_for_python_callers():
    """A fleet given to ``PlanRequest`` (``servers``): with a deployment, instead of the one-layout
    fields, within the same bounds; refused naming ``servers``."""
    from glm_fp8.core.errors import PlanArgumentError
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.planning.fleet import Server
    from glm_fp8.planning.report import plan_report
    from glm_fp8.planning.request import PlanRequest

    for request, want in (
        (PlanRequest(servers=(Server(8),)), "servers: describe the deployment and need trainer_gpus"),
        (PlanRequest(trainer_gpus=8, engine_tp=8, servers=(Server(8),)), "servers: given with engine_tp"),
        (PlanRequest(trainer_gpus=8, servers=(Server(8, dp=128),)), "server0: TP 8 x DP 128 = 1024 ranks"),
        (
            PlanRequest(trainer_gpus=8, servers=[Server(8)]),
            "servers: expected a tuple of glm_fp8.planning.fleet.Server",
        ),
    ):
        with pytest.raises(PlanArgumentError, match=re.escape(want)) as exc:
            plan_report(PRESETS["glm-5"], request)
        assert exc.value.argument == "servers"


def test_version(capsys):
    from glm_fp8 import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"glm-fp8 {__version__}\n"


def test_gather_dtype_defaults_to_the_trainers_own():
    """No cast by default: estimate_memory reads each input's own dtype, and the CLI gathers fp32
    masters as fp32 (twice the bf16 bytes) unless --gather-dtype bf16 opts into the cast."""
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.planning.memory import estimate_memory, travel_plan

    plan = plan_from_config(PRESETS["glm-4.5"], 5)
    fp32 = travel_plan(plan, torch.float32)
    assert estimate_memory(fp32).inputs == estimate_memory(fp32, torch.float32).inputs
    # twice the bf16 masters' bytes, but for what the model keeps in float32 (router, bias)
    assert estimate_memory(fp32).inputs == pytest.approx(
        2 * estimate_memory(travel_plan(plan, torch.bfloat16)).inputs, rel=1e-3
    )
    bf16_cast = travel_plan(plan, torch.float32, torch.bfloat16)
    assert estimate_memory(bf16_cast).inputs < estimate_memory(fp32).inputs
    assert estimate_memory(bf16_cast).output == estimate_memory(fp32).output


def test_plan_gather_dtype_option(capsys):
    got = {}
    for flags in ([], ["--gather-dtype", "bf16"], ["--master-dtype", "bf16"]):
        assert main(["plan", "--model", "glm-4.5", "--json", *flags]) == 0
        got[tuple(flags)] = json.loads(capsys.readouterr().out)
    default = got[()]
    assert default["assumptions"]["gathered_in"] == "the masters' own dtype (float32)"
    sparse = {
        k: [x for x in r["layer_kinds"] if x["kind"] == "sparse"][0]["gathered_bytes"] for k, r in got.items()
    }
    assert sparse[()] > 1.9 * sparse[("--gather-dtype", "bf16")]
    assert sparse[("--master-dtype", "bf16")] == pytest.approx(sparse[("--gather-dtype", "bf16")], rel=1e-3)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("", "--server: expected KEY=VALUE[,KEY=VALUE...] with keys tp, dp"),
        ("tp=8,pp=2", "--server: unknown key 'pp' in 'tp=8,pp=2'; expected KEY=VALUE"),
        ("tp=8,tp=4", "--server: tp given twice in 'tp=8,tp=4'"),
        ("tp", "--server: tp: expected tp=VALUE in 'tp'"),
        ("tp=eight", "--server: tp: expected an integer in [1, 512] (at most 512 ranks per server"),
        ("tp=8,dp=128", "--server: TP 8 x DP 128 = 1024 ranks; expected at most 512 ranks per server"),
        ("replicas=0", "--server: replicas: expected an integer >= 1, got 0"),
        ("tp=8,dp=4,ep=16", "--server: ep=16 with tp=8, dp=4: vLLM's expert-parallel size is TP x DP = 32"),
        ("tp=8,name=a b", "--server: name: expected letters, digits, '_', '.' or '-', got 'a b'"),
        ("tp=8,gbps=0", "--server: gbps: expected a finite number > 0, got 0"),
    ],
)
def test_plan_refuses_malformed_servers(capsys, spec, expected):
    assert expected in _usage_error(capsys, ["plan", "--trainer-gpus", "8", "--server", spec])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--server", "tp=8"], "--server: describes the deployment and needs --trainer-gpus N (or --nodes)"),
        (
            ["--trainer-gpus", "8", "--server", "tp=8", "--engine-tp", "8"],
            "--engine-tp: one engine layout; --server gives each server its own",
        ),
        (
            ["--fleet", "glm-5-4xep8", "--engines", "2"],
            "--engines: one engine layout; --fleet glm-5-4xep8 gives",
        ),
        (["--fleet", "glm-5-4xep8", "--server", "tp=8"], "--server: --fleet glm-5-4xep8 gives the servers"),
        (["--fleet", "nosuch"], "--fleet: invalid choice: 'nosuch'"),
        (
            ["--trainer-gpus", "8", "--server", "tp=8,name=a", "--server", "tp=4,name=a"],
            "--server: expected distinct server names, got ['a', 'a']",
        ),
        (
            ["--trainer-gpus", "8", "--server", "tp=2", "--server", "tp=64,name=big"],
            "--server: server big (TP 64 x DP 1, MoE TP 64): model.layers.0.self_attn.kv_b_proj.weight",
        ),
        (
            ["--trainer-gpus", "8", *["--server", "tp=8,replicas=200"] * 2],
            "--server: 400 servers in all; expected at most 256",
        ),
    ],
)
def test_plan_refuses_fleets_that_contradict_or_exceed(capsys, argv, expected):
    assert expected in _usage_error(capsys, ["plan", *argv])


def test_plan_fleet_preset_of_the_target_case(capsys):
    """--fleet glm-5-4xep8 is --trainer-gpus 32 --engines 4 --engine-tp 8 --engine-ep: the same
    2.53 s and the same figures, said per server; a --server fleet of one server alike."""
    assert main([*DEPLOYMENT, "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main(["plan", "--fleet", "glm-5-4xep8", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert round(new["summary"]["predicted_seconds"], 2) == 2.53
    assert new["update"]["strategies"] == old["update"]["strategies"]
    assert new["update"]["fleet"] == old["update"]["fleet"]  # the same fleet: 4 replicas of one server
    assert {k: v for k, v in new["summary"].items() if k != "engine_extra"} == {
        k: v for k, v in old["summary"].items() if k != "engine_extra"
    }
    assert new["servers"][0]["rows"] == old["engine"]["rows"] and old["servers"] is None
    (server,) = new["summary"]["servers"]
    assert server["received_bytes"] == new["update"]["strategies"][-1]["received"]
    assert server["name"] == "server0" and server["layout"] == "TP 8 x DP 1, EP 8" and server["replicas"] == 4
    senders = new["summary"]["sender_bytes"]
    assert len(senders) == 32 and max(senders) == new["update"]["strategies"][-1]["sent"]
    out = _flat(_plan_text(capsys, ["plan", "--fleet", "glm-5-4xep8"]))
    assert (
        "deployment: 32 trainer GPUs -> 4 x server0 (TP 8 x DP 1, EP 8): 32 server ranks; 400 Gb/s per" in out
    )
    assert 'mode="auto" picks many senders (mode="senders"), predicted 2.53 s for the whole model' in out
    assert "server0 ranks (4 replicas x 8): 2.35 GiB in the target session, 1.54 GiB in the draft" in out
    assert "received by each server's busiest rank (fp8 many senders): server0 90.28 GiB" in out


# --- glm-fp8 plan --delta: the delta update beside the dense one (issue #33; model predictions) ---


def test_plan_delta_summary_detail_and_json(capsys):
    """--delta FRACTION: one summary line with the delta time next to the dense one and the wire
    fraction, a sender's kept copy against its GPU, each server's receiver; --detail: every fp8
    strategy's delta row; --json: the same figures (summary.delta, each strategy's delta)."""
    argv = [*DEPLOYMENT, "--delta", "0.0012"]
    flat = _flat(_plan_text(capsys, argv))
    assert (
        "delta update (model prediction; 0.12 % of the e4m3 bytes changed, scales 100 %, passthrough "
        "entries dense): 0.183 s against 2.53 s dense (fp8 many senders), 1.73 % of the dense bytes" in flat
    )
    kept = (
        r"a sender keeps what it last sent: 22\.64 GiB on the GPU; on its GPU [\d.]+ GiB with the "
        r"transient peak, \+ 86\.4 GiB of master shards = [\d.]+ GiB: fits 139 GiB"
    )
    assert re.search(kept, flat), flat
    assert "server ranks' receiver in a delta update of every layer in one session" in flat
    assert "the MTP layer's included): server0 4.61 GiB (dense 3.07)" in flat
    detail = _plan_text(capsys, [*argv, "--detail"])
    row = r"^fp8 many senders\s+1\.801\s+1\.561\s+1\.73 %\s+0\.183\s+2\.53\s+22\.64\s+[\d.]+$"
    assert re.search(row, detail, re.M), detail
    assert "fp8 many senders: 1.01 x conversion 181.0 ms + fill 0.5 ms = 0.183 s" in _flat(detail)
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    d, many = got["summary"]["delta"], got["update"]["strategies"][-1]
    assert (d["fraction"], d["kept"], d["scales_changed"], d["passthrough"]) == (0.0012, "gpu", 1.0, None)
    assert d["seconds"] == many["delta"]["seconds"] and d["dense_seconds"] == many["seconds"]
    assert d["sender_kept_bytes"] == many["delta"]["kept"] and d["fits"]
    assert got["update"]["strategies"][0]["delta"] is None  # bf16 broadcast: no delta
    assert main([*DEPLOYMENT, "--json"]) == 0  # without --delta: none
    assert json.loads(capsys.readouterr().out)["summary"]["delta"] is None
    # kept in host memory (a small deployment): 2 layers of it staged on the GPU, its copies timed
    host = _flat(
        _plan_text(
            capsys,
            [
                "plan",
                "--model",
                "qwen3-moe",
                "--trainer-gpus",
                "2",
                "--engine-tp",
                "2",
                "--delta",
                "0.01",
                "--delta-kept",
                "host",
            ],
        )
    )
    assert re.search(r"GiB in pinned host memory; on its GPU", host), host
    assert re.search(r"1\.01 x host copy read in place [\d.]+ GB / 55\.3 GB/s", host), host


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--delta", "1.5", "--trainer-gpus", "8"],
            "--delta: expected a fraction in [0, 1] (0.0012 for 0.12 %), got 1.5",
        ),
        (["--delta", "-0.1", "--trainer-gpus", "8"], "--delta: expected a fraction in [0, 1]"),
        (
            ["--delta", "0.12%", "--trainer-gpus", "8"],
            "--delta: expected a fraction in [0, 1] (0.0012 for 0.12 %), got '0.12%'",
        ),
        (["--delta", "nan", "--trainer-gpus", "8"], "--delta: expected a fraction in [0, 1]"),
        (
            ["--delta", "0.01"],
            "--delta: a delta update is predicted for a deployment and needs --trainer-gpus N",
        ),
        (
            ["--trainer-gpus", "8", "--delta-kept", "host"],
            "--delta-kept: describes a delta update and needs --delta FRACTION",
        ),
        (
            ["--trainer-gpus", "8", "--delta-scales", "0"],
            "--delta-scales: describes a delta update and needs",
        ),
        (
            ["--trainer-gpus", "8", "--delta", "0.01", "--delta-scales", "2"],
            "--delta-scales: expected a fraction",
        ),
        (["--trainer-gpus", "8", "--delta", "0.01", "--delta-kept", "disk"], "--delta-kept: invalid choice"),
    ],
)
def test_plan_refuses_a_bad_delta(capsys, argv, expected):
    assert expected in _usage_error(capsys, ["plan", *argv])


def test_version_and_preset_names_in_any_case(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("glm-fp8 ")
    assert main(["plan", "--model", "GLM-5", "--json"]) == 0
    upper = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "glm-5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == upper

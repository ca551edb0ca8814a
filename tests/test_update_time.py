"""The update-time model: its figures follow from the plans' bytes and its two measured
constants, exactly as its arithmetic line states, and the issue's target case holds.

Invariant: for every strategy, ``seconds == PIPELINE_FACTOR * max(sent, received, gathered) /
link + CONVERT_SECONDS_PER_BYTE * fill``, and the bytes are those of the plans (a whole-model
fp8 update of GLM-5 is 706.06 GiB; an engine rank at EP=8 receives 90.28 GiB of it).
"""

import json
import re

import pytest
import torch

from glm_fp8.cli import main
from glm_fp8.engine import EngineLayout
from glm_fp8.models import PRESETS
from glm_fp8.transfer.pack import update_bytes
from glm_fp8.update_time import PIPELINE_FACTOR, STRATEGIES, Fleet, predict

GLM5 = PRESETS["glm-5"]
GIB = 2**30


def test_glm5_into_four_ep8_engines_from_32_trainer_gpus():
    """The target: a whole GLM-5 fp8 update into 4 engines of 8 H200 (EP=8) from 32 trainer
    H200 at 400 Gb/s per GPU, predicted at most 3 s with many senders."""
    fleet = Fleet(trainer_gpus=32, engines=4, engine_tp=8, engine_ep=True, link_gbps=400)
    preds = {p.strategy: p for p in predict(GLM5, fleet)}
    assert tuple(preds) == STRATEGIES
    layouts = EngineLayout.all_ranks(8, enable_expert_parallel=True)
    full, per_rank = update_bytes(GLM5, layouts)
    assert preds["fp8 broadcast"].sent == full and round(full / GIB, 2) == 706.06
    assert preds["fp8 scatter"].received == max(per_rank) and round(max(per_rank) / GIB, 2) == 90.28
    # many senders: the same shard, in segments from each sender (each aligned, with its checksum)
    assert 0 <= preds["fp8 many senders"].received - max(per_rank) < 32 * 80 * (256 + 8)
    many = preds["fp8 many senders"]
    assert many.senders == 32 and many.seconds <= 3.0
    # Point to point, a sender sends its part to each replica: about what an engine rank
    # receives (the busiest sender owns three decoder layers' other entries besides its rows).
    assert round(many.sent / GIB, 2) == 91.06
    assert many.seconds == pytest.approx(PIPELINE_FACTOR * many.sent / 50e9, rel=2e-3)
    # Two slots of conversion and of send buffers, one layer's gathered tensors: fp32 masters (the
    # default) travel as fp32, so the gather is twice bf16 masters' (3.06 GiB in all then).
    bf16 = {p.strategy: p for p in predict(GLM5, fleet, master_dtype=torch.bfloat16)}["fp8 many senders"]
    assert bf16.sender_peak < 3.1 * GIB < many.sender_peak < 4 * GIB
    assert many.gathered == pytest.approx(2 * bf16.gathered, rel=1e-3)
    cast = {p.strategy: p for p in predict(GLM5, fleet, gather_dtype=torch.bfloat16)}["fp8 many senders"]
    assert cast.gathered == pytest.approx(bf16.gathered, rel=1e-2)  # the opt-in cast: bf16 on the wire
    assert preds["bf16 broadcast"].sent > 1.9 * full  # twice the bytes (plus bf16 passthrough alike)
    assert preds["bf16 broadcast"].seconds > 10 * many.seconds


def test_every_figure_is_its_arithmetic():
    fleet = Fleet(trainer_gpus=16, engines=2, engine_tp=4, engine_dp=2, engine_ep=True, link_gbps=200)
    for p in predict(GLM5, fleet):
        busiest, bw, fill_ms, total = map(float, re.fullmatch(
            r"[\d.]+ x ([\d.]+) GB / ([\d.]+) GB/s \+ fill ([\d.]+) ms = ([\d.]+) s", p.arithmetic
        ).groups())  # fmt: skip
        assert bw == 25.0
        assert busiest == pytest.approx(max(p.sent, p.received, p.gathered) / 1e9, abs=0.05)
        assert p.seconds == pytest.approx(PIPELINE_FACTOR * busiest / bw + fill_ms / 1e3, abs=0.01)
        assert round(p.seconds, 2) == total


def test_more_senders_and_faster_links_never_predict_longer():
    times = [
        {p.strategy: p.seconds for p in predict(GLM5, Fleet(trainer_gpus=t, engine_ep=True, link_gbps=g))}
        for t, g in ((8, 400), (32, 400), (32, 800))
    ]
    assert times[1]["fp8 many senders"] <= times[0]["fp8 many senders"]
    assert all(times[2][s] < times[1][s] for s in STRATEGIES)
    # many senders need whole experts (each quantizes its own); split experts are gathered
    whole = predict(GLM5, Fleet(trainer_gpus=32, engine_ep=True))
    split = predict(GLM5, Fleet(trainer_gpus=32, engine_ep=True, experts_whole=False))
    assert [p.strategy for p in split] == list(STRATEGIES[:3])
    assert whole[-1].gathered * 100 < split[-1].gathered


def test_fleet_keeps_plain_ints():
    """A fleet takes what ``check_int`` takes (numpy's and torch's integer scalars) and holds plain
    ints: ``plan --json`` writes it out."""
    np = pytest.importorskip("numpy")
    fleet = Fleet(trainer_gpus=np.int64(8), engine_tp=torch.tensor(4))
    assert fleet == Fleet(trainer_gpus=8, engine_tp=4)
    assert type(fleet.trainer_gpus) is int and type(fleet.engine_tp) is int
    json.dumps(fleet.__dict__)


@pytest.mark.parametrize("field, value", [("trainer_gpus", 0), ("engines", 1.5), ("link_gbps", 0.0)])
def test_bad_fleet_is_refused(field, value):
    with pytest.raises(ValueError, match=f"Fleet.{field}: expected"):
        Fleet(**{"trainer_gpus": 8, field: value})


def test_cli_prints_the_table_and_the_json(capsys):
    argv = ["plan", "--trainer-gpus", "32", "--engines", "4", "--engine-tp", "8", "--engine-ep", "--detail"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted whole-model update: 32 trainer GPUs -> 4 engine(s) of TP 8 x DP 1 EP" in out
    assert re.search(r"^fp8 many senders\s+32\s+91\.1\s+90\.3\s+", out, re.M), out
    assert "many senders' transfer plan" in out
    assert re.search(r"^\s+4\s+32\.\.39\s+69\s+91\.06\s", out, re.M), out
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["update"]["strategies"]
    assert [p["strategy"] for p in got] == list(STRATEGIES) and got[-1]["seconds"] <= 3.0

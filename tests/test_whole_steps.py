"""The compute model against whole training steps measured on an H200 (costmodels/profiles/h200_steps.json)."""

import json

import pytest
import torch

import costmodels as cm
from costmodels import whole_steps as ws

STEP_BAND = (0.85, 1.15)  # measured / predicted, per step


@pytest.fixture(scope="module")
def predictions():
    model = cm.MeasuredCompute("h200")
    return [ws.predict_step(model, step) for step in ws.load_steps()]


def test_every_measured_step_is_predicted_within_the_band(predictions):
    assert len(predictions) == 4
    out = {p.step.case: round(p.ratio, 3) for p in predictions if not STEP_BAND[0] <= p.ratio <= STEP_BAND[1]}
    assert out == {}
    # the four cover both regimes: kernels decide the large steps, the host the debug one
    assert {p.bound for p in predictions} == {"GPU", "host"}


def test_distinct_calls_keep_their_rank_order(predictions):
    assert ws.spearman(predictions) >= 0.9


def test_host_only_calls_are_what_explains_the_launch_bound_step(predictions):
    # priced without the views and other host-only calls, the launch-bound step is half its time
    (debug,) = [p for p in predictions if p.bound == "host"]
    kernels_only = cm.MeasuredCompute("h200")
    step = ws.MeasuredStep(debug.step.case, debug.step.calls, sum(c.count for c in debug.step.calls),
                           debug.step.measured_us)
    assert ws.predict_step(kernels_only, step).ratio > 2.0


def test_the_step_file_round_trips_its_specs():
    # decoding is exact: the meta tensors have the recorded shapes, strides and dtypes
    data = json.loads((cm.measured.profiles_dir() / "h200_steps.json").read_text())
    row = data["cases"][0]["rows"][2]
    a, b = ws.decode_spec(row["args"])
    assert a.shape == torch.Size(row["args"]["L"][0]["T"]) and b.stride() == tuple(row["args"]["L"][1]["S"])
    assert a.dtype == torch.bfloat16 and a.device.type == "meta"


def test_bad_step_specs_are_named(tmp_path):
    data = json.loads((cm.measured.profiles_dir() / "h200_steps.json").read_text())
    data["cases"] = data["cases"][:1]
    data["cases"][0]["rows"][0]["op"] = "aten.not_an_op.default"
    bad = tmp_path / "steps.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"op 'aten.not_an_op.default' is not an ATen operator"):
        ws.load_steps(bad)
    with pytest.raises(ValueError, match=r"unknown dtype 'bf17'"):
        ws.decode_spec({"T": [2], "S": [1], "D": "bf17"}, "x")

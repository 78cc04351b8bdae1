"""``apmodel calibrate-compute``: measure this machine's kernels, fit a compute profile, and check the
fitted CPU model against kernels it was not fitted to.

The CI check (:func:`test_cpu_profile_predicts_held_out_training_ops`): the quick kernel set is
measured and fitted on this machine's CPU (one thread), then every ATen op of one forward+backward
step of a tiny transformer (shapes that are not in the fit set) is timed with the same method and
predicted by the fitted profile. Asserted: the median factor ``max(pred/meas, meas/pred)`` over
the ops is at most 1.5, and at least :data:`MIN_FRACTION_WITHIN` of the ops are within 1.5x.
Noise on a shared machine is tamed by the method itself (warm-up, interleaved passes, median of
repeats, a robust loss in the fit); a sustained change of the machine's speed between the fit and
the check (seen: all ops 2x slower) is measured on a dozen fitted kernels re-timed beside the
held-out ops and divided out. That the check can fail is shown on the same ops: the
fitted profile made 2x too fast fails both thresholds (the nominal CPU roofline is reported only:
how far it misses depends on the CPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import costmodels as cm
from apmodel.cli import app
from apmodel.frontend.config import ConfigError, parse_config_text
from costmodels import fitting
from costmodels import kernel_timing as kt
from costmodels import measured as ms
from costmodels import measurements as mr

from _helpers import benchmark_script

aten = torch.ops.aten

#: The held-out check: largest median factor max(pred/meas, meas/pred) over the ops...
MAX_MEDIAN_FACTOR = 1.5
#: ... the factor that counts as "predicted" ...
FACTOR = 1.5
#: ... and the least share of the ops predicted within it. Measured on this project's 2-core CI
#: machine under load from other jobs: 80-90% (the misses: strided copies, column sums, tiny
#: fills; see the README).
MIN_FRACTION_WITHIN = 0.7
#: Threads of the calibration and of the held-out timings (one: a shared 2-core machine).
THREADS = 1


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


# ------------------------------------------------------------------------------ the profile
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> dict[str, Any]:
    """One `apmodel calibrate-compute --quick` run on this machine (CPU without CUDA)."""
    folder = tmp_path_factory.mktemp("calibrate")
    out = folder / "cpu_profile.json"
    res = CliRunner().invoke(app, ["calibrate-compute", "--quick", "--threads", str(THREADS), "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return {"out": out, "measurements": folder / "cpu_profile_kernels.json", "stdout": res.stdout}


needs_cpu_run = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU checks measure the CPU; "
                                   "with CUDA present calibrate-compute measures the GPU")


@needs_cpu_run
def test_calibrate_compute_writes_a_profile_that_round_trips(calibrated):
    out, meas_path = calibrated["out"], calibrated["measurements"]
    assert "compute profile saved to" in calibrated["stdout"] and "matmul" in calibrated["stdout"]
    text = out.read_text()
    data = json.loads(text)
    assert data["schema"] == ms.PROFILE_SCHEMA and data["device"] == "cpu"
    assert data["executions"] == ["eager"]
    prof = cm.ComputeProfile.load(out)
    assert prof.dumps() == text                        # the file is exactly what the profile writes
    assert cm.ComputeProfile.from_dict(json.loads(prof.dumps())).to_dict() == prof.to_dict()
    # provenance: device, torch version, date, method, threads
    prov = prof.provenance
    assert prov["device_type"] == "cpu" and prov["device"].startswith("CPU")
    assert prov["torch"] == torch.__version__ and prov["threads"] == THREADS
    assert prov["measurements"] == meas_path.name and prov["kernel_set"] == "quick"
    assert "median" in prov["method"] and "perf_counter" in prov["method"]
    assert prov["date"][:4].isdigit() and "T" in prov["date"]
    # the measurements file: every row priced, timed, reproducible by the fit
    meas = mr.load_measurements(meas_path)
    assert meas["schema"] == mr.MEASUREMENTS_SCHEMA and meas["device_type"] == "cpu"
    rows = meas["rows"]
    assert len(rows) == prof.fit["eager"]["rows"] >= 60
    assert {r["op"] for r in rows} >= {"mm", "mm_tt", "bmm", "add", "copy_", "gelu", "sum", "sum_dim0", "layer_norm",
                                       "softmax", "log_softmax", "embedding", "embedding_dense_backward",
                                       "sdpa_flash_fwd", "sdpa_flash_fwd_plus_bwd"}
    assert all(r["meas_us"] > 0 and mr.row_calls(r) for r in rows)
    # the profile's fit summary is its predictions of the file's rows (the measurement condition:
    # cache warm), and it reproduces them
    again = fitting.summary(fitting.fit_reports(prof, rows, "cpu")["eager"])
    assert again == json.loads(json.dumps(prof.to_dict()["fit"]["eager"]))
    assert prof.fit["eager"]["median_abs_rel_err"] < 0.25


@needs_cpu_run
def test_compute_model_accepts_the_cpu_profile(calibrated, tmp_path):
    out = calibrated["out"]
    model = cm.compute_model("cpu", profile=str(out))
    assert isinstance(model, cm.MeasuredCompute) and model.execution == "eager"
    assert model.profile.matches(cm.device("cpu"))      # used as fitted, not rescaled
    a, b = meta(256, 512), meta(512, 128)
    t = model.time_us(aten.mm.default, (a, b), {}, meta(256, 128))
    rate = 2 * 256 * 512 * 128 / (t * 1e-6)
    assert 1e9 < rate < cm.device("cpu").peak_flops("fp32")     # fitted, below the nominal peak
    # a CPU has no CUDA graphs: the profile says so, and pricing graphs is refused by name
    with pytest.raises(cm.ProfileError, match=r"no 'graphs' timings.*eager"):
        cm.compute_model("cpu", profile=str(out), execution="graphs")
    # from the configuration: relative to the file, as `calibration`
    cfg_dir = out.parent
    cfg = parse_config_text('[pricing]\ncompute_profile = "cpu_profile.json"\nexecution = "eager"\n',
                            str(cfg_dir / "apmodel.toml"), cfg_dir)
    assert cfg.options["compute_profile"] == str(out) and cfg.options["execution"] == "eager"
    assert isinstance(cm.compute_model("cpu", profile=cfg.options["compute_profile"], execution=cfg.options["execution"]),
                      cm.MeasuredCompute)


# --------------------------------------------------------------------- the held-out check
def _script():
    return benchmark_script("cpu_compute_check")


@needs_cpu_run
def test_cpu_profile_predicts_held_out_training_ops(calibrated):
    check = _script()
    prof = cm.load_profile(str(calibrated["out"]))
    rows = mr.load_measurements(calibrated["measurements"])["rows"]
    rep = check.held_out(prof, threads=THREADS, fit_rows=rows)
    # judged at the fit's machine speed: re-timed fitted kernels measure how much slower this
    # shared machine runs now than a few seconds ago (it has been seen at 2x), and that is divided out
    fitted, roofline = rep["fitted_at_fit_speed"], rep["roofline"]
    assert rep["in_fit_set"] == []                  # held out: no op has the operand shapes of a fitted row
    assert rep["drift_rows"] == 12 and rep["drift"] > 0
    assert fitted["ops"] >= 30 and fitted["factor"] == FACTOR
    worst = "\n".join(f"  {w['op']} {w['shapes']}: meas {w['meas_us']:.1f} µs, pred {w['pred_us']:.1f} µs"
                      for w in fitted["worst"])
    summary = (f"{fitted['ops']} held-out ops: machine at {rep['drift']:.2f}x its fit-time speed; at fit speed "
               f"median factor {fitted['median_factor']:.3f}, {fitted['within']:.0%} within {FACTOR}x "
               f"(as measured: {rep['fitted']['median_factor']:.3f}, {rep['fitted']['within']:.0%}); worst:\n{worst}")
    print(summary)
    assert fitted["median_factor"] <= MAX_MEDIAN_FACTOR, summary
    assert fitted["within"] >= MIN_FRACTION_WITHIN, summary
    # the check discriminates: the same profile made 2x too fast on every op, judged on the same
    # timings, fails both thresholds. (The nominal roofline is reported but not asserted on: how far
    # it misses depends on which CPU runs the suite, 2.2x to 4.5x seen.)
    wrong = rep["fitted_2x_fast"]
    assert wrong["median_factor"] > MAX_MEDIAN_FACTOR and wrong["within"] < MIN_FRACTION_WITHIN, wrong
    assert roofline["ops"] == fitted["ops"]


# ----------------------------------------------------------------------- without measuring
def test_cpu_kernel_set_is_priced_and_stays_below_the_allocator_threshold():
    rows = kt.kernel_rows("cpu", quick=True)
    full = kt.kernel_rows("cpu", quick=False)
    assert len(rows) < len(full)
    for r in full:
        calls = mr.row_calls(r)
        for c in calls:
            for t in cm.compute.tensors_in(c.out):
                assert t.numel() * t.element_size() < kt.HOST_ALLOCATOR_WARM_BYTES, mr.describe_row(r)
    shapes = {tuple(map(tuple, r["shapes"])) for r in rows if r["op"] == "mm"}
    assert ((256, 256), (256, 255)) in shapes and ((256, 255), (255, 256)) in shapes     # misaligned pitches
    assert min(math.prod(r["shapes"][0]) for r in rows if r["op"] == "add") <= 1024          # the launch floor
    # the CPU's flash-attention kernels are priced as flash attention
    model = cm.compute_model("h200")
    att = [r for r in rows if r["op"] == "sdpa_flash_fwd_plus_bwd"][0]
    kinds = [model.breakdown(c.op, c.args, c.kwargs, c.out)["kind"] for c in mr.row_calls(att)]
    assert kinds == ["attention:flash:fwd", "attention:flash:bwd"]
    assert mr.row_harness_cpu_us(model, att) == 0.0        # timed as ATen calls, no autograd harness


def test_materialized_calls_run_what_is_priced():
    row = {"op": "cross_entropy_fp32", "shapes": [[8, 50]], "dtype": "float32"}
    calls = mr.row_calls(row)
    seq = kt.materialize(calls, torch.device("cpu"))
    assert [op for op, _, _ in seq] == [c.op for c in calls]
    # the log-softmax reads the upcast's output, the loss reads the log-softmax's; targets index classes
    (_, a0, _), (_, a1, _), (_, a2, _) = seq
    assert a2[1].dtype == torch.int64 and 0 <= int(a2[1].min()) and int(a2[1].max()) < 50
    for (_, args, _), c in zip(seq, calls, strict=False):
        for real, fake in zip(cm.compute.tensors_in(args), cm.compute.tensors_in(c.args), strict=False):
            assert real.shape == fake.shape and real.stride() == fake.stride() and real.dtype == fake.dtype
    kt.runner(seq)()
    emb = mr.row_calls({"op": "embedding_dense_backward", "shapes": [[16, 8], [16]], "dtype": "float32",
                        "bytes": 100 * 8 * 4 + 16 * 8 * 4 + 16 * 8})
    (op, args, kwargs), = kt.materialize(emb, torch.device("cpu"))
    assert args[2] == 100 and int(args[1].max()) < 100
    assert isinstance(kt.time_us(kt.runner([(op, args, kwargs)]), torch.device("cpu"), quick=True), float)


def _cpu_profile_dict() -> dict:
    settings = fitting.settings_for("cpu", sm_count=1)
    prof = cm.ComputeProfile(device="cpu", params=settings.initial, reference=settings.reference,
                             executions=("eager",))
    return json.loads(prof.dumps())


def test_bad_profile_files_name_the_file_and_field(tmp_path):
    good = _cpu_profile_dict()
    path = tmp_path / "cpu.json"
    cases = [
        (lambda d: d["params"]["memory"].pop("hbm_TBps"), "params.memory.hbm_TBps"),
        (lambda d: d["params"]["memory"]["traffic"].__setitem__("transcendental", "fast"), "params.memory.traffic.transcendental"),
        (lambda d: d["params"]["memory"].__setitem__("softmax_single_pass_max_dim", -1), "softmax_single_pass_max_dim"),
        (lambda d: d["params"]["attention"]["cudnn"].__setitem__("same_as", "cudnn"), "attention.cudnn.same_as"),
        (lambda d: d["params"]["attention"].__setitem__("flash", {"same_as": "cudnn"}), "attention.flash.same_as"),
        (lambda d: d.__setitem__("executions", ["eager", "lazy"]), "executions"),
        (lambda d: d.__setitem__("executions", []), "executions"),
        (lambda d: d["reference"].__setitem__("hbm_TBps", "fast"), "reference.hbm_TBps"),
        (lambda d: d["reference"].__setitem__("sm_count", 1.5), "reference.sm_count"),
        (lambda d: d["reference"].pop("peak_tflops"), "peak_tflops"),
        (lambda d: d.__setitem__("schema", "apmodel.compute_profile/0"), "schema"),
        (lambda d: d.__setitem__("provenance", "me"), "provenance"),
    ]
    for mutate, field in cases:
        d = json.loads(json.dumps(good))
        mutate(d)
        path.write_text(json.dumps(d))
        with pytest.raises(cm.ProfileError) as e:
            cm.compute_model("cpu", profile=str(path))
        assert str(path) in str(e.value) and field in str(e.value), (field, str(e.value))
    for text, what in (("{not json", "invalid JSON"), ("[1, 2]", "JSON object")):
        path.write_text(text)
        with pytest.raises(cm.ProfileError, match=what) as e:
            cm.compute_model("cpu", profile=str(path))
        assert str(path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        cm.compute_model("cpu", profile=str(tmp_path / "missing.json"))
    # the good one loads; its cuDNN is flash's; graphs are refused
    path.write_text(json.dumps(good))
    model = cm.compute_model("cpu", profile=str(path))
    assert model.profile.executions == ("eager",) and model._attention["cudnn"] == model._attention["flash"]
    with pytest.raises(cm.ProfileError, match="graphs"):
        cm.compute_model("cpu", profile=str(path), execution="graphs")


def test_profiles_without_the_new_keys_price_as_before():
    """The H200 profile has no transcendental factor and no single-pass limit: gelu is priced as an
    elementwise op, softmax rows up to 1024 in one pass (as fitted)."""
    h200 = cm.compute_model("h200")
    x = meta(1 << 20, dtype=torch.bfloat16)
    gelu = h200.breakdown(aten.gelu.default, (x,), {}, x)
    add = h200.breakdown(aten.mul.Tensor, (x, 2.0), {}, x)
    assert gelu["kind"] == "transcendental" and gelu["total_us"] == pytest.approx(add["total_us"])
    assert h200.profile.executions == ("eager", "graphs")
    # a CPU profile: every softmax row pays its factor, gelu its own
    cpu = cm.compute_model("cpu", profile=_cpu_profile_dict())
    s = meta(64, 128)
    for op, args, kind in ((aten._softmax.default, (s, -1, False), "softmax"), (aten.gelu.default, (s,), "transcendental")):
        b = cpu.breakdown(op, args, {}, s)
        assert b["kind"] == kind and b["gpu_us"] == pytest.approx(cpu.memory_us(b["bytes"], cpu._traffic[kind]))
        assert cpu._traffic[kind] > 2 * cpu._traffic["elementwise"]
    # the same softmax row on the H200 is one pass (elementwise traffic)
    b = h200.breakdown(aten._softmax.default, (s, -1, False), {}, s)
    assert b["gpu_us"] == pytest.approx(h200.memory_us(b["bytes"], h200._traffic["elementwise"]))


@pytest.mark.parametrize("text,key", [
    ('[pricing]\nexecution = "lazy"\n', "pricing.execution"),
    ('[pricing]\nexecution = true\n', "pricing.execution"),
    ('[pricing]\ncompute_profile = 3\n', "pricing.compute_profile"),
    ('[pricing]\ncompute_profile = "h200"\n', "pricing.compute_profile"),
])
def test_config_keys_are_validated(text, key):
    with pytest.raises(ConfigError) as e:
        parse_config_text(text, "apmodel.toml")
    assert str(e.value).startswith("apmodel.toml: ") and key in str(e.value)


def test_config_compute_profile_is_relative_to_the_file(tmp_path):
    cfg = parse_config_text('[pricing]\ncompute_profile = "profiles/cpu.json"\n', "x.toml", tmp_path)
    assert cfg.options["compute_profile"] == str(tmp_path / "profiles" / "cpu.json") and "execution" not in cfg.options
    absolute = parse_config_text(f'[pricing]\ncompute_profile = "{tmp_path / "p.json"}"\n', "x.toml", Path("/elsewhere"))
    assert absolute.options["compute_profile"] == str(tmp_path / "p.json")


@pytest.mark.parametrize("args,expect", [
    (["--out", "no_such_dir/p.json"], "does not exist"),
    (["--out", "p.json", "--measurements-out", "p.json"], "another file"),
    (["--out", "p.json", "--device-name", "h100", "--quick"], "is a GPU"),
    (["--out", "p.json", "--device-name", "tpu9", "--quick"], "tpu9"),
])
def test_calibrate_compute_errors_are_one_line(tmp_path, monkeypatch, args, expect):
    if torch.cuda.is_available() and "--device-name" in args:
        pytest.skip("device names are checked against a CPU here")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["calibrate-compute", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], res.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quick_profile_has_graph_timings(tmp_path):
    cal = fitting.calibrate_compute(quick=True)
    assert cal.profile.executions == ("eager", "graphs")
    assert any("meas_graph_us" in r for r in cal.measurements["rows"])
    assert cal.reports["eager"]["median_abs_rel_err"] < 0.25
    path = tmp_path / "gpu.json"
    path.write_text(cal.profile.dumps())
    assert isinstance(cm.compute_model(cal.profile.device, profile=str(path), execution="graphs"), cm.MeasuredCompute)

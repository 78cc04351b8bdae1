"""Measured compute model: fit quality on the shipped H200 kernel timings, and the effects it must
capture (matmul alignment, attention backends, launch floors, op kinds)."""

import json
import math

import pytest
import torch

import costmodels as cm
from costmodels import measured as ms
from costmodels import measurements as mr

from _helpers import benchmark_script

aten = torch.ops.aten


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def mm_us(model, m, k, n, dtype=torch.bfloat16):
    a, b = meta(m, k, dtype=dtype), meta(k, n, dtype=dtype)
    return model.time_us(aten.mm.default, (a, b), {}, meta(m, n, dtype=dtype))


def _script():
    return benchmark_script("compute_profile")


@pytest.fixture(scope="module")
def rows():
    return mr.load_measurements(device="h200")["rows"]


@pytest.fixture(scope="module")
def h200():
    return cm.compute_model("h200")


# --- fit quality -----------------------------------------------------------------------------
def test_shipped_measurements_are_the_issue_data(rows):
    data = mr.load_measurements(device="h200")
    assert len(rows) == 314
    assert "H200" in data["gpu"] and data["provenance"]["software"].startswith("PyTorch 2.11")
    assert {r["op"] for r in rows} >= {"mm", "mm_tt", "bmm", "sdpa_flash_fwd", "sdpa_cudnn_fwd_plus_bwd",
                                        "add", "to_fp32", "cross_entropy_fp32", "embedding_dense_backward"}


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_fitted_h200_predicts_every_row_within_1_5x(rows, cache):
    # "warm": the measurement condition (one op replayed on the same buffers); "cold": as planned
    model = ms.MeasuredCompute("h200", execution="eager", cache=cache)
    rep = mr.fit_report(model, rows)
    assert rep["rows"] == len(rows)
    bad = [(it["row"], round(it["ratio"], 2)) for it in rep["items"] if not 1 / 1.5 <= it["ratio"] <= 1.5]
    assert not bad, bad
    assert rep["median_abs_rel_err"] <= 0.15
    # the default model is the cold one
    if cache == "cold":
        assert mr.fit_report(cm.compute_model("h200"), rows)["median_abs_rel_err"] == rep["median_abs_rel_err"]


def test_cuda_graph_timings_within_1_5x(rows):
    model = ms.MeasuredCompute("h200", execution="graphs", cache="warm")
    rep = mr.fit_report(model, rows, measured="meas_graph_us")
    assert rep["rows"] == sum(1 for r in rows if r.get("meas_graph_us") is not None) > 0
    assert rep["max_factor"] <= 1.5
    assert rep["median_abs_rel_err"] <= 0.15


def test_single_op_rows_equal_time_us(rows, h200):
    """A one-op row's prediction is exactly what the planner pays for that op."""
    for r in rows[:40]:
        calls = mr.row_calls(r)
        if len(calls) == 1:
            c = calls[0]
            assert mr.predict_row(h200, r, calls) == pytest.approx(h200.time_us(c.op, c.args, c.kwargs, c.out))


def test_profile_states_provenance_and_fit():
    prof = cm.builtin_profile("h200")
    assert prof.device == "h200" and prof.reference["hbm_TBps"] == cm.device("h200").hbm_TBps
    assert prof.provenance["measurements"] == "h200_kernels.json"
    assert "PyTorch 2.11" in prof.provenance["software"]
    assert prof.fit["eager"]["rows"] == 314 and prof.fit["eager"]["max_factor"] <= 1.5
    h100 = cm.builtin_profile("h100")
    assert h100.device == "h100_sxm"
    assert h100.provenance["derived_from"]["device"] == "h200"
    assert "datasheet" in h100.provenance["derived_from"]["method"]
    assert h100.params["memory"]["hbm_TBps"] == pytest.approx(
        prof.params["memory"]["hbm_TBps"] * 3.35 / 4.8, rel=1e-4)
    assert h100.params["matmul"]["tflops"]["bf16"] == pytest.approx(prof.params["matmul"]["tflops"]["bf16"])


def test_refit_reproduces_shipped_profile(rows):
    pytest.importorskip("scipy")
    from costmodels import fitting

    result = fitting.fit_profile(rows, "h200", log=lambda s: None)
    fitted = result.profile
    assert fitted.executions == ("eager", "graphs")      # the file has CUDA-graph timings
    assert result.unconstrained == []                    # every parameter is fitted to data
    shipped = cm.builtin_profile("h200")

    def leaves(d, path=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{path}{k}.")
            else:
                yield f"{path}{k}", v

    got = dict(leaves(fitted.to_dict()["params"]))
    want = dict(leaves(shipped.to_dict()["params"]))
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, (int, float)):
            assert got[k] == pytest.approx(v, rel=0.02, abs=0.05), k
        else:
            assert got[k] == v, k


# --- effects ---------------------------------------------------------------------------------
def test_matmul_alignment(h200):
    base = mm_us(h200, 4096, 4096, 4096)
    assert 0.6 * 989.4e12 <= 2 * 4096**3 / (base * 1e-6) <= 0.8 * 989.4e12   # ~730 TFLOP/s measured
    assert mm_us(h200, 4096, 4096, 4097) > 4 * base       # n odd: 2-byte pitch, 106 TFLOP/s measured
    assert mm_us(h200, 4096, 4097, 4096) > 4 * base       # k odd
    assert 1.5 * base < mm_us(h200, 4096, 4096, 4098) < 4 * base   # 4-byte pitch, 236 measured
    assert mm_us(h200, 4096, 4096, 4104) < 1.1 * base     # 16-byte pitch again
    assert mm_us(h200, 4097, 4096, 4096) < 1.2 * base     # m is no pitch: tile quantisation only
    # GPT-2's vocabulary
    assert mm_us(h200, 2048, 768, 50257) > 3 * mm_us(h200, 2048, 768, 50304)
    # the pitch comes from the strides: a transposed view of a [50257, 768] weight is aligned on
    # its rows (pitch 768), a transposed view of a [2048, 50257] gradient is not
    w = meta(50257, 768)
    x = meta(2048, 768)
    aligned = h200.time_us(aten.mm.default, (x, w.t()), {}, meta(2048, 50257))
    g = meta(2048, 50257)
    gw = h200.time_us(aten.mm.default, (g.t(), x), {}, meta(50257, 768))
    gw_contig = h200.time_us(aten.mm.default, (meta(50257, 2048), x), {}, meta(50257, 768))
    assert gw > 3 * gw_contig
    assert aligned > 3 * mm_us(h200, 2048, 768, 50304)   # the [2048, 50257] output is misaligned


def test_attention_backends_differ(h200):
    q = meta(1, 32, 8192, 128)
    fl = aten._scaled_dot_product_flash_attention.default(q, q, q, 0.0, True)
    cu = aten._scaled_dot_product_cudnn_attention.default(q, q, q, None, True, 0.0, True)
    t_fl = h200.time_us(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, True), {}, fl)
    t_cu = h200.time_us(aten._scaled_dot_product_cudnn_attention.default, (q, q, q, None, True, 0.0, True), {}, cu)
    flops = 4 * 32 * 8192 * 8192 * 128 / 2
    assert 250e12 < flops / (t_fl * 1e-6) < 380e12        # flash ~320 TFLOP/s measured
    assert 500e12 < flops / (t_cu * 1e-6) < 720e12        # cuDNN ~610
    # the flash op priced as cuDNN
    as_cudnn = ms.MeasuredCompute("h200", attention_backend="cudnn")
    assert as_cudnn.time_us(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, True), {}, fl) \
        == pytest.approx(t_cu)
    # causal halves the work
    t_full = h200.time_us(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, False), {}, fl)
    assert 1.6 * t_fl < t_full < 2.2 * t_fl


def test_launch_floor_eager_and_graphs():
    eager = cm.compute_model("h200")
    graphs = cm.compute_model("h200", execution="graphs")
    x = meta(1024)
    t_e = eager.time_us(aten.add.Tensor, (x, x), {}, x)
    t_g = graphs.time_us(aten.add.Tensor, (x, x), {}, x)
    assert 8.0 <= t_e <= 10.5
    assert 0.5 <= t_g <= 2.0
    for op, args, out in [(aten.mul.Tensor, (x, 2.0), x), (aten.silu.default, (x,), x),
                          (aten.sum.default, (x,), meta(())), (aten.mm.default, (meta(16, 16), meta(16, 16)), meta(16, 16))]:
        assert 8.0 <= eager.time_us(op, args, {}, out) <= 15.0, op
    # a large op is not launch bound: the two modes agree to within the launch gap
    big = meta(1 << 28)
    assert eager.time_us(aten.add.Tensor, (big, big), {}, big) - graphs.time_us(aten.add.Tensor, (big, big), {}, big) \
        < 5.0


def test_allocations_cost_the_floor_only(h200):
    floor = h200.time_us(aten.add.Tensor, (meta(4), meta(4)), {}, meta(4))
    huge = meta(16384, 16384)
    for op, args, kwargs in [
        (aten.empty.memory_format, ([16384, 16384],), {"dtype": torch.bfloat16, "device": "meta"}),
        (aten.new_empty_strided.default, (meta(4), [16384, 16384], [16384, 1]), {}),
        (aten.empty_like.default, (huge,), {}),
        (aten.empty_strided.default, ([16384, 16384], [16384, 1]), {}),
    ]:
        assert h200.time_us(op, args, kwargs, huge) == pytest.approx(floor, rel=0.01), op
        assert cm.compute_model("h200", execution="graphs").time_us(op, args, kwargs, huge) == 0.0
    # zeros runs a fill kernel: it writes the output but reads nothing
    zeros = h200.breakdown(aten.zeros.default, ([16384, 16384],), {}, huge)
    copy = h200.breakdown(aten.clone.default, (huge,), {}, huge)
    assert zeros["bytes"] == 16384 * 16384 * 2 and copy["bytes"] == 2 * zeros["bytes"]
    assert zeros["total_us"] < 0.6 * copy["total_us"]


def test_fp32_internal_ops_move_fp32_bytes(h200):
    logits = meta(4096, 50257, dtype=torch.float32)     # traced in fp32, priced in bf16
    lsm_bf16 = h200.breakdown(aten._log_softmax.default, (logits, 1, False), {}, logits, dtype=torch.bfloat16)
    plain = h200.breakdown(aten.add.Tensor, (logits, logits), {}, logits, dtype=torch.bfloat16)
    assert lsm_bf16["bytes"] >= 2 * 4096 * 50257 * 2 * 2     # fp32 read + write, not bf16
    # = what autocast runs: upcast, fp32 log-softmax
    x = meta(4096, 50257)
    up = h200.time_us(aten._to_copy.default, (x,), {"dtype": torch.float32}, logits)
    lsm32 = h200.time_us(aten._log_softmax.default, (logits, 1, False), {}, logits)
    assert lsm_bf16["total_us"] == pytest.approx(up + lsm32, rel=0.05)
    assert lsm_bf16["total_us"] > 2 * plain["total_us"]
    # a dtype conversion makes ~2 passes
    conv = h200.breakdown(aten._to_copy.default, (x,), {"dtype": torch.float32}, logits)
    assert conv["kind"] == "convert"
    assert conv["gpu_us"] > 1.7 * h200.memory_us(conv["bytes"])


def test_embedding_backward_slower_than_its_bytes(h200):
    grad, idx = meta(4096, 4096), torch.empty(4096, dtype=torch.int64, device="meta")
    out = meta(128256, 4096)
    p = h200.breakdown(aten.embedding_dense_backward.default, (grad, idx, 128256, -1, False), {}, out)
    assert p["total_us"] > 2 * p["bytes"] / (cm.device("h200").hbm_bytes_per_s * 0.9) * 1e6
    assert 450 < p["total_us"] < 900                         # 658 µs measured


def test_views_and_getitem_are_free(h200):
    x = meta(64, 128)
    assert h200.time_us(aten.view.default, (x, [128, 64]), {}, meta(128, 64)) == 0.0
    assert h200.time_us(aten.t.default, (x,), {}, meta(128, 64)) == 0.0
    import operator
    assert h200.time_us(operator.getitem, ((x, x), 0), {}, x) == 0.0


# --- selection -------------------------------------------------------------------------------
def test_compute_model_picks_measured_where_a_profile_exists():
    assert isinstance(cm.compute_model("h200"), cm.MeasuredCompute)
    h100 = cm.compute_model("h100")
    assert isinstance(h100, cm.MeasuredCompute) and h100.profile.device == "h100_sxm"
    for dev in ("a100", "b200", "cpu"):
        assert isinstance(cm.compute_model(dev), cm.RooflineCompute)
    # the roofline stays available by name
    assert isinstance(cm.RooflineCompute("h200"), cm.RooflineCompute)
    assert isinstance(cm.compute_model("h200"), cm.ComputeModel)
    # a profile for a device without a built-in one
    a100 = cm.compute_model("a100", profile="h200")
    assert isinstance(a100, cm.MeasuredCompute) and a100.profile.reference["device"] == "a100_80gb_sxm"
    with pytest.raises(ValueError, match="execution"):
        cm.compute_model("h200", execution="lazy")
    with pytest.raises(ValueError, match="cache"):
        cm.MeasuredCompute("h200", cache="hot")
    with pytest.raises(ValueError, match="no built-in compute profile"):
        cm.MeasuredCompute("a100")


def test_cost_context_uses_compute_model():
    from apmodel.entry.api import cost_context

    ctx = cost_context((8,), device="h200")
    assert isinstance(ctx.compute, cm.MeasuredCompute)
    assert ctx.compute.profile.device == "h200" and ctx.compute.execution == "eager"
    ref = cm.compute_model("h200")
    a, b = meta(4096, 4097, dtype=torch.float32), meta(4097, 4096, dtype=torch.float32)
    out = meta(4096, 4096, dtype=torch.float32)
    assert ctx.compute.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16) == \
        ref.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16)
    assert isinstance(cost_context((8,), device="a100").compute, cm.RooflineCompute)
    # a given model still wins, by object or by name
    roof = cm.RooflineCompute("h200")
    assert cost_context((8,), device="h200", compute_model=roof).compute is roof
    assert isinstance(cost_context((8,), device="h200", compute_model="costmodels:RooflineCompute").compute,
                      cm.RooflineCompute)


def test_device_scaling_by_datasheet_ratios():
    h200, h100 = cm.compute_model("h200"), cm.compute_model("h100")
    big = meta(1 << 28)
    r = h100.time_us(aten.add.Tensor, (big, big), {}, big) / h200.time_us(aten.add.Tensor, (big, big), {}, big)
    assert r == pytest.approx(4.8 / 3.35, rel=0.02)
    # same peak: the same GEMM rate (the epilogue write is on the slower HBM)
    assert mm_us(h100, 8192, 8192, 8192) == pytest.approx(mm_us(h200, 8192, 8192, 8192), rel=0.02)
    # an overridden device spec scales the profile of its name
    slow = cm.compute_model(cm.device("h200", hbm_TBps=2.4))
    assert slow.time_us(aten.add.Tensor, (big, big), {}, big) == pytest.approx(
        2 * h200.time_us(aten.add.Tensor, (big, big), {}, big), rel=0.02)


def test_profile_round_trip_and_validation(tmp_path):
    prof = cm.builtin_profile("h200")
    path = tmp_path / "p.json"
    path.write_text(prof.dumps())
    again = cm.load_profile(path)
    assert again.to_dict()["params"] == prof.to_dict()["params"]
    model = cm.compute_model("h200", profile=str(path))
    assert mm_us(model, 4096, 4096, 4096) == mm_us(cm.compute_model("h200"), 4096, 4096, 4096)
    d = json.loads(prof.dumps())
    del d["params"]["matmul"]["align_efficiency"]["2"]
    with pytest.raises(cm.ProfileError, match="align_efficiency.2"):
        cm.load_profile(d)
    d = json.loads(prof.dumps())
    d["schema"] = "something/9"
    with pytest.raises(cm.ProfileError, match="schema"):
        cm.load_profile(d)
    d = json.loads(prof.dumps())
    d["params"]["memory"]["hbm_TBps"] = -1
    with pytest.raises(cm.ProfileError, match="hbm_TBps"):
        cm.load_profile(d)
    # profiles are read-only
    with pytest.raises(TypeError):
        prof.params["memory"]["hbm_TBps"] = 1.0


def test_repeated_calls_are_priced_once(h200, monkeypatch):
    """The planner prices the same op call thousands of times: the second call is a cache hit
    (counted, not timed: wall-clock limits do not belong in unit tests on a shared machine)."""
    a, b, out = meta(4096, 1024, dtype=torch.float32), meta(1024, 4096, dtype=torch.float32), meta(4096, 4096, dtype=torch.float32)
    calls = []
    inner = h200.price
    monkeypatch.setattr(h200, "price", lambda *args, **kw: calls.append(1) or inner(*args, **kw))
    first = h200.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16)
    for _ in range(100):
        assert h200.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16) == first
    assert len(calls) == 1
    h200.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.float32)  # another dtype: another key
    assert len(calls) == 2
    # strides are part of the key: a transposed operand can change the price
    at = meta(1024, 4096, dtype=torch.float32).t()
    assert math.isfinite(h200.time_us(aten.mm.default, (at, b), {}, out, dtype=torch.bfloat16))


def test_benchmark_script_prints_table_and_json(capsys):
    compute_profile = _script()
    assert compute_profile.main(["--worst", "3"]) == 0
    text = capsys.readouterr().out
    assert "median |pred/meas-1|" in text and "worst 3" in text
    assert compute_profile.main(["--json", "-", "--worst", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reports"]["eager"]["rows"] == 314
    assert data["reports"]["eager"]["max_factor"] <= 1.5

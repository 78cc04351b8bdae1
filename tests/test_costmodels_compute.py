"""Roofline compute model on local meta tensors."""

import operator

import pytest
import torch

import costmodels as cm

aten = torch.ops.aten


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.fixture(scope="module")
def h100():
    return cm.RooflineCompute(cm.device("h100"))


def test_large_bf16_gemm_runs_near_peak(h100):
    M = N = K = 8192
    a, b, out = meta(M, K), meta(K, N), meta(M, N)
    t = h100.time_us(aten.mm.default, (a, b), {}, out)
    achieved = 2 * M * N * K / (t * 1e-6)          # FLOP/s, counted by hand
    peak = 989.4e12                                 # H100 SXM dense bf16, datasheet
    assert 0.6 * peak <= achieved <= peak
    parts = h100.breakdown(aten.mm.default, (a, b), {}, out)
    assert parts["compute_us"] > 5 * parts["memory_us"]   # compute bound


def test_elementwise_sits_on_the_bandwidth_roof(h100):
    x = meta(8192, 8192)
    t = h100.time_us(aten.add.Tensor, (x, x), {}, x)
    nbytes = 3 * 8192 * 8192 * 2                      # two reads and one write of bf16
    roof_us = nbytes / (3.35e12 * cm.device("h100").memory_efficiency) * 1e6
    assert t == pytest.approx(roof_us + cm.device("h100").launch_floor_us, rel=1e-6)
    parts = h100.breakdown(aten.add.Tensor, (x, x), {}, x)
    assert parts["memory_us"] > 10 * parts["compute_us"]
    # other memory-bound ops: norms, reductions, copies
    y = meta(4096, 4096)
    assert h100.time_us(aten.sum.dim_IntList, (y, [1]), {}, meta(4096)) > h100.time_us(aten.sum.dim_IntList, (meta(16, 4096), [1]), {}, meta(16))
    assert h100.time_us(aten._to_copy.default, (y,), {"dtype": torch.float32}, meta(4096, 4096, dtype=torch.float32)) > 0


def test_views_and_getitem_are_free(h100):
    x = meta(64, 128)
    for op, args, out in [
        (aten.view.default, (x, [128, 64]), meta(128, 64)),
        (aten._unsafe_view.default, (x, [8192]), meta(8192)),
        (aten.t.default, (x,), meta(128, 64)),
        (aten.transpose.int, (x, 0, 1), meta(128, 64)),
        (aten.permute.default, (x, [1, 0]), meta(128, 64)),
        (aten.expand.default, (meta(1, 128), [64, 128]), x),
        (aten.unsqueeze.default, (x, 0), meta(1, 64, 128)),
        (aten.slice.Tensor, (x, 0, 0, 32), meta(32, 128)),
        (aten.select.int, (x, 0, 0), meta(128)),
        (aten.alias.default, (x,), x),
        (aten.detach.default, (x,), x),
        (aten.reshape.default, (x, [8192]), meta(8192)),
        (aten.squeeze.dim, (meta(1, 64), 0), meta(64)),
    ]:
        assert h100.time_us(op, args, {}, out) == 0.0, op
    assert h100.time_us(operator.getitem, ((x, x), 0), {}, x) == 0.0


def test_small_ops_pay_the_launch_floor(h100):
    x = meta(4)
    assert h100.time_us(aten.mul.Tensor, (x, x), {}, x) == pytest.approx(cm.device("h100").launch_floor_us, rel=1e-3)


def test_dtype_override_prices_fp32_trace_in_bf16(h100):
    a32, o32 = meta(4096, 4096, dtype=torch.float32), meta(4096, 4096, dtype=torch.float32)
    t_fp32 = h100.time_us(aten.mm.default, (a32, a32), {}, o32)
    t_bf16 = h100.time_us(aten.mm.default, (a32, a32), {}, o32, dtype=torch.bfloat16)
    assert t_bf16 == pytest.approx(h100.time_us(aten.mm.default, (meta(4096, 4096),) * 2, {}, meta(4096, 4096)))
    assert t_fp32 > 10 * t_bf16  # fp32 matmul without TF32 runs on CUDA cores (67 TF)
    tf32 = cm.RooflineCompute("h100", fp32_matmul="tf32").time_us(aten.mm.default, (a32, a32), {}, o32)
    assert t_bf16 < tf32 < t_fp32
    # elementwise: bytes halve
    e32 = h100.breakdown(aten.add.Tensor, (a32, a32), {}, o32)
    e16 = h100.breakdown(aten.add.Tensor, (a32, a32), {}, o32, dtype=torch.bfloat16)
    assert e16["bytes"] * 2 == e32["bytes"]
    # integer tensors keep their dtype
    idx = meta(4096, dtype=torch.int64)
    emb = h100.breakdown(aten.embedding.default, (meta(128256, 4096, dtype=torch.float32), idx), {},
                         meta(4096, 4096, dtype=torch.float32), dtype=torch.bfloat16)
    assert emb["bytes"] == 4096 * 8 + 2 * 4096 * 4096 * 2   # rows gathered, not the whole table


def test_flops_of_matmul_family_attention_and_conv(h100):
    b, m, k, n = 4, 256, 512, 128
    cases = [
        (aten.mm.default, (meta(m, k), meta(k, n)), meta(m, n), 2 * m * k * n),
        (aten.addmm.default, (meta(n), meta(m, k), meta(k, n)), meta(m, n), 2 * m * k * n),
        (aten.bmm.default, (meta(b, m, k), meta(b, k, n)), meta(b, m, n), 2 * b * m * k * n),
        (aten.baddbmm.default, (meta(b, m, n), meta(b, m, k), meta(b, k, n)), meta(b, m, n), 2 * b * m * k * n),
    ]
    for op, args, out, want in cases:
        assert h100.flops(op, args, {}, out) == want, op
    B, H, S, D = 2, 8, 1024, 64
    q = meta(B, H, S, D)
    fwd = aten._scaled_dot_product_flash_attention.default(q, q, q)
    assert h100.flops(aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, fwd) == 4 * B * H * S * S * D
    eff = aten._scaled_dot_product_efficient_attention.default(q, q, q, None, True)
    assert h100.flops(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True), {}, eff) == 4 * B * H * S * S * D
    bargs = (q, q, q, q, fwd[0], fwd[1], fwd[2], fwd[3], fwd[4], fwd[5], 0.0, False, fwd[6], fwd[7])
    grads = aten._scaled_dot_product_flash_attention_backward.default(*bargs)
    bwd = h100.flops(aten._scaled_dot_product_flash_attention_backward.default, bargs, {}, grads)
    assert bwd == pytest.approx(2.5 * 4 * B * H * S * S * D)   # 5 matmuls of the 2 in forward
    t_fwd = h100.time_us(aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, fwd)
    t_bwd = h100.time_us(aten._scaled_dot_product_flash_attention_backward.default, bargs, {}, grads)
    assert t_bwd > t_fwd > cm.device("h100").launch_floor_us
    # convolution: 2 * N * Cout * Hout * Wout * Cin * kh * kw
    x, w = meta(8, 64, 56, 56), meta(128, 64, 3, 3)
    out = meta(8, 128, 56, 56)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert h100.flops(aten.convolution.default, args, {}, out) == 2 * 8 * 128 * 56 * 56 * 64 * 9


def test_repeated_calls_are_priced_once(h100, monkeypatch):
    """The planner prices the same op call thousands of times: the second call is a cache hit
    (counted, not timed: wall-clock limits do not belong in unit tests on a shared machine)."""
    a, b, out = meta(4096, 1024, dtype=torch.float32), meta(1024, 4096, dtype=torch.float32), meta(4096, 4096, dtype=torch.float32)
    calls = []
    inner = h100._price
    monkeypatch.setattr(h100, "_price", lambda *args, **kw: calls.append(1) or inner(*args, **kw))
    first = h100.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16)
    for _ in range(100):
        assert h100.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.bfloat16) == first
    assert len(calls) == 1
    h100.time_us(aten.mm.default, (a, b), {}, out, dtype=torch.float32)  # another dtype: another key
    assert len(calls) == 2


def test_devices_rank_sensibly():
    x = meta(8192, 8192)
    ts = {d: cm.RooflineCompute(d).time_us(aten.mm.default, (x, x), {}, x) for d in ("a100", "h100", "b200", "cpu")}
    assert ts["b200"] < ts["h100"] < ts["a100"] < ts["cpu"]
    y = meta(8192, 8192)
    assert cm.RooflineCompute("h200").time_us(aten.add.Tensor, (y, y), {}, y) < \
        cm.RooflineCompute("h100").time_us(aten.add.Tensor, (y, y), {}, y)

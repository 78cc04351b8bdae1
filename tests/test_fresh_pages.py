"""Fresh host pages: outputs at or above glibc's mmap threshold pay their first touch on a CPU device
(ops and collectives alike), nothing below it, nothing on a GPU."""

import dataclasses

import pytest
import torch

import costmodels
from apmodel.core.options import PlanOptions
from apmodel.problem.pricing import build_cost_context
from costmodels.fresh_pages import FreshPageCollectives, output_bytes
from costmodels.hardware import CPU_FRESH_PAGES_GBPS, GLIBC_MMAP_THRESHOLD_MAX_BYTES

MIB = 2**20
LOG_SOFTMAX = torch.ops.aten._log_softmax.default


def _fault_us(nbytes: float) -> float:  # the first touch at the constant's rate, computed by hand
    return nbytes / (CPU_FRESH_PAGES_GBPS * 1e9) * 1e6


def test_spec_threshold():
    cpu = costmodels.device("cpu")
    assert cpu.fresh_pages_from_bytes == GLIBC_MMAP_THRESHOLD_MAX_BYTES == 32 * MIB
    assert cpu.fresh_pages_us(32 * MIB - 1) == 0.0
    assert cpu.fresh_pages_us(32 * MIB) == pytest.approx(_fault_us(32 * MIB))
    assert costmodels.device("h100").fresh_pages_us(1 << 34) == 0.0
    with pytest.raises(ValueError, match="fresh_pages_GBps"):
        dataclasses.replace(cpu, fresh_pages_GBps=0.0)


@pytest.mark.parametrize("rows, charged", [(512, False), (1024, True), (2048, True)])
def test_op_outputs_charged_above_threshold(rows, charged):
    cpu = costmodels.device("cpu")
    caching = dataclasses.replace(cpu, fresh_pages_from_bytes=None)  # the same host, no fresh pages
    x = torch.empty(rows, 8192, device="meta")  # fp32: 16, 32, 64 MiB
    args = (x, 1, False)
    extra = costmodels.compute_model(cpu).time_us(LOG_SOFTMAX, args, {}, x) - \
        costmodels.compute_model(caching).time_us(LOG_SOFTMAX, args, {}, x)
    assert extra == pytest.approx(_fault_us(x.numel() * 4) if charged else 0.0)


def test_measured_model_charges_too():
    h100 = costmodels.device("h100")
    host_like = dataclasses.replace(h100, fresh_pages_from_bytes=32 * MIB)
    x = torch.empty(1024, 8192, device="meta")
    args = (x, 1, False)
    plain = costmodels.compute_model(h100).time_us(LOG_SOFTMAX, args, {}, x)
    assert isinstance(costmodels.compute_model(h100), costmodels.MeasuredCompute)
    assert costmodels.compute_model(host_like, profile=costmodels.builtin_profile("h100")).time_us(
        LOG_SOFTMAX, args, {}, x) - plain == pytest.approx(_fault_us(32 * MIB))
    view = torch.ops.aten.view.default
    assert costmodels.compute_model(host_like, profile=costmodels.builtin_profile("h100")).time_us(
        view, (x, [8, 128, 8192]), {}, x.view(8, 128, 8192)) == 0.0  # a view allocates nothing


def test_collective_outputs():
    assert output_bytes("all_gather", 64 * MIB, 2) == 64 * MIB
    assert output_bytes("reduce_scatter", 64 * MIB, 2) == 32 * MIB
    assert output_bytes("all_reduce", 16 * MIB, 4) == 16 * MIB
    assert output_bytes("all_to_all", 16 * MIB, 4) == 64 * MIB  # DTensor's gather on a host mesh
    cpu = costmodels.device("cpu")
    base = costmodels.NCCLCollectives(costmodels.Topology((2, 1), cpu, 2))
    fresh = FreshPageCollectives(base, cpu, (2, 1))
    for kind, nbytes in [("all_gather", 64 * MIB), ("reduce_scatter", 64 * MIB), ("all_reduce", 8 * MIB)]:
        added = fresh.time_us(kind, nbytes, 0) - base.time_us(kind, nbytes, 0)
        out = output_bytes(kind, nbytes, 2)
        assert added == pytest.approx(_fault_us(out) if out >= 32 * MIB else 0.0)
    assert fresh.time_us("all_gather", 64 * MIB, 1) == 0.0  # one rank: no collective


def test_cost_context_wraps_host_devices_only():
    assert "FreshPageCollectives" in repr(build_cost_context((2,), PlanOptions(device="cpu")).comm)
    assert "FreshPageCollectives" not in repr(build_cost_context((2,), PlanOptions(device="h100")).comm)


def test_fp32_internal_op_charged_once():
    # log_softmax priced in bf16 runs in fp32 inside (the measured model's FP32_INTERNAL_OPS): its
    # bf16 output's fresh pages are charged once, at the priced dtype
    h100 = costmodels.device("h100")
    host_like = dataclasses.replace(h100, fresh_pages_from_bytes=16 * MIB)
    profile = costmodels.builtin_profile("h100")
    x = torch.empty(1024, 8192, device="meta", dtype=torch.bfloat16)  # 16 MiB in bf16
    args = (x, 1, False)
    plain = costmodels.compute_model(h100).time_us(LOG_SOFTMAX, args, {}, x, dtype=torch.bfloat16)
    fresh = costmodels.compute_model(host_like, profile=profile).time_us(LOG_SOFTMAX, args, {}, x,
                                                                          dtype=torch.bfloat16)
    assert fresh - plain == pytest.approx(_fault_us(16 * MIB))

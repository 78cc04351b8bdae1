"""The memory model (apmodel.problem.memory): per-device bytes of a plan, held to a real single-device run
(bytes autograd saves, counted by ``torch.autograd.graph.saved_tensors_hooks``), to the arithmetic
of sharded storage, and used as a constraint (a plan over the limit is re-solved under a memory
row, or refused with a named out-of-memory error)."""

from __future__ import annotations

import math

import pytest
import torch

import apmodel
from apmodel.graph.capture import capture
from apmodel.models import build, config, sample_inputs
from apmodel.problem.memory import OPTIMIZER_STATE_COPIES, MemoryModel, OutOfMemory

from _helpers import SavedStorages

CASES = [
    ("llama3-debug", dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=256, max_seq_len=64), 4, 64),
    ("gpt2", dict(n_layers=2, dim=64, n_heads=4, vocab_size=256, max_seq_len=64), 4, 64),
    ("moe-debug", dict(n_layers=2), 4, 32),
]
TINY = dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=128, max_seq_len=32)


def _saved_bytes_eager(model: torch.nn.Module, inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    saved = SavedStorages(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.note, lambda t: t):
        model(*inputs)
    return saved.total_bytes


@pytest.mark.parametrize("name,overrides,batch,seq", CASES, ids=[c[0] for c in CASES])
def test_saved_activations_match_a_real_run_within_10_percent(name, overrides, batch, seq):
    cfg = config(name, **overrides)
    with torch.device("meta"):
        meta = build(cfg)
    captured = capture(meta, sample_inputs(cfg, batch, seq, device="meta"))
    mm = MemoryModel(captured, {}, (1,), lambda dtype: dtype.itemsize)  # as traced (fp32), one device
    predicted = sum(mm.local_bytes(n, ("R",)) for n in mm.saved)
    torch.manual_seed(0)
    real = _saved_bytes_eager(build(cfg), sample_inputs(cfg, batch, seq, device="cpu"))
    assert abs(predicted - real) <= 0.10 * real, (predicted, real)


@pytest.mark.parametrize("name,overrides,batch,seq", CASES, ids=[c[0] for c in CASES])
def test_saved_activations_of_a_mixed_precision_step_match_a_real_bf16_run(name, overrides, batch, seq):
    """Mixed precision traces the step with bf16 parameters and inputs (the model's own fp32 casts
    become nodes); the saved bytes at traced dtypes match a real run of the model with bf16 weights."""
    from apmodel.lowering import capture_on_meta

    cfg = config(name, **overrides)
    with torch.device("meta"):
        meta = build(cfg)
    captured = capture_on_meta(meta, sample_inputs(cfg, batch, seq, device="meta"), None, param_dtype=torch.bfloat16)
    mm = MemoryModel(captured, {}, (1,), lambda dtype: dtype.itemsize)  # as traced, one device
    predicted = sum(mm.local_bytes(n, ("R",)) for n in mm.saved)
    torch.manual_seed(0)
    model = build(cfg).to(torch.bfloat16)
    for name_, b in build(cfg).named_buffers():  # buffers keep their dtype, as under FSDP2's policy
        model.get_buffer(name_).data = b
    real = _saved_bytes_eager(model, sample_inputs(cfg, batch, seq, device="cpu"))
    assert abs(predicted - real) <= 0.10 * real, (predicted, real)


@pytest.fixture(scope="module")
def tiny():
    cfg = config("llama3-debug", **TINY)
    with torch.device("meta"):
        model = build(cfg)
    return capture(model, sample_inputs(cfg, 8, 32, device="meta"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "none"])
def test_state_bytes_are_the_sharded_parameters(tiny, optimizer):
    plan = apmodel.plan(tiny, (4,), dtype="bf16", optimizer=optimizer)
    numel = sum(n.meta["val"].numel() for n in tiny.gm.graph.nodes if n.name in tiny.param_fqn)
    mem = plan.memory
    assert mem["params_bytes"] == numel * 4 // 4  # fp32 masters (bf16 mixed precision), sharded 4 ways
    assert mem["grads_bytes"] == mem["params_bytes"]
    assert mem["optimizer_bytes"] == OPTIMIZER_STATE_COPIES[optimizer] * mem["grads_bytes"]
    assert mem["hbm_bytes"] == 80 * 2**30  # h100
    linear = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"))
    assert linear < mem["peak_bytes"]
    again = apmodel.Plan.from_json(plan.to_json())
    assert again.memory == {k: (None if v is None else float(v)) for k, v in mem.items()}


def test_a_memory_limit_changes_the_plan_to_fit(tiny):
    free = apmodel.plan(tiny, (2, 2), param_policy="free", solver="highs", memory_limit_bytes=math.inf)
    tight = free.memory["peak_bytes"] * 0.8
    # TRW-S under the memory row (HiGHS's MILP reaches the same plan here in ~4x the time)
    fitted = apmodel.plan(tiny, (2, 2), param_policy="free", solver="trws", memory_limit_bytes=tight)
    assert fitted.memory["peak_bytes"] <= tight
    assert fitted.objective_us >= free.objective_us - 1e-6  # the limit can only cost time
    assert fitted.node_strategy != free.node_strategy


def test_no_plan_fits_is_a_named_out_of_memory_error(tiny):
    with pytest.raises(OutOfMemory, match=r"out of memory: no plan fits 0\.00 GB per device.*smallest any plan"):
        apmodel.plan(tiny, (2, 2), memory_limit_bytes=1000.0)


def test_mixed_precision_reduces_gradients_and_keeps_masters_in_fp32():
    """bf16 compute and gathers, fp32 gradient reductions and master state (FSDP2's policy)."""
    import costmodels

    cfg = config("llama3-debug", n_layers=1, dim=1024, n_heads=16, n_kv_heads=8, ffn_hidden_dim=4096, vocab_size=4096, max_seq_len=512)
    with torch.device("meta"):
        model = build(cfg)
    captured = capture(model, sample_inputs(cfg, 64, 512, device="meta"))
    roofline = costmodels.RooflineCompute(costmodels.device("h100"))
    off = apmodel.plan(captured, (8,), mixed_precision=False, compute_model=roofline)
    # the same plan priced under mixed precision: only the gradient reductions change
    same = apmodel.plan(captured, (8,), mixed_precision=True, compute_model=roofline, replay=off)
    assert same.node_strategy == off.node_strategy
    assert same.compute_us == pytest.approx(off.compute_us)
    assert same.comm_by_collective["all_gather@axis0"] == pytest.approx(off.comm_by_collective["all_gather@axis0"])
    # twice the bytes: a gradient reduction in a bucket costs its bytes' share of the bucket, which
    # doubles; latency outside buckets (a ~20 µs floor per collective) and the non-gradient
    # reduce-scatters do not
    rs_same, rs_off = same.comm_by_collective["reduce_scatter@axis0"], off.comm_by_collective["reduce_scatter@axis0"]
    assert 1.15 * rs_off < rs_same <= 2.0 * rs_off * (1 + 1e-9)
    assert same.memory["params_bytes"] == 2 * off.memory["params_bytes"]  # fp32 masters vs bf16
    assert same.memory["activations_bytes"] == off.memory["activations_bytes"]  # bf16 either way
    on = apmodel.plan(captured, (8,), mixed_precision=True, compute_model=roofline)
    assert off.objective_us < on.objective_us <= same.objective_us + 1e-6
    default = apmodel.plan(captured, (8,), compute_model=roofline)  # bf16 pricing: mixed precision on
    assert default.objective_us == pytest.approx(on.objective_us)


def test_compare_recipes_marks_what_does_not_fit():
    """`--compare-recipes` reports each recipe's peak memory and whether it fits the limit: with a
    limit between the found plan's peak and DDP's (parameters replicated), DDP is marked over."""
    import json

    from typer.testing import CliRunner

    from apmodel.cli import app

    args = ["plan", "--model", "llama3-debug", "--layers", "1", "--mesh", "2x2", "--seq", "64", "--batch", "8",
            "--compare-recipes", "--json"]
    first = json.loads(CliRunner().invoke(app, args).stdout)
    found, ddp = first["memory"]["peak_bytes"], first["recipes_detail"]["ddp"]["peak_bytes"]
    assert ddp > found > 0
    limit = (found + ddp) / 2
    res = CliRunner().invoke(app, [*args, "--memory-limit-bytes", f"{limit:.0f}"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["memory_limit_bytes"] == pytest.approx(limit)
    detail = data["recipes_detail"]
    assert detail["ddp"]["fits_memory"] is False
    for name, r in detail.items():
        if r["peak_bytes"] is not None:
            assert r["fits_memory"] == (r["peak_bytes"] <= float(f"{limit:.0f}")), name
    table = CliRunner().invoke(app, [a for a in args if a != "--json"] + ["--memory-limit-bytes", f"{limit:.0f}"])
    assert "(over)" in table.stdout

"""Lowering: the parallel module computes what the single-device model computes, and issues exactly
the collectives its plan predicts.

Multi-process checks run once, in 4 processes joined in a real gloo group (one spawn for all of them,
see ``tests/_dist_utils.py``): a shrunk LLaMA-3 (1 layer, dim 64, vocab 128, batch 4, seq 16) on a
1D mesh of 4 and a 2×2 mesh, for the plan the solver picks and for two forced plans (FSDP-like and
Megatron-style tensor parallel). The truth is the same model run eagerly in one process with the same
weights (``F.scaled_dot_product_attention`` path, plain autograd), and, for communication, the
collectives seen at dispatch (a TorchDispatchMode that records each functional collective with its
process group, hence its mesh axis), compared with the plan's redistributions priced into steps by
``costmodels.redistribution_steps``.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import apmodel
from apmodel.candidates.strategies import input_slots
from apmodel.core import placements as pl
from apmodel.core.options import PlanOptions
from apmodel.graph.capture import capture
from apmodel.lowering import (
    issued_redistributions,
    load_full_state_dict,
    lower,
    planned_redistributions,
)
from apmodel.models import build, config, sample_inputs
from apmodel.result.plans import Plan

from _dist_utils import CollectiveRecorder, gloo_view, predicted_collectives, run_distributed
from _helpers import full_weights

CFG = dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=128, max_seq_len=16)
BATCH, SEQ = 4, 12  # 48 tokens: no weight dimension equals batch x seq (recipes tell activations by it)
WORLD = 4
MESHES = {"1d": (4,), "2d": (2, 2)}
RECIPES = ("solver", "fsdp", "tp", "random")
SCENARIOS = [f"{m}-{r}" for m in MESHES for r in RECIPES]
TRAINED = [s for s in SCENARIOS if not s.endswith("random")]  # random plans: one step, not trained
TRAIN_STEPS = 5
LOSS_TOL = 1e-5  # fp32, absolute
GRAD_RTOL = 1e-4  # max |g - g_ref| / max |g_ref|, per parameter
TRAIN_RTOL = 1e-4  # relative, per step's loss

# Megatron-style column / row parallel linear weights (torch Linear weight is [out, in]).
_COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
_ROW = ("attention.wo", "feed_forward.w2")


class MLP(torch.nn.Module):
    """A model that returns a tensor (no loss function)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tiny(device: str = "meta") -> torch.nn.Module:
    with torch.device(device):
        return build("llama3-debug", **CFG)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) on CPU, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    return sample_inputs(config("llama3-debug", **CFG), BATCH, SEQ, device="cpu", generator=g)


def reference_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = tiny("cpu")
    m.init_weights()
    return full_weights(m)


# ------------------------------------------------------------------------------------------------
# forced plans (constraints on the placement model)


def _tp_storage(fqn: str) -> str:
    """Megatron-style placement of a parameter on a 1D tensor-parallel mesh."""
    if fqn == "tok_embeddings.weight":
        return "S(1)"
    if any(fqn.endswith(f"{c}.weight") for c in _COLUMN):
        return "S(0)"
    if any(fqn.endswith(f"{r}.weight") for r in _ROW):
        return "S(1)"
    return "R"


def tensor_parallel_1d(m) -> None:
    """Constraint: Megatron-style tensor parallelism on a 1D mesh (apmodel.reading.recipes' Megatron
    recipes need a data-parallel axis too): every parameter stored as Megatron does, and read by
    its consumers at its storage placement (weights never move)."""
    for node, fqn in m.captured.param_fqn.items():
        want = _tp_storage(fqn)
        m.fix(fqn, want, name=f"tp: {fqn} stored {want}")
        pnode = m.node_by_name[node]
        for user in pnode.users:
            if user.op != "call_function":
                continue
            for j, (prod, _) in enumerate(input_slots(user)):
                if prod is pnode:
                    m.fix(user.name, want, on=f"input:{j}", name=f"tp: {user.name} reads {fqn} as {want}")


def forced_plan(captured, recipe: str, mesh_shape: tuple[int, ...]) -> Plan:
    """FSDP (apmodel.reading.recipes "fsdp") or tensor parallel (apmodel.reading.recipes "megatron_tp": TP on the
    last axis + data parallel on the others; on a 1D mesh :func:`tensor_parallel_1d`)."""
    from apmodel.reading import recipes

    if recipe == "tp" and len(mesh_shape) == 1:
        # priced per collective: with bucketed gathers, gathering this tiny model's sharded weights
        # is cheaper than reducing its activations, and the plan would not be tensor parallel
        return apmodel.plan(captured, mesh_shape, device="h100", constraints=[tensor_parallel_1d],
                            param_policy="free", input_placements=["R", "R"], bucket_mb=0)
    r = recipes.get({"fsdp": "fsdp", "tp": "megatron_tp"}[recipe])
    return apmodel.plan(captured, mesh_shape, device="h100", constraints=r.constraints(mesh_shape),
                        param_policy=r.param_policy, replicate_axes=r.replicate_axes(mesh_shape))


def random_plan(captured, mesh_shape: tuple[int, ...], seed: int) -> Plan:
    """A feasible plan with (mostly) random strategies: the solver's problem with large random
    compute costs added, so every node takes some valid strategy and lowering must insert whatever
    redistributions that implies (hundreds, of every kind)."""
    import numpy as np

    import solvers
    from apmodel.entry.api import build_model

    pmodel = build_model(captured, mesh_shape, device="h100", param_policy="free")
    problem = pmodel.compile()
    rng = np.random.default_rng(seed)
    noisy = [np.where(np.isfinite(u), u + rng.uniform(0.0, 2000.0, size=u.shape), u) for u in problem.unary]
    problem = solvers.PairwiseProblem(unary=noisy, edges=list(problem.edges), constraints=list(problem.constraints),
                                      names=list(problem.names) if problem.names else None)
    sol = solvers.solve(problem, backend="trws")
    return Plan.from_assignment(pmodel, sol.assignment, solver={"backend": "trws", "note": "random costs"}, timings={},
                                workload=PlanOptions(device="h100", param_policy="free").to_record())


def make_plans(out_dir: Path) -> dict[str, Plan]:
    tokens, targets = batch()
    captured = capture(tiny(), (tokens.to("meta"), targets.to("meta")))
    plans = {}
    for mname, mesh_shape in MESHES.items():
        for recipe in RECIPES:
            if recipe == "solver":
                p = apmodel.plan(captured, mesh_shape, device="h100")
            elif recipe == "random":
                p = random_plan(captured, mesh_shape, seed=len(plans))
            else:
                p = forced_plan(captured, recipe, mesh_shape)
            name = f"{mname}-{recipe}"
            p.save(out_dir / f"{name}.json")
            plans[name] = p
    return plans


# ------------------------------------------------------------------------------------------------
# what the workers run


def _worker(rank: int, world: int, plan_dir: str, names: list[str]) -> dict[str, Any]:
    import time

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from apmodel.models.llama3 import Transformer

    tokens, targets = batch()
    full = reference_weights()
    captured = capture(tiny(), (tokens.to("meta"), targets.to("meta")))
    results: dict[str, Any] = {}
    # One mesh per shape: DTensor's sharding cache treats equal meshes as one, so a second mesh of
    # the same shape would see outputs on the first one's process groups (same ranks, other names).
    meshes = {m: dist.init_device_mesh("cpu", s) for m, s in MESHES.items()}
    for name in names:
        t0 = time.perf_counter()
        mesh_shape = MESHES[name.split("-")[0]]
        mesh = meshes[name.split("-")[0]]
        plan = Plan.load(Path(plan_dir) / f"{name}.json")
        r: dict[str, Any] = {}

        # reference: the same weights, one process, eager autograd
        ref = tiny("cpu")
        load_full_state_dict(ref, full)
        # parallel: built on meta, lowered (one collective per planned redistribution: the priced
        # program, compared below collective by collective), materialised, loaded
        model = lower(tiny("meta"), mesh, plan, captured, bucket_mb=None)
        model.to_empty(device="cpu")
        load_full_state_dict(model, full)
        r["isinstance"] = isinstance(model, Transformer)
        r["keys_equal"] = list(model.state_dict()) == list(ref.state_dict())
        r["placements_ok"] = all(
            isinstance(p, DTensor) and pl.tuple_to_str(p.placements) == pl.tuple_to_str(plan.param_placements[k])
            for k, p in model.named_parameters()
        )

        rec = CollectiveRecorder()
        with rec:
            loss = model(tokens, targets)
            loss.backward()
        issued = issued_redistributions(model)
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        r["loss"] = loss.full_tensor().item()
        r["ref_loss"] = ref_loss.item()
        errs = {}
        for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=False):
            g = p.grad.full_tensor()
            errs[k] = ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
        r["grad_rel_err"] = errs
        r["grad_placements_ok"] = all(
            pl.tuple_to_str(p.grad.placements) == pl.tuple_to_str(p.placements) for p in model.parameters()
        )

        # communication: issued vs planned redistributions; dispatched collectives vs predicted steps
        planned = planned_redistributions(plan, captured)
        r["issued_keys"] = sorted(map(repr, Counter(x.key for x in issued).items()))
        r["planned_keys"] = sorted(map(repr, Counter(x.key for x in planned).items()))
        axis_of = {mesh.get_group(a).group_name: a for a in range(len(mesh_shape))}
        r["dispatched"] = dict(Counter((k, axis_of.get(g, g)) for k, g, _dtype in rec.calls))
        r["predicted"] = dict(gloo_view(predicted_collectives(planned, mesh_shape, with_dtype=False)))
        r["plan_kinds"] = sorted({k for k, _ in predicted_collectives(planned, mesh_shape, with_dtype=False)})

        r["seconds"] = time.perf_counter() - t0
        if name not in TRAINED:
            results[name] = r
            continue
        # training: AdamW on DTensor parameters against AdamW on the reference
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt.step()  # the step-0 gradients from above
        ref_opt.step()
        losses, ref_losses = [], []
        for _ in range(TRAIN_STEPS - 1):
            opt.zero_grad()
            ref_opt.zero_grad()
            lp = model(tokens, targets)
            lp.backward()
            opt.step()
            lr_ = ref(tokens, targets)
            lr_.backward()
            ref_opt.step()
            losses.append(lp.full_tensor().item())
            ref_losses.append(lr_.item())
        r["train"] = (losses, ref_losses)
        r["seconds"] = time.perf_counter() - t0
        results[name] = r

    # apmodel.parallelize end to end on a model with real weights: plans on rank 0 (broadcast),
    # traces a meta twin of the model, lowers it in place (the weights are kept: local chunks)
    t0 = time.perf_counter()
    model = tiny("cpu")
    load_full_state_dict(model, full)
    par = apmodel.parallelize(model, meshes["2d"], (tokens, targets))
    loss = par(tokens, targets)
    loss.backward()
    ref = tiny("cpu")
    load_full_state_dict(ref, full)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    results["parallelize"] = {
        "loss": loss.full_tensor().item(),
        "ref_loss": ref_loss.item(),
        "grad_rel_err": {
            k: ((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
            for (k, p), (_, q) in zip(par.named_parameters(), ref.named_parameters(), strict=False)
        },
        "plan": par._apmodel_program.plan.to_json()["node_strategy"],
        "seconds": time.perf_counter() - t0,
    }

    # a model without loss_fn (the output is what is differentiated) and an input that needs grad
    t0 = time.perf_counter()
    torch.manual_seed(0)
    ref_mlp = MLP()
    x = torch.randn(8, 16, requires_grad=True)
    par_mlp = apmodel.parallelize(copy.deepcopy(ref_mlp), meshes["1d"], (x,))
    out = par_mlp(x)
    (out.full_tensor() ** 2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (ref_mlp(x_ref) ** 2).sum().backward()
    results["no_loss"] = {
        "loss": out.full_tensor().sum().item(),
        "out_err": (out.full_tensor() - ref_mlp(x_ref)).abs().max().item(),
        "grad_err": max((p.grad.full_tensor() - q.grad).abs().max().item()
                        for p, q in zip(par_mlp.parameters(), ref_mlp.parameters(), strict=False)),
        "input_grad_err": (x.grad - x_ref.grad).abs().max().item(),
        "seconds": time.perf_counter() - t0,
    }

    # the FSDP2-style flow: meta model -> parallelize(plan=) -> to_empty -> the model's own init
    t0 = time.perf_counter()
    par = apmodel.parallelize(tiny("meta"), meshes["1d"], (tokens, targets), plan=Plan.load(Path(plan_dir) / "1d-solver.json"))
    par.to_empty(device="cpu")
    torch.manual_seed(0)
    par.init_weights()
    ref = tiny("cpu")
    ref.init_weights()
    loss = par(tokens, targets)
    loss.backward()
    results["init_weights"] = {
        "loss": loss.full_tensor().item(),
        "buffers_equal": all(torch.equal(par.get_buffer(k), b) for k, b in ref.named_buffers()),
        "std_ratio": (par.output.weight.full_tensor().std() / ref.output.weight.std()).item(),
        "seconds": time.perf_counter() - t0,
    }
    return results


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple[Path, dict[str, Plan]]:
    d = tmp_path_factory.mktemp("plans")
    return d, make_plans(d)


@pytest.fixture(scope="module")
def dist_results(plans) -> dict[str, Any]:
    plan_dir, _ = plans
    per_rank = run_distributed(_worker, WORLD, str(plan_dir), SCENARIOS, timeout_s=300)
    # every rank must see the same numbers (they print the same global values)
    for r in per_rank[1:]:
        for name in SCENARIOS + ["parallelize", "init_weights", "no_loss"]:
            assert r[name]["loss"] == per_rank[0][name]["loss"], name
    assert all(r["parallelize"]["plan"] == per_rank[0]["parallelize"]["plan"] for r in per_rank)
    for name, r in per_rank[0].items():
        logging.getLogger(__name__).info("%s: %.1f s in the workers", name, r["seconds"])
    return per_rank[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_parallel_module_matches_single_device(dist_results, name):
    r = dist_results[name]
    assert r["isinstance"] and r["keys_equal"] and r["placements_ok"]
    assert abs(r["loss"] - r["ref_loss"]) <= LOSS_TOL, (r["loss"], r["ref_loss"])
    bad = {k: e for k, e in r["grad_rel_err"].items() if not e <= GRAD_RTOL}
    assert not bad, bad
    assert r["grad_placements_ok"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_training_steps_track_single_device(dist_results, name):
    losses, ref_losses = dist_results[name]["train"]
    assert len(losses) == TRAIN_STEPS - 1
    for a, b in zip(losses, ref_losses, strict=False):
        assert abs(a - b) <= TRAIN_RTOL * abs(b), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_collectives_match_plan(dist_results, name):
    r = dist_results[name]
    assert r["issued_keys"] == r["planned_keys"]
    assert r["dispatched"] == r["predicted"], (r["dispatched"], r["predicted"])


@pytest.mark.slow
def test_parallelize_end_to_end(dist_results):
    r = dist_results["parallelize"]
    assert abs(r["loss"] - r["ref_loss"]) <= LOSS_TOL
    bad = {k: e for k, e in r["grad_rel_err"].items() if not e <= GRAD_RTOL}
    assert not bad, bad


@pytest.mark.slow
def test_meta_model_initialised_after_lowering(dist_results):
    """to_empty + the model's own init_weights on the DTensor module (values differ from a
    single-device init: DTensor draws random numbers per shard), then a step runs."""
    r = dist_results["init_weights"]
    assert math.isfinite(r["loss"]) and r["buffers_equal"]
    assert 0.8 < r["std_ratio"] < 1.2


@pytest.mark.slow
def test_model_without_loss_fn_and_input_gradient(dist_results):
    r = dist_results["no_loss"]
    assert r["out_err"] <= 1e-5 and r["grad_err"] <= 1e-4 and r["input_grad_err"] <= 1e-5, r


@pytest.mark.slow
def test_all_collective_kinds_exercised(dist_results):
    kinds = set()
    for name in SCENARIOS:
        kinds |= set(dist_results[name]["plan_kinds"])
    assert {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"} <= kinds, kinds


def test_forced_plans_are_what_they_say(plans):
    _, ps = plans
    for mname, mesh_shape in MESHES.items():
        D = len(mesh_shape)
        fsdp, tp = ps[f"{mname}-fsdp"], ps[f"{mname}-tp"]
        assert all(pl.to_str(x).startswith("S") for p in fsdp.param_placements.values() for x in p)
        assert pl.tuple_to_str(tp.param_placements["layers.0.attention.wo.weight"]) == "R" * (D - 1) + "S(1)"
        assert any(k.startswith("all_gather") for k in fsdp.comm_by_collective)
        assert any(k.startswith("reduce_scatter") for k in fsdp.comm_by_collective)
        assert any(k.startswith("all_reduce") for k in tp.comm_by_collective)


# ------------------------------------------------------------------------------------------------
# single-process checks (fake process group: nothing runs that would communicate)


def _fake_mesh(shape):
    from apmodel._torch_private import fake_mesh

    return fake_mesh(shape)


@pytest.fixture(scope="module")
def captured():
    tokens, targets = batch()
    return capture(tiny(), (tokens.to("meta"), targets.to("meta")))


def test_planned_redistributions_price_to_the_plans_comm_cost(plans, captured):
    """Lowering reads the same redistributions off a plan as the planner priced."""
    from apmodel.problem.pricing import build_cost_context

    _, ps = plans
    for name, plan in ps.items():
        cost = build_cost_context(plan.mesh_shape, PlanOptions.from_record(plan.workload), captured)
        planned = planned_redistributions(plan, captured)
        us = sum(s[3] for r in planned
                 for s in cost.redistribution_steps(r.global_shape, r.dtype, r.src, r.dst, gradient=r.gradient,
                                                    bucketed=r.bucketed))
        assert us == pytest.approx(plan.comm_us, rel=1e-9, abs=1e-9), name


def test_lowered_module_keeps_class_hierarchy_and_keys(plans, captured):
    from torch.distributed.tensor import DTensor

    from apmodel.models.llama3 import Transformer

    _, ps = plans
    plan = ps["1d-solver"]
    model = tiny("meta")
    keys = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    par = lower(model, _fake_mesh((4,)), plan, captured)
    assert par is model and isinstance(par, Transformer) and type(par) is not Transformer
    assert list(par.state_dict()) == keys
    assert [n for n, _ in par.named_modules()] == modules
    for fqn, p in par.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "meta"
        assert pl.tuple_to_str(p.placements) == pl.tuple_to_str(plan.param_placements[fqn])
        assert tuple(p.to_local().shape) == pl.local_shape(tuple(p.shape), p.placements, (4,))
    par.to_empty(device="cpu")
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in par.parameters())
    with pytest.raises(ValueError, match="already been parallelized"):
        lower(par, _fake_mesh((4,)), plan, captured)


def test_lowering_refuses_wrong_mesh_fingerprint_and_uneven_shards(plans, captured):
    _, ps = plans
    plan = ps["1d-solver"]
    with pytest.raises(ValueError, match=r"mesh shape \(2, 2\) differs from the plan's mesh shape \(4,\)"):
        lower(tiny(), _fake_mesh((2, 2)), plan, captured)
    tokens, targets = batch()
    other = capture(tiny(), (tokens[:, :8].to("meta"), targets[:, :8].to("meta")))
    with pytest.raises(ValueError, match="does not match the plan"):
        lower(tiny(), _fake_mesh((4,)), plan, other)
    # a plan that shards some tensor dimension unevenly (size not divisible by 4)
    bad = copy.copy(plan)
    bad.node_strategy = dict(plan.node_strategy)
    from torch.distributed.tensor import Shard

    for n in captured.gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and isinstance(v, torch.Tensor) and any(s % 4 for s in v.shape):
            d = next(i for i, s in enumerate(v.shape) if s % 4)
            old = bad.node_strategy[n.name]
            bad.node_strategy[n.name] = type(old)(outputs=((Shard(d),),), inputs=old.inputs)
            break
    else:
        pytest.fail("the test graph has no tensor that 4 does not divide: pick another size")
    with pytest.raises(ValueError, match="uneven"):
        lower(tiny(), _fake_mesh((4,)), bad, captured)


def test_call_time_inputs_are_checked(plans, captured):
    _, ps = plans
    par = lower(tiny(), _fake_mesh((4,)), ps["1d-solver"], captured)
    tokens, targets = batch()
    with pytest.raises(ValueError, match=r"cannot be traced at input shapes args\[0\] \(4, 8\), args\[1\] \(4, 12\)"):
        par(tokens[:, :8], targets)  # a shorter sequence for the tokens only: the model's loss refuses it
    with pytest.raises(ValueError, match="dtype torch.int32"):
        par(tokens, targets.int())
    with pytest.raises(ValueError, match=r"takes 2 model argument\(s\) positionally, as traced; got 1"):
        par(tokens)

"""Planner core: capture → strategies → clustering → PlacementModel → Plan, checked against exact
solvers, brute-force pricing and the structure the paper predicts (FSDP on a 1D mesh)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import apmodel
import solvers
from apmodel.core import placements as pl
from apmodel.entry.api import build_model, solve_model
from apmodel.graph.capture import capture
from apmodel.models import build, sample_inputs
from apmodel.result.plans import Plan, PlanMismatch


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.scale = nn.Parameter(torch.ones(2))  # smaller than the mesh degree: must stay replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        return (y * y).mean() * self.scale.sum()


def mlp_graph(batch: int = 32, dim: int = 64):
    with torch.device("meta"):
        model = MLP(dim)
        x = torch.randn(batch, dim)
    return capture(model, (x,))


@pytest.fixture(scope="module")
def mlp_captured():
    return mlp_graph()


@pytest.fixture(scope="module")
def llama_captured():
    with torch.device("meta"):
        model = build("llama3-debug")
    return capture(model, sample_inputs("llama3-debug", batch=8, seq=64))


def _plan(captured, mesh, solver="highs", **kw):
    timings = {}
    pm = build_model(captured, mesh, timings=timings, **kw)
    return solve_model(pm, solver=solver, timings=timings)


# ----------------------------------------------------------------------------------- backends agree
@pytest.mark.parametrize("graph", ["mlp_captured", "llama_captured"])
@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_backends_agree(graph, mesh, request):
    """On a one-layer MLP and on llama3-debug every backend reaches HiGHS' optimum: the exact ones
    and TRW-S (polished to a certified 0.1% gap) within 0.1%, pgmpy's MPLP (approximate, no
    certificate) within 1% (brute force too, where the problem is small enough to enumerate)."""
    pm = build_model(request.getfixturevalue(graph), mesh)
    problem = pm.compile()
    exact = solvers.solve(problem, backend="highs")
    assert exact.status == "optimal"
    small = np.log(problem.n_states.astype(float)).sum() <= np.log(2e5)  # brute force can enumerate it (no overflow)
    backends = [n for n in solvers.BUILTIN_BACKENDS if n in solvers.available() and n != "highs" and (small or n != "brute")]
    for backend in backends:
        sol = solvers.solve(problem, backend=backend)
        assert sol.energy >= exact.energy - 1e-6 * max(1.0, abs(exact.energy)), backend
        caps = solvers.BUILTIN_BACKENDS[backend].capabilities
        assert sol.energy <= exact.energy * (1.001 if caps.exact or caps.lower_bound else 1.01), backend


def test_objective_equals_independent_pricing(llama_captured):
    """The solver's energy (compiled, clustered problem) equals the plan priced node by node
    (the serial price: with overlap the objective is the step, tests/test_overlap.py)."""
    plan = _plan(llama_captured, (2, 2), solver="highs", overlap=False)
    assert plan.objective_us == pytest.approx(plan.solver["energy_us"], rel=1e-9)
    assert plan.objective_us == pytest.approx(plan.compute_us + plan.comm_us, rel=1e-12)
    assert sum(plan.comm_by_collective.values()) == pytest.approx(plan.comm_us, rel=1e-9)
    layers = plan.per_layer
    assert sum(v["compute_us"] + v["comm_us"] for v in layers.values()) == pytest.approx(plan.objective_us, rel=1e-9)


def test_clustering_shares_layers_and_matches_unclustered(llama_captured):
    """Clustered variables are fewer; the clustered optimum is a feasible point of the unclustered
    problem, so it can be no better than it (and on this model it is just as good)."""
    mesh = (4,)
    pm_c = build_model(llama_captured, mesh)
    pm_u = build_model(llama_captured, mesh, merge_copies=False)
    assert pm_c.summary()["groups"] < pm_u.summary()["groups"]
    assert pm_u.summary()["groups"] == pm_u.summary()["nodes"]
    e_c = solvers.solve(pm_c.compile(), backend="highs").energy
    e_u = solvers.solve(pm_u.compile(), backend="highs").energy
    assert e_c >= e_u * (1 - 1e-9)
    assert e_c <= e_u * 1.001


# ----------------------------------------------------------------------------------- emerging structure
def test_fsdp_emerges_on_1d_mesh():
    """With activations much larger than weights (batch 256 × seq 256 × dim 256 vs 256×768
    weights), gathering weights beats any activation resharding: FSDP. (At batch 64 it does not:
    each collective pays a measured floor of ~20 µs, and gathering one layer's activations once
    costs less than gathering its seven small weights one by one.)"""
    with torch.device("meta"):
        model = build("llama3-debug")
    llama_captured = capture(model, sample_inputs("llama3-debug", batch=256, seq=256))
    plan = _plan(llama_captured, (4,))
    for fqn, p in plan.param_placements.items():
        assert pl.to_str(p[0]).startswith("S"), f"{fqn} is not sharded: {pl.tuple_to_str(p)}"
    cap = plan.captured
    tokens = [n for n, i in cap.input_index.items() if i == 0][0]
    assert pl.tuple_to_str(plan.node_strategy[tokens].outputs[0]) == "S(0)"
    # The batch stays sharded: every matmul's activation input is sharded on the batch dim.
    for name, node in plan.model.node_by_name.items():
        if node.target == torch.ops.aten.mm.default and not cap.is_backward.get(name, False):
            s = plan.node_strategy[name]
            assert pl.tuple_to_str(s.inputs[0]) == "S(0)", (name, str(s))
    assert plan.comm_by_collective.get("all_gather@axis0", 0) > 0  # weights are gathered (FSDP)


def test_2d_mesh_weights_sharded_on_both_axes(llama_captured):
    plan = _plan(llama_captured, (2, 2))
    for fqn, p in plan.param_placements.items():
        if fqn.endswith("weight") and ("attention.w" in fqn or "feed_forward" in fqn):
            assert all(pl.to_str(x).startswith("S") for x in p), f"{fqn}: {pl.tuple_to_str(p)}"


def test_small_parameter_stays_replicated(mlp_captured):
    plan = _plan(mlp_captured, (4,))
    assert pl.tuple_to_str(plan.param_placements["scale"]) == "R"
    assert pl.tuple_to_str(plan.param_placements["up.weight"]).startswith("S")


# ----------------------------------------------------------------------------------- constraints
def test_megatron_fix_costs_at_least_free_optimum(llama_captured):
    free = _plan(llama_captured, (2, 2))
    fixed = _plan(llama_captured, (2, 2), constraints=[apmodel.fix("layers.*.attention.wo.weight", "S(1)S(1)")])
    assert all(pl.tuple_to_str(p) == "S(1)S(1)" for f, p in fixed.param_placements.items() if f.endswith("attention.wo.weight"))
    assert fixed.objective_us >= free.objective_us * (1 - 1e-9)


def test_contradictory_constraints_are_named(llama_captured):
    with pytest.raises(apmodel.ConstraintConflict) as err:
        build_model(
            llama_captured, (4,),
            constraints=[apmodel.fix("layers.0.attention.wq.weight", "S(0)", name="col"),
                         apmodel.forbid("layers.0.attention.wq.weight", "S(0)", name="no-col")],
        )
    assert "col" in str(err.value) and "no-col" in str(err.value)


def test_unknown_pattern_and_bad_placement_are_clear(mlp_captured):
    with pytest.raises(KeyError, match="nothing_here"):
        build_model(mlp_captured, (4,), constraints=[apmodel.fix("nothing_here.*", "S(0)")])
    with pytest.raises(ValueError, match="Q\\(0\\)"):
        build_model(mlp_captured, (4,), constraints=[apmodel.fix("up.weight", "Q(0)")])


def test_infeasible_linear_constraint_names_it(mlp_captured):
    c = apmodel.linear("at-least-two-replicas", [("up.weight", "R", 1.0)], ">=", 2.0)
    pm = build_model(mlp_captured, (4,), param_policy="free", constraints=[c])
    with pytest.raises(solvers.Infeasible, match="at-least-two-replicas"):
        solvers.solve(pm.compile(), backend="highs")


def test_parameter_memory_budget(mlp_captured):
    """A budget row instead of the full-shard policy: tighter budgets never get cheaper."""
    loose = _plan(mlp_captured, (4,), param_memory_fraction=1.0)
    tight = _plan(mlp_captured, (4,), param_memory_fraction=0.3)
    assert tight.objective_us >= loose.objective_us * (1 - 1e-9)
    pm = tight.model
    used = 0.0
    total = 0.0
    for node, fqn in pm.captured.param_fqn.items():
        numel = pm.node_by_name[node].meta["val"].numel()
        factor = math.prod(pm.mesh_shape[a] for a, p in enumerate(tight.param_placements[fqn]) if pl.to_str(p).startswith("S"))
        used += numel / factor
        total += numel
    assert used <= 0.3 * total + 1e-6


# ----------------------------------------------------------------------------------- plan files
def test_save_load_replay_roundtrip(llama_captured, tmp_path):
    plan = _plan(llama_captured, (2, 2), solver="trws")
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["mesh_shape"] == [2, 2]
    loaded = Plan.load(path)
    assert loaded.node_strategy == plan.node_strategy
    assert loaded.param_placements == plan.param_placements
    replayed = _plan(llama_captured, (2, 2), solver="highs", constraints=[apmodel.replay_constraints(path)])
    assert replayed.node_strategy == plan.node_strategy
    assert replayed.objective_us == pytest.approx(plan.objective_us, rel=1e-9)
    assert apmodel.diff(plan, replayed) == []


def test_plan_refused_on_other_mesh_or_model(llama_captured, mlp_captured, tmp_path):
    plan = _plan(llama_captured, (4,))
    with pytest.raises(PlanMismatch, match="mesh"):
        plan.check_compatible(llama_captured, (2, 2))
    with pytest.raises(PlanMismatch, match="fingerprint"):
        plan.check_compatible(mlp_captured, (4,))
    with pytest.raises(PlanMismatch):
        _plan(mlp_captured, (4,), constraints=[apmodel.replay_constraints(plan)])


def test_malformed_plan_file_names_field(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "apmodel-plan", "version": 1, "mesh_shape": "four"}))
    with pytest.raises(ValueError, match="missing field"):
        Plan.load(p)
    p.write_text(json.dumps({"format": "apmodel-plan", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        Plan.load(p)


def test_explain_chosen_is_locally_optimal(llama_captured):
    """Explain prices each candidate against the rest of the plan; for a node that forms its own
    group, an exact optimum cannot be improved by moving that node alone."""
    plan = _plan(llama_captured, (4,))
    grouping = plan.model.compiled.grouping
    fqn = "output.weight"
    node = plan.model.fqn_to_node[fqn]
    assert len(grouping.groups[grouping.group_of[node]]) == 1
    rows = plan.explain(fqn)
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1
    allowed = [r for r in rows if r["allowed"]]
    assert chosen[0]["total_us"] <= min(r["total_us"] for r in allowed) + 1e-6
    with pytest.raises(KeyError, match="nope"):
        plan.explain("nope")

"""Expert recipes as constraints: each forced plan has the placements the recipe prescribes, its
price follows from the collective model, and the searched plan is never worse than a recipe its
space contains."""

from __future__ import annotations

import math

import pytest
import torch

import costmodels
from apmodel import _torch_private as tp
from apmodel.candidates.strategies import enumerate_strategies
from apmodel.core import placements as pl
from apmodel.entry.api import cost_context, placement_model, solve_model
from apmodel.graph.capture import capture
from apmodel.models import build, sample_inputs
from apmodel.reading import recipes as R

SOLVER = "trws"
REGION_RECIPES = {"fsdp_ep": "routed_experts_top2", "fsdp_tp_ep": "routed_experts_top2", "fsdp_tp_cp": "attention_flash"}


@pytest.fixture(scope="module")
def captured():
    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    return capture(model, sample_inputs("llama3-debug", batch=8, seq=64))


@pytest.fixture(scope="module")
def setup_2x2(captured):
    mesh = (2, 2)
    return enumerate_strategies(captured.gm, mesh), cost_context(mesh)


def _run(name, captured, setup):
    strategies, cost = setup
    return R.run(R.get(name), captured, strategies, cost, solver=SOLVER)


@pytest.fixture(scope="module")
def results_2x2(captured, setup_2x2):
    """Every recipe solved once on the 2x2 mesh."""
    return {r.name: _run(r.name, captured, setup_2x2) for r in R.RECIPES}


def _s(plan, fqn):
    return pl.tuple_to_str(plan.param_placements[fqn])


def _uses(plan, fqn):
    """Placement strings of the forward ops' input that reads ``fqn``."""
    from apmodel.reading.roles import param_uses

    return {"".join(u[1]) for u in param_uses(plan.model, plan.node_strategy, fqn)}


def test_ddp_replicates_every_parameter_and_uses_it_replicated(captured, results_2x2):
    r = results_2x2["ddp"]
    assert r.status == "ok"
    for fqn in r.plan.param_placements:
        assert _s(r.plan, fqn) == "RR"
        assert _uses(r.plan, fqn) <= {"RR"}
    # all bytes of every parameter on every device (bf16)
    total = sum(math.prod(captured.gm.graph.find_nodes(op="placeholder", target=n)[0].meta["val"].shape)
                for n in captured.param_fqn) * 2
    assert r.param_bytes == pytest.approx(total)


def test_fsdp_shards_storage_and_gathers_for_use(captured, results_2x2):
    r = results_2x2["fsdp"]
    assert r.status == "ok"
    for fqn in r.plan.param_placements:
        assert "R" not in _s(r.plan, fqn), fqn  # fully sharded on both axes
        assert _uses(r.plan, fqn) <= {"RR"}, fqn


@pytest.mark.parametrize("name,norm_out", [("megatron_tp", "R"), ("megatron_tp_sp", "S(1)")])
def test_megatron_column_row_and_norm_outputs(captured, results_2x2, name, norm_out):
    r = results_2x2[name]
    assert r.status == "ok", r.reason
    p = r.plan
    for w in ("wq", "wk", "wv"):
        assert _s(p, f"layers.0.attention.{w}.weight") == "RS(0)"
        assert _uses(p, f"layers.0.attention.{w}.weight") == {"RS(0)"}
    for w in ("w1", "w3"):
        assert _s(p, f"layers.0.feed_forward.{w}.weight") == "RS(0)"
    assert _s(p, "layers.0.attention.wo.weight") == "RS(1)"
    assert _s(p, "layers.0.feed_forward.w2.weight") == "RS(1)"
    assert _s(p, "layers.0.attention_norm.weight") == "RR"
    # the forward op applying the norm weight produces the norm output
    pm = p.model
    node = pm.fqn_to_node["layers.0.ffn_norm.weight"]
    outs = [pl.to_str(p.node_strategy[u.name].outputs[0][1]) for u in pm.node_by_name[node].users
            if not captured.is_backward.get(u.name, False)]
    assert outs and set(outs) == {norm_out}


def test_fsdp_tp_shards_data_axis_and_keeps_tp_layout(captured, results_2x2):
    r = results_2x2["fsdp_tp"]
    assert r.status == "ok", r.reason
    wq = _s(r.plan, "layers.0.attention.wq.weight")
    assert wq.endswith("S(0)") and not wq.startswith("R")
    assert _uses(r.plan, "layers.0.attention.wq.weight") == {"RS(0)"}


def _nll_mean_is_partial() -> bool:
    """Whether this torch's rule takes a mean nll loss of batch-sharded inputs as a partial mean."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    x, t = torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    cands = ((Shard(0),), (Replicate(),))
    args = (tp.TensorArg((4, 8), (8, 1), torch.float32, cands), tp.TensorArg((4,), (1,), torch.long, cands), None, 1, -100)
    out = torch.ops.aten.nll_loss_forward.default(x, t, None, 1, -100)
    got = tp.op_strategies(torch.ops.aten.nll_loss_forward.default, args, {}, out, tp.fake_mesh((2,)))
    return any(o[0] is not None and isinstance(o[0][0], Partial) for o, _ in got)


def test_tp_recipes_do_not_apply_to_a_1d_mesh(captured):
    mesh = (4,)
    setup = (enumerate_strategies(captured.gm, mesh), cost_context(mesh))
    for name in ("megatron_tp", "megatron_tp_sp", "fsdp_tp", "hsdp"):
        r = _run(name, captured, setup)
        assert r.status == "n/a" and "axes" in r.reason
    # DDP on one axis: activations are batch-sharded, so weight gradients are partial sums. Pure
    # DDP reduces them with all-reduces merged into 25 MiB buckets in order (fp32 gradients under
    # mixed precision; priced here by the collective model directly, bucket by bucket); the
    # recipe's plan may only be cheaper (e.g. gathering a small activation gradient instead of
    # reducing a large embedding gradient), and most of its traffic is gradient all-reduce.
    r = _run("ddp", captured, setup)
    comm = costmodels.NCCLCollectives(costmodels.Topology(mesh, costmodels.device("h100"), 8))
    shapes = [captured.gm.graph.find_nodes(op="placeholder", target=n)[0].meta["val"].shape for n in captured.param_fqn]
    buckets = [0]
    for nbytes in (math.prod(s) * 4 for s in shapes):
        if buckets[-1] and buckets[-1] + nbytes > 25 * 2**20:
            buckets.append(0)
        buckets[-1] += nbytes
    pure_ddp = sum(comm.time_us("all_reduce", b, 0) for b in buckets)
    loss = 4 * comm.time_us("all_reduce", 4, 0)
    got = r.plan.comm_by_collective
    assert set(got) <= {"all_reduce@axis0", "all_gather@axis0"}
    # torch 2.14 on: nll_loss_forward's rule has no partial mean, so the batch-sharded
    # log-probabilities are gathered for the loss (an all-gather that pure DDP lacks)
    gather = 0.0 if _nll_mean_is_partial() else got.get("all_gather@axis0", 0.0)
    assert r.plan.comm_us <= pure_ddp + loss + gather
    assert got["all_reduce@axis0"] >= 0.5 * pure_ddp


def test_found_plan_is_never_worse_than_a_recipe_in_its_space(captured, setup_2x2, results_2x2):
    strategies, cost = setup_2x2
    found = solve_model(placement_model(captured, strategies, cost), solver=SOLVER)
    free = solve_model(placement_model(captured, strategies, cost, param_policy="free"), solver=SOLVER)
    for recipe in R.RECIPES:
        r = results_2x2[recipe.name]
        if recipe.name in REGION_RECIPES:  # need an expert or attention region this model lacks
            assert r.status == "n/a" and "local_map region" in r.reason, (recipe.name, r.reason)
            assert not recipe.applies_to(captured)  # so compare_recipes leaves them out
            continue
        assert r.status == "ok", (recipe.name, r.reason)
        assert free.objective_us <= r.objective_us * (1 + 1e-6), recipe.name
        if R.within_default_space(recipe):
            assert found.objective_us <= r.objective_us * (1 + 1e-6), recipe.name


def test_infeasible_recipe_is_reported(captured, setup_2x2):
    # a recipe demanding an impossible storage (a partial parameter) is infeasible, not an error
    bad = R.Recipe("bad", "impossible", "free", lambda mesh: [R.ParamRule(("*",), storage={0: "P"}, label="bad")])
    strategies, cost = setup_2x2
    r = R.run(bad, captured, strategies, cost, solver=SOLVER)
    assert r.status == "infeasible" and "bad" in r.reason


def test_emerged_roles_read_back_the_recipes(results_2x2):
    """The CLI's reading of a plan names the parallelism each recipe prescribes."""
    from apmodel.reading.roles import emerged

    fsdp = emerged(results_2x2["fsdp"].plan)
    assert all("FSDP" in fsdp[a] and "tensor parallel" not in fsdp[a] for a in ("axis0", "axis1"))
    assert all("data parallel" in fsdp[a] for a in ("axis0", "axis1"))
    sp = emerged(results_2x2["megatron_tp_sp"].plan)
    assert "tensor parallel" in sp["axis1"] and "sequence parallel" in sp["axis1"]
    assert "data parallel" in sp["axis0"] and "tensor parallel" not in sp["axis0"]
    tp = emerged(results_2x2["megatron_tp"].plan)
    assert "tensor parallel" in tp["axis1"] and "sequence parallel" not in tp["axis1"]
    ddp = emerged(results_2x2["ddp"].plan)
    assert all("weights replicated" in ddp[a] and "FSDP" not in ddp[a] for a in ("axis0", "axis1"))


# ------------------------------------------------------------------------------ GPT-2 (other names)
@pytest.fixture(scope="module")
def gpt2_2x2():
    """GPT-2 small's shapes (one layer): fused qkv with biases, LayerNorm with biases, a vocabulary of
    50257 that does not split over 2 ranks. Every recipe priced on a 2x2 mesh, plus the found plans
    of the default and the free-storage policies."""
    with torch.device("meta"):
        model = build("gpt2", n_layers=1)
    cap = capture(model, sample_inputs("gpt2", batch=8, seq=64))
    mesh = (2, 2)
    strategies, cost = enumerate_strategies(cap.gm, mesh), cost_context(mesh)
    results = {r.name: R.run(r, cap, strategies, cost, solver=SOLVER) for r in R.RECIPES}
    found = solve_model(placement_model(cap, strategies, cost), solver=SOLVER)
    free = solve_model(placement_model(cap, strategies, cost, param_policy="free"), solver=SOLVER)
    return cap, results, found, free


def test_gpt2_tensor_parallel_recipes_are_priced(gpt2_2x2):
    _, results, _, _ = gpt2_2x2
    for name in ("megatron_tp", "megatron_tp_sp", "fsdp_tp"):
        r = results[name]
        assert r.status == "ok", (name, r.reason)
        assert math.isfinite(r.objective_us) and r.objective_us > 0
        # the vocabulary (50257) does not split over the 2 tensor-parallel ranks: kept whole, and said so
        assert any(n.startswith("output.weight") and "does not divide by 2" in n for n in r.notes), r.notes
        assert any(n.startswith("tok_embeddings.weight") for n in r.notes), r.notes
    p = results["megatron_tp"].plan
    for fqn, want in {"layers.0.attention.wqkv.weight": "RS(0)", "layers.0.attention.wqkv.bias": "RS(0)",
                      "layers.0.attention.wo.weight": "RS(1)", "layers.0.attention.wo.bias": "RR",
                      "layers.0.mlp.fc.weight": "RS(0)", "layers.0.mlp.fc.bias": "RS(0)",
                      "layers.0.mlp.proj.weight": "RS(1)", "layers.0.mlp.proj.bias": "RR",
                      "layers.0.attention_norm.weight": "RR", "layers.0.ffn_norm.bias": "RR",
                      "output.weight": "RR", "tok_embeddings.weight": "RR"}.items():
        assert _s(p, fqn) == want, fqn
    assert _uses(p, "layers.0.mlp.fc.weight") == {"RS(0)"}
    assert _uses(p, "layers.0.mlp.proj.weight") == {"RS(1)"}


def test_gpt2_recipes_never_beat_the_searched_plans(gpt2_2x2):
    """The honesty check: the free-storage search contains every recipe, the default search the
    full_shard ones; neither may be more expensive than a recipe in its space."""
    _, results, found, free = gpt2_2x2
    priced = [r for r in results.values() if r.status == "ok"]
    assert len(priced) == len(R.RECIPES) - len(REGION_RECIPES), {r.name: r.reason for r in results.values()}
    for r in priced:
        assert free.objective_us <= r.objective_us * (1 + 1e-6), r.name
        if R.within_default_space(R.get(r.name)):
            assert found.objective_us <= r.objective_us * (1 + 1e-6), r.name


def test_gpt2_roles_read_tensor_parallelism(gpt2_2x2):
    from apmodel.reading.roles import emerged

    _, results, _, _ = gpt2_2x2
    tp = emerged(results["megatron_tp"].plan)
    assert "tensor parallel" in tp["axis1"] and "tensor parallel" not in tp["axis0"]
    sp = emerged(results["megatron_tp_sp"].plan)
    assert "sequence parallel" in sp["axis1"]  # GPT-2's LayerNorm outputs found through its conventions


def test_recipes_take_given_conventions(captured, setup_2x2):
    """Conventions that name no linear layer make the tensor-parallel recipes not applicable;
    the LLaMA default gives the same plan as the derived conventions on a LLaMA model."""
    from apmodel.graph.conventions import LLAMA, ModelConventions

    strategies, cost = setup_2x2
    none = ModelConventions(column_parallel=(), row_parallel=(), source="test: nothing to split")
    r = R.run(R.get("megatron_tp"), captured, strategies, cost, solver=SOLVER, conventions=none)
    assert r.status == "n/a" and "nothing to split" in r.reason
    a = R.run(R.get("megatron_tp"), captured, strategies, cost, solver=SOLVER, conventions=LLAMA)
    b = R.run(R.get("megatron_tp"), captured, strategies, cost, solver=SOLVER)
    assert a.plan.param_placements == b.plan.param_placements
    assert a.objective_us == pytest.approx(b.objective_us, rel=1e-9)


def test_compare_recipes_searches_the_free_storage_space():
    """``compare_recipes`` of a default (full_shard) run searches the free-storage space too and
    checks every recipe against it: on GPT-2 the Megatron recipes (free storage) beat the
    full_shard plan, which is no reason for a warning, while the free-storage plan beats them all."""
    from apmodel.core.options import PlanOptions
    from apmodel.entry.api import plan_workload
    from apmodel.frontend.workloads import load_workload

    result = plan_workload(load_workload("gpt2", (2, 2), batch=8, seq=64, layers=1), PlanOptions(solver=SOLVER),
                           compare_recipes=True)
    free = result.free_plan
    assert free is not result.plan and free.workload.get("policy") == "free"
    priced = [r for r in result.recipes if r.objective_us is not None]
    assert {r.name for r in priced} >= {"megatron_tp", "megatron_tp_sp", "fsdp_tp"}
    for r in priced:
        assert free.objective_us <= r.objective_us * (1 + 1e-6), r.name
    assert not any("cheaper than" in w for w in result.warnings), result.warnings


@pytest.mark.parametrize("model, overrides, recipes", [
    ("moe-debug", dict(n_layers=2), ("fsdp_ep", "fsdp_tp_ep")),
    ("llama3-debug", dict(n_layers=1, context_parallel=True), ("fsdp_tp_cp",)),
])
def test_region_recipes_run_their_regions_as_declared(model, overrides, recipes):
    """FSDP+EP runs the routed experts expert parallel on the last axis (data parallel before it),
    FSDP+TP+EP expert parallel on the TP axis, FSDP+TP+CP attention context parallel before the TP
    axis (heads split on it); the searched plan, whose space holds them all, is never worse."""
    from apmodel.graph.regions import region_of
    from apmodel.models import config

    with torch.device("meta"):
        m = build(config(model, **overrides))
    cap = capture(m, sample_inputs(model, batch=8, seq=64))
    mesh = (2, 2)
    strategies, cost = enumerate_strategies(cap.gm, mesh), cost_context(mesh)
    found = solve_model(placement_model(cap, strategies, cost), solver=SOLVER)
    want = {"fsdp_ep": ("data_parallel", "expert_parallel"), "fsdp_tp_ep": ("data_parallel", "expert_parallel"),
            "fsdp_tp_cp": ("context_parallel", "heads")}
    for name in recipes:
        r = R.run(R.get(name), cap, strategies, cost, solver=SOLVER)
        assert r.status == "ok", (name, r.reason)
        node = next(n for n in cap.gm.graph.nodes if n.name == REGION_RECIPES[name])
        modes = region_of(node.target).alternative_on_axes(r.plan.node_strategy[node.name].inputs, backward=False)
        assert modes == want[name], name
        assert found.objective_us <= r.objective_us * (1 + 1e-6), name

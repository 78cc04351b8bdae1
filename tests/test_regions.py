"""local_map regions: a user function on local shards, one node of the joint graph each way,
planned around, priced by the ops it runs, and lowered by running it on the planned shards.

Truths: the same model written without the region (single-device eager training, and the
ordinary planner's prices of the same ops), and the declared placements.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apmodel
from apmodel.entry.api import build_model
from apmodel.graph.capture import capture
from apmodel.graph.regions import RegionError, local_map

from _dist_utils import run_distributed
from _helpers import train

D, H, V = 16, 32, 64
BATCH, SEQ = 8, 4
STEPS = 3
LOSS_RTOL = 1e-5


def row_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Row-wise: each row of ``x`` is independent, so row shards compute their rows exactly."""
    return F.gelu(x @ w1) @ w2


REGION = local_map(row_mlp, name="test_row_mlp", in_placements=("S(0)", "R", "R"), out_placements=("S(0)",))


def centre_rows(x: torch.Tensor) -> torch.Tensor:
    """The README's region with its own collective: rows minus the mean of all rows."""
    comm = apmodel.region_comm("rows")
    return x - comm.all_gather(x, 0).mean(0, keepdim=True)


CENTRE = local_map(centre_rows, name="test_centre_rows", alternatives={"rows": (("S(0)",), ("S(0)",))})


class Net(nn.Module):
    """Embedding -> residual MLP (as a region, or inline) -> vocabulary head."""

    def __init__(self, use_region: bool = True, centre: bool = False) -> None:
        super().__init__()
        self.use_region = use_region
        self.centre = centre
        self.emb = nn.Embedding(V, D)
        self.w1 = nn.Parameter(torch.randn(D, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(H, D) * 0.1)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).flatten(0, 1)
        if self.centre:  # inline, the function runs on whole rows (region_comm is size 1)
            x = CENTRE(x) if self.use_region else centre_rows(x)
        mlp = REGION(x, self.w1, self.w2) if self.use_region else row_mlp(x, self.w1, self.w2)
        return self.head(x + mlp)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets.flatten())


def _batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randint(0, V, (BATCH, SEQ), generator=g).to(device),
            torch.randint(0, V, (BATCH, SEQ), generator=g).to(device))


def _net(use_region: bool, device: str, centre: bool = False) -> Net:
    torch.manual_seed(0)
    with torch.device(device):
        return Net(use_region, centre)


SHARDED = [apmodel.fix("test_row_mlp", "S(0)S(0)"), apmodel.fix("test_row_mlp_backward", "S(0)S(0)", on="input:0")]


def test_a_region_is_one_node_each_way_with_its_declared_strategies():
    tokens, targets = _batch("meta")
    captured = capture(_net(True, "meta"), (tokens,), loss_fn, targets=(targets,))
    regions = [n.name for n in captured.gm.graph.nodes if "test_row_mlp" in str(n.target)]
    assert regions == ["test_row_mlp", "test_row_mlp_backward"]
    pm = build_model(captured, (2, 2))
    got = sorted(str(s) for s in pm.strategies["test_row_mlp"])
    # the declared strategy on every subset of the two axes (replicated elsewhere)
    assert got == sorted(["RR <- (RR, RR, RR)", "RS(0) <- (RS(0), RR, RR)", "S(0)R <- (S(0)R, RR, RR)",
                          "S(0)S(0) <- (S(0)S(0), RR, RR)"])
    # backward: row gradients stay sharded, the replicated weights' local gradients are partial sums
    assert "S(0)S(0), PP, PP <- (S(0)S(0), S(0)S(0), RR, RR)" in {str(s) for s in pm.strategies["test_row_mlp_backward"]}


def test_a_region_is_priced_by_the_ops_it_runs():
    """On one device, the region model's compute is the inline model's (priced node by node by the
    ordinary path) plus one recomputation of the region's forward in its backward (the region
    keeps only its inputs)."""
    from apmodel.candidates.strategies import enumerate_strategies

    tokens, targets = _batch("meta")
    cost = apmodel.cost_context((1,), device="h100")

    def per_node(use_region: bool) -> dict[str, float]:
        captured = capture(_net(use_region, "meta"), (tokens,), loss_fn, targets=(targets,))
        strategies = enumerate_strategies(captured.gm, (1,), progress=False)
        return {n.name: float(cost.compute_vector(n, strategies[n.name])[0])
                for n in captured.gm.graph.nodes if n.op == "call_function"}

    region, inline = per_node(True), per_node(False)
    assert region["test_row_mlp"] > 0 and region["test_row_mlp_backward"] > region["test_row_mlp"]
    assert sum(region.values()) == pytest.approx(sum(inline.values()) + region["test_row_mlp"], rel=1e-6)


def outer_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise, through an N x D x D intermediate: a region whose working set dwarfs its output."""
    return (x.unsqueeze(-1) * x.unsqueeze(-2)).sum(-1)


OUTER = local_map(outer_rows, name="test_outer_rows", in_placements=("S(0)",), out_placements=("S(0)",))


class OuterNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OUTER(self.lin(x)).square().mean()


def test_a_regions_working_set_counts_in_the_peak():
    """The intermediates a region's function holds are per-device memory: the forward's largest
    live set is its N x D x D product plus the N x D sum (hand-counted; the unsqueezes are views),
    the backward holds at least one such product, and a plan's peak includes it (the graph-level
    transients alone are N x D sized here)."""
    n, d, ranks = 64, 32, 4
    cost = apmodel.cost_context((ranks,), device="h100")
    size = cost.itemsize(torch.float32)
    local = torch.empty(n // ranks, d, device="meta")
    fwd = OUTER.working_bytes(cost, [local], modes=("sharded",), backward=False)
    assert fwd == (n // ranks) * (d * d + d) * size
    bwd = OUTER.working_bytes(cost, [torch.empty(n // ranks, d, device="meta"), local], modes=("sharded",),
                              backward=True)
    assert bwd >= (n // ranks) * d * d * size
    with torch.device("meta"):
        model = OuterNet(d)
    plan = apmodel.plan(model, (ranks,), (torch.empty(n, d, device="meta"),),
                        constraints=[apmodel.fix("test_outer_rows", "S(0)"),
                                     apmodel.fix("test_outer_rows_backward", "S(0)", on="input:0")])
    m = plan.memory
    transient = m["peak_bytes"] - m["params_bytes"] - m["grads_bytes"] - m["optimizer_bytes"] - m["activations_bytes"]
    assert transient >= bwd > 8 * n * d * size, (transient, bwd)


def test_selective_checkpointing_keeps_a_region_full_recomputes_it():
    """A region is a hand-written compute block: ``selective`` keeps its output like a matmul's,
    ``full`` recomputes it in backward from the layer input."""
    tokens, targets = _batch("meta")
    copies = {}
    for ac in ("selective", "full"):
        plan = apmodel.plan(_net(True, "meta"), (2, 2), (tokens,), loss_fn=loss_fn, targets=(targets,), ac=ac)
        copies[ac] = "test_row_mlp_recompute" in plan.node_strategy
        assert plan.objective_us == pytest.approx(plan.solver["energy_us"], rel=1e-9)
    assert copies == {"selective": False, "full": True}


def test_constraints_select_a_region_by_name_and_bad_declarations_are_named():
    tokens, targets = _batch("meta")
    plan = apmodel.plan(_net(True, "meta"), (2, 2), (tokens,), loss_fn=loss_fn, targets=(targets,), constraints=SHARDED)
    assert str(plan.node_strategy["test_row_mlp"]).startswith("S(0)S(0) <- (S(0)S(0)")
    with pytest.raises(RegionError, match="'bad'.*input 0.*partial"):
        local_map(row_mlp, name="bad", in_placements=("P", "R", "R"), out_placements=("S(0)",))
    with pytest.raises(RegionError, match="'bad2'.*'X\\(1\\)'"):
        local_map(row_mlp, name="bad2", in_placements=("X(1)", "R", "R"), out_placements=("S(0)",))
    with pytest.raises(RegionError, match="already used"):
        local_map(lambda x, a, b: x, name="test_row_mlp", in_placements=("S(0)", "R", "R"), out_placements=("S(0)",))
    assert local_map(row_mlp, name="test_row_mlp", in_placements=("S(0)", "R", "R"), out_placements=("S(0)",)) is REGION


def test_region_as_names_bad_alternatives_and_regions():
    tokens, targets = _batch("meta")

    def plan(*constraints):
        return apmodel.plan(_net(True, "meta", centre=True), (2, 2), (tokens,), loss_fn=loss_fn,
                            targets=(targets,), constraints=list(constraints))

    with pytest.raises(ValueError, match="'test_centre_rows' has no alternative 'cols'.*'rows'"):
        plan(apmodel.region_as("test_centre_rows", "cols", None))
    with pytest.raises(ValueError, match="1 entries for a mesh of 2 axes"):
        plan(apmodel.region_as("test_centre_rows", "rows"))
    with pytest.raises(KeyError, match="'nothing_\\*' matches no local_map region"):
        plan(apmodel.region_as("nothing_*", None, None))
    got = plan(apmodel.region_as("test_centre_rows", "replicated", "rows"))
    assert str(got.node_strategy["test_centre_rows"]).startswith("RS(0) <- (RS(0))")
    with pytest.raises(RegionError, match="'twice'.*'a' and 'b' place the inputs alike"):
        local_map(centre_rows, name="twice", alternatives={"a": (("S(0)",), ("S(0)",)), "b": (("S(0)",), ("R",))})
    with pytest.raises(RegionError, match="'both'.*not both"):
        local_map(centre_rows, name="both", in_placements=("S(0)",), out_placements=("S(0)",),
                  alternatives={"a": (("S(0)",), ("S(0)",))})


def _train(model: nn.Module, step) -> list[float]:
    return train(model, step, STEPS, lambda params: torch.optim.SGD(params, lr=0.5))


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = _batch()
    state = _net(True, "cpu").state_dict()
    model = apmodel.parallelize(_net(True, "meta"), mesh, (tokens.to("meta"),), loss_fn=loss_fn,
                                targets=(targets.to("meta"),), constraints=SHARDED)
    model.to_empty(device="cpu")
    load_full_state_dict(model, state)
    losses = _train(model, lambda m: m(tokens, targets))
    plan = model._apmodel_program.plan
    # full activation checkpointing: the region runs again in backward (its recomputed copy)
    full_ac = apmodel.parallelize(_net(True, "meta"), mesh, (tokens.to("meta"),), loss_fn=loss_fn,
                                  targets=(targets.to("meta"),), constraints=SHARDED, ac="full")
    full_ac.to_empty(device="cpu")
    load_full_state_dict(full_ac, state)
    # the README's region with its own all-gather, run on both axes (4 ranks)
    centred = apmodel.parallelize(_net(True, "meta", centre=True), mesh, (tokens.to("meta"),), loss_fn=loss_fn,
                                  targets=(targets.to("meta"),),
                                  constraints=SHARDED + [apmodel.region_as("test_centre_rows", "rows", "rows")])
    centred.to_empty(device="cpu")
    load_full_state_dict(centred, _net(True, "cpu", centre=True).state_dict())
    return {"losses": losses, "fwd": str(plan.node_strategy["test_row_mlp"]),
            "centred_losses": _train(centred, lambda m: m(tokens, targets)),
            "bwd": str(plan.node_strategy["test_row_mlp_backward"]),
            "full_ac_losses": _train(full_ac, lambda m: m(tokens, targets)),
            "full_ac_recomputes": "test_row_mlp_recompute" in full_ac._apmodel_program.plan.node_strategy}


@pytest.mark.slow
def test_a_region_trains_on_a_2x2_mesh_as_the_inline_model_on_one_device():
    per_rank = run_distributed(_worker, 4, timeout_s=600)
    got = per_rank[0]
    assert all(r["losses"] == got["losses"] for r in per_rank)
    assert got["fwd"].startswith("S(0)S(0)") and got["bwd"].startswith("S(0)S(0)")
    ref = _train(_net(False, "cpu"), lambda m: loss_fn(m(_batch()[0]), _batch()[1]))
    for step, (a, b) in enumerate(zip(got["losses"], ref, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)
    assert got["full_ac_recomputes"]
    for step, (a, b) in enumerate(zip(got["full_ac_losses"], ref, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), ("ac=full", step, a, b)
    centred = _train(_net(False, "cpu", centre=True), lambda m: loss_fn(m(_batch()[0]), _batch()[1]))
    for step, (a, b) in enumerate(zip(got["centred_losses"], centred, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), ("centre_rows", step, a, b)
    # the region model itself on one device (its backward operator outside DTensor) trains the same
    alone = _train(_net(True, "cpu"), lambda m: loss_fn(m(_batch()[0]), _batch()[1]))
    assert alone == pytest.approx(ref, rel=1e-6)

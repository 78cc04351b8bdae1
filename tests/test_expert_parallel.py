"""Sparse MoE with expert parallelism: the routed experts are a ``local_map`` region whose tokens
travel to their experts' ranks by all-to-all.

Truths: the dense-routed model (every expert on every token, gates zero off the top-k: the same
function with static shapes) trained on one device, and brute arithmetic of the routed FLOPs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import apmodel
from apmodel import Plan
from apmodel.models import build, config
from apmodel.models.moe import EXPERT_LOAD_IMBALANCE, RoutedExperts

from _dist_utils import run_distributed
from _helpers import full_weights, train
from _tiny import tiny_model

TINY_MOE = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, moe_hidden_dim=16,
                n_routed_experts=8, n_shared_experts=1, top_k=2, n_dense_layers=1, vocab_size=64, max_seq_len=16)
BATCH, SEQ, STEPS = 8, 16, 3
LOSS_RTOL = 1e-5


def tiny_moe(device: str, routing: str = "sparse") -> torch.nn.Module:
    return tiny_model("moe-debug", device, **TINY_MOE, routing=routing)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, TINY_MOE["vocab_size"], (BATCH, SEQ), generator=g),
            torch.randint(0, TINY_MOE["vocab_size"], (BATCH, SEQ), generator=g))


def _train(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
    return train(model, lambda m: m(tokens, targets), STEPS)


def test_sparse_routing_is_the_dense_function_on_one_device():
    tokens, targets = _batch()
    sparse, dense = tiny_moe("cpu"), tiny_moe("cpu", "dense")
    assert _train(sparse, tokens, targets) == pytest.approx(_train(dense, tokens, targets), rel=1e-6)


def test_routed_experts_are_priced_for_the_routed_tokens():
    """The region's expert matmuls cost top_k / E of the dense model's (plus the load-imbalance
    padding under expert parallelism), and its all-to-alls are priced by the collective model."""
    from apmodel.graph.regions import RegionComm, region_scope

    cost = apmodel.cost_context((4,), device="h100")
    t, dim, hidden, experts, k = 4096, 2048, 1408, 64, 6
    region = RoutedExperts(k).region()
    meta = dict(device="meta")
    x, probs = torch.empty(t, dim, **meta), torch.empty(t, experts, **meta)
    w = [torch.empty(experts, dim, hidden, **meta), torch.empty(experts, hidden, dim, **meta),
         torch.empty(experts, dim, hidden, **meta)]
    flops = cost.compute

    def matmul_flops(modes, local_experts):
        ws = [wi[:local_experts] for wi in w]
        return region.time_us(cost, [x, probs, *ws], modes=modes, backward=False)

    alone = matmul_flops((None,), experts)
    ep = matmul_flops(("expert_parallel",), experts // 4)
    # the all-to-all of the busiest rank's rows, both ways, priced by the collective model
    rows = 4096 * k * EXPERT_LOAD_IMBALANCE
    a2a = 2 * cost.comm.time_us("all_to_all", rows * dim * 4, 0)
    assert ep > a2a > 0
    # dense-routed compute of the same experts (every expert on every token) is E / k times more
    dense = sum(flops.time_us(torch.ops.aten.bmm.default, (torch.empty(experts, t, a, **meta), torch.empty(experts, a, b, **meta)),
                              {}, torch.empty(experts, t, b, **meta)) for a, b in ((dim, hidden), (dim, hidden), (hidden, dim)))
    assert alone < dense * k / experts * 1.3
    records: list = []
    with region_scope({"expert_parallel": RegionComm(4, 0, (0,), None, records)}):
        RoutedExperts(k)(x, probs, *[wi[:experts // 4] for wi in w])
    assert [r.kind for r in records] == ["all_to_all"] * 3  # counts, rows there, rows back
    assert records[0].numel == experts and records[0].dtype == torch.int64
    assert records[1].numel == pytest.approx(rows * dim, rel=1e-3)


def test_a_plan_counts_the_regions_all_to_alls_as_communication():
    """The region's collectives leave the compute term for the comm term, under their own key,
    priced by the collective model: per step 3 all-to-alls forward (counts, rows there and back)
    and 5 in backward (the recomputed 3, the 2 row exchanges' gradients)."""
    with torch.device("meta"):
        model = build(config("moe-debug", **TINY_MOE))
    tokens, targets = (t.to("meta") for t in _batch())
    plan = apmodel.plan(model, (2, 2), (tokens, targets),
                        constraints=[apmodel.region_as("routed_experts_*", "data_parallel", "expert_parallel")])
    assert plan.objective_us == pytest.approx(plan.compute_us + plan.comm_us, rel=1e-9)
    got = plan.comm_by_collective["all_to_all (routed_experts_top2)@axis1"]
    cost = apmodel.cost_context((2, 2))
    pairs = BATCH * SEQ // 4 * TINY_MOE["top_k"]  # tokens split over both axes, top-k slots each
    local = TINY_MOE["n_routed_experts"] // 2
    rows = max(pairs, local * -(-int(pairs * EXPERT_LOAD_IMBALANCE) // local))
    row_bytes = rows * TINY_MOE["dim"] * 2  # priced in bf16
    count_bytes = TINY_MOE["n_routed_experts"] * 8
    want = 6 * cost.comm.time_us("all_to_all", row_bytes, 1) + 2 * cost.comm.time_us("all_to_all", count_bytes, 1)
    assert got == pytest.approx(want, rel=1e-9)
    # explain shows the forward's three as the region node's communication, not its compute
    from apmodel.result.plans import explain

    chosen = next(r for r in explain(plan.model, plan.node_strategy, "routed_experts_top2") if r["chosen"])
    forward = 2 * cost.comm.time_us("all_to_all", row_bytes, 1) + cost.comm.time_us("all_to_all", count_bytes, 1)
    assert chosen["comm_us"] >= forward * (1 - 1e-9) and chosen["compute_us"] > 0


def _worker(rank: int, world: int, per_axis: tuple) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = _batch()
    state = full_weights(tiny_moe("cpu"))
    model = apmodel.parallelize(tiny_moe("meta"), mesh, (tokens.to("meta"), targets.to("meta")),
                                constraints=[apmodel.region_as("routed_experts_*", *per_axis)])
    model.to_empty(device="cpu")
    load_full_state_dict(model, state)
    plan = model._apmodel_program.plan
    # the region's own all-to-alls: how many, over groups of which size
    sizes: list[int] = []
    real = dist.all_to_all_single

    def counted(out, inp, out_splits=None, in_splits=None, group=None, **kw):
        sizes.append(dist.get_world_size(group))
        return real(out, inp, out_splits, in_splits, group=group, **kw)

    dist.all_to_all_single = counted
    try:
        losses = _train(model, tokens, targets)
    finally:
        dist.all_to_all_single = real
    # the plan as a file replays: same regions, same first loss
    again = apmodel.parallelize(tiny_moe("meta"), mesh, (tokens.to("meta"), targets.to("meta")),
                                plan=Plan.from_json(plan.to_json(), "test"))
    again.to_empty(device="cpu")
    load_full_state_dict(again, state)
    return {"losses": losses, "replayed_loss": float(again(tokens, targets).detach().full_tensor()),
            "a2a_group_sizes": sorted(set(sizes)), "a2a_per_step": len(sizes) / STEPS,
            "region": str(plan.node_strategy["routed_experts_top2"]),
            "experts_used_as": [str(p) for p in plan.node_strategy["routed_experts_top2"].inputs[2]]}


@pytest.mark.slow
@pytest.mark.parametrize("per_axis", [("expert_parallel", "expert_parallel"), ("expert_parallel", "tensor_parallel"),
                                      ("data_parallel", "expert_parallel")])
def test_expert_parallel_training_equals_the_dense_model_on_one_device(per_axis):
    per_rank = run_distributed(_worker, 4, per_axis, timeout_s=600)
    got = per_rank[0]
    assert all(r["losses"] == got["losses"] for r in per_rank)
    tokens, targets = _batch()
    ref = _train(tiny_moe("cpu", "dense"), tokens, targets)
    for step, (a, b) in enumerate(zip(got["losses"], ref, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (per_axis, step, a, b)
    assert abs(got["replayed_loss"] - ref[0]) <= LOSS_RTOL * abs(ref[0])
    # tokens went to their experts: per step, forward (counts, rows there and back), the
    # backward's recomputation (the same three) and the two row exchanges' gradients
    ep_ranks = 4 if per_axis.count("expert_parallel") == 2 else 2
    assert got["a2a_group_sizes"] == [ep_ranks] and got["a2a_per_step"] == 8
    ep_axes = [a for a, mode in enumerate(per_axis) if mode == "expert_parallel"]
    assert [got["experts_used_as"][a] for a in ep_axes] == ["S(0)"] * len(ep_axes)

"""Context-parallel attention: the ``local_map`` region that shards the sequence, all-gathers keys
and values and balances the causal work by swapping query halves with the mirrored rank.

Truths: the plain LLaMA (attention not a region) trained on one device, and the exact count of
causal score entries (a full sequence's, split evenly over the ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import apmodel
from apmodel.graph.regions import RegionComm, region_scope
from apmodel.models.attention import ContextParallelAttention
from apmodel.problem.pricing import CostContext

from _dist_utils import run_distributed
from _helpers import full_weights, train
from _tiny import fixed_tokens, tiny_llama

STEPS = 3
LOSS_RTOL = 1e-5


class _AttentionFlops:
    """A compute model pricing attention kernels at their nominal FLOPs (everything else 0)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def time_us(self, op, args, kwargs, out, dtype=None) -> float:
        return float(self.inner.flops(op, args, kwargs, out)) if "scaled_dot_product" in str(op) else 0.0


class _FreeComm:
    def __init__(self, mesh_shape: tuple[int, ...]) -> None:
        self.mesh_shape = mesh_shape

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        return 0.0


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_rank_does_an_equal_share_of_the_causal_work(ranks):
    """Per rank, the region's attention kernels cover exactly 1/ranks of the full sequence's causal
    scores, forward and backward (the zig-zag balance), and its collectives are the key/value
    all-gathers (reduce-scatters in backward) and the query-half swaps."""
    b, h, s, d = 2, 4, 24 * ranks, 16
    compute = _AttentionFlops(apmodel.cost_context((1,), device="h100").compute)
    cost = CostContext(mesh_shape=(ranks,), compute=compute, comm=_FreeComm((ranks,)))
    region = ContextParallelAttention().region()
    meta = [torch.empty(b, h, s, d, device="meta") for _ in range(3)]
    local = [t[:, :, : s // ranks] for t in meta]
    for backward in (False, True):
        args = ([local[0]] if backward else []) + local
        whole = ([meta[0]] if backward else []) + meta
        share = region.time_us(cost, args, modes=("context_parallel",), backward=backward)
        total = region.time_us(cost, whole, modes=(None,), backward=backward)
        assert share * ranks == pytest.approx(total, rel=1e-9), backward
    # an odd chunk cannot be halved: the whole chunk of the busiest (last) rank is priced
    odd = [torch.empty(b, h, 3 * ranks, d, device="meta") for _ in range(3)]
    odd_share = region.time_us(cost, [t[:, :, :3] for t in odd], modes=("context_parallel",), backward=False)
    odd_total = region.time_us(cost, odd, modes=(None,), backward=False)
    c, n_seq = 3, 3 * ranks  # the last chunk's scores: every earlier key, and a causal diagonal block
    assert odd_share / odd_total == pytest.approx((c * (n_seq - c) + c * (c + 1) / 2) / (n_seq * (n_seq + 1) / 2), rel=1e-9)
    records: list = []
    with region_scope({"context_parallel": RegionComm(ranks, 0, (0,), None, records)}):
        ContextParallelAttention()(*local)
    assert [r.kind for r in records] == ["all_gather", "all_gather", "all_to_all", "all_to_all"]
    assert records[0].numel == b * h * s * d


def _worker(rank: int, world: int, per_axis: tuple) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    state = full_weights(tiny_llama("cpu", context_parallel=True))
    model = apmodel.parallelize(tiny_llama("meta", context_parallel=True), mesh, (tokens.to("meta"), targets.to("meta")),
                                constraints=[apmodel.region_as("attention_*", *per_axis)])
    model.to_empty(device="cpu")
    load_full_state_dict(model, state)
    losses = train(model, lambda m: m(tokens, targets), STEPS)
    plan = model._apmodel_program.plan
    return {"losses": losses, "attention": [str(p) for p in plan.node_strategy["attention_flash"].inputs[0]]}


def _reference() -> list[float]:
    tokens, targets = fixed_tokens()
    return train(tiny_llama("cpu"), lambda m: m(tokens, targets), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("per_axis", [("context_parallel", "context_parallel"), ("heads", "context_parallel")])
def test_context_parallel_training_equals_the_plain_model_on_one_device(per_axis):
    per_rank = run_distributed(_worker, 4, per_axis, timeout_s=600)
    got = per_rank[0]
    assert all(r["losses"] == got["losses"] for r in per_rank)
    assert got["attention"] == [{"context_parallel": "S(2)", "heads": "S(1)"}[m] for m in per_axis]
    for step, (a, b) in enumerate(zip(got["losses"], _reference(), strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (per_axis, step, a, b)


def _region_worker(rank: int, world: int, seq: int) -> dict[str, Any]:
    """The region's function on this rank's chunk, against causal attention on the whole sequence."""
    import torch.distributed as dist
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, seq, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query: 2 key/value heads for 4 query heads
    chunk = seq // world
    part = [t[:, :, rank * chunk:(rank + 1) * chunk].clone().requires_grad_() for t in (q, k, v)]
    comm = RegionComm(world, rank, (0,), dist.group.WORLD)
    with region_scope({"context_parallel": comm}):
        out = ContextParallelAttention()(*part)
    out.square().sum().backward()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(whole[0], whole[1].repeat_interleave(2, 1), whole[2].repeat_interleave(2, 1),
                                         is_causal=True)
    ref.square().sum().backward()
    mine = slice(rank * chunk, (rank + 1) * chunk)
    return {"out": (out - ref[:, :, mine]).abs().max().item(),
            "grads": max((p.grad - w.grad[:, :, mine]).abs().max().item() for p, w in zip(part, whole, strict=False))}


@pytest.mark.parametrize("world, seq", [(2, 8), (3, 12), (2, 6)])  # balanced halves, an odd rank count, odd chunks
def test_the_region_function_computes_causal_attention_and_its_gradients(world, seq):
    for got in run_distributed(_region_worker, world, seq, timeout_s=300):
        assert got["out"] < 1e-5 and got["grads"] < 1e-5, got

"""Parameter collectives priced as the native program runs them: merged into buckets.

Truths: the collective model's own time of one merged collective (shares of a full bucket add up
to it), and the collectives the native program's graphs hold after bucketing, each priced alone
by the same model (gloo, 2 processes: the DDP recipe's plan costs exactly what its issued
collectives cost; the FSDP recipe's differs only by its one partial bucket).
"""

from __future__ import annotations

import math

import pytest
import torch.nn.functional as F

import costmodels
from costmodels import BucketedCollectives

from _dist_utils import run_distributed
from _tiny import fixed_tokens, tiny_llama

BUCKET_BYTES = 4 * 2**20


def _nccl() -> costmodels.NCCLCollectives:
    return costmodels.NCCLCollectives(costmodels.Topology((8,), costmodels.device("h100"), 8))


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("pieces", [1, 3, 16, 1000])
def test_shares_of_a_full_bucket_add_up_to_the_merged_collective(kind, pieces):
    base = _nccl()
    bucketed = BucketedCollectives(base, BUCKET_BYTES)
    share = BUCKET_BYTES / pieces
    total = sum(bucketed.time_us(kind, share, 0) for _ in range(pieces))
    assert total == pytest.approx(base.time_us(kind, BUCKET_BYTES, 0), rel=1e-12)
    assert bucketed.time_us(kind, share, 0) <= base.time_us(kind, share, 0)


def test_a_collective_as_large_as_the_bucket_and_an_all_to_all_pay_their_own_time():
    base = _nccl()
    bucketed = BucketedCollectives(base, BUCKET_BYTES)
    for nbytes in (BUCKET_BYTES, 3 * BUCKET_BYTES):
        assert bucketed.time_us("all_gather", nbytes, 0) == base.time_us("all_gather", nbytes, 0)
    assert bucketed.time_us("all_to_all", 1024, 0) == base.time_us("all_to_all", 1024, 0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketedCollectives(base, 0)


def test_bucket_mb_zero_prices_every_collective_alone():
    """The option reaches the price: with buckets, FSDP's many small gathers cost less than alone."""
    import apmodel
    from apmodel.reading import recipes

    tokens, targets = fixed_tokens()
    fsdp = recipes.get("fsdp")

    def priced(bucket_mb: float) -> float:
        plan = apmodel.plan(tiny_llama("meta"), (8,), (tokens.to("meta"),), targets=(targets.to("meta"),),
                            loss_fn=_lm_loss, device="h100", constraints=fsdp.constraints((8,)),
                            param_policy=fsdp.param_policy, bucket_mb=bucket_mb)
        return plan.comm_by_collective["all_gather@axis0"]

    assert priced(25.0) < 0.5 * priced(0.0)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


#: the kinds a dense plan issues; each one's nccl-tests size is the larger of its input and output
#: (an all-gather's gathered output, a reduce-scatter's full input, an all-reduce's buffer)
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _issued_worker(rank: int, world: int, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    import apmodel
    from apmodel.reading import recipes

    mesh = dist.init_device_mesh("cpu", mesh_shape)
    tokens, targets = fixed_tokens()
    out = {}
    for name in names:
        r = recipes.get(name)
        model = apmodel.parallelize(tiny_llama("meta"), mesh, (tokens.to("meta"),), targets=(targets.to("meta"),),
                                    loss_fn=_lm_loss, device="h100", dtype="fp32",
                                    constraints=r.constraints(mesh_shape), param_policy=r.param_policy)
        prog = model._apmodel_program
        issued = []
        for phase, gm in (("forward", prog.native.forward_graph), ("backward", prog.native.backward_graph)):
            for n in gm.graph.nodes:
                if n.op != "call_function" or getattr(n.target, "namespace", None) != "_c10d_functional":
                    continue
                kind = next((k for k in _KINDS if n.target.__name__.startswith(k)), None)
                if kind is None:
                    assert n.target.__name__.startswith("wait_tensor"), n.target
                    continue
                val, inp = n.meta["val"], n.all_input_nodes[0].meta["val"]
                issued.append((kind, max(val.numel(), inp.numel()) * val.element_size(), phase))
        out[name] = {"issued": issued, "comm_us": prog.plan.comm_us, "params": len(prog.plan.param_placements)}
    return out


@pytest.mark.slow
def test_recipe_plans_cost_what_their_issued_collectives_cost():
    from apmodel.core.options import PlanOptions
    from apmodel.problem.pricing import build_cost_context

    world = 2
    got = run_distributed(_issued_worker, world, (world,), ("ddp", "fsdp"))[0]
    comm = build_cost_context((world,), PlanOptions(device="h100", dtype="fp32")).comm
    alone = {name: [comm.time_us(kind, nbytes, 0) for kind, nbytes, _ in r["issued"]] for name, r in got.items()}
    # DDP: every gradient all-reduced in one bucket holding all the parameters (the bucket the
    # price assumes), the loss's activations gathered alone
    ddp = got["ddp"]
    assert sum(kind == "all_reduce" for kind, _, _ in ddp["issued"]) == 1
    assert ddp["comm_us"] == pytest.approx(math.fsum(alone["ddp"]), rel=1e-9)
    # FSDP: the forward's gathers and the backward's reduce-scatters fill the assumed bucket; the
    # few parameters the backward gathers again fill a partial one, which the price counts as its
    # bytes' share of a full bucket: cheaper than the partial bucket alone, by at most its time
    fsdp = got["fsdp"]
    partial = min(t for (kind, _, _), t in zip(fsdp["issued"], alone["fsdp"], strict=False) if kind == "all_gather")
    assert math.fsum(alone["fsdp"]) - partial <= fsdp["comm_us"] <= math.fsum(alone["fsdp"]) * (1 + 1e-9)


@pytest.mark.slow
def test_a_2d_meshs_parameter_gathers_merge_per_axis():
    """FSDP on 2x2 gathers each parameter over axis 1, then axis 0, parameter after parameter; the
    program merges them per axis as priced (one key at a time), so its forward holds fewer gathers
    than the model has parameters (one per parameter per axis, unmerged)."""
    got = run_distributed(_issued_worker, 4, (2, 2), ("fsdp",))[0]["fsdp"]
    forward_gathers = [b for kind, b, phase in got["issued"] if kind == "all_gather" and phase == "forward"]
    assert 2 <= len(forward_gathers) < got["params"], got["issued"]

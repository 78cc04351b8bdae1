"""Redistribution costs between placement tuples."""

import itertools
import math
from types import SimpleNamespace

import pytest

import costmodels as cm


@pytest.fixture()
def comm():
    return cm.NCCLCollectives(cm.Topology((2, 4), cm.device("h100"), gpus_per_node=8))


SHAPE = (1024, 4096)


def test_identity_and_replicate_to_shard_are_free(comm):
    assert cm.redistribution_us(comm, SHAPE, 2, ("S(0)", "S(1)"), ("S(0)", "S(1)")) == 0.0
    for dst in [("S(0)", "R"), ("R", "S(1)"), ("S(0)", "S(1)"), ("S(1)", "S(1)"), ("S(0)", "S(0)")]:
        assert cm.redistribution_us(comm, SHAPE, 2, ("R", "R"), dst) == 0.0
        assert cm.redistribution_steps(comm, SHAPE, 2, ("R", "R"), dst) == []


def test_forbidden_transitions_are_inf(comm):
    for src, dst in [(("R", "R"), ("P", "R")), (("S(0)", "R"), ("P", "R")),
                     (("R", "S(1)"), ("R", "P")), (("P", "S(0)"), ("P", "P"))]:
        assert cm.redistribution_us(comm, SHAPE, 2, src, dst) == math.inf
        assert cm.redistribution_steps(comm, SHAPE, 2, src, dst)[-1][0] == "forbidden"


def test_partial_mean_reduces_like_a_sum_and_never_turns_into_another_partial(comm):
    for dst in [("R", "R"), ("S(0)", "R"), ("R", "S(1)")]:
        assert cm.redistribution_us(comm, SHAPE, 2, ("P(avg)", "R"), dst) == \
            cm.redistribution_us(comm, SHAPE, 2, ("P", "R"), dst)
    assert math.isinf(cm.redistribution_us(comm, SHAPE, 2, ("P(avg)", "R"), ("P", "R")))
    assert math.isinf(cm.redistribution_us(comm, SHAPE, 2, ("P", "R"), ("P(avg)", "R")))
    assert cm.redistribution_us(comm, SHAPE, 2, ("P(avg)", "R"), ("P(avg)", "R")) == 0


def test_single_steps_price_the_right_collective_on_the_right_buffer(comm):
    nbytes = SHAPE[0] * SHAPE[1] * 2
    # S -> R on axis 1 (4 ranks): all-gather of the full tensor (the other axis is R)
    assert cm.redistribution_us(comm, SHAPE, 2, ("R", "S(0)"), ("R", "R")) == \
        pytest.approx(comm.time_us("all_gather", nbytes, 1))
    # with axis 0 sharding dim 1, the group along axis 1 gathers half of the tensor
    assert cm.redistribution_steps(comm, SHAPE, 2, ("S(1)", "S(0)"), ("S(1)", "R")) == \
        [("all_gather", 1, nbytes // 2, pytest.approx(comm.time_us("all_gather", nbytes // 2, 1)))]
    # P -> R all-reduce, P -> S reduce-scatter of the whole buffer
    assert cm.redistribution_us(comm, SHAPE, 2, ("P", "R"), ("R", "R")) == \
        pytest.approx(comm.time_us("all_reduce", nbytes, 0))
    assert cm.redistribution_us(comm, SHAPE, 2, ("R", "P"), ("R", "S(1)")) == \
        pytest.approx(comm.time_us("reduce_scatter", nbytes, 1))
    # S(0) -> S(1): all-to-all of the local shard
    assert cm.redistribution_steps(comm, SHAPE, 2, ("R", "S(0)"), ("R", "S(1)")) == \
        [("all_to_all", 1, nbytes // 4, pytest.approx(comm.time_us("all_to_all", nbytes // 4, 1)))]


def test_uneven_shards_round_up(comm):
    # dim 0 of size 10 over 4 ranks: shards of 3 rows, padded gather of 12 rows
    steps = cm.redistribution_steps(comm, (10, 8), 4, ("R", "S(0)"), ("R", "R"))
    assert steps[0][:3] == ("all_gather", 1, 12 * 8 * 4)
    # nested: 10 -> ceil(10/2) = 5 rows per axis-0 group -> 4 x ceil(5/4) = 8 gathered
    steps = cm.redistribution_steps(comm, (10, 8), 4, ("S(0)", "S(0)"), ("S(0)", "R"))
    assert steps[0][:3] == ("all_gather", 1, 8 * 8 * 4)


def test_nested_sharding_goes_through_replicate(comm):
    nbytes = SHAPE[0] * SHAPE[1] * 2
    # (S(0), S(0)) -> (R, S(0)): the inner shard is nested inside the outer one, so
    # DTensor first gathers the inner axis (half buffer), then the outer (full buffer),
    # then slices locally
    steps = cm.redistribution_steps(comm, SHAPE, 2, ("S(0)", "S(0)"), ("R", "S(0)"))
    assert [(k, a, b) for k, a, b, _ in steps] == [("all_gather", 1, nbytes // 2), ("all_gather", 0, nbytes)]
    total = cm.redistribution_us(comm, SHAPE, 2, ("S(0)", "S(0)"), ("R", "S(0)"))
    assert total == pytest.approx(sum(s[3] for s in steps))
    # reduce-scatters from (P, P) go outer to inner without an intermediate replicate
    steps = cm.redistribution_steps(comm, SHAPE, 2, ("P", "P"), ("S(0)", "S(0)"))
    assert [(k, a, b) for k, a, b, _ in steps] == [("reduce_scatter", 0, nbytes), ("reduce_scatter", 1, nbytes // 2)]


PLACEMENTS = ["R", "P", "P(avg)", "S(0)", "S(1)"]


def _dtensor_plan(mesh_shape, shape, src, dst):
    """Steps of torch's own greedy redistribute planner (private API; a stand-in mesh and
    spec are enough for it): the independent truth for the order of steps."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    def conv(p):
        if p.startswith("P"):
            return Partial("avg") if p == "P(avg)" else Partial()
        return Replicate() if p == "R" else Shard(int(p[2:-1]))

    mesh = SimpleNamespace(ndim=len(mesh_shape), size=lambda mesh_dim: mesh_shape[mesh_dim],
                           _sym_get_coordinate=lambda i: 0)
    def spec(pl):
        pls = tuple(conv(p) for p in pl)
        return SimpleNamespace(shape=shape, placements=pls,
                               num_shards=math.prod(mesh_shape[i] for i, p in enumerate(pls) if isinstance(p, Shard)))
    planner = SimpleNamespace(device_mesh=mesh)
    infos = DTensorRedistributePlanner.generate_greedy_transform_infos(planner, spec(src), spec(dst))
    kinds = []
    for info in infos:
        a, b = info.src_dst_placements
        if b.is_partial():
            kinds.append(("forbidden", info.mesh_dim))
            break
        if a.is_replicate():
            continue  # local slice
        kind = ("all_reduce" if b.is_replicate() else "reduce_scatter") if a.is_partial() else \
            ("all_gather" if b.is_replicate() else "all_to_all")
        kinds.append((kind, info.mesh_dim))
    return kinds


@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 2, 2)])
def test_step_order_matches_dtensor(mesh_shape):
    comm = cm.NCCLCollectives(cm.Topology(mesh_shape, "h100"))
    shape = (64, 32)
    n = 0
    for src in itertools.product(PLACEMENTS, repeat=len(mesh_shape)):
        for dst in itertools.product(PLACEMENTS, repeat=len(mesh_shape)):
            ours = [(k, a) for k, a, _, _ in cm.redistribution_steps(comm, shape, 4, src, dst)]
            assert ours == _dtensor_plan(mesh_shape, shape, src, dst), (src, dst)
            n += 1
    assert n == len(PLACEMENTS) ** (2 * len(mesh_shape))


def test_cache_lives_on_the_comm_object(comm):
    other = cm.NCCLCollectives(comm.topo)
    cm.redistribution_us(comm, SHAPE, 2, ("S(0)", "S(1)"), ("S(0)", "R"))
    cm.redistribution_us(comm, SHAPE, 2, ("S(0)", "S(1)"), ("S(0)", "R"))
    info = comm.redistribution_cache.cache_info()
    assert info.hits >= 1 and info.currsize == 1
    assert other.redistribution_cache is None


def test_works_with_any_comm_model_and_calibration(comm):
    class Flat:
        mesh_shape = (2, 4)

        def time_us(self, kind, nbytes, axis):
            return 1.0 + nbytes / 1e6

    assert cm.redistribution_us(Flat(), SHAPE, 2, ("P", "R"), ("R", "R")) == pytest.approx(1.0 + 8.388608)
    cal = cm.CalibratedCollectives(comm, cm.Calibration())
    assert cm.redistribution_us(cal, SHAPE, 2, ("P", "R"), ("R", "R")) == \
        pytest.approx(cm.redistribution_us(comm, SHAPE, 2, ("P", "R"), ("R", "R")))


def test_bad_placements(comm):
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        cm.redistribution_us(comm, SHAPE, 2, ("R",), ("S(0)",))
    with pytest.raises(ValueError, match="shards dim 2 of a 2-d tensor"):
        cm.redistribution_us(comm, SHAPE, 2, ("R", "R"), ("S(2)", "R"))
    with pytest.raises(ValueError, match="bad placement 'Shard"):
        cm.redistribution_us(comm, SHAPE, 2, ("R", "R"), ("Shard(0)", "R"))


# ------------------------------------------------------------------ whole-edge matrices
def _random_block(rng, mesh_shape, ndim, n):
    tokens = ["R", "P", "P(avg)"] + [f"S({d})" for d in range(ndim)]
    every = list(itertools.product(tokens, repeat=len(mesh_shape)))
    return rng.sample(every, min(n, len(every)))


@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 4), (1, 8), (4, 2, 4), (3, 1, 2),
                                        (2, 2, 2, 4), (2, 1, 3, 2)])
def test_matrix_equals_scalar_prices_bit_for_bit(mesh_shape):
    """The vectorised block pricing against the scalar step-by-step reference, on random
    placement pairs, shapes with uneven / size-1 dims and item sizes."""
    import random

    import numpy as np

    from costmodels.redistribution import redistribution_matrix

    rng = random.Random(hash(mesh_shape) & 0xFFFF)
    comm = cm.NCCLCollectives(cm.Topology(mesh_shape, cm.device("h100"), gpus_per_node=8))
    n_inf = n_pos = 0
    for _ in range(6):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.choice([1, 3, 7, 8, 12, 64, 100, 2048, 4096]) for _ in range(ndim))
        itemsize = rng.choice([1, 2, 4])
        srcs = _random_block(rng, mesh_shape, ndim, 40)
        dsts = _random_block(rng, mesh_shape, ndim, 40)
        got = redistribution_matrix(comm, shape, itemsize, srcs, dsts)
        want = np.array([[cm.redistribution_us(comm, shape, itemsize, s, d) for d in dsts] for s in srcs])
        assert got.shape == (len(srcs), len(dsts))
        bad = np.argwhere(got != want)
        assert len(bad) == 0, [(srcs[a], dsts[b], got[a, b], want[a, b]) for a, b in bad[:3]]
        n_inf += int(np.isinf(want).sum())
        n_pos += int(((want > 0) & np.isfinite(want)).sum())
    assert n_inf > 0 and n_pos > 0  # both forbidden and priced pairs were exercised


def test_matrix_exhaustive_on_a_small_mesh_and_cache_reuse():
    import numpy as np

    from costmodels.redistribution import redistribution_matrix

    comm = cm.NCCLCollectives(cm.Topology((2, 2, 2), "h100"))
    every = list(itertools.product(PLACEMENTS, repeat=3))
    for shape in [(64, 32), (5, 3)]:
        want = np.array([[cm.redistribution_us(comm, shape, 2, s, d) for d in every] for s in every])
        assert np.array_equal(redistribution_matrix(comm, shape, 2, every, every), want)
    # the shape-free step table of the block is kept on the comm object and reused
    cache = comm.redistribution_matrix_cache
    assert len(cache.blocks) == 1 and cm.NCCLCollectives(comm.topo).redistribution_matrix_cache is None


def test_matrix_with_any_comm_model_and_bad_input():
    import numpy as np

    from costmodels.redistribution import redistribution_matrix

    class Slotted:  # refuses the cache attribute: priced without reuse
        __slots__ = ()
        mesh_shape = (2, 4)

        def time_us(self, kind, nbytes, axis):
            return 1.0 + nbytes / 1e6

    srcs, dsts = [("P", "R"), ("S(0)", "S(1)")], [("R", "R"), ("R", "P"), ("S(1)", "S(0)")]
    want = np.array([[cm.redistribution_us(Slotted(), SHAPE, 2, s, d) for d in dsts] for s in srcs])
    assert np.array_equal(redistribution_matrix(Slotted(), SHAPE, 2, srcs, dsts), want)
    assert redistribution_matrix(Slotted(), SHAPE, 2, [], dsts).shape == (0, 3)
    comm = cm.NCCLCollectives(cm.Topology((2, 4), "h100"))
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        redistribution_matrix(comm, SHAPE, 2, [("R",)], [("R", "R")])
    with pytest.raises(ValueError, match="shards dim 2 of a 2-d tensor"):
        redistribution_matrix(comm, SHAPE, 2, [("R", "R")], [("S(2)", "R")])
    with pytest.raises(ValueError, match="bad placement 'Shard"):
        redistribution_matrix(comm, SHAPE, 2, [("Shard(0)", "R")], [("R", "R")])


def test_cost_context_matrix_spreads_block_prices():
    """apmodel's edge matrix: duplicates and ``None`` (no tensor: free) entries."""
    import numpy as np
    import torch

    from apmodel.problem.pricing import CostContext

    mesh = (2, 4)
    comm = cm.NCCLCollectives(cm.Topology(mesh, "h100"))
    ctx = CostContext(mesh, compute=None, comm=comm)
    srcs = [("S(0)", "R"), None, ("P", "S(1)"), ("S(0)", "R")]
    dsts = [("R", "R"), ("R", "P"), None, ("S(1)", "S(0)"), ("R", "R")]
    got = ctx.redistribution_matrix((16, 4096), torch.float32, srcs, dsts)
    want = np.array([[0.0 if s is None or d is None else
                      cm.redistribution_us(comm, (16, 4096), 2, s, d) for d in dsts] for s in srcs])
    assert np.array_equal(got, want)  # priced in bf16 (2 bytes), the context's dtype
    assert got[0, 0] > 0 and np.isinf(got[0, 1]) and got[1].sum() == 0

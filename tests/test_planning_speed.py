"""The shortcuts that make planning fast at scale (issue 27) give the direct computation's results.

Truths: torch's own full-product expansion of single-dim rules followed by the per-strategy
rewrite and filters (as apmodel ran them before the coded expansion), torch's
``is_tensor_shardable``, a left-to-right running sum, and pricing every strategy's call one by one.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from apmodel import _torch_private as tp
from apmodel.candidates import expansion
from apmodel.candidates.strategies import (
    Ball,
    Strategy,
    _align_outputs,
    _ball_combos,
    _out_shapes,
    _unmask,
    enumerate_strategies,
)
from apmodel.candidates.strategy_filters import Filter, TensorChecks
from apmodel.core.options import PlanOptions
from apmodel.graph.capture import capture
from apmodel.models import build, config, sample_inputs
from apmodel.problem.pair_blocks import PairSum, distinct_blocks, joint_classes
from apmodel.problem.pricing import build_cost_context

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _arg(shape, nd, dtype=torch.float32, partial=False):
    """A tensor argument offered in every R / S(d) (and P) placement on an ``nd``-axis mesh."""
    t = torch.empty(shape, device="meta", dtype=dtype)
    opts = [R] + ([P] if partial else []) + [Shard(d) for d in range(len(shape))]
    return tp.TensorArg(tuple(shape), tuple(t.stride()), dtype, tuple(itertools.product(opts, repeat=nd)))


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _cases(nd):
    long = torch.int64
    return [
        (aten.mm.default, (_arg((64, 32), nd), _arg((32, 16), nd)), {}, _meta(64, 16)),
        (aten.mm.default, (_arg((6, 32), nd), _arg((32, 4), nd)), {}, _meta(6, 4)),  # small, uneven dims
        (aten.add.Tensor, (_arg((8, 4, 16), nd, partial=True), _arg((8, 4, 16), nd, partial=True)), {}, _meta(8, 4, 16)),
        (aten.mul.Tensor, (_arg((8, 16, 4), nd), _arg((4,), nd)), {}, _meta(8, 16, 4)),
        (aten.silu.default, (_arg((8, 16), nd),), {}, _meta(8, 16)),
        (aten.pow.Tensor_Scalar, (_arg((8, 16, 32), nd), 2), {}, _meta(8, 16, 32)),
        (aten.embedding.default, (_arg((64, 16), nd), _arg((8, 4), nd, long)), {}, _meta(8, 4, 16)),
        (aten.embedding_dense_backward.default, (_arg((8, 4, 16), nd), _arg((8, 4), nd, long), 64, -1, False), {},
         _meta(64, 16)),
    ]


def _reference(op, args, kwargs, out, mesh, checks, nd):
    """torch's full expansion, then per strategy: align, unmask, deduplicate, filter."""
    raw = tp.op_strategies(op, args, kwargs, out, mesh)
    out_shapes = _out_shapes(out)
    seen, kept = set(), []
    for outs, ins in raw:
        s = _unmask(Strategy(_align_outputs(outs, out_shapes, nd), tuple(ins)))
        if s not in seen:
            seen.add(s)
            if checks.keep(s):
                kept.append(s)
    return kept, len(raw)


FILTERS = [
    dict(allow_uneven=False, partial_inputs=True, partial_reduce_ops=("sum", "avg"), partial_input_ops=("sum",)),
    dict(allow_uneven=True, partial_inputs=False, partial_reduce_ops=("sum", "avg", "max", "min"),
         partial_input_ops=("sum", "avg")),
]


@pytest.mark.parametrize("ms", [(2, 2, 2, 4), (4, 8), (3,)])
@pytest.mark.parametrize("options", FILTERS)
def test_coded_expansion_is_torchs_expansion_filtered(ms, options):
    nd = len(ms)
    mesh = tp.fake_mesh(ms)
    f = Filter(ms, **options)
    for op, args, kwargs, out in _cases(nd):
        if tp.rule_kind(op) != "single_dim":
            continue
        out_shapes = _out_shapes(out)
        in_shapes = [a.shape for a in tp._collect_tensor_args((args, kwargs))]
        checks = TensorChecks(op, out_shapes, in_shapes, f)
        rule = tp.SingleDimRule(op, args, kwargs, out, mesh)
        assert rule.exact, op
        got = expansion.expand(rule, expansion.all_combinations(len(rule.entries), nd), len(out_shapes),
                               checks.output, checks.input)
        want, n_raw = _reference(op, args, kwargs, out, mesh, checks, nd)
        # repr: the same placements in the same order (DTensor's masked partial compares by identity)
        assert repr([Strategy(o, i) for o, i in got.strategies]) == repr(want), op
        assert got.raw == n_raw, op


def test_coded_expansion_within_a_ball():
    ms = (2, 2, 2, 4)
    nd = len(ms)
    mesh = tp.fake_mesh(ms)
    f = Filter(ms, False, True, ("sum", "avg"), ("sum",))
    op, args, kwargs, out = _cases(nd)[0]  # mm
    rule = tp.SingleDimRule(op, args, kwargs, out, mesh)
    out_shapes = _out_shapes(out)
    checks = TensorChecks(op, out_shapes, [a.shape for a in args], f)
    center = (Strategy(((Shard(0),),), ((Shard(0),), (R,))), Strategy(((R,),), ((R,), (R,))),
              Strategy(((Shard(1),),), ((R,), (Shard(1),))), Strategy(((P,),), ((Shard(1),), (Shard(0),))))
    for radius in (0, 1, 2):
        ball = Ball(center, radius)
        combos = _ball_combos(rule, ball, out_shapes)
        got = expansion.expand(rule, np.array(combos, dtype=np.int64).reshape(-1, nd), len(out_shapes),
                               checks.output, checks.input)
        seen, want = set(), []
        for outs, ins in rule.expand(combos):
            s = _unmask(Strategy(_align_outputs(outs, out_shapes, nd), tuple(ins)))
            if s not in seen:
                seen.add(s)
                if checks.keep(s):
                    want.append(s)
        assert want and [Strategy(o, i) for o, i in got.strategies] == want


def test_static_shardability_is_torchs():
    rng = random.Random(0)
    placements = [R, P, Partial("avg")] + [Shard(d) for d in range(4)]
    for _ in range(3000):
        ms = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 4)))
        mesh = tp.fake_mesh(ms)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 8, 64]) for _ in range(rng.randint(0, 3)))
        pl = tuple(rng.choice(placements) for _ in ms)
        spec = tp.DTensorSpec(mesh, pl, tp.TensorMeta(torch.Size(shape), (1,) * len(shape), torch.float32))
        want = tp._ops_utils.is_tensor_shardable(shape, spec)
        assert tp._static_shardable(shape, pl, ms) == want, (shape, pl, ms)


def _factored(rng, n_rows, n_cols, distinct_rows, distinct_cols, scale=1.0):
    """A random matrix as (block, rows, cols): ``distinct_rows`` x ``distinct_cols`` prices spread over
    ``n_rows`` x ``n_cols`` entries, with the dense matrix for reference."""
    block = rng.random((distinct_rows, distinct_cols)) * scale
    rows, cols = rng.integers(0, distinct_rows, n_rows), rng.integers(0, distinct_cols, n_cols)
    return (block, rows, cols), block[np.ix_(rows, cols)]


def test_pair_factors_count_repeated_matrices_once():
    rng = np.random.default_rng(0)
    (fa, a), (fb, b), (fc, c) = (_factored(rng, 300, 257, 9, 5, 1e3), _factored(rng, 257, 300, 4, 11, 1 / 7),
                                 _factored(rng, 300, 257, 3, 3))
    terms = [(fa, False), (fb, True), (fa, False), (fa, False), (fb, True)] * 7 + [(fc, False)]
    dense = {id(fa): a, id(fb): b, id(fc): c}
    want = a.copy()
    for f, transposed in terms[1:]:
        want = want + (dense[id(f)].T if transposed else dense[id(f)])
    pair = PairSum.of(terms)
    block = np.full((pair.block_shape[0] + 2, pair.block_shape[1] + 3), np.nan)  # written in place, as into a stack
    pair.write(block[: pair.block_shape[0], : pair.block_shape[1]])
    assert np.isnan(block[pair.block_shape[0]:]).all() and np.isnan(block[:, pair.block_shape[1]:]).all()
    assert pair.block_shape[0] * pair.block_shape[1] <= 9 * 4 * 3 * 5 * 11 * 3  # one entry per class pair, never more
    out = block[np.ix_(pair.row_class, pair.col_class)]
    np.testing.assert_allclose(out, want, rtol=1e-13)  # the term-by-term sum, up to its rounding
    np.testing.assert_array_equal(out, (21 * a + 14 * b.T) + c)  # each distinct matrix once, times its count
    one = PairSum.of([(fb, True)])
    block = np.empty(one.block_shape)
    one.write(block)
    np.testing.assert_array_equal(block[np.ix_(one.row_class, one.col_class)], b.T)


def test_pairs_summing_to_equal_blocks_share_one():
    """Pairs of other terms whose blocks come out equal (a matrix and its equal copy, another
    object) keep one block; every pair still reads its own sum, forbidden pairs included."""
    rng = np.random.default_rng(2)
    (fa, a), (fb, b) = _factored(rng, 40, 30, 6, 5, 10.0), _factored(rng, 40, 30, 3, 4)
    fa_copy = tuple(x.copy() for x in fa)  # equal, another object
    fa[0][0, 0] = np.inf  # a forbidden pair, in both
    fa_copy[0][0, 0] = np.inf
    a, a_copy = fa[0][np.ix_(fa[1], fa[2])], fa_copy[0][np.ix_(fa_copy[1], fa_copy[2])]
    pairs = [PairSum.of([(fa, False)]), PairSum.of([(fb, False)]), PairSum.of([(fa_copy, False)]),
             PairSum.of([(fa, False), (fb, False)])]
    want = [a, b, a_copy, a + b]
    ca = max(p.block_shape[0] for p in pairs)
    cb = max(p.block_shape[1] for p in pairs)
    blocks, block_of = distinct_blocks(pairs, ca, cb)
    assert block_of.tolist() == [0, 1, 0, 2] and len(blocks) == 3
    for pair, k, m in zip(pairs, block_of, want, strict=False):
        np.testing.assert_array_equal(blocks[k][np.ix_(pair.row_class, pair.col_class)], m)


def test_joint_classes_group_indices_labelled_alike_by_every_vector():
    rng = np.random.default_rng(1)
    for n, sizes in ((1, (1,)), (40, (3,)), (500, (4, 7, 2)), (300, (300, 300))):
        labels = [rng.integers(0, k, n) for k in sizes]
        classes, first = joint_classes(labels)
        # brute force: the tuple of an index's labels is its class
        tuples = [tuple(int(lab[i]) for lab in labels) for i in range(n)]
        assert len(set(tuples)) == len(first)
        for i in range(n):
            assert tuples[first[classes[i]]] == tuples[i]
        assert sorted(first.tolist()) == sorted(tuples.index(t) for t in set(tuples))  # the first of every class


def test_compute_prices_shared_by_equal_calls_are_each_strategys_own():
    cfg = config("llama3-debug", n_layers=1)
    with torch.device("meta"):
        model = build(cfg)
    captured = capture(model, sample_inputs(cfg, batch=4, seq=64))
    ms = (2, 2)
    cost = build_cost_context(ms, PlanOptions(device="h100", gpus_per_node=8))
    strategies = enumerate_strategies(captured.gm, ms, progress=False)
    checked = 0
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or node.name not in strategies or len(strategies[node.name]) < 4:
            continue
        strats = strategies[node.name]
        together = cost.compute_vector(node, strats)
        one_by_one = np.array([cost.compute_vector(node, [s])[0] for s in strats])
        assert np.array_equal(together, one_by_one), node.name
        checked += 1
    assert checked > 10


def test_captured_module_generates_its_code_on_first_use():
    def step(x, w):
        return (torch.relu(x @ w) * x.sum().detach()).sum()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return step(x, self.w)

    model = Tiny()
    x = torch.randn(3, 4)
    captured = capture(model, (x,), loss_fn=None)
    code = captured.gm.code  # generated now, for the simplified graph
    assert "detach" not in code and "def forward" in code
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    values = {n.name: None for n in placeholders}
    for name, fqn in captured.param_fqn.items():
        values[name] = model.get_parameter(fqn).detach()
    for name in captured.input_index:
        values[name] = x
    for name in values:
        if values[name] is None:  # the loss tangent
            values[name] = torch.ones(())
    out = captured.gm(*[values[n.name] for n in placeholders])
    torch.testing.assert_close(out[0], step(x, model.w).detach())


def test_group_pairs_with_the_same_terms_share_one_block():
    """Every pair's matrix is the sum of its graph edges' redistribution matrices (built here edge by
    edge, dense), although pairs whose terms are the same objects share one block."""
    from apmodel.entry.api import build_model

    cfg = config("llama3-debug", n_layers=2)
    with torch.device("meta"):
        model = build(cfg)
    pm = build_model(capture(model, sample_inputs(cfg, batch=4, seq=64)), (2, 2))
    problem = pm.compile()
    group_of = pm.compiled.grouping.group_of
    want: dict[tuple[int, int], np.ndarray] = {}
    for e in pm.edges:
        gu, gv = group_of[e.producer], group_of[e.consumer]
        if gu != gv:
            m = pm.edge_matrix(e)
            key = (min(gu, gv), max(gu, gv))
            want[key] = want[key] + (m.T if gu > gv else m) if key in want else (m.T if gu > gv else m)
    got = {(u, v): m for u, v, m in problem.edges}
    assert got.keys() == want.keys()
    for key, m in want.items():
        np.testing.assert_allclose(got[key], m, rtol=1e-12, err_msg=str(key))
    factored = [g.factors for g in problem.groups if g.factors is not None]
    assert len(factored) == len(problem.groups)
    assert sum(len(f.blocks) for f in factored) < problem.n_edges  # some pairs share a block

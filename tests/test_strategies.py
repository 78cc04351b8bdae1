"""Strategy enumeration (apmodel/candidates/strategies.py) and placement strings (apmodel/core/placements.py).

The independent truth for the semantic checks is a small SPMD simulator written here: it splits
real tensors into per-device pieces for a placement tuple, runs the op on each device's pieces,
and reassembles the global result from the output placement.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from apmodel import _torch_private as tp
from apmodel.candidates.strategies import (
    EXCLUDED,
    Strategy,
    StrategyCache,
    enumerate_strategies,
    fake_mesh,
    input_slots,
    node_strategies,
    placeholder_placements,
)
from apmodel.core.placements import from_str, is_even, local_shape, parse, to_str, tuple_to_str

aten = torch.ops.aten
R, P = Replicate(), Partial()


def S(d):
    return Shard(d)


# ------------------------------------------------------------------------------------------------
# placements


def test_placement_strings_round_trip():
    for s in ["R", "P", "S(0)", "S(12)", "P(avg)"]:
        assert to_str(from_str(s)) == s
    for s in ["S(0)S(1)", "RP", "S(0)RS(2)P", "S(0)S(0)S(0)S(0)"]:
        assert tuple_to_str(parse(s)) == s
    assert parse("S(0)R") == (Shard(0), Replicate())
    assert parse("S(0), R", ndim=2) == (Shard(0), Replicate())


@pytest.mark.parametrize("bad", ["", "X", "S(-1)", "S0", "S(0)Q", "s(0)", "S(a)"])
def test_malformed_placement_strings(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_wrong_token_count_and_types():
    with pytest.raises(ValueError, match="2 axes"):
        parse("RRR", ndim=2)
    with pytest.raises(TypeError):
        from_str(3)


def test_local_shape_and_evenness():
    assert local_shape((10, 7), "S(0)S(1)", (4, 2)) == (3, 4)  # ceil(10/4), ceil(7/2)
    assert local_shape((16, 8), (S(0), S(0)), (2, 4)) == (2, 8)
    assert local_shape((16, 8), "PR", (2, 4)) == (16, 8)
    assert is_even((16, 8), "S(0)S(1)", (4, 8))
    assert not is_even((6, 8), "S(0)R", (4, 8))
    with pytest.raises(ValueError):
        local_shape((4,), "S(1)", (2,))


# ------------------------------------------------------------------------------------------------
# an independent SPMD simulator (even shards only)


def _coords(ms):
    return list(itertools.product(*[range(k) for k in ms]))


def _distribute(x, pl, ms, gen):
    """Per-device local tensors of global x placed as pl; Partial splits values with random weights."""
    weights = [torch.rand(k, generator=gen, dtype=torch.float64) for k in ms]
    weights = [w / w.sum() for w in weights]
    out = {}
    for c in _coords(ms):
        t = x
        for axis, p in enumerate(pl):
            if isinstance(p, Shard):
                t = t.chunk(ms[axis], dim=p.dim)[c[axis]]
            elif isinstance(p, Partial):
                t = t * weights[axis][c[axis]]
        out[c] = t
    return out


def _collect(local, pl, ms):
    """Global tensor from per-device locals placed as pl (checks replicas agree)."""
    cur = dict(local)
    for axis in reversed(range(len(ms))):
        nxt = {}
        for c in {k[:axis] + k[axis + 1:] for k in cur}:
            parts = [cur[c[:axis] + (i,) + c[axis:]] for i in range(ms[axis])]
            p = pl[axis]
            if isinstance(p, Shard):
                nxt[c] = torch.cat(parts, dim=p.dim)
            elif isinstance(p, Partial):
                nxt[c] = sum(parts)
            else:
                for q in parts[1:]:
                    torch.testing.assert_close(q, parts[0])
                nxt[c] = parts[0]
        cur = nxt
    return cur[()]


def _check_semantics(fn, inputs, strategies, ms):
    gen = torch.Generator().manual_seed(0)
    want = fn(*inputs)
    for s in strategies:
        locals_ = [_distribute(x, pl, ms, gen) for x, pl in zip(inputs, s.inputs, strict=False)]
        outs = {c: fn(*[lx[c] for lx in locals_]) for c in _coords(ms)}
        got = _collect(outs, s.outputs[0], ms)
        torch.testing.assert_close(got, want, msg=lambda m, s=s: f"strategy {s}: {m}")


# ------------------------------------------------------------------------------------------------
# small graphs


def _graph(fn, *shapes):
    """make_fx graph of fn on meta tensors (a shape stands for a float32 tensor of that shape)."""
    return make_fx(fn)(*[s if isinstance(s, torch.Tensor) else torch.empty(s, device="meta") for s in shapes])


def _enumerate_node(gm, target, mesh, **kw):
    cache = StrategyCache()
    out = enumerate_strategies(gm, mesh, progress=False, cache=cache, **kw)
    node = next(n for n in gm.graph.nodes if n.target == target)
    return node, out[node.name], out, cache


@pytest.mark.parametrize("ms,n_no_partial_in,n_all", [((8,), 4, 6), ((4, 8), 16, 36), ((2, 2, 4), 64, 216)])
def test_mm_counts(ms, n_no_partial_in, n_all):
    gm = _graph(torch.mm, (64, 64), (64, 64))
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, ms, partial_inputs=False)
    assert len(strats) == n_no_partial_in  # docs/design.md, "Strategy counts": 4 / 16 / 64
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, ms)
    # the single-dim rule also offers P x R -> P and R x P -> P per axis: 6 per axis
    assert len(strats) == n_all
    assert len(set(strats)) == len(strats)


@pytest.mark.parametrize("ms,n_sum,n_any", [((8,), 5, 10), ((4, 8), 25, 82), ((2, 2, 4), 125, 634)])
def test_add_counts(ms, n_sum, n_any):
    if tp.rule_kind(aten.add.Tensor) == "op_strategy":
        # torch 2.11: add's full-mesh rule follows its inputs' candidates (R, S(0..2) per axis),
        # and these placeholders offer no partial
        n_sum = n_any = 4 ** len(ms)
    gm = _graph(torch.add, (64, 64, 64), (64, 64, 64))
    _, strats, _, _ = _enumerate_node(gm, aten.add.Tensor, ms)
    assert len(strats) == n_sum  # R, S(0..2), PxP->P per axis
    # With every Partial kind DTensor's rule offers (avg, max, min), the counts are those of
    # docs/design.md, "Strategy counts" (10 / 81 / 633 by hand) up to one combination on 2+ axes (sum and avg partials mix).
    _, strats, _, _ = _enumerate_node(gm, aten.add.Tensor, ms, partial_reduce_ops=("sum", "avg", "max", "min"),
                                      partial_input_ops=("sum", "avg", "max", "min"))
    assert len(strats) == n_any


@pytest.mark.parametrize("ms", [(2,), (2, 2)])
def test_mm_strategies_are_semantically_valid(ms):
    gm = _graph(torch.mm, (8, 8), (8, 8))
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, ms)
    want = {
        Strategy(((S(0),) * len(ms),), ((S(0),) * len(ms), (R,) * len(ms))),
        Strategy(((S(1),) * len(ms),), ((R,) * len(ms), (S(1),) * len(ms))),
        Strategy(((P,) * len(ms),), ((S(1),) * len(ms), (S(0),) * len(ms))),
        Strategy(((R,) * len(ms),), ((R,) * len(ms), (R,) * len(ms))),
    }
    assert want <= set(strats)
    if len(ms) == 2:  # Table 1 of the paper: FSDP+TP column layout, X (S0,R) W (R,S1) -> Y (S0,S1)
        assert Strategy(((S(0), S(1)),), ((S(0), R), (R, S(1)))) in strats
    a, b = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    _check_semantics(torch.mm, [a, b], strats, ms)


@pytest.mark.parametrize("ms", [(2,), (2, 2)])
def test_add_mul_silu_strategies_are_semantically_valid(ms):
    x = torch.randn(4, 8, dtype=torch.float64)
    y = torch.randn(4, 8, dtype=torch.float64)
    for fn, target, args in [(torch.add, aten.add.Tensor, (x, y)), (torch.mul, aten.mul.Tensor, (x, y)),
                             (lambda t: F.silu(t), aten.silu.default, (x,))]:
        gm = _graph(fn, *[a.shape for a in args])
        _, strats, _, _ = _enumerate_node(gm, target, ms)
        _check_semantics(fn, list(args), strats, ms)
        if target is aten.mul.Tensor and tp.rule_kind(target) == "single_dim":
            # P x R -> P is valid for mul, P x P is not offered (torch 2.11's full-mesh rule offers
            # partials only where an input's producer does, and these placeholders do not)
            assert Strategy(((P,) * len(ms),), ((P,) * len(ms), (R,) * len(ms))) in strats
            assert not any(all(isinstance(p, Partial) for p in pl) for s in strats for pl in s.inputs
                           if s.inputs[1] == s.inputs[0] == pl)
        if target is aten.silu.default:
            assert not any(isinstance(p, Partial) for s in strats for pl in s.inputs for p in pl)


def test_view_and_t_follow_every_producer_candidate():
    gm = _graph(lambda a: a.t().reshape(-1), (16, 8))
    out = enumerate_strategies(gm, (4,), progress=False)
    assert len(out["a_1"]) == 3  # R, S(0), S(1)
    if tp.rule_kind(aten.t.default) == "op_strategy":
        assert {s.inputs[0] for s in out["t"]} == {(R,), (S(0),), (S(1),)}
        assert len(out["t"]) == 3  # one per candidate, not a single follow-the-input strategy
    else:  # torch 2.14 on: t has a single-dim rule, which also passes partials through
        assert {s.inputs[0] for s in out["t"]} >= {(R,), (S(0),), (S(1),)}
        assert all(s.outputs[0] == tuple(S(1 - p.dim) if isinstance(p, Shard) else p for p in s.inputs[0])
                   for s in out["t"])
    view = next(k for k in out if "view" in k)  # make_fx writes clone + _unsafe_view
    assert (S(0),) in {s.outputs[0] for s in out[view]}


def test_placeholders_have_no_partial_and_are_filtered():
    assert set(placeholder_placements((8, 8), (2,))) == {(R,), (S(0),), (S(1),)}
    # dim 0 (6) is not divisible by 4: dropped unless uneven shards are allowed
    assert (S(0),) not in placeholder_placements((6, 8), (4,))
    assert (S(0),) in placeholder_placements((6, 8), (4,), allow_uneven=True)
    # dim 0 (2) smaller than the mesh degree (4): always dropped
    assert (S(0),) not in placeholder_placements((2, 8), (4,), allow_uneven=True)
    pls = placeholder_placements((8, 8), (2, 2))
    assert len(pls) == 9 and (S(0), S(0)) in pls
    assert not any(isinstance(p, Partial) for pl in pls for p in pl)


def test_uneven_filter_applies_to_op_strategies():
    gm = _graph(torch.mm, (6, 8), (8, 8))
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, (4,))
    assert not any(S(0) in pl for s in strats for pl in s.inputs[:1])
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, (4,), allow_uneven=True)
    assert any(s.inputs[0] == (S(0),) for s in strats)


def test_getitem_follows_producer_output():
    def f(x, w, b):
        return aten.native_layer_norm.default(x, [8], w, b, 1e-5)

    gm = _graph(f, (4, 4, 8), (8,), (8,))
    gm.graph.eliminate_dead_code()
    out = enumerate_strategies(gm, (2,), progress=False)
    ln = next(n for n in gm.graph.nodes if n.target == aten.native_layer_norm.default)
    getitems = [n for n in gm.graph.nodes if n.op == "call_function" and n.args and n.args[0] is ln]
    assert getitems
    for g in getitems:
        idx = g.args[1]
        assert input_slots(g) == [(ln, idx)]
        want = list(dict.fromkeys(s.outputs[idx] for s in out[ln.name]))
        assert [s.outputs[0] for s in out[g.name]] == want
        assert all(s.inputs == s.outputs for s in out[g.name])


@torch.library.custom_op("apmodel_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_unknown_op_gets_replicate_only_and_one_warning(caplog):
    gm = _graph(lambda x: torch.ops.apmodel_test.twice(torch.ops.apmodel_test.twice(x)), (8, 8))
    cache = StrategyCache()
    with caplog.at_level(logging.WARNING, logger="apmodel.candidates.strategies"):
        out = enumerate_strategies(gm, (2, 2), progress=False, cache=cache)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(nodes) == 2
    for n in nodes:
        assert out[n.name] == [Strategy(((R, R),), ((R, R),))]
    msgs = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert len(msgs) == 1 and "replicate" in msgs[0]
    assert cache.unsupported == {"apmodel_test.twice.default": 2}


def test_embedding_exclusion():
    assert any(ex.op == aten.embedding.default for ex in EXCLUDED)
    gm = _graph(lambda w, i: aten.embedding.default(w, i), (64, 16), torch.empty(4, 8, dtype=torch.long, device="meta"))
    _, strats, _, _ = _enumerate_node(gm, aten.embedding.default, (2, 2))
    assert strats
    assert not any(s.inputs[0] == (S(0), S(0)) for s in strats)
    assert any(s.inputs[0] == (S(0), R) for s in strats)  # one axis is fine
    assert tuple_to_str(next(s for s in strats if s.inputs[0] == (S(0), R)).outputs[0]) == "PR"
    _, strats1d, _, _ = _enumerate_node(gm, aten.embedding.default, (4,))
    assert any(s.inputs[0] == (S(0),) for s in strats1d)


def test_output_node_skipped_and_cache_reused():
    gm = _graph(lambda a, b: torch.mm(a, b) + torch.mm(b, a), (16, 16), (16, 16))
    cache = StrategyCache()
    out = enumerate_strategies(gm, (2, 2), progress=False, cache=cache)
    names = [n.name for n in gm.graph.nodes]
    assert set(out) == set(names) - {"output"}
    # the second mm has the same op, shapes and producer candidate sets as the first: reused
    assert cache.hits >= 1
    mm = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    assert out[mm[0].name] == out[mm[1].name]
    again = node_strategies(mm[1], fake_mesh((2, 2)), out, cache=cache)
    assert again == out[mm[1].name]
    with pytest.raises(ValueError, match="producer"):
        node_strategies(mm[1], fake_mesh((2, 2)), {})


def test_four_axis_mesh():
    gm = _graph(torch.mm, (16, 16), (16, 16))
    _, strats, _, _ = _enumerate_node(gm, aten.mm.default, (2, 2, 2, 2), partial_inputs=False)
    assert len(strats) == 4 ** 4


# ------------------------------------------------------------------------------------------------
# a joint forward/backward graph


class _Block(nn.Module):
    def __init__(self, d=32, h=64, heads=4):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.n1 = nn.RMSNorm(d)
        self.n2 = nn.RMSNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True)[0]
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.silu(self.w1(self.n2(x))))


class _Model(nn.Module):
    def __init__(self, n_layers=2, vocab=128, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n_layers))

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def _joint(n_layers=2):
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with torch.device("meta"):
        model = _Model(n_layers)
        tokens = torch.randint(0, 128, (8, 16))
    with contextlib.ExitStack() as stack:
        return aot_export_joint_with_descriptors(stack, model, (tokens,)).graph_module


@pytest.mark.parametrize("ms", [(8,), (2, 4)])
def test_joint_graph(ms):
    gm = _joint()
    cache = StrategyCache()
    out = enumerate_strategies(gm, ms, progress=False, cache=cache)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    assert len(out) == len(nodes)
    ops = {n.target for n in nodes}
    assert aten._scaled_dot_product_flash_attention_backward.default in ops
    # torch 2.15's rule for aten.unbind.int rejects these inputs (measured: the ops run replicated,
    # with a warning naming them); every other op has a working rule on every supported release
    known_gaps = {"aten.unbind.int"} if tp.torch_version() >= (2, 15) else set()
    assert set(cache.unsupported) <= known_gaps, cache.unsupported
    assert cache.hits > 0  # the second layer reuses the first's enumerations
    for n in nodes:
        strats = out[n.name]
        assert strats, n.name
        assert len(set(strats)) == len(strats)
        slots = input_slots(n) if n.op == "call_function" else []
        for s in strats:
            assert len(s.inputs) == len(slots)
            for (prod, idx), pl in zip(slots, s.inputs, strict=True):
                val = prod.meta["val"] if n.target.__name__ != "getitem" else prod.meta["val"][idx]
                assert pl is None or is_even(tuple(val.shape), pl, ms)
            # placements use the shared vocabulary only
            for pl in s.outputs + s.inputs:
                if pl is not None:
                    assert tuple_to_str(parse(tuple_to_str(pl))) == tuple_to_str(pl)
        if n.op == "placeholder":
            assert not any(isinstance(p, Partial) for s in strats for p in s.outputs[0])
    # attention can be batch-sharded (8 sequences), and head-sharded (4 heads) where an axis is <= 4
    sdpa = next(n for n in nodes if n.target == aten._scaled_dot_product_flash_attention.default)
    q_pls = {s.inputs[0] for s in out[sdpa.name]}
    assert any(S(0) in pl for pl in q_pls)
    assert any(S(1) in pl for pl in q_pls) == (min(ms) <= 4)

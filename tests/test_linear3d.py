"""Linear layers kept N-D (``apmodel/graph/linear3d.py``): the flattened ``view -> mm -> view`` of a
linear on a ``[batch, seq, feature]`` activation, and its backward matmuls, become ``mm_nd`` /
``mm_nd_wgrad`` at capture, whose sharding rules let batch, sequence and feature sharding combine.

Truths: eager single-device PyTorch (the captured joint graph run on CPU tensors; the tiny LLaMA
and a zoo model trained on 2x2 gloo, losses of 3 AdamW steps and every gradient of the first step,
rel 1e-5), and the plain ``torch.mm`` / ``einsum`` of the ops' definitions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apmodel
from apmodel.core.placements import tuple_to_str
from apmodel.graph.linear3d import MM_ND, MM_ND_WGRAD, as_mm_call, mm_nd_rule, mm_nd_wgrad_rule
from apmodel.lowering import capture_on_meta

from _dist_utils import run_distributed
from _helpers import assert_same_training, full_weights, losses_and_first_grads
from _tiny import fixed_tokens, tiny_llama
from zoo_models import ZOO

RTOL = 1e-5
STEPS = 3
FFN = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _targets(captured) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in captured.gm.graph.nodes:
        if n.op == "call_function":
            counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    return counts


def _tiny_captured():
    tokens, targets = fixed_tokens()
    return capture_on_meta(tiny_llama("meta"), (tokens,), _lm_loss, targets=(targets,))


# ------------------------------------------------------------------------- the rewrite
def test_every_linear_of_llama_is_kept_3d():
    counts = _targets(_tiny_captured())
    linears = 2 * 7 + 1  # two layers of q, k, v, o, w1, w2, w3, and the output projection
    assert counts.get("aten.mm.default", 0) == 0
    assert counts[str(MM_ND)] == 2 * linears  # forward and input gradient
    assert counts[str(MM_ND_WGRAD)] == linears


def test_ops_compute_their_definitions():
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(2, 3, 4, 5, generator=g), torch.randn(6, 5, generator=g)
    assert torch.allclose(MM_ND(a, w.t()), torch.einsum("...k,nk->...n", a, w), rtol=1e-6, atol=1e-6)
    gout = torch.randn(2, 3, 4, 6, generator=g)
    assert torch.allclose(MM_ND_WGRAD(gout, a), torch.einsum("...n,...k->nk", gout, a), rtol=1e-6, atol=1e-5)


def test_linears_on_2d_activations_are_left_as_they_are():
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    with torch.device("meta"):
        x = torch.empty(6, 8)
    counts = _targets(capture_on_meta(model.to("meta"), (x,), lambda y, _x: y.sum()))
    assert str(MM_ND) not in counts and str(MM_ND_WGRAD) not in counts
    assert counts["aten.mm.default"] == 5  # two forward, two weight gradients, one input gradient


def test_joint_graph_computes_the_eager_step_on_one_device():
    """The rewritten joint graph, run on CPU tensors, gives the loss and gradients of eager PyTorch."""
    case = next(c for c in ZOO if c.name == "tied_lm")
    args, _, targets = case.step_inputs()
    with torch.device("meta"):
        captured = capture_on_meta(case.build(), args, case.loss_fn, targets=targets)
    assert str(MM_ND_WGRAD) in _targets(captured)
    model = case.seeded()
    params = dict(model.named_parameters())
    flat = [*args, *targets]
    values = []
    for node in captured.gm.graph.find_nodes(op="placeholder"):
        role = captured.roles[node.name]
        if role == "param":
            values.append(params[captured.param_fqn[node.name]].detach())
        else:
            values.append(flat[captured.input_index[node.name]] if role == "input" else torch.ones(()))
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    got = {a.name: v for a, v in zip(out_node.args[0], captured.gm(*values), strict=True) if a is not None}
    loss = case.loss_fn(model(*args), *targets)
    loss.backward()
    loss_node = next(k for k, r in captured.roles.items() if r == "output")
    assert float(got[loss_node].detach()) == pytest.approx(float(loss.detach()), rel=RTOL)
    for pnode, gnode in captured.param_grad.items():
        want = params[captured.param_fqn[pnode]].grad
        assert float((got[gnode] - want).abs().max()) <= RTOL * float(want.abs().max()) + 1e-7, captured.param_fqn[pnode]


# ------------------------------------------------------------------------- rules and pricing
def _meta_spec(*shape: int) -> Any:
    return torch.empty(shape, device="meta")


def _rows(rows) -> set[tuple[str, ...]]:
    from apmodel.core.placements import to_str

    return {tuple(to_str(p) for p in (*out, *ins)) for out, ins in rows}


def test_sharding_rules_combine_batch_sequence_and_feature():
    fwd = _rows(mm_nd_rule(_meta_spec(8, 16, 32), _meta_spec(32, 64)))
    assert ("S(0)", "S(0)", "R") in fwd and ("S(1)", "S(1)", "R") in fwd  # batch, sequence
    assert ("P", "S(2)", "S(0)") in fwd and ("S(2)", "R", "S(1)") in fwd  # contraction, output feature
    wgrad = _rows(mm_nd_wgrad_rule(_meta_spec(8, 16, 64), _meta_spec(8, 16, 32)))
    assert {("P", "S(0)", "S(0)"), ("P", "S(1)", "S(1)"), ("S(0)", "S(2)", "R"), ("S(1)", "R", "S(2)")} <= wgrad


def test_priced_as_the_mm_it_replaces():
    a, b = torch.empty(4, 8, 32, device="meta"), torch.empty(64, 32, device="meta").t()
    op, args, out = as_mm_call(MM_ND, (a, b))
    assert op is torch.ops.aten.mm.default and [tuple(x.shape) for x in args] == [(32, 32), (32, 64)]
    assert args[1].stride() == b.stride() and tuple(out.shape) == (32, 64)
    g = torch.empty(4, 8, 64, device="meta")
    op, args, out = as_mm_call(MM_ND_WGRAD, (g, a))
    assert [tuple(x.shape) for x in args] == [(64, 32), (32, 32)] and tuple(out.shape) == (64, 32)
    assert as_mm_call(torch.ops.aten.add.Tensor, (a, a)) is None


def test_sequence_and_batch_sharded_ffn_is_a_plan():
    """``(S(0), S(1))`` on every FFN projection's output: a plan on 2x2 holds it (h100 prices)."""
    captured = _tiny_captured()
    constraints = [apmodel.fix_output(m, "S0,S1") for m in FFN]
    plan = apmodel.plan(captured, (2, 2), device="h100", constraints=constraints)
    nodes = [n for n in captured.gm.graph.nodes if n.target is MM_ND and not captured.is_backward[n.name]
             and any(str(p).endswith(FFN) for p, _ in n.meta["nn_module_stack"].values())]
    assert len(nodes) == 6
    assert all(tuple_to_str(plan.node_strategy[n.name].outputs[0]) == "S(0)S(1)" for n in nodes)


# ------------------------------------------------------------------------- 2x2 gloo
def _ffn_redistributions(model: nn.Module, captured_nodes: dict[str, Any]) -> list[Any]:
    """The redistributions of N-D activations the native program issued between two nodes of
    the FFN (into it and out of it are the plan's business)."""
    from apmodel.lowering import issued_redistributions

    def in_ffn(name: str) -> bool:
        node = captured_nodes.get(name)
        if node is None:
            return False
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        return any(".feed_forward" in str(p) for p, _ in stack.values())

    return [r for r in issued_redistributions(model)
            if in_ffn(r.consumer) and in_ffn(r.producer) and len(r.global_shape) == 3]


def _ffn_gradients_s0s1(model: Any) -> None:
    """The FFN's backward keeps ``(S(0), S(1))`` too: every 3-D gradient computed in it."""
    for node in model.nodes:
        stack = node.meta.get("fwd_nn_module_stack") or {}
        val = node.meta.get("val")
        if (model.captured.is_backward.get(node.name) and node.op == "call_function" and getattr(val, "ndim", 0) == 3
                and any(".feed_forward" in str(p) for p, _ in stack.values())):
            model.restrict(node.name, lambda s: model.output_strs(s) == ("S(0)", "S(1)"), "test: FFN gradients S0,S1")


def _train(model: nn.Module, call) -> dict[str, Any]:
    return losses_and_first_grads(model, call, STEPS)


def _meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _gloo_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    full = full_weights(tiny_llama("cpu"))
    out: dict[str, Any] = {}

    def llama(**plan_args) -> nn.Module:
        with torch.device("meta"):
            model = tiny_llama("meta")
        model = apmodel.parallelize(model, mesh, (_meta(tokens),), loss_fn=_lm_loss, targets=(_meta(targets),),
                                    device="h100", **plan_args)
        model.to_empty(device="cpu")
        apmodel.lowering.load_full_state_dict(model, full)
        return model

    model = llama()
    out["llama"] = _train(model, lambda m: m(tokens, targets))
    model = llama(constraints=[*(apmodel.fix_output(m, "S0,S1") for m in ("ffn_norm", *FFN)), _ffn_gradients_s0s1])
    out["llama-ffn-s0s1"] = _train(model, lambda m: m(tokens, targets))
    captured = model._apmodel_program.captured
    out["ffn-redistributions"] = [(r.producer, r.consumer, r.src, r.dst)
                                  for r in _ffn_redistributions(model, {n.name: n for n in captured.gm.graph.nodes})]
    out["ffn-nodes"] = sum(1 for n in captured.gm.graph.nodes if n.target in (MM_ND, MM_ND_WGRAD))

    case = next(c for c in ZOO if c.name == "tied_lm")
    args, _, tgts = case.step_inputs()
    weights = full_weights(case.seeded())
    with torch.device("meta"):
        zoo = case.build()
    zoo = apmodel.parallelize(zoo, mesh, tuple(map(_meta, args)), loss_fn=case.loss_fn,
                              targets=tuple(map(_meta, tgts)), device="h100")
    zoo.to_empty(device="cpu")
    apmodel.lowering.load_full_state_dict(zoo, weights)
    out["tied_lm"] = _train(zoo, lambda m: m(*args, *tgts))
    return out


def _eager_llama() -> dict[str, Any]:
    tokens, targets = fixed_tokens()
    model = tiny_llama("cpu")
    return _train(model, lambda m: _lm_loss(m(tokens), targets))


def _eager_zoo() -> dict[str, Any]:
    case = next(c for c in ZOO if c.name == "tied_lm")
    args, _, tgts = case.step_inputs()
    return _train(case.seeded(), lambda m: case.loss_fn(m(*args), *tgts))


@pytest.fixture(scope="module")
def gloo() -> dict[str, Any]:
    return run_distributed(_gloo_worker, 4, timeout_s=900)[0]


def _assert_trains_like(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert_same_training(got, want, name, RTOL)


@pytest.mark.slow
def test_llama_on_2x2_trains_like_one_device(gloo):
    want = _eager_llama()
    _assert_trains_like(gloo["llama"], want, "llama")


@pytest.mark.slow
def test_sequence_and_batch_sharded_ffn_trains_like_one_device_without_redistribution(gloo):
    _assert_trains_like(gloo["llama-ffn-s0s1"], _eager_llama(), "llama (S0,S1) FFN")
    assert gloo["ffn-nodes"] > 0
    assert gloo["ffn-redistributions"] == [], gloo["ffn-redistributions"]


@pytest.mark.slow
def test_zoo_model_on_2x2_trains_like_one_device(gloo):
    _assert_trains_like(gloo["tied_lm"], _eager_zoo(), "tied_lm")


# ------------------------------------------------------------------------- the paper's plans
def test_paper_plans_are_eleven_distinct_constraint_sets():
    import json

    from _helpers import ROOT, benchmark_script

    paper = benchmark_script("paper_plans")
    table = json.loads((ROOT / "benchmarks" / "data" / "paper_table6_plans.json").read_text())
    assert "Table 6" in table["source"]
    for differing in (False, True):
        sets = paper.constraint_sets(table["plans"], 2, differing)
        assert list(sets) == [f"p{i:02d}" for i in range(11)] and sets["p00"] == {}
        assert len({frozenset(f.items()) for f in sets.values()}) == 11
    sets = paper.constraint_sets(table["plans"], 2, True)  # the pairs the flattened graph could not tell apart
    assert sets["p01"] != sets["p03"] and sets["p02"] != sets["p04"]
    assert sets["p01"]["layers.*.feed_forward.w2"] == ("P", "S(1)")


@pytest.mark.slow
def test_paper_plans_solve_with_every_fixed_output_held(tmp_path):
    import json

    from _helpers import benchmark_script

    out = tmp_path / "plans.json"
    assert benchmark_script("paper_plans").main(["--seq", "128", "--layers", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["plan"] for r in rows] == [f"p{i:02d}" for i in range(11)]
    assert all(r["fixes_held"] and r["objective_us"] > 0 for r in rows)


# ------------------------------------------------------------------------- strategies, enumerated
def _enumerated(target: Any, shapes: list[tuple[int, ...]], mesh: tuple[int, ...], **kw: Any) -> list[Any]:
    from torch.fx.experimental.proxy_tensor import make_fx

    from apmodel.candidates.strategies import StrategyCache, enumerate_strategies

    gm = make_fx(target)(*[torch.empty(s, device="meta") for s in shapes])
    out = enumerate_strategies(gm, mesh, progress=False, cache=StrategyCache(), **kw)
    return out[next(n.name for n in gm.graph.nodes if n.target == target)]


def _local(x: torch.Tensor, placements: Any, coord: tuple[int, ...], mesh: tuple[int, ...]) -> torch.Tensor:
    """Rank ``coord``'s shard of ``x``: chunks for S(d); a partial sum held whole by rank 0 of its axis."""
    from torch.distributed.tensor import Partial, Shard

    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            x = x.chunk(mesh[axis], dim=p.dim)[coord[axis]]
        elif isinstance(p, Partial):
            x = x if coord[axis] == 0 else torch.zeros_like(x)
    return x


def _global(locals_: dict, placements: Any, mesh: tuple[int, ...]) -> torch.Tensor:
    """The value per-rank outputs placed as ``placements`` hold (innermost axis first)."""
    from torch.distributed.tensor import Partial, Shard

    cur = dict(locals_)
    for axis in reversed(range(len(mesh))):
        nxt = {}
        for c in {k[:axis] + k[axis + 1:] for k in cur}:
            parts = [cur[c[:axis] + (i,) + c[axis:]] for i in range(mesh[axis])]
            p = placements[axis]
            nxt[c] = torch.cat(parts, p.dim) if isinstance(p, Shard) else sum(parts) if isinstance(p, Partial) else parts[0]
        cur = nxt
    return cur[()]


@pytest.mark.parametrize("target, shapes", [(MM_ND, [(4, 4, 8), (8, 4)]), (MM_ND_WGRAD, [(4, 4, 4), (4, 4, 8)])])
def test_every_enumerated_strategy_computes_the_op(target, shapes):
    """On a 2x2 mesh: the counts of DTensor's mm rule (R, each free dim, the contraction, per axis;
    here 5 per axis without partial inputs), and every strategy run on local shards gives the op's value."""
    import itertools

    mesh = (2, 2)
    strategies = _enumerated(target, shapes, mesh, partial_inputs=False)
    assert len(strategies) == len(set(strategies)) == 25
    assert len(_enumerated(target, shapes, mesh)) > 25  # with partial inputs: the linearity rows
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    want = target(*inputs)
    for s in strategies:
        coords = list(itertools.product(*map(range, mesh)))
        outs = {c: target(*[_local(x, p, c, mesh) for x, p in zip(inputs, s.inputs, strict=True)]) for c in coords}
        torch.testing.assert_close(_global(outs, s.outputs[0], mesh), want, msg=lambda m, s=s: f"{s}: {m}")

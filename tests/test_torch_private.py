"""Conformance of the private torch DTensor APIs apmodel relies on (apmodel/_torch_private.py).

If a torch upgrade moves or changes these, this file says what broke.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from apmodel import _torch_private as tp

aten = torch.ops.aten


def _cands(shape, nd):
    opts = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return tuple(itertools.product(opts, repeat=nd))


def _arg(shape, nd, dtype=torch.float32):
    t = torch.empty(shape, device="meta", dtype=dtype)
    return tp.TensorArg(tuple(shape), tuple(t.stride()), dtype, _cands(shape, nd))


def test_registries_exist_and_hold_the_ops_we_use():
    regs = tp.registries()
    assert set(regs) == {"op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"}
    full, single = regs["op_strategy_funcs"], regs["op_single_dim_strategy_funcs"]
    # Full-mesh / single-dim rules: torch 2.11 ~580 / 4 (mm, bmm, addmm, baddbmm); 2.13 ~160 /
    # ~1000 (pointwise, embedding, norms moved); 2.14 and 2.15: 19 / ~1220 (all but view-like ops).
    assert len(full) + len(single) > 500
    used = (aten.mm.default, aten.view.default, aten.t.default, aten.sum.default, aten._log_softmax.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_efficient_attention_backward.default,
            aten.add.Tensor, aten.mul.Tensor, aten.silu.default, aten.embedding.default,
            aten.embedding_dense_backward.default, aten._fused_rms_norm.default,
            aten._fused_rms_norm_backward.default, aten.native_layer_norm.default)
    for op in used:
        assert op in single or op in full, op
        assert tp.rule_kind(op) == ("single_dim" if op in single else "op_strategy"), op
    for op in (aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default):
        assert op in full, op  # view-like ops follow their input's placements on every release
    assert aten.mm.default in single
    if tp.torch_version() >= (2, 13):
        assert aten.add.Tensor in single and aten.embedding.default in single
    if tp.torch_version() >= (2, 14):
        assert aten.t.default in single and aten._scaled_dot_product_flash_attention.default in single
    assert tp.rule_kind(aten.mm.default) == "single_dim"  # torch's dispatcher prefers the single-dim rule
    assert tp.rule_kind(aten.view.default) == "op_strategy"
    assert tp.has_sharding_rule(aten.add.Tensor)
    assert not tp.has_sharding_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)


@pytest.mark.parametrize("shape", [(8,), (2, 4), (2, 2, 2), (2, 1, 2, 2)])
def test_fake_mesh_shapes_and_no_process_group(shape):
    was_initialized = torch.distributed.is_initialized()
    m1 = tp.fake_mesh(shape)
    m2 = tp.fake_mesh(shape)
    assert tuple(m1.shape) == tuple(m2.shape) == shape
    assert m1.device_type == "cpu" and m1.get_coordinate() == (0,) * len(shape)
    assert torch.distributed.is_initialized() == was_initialized  # planning installs no group


def test_fake_mesh_rejects_bad_shapes():
    with pytest.raises(ValueError, match="mesh_shape"):
        tp.fake_mesh((2, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="mesh_shape"):
        tp.fake_mesh((0, 2))


def test_single_dim_lookup_mm_counts():
    out = torch.empty(64, 64, device="meta")
    for ms, n in [((8,), 6), ((4, 8), 36)]:
        mesh = tp.fake_mesh(ms)
        a = _arg((64, 64), len(ms))
        got = tp.op_strategies(aten.mm.default, (a, a), {}, out, mesh)
        sums = {(o, i) for o, i in got
                if all(p.reduce_op == "sum" for pl in o + i for p in pl if isinstance(p, Partial))}
        # per axis: RxR->R, S0xR->S0, RxS1->S1, S1xS0->P, PxR->P, RxP->P (+ the same with Partial("avg"))
        assert len(sums) == n
        if len(ms) == 1:
            assert len(got) == 8  # P(avg) x R -> P(avg) and R x P(avg) -> P(avg)


def test_full_mesh_lookup_follows_all_input_candidates():
    mesh = tp.fake_mesh((4, 8))
    a = _arg((64, 32), 2)
    got = tp.op_strategies(aten.transpose.int, (a, 0, 1), {}, torch.empty(32, 64, device="meta"), mesh)
    # transpose follows its input: one strategy per candidate placement of the input (3 x 3)
    assert len(got) == 9
    for (out,), (inp,) in got:
        flip = tuple(Shard(1 - p.dim) if isinstance(p, Shard) else p for p in inp)
        assert out == flip


def test_zero_cost_patch_gives_same_strategies_and_restores():
    mesh = tp.fake_mesh((2, 4))
    a = _arg((16, 16), 2)
    out = torch.empty(16, 16, device="meta")
    original = tp._ops_utils.generate_redistribute_costs
    for op, args in [(aten.mm.default, (a, a)), (aten.view.default, (a, [256])), (aten.sum.dim_IntList, (a, [1]))]:
        o = out if op is not aten.view.default else torch.empty(256, device="meta")
        if op is aten.sum.dim_IntList:
            o = torch.empty(16, device="meta")
        fast = tp.op_strategies(op, args, {}, o, mesh)
        slow = tp.op_strategies(op, args, {}, o, mesh, with_torch_costs=True)
        assert fast == slow, op
    assert tp._ops_utils.generate_redistribute_costs is original


def test_sdpa_flash_rule_offers_head_and_batch_sharding():
    mesh = tp.fake_mesh((2,))
    q = tp.TensorArg((4, 8, 16, 32), (4096, 512, 32, 1), torch.float32, _cands((4, 8, 16, 32), 1))
    val = aten._scaled_dot_product_flash_attention.default(
        *(torch.empty(4, 8, 16, 32, device="meta"),) * 3, 0.0, True)
    got = tp.op_strategies(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, True), {}, val, mesh)
    ins = {i for _, i in got}
    assert ((Shard(1),),) * 3 in ins  # heads
    assert ((Shard(0),),) * 3 in ins  # batch
    assert ((Replicate(),),) * 3 in ins
    assert not any(isinstance(p, Partial) for _, i in got for pl in i for p in pl)


_REAL_PG_SCRIPT = r"""
import os, tempfile, torch, torch.distributed as dist
from apmodel import _torch_private as tp
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
pg = dist.group.WORLD
mesh = tp.fake_mesh((2, 2))
assert tuple(mesh.shape) == (2, 2)
assert dist.group.WORLD is pg and dist.get_backend() == "gloo" and dist.get_world_size() == 1
t = torch.ones(3)
dist.all_reduce(t)  # the real group still works
assert t.tolist() == [1.0, 1.0, 1.0]
from torch.distributed.tensor.placement_types import Replicate, Shard
a = tp.TensorArg((8, 8), (8, 1), torch.float32, ((Replicate(),) * 2,))
assert len(tp.op_strategies(torch.ops.aten.mm.default, (a, a), {}, torch.empty(8, 8, device="meta"), mesh)) > 4
dist.destroy_process_group()
print("OK")
"""


_PLAN_THEN_GLOO_SCRIPT = r"""
import os, tempfile, torch, torch.distributed as dist
import apmodel
from apmodel.models import build, config, sample_inputs
cfg = dict(n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=8)
with torch.device("meta"):
    model = build("llama3-debug", **cfg)
inputs = sample_inputs(config("llama3-debug", **cfg), 4, 8, device="meta")
for _ in range(2):
    apmodel.plan(model, (2, 2), inputs)
    assert not dist.is_initialized(), "planning left a default process group behind"
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
assert dist.get_backend() == "gloo" and dist.get_world_size() == 1 and dist.get_rank() == 0
t = torch.ones(2)
dist.all_reduce(t)
dist.destroy_process_group()
print("OK")
"""


def _run_script(script: str) -> None:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_fake_mesh_leaves_a_real_process_group_alone():
    _run_script(_REAL_PG_SCRIPT)


def test_planning_twice_then_gloo_init_in_one_process():
    _run_script(_PLAN_THEN_GLOO_SCRIPT)


def test_norm_backward_pairs_statistics_with_the_input_and_replicates_the_weights():
    # torch 2.11's full-mesh rule pairs candidates by index; every release must still offer only
    # strategies whose mean/rstd follow the input and whose weight/bias are replicated
    mesh = tp.fake_mesh((2, 2))
    x, stat, w = _arg((4, 8, 16), 2), _arg((4, 8, 1), 2), _arg((16,), 2)
    out = aten.native_layer_norm_backward.default(
        *(torch.empty(4, 8, 16, device="meta"),) * 2, [16], *(torch.empty(4, 8, 1, device="meta"),) * 2,
        *(torch.empty(16, device="meta"),) * 2, [True, True, True])
    got = tp.op_strategies(aten.native_layer_norm_backward.default, (x, x, [16], stat, stat, w, w, [True, True, True]),
                           {}, out, mesh)
    ins = {i[1] for _, i in got}
    assert {(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Replicate(), Replicate())} <= ins
    for _, (g, inp, mean, rstd, weight, bias) in got:
        assert g == inp == mean == rstd and Shard(2) not in inp
        assert weight == bias == (Replicate(), Replicate())


def test_a_missing_torch_feature_names_the_release_and_the_piece():
    with pytest.raises(tp.MissingTorchFeature, match=re.escape(f"torch {torch.__version__} has no torch.nope.thing (the piece)")):
        tp._torch_feature("torch.nope", "thing", "the piece")
    assert tp.ParamAOTInput.__name__ == "ParamAOTInput"  # resolved on first use
    with pytest.raises(AttributeError):
        tp.no_such_name  # noqa: B018
    assert tp.torch_version() >= (2, 11)
    assert torch.__version__ in tp.no_rule_reason(aten.convolution.default)


def test_data_dependent_errors_are_recognised():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    assert tp.is_data_dependent_error(GuardOnDataDependentSymNode(None, "u0 > 0"))
    assert not tp.is_data_dependent_error(RuntimeError("shape mismatch"))

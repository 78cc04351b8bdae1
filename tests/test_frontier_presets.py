"""Today's largest presets: LLaMA-3.1 405B, Qwen3-32B (QK-norm, 128-wide heads on a 5120 model),
Qwen3-235B-A22B (128 experts, top-8 renormalised, no shared expert).

Each builds on the meta device with its published parameter count and plans; tiny configurations
of the new architecture features train on a 2x2 gloo mesh as the same model does on one process
(3 AdamW steps, losses within 1e-5 relative), and the renormalised sparse routing equals its dense
reference on one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import apmodel
from apmodel.models import build, config

from _dist_utils import run_distributed
from _helpers import full_weights, train
from _tiny import TINY, fixed_tokens, tiny_model

STEPS = 3
LOSS_RTOL = 1e-5

#: (preset, published parameters in billions, tolerance): Meta's and Qwen's model cards
PUBLISHED = [("llama3-405b", 405.9, 0.01), ("qwen3-32b", 32.8, 0.01), ("qwen3-235b-a22b", 235.1, 0.01)]

#: tiny configurations of the new features: heads wider than dim / n_heads, QK-norm, renormalised
#: top-k routing without a shared expert
TINY_QWEN = dict(TINY, attention_head_dim=16, qk_norm=True)
TINY_QWEN_MOE = dict(TINY, attention_head_dim=16, qk_norm=True, moe_hidden_dim=16, n_routed_experts=4, top_k=2,
                     n_shared_experts=0, n_dense_layers=0, renormalize_topk=True)
CASES = {"qwen3": ("qwen3-32b", TINY_QWEN), "qwen3-moe": ("qwen3-235b-a22b", TINY_QWEN_MOE)}


@pytest.mark.parametrize("preset,billions,rel", PUBLISHED)
def test_presets_build_on_meta_with_their_published_sizes(preset, billions, rel):
    with torch.device("meta"):
        model = build(preset)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=rel)


def test_qwen3_attention_has_its_own_head_width_and_qk_norm():
    cfg = config("qwen3-32b")
    assert cfg.head_dim == 128 and cfg.dim // cfg.n_heads == 80
    with torch.device("meta"):
        model = build("qwen3-32b", n_layers=1)
    attn = model.layers["0"].attention
    assert tuple(attn.wq.weight.shape) == (64 * 128, 5120) and tuple(attn.q_norm.weight.shape) == (128,)


def test_renormalised_sparse_routing_equals_its_dense_reference():
    sparse = tiny_model("qwen3-235b-a22b", "cpu", **TINY_QWEN_MOE)
    dense = tiny_model("qwen3-235b-a22b", "cpu", **TINY_QWEN_MOE, routing="dense")
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(2, 8, TINY["dim"], generator=torch.Generator().manual_seed(1))
    a, b = sparse.layers["0"].moe(x), dense.layers["0"].moe(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and a.abs().max() > 0
    # renormalising changes the function: each token's gates sum to one (not without it)
    gates = dense.layers["0"].moe.gate_weights(x.flatten(0, 1))
    assert torch.allclose(gates.sum(-1), torch.ones(16))
    plain = tiny_model("qwen3-235b-a22b", "cpu", **dict(TINY_QWEN_MOE, renormalize_topk=False), routing="dense")
    plain.load_state_dict(sparse.state_dict())
    assert (plain.layers["0"].moe.gate_weights(x.flatten(0, 1)).sum(-1) < 1 - 1e-3).all()


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    out = {}
    for name, (preset, fields) in CASES.items():
        weights = full_weights(tiny_model(preset, "cpu", **fields))
        model = apmodel.parallelize(tiny_model(preset, "meta", **fields), mesh, (tokens.to("meta"), targets.to("meta")),
                                    device="h100")
        model.to_empty(device="cpu")
        load_full_state_dict(model, weights)
        out[name] = train(model, lambda m: m(tokens, targets), STEPS)
    return out


@pytest.mark.slow
def test_tiny_qwen3_models_train_on_a_2x2_mesh_like_one_device():
    got = run_distributed(_worker, 4, timeout_s=600)[0]
    tokens, targets = fixed_tokens()
    for name, (preset, fields) in CASES.items():
        want = train(tiny_model(preset, "cpu", **fields), lambda m: m(tokens, targets), STEPS)
        for step, (a, b) in enumerate(zip(got[name], want, strict=False)):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (name, step, a, b)


@pytest.mark.parametrize("preset", [name for name, _, _ in PUBLISHED])
def test_presets_plan_with_their_full_widths(preset):
    # two layers at full width (every layer is the same): the planner shards every weight matrix
    from apmodel.models import sample_inputs

    with torch.device("meta"):
        model = build(preset, n_layers=2)
    plan = apmodel.plan(model, (2, 4), sample_inputs(config(preset, n_layers=2), 8, 512), device="h100")
    assert plan.objective_us > 0 and plan.comm_us > 0
    matrices = {f: p for f, p in plan.param_placements.items() if "norm" not in f and "router" not in f}
    assert matrices and all("S(" in apmodel.core.placements.tuple_to_str(p) for p in matrices.values())

"""DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing, routed + shared experts)
and the routed experts' grouped GEMM.

Truths: the published parameter counts (DeepSeek-V3 report: 671B without its multi-token
prediction module; DeepSeek-V2-Lite's model card: 15.7B), attention written out head by head
from the report's equations, the routing written per token with Python sorting, the dense
routing (every expert on every token), a loop over experts, and the same model trained on one
process.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import apmodel
from apmodel._torch_private import grouped_mm_runs
from apmodel.models import build, config, sample_inputs
from apmodel.models.moe import ExpertGroups, RoutedExperts

from _dist_utils import run_distributed
from _helpers import full_weights, train
from _tiny import TINY, fixed_tokens, tiny_model

STEPS = 3
LOSS_RTOL = 1e-5

#: (preset, published parameters in billions, tolerance): DeepSeek-V3 report (671B total, the 14B
#: multi-token prediction module not included); DeepSeek-V2-Lite model card (15.7B), whose sizes
#: the 16B preset takes
PUBLISHED = [("deepseek-v3", 671.0, 0.002), ("deepseek-v3-16b", 15.7, 0.01)]

#: tiny DeepSeek-V3: compressed queries, values narrower than the query/key heads (padded for
#: the fused kernel), 4 experts in 2 groups (one kept per token), 2 per token, 1 shared
TINY_DSV3 = dict(TINY, n_kv_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, moe_hidden_dim=16, n_routed_experts=4, n_shared_experts=1, top_k=2, n_group=2,
                 topk_group=1, n_dense_layers=1, routed_scaling_factor=2.5)
#: routing with more choice: 16 experts in 4 groups, 2 groups kept, 4 per token
ROUTING = dict(TINY_DSV3, n_routed_experts=16, n_group=4, topk_group=2, top_k=4)


def _randomized(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter and the expert bias drawn at scale 0.3 (the real init's expert outputs are
    ~1e-3, too small for a comparison to mean much)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "bias" in n]:
            t.copy_(torch.randn(t.shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


@pytest.mark.parametrize("preset,billions,rel", PUBLISHED)
def test_presets_build_on_meta_with_their_published_sizes(preset, billions, rel):
    with torch.device("meta"):
        model = build(preset)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=rel)


def test_deepseek_v3_layers_have_the_published_widths():
    with torch.device("meta"):
        model = build("deepseek-v3", n_layers=4)
    attn, moe = model.layers["3"].attention, model.layers["3"].moe
    shapes = {n: tuple(p.shape) for n, p in attn.named_parameters()}
    assert shapes == {"wq_a.weight": (1536, 7168), "q_norm.weight": (1536,), "wq_b.weight": (128 * 192, 1536),
                      "wkv_a.weight": (512 + 64, 7168), "kv_norm.weight": (512,), "wkv_b.weight": (128 * 256, 512),
                      "wo.weight": (7168, 128 * 128)}
    assert tuple(moe.experts.w1.shape) == (256, 7168, 2048) and tuple(moe.expert_bias.shape) == (256,)
    assert tuple(moe.shared_experts.w1.weight.shape) == (2048, 7168)
    assert [layer.moe_enabled for layer in model.layers.values()] == [False, False, False, True]
    assert tuple(model.layers["0"].feed_forward.w1.weight.shape) == (18432, 7168)
    assert tuple(model.rope_cos.shape) == (4096, 64)  # RoPE on the decoupled 64-wide key only
    with torch.device("meta"):
        lite = build("deepseek-v3-16b", n_layers=1).layers["0"].attention
    assert lite.wq is not None and tuple(lite.wq.weight.shape) == (16 * 192, 2048) and not hasattr(lite, "wq_a")


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="n_group=3 does not divide n_routed_experts=8"):
        config("deepseek-v3-debug", n_group=3)
    with pytest.raises(ValueError, match="top_k=5 experts cannot be chosen from topk_group=2 groups of 2"):
        config("deepseek-v3-debug", top_k=5)
    with pytest.raises(ValueError, match="v_head_dim=64 wider than the query/key heads"):
        config("deepseek-v3-debug", v_head_dim=64)
    with pytest.raises(ValueError, match="context_parallel"):
        config("deepseek-v3-debug", context_parallel=True)


def test_latent_attention_equals_the_reports_equations_head_by_head():
    model = _randomized(tiny_model("deepseek-v3-debug", "cpu", **TINY_DSV3))
    attn = model.layers["0"].attention
    bs, seq, heads, nope, rope, vd = 2, 16, 4, 8, 8, 8
    x = torch.randn(bs, seq, TINY["dim"], generator=torch.Generator().manual_seed(2))
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]

    def rotate(t):  # rotate-half RoPE on the last dim of [..., seq, rope]
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

    c_q = F.rms_norm(x @ attn.wq_a.weight.T, (16,), attn.q_norm.weight, 1e-6)
    q = (c_q @ attn.wq_b.weight.T).view(bs, seq, heads, nope + rope)
    kv_a = x @ attn.wkv_a.weight.T
    c_kv = F.rms_norm(kv_a[..., :16], (16,), attn.kv_norm.weight, 1e-6)
    k_rope = rotate(kv_a[..., 16:])  # [bs, seq, rope], one for all heads
    kv = (c_kv @ attn.wkv_b.weight.T).view(bs, seq, heads, nope + vd)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    outs = []
    for h in range(heads):
        qh = torch.cat([q[:, :, h, :nope], rotate(q[:, :, h, nope:])], dim=-1)
        kh = torch.cat([kv[:, :, h, :nope], k_rope], dim=-1)
        scores = (qh @ kh.transpose(1, 2)) / math.sqrt(nope + rope)
        outs.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ kv[:, :, h, nope:])
    want = torch.cat(outs, dim=-1) @ attn.wo.weight.T
    got = attn(x, cos, sin)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5) and want.abs().max() > 0.1


def _reference_gates(scores: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                     scale: float) -> torch.Tensor:
    """Group-limited routing token by token, with Python sorting."""
    gates = torch.zeros_like(scores)
    size = scores.shape[1] // n_group
    for t in range(scores.shape[0]):
        biased = (scores[t] + bias).tolist()
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:top_k // topk_group])
                       for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        total = sum(float(scores[t, e]) for e in chosen)
        for e in chosen:
            gates[t, e] = scores[t, e] / total * scale
    return gates


def test_routing_is_group_limited_sigmoid_top_k_with_a_selection_only_bias():
    moe = _randomized(tiny_model("deepseek-v3-debug", "cpu", **ROUTING)).layers["1"].moe
    x = torch.randn(64, TINY["dim"], generator=torch.Generator().manual_seed(3))
    scores = torch.sigmoid(moe.router(x)).detach()
    got = moe.gate_weights(x).detach()
    want = _reference_gates(scores, moe.expert_bias, 4, 2, 4, 2.5)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert ((got > 0).sum(-1) == 4).all() and torch.allclose(got.sum(-1), torch.full((64,), 2.5))
    # the bias moves the choice, not the weights: a large bias on expert 0 selects it for every token
    with torch.no_grad():
        moe.expert_bias[0] = 100.0
    biased = moe.gate_weights(x).detach()
    assert (biased[:, 0] > 0).all()
    assert torch.allclose(biased, _reference_gates(scores, moe.expert_bias, 4, 2, 4, 2.5), rtol=1e-6, atol=1e-7)
    chosen = biased > 0  # the weights are the unbiased affinities of the chosen experts, normalised
    assert torch.allclose(biased, scores * chosen / (scores * chosen).sum(-1, keepdim=True) * 2.5)


def test_the_expert_bias_balances_load_outside_the_gradient():
    moe = tiny_model("deepseek-v3-debug", "cpu", **ROUTING).layers["1"].moe
    assert "expert_bias" in dict(moe.named_buffers()) and "expert_bias" not in dict(moe.named_parameters())
    load = torch.tensor([10, 0, 5, 5] * 4)
    moe.update_expert_bias(load)
    assert moe.expert_bias.tolist() == pytest.approx([-0.001, 0.001, 0.0, 0.0] * 4)
    with pytest.raises(ValueError, match="one count per routed expert"):
        moe.update_expert_bias(torch.ones(3))


def test_sparse_routing_equals_its_dense_reference_forward_and_backward():
    sparse = _randomized(tiny_model("deepseek-v3-debug", "cpu", **ROUTING))
    dense = tiny_model("deepseek-v3-debug", "cpu", **ROUTING, routing="dense")
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(2, 16, TINY["dim"], generator=torch.Generator().manual_seed(4))
    a, b = sparse.layers["1"].moe(x), dense.layers["1"].moe(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) and a.abs().max() > 0.1
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(sparse.layers["1"].moe.named_parameters(), dense.layers["1"].moe.parameters(), strict=False):
        assert (p.grad - q.grad).norm() <= 1e-5 * q.grad.norm() and q.grad.norm() > 0, name


# ---------------------------------------------------------------------------------------------
# the routed experts' grouped GEMM


def _loop(x, w1, w2, w3, sizes):
    return torch.cat([(F.silu(c @ w1[i]) * (c @ w3[i])) @ w2[i] for i, c in enumerate(x.split(sizes))])


@pytest.mark.parametrize("dtype,grouped", [(torch.float32, True), (torch.float64, False)])
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1, 0, 7], [4, 4, 4, 4, 4, 4], [0, 0, 0, 0, 0, 9]])
def test_grouped_experts_equal_a_loop_over_experts(dtype, grouped, sizes):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(sizes), 8, generator=g, dtype=dtype)
    ws = [torch.randn(6, 8, 12, generator=g, dtype=dtype), torch.randn(6, 12, 8, generator=g, dtype=dtype),
          torch.randn(6, 8, 12, generator=g, dtype=dtype)]
    assert grouped_mm_runs(x, ws[0]) is grouped  # fp32 on CPU: torch._grouped_mm; fp64: the padded bmm
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    refs = [t.clone().requires_grad_() for t in (x, *ws)]
    got = ExpertGroups(torch.tensor(sizes), sizes).swiglu(*leaves)
    want = _loop(*refs, sizes)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(got.shape, generator=g, dtype=dtype)
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, refs, grad), strict=False):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _matmuls(gm: torch.fx.GraphModule) -> dict[str, int]:
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return {op: sum(name.startswith(f"aten.{op}.") for name in names) for op in ("mm", "bmm", "_grouped_mm")}


def test_many_experts_run_as_three_grouped_kernels_not_one_per_expert():
    experts, t, dim, hidden, k = 64, 96, 16, 32, 6
    g = torch.Generator().manual_seed(6)
    x, probs = torch.randn(t, dim, generator=g), torch.randn(t, experts, generator=g).softmax(-1)
    ws = [torch.randn(experts, dim, hidden, generator=g), torch.randn(experts, hidden, dim, generator=g),
          torch.randn(experts, dim, hidden, generator=g)]
    routed = RoutedExperts(k)
    # run (real tensors: the dispatch sizes its groups from the data)
    assert _matmuls(make_fx(routed)(x, probs, *ws)) == {"mm": 0, "bmm": 0, "_grouped_mm": 3}
    # traced for pricing on meta: bf16 (the grouped kernel's dtype on CUDA) as run; fp32 as the bmm
    meta = [torch.empty(a.shape, device="meta", dtype=torch.bfloat16) for a in (x, probs, *ws)]
    assert _matmuls(make_fx(routed, tracing_mode="fake")(*meta)) == {"mm": 0, "bmm": 0, "_grouped_mm": 3}
    meta32 = [a.float() for a in meta]
    assert _matmuls(make_fx(routed, tracing_mode="fake")(*meta32)) == {"mm": 0, "bmm": 3, "_grouped_mm": 0}


@pytest.mark.parametrize("model", ["measured", "roofline"])
def test_the_grouped_kernel_is_priced_as_the_batched_gemm_it_equals(model):
    """Each form autograd runs (forward, input and weight gradients) at DeepSeek-V3's expert sizes:
    the FLOPs of the whole grouped GEMM at tensor-core speed, not an elementwise op's price."""
    from costmodels.compute import RooflineCompute
    from costmodels.measured import compute_model

    cost = compute_model("h100") if model == "measured" else RooflineCompute("h100")
    aten, meta = torch.ops.aten, dict(device="meta", dtype=torch.bfloat16)
    groups, rows, dim, hidden = 32, 32768, 7168, 2048
    offs = torch.empty(groups, dtype=torch.int32, device="meta")
    x, w, dy = torch.empty(rows, dim, **meta), torch.empty(groups, dim, hidden, **meta), torch.empty(rows, hidden, **meta)
    forms = {"forward": (x, w, (groups, rows // groups, dim, hidden)),
             "input_grad": (dy, w.transpose(1, 2), (groups, rows // groups, hidden, dim)),
             "weight_grad": (x.t(), dy, (groups, dim, rows // groups, hidden))}
    for name, (a, b, (g, m, k, n)) in forms.items():
        out = aten._grouped_mm.default(a, b, offs)
        got = cost.time_us(aten._grouped_mm.default, (a, b, offs), {}, out, dtype=torch.bfloat16)
        bmm_args = (torch.empty(g, m, k, **meta), torch.empty(g, k, n, **meta))
        want = cost.time_us(aten.bmm.default, bmm_args, {}, torch.empty(g, m, n, **meta), dtype=torch.bfloat16)
        assert got == pytest.approx(want, rel=1e-9), name
        assert cost.flops(aten._grouped_mm.default, (a, b, offs), {}, out) == 2 * rows * dim * hidden, name
        # at H100's ~1e15 bf16 FLOP/s the 2.9e12 FLOPs take milliseconds
        assert got > 1000.0, name


# ---------------------------------------------------------------------------------------------
# planning and training


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3-16b"])
def test_presets_plan_with_their_full_widths(preset):
    # two layers at full width, one dense and one MoE: the planner shards every weight matrix
    cfg = config(preset, n_layers=2, n_dense_layers=1)
    with torch.device("meta"):
        model = build(cfg)
    plan = apmodel.plan(model, (2, 4), sample_inputs(cfg, 8, 512), device="h100")
    assert plan.objective_us > 0 and plan.comm_us > 0
    matrices = {f: p for f, p in plan.param_placements.items() if "norm" not in f and "router" not in f}
    assert "layers.1.moe.experts.w1" in matrices and "layers.0.attention.wkv_b.weight" in matrices
    assert all("S(" in apmodel.core.placements.tuple_to_str(p) for p in matrices.values())
    assert any(name.startswith("routed_experts_top") for name in plan.node_strategy)


#: a selection bias that changes which expert group wins (group sums +0.4 and -0.2)
TRAIN_BIAS = (0.3, 0.1, -0.2, 0.0)


def _tiny_trained_model(bias: tuple[float, ...]) -> torch.nn.Module:
    """The tiny model with weights at scale 0.3 (the experts' outputs matter to the loss) and
    ``bias`` as its MoE layer's expert bias."""
    model = _randomized(tiny_model("deepseek-v3-debug", "cpu", **TINY_DSV3))
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.tensor(bias))
    return model


def _worker(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    weights = full_weights(_tiny_trained_model(TRAIN_BIAS))
    model = apmodel.parallelize(tiny_model("deepseek-v3-debug", "meta", **TINY_DSV3), mesh,
                                (tokens.to("meta"), targets.to("meta")), device="h100",
                                constraints=[apmodel.region_as("routed_experts_*", "expert_parallel", "expert_parallel")])
    model.to_empty(device="cpu")
    load_full_state_dict(model, weights)
    return train(model, lambda m: m(tokens, targets), STEPS)


@pytest.mark.slow
def test_tiny_deepseek_v3_trains_on_a_2x2_mesh_like_one_device():
    per_rank = run_distributed(_worker, 4, timeout_s=600)
    assert all(r == per_rank[0] for r in per_rank)
    tokens, targets = fixed_tokens()
    want = train(_tiny_trained_model(TRAIN_BIAS), lambda m: m(tokens, targets), STEPS)
    for step, (a, b) in enumerate(zip(per_rank[0], want, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)
    # the routing shows in the losses: without the bias another expert group wins
    unbiased = train(_tiny_trained_model((0.0,) * 4), lambda m: m(tokens, targets), STEPS)
    assert abs(unbiased[0] - want[0]) > 100 * LOSS_RTOL * abs(want[0])

"""Hybrid sliding-window / full attention (the paper's 30B hybrid class): the banded kernel against
brute force, its price against the full kernel's, the layer pattern, the preset on meta, stamped
capture of two kinds of layers, and a tiny config trained on a 2x2 gloo mesh like one device."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import apmodel
from apmodel.core.options import make_options
from apmodel.models import build, config, sample_inputs
from apmodel.models.attention import SlidingWindowAttention, sliding_window_attention, sliding_window_mask
from apmodel.models.llama3 import LlamaConfig
from apmodel.problem.pricing import build_cost_context
from costmodels.compute import RooflineCompute

from _dist_utils import run_distributed
from _helpers import full_weights, train
from _tiny import TINY, fixed_tokens, tiny_model
from test_capture_stamping import _both, assert_same_capture

STEPS = 3
LOSS_RTOL = 1e-5
#: tiny hybrid: layer 0 in a window of 4 keys (of 16 positions), layer 1 full
TINY_HYBRID = dict(TINY, sliding_window=4, full_attention_every=2, qk_norm=True)


def _brute_force(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Each query position by itself: softmax over the keys j with i - window < j <= i."""
    out = torch.zeros_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for i in range(q.shape[2]):
        lo = max(0, i - window + 1)
        scores = (q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2)) * scale
        out[:, :, i:i + 1] = torch.softmax(scores, dim=-1) @ v[:, :, lo:i + 1]
    return out


@pytest.mark.parametrize("seq,window", [(16, 4), (16, 1), (13, 5), (8, 8), (8, 20)])
def test_window_attention_equals_brute_force(seq, window):
    g = torch.Generator().manual_seed(seq * 31 + window)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = sliding_window_attention(q, k, v, window)
    want = _brute_force(q, k, v, window)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    a = torch.autograd.grad(got, (q, k, v), grad)
    b = torch.autograd.grad(want, (q, k, v), grad)
    assert all(torch.allclose(x, y, rtol=1e-9, atol=1e-11) for x, y in zip(a, b, strict=True))
    mask = sliding_window_mask(seq, window)
    assert [[bool(mask[i, j]) for j in range(seq)] for i in range(seq)] == \
        [[i - window < j <= i for j in range(seq)] for i in range(seq)]


def test_window_region_repeats_key_value_heads():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = SlidingWindowAttention(3).region()(q, k, v)
    want = _brute_force(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), 3)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("model", ["measured", "roofline"])
def test_window_attention_is_priced_by_its_window(model, backward):
    """At seq 8192 and window 1024 the banded kernel's priced time is its share of query-key pairs of
    the full causal kernel's: seq W / (seq²/2) = 2 W / seq with H100's measured model, which counts a
    causal kernel's kept half; W / seq with the roofline, which counts it whole."""
    seq, window = 8192, 1024
    options = make_options(device="h100") if model == "measured" else \
        make_options(device="h100", compute_model=RooflineCompute("h100"))
    cost = build_cost_context((1,), options)
    q = torch.empty(1, 32, seq, 128, device="meta")
    kv = torch.empty(1, 8, seq, 128, device="meta")
    args = (q, q, kv, kv) if backward else (q, kv, kv)  # the backward takes the output's gradient first
    swa = SlidingWindowAttention(window).region().time_us(cost, args, modes=(None,), backward=backward)
    full = SlidingWindowAttention(seq).region().time_us(cost, args, modes=(None,), backward=backward)  # causal
    pairs = 2 * window / seq if model == "measured" else window / seq
    assert swa / full == pytest.approx(pairs, rel=0.15)


def test_layer_pattern_and_config_errors():
    cfg = config("hybrid-swa-30b")
    windows = [cfg.attention_window(i) for i in range(cfg.n_layers)]
    assert windows[:6] == [1024] * 5 + [None] and windows.count(None) == 10  # every 6th layer full
    explicit = LlamaConfig(n_layers=3, sliding_window=16, layer_types=("full", "sliding", "full"))
    assert [explicit.attention_window(i) for i in range(3)] == [None, 16, None]
    assert [LlamaConfig(n_layers=2, sliding_window=16).attention_window(i) for i in range(2)] == [16, 16]  # Mistral
    bad = {
        "sliding_window=0 must be a positive": dict(sliding_window=0),
        "full_attention_every=2 needs a sliding_window": dict(full_attention_every=2),
        "layer_types has 1 entries for n_layers=2": dict(n_layers=2, sliding_window=4, layer_types=("full",)),
        r"layer_types \['local'\] not in": dict(n_layers=1, sliding_window=4, layer_types=("local",)),
        "sliding layers but sliding_window is not set": dict(n_layers=1, layer_types=("sliding",)),
        "context_parallel is not implemented for sliding-window": dict(sliding_window=4, context_parallel=True),
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            LlamaConfig(**fields)
    with pytest.raises(ValueError, match="sliding_window needs each layer's index"):
        with torch.device("meta"):
            build("moe-debug", sliding_window=4)


def test_hybrid_30b_builds_and_plans_on_meta():
    with torch.device("meta"):
        model = build("hybrid-swa-30b")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(28.42, rel=0.01)
    # two full-width layers, one of each kind, at the paper's 4K sequence
    with torch.device("meta"):
        model = build("hybrid-swa-30b", n_layers=2, full_attention_every=2)
    plan = apmodel.plan(model, (2, 4), sample_inputs(config("hybrid-swa-30b"), 8, 4096), device="h100")
    assert plan.objective_us > 0 and plan.comm_us > 0
    assert "attention_window1024_flash" in plan.node_strategy  # the sliding layer runs the banded kernel
    matrices = {f: p for f, p in plan.param_placements.items() if "norm" not in f}
    assert matrices and all("S(" in apmodel.core.placements.tuple_to_str(p) for p in matrices.values())


@pytest.mark.parametrize("layers,every", [(12, 2), (14, 3)])
def test_two_kinds_of_layers_are_stamped_as_traced(layers, every, monkeypatch):
    """Layers of two kinds in turn (every 2nd or 3rd full) are traced as a template and stamped:
    node for node the graph of tracing every layer, names included."""
    monkeypatch.setattr("apmodel.models.PRESETS", {**apmodel.models.PRESETS, "hybrid-test": (
        LlamaConfig, apmodel.models.Transformer,
        dict(apmodel.models.PRESETS["hybrid-swa-debug"][2], full_attention_every=every))})
    stamped, full = _both("hybrid-test", layers, monkeypatch)
    assert_same_capture(stamped, full)


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    weights = full_weights(tiny_model("hybrid-swa-debug", "cpu", **TINY_HYBRID))
    model = apmodel.parallelize(tiny_model("hybrid-swa-debug", "meta", **TINY_HYBRID), mesh,
                                (tokens.to("meta"), targets.to("meta")), device="h100")
    model.to_empty(device="cpu")
    load_full_state_dict(model, weights)
    return {"losses": train(model, lambda m: m(tokens, targets), STEPS)}


@pytest.mark.slow
def test_tiny_hybrid_trains_on_a_2x2_mesh_like_one_device():
    got = run_distributed(_worker, 4, timeout_s=600)[0]["losses"]
    tokens, targets = fixed_tokens()
    want = train(tiny_model("hybrid-swa-debug", "cpu", **TINY_HYBRID), lambda m: m(tokens, targets), STEPS)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=False)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)

"""Reference models: published sizes, real CPU numerics, attention/RoPE/GQA/MoE against independent
reference computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from apmodel.models import PRESETS, build, config, cross_entropy_loss, sample_inputs
from apmodel.models.attention import (
    causal_attention,
    flash_attention_backward,
    flash_attention_forward,
    rms_norm_backward,
)
from apmodel.models.llama3 import apply_rope, repeat_kv, rope_tables


def _meta(name: str, **kw):
    with torch.device("meta"):
        return build(name, **kw)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _llama_count(c) -> int:
    """Parameter count from the architecture: embedding + head, per layer 4 attention matrices
    (q/o: dim x dim; k/v: dim x kv_heads*head_dim), 3 FFN matrices, 2 norms; final norm."""
    kv = c.n_kv_heads * (c.dim // c.n_heads)
    layer = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_hidden_dim + 2 * c.dim
    return 2 * c.vocab_size * c.dim + c.n_layers * layer + c.dim


def test_llama3_published_sizes():
    m8 = _meta("llama3-8b")
    assert _n_params(m8) == _llama_count(config("llama3-8b"))
    assert abs(_n_params(m8) - 8.03e9) < 0.005e9  # Meta: "8B", 8,030,261,248 parameters
    m70 = _meta("llama3-70b")
    assert _n_params(m70) == _llama_count(config("llama3-70b"))
    assert abs(_n_params(m70) - 70.55e9) < 0.05e9  # Meta: "70B" (70.6e9)
    assert all(p.device.type == "meta" for p in m70.parameters())
    names = {n for n, _ in m8.named_parameters()}
    for fqn in ("tok_embeddings.weight", "layers.31.attention.wq.weight", "layers.0.attention.wk.weight",
                "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
                "layers.0.ffn_norm.weight", "norm.weight", "output.weight"):
        assert fqn in names


def test_gpt2_sizes():
    d, V, T = 768, 50257, 1024
    layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    tied = V * d + T * d + 12 * layer + 2 * d
    assert _n_params(_meta("gpt2", tie_embeddings=True)) == tied
    assert abs(tied - 124.4e6) < 0.1e6  # OpenAI GPT-2 small: 124M
    assert _n_params(_meta("gpt2")) == tied + V * d  # untied head by default
    assert abs(_n_params(_meta("gpt2-medium", tie_embeddings=True)) - 354.8e6) < 0.5e6  # "355M"


def test_moe_sizes():
    c = config("deepseek-moe-16b")
    m = _meta("deepseek-moe-16b")
    assert abs(_n_params(m) - 16.4e9) < 0.1e9  # DeepSeekMoE 16B: 16.4B total
    experts = c.n_routed_experts * 3 * c.dim * c.moe_hidden_dim
    assert m.layers["1"].moe.experts.w1.numel() * 3 == experts


def test_presets_build_on_meta_and_overrides():
    for name in PRESETS:
        m = _meta(name, n_layers=1)
        assert len(m.layers) == 1
    with pytest.raises(ValueError, match="unknown model preset"):
        build("llama4")
    with pytest.raises(ValueError, match="n_layer"):
        build("llama3-debug", n_layer=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        build("llama3-debug", n_kv_heads=3)


def test_sample_inputs():
    tokens, targets = sample_inputs("llama3-debug", 3, 16, device="cpu")
    assert tokens.shape == targets.shape == (3, 16) and tokens.dtype == torch.int64
    assert int(tokens.max()) < 2048 and int(tokens.min()) >= 0
    assert sample_inputs("llama3-8b", 8, 2048)[0].device.type == "meta"
    with pytest.raises(ValueError, match="max_seq_len"):
        sample_inputs("gpt2", 1, 4096)


def test_cross_entropy_matches_torch():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    torch.testing.assert_close(cross_entropy_loss(logits, targets), F.cross_entropy(logits.view(-1, 11), targets.view(-1)))


@pytest.mark.parametrize("name", ["llama3-debug", "moe-debug", "gpt2"])
def test_forward_on_cpu_after_meta_init(name):
    torch.manual_seed(0)
    m = _meta(name, n_layers=2).to_empty(device="cpu")
    m.init_weights()
    tokens, targets = sample_inputs(name, 2, 32, device="cpu")
    logits = m(tokens)
    assert logits.shape == (2, 32, m.config.vocab_size) and torch.isfinite(logits).all()
    loss = m(tokens, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    # untrained model: loss near log(vocab)
    assert abs(loss.item() - math.log(m.config.vocab_size)) < 3.0


def test_flash_reference_matches_sdpa():
    """The CPU reference of the flash op (used to run meta-traced graphs) against torch's SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, lse, *_ = flash_attention_forward(q, k, v, 0.0, True)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), grad_out)
    rq, rk, rv = flash_attention_backward(grad_out, q, k, v, out, lse, None, None, 24, 24, 0.0, True, None, None)
    torch.testing.assert_close((rq, rk, rv), (gq, gk, gv))


def test_causal_attention_paths():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    # CPU path: causal softmax attention written out by hand
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(causal_attention(q, k, v), scores.softmax(-1) @ v)
    # meta path: the explicit aten ops (shape only; they have no CPU kernel)
    qm = q.to("meta")
    assert causal_attention(qm, qm, qm, "flash").shape == q.shape
    assert causal_attention(qm, qm, qm, "efficient").shape == q.shape
    with pytest.raises(ValueError, match="backend"):
        causal_attention(qm, qm, qm, "math")


def test_repeat_kv_is_repeat_interleave_over_heads():
    x = torch.randn(2, 5, 3, 4)
    torch.testing.assert_close(repeat_kv(x, 4), x.repeat_interleave(4, dim=2))


def test_rope_relative_position():
    """RoPE: rotations keep norms, and q·k depends only on the position difference."""
    torch.manual_seed(0)
    hd = 16
    cos, sin = rope_tables(hd, 32, 10000.0)
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    seq = lambda x: x.expand(1, 32, 1, hd)  # noqa: E731 - same vector at every position
    rq, rk = apply_rope(seq(q), cos.double(), sin.double())[0, :, 0], apply_rope(seq(k), cos.double(), sin.double())[0, :, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(32))
    torch.testing.assert_close(rq[7] @ rk[3], rq[20] @ rk[16])
    torch.testing.assert_close(rq[5] @ rk[5], q @ k)


def test_moe_dense_routing_equals_sparse_dispatch():
    torch.manual_seed(0)
    m = build("moe-debug")
    m.init_weights()
    moe = m.layers["1"].moe
    x = torch.randn(1, 6, 256)
    out = moe(x)
    # reference: per token, run only its top-k experts, weight by router probability
    tokens = x[0]
    probs = F.softmax(tokens @ moe.router.weight.t(), dim=-1)
    ref = []
    for t in range(tokens.shape[0]):
        acc = moe.shared_experts(tokens[t])
        for e in probs[t].topk(moe.top_k).indices.tolist():
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            acc = acc + probs[t, e] * ((F.silu(tokens[t] @ w1) * (tokens[t] @ w3)) @ w2)
        ref.append(acc)
    torch.testing.assert_close(out[0], torch.stack(ref), rtol=1e-4, atol=1e-5)


def test_rms_norm_backward_reference_matches_autograd():
    """The CPU reference of aten._fused_rms_norm_backward against autograd of the written-out formula."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    eps = 1e-5
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = x * rstd * w
    torch.testing.assert_close(y, F.rms_norm(x, (8,), w, eps))
    grad_out = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad_out)
    rx, rw = rms_norm_backward(grad_out, x.detach(), [8], rstd.detach(), w.detach(), [True, True])
    torch.testing.assert_close((rx, rw), (gx, gw))

"""DeepSeek-MoE-style decoder: LLaMA-3 attention blocks whose FFN is a mixture of experts
(shared experts that see every token + routed experts chosen by top-k gating).

Routing is computed *densely* so that the traced graph has static shapes: every routed expert
runs on every token, and its output is multiplied by a gate weight that is zero unless the
expert is among the token's top-k. This is numerically the same as sparse dispatch (up to ties
in the top-k threshold) but costs ``n_routed_experts / top_k`` times the routed-expert FLOPs;
a planner that prices this graph over-counts routed-expert compute by that factor.

Routed expert weights are stacked into 3-D parameters (``experts.w1: [E, dim, hidden]`` etc.),
as torchtitan's grouped experts, so expert parallelism is sharding dim 0 of those parameters and of
the ``[E, tokens, *]`` activations (batched matmuls ``bmm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from apmodel.models.llama3 import Attention, FeedForward, LlamaConfig, RMSNorm, Transformer


@dataclass
class MoEConfig(LlamaConfig):
    """Sizes of a DeepSeek-MoE-style model. Defaults are DeepSeekMoE 16B (DeepSeek-AI, 2024:
    2 shared + 64 routed experts, top-6, first layer dense), with GQA attention instead of MHA.
    The attention and dense fields are the LLaMA ones (the attention block is shared)."""

    dim: int = 2048
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    vocab_size: int = 102400
    ffn_hidden_dim: int = 10944  # dense FFN of the first n_dense_layers layers
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    moe_hidden_dim: int = 1408  # hidden size of each (shared or routed) expert
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    top_k: int = 6
    n_dense_layers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # head sizes and attention backend
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} must be in [1, n_routed_experts={self.n_routed_experts}]"
            )


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts with stacked weights; ``x: [n, tokens, dim] -> [n, tokens, dim]``."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.n_routed = cfg.n_routed_experts
        self.router = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_hidden_dim)
        # the shared experts act as one SwiGLU of width n_shared * moe_hidden (as in DeepSeek's code)
        self.shared_experts = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_hidden_dim)

    def gate_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Dense gate ``[tokens, n_routed]``: softmax router probability for the top-k experts of each
        token, 0 for the others (DeepSeekMoE: no renormalisation over the top-k)."""
        probs = F.softmax(self.router(x), dim=-1)
        kth_largest = torch.topk(probs, self.top_k, dim=-1).values[:, -1:]
        return probs * (probs >= kth_largest).to(probs.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        tokens = x.reshape(bs * seq, dim)
        gates = self.gate_weights(tokens)  # [tokens, E]
        routed = self.experts(tokens.unsqueeze(0).expand(self.n_routed, -1, -1))  # [E, tokens, dim]
        combined = (routed * gates.t().unsqueeze(-1)).sum(dim=0)
        return (combined + self.shared_experts(tokens)).view(bs, seq, dim)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std)
        self.shared_experts.init_weights(init_std)


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = layer_id >= cfg.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        self.init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)


class MoETransformer(Transformer):
    """``tokens [batch, seq] (int64) -> logits [batch, seq, vocab]`` (or the loss, given targets):
    the LLaMA-3 decoder with MoE blocks (see :class:`MoEBlock`)."""

    def make_block(self, layer_id: int, cfg: MoEConfig) -> nn.Module:
        return MoEBlock(layer_id, cfg)

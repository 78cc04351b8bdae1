"""DeepSeek-V3-style decoder (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §2.1):
multi-head latent attention, fine-grained routed + shared experts with sigmoid, group-limited
top-k routing and aux-loss-free balancing.

* Multi-head latent attention (MLA, report §2.1.1): queries from a low-rank compression
  (``wq_a: dim -> q_lora_rank``, RMSNorm, ``wq_b -> heads x (qk_nope + qk_rope)``; without
  compression, ``q_lora_rank = 0``, one ``wq``); keys and values from one latent
  (``wkv_a: dim -> kv_lora_rank + qk_rope``: the latent, RMSNorm, ``wkv_b -> heads x (qk_nope +
  v)``) and a decoupled RoPE key of ``qk_rope_head_dim`` computed once and shared by every head.
  Softmax scale ``1 / sqrt(qk_nope + qk_rope)`` (the report's eq. 10, the query's width). Values
  narrower than the query/key heads are padded with zeros for the fused attention kernel (its
  output is as wide as the query) and the padding is cut from the output; the padding's FLOPs
  are priced, as a padded kernel runs them.
* Routing (report §2.1.2): affinities ``sigmoid(router(x))``; the selection adds a per-expert bias
  (``expert_bias``, a buffer: aux-loss-free load balancing, updated outside the gradient by
  :meth:`DeepSeekV3MoE.update_expert_bias`), first keeps the ``topk_group`` of ``n_group`` expert
  groups (nodes, in the report) with the largest sums of their ``top_k // topk_group`` best biased
  affinities, then the ``top_k`` best experts inside them; the weights are the unbiased affinities
  of the chosen experts, divided by their sum (``renormalize_topk``) and multiplied by
  ``routed_scaling_factor``. The weights form a dense ``[tokens, n_routed]`` gate (zero off the
  top-k), which the expert-parallel region :class:`apmodel.models.moe.RoutedExperts` dispatches
  sparsely (its top-k picks exactly the nonzero gates) and ``routing="dense"`` multiplies with
  every expert's output (the reference).
* The first ``n_dense_layers`` layers have a dense SwiGLU of ``ffn_hidden_dim``; the others a MoE
  of ``n_routed_experts`` experts of ``moe_hidden_dim`` plus ``n_shared_experts`` shared ones.

Out of scope: multi-token prediction (the report's §2.2: an extra module trained beside the main
model, 14B parameters in DeepSeek-V3, not counted in its 671B), YaRN's context extension (§4.3:
RoPE here is the pretraining one at 4K positions) and FP8 training. RoPE is the rotate-half form
(DeepSeek's code rotates interleaved pairs: a fixed permutation of the same rotation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from apmodel.graph.regions import LocalRegion
from apmodel.models.attention import causal_attention
from apmodel.models.llama3 import LlamaConfig, RMSNorm, apply_rope
from apmodel.models.moe import MoE, MoEBlock, MoEConfig, MoETransformer, RoutedExperts

#: Bias update speed (gamma) of aux-loss-free balancing: 0.001 for the first 14.3T tokens
#: (DeepSeek-V3 report §4.2, hyper-parameters).
BIAS_UPDATE_SPEED = 0.001


@dataclass
class DeepSeekV3Config(MoEConfig):
    """Sizes of a DeepSeek-V3-style model. Defaults are DeepSeek-V3 671B (its config.json and the
    report's §4.2); the LLaMA/MoE fields keep their meanings (``ffn_hidden_dim``: the dense
    layers' FFN, ``moe_hidden_dim``: each expert's). ``n_kv_heads`` is unused (MLA: every head
    has its own keys and values from the shared latent)."""

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int = 128
    vocab_size: int = 129280
    ffn_hidden_dim: int = 18432
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    moe_hidden_dim: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    top_k: int = 8
    n_dense_layers: int = 3
    renormalize_topk: bool = True  # norm_topk_prob: the chosen affinities divided by their sum
    q_lora_rank: int = 1536  # 0: queries without low-rank compression (one wq)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_group: int = 8  # expert groups (nodes); routing keeps topk_group of them per token
    topk_group: int = 4
    routed_scaling_factor: float = 2.5

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.context_parallel or self.qk_norm or self.attention_head_dim is not None:
            raise ValueError(f"{name}: multi-head latent attention has no context_parallel, qk_norm or "
                             f"attention_head_dim (its widths are q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                             f"qk_rope_head_dim, v_head_dim)")
        super().__post_init__()  # checks the RoPE width (head_dim below) is even
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{name}: {field}={getattr(self, field)} must be positive")
        if self.q_lora_rank < 0:
            raise ValueError(f"{name}: q_lora_rank={self.q_lora_rank} must be 0 (no compression) or positive")
        if self.v_head_dim > self.qk_head_dim:
            raise ValueError(f"{name}: v_head_dim={self.v_head_dim} wider than the query/key heads "
                             f"({self.qk_head_dim} = qk_nope_head_dim + qk_rope_head_dim)")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(f"{name}: n_group={self.n_group} does not divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{name}: topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if not self.topk_group <= self.top_k <= self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"{name}: top_k={self.top_k} experts cannot be chosen from topk_group={self.topk_group} "
                             f"groups of {self.n_routed_experts // self.n_group} (at least one per group)")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"{name}: routed_scaling_factor={self.routed_scaling_factor} must be positive")

    @property
    def head_dim(self) -> int:
        """The width RoPE rotates: the decoupled key's and each query head's rotary part."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MultiHeadLatentAttention(nn.Module):
    """MLA (see the module doc): ``x [batch, seq, dim] -> [batch, seq, dim]``."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.backend = cfg.attention_backend
        qk_width = cfg.n_heads * cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk_width, bias=False)
            self.wq = None
        else:
            self.wq = nn.Linear(cfg.dim, qk_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        heads, qk = self.n_heads, self.nope + self.rope
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bs, seq, heads, qk).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)  # [bs, seq, 1, rope]: one key for every head
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(bs, seq, heads, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(bs, seq, heads, self.rope)], dim=-1)
        if self.v_dim < qk:  # the fused kernel's output is as wide as the query: zero columns, cut after
            v = F.pad(v, (0, qk - self.v_dim))
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.backend)
        return self.wo(out[..., :self.v_dim].transpose(1, 2).reshape(bs, seq, heads * self.v_dim))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, getattr(self, "wq_a", None), getattr(self, "wq_b", None), self.wkv_a, self.wkv_b):
            if lin is not None:
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for norm in (getattr(self, "q_norm", None), self.kv_norm):
            if norm is not None:
                norm.init_weights()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class DeepSeekV3MoE(MoE):
    """Routed + shared experts with DeepSeek-V3's routing (see the module doc)."""

    expert_bias: torch.Tensor  # [n_routed]: added to the affinities for selection only

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__(cfg)
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts))

    def gate_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Dense gate ``[tokens, n_routed]``: each token's routing weight for its ``top_k`` experts
        chosen by group-limited selection on the biased sigmoid affinities, 0 for the others."""
        scores = torch.sigmoid(self.router(x))
        biased = scores + self.expert_bias
        if self.topk_group < self.n_group:
            t = biased.shape[0]
            per_group = biased.view(t, self.n_group, -1)
            # a group's score: the sum of its best top_k // topk_group biased affinities
            group_score = per_group.topk(self.top_k // self.topk_group, dim=-1).values.sum(dim=-1)
            kept = group_score >= group_score.topk(self.topk_group, dim=-1).values[:, -1:]
            biased = per_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, -1)
        chosen = biased >= biased.topk(self.top_k, dim=-1).values[:, -1:]
        gates = scores * chosen.to(scores.dtype)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return gates * self.scaling

    def routed_region(self, tokens: torch.Tensor) -> tuple[LocalRegion, torch.Tensor]:
        """The region follows the final gate weights (nonzero exactly on the chosen experts): its
        own top-k finds them and weights by them as they are."""
        return RoutedExperts(self.top_k).region(), self.gate_weights(tokens)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, speed: float = BIAS_UPDATE_SPEED) -> None:
        """Aux-loss-free balancing after a step (report §2.1.2): each expert's bias rises by
        ``speed`` if it received fewer tokens than the mean, falls by ``speed`` if more."""
        if tokens_per_expert.shape != self.expert_bias.shape:
            raise ValueError(f"update_expert_bias: tokens_per_expert has shape {tuple(tokens_per_expert.shape)}, "
                             f"expected one count per routed expert {tuple(self.expert_bias.shape)}")
        load = tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=speed)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.expert_bias.zero_()


class DeepSeekV3Block(MoEBlock):
    """A DeepSeek-V3 layer: multi-head latent attention, then a dense FFN (the first
    ``n_dense_layers``) or the MoE with DeepSeek-V3's routing."""

    def make_attention(self, cfg: MoEConfig) -> nn.Module:
        return MultiHeadLatentAttention(cast(DeepSeekV3Config, cfg))

    def make_moe(self, cfg: MoEConfig) -> nn.Module:
        return DeepSeekV3MoE(cast(DeepSeekV3Config, cfg))


class DeepSeekV3Transformer(MoETransformer):
    """``tokens [batch, seq] (int64) -> logits [batch, seq, vocab]`` (or the loss, given targets):
    the decoder with :class:`DeepSeekV3Block` blocks (RoPE tables of ``qk_rope_head_dim``)."""

    def make_block(self, layer_id: int, cfg: LlamaConfig) -> nn.Module:
        return DeepSeekV3Block(layer_id, cast(DeepSeekV3Config, cfg))

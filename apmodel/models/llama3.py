"""LLaMA-3-style dense decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), optionally with
sliding-window attention in some layers (``sliding_window``: Mistral, Gemma 2 / 3 style hybrids).

Parameter names follow torchtitan: ``tok_embeddings``, ``layers.N.attention.{wq,wk,wv,wo}``,
``layers.N.feed_forward.{w1,w2,w3}``, ``layers.N.attention_norm``, ``layers.N.ffn_norm``, ``norm``,
``output``. The model builds on ``torch.device("meta")``; call :meth:`Transformer.init_weights`
after moving it to a real device (``to_empty``) to fill parameters and the RoPE tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from apmodel.models.attention import (
    ATTENTION_BACKENDS,
    ContextParallelAttention,
    SlidingWindowAttention,
    causal_attention,
)
from apmodel.models.loss import cross_entropy_loss

#: per-layer attention kinds of ``LlamaConfig.layer_types``
LAYER_TYPES = ("sliding", "full")


@dataclass
class LlamaConfig:
    """Sizes of a LLaMA-3-style model. Defaults are LLaMA-3 8B (Meta's published config)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_hidden_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    # aten op used for attention when traced on the meta device ("flash" or "efficient")
    attention_backend: str = "flash"
    # attention as a local_map region the planner may run context parallel (models.attention)
    context_parallel: bool = False
    # per-head size when it is not dim // n_heads (Qwen3: 128 with dim 5120 and 64 heads)
    attention_head_dim: int | None = None
    # RMSNorm on each head's queries and keys before RoPE (Qwen3's QK-norm)
    qk_norm: bool = False
    # keys per query of the sliding-window layers (models.attention.SlidingWindowAttention); None: none
    sliding_window: int | None = None
    # with sliding_window: layer i attends fully when (i + 1) % full_attention_every == 0 (Gemma 3: 6,
    # five sliding layers then one full), the others in the window; None: every layer in the window
    full_attention_every: int | None = None
    # instead, per layer "sliding" or "full" (n_layers entries)
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"{type(self).__name__}: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{type(self).__name__}: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}: head_dim must be even for RoPE")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{type(self).__name__}: attention_backend={self.attention_backend!r} not in {ATTENTION_BACKENDS}"
            )
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        name = type(self).__name__
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"{name}: sliding_window={self.sliding_window!r} must be a positive number of keys")
        if self.full_attention_every is not None:
            if self.sliding_window is None:
                raise ValueError(f"{name}: full_attention_every={self.full_attention_every} needs a sliding_window")
            if self.full_attention_every < 1:
                raise ValueError(f"{name}: full_attention_every={self.full_attention_every} must be >= 1")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.n_layers:
                raise ValueError(f"{name}: layer_types has {len(types)} entries for n_layers={self.n_layers}")
            bad = sorted({t for t in types if t not in LAYER_TYPES})
            if bad:
                raise ValueError(f"{name}: layer_types {bad} not in {LAYER_TYPES}")
            if "sliding" in types and self.sliding_window is None:
                raise ValueError(f"{name}: layer_types has sliding layers but sliding_window is not set")
            if self.full_attention_every is not None:
                raise ValueError(f"{name}: give layer_types or full_attention_every, not both")
            self.layer_types = types
        if self.context_parallel and any(self.attention_window(i) is not None for i in range(self.n_layers)):
            raise ValueError(f"{name}: context_parallel is not implemented for sliding-window layers "
                             "(a window crossing a sequence shard needs its neighbour's keys)")

    def attention_window(self, layer_id: int) -> int | None:
        """Keys per query of layer ``layer_id``'s attention: the sliding window, or None (full causal)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer_id] == "sliding" else None
        every = self.full_attention_every
        return None if every is not None and (layer_id + 1) % every == 0 else self.sliding_window

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim if self.attention_head_dim is not None else self.dim // self.n_heads


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each ``[max_seq_len, head_dim]`` (the half-dim frequencies repeated twice,
    for the rotate-half formulation)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x: [batch, seq, heads, head_dim]`` with ``cos, sin: [seq, head_dim]``.
    Real-valued (no complex tensors, which DTensor handles poorly). Computed in the tables' dtype
    (fp32) and returned in ``x``'s (a no-op when both are fp32: no node in the graph)."""
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return (x * cos + _rotate_half(x) * sin).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(mean(x²) + eps) * weight; traces with a fused backward op (_fused_rms_norm_backward)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query attention; ``layer_id`` picks its window in a model with sliding-window layers."""

    def __init__(self, cfg: LlamaConfig, layer_id: int | None = None) -> None:
        super().__init__()
        if layer_id is None and cfg.sliding_window is not None:
            raise ValueError(f"{type(cfg).__name__}: sliding_window needs each layer's index "
                             "(Attention(cfg, layer_id)); this model's blocks do not pass it")
        self.window = None if layer_id is None else cfg.attention_window(layer_id)
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.backend = cfg.attention_backend
        self.context_parallel = cfg.context_parallel
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # QK-norm: per head, over head_dim
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context_parallel:  # the region repeats the key/value heads itself, after any gather
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, head_dim]
            out = ContextParallelAttention(self.backend).region()(q, k, v)
        elif self.window is not None and self.window < seq:  # the region repeats the key/value heads too
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = SlidingWindowAttention(self.window, self.backend).region()(q, k, v)
        else:
            # grouped-query attention: each kv head serves n_heads // n_kv_heads query heads
            k, v = repeat_kv(k, self.n_heads // self.n_kv_heads), repeat_kv(v, self.n_heads // self.n_kv_heads)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, seq, head_dim]
            out = causal_attention(q, k, v, self.backend)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[bs, seq, n_kv_heads, d] -> [bs, seq, n_kv_heads * n_rep, d]`` (each kv head repeated n_rep times)."""
    if n_rep == 1:
        return x
    bs, seq, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(bs, seq, n_kv, n_rep, d).reshape(bs, seq, n_kv * n_rep, d)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg, layer_id)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # depth-scaled init, as torchtitan does
        self.init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """LLaMA-3-style decoder: ``tokens [batch, seq] (int64) -> logits [batch, seq, vocab]`` (or the loss, given targets)."""

    rope_cos: torch.Tensor  # buffers [max_seq_len, head_dim]
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # a ModuleDict keyed "0", "1", ... gives the torchtitan FQNs layers.N.*
        self.layers = nn.ModuleDict({str(i): self.make_block(i, cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def make_block(self, layer_id: int, cfg: LlamaConfig) -> nn.Module:
        """The block of layer ``layer_id`` (subclasses swap the feed-forward, e.g. MoE)."""
        return TransformerBlock(layer_id, cfg)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``, or the mean cross-entropy loss (scalar) when ``targets``
        (int64 ``[batch, seq]``) is given.

        A pipeline stage (:mod:`apmodel.lowering.pipeline`, torchtitan's convention) holds some of
        the layers and sets the modules it does not run to None: without ``tok_embeddings`` the
        input is the hidden state ``[batch, seq, dim]``; without ``output`` (and ``norm``) the
        hidden state is returned."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"{type(self).__name__}: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else cross_entropy_loss(logits, targets)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill parameters and RoPE tables (after ``to_empty(device=...)`` from meta)."""
        cos, sin = rope_tables(
            self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, device=self.rope_cos.device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.tok_embeddings is not None:  # a pipeline stage may not hold it (see forward)
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]  # nn.Module.__getattr__ says Tensor | Module
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None:
            final_std = self.config.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std, b=3 * final_std)

"""GPT-2-style decoder: learned positional embedding, pre-LayerNorm blocks, GELU MLP.

Parameter names: ``tok_embeddings``, ``pos_embeddings``, ``layers.N.{attention_norm,attention.{wqkv,wo},
ffn_norm,mlp.{fc,proj}}``, ``norm``, ``output``. OpenAI's model ties the output head to the token embedding; here the head is a
separate matrix by default (``tie_embeddings=False``) because AOTAutograd lifts a tied parameter
as two graph inputs (one per FQN), which a planner would then place independently. With
``tie_embeddings=True`` the parameter count is OpenAI's (GPT-2 small ≈ 124M; untied ≈ 163M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from apmodel.models.attention import ATTENTION_BACKENDS, causal_attention
from apmodel.models.loss import cross_entropy_loss


@dataclass
class GPT2Config:
    """Sizes of a GPT-2-style model. Defaults are GPT-2 small (OpenAI, 2019)."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    attention_backend: str = "flash"
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"GPT2Config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"GPT2Config: attention_backend={self.attention_backend!r} not in {ATTENTION_BACKENDS}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.backend = cfg.attention_backend
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        q, k, v = self.wqkv(x).split(dim, dim=-1)
        q, k, v = (t.view(bs, seq, self.n_heads, dim // self.n_heads).transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v, self.backend)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = CausalSelfAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class GPT2(nn.Module):
    """``tokens [batch, seq] (int64) -> logits [batch, seq, vocab]`` (or the loss, given targets)."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``, or the mean cross-entropy loss (scalar) when ``targets``
        (int64 ``[batch, seq]``) is given.

        A pipeline stage (:mod:`apmodel.lowering.pipeline`) holds some of the layers and sets the
        modules it does not run to None: without the embeddings the input is the hidden state
        ``[batch, seq, dim]``; without ``output`` (and ``norm``) the hidden state is returned."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"GPT2: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None:  # positions as a slice of the table (no arange factory op in the graph)
            h = h + self.pos_embeddings.weight[:seq]
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else cross_entropy_loss(logits, targets)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers)."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            elif name.endswith(("attention.wo.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=resid_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)


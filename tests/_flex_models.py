"""A small language model whose attention is ``torch.nn.attention.flex_attention`` with a block
mask built inside ``forward`` (causal, or causal within documents split at token 0), and the
same model on ``F.scaled_dot_product_attention`` with the dense mask written out by hand: the
independent truth for a backward (flex_attention has none on CPU in torch 2.13)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

EOS = 0  # the token that ends a document


def document_ids(tokens: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: the index of each token's document (a document ends at an EOS token)."""
    ends = (tokens == EOS).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


class FlexLM(nn.Module):
    """Embedding, ``layers`` pre-norm blocks (attention + MLP), a head. ``mask``: ``"causal"`` or
    ``"document"``; ``kv_heads`` < ``heads``: grouped-query attention. ``dense=True``: the same
    function through SDPA with the hand-written mask (no flex_attention)."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, kv_heads: int = 4, layers: int = 2,
                 mask: str = "causal", dense: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.mask, self.dense = heads, kv_heads, dim // heads, mask, dense
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers))
        self.q = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.kv = nn.ModuleList(nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, block_mask) -> torch.Tensor:
        gqa = self.kv_heads != self.heads
        if not self.dense:
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        seq = tokens.shape[1]
        pos = torch.arange(seq, device=tokens.device)
        keep = pos[:, None] >= pos[None, :]
        if self.mask == "document":
            docs = document_ids(tokens)
            keep = keep[None] & (docs[:, :, None] == docs[:, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.reshape(-1, 1, seq, seq), enable_gqa=gqa)

    def block_mask(self, tokens: torch.Tensor):
        """The flex block mask of ``tokens`` (what ``forward`` builds when it is given none)."""
        batch, seq = tokens.shape
        if self.mask == "causal":
            def causal(b, h, q, kv):
                return q >= kv
            return create_block_mask(causal, None, None, seq, seq, device=tokens.device)
        docs = document_ids(tokens)

        def document(b, h, q, kv):
            return (q >= kv) & (docs[b, q] == docs[b, kv])
        return create_block_mask(document, batch, None, seq, seq, device=tokens.device)

    def forward(self, tokens: torch.Tensor, block_mask=None) -> torch.Tensor:
        batch, seq = tokens.shape
        if block_mask is None and not self.dense:
            block_mask = self.block_mask(tokens)
        x = self.embed(tokens)
        for i in range(len(self.q)):
            h = self.norms[2 * i](x)
            q = self.q[i](h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            k, v = self.kv[i](h).view(batch, seq, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            y = self._attend(q, k, v, tokens, block_mask)
            x = x + self.o[i](y.transpose(1, 2).reshape(batch, seq, -1))
            x = x + self.mlp[i](self.norms[2 * i + 1](x))
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def tokens(batch: int, seq: int, vocab: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), with a few EOS tokens (documents) in every row."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, vocab, (batch, seq + 1), generator=g)
    t[:, torch.randint(1, seq, (max(1, seq // 16),), generator=g)] = EOS
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()

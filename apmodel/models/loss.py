"""Training loss of the reference models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: the standard ``F.cross_entropy`` over flattened tokens.
    ``logits: [..., vocab]`` float, ``targets: [...]`` int64 class ids. Computed in fp32 (as real
    recipes do for bf16 logits; a no-op, with no node in the graph, for fp32 logits)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

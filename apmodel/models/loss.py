"""Training loss of the reference models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, written as log_softmax + gather + mean: on the meta device
    ``F.cross_entropy`` traces with no backward, these three ops do.
    ``logits: [..., vocab]`` float, ``targets: [...]`` int64 class ids."""
    logprobs = F.log_softmax(logits, dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()

"""Models the reference models do not cover, for the zoo tests (tests/test_zoo.py).

Each entry builds the model on a device, one batch of inputs on CPU (the same in every process),
and says how the step is called: ``loss = loss_fn(model(*args, **kwargs), *targets)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8


class ConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear: BatchNorm running statistics are buffers updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        h = F.avg_pool2d(h, 2)
        return self.head(h.flatten(1))


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` (2 layers, no dropout) over embedded tokens, mean-pooled, classified."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


class TiedLM(nn.Module):
    """Token MLP language model whose output layer shares the embedding's weight (as GPT-2 does)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        return self.head(self.norm(h + self.mlp(h)))


class PartlyFrozen(nn.Module):
    """A frozen input projection (``requires_grad=False``) under a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 32)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)))


class KeywordInputs(nn.Module):
    """Called with a keyword tensor (a mask) and a keyword constant."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = torch.relu(self.proj(x)) * mask.unsqueeze(-1) * scale
        return self.out(h.sum(1))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class ZooCase:
    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    inputs: Callable[[torch.Generator], tuple[tuple, dict, tuple]]
    """generator -> (args, kwargs, targets), CPU tensors"""
    options: dict[str, Any] = field(default_factory=dict)

    def seeded(self) -> nn.Module:
        """The model with the weights every test and process starts from (seed 0), on CPU."""
        torch.manual_seed(0)
        return self.build()

    def step_inputs(self) -> tuple[tuple, dict, tuple]:
        """The one batch every test and process uses: (args, kwargs, targets) from seed 7."""
        return self.inputs(torch.Generator().manual_seed(7))


def _images(g: torch.Generator):
    return (torch.randn(BATCH, 3, 8, 8, generator=g),), {}, (torch.randint(0, 10, (BATCH,), generator=g),)


def _tokens(vocab: int, classes: int | None):
    def make(g: torch.Generator):
        tokens = torch.randint(0, vocab, (BATCH, 6), generator=g)
        labels = torch.randint(0, classes, (BATCH,), generator=g) if classes else torch.randint(0, vocab, (BATCH, 6), generator=g)
        return (tokens,), {}, (labels,)

    return make


def _features(g: torch.Generator):
    return (torch.randn(BATCH, 16, generator=g),), {}, (torch.randint(0, 4, (BATCH,), generator=g),)


def _masked(g: torch.Generator):
    x = torch.randn(BATCH, 6, 16, generator=g)
    mask = (torch.rand(BATCH, 6, generator=g) > 0.3).float()
    return (x,), {"mask": mask, "scale": 0.5}, (torch.randint(0, 4, (BATCH,), generator=g),)


ZOO = [
    ZooCase("cnn_batchnorm", ConvNet, nn.CrossEntropyLoss(), _images),
    ZooCase("transformer_encoder", EncoderClassifier, F.cross_entropy, _tokens(32, 4)),
    ZooCase("tied_lm", TiedLM, _lm_loss, _tokens(64, None)),
    ZooCase("frozen", PartlyFrozen, F.cross_entropy, _features),
    ZooCase("keyword_inputs", KeywordInputs, lambda logits, y: F.nll_loss(F.log_softmax(logits, -1), y), _masked),
]

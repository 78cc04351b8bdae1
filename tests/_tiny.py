"""A tiny LLaMA (weights from seed 0) and a fixed token batch, shared by the gloo training tests."""

from __future__ import annotations

import torch
import torch.nn as nn

from apmodel.models import build, config

#: Small enough for 4 gloo processes on 2 cores; every dimension divides a 2x2 mesh.
TINY = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=16)
TINY_BATCH, TINY_SEQ = 8, 16


def tiny_model(preset: str, device: str, **fields) -> nn.Module:
    """Preset ``preset`` with config ``fields`` on ``device``, weights from seed 0; initialised
    unless on meta (then ``to_empty`` and load)."""
    with torch.device(device):
        torch.manual_seed(0)
        model = build(config(preset, **fields))
    if device != "meta":
        model.init_weights()
    return model


def tiny_llama(device: str, **fields) -> nn.Module:
    """The tiny LLaMA on ``device`` (``fields`` change its config)."""
    return tiny_model("llama3-debug", device, **{**TINY, **fields})


def fixed_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), ``[TINY_BATCH, TINY_SEQ]`` each, the same on every call and rank."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY["vocab_size"], (TINY_BATCH, TINY_SEQ), generator=g)
    return tokens, torch.randint(0, TINY["vocab_size"], (TINY_BATCH, TINY_SEQ), generator=g)

"""``nn.TransformerDecoder`` with its default causal-mask detection (which compares the mask with a
causal one by value) traces on the meta device, plans, and runs like the eager module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apmodel
from apmodel.graph.capture import capture

from _dist_utils import run_distributed
from _helpers import full_weights


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.decoder(x, memory, tgt_mask=mask))  # tgt_is_causal left to detection


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 32, (4, 8), generator=g), torch.randn(4, 6, 16, generator=g),
            torch.randint(0, 32, (4, 8), generator=g))


def _worker(rank: int, world: int, plan_json: dict) -> tuple[float, float]:
    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict
    from apmodel.result.plans import Plan

    mesh = dist.init_device_mesh("cpu", (1,))
    tokens, memory, targets = _batch()
    torch.manual_seed(0)
    ref = Decoder()
    with torch.device("meta"):
        model = Decoder()
    model = apmodel.parallelize(model, mesh, (tokens.to("meta"), memory.to("meta")), targets=(targets.to("meta"),),
                                loss_fn=_loss, plan=Plan.from_json(plan_json, "decoder"))
    model.to_empty(device="cpu")
    load_full_state_dict(model, full_weights(ref))
    got = model(tokens, memory, targets)
    return float(got.full_tensor() if hasattr(got, "full_tensor") else got), float(_loss(ref(tokens, memory), targets))


@pytest.mark.slow
def test_transformer_decoder_with_causal_detection_traces_plans_and_runs():
    tokens, memory, targets = _batch()
    with torch.device("meta"):
        model = Decoder()
    captured = capture(model, (tokens.to("meta"), memory.to("meta")), _loss, targets=(targets.to("meta"),))
    plan = apmodel.plan(captured, (1,), device="h100")
    got, want = run_distributed(_worker, 1, plan.to_json(), timeout_s=300)[0]
    assert abs(got - want) <= 1e-5 * abs(want)

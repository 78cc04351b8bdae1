"""Pipeline stages on a real gloo mesh: a tiny LLaMA on (2 pipeline × 2) CPU processes, 1F1B (and
the interleaved schedule) over 4 microbatches, each stage's step lowered with its own SPMD plan on
the stage mesh, trains 3 AdamW steps with the losses of one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_utils import run_distributed
from _helpers import train
from _tiny import fixed_tokens, tiny_llama

#: Layers of the tiny LLaMA here: 4, split unevenly so a stage holds more than one layer.
LAYERS = 4
STAGES = ((0, 0), (1, 3))
MICROBATCHES = 4
STEPS = 3


def _reference_losses() -> list[float]:
    tokens, targets = fixed_tokens()
    model = tiny_llama("cpu", n_layers=LAYERS)
    return train(model, lambda m: m(tokens, targets), STEPS)


def _worker(rank: int, world: int, schedule: str, stages: tuple) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models.loss import cross_entropy_loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens, targets = fixed_tokens()
    pipelined = apmodel.parallelize_pipeline(
        lambda: tiny_llama("meta", n_layers=LAYERS), mesh, (tokens,), loss_fn=cross_entropy_loss, pp_axis=0,
        stages=stages, microbatches=MICROBATCHES, pp_schedule=schedule)
    reference = tiny_llama("cpu", n_layers=LAYERS)
    full = {**reference.state_dict(), **dict(reference.named_buffers())}  # RoPE tables are not persistent
    for module in pipelined.stages:
        module.to_empty(device="cpu")
        load_full_state_dict(module, full)
    opt = torch.optim.AdamW(pipelined.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = pipelined.step(tokens, target=targets)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    layers = [sorted({int(n.split(".")[1]) for n, _ in m.named_parameters() if n.startswith("layers.")})
              for m in pipelined.stages]
    return {"losses": losses, "stages": pipelined.stage_indices, "layers": layers}


@pytest.mark.slow
def test_1f1b_pipeline_of_spmd_stages_trains_like_one_device():
    per_rank = run_distributed(_worker, 4, "1f1b", STAGES, timeout_s=900)
    reference = _reference_losses()
    # ranks 0, 1: pipeline rank 0 (stage 0, layer 0); ranks 2, 3: stage 1 (layers 1-3) and the loss
    assert [r["stages"] for r in per_rank] == [[0], [0], [1], [1]]
    assert [r["layers"] for r in per_rank] == [[[0]], [[0]], [[1, 2, 3]], [[1, 2, 3]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
    assert per_rank[0]["losses"] == [None] * STEPS


@pytest.mark.slow
def test_interleaved_pipeline_trains_like_one_device():
    """Two stages per pipeline rank (ScheduleInterleaved1F1B): stage k on pipeline rank k mod 2."""
    per_rank = run_distributed(_worker, 4, "interleaved", ((0, 0), (1, 1), (2, 2), (3, 3)), timeout_s=900)
    assert [r["stages"] for r in per_rank] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [r["layers"] for r in per_rank[1:3]] == [[[0], [2]], [[1], [3]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(_reference_losses(), rel=1e-5)

"""Every preset with repeated layers lowers through the pipeline: a tiny GPT-2, DeepSeek-MoE,
DeepSeek-V3 and hybrid sliding-window model on a real (2 pipeline × 2) gloo mesh, one layer per
stage, 1F1B over 4 microbatches, train 3 AdamW steps with the losses of one device (rel 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_utils import run_distributed
from _helpers import train
from _tiny import TINY, fixed_tokens, tiny_model

STAGES = ((0, 0), (1, 1))
MICROBATCHES, STEPS = 4, 3
#: Tiny configurations (two layers each), as the presets' own tests build them.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", dict(n_layers=2, dim=32, n_heads=4, vocab_size=64, max_seq_len=16)),
    "deepseek-moe": ("moe-debug", dict(TINY, moe_hidden_dim=16, n_routed_experts=8, n_shared_experts=1, top_k=2,
                                       n_dense_layers=1)),
    "deepseek-v3": ("deepseek-v3-debug", dict(TINY, n_kv_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                              qk_rope_head_dim=8, v_head_dim=8, moe_hidden_dim=16, n_routed_experts=4,
                                              n_shared_experts=1, top_k=2, n_group=2, topk_group=1, n_dense_layers=1,
                                              routed_scaling_factor=2.5)),
    "hybrid-swa": ("hybrid-swa-debug", dict(TINY, sliding_window=4, full_attention_every=2, qk_norm=True)),
}


def _worker(rank: int, world: int, name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models.loss import cross_entropy_loss

    preset, fields = PRESETS[name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens, targets = fixed_tokens()
    pipelined = apmodel.parallelize_pipeline(lambda: tiny_model(preset, "meta", **fields), mesh, (tokens,),
                                             loss_fn=cross_entropy_loss, pp_axis=0, stages=STAGES,
                                             microbatches=MICROBATCHES)
    reference = tiny_model(preset, "cpu", **fields)
    full = {**reference.state_dict(), **dict(reference.named_buffers())}
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
    return {"losses": losses, "layers": layers}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_trains_through_the_pipeline_like_one_device(name):
    preset, fields = PRESETS[name]
    tokens, targets = fixed_tokens()
    reference = train(tiny_model(preset, "cpu", **fields), lambda m: m(tokens, targets), STEPS)
    per_rank = run_distributed(_worker, 4, name, timeout_s=600)
    assert [r["layers"] for r in per_rank] == [[[0]], [[0]], [[1]], [[1]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5), name
    assert per_rank[0]["losses"] == [None] * STEPS

"""Every preset with repeated layers lowers through the pipeline: a tiny GPT-2, DeepSeek-MoE,
DeepSeek-V3, hybrid sliding-window model and a transformers LLaMA (layers in an ``nn.ModuleList``)
on a real (2 pipeline × 2) gloo mesh, one layer per stage, 1F1B over 4 microbatches, train 3 AdamW
steps with the losses of one device (rel 1e-5)."""

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
    # a transformers model: ``hf:`` workloads build these (apmodel.frontend.hf.build)
    "hf-llama": ("hf", dict(model_type="llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, vocab_size=64, max_position_embeddings=16,
                            tie_word_embeddings=False)),
}


def _build(name: str, device: str) -> torch.nn.Module:
    preset, fields = PRESETS[name]
    if preset != "hf":
        return tiny_model(preset, device, **fields)
    import transformers

    from apmodel.frontend import hf

    cfg = dict(fields)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        torch.manual_seed(0)
        return hf.build(config)


def _balance(model: torch.nn.Module) -> int:
    """DeepSeek-V3's aux-loss-free balancing after a step, as a trainer runs it: every MoE layer's
    expert bias moved by fixed made-up loads, fast enough to change the routing (speed 0.5).
    Returns how many layers it updated."""
    n = 0
    for m in model.modules():
        if hasattr(m, "update_expert_bias"):
            experts = m.expert_bias.shape[0]
            m.update_expert_bias((torch.arange(experts) >= experts // 2).long(), speed=0.5)  # the first half favoured
            n += 1
    return n


def _loss(name: str, model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from apmodel.models.loss import cross_entropy_loss

    if PRESETS[name][0] == "hf":
        return cross_entropy_loss(model(tokens).logits, targets)
    return model(tokens, targets)


def _worker(rank: int, world: int, name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models.loss import cross_entropy_loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens, targets = fixed_tokens()
    pipelined = apmodel.parallelize_pipeline(lambda: _build(name, "meta"), mesh, (tokens,),
                                             loss_fn=cross_entropy_loss, pp_axis=0, stages=STAGES,
                                             microbatches=MICROBATCHES)
    reference = _build(name, "cpu")
    full = {**reference.state_dict(), **dict(reference.named_buffers())}
    for module in pipelined.stages:
        module.to_empty(device="cpu")
        load_full_state_dict(module, full)
    opt = torch.optim.AdamW(pipelined.parameters(), lr=1e-2)
    losses, balanced = [], 0
    for _ in range(STEPS):
        loss = pipelined.step(tokens, target=targets)
        opt.step()
        opt.zero_grad()
        balanced += sum(_balance(m) for m in pipelined.stages)  # the stage's own MoE layers' buffers
        losses.append(None if loss is None else float(loss))
    layers = [sorted({int(n.split("layers.")[1].split(".")[0]) for n, _ in m.named_parameters() if "layers." in n})
              for m in pipelined.stages]
    return {"losses": losses, "layers": layers, "balanced": balanced}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_trains_through_the_pipeline_like_one_device(name):
    tokens, targets = fixed_tokens()

    def balanced_loss(m: torch.nn.Module) -> torch.Tensor:
        _balance(m)  # before each step's forward but the first: after the previous step, as the stages do
        return _loss(name, m, tokens, targets)

    plain = train(_build(name, "cpu"), lambda m: _loss(name, m, tokens, targets), STEPS)
    model = _build(name, "cpu")
    first = [True]

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        if first[0]:
            first[0] = False
            return _loss(name, m, tokens, targets)
        return balanced_loss(m)

    reference = train(model, loss_of, STEPS)
    if name == "deepseek-v3":  # the bias updates change the routing, so the check below sees them
        assert reference != pytest.approx(plain, rel=1e-5)
    per_rank = run_distributed(_worker, 4, name, timeout_s=600)
    assert [r["layers"] for r in per_rank] == [[[0]], [[0]], [[1]], [[1]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5), name
    assert per_rank[0]["losses"] == [None] * STEPS
    # DeepSeek-V3's second layer is its MoE layer: updated on the second stage's ranks, every step
    assert [r["balanced"] for r in per_rank] == ([0, 0, STEPS, STEPS] if name == "deepseek-v3" else [0] * 4)

"""The Hugging Face families of the paper's Table 5 beyond those of test_hf.py, trained on a 2x2 gloo mesh.

One tiny configuration per family (two layers, hidden size 64): T5 (an encoder-decoder, the
decoder fed the labels shifted right with ``new_zeros``), BLOOM (ALiBi), Falcon (multi-query,
a list index in its attention), GPT-J, GPT-Neo (a mask value made with ``torch.tensor`` in
forward), StableLM, Phi. Each is planned on the mesh, lowered, and trained 3 AdamW steps beside
the same model in plain PyTorch on one process: losses equal to 1e-5 relative, every parameter
and buffer equal after the steps. All families share one 4-process run (process start-up and
imports are most of a run's time).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the optional dependency transformers is not installed "
                                           "(pip install -e '.[hf]')")

import apmodel  # noqa: E402
from apmodel.frontend import hf  # noqa: E402
from apmodel.graph.capture import capture  # noqa: E402

from _dist_utils import run_distributed  # noqa: E402
from _helpers import full_weights, train  # noqa: E402

MESH = (2, 2)
STEPS = 3
LOSS_RTOL = 1e-5
#: parameters and buffers after the steps (AdamW at lr 1e-3 moves a parameter by ~1e-3 a step;
#: its normalisation turns float-rounding differences of near-zero gradients into ~1e-5)
STATE_ATOL = 1e-4
BATCH, SEQ, VOCAB = 8, 16, 128

#: Tiny configs by family: (model_type and fields, head)
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "t5": (dict(model_type="t5", num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "bloom": (dict(model_type="bloom", n_layer=2, hidden_size=64, n_head=4, vocab_size=VOCAB), "causal"),
    "falcon": (dict(model_type="falcon", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                    new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False), "causal"),
    "gptj": (dict(model_type="gptj", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, rotary_dim=8),
             "causal"),
    "gpt_neo": (dict(model_type="gpt_neo", num_layers=2, hidden_size=64, num_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=64, attention_types=[[["global", "local"], 1]], window_size=8), "causal"),
    "stablelm": (dict(model_type="stablelm", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64),
                 "causal"),
    "phi": (dict(model_type="phi", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 vocab_size=VOCAB, max_position_embeddings=64), "causal"),
}


def _config(family: str) -> Any:
    import transformers

    fields = dict(FAMILIES[family][0])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, labels


def _meta_capture(family: str):
    with torch.device("meta"):
        model = hf.build(_config(family), FAMILIES[family][1])
    ids, labels = _batch(torch.Generator().manual_seed(7))
    return model, capture(model, (ids.to("meta"),), hf.hf_loss, kwargs={"labels": labels.to("meta")})


def _train(model: torch.nn.Module, loss_of: Any) -> list[float]:
    """STEPS AdamW steps (lr 1e-3) on the same batches for every model (a fresh generator each)."""
    g = torch.Generator().manual_seed(11)
    return train(model, lambda m: loss_of(m, *_batch(g)), STEPS, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def _train_worker(rank: int, world: int, plans: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from apmodel.lowering import load_full_state_dict, lower
    from apmodel.result.plans import Plan

    mesh = dist.init_device_mesh("cpu", MESH)
    out = {}
    for family, plan_path in plans.items():
        torch.manual_seed(0)
        ref = hf.build(_config(family), FAMILIES[family][1])
        full = full_weights(ref)
        model, captured = _meta_capture(family)
        model = lower(model, mesh, Plan.load(plan_path), captured)
        model.to_empty(device="cpu")
        load_full_state_dict(model, full)
        losses = _train(model, lambda m, ids, labels: m(ids, labels=labels))  # the lowered step returns the loss
        ref_losses = _train(ref, lambda m, ids, labels: m(ids, labels=labels).loss)
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        err = max((state[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items())
        out[family] = {"losses": losses, "ref_losses": ref_losses, "state_err": err}
    return out


@pytest.mark.slow
def test_table5_families_train_like_one_device_on_a_2x2_mesh(tmp_path):
    plans = {}
    for family in FAMILIES:
        _, captured = _meta_capture(family)
        plan = apmodel.plan(captured, MESH, device="h100")
        plans[family] = str(tmp_path / f"{family}.json")
        plan.save(plans[family])
    result = run_distributed(_train_worker, 4, plans, timeout_s=600)[0]
    assert set(result) == set(FAMILIES)
    off = {family: r for family, r in result.items()
           if any(abs(got - want) > LOSS_RTOL * abs(want) for got, want in zip(r["losses"], r["ref_losses"], strict=False))
           or r["state_err"] >= STATE_ATOL}
    assert off == {}

"""Cutting pipeline stages out of a model, and the boundary placements stages agree on (no
processes: meta models and the pieces of :mod:`apmodel.lowering.pipeline`)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from apmodel.lowering import pipeline as P
from apmodel.result.pipeline_record import DegreePrice, PipelineChoice, PipelineError

from _tiny import TINY, tiny_model

GPT2 = dict(n_layers=2, dim=32, n_heads=4, vocab_size=64, max_seq_len=16)
TOKENS = torch.zeros(2, 16, dtype=torch.long, device="meta")


def _hf(model_type: str, **fields):
    transformers = pytest.importorskip("transformers")
    from apmodel.frontend import hf

    with torch.device("meta"):
        return hf.build(transformers.AutoConfig.for_model(model_type, **fields))


HF_LLAMA = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=64, max_position_embeddings=16, tie_word_embeddings=False)


def test_modules_before_the_layers_are_found_by_what_the_forward_reads():
    # GPT-2 reads its position table as a tensor (no module call) before the first layer
    assert P.children_before_layers(tiny_model("gpt2", "meta", **GPT2), (TOKENS,)) == {"tok_embeddings",
                                                                                      "pos_embeddings"}
    assert P.children_before_layers(tiny_model("llama3-debug", "meta", **TINY), (TOKENS,)) == {"tok_embeddings"}
    stage = P.cut_stage(tiny_model("gpt2", "meta", **GPT2), 1, 1, is_first=False, is_last=True,
                        before={"tok_embeddings", "pos_embeddings"})
    assert stage.tok_embeddings is None and stage.pos_embeddings is None and stage.output is not None
    assert {n.split(".")[1] for n, _ in stage.named_parameters() if n.startswith("layers.")} == {"1"}


def test_tied_weights_across_stages_are_refused():
    with pytest.raises(P.PipelineLoweringError, match="output, tok_embeddings share a parameter"):
        P.cut_stage(tiny_model("gpt2", "meta", **GPT2, tie_embeddings=True), 0, 0, is_first=True, is_last=False)


def test_a_module_list_keeps_the_full_models_names():
    model = _hf("llama", **HF_LLAMA)
    before = P.children_before_layers(model, (TOKENS,))
    assert before == {"model.embed_tokens"}
    full = {n for n, _ in model.named_parameters()}
    middle = P.cut_stage(model, 1, 1, is_first=False, is_last=False, before=before)
    names = {n for n, _ in middle.named_parameters()}
    assert names and names <= full and {n.split(".")[2] for n in names} == {"1"}
    assert isinstance(middle.model.layers, P.StageLayers) and len(middle.model.layers[:3]) == 1
    assert isinstance(middle.model.embed_tokens, torch.nn.Identity) and isinstance(middle.lm_head, torch.nn.Identity)
    hidden = torch.zeros(2, 16, 32, device="meta")
    with P._on_meta():
        out = P.stage_output(middle(hidden))
    assert out.shape == hidden.shape  # the hidden state in, the hidden state out


def test_a_learned_position_table_in_a_module_list_model_is_refused():
    model = _hf("gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, tie_word_embeddings=False)
    with pytest.raises(P.PipelineLoweringError, match="learned position table"):
        P.cut_stage(model, 1, 1, is_first=False, is_last=True)


def test_stages_agree_on_the_recorded_boundary_placement_or_the_default():
    act = torch.empty(4, 16, 32, device="meta")
    recorded = P._agreed_boundaries([act, act], [["S(1)", "R"], None], (2, 2))
    assert [b.placements for b in recorded] == [(Shard(1), Replicate()), (Shard(0), Replicate())]
    assert recorded[0].shape == act.shape
    with pytest.raises(P.PipelineLoweringError, match=r"boundary 0 \(stage 0 to 1\).*no partial sums"):
        P._agreed_boundaries([act], [["P", "R"]], (2, 2))
    with pytest.raises(P.PipelineLoweringError, match="expected one per boundary"):
        P._agreed_boundaries([act], [None, None], (2, 2))


def test_the_record_keeps_what_crosses_each_boundary():
    two = DegreePrice(2, 10.0, 1e9, True, (2,), ((0, 0), (1, 1)), boundary_bytes=(2048.0,),
                      boundary_placements=(("S(0)",),))
    choice = PipelineChoice(axis=0, mesh=(2, 2), schedule="1f1b", microbatches=4, chosen=two, alternatives=[two])
    data = choice.to_json()
    assert data["boundary_bytes"] == [2048.0] and data["boundary_placements"] == [["S(0)"]]
    again = PipelineChoice.from_json(data)
    assert again.chosen.boundary_placements == (("S(0)",),) and again.alternatives[0].boundary_bytes == (2048.0,)
    with pytest.raises(PipelineError, match="boundary_placements"):
        PipelineChoice.from_json({**data, "boundary_placements": [["P"]]})

"""Model conventions: the layer pattern and parameter roles derived from a traced graph (data flow)
and from a module tree (names), checked against what each reference model's source says its
layers are (written out here by hand, independently of the derivation)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from apmodel.graph import conventions as C
from apmodel.graph.capture import capture
from apmodel.models import build, sample_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_models import EncoderClassifier  # noqa: E402

#: What apmodel/models/*.py say each parameter of layer 0 and of the model is (by reading the code).
LLAMA_ROLES = {
    "tok_embeddings.weight": "embedding", "output.weight": "output", "norm.weight": "norm",
    "layers.0.attention_norm.weight": "norm", "layers.0.ffn_norm.weight": "norm",
    "layers.0.attention.wq.weight": "column", "layers.0.attention.wk.weight": "column",
    "layers.0.attention.wv.weight": "column", "layers.0.attention.wo.weight": "row",
    "layers.0.feed_forward.w1.weight": "column", "layers.0.feed_forward.w3.weight": "column",
    "layers.0.feed_forward.w2.weight": "row",
}
GPT2_ROLES = {
    "tok_embeddings.weight": "embedding", "pos_embeddings.weight": "", "output.weight": "output",
    "norm.weight": "norm", "norm.bias": "tp_replicated",
    "layers.0.attention_norm.weight": "norm", "layers.0.attention_norm.bias": "tp_replicated",
    "layers.0.attention.wqkv.weight": "column", "layers.0.attention.wqkv.bias": "column",
    "layers.0.attention.wo.weight": "row", "layers.0.attention.wo.bias": "tp_replicated",
    "layers.0.ffn_norm.weight": "norm", "layers.0.ffn_norm.bias": "tp_replicated",
    "layers.0.mlp.fc.weight": "column", "layers.0.mlp.fc.bias": "column",
    "layers.0.mlp.proj.weight": "row", "layers.0.mlp.proj.bias": "tp_replicated",
}
MOE_LAYER1_ROLES = {  # moe-debug: layer 0 dense (as LLaMA), layer 1 routed experts + shared experts
    "layers.1.attention.wq.weight": "column", "layers.1.attention.wo.weight": "row",
    "layers.1.moe.shared_experts.w1.weight": "column", "layers.1.moe.shared_experts.w3.weight": "column",
    "layers.1.moe.shared_experts.w2.weight": "row",
    "layers.1.moe.router.weight": "",  # routes tokens: neither half of a pair
    "layers.1.moe.experts.w1": "", "layers.1.moe.experts.w2": "", "layers.1.moe.experts.w3": "",  # [E, in, out]
}
ENCODER_ROLES = {
    "embed.weight": "embedding", "head.weight": "output", "head.bias": "output",
    "encoder.layers.0.self_attn.in_proj_weight": "column", "encoder.layers.0.self_attn.in_proj_bias": "column",
    "encoder.layers.0.self_attn.out_proj.weight": "row", "encoder.layers.0.self_attn.out_proj.bias": "tp_replicated",
    "encoder.layers.0.linear1.weight": "column", "encoder.layers.0.linear1.bias": "column",
    "encoder.layers.0.linear2.weight": "row", "encoder.layers.0.linear2.bias": "tp_replicated",
    "encoder.layers.0.norm1.weight": "norm", "encoder.layers.0.norm1.bias": "tp_replicated",
    "encoder.layers.0.norm2.weight": "norm", "encoder.layers.0.norm2.bias": "tp_replicated",
}


def _preset(name: str, n_layers: int = 2):
    with torch.device("meta"):
        model = build(name, n_layers=n_layers)
    return model, capture(model, sample_inputs(name, batch=4, seq=32))


def _encoder():
    with torch.device("meta"):
        model = EncoderClassifier()
    tokens = torch.zeros(8, 6, dtype=torch.long, device="meta")
    labels = torch.zeros(8, dtype=torch.long, device="meta")
    return model, capture(model, (tokens,), F.cross_entropy, targets=(labels,))


CASES = {
    "llama3-debug": (lambda: _preset("llama3-debug"), "layers.{i}.", LLAMA_ROLES),
    "gpt2": (lambda: _preset("gpt2"), "layers.{i}.", GPT2_ROLES),
    "moe-debug": (lambda: _preset("moe-debug"), "layers.{i}.", {**LLAMA_ROLES, **MOE_LAYER1_ROLES}),
    "transformer_encoder": (_encoder, "encoder.layers.{i}.", ENCODER_ROLES),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    make, pattern, roles = CASES[request.param]
    model, captured = make()
    return request.param, model, captured, pattern, roles


def test_derived_from_the_graph(case):
    name, _, captured, pattern, roles = case
    conv = C.derive(captured)
    assert conv.layer_pattern == pattern, name
    got = conv.roles(roles)
    assert got == roles, name
    # every parameter of layer 1 has the role of its layer-0 twin (where layer 1 has one)
    fqns = list(captured.param_fqn.values())
    for fqn in fqns:
        layer, rest = conv.split(fqn)
        twin = pattern.replace("{i}", "0") + rest
        if layer and twin in fqns and name != "moe-debug":
            assert conv.role(fqn) == conv.role(twin), fqn


def test_derived_from_the_module_tree_agrees(case):
    name, model, captured, pattern, roles = case
    conv = C.from_module(model)
    assert conv.layer_pattern == pattern, name
    assert conv.roles(roles) == roles, name
    graph = C.derive(captured)
    fqns = list(captured.param_fqn.values())
    assert conv.roles(fqns) == graph.roles(fqns), name


def test_layers_split_by_the_pattern(case):
    name, _, captured, pattern, _ = case
    conv = C.derive(captured)
    layers = {conv.layer_of(f) for f in captured.param_fqn.values()} - {""}
    assert layers == {pattern.replace("{i}.", str(i)) for i in range(2)}, name
    outside = [f for f in captured.param_fqn.values() if not conv.layer_of(f)]
    assert outside and all(not f.startswith(pattern.split("{i}")[0]) for f in outside)


def test_llama_default_is_todays_behaviour():
    """The default conventions are the names the recipes, report and roles assumed before."""
    _, captured = _preset("llama3-debug")
    fqns = list(captured.param_fqn.values())
    assert C.LLAMA.roles(fqns) == C.derive(captured).roles(fqns)
    assert C.LLAMA.split("layers.12.attention.wq.weight") == ("layers.12", "attention.wq.weight")
    assert C.LLAMA.split("model.layers.3.mlp.w1.weight") == ("model.layers.3", "mlp.w1.weight")  # any prefix
    assert C.LLAMA.split("output.weight") == ("", "output.weight")
    assert C.LLAMA.is_norm_weight("layers.0.ffn_norm.weight") and not C.LLAMA.is_norm_weight("layers.0.ffn_norm.bias")


def test_one_layer_model_still_has_its_layer():
    _, captured = _preset("gpt2", n_layers=1)
    conv = C.derive(captured)
    assert conv.layer_pattern == "layers.{i}."
    assert conv.role("layers.0.attention.wqkv.weight") == "column" and conv.role("layers.0.mlp.proj.weight") == "row"


def test_layer_pattern_from_names():
    f = C.layer_pattern_from_names
    assert f(["h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight", "wte.weight"]) == "h.{i}."
    assert f(["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"]) == "transformer.h.{i}."
    bert = [f"bert.encoder.layer.{i}.attention.self.query.weight" for i in range(3)]
    assert f(bert + ["bert.embeddings.word_embeddings.weight"]) == "bert.encoder.layer.{i}."
    # a Sequential of bare layers is not a stack of blocks; the outer container wins over an inner one
    assert f(["mlp.0.weight", "mlp.2.weight"]) is None
    assert f(["layers.0.experts.0.w.weight", "layers.0.experts.1.w.weight", "layers.1.attn.w.weight"]) == "layers.{i}."
    assert f(["0.attn.weight.x", "1.attn.weight.x"]) == "{i}."
    assert f(["w", "b"]) is None


def test_from_names_for_plan_files():
    conv = C.from_names(["h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight",
                         "ln_f.weight", "layer_norm.weight", "wte.weight"])
    assert conv.layer_pattern == "h.{i}."
    assert conv.split("h.1.attn.c_attn.weight") == ("h.1", "attn.c_attn.weight")
    assert conv.is_norm_weight("layer_norm.weight") and not conv.is_norm_weight("wte.weight")
    assert conv.role("h.7.attn.c_attn.weight") == ""  # no roles from names alone


def test_given_conventions_are_checked():
    with pytest.raises(ValueError, match="{i}"):
        C.ModelConventions(layer_pattern="layers.")
    with pytest.raises(TypeError, match="sequence of glob patterns"):
        C.ModelConventions(column_parallel="*.wq.weight")
    hf = C.ModelConventions(layer_pattern="model.layers.{i}.", column_parallel=("*.q_proj.weight",),
                            row_parallel=("*.o_proj.weight",), norm_weights=("*layernorm.weight",),
                            embedding=("model.embed_tokens.weight",), output=("lm_head.weight",), source="given")
    assert hf.split("model.layers.4.self_attn.q_proj.weight") == ("model.layers.4", "self_attn.q_proj.weight")
    assert hf.layer_index("model.layers.4.self_attn.q_proj.weight") == 4
    assert hf.role("model.layers.4.self_attn.o_proj.weight") == "row"
    assert hf.role("model.layers.4.input_layernorm.weight") == "norm"
    assert hf.to_dict()["source"] == "given"

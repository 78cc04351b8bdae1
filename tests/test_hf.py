"""Hugging Face transformers built from their configs (``hf:`` specs, :mod:`apmodel.frontend.hf`).

Tiny configurations (two layers, hidden size 64) of the families apmodel knows by name: they
plan with a backward (every parameter gets a gradient), keep tied weights tied, trace attention as
the fused flash op (no materialised mask), get tensor-parallel recipes priced; spec errors are one
named line; and a tiny GPT-2 lowered on a real 2x2 gloo mesh trains 3 steps like one device.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the optional dependency transformers is not installed "
                                           "(pip install -e '.[hf]')")

import apmodel  # noqa: E402
from apmodel.core.options import PlanOptions  # noqa: E402
from apmodel.entry.api import plan_workload  # noqa: E402
from apmodel.frontend import hf  # noqa: E402
from apmodel.frontend.workloads import WorkloadError, load_workload  # noqa: E402
from apmodel.graph.capture import capture  # noqa: E402

from _dist_utils import run_distributed  # noqa: E402
from _helpers import full_weights

MESH = (2, 2)
STEPS = 3
LOSS_RTOL = 1e-5

#: Tiny configs (config.json contents) of the families of apmodel.frontend.hf.PRESETS.
TINY: dict[str, dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32),
    "bert": dict(model_type="bert", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=128, vocab_size=128, max_position_embeddings=32),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "gpt_neox": dict(model_type="gpt_neox", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     intermediate_size=128, vocab_size=128, max_position_embeddings=64, rotary_pct=0.25,
                     tie_word_embeddings=False),
    "opt": dict(model_type="opt", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64),
}
BATCH, SEQ = 4, 12  # batch x seq (48) is no weight dimension: the recipes' batch rule reads dim 0 sizes


def _config_file(tmp_path: Path, family: str, **changes: Any) -> str:
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps({**TINY[family], **changes}))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_configs")
    return {family: _config_file(root, family) for family in TINY}


def _capture(spec: str, **kw: Any):
    wl = load_workload(spec, MESH, batch=BATCH, seq=SEQ, **kw)
    return wl, capture(wl.model, wl.sample_inputs, wl.loss_fn, kwargs=wl.kwargs)


def _ops(captured) -> set[str]:
    return {str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"}


# ------------------------------------------------------------------------------ planning
def _skip_old_opt(family: str) -> None:
    import transformers
    from packaging.version import Version

    if family == "opt" and Version(transformers.__version__) < Version("5.23"):
        pytest.skip(f"transformers {transformers.__version__} draws OPT's layer-drop number even at probability 0 "
                    "(a random branch a trace cannot take); fixed in 5.23")


@pytest.mark.parametrize("family", list(TINY))
def test_plan_has_a_backward_for_every_parameter(configs, family):
    _skip_old_opt(family)
    wl, captured = _capture(configs[family])
    fqns = {fqn for fqn, p in wl.model.named_parameters() if p.requires_grad}  # tied: the first FQN only
    assert set(captured.param_fqn.values()) == fqns
    assert set(captured.param_grad) == set(captured.param_fqn)  # every parameter gets a gradient
    plan = apmodel.plan(captured, MESH, device="h100")
    backward = [n for n, b in captured.is_backward.items() if b and n in plan.node_strategy]
    assert len(backward) > 0.4 * len(plan.node_strategy)  # the plan places the backward too
    grads = set(captured.param_grad.values())
    assert grads <= set(plan.node_strategy)
    assert set(plan.param_placements) >= fqns
    # attention is the fused flash op: no [b, 1, s, s] mask was built (no math-path softmax)
    ops = _ops(captured)
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._safe_softmax.default" not in ops and "aten._softmax.default" not in ops


def test_masked_lm_head_and_tied_decoder(configs):
    wl, captured = _capture(configs["bert"])
    assert type(wl.model).__name__ == "BertForMaskedLM"
    tied = {fqn for aliases in captured.tied_params.values() for fqn in aliases}
    assert {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} <= tied


def test_tied_weights_are_one_variable_with_one_placement(configs):
    _, captured = _capture(configs["gpt2"])
    (node,) = [n for n, f in captured.param_fqn.items() if f == "transformer.wte.weight"]
    assert captured.tied_params == {node: ["lm_head.weight"]}
    plan = apmodel.plan(captured, MESH, device="h100")
    assert plan.param_placements["lm_head.weight"] == plan.param_placements["transformer.wte.weight"]


def test_grouped_query_attention_traces_as_flash_with_repeated_heads(configs):
    _, captured = _capture(configs["llama"])
    (flash,) = [n for n in captured.gm.graph.nodes
                if n.target is torch.ops.aten._scaled_dot_product_flash_attention.default][:1]
    q, k, v = (a.meta["val"] for a in flash.args[:3])
    assert q.shape == k.shape == v.shape == (BATCH, 4, SEQ, 16)  # 2 key/value heads repeated for 4 query heads


def test_layers_batch_and_seq_flags(configs, caplog):
    wl = load_workload(configs["gpt2"], MESH, batch=8, seq=16, layers=1)
    assert wl.model.config.num_hidden_layers == 1 and len(wl.model.transformer.h) == 1
    assert tuple(wl.sample_inputs[0].shape) == (8, 16) and wl.sample_inputs[0].device.type == "meta"
    assert wl.record == {"model": configs["gpt2"], "batch": 8, "seq": 16, "layers": 1}
    with caplog.at_level(logging.WARNING, logger="apmodel.frontend.hf"):
        capped = load_workload(configs["gpt2"], MESH, batch=8, seq=100)
    assert tuple(capped.sample_inputs[0].shape) == (8, 32) and capped.record["seq"] == 32  # n_positions
    assert "longer than its position table" in caplog.text
    rotary = load_workload(configs["llama"], MESH, batch=8, seq=100)  # no position table: not capped
    assert tuple(rotary.sample_inputs[0].shape) == (8, 100)


def test_training_configuration_has_no_dropout_and_no_cache(configs):
    wl = load_workload(_config_file_from(configs["gpt2"], resid_pdrop=0.1, attn_pdrop=0.1), MESH, batch=4, seq=8)
    cfg = wl.model.config
    assert cfg.use_cache is False and cfg.resid_pdrop == 0.0 and cfg.attn_pdrop == 0.0 and cfg.embd_pdrop == 0.0
    assert cfg._attn_implementation == hf.ATTENTION
    assert all(p.device.type == "meta" for p in wl.model.parameters())


def _config_file_from(spec: str, **changes: Any) -> str:
    path = Path(spec[len("hf:"):])
    out = path.with_name(path.stem + "-changed.json")
    out.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return f"hf:{out}"


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_tensor_parallel_recipes_are_priced(configs, family):
    wl = load_workload(configs[family], MESH, batch=BATCH, seq=SEQ)
    result = plan_workload(wl, PlanOptions(device="h100"), compare_recipes=True)
    status = {r.name: r.status for r in result.recipes}
    assert all(s == "ok" for s in status.values()), {r.name: r.reason for r in result.recipes if r.status != "ok"}


def test_presets_have_their_published_sizes():
    expected = {"gpt2-medium": 354.8e6, "bert-base": 110.0e6, "tinyllama-1.1b": 1.100e9, "pythia-160m": 162.3e6,
                "opt-125m": 125.2e6}
    for name, params in expected.items():
        with torch.device("meta"):
            model = hf.build(f"hf:{name}", layers=None)
        got = sum(p.numel() for p in model.parameters())
        assert got == pytest.approx(params, rel=0.02), (name, got)


# ------------------------------------------------------------------------------ errors
def test_spec_errors_are_one_named_line(tmp_path):
    cases = {
        "hf:nonesuch": "unknown Hugging Face model 'nonesuch'",
        f"hf:{tmp_path}/missing/config.json": "does not exist",
        "hf:": "give a model after hf:",
    }
    bad_type = tmp_path / "bad.json"
    bad_type.write_text(json.dumps({"model_type": "no_such_architecture"}))
    cases[f"hf:{bad_type}"] = "cannot build model_type 'no_such_architecture'"
    no_type = tmp_path / "untyped.json"
    no_type.write_text(json.dumps({"n_layer": 2}))
    cases[f"hf:{no_type}"] = 'has no "model_type"'
    for spec, text in cases.items():
        with pytest.raises(WorkloadError) as e:
            load_workload(spec, MESH, batch=4, seq=8)
        assert text in str(e.value) and "\n" not in str(e.value), (spec, str(e.value))
        assert repr(spec) in str(e.value)


def test_cli_names_the_spec_in_one_error_line():
    from typer.testing import CliRunner

    from apmodel.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "hf:nonesuch", "--mesh", "2x2"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model 'hf:nonesuch': unknown Hugging Face model")


def test_cli_plans_a_config_file_and_reports_the_sequence_planned(configs):
    from typer.testing import CliRunner

    from apmodel.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", configs["gpt2"], "--mesh", "2x2", "--batch", "8",
                                      "--seq", "64", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == configs["gpt2"] and data["seq"] == 32  # capped at n_positions
    assert data["param_placements"]["lm_head.weight"] == data["param_placements"]["transformer.wte.weight"]


# ------------------------------------------------------------------------------ lowering
#: One decoder with tied weights (GPT-2, causal LM) and one encoder (BERT, masked LM).
LOWERED = {"gpt2": "causal", "bert": "masked"}


def _tiny_config(family: str) -> Any:
    import transformers

    cfg = dict(TINY[family])
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _batch(family: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TINY[family]["vocab_size"], (8, 16), generator=generator)
    return ids, ids.clone()


def _meta_capture(family: str):
    with torch.device("meta"):
        model = hf.build(_tiny_config(family), LOWERED[family])
    ids, labels = _batch(family, torch.Generator().manual_seed(7))
    return model, capture(model, (ids.to("meta"),), hf.hf_loss, kwargs={"labels": labels.to("meta")})


def _train_worker(rank: int, world: int, plan_path: str, family: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from apmodel.lowering import load_full_state_dict, lower
    from apmodel.result.plans import Plan

    mesh = dist.init_device_mesh("cpu", MESH)
    torch.manual_seed(0)
    ref = hf.build(_tiny_config(family), LOWERED[family])
    full = full_weights(ref)
    model, captured = _meta_capture(family)
    model = lower(model, mesh, Plan.load(plan_path), captured)
    model.to_empty(device="cpu")
    load_full_state_dict(model, full)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(11)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        ids, labels = _batch(family, g)
        opt.zero_grad()
        loss = model(ids, labels=labels)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = ref(ids, labels=labels).loss
        ref_loss.backward()
        ref_opt.step()
        losses.append(loss.full_tensor().item())
        ref_losses.append(ref_loss.item())
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    err = max((state[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items() if k in state)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    return {"losses": losses, "ref_losses": ref_losses, "state_err": err,
            "tied": out is not None and out.weight is inp.weight}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(LOWERED))
def test_tiny_model_trains_like_one_device_on_a_gloo_mesh(tmp_path, family):
    _, captured = _meta_capture(family)
    plan = apmodel.plan(captured, MESH, device="h100")
    plan.save(tmp_path / f"{family}.json")
    r = run_distributed(_train_worker, 4, str(tmp_path / f"{family}.json"), family, timeout_s=300)[0]
    for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=False)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (step, got, want)
    assert r["state_err"] < 1e-4
    assert r["tied"]  # both tie their word embeddings to the LM head, and the tie survives lowering

def test_an_unknown_model_type_is_one_short_line(tmp_path, caplog):
    """transformers' own message lists every model type it knows (12,000 characters): the error
    keeps its first sentence; the whole message is logged at INFO (``-v``)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 64}))
    with caplog.at_level(logging.INFO, logger="apmodel.frontend.hf"):
        with pytest.raises(hf.HFSpecError, match=r"cannot build model_type 'no-such-model'.*-v shows") as info:
            hf.build(f"hf:{path}", layers=None)
    assert len(str(info.value)) < 450 + len(str(path)) and "\n" not in str(info.value)
    whole = [r.getMessage() for r in caplog.records if "whole message" in r.getMessage()]
    assert whole and len(whole[0]) > 1000

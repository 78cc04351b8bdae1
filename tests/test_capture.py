"""Capture: labelled joint graph of the reference models. The strongest check runs the captured
graph on real CPU tensors and compares loss and gradients with eager autograd."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from apmodel.graph.capture import CapturedGraph, capture
from apmodel.models import build, cross_entropy_loss, sample_inputs
from apmodel.models.attention import CPU_REFERENCE_KERNELS

B, S = 2, 32


def _capture(name: str = "llama3-debug", batch: int = B, seq: int = S, **kw) -> CapturedGraph:
    with torch.device("meta"):
        model = build(name, **kw)
    return capture(model, sample_inputs(name, batch, seq))


@pytest.fixture(scope="module")
def llama() -> CapturedGraph:
    return _capture()


class _CPUInterpreter(fx.Interpreter):
    """Runs a meta-traced graph on CPU tensors: ops without a CPU kernel go to reference kernels,
    factory ops that name the meta device get the CPU device."""

    def call_function(self, target, args, kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return CPU_REFERENCE_KERNELS.get(target, target)(*args, **kwargs)


def _run_on_cpu(cg: CapturedGraph, model: nn.Module, inputs: tuple) -> dict[str, torch.Tensor]:
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    args = []
    for node in cg.gm.graph.find_nodes(op="placeholder"):
        role = cg.roles[node.name]
        if role == "param":
            args.append(params[cg.param_fqn[node.name]].detach())
        elif role == "buffer":
            args.append(buffers[cg.buffer_fqn[node.name]])
        elif role == "input":
            args.append(inputs[cg.input_index[node.name]])
        else:
            assert role == "tangent"
            args.append(torch.ones(()))  # d loss / d loss
    out = _CPUInterpreter(cg.gm).run(*args)
    out_node = cg.gm.graph.output_node()
    return {n.name: v for n, v in zip(out_node.args[0], out, strict=True) if isinstance(n, fx.Node)}


def test_roles_complete_and_every_param_has_grad(llama):
    with torch.device("meta"):
        model = build("llama3-debug")
    fqns = {n for n, _ in model.named_parameters()}
    placeholders = [n.name for n in llama.gm.graph.find_nodes(op="placeholder")]
    assert all(p in llama.roles for p in placeholders)
    assert set(llama.param_fqn.values()) == fqns
    assert set(llama.buffer_fqn.values()) == {"rope_cos", "rope_sin"}
    assert sorted(llama.input_index.values()) == [0, 1]
    assert set(llama.param_grad) == set(llama.param_fqn)  # every parameter has a gradient
    assert llama.input_grad == {}  # integer tokens get no gradient
    nodes = {n.name: n for n in llama.gm.graph.nodes}
    for p, g in llama.param_grad.items():
        assert llama.roles[g] == "grad_param"
        assert nodes[g].meta["val"].shape == nodes[p].meta["val"].shape
    ((out, tangent),) = llama.output_tangent.items()
    assert llama.roles[out] == "output" and llama.roles[tangent] == "tangent"
    assert nodes[out].meta["val"].shape == ()
    assert llama.nodes_with_role("output") == [out]


def test_attention_ops_and_backward_flags(llama):
    targets = {str(n.target): n.name for n in llama.gm.graph.nodes if n.op == "call_function"}
    fwd = targets["aten._scaled_dot_product_flash_attention.default"]
    bwd = targets["aten._scaled_dot_product_flash_attention_backward.default"]
    assert not llama.is_backward[fwd] and llama.is_backward[bwd]
    assert all(llama.is_backward[g] for g in llama.param_grad.values())
    assert not any(llama.is_backward[p] for p in llama.param_fqn)
    assert set(llama.is_backward) == {n.name for n in llama.gm.graph.nodes}
    assert "aten.detach.default" not in targets
    assert llama.unsupported_ops == []  # every op has a DTensor rule
    assert llama.stats["backward"] > llama.stats["forward"] > 0


def test_joint_graph_matches_eager_autograd(llama):
    """Run the captured graph on real CPU tensors: loss and every gradient equal eager autograd
    (which runs the model's CPU attention path, torch's SDPA)."""
    torch.manual_seed(0)
    model = build("llama3-debug")
    model.init_weights()
    tokens, targets = sample_inputs("llama3-debug", B, S, device="cpu")
    results = _run_on_cpu(llama, model, (tokens, targets))
    loss = model(tokens, targets)
    loss.backward()
    ((out, _),) = llama.output_tangent.items()
    torch.testing.assert_close(results[out], loss.detach())
    params = dict(model.named_parameters())
    for p, g in llama.param_grad.items():
        torch.testing.assert_close(results[g], params[llama.param_fqn[p]].grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, p=p: f"{llama.param_fqn[p]}: {m}")


def test_fingerprint_stable_and_shape_sensitive(llama):
    again = _capture()
    assert again.fingerprint == llama.fingerprint
    assert len(llama.fingerprint) == 64
    assert _capture(seq=S * 2).fingerprint != llama.fingerprint


def test_loss_fn_and_float_inputs():
    # loss_fn path: model(tokens) -> logits, loss computed by loss_fn; FQNs carry no wrapper prefix
    with torch.device("meta"):
        model = build("gpt2", n_layers=1)
    tokens, _ = sample_inputs("gpt2", B, S)
    cg = capture(model, (tokens,), loss_fn=lambda logits, tok: cross_entropy_loss(logits, tok))
    assert set(cg.param_fqn.values()) == {n for n, _ in model.named_parameters()}
    assert set(cg.param_grad) == set(cg.param_fqn) and cg.unsupported_ops == []
    # a float input that requires grad gets a gradient; no loss_fn: the output is traced as is
    with torch.device("meta"):
        lin = nn.Linear(8, 4)
        x = torch.randn(3, 8, requires_grad=True)
    cg = capture(lin, (x,))
    ((inp, grad),) = cg.input_grad.items()
    assert cg.input_index[inp] == 0 and cg.roles[grad] == "grad_input"
    ((out, tangent),) = cg.output_tangent.items()
    assert cg.gm.graph.find_nodes(op="placeholder")[-1].name == tangent


def test_moe_captures_with_rules():
    cg = _capture("moe-debug")
    assert set(cg.param_grad) == set(cg.param_fqn)
    assert cg.unsupported_ops == []


def test_bad_inputs_are_named():
    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    tokens, targets = sample_inputs("llama3-debug", B, S)
    with pytest.raises(ValueError, match="nn.Module"):
        capture(lambda t: t, (tokens,))
    with pytest.raises(ValueError, match=r"sample_inputs\[1\]"):
        capture(model, (tokens, 3))
    with pytest.raises(ValueError, match="sample_inputs"):
        capture(model, {"tokens": tokens})
    with pytest.raises(ValueError, match="scalar"):
        capture(model, (tokens,), loss_fn=lambda logits, tok: logits)
    with pytest.raises(ValueError, match="loss_fn"):
        capture(model, (tokens,), loss_fn="cross_entropy")


def test_fast_trace_equals_functionalized_trace(llama):
    """Tracing without functionalization (default, in-place ops on fresh intermediates rewritten)
    gives the same graph as AOTAutograd's functionalized trace."""
    with torch.device("meta"):
        model = build("llama3-debug")
    slow = capture(model, sample_inputs("llama3-debug", B, S), functionalize=True)
    assert slow.fingerprint == llama.fingerprint
    assert not any(getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
                   for n in llama.gm.graph.nodes if n.op == "call_function")


class _MutatesView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y[0].mul_(2.0)  # in-place on a view: needs functionalization
        return y.sum()


def test_mutation_of_a_view_falls_back_to_functionalization():
    with torch.device("meta"):
        model, x = _MutatesView(), torch.randn(3, 4)
    cg = capture(model, (x,))
    assert cg.fingerprint == capture(model, (x,), functionalize=True).fingerprint
    with pytest.raises(ValueError, match="functionalize=True"):
        capture(model, (x,), functionalize=False)

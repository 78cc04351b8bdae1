"""The per-layer breakdown books every node's cost to a named part of the model (no "other"):
parameters with their layer, the loss function as "loss", autograd's gradient sums with a layer."""

from __future__ import annotations

import pytest
import torch

import apmodel
from apmodel import models
from apmodel.result.cost_labels import LOSS, UNATTRIBUTED, layer_of, node_labels

OVERRIDES = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=128, max_seq_len=32)
#: The ops of the loss function (cross entropy over the logits), forward and backward.
LOSS_OPS = {"_log_softmax", "nll_loss_forward", "nll_loss_backward", "_log_softmax_backward_data"}


@pytest.fixture(scope="module")
def plan():
    with torch.device("meta"):
        m = models.build("llama3-debug", **OVERRIDES)
    inputs = models.sample_inputs(models.config("llama3-debug", **OVERRIDES), 8, 32, device="meta")
    return apmodel.plan(m, (2, 2), inputs)


def _op(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def test_every_cost_is_booked_to_a_named_part(plan):
    assert set(plan.per_layer) == {"tok_embeddings", "layers.0", "layers.1", "norm", "output", LOSS}
    total = sum(v["compute_us"] + v["comm_us"] for v in plan.per_layer.values())
    assert total == pytest.approx(plan.overlap["serial_us"], rel=1e-9)  # the serial sum, booked by part


def test_loss_is_the_loss_functions_ops(plan):
    pm = plan.model
    want = sum(float(pm.cost.compute_vector(n, [plan.node_strategy[n.name]])[0])
               for n in pm.nodes if _op(n) in LOSS_OPS)
    assert want > 0
    assert plan.per_layer[LOSS]["compute_us"] == pytest.approx(want, rel=1e-9)


def test_parameters_and_gradient_sums_go_with_their_layer(plan):
    pm = plan.model
    labels = node_labels(pm.nodes, pm.captured.is_backward)
    assert UNATTRIBUTED not in labels.values()
    for node, fqn in pm.captured.param_fqn.items():
        # by the FQN: layers.N.<...> -> layers.N, else the top-level module's name
        parts = fqn.split(".")
        want = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        assert labels[node] == want, fqn  # so the gradient's reduction into storage is booked there
    # autograd's gradient sums (no module stack of their own) go to a module: the one whose op's
    # gradient they add in
    modules = {layer_of(n.meta, None) for n in pm.nodes} - {None}
    sums = [n for n in pm.nodes if n.meta.get("is_gradient_acc")]
    assert sums and {labels[n.name] for n in sums} <= modules
    assert {labels[n.name] for n in sums} >= {"layers.0", "layers.1"}


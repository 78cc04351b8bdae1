"""A newcomer's misuses of the Python API get one named error before any tracing: what was given,
what is expected, and how to make it (issue: a newcomer's first hour)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

import apmodel
from apmodel._torch_private import fake_mesh

from _tiny import fixed_tokens, tiny_llama


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _meta_batch():
    tokens, targets = fixed_tokens()
    return tokens.to("meta"), targets.to("meta")


def test_parallelize_with_a_mesh_shape_says_how_to_make_a_device_mesh():
    tokens, targets = _meta_batch()
    with pytest.raises(TypeError, match=r"mesh must be a torch.distributed DeviceMesh, got tuple \(2, 2\).*"
                                        r"init_device_mesh\('cuda', \(2, 2\)\).*apmodel.plan\(model, \(2, 2\)"):
        apmodel.parallelize(tiny_llama("meta"), (2, 2), (tokens,), targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(TypeError, match=r"got str '2x2'.*init_device_mesh\('cuda', \(2, 2\)\)"):
        apmodel.parallelize(tiny_llama("meta"), "2x2", (tokens,), targets=(targets,), loss_fn=_lm_loss)


def test_parallelizing_twice_is_named():
    tokens, targets = _meta_batch()
    model = apmodel.parallelize(tiny_llama("meta"), fake_mesh((1,)), (tokens,), targets=(targets,),
                                loss_fn=_lm_loss, device="h100")
    with pytest.raises(ValueError, match=r"this Parallel\w*Transformer has already been parallelized"):
        apmodel.parallelize(model, fake_mesh((1,)), (tokens,), targets=(targets,), loss_fn=_lm_loss)


def test_plan_takes_the_clis_mesh_text_and_names_bad_shapes():
    tokens, targets = _meta_batch()
    plan = apmodel.plan(tiny_llama("meta"), "2x2", (tokens,), targets=(targets,), loss_fn=_lm_loss, device="h100")
    assert tuple(plan.mesh_shape) == (2, 2)
    with pytest.raises(apmodel.workloads.WorkloadError, match=r"mesh_shape '2y2': expected axis sizes joined by 'x'"):
        apmodel.plan(tiny_llama("meta"), "2y2", (tokens,), targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(TypeError, match=r"mesh_shape must be axis sizes such as \(4, 8\) or \"4x8\", got float 2.5"):
        apmodel.plan(tiny_llama("meta"), 2.5, (tokens,), targets=(targets,), loss_fn=_lm_loss)


def test_a_bare_tensor_as_inputs_is_named_with_the_fix():
    tokens, targets = _meta_batch()
    with pytest.raises(TypeError, match=r"sample_inputs must be a tuple of the model's positional inputs, got a "
                                        r"single Tensor of shape \(8, 16\): pass \(sample_input,\) instead"):
        apmodel.plan(tiny_llama("meta"), (2, 2), tokens, targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(TypeError, match=r"targets must be a tuple of the model's positional inputs, got a single "
                                        r"Tensor"):
        apmodel.plan(tiny_llama("meta"), (2, 2), (tokens,), targets=targets, loss_fn=_lm_loss)


def test_other_misuses_are_named():
    tokens, targets = _meta_batch()
    with pytest.raises(TypeError, match=r"apmodel.plan: model must be a torch.nn.Module \(or a captured graph\), "
                                        r"got str"):
        apmodel.plan("llama3-8b", (2, 2), (tokens,))
    with pytest.raises(TypeError, match=r"loss_fn must be callable .* got str"):
        apmodel.plan(tiny_llama("meta"), (2, 2), (tokens,), targets=(targets,), loss_fn="cross_entropy")
    with pytest.raises(TypeError, match=r"kwargs must be a dict of keyword inputs, got list"):
        apmodel.plan(tiny_llama("meta"), (2, 2), (tokens,), kwargs=[1])

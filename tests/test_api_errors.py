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
    with pytest.raises(apmodel.frontend.workloads.WorkloadError, match=r"mesh_shape '2y2': expected axis sizes joined by 'x'"):
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


def test_build_model_and_attach_name_their_misuses(tmp_path):
    tokens, targets = _meta_batch()
    with pytest.raises(TypeError, match=r"apmodel.build_model: mesh_shape must be axis sizes .* got dict"):
        apmodel.build_model(tiny_llama("meta"), {"dp": 2}, (tokens,), targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(ValueError, match=r"apmodel.build_model: mesh_shape \(2, 0\) must be one or more positive"):
        apmodel.build_model(tiny_llama("meta"), (2, 0), (tokens,), targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(TypeError, match=r"apmodel.build_model: sample_inputs must be a tuple of the model's "
                                        r"positional inputs, got a single Tensor"):
        apmodel.build_model(tiny_llama("meta"), (2,), tokens, targets=(targets,), loss_fn=_lm_loss)
    with pytest.raises(TypeError, match=r"apmodel.attach: expected a Plan .* got dict"):
        apmodel.attach({"objective_us": 1.0})
    from apmodel.result.plans import PlanFileError

    with pytest.raises(PlanFileError, match=r"no_such_plan\.json"):
        apmodel.attach(tmp_path / "no_such_plan.json")


def test_local_map_names_its_misuses():
    with pytest.raises(TypeError, match=r"local_map: fn must be a function or a callable object .* got int"):
        apmodel.local_map(3, name="not_callable", in_placements=["S(0)"], out_placements=["S(0)"])
    with pytest.raises(apmodel.graph.regions.RegionError, match=r"local_map name 7 must be an identifier"):
        apmodel.local_map(lambda x: x, name=7, in_placements=["S(0)"], out_placements=["S(0)"])
    with pytest.raises(TypeError, match=r"local_map 'bad_cost': cost_us must be callable .* got float"):
        apmodel.local_map(lambda x: x, name="bad_cost", in_placements=["S(0)"], out_placements=["S(0)"], cost_us=3.0)
    with pytest.raises(TypeError, match=r"local_map 'bad_alts': alternatives must be a dict .* got list"):
        apmodel.local_map(lambda x: x, name="bad_alts", alternatives=[(["S(0)"], ["S(0)"])])


def test_cost_model_apis_name_their_misuses():
    import costmodels as cm

    comm = cm.NCCLCollectives(cm.Topology((8,), "h100"))
    log = cm.parse_nccl_tests(cm.format_nccl_tests("all_gather", 8, [(1024, 20.0), (2048, 21.0)]))
    with pytest.raises(TypeError, match=r"Calibration.fit: logs must be \(NcclTestsLog, mesh axis\) pairs .* item 0 "
                                        r"is NcclTestsLog"):
        cm.Calibration.fit(comm, [log])
    with pytest.raises(TypeError, match=r"Calibration.fit: base must be a collective model .* got str"):
        cm.Calibration.fit("h100", [(log, 0)])
    with pytest.raises(TypeError, match=r"CalibratedCollectives: calibration must be a Calibration "
                                        r"\(Calibration.load\(path\) for a saved file\), got str"):
        cm.CalibratedCollectives(comm, "calibration.json")
    with pytest.raises(TypeError, match=r"Topology: device must be a device name .* got int"):
        cm.Topology((8,), 100)
    with pytest.raises(TypeError, match=r"MeasuredCompute: device must be a device name .* got NoneType"):
        cm.MeasuredCompute(None)
    with pytest.raises(TypeError, match=r"NCCLCollectives needs a Topology, got tuple"):
        cm.NCCLCollectives((8,))


def test_plan_moves_sample_inputs_on_cpu_to_meta_itself():
    """A model on meta (the README's advice) with inputs made on the CPU plans as parallelize does:
    only the shapes matter, so plan traces them on meta (it raised torch's device mismatch)."""
    tokens, targets = fixed_tokens()
    on_cpu = apmodel.plan(tiny_llama("meta"), (2, 2), (tokens,), targets=(targets,), loss_fn=_lm_loss, device="h100")
    meta_tokens, meta_targets = _meta_batch()
    on_meta = apmodel.plan(tiny_llama("meta"), (2, 2), (meta_tokens,), targets=(meta_targets,), loss_fn=_lm_loss,
                           device="h100")
    # the same graph (its fingerprint hashes every node, op and shape); the solves are not compared:
    # the solver's time-based switches may break a tie another way on a loaded machine
    assert on_cpu.fingerprint == on_meta.fingerprint and on_cpu.sizes == on_meta.sizes
    assert tokens.device.type == "cpu"  # the caller's tensors are left where they are


def test_gpus_per_node_that_splits_the_mesh_unevenly_is_named(caplog):
    """3 GPUs per node put ranks 0-2 on one node and rank 3 on another: along axis 0 group {0, 2}
    shares a node and {1, 3} crosses the network, which the topology cannot price alike."""
    from apmodel.core.options import OptionsError

    tokens, targets = _meta_batch()
    with pytest.raises(OptionsError, match=r"^gpus_per_node 3 lays mesh \(2, 2\) onto nodes unevenly: the device "
                                           r"groups along mesh axis 0 span nodes differently .* use 1, 2 or a value >= 4$"):
        apmodel.plan(tiny_llama("meta"), (2, 2), (tokens,), targets=(targets,), loss_fn=_lm_loss, gpus_per_node=3)
    with pytest.raises(OptionsError, match=r"gpus_per_node 3 lays mesh \(2, 2\)"):
        apmodel.cost_context((2, 2), gpus_per_node=3)
    with pytest.raises(OptionsError, match=r"gpus_per_node 3 lays mesh \(2, 2\)"):  # on every rank, before planning
        apmodel.parallelize(tiny_llama("meta"), fake_mesh((2, 2)), (tokens,), targets=(targets,), loss_fn=_lm_loss,
                            gpus_per_node=3)
    # the default (8) is a guess the user did not make: a mesh it does not fit is a warning, once
    with caplog.at_level("WARNING", logger="apmodel.core.options"):
        apmodel.cost_context((2, 9))  # a mesh no other test plans, so the once is this test's
        apmodel.cost_context((2, 9))
    said = [r.getMessage() for r in caplog.records if "onto nodes unevenly" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("gpus_per_node 8 (the default) lays mesh (2, 9)"), said

"""``parallelize(device="auto")``: the hardware of the live mesh as planning options
(:mod:`apmodel.frontend.machine`). GPUs are simulated by their names (no GPU here); CPU meshes are timed on
a real 2x2 gloo mesh in the slow tier."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import apmodel
from apmodel._torch_private import fake_mesh
from apmodel.core.options import OptionsError
from apmodel.frontend import machine

from _dist_utils import run_distributed
from _tiny import fixed_tokens, tiny_llama


class _CudaMesh:
    device_type = "cuda"


@pytest.fixture
def live_gpu(monkeypatch):
    """A process group that is up, on GPUs named by the test."""
    monkeypatch.setattr(machine.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def named(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)

    return named


@pytest.mark.parametrize("gpu,spec", [("NVIDIA H100 80GB HBM3", "h100_sxm"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA A100-SXM4-80GB", "a100_80gb_sxm"), ("NVIDIA B200", "b200")])
def test_known_gpus_are_priced_as_their_spec(live_gpu, gpu, spec):
    live_gpu(gpu)
    found = machine.detect(_CudaMesh(), {})
    assert found.options == {"device": spec, "gpus_per_node": 8}
    assert gpu in found.description


def test_unknown_gpu_is_named_in_a_warning_with_the_spec_used(live_gpu, caplog):
    live_gpu("NVIDIA GeForce RTX 4090")
    with caplog.at_level(logging.WARNING, logger="apmodel.frontend.machine"):
        found = machine.detect(_CudaMesh(), {})
    assert found.options["device"] == machine.FALLBACK_GPU
    assert "RTX 4090" in caplog.text and machine.FALLBACK_GPU in caplog.text


def test_gpus_per_node_from_the_launcher_and_given_options_win(live_gpu, monkeypatch):
    live_gpu("NVIDIA H200")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert machine.detect(_CudaMesh(), {}).options["gpus_per_node"] == 4
    assert machine.detect(_CudaMesh(), {"gpus_per_node": 2}).options["gpus_per_node"] == 2


def test_a_mesh_without_process_groups_is_priced_as_plan_prices():
    found = machine.detect(fake_mesh((2, 2)), {"dtype": "fp32"})
    assert found.options == {"device": apmodel.core.options.default_of("device"), "dtype": "fp32"}


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "here"))
    assert machine.cache_dir() == tmp_path / "here" and (tmp_path / "here").is_dir()
    monkeypatch.delenv(machine.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine.cache_dir() == tmp_path / "xdg" / "apmodel"
    assert machine.compute_profile_path().parent == tmp_path / "xdg" / "apmodel"


def test_plan_refuses_auto_saying_it_needs_a_live_mesh():
    tokens, targets = fixed_tokens()
    with pytest.raises(OptionsError, match="live mesh"):
        apmodel.plan(tiny_llama("meta"), (2, 2), (tokens.to("meta"),), targets=(targets.to("meta"),),
                     loss_fn=lambda o, t: o.sum(), device="auto")


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _auto_worker(rank: int, world: int, cache: str) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict
    from costmodels.calibration import Calibration

    from _helpers import full_weights

    os.environ[machine.CACHE_ENV] = cache
    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    model = apmodel.parallelize(tiny_llama("meta"), mesh, (tokens,), loss_fn=_lm_loss, targets=(targets,))
    workload = model._apmodel_program.plan.workload
    model.to_empty(device="cpu")
    ref = tiny_llama("cpu")
    load_full_state_dict(model, full_weights(ref))
    loss, ref_loss = model(tokens, targets), _lm_loss(ref(tokens), targets)
    out = {k: workload.get(k) for k in ("device", "dtype", "gpus_per_node", "priced_for", "calibration",
                                        "compute_profile")}
    out["losses"] = (float(loss.full_tensor()), float(ref_loss))
    if rank == 0:
        with open(workload["calibration"]) as f:
            import json

            cal = Calibration.from_json(json.load(f))
        out["calibrated_axes"] = sorted({axis for _, axis in cal.curves})
    return out


@pytest.mark.slow
def test_parallelize_on_cpu_processes_prices_them_with_timed_collectives(tmp_path):
    results = run_distributed(_auto_worker, 4, str(tmp_path), timeout_s=600)
    r = results[0]
    assert (r["device"], r["dtype"], r["gpus_per_node"]) == ("cpu", "fp32", 4)
    assert "collectives timed on the live process groups" in r["priced_for"]
    assert r["calibrated_axes"] == [0, 1]  # both mesh axes timed
    assert r["compute_profile"].startswith(str(tmp_path)) and (tmp_path / r["compute_profile"].rsplit("/", 1)[1]).exists()
    assert all(x["priced_for"] == r["priced_for"] for x in results)  # every rank runs rank 0's plan
    got, want = r["losses"]
    assert abs(got - want) <= 1e-5 * abs(want)


def _one_rank_worker(rank: int, world: int, cache: str) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    os.environ[machine.CACHE_ENV] = cache
    mesh = dist.init_device_mesh("cpu", (1,))
    tokens, targets = fixed_tokens()
    model = apmodel.parallelize(tiny_llama("meta"), mesh, (tokens,), loss_fn=_lm_loss, targets=(targets,))
    workload = model._apmodel_program.plan.workload
    return {k: workload.get(k) for k in ("device", "calibration", "priced_for")}


@pytest.mark.slow
def test_a_mesh_of_one_rank_is_priced_without_timing_collectives(tmp_path):
    # an axis of one rank sends nothing: timing it gave a calibration with nothing to correct
    # (the fit refused "model time is 0 for all_reduce on axis 0")
    [r] = run_distributed(_one_rank_worker, 1, str(tmp_path), timeout_s=300)
    assert r["device"] == "cpu" and r["calibration"] is None
    assert "collectives timed" not in r["priced_for"]


@pytest.mark.parametrize(("processes", "threads", "cores", "share"),
                         [(2, 1, 2, 1.0), (4, 1, 2, 0.5), (1, 4, 2, 0.5), (3, 2, 8, 1.0), (8, 1, 2, 0.25)])
def test_cpu_share_is_the_fair_share_of_an_oversubscribed_host(monkeypatch, processes, threads, cores, share):
    from costmodels import fitting

    monkeypatch.setattr(fitting, "_host_cores", lambda: cores)
    assert fitting.cpu_share(processes, threads) == share

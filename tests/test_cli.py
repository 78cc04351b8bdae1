"""The ``apmodel`` command line, run in-process through typer's CliRunner on tiny workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from apmodel.cli import JSON_KEYS, app, parse_mesh
from apmodel.config import ConfigError, load_config

DATA = Path(__file__).parent / "data"
LLAMA = ["--model", "llama3-debug", "--mesh", "2x2", "--seq", "64", "--batch", "8", "--layers", "1"]


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tiny_mlp(batch: int = 16):
    """A ``--model test_cli:tiny_mlp`` factory: (model, sample_inputs, loss_fn)."""
    return TinyMLP(), (torch.randn(batch, 32),), lambda out, x: (out * out).mean()


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory):
    """One `plan --json --compare-recipes --out` run shared by the tests below."""
    path = tmp_path_factory.mktemp("plans") / "a.json"
    res = invoke("plan", *LLAMA, "--json", "--compare-recipes", "--out", str(path))
    assert res.exit_code == 0, res.output + repr(res.exception)
    return json.loads(res.stdout), path


def test_json_has_every_design_key_and_consistent_totals(llama_plan):
    data, path = llama_plan
    assert set(JSON_KEYS) <= set(data)
    for key in ("model", "mesh", "device", "solver", "nodes", "groups", "states", "edges", "trace_s", "build_s",
                "solve_s", "total_s", "objective_us", "lower_bound_us", "status", "compute_us", "comm_us",
                "param_placements", "recipes"):
        assert key in data, key
    assert data["mesh"] == [2, 2] and data["model"] == "llama3-debug" and data["solver"] == "trws"
    assert data["objective_us"] == pytest.approx(data["compute_us"] + data["comm_us"], rel=1e-9)
    assert data["lower_bound_us"] is None or data["lower_bound_us"] <= data["objective_us"] * (1 + 1e-6)
    assert data["param_placements"]["layers.0.attention.wq.weight"].count("S(") == 2  # full_shard
    saved = json.loads(path.read_text())
    assert saved["workload"]["model"] == "llama3-debug" and saved["workload"]["layers"] == 1
    assert saved["objective_us"] == pytest.approx(data["objective_us"])


def test_found_plan_never_worse_than_a_recipe(llama_plan):
    data, _ = llama_plan
    assert data["warnings"] == []
    assert set(data["recipes"]) >= {"ddp", "fsdp", "megatron_tp", "megatron_tp_sp", "fsdp_tp"}
    free = data["free_policy_objective_us"]
    for name, detail in data["recipes_detail"].items():
        if detail["objective_us"] is None:
            continue
        assert data["recipes"][name] == detail["objective_us"]
        # the free-storage search contains every recipe; the default one the full_shard recipes
        assert free <= detail["objective_us"] * (1 + 1e-6), name
        if name in ("fsdp", "fsdp_tp"):
            assert data["objective_us"] <= detail["objective_us"] * (1 + 1e-6), name


def test_explain_prints_the_candidate_table(llama_plan):
    _, path = llama_plan
    res = invoke("explain", str(path), "layers.0.attention.wq.weight", "--top", "3")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "★" in res.stdout and "candidates" in res.stdout
    res = invoke("explain", str(path), "no.such.param")
    assert res.exit_code != 0 and "no.such.param" in res.output


def test_user_factory_with_config_constraint_and_diff(llama_plan, tmp_path):
    cfg = tmp_path / "apmodel.toml"
    cfg.write_text('[solver]\nbackend = "highs"\n\n[[constraints]]\nfix = "up.weight"\nplacement = "S(1)"\n')
    out = tmp_path / "b.json"
    res = invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "4", "--batch", "16", "--config", str(cfg),
                 "--json", "--out", str(out))
    assert res.exit_code == 0, res.output + repr(res.exception)
    data = json.loads(res.stdout)
    assert data["solver"] == "highs" and data["status"] == "optimal"
    assert data["param_placements"]["up.weight"] == "S(1)"
    # flags override the file
    res = invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "4", "--config", str(cfg), "--solver", "trws", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["solver"] == "trws"
    # diff against the LLaMA plan (different graphs) and against itself
    res = invoke("diff", str(llama_plan[1]), str(out))
    assert res.exit_code == 0, res.output
    assert "Parameters placed differently" in res.stdout and "fingerprints differ" in res.stdout
    res = invoke("diff", str(out), str(out))
    assert res.exit_code == 0 and "identical placements" in res.stdout


def test_human_readable_summary():
    res = invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "2x2", "--batch", "16")
    assert res.exit_code == 0, res.output + repr(res.exception)
    for text in ("Problem and solver", "Objective breakdown", "Parameter placements", "What emerged"):
        assert text in res.stdout


@pytest.mark.parametrize("mesh", ["4y8", "0x4", "2x2x2x2x2", "x"])
def test_bad_mesh_is_a_clear_error(mesh):
    res = invoke("plan", "--model", "llama3-debug", "--mesh", mesh)
    assert res.exit_code == 2
    assert "--mesh" in res.output and mesh in res.output
    with pytest.raises(ValueError, match="--mesh"):
        parse_mesh(mesh)


def test_parse_mesh():
    assert parse_mesh("4x8") == (4, 8) and parse_mesh("8") == (8,) and parse_mesh("2,2,2,4") == (2, 2, 2, 4)


@pytest.mark.parametrize(
    "text,key",
    [
        ('[solver]\ntimeout = 3\n', "solver.timeout"),
        ('[sovler]\nbackend = "trws"\n', "sovler"),
        ('[solver]\ntime_limit = "long"\n', "solver.time_limit"),
        ('[topology]\ngpus_per_node = 8.5\n', "topology.gpus_per_node"),
        ('[planner]\nparam_policy = "zero"\n', "planner.param_policy"),
        ('[[constraints]]\nfix = "a.weight"\nplacment = "RR"\n', "placment"),
        ('[[constraints]]\nlinear = "x"\nterms = [["a", "R"]]\nsense = "<="\nrhs = 1\n', "constraints[0].terms[0]"),
    ],
)
def test_config_errors_name_the_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(path)
    res = invoke("plan", "--model", "llama3-debug", "--mesh", "2x2", "--config", str(path))
    assert res.exit_code == 2 and key in res.output.replace("\n", "")


def test_example_config_loads():
    cfg = load_config(Path(__file__).parent.parent / "examples" / "apmodel.toml")
    assert cfg.solver and cfg.device and cfg.constraints


def test_devices_table():
    res = invoke("devices")
    assert res.exit_code == 0
    for name in ("h100_sxm", "a100_80gb_sxm", "b200", "cpu"):
        assert name in res.stdout


def test_calibrate_recovers_the_synthetic_factor(tmp_path):
    out = tmp_path / "cal.json"
    logs = [str(DATA / f"nccl_tests_synthetic_h100x8_{k}.txt") for k in ("all_gather", "reduce_scatter")]
    res = invoke("calibrate", *logs, "--axis", "0", "--out", str(out))
    assert res.exit_code == 0, res.output + repr(res.exception)
    cal = json.loads(out.read_text())
    kinds = {c["kind"] for c in cal["curves"]}
    assert kinds == {"all_gather", "reduce_scatter"}
    # the logs were generated with factor(size) = 1.4 at 8 B falling linearly in log2 to 0.95 at 1 GiB
    for c in cal["curves"]:
        assert c["factors"][0] == pytest.approx(1.4, rel=0.02)
        assert c["factors"][-1] == pytest.approx(0.95, rel=0.02)
    res = invoke("calibrate", logs[0], "--axis", "3", "--out", str(out))
    assert res.exit_code == 2 and "--axis" in res.output


def test_every_subcommand_has_help():
    for cmd in ("plan", "explain", "diff", "calibrate", "devices"):
        res = invoke(cmd, "--help")
        assert res.exit_code == 0 and "Usage" in res.output, cmd
    assert invoke("--help").exit_code == 0

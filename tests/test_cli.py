"""The ``apmodel`` command line, run in-process through typer's CliRunner on tiny workloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from apmodel.cli import JSON_KEYS, app
from apmodel.frontend.config import ConfigError, load_config
from apmodel.frontend.workloads import parse_mesh

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
    # the objective is the step with overlap: at most the serial sum, at least the computation
    assert data["serial_objective_us"] == pytest.approx(data["compute_us"] + data["comm_us"], rel=1e-9)
    assert data["compute_us"] * (1 - 1e-9) <= data["objective_us"] <= data["serial_objective_us"] * (1 + 1e-9)
    assert data["step_us"] == data["objective_us"]
    assert data["exposed_comm_us"] + data["hidden_comm_us"] == pytest.approx(data["comm_us"], rel=1e-9)
    assert data["lower_bound_us"] is None  # the solver's bound is on the serial objective, not the step
    lb = data["serial_lower_bound_us"]
    assert lb is None or lb <= data["serial_objective_us"] * (1 + 1e-6)
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
        # stored bytes are fp32 masters (bf16 pricing, mixed precision): twice the priced bytes
        assert detail["params_bytes"] == pytest.approx(2 * detail["param_bytes_per_device"]), name
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


#: Plan files edited into disagreeing with themselves (issue 43: report, diff and explain read them
#: without a word) and the start of what every command says about them.
EDITS = {
    "mesh 2x2 to 2x3": (lambda d: d.update(mesh_shape=[2, 3]),
                        "field 'mesh_shape' [2, 3] disagrees with 'workload.mesh' [2, 2], the mesh it was planned on: "
                        "the file was edited or is corrupt: restore it or re-plan"),
    "negative objective": (lambda d: d.update(objective_us=-1.0), "field 'objective_us' must be a time >= 0 (µs), got -1.0"),
    "fingerprint": (lambda d: d.update(fingerprint="1234abcd"),
                    "field 'fingerprint' must be the 64 hex digits of the graph's sha256, got '1234abcd'"),
    "unknown parameter": (lambda d: d["param_placements"].update({"layers.9.extra.weight": "S(0)S(1)"}),
                          "field \"param_placements['layers.9.extra.weight']\" places a parameter the planned model "
                          "does not have"),
}


@pytest.mark.parametrize("command", ["report", "diff", "diff-second", "explain"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_every_command_refuses_an_edited_plan_file_alike(llama_plan, tmp_path, edit, command):
    """One validation on load (Plan.from_json) behind every command: the same line, naming the file and the field."""
    _, good = llama_plan
    data = json.loads(good.read_text())
    mutate, message = EDITS[edit]
    mutate(data)
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    args = {"report": ["report", str(bad), "--no-trace", "--out", str(tmp_path / "r.html")],
            "diff": ["diff", str(bad), str(good)], "diff-second": ["diff", str(good), str(bad)],
            "explain": ["explain", str(bad), "layers.0.attention.wq.weight"]}[command]
    line = error_line(invoke(*args))
    assert line.startswith(f"error: {bad}: {message}"), line
    assert not (tmp_path / "r.html").exists()


def test_user_factory_with_config_constraint_and_diff(llama_plan, tmp_path):
    cfg = tmp_path / "apmodel.toml"
    cfg.write_text('[solving]\nsolver = "highs"\n\n[[constraints]]\nfix = "up.weight"\nplacement = "S(1)"\n')
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
        ('[solving]\ntimeout = 3\n', "solving.timeout"),
        ('[sovling]\nsolver = "trws"\n', "sovling"),
        ('[solving]\ntime_limit = "long"\n', "solving.time_limit"),
        ('[pricing]\ngpus_per_node = 8.5\n', "pricing.gpus_per_node"),
        ('[search]\nparam_policy = "zero"\n', "search.param_policy"),
        ('[planner]\nparam_policy = "zero"\n', "planner.param_policy"),  # an old key, named as written
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
    assert cfg.options["solver"] and cfg.options["device"] and cfg.constraints


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
    # the logs were generated from NCCL's tuning table times factor(size) = 1.4 at 8 B falling
    # linearly in log2 to 0.95 at 1 GiB; the calibration corrects the default (measured) model
    import costmodels as cm

    topo = cm.Topology((8,), "h100")
    default, table = cm.NCCLCollectives(topo), cm.NCCLCollectives(topo, measured=cm.MeasuredNccl.nccl_tuning_table())
    for c in cal["curves"]:
        for size, factor, shipped in ((8, c["factors"][0], 1.4), (2**30, c["factors"][-1], 0.95)):
            want = shipped * table.time_us(c["kind"], size, 0) / default.time_us(c["kind"], size, 0)
            assert factor == pytest.approx(want, rel=0.02)
    assert "Measured / predicted by size class" in res.stdout
    res = invoke("calibrate", logs[0], "--axis", "3", "--out", str(out))
    assert res.exit_code == 2 and "--axis" in res.output


def test_calibrate_several_axes_and_a_log_without_rank_lines(tmp_path):
    # an inter-node and an intra-node log into one calibration of a 2x8 mesh; the intra-node one
    # lost its '# Rank' lines (as posted logs often do): --ranks or --mesh supplies the count
    import costmodels as cm

    out = tmp_path / "cal.json"
    comm = cm.NCCLCollectives(cm.Topology((2, 8), "h100"))
    sizes = [2**k for k in range(10, 28, 3)]
    inter = tmp_path / "inter_all_gather.log"
    inter.write_text(cm.format_nccl_tests("all_gather", 2, [(s, 1.5 * comm.time_us("all_gather", s, 0)) for s in sizes]))
    text = cm.format_nccl_tests("all_gather", 8, [(s, 0.8 * comm.time_us("all_gather", s, 1)) for s in sizes])
    intra = tmp_path / "intra_all_gather.log"
    intra.write_text("\n".join(line for line in text.splitlines() if "Rank" not in line))
    res = invoke("calibrate", str(inter), str(intra), "--axis", "0", "--axis", "1", "--mesh", "2x8", "--out", str(out))
    assert res.exit_code == 0, res.output + repr(res.exception)
    curves = {(c["axis"], c["ranks"]): c["factors"] for c in json.loads(out.read_text())["curves"]}
    assert set(curves) == {(0, 2), (1, 8)}
    assert curves[(0, 2)] == pytest.approx([1.5] * len(sizes), rel=0.01)
    assert curves[(1, 8)] == pytest.approx([0.8] * len(sizes), rel=0.01)
    # one log without Rank lines and no --mesh: --ranks is asked for, then accepted
    res = invoke("calibrate", str(intra), "--out", str(out))
    assert res.exit_code != 0 and "--ranks" in res.output
    res = invoke("calibrate", str(intra), "--ranks", "8", "--out", str(out))
    assert res.exit_code == 0, res.output
    # three --axis values for two logs is named
    res = invoke("calibrate", str(inter), str(intra), "--axis", "0", "--axis", "1", "--axis", "1",
                 "--mesh", "2x8", "--out", str(out))
    assert res.exit_code != 0 and "3 --axis values for 2 logs" in res.output


def test_every_subcommand_has_help():
    for cmd in ("plan", "explain", "diff", "calibrate", "devices"):
        res = invoke(cmd, "--help")
        assert res.exit_code == 0 and "Usage" in res.output, cmd
    assert invoke("--help").exit_code == 0


# ------------------------------------------------------------------ failures: one line, exit code 2
class NonzeroModel(TinyMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[y.nonzero()[:, 0]]  # output shape depends on the values


class ItemModel(TinyMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * y.sum().item()


class BranchModel(TinyMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if y.sum() > 0 else -y  # Python control flow on a tensor value


def _factory(cls):
    return lambda batch=16: (cls(), (torch.randn(batch, 32),), lambda out, x: (out * out).mean())


nonzero_mlp, item_mlp, branch_mlp = _factory(NonzeroModel), _factory(ItemModel), _factory(BranchModel)


def exploding_factory(batch: int = 16):
    """Fails the test if the CLI gets as far as building the model."""
    raise AssertionError("the CLI should have stopped before building the model")


def error_line(res) -> str:
    """The CLI's single error line (stderr), checking exit code 2 and the absence of a traceback."""
    assert res.exit_code == 2, res.output + repr(res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], res.stderr
    return errors[0]


def test_gpus_per_node_that_splits_the_mesh_unevenly_is_named(tmp_path):
    """--gpus-per-node 3 on a 2x2 mesh: named before tracing, by plan and by calibrate."""
    line = error_line(invoke("plan", "--model", "test_cli:exploding_factory", "--mesh", "2x2", "--gpus-per-node", "3"))
    assert line.startswith("error: --gpus-per-node 3 lays mesh (2, 2) onto nodes unevenly") and \
        line.endswith("use 1, 2 or a value >= 4"), line
    log = DATA / "nccl_tests_synthetic_h100x8_all_gather.txt"
    line = error_line(invoke("calibrate", str(log), "--mesh", "2x4", "--axis", "1", "--gpus-per-node", "3",
                             "--out", str(tmp_path / "cal.json")))
    assert line.startswith("error: --gpus-per-node 3 lays mesh (2, 4) onto nodes unevenly"), line


def test_missing_calibration_file_is_named(tmp_path):
    cfg = tmp_path / "apmodel.toml"
    cfg.write_text('[pricing]\ncalibration = "missing.json"\n')
    line = error_line(invoke("plan", "--model", "test_cli:exploding_factory", "--mesh", "4", "--config", str(cfg)))
    assert f"'{tmp_path / 'missing.json'}'" in line and "pricing.calibration" in line and "does not exist" in line


@pytest.mark.parametrize("where,expect", [
    ("no_such_dir/plan.json", "does not exist"),
    ("a_file/plan.json", "is a file, not a directory"),
    (".", "is a directory"),
])
def test_unwritable_out_fails_before_planning(tmp_path, where, expect):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / where
    line = error_line(invoke("plan", "--model", "test_cli:exploding_factory", "--mesh", "4", "--out", str(out)))
    assert line.startswith(f"error: --out '{out}'") and expect in line


def test_infeasible_constraints_print_literally(tmp_path):
    """One line naming the constraint; rich markup must not eat [workload], nor quotes be stripped."""
    cfg = tmp_path / "apmodel.toml"
    cfg.write_text('[[constraints]]\nlinear = "need_two [workload]"\nterms = [["up.weight", "S(0)", 1.0]]\n'
                   'sense = ">="\nrhs = 2\n')
    line = error_line(invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "4", "--config", str(cfg)))
    assert line.startswith("error: infeasible: ") and line.endswith("'need_two [workload]'")


def test_unknown_module_keeps_its_quotes():
    line = error_line(invoke("plan", "--model", "no_such_module_xyz:f", "--mesh", "4"))
    assert line.endswith("No module named 'no_such_module_xyz'")


def test_solver_time_out_without_assignment_suggests_remedies():
    """What a backend raises when it stops at its time limit before any feasible assignment."""
    import solvers

    def timed_out(problem, time_limit=None, **options):
        raise solvers.TimeLimitReached("stopped with status 'Time limit reached' and no feasible assignment")

    solvers.register("timed_out_for_test", timed_out)
    try:
        line = error_line(invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "4", "--solver",
                                 "timed_out_for_test", "--time-limit", "0.5"))
    finally:
        solvers.default_registry().unregister("timed_out_for_test")
    assert "'timed_out_for_test' reached its time limit (0.5 s)" in line
    assert "--time-limit" in line and "--solver trws" in line


def test_highs_time_limit_gives_its_best_plan_or_one_line():
    """At its time limit HiGHS returns the best plan it knows (status time_limit, with its bound);
    a machine fast enough to finish reports optimal; without any assignment the error is one line
    (that path is pinned by the fake backend above). Every outcome is checked, none skipped."""
    res = invoke("plan", *LLAMA, "--solver", "highs", "--time-limit", "0.001")
    if res.exit_code == 0:
        status = re.search(r"backend / status\s*│\s*(\S+) / (\S+)", res.stdout)
        assert status is not None, res.stdout
        assert status.group(1) == "highs" and status.group(2) in ("time_limit", "optimal"), status.groups()
    else:
        line = error_line(res)
        assert "'highs' reached its time limit" in line and "--solver trws" in line


@pytest.mark.parametrize("mesh,expect", [
    ("1000000x1000000", "1,000,000,000,000 devices; at most 1,048,576 (2**20)"),
    ("2x2x2x2x2", "5 axes; at most 4"),
])
def test_huge_mesh_is_refused_before_any_allocation(mesh, expect):
    line = error_line(invoke("plan", "--model", "test_cli:exploding_factory", "--mesh", mesh))
    assert f"--mesh '{mesh}'" in line and expect in line


@pytest.mark.parametrize("factory,op", [
    ("nonzero_mlp", "aten.nonzero"),
    ("item_mlp", "aten._local_scalar_dense"),
    ("branch_mlp", "aten._local_scalar_dense"),
])
def test_data_dependent_op_is_one_named_line(factory, op):
    line = error_line(invoke("plan", "--model", f"test_cli:{factory}", "--mesh", "2"))
    assert f"--model 'test_cli:{factory}': cannot trace" in line and op in line and "test_cli.py:" in line


def test_model_module_in_the_working_directory(tmp_path, monkeypatch):
    """`--model mod:factory` finds mod.py in the cwd, as `python -m` would, and leaves sys.path as it was."""
    import sys

    (tmp_path / "cwd_model_for_cli_test.py").write_text(
        "import torch\n\n"
        "def factory(batch=16):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))\n"
        "    return model, (torch.randn(batch, 32),), lambda out, x: (out * out).mean()\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    res = invoke("plan", "--model", "cwd_model_for_cli_test:factory", "--mesh", "2", "--json")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["param_placements"]["0.weight"]
    assert sys.path == before
    sys.modules.pop("cwd_model_for_cli_test", None)


def test_console_script_errors_without_traceback(tmp_path):
    """The real `apmodel` process (the cwd is not on its sys.path): one stderr line, exit code 2."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("apmodel") or str(Path(sys.executable).parent / "apmodel")
    (tmp_path / "dd_model.py").write_text(
        "import torch\n\n"
        "class M(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        y = super().forward(x)\n"
        "        return y[y.nonzero()[:, 0]].sum()\n\n"
        "def factory():\n"
        "    return M(8, 8, bias=False), (torch.randn(4, 8),)\n")
    proc = subprocess.run([exe, "plan", "--model", "dd_model:factory", "--mesh", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --model 'dd_model:factory'"), proc.stderr
    assert "aten.nonzero" in lines[0] and "dd_model.py:6 in forward" in lines[0]


def test_plan_warnings_are_shown_deduplicated(monkeypatch):
    """Plan.warnings (when the Plan has them) join the recipe checks: in the table and in --json."""
    import apmodel.entry.api as api

    solve = api._solve

    def with_warnings(*args, **kwargs):
        plan = solve(*args, **kwargs)
        plan.warnings = ["check [this] 'x'", "check [this] 'x'", "second"]
        return plan

    monkeypatch.setattr(api, "_solve", with_warnings)
    res = invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "2", "--json")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["warnings"] == ["check [this] 'x'", "second"]
    res = invoke("plan", "--model", "test_cli:tiny_mlp", "--mesh", "2")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert res.stdout.count("WARNING: check [this] 'x'") == 1 and "WARNING: second" in res.stdout


def test_explain_a_plan_saved_from_the_python_api(tmp_path):
    """The API records the workload as the CLI does (preset, layers, batch, seq), so a plan saved
    from Python can be explained from the command line."""
    import torch

    import apmodel
    from apmodel.models import build, sample_inputs

    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    plan = apmodel.plan(model, (2, 2), sample_inputs("llama3-debug", 8, 32, device="meta"))
    assert {k: plan.workload[k] for k in ("model", "layers", "batch", "seq")} == {
        "model": "llama3-debug", "layers": 1, "batch": 8, "seq": 32}
    path = tmp_path / "api.json"
    plan.save(path)
    res = invoke("explain", str(path), "layers.0.attention.wq.weight")
    assert res.exit_code == 0, res.output
    from apmodel.core import placements as pl

    assert "layers.0.attention.wq.weight" in res.output
    assert pl.tuple_to_str(plan.param_placements["layers.0.attention.wq.weight"]) in res.output


def test_the_default_sequence_fits_the_presets_position_table():
    """Without --seq a preset plans at 2048 or its position table when shorter (llama3-debug holds
    512: the default 2048 failed); a --seq beyond the table is still the model's error."""
    from apmodel.frontend.workloads import DEFAULT_SEQ, default_seq

    assert default_seq("llama3-debug") == 512 and default_seq("gpt2") == 1024
    assert default_seq("llama3-8b") == DEFAULT_SEQ and default_seq("pkg.mod:factory") == DEFAULT_SEQ
    res = invoke("plan", "--model", "llama3-debug", "--mesh", "2", "--layers", "1", "--batch", "2", "--json")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["seq"] == 512


def test_a_reader_closing_the_pipe_early_is_not_a_failure():
    """`apmodel plan ... | head -1`: the command exits 0 with nothing on stderr (rich exits 1)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "apmodel.cli", "plan", "--model", "llama3-debug", "--mesh", "2",
                             "--layers", "1", "--batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written (planning takes seconds)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"error:" not in err


def test_a_size_one_axis_gets_no_role():
    """`--mesh 1` once read its one axis as "tensor parallel 16/16" (a shard of one device)."""
    from apmodel.reading.roles import SIZE_ONE_AXIS

    res = invoke("plan", "--model", "llama3-debug", "--mesh", "1", "--layers", "1", "--batch", "2", "--json")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["emerged"] == {"axis0": SIZE_ONE_AXIS}
    res = invoke("plan", "--model", "llama3-debug", "--mesh", "1x2", "--layers", "1", "--batch", "2", "--json")
    emerged = json.loads(res.stdout)["emerged"]
    assert emerged["axis0"] == SIZE_ONE_AXIS and emerged["axis1"] != SIZE_ONE_AXIS


def test_calibrate_refuses_a_log_of_another_kind(tmp_path):
    log = str(DATA / "nccl_tests_synthetic_h100x8_all_gather.txt")
    res = invoke("calibrate", log, "--kind", "all_reduce", "--axis", "0", "--out", str(tmp_path / "cal.json"))
    assert res.exit_code == 2 and "not all_reduce" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "cal.json").exists()

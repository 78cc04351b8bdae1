"""One planning path: the CLI and the Python API reach the same plan through ``api.plan_workload``,
with every option in one ``PlanOptions`` recorded in the plan file."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import apmodel
from apmodel.candidates.strategies import enumerate_strategies
from apmodel.cli import app
from apmodel.core import placements as pl
from apmodel.core.options import DEFAULT_SEED_RADIUS, OptionsError, PlanOptions
from apmodel.entry.api import cost_context
from apmodel.graph.capture import capture
from apmodel.models import build, sample_inputs
from apmodel.problem import seeding

from test_cli import tiny_mlp

MESH = (2, 2, 2)
PARAM = "layers.0.attention.wq.weight"


@pytest.fixture(scope="module")
def far_strategy() -> tuple[str, str]:
    """(node, output placement) of an mm whose placement no seeded candidate (3-axis mesh, default
    radius) produces, so that a constraint fixing it conflicts with the seeded space."""
    model, inputs, loss_fn = tiny_mlp()
    captured = capture(model.to("meta"), tuple(x.to("meta") for x in inputs), loss_fn)
    seeds = seeding.seed(captured, MESH, cost=cost_context(MESH))
    balls = seeding.balls(seeds, captured, MESH, DEFAULT_SEED_RADIUS)
    full = enumerate_strategies(captured.gm, MESH)
    for n in captured.gm.graph.nodes:
        if n.target == torch.ops.aten.mm.default:
            inside = {s.outputs[0] for s in full[n.name] if balls[n.name].contains(s)}
            far = [s.outputs[0] for s in full[n.name] if s.outputs[0] not in inside]
            if far:
                return n.name, pl.tuple_to_str(far[0])
    raise AssertionError("every mm placement lies in the seeded space: the test needs another model")


def test_seeding_fallback_is_the_same_from_the_cli_and_the_api(tmp_path, far_strategy, caplog):
    """A constraint outside the seeded candidates (3-axis mesh) is honoured by both entry points,
    which rebuild the full space the same way and find the same plan."""
    node, far_placement = far_strategy
    cfg = tmp_path / "far.toml"
    cfg.write_text(f'[[constraints]]\nfix = "{node}"\nplacement = "{far_placement}"\n', encoding="utf-8")
    out = tmp_path / "cli.json"
    res = CliRunner().invoke(app, ["plan", "--model", "test_cli:tiny_mlp", "--mesh", "2x2x2", "--batch", "16",
                                   "--solver", "highs", "--config", str(cfg), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    cli_plan = apmodel.Plan.load(out)
    model, inputs, loss_fn = tiny_mlp(batch=16)
    caplog.clear()
    api_plan = apmodel.plan(model.to("meta"), MESH, tuple(x.to("meta") for x in inputs), loss_fn=loss_fn,
                            solver="highs", constraints=[apmodel.fix(node, far_placement)])
    assert "rebuilding without seeding" in caplog.text  # the fallback did run
    for p in (cli_plan, api_plan):
        assert pl.tuple_to_str(p.node_strategy[node].outputs[0]) == far_placement
    assert api_plan.objective_us == pytest.approx(cli_plan.objective_us, rel=1e-9)
    assert json.loads(res.stdout)["objective_us"] == pytest.approx(cli_plan.objective_us, rel=1e-9)


def test_plan_files_record_the_options_they_were_made_with(tmp_path):
    options = PlanOptions(device="h200", param_policy="free", optimizer="sgd", memory_limit_bytes=math.inf,
                          solver="highs", replicate_axes=(1,))
    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    plan = apmodel.plan(model, (2, 2), sample_inputs("llama3-debug", batch=8, seq=32, device="meta"), options=options)
    path = tmp_path / "p.json"
    plan.save(path)
    again = PlanOptions.from_record(apmodel.Plan.load(path).workload)
    assert again == options
    # and the record rebuilds the model: explain works on it
    saved = apmodel.attach(apmodel.Plan.load(path))
    assert saved.explain(PARAM)


def test_old_plan_records_keep_their_meaning():
    old = {"model": "llama3-debug", "device": "h100", "memory_limit_GB": 70.0, "param_policy": "free"}
    opts = PlanOptions.from_record(old)
    assert opts.memory_limit_bytes == 70e9 and opts.param_policy == "free" and opts.solver == "trws"
    assert opts.bucket_mb == 0.0  # priced with every collective alone, as it was


@pytest.mark.parametrize("change,named", [
    ({"param_policy": "half"}, "param_policy"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"execution": "jit"}, "execution"),
    ({"dtype": "int4"}, "dtype"),
    ({"memory_limit_bytes": -1.0}, "memory_limit"),
    ({"topology": {"intra_gbps": 1.0}}, "intra_gbps"),
])
def test_bad_options_are_named(change, named):
    with pytest.raises(OptionsError, match=named):
        PlanOptions(**change)


def test_an_unknown_option_keyword_is_named():
    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    with pytest.raises(OptionsError, match="'sovler'"):
        apmodel.plan(model, (2,), sample_inputs("llama3-debug", batch=8, seq=32, device="meta"), sovler="highs")


#: What the CLI may import from the package: the API, its inputs (config, workloads, options), what
#: it prints (plans, roles, recipe names, report, formatting), and the private-torch boundary to ask
#: which errors are torch's data-dependent ones (rather than list their names). No pipeline stage.
CLI_ALLOWED = {"apmodel.entry.api", "apmodel.frontend.config", "apmodel.frontend.workloads", "apmodel.core.options", "apmodel.core.option_spec", "apmodel.result.plans",
               "apmodel.reading.roles", "apmodel.reading.recipes", "apmodel.reading.report", "apmodel.core.formatting", "apmodel.core.placements",
               "apmodel._torch_private"}


def test_the_cli_holds_no_pipeline_stage():
    imported = set()
    package = Path(apmodel.__file__).with_name("cli")
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("apmodel"):
                if node.module.startswith("apmodel.cli"):
                    continue  # the package's own modules
                # "from <package> import <module>" names the module
                is_package = package.parent.parent.joinpath(*node.module.split(".")).is_dir()
                names = [f"{node.module}.{a.name}" for a in node.names] if is_package else [node.module]
                imported.update(names)
    assert len(list(package.glob("*.py"))) >= 3 and imported <= CLI_ALLOWED, sorted(imported - CLI_ALLOWED)


def test_execution_mode_and_compute_profile_flags_reach_the_compute_model(tmp_path):
    """--execution graphs removes the per-op launch cost of the measured h200 model (a smaller
    compute time); a missing --compute-profile is one named error line before any tracing."""
    def compute_us(*flags: str) -> float:
        res = CliRunner().invoke(app, ["plan", "--model", "test_cli:tiny_mlp", "--mesh", "2", "--device", "h200",
                                       "--json", *flags])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["compute_us"]

    eager, graphs = compute_us(), compute_us("--execution", "graphs")
    assert 0 < graphs < eager
    res = CliRunner().invoke(app, ["plan", "--model", "test_cli:tiny_mlp", "--mesh", "2",
                                   "--compute-profile", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "compute profile" in res.output and "does not exist" in res.output

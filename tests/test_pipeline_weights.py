"""Pipeline stages synchronise their weights once per step: the timeline of once-per-step work
against hand-computed 1F1B timelines, each stage's weight traffic independent of the microbatch
count, the choice between keeping parameters gathered and gathering them per microbatch under the
memory limit, and LLaMA-3 70B on 4x8x8 H100 getting faster with more microbatches."""

from __future__ import annotations

import pytest

from apmodel.core import schedules
from apmodel.core.options import PlanOptions
from apmodel.entry import api
from apmodel.frontend.workloads import load_workload
from apmodel.solve.pipeline import PipelineOptions, price_degree, stage_work
from apmodel.solve.stage_costs import StepUnits, UnitCost

# One layer, per microbatch (µs): 10 forward of which 2 gather parameters; 20 backward of which 2
# gather again and 3 reduce gradients. Bytes: 100 of state, 10 of activations, 40 gathered, 60 of
# unreduced gradients.
LAYER = UnitCost("layer", forward_us=10.0, backward_us=20.0, gather_us=4.0, reduce_us=3.0, state_bytes=100.0,
                 activation_bytes=10.0, gather_once_us=2.0, gathered_bytes=40.0, unreduced_grad_bytes=60.0)
NOTHING = UnitCost("edge", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _units(n_layers: int = 4) -> StepUnits:
    return StepUnits(pre=NOTHING, layers=(LAYER,) * n_layers, post=NOTHING, boundary_bytes=(0.0,) * n_layers,
                     transient_bytes=0.0)


def _price(microbatches: int, sync: tuple[str, ...] | None = None, limit: float | None = None):
    return price_degree(_units(), 2, "1f1b", microbatches, lambda src, dst, nbytes: 0.0, stage_mesh_shape=(8,),
                        memory_limit_bytes=limit, weight_sync=sync)


@pytest.mark.parametrize("degree,microbatches", [(2, 2), (2, 5), (4, 8), (3, 7)])
def test_once_per_step_work_on_the_1f1b_timeline(degree, microbatches):
    """Setup at the step's start on every rank, flush after each stage's last backward: the
    textbook 1F1B step shifted by the setup, plus the first stage's flush (the last to finish;
    the other stages' flushes run while their gradient goes on to the stage before)."""
    f, b, g, r = 1.5, 2.75, 0.7, 0.4
    t = schedules.simulate("1f1b", degree, microbatches, [f] * degree, [b] * degree, setup_us=[g] * degree,
                           flush_us=[r] * degree)
    assert t.step_us == pytest.approx(g + (microbatches + degree - 1) * (f + b) + r)
    assert t.busy_us == pytest.approx([g + microbatches * (f + b) + r] * degree)


def test_weight_traffic_is_paid_once_per_step():
    """Two stages of two layers each: per microbatch 20 µs forward (4 gathering), 40 backward (4
    gathering, 6 reducing). Each weight sync's step by hand, at 4 and 8 microbatches."""
    for m in (4, 8):
        assert _price(m, ("microbatch",) * 2).objective_us == pytest.approx((m + 1) * 60)
        assert _price(m, ("reduce_once",) * 2).objective_us == pytest.approx((m + 1) * 54 + 6)
        assert _price(m, ("gather_once",) * 2).objective_us == pytest.approx(4 + (m + 1) * 46 + 6)


def test_doubling_microbatches_leaves_each_stages_weight_traffic():
    four, eight = _price(4), _price(8)
    assert four.weight_sync == eight.weight_sync == ("gather_once",) * 2  # no limit: the cheapest
    assert four.reduce_step_us == eight.reduce_step_us == (6.0, 6.0)  # 2 layers x 3 µs, once per step
    assert four.gather_step_us == eight.gather_step_us == (4.0, 4.0)  # the forward's gathers, once
    assert four.stage_us == eight.stage_us == (16.0 + 30.0,) * 2  # per microbatch: no weight traffic
    # per microbatch, the reductions grew with the microbatches: 4 x 6 against 8 x 6 µs per stage
    per_mb_four, per_mb_eight = _price(4, ("microbatch",) * 2), _price(8, ("microbatch",) * 2)
    assert per_mb_eight.objective_us - per_mb_four.objective_us == pytest.approx(4 * 60)
    assert eight.objective_us - four.objective_us == pytest.approx(4 * 46)


def test_kept_parameters_step_back_under_the_memory_limit():
    """1F1B on degree 2, 4 microbatches: stage 0 holds 2 layers' state (200 bytes) and 2
    microbatches of activations (2 x 20), stage 1 one (220 bytes in all). Kept gathered a stage
    adds 2 x (40 + 60) = 200 bytes, reduced once per step 2 x 60 = 120. Over the limit, the rank's
    stage steps back, each time the cheapest choice that fits."""
    work = stage_work(LAYER, "gather_once")
    assert (work.forward_us, work.backward_us, work.setup_us, work.flush_us) == (8.0, 15.0, 2.0, 3.0)
    cases = {440: ("gather_once", "gather_once"), 439: ("reduce_once", "gather_once"),
             419: ("reduce_once", "reduce_once"), 359: ("microbatch", "reduce_once"),
             339: ("microbatch", "microbatch")}
    for limit, want in cases.items():
        priced = _price(4, limit=limit)
        assert priced.weight_sync == want, limit
        assert priced.fits is True
    over = _price(4, limit=239)
    assert over.weight_sync == ("microbatch", "microbatch") and over.fits is False
    assert over.peak_bytes == pytest.approx(240)


def test_llama3_70b_step_falls_with_more_microbatches():
    """Degree 4 on 4x8x8 H100, batch 128: 16 microbatches (of 8 samples, still one per rank of the
    stage mesh's data axis) beat 8, since each stage's weights are synchronised once per step (per
    microbatch, the step grew: 6.64 s at 8, 7.50 s at 16). At batch 64 the 16 microbatches of 4
    cannot be split over that 8-wide axis, and the stage plan's microbatch costs more than at 8."""
    steps = {}
    for m in (8, 16):
        workload = load_workload("llama3-70b", (4, 8, 8), batch=128, seq=4096)
        result = api.plan_pipelined(workload, PlanOptions(device="h100", gpus_per_node=8),
                                    PipelineOptions(pp_axis=0, pp_degrees=(4,), microbatches=m))
        pp = result.plan.pipeline
        assert pp["degree"] == 4 and all(s != "microbatch" for s in pp["weight_sync"])
        steps[m] = pp["objective_us"]
    assert steps[16] < steps[8]


# ------------------------------------------------------------------------------ one objective
_CLI = ("plan", "--model", "llama3-debug", "--layers", "2", "--mesh", "2x2", "--seq", "64", "--batch", "8",
        "--pp-axis", "0", "--pp-degrees", "2", "--microbatches", "2")


def _cli(*args: str):
    from typer.testing import CliRunner

    from apmodel.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """A forced degree-2 plan: its --json and its plan file."""
    import json

    path = tmp_path_factory.mktemp("pp") / "pp.json"
    res = _cli(*_CLI, "--json", "--out", str(path))
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), path


def test_a_pipelined_plans_objective_is_the_step(pipelined):
    from apmodel.reading import report
    from apmodel.result.plans import Plan

    data, path = pipelined
    pp = data["pipeline"]
    assert pp["degree"] == 2
    assert data["objective_us"] == data["step_us"] == pp["objective_us"]
    chosen = next(a for a in pp["alternatives"] if a["degree"] == 2)
    assert data["objective_us"] == chosen["objective_us"]
    stage = pp["stage_plan"]  # one stage's microbatch, priced alone: less than the step of 2 microbatches
    assert 0 < stage["objective_us"] < data["objective_us"]
    assert stage["compute_us"] > 0 and data["compute_us"] is None and data["lower_bound_us"] is None
    plan = Plan.load(path)
    assert plan.step_objective_us == pytest.approx(pp["objective_us"])
    assert plan.objective_us == pytest.approx(stage["objective_us"])  # the file keeps the stage plan's own
    page = report.plan_page(plan)
    assert f"Objective <b>{pp['objective_us']:,.1f} µs</b> per step: a pipeline of degree 2" in page
    assert f"per microbatch: {stage['objective_us']:,.1f} µs, compute" in page


def test_diff_compares_the_steps(pipelined, tmp_path):
    from apmodel.result.plans import Plan

    data, path = pipelined
    res = _cli("diff", str(path), str(path))
    assert res.exit_code == 0, res.output
    assert "pipeline step" in res.output and "+0.0 µs" in res.output
    assert Plan.load(path).step_objective_us != Plan.load(path).objective_us


def test_a_plan_file_from_before_weight_sync_loads_and_replays(pipelined, tmp_path):
    """A version-3 file written before each stage's weight sync was recorded: it loads, and
    replays with every stage synchronised per microbatch, as it was priced then."""
    import json

    from apmodel.result.pipeline_record import PipelineChoice
    from apmodel.result.plans import Plan

    data, path = pipelined
    old = json.loads(path.read_text())
    assert old["version"] == 3
    for record in (old["pipeline"], *old["pipeline"]["alternatives"]):
        for key in ("weight_sync", "gather_step_us", "reduce_step_us"):
            record.pop(key, None)
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    plan = Plan.load(old_path)
    assert PipelineChoice.from_json(plan.pipeline).chosen.weight_sync == ()
    workload = load_workload("llama3-debug", (2, 2), batch=8, seq=64, layers=2)
    again = api.plan_pipelined(workload, PlanOptions(), PipelineOptions(pp_axis=0), replay=old_path)
    assert again.plan.pipeline["weight_sync"] == ["microbatch", "microbatch"]
    assert again.plan.pipeline["reduce_step_us"] == [0.0, 0.0]
    fresh = api.plan_pipelined(workload, PlanOptions(), PipelineOptions(pp_axis=0), replay=path)
    assert fresh.plan.pipeline["weight_sync"] == data["pipeline"]["weight_sync"]


# ------------------------------------------------------------------------------ memory
@pytest.mark.slow
def test_a_degree_over_the_limit_is_solved_again():
    """LLaMA-3 405B, degree 2 on 4x8x8 H100 (limit 72 GiB): the stage plan solved with its weights'
    traffic shared by 8 microbatches needs 104 GB on its fullest rank; solved again (under a memory
    row on the stage mesh, activations counted per microbatch in flight) it fits."""
    workload = load_workload("llama3-405b", (4, 8, 8), batch=64, seq=4096)
    result = api.plan_pipelined(workload, PlanOptions(device="h100", gpus_per_node=8),
                                PipelineOptions(pp_axis=0, pp_degrees=(2,), microbatches=8))
    pp = result.plan.pipeline
    limit = 72 * 2**30
    assert pp["degree"] == 2 and pp["peak_bytes"] <= limit
    assert "stage plan solved" in pp["alternatives"][0]["note"]


def test_shared_collectives_price_a_share():
    """A stage plan prices its weights' collectives as 1 / M of what they cost (M microbatches share them)."""
    import costmodels

    base = costmodels.NCCLCollectives(costmodels.Topology((8,), costmodels.device("h100"), 8))
    shared = costmodels.SharedCollectives(base, 4)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert shared.time_us(kind, 2**26, 0) == pytest.approx(base.time_us(kind, 2**26, 0) / 4)
    with pytest.raises(ValueError, match="shares must be a finite number >= 1"):
        costmodels.SharedCollectives(base, 0.5)

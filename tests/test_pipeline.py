"""Pipeline stages composed with SPMD plans: schedules against their textbook timelines, stage
splits against brute force, per-unit costs against the plan's own price, a planned pipeline
against brute force over the splits of unequal layers, plan files, named errors."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
import torch.nn as nn

import costmodels
from apmodel.core import schedules
from apmodel.core.options import PlanOptions
from apmodel.entry import api
from apmodel.frontend.workloads import Workload
from apmodel.result.plans import Plan, PlanFileError
from apmodel.solve.pipeline import (
    PipelineChoice,
    PipelineError,
    PipelineOptions,
    lowered_weight_us,
    plan_pipeline,
    stage_mesh,
    stage_rank,
    stage_work,
)
from apmodel.solve.stage_costs import assign_units, step_units, weight_only_nodes
from costmodels.p2p import peer_link, send_recv_us


# ------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("degree,microbatches", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_1f1b_timeline_is_the_textbook_one(degree, microbatches):
    f, b = 1.5, 2.75
    t = schedules.simulate("1f1b", degree, microbatches, [f] * degree, [b] * degree)
    assert t.step_us == pytest.approx((microbatches + degree - 1) * (f + b))
    assert t.bubble_us == pytest.approx((degree - 1) * (f + b))
    # stage s holds min(m, d - s) microbatches of activations (PipeDream-Flush's bound)
    assert t.in_flight == tuple(min(microbatches, degree - s) for s in range(degree))


@pytest.mark.parametrize("degree,microbatches", [(2, 4), (4, 8), (4, 12), (2, 2)])
def test_interleaved_timeline_is_megatrons(degree, microbatches):
    v = schedules.INTERLEAVED_STAGES_PER_RANK
    f, b = 1.0, 2.0  # the whole model per microbatch: f·d forward, split in d·v chunks
    n = degree * v
    t = schedules.simulate("interleaved", degree, microbatches, [f / v] * n, [b / v] * n)
    # Narayanan et al. 2021, §2.2: bubble (d - 1)·(f + b) / v beside m·(f + b)
    assert t.step_us == pytest.approx(microbatches * (f + b) + (degree - 1) * (f + b) / v)


@pytest.mark.parametrize("schedule,degree,microbatches", [("1f1b", 4, 6), ("interleaved", 3, 6)])
def test_orders_run_every_action_once_on_its_rank(schedule, degree, microbatches):
    orders = schedules.orders(schedule, degree, microbatches)
    v = schedules.stages_per_rank(schedule)
    for r, acts in enumerate(orders):
        want = {(k, s, i) for k in "FB" for s in range(r, degree * v, degree) for i in range(microbatches)}
        assert sorted((a.kind, a.stage, a.microbatch) for a in acts) == sorted(want)
        for a in acts:  # a stage runs its microbatches in order, and a backward after its forward
            if a.kind == "B":
                assert acts.index(schedules.Action("F", a.stage, a.microbatch)) < acts.index(a)


def _torch_compute_orders(schedule: str, degree: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """torch's own per-rank compute actions of a V schedule (its order generator run without
    stages or a process group), the overlapped F&B pairs flattened into their two halves."""
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = degree, microbatches
    sched.num_stages = sched._num_stages = 2 * degree
    out = []
    for r in range(degree):
        acts = []
        for a in sched._calculate_single_rank_operations(r):
            for x in (() if a is None else a.sub_actions or (a,)):
                acts.append((x.computation_type.value, x.stage_index, x.microbatch_index))
        out.append(acts)
    return out


@pytest.mark.parametrize("schedule", schedules.V_SCHEDULES)
@pytest.mark.parametrize("degree,microbatches", [(1, 2), (2, 4), (2, 7), (3, 6), (3, 10), (4, 8), (4, 13), (5, 12)])
def test_v_orders_are_torchs(schedule, degree, microbatches):
    ours = [[(a.kind, a.stage, a.microbatch) for a in acts] for acts in schedules.orders(schedule, degree, microbatches)]
    assert ours == _torch_compute_orders(schedule, degree, microbatches)
    for r in range(degree):  # the V: stage r and 2d - 1 - r on rank r
        assert schedules.rank_stages(schedule, degree, r) == [r, 2 * degree - 1 - r]


@pytest.mark.parametrize("degree,microbatches", [(2, 4), (3, 7), (4, 8), (4, 12)])
@pytest.mark.parametrize("t", [1.0, 2.5])
def test_zbv_is_zero_bubble_with_equal_passes(degree, microbatches, t):
    """Qi et al., ZB-V (§6), with T_F = T_B(input) = T_W: no rank idles between its first and its
    last pass; the step is the work plus the V's fill, (d - 1)·T_F (the parallelogram's offset, which
    the paper's post-validation lets the next step reclaim and a synchronous step does not)."""
    n = 2 * degree
    tl = schedules.simulate("zbv", degree, microbatches, [t] * n, [2 * t] * n, weight_us=[t] * n)
    work = 2 * microbatches * 3 * t
    for r in range(degree):
        assert tl.busy_us[r] == pytest.approx(work)
        assert tl.last_us[r] - tl.first_us[r] == pytest.approx(work)  # zero bubble within the rank
    assert tl.bubble_us == pytest.approx((degree - 1) * t)
    assert tl.step_us == pytest.approx(work + (degree - 1) * t)


@pytest.mark.parametrize("degree,microbatches", [(2, 4), (3, 6), (3, 10), (4, 8), (5, 13)])
@pytest.mark.parametrize("t", [1.0, 3.0])
def test_dualpipev_bubble_is_deepseeks(degree, microbatches, t):
    """DeepSeek-V3's DualPipe table: bubble (PP/2 - 1)(F&B + B - 3W), PP stages on PP/2 ranks for
    DualPipe-V; F&B = F + B as torch runs the pair (one stream, in turn); F = I = W = t, B = I + W."""
    n = 2 * degree
    f, b, w = t, 2 * t, t
    tl = schedules.simulate("dualpipev", degree, microbatches, [f] * n, [b] * n, weight_us=[w] * n)
    assert tl.bubble_us == pytest.approx((degree - 1) * ((f + b) + b - 3 * w))


@pytest.mark.parametrize("schedule", schedules.V_SCHEDULES)
def test_v_schedules_hold_activations_until_their_weight_gradient(schedule):
    """The activations a stage holds: forwards whose W (or B) has not run; the V's first stage holds
    the most, 2d (1F1B's first stage holds d)."""
    d, m = 3, 9
    got = schedules.in_flight(schedule, d, m)
    assert got == schedules.simulate(schedule, d, m, [1.0] * 2 * d, [2.0] * 2 * d).in_flight
    assert got[0] == 2 * d and got[-1] == 1
    tl = schedules.simulate(schedule, d, m, [1.0] * 2 * d, [2.0] * 2 * d, activation_bytes=[1.0] * 2 * d)
    for r in range(d):  # a rank's two stages do not peak together
        assert got[r] <= tl.held_bytes[r] <= got[r] + got[2 * d - 1 - r]


def test_v_turn_pays_no_transfer():
    """Stages d - 1 and d share rank d - 1: their boundary's transfer is not paid."""
    base = schedules.simulate("zbv", 2, 4, [1.0] * 4, [2.0] * 4)
    turn = schedules.simulate("zbv", 2, 4, [1.0] * 4, [2.0] * 4, [0.0, 50.0, 0.0])
    assert turn.step_us == pytest.approx(base.step_us)
    assert schedules.simulate("zbv", 2, 4, [1.0] * 4, [2.0] * 4, [0.5, 0.0, 0.0]).step_us > base.step_us
    with pytest.raises(schedules.ScheduleError, match="7 microbatches cannot fill a dualpipev pipeline of degree 4"):
        schedules.orders("dualpipev", 4, 7)


def test_transfers_delay_the_receiver():
    no = schedules.simulate("1f1b", 2, 2, [1, 1], [1, 1])
    yes = schedules.simulate("1f1b", 2, 2, [1, 1], [1, 1], [0.5])
    # first forward waits once, the first backward's gradient once, the last backward once more
    assert yes.step_us > no.step_us
    assert schedules.simulate("1f1b", 1, 3, [1], [2]).step_us == pytest.approx(9)


def test_balanced_split_matches_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 3.0]) * rng.random() for _ in range(n)]
        first, last = rng.random() * 2, rng.random() * 2
        dp = schedules.balanced_split(costs, k, first_us=first, last_us=last)
        brute = schedules.brute_force_split(costs, k, first_us=first, last_us=last)
        assert schedules.split_cost(costs, dp, first_us=first, last_us=last) == pytest.approx(
            schedules.split_cost(costs, brute, first_us=first, last_us=last))
        assert [a for a, _ in dp][0] == 0 and dp[-1][1] == n - 1


def test_balanced_split_honours_memory():
    costs = [1.0] * 6
    # stage 0 may hold at most 2 layers (in 1F1B it keeps the most microbatches in flight)
    split = schedules.balanced_split(costs, 2, fits=lambda k, i, j: k != 0 or j - i + 1 <= 2)
    assert split == ((0, 1), (2, 5))
    brute = min((s for s in itertools.combinations(range(1, 6), 1)),
                key=lambda c: max(c[0], 6 - c[0]) if c[0] <= 2 else math.inf)
    assert split[0][1] + 1 == brute[0]
    with pytest.raises(schedules.ScheduleError, match="fits the memory limit"):
        schedules.balanced_split(costs, 2, fits=lambda k, i, j: False)


# ------------------------------------------------------------------------------ named errors
def test_bad_requests_are_named():
    with pytest.raises(schedules.ScheduleError, match="5 pipeline stages but the model has 4 repeated layers"):
        schedules.balanced_split([1.0] * 4, 5)
    with pytest.raises(PipelineError, match="microbatches 3 does not divide the batch 8"):
        PipelineOptions(pp_axis=0, microbatches=3).resolve((2, 2), 8)
    with pytest.raises(PipelineError, match="pp_axis 2 is out of range for mesh"):
        PipelineOptions(pp_axis=2).resolve((2, 2), 8)
    with pytest.raises(PipelineError, match="degree 3 does not divide the size 4"):
        PipelineOptions(pp_axis=0, pp_degrees=(1, 3)).resolve((4, 2), 8)
    with pytest.raises(PipelineError, match="2 microbatches cannot fill a 1f1b pipeline of degree 4"):
        PipelineOptions(pp_axis=0, pp_degrees=(4,), microbatches=2).resolve((4, 2), 8)
    with pytest.raises(PipelineError, match="pp_schedule 'zb'"):
        PipelineOptions(pp_axis=0, pp_schedule="zb")
    assert PipelineOptions(pp_axis=0).resolve((4, 2), 64) == ((1, 2, 4), 8)  # 2 microbatches per stage


def test_stage_mesh_keeps_rank_strides():
    assert stage_mesh((4, 8, 8), 0, 4) == ((8, 8), (8, 1))
    assert stage_mesh((4, 8, 8), 0, 2) == ((2, 8, 8), (64, 8, 1))
    assert stage_mesh((4, 8, 8), 0, 1) == ((4, 8, 8), (64, 8, 1))
    assert stage_mesh((8, 4), 1, 4) == ((8,), (4,))           # the pipeline inside a node
    assert stage_rank((4, 8, 8), 0, 2, 1) == 128              # pipeline rank 1 of degree 2: coordinate 2
    topo = costmodels.Topology((8, 4), "h100", 8, strides=(4, 1))
    assert topo.axis(0).nodes == 4                            # stride 4: 8 ranks over 4 nodes of 8


def test_p2p_price():
    topo = costmodels.Topology((4, 8), "h100", 8)
    across, inside = peer_link(topo, 0, 8), peer_link(topo, 0, 1)
    assert across.inter_node and not inside.inter_node
    nbytes = 64 * 2**20
    assert send_recv_us(nbytes, across) > send_recv_us(nbytes, inside) > 0
    # 400 Gb/s NIC at the fitted 0.79: about 39.5 GB/s
    assert send_recv_us(nbytes, across) == pytest.approx(across.latency_us + nbytes / 39.5e3, rel=1e-3)
    assert send_recv_us(0, across) == 0


# ------------------------------------------------------------------------------ per-unit costs
class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Unequal(nn.Module):
    """Layers of very different widths: the balanced split is not the even one."""

    def __init__(self, hiddens: tuple[int, ...], dim: int = 256) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim, bias=False)
        self.layers = nn.ModuleList(_Block(dim, h) for h in hiddens)
        self.head = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


HIDDENS = (8192, 8192, 256, 256, 256, 256)


def _unequal_workload(mesh: tuple[int, ...]) -> Workload:
    with torch.device("meta"):
        model = _Unequal(HIDDENS)
    return Workload(model, mesh, (torch.empty(64, 512, 16, device="meta"),))


def _plan_spmd(workload, options, record):
    return api.plan_workload(workload, options, record=record).plan


@pytest.fixture(scope="module")
def unequal_plan() -> Plan:
    return _plan_spmd(_unequal_workload((2,)), PlanOptions(device="h100"), {})


def test_units_add_up_to_the_plan(unequal_plan):
    units = step_units(unequal_plan.model, unequal_plan.node_strategy)
    assert len(units.layers) == len(HIDDENS)
    assert units.total_us == pytest.approx(unequal_plan.overlap["serial_us"], rel=1e-9)  # the units add up serially
    everything = [units.pre, *units.layers, units.post]
    mem = unequal_plan.memory
    assert sum(u.state_bytes for u in everything) == pytest.approx(
        mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"])
    assert sum(u.activation_bytes for u in everything) == pytest.approx(mem["activations_bytes"])
    # the widest layers cost most; the plan's own per-layer breakdown (booked by another path) agrees
    per_layer = [sum(unequal_plan.per_layer[f"layers.{i}"].values()) for i in range(len(HIDDENS))]
    assert [u.total_us for u in units.layers] == pytest.approx(per_layer, rel=1e-6)
    assert units.layers[0].total_us > 2 * units.layers[2].total_us
    # the residual stream crosses every boundary, the last one into the head
    assert all(b > 0 for b in units.boundary_bytes)


def test_units_price_the_weight_side_of_the_backward(unequal_plan):
    """weight_us: the backward a split backward's W runs: in a layer, its weight-gradient matmuls
    (dW = Xᵀ·dY; dX = dY·Wᵀ and the ReLU's backward are the input side), a share of the layer's
    backward under a half; the part before the layers has no earlier unit, its backward all weight
    side; the price of a V schedule's W is it (all of the first stage's backward)."""
    pmodel = unequal_plan.model
    unit, _ = assign_units(pmodel)
    layer_side = {pmodel.node_by_name[n] for n in weight_only_nodes(pmodel, unit) if 0 <= unit[n] < len(HIDDENS)}
    assert {str(n.target) for n in layer_side} == {"apmodel_linear.mm_nd_wgrad.default", "aten.t.default"}
    assert sum(str(n.target).endswith("wgrad.default") for n in layer_side) == 2 * len(HIDDENS)
    units = step_units(pmodel, unequal_plan.node_strategy)
    for u in units.layers:
        share = u.weight_us / (u.backward_us - u.reduce_us)
        assert 0.1 < share < 0.5, (u.name, share)
    pre = units.pre
    assert 0 < pre.weight_us <= pre.backward_us - pre.reduce_us
    assert units.post.weight_us < units.post.backward_us
    work = [stage_work(units.stage(0, 2, with_pre=True, with_post=False), "reduce_once"),
            stage_work(units.stage(3, 5, with_pre=False, with_post=True), "reduce_once")]
    assert lowered_weight_us(work) == [work[0].backward_us, work[1].weight_us]
    per_microbatch = stage_work(units.stage(3, 5, with_pre=False, with_post=True), "microbatch")
    assert per_microbatch.weight_us == pytest.approx(work[1].weight_us + units.stage(3, 5, with_pre=False,
                                                                                    with_post=True).reduce_us)


def test_planned_split_is_brute_force_over_splits():
    """Degree 2 on a (2, 2) mesh: the chosen split of the unequal layers is the one brute force
    over every split finds with the stage plan's per-layer price (the plan's own per_layer)."""
    workload = _unequal_workload((2, 2))
    plan, choice = plan_pipeline(workload, PlanOptions(device="h100"), PipelineOptions(pp_axis=0, pp_degrees=(1, 2)),
                                 _plan_spmd)
    by_degree = {a.degree: a for a in choice.alternatives}
    assert set(by_degree) == {1, 2}
    two = by_degree[2]
    # the stage plan is the whole model at the microbatch on the (2,) stage mesh
    stage_plan = _plan_spmd(Workload(workload.model, (2,), (torch.empty(64 // choice.microbatches, 512, 16,
                                                                         device="meta"),)),
                            PlanOptions(device="h100", memory_limit_bytes=math.inf), {})
    layer_us = [sum(stage_plan.per_layer[f"layers.{i}"].values()) for i in range(len(HIDDENS))]
    rest = stage_plan.overlap["serial_us"] - sum(layer_us)  # per-layer figures add up serially
    units = step_units(stage_plan.model, stage_plan.node_strategy)
    first, last = units.pre.total_us, units.post.total_us
    assert first + last == pytest.approx(rest, rel=1e-6)
    brute = schedules.brute_force_split(layer_us, 2, first_us=first, last_us=last)
    assert two.stages == brute
    assert two.stages != ((0, 2), (3, 5))  # not the even split: the wide layers sit apart
    # the choice is the cheapest degree that fits
    assert choice.degree == min(choice.alternatives, key=lambda a: a.objective_us).degree
    assert plan.pipeline is not None and plan.pipeline["degree"] == choice.degree
    assert tuple(by_degree[1].stage_mesh) == (2, 2) and tuple(two.stage_mesh) == (2,)


# ------------------------------------------------------------------------------ plan files
def _choice() -> PipelineChoice:
    from apmodel.result.pipeline_record import DegreePrice

    two = DegreePrice(2, 1234.5, 2e9, True, (8, 8), ((0, 39), (40, 79)), 100.0, 20.0, (600.0, 610.0))
    one = DegreePrice(1, 2000.0, 5e9, True, (2, 8, 8), stage_us=(2000.0,))
    return PipelineChoice(axis=0, mesh=(2, 8, 8), schedule="1f1b", microbatches=8, chosen=two, alternatives=[one, two])


def test_plan_file_records_the_pipeline(unequal_plan, tmp_path):
    plan = Plan.from_json(unequal_plan.to_json())
    assert plan.to_json()["version"] == 2 and "pipeline" not in plan.to_json()
    plan.pipeline = _choice().to_json()
    path = tmp_path / "pp.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 3
    assert data["pipeline"]["stages"] == [[0, 39], [40, 79]] and data["pipeline"]["degree"] == 2
    assert [a["degree"] for a in data["pipeline"]["alternatives"]] == [1, 2]
    again = Plan.load(path)
    assert again.pipeline == plan.pipeline
    assert PipelineChoice.from_json(again.pipeline).chosen.stages == ((0, 39), (40, 79))
    data["pipeline"]["degree"] = "two"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"pipeline\.degree"):
        Plan.load(path)
    data["pipeline"]["degree"] = 2
    data["pipeline"]["schedule"] = "zero-bubble"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"pipeline\.schedule"):
        Plan.load(path)


def test_a_pipelined_plan_replays(tmp_path):
    """Saved with its pipeline (version 3) and replayed: same degree, split, stage placements and price."""
    workload = _unequal_workload((2, 2))
    first = api.plan_pipelined(workload, PlanOptions(device="h100"), PipelineOptions(pp_axis=0, pp_degrees=(2,)))
    assert first.plan.pipeline["degree"] == 2 and tuple(first.plan.mesh_shape) == (2,)
    path = tmp_path / "pp.json"
    first.plan.save(path)
    again = api.plan_pipelined(_unequal_workload((2, 2)), PlanOptions(device="h100"),
                               PipelineOptions(pp_axis=0, pp_degrees=(1, 2), microbatches=2), replay=path)
    assert again.plan.node_strategy == first.plan.node_strategy
    for key in ("degree", "stages", "microbatches", "schedule"):
        assert again.plan.pipeline[key] == first.plan.pipeline[key], key
    for key in ("objective_us", "bubble_us", "p2p_us"):
        assert again.plan.pipeline[key] == pytest.approx(first.plan.pipeline[key]), key
    with pytest.raises(PipelineError, match=r"made for mesh \(2, 2\), got \(4,\)"):
        api.plan_pipelined(_unequal_workload((4,)), PlanOptions(device="h100"), PipelineOptions(pp_axis=0), replay=path)


# ------------------------------------------------------------------------------ the command line
_CLI = ("plan", "--model", "llama3-debug", "--layers", "2", "--mesh", "2x2", "--seq", "64", "--batch", "8")


def _cli(*args: str):
    from typer.testing import CliRunner

    from apmodel.cli import app

    return CliRunner().invoke(app, [*_CLI, *args])


def test_cli_json_gains_the_pipeline(tmp_path):
    path = tmp_path / "pp.json"
    res = _cli("--pp-axis", "0", "--pp-degrees", "1,2", "--microbatches", "2", "--json", "--out", str(path))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    pp = data["pipeline"]
    assert data["mesh"] == [2, 2] and pp["mesh"] == [2, 2] and pp["axis"] == 0
    assert {"degree", "schedule", "microbatches", "stages", "bubble_us", "p2p_us", "alternatives"} <= set(pp)
    assert pp["microbatches"] == 2 and pp["schedule"] == "1f1b"
    alternatives = {a["degree"]: a for a in pp["alternatives"]}
    assert set(alternatives) == {1, 2}
    assert alternatives[2]["stages"] == [[0, 0], [1, 1]] and alternatives[1]["stages"] == []
    for a in alternatives.values():
        assert a["objective_us"] > 0 and a["peak_bytes"] > 0
    chosen = min((a for a in alternatives.values() if a["fits"] is not False), key=lambda a: a["objective_us"])
    assert pp["degree"] == chosen["degree"] and pp["objective_us"] == chosen["objective_us"]
    assert Plan.load(path).pipeline == pp  # the plan file records the same choice
    # forcing degree 2: the stage plan is on the stage mesh, the split of 2 layers one per stage
    res = _cli("--pp-axis", "0", "--pp-degrees", "2", "--microbatches", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["pipeline"]["degree"] == 2 and data["pipeline"]["stage_mesh"] == [2]
    assert data["pipeline"]["stages"] == [[0, 0], [1, 1]] and data["pipeline"]["bubble_us"] > 0


@pytest.mark.parametrize("args,message", [
    (("--pp-axis", "0", "--microbatches", "3"), "microbatches 3 does not divide the batch 8"),
    (("--pp-axis", "2"), "pp_axis 2 is out of range for mesh (2, 2)"),
    (("--pp-axis", "0", "--pp-degrees", "3"), "degree 3 does not divide the size 2 of pipeline axis 0"),
    (("--pp-axis", "0", "--pp-degrees", "1,x"), "--pp-degrees '1,x': expected integers"),
    (("--pp-axis", "0", "--pp-schedule", "zb"), "--pp-schedule"),
    (("--pp-axis", "0", "--compare-recipes"), "compare_recipes prices the recipes without a pipeline"),
])
def test_cli_bad_pipeline_requests_are_named(args, message):
    res = _cli(*args, "--json")
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_more_stages_than_layers_is_refused_before_planning():
    from typer.testing import CliRunner

    from apmodel.cli import app

    args = [*_CLI, "--pp-axis", "0", "--pp-degrees", "4", "--json"]
    args[args.index("2x2")] = "4x1"
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "pipeline degree 4 (1f1b, 4 stages): more stages than the model's 2 repeated layers" in res.output


def test_a_stage_mesh_keeps_its_links():
    """A pipeline on the inner axis of (8, 4): the stage mesh's 8 ranks sit 4 apart, across 4 nodes of
    8, and its collectives are priced so (not as one node's 8 consecutive ranks)."""
    from apmodel.solve.pipeline import _stage_options

    options = _stage_options(PlanOptions(device="h100"), (8, 4), 1, 4)
    link = options.comm_model.topo.axis(0)
    assert (link.size, link.nodes, link.ranks_per_node) == (8, 4, 2)
    assert _stage_options(PlanOptions(device="h100"), (4, 8), 0, 4).comm_model is None  # row-major already


def test_auto_prices_every_schedule_that_runs():
    """pp_schedule "auto": each degree priced under every schedule that can run it (the V ones need
    2·degree microbatches and layers); the choice records the schedule it priced."""
    pp = PipelineOptions(pp_axis=0, pp_schedule="auto")
    assert pp.candidates(2, 4, 8) == schedules.SCHEDULES
    assert pp.candidates(4, 4, 8) == ("1f1b", "interleaved")       # V: 8 microbatches needed
    assert pp.candidates(2, 4, 3) == ("1f1b",)                      # 4 stages, 3 layers
    assert PipelineOptions(pp_axis=0, pp_schedule="zbv").candidates(2, 4) == ("zbv",)
    with pytest.raises(PipelineError, match="7 microbatches cannot fill a zbv pipeline of degree 4"):
        PipelineOptions(pp_axis=0, pp_degrees=(4,), microbatches=7, pp_schedule="zbv").resolve((4, 2), 56)


@pytest.mark.parametrize(("model", "needed", "first_of_last_kind"),
                         [("deepseek-v3", 4, 3), ("hybrid-swa-30b", 6, 0), ("llama3-70b", 1, 0), ("moe-debug", 2, 1)])
def test_the_stage_plan_holds_a_layer_of_every_kind(model, needed, first_of_last_kind):
    """The configs say it: DeepSeek-V3's first three layers dense (n_dense_layers), Gemma 3's hybrid
    full attention every sixth layer (sliding window otherwise), LLaMA's layers alike."""
    from apmodel.frontend.workloads import load_workload
    from apmodel.solve.pipeline import layers_to_plan, stand_ins

    workload = load_workload(model, (8,), batch=8, seq=128)
    k, kinds = layers_to_plan(workload)
    assert k == needed and kinds is not None
    assert kinds.index(kinds[-1]) == first_of_last_kind
    priced_as = stand_ins(kinds, k, len(kinds))
    assert all(kinds[j] == kinds[i] for i, j in enumerate(priced_as))  # every layer priced as one of its kind
    assert priced_as[:k] == list(range(k))


def test_a_moe_layer_is_not_priced_as_a_dense_one():
    """moe-debug (a dense layer, then a MoE layer) on two stages of one layer: the stage plan is
    solved on both layers (a one-layer cut would hold the dense layer only, and price the MoE layer
    as it), and the second stage's layer costs what the MoE layer of the whole-model plan does."""
    from apmodel.frontend.workloads import load_workload

    workload = load_workload("moe-debug", (2, 2), batch=8, seq=64)
    chosen = api.plan_pipelined(workload, PlanOptions(device="h100"), PipelineOptions(pp_axis=0, pp_degrees=(2,)))
    record = chosen.plan.pipeline
    assert record["degree"] == 2 and record["stages"] == [[0, 0], [1, 1]]
    units = step_units(chosen.plan.model, chosen.plan.node_strategy)
    assert len(units.layers) == 2  # both layers planned, not one standing for the other
    dense, moe = units.layers
    assert moe.forward_us != pytest.approx(dense.forward_us)


def test_auto_is_never_worse_than_one_schedule_alone():
    """``pp_schedule="auto"`` prices 1F1B on its own stage plan (stages of twice the layers of the
    two-per-rank schedules'), so at every degree it is at least as cheap as 1F1B alone."""
    priced = {}
    for schedule in ("1f1b", "auto"):
        chosen = api.plan_pipelined(_unequal_workload((2, 2)), PlanOptions(device="h100"),
                                    PipelineOptions(pp_axis=0, pp_degrees=(2,), microbatches=4, pp_schedule=schedule))
        priced[schedule] = {a["degree"]: a for a in chosen.plan.pipeline["alternatives"]}
    for degree, one in priced["1f1b"].items():
        assert priced["auto"][degree]["objective_us"] <= one["objective_us"] * (1 + 1e-9)

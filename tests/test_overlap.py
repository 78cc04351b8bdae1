"""Communication overlapped with computation: the order the program runs, its price, and its numerics.

Truths: timelines computed by hand (communication that fits behind compute costs nothing, longer
communication is exposed by the difference, a chained collective waits for the one it reads);
the serial sum (overlap off prices exactly compute + communication, the planner's pairwise
objective); the solver's serial optimum re-priced with overlap (the kept plan is never slower);
and, on real gloo processes, the same program run with every collective waited as issued (losses
and gradients equal, rel 1e-6).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import apmodel
from apmodel.result.plans import price
from costmodels.overlap import ProgramError, issue_order, serial_order, simulate
from costmodels.overlap import ProgramOp as Op

from _dist_utils import run_distributed
from _helpers import full_weights
from _tiny import fixed_tokens, tiny_llama
from test_native import _grads_and_losses, _lower
from zoo_models import ZOO


def _labels(ops, order):
    return [ops[i].label for i in order]


def _gather_before_matmul(comm_us: float) -> list[Op]:
    """x -> mm0 (100 µs); w gathered (comm_us), then mm1 (50 µs) reads mm0 and the gathered w."""
    return [Op("source", static=True, label="w"), Op("source", label="x"),
            Op("compute", (1,), 100.0, weight=1, label="mm0"),
            Op("issue", (0,), comm_us, lane=0, nbytes=10, label="gather"), Op("wait", (3,), label="wait"),
            Op("compute", (2, 4), 50.0, weight=1, label="mm1")]


def test_communication_that_fits_behind_compute_costs_nothing() -> None:
    ops = _gather_before_matmul(80.0)
    order = issue_order(ops, inflight_limit_bytes=100)
    assert _labels(ops, order) == ["w", "x", "gather", "mm0", "wait", "mm1"]  # issued first, waited last
    tl = simulate(ops, order)
    assert tl.step_us == pytest.approx(150.0)
    assert tl.exposed_comm_us == pytest.approx(0.0) and tl.hidden_comm_us == pytest.approx(80.0)


def test_communication_longer_than_compute_is_exposed_by_the_difference() -> None:
    ops = _gather_before_matmul(130.0)
    tl = simulate(ops, issue_order(ops, inflight_limit_bytes=100))
    assert tl.step_us == pytest.approx(100.0 + 30.0 + 50.0)
    assert tl.exposed_comm_us == pytest.approx(30.0)


def test_without_overlap_the_step_is_the_serial_sum() -> None:
    ops = _gather_before_matmul(80.0)
    order = serial_order(ops)
    assert _labels(ops, order) == ["w", "x", "mm0", "gather", "wait", "mm1"]
    assert simulate(ops, order).step_us == pytest.approx(100.0 + 80.0 + 50.0)


def test_an_activation_collective_waits_for_its_producer_and_hides_behind_independent_compute() -> None:
    # a -> mm_a (40) -> all_reduce (30) -> add reads it; mm_b (60) is independent of the all-reduce
    ops = [Op("source", label="a"), Op("compute", (0,), 40.0, weight=1, label="mm_a"),
           Op("issue", (1,), 30.0, lane=1, nbytes=1, label="ar"), Op("wait", (2,), label="wait"),
           Op("compute", (0,), 60.0, weight=1, label="mm_b"), Op("compute", (3, 4), 5.0, label="add")]
    order = issue_order(ops, inflight_limit_bytes=10)
    assert _labels(ops, order) == ["a", "mm_a", "ar", "mm_b", "wait", "add"]
    tl = simulate(ops, order)
    assert tl.step_us == pytest.approx(105.0)  # the all-reduce (40..70) ran under mm_b (40..100)
    serial = simulate(ops, serial_order(ops))
    assert serial.step_us == pytest.approx(135.0)


def _chained_gather(matmuls: int) -> list[Op]:
    """w gathered on axis 1 (20 µs), then on axis 0 (30 µs), read by the last of ``matmuls`` + 1
    matmuls (100 µs each, the last 10 µs) of x."""
    ops = [Op("source", static=True, label="w"), Op("source", label="x"),
           Op("issue", (0,), 20.0, lane=1, nbytes=1, label="g1"), Op("wait", (2,), label="w1"),
           Op("issue", (3,), 30.0, lane=0, nbytes=1, label="g0"), Op("wait", (4,), label="w0")]
    prev = 1
    for k in range(matmuls):
        ops.append(Op("compute", (prev,), 100.0, weight=1, label=f"mm{k}"))
        prev = len(ops) - 1
    ops.append(Op("compute", (5, prev), 10.0, weight=1, label="last"))
    return ops


def test_a_chained_collective_is_waited_once_a_heavy_op_ran_since_it_was_issued() -> None:
    ops = _chained_gather(2)
    order = issue_order(ops, inflight_limit_bytes=10)
    assert _labels(ops, order) == ["w", "x", "g1", "mm0", "w1", "g0", "mm1", "w0", "last"]
    tl = simulate(ops, order, keep_spans=True)
    spans = {ops[i].label: (lane, s, e) for i, lane, s, e in tl.spans}
    assert spans["g1"][1:] == (0.0, 20.0) and spans["g0"][1:] == (100.0, 130.0)  # the second hop after mm0
    assert tl.step_us == pytest.approx(210.0)  # both hops hidden
    # one matmul only: the first hop is waited after it, the second (30 µs) is exposed whole
    one = _chained_gather(1)
    assert simulate(one, issue_order(one, 10)).step_us == pytest.approx(100.0 + 30.0 + 10.0)


def test_the_inflight_limit_holds_and_a_larger_collective_runs_alone() -> None:
    # eight parameters' gathers of 40 bytes, each read by its own matmul; limit 100 bytes
    ops: list[Op] = [Op("source", label="x")]
    for k in range(8):
        ops.append(Op("source", static=True, label=f"w{k}"))
    prev = 0
    for k in range(8):
        g = len(ops)
        ops += [Op("issue", (1 + k,), 10.0, lane=0, nbytes=40, label=f"g{k}"), Op("wait", (g,), label=f"wait{k}")]
        ops.append(Op("compute", (prev, g + 1), 20.0, weight=1, label=f"mm{k}"))
        prev = len(ops) - 1
    order = issue_order(ops, inflight_limit_bytes=100)
    tl = simulate(ops, order)
    assert tl.peak_inflight_bytes <= 100
    assert tl.step_us < simulate(ops, serial_order(ops)).step_us
    big = [Op("source", static=True), Op("issue", (0,), 1.0, lane=0, nbytes=500), Op("wait", (1,)),
           Op("compute", (2,), 1.0)]
    assert simulate(big, issue_order(big, 100)).peak_inflight_bytes == 500  # alone: nothing else in flight


def test_orders_are_permutations_that_respect_every_dependency() -> None:
    # random DAGs of compute, views and collectives: every op once, every input before its reader
    import random

    for seed in range(30):
        rng = random.Random(seed)
        ops: list[Op] = [Op("source", static=rng.random() < 0.5) for _ in range(3)]
        for _ in range(40):
            i = len(ops)
            pick = rng.random()
            readable = [j for j in range(i) if ops[j].kind != "issue"]
            if pick < 0.3:
                ops.append(Op("issue", (rng.choice(readable),), rng.uniform(1, 50), lane=rng.randint(0, 1),
                              nbytes=rng.uniform(1, 60)))
                ops.append(Op("wait", (i,)))
            else:
                k = rng.randint(1, 3)
                ops.append(Op("view" if pick < 0.4 else "compute", tuple(sorted(set(rng.sample(readable, min(k, len(readable)))))),
                              rng.uniform(0, 30), weight=float(rng.random() < 0.5)))
        for order in (issue_order(ops, 100.0), serial_order(ops)):
            tl = simulate(ops, order)  # raises on a missing op or a reader before its input
            assert tl.step_us >= tl.compute_us - 1e-9
            assert tl.step_us <= tl.compute_us + tl.comm_us + 1e-9


def test_a_program_that_reads_a_later_op_is_refused() -> None:
    with pytest.raises(ProgramError, match="reads only earlier"):
        issue_order([Op("compute", (1,)), Op("source")], 10)
    with pytest.raises(ProgramError, match="exactly one issue"):
        issue_order([Op("source"), Op("wait", (0,))], 10)


# ------------------------------------------------------------------------------------------- plans
def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def tiny_captured():
    from apmodel.lowering import capture_on_meta

    tokens, targets = fixed_tokens()
    return capture_on_meta(tiny_llama("meta"), (tokens,), _lm_loss, targets=(targets,))


def test_overlap_off_prices_compute_plus_communication_exactly(tiny_captured) -> None:
    plan = apmodel.plan(tiny_captured, (2, 2), device="h100", overlap=False)
    assert plan.objective_us == pytest.approx(plan.compute_us + plan.comm_us, rel=1e-12)
    assert plan.objective_us == pytest.approx(plan.solver["energy_us"], rel=1e-9)
    assert plan.overlap["enabled"] is False


def test_the_kept_plan_is_never_slower_than_the_serial_optimum_repriced(tiny_captured) -> None:
    for mesh, device in (((2, 2), "h100"), ((4,), "a100"), ((2, 4), "cpu")):
        serial = apmodel.plan(tiny_captured, mesh, device=device, overlap=False)
        overlapped = apmodel.plan(tiny_captured, mesh, device=device, overlap=True)
        repriced = price(overlapped.model, serial.node_strategy)  # the serial optimum, priced by its step
        assert overlapped.objective_us <= repriced["objective_us"] + 1e-6, (mesh, device)
        assert overlapped.objective_us == pytest.approx(overlapped.overlap["step_us"])
        # the step never costs more than the sum, never less than the computation
        assert overlapped.compute_us - 1e-6 <= overlapped.objective_us <= overlapped.overlap["serial_us"] + 1e-6
        candidates = overlapped.solver["overlap_candidates"]
        assert candidates[0]["weight_traffic_scale"] == 1.0
        assert candidates[0]["serial_us"] == pytest.approx(serial.objective_us, rel=1e-9)


# ---------------------------------------------------------------------------------- gloo programs
def _waits_after_issue(gm) -> list[int]:
    """For each functional collective of ``gm``: how many nodes lie between it and its wait."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gaps = []
    for n in nodes:
        if n.op == "call_function" and "wait_tensor" in str(n.target) and isinstance(n.args[0], torch.fx.Node):
            gaps.append(pos[n] - pos[n.args[0]] - 1)
    return gaps


def _inflight_peak_bytes(gm) -> tuple[float, float]:
    """Most bytes of collectives issued and not yet waited, walking ``gm`` in its order, and the
    largest single collective."""
    from apmodel.lowering.native import _bytes, _is_collective

    used = peak = largest = 0.0
    live: dict[Any, float] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not _is_collective(n.target):
            continue
        if "wait_tensor" in str(n.target):
            used -= live.pop(n.args[0], 0.0)
        else:
            live[n] = _bytes(n)
            used += live[n]
            peak, largest = max(peak, used), max(largest, live[n])
    return peak, largest


def _overlap_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    mesh = dist.init_device_mesh("cpu", (2, 2))
    tokens, targets = fixed_tokens()
    out: dict[str, Any] = {}

    def run(build, full, args, loss_fn, tgts, **kw) -> dict[str, Any]:
        model = _lower(build, full, mesh, args, loss_fn, targets=tgts, **kw)
        r = _grads_and_losses(model, lambda m: m(*args, *tgts))  # 3 AdamW steps, the first step's gradients
        native = model._apmodel_program.native
        graphs = (native.forward_graph, native.backward_graph)
        return {**r, "gaps": [g for gm in graphs for g in _waits_after_issue(gm)],
                "inflight": [_inflight_peak_bytes(gm) for gm in graphs]}

    llama_full = full_weights(tiny_llama("cpu"))
    for overlap in (True, False):
        out[("llama", overlap)] = run(lambda: tiny_llama("meta"), llama_full, (tokens,), _lm_loss, (targets,),
                                      device="h100", overlap=overlap, inflight_mb=0.05)
    case = next(c for c in ZOO if c.name == "cnn_batchnorm")
    args, _, tgts = case.step_inputs()
    weights = full_weights(case.seeded())
    for overlap in (True, False):
        out[("cnn_batchnorm", overlap)] = run(case.build, weights, args, case.loss_fn, tgts, device="h100",
                                              overlap=overlap)
    return out


@pytest.mark.slow
def test_overlapped_program_equals_the_serial_one_on_2x2_gloo() -> None:
    out = run_distributed(_overlap_worker, 4, timeout_s=900)[0]
    for name in ("llama", "cnn_batchnorm"):
        on, off = out[(name, True)], out[(name, False)]
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-6), name
        assert on["grads"].keys() == off["grads"].keys() and on["grads"], name
        for k, g in off["grads"].items():
            scale = max(float(g.abs().max()), 1e-12)
            assert float((on["grads"][k] - g).abs().max()) <= 1e-6 * scale + 1e-8, (name, k)
        assert all(gap == 0 for gap in off["gaps"]), name  # serial: each wait right after its issue
        assert any(gap > 0 for gap in on["gaps"]), name  # overlapped: waits moved away from the issues
    # the in-flight limit (0.05 MB) held in the graphs' order; a collective larger than it runs alone
    for peak, largest in out[("llama", True)]["inflight"]:
        assert peak <= max(0.05 * 2**20, largest), (peak, largest)


def test_the_report_draws_one_layers_timeline_from_the_priced_program(tiny_captured) -> None:
    from apmodel.reading.report_data import timeline_lanes

    plan = apmodel.plan(tiny_captured, (2, 2), device="h100", overlap=True)
    drawn = timeline_lanes(plan, "layers.0")
    assert [lanes.id for lanes in drawn] == ["timeline-forward", "timeline-backward"]
    compute = sum(e - s for lanes in drawn for name, spans in lanes.lanes if name == "compute" for s, e, _, _ in spans)
    assert compute == pytest.approx(plan.per_layer["layers.0"]["compute_us"], rel=1e-9)  # every op of the layer once
    for lanes in drawn:
        assert all(0 <= s < e for _, spans in lanes.lanes for s, e, _, _ in spans)
    assert timeline_lanes(apmodel.plan(tiny_captured, (2, 2), device="h100", overlap=False)) == []


def _inductor_code_worker(rank: int, world: int, overlap: bool = True) -> list[str]:
    """The code Inductor writes for the overlapped tiny LLaMA's forward and backward on (2,)."""
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    mesh = dist.init_device_mesh("cpu", (world,))
    tokens, targets = fixed_tokens()
    with torch.device("meta"):
        model = tiny_llama("meta")
    model = apmodel.parallelize(model, mesh, (tokens.to("meta"),), loss_fn=_lm_loss, targets=(targets.to("meta"),),
                                device="h100", overlap=overlap)
    model.to_empty(device="cpu")
    apmodel.lowering.load_full_state_dict(model, full_weights(tiny_llama("cpu")))
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    _, code = run_and_get_code(lambda: compiled(tokens, targets).backward())
    return code


def _kernels_between_issue_and_wait(code: str) -> list[int]:
    """For each functional collective in Inductor's code: the kernel calls between its issue and its wait."""
    import re

    lines = code.splitlines()
    issued: dict[str, int] = {}
    gaps = []
    for i, line in enumerate(lines):
        m = re.search(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)", line)
        out = re.search(r"torch\.ops\._c10d_functional\.\w+_out\.default\(.*out=(\w+)\)", line)
        if m or out:
            issued[(m or out).group(1)] = i
            continue
        w = re.search(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)", line)
        if w and w.group(1) in issued:
            start = issued.pop(w.group(1))
            gaps.append(sum(1 for x in lines[start + 1:i] if re.search(r"(cpp_fused|extern_kernels\.|aten\.)", x)))
    return gaps


@pytest.mark.slow
def test_inductor_keeps_the_collectives_overlapped() -> None:
    """Under torch.compile (default options), Inductor's generated code keeps computation between a
    collective's issue and its wait, where the native program put it; with overlap off every wait
    follows its issue, so the check fails if Inductor collapsed the waits."""
    gaps = {}
    for overlap in (True, False):
        code = run_distributed(_inductor_code_worker, 2, overlap, timeout_s=900)[0]
        gaps[overlap] = [g for c in code for g in _kernels_between_issue_and_wait(c)]
        assert gaps[overlap], "no functional collective found in Inductor's code"
    assert any(g > 0 for g in gaps[True]), gaps
    assert all(g == 0 for g in gaps[False]), gaps


def test_a_count_limit_keeps_one_collective_in_flight() -> None:
    """gloo's limit (one in flight): the second gather waits until the first is waited, and the
    first still runs behind the computation."""
    ops = [Op("source", static=True, label="w0"), Op("source", static=True, label="w1"), Op("source", label="x"),
           Op("issue", (0,), 50.0, lane=0, nbytes=1, label="g0"), Op("wait", (3,), label="wait0"),
           Op("issue", (1,), 50.0, lane=0, nbytes=1, label="g1"), Op("wait", (5,), label="wait1"),
           Op("compute", (2,), 100.0, weight=1, label="mm0"), Op("compute", (4, 7), 100.0, weight=1, label="mm1"),
           Op("compute", (6, 8), 10.0, weight=1, label="mm2")]
    order = issue_order(ops, 1e9, max_inflight=1)
    assert _labels(ops, order) == ["w0", "w1", "x", "g0", "mm0", "wait0", "g1", "mm1", "wait1", "mm2"]
    assert simulate(ops, order).step_us == pytest.approx(210.0)  # both gathers hidden, one at a time
    both = issue_order(ops, 1e9)
    assert _labels(ops, both)[3:5] == ["g0", "g1"]  # without the count limit both lead

"""Pipeline stages on a real gloo mesh: a tiny LLaMA on (2 pipeline × 2) CPU processes, 1F1B (and
the interleaved schedule) over 4 microbatches, each stage's step lowered with its own SPMD plan on
the stage mesh, trains 3 AdamW steps with the losses of one device; each stage reduces its
gradients once per step, one collective per bucket (counted at dispatch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from apmodel.core import placements as pl

from _dist_utils import CollectiveRecorder, run_distributed
from _helpers import train
from _tiny import fixed_tokens, tiny_llama

#: Layers of the tiny LLaMA here: 4, split unevenly so a stage holds more than one layer.
LAYERS = 4
STAGES = ((0, 0), (1, 3))
MICROBATCHES = 4
STEPS = 3


def _reference_losses() -> list[float]:
    tokens, targets = fixed_tokens()
    model = tiny_llama("cpu", n_layers=LAYERS)
    return train(model, lambda m: m(tokens, targets), STEPS)


#: Collectives that reduce (a gradient's reduction is one of these).
REDUCING = ("reduce_scatter", "all_reduce")


class _Recorder(CollectiveRecorder):
    """Also the out= variants the native program's buckets use."""

    KINDS = {**CollectiveRecorder.KINDS, "all_gather_into_tensor_out": "all_gather",
             "reduce_scatter_tensor_out": "reduce_scatter", "all_reduce_out": "all_reduce"}


def _worker(rank: int, world: int, schedule: str, stages: tuple, weight_sync: str = "reduce_once") -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import apmodel
    from apmodel.lowering import load_full_state_dict, planned_redistributions
    from apmodel.lowering import pipeline as lowered
    from apmodel.models.loss import cross_entropy_loss

    recorder = _Recorder()
    windows: list[tuple[int, int]] = []  # the calls each step's gradient reduction issued
    reduce = lowered.reduce_gradients

    def counted(module: Any) -> int:
        before = len(recorder.calls)
        n = reduce(module)
        if n:
            windows.append((before, len(recorder.calls)))
        return n

    lowered.reduce_gradients = counted  # type: ignore[assignment]  # what the stages call once per step

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens, targets = fixed_tokens()
    pipelined = apmodel.parallelize_pipeline(
        lambda: tiny_llama("meta", n_layers=LAYERS), mesh, (tokens,), loss_fn=cross_entropy_loss, pp_axis=0,
        stages=stages, microbatches=MICROBATCHES, pp_schedule=schedule, weight_sync=[weight_sync] * len(stages))
    reference = tiny_llama("cpu", n_layers=LAYERS)
    full = {**reference.state_dict(), **dict(reference.named_buffers())}  # RoPE tables are not persistent
    for module in pipelined.stages:
        module.to_empty(device="cpu")
        load_full_state_dict(module, full)
    opt = torch.optim.AdamW(pipelined.parameters(), lr=1e-2)
    losses, per_step = [], []
    sched = pipelined.schedule
    pipeline_stages = list(getattr(sched, "_stages", None) or [sched._stage])
    for _ in range(STEPS):
        parts_before = sum(s.weight_parts_run for s in pipeline_stages)
        recorder.calls.clear()
        windows.clear()
        with recorder:
            loss = pipelined.step(tokens, target=targets)
        inside = [recorder.calls[a:b] for a, b in windows]  # per reduction: (kind, group, dtype) per collective
        per_step.append({"windows": sorted(sorted(c[0] for c in calls) for calls in inside),
                         "distinct": [len(set(calls)) == len(calls) for calls in inside],
                         "all_gathers": sum(1 for c in recorder.calls if c[0] == "all_gather"),
                         "outside_reducing": sum(1 for c in recorder.calls if c[0] in REDUCING) - sum(
                             1 for calls in inside for c in calls if c[0] in REDUCING),
                         # weight-gradient parts of the native backward the W actions ran
                         "weight_parts": sum(s.weight_parts_run for s in pipeline_stages) - parts_before})
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    layers = [sorted({int(n.split(".")[1]) for n, _ in m.named_parameters() if n.startswith("layers.")})
              for m in pipelined.stages]
    # what the stage plans reduce: the gradients' planned redistributions, by collective kind
    planned = []
    for module in pipelined.stages:
        prog = module._apmodel_program
        planned.append(sorted({step[0] for r in planned_redistributions(prog.plan, prog.captured)
                               if r.gradient and r.bucketed for step in _steps(r)}))
    return {"losses": losses, "stages": pipelined.stage_indices, "layers": layers, "per_step": per_step,
            "planned": planned}


def _steps(r: Any) -> list:
    import costmodels

    comm = costmodels.NCCLCollectives(costmodels.Topology((2,), costmodels.device("h100"), 8))
    itemsize = torch.empty((), dtype=r.dtype).element_size()
    return list(costmodels.redistribution_steps(comm, r.global_shape, itemsize, r.src, r.dst))


@pytest.mark.slow
def test_1f1b_pipeline_of_spmd_stages_trains_like_one_device():
    per_rank = run_distributed(_worker, 4, "1f1b", STAGES, timeout_s=900)
    reference = _reference_losses()
    # ranks 0, 1: pipeline rank 0 (stage 0, layer 0); ranks 2, 3: stage 1 (layers 1-3) and the loss
    assert [r["stages"] for r in per_rank] == [[0], [0], [1], [1]]
    assert [r["layers"] for r in per_rank] == [[[0]], [[0]], [[1, 2, 3]], [[1, 2, 3]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
    assert per_rank[0]["losses"] == [None] * STEPS
    for r in per_rank:  # one stage per rank: its gradients reduced once per step, one collective per bucket
        (planned,) = r["planned"]
        assert planned, "the stage plan reduces no gradient: nothing to count"
        for step in r["per_step"]:
            # every parameter's gradient fits one 25 MB bucket: one collective per kind the plan reduces with
            assert step["windows"] == [planned] and all(step["distinct"])


@pytest.mark.slow
def test_gradients_reduced_per_microbatch_when_priced_so():
    """weight_sync "microbatch": no reduction at the step's end; each microbatch's backward
    reduces (the same losses)."""
    per_rank = run_distributed(_worker, 4, "1f1b", STAGES, "microbatch", timeout_s=900)
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(_reference_losses(), rel=1e-5)
    for r in per_rank:
        (planned,) = r["planned"]
        for step in r["per_step"]:
            assert step["windows"] == []
            assert step["outside_reducing"] >= MICROBATCHES * sum(k in REDUCING for k in planned)


@pytest.mark.slow
def test_kept_parameters_are_gathered_once_per_step():
    """weight_sync "gather_once": each stage gathers its parameters on its first microbatch and
    keeps them: per step, m - 1 fewer of each parameter gather than gathering per microbatch (the
    same losses; gradients still reduced once per step)."""
    kept = run_distributed(_worker, 4, "1f1b", STAGES, "gather_once", timeout_s=900)
    each = run_distributed(_worker, 4, "1f1b", STAGES, "reduce_once", timeout_s=900)
    reference = _reference_losses()
    for r in kept[2:] + each[2:]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
    for a, b in zip(kept, each, strict=True):
        # after the first step, whose extra passes (pipelining infers its stages' shapes) differ
        for step_kept, step_each in zip(a["per_step"][1:], b["per_step"][1:], strict=True):
            fewer = step_each["all_gathers"] - step_kept["all_gathers"]
            assert fewer > 0 and fewer % (MICROBATCHES - 1) == 0, (step_each, step_kept)
            assert step_kept["windows"] == step_each["windows"] == [a["planned"][0]]


@pytest.mark.slow
def test_interleaved_pipeline_trains_like_one_device():
    """Two stages per pipeline rank (ScheduleInterleaved1F1B): stage k on pipeline rank k mod 2."""
    per_rank = run_distributed(_worker, 4, "interleaved", ((0, 0), (1, 1), (2, 2), (3, 3)), timeout_s=900)
    assert [r["stages"] for r in per_rank] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [r["layers"] for r in per_rank[1:3]] == [[[0], [2]], [[1], [3]]]
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(_reference_losses(), rel=1e-5)
    for r in per_rank:  # two stages per rank: each reduces once per step (REDUCE_GRAD after its last backward)
        for step in r["per_step"]:
            assert step["windows"] == sorted(r["planned"]) and all(step["distinct"])


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "weight_sync"), [("zbv", "reduce_once"), ("dualpipev", "gather_once")])
def test_v_schedules_train_like_one_device(schedule, weight_sync):
    """Two stages per pipeline rank in a V (ScheduleZBVZeroBubble, ScheduleDualPipeV): stage k and
    3 - k on pipeline rank k, the backward split into input and weight gradients (the native
    backward graph's two parts, the weight part run by the W action; kept gathered, cut from the
    kept-gathered main graph); the last stage, and so the loss, on pipeline rank 0. Each stage
    still reduces its gradients once per step, after its last weight gradient."""
    per_rank = run_distributed(_worker, 4, schedule, ((0, 0), (1, 1), (2, 2), (3, 3)), weight_sync, timeout_s=900)
    assert [r["stages"] for r in per_rank] == [[0, 3], [0, 3], [1, 2], [1, 2]]
    assert [r["layers"] for r in per_rank[1:3]] == [[[0], [3]], [[1], [2]]]
    reference = _reference_losses()
    for r in per_rank[:2]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
    assert per_rank[2]["losses"] == [None] * STEPS
    from apmodel.core.schedules import orders

    for rank, r in enumerate(per_rank):
        w_actions = sum(a.kind == "W" for a in orders(schedule, 2, MICROBATCHES)[rank // 2])
        assert w_actions > 0
        for step in r["per_step"]:
            assert step["windows"] == sorted(r["planned"]) and all(step["distinct"])
            # each W action ran the weight-gradient part of its native backward
            assert step["weight_parts"] == w_actions, (rank, step)


@pytest.mark.slow
def test_split_backward_reducing_per_microbatch():
    """ZB-V with the gradients reduced in each W action (``microbatch``: the weight part reduces
    and adds to ``.grad``; the V test covers the syncs that reduce once per step): the losses of
    one device."""
    per_rank = run_distributed(_worker, 4, "zbv", ((0, 0), (1, 1), (2, 2), (3, 3)), "microbatch", timeout_s=900)
    reference = _reference_losses()
    for r in per_rank[:2]:
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
    for r in per_rank:
        for step in r["per_step"]:
            assert step["weight_parts"] == 2 * MICROBATCHES, step
            assert step["windows"] == [] and step["outside_reducing"] > 0


# ------------------------------------------------------------------------------ transfers as priced
def _transfer_worker(rank: int, world: int, plan_json: dict) -> dict[str, Any]:
    """Trains the planned pipeline and counts the bytes each rank's stage sends per step (the
    tensors of the schedule's point-to-point sends)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models.loss import cross_entropy_loss
    from apmodel.result.plans import Plan

    sent = [0]
    batch_p2p = schedules._batch_p2p

    def counted(ops: list, desc: str | None = None) -> list:
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch_p2p(ops, desc)

    schedules._batch_p2p = counted  # what every schedule sends through
    plan = Plan.from_json(plan_json, "the test's plan")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens, targets = fixed_tokens()
    pipelined = apmodel.parallelize_pipeline(lambda: tiny_llama("meta", n_layers=LAYERS), mesh, (tokens,),
                                             loss_fn=cross_entropy_loss, pp_axis=0, plan=plan)
    reference = tiny_llama("cpu", n_layers=LAYERS)
    full = {**reference.state_dict(), **dict(reference.named_buffers())}
    for module in pipelined.stages:
        module.to_empty(device="cpu")
        load_full_state_dict(module, full)
    opt = torch.optim.AdamW(pipelined.parameters(), lr=1e-2)
    losses, per_step = [], []
    for _ in range(STEPS):
        sent[0] = 0
        loss = pipelined.step(tokens, target=targets)
        per_step.append(sent[0])
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    stage = pipelined.schedule._stage if hasattr(pipelined.schedule, "_stage") else None
    boundary = None if stage is None else (stage.submod.sends or stage.submod.receives)
    return {"losses": losses, "sent": per_step,
            "placements": None if boundary is None else [str(p) for p in boundary.placements]}


@pytest.mark.slow
@pytest.mark.parametrize(("options", "placed_as"), [({}, ["S(0)"]), ({"param_policy": "free"}, ["R"])],
                         ids=["batch-sharded", "replicated"])
def test_bytes_sent_between_stages_are_the_priced_bytes(options, placed_as):
    """A plan priced in fp32 (the dtype the gloo step runs in), lowered as planned: per step, each
    rank of the first stage sends its shard of every microbatch's activation and each rank of the
    second sends its shard of the gradient: microbatches × the plan's ``boundary_bytes`` each, at
    the recorded boundary placement. Batch-sharded (the default placement), the full activation
    would be twice that on this 2-rank stage mesh; replicated (what the stage plan of free
    parameter placements leaves there), the default placement would be half: the lowering follows
    the record. The losses are one device's."""
    import apmodel

    tokens, targets = fixed_tokens()
    plan = apmodel.plan(tiny_llama("meta", n_layers=LAYERS), (2, 2), (tokens.to("meta"), targets.to("meta")),
                        device="h100", dtype="fp32", pp_axis=0, pp_degrees=(2,), microbatches=MICROBATCHES, **options)
    record = plan.pipeline
    assert record["degree"] == 2 and len(record["boundary_bytes"]) == 1
    priced = record["boundary_bytes"][0]
    assert priced > 0 and record["boundary_placements"] == [placed_as]
    per_rank = run_distributed(_transfer_worker, 4, plan.to_json(), timeout_s=900)
    for r in per_rank[2:]:
        assert r["losses"] == pytest.approx(_reference_losses(), rel=1e-5)
    placed = [str(p) for p in pl.parse("".join(record["boundary_placements"][0]))]
    for r in per_rank:
        assert r["placements"] == placed
        # after the first step (the schedule's shape inference and neighbour set-up send too)
        assert r["sent"][1:] == [MICROBATCHES * priced] * (STEPS - 1), r["sent"]

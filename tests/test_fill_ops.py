"""Ops that fill a shape from an input (``new_zeros``, ``ones_like``, ``full_like``...): every
placement the planner may give their output is one lowering produces, and models using them train
on (2,) and 2x2 gloo meshes as on one device.

DTensor's rules give these ops several free output placements (replicated, or the input's when
the shapes agree) and pick one at run time; a plan that picked another crashed in lowering (T5's
``shift_right``: ``input_ids.new_zeros(...)`` planned replicated, DTensor produced ``S(0)R``).
Lowering now builds a fill's output at the planned placement itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn as nn

import apmodel
from apmodel.graph.capture import capture

from _dist_utils import run_distributed

STEPS = 3
FILL_OPS = ("new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like")


class Fills(nn.Module):
    """Each fill op of an input, as models use them (T5's shift-right among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        shifted = h.new_zeros(h.shape)            # T5's shift_right: zeros, then the input moved one step
        shifted[:, 1:] = h[:, :-1]
        scale = h.new_ones(h.shape) + h.new_full(h.shape, 0.5) + torch.ones_like(h) * torch.full_like(h, 2.0)
        blank = h.new_empty(h.shape).zero_() + torch.empty_like(h).fill_(1.0) + torch.zeros_like(h)
        return ((shifted + h) * scale + blank).pow(2).mean()


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randn(8, 6, 16, generator=g)


def _captured():
    with torch.device("meta"):
        model = Fills()
    return model, capture(model, (_batch(torch.Generator().manual_seed(0)).to("meta"),))


def _worker(rank: int, world: int, mesh_shape: tuple[int, ...], plan_path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.entry.api import build_model
    from apmodel.lowering import load_full_state_dict, lower
    from apmodel.result.plans import Plan

    mesh = dist.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    ref = Fills()
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model, captured = _captured()
    model = lower(model, mesh, Plan.load(plan_path), captured)
    model.to_empty(device="cpu")
    load_full_state_dict(model, full)

    # every candidate output placement of every fill node, built as lowering builds it
    program = model._apmodel_program
    pm = build_model(captured, mesh_shape)
    checked, wrong = 0, []
    for step in program.fwd_steps + program.bwd_steps:
        if step.fill is None:
            continue
        val = step.node.meta["val"]
        for strategy in pm.strategies.get(step.node.name, []):
            out = program._fill(dataclasses.replace(step, outputs=(tuple(strategy.outputs[0]),)), torch.device("cpu"))
            got = out.full_tensor()
            if got.shape != val.shape or not torch.equal(got, torch.full(val.shape, step.fill, dtype=val.dtype)):
                wrong.append((step.node.name, str(strategy)))
            checked += 1

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        x = _batch(g)
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        losses.append(loss.full_tensor().item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "checked": checked, "wrong": wrong,
            "fill_nodes": sorted(str(s.target) for s in program.fwd_steps + program.bwd_steps if s.fill is not None)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_fill_ops_plan_lower_and_train_like_one_device(tmp_path, mesh_shape):
    _, captured = _captured()
    traced = {str(n.target).split(".")[1] for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"} <= traced, traced
    # the plan that crashed before: the zeros replicated while their input is batch-sharded
    sharded, replicated = ("S(0)" + "R" * (len(mesh_shape) - 1)), "R" * len(mesh_shape)
    plan = apmodel.plan(captured, mesh_shape, device="h100", constraints=[
        apmodel.fix("new_zeros", sharded, on="input:0"), apmodel.fix("new_zeros", replicated)])
    plan.save(tmp_path / "plan.json")
    r = run_distributed(_worker, math.prod(mesh_shape), mesh_shape,
                        str(tmp_path / "plan.json"), timeout_s=300)[0]
    assert len(r["fill_nodes"]) >= 6 and r["wrong"] == []
    assert r["checked"] >= 2 * len(r["fill_nodes"])  # several candidates per fill
    for got, want in zip(r["losses"], r["ref_losses"], strict=False):
        assert got == pytest.approx(want, rel=1e-5)

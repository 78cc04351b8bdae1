"""The paper's storage budget ``high`` (``param_budget_ratio``): the mean local/global ratio over
parameter tensors. Its ends are the two policies it generalises, checked with an exact solver."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import apmodel
from apmodel.core import placements as pl
from apmodel.models import build, sample_inputs

MESH = (2, 2)


@pytest.fixture(scope="module")
def captured():
    with torch.device("meta"):
        model = build("llama3-debug", n_layers=1)
    return apmodel.build_model(model, MESH, sample_inputs("llama3-debug", batch=8, seq=32, device="meta")).captured


def _plan(captured, **options):
    return apmodel.plan(captured, MESH, solver="highs", memory_limit_bytes=math.inf, **options)


def _mean_ratio(plan) -> float:
    ratios = [1 / math.prod(MESH[a] for a, p in enumerate(pls) if pl.to_str(p).startswith("S"))
              for pls in plan.param_placements.values()]
    return float(np.mean(ratios))


def test_budget_ends_are_full_shard_and_free(captured):
    full = _plan(captured)                        # default policy: every parameter fully sharded
    free = _plan(captured, param_policy="free")
    lowest = _plan(captured, param_budget_ratio=1 / math.prod(MESH))
    highest = _plan(captured, param_budget_ratio=1.0)
    assert lowest.objective_us == pytest.approx(full.objective_us, rel=1e-9)
    assert highest.objective_us == pytest.approx(free.objective_us, rel=1e-9)
    assert _mean_ratio(lowest) == pytest.approx(1 / 4)


def test_budget_row_holds_and_objective_falls_as_it_loosens(captured):
    objectives = []
    for high in (0.25, 0.4, 0.6, 1.0):
        # the serial objective: a looser row can only lower the optimum of the problem solved
        plan = _plan(captured, param_budget_ratio=high, overlap=False)
        assert _mean_ratio(plan) <= high + 1e-9
        objectives.append(plan.objective_us)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(objectives, objectives[1:], strict=False)), objectives


def test_two_budgets_at_once_are_refused():
    with pytest.raises(ValueError, match="two storage budgets"):
        apmodel.PlanOptions(param_memory_fraction=0.5, param_budget_ratio=0.5)

"""Cost values are validated where they enter the model: a compute or comm model returning a
negative, NaN or infinite time (µs) is refused with a CostModelError that names the model, the
op or collective, and the value; forbidden transitions (inf, produced by apmodel itself) still work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import apmodel
import costmodels as cm
from apmodel.graph.capture import capture
from apmodel.models import build, config, sample_inputs
from apmodel.problem.pricing import CheckedComm, CostContext, CostModelError

MESH = (4,)


@pytest.fixture(scope="module")
def tiny():
    cfg = config("llama3-debug", n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_hidden_dim=64,
                 vocab_size=64, max_seq_len=8)
    with torch.device("meta"):
        model = build(cfg)
    return capture(model, sample_inputs(cfg, batch=4, seq=8, device="meta"))


class BadMatmul:
    """Roofline prices, except ``value`` for every aten.mm."""

    def __init__(self, value: float) -> None:
        self.base = cm.RooflineCompute(cm.device("h100"))
        self.value = value

    def time_us(self, op, args, kwargs, out, dtype=None):
        if str(op) == "aten.mm.default":
            return self.value
        return self.base.time_us(op, args, kwargs, out, dtype=dtype)


class BadCollective:
    """NCCL prices, except ``value`` for ``kind`` (``None``: every kind)."""

    def __init__(self, mesh_shape, value: float, kind: str | None = None) -> None:
        self.base = cm.NCCLCollectives(cm.Topology(tuple(mesh_shape), cm.device("h100")))
        self.mesh_shape = tuple(mesh_shape)
        self.value, self.kind = value, kind

    def time_us(self, kind, nbytes, axis):
        if self.kind is None or kind == self.kind:
            return self.value
        return self.base.time_us(kind, nbytes, axis)

    def __repr__(self) -> str:
        return f"BadCollective({self.value!r}, kind={self.kind!r})"


@pytest.mark.parametrize("value, shown", [(-1.5, r"a negative time \(-1\.5 µs\)"), (math.nan, "NaN"),
                                          (math.inf, "inf µs")])
def test_bad_compute_time_is_named(tiny, value, shown):
    # linears on [batch, seq, feature] are N-D ops priced as the mm they replace (apmodel/graph/linear3d.py)
    with pytest.raises(CostModelError, match=rf"compute model BadMatmul returned {shown} for aten\.mm\.default "
                                             rf"\(as apmodel_linear\.mm_nd(_wgrad)?\.default\) at node 'mm_nd(_wgrad)?(_\d+)?' "
                                             rf"\(strategy .*per-device input shapes \[\(\d+, \d+, \d+\)"):
        apmodel.plan(tiny, MESH, compute_model=BadMatmul(value))


def test_non_numeric_compute_time_is_named(tiny):
    with pytest.raises(CostModelError, match=r"returned 'fast', which is not a number for aten\.mm\.default"):
        apmodel.plan(tiny, MESH, compute_model=BadMatmul("fast"))  # type: ignore[arg-type]


@pytest.mark.parametrize("value, shown", [(-3.0, r"a negative time \(-3\.0 µs\)"), (math.nan, "NaN"),
                                          (math.inf, "inf µs")])
def test_bad_collective_time_is_named(tiny, value, shown):
    with pytest.raises(CostModelError, match=rf"comm model BadCollective\({value!r}, kind=None\) "
                                             rf"returned {shown} for (all_gather|reduce_scatter|all_reduce|all_to_all) "
                                             rf"of \d+ bytes on mesh axis 0 \(mesh \(4,\)\)"):
        apmodel.plan(tiny, MESH, comm_model=BadCollective(MESH, value))


def test_bad_collective_found_on_the_real_axis_when_seeding(tiny):
    # 3 axes: split-dimension seeding prices each axis through a 1-D view of the comm model;
    # the error still names the full mesh's axis
    mesh = (2, 2, 2)
    with pytest.raises(CostModelError, match=r"returned inf µs for all_reduce of \d+ bytes on mesh axis [0-2] "
                                             r"\(mesh \(2, 2, 2\)\)"):
        apmodel.plan(tiny, mesh, comm_model=BadCollective(mesh, math.inf, kind="all_reduce"))


def test_well_behaved_custom_models_still_plan(tiny):
    class Flat:
        mesh_shape = MESH

        def time_us(self, kind, nbytes, axis):
            return 5.0 + nbytes / 1e5

    class Scaled:
        base = cm.RooflineCompute(cm.device("h100"))

        def time_us(self, op, args, kwargs, out, dtype=None):
            return np.float32(2.0) * self.base.time_us(op, args, kwargs, out, dtype=dtype)  # numpy scalars are fine

    plan = apmodel.plan(tiny, MESH, compute_model=Scaled(), comm_model=Flat())
    assert math.isfinite(plan.objective_us) and plan.compute_us > 0 and plan.comm_us >= 0
    assert plan.overlap["serial_us"] == pytest.approx(plan.compute_us + plan.comm_us, rel=1e-6)
    assert plan.compute_us * (1 - 1e-9) <= plan.objective_us <= plan.overlap["serial_us"] * (1 + 1e-9)


def test_forbidden_transitions_keep_their_inf():
    mesh = (2, 4)
    comm = cm.NCCLCollectives(cm.Topology(mesh, "h100"))
    ctx = CostContext(mesh, compute=None, comm=comm)
    assert isinstance(ctx.comm, CheckedComm) and ctx.comm.topo is comm.topo  # attributes read through
    m = ctx.redistribution_matrix((16, 4096), torch.float32, [("S(0)", "R"), ("P", "R")], [("R", "R"), ("P", "R")])
    assert np.isinf(m[0, 1]) and np.isfinite(m[0, 0]) and np.isfinite(m[1, 0]) and m[1, 1] == 0
    assert math.isinf(ctx.redistribution_us((16, 4096), torch.float32, ("R", "R"), ("P", "R")))
    # wrapping is idempotent (a context built from another's comm checks once)
    assert CostContext(mesh, compute=None, comm=ctx.comm).comm is ctx.comm


def test_cached_prices_of_the_wrapped_model_are_not_reused_unchecked():
    mesh = (2, 4)
    bad = BadCollective(mesh, -1.0, kind="all_gather")
    cm.redistribution_us(bad, (16, 4096), 2, ("S(0)", "R"), ("R", "R"))  # fills bad's own cache
    ctx = CostContext(mesh, compute=None, comm=bad)
    with pytest.raises(CostModelError, match="all_gather of 131072 bytes on mesh axis 0"):
        ctx.redistribution_us((16, 4096), torch.float32, ("S(0)", "R"), ("R", "R"))

"""Lowering: a solved :class:`~apmodel.plan.Plan` + the user's module -> an ordinary ``nn.Module``.

This is the last pipeline stage (paper §5.1). It takes the joint forward-backward ATen graph the plan
was solved on (:class:`apmodel.graph.capture.CapturedGraph`) and makes it run on a real
:class:`~torch.distributed.device_mesh.DeviceMesh`, honouring every placement the plan chose.

Design
------
* **Parameters** become ``DTensor`` s with the plan's storage placement; buffers stay plain
  tensors with their global value (so the user's init fills them as usual). The module is changed
  in place (as FSDP2's ``fully_shard`` does): its class becomes a dynamically created subclass of
  the user's class, so ``isinstance`` checks, the module hierarchy and the ``state_dict`` keys are
  unchanged (values are DTensors, so optimizers and distributed checkpointing work). A model on the
  meta device stays on the meta device; call ``to_empty(device=...)`` and initialise it afterwards.
* **The interpreter** (:mod:`~apmodel.lowering.program`) prepares the joint graph for the mesh: per
  node the planned input placements, the redistribution each input needs (all-gather,
  reduce-scatter, all-reduce, all-to-all, local chunk; recorded as :class:`Redistribution`, equal to
  :func:`planned_redistributions`), the local kernel (handed in for ops a device lacks, see
  :func:`apmodel.core.kernels.local_kernels`), and the checks (output placements as planned, even shards,
  the plan's fingerprint and mesh, input shapes at call time). Where DTensor eager needs help (each
  found by lowering random feasible plans): masked embedding partials are applied at once and kept
  as plain partial sums; a view whose input lost the traced layout runs on a contiguous copy.
* **The native program** (:mod:`~apmodel.lowering.native`, the default): the interpreter's forward
  and backward traced once with ``make_fx`` on fake tensors of the run's device, so DTensor's
  dispatch unfolds into local kernels and ``_c10d_functional`` collectives on the mesh axes'
  process groups. A step runs the two graphs inside one ``autograd.Function`` over the parameters'
  local tensors: host time close to plain eager, and ``torch.compile`` (Inductor) compiles it with
  no graph break. Independent collectives of one kind and process group (the parameters'
  gathers, the gradients' reductions) are bucketed (``bucket_mb``), as the plan was priced.
  ``lowering="interpret"`` runs the interpreter over DTensors every step instead (slower; for
  debugging a plan node by node).

Communication is exactly the plan's: every collective comes from one of the recorded
redistributions (the tests check this against the collectives seen at dispatch, by kind and mesh
axis, with bucketing off). On gloo DTensor performs all-to-all as all-gather + local chunk (gloo has
no all-to-all).
"""


from apmodel.lowering.module import (
    LOWERINGS,
    capture_on_meta,
    defer_gradient_reduction,
    load_full_state_dict,
    lower,
    plan_on_one_rank,
    reduce_gradients,
    release_kept,
    split_weight_backward,
)
from apmodel.lowering.program import LoweredProgram
from apmodel.lowering.records import (
    Redistribution,
    issued_redistributions,
    planned_redistributions,
)

__all__ = [
    "LOWERINGS",
    "Redistribution",
    "LoweredProgram",
    "lower",
    "capture_on_meta",
    "plan_on_one_rank",
    "planned_redistributions",
    "issued_redistributions",
    "load_full_state_dict",
    "defer_gradient_reduction",
    "reduce_gradients",
    "release_kept",
    "split_weight_backward",
]

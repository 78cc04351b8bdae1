"""Lowering: a solved :class:`~apmodel.plan.Plan` + the user's module -> an ordinary ``nn.Module``.

This is the last pipeline stage (paper §5.1). It takes the joint forward-backward ATen graph the plan
was solved on (:class:`apmodel.capture.CapturedGraph`) and runs it over DTensors on a real
:class:`~torch.distributed.device_mesh.DeviceMesh`, honouring every placement the plan chose.

Design
------
* **Parameters** become ``DTensor`` s with the plan's storage placement; buffers stay plain
  tensors with their global value (so the user's init fills them as usual) and are wrapped at their
  planned placement (replicated, by the planner's policy) at each step, without communication. The module is
  changed in place (as FSDP2's ``fully_shard`` does): its class becomes a dynamically created subclass
  of the user's class, so ``isinstance`` checks, the module hierarchy and the ``state_dict`` keys are
  unchanged (values are DTensors, so distributed checkpointing works). A model on the meta device stays
  on the meta device; call ``to_empty(device=...)`` and initialise it afterwards.
* **Execution** is one ``torch.autograd.Function`` per step. Its ``forward`` interprets the forward
  nodes of the joint graph; its ``backward`` interprets the backward nodes with the incoming tangent.
  Autograd never differentiates through DTensor, so forward and backward use exactly the layouts the
  plan chose for each (they may differ).
* **Redistribution**: before each node runs, every tensor argument whose current placement differs
  from the node's planned input placement is explicitly ``redistribute`` d (all-gather, reduce-scatter,
  all-reduce, all-to-all, or a local chunk). Each one is recorded (:class:`Redistribution`), so a
  step's communication can be compared with the plan's prediction (:func:`planned_redistributions`).
* **Shapes**: view and factory shape arguments stay global; DTensor's dispatch translates them to
  local shapes. Factories (ops without a tensor argument) are run at their global shape on every rank
  and then chunked locally to the planned placement (no communication).
* **Checks**: after each op the output placement is compared with the plan; a mismatch that needs no
  communication to fix (``R`` -> ``S(d)``) is fixed locally, any other mismatch raises. Uneven shards,
  a mesh of the wrong shape, a graph whose fingerprint differs from the plan's, and sample inputs of the
  wrong shape or dtype at call time raise ``ValueError`` naming the offending node / input.
* **Where DTensor eager needs help** (each found by lowering random feasible plans):
  DTensor's masked partial (embedding over a vocabulary-sharded table) holds a one-shot mask, so it
  is applied at once and the value kept as a plain partial sum; a view whose local input lost the
  traced memory layout in a redistribution (attention output laid out ``[b, s, h, d]``) runs on a
  contiguous local copy; ops without a kernel on the device (the flash-attention op on CPU) run a
  reference kernel on the local shards (handed in: :func:`apmodel.kernels.local_kernels`).

Communication is exactly the plan's: every collective comes from one of the recorded
redistributions, which equal :func:`planned_redistributions` (the tests check this against the
collectives seen at dispatch, by kind and mesh axis). On gloo DTensor performs all-to-all as
all-gather + local chunk (gloo has no all-to-all).
"""


from apmodel.lowering.module import (
    LOWERINGS,
    capture_on_meta,
    load_full_state_dict,
    lower,
    plan_on_one_rank,
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
]

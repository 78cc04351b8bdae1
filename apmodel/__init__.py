"""apmodel: automatic parallelism planning for PyTorch training steps.

Pipeline (one module per stage): capture → strategies → clustering → model → plan → lowering.

    plan = apmodel.plan(model, (4, 8), (tokens, targets), loss_fn=loss, device="h100")
    par_model = apmodel.parallelize(model, mesh, (tokens, targets), loss_fn=loss)
"""

from apmodel.api import build_model, cost_context, plan, replay_constraints, solve_model
from apmodel.capture import CapturedGraph, capture
from apmodel.constraints import Fix, Forbid, Linear, fix, forbid, linear
from apmodel.model import ConstraintConflict, PlacementModel
from apmodel.plan import Plan, PlanMismatch, diff

__all__ = [
    "CapturedGraph", "ConstraintConflict", "Fix", "Forbid", "Linear", "PlacementModel", "Plan", "PlanMismatch",
    "build_model", "capture", "cost_context", "diff", "fix", "forbid", "linear", "parallelize", "plan",
    "replay_constraints", "solve_model",
]


def __getattr__(name: str):
    # parallelize pulls in the lowering stage (distributed runtime); import it on first use.
    if name == "parallelize":
        from apmodel.lowering import parallelize

        return parallelize
    raise AttributeError(f"module 'apmodel' has no attribute {name!r}")

"""apmodel: automatic parallelism planning for PyTorch training steps.

Pipeline (one module per stage): capture → strategies → clustering → model → search → plan →
lowering, orchestrated by :mod:`apmodel.entry.api` with every option in one :class:`~apmodel.core.options.PlanOptions`.

    plan = apmodel.plan(model, (4, 8), (tokens, targets), loss_fn=loss, device="h100")
    par_model = apmodel.parallelize(model, mesh, (tokens, targets), loss_fn=loss)

Public names are imported on first use, so that ``import apmodel.core.placements`` (or the command
line's ``--help``) does not pay for the whole pipeline.
"""

from importlib import import_module

#: public name -> module that defines it
_EXPORTS = {
    "build_model": "apmodel.entry.api",
    "cost_context": "apmodel.entry.api",
    "plan": "apmodel.entry.api",
    "replay_constraints": "apmodel.entry.api",
    "solve_model": "apmodel.entry.api",
    "CapturedGraph": "apmodel.graph.capture",
    "Fix": "apmodel.problem.constraints",
    "Forbid": "apmodel.problem.constraints",
    "FixOutput": "apmodel.problem.constraints",
    "Linear": "apmodel.problem.constraints",
    "fix": "apmodel.problem.constraints",
    "fix_output": "apmodel.problem.constraints",
    "forbid": "apmodel.problem.constraints",
    "linear": "apmodel.problem.constraints",
    "region_as": "apmodel.problem.constraints",
    "RegionAs": "apmodel.problem.constraints",
    "ConstraintConflict": "apmodel.problem.placement_model",
    "PlacementModel": "apmodel.problem.placement_model",
    "Plan": "apmodel.result.plans",
    "PlanMismatch": "apmodel.result.plans",
    "diff": "apmodel.result.plans",
    "parallelize": "apmodel.entry.api",
    "parallelize_pipeline": "apmodel.entry.api",
    "PlanOptions": "apmodel.core.options",
    "Workload": "apmodel.frontend.workloads",
    "plan_workload": "apmodel.entry.api",
    "attach": "apmodel.entry.api",
    "local_map": "apmodel.graph.regions",
    "LocalRegion": "apmodel.graph.regions",
    "RegionComm": "apmodel.graph.regions",
    "region_comm": "apmodel.graph.regions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'apmodel' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return __all__

"""apmodel: automatic parallelism planning for PyTorch training steps.

Pipeline (one module per stage): capture → strategies → clustering → model → search → plan →
lowering, orchestrated by :mod:`apmodel.api` with every option in one :class:`~apmodel.options.PlanOptions`.

    plan = apmodel.plan(model, (4, 8), (tokens, targets), loss_fn=loss, device="h100")
    par_model = apmodel.parallelize(model, mesh, (tokens, targets), loss_fn=loss)

Public names are imported on first use, so that ``import apmodel.placements`` (or the command
line's ``--help``) does not pay for the whole pipeline.
"""

from importlib import import_module

#: public name -> module that defines it
_EXPORTS = {
    "build_model": "apmodel.api",
    "cost_context": "apmodel.api",
    "plan": "apmodel.api",
    "replay_constraints": "apmodel.api",
    "solve_model": "apmodel.api",
    "CapturedGraph": "apmodel.capture",
    "Fix": "apmodel.constraints",
    "Forbid": "apmodel.constraints",
    "Linear": "apmodel.constraints",
    "fix": "apmodel.constraints",
    "forbid": "apmodel.constraints",
    "linear": "apmodel.constraints",
    "region_as": "apmodel.constraints",
    "RegionAs": "apmodel.constraints",
    "ConstraintConflict": "apmodel.placement_model",
    "PlacementModel": "apmodel.placement_model",
    "Plan": "apmodel.plans",
    "PlanMismatch": "apmodel.plans",
    "diff": "apmodel.plans",
    "parallelize": "apmodel.api",
    "parallelize_pipeline": "apmodel.api",
    "PlanOptions": "apmodel.options",
    "Workload": "apmodel.workloads",
    "plan_workload": "apmodel.api",
    "attach": "apmodel.api",
    "local_map": "apmodel.regions",
    "LocalRegion": "apmodel.regions",
    "RegionComm": "apmodel.regions",
    "region_comm": "apmodel.regions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'apmodel' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return __all__

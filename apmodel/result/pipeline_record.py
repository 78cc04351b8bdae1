"""The record of a pipeline choice: the chosen degree, its stage split and price, and every degree
priced, as plan files and ``apmodel plan --json`` carry it (the ``pipeline`` object). Read back with
every field checked (:meth:`PipelineChoice.from_json`). See :mod:`apmodel.solve.pipeline` for how it is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from apmodel.core import schedules


class PipelineError(ValueError):
    """A pipeline request the planner cannot follow; the message names the option at fault."""


@dataclass(frozen=True)
class DegreePrice:
    """One pipeline degree, priced. µs per step; bytes per device (the fullest rank)."""

    degree: int
    objective_us: float
    peak_bytes: float | None
    fits: bool | None
    stage_mesh: tuple[int, ...]
    stages: tuple[tuple[int, int], ...] = ()
    bubble_us: float = 0.0
    p2p_us: float = 0.0
    stage_us: tuple[float, ...] = ()
    """per stage: one microbatch's forward + backward"""
    stage_plan_layers: int | None = None
    """repeated layers of the model the stage plan was solved for (None: the model's own)"""
    note: str = ""
    weight_sync: tuple[str, ...] = ()
    """per stage: how it synchronises its weights (:data:`apmodel.core.schedules.WEIGHT_SYNCS`)"""
    gather_step_us: tuple[float, ...] = ()
    """per stage: gathering its parameters once per step (0 unless kept gathered)"""
    reduce_step_us: tuple[float, ...] = ()
    """per stage: reducing its accumulated gradients once per step (0 if reduced per microbatch)"""
    schedule: str = ""
    """the schedule it was priced under (:data:`apmodel.core.schedules.SCHEDULES`; "" for degree 1)"""
    boundary_bytes: tuple[float, ...] = ()
    """per boundary (stage ``k`` to ``k + 1``): bytes each rank sends per microbatch, the activation
    (and back, its gradient), as priced"""
    boundary_placements: tuple[tuple[str, ...] | None, ...] = ()
    """per boundary: the activation's placement on the stage mesh (strings, one per axis; never a
    partial sum) whose local shard each rank sends; None: nothing crosses"""

    def to_json(self) -> dict[str, Any]:
        return {"degree": self.degree, "objective_us": self.objective_us, "peak_bytes": self.peak_bytes,
                "fits": self.fits, "stage_mesh": list(self.stage_mesh), "stages": [list(s) for s in self.stages],
                "bubble_us": self.bubble_us, "p2p_us": self.p2p_us, "stage_us": list(self.stage_us),
                "stage_plan_layers": self.stage_plan_layers, "note": self.note, "weight_sync": list(self.weight_sync),
                "gather_step_us": list(self.gather_step_us), "reduce_step_us": list(self.reduce_step_us),
                "schedule": self.schedule,
                "boundary_bytes": list(self.boundary_bytes),
                "boundary_placements": [None if p is None else list(p) for p in self.boundary_placements]}


@dataclass
class PipelineChoice:
    """The chosen degree, its split and price, and every degree priced (``alternatives``)."""

    axis: int
    mesh: tuple[int, ...]
    schedule: str
    microbatches: int
    chosen: DegreePrice
    alternatives: list[DegreePrice] = field(default_factory=list)
    planning_s: float = 0.0
    """seconds spent planning and pricing every degree"""

    @property
    def degree(self) -> int:
        return self.chosen.degree

    def to_json(self) -> dict[str, Any]:
        """The ``pipeline`` object of ``--json`` and of plan files."""
        c = self.chosen
        return {"axis": self.axis, "mesh": list(self.mesh), "degree": c.degree, "schedule": self.schedule,
                "microbatches": self.microbatches, "stage_mesh": list(c.stage_mesh),
                "stages": [list(s) for s in c.stages], "objective_us": c.objective_us, "bubble_us": c.bubble_us,
                "p2p_us": c.p2p_us, "peak_bytes": c.peak_bytes, "stage_us": list(c.stage_us),
                "weight_sync": list(c.weight_sync), "gather_step_us": list(c.gather_step_us),
                "reduce_step_us": list(c.reduce_step_us), "boundary_bytes": list(c.boundary_bytes),
                "boundary_placements": [None if p is None else list(p) for p in c.boundary_placements],
                "alternatives": [a.to_json() for a in self.alternatives], "planning_s": self.planning_s}

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> "PipelineChoice":
        """Read :meth:`to_json`'s object; a malformed field raises :class:`PipelineError` naming it."""
        def bad(where: str, what: str, got: Any) -> PipelineError:
            return PipelineError(f"{source}: field 'pipeline.{where}' must be {what}, got {str(got)[:80]!r}")

        def integer(value: Any, where: str, low: int = 1) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise bad(where, f"an integer >= {low}", value)
            return value

        def number(value: Any, where: str, optional: bool = False) -> float | None:
            if value is None and optional:
                return None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(where, "a finite number", value)
            return float(value)

        def ints(value: Any, where: str) -> tuple[int, ...]:
            if not isinstance(value, list) or not value:
                raise bad(where, "a non-empty list of integers", value)
            return tuple(integer(x, where) for x in value)

        def degree_price(d: Any, prefix: str) -> DegreePrice:
            def where(key: str) -> str:
                return f"{prefix}.{key}" if prefix else key

            if not isinstance(d, dict):
                raise bad(prefix, "an object", d)
            stages = d.get("stages", [])
            if not isinstance(stages, list) or not all(isinstance(s, list) and len(s) == 2 for s in stages):
                raise bad(where("stages"), "a list of [first_layer, last_layer] pairs", stages)
            for key in ("stage_us", "gather_step_us", "reduce_step_us"):
                if not isinstance(d.get(key, []), list):
                    raise bad(where(key), "a list of µs per stage", d.get(key))
            syncs = d.get("weight_sync", [])  # absent before weight sync was priced: every stage per microbatch
            if not isinstance(syncs, list) or any(x not in schedules.WEIGHT_SYNCS for x in syncs):
                raise bad(where("weight_sync"), f"a list of {', '.join(schedules.WEIGHT_SYNCS)}", syncs)
            priced_under = d.get("schedule", "")  # absent before the schedule was chosen with the degree
            if priced_under not in ("", *schedules.SCHEDULES):
                raise bad(where("schedule"), f"one of {', '.join(schedules.SCHEDULES)}", priced_under)
            placements = d.get("boundary_placements", [])  # absent before the lowering sent shards
            if not isinstance(placements, list) or not all(
                    p is None or (isinstance(p, list) and all(isinstance(x, str) and not x.startswith("P") for x in p))
                    for p in placements):
                raise bad(where("boundary_placements"), "a list of placements (lists of \"R\" / \"S(d)\") or nulls",
                          placements)
            if not isinstance(d.get("boundary_bytes", []), list):
                raise bad(where("boundary_bytes"), "a list of bytes per boundary", d.get("boundary_bytes"))
            fits = d.get("fits")
            if fits is not None and not isinstance(fits, bool):
                raise bad(where("fits"), "true, false or null", fits)
            return DegreePrice(
                degree=integer(d.get("degree"), where("degree")),
                objective_us=number(d.get("objective_us"), where("objective_us")) or 0.0,
                peak_bytes=number(d.get("peak_bytes"), where("peak_bytes"), optional=True),
                fits=fits, stage_mesh=ints(d.get("stage_mesh"), where("stage_mesh")),
                stages=tuple((integer(a, where("stages"), 0), integer(b, where("stages"), 0)) for a, b in stages),
                bubble_us=number(d.get("bubble_us", 0.0), where("bubble_us")) or 0.0,
                p2p_us=number(d.get("p2p_us", 0.0), where("p2p_us")) or 0.0,
                stage_us=tuple(number(x, where("stage_us")) or 0.0 for x in d.get("stage_us", [])),
                stage_plan_layers=None if d.get("stage_plan_layers") is None
                else integer(d.get("stage_plan_layers"), where("stage_plan_layers")),
                note=str(d.get("note", "")), weight_sync=tuple(syncs),
                gather_step_us=tuple(number(x, where("gather_step_us")) or 0.0 for x in d.get("gather_step_us", [])),
                reduce_step_us=tuple(number(x, where("reduce_step_us")) or 0.0 for x in d.get("reduce_step_us", [])),
                schedule=priced_under,
                boundary_bytes=tuple(number(x, where("boundary_bytes")) or 0.0 for x in d.get("boundary_bytes", [])),
                boundary_placements=tuple(None if p is None else tuple(p) for p in placements),
            )

        if not isinstance(data, dict):
            raise bad("", "an object", data)
        schedule = data.get("schedule")
        if schedule not in schedules.SCHEDULES:
            raise bad("schedule", f"one of {', '.join(schedules.SCHEDULES)}", schedule)
        alternatives = data.get("alternatives", [])
        if not isinstance(alternatives, list):
            raise bad("alternatives", "a list", alternatives)
        chosen = degree_price(data, "")
        return cls(axis=integer(data.get("axis"), "axis", 0), mesh=ints(data.get("mesh"), "mesh"), schedule=schedule,
                   microbatches=integer(data.get("microbatches"), "microbatches"), chosen=chosen,
                   alternatives=[degree_price(a, f"alternatives[{i}]") for i, a in enumerate(alternatives)],
                   planning_s=number(data.get("planning_s", 0.0), "planning_s") or 0.0)

"""User constraints, written in Python, applied to a :class:`~apmodel.problem.placement_model.PlacementModel`.

A constraint is any object with ``apply(model)`` (or a plain callable taking the model). The
built-ins select parameters by FQN glob (``"layers.*.attention.wo.weight"``) or graph nodes by name
glob, and fix or forbid placements, or add a linear row over placement indicators::

    apmodel.plan(model, (4, 8), inputs, constraints=[
        apmodel.fix("layers.*.attention.wo.weight", "S(0)S(1)"),
        apmodel.forbid("output.weight", "RR"),
        lambda m: m.fix("layers.0.feed_forward.w2.weight", "S(1)S(0)"),
        apmodel.region_as("routed_experts_*", "data_parallel", "expert_parallel"),
    ])

Every constraint carries a name; a set of constraints that leaves some node without a strategy
raises :class:`~apmodel.problem.placement_model.ConstraintConflict` naming the constraints involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, Union, runtime_checkable

if TYPE_CHECKING:
    from apmodel.problem.placement_model import PlacementModel


@runtime_checkable
class Constraint(Protocol):
    name: str

    def apply(self, model: "PlacementModel") -> None: ...


ConstraintLike = Union[Constraint, Callable[["PlacementModel"], Any]]


@dataclass(frozen=True)
class Fix:
    """Force the selected parameters/nodes to ``placement`` (on their output or input ``J``)."""

    pattern: str
    placement: Any
    on: str = "output"
    name: str = ""

    def apply(self, model: "PlacementModel") -> None:
        model.fix(self.pattern, self.placement, on=self.on, name=self.name or None)


@dataclass(frozen=True)
class Forbid:
    """Exclude ``placement`` for the selected parameters/nodes."""

    pattern: str
    placement: Any
    on: str = "output"
    name: str = ""

    def apply(self, model: "PlacementModel") -> None:
        model.forbid(self.pattern, self.placement, on=self.on, name=self.name or None)


@dataclass(frozen=True)
class RegionAs:
    """Run the ``local_map`` regions named like ``pattern`` as ``per_axis`` (an alternative,
    ``"replicated"`` or None per mesh axis)."""

    pattern: str
    per_axis: tuple[str | None, ...]
    name: str = ""

    def apply(self, model: "PlacementModel") -> None:
        model.run_regions_as(self.pattern, self.per_axis, name=self.name or None)


@dataclass(frozen=True)
class Linear:
    """``Σ coef · [pattern placed as placement]  sense  rhs`` over the placement indicators."""

    name: str
    terms: tuple[tuple[str, Any, float], ...]
    sense: str
    rhs: float

    def apply(self, model: "PlacementModel") -> None:
        model.add_linear(self.name, self.terms, self.sense, self.rhs)


def fix(pattern: str, placement: Any, *, on: str = "output", name: str = "") -> Fix:
    return Fix(pattern, placement, on, name)


def forbid(pattern: str, placement: Any, *, on: str = "output", name: str = "") -> Forbid:
    return Forbid(pattern, placement, on, name)


def region_as(pattern: str, *per_axis: str | None, name: str = "") -> RegionAs:
    """``region_as("routed_experts_*", "expert_parallel", None)``: those regions run expert
    parallel on mesh axis 0, axis 1 left to the solver."""
    return RegionAs(pattern, tuple(per_axis), name)


def linear(name: str, terms: Iterable[tuple[str, Any, float]], sense: str, rhs: float) -> Linear:
    return Linear(name, tuple(terms), sense, float(rhs))


def apply_all(model: "PlacementModel", constraints: Sequence[ConstraintLike]) -> None:
    """Apply constraints in order; a non-constraint gets a TypeError naming its position."""
    for i, c in enumerate(constraints):
        if hasattr(c, "apply"):
            c.apply(model)
        elif callable(c):
            c(model)
        else:
            raise TypeError(f"constraints[{i}] = {c!r} is neither a constraint (with .apply(model)) nor a callable")

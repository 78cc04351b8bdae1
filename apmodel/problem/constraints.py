"""User constraints, written in Python, applied to a :class:`~apmodel.problem.placement_model.PlacementModel`.

A constraint is any object with ``apply(model)`` (or a plain callable taking the model). The
built-ins select parameters by FQN glob (``"layers.*.attention.wo.weight"``) or graph nodes by name
glob, and fix or forbid placements, or add a linear row over placement indicators::

    apmodel.plan(model, (4, 8), inputs, constraints=[
        apmodel.fix("layers.*.attention.wo.weight", "S(0)S(1)"),
        apmodel.forbid("output.weight", "RR"),
        lambda m: m.fix("layers.0.feed_forward.w2.weight", "S(1)S(0)"),
        apmodel.region_as("routed_experts_*", "data_parallel", "expert_parallel"),
        apmodel.fix_output("layers.*.attention.wo", "S0,S1"),  # a module's output, paper notation
    ])

Every constraint carries a name; a set of constraints that leaves some node without a strategy
raises :class:`~apmodel.problem.placement_model.ConstraintConflict` naming the constraints involved.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, Union, runtime_checkable

from apmodel.core import placements as pl

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


def _placed(model: "PlacementModel", want: tuple[str, ...], s: Any) -> bool:
    return model.output_strs(s) == want


def _matches_module(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def module_output_nodes(model: "PlacementModel", pattern: str) -> dict[str, str]:
    """Module path -> the forward node that computes its output (the last forward op run inside
    it), for every module whose path matches ``pattern`` (a glob over module paths such as
    ``"layers.*.attention.wo"``, or over their tails: ``"wo"``, ``"feed_forward.w*"``)."""
    is_backward = model.captured.is_backward
    last: dict[str, str] = {}
    for node in model.nodes:
        if node.op != "call_function" or is_backward.get(node.name, False) or node.name not in model.strategies:
            continue
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if _matches_module(str(path), pattern):
                last[str(path)] = node.name
    if not last:
        raise KeyError(f"output constraint: pattern {pattern!r} matches no module of the graph "
                       f"(module paths look like 'layers.0.attention.wo')")
    return last


@dataclass(frozen=True)
class FixOutput:
    """Force the output of every module matching ``pattern`` (see :func:`module_output_nodes`)
    to ``placement`` on its N-D activation, in apmodel's notation (``"S(0)S(1)"``) or the
    paper's (``"S0,S1"``, ``"P,S2"``, ``"R"`` for all axes)."""

    pattern: str
    placement: str
    name: str = ""

    def apply(self, model: "PlacementModel") -> None:
        label = self.name or f"output({self.pattern!r}, {self.placement!r})"
        want = pl.parse_notation(self.placement, len(model.mesh_shape))
        for path, node in module_output_nodes(model, self.pattern).items():
            val = model.node_by_name[node].meta.get("val")
            ndim = getattr(val, "ndim", 0)
            dims = [int(p[2:-1]) for p in want if p.startswith("S(")]
            if any(d >= ndim for d in dims):
                raise ValueError(f"{label}: the output of module {path!r} (node {node!r}) has {ndim} dims; "
                                 f"placement {self.placement!r} shards dim {max(dims)}")
            model.restrict(node, functools.partial(_placed, model, want), f"{label} on {path}")


def fix_output(pattern: str, placement: str, *, name: str = "") -> FixOutput:
    """``fix_output("wo", "S0,S1")``: the output of every module named like ``wo`` placed
    ``(S(0), S(1))`` (batch on mesh axis 0, sequence on axis 1)."""
    return FixOutput(pattern, placement, name)


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

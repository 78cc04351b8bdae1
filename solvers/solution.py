"""Results and errors shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATUSES = ("optimal", "feasible", "time_limit")


class Infeasible(Exception):
    """No assignment has finite energy and satisfies every constraint.

    ``variables`` and ``constraints`` name what is involved.  ``proven`` is False when an
    approximate backend merely failed to find a feasible assignment.
    """

    def __init__(self, message: str, variables: tuple[str, ...] = (), constraints: tuple[str, ...] = (),
                 proven: bool = True) -> None:
        super().__init__(message)
        self.variables = tuple(variables)
        self.constraints = tuple(constraints)
        self.proven = proven


class SolverError(RuntimeError):
    """A backend failed or returned something unusable (not an infeasibility proof)."""


class TimeLimitReached(SolverError):
    """The time limit ran out before the backend found any feasible assignment."""


class Unsupported(ValueError):
    """The backend cannot honour part of the problem (e.g. side constraints)."""


@dataclass
class BackendResult:
    """What a backend hands back to :func:`solvers.solve` (energy is recomputed there)."""

    assignment: np.ndarray
    lower_bound: float | None = None
    status: str = "feasible"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Solution:
    """A solved problem.

    ``energy`` is recomputed exactly from the problem; ``lower_bound`` is a proven bound on the
    optimum when the backend has one; ``gap`` is ``(energy - lower_bound) / max(|energy|, 1e-12)``
    (None without a bound); ``seconds`` is wall time including presolve.
    """

    assignment: np.ndarray
    energy: float
    lower_bound: float | None
    status: str
    seconds: float
    backend: str
    gap: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

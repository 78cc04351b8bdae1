"""Backend lookup and the :func:`solve` entry point.

A backend is a callable ``backend(problem, time_limit=None, **options)`` returning a
:class:`~solvers.solution.BackendResult` (or a :class:`~solvers.solution.Solution`, or just an
assignment array), or an object with such a ``solve`` method, or a class whose no-argument
instance has one.  Every backend has a :class:`~solvers.backends.Capabilities` record (data, see
:mod:`solvers.backends`): built-in backends are declared in :data:`~solvers.backends.BUILTIN_BACKENDS`
and imported lazily; user backends live in a :class:`SolverRegistry` object with the record given
to :meth:`SolverRegistry.register` (or a ``capabilities`` attribute of the backend; without either,
:data:`~solvers.backends.UNDECLARED`).  :func:`solve` refuses a problem whose linear rows the backend
cannot take before it runs anything.  The default registry is created on first use by
:func:`default_registry` (no module-level mutable state).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .backends import BUILTIN_BACKENDS, UNDECLARED, Capabilities
from .presolve import presolve
from .problem import PairwiseProblem
from .reduce import Reduction, reduce_problem
from .solution import STATUSES, BackendResult, Solution, SolverError, Unsupported

log = logging.getLogger(__name__)

Backend = Callable[..., Any]


def _as_callable(name: str, backend: Any) -> Backend:
    if isinstance(backend, type):
        backend = backend()
    if hasattr(backend, "solve") and callable(backend.solve):
        return backend.solve
    if callable(backend):
        return backend
    raise TypeError(f"backend {name!r} must be callable or have a solve() method, got {type(backend).__name__}")


def _installed(module: str | None) -> bool:
    return module is None or importlib.util.find_spec(module) is not None


class SolverRegistry:
    """Built-in backends plus user-registered ones (registered names shadow built-ins)."""

    def __init__(self) -> None:
        self._user: dict[str, tuple[Backend, Capabilities]] = {}

    def register(self, name: str, backend: Any, capabilities: Capabilities | None = None) -> None:
        """Add ``backend`` under ``name``.  ``capabilities``: what it can do (default: the backend's
        ``capabilities`` attribute if it is a :class:`Capabilities`, else ``UNDECLARED``)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty str, got {name!r}")
        if capabilities is None:
            declared = getattr(backend, "capabilities", None)
            capabilities = declared if isinstance(declared, Capabilities) else UNDECLARED
        if not isinstance(capabilities, Capabilities):
            raise TypeError(f"capabilities of backend {name!r} must be a solvers.Capabilities, "
                            f"got {type(capabilities).__name__}")
        self._user[name] = (_as_callable(name, backend), capabilities)

    def unregister(self, name: str) -> None:
        if name not in self._user:
            raise KeyError(f"no user backend named {name!r}")
        del self._user[name]

    def available(self) -> list[str]:
        """Built-in backends whose dependency is installed, then user backends."""
        names = [n for n, spec in BUILTIN_BACKENDS.items() if _installed(spec.capabilities.requires)]
        return names + [n for n in self._user if n not in names]

    def capabilities(self, name: str) -> Capabilities:
        """The capability record of backend ``name`` (installed or not, for built-ins)."""
        if name in self._user:
            return self._user[name][1]
        if name not in BUILTIN_BACKENDS:
            raise ValueError(f"unknown solver backend {name!r}; available: {', '.join(self.available())}")
        return BUILTIN_BACKENDS[name].capabilities

    def all_capabilities(self) -> dict[str, Capabilities]:
        """Every available backend's record, in :meth:`available` order."""
        return {n: self.capabilities(n) for n in self.available()}

    def get(self, name: str) -> Backend:
        if name in self._user:
            return self._user[name][0]
        if name not in BUILTIN_BACKENDS:
            raise ValueError(f"unknown solver backend {name!r}; available: {', '.join(self.available())}")
        spec = BUILTIN_BACKENDS[name]
        dep = spec.capabilities.requires
        if not _installed(dep):
            raise ValueError(f"solver backend {name!r} needs the {dep!r} package, which is not installed")
        return getattr(importlib.import_module(spec.module), spec.function)


@functools.lru_cache(maxsize=None)
def default_registry() -> SolverRegistry:
    """The process-wide registry used by :func:`solve`, :func:`available` and :func:`register`."""
    return SolverRegistry()


def register(name: str, backend: Any, capabilities: Capabilities | None = None) -> None:
    """Register a user backend in the default registry (see :meth:`SolverRegistry.register`)."""
    default_registry().register(name, backend, capabilities)


def available() -> list[str]:
    """Names of installed built-in backends plus registered ones."""
    return default_registry().available()


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` can do (its :class:`~solvers.backends.Capabilities` record)."""
    return default_registry().capabilities(name)


def all_capabilities() -> dict[str, Capabilities]:
    """Records of every available backend of the default registry, by name."""
    return default_registry().all_capabilities()


def _rows_for_backend(problem: PairwiseProblem, run_presolve: bool) -> list[tuple[str, str]]:
    """(name, sense) of the rows the backend will see: with the presolve, rows over one variable
    (or none) become domain restrictions and only rows over several variables remain."""
    out = []
    for c in problem.constraints:
        if not run_presolve or len({t[0] for t in c.terms}) > 1:
            out.append((c.name, c.sense))
    return out


def check_capabilities(problem: PairwiseProblem, backend: str, *, registry: SolverRegistry | None = None,
                       run_presolve: bool = True, time_limit: float | None = None) -> Capabilities:
    """Raise :class:`~solvers.Unsupported` when ``backend`` cannot take ``problem``'s linear rows
    (naming the backend, the rows and the backends that could); return its record otherwise.
    A time limit the backend does not honour is logged, not refused."""
    reg = registry or default_registry()
    caps = reg.capabilities(backend)
    rows = _rows_for_backend(problem, run_presolve)
    if rows:
        others = [n for n, c in reg.all_capabilities().items() if n != backend and c.refusal(n, rows) is None]
        why = caps.refusal(backend, rows, others)
        if why is not None:
            raise Unsupported(why)
    if time_limit is not None and not caps.time_limit:
        log.warning("solver backend %r does not honour time_limit=%ss; it runs to completion", backend, time_limit)
    return caps


def _relative_gap(energy: float, bound: float | None) -> float | None:
    if bound is None:
        return None
    return max(0.0, (energy - bound) / max(abs(energy), 1e-12))


# options that refer to the original problem's variables / indicators: mapped, or reduction skipped
_UNMAPPABLE_OPTIONS = ("extra_constraints",)


def _map_options(red: Reduction, options: dict[str, Any]) -> dict[str, Any]:
    """Translate options that name original variables (``order``, ``warm_start``) to the reduced problem."""
    out = dict(options)
    if out.get("order") is not None:
        rank = np.empty(red.original.n_vars, dtype=np.int64)
        rank[np.asarray(out["order"], dtype=np.int64)] = np.arange(red.original.n_vars)
        out["order"] = np.argsort(rank[red.kept], kind="stable")
    if out.get("warm_start") is not None:
        out["warm_start"] = red.restrict(red.original.check_assignment(out["warm_start"]))
    return out


def solve(problem: PairwiseProblem, backend: str = "trws", time_limit: float | None = None, *,
          registry: SolverRegistry | None = None, run_presolve: bool = True, reduce: bool = True,
          **options: Any) -> Solution:
    """Solve ``problem`` with the named backend.

    ``time_limit`` is in seconds (None: no limit).  ``options`` go to the backend.  ``reduce``: run
    the exact reductions of :mod:`solvers.reduce` (after the presolve) and give the backend the
    reduced problem; the returned solution always refers to ``problem``.  Raises
    :class:`~solvers.Infeasible` when no assignment is feasible, :class:`~solvers.SolverError`
    when the backend returns an unusable assignment.
    """
    if not isinstance(problem, PairwiseProblem):
        raise TypeError(f"problem must be a solvers.PairwiseProblem, got {type(problem).__name__}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive seconds or None, got {time_limit!r}")
    check_capabilities(problem, backend, registry=registry, run_presolve=run_presolve, time_limit=time_limit)
    fn = (registry or default_registry()).get(backend)
    return solve_with(problem, fn, backend, time_limit, run_presolve=run_presolve, reduce=reduce, **options)


def solve_with(problem: PairwiseProblem, fn: Backend, backend: str, time_limit: float | None = None, *,
               run_presolve: bool = True, reduce: bool = True, **options: Any) -> Solution:
    """:func:`solve` with the backend function itself (``backend`` names it in messages): presolve,
    reductions, the call, and the checks of what it returned. Compositions use it to run a leaf
    backend without looking a name up in a registry a user may have changed."""
    t0 = time.perf_counter()
    if problem.n_vars == 0:
        return Solution(np.zeros(0, dtype=np.int64), 0.0, 0.0, "optimal", time.perf_counter() - t0, backend, 0.0)
    work = presolve(problem).problem if run_presolve else problem
    red = None
    if reduce and not any(options.get(k) is not None for k in _UNMAPPABLE_OPTIONS):
        red = reduce_problem(work)
        options = _map_options(red, options)
        work = red.problem
    if work.n_vars == 0:  # the reductions solved it
        raw = BackendResult(np.zeros(0, dtype=np.int64), 0.0, "optimal", {})
    else:
        if time_limit is not None:
            time_limit = max(1e-3, time_limit - (time.perf_counter() - t0))
        raw = fn(work, time_limit=time_limit, **options)
    if isinstance(raw, Solution):
        raw = BackendResult(raw.assignment, raw.lower_bound, raw.status, dict(raw.info))
    elif not isinstance(raw, BackendResult):
        raw = BackendResult(np.asarray(raw))
    if red is not None:
        try:
            xr = work.check_assignment(raw.assignment)
        except ValueError as err:
            raise SolverError(f"backend {backend!r} returned an invalid assignment: {err}") from err
        bound = None if raw.lower_bound is None else float(raw.lower_bound) + red.offset
        info = dict(raw.info, reduce=dict(red.stats))
        raw = BackendResult(red.expand(xr), bound, raw.status, info)
    seconds = time.perf_counter() - t0
    try:
        x = problem.check_assignment(raw.assignment)
    except ValueError as err:
        raise SolverError(f"backend {backend!r} returned an invalid assignment: {err}") from err
    energy = problem.energy(x)
    if not np.isfinite(energy):
        raise SolverError(f"backend {backend!r} returned an assignment with infinite energy (a forbidden state or pair)")
    violated = problem.violated_constraints(x)
    if violated:
        raise SolverError(f"backend {backend!r} returned an assignment violating constraint(s) {violated}")
    status = raw.status
    if status not in STATUSES:
        raise SolverError(f"backend {backend!r} returned unknown status {status!r}")
    bound = None if raw.lower_bound is None else float(raw.lower_bound)
    if bound is not None and bound > energy:  # rounding in the backend; a bound never exceeds a feasible energy
        bound = energy if bound - energy <= 1e-6 * max(1.0, abs(energy)) else None
    gap = _relative_gap(energy, bound)
    if status == "feasible" and gap is not None and gap <= 1e-9:
        status = "optimal"
    log.info("solve: backend=%s vars=%d edges=%d energy=%.6g bound=%s status=%s %.3fs", backend,
             problem.n_vars, problem.n_edges, energy, bound, status, seconds)
    return Solution(x, energy, bound, status, seconds, backend, gap, raw.info)

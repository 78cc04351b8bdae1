"""What each solver backend can do, as data: one :class:`Capabilities` record per backend.

This module imports nothing beyond the standard library, so help texts (the CLI's ``--solver``)
can list the backends without loading numpy or scipy.  :func:`solvers.solve` reads the record of
the backend it is asked for and refuses a problem the backend cannot take before any work is done
(see :meth:`Capabilities.refusal`).

The built-in records describe what each adapter does today:

========  =====  ===========  ===============================  ==========  ==============
backend   exact  lower bound  multi-variable linear rows       time limit  needs
========  =====  ===========  ===============================  ==========  ==============
trws      no     yes          one ``<=`` / ``>=`` row (budget)  yes         --
highs     yes    yes          any number, any sense            yes         ``highspy``
cvxpy     yes    no           any number, any sense            yes [1]_    ``cvxpy``
pgmpy     no     no           none                             yes [2]_    ``pgmpy``
brute     yes    yes          any number, any sense            no          --
========  =====  ===========  ===============================  ==========  ==============

.. [1] passed to cvxpy's default MILP solver (HiGHS); other cvxpy solvers get it only through
   their own ``solver_options``.
.. [2] checked between MPLP sweeps, so a run can overshoot by one sweep (see
   :mod:`solvers.pgmpy_backend`).

Rows over a single variable (fixing or forbidding states) never reach a backend: the presolve
turns them into domain restrictions, so every backend takes them when the presolve runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

#: Senses of a :class:`~solvers.LinearConstraint` row.
ALL_SENSES: frozenset[str] = frozenset({"<=", ">=", "=="})
INEQUALITY_SENSES: frozenset[str] = frozenset({"<=", ">="})


@dataclass(frozen=True)
class Capabilities:
    """What one backend can do.

    ``exact``: a result with status ``"optimal"`` is proven optimal and the backend searches until
    it is (or the time limit ends).  ``lower_bound``: it returns a proven lower bound on the
    optimum.  ``row_senses``: the senses of linear rows over several variables it accepts (empty:
    none; ``{"<=", ">="}``: inequality rows such as a memory or parameter budget; all three: also
    equality rows).  ``max_rows``: how many such rows at most (None: any number).  ``time_limit``:
    it stops at ``time_limit`` seconds.  ``requires``: the third-party module it imports (None:
    numpy and scipy only).
    """

    exact: bool
    lower_bound: bool
    row_senses: frozenset[str] = ALL_SENSES
    max_rows: int | None = None
    time_limit: bool = True
    requires: str | None = None

    def __post_init__(self) -> None:
        senses = frozenset(self.row_senses)
        if not senses <= ALL_SENSES:
            raise ValueError(f"row_senses must be a subset of {sorted(ALL_SENSES)}, got {sorted(senses)}")
        object.__setattr__(self, "row_senses", senses)
        if self.max_rows is not None and self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 or None, got {self.max_rows}")
        if not senses and self.max_rows is None:
            object.__setattr__(self, "max_rows", 0)

    @property
    def linear_rows(self) -> str:
        """``"none"``, ``"inequality"`` or ``"equality and inequality"`` (rows over several variables)."""
        if not self.row_senses or self.max_rows == 0:
            return "none"
        if "==" in self.row_senses:
            return "equality and inequality" if self.row_senses & INEQUALITY_SENSES else "equality"
        return "inequality"

    def summary(self) -> str:
        """One line: ``exact, lower bound, rows: any, time limit, needs highspy``."""
        parts = ["exact" if self.exact else "approximate"]
        if self.lower_bound:
            parts.append("lower bound")
        rows = self.linear_rows
        if rows != "none" and self.max_rows is not None:
            rows = f"{_count(self.max_rows)} {rows} row" + ("s" if self.max_rows != 1 else "")
        elif rows != "none":
            rows = f"{rows} rows"
        parts.append("no linear rows" if rows == "none" else rows)
        if not self.time_limit:
            parts.append("no time limit")
        if self.requires:
            parts.append(f"needs {self.requires}")
        return ", ".join(parts)

    def refusal(self, name: str, rows: Iterable[tuple[str, str]], others: Iterable[str] = ()) -> str | None:
        """Why backend ``name`` cannot take a problem whose multi-variable rows are ``rows``
        (``(row name, sense)`` pairs), or None when it can.  ``others`` names backends that could."""
        rows = list(rows)
        if not rows:
            return None
        hint = ", ".join(others)
        hint = f"; backends that accept them: {hint}" if hint else ""
        if self.linear_rows == "none":
            return (f"solver backend {name!r} does not support linear side constraints over several variables; "
                    f"the problem has {len(rows)} ({_names(rows)}){hint}")
        bad = [r for r in rows if r[1] not in self.row_senses]
        if bad:
            kinds = "equality" if all(s == "==" for _, s in bad) else "these"
            return (f"solver backend {name!r} cannot take {kinds} rows over several variables ({_names(bad)}, "
                    f"sense {', '.join(sorted({s for _, s in bad}))}); it accepts {self.linear_rows} rows only{hint}")
        if self.max_rows is not None and len(rows) > self.max_rows:
            return (f"solver backend {name!r} takes at most {_count(self.max_rows)} linear row"
                    f"{'s' if self.max_rows != 1 else ''} over several variables (a budget); the problem has "
                    f"{len(rows)} ({_names(rows)}){hint}")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"exact": self.exact, "lower_bound": self.lower_bound, "linear_rows": self.linear_rows,
                "row_senses": sorted(self.row_senses), "max_rows": self.max_rows, "time_limit": self.time_limit,
                "requires": self.requires}


def _count(n: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(n, str(n))


def _names(rows: list[tuple[str, str]], limit: int = 4) -> str:
    names = [repr(r[0]) for r in rows[:limit]]
    return ", ".join(names) + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


#: Record of a backend registered without one: nothing is refused up front (the backend may still
#: raise :class:`~solvers.Unsupported`), nothing is promised.
UNDECLARED = Capabilities(exact=False, lower_bound=False, row_senses=ALL_SENSES, max_rows=None, time_limit=False)


@dataclass(frozen=True)
class BackendSpec:
    """A built-in backend: where its adapter function lives, what it can do, and what runs (a
    composition of leaf backends says so: see :mod:`solvers.compositions`)."""

    name: str
    module: str
    function: str
    capabilities: Capabilities
    title: str
    runs: str = ""


#: The built-in backends, imported lazily by the registry.  See the module docstring's table.
BUILTIN_BACKENDS: Mapping[str, BackendSpec] = MappingProxyType({s.name: s for s in (
    BackendSpec("trws", "solvers.compositions", "trws", Capabilities(
        exact=False, lower_bound=True, row_senses=INEQUALITY_SENSES, max_rows=1), "TRW-S message passing + local search",
        runs="trws, then polish by highs when the certified gap is above 0.1%; highs alone when trws finds no "
             "assignment within a side constraint"),
    BackendSpec("highs", "solvers.compositions", "highs", Capabilities(
        exact=True, lower_bound=True, requires="highspy"), "MILP through HiGHS",
        runs="highs, warm-started by trws under a time limit"),
    BackendSpec("cvxpy", "solvers.cvxpy_backend", "solve_cvxpy", Capabilities(
        exact=True, lower_bound=False, requires="cvxpy"), "MILP through cvxpy"),
    BackendSpec("pgmpy", "solvers.pgmpy_backend", "solve_pgmpy", Capabilities(
        exact=False, lower_bound=False, row_senses=frozenset(), requires="pgmpy"), "MPLP through pgmpy"),
    BackendSpec("brute", "solvers.brute", "solve_brute", Capabilities(
        exact=True, lower_bound=True, time_limit=False), "exhaustive search, tiny problems"),
)})


def help_text(names: Iterable[str] | None = None) -> str:
    """``trws (approximate, lower bound, ...); highs (exact, ...); ...``: one clause per backend."""
    specs = [BUILTIN_BACKENDS[n] for n in (names if names is not None else BUILTIN_BACKENDS)]
    return "; ".join(f"{s.name} ({s.capabilities.summary()}{'; runs ' + s.runs if s.runs else ''})" for s in specs)

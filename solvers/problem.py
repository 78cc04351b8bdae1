"""The pairwise discrete optimisation problem that every backend solves.

Minimise   sum_v unary[v][x_v] + sum_(u,v) cost_uv[x_u, x_v]
subject to optional linear rows over the indicators x[var, state] (1 when var takes state).

``+inf`` marks a forbidden state (unary) or a forbidden pair of states (edge matrix).

Edges are stored canonically with ``u < v`` (a matrix given for ``(v, u)`` is transposed) and
grouped by matrix shape ``(n_u, n_v)`` into stacked arrays (:class:`EdgeGroup`) so that backends
can work on many edges per numpy call (edges given already stacked, :class:`EdgeStack`, or
factored into their distinct rows and columns, :class:`FactoredStack`, keep their own group: a
shape may then have more than one).  Duplicate edges (the same unordered pair given
more than once) are **merged by summing** their matrices; self-loops are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

SENSES = ("<=", ">=", "==")


@dataclass(frozen=True)
class LinearConstraint:
    """One linear row ``sum coef * x[var, state]  (<=|>=|==)  rhs`` over the indicators.

    ``terms`` is a sequence of ``(var, state, coef)`` or a mapping ``{(var, state): coef}``;
    repeated ``(var, state)`` pairs are summed.  ``var`` is an index (or a name when the problem
    has names).
    """

    name: str
    terms: Sequence[tuple] | Mapping[tuple, float]
    sense: str
    rhs: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"LinearConstraint name must be a str, got {type(self.name).__name__}")
        if self.sense not in SENSES:
            raise ValueError(f"constraint {self.name!r}: sense must be one of {SENSES}, got {self.sense!r}")
        rhs = float(self.rhs)
        if not math.isfinite(rhs):
            raise ValueError(f"constraint {self.name!r}: rhs must be finite, got {self.rhs!r}")
        object.__setattr__(self, "rhs", rhs)
        if isinstance(self.terms, Mapping):
            terms = tuple((k[0], k[1], v) for k, v in self.terms.items())
        else:
            terms = tuple(tuple(t) for t in self.terms)
        for t in terms:
            if len(t) != 3:
                raise ValueError(f"constraint {self.name!r}: each term must be (var, state, coef), got {t!r}")
        object.__setattr__(self, "terms", terms)


@dataclass(frozen=True)
class GroupFactors:
    """A factored group's matrices (:class:`FactoredStack`, checked): edge ``k``'s is
    ``blocks[block_of[k]][np.ix_(row_class[k], col_class[k])]``."""

    row_class: np.ndarray  # (k, a)
    col_class: np.ndarray  # (k, b)
    blocks: np.ndarray  # (n, ca, cb)
    block_of: np.ndarray  # (k,)


class EdgeGroup:
    """Edges whose cost matrices have the same shape ``(a, b)``, stacked.

    ``u[k] < v[k]`` are the endpoints of edge ``k`` and ``costs[k]`` its ``(a, b)`` matrix
    (+inf = forbidden pair).  ``edge_ids[k]`` is the edge's position in ``problem.edges``.

    A group given factored (:class:`FactoredStack`) holds ``factors`` (:class:`GroupFactors`);
    ``costs`` is then spread out on first use and kept. Backends that read the factors (the
    presolve, the reductions, TRW-S, the energy) never spread it.
    """

    __slots__ = ("shape", "u", "v", "edge_ids", "factors", "_costs")

    def __init__(self, shape: tuple[int, int], u: np.ndarray, v: np.ndarray, costs: np.ndarray | None,
                 edge_ids: np.ndarray, factors: GroupFactors | None = None) -> None:
        if (costs is None) == (factors is None):
            raise ValueError("an edge group has either its costs or their factors")
        self.shape, self.u, self.v, self.edge_ids = shape, u, v, edge_ids
        self.factors = factors
        self._costs = costs

    def __len__(self) -> int:
        return len(self.u)

    @property
    def factored(self) -> bool:
        return self.factors is not None

    @property
    def costs(self) -> np.ndarray:
        """The ``(k, a, b)`` matrices (read-only; spread from the factors on first use)."""
        if self._costs is None:
            self._costs = _readonly(self.dense())
        return self._costs

    def dense(self, cap: float | None = None) -> np.ndarray:
        """A new ``(k, a, b)`` array of the matrices, entries above ``cap`` (when given) set to it."""
        f = self.factors
        if f is None or self._costs is not None:
            return self.costs.copy() if cap is None else np.minimum(self.costs, cap)
        blocks = f.blocks if cap is None else np.minimum(f.blocks, cap)
        return blocks[f.block_of[:, None, None], f.row_class[:, :, None], f.col_class[:, None, :]]

    def matrix(self, k: int) -> np.ndarray:
        """Edge ``k``'s ``(a, b)`` matrix (a view of ``costs`` or, factored, a new array)."""
        f = self.factors
        if f is None or self._costs is not None:
            return self.costs[k]
        return f.blocks[f.block_of[k]][np.ix_(f.row_class[k], f.col_class[k])]

    def at(self, xu: np.ndarray, xv: np.ndarray) -> np.ndarray:
        """Every edge's cost at states ``xu[k]`` of ``u[k]`` and ``xv[k]`` of ``v[k]``."""
        ks = np.arange(len(self))
        f = self.factors
        if f is None or self._costs is not None:
            return self.costs[ks, xu, xv]
        return f.blocks[f.block_of, f.row_class[ks, xu], f.col_class[ks, xv]]


@dataclass(frozen=True)
class EdgeStack:
    """Edges of one matrix shape given already stacked: edge ``k`` joins ``u[k] < v[k]`` with the
    ``(a, b)`` matrix ``costs[k]`` of ``costs`` ``(k, a, b)``.

    For problems whose matrices run to gigabytes: a C-contiguous float64 ``costs`` becomes the
    problem's own array (made read-only, not copied), where a list of ``(u, v, matrix)`` edges is
    copied into one stack. Its pairs must differ from every other edge given (duplicates are an
    error here, not summed).
    """

    u: Sequence[int] | np.ndarray
    v: Sequence[int] | np.ndarray
    costs: np.ndarray


@dataclass(frozen=True)
class FactoredStack:
    """Edges of one matrix shape whose matrices repeat rows and columns, given by their distinct
    values: edge ``k`` joins ``u[k] < v[k]`` with the matrix ``blocks[block_of[k]][np.ix_(row_class[k],
    col_class[k])]`` (``row_class`` (k, a) and ``col_class`` (k, b) integers indexing ``blocks``
    (n, ca, cb); ``block_of`` (k,), default ``0..k-1``, lets edges share blocks, as the reductions
    hand on the rows of a placement problem's blocks they keep; entries no class points to are not
    read but must not be NaN or -inf).

    A placement problem's matrices are sums of redistribution prices that depend on a few
    distinct placements: stored so, LLaMA-3 8B's 242 M pairs on a 4-D mesh take 126 M entries (43 M
    with the pairs whose sums are equal sharing a block), and the backends that read the factors
    never build the dense matrices. Kept without copying
    (like :class:`EdgeStack`); pairs must differ from every other edge given.
    """

    u: Sequence[int] | np.ndarray
    v: Sequence[int] | np.ndarray
    row_class: np.ndarray
    col_class: np.ndarray
    blocks: np.ndarray
    block_of: Sequence[int] | np.ndarray | None = None


@dataclass(frozen=True)
class _ConstraintRows:
    matrix: sp.csr_matrix  # (m, n_indicators)
    lower: np.ndarray
    upper: np.ndarray


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


class PairwiseProblem:
    """A pairwise problem over ``n_vars`` discrete variables; see the module docstring.

    Attributes: ``n_vars``; ``n_states`` (int array); ``offsets`` (int array, length n_vars+1; the
    flat indicator index of ``(v, s)`` is ``offsets[v] + s``); ``unary`` (tuple of float arrays);
    ``unary_flat``; ``groups`` (tuple of :class:`EdgeGroup`); ``constraints`` (tuple of
    :class:`LinearConstraint`, terms resolved to integer indices); ``names``.
    """

    def __init__(
        self,
        unary: Sequence[Sequence[float] | np.ndarray],
        edges: Iterable[tuple | EdgeStack | FactoredStack] = (),
        constraints: Iterable[LinearConstraint] = (),
        names: Sequence[str] | None = None,
    ) -> None:
        unary_arrays = []
        for i, u in enumerate(unary):
            arr = np.array(u, dtype=np.float64).reshape(-1) if np.ndim(u) <= 1 else None
            if arr is None:
                raise ValueError(f"unary cost of variable {i} must be 1-D, got shape {np.shape(u)}")
            if arr.size == 0:
                raise ValueError(f"variable {i} has no states (empty unary cost vector)")
            unary_arrays.append(arr)
        n_vars = len(unary_arrays)
        if names is not None:
            names = tuple(str(n) for n in names)
            if len(names) != n_vars:
                raise ValueError(f"names has {len(names)} entries but there are {n_vars} variables")
        self.names: tuple[str, ...] | None = names
        self.n_vars = n_vars
        self.n_states = _readonly(np.array([a.size for a in unary_arrays], dtype=np.int64))
        self.offsets = _readonly(np.concatenate([[0], np.cumsum(self.n_states)]).astype(np.int64))
        for i, a in enumerate(unary_arrays):
            if np.isnan(a).any():
                raise ValueError(f"unary cost of variable {self.var_name(i)} contains NaN")
            if np.isneginf(a).any():
                raise ValueError(f"unary cost of variable {self.var_name(i)} contains -inf")
        self.unary_flat = _readonly(
            np.concatenate(unary_arrays) if unary_arrays else np.zeros(0, dtype=np.float64)
        )
        self.unary = tuple(
            self.unary_flat[self.offsets[i] : self.offsets[i + 1]] for i in range(n_vars)
        )
        self._name_index = {n: i for i, n in enumerate(names)} if names else {}
        self.groups = self._build_groups(edges)
        self.constraints, self._rows = self._build_constraints(constraints)

    # ------------------------------------------------------------------ construction helpers
    def _resolve_var(self, var, what: str) -> int:
        if isinstance(var, str):
            if var not in self._name_index:
                raise ValueError(f"{what}: unknown variable {var!r}")
            return self._name_index[var]
        if isinstance(var, (bool, np.bool_)) or not isinstance(var, (int, np.integer)):
            raise TypeError(f"{what}: variable must be an int index or a name, got {var!r}")
        var = int(var)
        if not 0 <= var < self.n_vars:
            raise ValueError(f"{what}: unknown variable {var} (there are {self.n_vars} variables)")
        return var

    def _build_groups(self, edges: Iterable[tuple | EdgeStack | FactoredStack]) -> tuple[EdgeGroup, ...]:
        merged: dict[tuple[int, int], np.ndarray] = {}
        stacks: list[EdgeStack] = []
        factored: list[FactoredStack] = []
        for e in edges:
            if isinstance(e, EdgeStack):
                stacks.append(e)
                continue
            if isinstance(e, FactoredStack):
                factored.append(e)
                continue
            if len(e) != 3:
                raise ValueError(f"edge must be (u, v, matrix), got a tuple of length {len(e)}")
            u_in, v_in, mat = e
            u = self._resolve_var(u_in, f"edge ({u_in!r}, {v_in!r})")
            v = self._resolve_var(v_in, f"edge ({u_in!r}, {v_in!r})")
            label = f"edge ({self.var_name(u)}, {self.var_name(v)})"
            if u == v:
                raise ValueError(f"{label} is a self-loop; put its diagonal into the unary cost instead")
            m = np.asarray(mat, dtype=np.float64)
            want = (int(self.n_states[u]), int(self.n_states[v]))
            if m.shape != want:
                raise ValueError(f"{label}: cost matrix has shape {m.shape}, expected {want}")
            if u > v:
                u, v, m = v, u, m.T
            key = (u, v)
            if key in merged:
                merged[key] = merged[key] + m  # duplicate edges are merged by summing
            else:
                merged[key] = m
        by_shape: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
        for (u, v), m in merged.items():
            by_shape.setdefault(m.shape, []).append((u, v, m))
        stacked = [(np.array([it[0] for it in items], dtype=np.int64), np.array([it[1] for it in items], dtype=np.int64),
                    np.stack([it[2] for it in items]), None) for _, items in sorted(by_shape.items(), key=lambda kv: kv[0])]
        seen = set(merged)
        for st in stacks:
            stacked.append((*self._check_stack(st, seen), None))
        for fs in factored:
            stacked.append(self._check_factored(fs, seen))
        groups = []
        next_id = 0
        # stable: given order within a shape
        for us, vs, costs, factors in sorted(stacked, key=lambda t: (t[2].shape[1:] if t[3] is None else t[3][0])):
            if factors is None:
                low = costs.min(axis=(1, 2), initial=np.inf)  # NaN where any entry is NaN, -inf where any is -inf
            else:  # the blocks the edges use (a reduced problem's stacks share their original's blocks)
                used, which = np.unique(factors[3], return_inverse=True)
                low = np.array([costs[i].min(initial=np.inf) for i in used.tolist()])[which.reshape(-1)]
            bad = np.isnan(low) | np.isneginf(low)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"edge ({self.var_name(us[k])}, {self.var_name(vs[k])}): cost matrix contains NaN or -inf"
                )
            ids = np.arange(next_id, next_id + len(us), dtype=np.int64)
            next_id += len(us)
            if factors is None:
                groups.append(EdgeGroup(costs.shape[1:], _readonly(us), _readonly(vs), _readonly(costs), _readonly(ids)))
            else:
                shape, rows, cols, block_of = factors
                groups.append(EdgeGroup(shape, _readonly(us), _readonly(vs), None, _readonly(ids), GroupFactors(
                    _readonly(rows), _readonly(cols), _readonly(costs), _readonly(block_of))))
        return tuple(groups)

    def _check_factored(self, fs: FactoredStack, seen: set[tuple[int, int]]) -> tuple:
        """A :class:`FactoredStack` resolved and checked: ``(u, v, blocks, (shape, row_class, col_class, block_of))``."""
        blocks = np.ascontiguousarray(fs.blocks, dtype=np.float64)
        rows = np.ascontiguousarray(fs.row_class, dtype=np.int64)
        cols = np.ascontiguousarray(fs.col_class, dtype=np.int64)
        k = len(fs.u)
        block_of = np.arange(k, dtype=np.int64) if fs.block_of is None else np.ascontiguousarray(fs.block_of, dtype=np.int64)
        if blocks.ndim != 3 or rows.ndim != 2 or cols.ndim != 2 or not len(rows) == len(cols) == len(fs.v) == len(block_of) == k:
            raise ValueError(f"FactoredStack: blocks {np.shape(fs.blocks)}, row_class {np.shape(fs.row_class)}, "
                             f"col_class {np.shape(fs.col_class)} and block_of {np.shape(block_of)} must be (n, ca, cb), "
                             f"(k, a), (k, b) and (k,) for its {k} edges")
        for labels, size, what in ((rows, blocks.shape[1], "row_class"), (cols, blocks.shape[2], "col_class"),
                                   (block_of, len(blocks), "block_of")):
            if labels.size and (labels.min() < 0 or labels.max() >= size):
                raise ValueError(f"FactoredStack: {what} must index the blocks' {size} entries, got "
                                 f"{int(labels.min())}..{int(labels.max())}")
        us, vs = self._check_endpoints(fs.u, fs.v, (rows.shape[1], cols.shape[1]), "FactoredStack", seen)
        return us, vs, blocks, ((rows.shape[1], cols.shape[1]), rows, cols, block_of)

    def _check_stack(self, st: EdgeStack, seen: set[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An :class:`EdgeStack`'s endpoints resolved and checked, and its costs as float64 (no copy when they are)."""
        costs = np.ascontiguousarray(st.costs, dtype=np.float64)
        if costs.ndim != 3 or len(st.u) != len(costs) or len(st.v) != len(costs):
            raise ValueError(f"EdgeStack: costs of shape {np.shape(st.costs)} must be (k, a, b) for its "
                             f"{len(st.u)} u and {len(st.v)} v endpoints")
        us, vs = self._check_endpoints(st.u, st.v, costs.shape[1:], "EdgeStack", seen)
        return us, vs, costs

    def _check_endpoints(self, u_in: Sequence[int] | np.ndarray, v_in: Sequence[int] | np.ndarray, shape: tuple[int, ...],
                         what: str,
                         seen: set[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """A stack's endpoints resolved, checked against its matrices' ``shape`` and added to ``seen``."""
        us = np.array([self._resolve_var(u, what) for u in u_in], dtype=np.int64)
        vs = np.array([self._resolve_var(v, what) for v in v_in], dtype=np.int64)
        for u, v in zip(us.tolist(), vs.tolist(), strict=False):
            label = f"{what} edge ({self.var_name(u)}, {self.var_name(v)})"
            if u >= v:
                raise ValueError(f"{label}: a stack's edges need u < v")
            if (int(self.n_states[u]), int(self.n_states[v])) != tuple(shape):
                raise ValueError(f"{label}: matrices of shape {tuple(shape)}, expected "
                                 f"{(int(self.n_states[u]), int(self.n_states[v]))}")
            if (u, v) in seen:
                raise ValueError(f"{label} is given twice (a stack's edges are not summed with others)")
            seen.add((u, v))
        return us, vs

    def _build_constraints(self, constraints: Iterable[LinearConstraint]):
        resolved = []
        rows, cols, vals, lower, upper = [], [], [], [], []
        for r, c in enumerate(constraints):
            if not isinstance(c, LinearConstraint):
                raise TypeError(f"constraints must be solvers.LinearConstraint, got {type(c).__name__}")
            terms = []
            for var, state, coef in c.terms:
                v = self._resolve_var(var, f"constraint {c.name!r}")
                if isinstance(state, (bool, np.bool_)) or not isinstance(state, (int, np.integer)):
                    raise TypeError(f"constraint {c.name!r}: state must be an int, got {state!r}")
                s = int(state)
                if not 0 <= s < self.n_states[v]:
                    raise ValueError(
                        f"constraint {c.name!r}: variable {self.var_name(v)} has no state {s} "
                        f"(it has {int(self.n_states[v])})"
                    )
                coef = float(coef)
                if not math.isfinite(coef):
                    raise ValueError(f"constraint {c.name!r}: coefficient of ({self.var_name(v)}, {s}) is not finite")
                terms.append((v, s, coef))
                rows.append(r)
                cols.append(int(self.offsets[v]) + s)
                vals.append(coef)
            resolved.append(LinearConstraint(c.name, terms, c.sense, c.rhs))
            lower.append(-np.inf if c.sense == "<=" else c.rhs)
            upper.append(np.inf if c.sense == ">=" else c.rhs)
        m = len(resolved)
        mat = sp.csr_matrix(
            (np.array(vals, dtype=np.float64), (np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64))),
            shape=(m, self.n_indicators),
        )
        mat.sum_duplicates()
        return tuple(resolved), _ConstraintRows(mat, np.array(lower, dtype=np.float64), np.array(upper, dtype=np.float64))

    @classmethod
    def _from_parts(cls, base: PairwiseProblem, unary_flat: np.ndarray, constraints: Sequence[LinearConstraint]) -> PairwiseProblem:
        """A copy of ``base`` with a new unary (same state counts) and constraints; edges shared."""
        p = cls.__new__(cls)
        p.names = base.names
        p.n_vars = base.n_vars
        p.n_states = base.n_states
        p.offsets = base.offsets
        p.unary_flat = _readonly(np.array(unary_flat, dtype=np.float64))
        p.unary = tuple(p.unary_flat[p.offsets[i] : p.offsets[i + 1]] for i in range(p.n_vars))
        p._name_index = base._name_index
        p.groups = base.groups
        p.constraints, p._rows = p._build_constraints(constraints)
        return p

    # ------------------------------------------------------------------ queries
    @property
    def n_indicators(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_edges(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def edges(self) -> list[tuple[int, int, np.ndarray]]:
        """Canonical edge list ``(u, v, matrix)`` with ``u < v``, in ``edge_ids`` order."""
        out: list = [None] * self.n_edges
        for g in self.groups:
            for k in range(len(g)):
                out[g.edge_ids[k]] = (int(g.u[k]), int(g.v[k]), g.matrix(k))
        return out

    @property
    def constraint_matrix(self) -> sp.csr_matrix:
        """Constraint rows as a CSR matrix of shape (n_constraints, n_indicators)."""
        return self._rows.matrix

    @property
    def constraint_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) bound of each row (-inf / +inf where one-sided)."""
        return self._rows.lower, self._rows.upper

    def var_name(self, v: int) -> str:
        v = int(v)
        return self.names[v] if self.names else f"x{v}"

    def check_assignment(self, assignment) -> np.ndarray:
        x = np.asarray(assignment)
        if x.shape != (self.n_vars,):
            raise ValueError(f"assignment must have shape ({self.n_vars},), got {x.shape}")
        if not np.issubdtype(x.dtype, np.integer):
            if not np.all(np.equal(np.mod(x, 1), 0)):
                raise ValueError("assignment must contain integer states")
        x = x.astype(np.int64)
        bad = (x < 0) | (x >= self.n_states)
        if bad.any():
            v = int(np.flatnonzero(bad)[0])
            raise ValueError(f"assignment gives variable {self.var_name(v)} state {x[v]}, it has {int(self.n_states[v])}")
        return x

    def energy(self, assignment) -> float:
        """Exact energy of a complete assignment (+inf if it uses a forbidden state or pair)."""
        x = self.check_assignment(assignment)
        total = math.fsum(self.unary_flat[self.offsets[:-1] + x].tolist())
        parts = [total]
        for g in self.groups:
            parts.append(math.fsum(g.at(x[g.u], x[g.v]).tolist()))
        return math.fsum(parts)

    def constraint_lhs(self, assignment) -> np.ndarray:
        x = self.check_assignment(assignment)
        return np.asarray(self._rows.matrix[:, self.offsets[:-1] + x].sum(axis=1)).reshape(-1)

    def violated_constraints(self, assignment, tol: float = 1e-6) -> list[str]:
        """Names of constraints the assignment violates (tolerance scaled by max(1, |rhs|))."""
        if not self.constraints:
            return []
        lhs = self.constraint_lhs(assignment)
        lo, hi = self.constraint_bounds
        out = []
        for i, c in enumerate(self.constraints):
            t = tol * max(1.0, abs(c.rhs))
            if lhs[i] < lo[i] - t or lhs[i] > hi[i] + t:
                out.append(c.name)
        return out

    def __repr__(self) -> str:
        return (
            f"PairwiseProblem(vars={self.n_vars}, indicators={self.n_indicators}, edges={self.n_edges}, "
            f"groups={len(self.groups)}, constraints={len(self.constraints)})"
        )

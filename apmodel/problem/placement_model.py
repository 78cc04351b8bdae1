"""The declarative placement model: one decision variable per node group, priced and constrained.

``PlacementModel`` turns a captured joint graph, its candidate strategies and a cost model into a
pairwise problem (``solvers.PairwiseProblem``):

* **variables**: one per group of nodes that choose together (see :mod:`apmodel.problem.clustering`);
  the states of a variable are the candidate strategies shared by its members;
* **unary terms**: compute cost (µs) of each strategy on its per-device shapes, summed over the
  group's members (so L copies of a layer weigh L times), plus the cost of edges that fall inside
  one group, plus boundary costs (a forward output redistributed to its required placement);
* **pairwise terms**: redistribution cost (µs) between a producer's output placement and the
  placement its consumer expects, on every graph edge; a parameter's gradient is an edge back to
  the parameter (it must end in the parameter's storage placement, which prices the gradient
  reduction), an input's gradient likewise, and a buffer's new value (BatchNorm running
  statistics) is an edge back to the buffer;
* **constraints**: allowed-state masks (boundary placements, the parameter-storage policy, user
  fixes and bans, each recorded with its provenance so conflicts can be named) and linear rows over
  the indicators (parameter-memory budget, user rows).

The model is built in two steps so users can constrain it in Python in between::

    m = PlacementModel(captured, mesh_shape=(4, 8), cost=cost)
    m.fix("layers.*.attention.wo.weight", "S(0)S(1)")
    problem = m.compile()
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

import solvers
from apmodel.candidates.strategies import Strategy, input_slots
from apmodel.candidates.strategy_filters import Placements
from apmodel.core import placements as pl
from apmodel.graph.capture import CapturedGraph
from apmodel.problem.clustering import Grouping, cluster, local_signature
from apmodel.problem.memory import MemoryModel
from apmodel.problem.pair_blocks import Factors, factored_stacks
from apmodel.problem.pricing import CostContext

logger = logging.getLogger(__name__)



class ConstraintConflict(ValueError):
    """Constraints leave some node with no allowed strategy; the message names them."""


@dataclass
class Edge:
    """One data edge of the joint graph: ``producer`` output ``out_index`` feeds ``consumer``.

    ``slot`` is the consumer's input slot; ``slot == -1`` marks a gradient edge whose consumer is
    the parameter (or input) placeholder, expecting the placeholder's own output placement.
    """

    producer: str
    out_index: int
    consumer: str
    slot: int


@dataclass
class CompiledModel:
    """What :meth:`PlacementModel.compile` produced, kept for decoding solutions."""

    problem: solvers.PairwiseProblem
    grouping: Grouping
    group_states: list[list[Strategy]]
    build_s: float


@dataclass
class _Restriction:
    mask: np.ndarray
    reasons: list[str] = field(default_factory=list)


def _tensor_value(val: Any, index: int) -> torch.Tensor | None:
    if isinstance(val, (list, tuple)):
        val = val[index] if index < len(val) else None
    return val if isinstance(val, torch.Tensor) else None


def _tensor(val: Any, index: int) -> torch.Tensor:
    """:func:`_tensor_value` where a tensor is known to be (a parameter, the producer of an edge)."""
    t = _tensor_value(val, index)
    assert t is not None, f"not a tensor: output {index} of {val!r}"
    return t


def _param_placements(s: Strategy) -> Placements:
    """The placements of a parameter's strategy (its one output, a tensor)."""
    out = s.outputs[0]
    assert out is not None
    return out


def _negated(pred: Callable[[Strategy], bool]) -> Callable[[Strategy], bool]:
    return lambda s: not pred(s)


def default_batch_placement(val: torch.Tensor | None, mesh_shape: Sequence[int]) -> tuple[str, ...]:
    """Default boundary placement: batch (dim 0) sharded on mesh axis 0 when it divides evenly,
    replicated elsewhere (placement strings, one per mesh axis)."""
    D = len(mesh_shape)
    if val is not None and val.dim() >= 1 and val.shape[0] % mesh_shape[0] == 0 and val.shape[0] >= mesh_shape[0]:
        return tuple(["S(0)"] + ["R"] * (D - 1))
    return tuple(["R"] * D)


class PlacementModel:
    """Declarative placement problem over one captured joint graph.

    Args:
        captured: the joint forward-backward graph (:func:`apmodel.graph.capture.capture`).
        strategies: candidate strategies per node name (:func:`apmodel.candidates.strategies.enumerate_strategies`).
        cost: the cost context (compute and communication models, mesh shape, pricing dtype).
        input_placements: placement of each model input (by position); ``None`` entries and missing
            positions get the default, batch dimension sharded on mesh axis 0.
        output_placements: required placement of each forward output (default: replicated for
            scalars, batch-sharded like the inputs otherwise).
        param_policy: ``"full_shard"`` (default: every parameter stored with the largest sharding
            factor it admits, on all axes but ``replicate_axes``), or ``"free"``.
        replicate_axes: mesh axes on which parameters are replicated (DDP/HSDP axes).
        param_memory_fraction: if given, a linear budget row: total per-device parameter bytes
            ≤ fraction × total parameter bytes (instead of the ``full_shard`` restriction).
        param_budget_ratio: if given, the AutoParallel paper's storage budget ``high`` (Appendix
            C): the average over parameter tensors of their local / global element ratio ≤ the
            ratio (instead of the ``full_shard`` restriction; 1/world size forces full sharding,
            1 allows any storage).
        merge_copies, flow_coupling: clustering switches (see :mod:`apmodel.problem.clustering`).
        optimizer: the optimizer whose state the memory model counts (``"adamw"``, ``"sgd"``, ...;
            :mod:`apmodel.problem.memory`); the device capacity comes from ``cost.hbm_bytes``.
    """

    def __init__(
        self,
        captured: CapturedGraph,
        strategies: Mapping[str, list[Strategy]],
        cost: CostContext,
        *,
        input_placements: Sequence[Any] | None = None,
        output_placements: Sequence[Any] | None = None,
        param_policy: str = "full_shard",
        replicate_axes: Sequence[int] = (),
        param_memory_fraction: float | None = None,
        param_budget_ratio: float | None = None,
        merge_copies: bool = True,
        flow_coupling: bool = True,
        optimizer: str = "adamw",
    ) -> None:
        if param_policy not in ("full_shard", "free"):
            raise ValueError(f"param_policy must be 'full_shard' or 'free', got {param_policy!r}")
        self.captured = captured
        self.cost = cost
        self.mesh_shape = tuple(cost.mesh_shape)
        self.merge_copies = merge_copies
        self.flow_coupling = flow_coupling
        gm = captured.gm
        self.nodes: list[fx.Node] = [n for n in gm.graph.nodes if n.op != "output"]
        self.node_by_name = {n.name: n for n in self.nodes}
        missing = [n.name for n in self.nodes if n.name not in strategies]
        if missing:
            raise ValueError(f"no strategies given for nodes {missing[:5]}{'...' if len(missing) > 5 else ''}")
        # Intern equal strategy lists into one list object, so that identity (cheap) can key the
        # clustering and the cost memos.
        # A list object seen before (enumerate_strategies shares one per memo entry) is looked
        # up by identity, without hashing its strategies again.
        # Lists are compared as tuples of placement numbers (equal placements, equal numbers),
        # which hash in C; a placement tuple is numbered by its identity first.
        interned: dict[tuple, list[Strategy]] = {}
        by_id: dict[int, tuple[Sequence[Strategy], list[Strategy]]] = {}
        number = pl.numbering()
        self.strategies: dict[str, list[Strategy]] = {}
        for n in self.nodes:
            strats = strategies[n.name]
            seen = by_id.get(id(strats))
            if seen is None or seen[0] is not strats:
                key = tuple((tuple(map(number, s.outputs)), tuple(map(number, s.inputs))) for s in strats)
                seen = by_id[id(strats)] = (strats, interned.setdefault(key, list(strats)))
            self.strategies[n.name] = seen[1]
        for name, strats in self.strategies.items():
            if not strats:
                raise ValueError(f"node {name!r} ({self.node_by_name[name].target}) has no candidate strategy")
        self.fqn_to_node = {fqn: node for node, fqn in captured.param_fqn.items()}
        self._restrictions: dict[str, _Restriction] = {}
        #: (id of an interned strategy list, "out"/"in", index) -> placement strings per strategy
        self._strs: dict[tuple[int, str, int], list[tuple[str, ...] | None]] = {}
        self.linear_rows: list[tuple[str, list[tuple[str, int, float]], str, float]] = []
        self.edges = self._collect_edges()
        self.boundary_outputs = self._boundary_outputs(output_placements)
        self._apply_input_boundary(input_placements)
        self._apply_tangent_boundary()
        self._apply_buffer_policy()
        self.replicate_axes = tuple(int(a) for a in replicate_axes)
        for a in self.replicate_axes:
            if not 0 <= a < len(self.mesh_shape):
                raise ValueError(f"replicate_axes: axis {a} is not an axis of mesh {self.mesh_shape}")
        if param_memory_fraction is not None and param_budget_ratio is not None:
            raise ValueError("param_memory_fraction and param_budget_ratio are two storage budgets: give one")
        if param_memory_fraction is not None:
            self._add_param_budget(float(param_memory_fraction), per_tensor=False)
        elif param_budget_ratio is not None:
            self._add_param_budget(float(param_budget_ratio), per_tensor=True)
        elif param_policy == "full_shard":
            self._apply_full_shard()
        self.memory = MemoryModel(
            captured, self.strategies, self.mesh_shape, cost.itemsize, optimizer=optimizer, hbm_bytes=cost.hbm_bytes,
            state_itemsize=cost.state_itemsize, region_working_bytes=cost.region_working_bytes,
        )
        self._compiled: CompiledModel | None = None
        #: weight of the parameters' gathers and gradients' reductions in the compiled problem (1:
        #: their price; less: the overlap surrogate, see apmodel.solve.search.solve_model)
        self.weight_traffic_scale = 1.0
        #: compute cost vectors by (local signature, strategy list), priced once per model
        self._compute_memo: dict[Hashable, np.ndarray] = {}

    def set_weight_traffic_scale(self, scale: float) -> None:
        """Weigh the parameters' gathers and gradients' reductions by ``scale`` in the compiled
        problem (the plan is still priced at full price); recompiles on the next solve."""
        if scale != self.weight_traffic_scale:
            self.weight_traffic_scale = float(scale)
            self._compiled = None

    # ------------------------------------------------------------------ graph structure
    def _collect_edges(self) -> list[Edge]:
        edges: list[Edge] = []
        for n in self.nodes:
            for j, (producer, k) in enumerate(input_slots(n)):
                if _tensor_value(producer.meta.get("val"), k) is None:
                    continue
                edges.append(Edge(producer.name, k, n.name, j))
        cap = self.captured
        for param, grad in cap.param_grad.items():
            edges.append(Edge(grad, 0, param, -1))
        for inp, grad in cap.input_grad.items():
            edges.append(Edge(grad, 0, inp, -1))
        for buf, update in cap.buffer_update.items():  # written back at the buffer's placement
            edges.append(Edge(update, 0, buf, -1))
        return edges

    def _boundary_outputs(self, output_placements: Sequence[Any] | None) -> dict[str, tuple[str, ...]]:
        """Forward outputs -> required placement strings."""
        outs = [name for name, role in self.captured.roles.items() if role == "output"]
        required: dict[str, tuple[str, ...]] = {}
        for i, name in enumerate(outs):
            given = output_placements[i] if output_placements is not None and i < len(output_placements) else None
            val = _tensor_value(self.node_by_name[name].meta.get("val"), 0)
            if given is None:
                given = self._default_batch_placement(val)
            required[name] = self._placement_strs(given, f"output {i} ({name})")
        return required

    def _default_batch_placement(self, val: torch.Tensor | None) -> tuple:
        return default_batch_placement(val, self.mesh_shape)

    def _placement_strs(self, given: Any, what: str) -> tuple[str, ...]:
        return pl.to_strs(given, len(self.mesh_shape), what)

    # ------------------------------------------------------------------ restrictions
    def restrict(self, node: str, allowed: Callable[[Strategy], bool] | np.ndarray, reason: str) -> None:
        """Keep only the strategies of ``node`` for which ``allowed`` holds; record ``reason``."""
        strats = self.strategies[node]
        mask = np.asarray(allowed, dtype=bool) if isinstance(allowed, np.ndarray) else np.array([bool(allowed(s)) for s in strats])
        r = self._restrictions.get(node)
        if r is None:
            r = self._restrictions[node] = _Restriction(np.ones(len(strats), dtype=bool))
        r.mask &= mask
        r.reasons.append(reason)
        self._compiled = None
        if not r.mask.any():
            raise ConstraintConflict(
                f"no strategy of node {node!r} ({self.node_by_name[node].target}) satisfies all of: "
                + "; ".join(r.reasons)
            )

    def allowed_mask(self, node: str) -> np.ndarray:
        r = self._restrictions.get(node)
        return r.mask if r is not None else np.ones(len(self.strategies[node]), dtype=bool)

    def restriction_reasons(self, node: str) -> list[str]:
        r = self._restrictions.get(node)
        return list(r.reasons) if r is not None else []

    def output_strs(self, s: Strategy, k: int = 0) -> tuple[str, ...] | None:
        """Placement strings of output ``k`` of strategy ``s`` (None for a non-tensor output)."""
        p = s.outputs[k] if k < len(s.outputs) else None
        return None if p is None else tuple(pl.to_str(x) for x in p)

    def _apply_input_boundary(self, input_placements: Sequence[Any] | None) -> None:
        for name, idx in self.captured.input_index.items():
            given = input_placements[idx] if input_placements is not None and idx < len(input_placements) else None
            val = _tensor_value(self.node_by_name[name].meta.get("val"), 0)
            if given is None:
                given = self._default_batch_placement(val)
            want = self._placement_strs(given, f"input {idx} ({name})")
            self.restrict(name, self._outputs_placed(want), f"boundary: input {idx} placed {''.join(want)}")

    def _outputs_placed(self, want: tuple[str, ...] | None) -> Callable[[Strategy], bool]:
        """Whether a strategy places its output ``want`` (placement strings)."""
        return lambda s: self.output_strs(s) == want

    def _apply_tangent_boundary(self) -> None:
        for out, tangent in self.captured.output_tangent.items():
            want = self.boundary_outputs.get(out)
            if want is not None and tangent in self.strategies:
                self.restrict(tangent, self._outputs_placed(want), f"boundary: tangent of {out} placed like it")

    def _apply_buffer_policy(self) -> None:
        # Buffers (e.g. RoPE tables) are small and not trained: keep them replicated so the lowered
        # module can hold them as plain replicated tensors.
        D = len(self.mesh_shape)
        for name, fqn in self.captured.buffer_fqn.items():
            self.restrict(name, lambda s: self.output_strs(s) == ("R",) * D, f"policy: buffer {fqn} replicated")

    def _param_shard_factor(self, s: Strategy) -> int:
        f = 1
        for axis, p in enumerate(_param_placements(s)):
            if pl.to_str(p).startswith("S"):
                f *= self.mesh_shape[axis]
        return f

    def _apply_full_shard(self) -> None:
        """Paper §4.3: parameters fully sharded on the non-replicated axes (fixed storage)."""
        for node, fqn in self.captured.param_fqn.items():
            strats = self.strategies[node]
            ok = np.array(
                [
                    not any(pl.to_str(p).startswith("P") for p in _param_placements(s))
                    and all(pl.to_str(_param_placements(s)[a]) == "R" for a in self.replicate_axes)
                    for s in strats
                ]
            )
            if not ok.any():
                raise ConstraintConflict(f"parameter {fqn}: no candidate placement is replicated on axes {self.replicate_axes}")
            factors = np.array([self._param_shard_factor(s) for s in strats])
            best = factors[ok].max()
            self.restrict(node, ok & (factors == best), f"policy: parameter {fqn} fully sharded (factor {best})")

    def _add_param_budget(self, fraction: float, *, per_tensor: bool) -> None:
        """Storage budget row: Σ weight × local/global ≤ fraction × Σ weight over parameters, the
        weight being each tensor's element count (a byte budget) or 1 (``per_tensor``: the
        paper's average storage ratio)."""
        name = "param_budget_ratio" if per_tensor else "param_memory_fraction"
        if not 0 < fraction <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {fraction}")
        terms = []
        total = 0.0
        for node, fqn in self.captured.param_fqn.items():
            numel = 1 if per_tensor else _tensor(self.node_by_name[node].meta["val"], 0).numel()
            total += numel
            for i, s in enumerate(self.strategies[node]):
                if any(pl.to_str(p).startswith("P") for p in _param_placements(s)):
                    continue
                terms.append((node, i, numel / self._param_shard_factor(s)))
            self.restrict(node, lambda s: not any(pl.to_str(p).startswith("P") for p in _param_placements(s)), f"policy: parameter {fqn} not partial")
        self.linear_rows.append(("param_budget_ratio" if per_tensor else "param_memory_budget", terms, "<=",
                                 fraction * total))

    def add_memory_limit(self, limit_bytes: float, *, reserved_bytes: float = 0.0, activation_copies: float = 1.0) -> None:
        """Per-device memory row: parameters, gradients, optimizer state and saved activations
        (see :mod:`apmodel.problem.memory`) ≤ ``limit_bytes - reserved_bytes`` (``reserved_bytes``: what the
        row cannot see, e.g. the step's largest transient; ``activation_copies``: microbatches whose
        activations are held at once, a pipeline stage's). Replaces an earlier memory row."""
        self.linear_rows = [r for r in self.linear_rows if r[0] != "memory"]
        self.linear_rows.append(("memory", self.memory.row(activation_copies), "<=", float(limit_bytes - reserved_bytes)))
        self._compiled = None

    # ------------------------------------------------------------------ user constraints
    def select(self, pattern: str) -> list[str]:
        """Node names matched by ``pattern``: parameter FQNs first (glob), else node names (glob)."""
        fqns = [f for f in self.fqn_to_node if fnmatch.fnmatchcase(f, pattern)]
        if fqns:
            return [self.fqn_to_node[f] for f in fqns]
        names = [n for n in self.strategies if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise KeyError(f"pattern {pattern!r} matches no parameter and no graph node")
        return names

    def _matcher(self, placement: Any, node: str, where: str) -> Callable[[Strategy], bool]:
        want = self._placement_strs(placement, f"constraint on {node}")
        if where == "output":
            return lambda s: self.output_strs(s) == want
        if where.startswith("input"):
            j = int(where.split(":")[1]) if ":" in where else 0

            def match(s: Strategy) -> bool:
                p = s.inputs[j] if j < len(s.inputs) else None
                return p is not None and tuple(pl.to_str(x) for x in p) == want

            return match
        raise ValueError(f"constraint 'on' must be 'output' or 'input:J', got {where!r}")

    def fix(self, pattern: str, placement: Any, *, on: str = "output", name: str | None = None) -> list[str]:
        """Force the nodes/parameters matching ``pattern`` to ``placement`` (e.g. ``"S(0)S(1)"``)."""
        label = name or f"fix({pattern!r}, {placement!r}, on={on!r})"
        nodes = self.select(pattern)
        for n in nodes:
            self.restrict(n, self._matcher(placement, n, on), label)
        return nodes

    def forbid(self, pattern: str, placement: Any, *, on: str = "output", name: str | None = None) -> list[str]:
        """Exclude ``placement`` for the nodes/parameters matching ``pattern``."""
        label = name or f"forbid({pattern!r}, {placement!r}, on={on!r})"
        nodes = self.select(pattern)
        for n in nodes:
            m = self._matcher(placement, n, on)
            self.restrict(n, _negated(m), label)
        return nodes

    def run_regions_as(self, pattern: str, per_axis: Sequence[str | None], *, name: str | None = None) -> list[str]:
        """Run the ``local_map`` regions whose region name matches ``pattern`` (glob; forward,
        backward and recomputed nodes) as ``per_axis``: per mesh axis one of the region's
        alternatives, ``"replicated"``, or None (left to the solver)."""
        from apmodel.graph.regions import is_backward, region_of

        label = name or f"region_as({pattern!r}, {', '.join(map(repr, per_axis))})"
        if len(per_axis) != len(self.mesh_shape):
            raise ValueError(f"{label}: {len(per_axis)} entries for a mesh of {len(self.mesh_shape)} axes")
        nodes = []
        for n in self.nodes:
            region = region_of(n.target) if n.op == "call_function" else None
            if region is None or not fnmatch.fnmatchcase(region.name, pattern) or n.name not in self.strategies:
                continue
            known = {a.name for a in region.alternatives} | {"replicated"}
            bad = [a for a in per_axis if a is not None and a not in known]
            if bad:
                raise ValueError(f"{label}: region {region.name!r} has no alternative {bad[0]!r} (it has {sorted(known)})")
            backward = is_backward(n.target)

            def allowed(s: Strategy, region=region, backward=backward) -> bool:
                modes = region.alternative_on_axes(s.inputs, backward=backward)
                return all(want is None or (mode or "replicated") == want for mode, want in zip(modes, per_axis, strict=False))

            self.restrict(n.name, allowed, label)
            nodes.append(n.name)
        if not nodes:
            raise KeyError(f"{label}: pattern {pattern!r} matches no local_map region of the graph")
        return nodes

    def fix_strategy(self, node: str, strategy: Strategy, reason: str) -> None:
        """Force ``node`` to exactly ``strategy`` (used by plan replay)."""
        strats = self.strategies.get(node)
        if strats is None:
            raise KeyError(f"node {node!r} is not in the graph")
        if strategy not in strats:
            raise ConstraintConflict(f"{reason}: strategy {strategy} is not a candidate of node {node!r} on this workload")
        self.restrict(node, np.array([s == strategy for s in strats]), reason)

    def add_linear(self, name: str, terms: Iterable[tuple[str, Any, float]], sense: str, rhs: float) -> None:
        """A linear row over indicators: ``Σ coef · [pattern placed as placement] (sense) rhs``."""
        rows: list[tuple[str, int, float]] = []
        for pattern, placement, coef in terms:
            for n in self.select(pattern):
                m = self._matcher(placement, n, "output")
                rows.extend((n, i, float(coef)) for i, s in enumerate(self.strategies[n]) if m(s))
        if sense not in ("<=", ">=", "=="):
            raise ValueError(f"linear constraint {name!r}: sense must be '<=', '>=' or '==', got {sense!r}")
        self.linear_rows.append((name, rows, sense, float(rhs)))
        self._compiled = None

    # ------------------------------------------------------------------ costs
    def _state_key(self, name: str) -> Hashable:
        """Identity of a node's decision space: its (interned) strategy list and allowed states."""
        r = self._restrictions.get(name)
        return (id(self.strategies[name]), None if r is None else r.mask.tobytes())

    def compute_vector(self, name: str) -> np.ndarray:
        """Compute cost (µs) of every candidate strategy of node ``name``."""
        return self.cost.compute_vector(self.node_by_name[name], self.strategies[name])

    def edge_matrix(self, e: Edge) -> np.ndarray:
        """Redistribution cost (µs) for every (producer strategy, consumer strategy) pair of ``e``."""
        block, rows, cols = self.edge_factors(e)
        return block[np.ix_(rows, cols)]

    def edge_factors(self, e: Edge) -> Factors:
        """:meth:`edge_matrix` factored: ``(block, rows, cols)`` with the matrix ``block[np.ix_(rows, cols)]``
        (the distinct placements priced once; ``block`` is shared: read it, never write it)."""
        prod = self.node_by_name[e.producer]
        val = _tensor(prod.meta.get("val"), e.out_index)
        src = self._strategy_strs(e.producer, "out", e.out_index)
        dst = self._strategy_strs(e.consumer, "out", 0) if e.slot < 0 else self._strategy_strs(e.consumer, "in", e.slot)
        return self.cost.redistribution_factors(tuple(val.shape), val.dtype, src, dst, gradient=self.is_param_gradient(e),
                                                bucketed=self.is_bucketed(e))

    def _strategy_strs(self, node: str, side: str, index: int) -> list[tuple[str, ...] | None]:
        """Placement strings of output (``side="out"``) or input slot ``index`` of every strategy
        of ``node``, memoised per interned strategy list (the model's lists live as long as it)."""
        strats = self.strategies[node]
        key = (id(strats), side, index)
        strs = self._strs.get(key)
        if strs is None:
            if side == "out":
                strs = [self.output_strs(s, index) for s in strats]
            else:
                strs = [None if (inp := s.inputs[index]) is None else tuple(pl.to_str(x) for x in inp) for s in strats]
            self._strs[key] = strs
        return strs

    def is_param_gradient(self, e: Edge) -> bool:
        """True for an edge that carries a parameter gradient: from the op that computes it,
        through views (``t``, ``view``), back to the parameter. Its reduction (wherever the plan
        puts it on this chain) is priced in the reduce dtype under mixed precision."""
        chain = self._gradient_chain
        return e.producer in chain and (e.consumer in chain or (e.slot < 0 and e.consumer in self.captured.param_fqn))

    @functools.cached_property
    def _gradient_chain(self) -> frozenset[str]:
        return self.captured.param_gradient_chain()

    def is_bucketed(self, e: Edge) -> bool:
        """True for an edge whose collectives the native program merges with others of their kind
        (priced as their share of a bucket, :meth:`apmodel.problem.pricing.CostContext.redistribution_matrix`):
        a parameter's gather (out of the parameter or a view or cast of it) and a gradient's
        reduction. Neither depends on another collective, so the program merges all of one kind
        and process group; an activation's collective usually depends on the one before it,
        through the computation between them, and runs alone."""
        return e.producer in self.param_values or self.is_param_gradient(e)

    @functools.cached_property
    def param_values(self) -> frozenset[str]:
        """Parameters and their views and casts (:meth:`apmodel.graph.capture.CapturedGraph.param_value_chain`)."""
        return self.captured.param_value_chain()

    def boundary_vector(self, name: str) -> np.ndarray:
        """Cost (µs) of bringing forward output ``name`` to its required placement."""
        val = _tensor(self.node_by_name[name].meta.get("val"), 0)
        src = [self.output_strs(s, 0) for s in self.strategies[name]]
        return self.cost.redistribution_matrix(tuple(val.shape), val.dtype, src, [self.boundary_outputs[name]])[:, 0]

    # ------------------------------------------------------------------ compile
    def compile(self) -> solvers.PairwiseProblem:
        """Cluster, price and assemble the pairwise problem (cached until a constraint changes)."""
        return self._compile().problem

    @property
    def compiled(self) -> CompiledModel:
        return self._compile()

    def _compile(self) -> CompiledModel:
        if self._compiled is not None:
            return self._compiled
        t0 = time.perf_counter()
        cap = self.captured
        roles = cap.roles
        signatures = {
            n.name: local_signature(n, roles.get(n.name) if n.op == "placeholder" else None, cap.is_backward.get(n.name, False))
            for n in self.nodes
        }
        state_key = {n.name: self._state_key(n.name) for n in self.nodes}
        grouping = cluster(self.nodes, signatures, state_key, merge_copies=self.merge_copies, flow_coupling=self.flow_coupling)
        G = grouping.num_groups
        group_states = [self.strategies[ms[0]] for ms in grouping.groups]
        unary = self._compute_unaries(grouping, signatures, group_states)
        terms = self._pair_terms(grouping, unary)
        stacks = factored_stacks(terms, [len(s) for s in group_states])

        # Forbidden states (restrictions) as +inf unaries.
        for g, members in enumerate(grouping.groups):
            mask = self.allowed_mask(members[0])
            unary[g] = np.where(mask, unary[g], np.inf)

        constraints = []
        for name, row, sense, rhs in self.linear_rows:
            coef: dict[tuple[int, int], float] = defaultdict(float)
            for node, state, c in row:
                coef[(grouping.group_of[node], state)] += c
            constraints.append(solvers.LinearConstraint(name=name, terms=[(g, s, c) for (g, s), c in coef.items()], sense=sense, rhs=rhs))

        names = [self._group_label(ms) for ms in grouping.groups]
        problem = solvers.PairwiseProblem(
            unary=unary,
            edges=stacks,
            constraints=constraints,
            names=names,
        )
        build_s = time.perf_counter() - t0
        logger.info(
            "model: %d nodes, %d groups, %d states, %d edges (built in %.2f s)",
            len(self.nodes), G, sum(len(s) for s in group_states), len(terms), build_s,
        )
        self._compiled = CompiledModel(problem=problem, grouping=grouping, group_states=group_states, build_s=build_s)
        return self._compiled

    def _compute_unaries(self, grouping: Grouping, signatures: Mapping[str, Hashable],
                         group_states: Sequence[Sequence[Strategy]]) -> list[np.ndarray]:
        """Per group, the compute cost of each state summed over its members (priced once per
        distinct content), plus the boundary costs of the forward outputs among them."""
        compute_memo = self._compute_memo  # kept across recompiles (constraints and scales leave it valid)
        unary = [np.zeros(len(s)) for s in group_states]
        for g, members in enumerate(grouping.groups):
            for m in members:
                key = (signatures[m], id(self.strategies[m]))
                vec = compute_memo.get(key)
                if vec is None:
                    vec = compute_memo[key] = self.compute_vector(m)
                unary[g] += vec
        for name in self.boundary_outputs:
            unary[grouping.group_of[name]] += self.boundary_vector(name)
        return unary

    def _pair_terms(self, grouping: Grouping, unary: list[np.ndarray]) -> dict[tuple[int, int], list[tuple[Factors, bool]]]:
        """The redistribution of every graph edge, priced once per distinct (strategies, shape) pair:
        per group pair ``(gu, gv)``, ``gu < gv``, its edges' factored matrices in order (each flagged
        if transposed); an edge inside one group adds its matrix's diagonal to ``unary`` instead."""
        matrix_memo: dict[Hashable, Factors] = {}
        scaled_blocks: dict[int, np.ndarray] = {}  # a shared block scaled once (weight_traffic_scale)
        same_factors: dict[tuple, Factors] = {}  # equal factors (other strategy lists, equal strings) as one object
        terms: dict[tuple[int, int], list[tuple[Factors, bool]]] = {}  # per group pair: (matrix, transposed) in order
        for e in self.edges:
            val = _tensor(self.node_by_name[e.producer].meta.get("val"), e.out_index)
            edge_key = (id(self.strategies[e.producer]), e.out_index, id(self.strategies[e.consumer]), e.slot,
                        tuple(val.shape), val.dtype, self.is_param_gradient(e), self.is_bucketed(e))
            factors = matrix_memo.get(edge_key)
            if factors is None:
                block, rows, cols = self.edge_factors(e)
                if self.weight_traffic_scale != 1.0 and self.is_bucketed(e):
                    scaled = scaled_blocks.get(id(block))
                    if scaled is None:  # forbidden pairs (+inf) stay forbidden
                        scaled = scaled_blocks[id(block)] = np.where(np.isinf(block), block,
                                                                     block * self.weight_traffic_scale)
                    block = scaled
                factors = same_factors.setdefault((id(block), rows.tobytes(), cols.tobytes()), (block, rows, cols))
                matrix_memo[edge_key] = factors
            gu, gv = grouping.group_of[e.producer], grouping.group_of[e.consumer]
            if gu == gv:  # the matrix's diagonal
                block, rows, cols = factors
                unary[gu] += block[rows, cols]
                continue
            terms.setdefault((min(gu, gv), max(gu, gv)), []).append((factors, gu > gv))
        return terms

    def _group_label(self, members: list[str]) -> str:
        rep = members[0]
        label = self.captured.param_fqn.get(rep, rep)
        return label if len(members) == 1 else f"{label} (+{len(members) - 1} copies)"

    def summary(self) -> dict[str, int]:
        """Sizes of the compiled problem: nodes, groups, states, edges."""
        c = self._compile()
        return {
            "nodes": len(self.nodes),
            "groups": c.grouping.num_groups,
            "states": int(sum(len(s) for s in c.group_states)),
            "edges": c.problem.n_edges,
        }

    def decode(self, assignment: Sequence[int] | np.ndarray) -> dict[str, Strategy]:
        """Solver assignment (one state per group) -> strategy per node."""
        c = self._compile()
        out: dict[str, Strategy] = {}
        for g, members in enumerate(c.grouping.groups):
            s = c.group_states[g][int(assignment[g])]
            for m in members:
                out[m] = s
        return out

    def encode(self, node_strategy: Mapping[str, Strategy]) -> np.ndarray:
        """Strategy per node -> assignment (one state per group); members must agree."""
        c = self._compile()
        assignment = np.zeros(c.grouping.num_groups, dtype=np.int64)
        for g, members in enumerate(c.grouping.groups):
            chosen = {node_strategy[m] for m in members}
            if len(chosen) != 1:
                raise ValueError(f"group {self._group_label(members)}: members choose different strategies")
            assignment[g] = c.group_states[g].index(chosen.pop())
        return assignment

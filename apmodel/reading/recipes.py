"""Expert recipes (DDP, FSDP, HSDP, Megatron TP with/without sequence parallel, FSDP+TP) written as
apmodel constraints, so they can be priced under the same cost model as a searched plan.

A recipe is data: a parameter-storage policy (``full_shard`` or ``free``), replicated mesh axes,
and a list of constraints that fix, per mesh axis,

* where each parameter is **stored** (its placeholder's output placement),
* how each parameter is **used** by the ops that read it (the input placement of its first
  consumers: ``R`` on an axis means the weight is all-gathered / replicated there, ``S(d)`` means
  the op works on the local shard: tensor parallelism), and
* where the recipe defines them, **activations** (the outputs of the norms: replicated on the
  tensor-parallel axis for Megatron, sharded on the sequence dimension with sequence parallel).

Everything the recipe leaves open (how the batch flows through attention, where gradients are
reduced) is chosen by the solver, so a recipe's price is the best plan *within* the recipe.

The tensor-parallel recipes read the parts of the model from its
:class:`~apmodel.graph.conventions.ModelConventions` (by default derived from the traced graph, see
:func:`apmodel.graph.conventions.derive`; for LLaMA names the same as :data:`apmodel.graph.conventions.LLAMA`):
column-parallel linears and the output projection (weights ``[out, in]`` sharded on dim 0, with
their biases), row-parallel linears (dim 1; their biases kept whole; the dimensions swap for
weights stored ``[in, out]``, Hugging Face's ``Conv1D``), a vocabulary-parallel
embedding (dim 0), and norms kept whole. A parameter whose split dimension does not divide by the
tensor-parallel degree (GPT-2's vocabulary of 50257 on 2 ranks) is kept whole on that axis too,
and the result's ``notes`` say so: Megatron would pad it, which changes the model. The data axes
are all axes but the last, the tensor-parallel axis is the last (innermost, fastest) one; inputs
are batch-sharded on axis 0.

Recipes whose storage policy is ``free`` (DDP, HSDP, Megatron with replicated data-parallel
parameters) hold more parameter bytes per device than the planner's default ``full_shard``
policy allows: they lie outside its search space and are compared against a plan searched under
the ``free`` policy as well (:func:`apmodel.entry.api` does, for ``compare_recipes``).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

import solvers
from apmodel.candidates.strategies import input_slots
from apmodel.core import placements as pl
from apmodel.core.options import PlanOptions, make_options
from apmodel.graph.conventions import ModelConventions, derive
from apmodel.solve.search import placement_model, solve_model

logger = logging.getLogger(__name__)

AxisSpec = Mapping[int, str]  # mesh axis -> "R" | "P" | "S(d)" | "S" (any shard)


class NotApplicable(ValueError):
    """A recipe that does not apply to this mesh or model (the message says why)."""


def _matches(strs: Sequence[str] | None, spec: AxisSpec) -> bool:
    if strs is None:
        return False
    for axis, want in spec.items():
        got = strs[axis]
        if want == "S":
            if not got.startswith("S"):
                return False
        elif got != want:
            return False
    return True


def _strs(p) -> tuple[str, ...] | None:
    return None if p is None else tuple(pl.to_str(x) for x in p)


def _params(m, patterns: Sequence[str], exclude: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(node name, FQN) of the parameters matching any glob of ``patterns`` and none of ``exclude``."""
    return [(node, fqn) for node, fqn in m.captured.param_fqn.items()
            if any(fnmatch.fnmatchcase(fqn, p) for p in patterns) and not any(fnmatch.fnmatchcase(fqn, p) for p in exclude)]


@dataclass(frozen=True)
class ParamRule:
    """Per-axis storage and use placements for the parameters matching ``patterns``."""

    patterns: tuple[str, ...]
    storage: AxisSpec = field(default_factory=dict)
    use: AxisSpec = field(default_factory=dict)
    label: str = ""
    exclude: tuple[str, ...] = ()

    def apply(self, m) -> None:
        for node, fqn in _params(m, self.patterns, self.exclude):
            _restrict_param(m, node, fqn, self.storage, self.use, self.label)


def _restrict_param(m, node: str, fqn: str, storage: AxisSpec, use: AxisSpec, label: str) -> None:
    """Keep the strategies storing parameter ``fqn`` as ``storage`` and its direct readers' that
    read it as ``use`` (per mesh axis; an empty spec leaves that side free)."""
    if storage:
        m.restrict(node, lambda s: _matches(_strs(s.outputs[0]), storage),
                   f"recipe {label}: {fqn} stored {_spec_str(storage)}")
    if use:
        pnode = m.node_by_name[node]
        for user in pnode.users:
            if user.name not in m.strategies:
                continue
            slots = [j for j, (prod, _k) in enumerate(input_slots(user)) if prod is pnode]
            for j in slots:
                m.restrict(user.name, lambda s, j=j: j < len(s.inputs) and _matches(_strs(s.inputs[j]), use),
                           f"recipe {label}: {fqn} used as {_spec_str(use)} by {user.name}")


@dataclass(frozen=True)
class NormOutputRule:
    """Forward outputs of the ops that apply a norm weight placed per axis (Megatron activations).
    The norm weights are ``conventions.norm_weights`` (None: derived from the graph)."""

    spec: AxisSpec
    conventions: ModelConventions | None = None
    label: str = ""

    def with_conventions(self, conventions: ModelConventions) -> "NormOutputRule":
        return replace(self, conventions=conventions)

    def apply(self, m) -> None:
        conv = self.conventions or derive(m.captured)
        for node, fqn in _params(m, conv.norm_weights):
            for user in m.node_by_name[node].users:
                if user.name not in m.strategies or m.captured.is_backward.get(user.name, False):
                    continue
                m.restrict(user.name, lambda s: _matches(_strs(s.outputs[0]) if s.outputs else None, self.spec),
                           f"recipe {self.label}: output of {fqn}'s norm ({user.name}) placed {_spec_str(self.spec)}")


@dataclass(frozen=True)
class BatchShardRule:
    """Data parallelism: every activation whose dim 0 is the batch (``[b, ...]``) or the flattened
    batch x sequence (``[b*s, ...]``) is sharded on dim 0 on the data axes, forward and backward
    (parameter gradients excluded). Without it a "DDP" plan could gather the activations and
    compute redundantly instead of reducing gradients. Nodes with no such candidate are left free."""

    axes: tuple[int, ...]
    label: str = ""

    def apply(self, m) -> None:
        batch = _input_dim(m.captured, 0)
        if batch is None or not self.axes:
            return
        seq = _input_dim(m.captured, 1)
        leading = {batch} | ({batch * seq} if seq else set())
        grads = set(m.captured.param_grad.values())
        spec = {a: "S(0)" for a in self.axes}
        for n in m.nodes:
            if n.op == "placeholder" or n.name in grads:
                continue
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() < 1 or int(val.shape[0]) not in leading:
                continue
            mask = np.array([bool(s.outputs) and _matches(_strs(s.outputs[0]), spec) for s in m.strategies[n.name]])
            if not mask.any():
                logger.debug("recipe %s: %s has no batch-sharded candidate; left free", self.label, n.name)
                continue
            m.restrict(n.name, mask, f"recipe {self.label}: activation {n.name} batch-sharded on axes {list(self.axes)}")


@dataclass(frozen=True)
class RegionRule:
    """Run the ``local_map`` regions named like ``pattern`` as ``per_axis`` (an alternative per
    mesh axis: ``expert_parallel``, ``context_parallel``, ...); a model without such a region
    makes the recipe not applicable."""

    pattern: str
    per_axis: tuple[str | None, ...]
    label: str = ""

    def apply(self, m) -> None:
        try:
            m.run_regions_as(self.pattern, self.per_axis, name=f"recipe {self.label}: {self.pattern} as "
                             f"{', '.join(str(a) for a in self.per_axis)}")
        except KeyError:
            raise NotApplicable(f"the model has no local_map region {self.pattern!r}") from None


def _spec_str(spec: AxisSpec) -> str:
    return ", ".join(f"{v} on axis {a}" for a, v in sorted(spec.items()))


#: role -> the dimension of the weight a tensor-parallel axis splits (None: kept whole)
_TP_DIM = {"column": 0, "output": 0, "embedding": 0, "row": 1, "norm": None, "tp_replicated": None}


@dataclass(frozen=True)
class TensorParallelRule:
    """Megatron's parameter layout on the last mesh axis, data parallelism on the others.

    Each parameter's role comes from ``conventions`` (None: derived from the graph when applied):
    column-parallel, output and embedding parameters are split on dim 0 over the tensor-parallel
    axis, row-parallel ones on dim 1, norms kept whole and read whole, and so is any parameter
    whose split dimension does not divide by the axis size (see :meth:`layout`).
    ``tp_replicated`` parameters (biases of row-parallel layers, norm biases) are kept whole but
    may be read as partial sums: ATen fuses a row-parallel layer's bias into its matmul
    (``addmm``), and reading the bias as a partial sum is how Megatron's "add the bias after the
    reduction" looks there. Unclassified parameters are left to the solver. On the data axes
    parameters are stored ``data_storage`` ("R": replicated, DDP; "S": sharded, FSDP) and
    gathered for use."""

    data_storage: str
    conventions: ModelConventions | None = None
    label: str = ""

    def with_conventions(self, conventions: ModelConventions) -> "TensorParallelRule":
        return replace(self, conventions=conventions)

    def layout(self, captured, mesh_shape: Sequence[int]) -> tuple[dict[str, tuple[str, int | None]], list[str]]:
        """(FQN -> (role, split dim or None), notes) for every classified parameter; raises
        :class:`NotApplicable` when the model has no linear layer to split."""
        conv = self.conventions or derive(captured)
        tp_size = int(mesh_shape[-1])
        vals = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
        out: dict[str, tuple[str, int | None]] = {}
        notes: list[str] = []
        for node, fqn in captured.param_fqn.items():
            role = conv.role(fqn)
            if not role:
                continue
            shape = tuple(getattr(vals.get(node), "shape", ()))
            dim = conv.split_dim(fqn, len(shape))  # _TP_DIM, swapped for weights stored [in, out]
            if dim is not None and (dim >= len(shape) or shape[dim] % tp_size):
                notes.append(f"{fqn} ({role}, shape {'x'.join(map(str, shape))}) kept whole on the tensor-parallel "
                             f"axis: dim {dim} does not divide by {tp_size}")
                dim = None
            out[fqn] = (role, dim)
        for fqn in sorted(_fused_bias_weights(captured, out)):
            notes.append(f"{fqn} (row, read by a matmul that adds a bias kept whole) stored split on the tensor-"
                         "parallel axis, its use left to the solver: the fused bias would have to be read as a "
                         "partial sum, and apmodel prices no Replicate -> Partial")
        if not any(role in ("column", "row") for role, _ in out.values()):
            raise NotApplicable(f"the model has no column- or row-parallel linear layers under its conventions "
                                f"({conv.source})")
        return out, notes

    def apply(self, m) -> None:
        mesh = m.mesh_shape
        tp = len(mesh) - 1
        layout, notes = self.layout(m.captured, mesh)
        for note in notes:
            logger.info("recipe %s: %s", self.label, note)
        dstore = {a: self.data_storage for a in range(tp)}
        duse = {a: "R" for a in range(tp)}
        fused = _fused_bias_weights(m.captured, layout)
        for node, fqn in m.captured.param_fqn.items():
            if fqn not in layout:
                continue
            role, dim = layout[fqn]
            if dim is not None:
                use = duse if fqn in fused else {**duse, tp: f"S({dim})"}
                _restrict_param(m, node, fqn, {**dstore, tp: f"S({dim})"}, use, self.label)
                continue
            # kept whole on the tensor-parallel axis (FSDP shards even small parameters on every
            # axis: then the policy decides the storage and the recipe only how they are read)
            storage = _all(mesh, "R") if self.data_storage == "R" else {}
            use = duse if role == "tp_replicated" else _all(mesh, "R")
            _restrict_param(m, node, fqn, storage, use, self.label)


def _fused_bias_weights(captured, layout: Mapping[str, tuple[str, int | None]]) -> set[str]:
    """Split row-parallel weights read directly by an op that also reads a ``tp_replicated``
    parameter (``addmm(bias, x, W)`` with W stored ``[in, out]``, Hugging Face's ``Conv1D``).

    Their partial-sum output needs the bias as a partial sum too, which a replicated bias only
    becomes by Replicate -> Partial, a transition apmodel does not price (see
    ``costmodels.redistribution``); the recipe then fixes their storage only, as it does in effect
    for ``[out, in]`` weights, whose direct reader is the transpose."""
    fqn_of = captured.param_fqn
    nodes = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    out: set[str] = set()
    for node, fqn in fqn_of.items():
        role, dim = layout.get(fqn, ("", None))
        if role != "row" or dim is None:
            continue
        for user in nodes[node].users:
            others = [a for a in user.all_input_nodes if a.name in fqn_of and a.name != node]
            if any(layout.get(fqn_of[a.name], ("", None))[0] == "tp_replicated" for a in others):
                out.add(fqn)
    return out


@dataclass(frozen=True)
class Recipe:
    """A hand-written parallelisation recipe as apmodel constraints (see the module docstring)."""

    name: str
    title: str
    param_policy: str
    make: Callable[[tuple[int, ...]], list[Any]]
    replicate_axes: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda mesh: ()
    min_axes: int = 1
    #: True when the last axis is tensor parallel (the batch is split over the other axes only)
    tensor_parallel: bool = False
    #: True when the axis before the tensor-parallel one splits the sequence (not the batch)
    context_parallel: bool = False
    #: region-name glob the recipe places (expert or attention regions); it applies to models
    #: that have one (:meth:`applies_to`)
    needs_region: str | None = None

    def applies_to(self, captured) -> bool:
        """Whether the model has what the recipe places (its ``local_map`` region, if it needs one)."""
        if self.needs_region is None:
            return True
        from apmodel.graph.regions import region_of

        return any(fnmatch.fnmatchcase(r.name, self.needs_region) for r in
                   (region_of(n.target) for n in captured.gm.graph.nodes if n.op == "call_function") if r is not None)

    def data_degree(self, mesh_shape: Sequence[int]) -> int:
        """How many ways the batch is split (product of the data-parallel axes)."""
        axes = mesh_shape[:len(mesh_shape) - int(self.tensor_parallel) - int(self.context_parallel)]
        return int(np.prod(axes)) if len(axes) else 1

    def constraints(self, mesh_shape: Sequence[int], conventions: ModelConventions | None = None) -> list[Any]:
        """The recipe's constraints on ``mesh_shape``; rules that read the model's parts use
        ``conventions`` (None: each derives them from the graph it is applied to)."""
        mesh_shape = tuple(mesh_shape)
        if len(mesh_shape) < self.min_axes:
            raise NotApplicable(
                f"needs a mesh with >= {self.min_axes} axes (the batch is sharded on axis 0, tensor parallelism on the last axis)")
        rules = self.make(mesh_shape)
        if conventions is not None:
            rules = [r.with_conventions(conventions) if hasattr(r, "with_conventions") else r for r in rules]
        return rules


def _all(mesh, tok):
    return {a: tok for a in range(len(mesh))}


def _ddp(mesh):
    return [ParamRule(("*",), storage=_all(mesh, "R"), use=_all(mesh, "R"), label="ddp"),
            BatchShardRule(tuple(range(len(mesh))), label="ddp")]


def _fsdp(mesh):
    # storage: the full_shard policy (every parameter sharded as far as it can be); use: gathered
    return [ParamRule(("*",), use=_all(mesh, "R"), label="fsdp"), BatchShardRule(tuple(range(len(mesh))), label="fsdp")]


def _hsdp(mesh):
    return [ParamRule(("*",), use=_all(mesh, "R"), label="hsdp"), BatchShardRule(tuple(range(len(mesh))), label="hsdp")]


def _tp_rules(mesh, label: str, *, data_storage: str, sequence_parallel: bool) -> list[Any]:
    """Megatron-style tensor parallelism on the last axis; data parallelism on the others.

    ``data_storage``: "R" (DDP, classic Megatron) or "S" (FSDP on the data axes)."""
    tp = len(mesh) - 1
    return [TensorParallelRule(data_storage, label=label), BatchShardRule(tuple(range(tp)), label=label),
            NormOutputRule({tp: "S(1)" if sequence_parallel else "R"}, label=label)]


#: the routed experts' weights of apmodel's MoE models (models.moe)
EXPERT_WEIGHTS = ("*.experts.w1", "*.experts.w2", "*.experts.w3")


def _fsdp_ep(mesh):
    """FSDP on every axis, the routed experts expert-parallel on the last axis (all-to-all there)
    and data parallel on the others (their weights gathered over those axes, FSDP)."""
    n = len(mesh)
    return [ParamRule(("*",), use=_all(mesh, "R"), exclude=EXPERT_WEIGHTS, label="fsdp_ep"),
            BatchShardRule(tuple(range(n)), label="fsdp_ep"),
            RegionRule("routed_experts_*", ("data_parallel",) * (n - 1) + ("expert_parallel",), label="fsdp_ep")]


def _fsdp_tp_ep(mesh):
    """torchtitan's FSDP + TP + EP with expert-tensor-parallel degree 1: Megatron TP with sequence
    parallel on the last axis, the routed experts expert-parallel over the same ranks (each token
    shard's tokens travel to their experts' ranks there), FSDP and data parallel on the others."""
    n = len(mesh)
    return _tp_rules(mesh, "fsdp_tp_ep", data_storage="S", sequence_parallel=True) + [
        RegionRule("routed_experts_*", ("data_parallel",) * (n - 1) + ("expert_parallel",), label="fsdp_tp_ep")]


def _fsdp_tp_cp(mesh):
    """torchtitan's FSDP + TP + CP: Megatron TP with sequence parallel on the last axis
    (attention split by heads there), context parallel on the axis before it (the sequence split,
    attention the context-parallel region), FSDP and data parallel on the others."""
    n = len(mesh)
    tp, cp = n - 1, n - 2
    return [TensorParallelRule("S", label="fsdp_tp_cp"), BatchShardRule(tuple(range(cp)), label="fsdp_tp_cp"),
            NormOutputRule({cp: "S(1)", tp: "S(1)"}, label="fsdp_tp_cp"),
            RegionRule("attention_*", ("batch",) * cp + ("context_parallel", "heads"), label="fsdp_tp_cp")]


RECIPES: tuple[Recipe, ...] = (
    Recipe("ddp", "DDP (parameters replicated)", "free", _ddp),
    Recipe("fsdp", "FSDP / ZeRO-3 (all axes)", "full_shard", _fsdp),
    Recipe("hsdp", "HSDP (replicate axis 0, shard the rest)", "full_shard", _hsdp,
           replicate_axes=lambda mesh: (0,), min_axes=2),
    Recipe("megatron_tp", "Megatron TP (last axis) + DDP", "free",
           lambda mesh: _tp_rules(mesh, "megatron_tp", data_storage="R", sequence_parallel=False), min_axes=2,
           tensor_parallel=True),
    Recipe("megatron_tp_sp", "Megatron TP + sequence parallel + DDP", "free",
           lambda mesh: _tp_rules(mesh, "megatron_tp_sp", data_storage="R", sequence_parallel=True), min_axes=2,
           tensor_parallel=True),
    Recipe("fsdp_tp", "FSDP + TP + sequence parallel (torchtitan 2D)", "full_shard",
           lambda mesh: _tp_rules(mesh, "fsdp_tp", data_storage="S", sequence_parallel=True), min_axes=2,
           tensor_parallel=True),
    Recipe("fsdp_ep", "FSDP + expert parallel (last axis)", "full_shard", _fsdp_ep, needs_region="routed_experts_*"),
    Recipe("fsdp_tp_ep", "FSDP + TP + EP (EP on the TP axis)", "full_shard", _fsdp_tp_ep, min_axes=2,
           tensor_parallel=True, needs_region="routed_experts_*"),
    Recipe("fsdp_tp_cp", "FSDP + TP + CP (CP before the TP axis)", "full_shard", _fsdp_tp_cp, min_axes=2,
           tensor_parallel=True, context_parallel=True, needs_region="attention_*"),
)


def get(name: str) -> Recipe:
    for r in RECIPES:
        if r.name == name:
            return r
    raise ValueError(f"unknown recipe {name!r}; known: {[r.name for r in RECIPES]}")


def within_default_space(recipe: Recipe) -> bool:
    """True when the planner's default search (full_shard, nothing replicated) contains the recipe."""
    return recipe.param_policy == "full_shard" and not recipe.replicate_axes((2, 2))


# ------------------------------------------------------------------------------------ pricing
def param_bytes_per_device(plan, captured, itemsize: int) -> float:
    """Bytes of parameters one device stores under ``plan`` (the largest shard of each)."""
    total = 0.0
    nodes = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    for node, fqn in captured.param_fqn.items():
        val = nodes[node].meta["val"]
        shape = pl.local_shape(tuple(val.shape), plan.param_placements[fqn], plan.mesh_shape)
        total += float(np.prod(shape)) * itemsize
    return total


@dataclass
class RecipeResult:
    name: str
    title: str
    param_policy: str
    objective_us: float | None = None
    compute_us: float | None = None
    comm_us: float | None = None
    param_bytes: float | None = None
    status: str = "ok"           # "ok" | "n/a" | "infeasible"
    reason: str = ""
    notes: list[str] = field(default_factory=list)  # where the recipe had to depart from its letter
    seconds: float = 0.0
    plan: Any = None


def _input_dim(captured, dim: int) -> int | None:
    """Size of ``dim`` of the first model input that has it (dim 0: the global batch; dim 1 of
    tokens ``[b, s]``: the sequence length), if any."""
    nodes = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    for name, _idx in sorted(captured.input_index.items(), key=lambda kv: kv[1]):
        val = nodes[name].meta.get("val")
        if getattr(val, "dim", lambda: 0)() > dim:
            return int(val.shape[dim])
    return None


def run(recipe: Recipe, captured, strategies, cost, options: PlanOptions | None = None, *, itemsize: int = 2,
        conventions: ModelConventions | None = None, **option_values: Any) -> RecipeResult:
    """Price ``recipe`` on a capture: build its constrained model, solve, decode.

    ``options`` (or their keywords, e.g. ``solver="highs"``) are the planning run's; the recipe
    sets the parameter storage policy and the replicated axes itself. ``conventions``: the
    model's parts (None: derived from ``captured``, :func:`apmodel.graph.conventions.derive`)."""
    from apmodel.problem.placement_model import ConstraintConflict

    options = make_options(options, **option_values)
    res = RecipeResult(recipe.name, recipe.title, recipe.param_policy)
    mesh = tuple(cost.mesh_shape)
    t0 = time.perf_counter()
    try:
        cons = recipe.constraints(mesh, conventions or derive(captured))
        for rule in cons:
            if hasattr(rule, "layout"):
                res.notes += rule.layout(captured, mesh)[1]
        batch = _input_dim(captured, 0)
        degree = recipe.data_degree(mesh)
        if batch is not None and batch % degree:
            raise NotApplicable(f"the global batch {batch} does not split over the {degree} data-parallel ranks")
    except NotApplicable as e:
        res.status, res.reason = "n/a", str(e)
        return res
    try:
        forced = options.replace(param_policy=recipe.param_policy, replicate_axes=tuple(recipe.replicate_axes(mesh)),
                                 param_memory_fraction=None, param_budget_ratio=None)
        pm = placement_model(captured, strategies, cost, forced, constraints=cons)
        plan = solve_model(pm, forced, workload={"recipe": recipe.name})
    except (ConstraintConflict, solvers.Infeasible) as e:
        res.status, res.reason = "infeasible", str(e)
        res.seconds = time.perf_counter() - t0
        return res
    except KeyError as e:  # a glob that matches nothing in this model
        res.status, res.reason = "n/a", str(e)
        return res
    except NotApplicable as e:  # a rule that needs a part the model lacks (a local_map region)
        res.status, res.reason = "n/a", str(e)
        return res
    if not np.isfinite(plan.objective_us):
        res.status, res.reason = "infeasible", "the solver found no finite-cost plan within the recipe"
        return res
    res.objective_us, res.compute_us, res.comm_us = plan.objective_us, plan.compute_us, plan.comm_us
    res.param_bytes = param_bytes_per_device(plan, captured, itemsize)
    res.plan = plan
    res.seconds = time.perf_counter() - t0
    logger.info("recipe %s: %.1f µs (%.2f s)", recipe.name, plan.objective_us, res.seconds)
    return res


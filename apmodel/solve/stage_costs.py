"""A solved plan read per pipeline unit: what each repeated layer, the part before the layers (the
embedding) and the part after them (final norm, output projection, loss) cost per step, forward and
backward, and what each holds in memory; and what crosses each boundary between layers.

A pipeline stage is a contiguous run of layers (the first stage also runs the part before, the last
the part after), so the price of any stage split is a sum of these units. The units come from one
SPMD plan of the whole model on the stage mesh (:mod:`apmodel.solve.pipeline`): identical layers are
planned alike there (one decision variable per repeated layer), which is what one plan per stage
would give inside the stages.

How nodes are assigned:

* a node inside a repeated layer (its module stack names ``layers.N``, after the model's layer
  pattern, :func:`apmodel.graph.conventions.layer_pattern_from_names`) belongs to layer ``N``;
* another forward node belongs to the part after the layers when it reads (through any chain of
  forward nodes) a layer's output, else to the part before; another backward node belongs to the
  part before when it reads (through backward nodes) a layer's backward, else to the part after
  (the loss's backward runs first, the embedding's last);
* a parameter belongs to its layer by name, else to the unit of the nodes that read it; a graph
  input to the unit that reads it.

Prices are those of :func:`apmodel.result.plans.price` (the sum over units is the plan's objective):
compute by node, redistributions by the edge's consumer (a gradient's reduction by its
parameter). The weights' traffic is kept apart from the rest, since a pipeline pays it per step
rather than per microbatch (:mod:`apmodel.solve.pipeline`): ``gather_us`` the parameters' gathers
(forward and backward, out of a parameter or a view or cast of it), ``gather_once_us`` the
forward's gathers alone (what gathering once and keeping the result costs), ``reduce_us`` the
gradients' reductions (:meth:`apmodel.problem.placement_model.PlacementModel.is_bucketed` tells
them from activations' collectives). Memory is :class:`apmodel.problem.memory.MemoryModel`'s per
unit: parameter, gradient and optimizer bytes; activations saved for the backward of one step (one
microbatch); ``gathered_bytes`` the parameters as the forward's gathers leave them (what keeping
them gathered holds); ``unreduced_grad_bytes`` the gradients before their reduction (what
accumulating them over microbatches holds). ``weight_us``: the part of the backward only the
parameters' gradients need (:func:`weight_only_nodes`), what a split backward runs in ``W``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from apmodel.graph.conventions import ModelConventions, layer_pattern_from_names
from apmodel.problem.clustering import local_signature
from apmodel.problem.memory import OPTIMIZER_STATE_COPIES
from apmodel.result.cost_labels import node_labels
from apmodel.result.plans import planned_edges

if TYPE_CHECKING:
    import torch.fx as fx

    from apmodel.candidates.strategies import Strategy
    from apmodel.problem.placement_model import PlacementModel

#: Unit labels of the parts outside the repeated layers.
PRE, POST = "pre", "post"
#: The fields of :class:`UnitCost` a stage sums over its units.
_SUMMED = ("forward_us", "backward_us", "gather_us", "reduce_us", "state_bytes", "activation_bytes", "gather_once_us",
           "gathered_bytes", "unreduced_grad_bytes", "weight_us")


class NoRepeatedLayers(ValueError):
    """The model has no repeated layers (``layers.N``-style parameter names) to cut into stages."""


@dataclass(frozen=True)
class UnitCost:
    """One unit of a pipeline: µs per step (of the plan's batch) and bytes per device."""

    name: str
    forward_us: float
    backward_us: float
    gather_us: float
    """parameter gathers, forward and backward (included in forward_us / backward_us)"""
    reduce_us: float
    """gradient reductions (included in backward_us)"""
    state_bytes: float
    """parameters, gradients and optimizer state"""
    activation_bytes: float
    """forward values the backward reads"""
    gather_once_us: float = 0.0
    """the forward's parameter gathers alone: gathering once and keeping the result"""
    gathered_bytes: float = 0.0
    """the parameters as gathered for the forward, per device"""
    unreduced_grad_bytes: float = 0.0
    """the gradients before their reduction, per device"""
    weight_us: float = 0.0
    """the backward's weight side (included in backward_us, reductions excluded): compute, and
    activations' redistributions, of the backward nodes no backward of an earlier unit reads
    (:func:`weight_only_nodes`), what a split backward's ``W`` runs"""

    @property
    def total_us(self) -> float:
        return self.forward_us + self.backward_us

    @property
    def weight_comm_us(self) -> float:
        """parameter gathers and gradient reductions"""
        return self.gather_us + self.reduce_us


@dataclass(frozen=True)
class StepUnits:
    """Every unit of one plan, in pipeline order, and what crosses between layers."""

    pre: UnitCost
    layers: tuple[UnitCost, ...]
    post: UnitCost
    boundary_bytes: tuple[float, ...]
    """``boundary_bytes[i]``: bytes per device of the input-dependent forward values made at or
    before layer ``i`` and read after it (the activation a stage ending at layer ``i`` sends; the
    last entry, after the last layer, is what the head reads), each at :attr:`boundary_placements`
    (a partial sum counted reduced: replicated, the same bytes)"""
    transient_bytes: float
    """the plan's largest transient (peak less the linear terms), bytes per device"""
    boundary_placements: tuple[tuple[str, ...] | None, ...] = ()
    """``boundary_placements[i]``: the placement (strings, one per stage-mesh axis) of the largest
    value crossing boundary ``i`` as the plan leaves it, a partial sum (``"P"``) replaced by
    ``"R"`` (the sender reduces it: a pipeline sends no partial sums); None where nothing crosses.
    The pipeline lowering sends each rank's local shard at this placement
    (:mod:`apmodel.lowering.pipeline`); empty: not read"""

    def stage(self, first: int, last: int, *, with_pre: bool, with_post: bool) -> UnitCost:
        """The sum of layers ``first .. last`` (inclusive), with the part before / after."""
        units = list(self.layers[first:last + 1]) + ([self.pre] if with_pre else []) + ([self.post] if with_post else [])
        return UnitCost(f"layers {first}-{last}", **{f: sum(getattr(u, f) for u in units) for f in _SUMMED})

    @property
    def total_us(self) -> float:
        return self.pre.total_us + self.post.total_us + sum(u.total_us for u in self.layers)

    def with_layers(self, n_layers: int, stand_ins: Sequence[int] | None = None) -> "StepUnits":
        """The units of the same model with ``n_layers`` repeated layers, read off this plan of
        fewer: layer ``i`` costs what this plan's layer ``stand_ins[i]`` does (a layer of the same
        kind; None: ``min(i, L - 1)``, the last one here standing for every layer it lacks), and so
        do boundaries."""
        k = len(self.layers)
        of = list(stand_ins) if stand_ins is not None else [min(i, k - 1) for i in range(n_layers)]
        if len(of) != n_layers or any(not 0 <= j < k for j in of):
            raise ValueError(f"with_layers: {n_layers} layers need a stand-in each among this plan's {k}, got {of}")
        placements = self.boundary_placements
        return replace(self, layers=tuple(self.layers[j] for j in of),
                       boundary_bytes=tuple(self.boundary_bytes[j] for j in of),
                       boundary_placements=tuple(placements[j] for j in of) if placements else ())


def count_layers(fqns: Iterable[str]) -> int:
    """How many repeated layers parameters named ``fqns`` hold (0 without a layer pattern)."""
    fqns = list(fqns)
    pattern = layer_pattern_from_names(fqns)
    if pattern is None:
        return 0
    conv = ModelConventions(layer_pattern=pattern)
    return len({i for f in fqns if (i := conv.layer_index(f)) is not None})


def _layer_of_stack(conv: ModelConventions, node: "fx.Node") -> int | None:
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node.meta.get(key)
        if stack:
            for path, _ in reversed(list(stack.values())):
                index = conv.layer_index(str(path))
                if index is not None:
                    return index
            return None
    return None


def assign_units(pmodel: "PlacementModel") -> tuple[dict[str, int], int]:
    """Node name -> unit index (-1 the part before the layers, 0..L-1 a layer, L the part after)
    and the number of layers L (see the module docstring)."""
    cap = pmodel.captured
    fqns = list(cap.param_fqn.values())
    pattern = layer_pattern_from_names(fqns)
    if pattern is None:
        raise NoRepeatedLayers("the model has no repeated layers (parameters named like layers.N.*) to split into "
                               "pipeline stages")
    conv = ModelConventions(layer_pattern=pattern)
    indices = sorted({i for f in fqns if (i := conv.layer_index(f)) is not None})
    if indices != list(range(len(indices))):
        raise NoRepeatedLayers(f"the repeated layers are numbered {indices[:8]}...: expected 0, 1, 2, ... in order")
    n_layers = len(indices)
    is_bwd = cap.is_backward
    labels = node_labels(pmodel.nodes, is_bwd)  # the plan's per-layer booking
    unit: dict[str, int] = {}
    after_fwd: set[str] = set()   # forward nodes downstream of a layer
    after_bwd: set[str] = set()   # backward nodes downstream of a layer's backward
    post_labels: set[str] = set()
    fwd_labels: set[str] = set()
    rest: list["fx.Node"] = []
    for n in pmodel.nodes:
        if n.op == "placeholder":
            continue
        layer = _layer_of_stack(conv, n)
        if layer is None:
            layer = conv.layer_index(labels[n.name])
        backward = bool(is_bwd.get(n.name))
        downstream = any(a.name in (after_bwd if backward else after_fwd) for a in n.all_input_nodes)
        if layer is not None:
            unit[n.name] = layer
            (after_bwd if backward else after_fwd).add(n.name)
            continue
        if downstream:
            (after_bwd if backward else after_fwd).add(n.name)
        if not backward:
            fwd_labels.add(labels[n.name])
            if downstream:
                post_labels.add(labels[n.name])
        rest.append(n)
    for n in rest:  # outside the layers: the part after them if its label's forward follows a layer
        label = labels[n.name]
        if label in fwd_labels:
            unit[n.name] = n_layers if label in post_labels else -1
        else:  # a backward op of no forward label: after the layers' backward is the embedding's side
            unit[n.name] = -1 if n.name in after_bwd else n_layers
    for n in pmodel.nodes:  # placeholders: parameters by name, others with their first reader
        if n.op != "placeholder":
            continue
        fqn = cap.param_fqn.get(n.name)
        index = None if fqn is None else conv.layer_index(fqn)
        if index is None:
            readers = [unit[u.name] for u in n.users if u.name in unit]
            index = readers[0] if readers else (n_layers if is_bwd.get(n.name) else -1)
        unit[n.name] = index
    return unit, n_layers


def weight_only_nodes(pmodel: "PlacementModel", unit: Mapping[str, int]) -> set[str]:
    """The backward nodes on the weights' side of their unit's backward: no backward node of an
    earlier unit (``unit``: :func:`assign_units`) reads them, through any chain of backward nodes.
    The rest of a unit's backward makes the gradient the earlier units read (a stage's input
    gradient, ``I``); these make only its parameters' gradients (the weight-gradient matmuls, the
    norms' weight sums: ``W``), as :mod:`apmodel.lowering.weight_split` cuts a stage's backward
    graph. The part before the layers reads no earlier unit: all of its backward is here."""
    is_bwd = pmodel.captured.is_backward
    lowest: dict[str, int] = {}  # backward node -> the lowest unit among it and the backward nodes reading it
    for n in reversed(list(pmodel.nodes)):
        if not is_bwd.get(n.name) or n.op == "placeholder":
            continue
        low = unit[n.name]
        for user in n.users:
            if user.name in lowest:
                low = min(low, lowest[user.name])
        lowest[n.name] = low
    return {name for name, low in lowest.items() if low >= unit[name]}


def step_units(pmodel: "PlacementModel", node_strategy: Mapping[str, "Strategy"]) -> StepUnits:
    """The per-unit costs and bytes of the plan ``node_strategy`` of ``pmodel``."""
    unit, n_layers = assign_units(pmodel)
    weight_side = weight_only_nodes(pmodel, unit)
    cap, cost = pmodel.captured, pmodel.cost
    is_bwd = cap.is_backward
    fwd: dict[int, float] = defaultdict(float)
    bwd: dict[int, float] = defaultdict(float)
    gather: dict[int, float] = defaultdict(float)
    gather_once: dict[int, float] = defaultdict(float)
    reduce: dict[int, float] = defaultdict(float)
    gathered: dict[int, float] = defaultdict(float)
    unreduced: dict[int, float] = defaultdict(float)
    weight: dict[int, float] = defaultdict(float)
    seen: set[Any] = set()  # (value, placement) of gathered parameters and unreduced gradients, counted once
    memo: dict[Any, float] = {}
    for n in pmodel.nodes:
        s = node_strategy[n.name]
        key = (local_signature(n, None, False), s)
        c = memo.get(key)
        if c is None:
            c = memo[key] = float(cost.compute_vector(n, [s])[0])
        (bwd if is_bwd.get(n.name) else fwd)[unit[n.name]] += c
        if n.name in weight_side:
            weight[unit[n.name]] += c
    for e, val, src, dst in planned_edges(pmodel, node_strategy):
        gradient = pmodel.is_param_gradient(e)
        weights = pmodel.is_bucketed(e)  # a parameter's gather or its gradient's reduction
        us = sum(step[3] for step in cost.redistribution_steps(tuple(val.shape), val.dtype, src, dst, gradient=gradient,
                                                               bucketed=weights))
        if weights:  # each time it runs, not its share of a step (CostContext.weight_microbatches)
            us *= cost.weight_microbatches
        if not us:
            continue
        backward = bool(is_bwd.get(e.producer) or is_bwd.get(e.consumer))
        u = unit[e.consumer]
        (bwd if backward else fwd)[u] += us
        if not weights:
            if e.consumer in weight_side:
                weight[u] += us
            continue
        producer = pmodel.node_by_name[e.producer]
        if gradient:
            reduce[u] += us
            if (e.producer, e.out_index, src) not in seen:
                seen.add((e.producer, e.out_index, src))
                unreduced[u] += pmodel.memory.local_bytes(producer, src, e.out_index)
            continue
        gather[u] += us
        if not backward:
            gather_once[u] += us
            if (e.producer, e.out_index, dst) not in seen:
                seen.add((e.producer, e.out_index, dst))
                gathered[u] += pmodel.memory.local_bytes(producer, dst, e.out_index)
    for name, want in pmodel.boundary_outputs.items():
        val = pmodel.node_by_name[name].meta["val"]
        have = pmodel.output_strs(node_strategy[name], 0)
        if have is not None:
            fwd[unit[name]] += sum(step[3] for step in cost.redistribution_steps(tuple(val.shape), val.dtype, have, want))

    mem = pmodel.memory
    copies = OPTIMIZER_STATE_COPIES[mem.optimizer]
    state: dict[int, float] = defaultdict(float)
    for node in cap.param_fqn:
        b = mem.local_bytes(pmodel.node_by_name[node], node_strategy[node].outputs[0], state=True)
        state[unit[node]] += b * (1 + (1 + copies if node in cap.param_grad else 0))
    acts: dict[int, float] = defaultdict(float)
    for n in mem.saved:
        acts[unit[n.name]] += mem.local_bytes(n, node_strategy[n.name].outputs[0])

    def make(u: int, name: str) -> UnitCost:
        return UnitCost(name, fwd[u], bwd[u], gather[u], reduce[u], state[u], acts[u], gather_once[u], gathered[u],
                        unreduced[u], weight[u])

    estimate = mem.estimate(node_strategy)
    transient = estimate.peak_bytes - (estimate.params_bytes + estimate.grads_bytes + estimate.optimizer_bytes
                                       + estimate.activations_bytes)
    boundary_bytes, boundary_placements = _boundaries(pmodel, node_strategy, unit, n_layers)
    return StepUnits(
        pre=make(-1, PRE),
        layers=tuple(make(i, f"layer {i}") for i in range(n_layers)),
        post=make(n_layers, POST),
        boundary_bytes=boundary_bytes,
        transient_bytes=max(0.0, transient),
        boundary_placements=boundary_placements,
    )


def _boundaries(pmodel: "PlacementModel", node_strategy: Mapping[str, "Strategy"], unit: Mapping[str, int],
                n_layers: int) -> tuple[tuple[float, ...], tuple[tuple[str, ...] | None, ...]]:
    """Per boundary after layer ``i``: local bytes of the forward values that depend on a graph
    input, are made in a unit up to ``i`` and read in a unit after it (``i = L - 1``: by the head),
    and the placement of the largest of them (partial sums as replicated; see
    :attr:`StepUnits.boundary_placements`)."""
    cap = pmodel.captured
    is_bwd = cap.is_backward
    data: set[str] = {name for name, role in cap.roles.items() if role == "input"}
    crossing: list[set[tuple[str, int]]] = [set() for _ in range(n_layers)]
    for n in pmodel.nodes:
        if is_bwd.get(n.name) or n.op == "placeholder":
            continue
        if any(a.name in data for a in n.all_input_nodes):
            data.add(n.name)
    for e in pmodel.edges:
        if e.slot < 0 or e.producer not in data or is_bwd.get(e.consumer):
            continue
        lo, hi = unit[e.producer], unit[e.consumer]
        for i in range(max(lo, 0), min(hi, n_layers)):
            crossing[i].add((e.producer, e.out_index))
    sizes: list[float] = []
    placements: list[tuple[str, ...] | None] = []
    for values in crossing:
        total, largest, where = 0.0, -1.0, None
        for name, k in sorted(values):
            node = pmodel.node_by_name[name]
            placed = node_strategy[name].outputs[k] if k < len(node_strategy[name].outputs) else None
            nbytes = pmodel.memory.local_bytes(node, placed, k)
            total += nbytes
            strs = pmodel.output_strs(node_strategy[name], k)
            if strs is not None and nbytes > largest:
                largest, where = nbytes, tuple("R" if x.startswith("P") else x for x in strs)
        sizes.append(total)
        placements.append(where)
    return tuple(sizes), tuple(placements)

"""Hand-written parallel regions (``local_map``) that the planner plans around (paper §3.4).

A region is a user function that runs on local shards with declared placements::

    expert_mlp = apmodel.local_map(
        mlp, name="expert_mlp",
        in_placements=("S(0)", "R", "R"),   # tokens row-sharded, both weights whole
        out_placements=("S(0)",),
    )
    y = expert_mlp(x, w1, w2)               # inside the model's forward

or, with several named ways to shard it on a mesh axis (the planner picks one per axis)::

    moe = apmodel.local_map(routed_experts, name="moe", alternatives={
        "expert_parallel": (("S(0)", "S(0)", "S(0)"), ("S(0)",)),  # tokens and experts split
        "data_parallel": (("S(0)", "S(0)", "R"), ("S(0)",)),        # tokens split, experts whole
    })

It becomes one operator of the joint graph (``apmodel_region::<name>``, forward) and one more for
its backward (``<name>_backward``, which recomputes the region and differentiates it locally), so
the capture, the placement model, constraints (by the node name ``<name>``), explain and diff see
it as a single node. Its candidate strategies are, on every mesh axis independently, one of the
alternatives or everything replicated (running the function on whole tensors, which is always
correct), registered with DTensor's ``register_sharding``; the backward's are derived: each
gradient takes its input's placement, except a replicated input next to a sharded one on the same
axis, whose local gradient is a partial sum.

The function learns on which ranks an alternative runs from :func:`region_comm` (a
:class:`RegionComm` over the mesh axes the plan gives that alternative) and issues its own
collectives through it (``all_gather``, ``all_to_all``, differentiable). It is priced by tracing
the function at the local shapes of each strategy: every op it runs by the compute model, and
every collective it issues through :class:`RegionComm` by the collective model (or the whole
region by ``cost_us``). It is lowered by running the function on the planned local shards.

Regions are registered with ``torch.library`` once per name for the life of the process (the
operator registry is torch's); making one again with the same name and function returns it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from apmodel._torch_private import OpOverload, aliases_first_input, overload_packet

NAMESPACE = "apmodel_region"
_ATTR = "_apmodel_region"  # where the LocalRegion hangs on its operator packet
SHARDED = "sharded"  # the name of the one alternative given by in_placements / out_placements


class RegionError(ValueError):
    """A ``local_map`` region is declared wrongly; the message names the region."""


def _placement(text: str | Placement, region: str, what: str, *, partial_ok: bool) -> Placement:
    if isinstance(text, Placement):
        p = text
    else:
        s = str(text).strip().upper().replace(" ", "")
        if s == "R":
            p = Replicate()
        elif s in ("P", "P(SUM)"):
            p = Partial()
        elif s.startswith("S(") and s.endswith(")") and s[2:-1].isdigit():
            p = Shard(int(s[2:-1]))
        else:
            raise RegionError(f"local_map {region!r}: {what} placement {text!r} is not R, S(d) or P")
    if not partial_ok and isinstance(p, Partial):
        raise RegionError(f"local_map {region!r}: {what} cannot be partial (P); inputs are R or S(d)")
    return p


@dataclass(frozen=True)
class Alternative:
    """One way to run a region on a mesh axis: its inputs' and outputs' placements there."""

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]

    def backward(self) -> tuple[list[Placement], list[Placement]]:
        """(placements of the input gradients, of the backward's inputs: output gradients then
        the forward inputs) on an axis where this alternative runs."""
        sharded = any(isinstance(p, Shard) for p in (*self.inputs, *self.outputs))
        grad_in = [Partial() if isinstance(p, Replicate) and sharded else p for p in self.inputs]
        # the gradient of a partial output is whole on every rank
        grad_out = [Replicate() if isinstance(p, Partial) else p for p in self.outputs]
        return grad_in, grad_out + list(self.inputs)


# ---------------------------------------------------------------------------------------------
# the region's own collectives
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveRecord:
    """A collective a region issued while it was traced for pricing."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_to_all"
    numel: int  # elements, nccl-tests convention: the gathered output, the scattered input, one rank's buffer
    dtype: torch.dtype
    alternative: str  # over the ranks of this alternative of the region


@dataclass
class RegionComm:
    """The ranks one alternative of a region spans on the planned mesh, and collectives over them.

    ``size`` ranks, this one ``rank`` among them, in the order of the shards (a tensor sharded on
    these axes holds chunk ``rank``). Size 1 — no communication — on one device, when the model is
    traced, and where the plan runs the region another way. While the region is priced ``group``
    is None and ``records`` collects what the function issues (the tensors are meta)."""

    size: int = 1
    rank: int = 0
    axes: tuple[int, ...] = ()
    group: Any = None
    records: list[CollectiveRecord] | None = None
    alternative: str = ""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The shards of every rank concatenated along ``dim`` (differentiable: the gradient is
        reduce-scattered back, the sum of every rank's gradient of the gathered tensor: each
        rank's own outputs' contribution, right when the outputs are sharded; a replicated output
        computed identically on every rank would count its gradient ``size`` times)."""
        return x if self.size == 1 else _AllGather.apply(x, dim, self)

    def all_to_all(self, x: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int]) -> torch.Tensor:
        """Rows of ``x`` (dim 0) sent in blocks, ``send_rows[j]`` to rank ``j``; the result holds
        ``recv_rows[j]`` rows from each rank ``j``, in rank order (differentiable: the gradient
        goes back the same way). While priced, ``recv_rows`` is the caller's expectation."""
        if self.size == 1:
            return x
        if len(send_rows) != self.size or len(recv_rows) != self.size or sum(send_rows) != x.shape[0]:
            raise ValueError(f"all_to_all over {self.size} ranks: send_rows {list(send_rows)} / recv_rows "
                             f"{list(recv_rows)} do not fit {x.shape[0]} rows")
        return _AllToAll.apply(x, [int(r) for r in send_rows], [int(r) for r in recv_rows], self)

    def _record(self, kind: str, numel: int, dtype: torch.dtype) -> None:
        assert self.records is not None  # recording happens while priced (group None), with records
        self.records.append(CollectiveRecord(kind, int(numel), dtype, self.alternative))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, comm: RegionComm) -> torch.Tensor:
        ctx.dim, ctx.comm = dim, comm
        shape = list(x.shape)
        shape[dim] *= comm.size
        if comm.group is None:
            comm._record("all_gather", math.prod(shape), x.dtype)
            return x.new_empty(shape)
        import torch.distributed as dist

        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(comm.size)]
        dist.all_gather(parts, x.contiguous(), group=comm.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        comm, dim = ctx.comm, ctx.dim
        if comm.group is None:
            comm._record("reduce_scatter", grad.numel(), grad.dtype)
            return grad.narrow(dim, 0, grad.shape[dim] // comm.size).clone(), None, None
        import torch.distributed as dist

        # gloo has no reduce-scatter: the sum everywhere, then this rank's chunk
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=comm.group)
        return total.chunk(comm.size, dim=dim)[comm.rank].contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], comm: RegionComm) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.comm = send, recv, comm
        return _all_to_all(x, send, recv, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.comm), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], comm: RegionComm) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = math.prod(x.shape[1:])
    if comm.group is None:
        comm._record("all_to_all", max(sum(send), sum(recv)) * row, x.dtype)
        return out
    import torch.distributed as dist

    dist.all_to_all_single(out, x.contiguous(), recv, send, group=comm.group)
    return out


_SCOPE: contextvars.ContextVar[Mapping[str, RegionComm] | None] = contextvars.ContextVar("apmodel_region_scope",
                                                                                         default=None)


#: While a lowered step is traced: the (local shape, dtype) of each output of the region call
#: being traced, known from the plan (the function itself may size its outputs from data, as a
#: token all-to-all does, which fake tensors cannot run).
_TRACED_OUTPUTS: contextvars.ContextVar[Sequence[tuple[tuple[int, ...], torch.dtype]] | None] = \
    contextvars.ContextVar("apmodel_region_traced_outputs", default=None)


@contextlib.contextmanager
def traced_outputs(outputs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> Iterator[None]:
    """Trace a region's forward as one call whose outputs have these local shapes and dtypes."""
    token = _TRACED_OUTPUTS.set(outputs)
    try:
        yield
    finally:
        _TRACED_OUTPUTS.reset(token)


def region_comm(alternative: str = SHARDED) -> RegionComm:
    """Inside a region's function: the ranks ``alternative`` runs on (size 1 where it does not)."""
    scope = _SCOPE.get()
    comm = None if scope is None else scope.get(alternative)
    return RegionComm() if comm is None else comm


@contextlib.contextmanager
def region_scope(comms: Mapping[str, RegionComm]) -> Iterator[None]:
    """Run a region's function with ``comms`` (alternative name -> its ranks) visible to it."""
    token = _SCOPE.set(comms)
    try:
        yield
    finally:
        _SCOPE.reset(token)


# ---------------------------------------------------------------------------------------------
# the region
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class LocalRegion:
    """A registered region: call it like the function it wraps (tensors in, tensors out)."""

    name: str
    fn: Callable[..., Any]
    alternatives: tuple[Alternative, ...]
    cost_us: Callable[..., float] | None = None
    communicates: bool = True  # the function may issue collectives through region_comm
    _priced: dict = field(default_factory=dict, repr=False)

    @property
    def n_in(self) -> int:
        return len(self.alternatives[0].inputs)

    @property
    def n_out(self) -> int:
        return len(self.alternatives[0].outputs)

    @property
    def op(self) -> OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    @property
    def backward_op(self) -> OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), f"{self.name}_backward").default

    def __call__(self, *tensors: torch.Tensor) -> Any:
        if len(tensors) != self.n_in:
            raise RegionError(f"local_map {self.name!r} takes {self.n_in} tensors, got {len(tensors)}")
        out = self.op(*tensors)  # one Tensor, or a tuple for several outputs (the op's schema)
        return out if self.n_out == 1 else tuple(out)

    # ---------------------------------------------------------------- local semantics
    def _run(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        out = self.fn(*tensors)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != self.n_out or not all(isinstance(o, torch.Tensor) for o in outs):
            raise RegionError(f"local_map {self.name!r}: the function returned {len(outs)} values, "
                              f"{self.n_out} tensors were declared")
        return outs

    def _vjp(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Gradients of the inputs, from the output gradients (first) and the inputs: the region
        recomputed under autograd and differentiated (in this thread)."""
        grads, inputs = args[:self.n_out], args[self.n_out:]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
            outs = self._run(*leaves)
            wrt = [x for x in leaves if x.requires_grad]
            got = dict(zip(map(id, wrt), torch.autograd.grad(outs, wrt, grads, allow_unused=True), strict=True))
        return [torch.zeros_like(x) if got.get(id(x)) is None else got[id(x)] for x in leaves]

    def _backward(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_vjp` as the backward operator's kernel. A kernel runs below the autograd
        dispatch key (inside DTensor's dispatch, for one), where this thread's dispatch state
        records no graph; a fresh thread starts clean (on the same device stream, with this
        thread's region scope) and shares the tensors."""
        stream = torch.cuda.current_stream() if args[0].is_cuda else None
        context = contextvars.copy_context()
        result: list = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    result.append(self._vjp(*args))
            except BaseException as e:  # re-raised in the calling thread
                errors.append(e)

        worker = threading.Thread(target=context.run, args=(run,), name=f"apmodel-region-{self.name}-backward")
        worker.start()
        worker.join()
        if errors:
            raise errors[0]
        return result[0]

    # ---------------------------------------------------------------- strategies (one mesh axis)
    def forward_strategies(self) -> list[tuple[list[Placement], list[Placement]]]:
        """Per mesh axis: (output placements, input placements) the region accepts."""
        R: Placement = Replicate()
        return [([R] * self.n_out, [R] * self.n_in)] + [(list(a.outputs), list(a.inputs)) for a in self.alternatives]

    def backward_strategies(self) -> list[tuple[list[Placement], list[Placement]]]:
        R: Placement = Replicate()
        return [([R] * self.n_in, [R] * (self.n_out + self.n_in))] + [a.backward() for a in self.alternatives]

    def alternative_on_axes(self, inputs: Sequence[Sequence[Placement] | None], *, backward: bool) -> tuple[str | None, ...]:
        """Per mesh axis, the alternative a strategy with input placements ``inputs`` (one
        per-axis tuple per input) runs there; None where everything is replicated."""
        n_axes = len(next(p for p in inputs if p is not None))
        keys = {tuple(map(str, a.backward()[1] if backward else a.inputs)): a.name for a in self.alternatives}
        modes: list[str | None] = []
        for axis in range(n_axes):
            on_axis = tuple(str(p[axis]) if p is not None else "R" for p in inputs)
            if all(isinstance(p[axis], Replicate) for p in inputs if p is not None):
                modes.append(None)
            elif on_axis in keys:
                modes.append(keys[on_axis])
            else:
                raise RegionError(f"local_map {self.name!r}: inputs placed {on_axis} on mesh axis {axis} match none "
                                  f"of its alternatives {[a.name for a in self.alternatives]}")
        return tuple(modes)

    # ---------------------------------------------------------------- pricing
    def time_us(self, cost: Any, local_args: Sequence[Any], *, modes: Sequence[str | None], backward: bool) -> float:
        """Time (µs) of the region (or its backward) on local shards ``local_args``, run as
        ``modes`` (per mesh axis, see :meth:`alternative_on_axes`): ``cost_us(*local_args,
        backward=...)`` when given, else ``cost.compute``'s prices of the ops the function runs,
        traced on the meta device at these shapes, plus ``cost.comm``'s prices of the collectives
        it issues through :func:`region_comm` (memoised). ``cost`` is a
        :class:`apmodel.problem.pricing.CostContext`."""
        tensors = [a for a in local_args if isinstance(a, torch.Tensor)]
        if self.cost_us is not None:
            return float(self.cost_us(*tensors, backward=backward))
        compute_us, collectives, _ = self._price(cost, tensors, tuple(modes), backward)
        return compute_us + sum(us for _, _, us in collectives)

    def collectives(self, cost: Any, local_args: Sequence[Any], *, modes: Sequence[str | None],
                    backward: bool) -> list[tuple[str, tuple[int, ...], float]]:
        """The collectives priced in :meth:`time_us`: (kind, mesh axes, µs) each ([] with ``cost_us``)."""
        if self.cost_us is not None:
            return []
        tensors = [a for a in local_args if isinstance(a, torch.Tensor)]
        return list(self._price(cost, tensors, tuple(modes), backward)[1])

    def working_bytes(self, cost: Any, local_args: Sequence[Any], *, modes: Sequence[str | None],
                      backward: bool) -> float:
        """Bytes (per device) of the most values the function holds at once at these local shapes
        (its intermediates and outputs, not its inputs; views free), from the same trace as
        :meth:`time_us`: gathered keys and values, all-to-all buffers, a backward's recomputed
        forward. 0 with ``cost_us`` (the function may not trace on meta)."""
        if self.cost_us is not None:
            return 0.0
        tensors = [a for a in local_args if isinstance(a, torch.Tensor)]
        return self._price(cost, tensors, tuple(modes), backward)[2]

    def _price(self, cost: Any, tensors: list[torch.Tensor], modes: tuple[str | None, ...],
               backward: bool) -> tuple[float, tuple[tuple[str, tuple[int, ...], float], ...], float]:
        mesh_shape = tuple(cost.mesh_shape)
        axes_of = {name: tuple(i for i, m in enumerate(modes) if m == name) for name in set(modes) if name is not None}
        # the trace depends on the local shapes and each alternative's group size, not on which
        # axes carry it: many strategies share one trace
        sizes = tuple(sorted((name, math.prod(mesh_shape[i] for i in axes)) for name, axes in axes_of.items()))
        key = (backward, cost.dtype, id(cost.compute), sizes, tuple((tuple(t.shape), t.dtype) for t in tensors))
        if key not in self._priced:
            records: list[CollectiveRecord] = []
            comms = {name: RegionComm(size, 0, (), None, records, name) for name, size in sizes}
            with region_scope(comms):
                compute_us, working = _traced_price(self._vjp if backward else self._run, tensors, cost)
            self._priced[key] = (compute_us, tuple(records), working)
        compute_us, records, working = self._priced[key]
        collectives = tuple((r.kind, axes_of[r.alternative],
                             collective_us(cost.comm, r.kind, r.numel * cost.itemsize(r.dtype), axes_of[r.alternative],
                                           mesh_shape)) for r in records)
        return compute_us, collectives, working


def collective_us(comm: Any, kind: str, nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int]) -> float:
    """Price (µs) of one collective over the ranks of several mesh axes, as one stage per axis,
    innermost first: an all-gather (reduce-scatter) of ``nbytes`` gathers the inner axes' share
    first and the outer axes' last; an all-to-all moves the whole buffer once per axis
    (hierarchical all-to-all)."""
    total, done = 0.0, 1
    group = math.prod(mesh_shape[a] for a in axes)
    for axis in sorted(axes, reverse=True):
        done *= mesh_shape[axis]
        stage_bytes = nbytes if kind == "all_to_all" else nbytes * done / group
        total += float(comm.time_us(kind, stage_bytes, axis))
    return total


def _meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    if isinstance(val, (list, tuple)):
        return type(val)(_meta(v) for v in val)
    return val


def _traced_price(fn: Callable, tensors: Sequence[torch.Tensor], cost: Any) -> tuple[float, float]:
    """(µs of the ops ``fn`` runs by ``cost.compute``, bytes of its largest live set) on ``tensors``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*[_meta(t) for t in tensors])
    total = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _meta(a.meta.get("val")))
        us = float(cost.compute.time_us(node.target, tuple(args), dict(kwargs), _meta(node.meta.get("val")),
                                        dtype=cost.dtype))
        if not 0.0 <= us < math.inf:
            raise RegionError(f"compute model priced {node.target} inside a region at {us!r} µs")
        total += us
    return total, _largest_live_bytes(gm, cost.itemsize)


def _largest_live_bytes(gm: torch.fx.GraphModule, itemsize: Callable[[torch.dtype], int]) -> float:
    """Walking the graph in order, the most bytes of op results alive at once: a result lives
    from its op to its last reader (outputs to the end), read directly or through a view of it or
    an element of its tuple (which hold no bytes of their own)."""
    nodes = list(gm.graph.nodes)
    owner: dict[torch.fx.Node, torch.fx.Node] = {}  # a node -> the result whose storage it is
    for n in nodes:
        shares = n.op == "call_function" and (n.target is operator.getitem or aliases_first_input(n))
        owner[n] = owner[n.args[0]] if shares else n
    last_read = {owner[a]: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    dying: dict[int, list[torch.fx.Node]] = {}
    for n, i in last_read.items():
        dying.setdefault(i, []).append(n)
    held: dict[torch.fx.Node, float] = {}
    live = peak = 0.0
    for i, n in enumerate(nodes):
        if n.op == "call_function" and owner[n] is n:
            vals = n.meta.get("val")
            vals = vals if isinstance(vals, (tuple, list)) else (vals,)
            held[n] = float(sum(v.numel() * itemsize(v.dtype) for v in vals if isinstance(v, torch.Tensor)))
            live += held[n]
            peak = max(peak, live)
        for d in dying.get(i, ()):
            live -= held.pop(d, 0.0)
    return peak


def region_of(target: Any) -> LocalRegion | None:
    """The region behind a graph node's target (its forward or backward op), else None."""
    packet = overload_packet(target)
    if packet is None or getattr(target, "namespace", None) != NAMESPACE:
        return None
    return getattr(packet, _ATTR, None)


def is_backward(target: Any) -> bool:
    region = region_of(target)
    return region is not None and target is region.backward_op


def _alternatives(name: str, in_placements: Sequence | None, out_placements: Sequence | None,
                  alternatives: Mapping[str, tuple[Sequence, Sequence]] | None) -> tuple[Alternative, ...]:
    if (alternatives is None) == (in_placements is None and out_placements is None):
        raise RegionError(f"local_map {name!r}: give in_placements and out_placements, or alternatives (not both)")
    declared = dict(alternatives) if alternatives is not None else {SHARDED: (in_placements or (), out_placements or ())}
    if not declared:
        raise RegionError(f"local_map {name!r}: alternatives is empty")
    out: list[Alternative] = []
    for alt, spec in declared.items():
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise RegionError(f"local_map {name!r}: alternative {alt!r} must be (input placements, output placements)")
        ins = tuple(_placement(p, name, f"alternative {alt!r} input {i}", partial_ok=False) for i, p in enumerate(spec[0]))
        outs = tuple(_placement(p, name, f"alternative {alt!r} output {i}", partial_ok=True) for i, p in enumerate(spec[1]))
        if not ins or not outs:
            raise RegionError(f"local_map {name!r} needs at least one input and one output placement")
        if all(isinstance(p, Replicate) for p in (*ins, *outs)):
            raise RegionError(f"local_map {name!r}: alternative {alt!r} replicates everything; that one is implied")
        out.append(Alternative(str(alt), ins, outs))
    if len({(len(a.inputs), len(a.outputs)) for a in out}) > 1:
        raise RegionError(f"local_map {name!r}: alternatives disagree on the number of inputs or outputs")
    seen: dict[tuple, str] = {}
    for a in out:
        key = tuple(map(str, a.inputs))
        if key in seen:
            raise RegionError(f"local_map {name!r}: alternatives {seen[key]!r} and {a.name!r} place the inputs alike; "
                              f"the plan could not tell them apart")
        seen[key] = a.name
    return tuple(out)


def local_map(
    fn: Callable[..., Any],
    *,
    name: str,
    in_placements: Sequence[str | Placement] | None = None,
    out_placements: Sequence[str | Placement] | None = None,
    alternatives: Mapping[str, tuple[Sequence[str | Placement], Sequence[str | Placement]]] | None = None,
    cost_us: Callable[..., float] | None = None,
    communicates: bool = True,
) -> LocalRegion:
    """Declare ``fn`` a parallel region the planner plans around.

    Args:
        fn: a function or a callable object (equal ones share a region: a frozen dataclass
            carrying settings), run on local shards: tensors in (as many as the placements declare, floating point),
            a tensor or a tuple of tensors out. On whole tensors it must compute the
            single-device result (the replicated alternative runs it so). Collectives go through
            ``apmodel.region_comm(alternative)``.
        name: the operator and graph-node name (letters, digits, ``_``), unique in the process;
            constraints select the region by it (``apmodel.fix("<name>", "S(0)S(0)")``).
        in_placements / out_placements: per tensor, its placement on each mesh axis the region
            is sharded over: ``"R"``, ``"S(d)"`` (outputs also ``"P"``, a partial sum); one
            alternative, named ``"sharded"``.
        alternatives: instead, several: name -> (input placements, output placements); the
            planner picks one (or all-replicated) per mesh axis. Their input placements differ.
        cost_us: ``cost_us(*local_tensors, backward=bool) -> µs`` replacing the traced price.
        communicates: False promises that ``fn`` issues no collectives (never calls
            :func:`region_comm`'s ``all_gather`` / ``all_to_all``): the native program then buckets
            and overlaps the plan's own collectives around the region, as it does without regions.
    """
    if not callable(fn):
        raise TypeError(f"local_map: fn must be a function or a callable object run on local shards, "
                        f"got {type(fn).__name__}")
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise RegionError(f"local_map name {name!r} must be an identifier (letters, digits, _)")
    if cost_us is not None and not callable(cost_us):
        raise TypeError(f"local_map {name!r}: cost_us must be callable as cost_us(*local_tensors, backward=bool) "
                        f"-> µs, got {type(cost_us).__name__}")
    if alternatives is not None and not isinstance(alternatives, Mapping):
        raise TypeError(f"local_map {name!r}: alternatives must be a dict name -> (input placements, output "
                        f"placements), got {type(alternatives).__name__}")
    alts = _alternatives(name, in_placements, out_placements, alternatives)
    namespace = getattr(torch.ops, NAMESPACE)
    existing = getattr(getattr(namespace, name, None), _ATTR, None) if hasattr(namespace, name) else None
    if existing is not None:
        if (existing.fn is fn or existing.fn == fn) and existing.alternatives == alts \
                and existing.communicates == communicates:
            return existing
        raise RegionError(f"local_map name {name!r} is already used by another region in this process")
    region = LocalRegion(name, fn, alts, cost_us, communicates)
    _register(region)
    return region


def _register(region: LocalRegion) -> None:
    from torch.distributed.tensor.experimental import register_sharding

    n_in, n_out = region.n_in, region.n_out
    args = ", ".join(f"Tensor x{i}" for i in range(n_in))
    fwd_schema = f"({args}) -> ({', '.join(['Tensor'] * n_out)})" if n_out > 1 else f"({args}) -> Tensor"
    grads = ", ".join(f"Tensor g{i}" for i in range(n_out))
    bwd_schema = f"({grads}, {args}) -> ({', '.join(['Tensor'] * n_in)})" if n_in > 1 else f"({grads}, {args}) -> Tensor"

    def forward(*xs: torch.Tensor) -> Any:
        outs = region._run(*xs)
        return outs[0] if n_out == 1 else tuple(outs)

    def backward_op(*xs: torch.Tensor) -> Any:
        gs = region._backward(*xs)
        return gs[0] if n_in == 1 else tuple(gs)

    fwd = torch.library.custom_op(f"{NAMESPACE}::{region.name}", forward, mutates_args=(), schema=fwd_schema)
    bwd = torch.library.custom_op(f"{NAMESPACE}::{region.name}_backward", backward_op, mutates_args=(), schema=bwd_schema)

    def fake_forward(*xs: torch.Tensor) -> Any:
        known = _TRACED_OUTPUTS.get()
        if known is None:  # shapes by running the function on fake tensors
            return forward(*xs)
        outs = tuple(torch.empty(shape, dtype=dtype, device=xs[0].device) for shape, dtype in known)
        return outs[0] if n_out == 1 else outs

    fwd.register_fake(fake_forward)
    bwd.register_fake(lambda *xs: torch.empty_like(xs[n_out]) if n_in == 1 else tuple(torch.empty_like(x) for x in xs[n_out:]))

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def autograd_backward(ctx: Any, *grad_outs: torch.Tensor) -> Any:
        return region.backward_op(*grad_outs, *ctx.saved_tensors)

    fwd.register_autograd(autograd_backward, setup_context=setup_context)
    register_sharding(region.op)(lambda *a, **k: region.forward_strategies())
    register_sharding(region.backward_op)(lambda *a, **k: region.backward_strategies())
    setattr(getattr(getattr(torch.ops, NAMESPACE), region.name), _ATTR, region)
    setattr(getattr(getattr(torch.ops, NAMESPACE), f"{region.name}_backward"), _ATTR, region)

"""Pricing graph nodes and edges with a cost model: the bridge between FX nodes and ``costmodels``.

``costmodels`` knows about ops with per-device shapes and about collectives on mesh axes; it knows
nothing about graphs. This module turns "node ``n`` under strategy ``s``" into per-device meta
tensors for the compute model, and "edge from placement ``a`` to ``b``" into a redistribution
price, with the caches that make pricing a 9,000-node graph affordable.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

import costmodels
from apmodel._torch_private import tree_flatten, tree_unflatten
from apmodel.candidates.strategies import Strategy
from apmodel.core import placements as pl
from apmodel.core.options import PRICING_DTYPES, PlanOptions, torch_dtype
from apmodel.graph.linear3d import as_mm_call
from apmodel.graph.regions import is_backward, region_of
from costmodels.overlap import GLOO_MAX_INFLIGHT

logger = logging.getLogger(__name__)

#: Pricing dtypes by their option names (:data:`apmodel.core.options.PRICING_DTYPES`).
DTYPES: dict[str, torch.dtype] = {name: torch_dtype(name) for name in PRICING_DTYPES}

#: Ops that only relabel memory; priced at 0 without asking the compute model.
_FREE_TARGETS = {"getitem"}


class CostModelError(ValueError):
    """A compute or communication model returned a time (µs) that is not a finite number >= 0."""


def describe_model(model: Any) -> str:
    """Short name of a cost model for messages: its class, plus its repr when that says more."""
    name = type(model).__qualname__
    text = repr(model)
    if text.startswith("<"):  # the default object repr adds only an address
        return name
    text = text if len(text) <= 200 else text[:197] + "..."
    return text if text.startswith(name) else f"{name} {text}"


def _bad_time(value: Any) -> str | None:
    """Why ``value`` is not a valid time in µs (``None`` when it is one)."""
    try:
        us = float(value)
    except (TypeError, ValueError):
        return f"{value!r}, which is not a number"
    if math.isnan(us):
        return "NaN"
    if us < 0:
        return f"a negative time ({us!r} µs)"
    if math.isinf(us):
        return "inf µs"
    return None


class CheckedComm:
    """Validates the prices (µs) of a CommModel where they enter the model.

    ``time_us`` raises :class:`CostModelError` for a negative, NaN or infinite time. ``inf`` is
    reserved for forbidden transitions (into a partial placement), which
    ``costmodels.redistribution`` produces itself without asking the comm model, so a comm model
    never has a reason to return it. The redistribution layer memoises prices per
    ``(kind, axis, nbytes)`` on this object, so each distinct collective is checked once.
    Other attributes (``topo``, ...) are read from the wrapped model.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.mesh_shape: tuple[int, ...] = tuple(model.mesh_shape)
        # costmodels.redistribution stores its caches on the comm object; they must live here
        # (not be read through to the wrapped model's), or cached prices would skip the check
        self.redistribution_cache = None
        self.redistribution_matrix_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Time (µs) of one ``kind`` collective of ``nbytes`` bytes on mesh ``axis``."""
        value = self.model.time_us(kind, nbytes, axis)
        why = _bad_time(value)
        if why is not None:
            raise CostModelError(
                f"comm model {describe_model(self.model)} returned {why} for {kind} of {nbytes} bytes on "
                f"mesh axis {axis} (mesh {self.mesh_shape}); collective times must be finite and >= 0 "
                f"(inf is reserved for forbidden transitions, which apmodel derives itself)"
            )
        return float(value)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not set on the wrapper; "model" guards against recursion
        # while unpickling / copying, before __init__ ran
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"CheckedComm({self.model!r})"


def _shapes(values: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]


def _local(t: torch.Tensor, placement: tuple | None, mesh_shape: Sequence[int]) -> torch.Tensor:
    """The per-device shard of ``t`` as a meta tensor, laid out in ``t``'s dimension order (a
    transposed operand stays transposed: the compute model reads alignment off the strides)."""
    shape = tuple(t.shape) if placement is None else pl.local_shape(tuple(t.shape), placement, mesh_shape)
    stride = t.stride()
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))  # outermost dimension first
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(shape, strides, dtype=t.dtype, device="meta")


class _LocalShapes:
    """The per-device shapes a strategy gives one node's tensor inputs (in input-slot order, see
    :meth:`CostContext._local_call`) and tensor outputs: what its priced call depends on."""

    def __init__(self, node: fx.Node, mesh_shape: tuple[int, ...],
                 memo: dict[tuple[int, ...], pl.ByIdentity[tuple[int, ...]]]) -> None:
        flat, _ = tree_flatten((node.args, node.kwargs))
        vals = (a.meta.get("val") for a in flat if isinstance(a, fx.Node))
        self.inputs = [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)]
        self.outputs = [tuple(o.shape) for o in tree_flatten(node.meta.get("val"))[0] if isinstance(o, torch.Tensor)]
        # per global shape, a placement tuple's local shape: ``memo`` is shared by every node priced
        # on the mesh (the strategies of all nodes share their placement tuples)
        for shape in set(self.inputs + self.outputs):
            if shape not in memo:
                memo[shape] = pl.ByIdentity(functools.partial(pl.local_shape, shape, mesh_shape=mesh_shape))
        self._local = memo

    def _shape(self, shape: tuple[int, ...], placement: tuple | None) -> tuple[int, ...]:
        return shape if placement is None else self._local[shape](placement)

    def of(self, s: Strategy) -> tuple:
        ins = tuple(self._shape(shape, s.inputs[j] if j < len(s.inputs) else None) for j, shape in enumerate(self.inputs))
        outs = tuple(self._shape(shape, s.outputs[k] if k < len(s.outputs) else None)
                     for k, shape in enumerate(self.outputs))
        return ins, outs


@dataclass
class CostContext:
    """Compute and communication models for one mesh, with the dtype in which to price.

    Args:
        mesh_shape: the mesh the plan is for.
        compute: a ``costmodels.ComputeModel`` (``time_us(op, args, kwargs, out, dtype=None)``).
        comm: a ``costmodels.CommModel`` (``time_us(kind, nbytes, axis)``); stored wrapped in a
            :class:`CheckedComm` so that every collective price is validated.
        dtype: floating-point tensors are priced as this dtype (the graph is traced in fp32);
            ``None`` prices them as traced.

    Both models must return finite times >= 0 µs; anything else raises :class:`CostModelError`
    naming the model, the op or collective, and the value.
    """

    mesh_shape: tuple[int, ...]
    compute: Any
    comm: Any
    dtype: torch.dtype | None = torch.bfloat16
    hbm_bytes: float | None = None
    """memory capacity of one device (bytes), for the memory model; None when unknown"""
    reduce_dtype: torch.dtype | None = None
    """mixed precision: parameter gradients are reduced in this dtype (FSDP2's ``reduce_dtype``,
    fp32 in real recipes); None: the pricing dtype"""
    master_dtype: torch.dtype | None = None
    """mixed precision: parameters, their gradients and optimizer state are stored in this dtype
    (fp32 master weights); None: the pricing dtype"""
    weight_microbatches: int = 1
    """microbatches that share each parameter gather and gradient reduction (a pipeline stage's
    plan): those collectives are priced divided by this (:class:`costmodels.SharedCollectives`)"""
    bucket_bytes: float = 0.0
    """cap (bytes) of the buckets the program merges parameter collectives into; 0: each priced alone"""
    param_elements: int = 0
    """elements of the model's parameters: bounds a bucket (a small model's gathers fill less than
    the cap); 0: unknown, buckets taken as full"""
    overlap: bool = False
    """price the step as the overlapped program runs it (:mod:`apmodel.result.step_timeline`); False: the
    serial sum"""
    inflight_bytes: float = 100 * 2**20
    """the overlapped program's in-flight limit (bytes)"""
    overlap_slowdown: float = 0.0
    """share of a hidden collective's time the computation still loses (the device's)"""
    max_inflight: int | None = None
    """most collectives in flight at once (one on CPU processes over gloo:
    :data:`costmodels.overlap.GLOO_MAX_INFLIGHT`); None: no count limit"""

    def __post_init__(self) -> None:
        if self.comm is not None and not isinstance(self.comm, CheckedComm):
            self.comm = CheckedComm(self.comm)
        self._bucketed_comms: dict[int, Any] = {}
        self._local_shapes: dict[tuple[int, ...], pl.ByIdentity[tuple[int, ...]]] = {}  # see _LocalShapes

    def itemsize(self, dtype: torch.dtype) -> int:
        """Bytes per element as priced (the pricing dtype for floating tensors)."""
        if self.dtype is not None and dtype.is_floating_point:
            return self.dtype.itemsize
        return dtype.itemsize

    def state_itemsize(self, dtype: torch.dtype) -> int:
        """Bytes per element of parameters, gradients and optimizer state (the master dtype)."""
        if self.master_dtype is not None and dtype.is_floating_point:
            return self.master_dtype.itemsize
        return self.itemsize(dtype)

    def _edge_itemsize(self, dtype: torch.dtype, gradient: bool) -> int:
        if gradient and self.reduce_dtype is not None and dtype.is_floating_point:
            return self.reduce_dtype.itemsize
        return self.itemsize(dtype)

    # ---------------------------------------------------------------- compute
    def _local_call(self, node: fx.Node, s: Strategy) -> tuple[tuple, dict, Any, list, list]:
        """``node``'s call at the per-device shapes of strategy ``s``: (args, kwargs, out, tensor
        inputs, outputs), every tensor a meta tensor."""
        flat, spec = tree_flatten((node.args, node.kwargs))
        out_flat, out_spec = tree_flatten(node.meta.get("val"))
        args = list(flat)
        inputs = []
        slot = 0  # input slots count tensor arguments only (see strategies.input_slots)
        for pos, a in enumerate(flat):
            if not isinstance(a, fx.Node):
                continue
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                placement = s.inputs[slot] if slot < len(s.inputs) else None
                args[pos] = _local(val, placement, self.mesh_shape)
                slot += 1
            else:
                args[pos] = val
            inputs.append(args[pos])
        outs = []
        k = 0
        for o in out_flat:
            if isinstance(o, torch.Tensor):
                placement = s.outputs[k] if k < len(s.outputs) else None
                outs.append(_local(o, placement, self.mesh_shape))
                k += 1
            else:
                outs.append(o)
        call_args, call_kwargs = tree_unflatten(args, spec)
        return tuple(call_args), dict(call_kwargs), tree_unflatten(outs, out_spec), inputs, outs

    def compute_vector(self, node: fx.Node, strategies: Sequence[Strategy]) -> np.ndarray:
        """Time (µs) of ``node`` under each strategy (0 for placeholders and getitem): its compute,
        and for a ``local_map`` region the collectives it issues itself as well."""
        if node.op != "call_function" or getattr(node.target, "__name__", "") in _FREE_TARGETS:
            return np.zeros(len(strategies))
        region = region_of(node.target)
        backward = region is not None and is_backward(node.target)
        result = np.zeros(len(strategies))
        # strategies with the same local shapes (and, for a region, alternatives) make the same
        # call: priced once
        local_shapes = _LocalShapes(node, self.mesh_shape, self._local_shapes)
        priced: dict[tuple, float] = {}
        for si, s in enumerate(strategies):
            modes = region.alternative_on_axes(s.inputs, backward=backward) if region is not None else None
            key = (modes, local_shapes.of(s))
            us = priced.get(key)
            if us is not None:
                result[si] = us
                continue
            call_args, call_kwargs, out, inputs, outs = self._local_call(node, s)
            asked = str(node.target)  # what the compute model was asked to price
            if region is not None:  # a local_map region: the ops it runs, at these local shapes
                assert modes is not None  # read off the region above
                value = region.time_us(self, call_args, modes=modes, backward=backward)
            elif (mm := as_mm_call(node.target, call_args)) is not None:  # an N-D linear: the mm it replaces
                asked = f"{mm[0]} (as {node.target})"
                value = self.compute.time_us(mm[0], mm[1], {}, mm[2], dtype=self.dtype)
            else:
                value = self.compute.time_us(node.target, call_args, call_kwargs, out, dtype=self.dtype)
            try:
                us = float(value)
            except (TypeError, ValueError):
                us = math.nan
            if not 0.0 <= us < math.inf:  # False for NaN too
                raise CostModelError(
                    f"compute model {describe_model(self.compute)} returned {_bad_time(value) or repr(value)} for "
                    f"{asked} at node {node.name!r} (strategy {s}; per-device input shapes "
                    f"{_shapes(inputs)}, output shapes {_shapes(outs)}); "
                    f"compute times must be finite and >= 0 µs"
                )
            result[si] = priced[key] = us
        return result

    def _region_call(self, node: fx.Node, s: Strategy) -> tuple[Any, list, tuple[str | None, ...], bool] | None:
        """(region, local arguments, alternative per mesh axis, backward) of a ``local_map``
        region node under strategy ``s``; None for other nodes."""
        region = region_of(node.target) if node.op == "call_function" else None
        if region is None:
            return None
        backward = is_backward(node.target)
        modes = region.alternative_on_axes(s.inputs, backward=backward)
        return region, list(self._local_call(node, s)[0]), modes, backward

    def region_collectives(self, node: fx.Node, s: Strategy) -> list[tuple[str, tuple[int, ...], float]]:
        """The collectives a ``local_map`` region node issues itself under strategy ``s``, as
        (kind, mesh axes, µs), included in :meth:`compute_vector`'s time; [] for other nodes."""
        call = self._region_call(node, s)
        if call is None:
            return []
        region, args, modes, backward = call
        return region.collectives(self, args, modes=modes, backward=backward)

    def region_working_bytes(self, node: fx.Node, s: Strategy) -> float:
        """Bytes a ``local_map`` region node holds inside its function under strategy ``s`` (see
        :meth:`apmodel.graph.regions.LocalRegion.working_bytes`); 0 for other nodes."""
        call = self._region_call(node, s)
        if call is None:
            return 0.0
        region, args, modes, backward = call
        return region.working_bytes(self, args, modes=modes, backward=backward)

    # ---------------------------------------------------------------- communication
    def _comm_for(self, itemsize: int, bucketed: bool) -> Any:
        """The comm model of one edge: ``bucketed`` (a parameter's gather or its gradient's
        reduction, which the native program merges with the others of its kind) prices each
        collective as its share of a bucket of ``bucket_bytes`` (at most the model's parameters
        at ``itemsize``; :class:`costmodels.BucketedCollectives`), shared by
        ``weight_microbatches`` microbatches."""
        if not bucketed:
            return self.comm
        comm = self._bucketed_comms.get(itemsize)
        if comm is None:
            comm = self.comm
            if self.bucket_bytes > 0:
                fill = self.param_elements * itemsize if self.param_elements > 0 else math.inf
                comm = costmodels.BucketedCollectives(comm, min(self.bucket_bytes, fill))
            if self.weight_microbatches > 1:
                comm = costmodels.SharedCollectives(comm, self.weight_microbatches)
            self._bucketed_comms[itemsize] = comm
        return comm

    @functools.cached_property
    def _redistribution(self):
        """Memoised scalar price of one redistribution (µs)."""

        @functools.lru_cache(maxsize=None)
        def price(shape: tuple[int, ...], itemsize: int, src: tuple[str, ...], dst: tuple[str, ...],
                  bucketed: bool) -> float:
            return float(costmodels.redistribution_us(self._comm_for(itemsize, bucketed), shape, itemsize, src, dst))

        return price

    def redistribution_us(
        self, shape: Sequence[int], dtype: torch.dtype, src: tuple[str, ...], dst: tuple[str, ...], *,
        gradient: bool = False, bucketed: bool = False,
    ) -> float:
        """Price (µs) of moving a tensor of global ``shape`` from placement ``src`` to ``dst``;
        ``gradient``: a parameter gradient on its way to the parameter (priced in ``reduce_dtype``);
        ``bucketed``: its collectives are merged into buckets by the program (see :meth:`_comm_for`)."""
        if src == dst:
            return 0.0
        return self._redistribution(tuple(shape), self._edge_itemsize(dtype, gradient), src, dst, bucketed)

    def redistribution_matrix(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        srcs: Sequence[tuple[str, ...] | None],
        dsts: Sequence[tuple[str, ...] | None],
        *,
        gradient: bool = False,
        bucketed: bool = False,
    ) -> np.ndarray:
        """Matrix ``M[a, b]`` = price (µs) of ``srcs[a] -> dsts[b]``; ``None`` entries cost 0:
        :meth:`redistribution_factors` spread with integer indexing (a new array)."""
        block, rows, cols = self.redistribution_factors(shape, dtype, srcs, dsts, gradient=gradient, bucketed=bucketed)
        return block[np.ix_(rows, cols)]

    def redistribution_factors(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        srcs: Sequence[tuple[str, ...] | None],
        dsts: Sequence[tuple[str, ...] | None],
        *,
        gradient: bool = False,
        bucketed: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`redistribution_matrix` as ``(block, rows, cols)`` with ``M = block[np.ix_(rows, cols)]``:
        ``block`` prices the distinct sources against the distinct destinations (µs; plus a free
        last row / column for ``None`` where there is one), ``rows`` / ``cols`` (int64) index it.

        The block comes from ``costmodels.redistribution.redistribution_matrix`` (same values as
        :meth:`redistribution_us`) and is cached on ``comm``: read it, never write it.
        """
        usrc = sorted({s for s in srcs if s is not None})
        udst = sorted({d for d in dsts if d is not None})
        si = {s: i for i, s in enumerate(usrc)}
        di = {d: i for i, d in enumerate(udst)}
        itemsize = self._edge_itemsize(dtype, gradient)
        comm = self._comm_for(itemsize, bucketed)
        block = costmodels.redistribution_matrix(comm, tuple(shape), itemsize, usrc, udst, copy=False)
        rows = np.array([si[s] if s is not None else len(usrc) for s in srcs], dtype=np.int64)
        cols = np.array([di[d] if d is not None else len(udst) for d in dsts], dtype=np.int64)
        if (rows < len(usrc)).all() and (cols < len(udst)).all():
            return block, rows, cols
        padded = np.zeros((len(usrc) + 1, len(udst) + 1))  # last row/column: "no tensor" = free
        padded[:-1, :-1] = block
        return padded, rows, cols

    def redistribution_steps(
        self, shape: Sequence[int], dtype: torch.dtype, src: tuple[str, ...], dst: tuple[str, ...], *,
        gradient: bool = False, bucketed: bool = False,
    ) -> list:
        """The collectives behind one redistribution: list of (kind, axis, nbytes, µs)."""
        if src == dst:
            return []
        itemsize = self._edge_itemsize(dtype, gradient)
        return list(costmodels.redistribution_steps(self._comm_for(itemsize, bucketed), tuple(shape), itemsize, src, dst))


def pricing_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype of a pricing-dtype option (a name of :data:`DTYPES`, a dtype or None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _cost_model(given: Any, default: Any, built_from: Any) -> Any:
    """``given`` itself, or a dotted name / the default constructed from ``built_from``."""
    if given is None:
        return default(built_from)
    if isinstance(given, str):
        return costmodels.load_object(given)(built_from)
    return given


def _traced_at(captured: Any, param_dtype: torch.dtype) -> bool:
    """Whether ``captured``'s floating parameters were traced in ``param_dtype``."""
    dtypes = {n.meta["val"].dtype for n in captured.gm.graph.nodes
              if captured.roles.get(n.name) == "param" and n.meta["val"].is_floating_point()}
    return dtypes == {param_dtype}


def build_cost_context(mesh_shape: Sequence[int], options: PlanOptions, captured: Any = None) -> CostContext:
    """The compute and communication models ``options`` ask for on a mesh.

    Compute: ``options.compute_model``, else ``costmodels.compute_model(device, profile=
    options.compute_profile, execution=options.execution)`` (the measured model where the device
    has a profile, else the roofline). Communication: ``options.comm_model``, else the NCCL model
    of the topology (with ``options.topology`` overrides), corrected by ``options.calibration``;
    parameter gathers and gradient reductions priced in buckets of ``options.bucket_mb`` (at most
    ``captured``'s parameters; each alone where the graph has a ``local_map`` region that
    communicates, which the native program runs unbucketed).
    Mixed precision (default on for bf16/fp16): gradient reductions and master state in fp32;
    run as well as priced (``options.run_precision``) and ``captured`` traced at the param dtype
    (as :func:`apmodel.entry.api.plan` traces it then): tensors are priced in their traced dtypes.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    spec = costmodels.device(options.device) if isinstance(options.device, str) else options.device
    topo = costmodels.Topology(mesh_shape, spec, options.gpus_per_node, **options.topology)
    if options.compute_model is None:
        compute = costmodels.compute_model(spec, profile=options.compute_profile, execution=options.execution)
    else:
        compute = _cost_model(options.compute_model, None, spec)
    comm = _cost_model(options.comm_model, costmodels.NCCLCollectives, topo)
    if options.calibration is not None:
        comm = costmodels.CalibratedCollectives(comm, costmodels.Calibration.load(options.calibration))
    if spec.fresh_pages_from_bytes is not None:  # a host allocator: large outputs fault their pages in
        comm = costmodels.FreshPageCollectives(comm, spec, mesh_shape)
    dtype = pricing_dtype(options.dtype)
    mixed = options.mixed_precision
    if mixed is None:
        mixed = dtype in (torch.bfloat16, torch.float16)
    full = torch.float32 if mixed else None
    if options.run_precision is not None and captured is not None and _traced_at(captured, DTYPES[options.run_precision[0]]):
        dtype = None  # traced at the param dtype with the model's own casts: price each tensor as traced
    bucket_bytes = options.bucket_mb * 2**20
    overlap = options.overlap
    param_elements = 0
    if captured is not None:
        nodes = captured.gm.graph.nodes
        param_elements = sum(n.meta["val"].numel() for n in nodes if captured.roles.get(n.name) == "param")
        if any(n.op == "call_function" and getattr(region_of(n.target), "communicates", False) for n in nodes):
            # a local_map region issues blocking collectives of its own: the native program then
            # keeps every collective in traced order, unmerged and waited as issued (apmodel.lowering.native)
            bucket_bytes = 0.0
            overlap = False
    return CostContext(
        mesh_shape=mesh_shape, compute=compute, comm=comm, dtype=dtype, hbm_bytes=spec.hbm_GiB * 2**30,
        reduce_dtype=full, master_dtype=full, weight_microbatches=options.weight_microbatches, bucket_bytes=bucket_bytes, param_elements=param_elements,
        overlap=overlap, inflight_bytes=options.inflight_mb * 2**20, overlap_slowdown=spec.overlap_slowdown,
        max_inflight=GLOO_MAX_INFLIGHT if spec.arch == "cpu" else None,
    )

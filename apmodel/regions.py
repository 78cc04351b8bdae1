"""Hand-written parallel regions (``local_map``) that the planner plans around (paper §3.4).

A region is a user function that runs on local shards with declared placements::

    expert_mlp = apmodel.local_map(
        mlp, name="expert_mlp",
        in_placements=("S(0)", "R", "R"),   # tokens row-sharded, both weights whole
        out_placements=("S(0)",),
    )
    y = expert_mlp(x, w1, w2)               # inside the model's forward

It becomes one operator of the joint graph (``apmodel_region::<name>``, forward) and one more for
its backward (``<name>_backward``, which recomputes the region and differentiates it locally), so
the capture, the placement model, constraints (by the node name ``<name>``), explain and diff see
it as a single node. Its candidate strategies are the declared one on every subset of mesh axes
(per axis: the declared placements, or everything replicated — running the function on whole
tensors, which is always correct), registered with DTensor's ``register_sharding``; the backward's
are derived: each gradient takes its input's placement, except a replicated input next to a
sharded one on the same axis, whose local gradient is a partial sum. It is priced by tracing the
function at the local shapes of each strategy and pricing every op it runs (or by ``cost_us``), and
lowered by DTensor itself: inputs are redistributed to the planned placements and the function
runs on the local shards (it may issue collectives of its own; those are not priced unless
``cost_us`` includes them).

Regions are registered with ``torch.library`` once per name for the life of the process (the
operator registry is torch's); making one again with the same name and function returns it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from apmodel._torch_private import OpOverload, overload_packet

NAMESPACE = "apmodel_region"
_ATTR = "_apmodel_region"  # where the LocalRegion hangs on its operator packet


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


@dataclass(eq=False)
class LocalRegion:
    """A registered region: call it like the function it wraps (tensors in, tensors out)."""

    name: str
    fn: Callable[..., Any]
    in_placements: tuple[Placement, ...]
    out_placements: tuple[Placement, ...]
    cost_us: Callable[..., float] | None = None
    _priced: dict = field(default_factory=dict, repr=False)

    @property
    def op(self) -> OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    @property
    def backward_op(self) -> OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), f"{self.name}_backward").default

    def __call__(self, *tensors: torch.Tensor) -> Any:
        if len(tensors) != len(self.in_placements):
            raise RegionError(f"local_map {self.name!r} takes {len(self.in_placements)} tensors, got {len(tensors)}")
        out = self.op(*tensors)  # one Tensor, or a tuple for several outputs (the op's schema)
        return out if len(self.out_placements) == 1 else tuple(out)

    # ---------------------------------------------------------------- local semantics
    def _run(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        out = self.fn(*tensors)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(self.out_placements) or not all(isinstance(o, torch.Tensor) for o in outs):
            raise RegionError(f"local_map {self.name!r}: the function returned {len(outs)} values, "
                              f"{len(self.out_placements)} tensors were declared")
        return outs

    def _vjp(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Gradients of the inputs, from the output gradients (first) and the inputs: the region
        recomputed under autograd and differentiated (in this thread)."""
        n_out = len(self.out_placements)
        grads, inputs = args[:n_out], args[n_out:]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
            outs = self._run(*leaves)
            wrt = [x for x in leaves if x.requires_grad]
            got = dict(zip(map(id, wrt), torch.autograd.grad(outs, wrt, grads, allow_unused=True)))
        return [torch.zeros_like(x) if got.get(id(x)) is None else got[id(x)] for x in leaves]

    def _backward(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_vjp` as the backward operator's kernel. A kernel runs below the autograd
        dispatch key (inside DTensor's dispatch, for one), where this thread's dispatch state
        records no graph; a fresh thread starts clean (on the same device stream) and shares the
        tensors."""
        stream = torch.cuda.current_stream() if args[0].is_cuda else None
        result: list = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    result.append(self._vjp(*args))
            except BaseException as e:  # re-raised in the calling thread
                errors.append(e)

        worker = threading.Thread(target=run, name=f"apmodel-region-{self.name}-backward")
        worker.start()
        worker.join()
        if errors:
            raise errors[0]
        return result[0]

    # ---------------------------------------------------------------- strategies (one mesh axis)
    def forward_strategies(self) -> list[tuple[list[Placement], list[Placement]]]:
        """Per mesh axis: (output placements, input placements) the region accepts."""
        R = Replicate()
        return [([R] * len(self.out_placements), [R] * len(self.in_placements)),
                (list(self.out_placements), list(self.in_placements))]

    def backward_strategies(self) -> list[tuple[list[Placement], list[Placement]]]:
        R = Replicate()
        n_in, n_out = len(self.in_placements), len(self.out_placements)
        sharded = any(isinstance(p, Shard) for p in (*self.in_placements, *self.out_placements))
        grad_in = [Partial() if isinstance(p, Replicate) and sharded else p for p in self.in_placements]
        # the gradient of a partial output is whole on every rank
        grad_out = [R if isinstance(p, Partial) else p for p in self.out_placements]
        return [([R] * n_in, [R] * (n_out + n_in)), (grad_in, grad_out + list(self.in_placements))]

    # ---------------------------------------------------------------- pricing
    def time_us(self, compute: Any, local_args: Sequence[Any], *, backward: bool, dtype: torch.dtype | None) -> float:
        """Compute time (µs) of the region (or its backward) on local shards ``local_args``:
        ``cost_us(*local_args, backward=...)`` when given, else the sum of ``compute``'s prices of
        the ops the function runs, traced on the meta device at these shapes (memoised)."""
        tensors = [a for a in local_args if isinstance(a, torch.Tensor)]
        if self.cost_us is not None:
            return float(self.cost_us(*tensors, backward=backward))
        key = (backward, dtype, id(compute), tuple((tuple(t.shape), t.dtype) for t in tensors))
        if key not in self._priced:
            self._priced[key] = _traced_time_us(self._vjp if backward else self._run, tensors, compute, dtype)
        return self._priced[key]


def _meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    if isinstance(val, (list, tuple)):
        return type(val)(_meta(v) for v in val)
    return val


def _traced_time_us(fn: Callable, tensors: Sequence[torch.Tensor], compute: Any, dtype: torch.dtype | None) -> float:
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*[_meta(t) for t in tensors])
    total = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _meta(a.meta.get("val")))
        us = float(compute.time_us(node.target, tuple(args), dict(kwargs), _meta(node.meta.get("val")), dtype=dtype))
        if not 0.0 <= us < math.inf:
            raise RegionError(f"compute model priced {node.target} inside a region at {us!r} µs")
        total += us
    return total


def region_of(target: Any) -> LocalRegion | None:
    """The region behind a graph node's target (its forward or backward op), else None."""
    packet = overload_packet(target)
    if packet is None or getattr(target, "namespace", None) != NAMESPACE:
        return None
    return getattr(packet, _ATTR, None)


def is_backward(target: Any) -> bool:
    region = region_of(target)
    return region is not None and target is region.backward_op


def local_map(
    fn: Callable[..., Any],
    *,
    name: str,
    in_placements: Sequence[str | Placement],
    out_placements: Sequence[str | Placement],
    cost_us: Callable[..., float] | None = None,
) -> LocalRegion:
    """Declare ``fn`` a parallel region the planner plans around.

    Args:
        fn: runs on local shards: tensors in (as many as ``in_placements``, floating point),
            a tensor or a tuple of tensors out (as many as ``out_placements``). On whole tensors
            it must compute the single-device result (the replicated alternative runs it so).
        name: the operator and graph-node name (letters, digits, ``_``), unique in the process;
            constraints select the region by it (``apmodel.fix("<name>", "S(0)S(0)")``).
        in_placements / out_placements: per tensor, its placement on each mesh axis the region
            is sharded over: ``"R"``, ``"S(d)"`` (outputs also ``"P"``, a partial sum).
        cost_us: ``cost_us(*local_tensors, backward=bool) -> µs`` replacing the traced price.
    """
    if not name.isidentifier() or name.startswith("_"):
        raise RegionError(f"local_map name {name!r} must be an identifier (letters, digits, _)")
    ins = tuple(_placement(p, name, f"input {i}", partial_ok=False) for i, p in enumerate(in_placements))
    outs = tuple(_placement(p, name, f"output {i}", partial_ok=True) for i, p in enumerate(out_placements))
    if not ins or not outs:
        raise RegionError(f"local_map {name!r} needs at least one input and one output placement")
    namespace = getattr(torch.ops, NAMESPACE)
    existing = getattr(getattr(namespace, name, None), _ATTR, None) if hasattr(namespace, name) else None
    if existing is not None:
        if existing.fn is fn and existing.in_placements == ins and existing.out_placements == outs:
            return existing
        raise RegionError(f"local_map name {name!r} is already used by another region in this process")
    region = LocalRegion(name, fn, ins, outs, cost_us)
    _register(region)
    return region


def _register(region: LocalRegion) -> None:
    from torch.distributed.tensor.experimental import register_sharding

    n_in, n_out = len(region.in_placements), len(region.out_placements)
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
    fwd.register_fake(forward)  # shapes by running the function on fake tensors
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

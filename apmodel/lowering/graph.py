"""Reading placements and the joint graph for lowering: placement tokens, argument trees,
the tensor inputs of a node and its planned strategy."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from apmodel.core import placements

#: One placement per mesh axis.
Placements = tuple[Placement, ...]


def _token(p: Placement) -> str:
    """One placement as its token in the shared vocabulary ("R", "S(d)", "P"; DTensor's masked and
    norm partials are partial sums: "P")."""
    return placements.to_str(p)


def placement_tokens(pl: Sequence[Placement]) -> tuple[str, ...]:
    return tuple(_token(p) for p in pl)


def format_placements(pl: Sequence[Placement] | None) -> str:
    return "None" if pl is None else "".join(placement_tokens(pl))


def all_replicated(pl: Sequence[Placement]) -> bool:
    return all(isinstance(p, Replicate) for p in pl)


def comm_free(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """True when going from src to dst needs no collective (only local chunking)."""
    return all(
        _token(s) == _token(d) or (isinstance(s, Replicate) and isinstance(d, Shard))
        for s, d in zip(src, dst, strict=False)
    )


def flatten_args(obj: Any) -> tuple[list, Any]:
    """Leaves of nested tuples/lists/dicts (FX's immutable ones included) and a spec to rebuild them
    with :func:`unflatten_args` (lists and tuples come back as tuples' and lists' plain types)."""
    leaves: list = []

    def walk(o: Any) -> Any:
        if isinstance(o, (tuple, list)):
            return (list if isinstance(o, list) else tuple, [walk(x) for x in o])
        if isinstance(o, dict):
            return (dict, [(k, walk(v)) for k, v in o.items()])
        leaves.append(o)
        return None

    return leaves, walk(obj)


def unflatten_args(leaves: Sequence[Any], spec: Any) -> Any:
    it = iter(leaves)

    def build(sp: Any) -> Any:
        if sp is None:
            return next(it)
        kind, items = sp
        if kind is dict:
            return {k: build(v) for k, v in items}
        return kind(build(x) for x in items)

    return build(spec)


def tensor_vals(node: fx.Node) -> list:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return list(v)
    return [v]


def shard_ways(pl: Placements, mesh_shape: Sequence[int], dim: int) -> int:
    """Into how many shards ``pl`` splits tensor dimension ``dim`` on a mesh of ``mesh_shape``."""
    ways = 1
    for axis, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim == dim:
            ways *= mesh_shape[axis]
    return ways


def check_even(name: str, shape: Sequence[int], pl: Placements, mesh_shape: Sequence[int]) -> None:
    for d, size in enumerate(shape):
        ways = shard_ways(pl, mesh_shape, d)
        if ways > 1 and int(size) % ways:
            raise ValueError(
                f"plan shards node {name!r} dim {d} (size {size}) {ways} ways ({format_placements(pl)} on mesh "
                f"{tuple(mesh_shape)}): uneven shards are not supported by lowering"
            )


def node_strategy_of(plan: Any, node: fx.Node):
    try:
        return plan.node_strategy[node.name]
    except KeyError:
        raise ValueError(f"plan has no strategy for graph node {node.name!r} ({node.target})") from None


def tensor_leaves(node: fx.Node) -> list[tuple[int, fx.Node, int]]:
    """(leaf position in the flattened (args, kwargs), producer, producer output index) for each
    input slot of ``node``, in the order of :func:`apmodel.candidates.strategies.input_slots` (the order of a
    strategy's ``inputs``)."""
    from apmodel.candidates.strategies import input_slots

    slots = input_slots(node)
    if node.target is operator.getitem and slots and slots[0][1] == node.args[1] and isinstance(
        slots[0][0].meta.get("val"), (tuple, list)
    ):
        return [(0, slots[0][0], slots[0][1])]
    flat, _ = flatten_args((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    if len(positions) != len(slots):
        raise ValueError(f"node {node.name!r} ({node.target}): cannot match its {len(slots)} input slots to its arguments")
    return [(i, prod, k) for i, (prod, k) in zip(positions, slots, strict=True)]


def add_to_grad(param: Any, local: torch.Tensor) -> None:
    """Add a gradient computed on local shards to ``param``'s ``.grad`` (a DTensor parameter: the
    gradient placed as the parameter is), as autograd's accumulation would."""
    from apmodel._torch_private import dtensor_like

    g = dtensor_like(param, local)
    param.grad = g if param.grad is None else param.grad + g


def copy_nodes(gm: fx.GraphModule, keep: Any, inputs: Sequence[fx.Node] = ()) -> tuple[fx.Graph, dict[fx.Node, Any]]:
    """A new graph of the nodes of ``gm`` for which ``keep(node)`` holds, in their order, reading
    ``inputs`` (nodes of ``gm`` computed elsewhere) as its first placeholders, ``kept_0``...; and
    the map from ``gm``'s nodes to the new graph's. How a graph is cut in two parts, the second
    reading what the first hands it."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for k, n in enumerate(inputs):
        env[n] = graph.placeholder(f"kept_{k}")
        env[n].meta = dict(n.meta)
    for n in gm.graph.nodes:
        if keep(n):
            env[n] = graph.node_copy(n, lambda a: env[a])
    return graph, env

"""Clustering: find repeated structure in the joint graph and group nodes that choose together.

Two mechanisms, both ending in a union-find over graph nodes:

* **Content hashing.** Every node gets a local signature (op, non-tensor arguments, output shapes
  and dtypes, placeholder role, forward/backward side). A few rounds of neighbourhood refinement
  (Weisfeiler-Lehman style: a node's hash absorbs its producers' hashes in argument order and the
  sorted hashes of its users) separate nodes that look alike locally but sit in different places
  of a layer. Nodes whose refined hashes agree, and whose candidate strategy lists and allowed
  states agree, are copies of one another: the L copies of a transformer layer collapse into one
  decision variable whose costs are weighted by L. Nodes near the ends of a stack of layers see
  the boundary within the refinement radius and stay separate, which is what we want.
* **Flow coupling.** When the copies of a clustered node read input slot ``j`` from producers that
  are not yet grouped together but offer the same strategies, those producers are merged too
  (paper §4.3), so the clustered variable has one neighbour per slot instead of L.

Forward/backward pairs (parameter ↔ gradient, input ↔ input gradient, output ↔ tangent) are *not*
merged here: the model couples them with priced edges (a gradient that is not produced in its
parameter's storage placement pays the reduce-scatter or all-reduce that puts it there).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Generic, Hashable, Mapping, Sequence, TypeVar

import torch
import torch.fx as fx

logger = logging.getLogger(__name__)

#: Refinement rounds. Five rounds separate the projections of one transformer layer from each
#: other (they differ in their users within two hops) while keeping the boundary effect (nodes of
#: the first and last layer that do not merge) to a few nodes per end.
DEFAULT_ROUNDS = 5


def _describe_value(value: Any) -> Hashable:
    """A hashable summary of a node's meta value: shapes and dtypes of the tensors it holds."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe_value(v) for v in value)
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    return type(value).__name__


def _describe_arg(arg: Any) -> Hashable:
    """Argument structure with graph nodes replaced by a marker (their identity enters later)."""
    if isinstance(arg, fx.Node):
        return "<node>"
    if isinstance(arg, (list, tuple)):
        return tuple(_describe_arg(a) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _describe_arg(v)) for k, v in arg.items()))
    if isinstance(arg, (int, float, bool, str)) or arg is None:
        return arg
    if isinstance(arg, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(arg)
    return type(arg).__name__


def local_signature(node: fx.Node, role: str | None, is_backward: bool) -> Hashable:
    """What a node is, independent of where it sits: op, arguments, value shapes, role."""
    return (
        node.op,
        str(node.target) if node.op != "placeholder" else "placeholder",
        _describe_arg(node.args),
        _describe_arg(node.kwargs),
        _describe_value(node.meta.get("val")),
        tuple(_describe_value(p.meta.get("val")) for p in node.all_input_nodes),
        role,
        is_backward,
    )


def refined_hashes(
    nodes: Sequence[fx.Node],
    signatures: Mapping[str, Hashable],
    rounds: int | None = None,
) -> dict[str, str]:
    """Weisfeiler-Lehman refinement of ``signatures`` over the graph's producer/user edges.

    Each distinct value gets a class number (signatures compared by their ``repr``, so ``1`` and
    ``1.0`` differ; later rounds by tuples of class numbers): two nodes share a class exactly when
    a digest of the same values would agree, without hash collisions and without serialising
    every node's neighbourhood each round. Returns the final class of each node as a string."""
    if rounds is None:
        rounds = DEFAULT_ROUNDS
    names = {n.name for n in nodes}
    classes: dict[Hashable, int] = {}
    hashes = {n.name: classes.setdefault(repr(signatures[n.name]), len(classes)) for n in nodes}
    inputs = {n.name: [p.name for p in n.all_input_nodes if p.name in names] for n in nodes}
    users = {n.name: [u.name for u in n.users if u.name in names] for n in nodes}
    for _ in range(rounds):
        classes = {}
        hashes = {
            name: classes.setdefault(
                (hashes[name], tuple([hashes[p] for p in inputs[name]]), tuple(sorted([hashes[u] for u in users[name]]))),
                len(classes),
            )
            for name in hashes
        }
    return {name: str(c) for name, c in hashes.items()}


_Item = TypeVar("_Item", bound=Hashable)


class UnionFind(Generic[_Item]):
    """Plain union-find over hashable items (path halving, union by size)."""

    def __init__(self, items: Sequence[_Item]) -> None:
        self._parent = {x: x for x in items}
        self._size = {x: 1 for x in items}

    def find(self, x: _Item) -> _Item:
        parent = self._parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: _Item, b: _Item) -> _Item:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if self._size[ra] < self._size[rb]:
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._size[ra] += self._size[rb]
        return ra

    def groups(self) -> dict[_Item, list[_Item]]:
        out: dict[_Item, list[_Item]] = defaultdict(list)
        for x in self._parent:
            out[self.find(x)].append(x)
        return dict(out)


@dataclass
class Grouping:
    """Result of clustering.

    ``groups[g]`` lists the node names of group ``g`` in graph order (its first entry is the
    representative); ``group_of[name]`` is the inverse. Every member of a group has the same
    candidate strategy list, so one state index means the same strategy for all of them.
    """

    groups: list[list[str]]
    group_of: dict[str, int]
    content_hash: dict[str, str]

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def cluster(
    nodes: Sequence[fx.Node],
    signatures: Mapping[str, Hashable],
    state_key: Mapping[str, Hashable],
    *,
    rounds: int | None = None,
    merge_copies: bool = True,
    flow_coupling: bool = True,
) -> Grouping:
    """Group ``nodes`` (decision nodes, in graph order).

    ``signatures`` gives each node's :func:`local_signature`; ``state_key`` a hashable key of the
    node's candidate strategy list *and* its allowed states (constraints), so only nodes whose
    decision spaces are identical can share a variable.
    """
    order = {n.name: i for i, n in enumerate(nodes)}
    uf = UnionFind([n.name for n in nodes])
    rounds = DEFAULT_ROUNDS if rounds is None else rounds
    hashes = refined_hashes(nodes, signatures, rounds) if merge_copies else {n.name: n.name for n in nodes}

    if merge_copies:
        buckets: dict[tuple, list[str]] = defaultdict(list)
        for n in nodes:
            buckets[(hashes[n.name], state_key[n.name])].append(n.name)
        for members in buckets.values():
            for other in members[1:]:
                uf.union(members[0], other)

    if merge_copies and flow_coupling:
        by_name = {n.name: n for n in nodes}
        for members in uf.groups().values():
            if len(members) < 2:
                continue
            slots = len(by_name[members[0]].all_input_nodes)
            for j in range(slots):
                producers: list[str] = []
                for m in members:
                    ins = by_name[m].all_input_nodes
                    if len(ins) != slots or ins[j].name not in by_name:
                        producers = []
                        break
                    producers.append(ins[j].name)
                if len(producers) < 2:
                    continue
                keys = {state_key[p] for p in producers}
                if len(keys) != 1:
                    continue  # producers offer different choices: they cannot share one variable
                roots = {uf.find(p) for p in producers}
                if len(roots) > 1:
                    for p in producers[1:]:
                        uf.union(producers[0], p)

    raw = sorted(uf.groups().values(), key=lambda ms: min(order[m] for m in ms))
    groups = [sorted(ms, key=order.__getitem__) for ms in raw]
    group_of = {m: g for g, ms in enumerate(groups) for m in ms}
    logger.info("clustering: %d decision nodes -> %d groups", len(nodes), len(groups))
    return Grouping(groups=groups, group_of=group_of, content_hash=hashes)

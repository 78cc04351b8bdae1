"""A native backward graph cut into its input-gradient part and its weight-gradient part, so a
zero-bubble pipeline schedule can run them as two actions (``I`` and, later, ``W``).

The backward graph of a stage (:class:`apmodel.lowering.native.NativeProgram`) returns the
parameters' gradients first, then the inputs' gradients. Its *input part* is every node the
inputs' gradients need (the chain of input-gradient matmuls, the collectives on that chain,
whatever they read), plus the nodes that must keep their place in the step: those drawing random
numbers (torch's ``nondeterministic_seeded`` tag) and those returning nothing anyone reads. Its
*weight part* is the rest: the nodes only the parameters' gradients need (the weight-gradient
matmuls, their reductions over the batch, the casts and bucketed collectives of those gradients).

:func:`split_weight` makes two graphs of one: ``input_part`` takes the backward graph's
placeholders and returns the inputs' gradients, then the values the weight part reads (the
*kept* values); ``weight_part`` takes those and returns the parameters' gradients. Running one
after the other gives what the whole graph gives: each node runs once, on the same values.

A node that writes into one of its arguments (an ``out=`` collective filling a bucket, an
in-place copy) stays after the earlier readers of that argument and before the later ones: a
reader in the input part pulls the writers before it into it, a writer the earlier readers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from apmodel._torch_private import op_schema
from apmodel.lowering.graph import copy_nodes


@dataclass(frozen=True)
class WeightSplit:
    """``input_part(*placeholders)`` returns ``(*input gradients, *kept values)``;
    ``weight_part(*kept values)`` returns the parameters' gradients."""

    input_part: fx.GraphModule
    weight_part: fx.GraphModule
    n_input_grads: int
    """how many input gradients ``input_part`` returns before the kept values"""
    n_kept: int
    """how many values the input part hands to the weight part"""
    n_weight_nodes: int
    """how many nodes (placeholders and output excluded) run in the weight part"""


def _writes(node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node`` writes into (its schema's mutable arguments)."""
    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, fx.Node):
                written.append(v)
    return written


def _dependencies(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """Per node, the nodes it must run after: its inputs, the writers into any of them that come
    before it, and (for a writer) the earlier readers of what it writes."""
    deps: dict[fx.Node, set[fx.Node]] = {}
    writers: dict[fx.Node, list[fx.Node]] = {}  # node -> the nodes so far that wrote into it
    readers: dict[fx.Node, list[fx.Node]] = {}  # node -> the nodes so far that read it
    for n in graph.nodes:
        d = set(n.all_input_nodes)
        for a in n.all_input_nodes:
            d.update(writers.get(a, ()))
        for target in _writes(n):
            d.update(readers.get(target, ()))
            writers.setdefault(target, []).append(n)
        d.discard(n)
        deps[n] = d
        for a in n.all_input_nodes:
            readers.setdefault(a, []).append(n)
    return deps


def _closure(roots: list[fx.Node], deps: dict[fx.Node, set[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(deps[n])
    return seen


def _pinned(node: fx.Node) -> bool:
    """A node that runs in the input part whatever reads it: random numbers (their order in the
    step fixes their values) and nodes whose result nobody reads (run for their effect)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return True
    return not node.users


def split_weight(gm: fx.GraphModule, n_param_grads: int) -> WeightSplit | None:
    """``gm`` (returning ``n_param_grads`` parameter gradients, then the input gradients) cut into
    its input and weight parts (see the module docstring); None when the weight part would hold no
    node (nothing to defer)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    if not 0 <= n_param_grads <= len(values):
        raise ValueError(f"split_weight: {n_param_grads} parameter gradients of a graph returning {len(values)} values")
    param_out, input_out = values[:n_param_grads], values[n_param_grads:]
    deps = _dependencies(gm.graph)
    roots = [v for v in input_out if isinstance(v, fx.Node)]
    roots += [n for n in gm.graph.nodes if _pinned(n)]
    roots += [n for n in gm.graph.nodes if n.op == "placeholder"]
    needed_by_input = _closure(roots, deps)
    weight_only = _closure([v for v in param_out if isinstance(v, fx.Node)], deps) - needed_by_input
    weight_only.discard(output)
    if not weight_only:
        return None

    kept: list[fx.Node] = []  # input-part nodes the weight part reads, in graph order
    kept_set: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n in weight_only or n is output:
            continue
        readers = [u for u in n.users if u in weight_only]
        if readers or any(v is n for v in param_out):
            kept.append(n)
            kept_set.add(n)

    first, env = copy_nodes(gm, lambda n: n is not output and n not in weight_only)
    first.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in input_out) + tuple(env[n] for n in kept))
    second, env = copy_nodes(gm, lambda n: n in weight_only, kept)
    second.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in param_out))
    first.lint()
    second.lint()
    return WeightSplit(fx.GraphModule(gm, first), fx.GraphModule(gm, second), len(input_out), len(kept),
                       len(weight_only))

"""A native graph cut where it stops depending on the parameters alone, so a pipeline stage can
gather its parameters once per step and keep them for every microbatch.

A graph's *static* nodes read only static placeholders (the parameters' local shards, or a
backward's saved tensors that are parameters' values) and other static nodes: the casts, the
all-gathers and their waits, the views that bring a parameter to the placement its readers want.
Between two optimizer steps they give the same values on every call, so :func:`split_static`
makes two graphs of one: the *prologue* (the static nodes, returning those the rest reads) and
the *main* graph (everything else, taking the prologue's values first). Running the prologue
once per step and the main graph per microbatch issues each parameter gather once per step
(:class:`apmodel.lowering.native.NativeProgram`, ``keep_gathered``).

A node with no input (a bucket's ``empty`` buffer, a constant) is static when every reader of it
is: a buffer the main graph writes must stay one per call. ``get_attr`` nodes and anything torch
tags ``nondeterministic_seeded`` (random numbers) stay in the main graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from apmodel.lowering.graph import copy_nodes


@dataclass(frozen=True)
class StaticSplit:
    """``prologue(*static placeholders)`` returns the values ``main(*those values, *the other
    placeholders)`` reads; ``main`` returns what the whole graph returned."""

    prologue: fx.GraphModule
    main: fx.GraphModule
    n_values: int
    """how many values the prologue hands to the main graph"""


def _deterministic(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and torch.Tag.nondeterministic_seeded not in getattr(
        node.target, "tags", ())


def _static_nodes(gm: fx.GraphModule, seeds: set[fx.Node]) -> set[fx.Node]:
    """The static nodes of ``gm`` given its static placeholders ``seeds`` (module docstring)."""
    sources = {n for n in gm.graph.nodes if not n.all_input_nodes and _deterministic(n)}
    while True:
        static = set(seeds) | sources
        for n in gm.graph.nodes:
            if n.all_input_nodes and _deterministic(n) and all(a in static for a in n.all_input_nodes):
                static.add(n)
        shared = {n for n in sources if any(u not in static for u in n.users)}
        if not shared:
            return static
        sources -= shared


def split_static(gm: fx.GraphModule, static_inputs: Sequence[bool]) -> StaticSplit | None:
    """``gm`` cut at its static nodes (see the module docstring); ``static_inputs``: per
    placeholder, in order, whether it is static. None when no static node is read by the rest
    (nothing to keep)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(static_inputs):
        raise ValueError(f"split_static: {len(placeholders)} placeholders, {len(static_inputs)} flags")
    static = _static_nodes(gm, {n for n, flag in zip(placeholders, static_inputs, strict=True) if flag})
    frontier = [n for n in gm.graph.nodes if n in static and any(u not in static for u in n.users)]
    if not any(n.op != "placeholder" for n in frontier):
        return None

    prologue, env = copy_nodes(gm, lambda n: n in static)
    prologue.output(tuple(env[n] for n in frontier))
    main, _ = copy_nodes(gm, lambda n: n not in static, frontier)
    return StaticSplit(fx.GraphModule(gm, prologue), fx.GraphModule(gm, main), len(frontier))

"""Activation checkpointing as a rewrite of the joint forward-backward graph.

``checkpoint(captured, policy)`` returns a new :class:`CheckpointedGraph` in which the backward no
longer reads the forward values the policy does not save: every backward node that read such a
value reads a *copy* of the forward computation that produces it instead, recomputed (recursively)
from values that are saved, graph inputs and parameters. The copies are ordinary backward nodes
(``is_backward``), placed right before the first backward node that needs them, so every later
stage takes them as they are:

* **pricing**: the copies get candidate strategies and compute costs like any node, so the
  recomputation is priced, and the planner may even choose other layouts for it than for the
  forward (they are separate decisions);
* **memory**: :func:`apmodel.problem.memory.saved_for_backward` counts the forward values backward nodes
  read; the copies read fewer of them (only saved values), so the saved activations drop;
* **lowering**: the interpreter runs the forward nodes, keeps what backward nodes read, then runs
  the backward nodes, copies included: the recomputation happens with no special case.

Why a rewrite of the graph and not a flag the cost and memory models read: the recomputation then
has a layout of its own to choose (the solver prices redistributions into and out of it like any
node), the memory model needs no notion of "recomputed" (it keeps counting what backward reads),
and the lowering needs no recomputation scheduler (it runs backward nodes in order; each copy
sits right before its first reader, inside the layer's backward, where ``torch.utils.checkpoint``
recomputes too). The price is graph size: for LLaMA-3 8B about 34 more nodes per layer under
``selective`` (6,676 -> 7,764) and 62 under ``full`` (8,660), which clustering folds into 60 and
106 more decision variables (436 -> 496 / 542 groups).

A lowered module replaying its plan at other input shapes traces the step again
(:meth:`apmodel.lowering.LoweredProgram.for_inputs`) and rewrites it with the plan's policy
(:func:`policy_of` the planned graph) before comparing structures.

Policies (``PlanOptions.ac``), applied per *region*: the repeated blocks of the model (``layers.N``,
found from the parameter names with :func:`apmodel.graph.conventions.layer_pattern_from_names` and read
off the module stack capture records on every node); a model without repeated blocks is one region.
Values outside every region (embedding, final norm, loss) are never recomputed, and a region's
outputs (values read outside it, e.g. a layer's residual output, which is the next layer's input)
are saved, as ``torch.utils.checkpoint`` saves a checkpointed function's inputs.

* ``"none"``: the graph as traced.
* ``"selective"``: inside a region, the outputs of matmuls (:data:`SAVED_OPS`: ``mm``, ``bmm``,
  ``addmm``, the N-D linears' ``mm_nd``), of the fused attention ops (output and logsumexp) and of ``local_map`` regions
  (:mod:`apmodel.graph.regions`) are saved; everything else
  (norms, activations, elementwise ops, RoPE) is recomputed from them (the per-op policy of
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` as torchtitan uses it).
* ``"full"``: inside a region nothing is saved but its inputs: the region's whole forward is
  recomputed from the region's input (per-layer ``torch.utils.checkpoint.checkpoint``).

Never recomputed, whatever the policy (kept saved): random ops (``nondeterministic_seeded``:
dropout, ``rand``; recomputing would draw another mask; the fused attention ops count as random
only with ``dropout_p > 0``), ops that write into their inputs, and ops whose outputs are buffer
updates (BatchNorm's running statistics: the statistics must be updated once per step). Views of a
saved value are read as they are (they hold no memory of their own).

Copies are named ``<forward name>_recompute``: deterministic, so capturing twice gives the same
graph, and their content hashes agree across layers, so the clustering merges the recomputation
of the L copies of a layer as it merges the layers. The fingerprint of the rewritten graph hashes
the rewritten nodes and the policy, so a plan made with one policy is refused for another.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import operator
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.fx as fx

from apmodel._torch_private import OpOverload, lazy_graph_module, op_schema
from apmodel.core.options import AC_POLICIES
from apmodel.graph.capture import CapturedGraph, aliases_first_input, graph_fingerprint
from apmodel.graph.conventions import layer_pattern_from_names
from apmodel.graph.linear3d import MM_ND, MM_ND_WGRAD
from apmodel.graph.regions import region_of

logger = logging.getLogger(__name__)

#: The policies, as :class:`~apmodel.core.options.PlanOptions` names them (its ``ac`` field).
POLICIES: tuple[str, ...] = AC_POLICIES

#: Suffix of the name of a recomputed copy of a forward node.
RECOMPUTE_SUFFIX = "_recompute"

#: Ops whose outputs the selective policy saves (:data:`SAVED_OP_NAMES`: matmuls and the fused
#: attention ops, whose outputs include the logsumexp their backward reads). Names under
#: ``torch.ops.aten``; an op missing from this torch build is skipped.
ATTENTION_OP_NAMES: tuple[str, ...] = (
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_flash_attention_forward.default",
    "_efficient_attention_forward.default",
)
SAVED_OP_NAMES: tuple[str, ...] = ("mm.default", "bmm.default", "addmm.default", *ATTENTION_OP_NAMES)


def _resolve_ops(names: tuple[str, ...]) -> frozenset[Any]:
    ops = set()
    for name in names:
        packet_name, overload = name.rsplit(".", 1)
        packet = getattr(torch.ops.aten, packet_name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            ops.add(op)
    return frozenset(ops)


#: ... and the N-D linears' matmuls (``apmodel/graph/linear3d.py``), the ``mm`` they replace.
SAVED_OPS: frozenset[Any] = _resolve_ops(SAVED_OP_NAMES) | {MM_ND, MM_ND_WGRAD}
#: Fused attention ops tagged random because of their dropout; deterministic when ``dropout_p`` is 0.
_ATTENTION_OPS: frozenset[Any] = _resolve_ops(ATTENTION_OP_NAMES)


@dataclass
class CheckpointedGraph(CapturedGraph):
    """A :class:`~apmodel.graph.capture.CapturedGraph` rewritten by :func:`checkpoint`."""

    ac: str = "none"
    """the policy the graph was rewritten with"""
    recompute_of: dict[str, str] = field(default_factory=dict)
    """copy node -> the forward node it recomputes"""
    regions: dict[str, str] = field(default_factory=dict)
    """forward node -> its region (``"layers.3"``; ``""`` when the whole model is one region);
    forward nodes outside every region are absent"""
    source_fingerprint: str = ""
    """fingerprint of the graph before the rewrite"""


def policy_of(captured: CapturedGraph) -> str:
    """The checkpointing policy ``captured`` was rewritten with (``"none"`` for a traced graph)."""
    return getattr(captured, "ac", "none")


# ------------------------------------------------------------------------------------ regions
def _layer_regex(captured: CapturedGraph) -> re.Pattern[str] | None:
    pattern = layer_pattern_from_names(captured.param_fqn.values())
    if pattern is None:
        return None
    head = pattern.split("{i}")[0]
    return re.compile(re.escape(head) + r"\d+")


def _module_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [str(path) for path, _ in stack.values()]


def regions_of(captured: CapturedGraph) -> dict[str, str]:
    """Forward op node -> its region: the repeated block (``layers.N``) whose module it ran in, or
    ``""`` for every forward op when the model has no repeated blocks (one region)."""
    regex = _layer_regex(captured)
    is_bwd = captured.is_backward
    ops = [n for n in captured.gm.graph.nodes if n.op == "call_function" and not is_bwd.get(n.name, False)]
    regions: dict[str, str] = {}
    if regex is not None:
        for n in ops:
            for path in _module_paths(n):
                if regex.fullmatch(path):
                    regions[n.name] = path
                    break
    if not regions:
        logger.info("checkpointing: no repeated layers found; the whole forward is one region")
        return {n.name: "" for n in ops}
    return regions


# ------------------------------------------------------------------------------ what is saved
def _argument(node: fx.Node, name: str, default: Any) -> Any:
    schema = op_schema(node.target)
    if schema is None:
        return default
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    return default


def is_random(node: fx.Node) -> bool:
    """The op draws random numbers (recomputing it would draw others)."""
    target = node.target
    if not isinstance(target, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target in _ATTENTION_OPS:
        p = _argument(node, "dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def _is_mutating(node: fx.Node) -> bool:
    schema = op_schema(node.target) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _pinned(captured: CapturedGraph) -> set[str]:
    """Forward nodes that are never recomputed: random ops, ops writing into an input, and the
    producers of buffer updates (with the getitems of those producers)."""
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    pinned: set[str] = set()
    for n in captured.gm.graph.nodes:
        if n.op == "call_function" and not captured.is_backward.get(n.name, False) and (is_random(n) or _is_mutating(n)):
            pinned.add(n.name)
    for update in captured.buffer_update.values():
        node = by_name[update]
        while node.op == "call_function":
            pinned.add(node.name)
            if node.target is operator.getitem or aliases_first_input(node):
                node = node.args[0]
            else:
                break
    # every output of a pinned multi-output op stays with it
    for n in captured.gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in pinned:
            pinned.add(n.name)
    return pinned


def saved_values(captured: CapturedGraph, policy: str, regions: dict[str, str] | None = None) -> dict[str, bool]:
    """Forward node -> True when the backward may read its forward value under ``policy`` (it is
    kept from the forward), False when it is recomputed."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy {policy!r} is not one of {', '.join(POLICIES)}")
    regions = regions_of(captured) if regions is None else regions
    is_bwd = captured.is_backward
    pinned = _pinned(captured)
    saved: dict[str, bool] = {}
    for n in captured.gm.graph.nodes:
        if n.op == "output" or is_bwd.get(n.name, False):
            continue
        if n.op != "call_function" or policy == "none":
            saved[n.name] = True
            continue
        region = regions.get(n.name)
        if region is None or n.name in pinned:
            saved[n.name] = True
            continue
        boundary = any(
            u.op == "output" or (not is_bwd.get(u.name, False) and regions.get(u.name) != region) for u in n.users
        )
        if boundary:
            saved[n.name] = True
        elif n.target is operator.getitem or aliases_first_input(n):
            saved[n.name] = saved.get(n.args[0].name, True)
        else:
            # local_map regions are hand-written compute blocks: kept like matmuls
            saved[n.name] = policy == "selective" and (n.target in SAVED_OPS or region_of(n.target) is not None)
    return saved


# ------------------------------------------------------------------------------------ rewrite
def checkpoint(captured: CapturedGraph, policy: str) -> CapturedGraph:
    """``captured`` rewritten so that its backward recomputes what ``policy`` does not save (see
    the module docstring). ``"none"`` returns ``captured`` itself (as does a graph already rewritten
    with ``policy``); a graph rewritten with another policy is a ``ValueError``. The input graph is
    not modified."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy {policy!r} is not one of {', '.join(POLICIES)}")
    done = policy_of(captured)
    if done == policy or policy == "none":
        return captured
    if done != "none":
        raise ValueError(f"the graph is already checkpointed with ac={done!r}; trace it again for ac={policy!r}")
    start = time.perf_counter()
    regions = regions_of(captured)
    saved = saved_values(captured, policy, regions)
    graph = copy.deepcopy(captured.gm.graph)  # names and meta (shallow) are kept
    is_bwd = dict(captured.is_backward)
    copies: dict[fx.Node, fx.Node] = {}  # forward node -> its recomputed copy

    def needs_copy(x: fx.Node) -> bool:
        return not is_bwd.get(x.name, False) and not saved.get(x.name, True)

    def recompute(value: fx.Node, before: fx.Node) -> fx.Node:
        """The copy of ``value``, created (with the copies it reads) right before ``before``."""
        stack: list[tuple[fx.Node, bool]] = [(value, False)]
        while stack:
            node, ready = stack.pop()
            if node in copies:
                continue
            if not ready:
                stack.append((node, True))
                stack.extend((x, False) for x in node.all_input_nodes if needs_copy(x) and x not in copies)
                continue
            remap = lambda x: copies[x] if needs_copy(x) else x  # noqa: E731
            with graph.inserting_before(before):
                new = graph.create_node(node.op, node.target, fx.map_arg(node.args, remap),
                                        fx.map_arg(node.kwargs, remap), name=node.name + RECOMPUTE_SUFFIX)
            new.meta = dict(node.meta)
            new.meta["partitioner_tag"] = "is_backward"
            new.meta["recompute_of"] = node.name
            is_bwd[new.name] = True
            copies[node] = new
        return copies[value]

    for b in [n for n in graph.nodes if n.op == "call_function" and is_bwd.get(n.name, False)]:
        for a in list(b.all_input_nodes):
            if needs_copy(a):
                b.replace_input_with(a, recompute(a, b))
    gm = lazy_graph_module(captured.gm, graph)  # its code generated on first use
    base_fp = graph_fingerprint(gm, captured.param_fqn)
    fingerprint = hashlib.sha256(f"{base_fp}|ac={policy}".encode()).hexdigest()
    ops = [n for n in graph.nodes if n.op == "call_function"]
    stats = dict(captured.stats)
    stats.update(
        nodes=len(graph.nodes),
        forward=sum(not is_bwd.get(n.name, False) for n in ops),
        backward=sum(is_bwd.get(n.name, False) for n in ops),
        recomputed=len(copies),
    )
    values = {f.name: getattr(captured, f.name) for f in fields(CapturedGraph)}
    rewrite_s = time.perf_counter() - start
    values.update(gm=gm, is_backward=is_bwd, fingerprint=fingerprint, stats=stats,
                  trace_s=captured.trace_s + rewrite_s)
    out = CheckpointedGraph(**values, ac=policy, recompute_of={c.name: f.name for f, c in copies.items()},
                            regions=regions, source_fingerprint=captured.fingerprint)
    logger.info(
        "checkpointing (ac=%s): %d forward values recomputed in %d region(s); %d -> %d nodes in %.2f s",
        policy, len(copies), len(set(regions.values())), len(captured.gm.graph.nodes), len(graph.nodes), rewrite_s,
    )
    return out

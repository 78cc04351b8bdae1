"""Where each node's cost is booked in a plan's per-layer breakdown (:attr:`apmodel.result.plans.Plan.per_layer`).

A node traced inside a module is booked to its layer (``layers.3``) or, outside the repeated
layers, to its outermost module (``tok_embeddings``, ``output``), read off the module stack capture
records (:func:`layer_of`). The other nodes of a joint forward-backward graph have no module
stack; they are booked by data flow (:func:`node_labels`) so that no cost is left unnamed:

* a graph input (parameter, buffer, token input, target, the loss's tangent) goes with the first
  op that reads it, so the reduction of a parameter's gradient into its storage (priced on the edge
  into the parameter) is booked to the parameter's own layer;
* a forward op outside every module is the model's own top-level code (:data:`TOP_LEVEL`: a
  ``freqs_cis[:seq]`` slice) when some module's op depends on it, else the loss function
  (:data:`LOSS`: it only leads to the step's output, e.g. ``log_softmax`` and ``nll_loss``);
* a backward op outside every module is booked with the forward op it differentiates (same
  autograd sequence number ``seq_nr``);
* autograd's gradient accumulation (``add`` of two gradients of one value, e.g. the residual
  stream's) goes to the layer whose gradient it adds in (the first input booked to a module).

:data:`UNATTRIBUTED` remains only for a node none of these rules reaches.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

#: A layer of the repeated blocks, by module path.
_LAYER = re.compile(r"^(.*?layers\.\d+)")
#: The loss function's ops (outside the model; or the model's own top-level code after its last module).
LOSS = "loss"
#: The model's own forward code outside every submodule (e.g. slicing a rotary table).
TOP_LEVEL = "model (top level)"
#: A node no rule of :func:`node_labels` reaches.
UNATTRIBUTED = "other"


def layer_of(node_meta: Mapping[str, Any], fallback: str | None = UNATTRIBUTED) -> str | None:
    """Layer label ("layers.3") of a node from its module stack, else its outermost module's path,
    else ``fallback`` (no module stack)."""
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node_meta.get(key)
        if stack:
            for path, _ in reversed(list(stack.values())):
                m = _LAYER.match(str(path))
                if m:
                    return m.group(1)
            return str(list(stack.values())[0][0]) or fallback
    return fallback


def node_labels(nodes: Iterable[Any], is_backward: Mapping[str, bool]) -> dict[str, str]:
    """Node name -> the label its compute, and the communication on the edges into it, is booked to
    (see the module docstring). ``nodes`` in graph (topological) order."""
    nodes = list(nodes)
    own = {n.name: layer_of(n.meta, None) for n in nodes}
    labels: dict[str, str] = {n.name: lab for n in nodes if (lab := own[n.name]) is not None}
    if not labels:  # no module paths at all (a model without submodules): nothing to attribute by
        return {n.name: UNATTRIBUTED for n in nodes}

    # forward ops outside every module: the model's top level if a module's op depends on them
    feeds_module: dict[str, bool] = {}
    for n in reversed(nodes):
        feeds_module[n.name] = any(own.get(u.name) is not None or feeds_module.get(u.name, False)
                                   for u in n.users if not is_backward.get(u.name, False))
    by_seq: dict[Any, str] = {}
    for n in nodes:
        if n.op == "placeholder" or is_backward.get(n.name, False):
            continue
        if n.name not in labels:
            labels[n.name] = TOP_LEVEL if feeds_module[n.name] else LOSS
        seq = n.meta.get("seq_nr")
        if seq is not None:
            by_seq.setdefault(seq, labels[n.name])

    # backward ops outside every module: with the forward op they differentiate, or by data flow
    for n in nodes:
        if n.op == "placeholder" or n.name in labels:
            continue
        seq = n.meta.get("seq_nr")
        if seq in by_seq and not n.meta.get("is_gradient_acc"):
            labels[n.name] = by_seq[seq]
            continue
        ins = n.all_input_nodes
        first = next((a.name for a in ins if own.get(a.name) is not None), None)
        first = first or next((a.name for a in ins if a.name in labels), None)
        labels[n.name] = labels[first] if first is not None else (by_seq.get(seq) or UNATTRIBUTED)

    # graph inputs: with the first op that reads them
    for n in nodes:
        if n.op == "placeholder" and n.name not in labels:
            user = next((u.name for u in n.users if u.name in labels), None)
            labels[n.name] = labels[user] if user is not None else UNATTRIBUTED
    return labels

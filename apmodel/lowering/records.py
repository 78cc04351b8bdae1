"""Redistribution records: what a lowered step issued, and what its plan says it should.

The tests hold the two lists equal (by kind and mesh axis) against the collectives seen at dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from apmodel.core.options import run_precision_of, torch_dtype
from apmodel.lowering.graph import placement_tokens, tensor_leaves, tensor_vals

# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Redistribution:
    """One redistribution of one tensor: `producer`'s output (index `index`) moved from `src` to `dst`
    placements before `consumer` runs. `phase` is "forward", "backward" or "input" (call-time
    conversion of a user input). Shapes are global."""

    consumer: str
    producer: str
    index: int
    phase: str
    src: tuple[str, ...]
    dst: tuple[str, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    gradient: bool = False
    """it moves a parameter gradient (priced in the reduce dtype under mixed precision)"""
    bucketed: bool = False
    """a parameter's gather or a gradient's reduction: merged into buckets by the native program,
    priced as a share of one (:meth:`apmodel.problem.placement_model.PlacementModel.is_bucketed`)"""

    @property
    def key(self) -> tuple:
        """Identity used to compare issued with planned redistributions."""
        return (self.consumer, self.producer, self.index, self.src, self.dst)


def planned_redistributions(plan: Any, captured: Any) -> list[Redistribution]:
    """The redistributions one training step issues under `plan`, read off the plan alone: for every
    node input whose planned placement differs from its producer's planned output placement, plus
    forward outputs whose planned placement differs from the required one (that of their tangent)
    and parameter / input gradients whose planned placement differs from the storage placement."""
    gm = captured.gm
    out: list[Redistribution] = []
    is_bwd = captured.is_backward
    precision = run_precision_of(getattr(plan, "workload", None) or {})
    reduce_dtype = torch_dtype(precision[1]) if precision is not None else None

    def moved_dtype(val: torch.Tensor, gradient: bool) -> torch.dtype:  # gradients move in the reduce dtype
        return reduce_dtype if gradient and reduce_dtype is not None and val.is_floating_point() else val.dtype

    chain = captured.param_gradient_chain()
    param_values = captured.param_value_chain()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        strat = plan.node_strategy[n.name]
        for (_, prod, idx), dst in zip(tensor_leaves(n), strat.inputs, strict=False):
            src = plan.node_strategy[prod.name].outputs[idx]
            if dst is None or src is None:
                continue
            val = tensor_vals(prod)[idx]
            if placement_tokens(src) != placement_tokens(dst):
                gradient = prod.name in chain and n.name in chain
                out.append(Redistribution(n.name, prod.name, idx, "backward" if is_bwd.get(n.name) else "forward",
                                          placement_tokens(src), placement_tokens(dst), tuple(val.shape), moved_dtype(val, gradient),
                                          gradient=gradient, bucketed=gradient or prod.name in param_values))
    by_name = {n.name: n for n in gm.graph.nodes}
    # Boundary moves: a forward output to its required (tangent) placement, each gradient to its
    # parameter's storage placement or its input's placement.
    boundary = [(f"output:{o}", o, t, "forward") for o, t in captured.output_tangent.items()]
    boundary += [(f"grad:{captured.param_fqn[p]}", g, p, "backward") for p, g in captured.param_grad.items()]
    boundary += [(f"grad:input{captured.input_index[i]}", g, i, "backward") for i, g in captured.input_grad.items()]
    boundary += [(f"buffer:{captured.buffer_fqn[b]}", u, b, "forward") for b, u in captured.buffer_update.items()]
    for label, producer, target, phase in boundary:
        src, dst = plan.node_strategy[producer].outputs[0], plan.node_strategy[target].outputs[0]
        if placement_tokens(src) != placement_tokens(dst):
            val = by_name[producer].meta["val"]
            gradient = label.startswith("grad:") and target in captured.param_fqn
            out.append(Redistribution(label, producer, 0, phase, placement_tokens(src), placement_tokens(dst), tuple(val.shape),
                                      moved_dtype(val, gradient), gradient=gradient, bucketed=gradient))
    return out


def issued_redistributions(module: nn.Module) -> list[Redistribution]:
    """The redistributions the parallel `module` issued in its last step (forward, and backward if
    it ran), in order; compare with :func:`planned_redistributions`."""
    prog = getattr(module, "_apmodel_program", None)
    if prog is None:
        raise TypeError(f"{type(module).__name__} was not made by apmodel.parallelize / lower")
    return list(prog.redistributions)

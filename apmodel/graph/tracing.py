"""Tracing one training step, the part capture and layer stamping share.

:class:`TracedStep` wraps the user's module (under the prefix :data:`WRAPPED`) with the loss, so
AOTAutograd sees one placeholder per tensor; :func:`trace` exports its joint forward-backward graph
on the meta device (every private torch API through :mod:`apmodel._torch_private`), naming the
module that calls a data-dependent op; :func:`simplify` gives the graph a flat calling convention
and drops ``aten.detach`` nodes and dead code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

# Prefix under which the user's module sits inside the wrapper that adds the loss.
WRAPPED = "model"


class TracedStep(nn.Module):
    """The step of an :class:`apmodel.graph.capture.InputSignature` (``signature``) as a module taking
    flat tensors, so that AOTAutograd sees the model's parameters (under the prefix ``model.``)
    and one placeholder per tensor."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, signature: Any) -> None:
        super().__init__()
        self.add_module(WRAPPED, model)
        self.loss_fn = loss_fn
        self.signature = signature

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        args, kwargs, targets = self.signature.split(flat)
        out = getattr(self, WRAPPED)(*args, **kwargs)
        if self.loss_fn is None:
            return out
        return self.loss_fn(out, *(targets if targets is not None else args))


def user_fqn(target: str) -> str:
    """A parameter or buffer FQN of the traced step -> its FQN in the user's model."""
    prefix = WRAPPED + "."
    return target[len(prefix):] if target.startswith(prefix) else target


class ModuleStack:
    """Which module of the step is running (FQN in the user's model), via forward hooks; on an
    exception the innermost module that was entered stays on top (post-hooks do not run)."""

    def __init__(self, step: nn.Module) -> None:
        self.path: list[str] = []
        self._types: list[str] = []
        self._handles = []
        for name, mod in step.named_modules():
            fqn = user_fqn(name) if name != WRAPPED else ""
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._enter(fqn)))
            self._handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.path.append(fqn)
            self._label(type(module).__qualname__)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.path.pop()
        self._types.pop()
        self._publish()

    def _label(self, qualname: str) -> None:
        self._types.append(qualname)
        self._publish()

    def _publish(self) -> None:
        """Tell FX which modules the ops traced next belong to (``node.meta["nn_module_stack"]``,
        copied to backward nodes as ``fwd_nn_module_stack``): plans break costs down per layer."""
        from torch.fx import traceback as fx_traceback

        stack = {p: (p, t) for p, t in zip(self.path, self._types, strict=False) if p}
        if stack:
            fx_traceback.current_meta["nn_module_stack"] = stack
        else:
            fx_traceback.current_meta.pop("nn_module_stack", None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def where(self, model: nn.Module) -> str:
        if not self.path or not self.path[-1]:
            return f"{type(model).__name__}.forward"
        fqn = self.path[-1]
        return f"module {fqn!r} ({type(model.get_submodule(fqn)).__name__})"


def trace(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any]:
    from apmodel._torch_private import (
        autocast_skips_meta,
        causal_mask_detection_off,
        composite_autograd_on_meta,
        export_joint,
        fused_attention_on_meta,
        is_data_dependent_error,
        library_sees_tracing,
    )
    from apmodel.graph.flex import flex_attention_captured
    from apmodel.graph.python_constants import PythonDataAsFactories

    modules = ModuleStack(module)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(composite_autograd_on_meta())
            stack.enter_context(fused_attention_on_meta())
            stack.enter_context(library_sees_tracing())  # libraries skip value-dependent checks, as under export
            stack.enter_context(causal_mask_detection_off())  # nn.Transformer*'s mask comparison reads values
            stack.enter_context(flex_attention_captured())  # flex_attention as a local_map region
            stack.enter_context(autocast_skips_meta())  # torch.autocast(device_type="meta") a no-op
            stack.enter_context(PythonDataAsFactories())  # torch.tensor(3.0) in forward: a graph node with its value
            return export_joint(stack, module, inputs, functionalize=functionalize)
    except Exception as e:
        if not is_data_dependent_error(e):
            raise
        op = str(e).split("\n")[0] or type(e).__name__
        raise ValueError(
            f"capture: {modules.where(getattr(module, WRAPPED))} calls {op}, whose result depends on "
            "tensor values (.item(), nonzero, boolean-mask indexing, or Python control flow on a tensor); "
            "apmodel traces shapes only: compute it outside the model, pass it as an input, or use a "
            "static-shape form (torch.where, masking by multiplication)"
        ) from None
    finally:
        modules.close()


def simplify(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Flat calling convention, no ``aten.detach`` nodes (identity on values), no dead code.
    Returns the module on the simplified graph (its Python code generated on first use: planning
    reads the graph only) and the number of nodes removed."""
    from apmodel._torch_private import lazy_graph_module

    # AOTAutograd's pytree codegen wraps inputs/outputs in nested structures; make the module
    # take one positional argument per placeholder and return the output node's flat list.
    gm.graph.set_codegen(fx.graph.CodeGen())
    before = len(gm.graph.nodes)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return lazy_graph_module(gm, gm.graph), before - len(gm.graph.nodes)

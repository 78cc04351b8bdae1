"""Capture: module + sample inputs + loss -> one joint forward-backward ATen FX graph, labelled.

The graph comes from AOTAutograd's ``aot_export_joint_with_descriptors`` (reached through
:func:`apmodel._torch_private.export_joint`, like every private torch API): it functionalises the
training step and traces forward and backward into one graph of ATen ops, with a descriptor on
every placeholder (``ParamAOTInput(target=fqn)``, ``BufferAOTInput``,
``PlainAOTInput(idx)``, ``TangentAOTInput(output)``) and on every graph output (``PlainAOTOutput``,
``GradAOTOutput(grad_of)``). :func:`capture` turns those descriptors into plain dictionaries keyed by
node name (:class:`CapturedGraph`), so later stages never touch AOTAutograd objects.

Trace on the meta device: build the model under ``with torch.device("meta")`` and pass meta
sample inputs. Nothing is allocated. The time is AOTAutograd's per-op dispatch (functionalisation,
fake tensors, proxy tracing, about 1.3 ms per node) spread evenly, so a stack of identical layers
(a transformer's) is traced with three layers and the others are stamped from the middle one,
after checking that every layer's forward calls the same ops on the same kinds of inputs (see
"repeated layers" below): LLaMA-3 8B (32 layers, 7.5k nodes) captures in about 2.3 s instead of
7.5 s on a 2-core machine, with the same graph.

After tracing, ``aten.detach`` nodes (no-ops on values, inserted by autograd around saved tensors)
are bypassed and dead code is removed; view ops are kept as they are, so the graph reads like the
model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import operator
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from apmodel._torch_private import OpOverload, op_schema, overload_name

logger = logging.getLogger(__name__)

# Prefix under which the user's module sits inside the wrapper that adds the loss.
_WRAPPED = "model"

# Placeholder roles (from the input descriptor) and output roles (from the output descriptor).
ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT, ROLE_TANGENT = "param", "buffer", "input", "tangent"
ROLE_OUTPUT, ROLE_GRAD_PARAM, ROLE_GRAD_INPUT = "output", "grad_param", "grad_input"
ROLE_BUFFER_UPDATE = "buffer_update"


@dataclass
class CapturedGraph:
    """A joint forward-backward ATen graph with every graph input and output labelled.

    All dictionaries are keyed by FX node name (``node.name``).
    """

    gm: fx.GraphModule
    """joint fwd+bwd ATen graph; ``node.meta["val"]`` holds fake (meta) tensor(s). Flat calling
    convention: ``gm(*one_value_per_placeholder)`` returns a list aligned with the output node's
    ``args[0]`` (None where an input has no gradient)."""
    roles: dict[str, str]
    """placeholders: "param" | "buffer" | "input" | "tangent"; returned nodes: "output" (forward
    output, e.g. the loss) | "grad_param" | "grad_input" | "buffer_update"."""
    param_fqn: dict[str, str]
    buffer_fqn: dict[str, str]
    input_index: dict[str, int]
    """input placeholder -> position in ``sample_inputs``"""
    signature: InputSignature
    """how the flat graph inputs map to the user's call (args, kwargs, targets)"""
    tied_params: dict[str, list[str]]
    """param placeholder -> the other FQNs of the same ``nn.Parameter`` (tied weights, e.g. an
    embedding shared with the output layer): one graph input, one gradient (the sum over uses)"""
    buffer_update: dict[str, str]
    """buffer placeholder -> node holding its new value after the step (BatchNorm running
    statistics, any in-place buffer update in forward); written back by lowering"""
    param_grad: dict[str, str]
    """param placeholder -> node returned as its gradient (params without a gradient are absent)"""
    input_grad: dict[str, str]
    """input placeholder -> its gradient node (only float inputs that require grad)"""
    output_tangent: dict[str, str]
    """forward output node -> its tangent placeholder"""
    is_backward: dict[str, bool]
    """every node -> True for backward nodes (tangent placeholders included)"""
    fingerprint: str
    """sha256 hex digest of op sequence, wiring, shapes, dtypes and parameter FQNs"""
    unsupported_ops: list[str]
    """sorted names of ops in the graph that have no DTensor sharding rule"""
    trace_s: float
    """seconds spent in capture (tracing plus labelling)"""
    stats: dict[str, int] = field(default_factory=dict)
    """node counts: "nodes" (all), "placeholders", "forward" and "backward" (call_function nodes)"""
    workload: dict[str, Any] = field(default_factory=dict)
    """how to rebuild the model by name (a reference-model preset: ``model``, ``layers``, and the
    ``batch`` and ``seq`` of its token input); empty for other models"""
    trace_options: dict[str, Any] = field(default_factory=dict)
    """how to trace the same step again at other shapes: ``loss_fn``, ``allow_unused_parameters``,
    ``functionalize`` (the arguments of :func:`capture` besides the model and the inputs)"""

    def param_gradient_chain(self) -> frozenset[str]:
        """Nodes whose value is a parameter gradient up to views: each gradient output, the views
        it is read through (``t``, ``view``, ``_unsafe_view``), and the op that computes it. A
        redistribution on an edge between two of them, or from one to its parameter, is the
        gradient's reduction."""
        by_name = {n.name: n for n in self.gm.graph.nodes}
        chain: set[str] = set()
        for grad in self.param_grad.values():
            node = by_name[grad]
            chain.add(node.name)
            while aliases_first_input(node):
                node = node.args[0]
                chain.add(node.name)
        return frozenset(chain)

    def nodes_with_role(self, role: str) -> list[str]:
        """Node names with ``role``, in graph order."""
        return [n for n, r in self.roles.items() if r == role]


@dataclass(frozen=True)
class InputSignature:
    """How the traced step is called: which flat graph input is which argument of the user's call.

    The step is ``model(*args, **kwargs)``, then, with a loss function, ``loss_fn(output,
    *targets)`` (or ``loss_fn(output, *args)`` when no targets are given: models that take their
    labels). Graph inputs are, in order: the positional ``args``, the tensor keyword arguments (in
    the order given), the ``targets``. Non-tensor keyword arguments are constants of the graph.
    """

    n_args: int
    kwarg_names: tuple[str, ...] = ()
    constant_kwargs: tuple[tuple[str, Any], ...] = ()
    n_targets: int | None = None
    """None: no separate targets (the loss gets the model's positional arguments)"""

    @property
    def n_inputs(self) -> int:
        return self.n_args + len(self.kwarg_names) + (self.n_targets or 0)

    def name(self, index: int) -> str:
        """A readable name of flat input ``index``: ``args[0]``, ``kwargs['mask']``, ``targets[0]``."""
        if index < self.n_args:
            return f"args[{index}]"
        index -= self.n_args
        if index < len(self.kwarg_names):
            return f"kwargs[{self.kwarg_names[index]!r}]"
        return f"targets[{index - len(self.kwarg_names)}]"

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> list[Any]:
        """The flat input list of one call ``(*args, **kwargs)``, where ``args`` holds the model's
        positional arguments followed by the targets; raises ``ValueError`` naming what differs
        from the traced call."""
        n_pos = self.n_args + (self.n_targets or 0)
        if len(args) != n_pos:
            what = f"{self.n_args} model argument(s)" + (f" + {self.n_targets} target(s)" if self.n_targets else "")
            raise ValueError(f"{where}: takes {what} positionally, as traced; got {len(args)}")
        names = set(self.kwarg_names) | {k for k, _ in self.constant_kwargs}
        unknown = sorted(set(kwargs) - names)
        missing = sorted(names - set(kwargs))
        if unknown or missing:
            raise ValueError(
                f"{where}: keyword arguments differ from the traced call "
                f"(unexpected {unknown}, missing {missing})"
            )
        for k, v in self.constant_kwargs:
            if not (kwargs[k] is v or (type(kwargs[k]) is type(v) and kwargs[k] == v)):
                raise ValueError(f"{where}: keyword argument {k!r} is {kwargs[k]!r}; it was traced as the constant {v!r}")
        return list(args[: self.n_args]) + [kwargs[k] for k in self.kwarg_names] + list(args[self.n_args:])

    def split(self, flat: Sequence[Any]) -> tuple[tuple, dict[str, Any], tuple | None]:
        """Flat inputs -> ``(args, kwargs, targets)`` of the traced call (constants included in
        ``kwargs``; ``targets`` is None when the loss reads the model's arguments)."""
        n_kw = len(self.kwarg_names)
        kwargs = dict(zip(self.kwarg_names, flat[self.n_args:self.n_args + n_kw]))
        kwargs.update(self.constant_kwargs)
        targets = tuple(flat[self.n_args + n_kw:]) if self.n_targets is not None else None
        return tuple(flat[: self.n_args]), kwargs, targets


class _TracedStep(nn.Module):
    """The step of :class:`InputSignature` as a module taking flat tensors, so that AOTAutograd
    sees the model's parameters (under the prefix ``model.``) and one placeholder per tensor."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, signature: InputSignature) -> None:
        super().__init__()
        self.add_module(_WRAPPED, model)
        self.loss_fn = loss_fn
        self.signature = signature

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        args, kwargs, targets = self.signature.split(flat)
        out = getattr(self, _WRAPPED)(*args, **kwargs)
        if self.loss_fn is None:
            return out
        return self.loss_fn(out, *(targets if targets is not None else args))


def has_dtensor_rule(op: Any) -> bool:
    """True when DTensor has a sharding rule for ``op`` (delegates to :mod:`apmodel._torch_private`,
    the one module that reads DTensor's private registries)."""
    from apmodel._torch_private import has_sharding_rule

    return has_sharding_rule(op)


def _as_tensor_tuple(values: Any, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(values, torch.Tensor):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        raise ValueError(f"capture: {what} must be a tuple of tensors, got {type(values).__name__}")
    for i, x in enumerate(values):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"capture: {what}[{i}] must be a torch.Tensor, got {type(x).__name__}")
    return tuple(values)


def _validate(
    model: Any, sample_inputs: Any, loss_fn: Any, kwargs: Any, targets: Any
) -> tuple[InputSignature, tuple[torch.Tensor, ...]]:
    """Check the call and return its signature and flat tensor inputs."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"capture: model must be a torch.nn.Module, got {type(model).__name__}")
    args = _as_tensor_tuple(sample_inputs, "sample_inputs")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"capture: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"capture: kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    tensor_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    constants = tuple((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    for k, v in constants:
        if not isinstance(v, (bool, int, float, str, type(None))):
            raise ValueError(
                f"capture: keyword argument {k!r} is a {type(v).__name__}; keyword arguments must be "
                "tensors or constants (bool, int, float, str, None)"
            )
    if targets is not None:
        if loss_fn is None:
            raise ValueError("capture: targets are passed to loss_fn; give loss_fn too")
        targets = _as_tensor_tuple(targets, "targets")
    signature = InputSignature(
        n_args=len(args),
        kwarg_names=tuple(tensor_kwargs),
        constant_kwargs=constants,
        n_targets=None if targets is None else len(targets),
    )
    flat = args + tuple(tensor_kwargs.values()) + (targets or ())
    devices = {p.device.type for p in model.parameters()} | {x.device.type for x in flat}
    if devices - {"meta"}:
        logger.warning(
            "capture: tensors on %s; trace on the meta device (build the model under "
            "torch.device('meta')) to avoid allocating memory and CPU-only attention kernels",
            sorted(devices),
        )
    return signature, flat


def _progress(message: str) -> contextlib.AbstractContextManager:
    """A transient rich spinner on stderr (nothing when stderr is not a terminal)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext()
    return console.status(message, spinner="dots")


class _ModuleStack:
    """Which module of the step is running (FQN in the user's model), via forward hooks; on an
    exception the innermost module that was entered stays on top (post-hooks do not run)."""

    def __init__(self, step: nn.Module) -> None:
        self.path: list[str] = []
        self._types: list[str] = []
        self._handles = []
        for name, mod in step.named_modules():
            fqn = _user_fqn(name) if name != _WRAPPED else ""
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

        stack = {p: (p, t) for p, t in zip(self.path, self._types) if p}
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


def _trace(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any]:
    from apmodel._torch_private import (
        composite_autograd_on_meta,
        export_joint,
        fused_attention_on_meta,
        is_data_dependent_error,
        library_sees_tracing,
    )

    from apmodel.python_constants import PythonDataAsFactories

    modules = _ModuleStack(module)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(composite_autograd_on_meta())
            stack.enter_context(fused_attention_on_meta())
            stack.enter_context(library_sees_tracing())  # libraries skip value-dependent checks, as under export
            stack.enter_context(PythonDataAsFactories())  # torch.tensor(3.0) in forward: a graph node with its value
            return export_joint(stack, module, inputs, functionalize=functionalize)
    except Exception as e:
        if not is_data_dependent_error(e):
            raise
        op = str(e).split("\n")[0] or type(e).__name__
        raise ValueError(
            f"capture: {modules.where(getattr(module, _WRAPPED))} calls {op}, whose result depends on "
            "tensor values (.item(), nonzero, boolean-mask indexing, or Python control flow on a tensor); "
            "apmodel traces shapes only: compute it outside the model, pass it as an input, or use a "
            "static-shape form (torch.where, masking by multiplication)"
        ) from None
    finally:
        modules.close()


# ------------------------------------------------------------------------------- repeated layers
# A transformer's layers are structurally identical, and tracing them is most of capture's time
# (about 0.25 s per LLaMA-3 8B layer). When a model holds such a stack, capture traces a copy of
# the model with its first three layers (first, one middle, last), checks that the graph repeats
# layer by layer, and stamps the middle layer once per missing layer: the same nodes, names,
# wiring, descriptors and metadata as tracing every layer (tests/test_capture_stamping.py compares
# the two on the reference models). Layers ahead of the stack that differ from it (DeepSeek-MoE's
# dense first layer) are traced as they are. Anything that does not fit falls back to the full trace.

#: stacks with fewer layers are traced whole (stamping traces three and runs two forward checks)
_STAMP_MIN_LAYERS = 6
#: layers of the traced template: the first, one middle layer and the last
_TEMPLATE_LAYERS = 3
_NAME_SUFFIX = re.compile(r"(.*)_(\d+)$")


class _NotStampable(Exception):
    """The traced template does not repeat layer by layer; trace the whole model instead."""


class _LayerStack:
    """Structurally identical layers in a container of the user's model (``nn.ModuleList``,
    ``nn.ModuleDict`` or ``nn.Sequential``), by the container's FQN and their child names
    (``keys``); ``before``: the container's children ahead of them, which differ (DeepSeek-MoE's
    dense first layers) and are traced as they are, like any module outside the stack."""

    def __init__(self, path: str, keys: Sequence[str], before: Sequence[str] = ()) -> None:
        self.path = path
        self.keys = tuple(keys)
        self.before = tuple(before)
        self._index = {k: i for i, k in enumerate(self.keys)}

    def prefix(self, i: int) -> str:
        return f"{self.path}.{self.keys[i]}" if self.path else self.keys[i]

    def layer_of(self, fqn: str) -> int | None:
        """Index of the layer ``fqn`` (a user FQN) lies in, None outside the stack."""
        if self.path:
            if not fqn.startswith(self.path + "."):
                return None
            fqn = fqn[len(self.path) + 1:]
        return self._index.get(fqn.split(".", 1)[0])

    def relayer(self, fqn: str, i: int, j: int) -> str:
        """``fqn`` of layer ``i`` moved to layer ``j``."""
        return self.prefix(j) + fqn[len(self.prefix(i)):]


def _module_signature(module: nn.Module) -> tuple:
    return (
        tuple((name, type(m)) for name, m in module.named_modules()),
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad, p.device.type)
              for name, p in module.named_parameters(remove_duplicate=False)),
        tuple((name, tuple(b.shape), b.dtype, b.device.type) for name, b in module.named_buffers(remove_duplicate=False)),
    )


def _repeated_stack(model: nn.Module) -> _LayerStack | None:
    """The run of structurally identical children (same module types, parameter and buffer
    names, shapes and dtypes; no parameter shared) that ends a container, of the most parameters.
    Only a leading part may differ: layers after the run would be traced with a truncated stack."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    best: tuple[int, _LayerStack] | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < _STAMP_MIN_LAYERS or len({id(c) for _, c in children}) != len(children):
            continue
        last = _module_signature(children[-1][1])
        start = len(children) - 1
        while start > 0 and _module_signature(children[start - 1][1]) == last:
            start -= 1
        run = children[start:]
        if len(run) < _STAMP_MIN_LAYERS:
            continue
        params = [p for _, c in run for p in c.parameters()]
        if any(uses.get(id(p), 0) != 1 for p in params):
            continue
        size = sum(p.numel() for p in params)
        if best is None or size > best[0]:
            best = (size, _LayerStack(path, [k for k, _ in run], [k for k, _ in children[:start]]))
    return best[1] if best is not None else None


def _truncated(model: nn.Module, stack: _LayerStack, k: int) -> nn.Module:
    """A shallow copy of ``model`` whose stack holds its first ``k`` layers (the same modules;
    the container's children before the stack stay)."""
    names = stack.path.split(".") if stack.path else []

    def rebuild(module: nn.Module, depth: int) -> nn.Module:
        new = copy.copy(module)
        if depth == len(names):
            new._modules = {key: module._modules[key] for key in (*stack.before, *stack.keys[:k])}
        else:
            new._modules = dict(module._modules)
            new._modules[names[depth]] = rebuild(module._modules[names[depth]], depth + 1)
        return new

    return rebuild(model, 0)


def _split_name(name: str) -> tuple[str, int]:
    """FX's node naming: ``mm`` is number 0 of base ``mm``, ``mm_3`` number 3."""
    m = _NAME_SUFFIX.match(name)
    if m is None:
        return name, 0
    if int(m.group(2)) == 0:
        raise _NotStampable(f"node name {name}")
    return m.group(1), int(m.group(2))


class _ForwardRecord(torch.overrides.TorchFunctionMode):
    """Every torch call of one forward pass, per layer of ``stack`` (and outside it): the function,
    its constants, its tensors' shapes and dtypes and where each tensor comes from (an op of the
    same layer, of a layer before or after it, outside the stack, or a parameter by its name in
    its layer). Two layers that record the same list trace to the same graph."""

    def __init__(self, step: nn.Module, stack: _LayerStack, n_layers: int) -> None:
        super().__init__()
        self.stack = stack
        self.n = n_layers
        self.layer: int | None = None
        self.layers: list[list[tuple]] = [[] for _ in range(n_layers)]
        self.outside: list[tuple] = []
        self._source: dict[int, tuple[int | None, int]] = {}
        self._alive: list[Any] = []
        self._named: dict[int, tuple[int | None, str]] = {}
        for name, t in [*step.named_parameters(remove_duplicate=False), *step.named_buffers(remove_duplicate=False)]:
            fqn = _user_fqn(name)
            i = stack.layer_of(fqn)
            self._named[id(t)] = (i, fqn[len(stack.prefix(i)):] if i is not None else fqn)
        self._handles = []
        container = getattr(step, _WRAPPED).get_submodule(stack.path) if stack.path else getattr(step, _WRAPPED)
        for i, key in enumerate(stack.keys[:n_layers]):
            layer = container.get_submodule(key)
            self._handles.append(layer.register_forward_pre_hook(self._enter(i)))
            self._handles.append(layer.register_forward_hook(self._leave))

    def _enter(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.layer = i

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.layer = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def _relative(self, i: int | None) -> Any:
        if i is None:
            return None
        if self.layer is not None:
            return i - self.layer
        return "first" if i == 0 else "last" if i == self.n - 1 else ("middle", i)

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            named = self._named.get(id(value))
            if named is not None:
                where = ("param", self._relative(named[0]), named[1])
            elif id(value) in self._source:
                i, index = self._source[id(value)]
                where = ("op", self._relative(i), index)
            else:
                where = ("input",)
            return ("tensor", tuple(value.shape), value.dtype, where)
        if isinstance(value, (tuple, list)):
            return tuple(self._describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self._describe(v)) for k, v in value.items())
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.Size)):
            return value
        if isinstance(value, slice):
            return ("slice", self._describe(value.start), self._describe(value.stop), self._describe(value.step))
        if isinstance(value, (torch.layout, torch.memory_format)) or value is Ellipsis:
            return repr(value)
        return type(value).__qualname__

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        record = self.outside if self.layer is None else self.layers[self.layer]
        record.append((func, self._describe(args), self._describe(kwargs)))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and id(t) not in self._named:
                self._source[id(t)] = (self.layer, len(record) - 1)
                self._alive.append(t)
        return out


def _record_forward(step: nn.Module, stack: _LayerStack, n_layers: int, inputs: tuple[torch.Tensor, ...]) -> _ForwardRecord:
    from apmodel._torch_private import composite_autograd_on_meta, fused_attention_on_meta, library_sees_tracing

    record = _ForwardRecord(step, stack, n_layers)
    try:
        with torch.no_grad(), composite_autograd_on_meta(), fused_attention_on_meta(), library_sees_tracing(), record:
            step(*inputs)
    finally:
        record.close()
    return record


class _Template:
    """A joint graph traced with layers 0, 1 and 2 of a stack, split into the runs of nodes of
    each layer (parameters, forward, backward) and the nodes outside the stack; :meth:`stamp`
    writes the graph of any number of layers."""

    def __init__(self, gm: fx.GraphModule, stack: _LayerStack) -> None:
        from apmodel._torch_private import BufferAOTInput, ParamAOTInput

        self.gm = gm
        self.stack = stack
        self.k = _TEMPLATE_LAYERS
        self._paths: dict[tuple[Any, int, int], Any] = {}
        self.nodes = list(gm.graph.nodes)
        out = self.nodes[-1]
        if out.op != "output" or len(out.args) != 1 or not isinstance(out.args[0], (tuple, list)):
            raise _NotStampable("output node")
        self.out = out
        tag: dict[fx.Node, int | None] = {}
        previous: int | None = None
        for n in self.nodes[:-1]:
            if n.op == "placeholder":
                desc = n.meta.get("desc")
                fqn = _user_fqn(desc.target) if isinstance(desc, (ParamAOTInput, BufferAOTInput)) else None
                t = stack.layer_of(fqn) if fqn is not None else None
                if n.target != n.name:
                    raise _NotStampable(f"placeholder {n.name}")
            elif n.op == "call_function":
                modules = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
                if modules:
                    t = next((i for i in map(stack.layer_of, modules) if i is not None), None)
                elif n.meta.get("is_gradient_acc"):
                    t = previous  # autograd's sum of two gradients: it goes with the op before it
                else:
                    t = None  # the model's own code around its modules
            else:
                raise _NotStampable(f"{n.op} node {n.name}")
            tag[n] = previous = t
        self.tag = tag
        # runs of equal tags; each run of layer segments must read 0, 1, 2 or 2, 1, 0
        self.parts: list[tuple[str, Any]] = []  # ("outside", nodes) | ("layers", ascending, [nodes of layer 0, 1, 2])
        self.where: dict[fx.Node, tuple[int, int]] = {}  # layer node -> (part, position)
        self.first_differs: set[int] = set()  # parts whose first layer does not match the others
        self.out_tags = self._output_tags(tag)
        self._split(self.nodes[:-1], [tag[n] for n in self.nodes[:-1]], nodes=True)
        self.out_parts = self._split(list(range(len(self.out_tags))), self.out_tags, nodes=False)
        # name numbering: each node's gap to the node of the same base before it
        self.gap: dict[fx.Node, tuple[str, int]] = {}
        last: dict[str, int] = {}
        for n in self.nodes[:-1]:
            base, num = _split_name(n.name)
            gap = num - last.get(base, -1)
            if gap < 1:
                raise _NotStampable(f"node names not in order at {n.name}")
            last[base] = num
            self.gap[n] = (base, gap)

    def _output_tags(self, tag: dict[fx.Node, int | None]) -> list[int | None]:
        """The layer of each returned value. The outputs end with one gradient per graph input
        (not the tangents), in input order, None for inputs without one (buffers, integer
        inputs; AOTAutograd gives those no descriptor): they take their input's layer."""
        from apmodel._torch_private import GradAOTOutput, TangentAOTInput

        descs = list(self.out.meta.get("desc", ()))
        if len(descs) != len(self.out.args[0]):
            raise _NotStampable("output descriptors")
        primals = [n for n in self.nodes if n.op == "placeholder" and not isinstance(n.meta.get("desc"), TangentAOTInput)]
        start = len(descs) - len(primals)
        if start < 0:
            raise _NotStampable("fewer outputs than gradients")
        tags: list[int | None] = []
        for e, d in enumerate(descs):
            if e >= start:
                primal = primals[e - start]
                if d is not None and not (isinstance(d, GradAOTOutput) and d.grad_of == primal.meta.get("desc")):
                    raise _NotStampable(f"output {e} is not the gradient of {primal.name}")
                tags.append(tag[primal])
            elif d is None:
                raise _NotStampable(f"output {e} has no descriptor")
            else:
                tags.append(self._desc_layer(d))
        return tags

    def _desc_layer(self, desc: Any) -> int | None:
        target = _desc_target(desc)
        return self.stack.layer_of(_user_fqn(target)) if target is not None else None

    def _split(self, items: list, tags: list[int | None], nodes: bool) -> list[tuple[str, Any]]:
        segments: list[tuple[int | None, list]] = []
        for item, t in zip(items, tags):
            if segments and segments[-1][0] == t:
                segments[-1][1].append(item)
            else:
                segments.append((t, [item]))
        parts: list[tuple[str, Any]] = [] if not nodes else self.parts
        i = 0
        while i < len(segments):
            t, run = segments[i]
            if t is None:
                parts.append(("outside", run))
                i += 1
                continue
            group = segments[i:i + self.k]
            order = [g[0] for g in group]
            if order not in (list(range(self.k)), list(range(self.k))[::-1]):
                raise _NotStampable(f"layer runs in order {order}")
            runs = [g[1] for g in group]
            if order[0] != 0:
                runs = runs[::-1]
            # the middle and the last layer must match node for node; the first may differ (its
            # input needs no gradient) as long as no other layer reads it (see stamp)
            first_matches = self._alike(runs[0], runs[1], nodes)
            if not self._alike(runs[1], runs[2], nodes) or not (first_matches or nodes):
                raise _NotStampable(f"layer runs differ (lengths {[len(r) for r in runs]})")
            if nodes:
                for run in runs:
                    for p, node in enumerate(run):
                        self.where[node] = (len(parts), p)
                if not first_matches:
                    self.first_differs.add(len(parts))
            parts.append(("layers", order[0] == 0, runs))
            i += self.k
        return parts

    @staticmethod
    def _alike(a: list, b: list, nodes: bool) -> bool:
        if len(a) != len(b):
            return False
        if not nodes:
            return True
        return all(
            x.op == y.op and (x.op == "placeholder" or x.target == y.target)
            and _split_name(x.name)[0] == _split_name(y.name)[0]
            for x, y in zip(a, b)
        )

    def _role(self, j: int, n: int) -> int:
        """The template layer that layer ``j`` of ``n`` is a copy of."""
        return 0 if j == 0 else self.k - 1 if j == n - 1 else 1

    def stamp(self, n: int) -> fx.GraphModule:
        """The graph of the same step with ``n`` layers (``n >= 2``)."""
        k = self.k
        # nodes go straight into the module's graph: the code is generated once, by _simplify
        gm = fx.GraphModule(self.gm, fx.Graph())
        gm.meta.update(self.gm.meta)
        graph = gm.graph
        outside: dict[fx.Node, fx.Node] = {}
        copies: dict[tuple[int, int, int], fx.Node] = {}  # (part, position, layer) -> node
        counter: dict[str, int] = {}

        def lookup(a: fx.Node, i: int | None, j: int | None) -> fx.Node:
            ta = self.tag[a]
            if ta is None:
                return outside[a]
            if i is None:  # outside the stack: reads the first or the last layer
                ja = 0 if ta == 0 else n - 1 if ta == k - 1 else None
            else:
                ja = j + (ta - i) if abs(ta - i) <= 1 else None
            if ja is None or not 0 <= ja < n:
                raise _NotStampable(f"{a.name} read across layers")
            if self._role(ja, n) != ta and ta != 1 and self._role(ja, n) != 1:
                raise _NotStampable(f"{a.name} read from layer {ja}")
            part, p = self.where[a]
            if part in self.first_differs and (ta == 0) != (self._role(ja, n) == 0):
                raise _NotStampable(f"{a.name}: the first layer differs from the others and is read across layers")
            return copies[(part, p, ja)]

        def emit(x: fx.Node, i: int | None, j: int | None) -> fx.Node:
            base, gap = self.gap[x]
            num = counter.get(base, -1) + gap
            counter[base] = num
            name = f"{base}_{num}" if num else base
            args = fx.node.map_arg(x.args, lambda a: lookup(a, i, j))
            kwargs = fx.node.map_arg(x.kwargs, lambda a: lookup(a, i, j))
            target = name if x.op == "placeholder" else x.target
            node = graph.create_node(x.op, target, args, kwargs, name=name, type_expr=x.type)
            if node.name != name:
                raise _NotStampable(f"name {name} taken")
            node.meta = self._meta(x.meta, i, j) if i is not None and i != j else dict(x.meta)
            return node

        for index, part in enumerate(self.parts):
            if part[0] == "outside":
                for x in part[1]:
                    outside[x] = emit(x, None, None)
                continue
            _, ascending, runs = part
            for j in (range(n) if ascending else range(n - 1, -1, -1)):
                i = self._role(j, n)
                for p, x in enumerate(runs[i]):
                    copies[(index, p, j)] = emit(x, i, j)

        values: list[Any] = []
        descs: list[Any] = []
        template_values = list(self.out.args[0])
        template_descs = list(self.out.meta["desc"])
        for part in self.out_parts:
            if part[0] == "outside":
                for e in part[1]:
                    v = template_values[e]
                    values.append(fx.node.map_arg(v, lambda a: lookup(a, None, None)))
                    descs.append(template_descs[e])
                continue
            _, ascending, runs = part
            for j in (range(n) if ascending else range(n - 1, -1, -1)):
                i = self._role(j, n)
                for e in runs[i]:
                    values.append(fx.node.map_arg(template_values[e], lambda a: lookup(a, i, j)))
                    descs.append(_relayer_desc(template_descs[e], lambda f: self._relayer_target(f, i, j)))
        out = graph.create_node("output", "output", (type(self.out.args[0])(values),), {}, type_expr=self.out.type)
        out.meta = {**self.out.meta, "desc": descs}
        return gm

    def _relayer_target(self, target: str, i: int, j: int) -> str:
        fqn = _user_fqn(target)
        return target[: len(target) - len(fqn)] + self.stack.relayer(fqn, i, j)

    def _meta(self, meta: dict[str, Any], i: int, j: int) -> dict[str, Any]:
        new = dict(meta)
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            modules = meta.get(key)
            if modules:
                new[key] = {self._relayer_path(p, i, j): (self._relayer_path(v[0], i, j), *v[1:])
                            for p, v in modules.items()}
        if "desc" in meta:
            new["desc"] = _relayer_desc(meta["desc"], lambda f: self._relayer_target(f, i, j))
        return new

    def _relayer_path(self, path: Any, i: int, j: int) -> Any:
        key = (path, i, j)
        if key not in self._paths:
            moved = isinstance(path, str) and self.stack.layer_of(path) == i
            self._paths[key] = self.stack.relayer(path, i, j) if moved else path
        return self._paths[key]


def _desc_target(desc: Any) -> str | None:
    """The parameter or buffer FQN an AOT descriptor names (a gradient's, a mutation's: nested)."""
    if not dataclasses.is_dataclass(desc):
        return None
    for f in dataclasses.fields(desc):
        value = getattr(desc, f.name)
        if f.name == "target" and isinstance(value, str):
            return value
        inner = _desc_target(value)
        if inner is not None:
            return inner
    return None


def _relayer_desc(desc: Any, rename: Callable[[str], str]) -> Any:
    if not dataclasses.is_dataclass(desc):
        return desc
    changes = {}
    for f in dataclasses.fields(desc):
        value = getattr(desc, f.name)
        if f.name == "target" and isinstance(value, str):
            changes[f.name] = rename(value)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = _relayer_desc(value, rename)
    return dataclasses.replace(desc, **changes) if changes else desc


def _trace_stamped(
    step: _TracedStep, stack: _LayerStack, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any]:
    """Trace ``step`` with the first three layers of ``stack`` and stamp the rest (raises
    :class:`_NotStampable` where the layers do not repeat)."""
    model = getattr(step, _WRAPPED)
    n, k = len(stack.keys), _TEMPLATE_LAYERS
    small = _TracedStep(_truncated(model, stack, k), step.loss_fn, step.signature)
    full_record = _record_forward(step, stack, n, inputs)
    small_record = _record_forward(small, stack, k, inputs)
    if not (
        all(r == full_record.layers[1] for r in full_record.layers[2:])
        and small_record.layers[0] == full_record.layers[0]
        and all(r == full_record.layers[1] for r in small_record.layers[1:])
        and small_record.outside == full_record.outside
    ):
        raise _NotStampable("the layers' forward passes differ (by position in the stack, or with their number)")
    gm, out_spec = _trace(small, inputs, functionalize=functionalize)
    return _Template(gm, stack).stamp(n), out_spec


def _trace_step(
    step: _TracedStep, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any]:
    """:func:`_trace`, with a stack of identical layers traced once and stamped where it repeats."""
    model = getattr(step, _WRAPPED)
    on_meta = all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers(), *inputs])
    stack = _repeated_stack(model) if on_meta else None
    if stack is not None:
        start = time.perf_counter()
        try:
            gm, out_spec = _trace_stamped(step, stack, inputs, functionalize)
        except Exception as e:  # anything the template cannot express: trace every layer
            logger.info("capture: layers %s not stamped (%s: %s); tracing all of them",
                        stack.path or "(the model)", type(e).__name__, e)
        else:
            logger.info("capture: traced 3 of the %d layers of %s and stamped the others in %.2f s",
                        len(stack.keys), stack.path or "the model", time.perf_counter() - start)
            return gm, out_spec
    return _trace(step, inputs, functionalize)


def aliases_first_input(node: fx.Node) -> bool:
    """A view of its first input (``t``, ``view``, ``transpose``, ``_unsafe_view``...)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is torch.ops.aten._unsafe_view.default:  # a view that does not say so in its schema
        return True
    schema = op_schema(node.target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _is_view(node: fx.Node) -> bool:
    """True when ``node``'s result may alias one of its inputs (a view, or an in-place op)."""
    if node.op != "call_function":
        return node.op == "placeholder"
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    schema = op_schema(node.target)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _functional_variant(op: Any) -> Any:
    """``aten.add_.Scalar`` -> ``aten.add.Scalar`` (None when there is none)."""
    if not isinstance(op, OpOverload):
        return None
    name = op.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, overload_name(op), None) if packet is not None else None


def _remove_local_mutations(gm: fx.GraphModule) -> bool:
    """Rewrite in-place ops on fresh intermediates as out-of-place ops; False when a mutation is
    not of that kind (it mutates an input, a view or an aliased tensor) and the graph must be
    traced with functionalization instead.

    Tracing without AOTAutograd's functionalization is about 20% faster; decompositions such as
    ``rms_norm``'s then leave ``add_`` on a tensor they just created. ``y = op_(x, ...)`` becomes
    ``y = op(x, ...)`` with every later use of ``x`` reading ``y``; this is exact when ``x`` is
    the output of a non-aliasing op and nothing views it.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutations = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and op_schema(n.target) is not None and op_schema(n.target).is_mutable
    ]
    for n in mutations:
        functional = _functional_variant(n.target)
        mutated = n.args[0] if n.args else None
        if functional is None or not isinstance(mutated, fx.Node) or _is_view(mutated):
            return False
        if any(u is not n and _is_view(u) for u in mutated.users):
            return False
        # only the first argument may be written
        if any(a.alias_info is not None and a.alias_info.is_write for a in op_schema(n.target).arguments[1:]):
            return False
    for n in mutations:
        mutated = n.args[0]
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(_functional_variant(n.target), n.args, n.kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        for u in list(mutated.users):
            if u is not new and order.get(u, -1) > order[n]:
                u.replace_input_with(mutated, new)
        gm.graph.erase_node(n)
    return True


def _simplify(gm: fx.GraphModule) -> int:
    """Flat calling convention, no ``aten.detach`` nodes (identity on values), no dead code.
    Returns the number of nodes removed."""
    # AOTAutograd's pytree codegen wraps inputs/outputs in nested structures; make the module
    # take one positional argument per placeholder and return the output node's flat list.
    gm.graph.set_codegen(fx.graph.CodeGen())
    before = len(gm.graph.nodes)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return before - len(gm.graph.nodes)


def _target_name(target: Any) -> str:
    if isinstance(target, OpOverload):
        return str(target)  # e.g. "aten.mm.default"
    return getattr(target, "__name__", str(target))


def _val_signature(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)}:{val.dtype}"
    if isinstance(val, (tuple, list)):
        return "(" + ",".join(_val_signature(v) for v in val) + ")"
    return repr(val)


def _fingerprint(gm: fx.GraphModule, param_fqn: dict[str, str]) -> str:
    """sha256 of, per node in order: op kind, target, arguments (nodes by position), value shapes
    and dtypes; plus each parameter placeholder's FQN."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg_repr(a: Any) -> str:
        return f"%{index[a]}" if isinstance(a, fx.Node) else repr(a)

    h = hashlib.sha256()
    for n in gm.graph.nodes:
        args = fx.node.map_aggregate(n.args, arg_repr)
        kwargs = fx.node.map_aggregate(n.kwargs, arg_repr)
        line = f"{n.op}|{_target_name(n.target)}|{args}|{kwargs}|{_val_signature(n.meta.get('val'))}"
        line += f"|{param_fqn.get(n.name, '')}\n"
        h.update(line.encode())
    return h.hexdigest()


def _label(gm: fx.GraphModule) -> dict[str, Any]:
    """Turn AOT descriptors into role / FQN / pairing dictionaries keyed by node name."""
    from apmodel._torch_private import (
        BufferAOTInput,
        GradAOTOutput,
        InputMutationAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        TangentAOTInput,
    )

    roles: dict[str, str] = {}
    param_fqn: dict[str, str] = {}
    buffer_fqn: dict[str, str] = {}
    input_index: dict[str, int] = {}
    by_input_desc: dict[Any, str] = {}
    tangent_of_output_desc: dict[Any, str] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        desc = n.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            roles[n.name] = ROLE_PARAM
            param_fqn[n.name] = _user_fqn(desc.target)
        elif isinstance(desc, BufferAOTInput):
            roles[n.name] = ROLE_BUFFER
            buffer_fqn[n.name] = _user_fqn(desc.target)
        elif isinstance(desc, PlainAOTInput):
            roles[n.name] = ROLE_INPUT
            input_index[n.name] = desc.idx
        elif isinstance(desc, TangentAOTInput):
            roles[n.name] = ROLE_TANGENT
            tangent_of_output_desc[desc.output] = n.name
        else:
            raise ValueError(
                f"capture: graph input {n.name} has descriptor {desc!r}, which capture does not "
                "handle (tensor subclasses, RNG state or effect tokens in the model)"
            )
        by_input_desc[desc] = n.name

    param_grad: dict[str, str] = {}
    input_grad: dict[str, str] = {}
    output_tangent: dict[str, str] = {}
    buffer_update: dict[str, str] = {}
    out_node = gm.graph.output_node()
    for value, desc in zip(out_node.args[0], out_node.meta["desc"]):
        if not isinstance(value, fx.Node):
            continue  # None: an input without gradient
        if isinstance(desc, PlainAOTOutput):
            role = ROLE_OUTPUT
            if desc in tangent_of_output_desc:
                output_tangent[value.name] = tangent_of_output_desc[desc]
        elif isinstance(desc, GradAOTOutput):
            of = by_input_desc.get(desc.grad_of)
            if isinstance(desc.grad_of, ParamAOTInput):
                role = ROLE_GRAD_PARAM
                param_grad[of] = value.name
            elif isinstance(desc.grad_of, PlainAOTInput):
                role = ROLE_GRAD_INPUT
                input_grad[of] = value.name
            else:
                role = "grad_" + type(desc.grad_of).__name__.lower()
        elif isinstance(desc, InputMutationAOTOutput) and isinstance(desc.mutated_input, BufferAOTInput):
            role = ROLE_BUFFER_UPDATE
            buffer_update[by_input_desc[desc.mutated_input]] = value.name
        elif isinstance(desc, InputMutationAOTOutput):
            raise ValueError(
                f"capture: the step writes in place into {desc.mutated_input.expr()} (node {value.name}); "
                "only buffers may be updated in place (a parameter or an input cannot)"
            )
        else:
            role = type(desc).__name__.lower()
        if value.name in roles:
            # one node returned twice, or a placeholder returned as is; keep the first label
            logger.debug("capture: node %s is both %s and %s", value.name, roles[value.name], role)
            continue
        roles[value.name] = role
    return dict(
        roles=roles,
        param_fqn=param_fqn,
        buffer_fqn=buffer_fqn,
        input_index=input_index,
        param_grad=param_grad,
        input_grad=input_grad,
        output_tangent=output_tangent,
        buffer_update=buffer_update,
    )


def _user_fqn(target: str) -> str:
    """A parameter or buffer FQN of the traced step -> its FQN in the user's model."""
    prefix = _WRAPPED + "."
    return target[len(prefix):] if target.startswith(prefix) else target


def _merge_tied_parameters(gm: fx.GraphModule, step: nn.Module) -> dict[str, list[str]]:
    """Make every tied ``nn.Parameter`` one graph input with one gradient.

    AOTAutograd lifts each FQN of a shared parameter as its own placeholder, with its own
    gradient; planned apart they would get two placements and train two tensors. The second and
    later placeholders are replaced by the first, and the first's gradient becomes the sum of all
    of them (what autograd computes for a shared tensor). Returns first placeholder -> the other
    FQNs.
    """
    from apmodel._torch_private import GradAOTOutput, ParamAOTInput

    fqns_of: dict[int, list[str]] = {}
    for fqn, p in step.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(p), []).append(fqn)
    owner = {fqn: fqns[0] for fqns in fqns_of.values() for fqn in fqns}
    first: dict[str, fx.Node] = {}
    merged: dict[fx.Node, list[fx.Node]] = {}
    for n in list(gm.graph.find_nodes(op="placeholder")):
        desc = n.meta.get("desc")
        if not isinstance(desc, ParamAOTInput) or desc.target not in owner:
            continue
        key = owner[desc.target]
        if key not in first:
            first[key] = n
            continue
        merged.setdefault(first[key], []).append(n)
    if not merged:
        return {}
    out_node = gm.graph.output_node()
    values = list(out_node.args[0])
    grad_slot = {
        d.grad_of.target: i for i, d in enumerate(out_node.meta["desc"])
        if isinstance(d, GradAOTOutput) and isinstance(d.grad_of, ParamAOTInput)
    }
    tied: dict[str, list[str]] = {}
    for keep, dups in merged.items():
        keep_slot = grad_slot.get(keep.meta["desc"].target)
        grads = [values[keep_slot]] if keep_slot is not None else []
        for dup in dups:
            dup.replace_all_uses_with(keep)
            slot = grad_slot.get(dup.meta["desc"].target)
            if slot is not None:
                grads.append(values[slot])
                values[slot] = None
            gm.graph.erase_node(dup)
        grads = [g for g in grads if isinstance(g, fx.Node)]
        if len(grads) > 1 and keep_slot is not None:
            total = grads[0]
            with gm.graph.inserting_before(out_node):
                for g in grads[1:]:
                    total = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, g))
                    total.meta["val"] = grads[0].meta["val"]
                    total.meta["partitioner_tag"] = "is_backward"
            values[keep_slot] = total
        elif grads and keep_slot is not None:
            values[keep_slot] = grads[0]
        tied[keep.name] = [_user_fqn(d.meta["desc"].target) for d in dups]
        logger.info(
            "capture: parameter %s is tied to %s: one graph input, gradients summed",
            _user_fqn(keep.meta["desc"].target), ", ".join(tied[keep.name]),
        )
    out_node.args = (type(out_node.args[0])(values),) + tuple(out_node.args[1:])
    gm.recompile()
    return tied


def _backward_flags(gm: fx.GraphModule, roles: dict[str, str]) -> dict[str, bool]:
    flags: dict[str, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            flags[n.name] = roles.get(n.name) == ROLE_TANGENT
        elif n.op == "output":
            flags[n.name] = False
        else:
            tag = n.meta.get("partitioner_tag")
            flags[n.name] = tag == "is_backward" if tag else bool(n.meta.get("autograd_backward", False))
    return flags


def _unsupported_ops(gm: fx.GraphModule) -> list[str]:
    missing: set[str] = set()
    checked: dict[Any, bool] = {}
    for n in [n for n in gm.graph.nodes if n.op == "call_function"]:
        if n.target is operator.getitem:
            continue
        if n.target not in checked:
            checked[n.target] = isinstance(n.target, OpOverload) and has_dtensor_rule(n.target)
        if not checked[n.target]:
            missing.add(_target_name(n.target))
    return sorted(missing)


def _preset_workload(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    preset = getattr(model, "apmodel_workload", None)
    if not isinstance(preset, dict) or not inputs or inputs[0].dim() != 2:
        return {}
    batch, seq = inputs[0].shape
    return {**preset, "batch": int(batch), "seq": int(seq)}


def capture(
    model: nn.Module,
    sample_inputs: Sequence[torch.Tensor] | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    functionalize: bool | None = None,
    allow_unused_parameters: bool = False,
) -> CapturedGraph:
    """Trace one training step of ``model`` into a labelled joint forward-backward ATen graph.

    The traced step is ``out = model(*sample_inputs, **kwargs)``, then ``loss_fn(out, *targets)``
    (a scalar), or ``loss_fn(out, *sample_inputs)`` when ``targets`` is None (models that take
    their labels), or ``out`` itself (a single tensor) when ``loss_fn`` is None. Build the model
    and the inputs on the meta device. Raises ``ValueError`` naming the argument on bad input.

    A parameter with ``requires_grad`` that gets no gradient is an error (a loss that does not
    reach it trains nothing) unless ``allow_unused_parameters``; frozen parameters
    (``requires_grad=False``) are planned as constants of the step.

    ``functionalize``: None (default) traces without AOTAutograd's functionalization (faster) and
    falls back to it when the graph mutates anything but fresh intermediates (BatchNorm's running
    statistics); True / False force one mode (False fails on such mutations).
    """
    signature, inputs = _validate(model, sample_inputs, loss_fn, kwargs, targets)
    module = _TracedStep(model, loss_fn, signature)
    name = type(model).__name__
    start = time.perf_counter()
    with _progress(f"tracing {name} (joint forward + backward)"):
        gm, out_spec = _trace_step(module, inputs, functionalize=bool(functionalize))
        if not functionalize and not _remove_local_mutations(gm):
            if functionalize is False:
                raise ValueError(f"capture: {name} mutates an input or a view; trace with functionalize=True")
            logger.info("capture: %s mutates an input or a view; tracing again with functionalization", name)
            gm, out_spec = _trace_step(module, inputs, functionalize=True)
    traced_s = time.perf_counter() - start

    out_node = gm.graph.output_node()
    forward_outs = [
        (v, d) for v, d in zip(out_node.args[0], out_node.meta["desc"]) if type(d).__name__ == "PlainAOTOutput"
    ]
    what = "loss_fn" if loss_fn is not None else "model"
    if out_spec.num_leaves != 1 or len(forward_outs) != 1:
        raise ValueError(f"capture: {what} must return a single tensor, got output structure {out_spec}")
    out_val = forward_outs[0][0].meta.get("val") if isinstance(forward_outs[0][0], fx.Node) else None
    if not isinstance(out_val, torch.Tensor):
        raise ValueError(f"capture: {what} must return a tensor, got {type(out_val).__name__}")
    if loss_fn is not None and out_val.dim() != 0:
        raise ValueError(f"capture: loss_fn must return a scalar, got a tensor of shape {tuple(out_val.shape)}")

    removed = _simplify(gm)
    tied = _merge_tied_parameters(gm, module)
    labels = _label(gm)
    is_backward = _backward_flags(gm, labels["roles"])
    trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    no_grad = sorted(
        fqn for node, fqn in labels["param_fqn"].items()
        if node not in labels["param_grad"] and fqn in trainable
    )
    if no_grad:
        message = (
            f"capture: {len(no_grad)} trainable parameter(s) get no gradient from the traced "
            f"{'loss' if loss_fn is not None else 'output'}: {', '.join(no_grad[:10])}"
            f"{' ...' if len(no_grad) > 10 else ''}"
        )
        if not allow_unused_parameters:
            raise ValueError(
                message + "; freeze them (requires_grad_(False)) or pass allow_unused_parameters=True "
                "if they are meant to stay unchanged"
            )
        logger.warning(message)
    fingerprint = _fingerprint(gm, labels["param_fqn"])
    unsupported = _unsupported_ops(gm)
    if unsupported:
        logger.warning("capture: ops without a DTensor sharding rule in torch %s (planned replicated): %s",
                       torch.__version__, ", ".join(unsupported))
    trace_s = time.perf_counter() - start
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    stats = {
        "nodes": len(gm.graph.nodes),
        "placeholders": len(gm.graph.find_nodes(op="placeholder")),
        "forward": sum(not is_backward[n.name] for n in ops),
        "backward": sum(is_backward[n.name] for n in ops),
    }
    logger.info(
        "captured %s: %d nodes (%d placeholders, %d forward ops, %d backward ops; %d detach/dead "
        "removed) in %.2f s (aot_export %.2f s)",
        name, stats["nodes"], stats["placeholders"], stats["forward"], stats["backward"], removed,
        trace_s, traced_s,
    )
    return CapturedGraph(
        gm=gm,
        is_backward=is_backward,
        fingerprint=fingerprint,
        unsupported_ops=unsupported,
        trace_s=trace_s,
        stats=stats,
        signature=signature,
        trace_options=dict(loss_fn=loss_fn, allow_unused_parameters=allow_unused_parameters, functionalize=functionalize),
        workload=_preset_workload(model, inputs),
        tied_params=tied,
        **labels,
    )

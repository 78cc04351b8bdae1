"""Repeated layers: trace three, stamp the others.

A transformer's layers are structurally identical, and tracing them is most of capture's time. :func:`trace_step` traces a copy of the model with its first
three layers (first, one middle, last), checks that the graph repeats layer by layer, and stamps
the middle layer once per missing layer: the same nodes, names, wiring, descriptors and metadata as
tracing every layer (``tests/test_capture_stamping.py`` compares the two on the reference models).
Anything that does not fit falls back to the full trace (:func:`apmodel.graph.tracing.trace`).

Layers of several kinds in a repeating pattern (hybrid attention: five sliding-window layers, then
one full) repeat with a *period* ``p``. Node names count the nodes of one base (``getitem``)
across layers, deleted ones included, so a layer's names depend on the kinds of the layers around
it: the template then holds the first ``k >= 3p + 2`` layers, ``k`` congruent to the layer count
modulo ``p`` (its last layer of the kind of the model's last). The model's first ``p + 1`` and last
``p + 1`` layers are stamped from the template's first and last ones, every other layer from the
template's layer of its kind in ``p + 1 ... 2p``, which has a whole period of middle layers on
either side, as a middle layer of the model has.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from apmodel._torch_private import with_children
from apmodel.graph.tracing import WRAPPED, TracedStep, trace, user_fqn

logger = logging.getLogger("apmodel.graph.capture")

# A transformer's layers are structurally identical, and tracing them is most of capture's time.
# When a model holds such a stack, capture traces a copy of
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
        children = dict(module.named_children())
        if depth == len(names):
            return with_children(module, {key: children[key] for key in (*stack.before, *stack.keys[:k])})
        children[names[depth]] = rebuild(children[names[depth]], depth + 1)
        return with_children(module, children)

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
            fqn = user_fqn(name)
            i = stack.layer_of(fqn)
            self._named[id(t)] = (i, fqn[len(stack.prefix(i)):] if i is not None else fqn)
        self._handles = []
        container = getattr(step, WRAPPED).get_submodule(stack.path) if stack.path else getattr(step, WRAPPED)
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
                where: tuple[Any, ...] = ("param", self._relative(named[0]), named[1])
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
    """A joint graph traced with the first ``k`` layers of a stack (layers of ``period`` kinds in
    turn), split into the runs of nodes of each layer (parameters, forward, backward) and the nodes
    outside the stack; :meth:`stamp` writes the graph of any number of layers."""

    def __init__(self, gm: fx.GraphModule, stack: _LayerStack, k: int = _TEMPLATE_LAYERS, period: int = 1) -> None:
        from apmodel._torch_private import BufferAOTInput, ParamAOTInput

        self.gm = gm
        self.stack = stack
        self.k = k
        self.period = period
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
                fqn = user_fqn(desc.target) if isinstance(desc, (ParamAOTInput, BufferAOTInput)) else None
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
        # runs of equal tags; each run of layer segments must read 0, 1, ..., k - 1 or the reverse
        self.parts: list[tuple[Any, ...]] = []  # ("outside", nodes) | ("layers", ascending, [nodes of layer 0 ... k-1])
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
        return self.stack.layer_of(user_fqn(target)) if target is not None else None

    def _split(self, items: list, tags: list[int | None], nodes: bool) -> list[tuple[Any, ...]]:
        segments: list[tuple[int | None, list]] = []
        for item, t in zip(items, tags, strict=True):
            if segments and segments[-1][0] == t:
                segments[-1][1].append(item)
            else:
                segments.append((t, [item]))
        parts: list[tuple[Any, ...]] = [] if not nodes else self.parts
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
            # the middle and the last layers must match the middle layer of their kind node for node;
            # the first may differ (its input needs no gradient) as long as no other layer reads it
            first_matches = self._alike(runs[0], runs[self._kind(0)], nodes)
            if not all(self._alike(runs[t], runs[self._kind(t)], nodes) for t in range(1, self.k)) or \
                    not (first_matches or nodes):
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
            for x, y in zip(a, b, strict=True)
        )

    def _kind(self, j: int) -> int:
        """The template's middle layer of layer ``j``'s kind (one framed by whole periods, module docstring)."""
        p = self.period
        return 1 if p == 1 else p + 1 + (j - p - 1) % p

    def _role(self, j: int, n: int) -> int:
        """The template layer that layer ``j`` of ``n`` is a copy of."""
        if self.period == 1:
            return 0 if j == 0 else self.k - 1 if j == n - 1 else 1
        if j <= self.period:
            return j
        if j >= n - 1 - self.period:
            return self.k - (n - j)
        return self._kind(j)

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
                assert j is not None  # a layer's node has both indices
                ja = j + (ta - i) if abs(ta - i) <= 1 else None
            if ja is None or not 0 <= ja < n:
                raise _NotStampable(f"{a.name} read across layers")
            # ja is of ta's kind (layers j and i are); only the first and the last may not stand in for each other
            if self._role(ja, n) != ta and ta in (0, k - 1) and self._role(ja, n) in (0, k - 1):
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
            node.meta = self._meta(x.meta, i, j) if i is not None and j is not None and i != j else dict(x.meta)
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
                    values.append(fx.node.map_arg(template_values[e], functools.partial(lookup, i=i, j=j)))
                    descs.append(_relayer_desc(template_descs[e], functools.partial(self._relayer_target, i=i, j=j)))
        out = graph.create_node("output", "output", (type(self.out.args[0])(values),), {}, type_expr=self.out.type)
        out.meta = {**self.out.meta, "desc": descs}
        return gm

    def _relayer_target(self, target: str, i: int, j: int) -> str:
        fqn = user_fqn(target)
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
    if not dataclasses.is_dataclass(desc) or isinstance(desc, type):  # descriptors are instances
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
    step: TracedStep, stack: _LayerStack, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any, int]:
    """Trace ``step`` with the first layers of ``stack`` (three, or more for layers of several kinds)
    and stamp the rest (raises :class:`_NotStampable` where the layers do not repeat); also returns
    how many layers were traced."""
    model = getattr(step, WRAPPED)
    n = len(stack.keys)
    full_record = _record_forward(step, stack, n, inputs)
    period = _period(full_record.layers)
    if period is None:
        raise _NotStampable("the layers' forward passes differ (by position in the stack)")
    # the fewest layers holding the first, the last and (period > 1) a middle period framed by two others
    k = _TEMPLATE_LAYERS if period == 1 else 3 * period + 2 + (n - 3 * period - 2) % period
    if k >= n:
        raise _NotStampable(f"a pattern of {period} kinds of layers does not repeat in {n} layers")
    small = TracedStep(_truncated(model, stack, k), step.loss_fn, step.signature)
    small_record = _record_forward(small, stack, k, inputs)
    if not (
        small_record.layers[0] == full_record.layers[0]
        and all(r == full_record.layers[1 + (t - 1) % period] for t, r in enumerate(small_record.layers) if t)
        and small_record.outside == full_record.outside
    ):
        raise _NotStampable("the layers' forward passes differ with their number")
    gm, out_spec = trace(small, inputs, functionalize=functionalize)
    return _Template(gm, stack, k, period).stamp(n), out_spec, k


def _period(layers: Sequence[list[tuple]]) -> int | None:
    """The smallest ``p`` such that every layer after the first records what layer ``1 + (j - 1) % p``
    does (1: all alike), None when the layers after the first repeat no pattern."""
    rest = layers[1:]
    for p in range(1, len(rest)):
        if all(r == rest[t % p] for t, r in enumerate(rest)):
            return p
    return None


def trace_step(
    step: TracedStep, inputs: tuple[torch.Tensor, ...], functionalize: bool
) -> tuple[fx.GraphModule, Any]:
    """:func:`_trace`, with a stack of identical layers traced once and stamped where it repeats."""
    model = getattr(step, WRAPPED)
    on_meta = all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers(), *inputs])
    stack = _repeated_stack(model) if on_meta else None
    if stack is not None:
        start = time.perf_counter()
        try:
            gm, out_spec, traced = _trace_stamped(step, stack, inputs, functionalize)
        except Exception as e:  # anything the template cannot express: trace every layer
            logger.info("capture: layers %s not stamped (%s: %s); tracing all of them",
                        stack.path or "(the model)", type(e).__name__, e)
        else:
            logger.info("capture: traced %d of the %d layers of %s and stamped the others in %.2f s",
                        traced, len(stack.keys), stack.path or "the model", time.perf_counter() - start)
            return gm, out_spec
    return trace(step, inputs, functionalize)

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
fake tensors, proxy tracing) spread evenly, so a stack of identical layers
(a transformer's) is traced with three layers and the others are stamped from the middle one,
after checking that every layer's forward calls the same ops on the same kinds of inputs (see
``apmodel/graph/stamping.py``), with the same graph as the full trace.

After tracing, ``aten.detach`` nodes (no-ops on values, inserted by autograd around saved tensors)
are bypassed and dead code is removed; view ops are kept as they are, so the graph reads like the
model, except around linear layers on N-D activations: their ``view -> mm -> view`` (and the
backward's two ``mm``) become one N-D op each (``apmodel/graph/linear3d.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from apmodel._torch_private import OpOverload, aliases_first_input, op_schema, overload_name
from apmodel.graph.flex import block_mask_of, dense_block_masks, dense_mask, is_block_mask
from apmodel.graph.linear3d import rewrite_linears
from apmodel.graph.stamping import trace_step
from apmodel.graph.tracing import TracedStep, simplify, user_fqn

logger = logging.getLogger(__name__)


# Placeholder roles (from the input descriptor) and output roles (from the output descriptor).
ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT, ROLE_TANGENT = "param", "buffer", "input", "tangent"
ROLE_OUTPUT, ROLE_GRAD_PARAM, ROLE_GRAD_INPUT = "output", "grad_param", "grad_input"
ROLE_BUFFER_UPDATE = "buffer_update"
#: dtype casts: a parameter cast (the model's ``weight.to(x.dtype)``) is still that parameter's value
_CAST_TARGETS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


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

    def param_value_chain(self) -> frozenset[str]:
        """Nodes whose value is one parameter up to views and casts: each parameter and the
        ``t``, ``view`` or dtype cast of it (of one of these) that the step reads. A redistribution
        out of one of them is the parameter's gather; it depends on no other collective."""
        chain = set(self.param_fqn)
        for n in self.gm.graph.nodes:  # graph order: a node's inputs come before it
            if n.op != "call_function" or len(n.all_input_nodes) != 1 or n.all_input_nodes[0].name not in chain:
                continue
            if aliases_first_input(n) or n.target in _CAST_TARGETS:
                chain.add(n.name)
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
    block_masks: tuple[int, ...] = ()
    """flat inputs that the user passes as FlexAttention BlockMasks: graph inputs holding their
    dense boolean masks (:func:`apmodel.graph.flex.dense_mask`), handed to the model as stand-in
    BlockMasks that read them"""

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
        flat = list(args[: self.n_args]) + [kwargs[k] for k in self.kwarg_names] + list(args[self.n_args:])
        for i in self.block_masks:
            if is_block_mask(flat[i]):
                flat[i] = dense_mask(flat[i])
            elif not isinstance(flat[i], torch.Tensor) or flat[i].dtype != torch.bool:
                raise ValueError(f"{where}: {self.name(i)} was traced as a FlexAttention BlockMask, got "
                                 f"{type(flat[i]).__name__}")
        return flat

    def split(self, flat: Sequence[Any]) -> tuple[tuple, dict[str, Any], tuple | None]:
        """Flat inputs -> ``(args, kwargs, targets)`` of the traced call (constants included in
        ``kwargs``; ``targets`` is None when the loss reads the model's arguments)."""
        if self.block_masks:
            flat = [block_mask_of(x) if i in self.block_masks else x for i, x in enumerate(flat)]
        n_kw = len(self.kwarg_names)
        kwargs = dict(zip(self.kwarg_names, flat[self.n_args:self.n_args + n_kw], strict=False))
        kwargs.update(self.constant_kwargs)
        targets = tuple(flat[self.n_args + n_kw:]) if self.n_targets is not None else None
        return tuple(flat[: self.n_args]), kwargs, targets




def has_dtensor_rule(op: Any) -> bool:
    """True when DTensor has a sharding rule for ``op`` (delegates to :mod:`apmodel._torch_private`,
    the one module that reads DTensor's private registries)."""
    from apmodel._torch_private import has_sharding_rule

    return has_sharding_rule(op)


def _as_tensor_tuple(values: Any, what: str, block_masks: bool = False) -> tuple[Any, ...]:
    if isinstance(values, torch.Tensor):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        raise ValueError(f"capture: {what} must be a tuple of tensors, got {type(values).__name__}")
    for i, x in enumerate(values):
        if not isinstance(x, torch.Tensor) and not (block_masks and is_block_mask(x)):
            raise ValueError(f"capture: {what}[{i}] must be a torch.Tensor"
                             f"{' or a FlexAttention BlockMask' if block_masks else ''}, got {type(x).__name__}")
    return tuple(values)


def _validate(
    model: Any, sample_inputs: Any, loss_fn: Any, kwargs: Any, targets: Any
) -> tuple[InputSignature, tuple[torch.Tensor, ...]]:
    """Check the call and return its signature and flat tensor inputs."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"capture: model must be a torch.nn.Module, got {type(model).__name__}")
    args = _as_tensor_tuple(sample_inputs, "sample_inputs", block_masks=True)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"capture: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"capture: kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    tensor_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) or is_block_mask(v)}
    constants = tuple((k, v) for k, v in kwargs.items() if k not in tensor_kwargs)
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
    flat, block_masks = dense_block_masks(args + tuple(tensor_kwargs.values()) + (targets or ()), model)
    signature = InputSignature(
        n_args=len(args),
        kwarg_names=tuple(tensor_kwargs),
        constant_kwargs=constants,
        n_targets=None if targets is None else len(targets),
        block_masks=block_masks,
    )
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








def _is_view(node: fx.Node) -> bool:
    """True when ``node``'s result may alias one of its inputs (a view, or an in-place op)."""
    if node.op != "call_function":
        return node.op == "placeholder"
    if node.target is operator.getitem:
        src = node.args[0]
        assert isinstance(src, fx.Node), src
        return _is_view(src)
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

    Tracing without AOTAutograd's functionalization is faster; decompositions such as
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


def graph_fingerprint(gm: fx.GraphModule, param_fqn: dict[str, str]) -> str:
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


def _returned(out_node: fx.Node) -> tuple[fx.node.Argument, ...] | list[fx.node.Argument]:
    """The values an output node returns (its one argument, a tuple or a list)."""
    values = out_node.args[0]
    assert isinstance(values, (tuple, list)), values
    return values


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
            param_fqn[n.name] = user_fqn(desc.target)
        elif isinstance(desc, BufferAOTInput):
            roles[n.name] = ROLE_BUFFER
            buffer_fqn[n.name] = user_fqn(desc.target)
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
    for value, desc in zip(_returned(out_node), out_node.meta["desc"], strict=True):
        if not isinstance(value, fx.Node):
            continue  # None: an input without gradient
        if isinstance(desc, PlainAOTOutput):
            role = ROLE_OUTPUT
            if desc in tangent_of_output_desc:
                output_tangent[value.name] = tangent_of_output_desc[desc]
        elif isinstance(desc, GradAOTOutput):
            of = by_input_desc.get(desc.grad_of)
            if isinstance(desc.grad_of, ParamAOTInput):
                assert of is not None  # every graph input's descriptor is in by_input_desc
                role = ROLE_GRAD_PARAM
                param_grad[of] = value.name
            elif isinstance(desc.grad_of, PlainAOTInput):
                assert of is not None
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
    returned = _returned(out_node)
    values = list(returned)
    grad_slot = {
        d.grad_of.target: i for i, d in enumerate(out_node.meta["desc"])
        if isinstance(d, GradAOTOutput) and isinstance(d.grad_of, ParamAOTInput)
    }
    tied: dict[str, list[str]] = {}
    for keep, dups in merged.items():
        keep_slot = grad_slot.get(keep.meta["desc"].target)
        returned_grads = [values[keep_slot]] if keep_slot is not None else []
        for dup in dups:
            dup.replace_all_uses_with(keep)
            slot = grad_slot.get(dup.meta["desc"].target)
            if slot is not None:
                returned_grads.append(values[slot])
                values[slot] = None
            gm.graph.erase_node(dup)
        grads = [g for g in returned_grads if isinstance(g, fx.Node)]
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
        tied[keep.name] = [user_fqn(d.meta["desc"].target) for d in dups]
        logger.info(
            "capture: parameter %s is tied to %s: one graph input, gradients summed",
            user_fqn(keep.meta["desc"].target), ", ".join(tied[keep.name]),
        )
    out_node.args = (type(returned)(values),) + tuple(out_node.args[1:])
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


def _check_step_output(gm: fx.GraphModule, out_spec: Any, loss_fn: Callable[..., torch.Tensor] | None) -> None:
    """The traced step returns one tensor: a scalar when it is ``loss_fn``'s."""
    out_node = gm.graph.output_node()
    forward_outs = [
        (v, d) for v, d in zip(_returned(out_node), out_node.meta["desc"], strict=True) if type(d).__name__ == "PlainAOTOutput"
    ]
    what = "loss_fn" if loss_fn is not None else "model"
    if out_spec.num_leaves != 1 or len(forward_outs) != 1:
        raise ValueError(f"capture: {what} must return a single tensor, got output structure {out_spec}")
    out_val = forward_outs[0][0].meta.get("val") if isinstance(forward_outs[0][0], fx.Node) else None
    if not isinstance(out_val, torch.Tensor):
        raise ValueError(f"capture: {what} must return a tensor, got {type(out_val).__name__}")
    if loss_fn is not None and out_val.dim() != 0:
        raise ValueError(f"capture: loss_fn must return a scalar, got a tensor of shape {tuple(out_val.shape)}")


def _check_gradients(model: nn.Module, labels: Mapping[str, Any], has_loss_fn: bool, allow_unused_parameters: bool) -> None:
    """Every trainable parameter gets a gradient (else an error, or a warning when
    ``allow_unused_parameters``)."""
    trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    no_grad = sorted(
        fqn for node, fqn in labels["param_fqn"].items()
        if node not in labels["param_grad"] and fqn in trainable
    )
    if no_grad:
        message = (
            f"capture: {len(no_grad)} trainable parameter(s) get no gradient from the traced "
            f"{'loss' if has_loss_fn else 'output'}: {', '.join(no_grad[:10])}"
            f"{' ...' if len(no_grad) > 10 else ''}"
        )
        if not allow_unused_parameters:
            raise ValueError(
                message + "; freeze them (requires_grad_(False)) or pass allow_unused_parameters=True "
                "if they are meant to stay unchanged"
            )
        logger.warning(message)


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
    module = TracedStep(model, loss_fn, signature)
    name = type(model).__name__
    start = time.perf_counter()
    with _progress(f"tracing {name} (joint forward + backward)"):
        gm, out_spec = trace_step(module, inputs, functionalize=bool(functionalize))
        if not functionalize and not _remove_local_mutations(gm):
            if functionalize is False:
                raise ValueError(f"capture: {name} mutates an input or a view; trace with functionalize=True")
            logger.info("capture: %s mutates an input or a view; tracing again with functionalization", name)
            gm, out_spec = trace_step(module, inputs, functionalize=True)
    traced_s = time.perf_counter() - start

    _check_step_output(gm, out_spec, loss_fn)
    gm, removed = simplify(gm)
    rewrite_linears(gm)  # linear layers kept N-D (apmodel/graph/linear3d.py)
    tied = _merge_tied_parameters(gm, module)
    labels = _label(gm)
    is_backward = _backward_flags(gm, labels["roles"])
    _check_gradients(model, labels, loss_fn is not None, allow_unused_parameters)
    fingerprint = graph_fingerprint(gm, labels["param_fqn"])
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

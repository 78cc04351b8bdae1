"""Where a model keeps its repeated blocks and which of its parameters play which part.

The hand-written recipes (Megatron tensor parallelism, FSDP + TP), the report's per-layer grid and
the reading of what each mesh axis does need to know, per parameter, whether it belongs to a
repeated block (a *layer*) and what it is: a column-parallel linear weight (the first of a pair:
q/k/v, up/gate), a row-parallel one (the one whose output returns to the residual stream: o/out,
down/proj), a norm weight, the token embedding or the output projection.  A
:class:`ModelConventions` holds that as data: glob patterns over parameter FQNs (``fnmatch``
syntax; ``*`` also matches dots) and a layer pattern such as ``"layers.{i}."``.

Three ways to get one:

* :data:`LLAMA`, the default: the LLaMA names of :mod:`apmodel.models.llama3` and torchtitan
  (``layers.N``, ``wq wk wv w1 w3`` column-parallel, ``wo w2`` row-parallel, ``*norm.weight``,
  ``tok_embeddings``, ``output``), exactly what the recipes assumed before conventions existed;
* :func:`derive` from a captured graph (:class:`~apmodel.graph.capture.CapturedGraph`), by **data flow**:
  the layer pattern is the repeated numbered container the parameter names spell
  (:func:`layer_pattern_from_names`); a linear weight is a 2-D parameter that a matmul reads,
  transposed (``x @ W.T``, PyTorch's ``[out, in]`` layout) or not (``x @ W``, the ``[in, out]``
  layout of Hugging Face's ``Conv1D``, listed in ``in_out``); inside one layer, a linear whose output
  reaches another linear's input (through attention, activations, splits...; the walk stops at
  norms, at graph inputs and at the layer's edge) is column-parallel, and a linear fed by others
  whose own output reaches none is row-parallel.  Norm parameters are those an ATen norm op reads
  or whose module's class name ends in ``Norm`` (a name heuristic, for hand-written RMSNorms);
  embeddings are read by ``aten.embedding``; linear weights outside the layers are output
  projections.  Where an output projection exists, only the tables and projections of its
  vocabulary count (a position table or an LM head's hidden-to-hidden transform is left
  unclassified).  Biases follow their linear (column-parallel) or are kept whole (row-parallel);
* :func:`from_module` from an ``nn.Module`` without tracing: the layer container from the module
  tree, and the column/row split by **name heuristics** (:data:`ROW_PARALLEL_NAMES`), for when no
  graph is at hand.

Stacked expert weights (``[experts, in, out]``) are left unclassified: the recipes leave them to
the solver.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from torch import fx, nn

    from apmodel.graph.capture import CapturedGraph

logger = logging.getLogger(__name__)

__all__ = ["LLAMA", "ROLES", "ROW_PARALLEL_NAMES", "ModelConventions", "derive", "for_plan", "from_module",
           "from_names", "layer_pattern_from_names"]

#: Roles a parameter can have, in the order :meth:`ModelConventions.role` tries them.
ROLES = ("output", "embedding", "column", "row", "norm", "tp_replicated")

#: Last name component of a linear layer that returns to the residual stream (used by
#: :func:`from_module` only; :func:`derive` reads the data flow instead).
ROW_PARALLEL_NAMES = frozenset({"wo", "w2", "o_proj", "out_proj", "down_proj", "c_proj", "proj", "fc2", "linear2",
                                "dense_4h_to_h", "out", "o", "down"})
#: Linear layers that route tokens to experts rather than transform the stream (:func:`from_module`).
ROUTER_NAMES = frozenset({"router", "gate"})

#: ATen ops that only relabel a tensor (followed when looking for the op that computes with it).
_VIEW_OPS = frozenset({"t", "transpose", "view", "_unsafe_view", "reshape", "permute", "expand", "alias",
                       "_to_copy", "detach", "clone", "contiguous", "unsqueeze", "squeeze"})
_MATMUL_OPS = frozenset({"mm", "addmm", "matmul", "linear", "bmm", "baddbmm", "mm_nd"})
_NORM_OPS = frozenset({"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm",
                       "group_norm", "native_batch_norm", "batch_norm", "_native_batch_norm_legit",
                       "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training"})
_BIAS_ADD_OPS = frozenset({"add"})


def _op(node: "fx.Node") -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _glob_any(fqn: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(fqn, p) for p in patterns)


@dataclass(frozen=True)
class ModelConventions:
    """Parameter roles and the layer pattern of one model (see the module docstring).

    ``layer_pattern``: the FQN prefix of a repeated block with ``{i}`` for its index, e.g.
    ``"layers.{i}."``, ``"h.{i}."``, ``"encoder.layer.{i}."``; a leading ``*`` allows any prefix
    (``"*layers.{i}."``). None: the model has no repeated blocks.  The pattern tuples are globs
    over parameter FQNs: ``column_parallel`` (split on dim 0 of ``[out, in]``, and the biases of
    those layers), ``row_parallel`` (split on dim 1), ``embedding`` (vocabulary-parallel, dim 0),
    ``output`` (column-parallel output projection, dim 0), ``norm_weights`` (norm scales: the
    ops applying them produce the activations sequence parallelism splits), ``tp_replicated``
    (kept whole on a tensor-parallel axis: norm biases, biases of row-parallel layers).
    ``in_out``: weights among those stored ``[in, out]`` (Hugging Face's ``Conv1D``), whose
    column/row split dimensions are swapped (:meth:`split_dim`). ``source`` says where the
    conventions came from.
    """

    layer_pattern: str | None = "*layers.{i}."
    norm_weights: tuple[str, ...] = ("*norm.weight",)
    column_parallel: tuple[str, ...] = ("*.wq.weight", "*.wk.weight", "*.wv.weight", "*.w1.weight", "*.w3.weight")
    row_parallel: tuple[str, ...] = ("*.wo.weight", "*.w2.weight")
    embedding: tuple[str, ...] = ("tok_embeddings.weight",)
    output: tuple[str, ...] = ("output.weight",)
    tp_replicated: tuple[str, ...] = ()
    source: str = "LLaMA names (apmodel.models.llama3, torchtitan)"
    in_out: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("norm_weights", "column_parallel", "row_parallel", "embedding", "output", "tp_replicated",
                     "in_out"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"ModelConventions.{name} must be a sequence of glob patterns, got the string {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.layer_pattern is not None and self.layer_pattern.count("{i}") != 1:
            raise ValueError(f"ModelConventions.layer_pattern must contain '{{i}}' once, got {self.layer_pattern!r}")

    # ------------------------------------------------------------------------------ layers
    @cached_property
    def _layer_regex(self) -> re.Pattern[str] | None:
        if self.layer_pattern is None:
            return None
        head, tail = self.layer_pattern.split("{i}")
        tail = tail.rstrip(".")
        prefix = ".*?".join(re.escape(part) for part in head.split("*"))
        return re.compile(rf"^({prefix}(\d+){re.escape(tail)})(?:\.(.*))?$")

    @property
    def layer_container(self) -> str | None:
        """The qualified name of the module holding the repeated layers (``"layers"``,
        ``"model.layers"``; ``""``: the model itself), read off the layer pattern; None without one."""
        return None if self.layer_pattern is None else self.layer_pattern.split("{i}")[0].strip("*.")

    def split(self, fqn: str) -> tuple[str, str]:
        """``("layers.3", "attention.wq.weight")`` for a parameter (or module path) inside layer 3,
        ``("", fqn)`` outside the layers."""
        rx = self._layer_regex
        m = rx.match(fqn) if rx is not None else None
        if m is None:
            return "", fqn
        return m.group(1), m.group(3) or ""

    def layer_of(self, fqn: str) -> str:
        """The layer label (``"layers.3"``) of a parameter or module path, ``""`` outside the layers."""
        return self.split(fqn)[0]

    def layer_index(self, fqn: str) -> int | None:
        rx = self._layer_regex
        m = rx.match(fqn) if rx is not None else None
        return None if m is None else int(m.group(2))

    # ------------------------------------------------------------------------------ roles
    def role(self, fqn: str) -> str:
        """One of :data:`ROLES`, or ``""`` when no pattern matches (the recipes leave it free)."""
        for role, patterns in self.patterns().items():
            if _glob_any(fqn, patterns):
                return role
        return ""

    def patterns(self) -> dict[str, tuple[str, ...]]:
        """Role -> globs, in :data:`ROLES` order."""
        return {"output": self.output, "embedding": self.embedding, "column": self.column_parallel,
                "row": self.row_parallel, "norm": self.norm_weights, "tp_replicated": self.tp_replicated}

    def is_norm_weight(self, fqn: str) -> bool:
        return _glob_any(fqn, self.norm_weights)

    def split_dim(self, fqn: str, ndim: int = 2) -> int | None:
        """The dimension tensor parallelism splits a parameter of ``ndim`` dimensions on: the output
        dimension of column-parallel linears and of the output projection, the vocabulary of an
        embedding, the input dimension of row-parallel linears (dim 0 of ``[out, in]`` or dim 1;
        swapped for an ``in_out`` weight); None when its role keeps it whole or it has none."""
        dim = {"column": 0, "output": 0, "embedding": 0, "row": 1}.get(self.role(fqn))
        if dim is not None and ndim == 2 and _glob_any(fqn, self.in_out):
            dim = 1 - dim
        return dim

    def roles(self, fqns: Iterable[str]) -> dict[str, str]:
        """FQN -> role for every parameter (``""`` when unclassified)."""
        return {f: self.role(f) for f in fqns}

    def to_dict(self) -> dict[str, Any]:
        return {"layer_pattern": self.layer_pattern, "norm_weights": list(self.norm_weights),
                "column_parallel": list(self.column_parallel), "row_parallel": list(self.row_parallel),
                "embedding": list(self.embedding), "output": list(self.output),
                "tp_replicated": list(self.tp_replicated), "in_out": list(self.in_out), "source": self.source}


#: The LLaMA default (today's behaviour of the recipes, report and roles).
LLAMA = ModelConventions()


# ------------------------------------------------------------------------------ layer pattern
def layer_pattern_from_names(fqns: Iterable[str]) -> str | None:
    """The numbered container of blocks the names spell: ``"layers.{i}."`` when parameters are
    named ``layers.0.attention.wq.weight``, ``layers.1....``. A numbered child counts as a block
    when it holds parameters of submodules (``layers.0.x.weight``, not ``mlp.0.weight``: a bare
    layer in an ``nn.Sequential``); the container whose blocks hold the most parameters wins (the
    outermost on a tie). None when there is none. A one-layer model still has its ``layers.0``."""
    covered: Counter[str] = Counter()
    for fqn in fqns:
        parts = fqn.split(".")
        for k in range(len(parts) - 2):  # index k, then at least a submodule and a parameter name
            if parts[k].isdigit():
                covered[".".join(parts[:k])] += 1
                break  # the outermost numbered container of this name
    if not covered:
        return None
    best = max(covered, key=lambda p: (covered[p], -p.count("."), -len(p)))
    return f"{best}.{{i}}." if best else "{i}."


def _generalise(conv_layer: ModelConventions, fqn: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``layers.*.attention.wq.weight`` (outside the layers: unchanged)."""
    layer, rest = conv_layer.split(fqn)
    if not layer:
        return _escape(fqn)
    head = conv_layer.layer_pattern.split("{i}")[0]  # type: ignore[union-attr]
    return _escape(head) + "*." + _escape(rest)


def _escape(name: str) -> str:
    """Escape glob metacharacters in a literal name."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _owner_name(fqn: str) -> str:
    """``layers.0.attention_norm.weight`` -> ``attention_norm`` (the module holding the parameter)."""
    parts = fqn.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def from_names(fqns: Iterable[str]) -> ModelConventions:
    """Conventions from parameter names alone (a plan read from a file): the layer pattern, norm
    parameters by name (``norm`` in the owning module's name, a heuristic), no linear roles."""
    fqns = list(fqns)
    pattern = layer_pattern_from_names(fqns)
    base = ModelConventions(layer_pattern=pattern, source="parameter names")
    norms = [f for f in fqns if "norm" in _owner_name(f).lower()]
    return replace(base, norm_weights=_unique(_generalise(base, f) for f in norms if f.endswith("weight")),
                   column_parallel=(), row_parallel=(), embedding=(), output=(),
                   tp_replicated=_unique(_generalise(base, f) for f in norms if not f.endswith("weight")))


# ------------------------------------------------------------------------------ from a graph
@dataclass
class _Linear:
    weight: str                      # FQN
    matmul: "fx.Node"
    activations: list["fx.Node"]     # the matmul's non-weight tensor operands
    in_out: bool = False             # stored [in, out] (read x @ W), not PyTorch's [out, in]
    bias: str | None = None
    feeds: set[str] = field(default_factory=set)   # weights of linears this one's output reaches
    fed_by: set[str] = field(default_factory=set)


def _through_views(node: "fx.Node", is_backward: Mapping[str, bool]) -> list[tuple["fx.Node", "fx.Node", bool]]:
    """(computing forward op, the input node it reads, transposed?) reached from ``node`` through
    view-like ops; ``transposed`` tracks whether the last two dims were swapped on the way."""
    out = []
    stack = [(node, False)]
    seen: set[str] = set()
    while stack:
        prod, swapped = stack.pop()
        for user in prod.users:
            if user.op != "call_function" or is_backward.get(user.name, False) or user.name in seen:
                continue
            op = _op(user)
            if op in _VIEW_OPS:
                seen.add(user.name)
                stack.append((user, swapped ^ _swaps_last_two(user, op)))
            else:
                out.append((user, prod, swapped))
    return out


def _graph_node(a: object) -> "fx.Node | None":
    """``a`` if it is a graph node (torch.fx imported here: this module loads without torch)."""
    from torch import fx

    return a if isinstance(a, fx.Node) else None


def _int(a: object) -> int:
    """An integer operand of an ATen op (a dimension)."""
    assert isinstance(a, int), a
    return a


def _swaps_last_two(node: "fx.Node", op: str) -> bool:
    if op == "t":
        return True
    if op == "transpose":
        src = _graph_node(node.args[0])
        val = src.meta.get("val") if src is not None else None
        ndim = getattr(val, "ndim", 2)
        dims = {_int(d) % max(ndim, 1) for d in node.args[1:3]}
        return dims == {ndim - 2, ndim - 1}
    if op == "permute":
        perm_arg = node.args[1]
        assert isinstance(perm_arg, (list, tuple)), perm_arg
        perm = [_int(d) for d in perm_arg]
        n = len(perm)
        return n >= 2 and perm[:-2] == list(range(n - 2)) and perm[-2:] == [n - 1, n - 2]
    return False


def _module_types(gm: "fx.GraphModule") -> dict[str, str]:
    """Module path -> class name, from the module stacks the capture recorded."""
    types: dict[str, str] = {}
    for n in gm.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            for path, qualname in (n.meta.get(key) or {}).values():
                types.setdefault(str(path), str(qualname).rsplit(".", 1)[-1])
    return types


def _node_layer(conv: ModelConventions, node: "fx.Node") -> str:
    """Layer of the innermost module the node ran in (``""`` outside the layers or unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        layer = conv.layer_of(str(path))
        if layer:
            return layer
    return ""


def _link_within_layers(linears: dict[str, _Linear], matmul_of: Mapping[str, str], norm_nodes: set[str],
                        layer_conv: ModelConventions, is_bwd: Mapping[str, bool]) -> None:
    """Record which linear's output reaches which linear's input (``feeds`` / ``fed_by``), walking
    back from each linear's activations through the forward ops of its own layer (a norm stops
    the walk: what follows it is another block)."""
    for lin in linears.values():
        layer = layer_conv.layer_of(lin.weight)
        if not layer:
            continue
        frontier = list(lin.activations)
        seen: set[str] = set()
        while frontier:
            node = frontier.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op != "call_function" or is_bwd.get(node.name, False) or node.name in norm_nodes:
                continue
            other = matmul_of.get(node.name)
            if other is not None:
                if other != lin.weight and layer_conv.layer_of(other) == layer:
                    linears[other].feeds.add(lin.weight)
                    lin.fed_by.add(other)
                continue
            if _node_layer(layer_conv, node) != layer:
                continue
            frontier.extend(node.all_input_nodes)


def derive(captured: "CapturedGraph") -> ModelConventions:
    """Conventions read off a captured graph by data flow (see the module docstring)."""
    gm = captured.gm
    is_bwd = captured.is_backward
    fqn_of = dict(captured.param_fqn)
    aliases = {n: list(a) for n, a in captured.tied_params.items()}
    nodes = {n.name: n for n in gm.graph.nodes}
    layer_conv = ModelConventions(layer_pattern=layer_pattern_from_names(fqn_of.values()))
    types = _module_types(gm)

    norm_params: set[str] = set()
    embeddings: set[str] = set()
    linears: dict[str, _Linear] = {}  # weight FQN -> linear
    matmul_of: dict[str, str] = {}    # matmul node name -> weight FQN
    for pname, fqn in fqn_of.items():
        pnode = nodes[pname]
        val = pnode.meta.get("val")
        ndim = getattr(val, "ndim", 0)
        owner_type = types.get(fqn.rsplit(".", 1)[0] if "." in fqn else "", "")
        for user, src, swapped in _through_views(pnode, is_bwd):
            op = _op(user)
            slots = [j for j, a in enumerate(user.args) if a is src]
            if op in _NORM_OPS or (owner_type.endswith("Norm") and ndim == 1):
                norm_params.add(fqn)
            elif op == "embedding" and slots == [0]:
                embeddings.add(fqn)
            elif op in _MATMUL_OPS and ndim == 2 and fqn not in linears:
                weight_slot = {"mm": 1, "mm_nd": 1, "matmul": 1, "addmm": 2, "linear": 1}.get(op)
                if weight_slot is None or slots != [weight_slot]:
                    continue  # not x @ W.T (W [out, in]) nor x @ W (W [in, out])
                acts = [n for j, a in enumerate(user.args) if j != weight_slot and (n := _graph_node(a)) is not None
                        and not (op == "addmm" and j == 0) and not (op == "linear" and j == 2)]
                lin = linears[fqn] = _Linear(fqn, user, acts, in_out=swapped == (op == "linear"))
                matmul_of[user.name] = fqn
                bias_arg = _graph_node(
                    user.args[0] if op == "addmm" else (user.args[2] if op == "linear" and len(user.args) > 2 else None))
                if bias_arg is not None and bias_arg.op == "placeholder" and bias_arg.name in fqn_of:
                    lin.bias = fqn_of[bias_arg.name]
    # biases added after the matmul (nn.MultiheadAttention's in_proj): add(mm output, 1-D parameter)
    for lin in linears.values():
        if lin.bias is not None:
            continue
        for user, _, _ in _through_views(lin.matmul, is_bwd):
            if _op(user) in _BIAS_ADD_OPS:
                for a in map(_graph_node, user.args):
                    if a is not None and a.op == "placeholder" and a.name in fqn_of and getattr(a.meta.get("val"), "ndim", 0) == 1:
                        lin.bias = fqn_of[a.name]

    # which linear's output reaches which linear's input, inside one layer
    norm_nodes = {u.name for pname, fqn in fqn_of.items() if fqn in norm_params
                  for u, _, _ in _through_views(nodes[pname], is_bwd)}
    _link_within_layers(linears, matmul_of, norm_nodes, layer_conv, is_bwd)

    # the vocabulary: rows of the embedding tables that output projections produce (when any do)
    shapes = {fqn: tuple(getattr(nodes[p].meta.get("val"), "shape", ())) for p, fqn in fqn_of.items()}
    out_width = {f: shapes[f][0 if not lin.in_out else -1] for f, lin in linears.items()
                 if not layer_conv.layer_of(f) and shapes[f]}
    vocab = set(out_width.values()) & {shapes[f][0] for f in embeddings if shapes[f]}
    vocab = {max(vocab)} if vocab else vocab  # the widest: a position table may match a hidden size
    if vocab:  # position tables and hidden-to-hidden transforms outside the layers are neither
        embeddings = {f for f in embeddings if shapes[f] and shapes[f][0] in vocab}
    column, row, output, replicated, in_out = [], [], [], [], []
    for lin in linears.values():
        bias = [lin.bias] if lin.bias else []
        if lin.in_out:
            in_out.append(lin.weight)
        if not layer_conv.layer_of(lin.weight):
            if not vocab or out_width.get(lin.weight) in vocab:
                output += [lin.weight, *bias]
        elif lin.feeds:
            column += [lin.weight, *bias]
        elif lin.fed_by:
            row.append(lin.weight)
            replicated += bias
    norm_w = [f for f in norm_params if f.rsplit(".", 1)[-1] == "weight"]
    replicated += [f for f in norm_params if f not in norm_w]

    def globs(names: list[str]) -> tuple[str, ...]:
        everything = []
        for f in names:
            everything.append(f)
            everything += [a for pname, fq in fqn_of.items() if fq == f for a in aliases.get(pname, [])]
        order = {f: i for i, f in enumerate(fqn_of.values())}
        return _unique(_generalise(layer_conv, f) for f in sorted(everything, key=lambda f: order.get(f, len(order))))

    conv = ModelConventions(
        layer_pattern=layer_conv.layer_pattern, norm_weights=globs(norm_w), column_parallel=globs(column),
        row_parallel=globs(row), embedding=globs(sorted(embeddings)), output=globs(output),
        tp_replicated=globs(replicated), in_out=globs(in_out),
        source="derived from the traced graph (module paths and data flow)")
    logger.debug("conventions derived: %s", conv.to_dict())
    return conv


def for_plan(plan: Any) -> ModelConventions:
    """The conventions of a plan: derived from its graph when its model is attached, else from
    its parameter names (layers and norms only)."""
    pm = getattr(plan, "model", None)
    if pm is not None:
        return derive(pm.captured)
    return from_names(plan.param_placements)


# ------------------------------------------------------------------------------ from a module
def from_module(module: "nn.Module") -> ModelConventions:
    """Conventions from the module tree, without tracing (see the module docstring).

    The layers are the numbered children of the container (``nn.ModuleList``, ``nn.ModuleDict``,
    ``nn.Sequential``) whose children are all of one class, hold parameters in submodules of their
    own (blocks, not bare layers), and that holds the most parameters.
    Inside a layer, an ``nn.Linear`` named in :data:`ROW_PARALLEL_NAMES` (or ``dense`` under a
    module named ``output``, BERT's naming) is row-parallel, one named in :data:`ROUTER_NAMES`
    is left alone, every other one is column-parallel; ``nn.MultiheadAttention``'s packed
    ``in_proj_weight`` is column-parallel and its ``out_proj`` row-parallel (a module of class
    ``Conv1D``, Hugging Face's linear layer stored ``[in, out]``, counts as an ``nn.Linear``, its
    weight in ``in_out``).  Outside the layers,
    ``nn.Embedding`` weights are embeddings (those whose size is an output projection's width, the
    vocabulary, when any is: position tables are left alone) and ``nn.Linear`` weights output
    projections.
    """
    from torch import nn

    container, best = None, 0
    for path, mod in module.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(mod.named_children())
        if not children or not all(k.isdigit() for k, _ in children):
            continue
        if len({type(c) for _, c in children}) != 1:
            continue
        if not all(any(True for sub in c.children() for _ in sub.parameters()) for _, c in children):
            continue  # bare layers (an nn.Sequential of Linear), not blocks
        size = sum(1 for _ in mod.parameters())
        if size > best:
            container, best = path, size
    pattern = None if container is None else f"{container}.{{i}}." if container else "{i}."
    layer_conv = ModelConventions(layer_pattern=pattern)

    column, row, norm_w, replicated, embedding, output, in_out = [], [], [], [], [], [], []
    outside = [(p, m) for p, m in module.named_modules() if not layer_conv.layer_of(p)]
    out_features = {m.out_features for _, m in outside if isinstance(m, nn.Linear)}
    tables = [m.num_embeddings for _, m in outside if isinstance(m, nn.Embedding)]
    vocab_tables = out_features & set(tables) or set(tables)  # position tables are not the vocabulary
    for path, mod in module.named_modules():
        if not any(True for _ in mod.parameters(recurse=False)):
            continue
        name = path.rsplit(".", 1)[-1]
        parent = path.rsplit(".", 2)[-2] if path.count(".") >= 1 else ""
        own = [f"{path}.{p}" if path else p for p, _ in mod.named_parameters(recurse=False)]
        in_layer = bool(layer_conv.layer_of(path))
        if type(mod).__name__.endswith("Norm") or isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
            norm_w += [f for f in own if f.endswith(".weight")]
            replicated += [f for f in own if not f.endswith(".weight")]
        elif isinstance(mod, nn.Embedding):
            if mod.num_embeddings in vocab_tables:
                embedding += own
        elif isinstance(mod, nn.MultiheadAttention):
            column += [f for f in own if f.rsplit(".", 1)[-1] in ("in_proj_weight", "in_proj_bias", "q_proj_weight",
                                                                 "k_proj_weight", "v_proj_weight")]
        elif isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D":
            bias = [f for f in own if f.endswith(".bias")]
            weight = [f for f in own if f.endswith(".weight")]
            if not isinstance(mod, nn.Linear):  # Hugging Face's Conv1D: a linear layer stored [in, out]
                in_out += weight
            if not in_layer:
                output += own
            elif name in ROUTER_NAMES:
                continue
            elif name in ROW_PARALLEL_NAMES or (name == "dense" and parent == "output"):
                row += weight
                replicated += bias
            else:
                column += own
    conv = ModelConventions(
        layer_pattern=pattern,
        norm_weights=_unique(_generalise(layer_conv, f) for f in norm_w),
        column_parallel=_unique(_generalise(layer_conv, f) for f in column),
        row_parallel=_unique(_generalise(layer_conv, f) for f in row),
        embedding=_unique(_generalise(layer_conv, f) for f in embedding),
        output=_unique(_generalise(layer_conv, f) for f in output),
        tp_replicated=_unique(_generalise(layer_conv, f) for f in replicated),
        in_out=_unique(_generalise(layer_conv, f) for f in in_out),
        source="derived from the module tree (layer container) and layer names (heuristics)")
    return conv

"""Linear layers kept N-D: ``view -> mm -> view`` rewritten into one op over ``[*batch_dims, feature]``.

A 3-D ``nn.Linear`` reaches the traced graph flattened: ``x [b, s, k]`` is viewed as ``[b*s, k]``,
multiplied by ``W.T``, and the ``[b*s, n]`` result viewed back as ``[b, s, n]``; its backward holds
one ``mm`` for the input gradient (same shape as the forward) and one for the weight gradient
(``g.view(b*s, n).T @ x.view(b*s, k)``). DTensor's view rule carries a sharding through that
flatten only on the leading dimension, so a placement sharding the batch on one mesh axis and the
sequence on another (``(S(0), S(1))``) cannot cross a linear without a redistribution nobody
needs. :func:`rewrite_linears` replaces each such ``mm`` (with the views around it) by

* ``apmodel_linear::mm_nd(a, b)``: ``a [..., K] @ b [K, N] -> [..., N]`` (the forward, ``b`` the
  graph's ``t(W)``, and the input gradient, ``b`` the weight itself), and
* ``apmodel_linear::mm_nd_wgrad(g, x)``: ``g [..., N]``, ``x [..., K]`` contracted over every
  leading dim -> ``[N, K]`` (the weight gradient),

each given DTensor's own single-dim einsum rule, the one ``mm`` has (``"aby,yz->abz"`` and
``"abz,aby->zy"`` for a 3-D activation; :func:`mm_nd_rule` / :func:`mm_nd_wgrad_rule` through
``register_sharding`` on a torch without it), so every combination of batch, sequence and feature
sharding across mesh axes is a placement of the op and enumeration needs no special case. A
flattening read by several matmuls becomes one N-D identity view they share (see
:func:`rewrite_linears`). Pricing asks the compute model about the ``mm`` the op replaces, at the
same local sizes and layouts (:func:`as_mm_call`); the native program calls :func:`mm_nd_local` /
:func:`mm_nd_wgrad_local` (a reshape and ``torch.mm``: Inductor sees plain ATen ops). A graph
whose matmuls are not in that shape (2-D activations, a bias fused as ``addmm``) is left as it is.
See docs/design.md, *Linear layers kept N-D*.
"""

from __future__ import annotations

import functools
import logging
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from apmodel._torch_private import register_einsum_rule

logger = logging.getLogger(__name__)

NAMESPACE = "apmodel_linear"
aten = torch.ops.aten
_FLATTEN_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


# ---------------------------------------------------------------------------------------------
# the ops' local semantics (also what the native program runs)


def mm_nd_local(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., K] @ b [K, N] -> [..., N]`` as one ``torch.mm`` over the flattened leading dims."""
    return torch.mm(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])


def mm_nd_wgrad_local(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum over leading dims of g[..., N]^T x[..., K] -> [N, K]`` as one ``torch.mm``."""
    return torch.mm(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


@torch.library.custom_op(f"{NAMESPACE}::mm_nd", mutates_args=())
def mm_nd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., K] @ b [K, N] -> [..., N]``."""
    return mm_nd_local(a, b)


@torch.library.custom_op(f"{NAMESPACE}::mm_nd_wgrad", mutates_args=())
def mm_nd_wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g [..., N]``, ``x [..., K]`` contracted over all leading dims -> ``[N, K]``."""
    return mm_nd_wgrad_local(g, x)


@mm_nd.register_fake
def _mm_nd_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@mm_nd_wgrad.register_fake
def _mm_nd_wgrad_fake(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.new_empty((g.shape[-1], x.shape[-1]))


MM_ND = torch.ops.apmodel_linear.mm_nd.default
MM_ND_WGRAD = torch.ops.apmodel_linear.mm_nd_wgrad.default
#: the ops of this module, by target (their native-program implementations)
LOCAL_IMPLS: Mapping[Any, Callable[..., torch.Tensor]] = MappingProxyType({MM_ND: mm_nd_local,
                                                                          MM_ND_WGRAD: mm_nd_wgrad_local})


# ---------------------------------------------------------------------------------------------
# sharding rules, per mesh axis (DTensor expands them over the mesh)

Rows = list[tuple[list[Placement], list[Placement | None]]]


def _linearity_rows() -> Rows:
    """One input partial, the other replicated: the output is partial (a matmul is linear in each
    input), for the reductions DTensor's ``mm`` rule accepts."""
    rows: Rows = []
    for op in Partial.LINEAR_REDUCE_OPS:
        rows.append(([Partial(op)], [Partial(op), Replicate()]))
        rows.append(([Partial(op)], [Replicate(), Partial(op)]))
    return rows


def mm_nd_rule(a: Any, b: Any) -> Rows:
    """``out = a[..., k] @ b[k, n]``: a leading dim of ``a`` sharded -> that dim of ``out``
    (``b`` whole); ``k`` sharded on both -> ``out`` partial sum; ``n`` sharded on ``b`` -> the
    last dim of ``out``; all replicated; the linearity rows of DTensor's ``mm``."""
    nd = len(a.shape)
    R: Placement = Replicate()
    rows: Rows = [([R], [R, R])]
    rows += [([Shard(d)], [Shard(d), R]) for d in range(nd - 1)]
    rows.append(([Partial()], [Shard(nd - 1), Shard(0)]))
    rows.append(([Shard(nd - 1)], [R, Shard(1)]))
    return rows + _linearity_rows()


def mm_nd_wgrad_rule(g: Any, x: Any) -> Rows:
    """``out[n, k] = sum over leading dims of g[..., n] x[..., k]``: a leading dim sharded on both
    -> ``out`` partial sum; ``n`` sharded on ``g`` -> ``out`` dim 0; ``k`` sharded on ``x`` ->
    ``out`` dim 1; all replicated; the linearity rows of DTensor's ``mm``."""
    nd = len(g.shape)
    R: Placement = Replicate()
    rows: Rows = [([R], [R, R])]
    rows += [([Partial()], [Shard(d), Shard(d)]) for d in range(nd - 1)]
    rows.append(([Shard(0)], [Shard(nd - 1), R]))
    rows.append(([Shard(1)], [R, Shard(nd - 1)]))
    return rows + _linearity_rows()


def einsum_equation(ranks: tuple[int, ...], *, wgrad: bool) -> str:
    """The einsum of ``mm_nd`` (``"aby,yz->abz"`` for a 3-D activation) or of ``mm_nd_wgrad``
    (``"abz,aby->zy"``), by the ranks of its tensor arguments."""
    lead = "abcdefghijklmnop"[: ranks[0] - 1]
    return f"{lead}z,{lead}y->zy" if wgrad else f"{lead}y,yz->{lead}z"


def _register_rules() -> None:
    """DTensor's own single-dim einsum rule where torch has it (the rule ``mm`` has: split-dimension
    seeding restricts it like ``mm``'s), else :func:`mm_nd_rule` / :func:`mm_nd_wgrad_rule`
    through ``register_sharding`` (the same rows per mesh axis, expanded over the mesh by DTensor)."""
    from torch.distributed.tensor.experimental import register_sharding

    if not register_einsum_rule(MM_ND, functools.partial(einsum_equation, wgrad=False)):
        register_sharding(MM_ND)(mm_nd_rule)
    if not register_einsum_rule(MM_ND_WGRAD, functools.partial(einsum_equation, wgrad=True)):
        register_sharding(MM_ND_WGRAD)(mm_nd_wgrad_rule)


_register_rules()


# ---------------------------------------------------------------------------------------------
# pricing: the mm each op replaces


def as_mm_call(target: Any, args: tuple) -> tuple[Any, tuple, torch.Tensor] | None:
    """``(aten.mm.default, args, out)`` on meta tensors: the ``mm`` an ``mm_nd`` /
    ``mm_nd_wgrad`` call on local tensors ``args`` replaces (same sizes, the layouts the flattened
    graph had: a contiguous activation, the weight as given, the gradient transposed), for the
    compute model to price; None for any other target."""
    if target is MM_ND:
        a, b = args[0], args[1]
        k, n = a.shape[-1], b.shape[-1]
        m = math.prod(a.shape[:-1])
        a2 = torch.empty((m, k), dtype=a.dtype, device="meta")
        b2 = torch.empty_strided(tuple(b.shape), tuple(b.stride()), dtype=b.dtype, device="meta")
        return aten.mm.default, (a2, b2), torch.empty((m, n), dtype=a.dtype, device="meta")
    if target is MM_ND_WGRAD:
        g, x = args[0], args[1]
        n, k = g.shape[-1], x.shape[-1]
        m = math.prod(g.shape[:-1])
        gt = torch.empty((m, n), dtype=g.dtype, device="meta").t()
        x2 = torch.empty((m, k), dtype=x.dtype, device="meta")
        return aten.mm.default, (gt, x2), torch.empty((n, k), dtype=g.dtype, device="meta")
    return None


def is_mm_nd(target: Any) -> bool:
    """True for the ops of this module."""
    return target is MM_ND or target is MM_ND_WGRAD


# ---------------------------------------------------------------------------------------------
# the rewrite


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _unflattened(node: Any) -> fx.Node | None:
    """The N-D (N >= 3) tensor ``node`` flattens to ``[prod(leading), last]``, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _FLATTEN_OPS:
        return None
    src = node.args[0]
    flat, full = _val(node), _val(src)
    if flat is None or full is None or full.ndim < 3 or flat.ndim != 2:
        return None
    if tuple(flat.shape) != (math.prod(full.shape[:-1]), full.shape[-1]):
        return None
    return src  # type: ignore[return-value]


def _unflattened_shared(graph: fx.Graph, flat: fx.Node, shared: dict[fx.Node, fx.Node]) -> fx.Node:
    """What a rewritten op reads in place of the flattening ``flat``: its N-D source, or, where
    ``flat`` has several readers (a gradient read by the weight- and the input-gradient matmul,
    an activation by the forward and the weight gradient), one N-D identity view of the source
    that they all read: the plan then redistributes the value once for all of them, as it did
    the flattened one (a redistribution is priced per edge)."""
    src = _unflattened(flat)
    assert src is not None
    if len(flat.users) <= 1:
        return src
    if flat not in shared:
        with graph.inserting_after(flat):
            node = graph.create_node("call_function", aten.view.default, (src, list(_val(src).shape)),  # type: ignore[union-attr]
                                     name=f"{flat.name}_nd")
        node.meta = {**flat.meta, "val": _val(src)}
        shared[flat] = node
    return shared[flat]


def _rewrite_mm_nd(graph: fx.Graph, mm: fx.Node, shared: dict[fx.Node, fx.Node]) -> bool:
    """``view(mm(view(a, [M, K]), b), [*lead, N])`` -> ``mm_nd(a, b)``; every user of the ``mm``
    must view it back to ``a``'s leading dims."""
    a2, b = mm.args[0], mm.args[1]
    a = _unflattened(a2)
    bval, out = _val(b), _val(mm)
    if a is None or bval is None or out is None or bval.ndim != 2 or not mm.users:
        return False
    lead = tuple(_val(a).shape[:-1])  # type: ignore[union-attr]
    users = list(mm.users)
    for u in users:
        uval = _val(u)
        if u.op != "call_function" or u.target not in _FLATTEN_OPS or uval is None \
                or tuple(uval.shape) != (*lead, out.shape[-1]):
            return False
    a = _unflattened_shared(graph, a2, shared)  # type: ignore[arg-type]
    with graph.inserting_before(mm):
        new = graph.create_node("call_function", MM_ND, (a, b), name="mm_nd")
    new.meta = {**mm.meta, "val": _val(users[0])}
    for u in users:
        u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(mm)
    return True


def _rewrite_wgrad(graph: fx.Graph, mm: fx.Node, shared: dict[fx.Node, fx.Node]) -> bool:
    """``mm(t(view(g, [M, N])), view(x, [M, K]))`` -> ``mm_nd_wgrad(g, x)`` (same leading dims)."""
    tg, x2 = mm.args[0], mm.args[1]
    if not isinstance(tg, fx.Node) or tg.op != "call_function" or tg.target is not aten.t.default:
        return False
    g, x = _unflattened(tg.args[0]), _unflattened(x2)
    if g is None or x is None or tuple(_val(g).shape[:-1]) != tuple(_val(x).shape[:-1]):  # type: ignore[union-attr]
        return False
    g, x = _unflattened_shared(graph, tg.args[0], shared), _unflattened_shared(graph, x2, shared)  # type: ignore[arg-type]
    with graph.inserting_before(mm):
        new = graph.create_node("call_function", MM_ND_WGRAD, (g, x), name="mm_nd_wgrad")
    new.meta = dict(mm.meta)
    mm.replace_all_uses_with(new)
    graph.erase_node(mm)
    return True


def rewrite_linears(gm: fx.GraphModule) -> int:
    """Rewrite every flattened N-D matmul of ``gm`` (forward, input gradient, weight gradient)
    into :data:`MM_ND` / :data:`MM_ND_WGRAD` in place (views left without readers removed);
    returns how many ``mm`` nodes were rewritten. The new nodes carry the replaced ``mm``'s
    metadata (module stack, stack trace), so layers, stamping and cost labels read them alike; a
    flattening that several of them read becomes one shared N-D identity view (``<view>_nd``),
    so that the plan redistributes that value once for all its readers, as it did the flattened
    one (a redistribution is priced per edge)."""
    graph = gm.graph
    done = 0
    shared: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        if _rewrite_mm_nd(graph, node, shared) or _rewrite_wgrad(graph, node, shared):
            done += 1
    if done:
        graph.eliminate_dead_code()
        gm.recompile()
        logger.debug("linear3d: %d flattened matmuls kept N-D", done)
    return done

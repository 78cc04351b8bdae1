"""What a plan does with each parameter and each mesh axis, read off the solved placements.

:func:`param_uses` follows a parameter to the forward ops that compute with it and reports the
placements they read it in; :func:`read_param` is one parameter's storage, uses and role per mesh
axis (what the CLI's table and the report's grid both show); :func:`emerged` names what each mesh
axis ended up doing (FSDP, tensor parallel, sequence parallel, data parallel, all-to-all). The CLI
tables, the plan report and the recipe tests read plans through these functions. Without the
plan's model (a plan read from a file) only storage can be read: :func:`storage_roles` says that
much and no more.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from apmodel.candidates.strategies import input_slots
from apmodel.core import placements as pl
from apmodel.graph.conventions import derive
from apmodel.graph.regions import is_backward, region_of
from apmodel.result.plans import parse_collective_key

#: Ops that only relabel a weight on its way to the op that computes with it.
_VIEW_OPS = frozenset({"t", "transpose", "view", "_unsafe_view", "reshape", "permute", "expand", "alias",
                       "_to_copy", "detach", "clone", "contiguous"})


def _view_dims(view: Any, dims: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The parameter dim each dim of ``view``'s output is (``dims``: the same for its input); None
    where a reshape mixes dims. Transposes and permutes move dims; dtype casts and copies keep them."""
    if dims is None:
        return None
    op = getattr(view.target, "__name__", str(view.target)).split(".")[0]
    if op == "t" and len(dims) == 2:
        return dims[::-1]
    if op == "transpose":
        a, b = (int(d) % len(dims) for d in view.args[1:3])
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    if op == "permute":
        return tuple(dims[int(d) % len(dims)] for d in view.args[1])
    src, val = view.args[0], view.meta.get("val")
    src_val = getattr(src, "meta", {}).get("val")
    if val is not None and src_val is not None and tuple(val.shape) == tuple(src_val.shape):
        return dims  # a cast, copy or a view that keeps the shape
    return None


def _in_param_dims(token: str, dims: tuple[int, ...] | None) -> str:
    """A placement token read on a view, in the parameter's own dims ("S(1)" of ``w.t()`` is "S(0)")."""
    if dims is None or not token.startswith("S("):
        return token
    return f"S({dims[int(token[2:-1])]})"


def param_uses(pmodel: Any, node_strategy: dict[str, Any], fqn: str, *, through_views: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """(consumer node, placement strings) for each forward op that reads parameter ``fqn``.

    With ``through_views``, follow view-like ops (``t``, ``view``...) to the computing forward ops
    (mm, embedding, mul...) and report the placements they expect for the weight (a redistribution
    after a transpose counts), in the parameter's own dims: ``mm`` reading ``w.t()`` split on its
    dim 1 reads ``w`` split on dim 0, "S(0)" (a reshape that mixes dims keeps the view's token)."""
    out = []
    root = pmodel.node_by_name[pmodel.fqn_to_node[fqn]]
    root_val = root.meta.get("val")
    frontier: list[tuple[Any, tuple[int, ...] | None]] = [
        (root, tuple(range(root_val.dim())) if root_val is not None else None)]
    seen = set()
    while frontier:
        prod, dims = frontier.pop()
        for user in prod.users:
            if user.name in seen or user.name not in node_strategy or pmodel.captured.is_backward.get(user.name, False):
                continue
            seen.add(user.name)
            op = getattr(user.target, "__name__", str(user.target)).split(".")[0]
            if through_views and op in _VIEW_OPS:
                frontier.append((user, _view_dims(user, dims)))
                continue
            for j, (src, _k) in enumerate(input_slots(user)):
                p = node_strategy[user.name].inputs[j] if j < len(node_strategy[user.name].inputs) else None
                if src is prod and p is not None:
                    out.append((user.name, tuple(_in_param_dims(pl.to_str(x), dims) for x in p)))
    return out


def param_role(stored: str, used: Sequence[str] | None) -> str:
    """Role of a parameter on one mesh axis from its storage token and the tokens its computing ops
    read it in (None: not known, the plan's model is not attached): "tp" (read sharded), "fsdp"
    (stored sharded, read whole), "sharded" (stored sharded, use not known or not read by the
    forward), "partial", "replicated". :func:`read_param` refines "tp" to "ep" for expert weights."""
    if any(u.startswith("S") for u in used or ()):
        return "tp"
    if stored.startswith("S"):
        return "fsdp" if used and all(u == "R" for u in used) else "sharded"
    if stored.startswith("P") or any(u.startswith("P") for u in used or ()):
        return "partial"
    return "replicated"


def _expert_parallel_use(pm: Any, ns: Mapping[str, Any], uses: Sequence[tuple[str, tuple[str, ...]]], axis: int) -> bool:
    """Whether a parameter is read sharded on ``axis`` by a ``local_map`` region that runs its
    expert-parallel alternative there (stacked expert weights: EP, not tensor parallelism)."""
    for name, placements in uses:
        node = pm.node_by_name.get(name)
        region = region_of(node.target) if node is not None and node.op == "call_function" else None
        if region is None or is_backward(node.target) or name not in ns or not placements[axis].startswith("S"):
            continue
        if (region.alternative_on_axes(ns[name].inputs, backward=False)[axis] or "").startswith("expert"):
            return True
    return False


@dataclass(frozen=True)
class ParamReading:
    """How a plan stores and uses one parameter, per mesh axis: the one reading the CLI's table and
    the report's grid both show (:func:`read_param`)."""

    fqn: str
    #: the graph placeholder holding it (a tied alias: its parameter's); None without the model
    node: str | None
    #: storage placement token per mesh axis ("S(0)", "R")
    stored: tuple[str, ...]
    #: (computing forward op, the placement tokens it reads the weight in), followed through views
    #: (``t``, ``view``...): a transposed weight's S(0) is its S(1); None when the model is not attached
    uses: tuple[tuple[str, tuple[str, ...]], ...] | None
    #: role per mesh axis (:func:`param_role`; "ep" for expert weights split by an expert-parallel region)
    roles: tuple[str, ...]

    def used(self, axis: int) -> tuple[str, ...] | None:
        """The distinct tokens the computing ops read on ``axis`` (sorted); None: not known."""
        return None if self.uses is None else tuple(sorted({p[axis] for _, p in self.uses}))

    @property
    def used_as(self) -> str:
        """The distinct placements the computing ops read ("RR", "S(0)R, RS(1)"); "—" when no
        forward op reads it, "?" when not known."""
        if self.uses is None:
            return "?"
        return ", ".join(sorted({"".join(p) for _, p in self.uses})) or "—"


def read_param(plan: Any, fqn: str) -> ParamReading:
    """How ``plan`` stores and uses parameter ``fqn`` (a tied alias reads as the parameter it shares).
    Uses need ``plan.model``; without it only storage is known."""
    stored = tuple(pl.to_str(p) for p in plan.param_placements[fqn])
    pm, ns = plan.model, plan.node_strategy
    uses, node = None, None
    if pm is not None:
        tied = {alias: node for node, aliases in pm.captured.tied_params.items() for alias in aliases}
        node = pm.fqn_to_node.get(fqn) or tied.get(fqn)
        if node is not None:
            uses = tuple(param_uses(pm, ns, pm.captured.param_fqn[node], through_views=True))
    reading = ParamReading(fqn, node, stored, uses, ())
    roles = []
    for a in range(len(stored)):
        role = param_role(stored[a], reading.used(a))
        if role == "tp" and uses is not None and _expert_parallel_use(pm, ns, uses, a):
            role = "ep"
        roles.append(role)
    return replace(reading, roles=tuple(roles))


#: The reading of a mesh axis of size 1: a "shard" on it is the whole tensor, nothing moves.
SIZE_ONE_AXIS = "one device (size 1: nothing is split or communicated on it)"


def emerged(plan: Any) -> dict[str, str]:
    """What each mesh axis does, read off the plan (:func:`storage_roles` without ``plan.model``).

    * parameters sharded in storage but read replicated by their forward ops -> FSDP (gathered);
    * matmul weights read sharded -> tensor parallel;
    * norm outputs sharded on dim 1 (sequence of ``[b, s, d]``) -> sequence parallel;
    * norm outputs sharded on dim 0 -> data parallel (batch);
    * all-to-all traffic on the axis -> all-to-all resharding;
    * ``local_map`` regions run by an alternative there -> its name (expert parallel, context
      parallel...), with the collectives the regions issue on the axis.

    The norm weights are those of the model's conventions (:func:`apmodel.graph.conventions.derive`).
    """
    pm = plan.model
    if pm is None:
        return storage_roles(plan)
    ns = plan.node_strategy
    conventions = derive(pm.captured)
    roles: dict[str, str] = {}
    weights = [f for f, node in pm.fqn_to_node.items() if getattr(pm.node_by_name[node].meta.get("val"), "dim", lambda: 0)() >= 2]
    norm_outputs = []
    for fqn, node in pm.fqn_to_node.items():
        if conventions.is_norm_weight(fqn):
            for user in pm.node_by_name[node].users:
                if user.name in ns and not pm.captured.is_backward.get(user.name, False) and ns[user.name].outputs:
                    val = user.meta.get("val")
                    if isinstance(val, (tuple, list)):  # native_layer_norm: (output, mean, rstd)
                        val = val[0] if val else None
                    if getattr(val, "dim", lambda: 0)() == 3 and ns[user.name].outputs[0] is not None:
                        norm_outputs.append(tuple(pl.to_str(x) for x in ns[user.name].outputs[0]))
    # local_map regions (expert-parallel MoE, context-parallel attention): the alternative per axis
    region_modes: list[Counter] = [Counter() for _ in plan.mesh_shape]
    region_totals: Counter = Counter()
    for n in pm.nodes:
        region = region_of(n.target) if n.op == "call_function" else None
        if region is None or is_backward(n.target) or n.name not in ns or pm.captured.is_backward.get(n.name, False):
            continue  # forward regions only (not their backward, nor a recomputed copy)
        region_totals[region.name] += 1
        for axis, mode in enumerate(region.alternative_on_axes(ns[n.name].inputs, backward=False)):
            if mode is not None:
                region_modes[axis][(region.name, mode)] += 1
    for axis, size in enumerate(plan.mesh_shape):
        if size == 1:
            roles[f"axis{axis}"] = SIZE_ONE_AXIS
            continue
        gathered = tp = replicated = 0
        for fqn in weights:
            stored = pl.to_str(plan.param_placements[fqn][axis])
            uses = [u[1][axis] for u in param_uses(pm, ns, fqn, through_views=True)]
            if any(u.startswith("S") for u in uses):
                tp += 1
            elif stored.startswith("S") and uses:
                gathered += 1
            elif stored == "R":
                replicated += 1
        sp = sum(1 for o in norm_outputs if o[axis] == "S(1)")
        dp = sum(1 for o in norm_outputs if o[axis] == "S(0)")
        a2a = plan.comm_by_collective.get(f"all_to_all@axis{axis}", 0.0)
        parts = []
        if dp:
            parts.append(f"data parallel (batch-sharded norm outputs {dp}/{len(norm_outputs)})")
        if gathered:
            parts.append(f"FSDP (weights sharded in storage, all-gathered for use: {gathered}/{len(weights)})")
        if tp:
            parts.append(f"tensor parallel (matmul/embedding weights used sharded: {tp}/{len(weights)})")
        if replicated:
            parts.append(f"weights replicated ({replicated}/{len(weights)})")
        if sp:
            parts.append(f"sequence parallel (norm outputs sharded on seq dim: {sp}/{len(norm_outputs)})")
        if a2a > 0:
            parts.append(f"all-to-all resharding ({a2a:,.0f} µs)")
        for (region, mode), count in sorted(region_modes[axis].items()):
            own = sum(us for k, us in plan.comm_by_collective.items()
                      if parse_collective_key(k)[1] == region and axis in parse_collective_key(k)[2])
            traffic = f", its collectives {own:,.0f} µs" if own > 0 else ""
            parts.append(f"{mode.replace('_', ' ')} ({region} regions {count}/{region_totals[region]}{traffic})")
        roles[f"axis{axis}"] = "; ".join(parts) or "idle (everything replicated on this axis)"
    return roles


def storage_roles(plan: Any) -> dict[str, str]:
    """What can be said of each mesh axis from a plan's storage placements and traffic alone (no
    model attached): how many parameters are stored sharded or replicated on it, and the
    collectives priced on it. How the parameters are *used* (FSDP gathers or tensor parallelism)
    needs the graph, and the text says so."""
    total = len(plan.param_placements)
    roles: dict[str, str] = {}
    for axis, size in enumerate(plan.mesh_shape):
        if size == 1:
            roles[f"axis{axis}"] = SIZE_ONE_AXIS
            continue
        tokens = [pl.to_str(p[axis]) for p in plan.param_placements.values()]
        sharded = sum(t.startswith("S") for t in tokens)
        replicated = sum(t == "R" for t in tokens)
        parts = [f"parameters stored sharded {sharded}/{total}, replicated {replicated}/{total}"]
        traffic = {k.split("@")[0]: v for k, v in plan.comm_by_collective.items() if k.endswith(f"@axis{axis}") and v > 0}
        if traffic:
            parts.append(", ".join(f"{kind.replace('_', '-')} {us:,.0f} µs" for kind, us in sorted(traffic.items())))
        parts.append("how they are used (gathered or read sharded) needs the plan's model")
        roles[f"axis{axis}"] = "; ".join(parts)
    return roles

"""Memory: the per-device bytes a plan needs, read off the joint graph (paper §4.2's storage
constraint, extended to a whole training step).

Per device, for a plan (one strategy per node):

* **parameters**: each parameter at its storage placement (local elements × bytes per element of
  the master dtype under mixed precision, else as priced; tied parameters once);
* **gradients**: one per trainable parameter, at the parameter's placement (the plan reduces each
  gradient to its parameter's placement, see :mod:`apmodel.problem.placement_model`);
* **optimizer state**: :data:`OPTIMIZER_STATE_COPIES` copies of each trainable parameter's
  local elements, in the same dtype (``torch.optim`` allocates its moments like the parameter);
* **activations**: the forward values the backward reads (what autograd saves), at their
  planned local shapes; views are counted once, through the value they view (their storage);
  parameters the backward reads are already counted;
* **peak**: the above plus the largest transient of one step of the graph: a node's output
  together with the copies of its inputs that the plan redistributes right before it
  (all-gathered weights, for instance); for a ``local_map`` region, the larger of its outputs
  and the most its function holds at once (gathered keys and values, all-to-all buffers).

Everything except the transient is linear in the placement indicators, so the same numbers make
a linear row of the placement model (:meth:`MemoryModel.row`): ``Σ bytes(node, state) ≤ limit``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from apmodel.candidates.strategies import Strategy, input_slots
from apmodel.core import placements as pl
from apmodel.graph.capture import aliases_first_input

logger = logging.getLogger(__name__)

#: Optimizer state per trainable element, in copies of the parameter: AdamW keeps two moments
#: (``exp_avg``, ``exp_avg_sq``), SGD with momentum one buffer, plain SGD none (torch.optim).
OPTIMIZER_STATE_COPIES: Mapping[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "none": 0}

#: Share of HBM the planner leaves for the CUDA context, the allocator's fragmentation and NCCL
#: buffers when it sets the default memory limit (PyTorch's caching allocator typically holds
#: 5-10% more than the live tensors).
HBM_RESERVE_FRACTION = 0.10


class OutOfMemory(ValueError):
    """No plan fits the per-device memory limit; the message says the smallest achievable
    footprint and what dominates it."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one plan (see the module docstring for what each holds)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    peak_bytes: float
    hbm_bytes: float | None

    def to_json(self) -> dict[str, float | None]:
        return {k: (None if v is None else int(round(v))) for k, v in asdict(self).items()}

    def _parts(self) -> dict[str, float]:
        return {
            "parameters": self.params_bytes, "gradients": self.grads_bytes,
            "optimizer state": self.optimizer_bytes, "activations": self.activations_bytes,
        }

    def dominant_kind(self) -> str:
        """The name of the largest component: ``"parameters"``, ``"gradients"``, ``"optimizer
        state"`` or ``"activations"`` (activation checkpointing shrinks the last)."""
        parts = self._parts()
        return max(parts, key=parts.__getitem__)

    def dominant(self) -> str:
        """The largest component, as ``"activations 61.2 GB"``."""
        name = self.dominant_kind()
        return f"{name} {self._parts()[name] / 1e9:.2f} GB"


def _value(node: fx.Node, index: int = 0) -> torch.Tensor | None:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[index] if index < len(val) else None
    return val if isinstance(val, torch.Tensor) else None


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose value owns ``node``'s storage (following views back to their base)."""
    while aliases_first_input(node):
        base = node.args[0]
        assert isinstance(base, fx.Node)  # aliases_first_input checks it
        node = base
    return node


def saved_for_backward(captured: Any) -> list[fx.Node]:
    """Forward values (storage roots, graph inputs other than parameters and buffers included)
    that backward nodes read, in graph order."""
    roles = captured.roles
    is_bwd = captured.is_backward
    saved: dict[fx.Node, None] = {}
    for n in captured.gm.graph.nodes:
        if n.op != "call_function" or not is_bwd.get(n.name, False):
            continue
        for a in n.all_input_nodes:
            if is_bwd.get(a.name, False):
                continue
            root = storage_root(a)
            if roles.get(root.name) in ("param", "buffer"):
                continue
            saved.setdefault(root, None)
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    return sorted(saved, key=order.__getitem__)


class MemoryModel:
    """Bytes per device of every candidate strategy of the nodes that hold memory across a step.

    ``itemsize(dtype) -> bytes`` prices activations (the cost context's pricing dtype),
    ``state_itemsize`` parameters, gradients and optimizer state (the master dtype under mixed
    precision; ``itemsize`` when None); ``optimizer`` is a key of :data:`OPTIMIZER_STATE_COPIES`;
    ``region_working_bytes(node, strategy) -> bytes`` what a ``local_map`` region holds inside its
    function (0 for other nodes; none counted when None).
    """

    def __init__(
        self,
        captured: Any,
        strategies: Mapping[str, Sequence[Strategy]],
        mesh_shape: Sequence[int],
        itemsize: Any,
        *,
        optimizer: str = "adamw",
        hbm_bytes: float | None = None,
        state_itemsize: Any = None,
        region_working_bytes: Callable[[fx.Node, Strategy], float] | None = None,
    ) -> None:
        if optimizer not in OPTIMIZER_STATE_COPIES:
            raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE_COPIES)}")
        self.captured = captured
        self.strategies = strategies
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.itemsize = itemsize
        self.state_itemsize = state_itemsize or itemsize
        self.optimizer = optimizer
        self.hbm_bytes = hbm_bytes
        self.region_working_bytes = region_working_bytes
        self.node_by_name = {n.name: n for n in captured.gm.graph.nodes}
        self.saved = saved_for_backward(captured)
        self._local_memo: dict[tuple, float] = {}

    # ------------------------------------------------------------------ per strategy
    def local_bytes(self, node: fx.Node, placement: Sequence[Any] | None, index: int = 0, *, state: bool = False) -> float:
        """Bytes of output ``index`` of ``node`` on one device under ``placement`` (``state``: in
        the parameters' storage dtype)."""
        val = _value(node, index)
        if val is None or placement is None:
            return 0.0
        strs = tuple(p if isinstance(p, str) else pl.to_str(p) for p in placement)
        key = (tuple(val.shape), val.dtype, strs, state)
        hit = self._local_memo.get(key)
        if hit is None:
            shape = pl.local_shape(tuple(val.shape), "".join(strs), self.mesh_shape)
            size = (self.state_itemsize if state else self.itemsize)(val.dtype)
            hit = self._local_memo[key] = float(math.prod(shape) * size)
        return hit

    def _state_bytes(self, name: str, *, state: bool = False) -> np.ndarray:
        node = self.node_by_name[name]
        return np.array([self.local_bytes(node, s.outputs[0], state=state) for s in self.strategies[name]])

    def param_vectors(self) -> dict[str, tuple[np.ndarray, bool]]:
        """Param node -> (bytes per strategy of its storage, trainable)."""
        cap = self.captured
        return {node: (self._state_bytes(node, state=True), node in cap.param_grad) for node in cap.param_fqn}

    def row(self, activation_copies: float = 1.0) -> list[tuple[str, int, float]]:
        """The linear memory row: (node, state index, bytes) for parameters, their gradients and
        optimizer state, and saved activations (everything but the transient), these
        ``activation_copies`` times (a pipeline stage holds several microbatches' at once)."""
        copies = OPTIMIZER_STATE_COPIES[self.optimizer]
        terms: list[tuple[str, int, float]] = []
        for node, (vec, trainable) in self.param_vectors().items():
            scale = 1 + (1 + copies if trainable else 0)
            terms.extend((node, i, float(b) * scale) for i, b in enumerate(vec) if b)
        for n in self.saved:
            terms.extend((n.name, i, float(b) * activation_copies) for i, b in enumerate(self._state_bytes(n.name)) if b)
        return terms

    # ------------------------------------------------------------------ one plan
    def estimate(self, node_strategy: Mapping[str, Strategy]) -> MemoryEstimate:
        """The per-device footprint of one plan."""
        copies = OPTIMIZER_STATE_COPIES[self.optimizer]
        params = grads = 0.0
        for node in self.captured.param_fqn:
            b = self.local_bytes(self.node_by_name[node], node_strategy[node].outputs[0], state=True)
            params += b
            if node in self.captured.param_grad:
                grads += b
        activations = sum(self.local_bytes(n, node_strategy[n.name].outputs[0]) for n in self.saved)
        transient = self._largest_transient(node_strategy)
        state = params + grads + grads * copies
        return MemoryEstimate(
            params_bytes=params,
            grads_bytes=grads,
            optimizer_bytes=grads * copies,
            activations_bytes=activations,
            peak_bytes=state + activations + transient,
            hbm_bytes=self.hbm_bytes,
        )

    def _largest_transient(self, node_strategy: Mapping[str, Strategy]) -> float:
        """Max over nodes of (output bytes + bytes of the inputs redistributed for it); a
        ``local_map`` region holds the larger of its outputs and its function's working set."""
        worst = 0.0
        for n in self.captured.gm.graph.nodes:
            if n.op != "call_function":
                continue
            s = node_strategy[n.name]
            total = sum(self.local_bytes(n, o, k) for k, o in enumerate(s.outputs))
            if self.region_working_bytes is not None:
                total = max(total, self.region_working_bytes(n, s))
            for (prod, k), dst in zip(input_slots(n), s.inputs, strict=False):
                src = node_strategy[prod.name].outputs[k] if k < len(node_strategy[prod.name].outputs) else None
                if dst is not None and src is not None and tuple(map(pl.to_str, src)) != tuple(map(pl.to_str, dst)):
                    total += self.local_bytes(prod, dst, k)
            worst = max(worst, total)
        return worst

    def smallest(self, allowed: Mapping[str, np.ndarray] | None = None) -> float:
        """A lower bound on the linear part of the footprint: each node at its smallest allowed
        state (exact when nodes choose independently)."""
        total = 0.0
        by_node: dict[str, dict[int, float]] = {}
        for node, i, b in self.row():
            by_node.setdefault(node, {})[i] = by_node.get(node, {}).get(i, 0.0) + b
        for node, states in by_node.items():
            mask = allowed.get(node) if allowed is not None else None
            n_states = len(self.strategies[node])
            vec = np.zeros(n_states)
            for i, b in states.items():
                vec[i] = b
            if mask is not None:
                vec = vec[np.asarray(mask, dtype=bool)]
            total += float(vec.min()) if len(vec) else 0.0
        return total

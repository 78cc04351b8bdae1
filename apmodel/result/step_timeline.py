"""A plan's step as the native program runs it: its forward and backward programs, ordered and timed.

The planner's pairwise objective sums compute and communication (the serial price). The native
program (:mod:`apmodel.lowering.native`) issues each collective as soon as what it reads exists and
waits for it just before its first reader, prefetching parameters' gathers within an in-flight
limit; this module builds the same two programs from the joint graph and a plan
(:class:`costmodels.overlap.ProgramOp`: every node a compute op priced by the cost model, every
planned redistribution a chain of collectives, each an issue and a wait, on its mesh axis's lane)
and orders and times them with the functions that order the native graphs
(:func:`costmodels.overlap.issue_order`), so the price and the program agree.

The forward program runs first; the backward starts where it ends (each communication lane as the
forward left it). Values the backward reads from the forward are its sources, static when they are
a parameter or a view or cast of one (so their gathers in the backward are prefetched too).
Times in µs, sizes in bytes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from apmodel._torch_private import overload_packet
from apmodel.graph.capture import ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, ROLE_TANGENT
from apmodel.graph.regions import region_of
from costmodels.overlap import ProgramOp, Timeline, issue_order, serial_order, simulate

if TYPE_CHECKING:
    from apmodel.problem.placement_model import PlacementModel

#: ops that move no data: emitted where first read, priced 0 on the timeline's order
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "split",
    "split_with_sizes", "unsqueeze", "squeeze", "alias", "detach", "getitem", "as_strided", "narrow", "unbind",
    "chunk", "view_as", "expand_as", "reshape_as",
})
#: ops heavy enough that a collective issued before one has likely finished after it (see
#: costmodels.overlap.issue_order): matmuls, convolutions, attention
HEAVY_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_grouped_mm",
                       "linear", "matmul", "einsum", "mm_nd", "mm_nd_wgrad"})


def op_name(target: Any) -> str:
    """The op's name without namespace or overload (``mm`` for ``aten.mm.default``)."""
    if target is operator.getitem:
        return "getitem"
    packet = overload_packet(target)
    if packet is not None:
        return str(getattr(packet, "__name__", packet)).rsplit(".", 1)[-1]
    return str(getattr(target, "__name__", target)).rsplit(".", 1)[-1]


def op_kind(target: Any) -> tuple[str, float]:
    """How the step program sees a call: ``("view", 0)``, ``("compute", 1)`` for a heavy op
    (matmuls, attention, a ``local_map`` region), else ``("compute", 0)``."""
    if region_of(target) is not None:
        return "compute", 1.0
    name = op_name(target)
    if name in VIEW_OPS:
        return "view", 0.0
    return "compute", 1.0 if name in HEAVY_OPS or "attention" in name else 0.0


@dataclass
class StepTimeline(Timeline):
    """The step of one plan (µs), from the forward's start to the backward's end (the fields of
    :class:`costmodels.overlap.Timeline` over both), whether it was ordered with ``overlap``, and
    ``phases``: the forward's and the backward's programs and timelines (for drawing)."""

    overlap: bool = False
    phases: dict[str, tuple[list[ProgramOp], Timeline]] = field(default_factory=dict)


#: a planned redistribution's collectives, ``(kind, mesh axis, bytes, µs)`` each
Steps = Sequence[tuple[str, int, float, float]]
#: an edge of the placement model as ``(producer, output index, consumer, input slot)``
EdgeKey = tuple[str, int, str, int]


class _ProgramBuilder:
    """The ops of one phase's program, appended in program order."""

    def __init__(self) -> None:
        self.ops: list[ProgramOp] = []

    def add(self, op: ProgramOp) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def chain(self, source: int, steps: Steps, label: str) -> int:
        """A redistribution's collectives in turn after ``source``: the last wait."""
        at = source
        for kind, axis, nbytes, us in steps:
            issue = self.add(ProgramOp("issue", (at,), float(us), lane=int(axis), nbytes=float(nbytes),
                                       label=f"{kind}@axis{axis} {label}"))
            at = self.add(ProgramOp("wait", (issue,), label=f"wait {label}"))
        return at


def _phase_program(pmodel: PlacementModel, backward: bool, compute_us: Mapping[str, float],
                   edge_steps: Mapping[EdgeKey, Steps], boundary_steps: Mapping[str, Steps]) -> list[ProgramOp]:
    cap = pmodel.captured
    static_values = pmodel.param_values
    is_bwd = cap.is_backward
    b = _ProgramBuilder()
    op_of: dict[str, int] = {}
    by_consumer: dict[str, list[Any]] = {}
    for e in pmodel.edges:
        by_consumer.setdefault(e.consumer, []).append(e)
    in_phase = [n for n in pmodel.nodes if n.op == "call_function" and is_bwd.get(n.name, False) == backward]
    phase_names = {n.name for n in in_phase}

    def source(name: str) -> int:
        i = op_of.get(name)
        if i is None:
            role = cap.roles.get(name)
            static = name in static_values or role in (ROLE_PARAM, ROLE_BUFFER)
            i = op_of[name] = b.add(ProgramOp("source", static=static, label=name))
        return i

    first_sources = (ROLE_TANGENT,) if backward else (ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT)
    for name, role in cap.roles.items():
        if role in first_sources:
            source(name)

    def read(e: Any, label: str) -> int:
        at = op_of[e.producer] if e.producer in op_of else source(e.producer)
        return b.chain(at, edge_steps.get((e.producer, e.out_index, e.consumer, e.slot), ()), label)

    outputs: list[int] = []
    for n in in_phase:
        inputs = [read(e, f"{e.producer}->{n.name}") for e in by_consumer.get(n.name, []) if e.slot >= 0]
        kind, weight = op_kind(n.target)
        op_of[n.name] = b.add(ProgramOp(kind, tuple(dict.fromkeys(inputs)), compute_us[n.name], weight=weight,  # type: ignore[arg-type]
                                        label=n.name))
    for name in cap.roles:  # gradients and buffer updates, at their placeholders' placements
        for e in by_consumer.get(name, []):
            if e.slot < 0 and e.producer in phase_names:
                outputs.append(read(e, f"{e.producer}->{name}"))
    for name, steps in boundary_steps.items():
        if name in phase_names:
            outputs.append(b.chain(op_of[name], steps, f"{name}->output"))
    read_later: set[str] = set()
    if not backward:  # what the backward reads from the forward is the forward's output
        read_later = {e.producer for e in pmodel.edges if e.producer in phase_names
                      and is_bwd.get(e.consumer, False)}
    used = {j for op in b.ops for j in op.inputs}
    outputs += [op_of[n] for n in phase_names if n in read_later or op_of[n] not in used]
    b.add(ProgramOp("compute", tuple(sorted(set(outputs))), 0.0, label="output"))
    return b.ops


def step_timeline(pmodel: PlacementModel, compute_us: Mapping[str, float], edge_steps: Mapping[EdgeKey, Steps],
                  boundary_steps: Mapping[str, Steps], *, overlap: bool, inflight_bytes: float,
                  overlap_slowdown: float = 0.0, max_inflight: int | None = None,
                  keep_spans: bool = False) -> StepTimeline:
    """The step of a plan (µs): its forward and backward programs ordered as the native program
    runs them (``overlap``; ``inflight_bytes`` the in-flight limit, ``max_inflight`` the most
    collectives in flight, one on gloo) and timed. ``compute_us``: each node's priced compute;
    ``edge_steps`` / ``boundary_steps``: the collectives of each planned redistribution, by edge
    and by forward output brought to its boundary placement (as :func:`apmodel.result.plans.price`
    prices them)."""
    phases: dict[str, tuple[list[ProgramOp], Timeline]] = {}
    start = 0.0
    lanes: dict[Any, float] = {}
    for phase in ("forward", "backward"):
        ops = _phase_program(pmodel, phase == "backward", compute_us, edge_steps, boundary_steps)
        order = issue_order(ops, inflight_bytes, max_inflight) if overlap else serial_order(ops)
        tl = simulate(ops, order, overlap_slowdown=overlap_slowdown if overlap else 0.0, start_us=start,
                      lanes_free_us=lanes, keep_spans=keep_spans)
        phases[phase] = (ops, tl)
        start = tl.end_us["compute"]
        lanes = {k: v for k, v in tl.end_us.items() if k != "compute"}
    compute = sum(tl.compute_us for _, tl in phases.values())
    comm = sum(tl.comm_us for _, tl in phases.values())
    step = start
    exposed = max(0.0, step - compute)
    return StepTimeline(step_us=step, compute_us=compute, comm_us=comm, exposed_comm_us=exposed,
                        hidden_comm_us=max(0.0, comm - exposed),
                        peak_inflight_bytes=max(tl.peak_inflight_bytes for _, tl in phases.values()),
                        overlap=overlap, phases=phases)

"""Pipeline schedules: the order each rank runs its microbatches in, the step's timeline, and the
split of a model's layers into stages.

A pipeline of ``degree`` ranks runs ``stages`` stages (``degree`` for 1F1B; ``degree × v`` for the
interleaved schedule, stage ``k`` on rank ``k mod degree``) over ``microbatches`` microbatches.
Each rank runs its actions (forward ``F`` or backward ``B`` of one stage on one microbatch) in a
fixed order, the order ``torch.distributed.pipelining``'s schedules run them:

* **1F1B** (``Schedule1F1B``): stage ``s`` runs ``min(m, degree - s)`` forwards, then alternates
  one backward and one forward, then the backwards left (Narayanan et al., *PipeDream-Flush*);
* **interleaved** (``ScheduleInterleaved1F1B``, Megatron-LM's interleaved schedule): forwards go
  through the rank's stages in rounds of ``degree`` microbatches (stage after stage, round after
  round), backwards likewise with the stages reversed; rank ``r`` warms up with
  ``(v - 1)·degree + 2·(degree - 1 - r)`` forwards, then alternates one forward and one
  backward, then runs the backwards left;
* **zbv** (``ScheduleZBVZeroBubble``, Qi et al., *Zero Bubble Pipeline Parallelism*, §6, ZB-V):
  two stages per rank in a V (rank ``r`` holds stage ``r`` and stage ``2d - 1 - r``, so the
  first and the last stage share rank 0), the backward split into its input-gradient ``I`` and its
  weight-gradient ``W``: rank ``r`` warms up with ``2(d - r) - 1`` forwards of its first stage,
  ``r`` pairs of forwards (second stage, first stage) and ``d - r`` triples ``F I W`` of its second
  stage; then alternates ``F I W`` on the first and on the second stage; cools down with ``r``
  pairs of ``I`` (first, second stage), ``d - r`` pairs of ``I`` and the oldest pending ``W`` of
  the first stage, then the second stage's pending ``W`` and the first's;
* **dualpipev** (``ScheduleDualPipeV``, DeepSeek-V3 report's DualPipe cut in half, the "V" of
  DualPipe's README): the same V placement; rank ``r`` runs ``2(d - r - 1)`` forwards of its
  first stage, ``r + 1`` pairs of forwards (first, second stage), ``d - r - 1`` triples (``I`` of
  the second stage, the oldest pending ``W``, ``F`` of the second stage), then its main phase of
  forward-and-backward pairs (the forward of one stage beside a full backward ``B`` of the other,
  :attr:`Action.overlap`), ``d - r - 1`` rounds of ``B`` and such a pair, ``r + 1`` rounds of
  backwards of both stages (full ones, then split ones from the middle round on: their ``W``
  wait), and the pending ``W`` s interleaved with the first stage's last backwards.

:func:`simulate` runs the orders against per-stage forward and backward times and a transfer
time per stage boundary: an action starts when its rank is free and its input has arrived (the
previous stage's forward, or the next stage's backward, plus the transfer). A stage may also have
work once per step: ``setup_us`` at the step's start (gathering parameters it keeps for every
microbatch) and ``flush_us`` after its last backward (reducing the gradients it accumulated, where
``torch.distributed.pipelining`` runs its ``REDUCE_GRAD`` action, the backward's gradient already
sent on); both hold the rank. The timeline is exact for the orders and times given (no overlap of
a transfer with anything but other ranks' work). A split backward's ``I`` needs the next stage's
input gradient (its ``I`` or ``B``) and ``W`` its own ``I``; stages on the same rank (the V's
turn) hand over without a transfer, as ``torch.distributed.pipelining`` does
(``set_local_fwd_input``). DualPipe-V's forward-and-backward pair runs, in ``torch`` 2.13, as its
two halves one after the other on one stream (``_PipelineScheduleRuntime`` runs ``OVERLAP_F_B``'s
sub-actions in turn unless a custom function is registered), and the pair's sends are issued after
both halves: it is priced so, ``F + B``, the forward's output leaving the rank at the pair's end.
With equal stages and no transfer time it gives the textbook figures: 1F1B takes
``(m + d - 1)·(f + b)``, the interleaved schedule ``m·(f + b) + (d - 1)·(f + b)/v`` (``f``, ``b``:
one microbatch's forward and backward through the whole model divided by ``d``). With one
microbatch's ``F``, ``I`` and ``W`` equal on every stage it gives the published bubbles of the
split-backward schedules (see ``tests/test_pipeline.py``).

**The split of a backward** into ``I`` and ``W`` (``weight_us``): where the caller does not give
it, :data:`WEIGHT_GRAD_SHARE` of the backward. A linear layer's backward is two matmuls of equal
FLOPs (``dX = dY·Wᵀ``, ``dW = Xᵀ·dY``), and Qi et al. price ``T_B = T_W`` in their schedules'
analysis (§2); the attention's score and value products have no weights, so a transformer layer's
real weight share is a little under half.

:func:`balanced_split` cuts a sequence of layer costs into contiguous stages minimising the most
expensive stage (dynamic programming over cut points; :func:`brute_force_split` checks it).

This module is pure Python: no torch, no planner.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

Schedule = Literal["1f1b", "interleaved", "zbv", "dualpipev"]
#: The schedules, declared once (the option ``pp_schedule`` takes these, and ``"auto"``).
SCHEDULES: tuple[str, ...] = get_args(Schedule)
#: The schedules with a V placement: stage ``k`` and stage ``2d - 1 - k`` on rank ``k``.
V_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")
#: Share of a stage's backward that its weight-gradient action ``W`` runs, where the caller gives
#: no split: half (a linear layer's ``dW`` matmul has the FLOPs of its ``dX`` one; Qi et al., *Zero
#: Bubble Pipeline Parallelism*, price ``T_B = T_W``).
WEIGHT_GRAD_SHARE = 0.5
#: How a pipeline stage synchronises its weights (parameters sharded over the stage mesh):
#: ``"microbatch"``: gathers its parameters and reduces their gradients on every microbatch;
#: ``"reduce_once"``: gathers per microbatch (FSDP's reshard after each use), accumulates the
#: gradients locally and reduces them once per step, after its last backward; ``"gather_once"``:
#: also gathers the parameters once per step, before its first forward, and keeps them gathered for
#: every microbatch (torchtitan's FSDP + pipeline without reshard). Cheapest last; most memory last.
WEIGHT_SYNCS: tuple[str, ...] = ("microbatch", "reduce_once", "gather_once")
#: Stages per rank of the interleaved schedule (``v``): Megatron-LM's and torchtitan's examples use 2.
INTERLEAVED_STAGES_PER_RANK = 2


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the degree, stages or microbatches at fault."""


ActionKind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a rank: ``kind`` "F" (forward), "B" (full backward), "I" (the
    backward's input gradient) or "W" (its weight gradient) of ``stage`` on ``microbatch``.
    ``overlap``: a forward that runs paired with the rank's next action (DualPipe-V's F&B)."""

    kind: ActionKind
    stage: int
    microbatch: int
    overlap: bool = False

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds: 1 for 1F1B, :data:`INTERLEAVED_STAGES_PER_RANK` interleaved, 2 in a V."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return 1 if schedule == "1f1b" else INTERLEAVED_STAGES_PER_RANK if schedule == "interleaved" else 2


def rank_of(schedule: str, degree: int, stage: int) -> int:
    """The pipeline rank that runs ``stage``: ``stage mod degree`` (1F1B, interleaved), or the V's
    (stage ``k`` and ``2d - 1 - k`` on rank ``k``)."""
    n = degree * stages_per_rank(schedule)
    if not 0 <= stage < n:
        raise ScheduleError(f"stage {stage}: a {schedule} pipeline of degree {degree} has stages 0..{n - 1}")
    if schedule in V_SCHEDULES:
        return stage if stage < degree else n - 1 - stage
    return stage % degree


def rank_stages(schedule: str, degree: int, rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` holds, first to last."""
    n = degree * stages_per_rank(schedule)
    return [k for k in range(n) if rank_of(schedule, degree, k) == rank]


def check(schedule: str, degree: int, microbatches: int) -> None:
    """Refuse a schedule ``torch.distributed.pipelining`` cannot run, naming what is at fault."""
    stages_per_rank(schedule)
    if degree < 1 or microbatches < 1:
        raise ScheduleError(f"pipeline degree {degree} and microbatches {microbatches} must be >= 1")
    if degree > 1 and microbatches < degree:
        raise ScheduleError(f"{microbatches} microbatches cannot fill a {schedule} pipeline of degree {degree}: "
                            f"give at least {degree} (Schedule1F1B needs microbatches >= stages)")
    if schedule == "interleaved" and degree > 1 and microbatches % degree:
        raise ScheduleError(f"the interleaved schedule runs microbatches in rounds of the pipeline degree: "
                            f"{microbatches} microbatches is not a multiple of degree {degree}")
    if schedule in V_SCHEDULES and microbatches < 2 * degree:
        raise ScheduleError(f"{microbatches} microbatches cannot fill a {schedule} pipeline of degree {degree} "
                            f"({2 * degree} stages in a V): give at least {2 * degree} (ScheduleDualPipeV needs "
                            f"microbatches >= stages; ScheduleZBVZeroBubble's warm-up runs 2·degree - 1)")


def orders(schedule: str, degree: int, microbatches: int) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (see the module docstring)."""
    check(schedule, degree, microbatches)
    m = microbatches
    if schedule == "zbv":
        return [_zbv_order(degree, m, r) for r in range(degree)]
    if schedule == "dualpipev":
        return [_dualpipev_order(degree, m, r) for r in range(degree)]
    if schedule == "1f1b":
        out = []
        for s in range(degree):
            warmup = min(m, degree - s)
            acts = [Action("F", s, i) for i in range(warmup)]
            for b in range(m):
                acts.append(Action("B", s, b))
                if warmup + b < m:
                    acts.append(Action("F", s, warmup + b))
            out.append(acts)
        return out
    v = INTERLEAVED_STAGES_PER_RANK
    out = []
    for r in range(degree):
        local = [r + j * degree for j in range(v)]  # the rank's stages, first to last
        fwd = [Action("F", local[j], g * degree + i)
               for g in range(m // degree) for j in range(v) for i in range(degree)]
        bwd = [Action("B", local[v - 1 - j], g * degree + i)
               for g in range(m // degree) for j in range(v) for i in range(degree)]
        warmup = min(len(fwd), (v - 1) * degree + 2 * (degree - 1 - r))
        acts = fwd[:warmup]
        f, b = warmup, 0
        while f < len(fwd) or b < len(bwd):
            if f < len(fwd):
                acts.append(fwd[f])
                f += 1
            if b < len(bwd):
                acts.append(bwd[b])
                b += 1
        out.append(acts)
    return out


class _Counter:
    """The next microbatch of each (stage, kind) of one rank's order, and its pending ``W`` s."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = {}
        self.pending: list[tuple[int, int]] = []  # (stage, microbatch) of an I whose W waits, oldest first
        self.acts: list[Action] = []

    def add(self, kind: ActionKind, stage: int, overlap: bool = False) -> None:
        # a backward, full or split, takes the stage's next backward microbatch
        key = (stage, "F" if kind == "F" else "W" if kind == "W" else "B")
        i = self.next.get(key, 0)
        self.next[key] = i + 1
        self.acts.append(Action(kind, stage, i, overlap))
        if kind == "I":
            self.pending.append((stage, i))

    def weight(self, stage: int | None = None) -> None:
        """The oldest pending ``W`` (of ``stage`` only, when given); nothing when none waits."""
        for j, (k, i) in enumerate(self.pending):
            if stage is None or k == stage:
                del self.pending[j]
                self.acts.append(Action("W", k, i))
                return


def _zbv_order(degree: int, m: int, r: int) -> list[Action]:
    """Rank ``r``'s ZB-V order (see the module docstring); ``m >= 2·degree``."""
    d, down, up = degree, r, 2 * degree - 1 - r
    c = _Counter()
    for _ in range(2 * (d - r) - 1):
        c.add("F", down)
    for _ in range(r):
        c.add("F", up)
        c.add("F", down)
    for _ in range(d - r):
        c.add("F", up)
        c.add("I", up)
        c.weight(up)
    while c.next.get((down, "F"), 0) < m or c.next.get((up, "F"), 0) < c.next.get((down, "F"), 0):
        if c.next.get((down, "F"), 0) < m:
            c.add("F", down)
        c.add("I", down)
        c.weight(down)
        c.add("F", up)
        c.add("I", up)
        c.weight(up)
    for _ in range(r):
        c.add("I", down)
        c.add("I", up)
    for _ in range(d - r):
        c.add("I", down)
        c.weight(down)
    while any(k == up for k, _ in c.pending):
        c.weight(up)
    while c.pending:
        c.weight(down)
    return c.acts


def _dualpipev_order(degree: int, m: int, r: int) -> list[Action]:
    """Rank ``r``'s DualPipe-V order (see the module docstring); ``m >= 2·degree``."""
    d, down, up = degree, r, 2 * degree - 1 - r
    c = _Counter()
    for _ in range(2 * (d - r - 1)):
        c.add("F", down)
    for _ in range(r + 1):
        c.add("F", down)
        c.add("F", up)
    for _ in range(d - r - 1):
        c.add("I", up)
        c.weight()
        c.add("F", up)
    for i in range(m - 2 * d + r + 1):
        # the last rank's first pair runs apart (its backward needs that very forward's loss)
        c.add("F", down, overlap=not (i == 0 and r == d - 1))
        c.add("B", up)
        c.add("F", up, overlap=True)
        c.add("B", down)
    for _ in range(d - r - 1):
        c.add("B", up)
        c.add("F", up, overlap=True)
        c.add("B", down)
    split = False  # from the middle round on, backwards leave their W for later
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        c.add("I" if split else "B", up)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        c.add("I" if split else "B", down)
    for _ in range(d - r - 1):
        c.weight()
        c.add("I" if split else "B", down)
    for _ in range(r + 1):
        c.weight()
    return c.acts


def in_flight(schedule: str, degree: int, microbatches: int) -> tuple[int, ...]:
    """Per stage: the most microbatches whose forward ran and whose weight gradient (``W``, or the
    full backward ``B``) did not yet, by the rank's order alone (the activations it holds)."""
    return _held_microbatches(orders(schedule, degree, microbatches), degree * stages_per_rank(schedule))


def _held_microbatches(ranks: Sequence[Sequence[Action]], n_stages: int) -> tuple[int, ...]:
    """:func:`in_flight` of the per-rank orders ``ranks``."""
    live, most = [0] * n_stages, [0] * n_stages
    for acts in ranks:
        for a in acts:
            if a.kind == "F":
                live[a.stage] += 1
                most[a.stage] = max(most[a.stage], live[a.stage])
            elif a.kind in ("B", "W"):
                live[a.stage] -= 1
    return tuple(most)


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found, in µs (``forward_us`` / ``backward_us`` are per stage and microbatch)."""

    step_us: float
    """the step: from the first forward to the last backward (or weight gradient)"""
    busy_us: tuple[float, ...]
    """per rank: time spent running actions"""
    bubble_us: float
    """the step less the busiest rank's work: time that rank waits"""
    in_flight: tuple[int, ...]
    """per stage: most microbatches whose forward ran and backward (its ``W``) did not yet (activations held)"""
    held_bytes: tuple[float, ...] = ()
    """per rank: the most activation bytes its stages hold at once (given ``activation_bytes``)"""
    first_us: tuple[float, ...] = ()
    """per rank: when its first action starts"""
    last_us: tuple[float, ...] = ()
    """per rank: when its last action (and its stages' flush) ends"""

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_us / self.step_us if self.step_us > 0 else 0.0


def _per_stage(schedule: str, degree: int, n_stages: int, forward_us: Sequence[float], backward_us: Sequence[float],
               transfer_us: Sequence[float], activation_bytes: Sequence[float], setup_us: Sequence[float],
               flush_us: Sequence[float], weight_us: Sequence[float]) -> tuple[list[float], ...]:
    """:func:`simulate`'s per-stage inputs with their defaults, refused where a count is wrong:
    transfers (one per boundary), activation bytes, setup, flush and weight-gradient times."""
    if len(forward_us) != n_stages or len(backward_us) != n_stages:
        raise ScheduleError(f"{schedule} on degree {degree} has {n_stages} stages; got times for "
                            f"{len(forward_us)} forward and {len(backward_us)} backward")
    transfer = list(transfer_us) or [0.0] * (n_stages - 1)
    if len(transfer) != n_stages - 1:
        raise ScheduleError(f"{n_stages} stages have {n_stages - 1} boundaries; got {len(transfer)} transfer times")
    act = list(activation_bytes) or [0.0] * n_stages
    setup = list(setup_us) or [0.0] * n_stages
    flush = list(flush_us) or [0.0] * n_stages
    weight = list(weight_us) or [WEIGHT_GRAD_SHARE * b for b in backward_us]
    if len(act) != n_stages or len(setup) != n_stages or len(flush) != n_stages or len(weight) != n_stages:
        raise ScheduleError(f"{n_stages} stages: got {len(act)} activation sizes, {len(setup)} setup, "
                            f"{len(flush)} flush and {len(weight)} weight-gradient times")
    return transfer, act, setup, flush, weight


def simulate(
    schedule: str,
    degree: int,
    microbatches: int,
    forward_us: Sequence[float],
    backward_us: Sequence[float],
    transfer_us: Sequence[float] = (),
    activation_bytes: Sequence[float] = (),
    setup_us: Sequence[float] = (),
    flush_us: Sequence[float] = (),
    weight_us: Sequence[float] = (),
) -> Timeline:
    """The timeline of one step. ``forward_us[k]`` / ``backward_us[k]``: one microbatch through
    stage ``k``; ``transfer_us[k]``: moving one microbatch's activation from stage ``k`` to
    ``k + 1`` (and its gradient back), default 0, not paid where both stages share a rank;
    ``activation_bytes[k]``: what stage ``k`` keeps from a forward until its backward's weight
    gradient (per device), for :attr:`Timeline.held_bytes`; ``setup_us[k]`` / ``flush_us[k]``:
    stage ``k``'s work once per step, at the step's start and after its last backward (``B`` or
    ``W``; default 0); ``weight_us[k]``: the part of ``backward_us[k]`` a split backward's ``W``
    runs (default: :data:`WEIGHT_GRAD_SHARE` of it; ``I`` runs the rest)."""
    n_stages = degree * stages_per_rank(schedule)
    transfer, act, setup, flush, weight = _per_stage(schedule, degree, n_stages, forward_us, backward_us, transfer_us,
                                                     activation_bytes, setup_us, flush_us, weight_us)
    home = [rank_of(schedule, degree, k) for k in range(n_stages)]
    own_us = {"F": list(forward_us), "B": list(backward_us), "W": weight,
              "I": [b - w for b, w in zip(backward_us, weight, strict=True)]}
    ranks = orders(schedule, degree, microbatches)
    held = [0.0] * degree
    most_held = [0.0] * degree
    # ("F", k, i): stage k's output of microbatch i; ("G", k, i): its input gradient (B or I);
    # ("W", k, i): its weight gradient. done: when it is ready on its own rank; sent: on the next
    done: dict[tuple[str, int, int], float] = {}
    sent: dict[tuple[str, int, int], float] = {}
    paired: list[tuple[str, int, int] | None] = [None] * degree  # a pair's forward, sent at the pair's end
    # each rank gathers what its stages keep at the step's start, before its first action
    free = [sum(setup[k] for k in range(n_stages) if home[k] == r) for r in range(degree)]
    pos = [0] * degree
    busy = list(free)
    finished = [0] * n_stages  # backwards (B or W) run per stage: the flush follows the last
    first = [math.inf] * degree
    left = sum(len(r) for r in ranks)
    while left:
        progressed = False
        for r, acts in enumerate(ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                k, i = a.stage, a.microbatch
                dep: tuple[str, int, int] | None
                if a.kind == "F":
                    dep, src = (None, k) if k == 0 else (("F", k - 1, i), k - 1)
                elif a.kind == "W":
                    dep, src = ("G", k, i), k
                else:
                    dep, src = (("F", k, i), k) if k == n_stages - 1 else (("G", k + 1, i), k + 1)
                if dep is None:
                    ready = 0.0
                elif home[src] == r:
                    if dep not in done:
                        break
                    ready = done[dep]
                else:
                    if dep not in sent:
                        break
                    ready = sent[dep] + transfer[min(k, src)]
                start = max(free[r], ready)
                first[r] = min(first[r], start)
                end = start + own_us[a.kind][k]
                finished[k] += a.kind in ("B", "W")
                after = flush[k] if finished[k] == microbatches else 0.0
                key = ("G" if a.kind in ("B", "I") else a.kind, k, i)
                done[key] = end
                if a.kind == "B":
                    done[("W", k, i)] = end
                if a.overlap:
                    paired[r] = key
                else:
                    sent[key] = end  # its output leaves before the reduction
                    if paired[r] is not None:
                        sent[paired[r]] = end  # type: ignore[index]
                        paired[r] = None
                free[r] = end + after
                busy[r] += own_us[a.kind][k] + after
                if a.kind != "I":
                    held[r] += (1 if a.kind == "F" else -1) * act[k]
                    most_held[r] = max(most_held[r], held[r])
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(ranks) if pos[r] < len(acts)}
            raise ScheduleError(f"{schedule} schedule deadlocks (ranks waiting at {stuck})")
    step_us = max(free)
    return Timeline(step_us=step_us, busy_us=tuple(busy), bubble_us=step_us - max(busy), in_flight=_held_microbatches(ranks, n_stages),
                    held_bytes=tuple(most_held), first_us=tuple(first), last_us=tuple(free))


# ------------------------------------------------------------------------------ stage splits
def _stage_cost(prefix: Sequence[float], first: float, last: float, n_stages: int, k: int, i: int, j: int) -> float:
    """Cost of stage ``k`` holding layers ``i .. j-1`` (prefix sums), with the first stage's and
    the last stage's extra units."""
    return prefix[j] - prefix[i] + (first if k == 0 else 0.0) + (last if k == n_stages - 1 else 0.0)


def balanced_split(
    layer_us: Sequence[float],
    n_stages: int,
    *,
    first_us: float = 0.0,
    last_us: float = 0.0,
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Contiguous stages ``((first_layer, last_layer), ...)`` (inclusive), each at least one layer,
    minimising the largest stage cost: the sum of its layers' ``layer_us``, plus ``first_us`` on
    the first stage (the embedding) and ``last_us`` on the last (the head and loss). ``fits(k, i,
    j)``: whether stage ``k`` may hold layers ``i .. j`` inclusive (memory); ties go to the split
    found first. Raises :class:`ScheduleError` when there are fewer layers than stages or no split fits."""
    n = len(layer_us)
    if n_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {n_stages}")
    if n_stages > n:
        raise ScheduleError(f"{n_stages} pipeline stages but the model has {n} repeated layers: each stage needs "
                            f"at least one layer (use a smaller pipeline degree)")
    prefix = [0.0]
    for c in layer_us:
        prefix.append(prefix[-1] + float(c))
    # best[k][j]: the smallest largest-stage cost of stages 0..k covering layers 0..j-1
    best = [[math.inf] * (n + 1) for _ in range(n_stages)]
    cut = [[-1] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n - n_stages + 2):
        if fits is None or fits(0, 0, j - 1):
            best[0][j] = _stage_cost(prefix, first_us, last_us, n_stages, 0, 0, j)
    for k in range(1, n_stages):
        for j in range(k + 1, n - (n_stages - 1 - k) + 1):
            for i in range(k, j):
                if best[k - 1][i] == math.inf or (fits is not None and not fits(k, i, j - 1)):
                    continue
                value = max(best[k - 1][i], _stage_cost(prefix, first_us, last_us, n_stages, k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[n_stages - 1][n] == math.inf:
        raise ScheduleError(f"no split of {n} layers into {n_stages} stages fits the memory limit")
    bounds = []
    j = n
    for k in range(n_stages - 1, -1, -1):
        i = cut[k][j] if k else 0
        bounds.append((i, j - 1))
        j = i
    return tuple(reversed(bounds))


def split_cost(layer_us: Sequence[float], split: Sequence[tuple[int, int]], *, first_us: float = 0.0,
               last_us: float = 0.0) -> float:
    """The largest stage cost of ``split`` (as :func:`balanced_split` counts it)."""
    prefix = [0.0]
    for c in layer_us:
        prefix.append(prefix[-1] + float(c))
    return max(_stage_cost(prefix, first_us, last_us, len(split), k, i, j + 1) for k, (i, j) in enumerate(split))


def brute_force_split(layer_us: Sequence[float], n_stages: int, *, first_us: float = 0.0,
                      last_us: float = 0.0) -> tuple[tuple[int, int], ...]:
    """Every split into contiguous stages tried: the one with the smallest largest stage (small
    inputs only: ``C(layers - 1, stages - 1)`` splits)."""
    n = len(layer_us)
    if n_stages > n:
        raise ScheduleError(f"{n_stages} pipeline stages but the model has {n} repeated layers")
    best: tuple[float, tuple[tuple[int, int], ...]] | None = None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0, *cuts, n)
        split = tuple((edges[k], edges[k + 1] - 1) for k in range(n_stages))
        cost = split_cost(layer_us, split, first_us=first_us, last_us=last_us)
        if best is None or cost < best[0]:
            best = (cost, split)
    assert best is not None
    return best[1]

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
  backward, then runs the backwards left.

:func:`simulate` runs the orders against per-stage forward and backward times and a transfer
time per stage boundary: an action starts when its rank is free and its input has arrived (the
previous stage's forward, or the next stage's backward, plus the transfer). A stage may also have
work once per step: ``setup_us`` at the step's start (gathering parameters it keeps for every
microbatch) and ``flush_us`` after its last backward (reducing the gradients it accumulated, where
``torch.distributed.pipelining`` runs its ``REDUCE_GRAD`` action, the backward's gradient already
sent on); both hold the rank. The timeline is exact for the orders and times given (no overlap of
a transfer with anything but other ranks' work).
With equal stages and no transfer time it gives the textbook figures: 1F1B takes
``(m + d - 1)·(f + b)``, the interleaved schedule ``m·(f + b) + (d - 1)·(f + b)/v`` (``f``, ``b``:
one microbatch's forward and backward through the whole model divided by ``d``).

:func:`balanced_split` cuts a sequence of layer costs into contiguous stages minimising the most
expensive stage (dynamic programming over cut points; :func:`brute_force_split` checks it).

This module is pure Python: no torch, no planner.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

Schedule = Literal["1f1b", "interleaved"]
#: The schedules, declared once (the option ``pp_schedule`` takes these).
SCHEDULES: tuple[str, ...] = get_args(Schedule)
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


@dataclass(frozen=True)
class Action:
    """One unit of work of a rank: ``kind`` "F" (forward) or "B" (backward) of ``stage`` on ``microbatch``."""

    kind: Literal["F", "B"]
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds: 1 for 1F1B, :data:`INTERLEAVED_STAGES_PER_RANK` interleaved."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return 1 if schedule == "1f1b" else INTERLEAVED_STAGES_PER_RANK


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


def orders(schedule: str, degree: int, microbatches: int) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (see the module docstring)."""
    check(schedule, degree, microbatches)
    m = microbatches
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


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found, in µs (``forward_us`` / ``backward_us`` are per stage and microbatch)."""

    step_us: float
    """the step: from the first forward to the last backward"""
    busy_us: tuple[float, ...]
    """per rank: time spent running actions"""
    bubble_us: float
    """the step less the busiest rank's work: time that rank waits"""
    in_flight: tuple[int, ...]
    """per stage: most microbatches whose forward ran and backward did not yet (activations held)"""
    held_bytes: tuple[float, ...] = ()
    """per rank: the most activation bytes its stages hold at once (given ``activation_bytes``)"""

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_us / self.step_us if self.step_us > 0 else 0.0


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
) -> Timeline:
    """The timeline of one step. ``forward_us[k]`` / ``backward_us[k]``: one microbatch through
    stage ``k``; ``transfer_us[k]``: moving one microbatch's activation from stage ``k`` to
    ``k + 1`` (and its gradient back), default 0; ``activation_bytes[k]``: what stage ``k`` keeps
    from a forward until its backward (per device), for :attr:`Timeline.held_bytes`;
    ``setup_us[k]`` / ``flush_us[k]``: stage ``k``'s work once per step, at the step's start and
    after its last backward (default 0)."""
    n_stages = degree * stages_per_rank(schedule)
    if len(forward_us) != n_stages or len(backward_us) != n_stages:
        raise ScheduleError(f"{schedule} on degree {degree} has {n_stages} stages; got times for "
                            f"{len(forward_us)} forward and {len(backward_us)} backward")
    transfer = list(transfer_us) or [0.0] * (n_stages - 1)
    if len(transfer) != n_stages - 1:
        raise ScheduleError(f"{n_stages} stages have {n_stages - 1} boundaries; got {len(transfer)} transfer times")
    act = list(activation_bytes) or [0.0] * n_stages
    setup = list(setup_us) or [0.0] * n_stages
    flush = list(flush_us) or [0.0] * n_stages
    if len(act) != n_stages or len(setup) != n_stages or len(flush) != n_stages:
        raise ScheduleError(f"{n_stages} stages: got {len(act)} activation sizes, {len(setup)} setup and "
                            f"{len(flush)} flush times")
    ranks = orders(schedule, degree, microbatches)
    held = [0.0] * degree
    most_held = [0.0] * degree
    done: dict[tuple[str, int, int], float] = {}
    # each rank gathers what its stages keep at the step's start, before its first action
    free = [sum(setup[k] for k in range(r, n_stages, degree)) for r in range(degree)]
    pos = [0] * degree
    busy = list(free)
    live = [0] * n_stages
    most = [0] * n_stages
    left = sum(len(r) for r in ranks)
    while left:
        progressed = False
        for r, acts in enumerate(ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind == "F":
                    dep = None if a.stage == 0 else ("F", a.stage - 1, a.microbatch)
                    wait = 0.0 if dep is None else transfer[a.stage - 1]
                    own = forward_us[a.stage]
                else:
                    dep = ("F", a.stage, a.microbatch) if a.stage == n_stages - 1 else ("B", a.stage + 1, a.microbatch)
                    wait = 0.0 if a.stage == n_stages - 1 else transfer[a.stage]
                    own = backward_us[a.stage]
                after = flush[a.stage] if a.kind == "B" and a.microbatch == microbatches - 1 else 0.0
                if dep is not None and dep not in done:
                    break
                start = max(free[r], 0.0 if dep is None else done[dep] + wait)
                done[(a.kind, a.stage, a.microbatch)] = start + own  # its gradient leaves before the reduction
                free[r] = start + own + after
                busy[r] += own + after
                live[a.stage] += 1 if a.kind == "F" else -1
                most[a.stage] = max(most[a.stage], live[a.stage])
                held[r] += act[a.stage] if a.kind == "F" else -act[a.stage]
                most_held[r] = max(most_held[r], held[r])
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(ranks) if pos[r] < len(acts)}
            raise ScheduleError(f"{schedule} schedule deadlocks (ranks waiting at {stuck})")
    step = max(free)
    return Timeline(step_us=step, busy_us=tuple(busy), bubble_us=step - max(busy), in_flight=tuple(most),
                    held_bytes=tuple(most_held))


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

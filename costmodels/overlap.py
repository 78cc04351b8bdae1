"""A step as its program runs it: the order collectives are issued and waited in, and its timeline.

A step program is a list of :class:`ProgramOp` in program order (a topological order: every op
after the ops it reads). Kinds:

* ``source``: a value that exists when the step starts (a parameter, a buffer, an input, a value
  the forward saved for the backward); ``static`` sources (parameters and what is computed from
  them alone) may be read ahead of time: the prologue that gathers a layer's weights.
* ``compute``: an op on the compute lane, ``duration_us`` long.
* ``view``: an op that moves no data (a view, a slice of a bucket): emitted where it is first read.
* ``issue``: a collective started on the communication lane of its process group (``lane``),
  ``duration_us`` long, holding ``nbytes`` of memory until its ``wait``.
* ``wait``: the compute lane waits until collective ``issue`` is done (``inputs == (issue,)``).

``weight``: 1 for a heavy op (a matmul, attention, a convolution), 0 otherwise: the order reads
the program's structure only, never its durations, so that every rank (whose local shapes may
differ) orders its program alike.

:func:`issue_order` puts a program in the order it runs with overlap: every collective issued as
soon as what it reads exists, waited just before its first reader, parameters' gathers prefetched
ahead of the compute that reads them, and at most ``inflight_limit_bytes`` of collectives in flight
(one collective larger than the limit runs alone). Without overlap every collective is waited right
after it is issued. The same function orders the native program's FX graphs
(:mod:`apmodel.lowering.native`) and the planner's priced program (:mod:`apmodel.result.step_timeline`), so
the price and the program agree on the order by construction.

:func:`simulate` times an order: one compute lane, one communication lane per process group, each
lane running its collectives in issue order; a wait stalls the compute lane until its collective
ends. ``overlap_slowdown``: the fraction of each hidden collective's time the compute lane still
pays (memory bandwidth and cores the communication takes from the computation: about 0 for NCCL
on GPUs, which have copy engines and spare SMs; CPU processes over gloo share their cores).

No torch: the ops are plain data. Times in µs, sizes in bytes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

OpKind = Literal["source", "compute", "view", "issue", "wait"]
KINDS: tuple[str, ...] = ("source", "compute", "view", "issue", "wait")


@dataclass(frozen=True)
class ProgramOp:
    """One op of a step program (see the module's docstring for the kinds)."""

    kind: OpKind
    inputs: tuple[int, ...] = ()
    duration_us: float = 0.0
    lane: Hashable = None
    nbytes: float = 0.0
    static: bool = False
    weight: float = 0.0
    label: str = ""


class ProgramError(ValueError):
    """A step program that is not one: an op reading a later op, a wait without its collective."""


def _check(ops: Sequence[ProgramOp]) -> None:
    for i, op in enumerate(ops):
        if op.kind not in KINDS:
            raise ProgramError(f"op {i} ({op.label or op.kind}): unknown kind {op.kind!r}")
        if any(not 0 <= j < i for j in op.inputs):
            raise ProgramError(f"op {i} ({op.label or op.kind}) reads ops {op.inputs}: a program reads only earlier ops")
        if op.kind == "wait" and (len(op.inputs) != 1 or ops[op.inputs[0]].kind != "issue"):
            raise ProgramError(f"op {i} ({op.label or 'wait'}) waits for {op.inputs}: a wait reads exactly one issue")


def serial_order(ops: Sequence[ProgramOp]) -> list[int]:
    """Program order with every collective waited right after it is issued (no overlap)."""
    _check(ops)
    waits: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind == "wait":
            waits.setdefault(op.inputs[0], []).append(i)
    order: list[int] = []
    for i, op in enumerate(ops):
        if op.kind == "wait":
            continue
        order.append(i)
        order.extend(waits.get(i, ()))
    return order


def _static_rooted(ops: Sequence[ProgramOp]) -> list[bool]:
    """Whether each op reads, transitively, only static sources (an op of no inputs counts)."""
    rooted = []
    for op in ops:
        if op.kind == "source":
            rooted.append(op.static)
        else:
            rooted.append(all(rooted[j] for j in op.inputs))
    return rooted


#: Collectives in flight at once on CPU processes over gloo: one. With several in flight (issued
#: early, waited late) gloo's two worker threads per process group run two collectives on one
#: context at once: 6 of 14 one-minute stress runs on 2 and 4 processes crashed (SIGSEGV,
#: "malloc(): unaligned tcache chunk detected", the other ranks then "Connection reset by peer";
#: torch 2.13 on the 2-core host), none of 14 with one in flight. One in flight still runs behind
#: the computation.
GLOO_MAX_INFLIGHT = 1


def issue_order(ops: Sequence[ProgramOp], inflight_limit_bytes: float, max_inflight: int | None = None) -> list[int]:
    """The order the program runs in with overlap (a permutation of ``range(len(ops))``).

    * Compute ops that read anything but static values keep their relative order: they are the
      step's slots.
    * Before each slot: collectives whose inputs exist are issued (in program order), and the
      prologue (ops reading static values only: casts and gathers of parameters) runs ahead, in
      program order, while the collectives in flight fit ``inflight_limit_bytes``. Where the limit
      or a chained collective (a gather over a second mesh axis reads the first's result) blocks
      them, the blocking collective is waited if a heavy op ran since it was issued (it has
      likely finished), else they stay blocked until a reader needs it.
    * Waits and views are emitted where they are first read (a wait forced earlier only to make
      room under the limit, oldest first).
    ``max_inflight``: at most this many collectives in flight at once (None: no count limit;
    :data:`GLOO_MAX_INFLIGHT` on gloo). Deterministic: every rank orders the same program alike,
    so collectives of one process group are issued in the same order everywhere."""
    _check(ops)
    return _IssueOrder(ops, inflight_limit_bytes, max_inflight).run()


class _IssueOrder:
    """The working state of :func:`issue_order`: the program's structure (read once) and the order
    emitted so far, with the collectives in flight."""

    def __init__(self, ops: Sequence[ProgramOp], inflight_limit_bytes: float, max_inflight: int | None) -> None:
        self.ops, self.inflight_limit_bytes, self.max_inflight = ops, inflight_limit_bytes, max_inflight
        n = self.n = len(ops)
        users: list[list[int]] = [[] for _ in range(n)]
        for i, op in enumerate(ops):
            for j in op.inputs:
                users[j].append(i)
        self.users = users
        wait_of: dict[int, int] = {}
        for i, op in enumerate(ops):
            if op.kind == "wait":
                wait_of.setdefault(op.inputs[0], i)
        self.wait_of = wait_of
        rooted = _static_rooted(ops)
        self.prologue = [i for i, op in enumerate(ops) if rooted[i] and op.kind != "source"]
        self.in_prologue = [False] * n
        for i in self.prologue:
            self.in_prologue[i] = True
        self.slots = [i for i, op in enumerate(ops) if op.kind == "compute" and not self.in_prologue[i]]

        # collectives whose result another collective reads (through views): a gradient reduced over
        # one mesh axis, then the next; their waits are taken as soon as they have settled, so the
        # next link starts without waiting for a reader at the end of the step
        feeds_collective = [False] * n
        for i in range(n - 1, -1, -1):
            feeds_collective[i] = any(ops[u].kind == "issue" or (ops[u].kind in ("view", "wait") and feeds_collective[u])
                                      for u in users[i])
        self.is_link = [i in wait_of and feeds_collective[wait_of[i]] for i in range(n)]
        # a view a collective reads is taken as soon as it can be, so the collective is not held back
        self.eager_view = [op.kind == "view" and any(ops[u].kind == "issue" or feeds_collective[u] for u in users[i])
                           for i, op in enumerate(ops)]

        self.emitted = [False] * n
        self.missing = [len(set(op.inputs)) for op in ops]
        self.order: list[int] = []
        self.inflight: OrderedDict[int, float] = OrderedDict()  # issue -> heavy ops emitted before it
        self.used = 0.0  # bytes in flight
        self.heavy = 0.0  # heavy ops emitted
        self.ready_issues: list[int] = []  # heap: collectives (and views they read) outside the prologue, inputs ready
        self.pointer = 0  # the next prologue op

    def run(self) -> list[int]:
        ops = self.ops
        for i, op in enumerate(ops):
            if op.kind == "source":
                self.emit(i)
        for s in self.slots:
            self.advance()
            self.demand(s)
        for i in range(self.n):  # what no slot read: the prologue's tail, collectives nobody waits for
            if not self.emitted[i]:
                self.demand(i)
        return self.order

    def emit(self, i: int) -> None:
        ops, inflight = self.ops, self.inflight
        self.order.append(i)
        self.emitted[i] = True
        op = ops[i]
        self.heavy += op.weight
        if op.kind == "issue":
            inflight[i] = self.heavy
            self.used += op.nbytes
        elif op.kind == "wait":
            c = op.inputs[0]
            if c in inflight:
                del inflight[c]
                self.used -= ops[c].nbytes
        missing = self.missing
        for u in set(self.users[i]):
            missing[u] -= 1
            if missing[u] == 0 and not self.in_prologue[u] and (ops[u].kind == "issue" or self.eager_view[u]):
                heapq.heappush(self.ready_issues, u)

    def fits(self, i: int) -> bool:
        if self.max_inflight is not None and len(self.inflight) >= self.max_inflight:
            return False
        return not self.inflight or self.used + self.ops[i].nbytes <= self.inflight_limit_bytes

    def demand(self, target: int) -> None:
        """Emit ``target`` and everything it reads (iteratively: graphs are deep)."""
        ops, emitted, inflight = self.ops, self.emitted, self.inflight
        stack = [target]
        while stack:
            i = stack[-1]
            if emitted[i]:
                stack.pop()
                continue
            todo = [j for j in ops[i].inputs if not emitted[j]]
            if todo:
                stack.extend(reversed(todo))
                continue
            if ops[i].kind == "issue" and not self.fits(i):  # make room: the oldest in flight is waited
                oldest = next(iter(inflight))
                if oldest in self.wait_of:
                    stack.append(self.wait_of[oldest])
                else:  # a collective nobody waits for stops counting
                    del inflight[oldest]
                    self.used -= ops[oldest].nbytes
                continue
            stack.pop()
            self.emit(i)

    def settled(self, c: int) -> bool:
        """A collective the program may wait for without stalling (by its structure, the same on
        every rank): at least one heavy op (``weight``) ran since it was issued."""
        return c in self.inflight and c in self.wait_of and self.heavy - self.inflight[c] >= 1

    def waits_behind(self, i: int) -> list[int]:
        """The collectives whose unemitted waits op ``i`` reads, directly or through views."""
        ops, emitted = self.ops, self.emitted
        found, stack, seen = [], [i], set()
        while stack:
            j = stack.pop()
            for k in ops[j].inputs:
                if emitted[k] or k in seen:
                    continue
                seen.add(k)
                if ops[k].kind == "wait":
                    found.append(ops[k].inputs[0])
                else:
                    stack.append(k)
        return found

    def advance(self) -> None:
        """Before a slot: issue what is ready, run the prologue ahead, wait for what has settled
        when that unblocks them."""
        while True:
            blockers: list[int] = []
            progressed = self._issue_ready(blockers)
            progressed = self._run_prologue(blockers) or progressed
            blockers.extend(c for c in self.inflight if self.is_link[c])
            for c in dict.fromkeys(blockers):
                if self.settled(c):
                    self.demand(self.wait_of[c])
                    progressed = True
            if not progressed:
                return

    def _issue_ready(self, blockers: list[int]) -> bool:
        """Issue the collectives whose inputs exist, in program order, while they fit (the oldest in
        flight joins ``blockers`` where one does not); whether any was."""
        ready_issues, emitted, progressed = self.ready_issues, self.emitted, False
        while ready_issues:
            i = ready_issues[0]
            if emitted[i]:
                heapq.heappop(ready_issues)
                continue
            if self.ops[i].kind == "issue" and not self.fits(i):
                blockers.append(next(iter(self.inflight)))
                break
            heapq.heappop(ready_issues)
            self.emit(i)
            progressed = True
        return progressed

    def _run_prologue(self, blockers: list[int]) -> bool:
        """Run the prologue ahead, in program order, until a chained collective or the limit blocks
        it (what blocks it joins ``blockers``); whether anything ran."""
        prologue, progressed = self.prologue, False
        while self.pointer < len(prologue):
            i = prologue[self.pointer]
            op = self.ops[i]
            if self.emitted[i] or op.kind == "wait":  # its waits are left for their readers
                self.pointer += 1
                continue
            behind = self.waits_behind(i)
            if behind:  # a chained collective: behind the wait of the one before it
                blockers.extend(behind)
                break
            if op.kind == "issue" and not self.fits(i):
                blockers.append(next(iter(self.inflight)))
                break
            self.emit(i)
            self.pointer += 1
            progressed = True
        return progressed


@dataclass
class Timeline:
    """A timed step (µs): ``step_us`` on the compute lane; ``compute_us`` and ``comm_us`` the sums
    of compute and collective durations; ``exposed_comm_us`` what the compute lane spent waiting
    (``step_us - compute_us``); ``hidden_comm_us`` the rest of ``comm_us``; ``peak_inflight_bytes``
    the most bytes of collectives in flight at once; ``spans``: per op ``(op index, lane, start,
    end)`` (lane ``"compute"`` for compute ops), for drawing."""

    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    hidden_comm_us: float
    peak_inflight_bytes: float
    end_us: dict[Hashable, float] = field(default_factory=dict)
    spans: list[tuple[int, Hashable, float, float]] = field(default_factory=list)


def simulate(ops: Sequence[ProgramOp], order: Sequence[int], *, overlap_slowdown: float = 0.0,
             start_us: float = 0.0, lanes_free_us: dict[Hashable, float] | None = None,
             keep_spans: bool = False) -> Timeline:
    """Time ``ops`` run in ``order`` (:func:`issue_order` or :func:`serial_order`).

    ``start_us`` and ``lanes_free_us``: where the compute lane and each communication lane stand
    when the program starts (a backward after its forward); the returned ``end_us`` holds them at
    the end (key ``"compute"`` for the compute lane)."""
    if sorted(order) != list(range(len(ops))):
        raise ProgramError("simulate: the order must list every op exactly once")
    position = {i: k for k, i in enumerate(order)}
    for i in order:
        if any(position[j] > position[i] for j in ops[i].inputs):
            raise ProgramError(f"simulate: op {i} ({ops[i].label or ops[i].kind}) runs before an op it reads")
    t = start_us
    lanes = dict(lanes_free_us or {})
    end: dict[int, float] = {}
    compute = comm = 0.0
    used = peak = 0.0
    spans: list[tuple[int, Hashable, float, float]] = []
    for i in order:
        op = ops[i]
        if op.kind in ("compute", "view"):
            if keep_spans and op.duration_us > 0:
                spans.append((i, "compute", t, t + op.duration_us))
            t += op.duration_us
            compute += op.duration_us
        elif op.kind == "issue":
            start = max(t, lanes.get(op.lane, start_us))
            end[i] = lanes[op.lane] = start + op.duration_us
            comm += op.duration_us
            used += op.nbytes
            peak = max(peak, used)
            if keep_spans:
                spans.append((i, op.lane, start, end[i]))
        elif op.kind == "wait":
            c = op.inputs[0]
            done = end[c]
            exposed = max(0.0, done - t)
            hidden = max(0.0, ops[c].duration_us - exposed)
            t = max(t, done) + overlap_slowdown * hidden
            used -= ops[c].nbytes
    step = t - start_us
    exposed_total = max(0.0, step - compute)
    return Timeline(step_us=step, compute_us=compute, comm_us=comm, exposed_comm_us=exposed_total,
                    hidden_comm_us=max(0.0, comm - exposed_total), peak_inflight_bytes=peak,
                    end_us={"compute": t, **lanes}, spans=spans)

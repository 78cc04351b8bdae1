"""TRW-S's two kernels (numpy, compiled) against each other and against brute force.

The compiled kernel's functions are plain Python until numba compiles them, so without numba the
same loops run interpreted (slow, on small problems only) and these tests still check them.
"""

from __future__ import annotations

import numpy as np
import pytest

import solvers
from solvers import trws, trws_compiled, trws_kernels

from test_solvers import TOL, brute_or_none, random_problem, with_budget

HAS_NUMBA = trws_compiled.available()


@pytest.fixture
def compiled(monkeypatch):
    """The compiled kernel: numba's when installed, else the same functions interpreted."""
    if not HAS_NUMBA:
        plain = trws_compiled.Kernels(trws_kernels.sweep, trws_kernels.edge_bound, trws_kernels.energy)
        monkeypatch.setattr(trws_compiled, "kernels", lambda: plain)
        monkeypatch.setattr(trws_compiled, "available", lambda: True)
    return "numba"


def _mixed_problem(seed: int, n: int = 40) -> solvers.PairwiseProblem:
    """Mixed state counts, +inf entries, compressible (layout) and incompressible edges, both orientations."""
    rng = np.random.default_rng(seed)
    ns = rng.integers(1, 9, size=n)
    unary = []
    for k in ns:
        u = rng.normal(size=k)
        u[rng.random(k) < 0.1] = np.inf
        u[0] = abs(u[0]) if np.isfinite(u[0]) else 1.0  # every variable keeps a finite state
        unary.append(u)
    edges = []
    for v in range(1, n):
        for u in rng.choice(v, size=min(v, 2), replace=False):
            a, b = ns[u], ns[v]
            if rng.random() < 0.5:  # layout-structured: repeated rows and columns
                t = rng.uniform(0, 2, size=(3, 3))
                m = t[np.arange(a)[:, None] % 3, np.arange(b)[None, :] % 3]
            else:
                m = rng.normal(scale=1.5, size=(a, b))
            m[rng.random(m.shape) < 0.05] = np.inf
            edges.append((int(u), v, m) if rng.random() < 0.5 else (v, int(u), m.T))
    return solvers.PairwiseProblem(unary, edges)


def _run(tr: trws.TRWS, sweeps: int, switch_after: int | None = None):
    x = np.zeros(tr.p.n_vars, dtype=np.int64)
    history = []
    for it in range(sweeps):
        if switch_after is not None and it == switch_after:
            tr.t0 -= trws.COMPILED_AFTER_S  # as if the numpy sweeps had taken that long
            tr.maybe_compile()
            assert tr.edges is not None
        tr.sweep(True, x)
        history.append((x.copy(), tr.internal_energy(x), tr.lower_bound()))
        tr.sweep(False)
    return history, tr.msum_lo.copy(), tr.msum_hi.copy()


def _assert_sweeps_alike(got: trws.TRWS, ref: trws.TRWS, sweeps: int, tol: float) -> None:
    """``got`` sweeps as ``ref`` does: the same decoded assignments and energies, and messages and
    bounds within ``tol`` (relative and absolute)."""
    h_ref, lo_ref, hi_ref = _run(ref, sweeps)
    h_got, lo_got, hi_got = _run(got, sweeps)
    np.testing.assert_allclose(lo_got, lo_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(hi_got, hi_ref, rtol=tol, atol=tol)
    for (x1, e1, b1), (x2, e2, b2) in zip(h_ref, h_got, strict=False):
        np.testing.assert_array_equal(x1, x2)
        assert e2 == pytest.approx(e1, rel=1e-12) and b2 == pytest.approx(b1, rel=tol, abs=tol)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_sweeps_equal_numpy(compiled, monkeypatch, seed, unified):
    """Every sweep's messages, decoded assignment, energy and bound are the numpy kernel's (the order
    inside a level does not matter; only float summation order may differ)."""
    if not unified:  # the numpy kernel's per-shape groups instead of its one padded block (mostly)
        monkeypatch.setattr(trws, "UNIFIED_ALL_ENTRIES", 0)
        monkeypatch.setattr(trws, "UNIFIED_MAX_CLASSES", 1)
        monkeypatch.setattr(trws, "UNIFIED_SMALL", 1)
    p = _mixed_problem(seed)
    ref = trws.TRWS(p, kernel="numpy")
    assert (len(ref.fwd) > 0) != unified  # per-shape groups (beside edges of single-state variables) or none
    got = trws.TRWS(p, kernel=compiled)
    assert got.edges is not None
    _assert_sweeps_alike(got, ref, 8, tol=1e-9)


@pytest.mark.parametrize("unified", [True, False])
def test_auto_switch_carries_every_message_over(compiled, monkeypatch, unified):
    """Switching to the compiled kernel mid-run continues exactly where the numpy kernel was."""
    if not unified:
        monkeypatch.setattr(trws, "UNIFIED_ALL_ENTRIES", 0)
        monkeypatch.setattr(trws, "UNIFIED_MAX_CLASSES", 1)
        monkeypatch.setattr(trws, "UNIFIED_SMALL", 1)
    monkeypatch.setattr(trws_compiled, "warm", lambda: False)  # a warm process would start compiled
    p = _mixed_problem(11)
    h_ref, lo_ref, hi_ref = _run(trws.TRWS(p, kernel="numpy"), 8)
    auto = trws.TRWS(p, kernel="auto")
    assert auto.edges is None  # starts on numpy
    h_got, lo_got, hi_got = _run(auto, 8, switch_after=3)
    np.testing.assert_allclose(lo_got, lo_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(hi_got, hi_ref, rtol=1e-9, atol=1e-9)
    assert [e for _, e, _ in h_got] == pytest.approx([e for _, e, _ in h_ref], rel=1e-12)
    monkeypatch.undo()
    if HAS_NUMBA:  # once the process has run the compiled sweeps, "auto" starts with them
        assert trws_compiled.warm() and trws.TRWS(p, kernel="auto").edges is not None


@pytest.mark.parametrize("layouts", [0, 2])
def test_compiled_kernel_against_brute_force(compiled, layouts):
    for seed in range(60):
        p = random_problem(seed, max_states=6 if layouts else 4, layouts=layouts)
        ref = brute_or_none(p)
        try:
            got = solvers.solve(p, "trws", kernel=compiled, reduce=seed % 2 == 0)
        except solvers.Infeasible as err:
            assert ref is None or not err.proven, seed
            continue
        assert ref is not None, seed
        assert got.energy >= ref.energy - TOL and got.lower_bound <= ref.energy + TOL, seed


@pytest.mark.parametrize("graph", ["chain", "tree"])
def test_compiled_kernel_exact_on_chains_and_trees(compiled, graph):
    for seed in range(40):
        p = random_problem(seed, graph=graph, max_vars=9)
        ref = brute_or_none(p)
        if ref is None:
            continue
        got = solvers.solve(p, "trws", kernel=compiled, local_search=False, reduce=False)
        assert got.energy == pytest.approx(ref.energy, abs=TOL), seed
        assert got.lower_bound == pytest.approx(ref.energy, abs=1e-5), seed


def test_compiled_kernel_with_a_budget_row(compiled):
    """The Lagrangian changes the unary between runs; the compiled sweeps read the current one."""
    for seed in range(20):
        p = with_budget(random_problem(seed, max_vars=7), seed)
        ref = brute_or_none(p)
        try:
            got = solvers.solve(p, "trws", kernel=compiled)
        except solvers.Infeasible:
            continue
        assert ref is not None and not p.violated_constraints(got.assignment), seed
        assert got.energy >= ref.energy - TOL and got.lower_bound <= ref.energy + TOL, seed


def test_kernel_option_errors(monkeypatch):
    p = random_problem(0)
    with pytest.raises(ValueError, match=r"trws kernel must be one of \('auto', 'numba', 'numpy'\), got 'cuda'"):
        solvers.solve(p, "trws", kernel="cuda", reduce=False)
    monkeypatch.setattr(trws_compiled, "available", lambda: False)
    with pytest.raises(ValueError, match="trws kernel 'numba' needs the numba package"):
        solvers.solve(p, "trws", kernel="numba", reduce=False)
    # "auto" without numba never switches
    tr = trws.TRWS(_mixed_problem(1), kernel="auto")
    tr.t0 -= 10 * trws.COMPILED_AFTER_S
    tr.maybe_compile()
    assert tr.edges is None and tr.ufwd is not None


def test_background_warm_up_leaves_the_compiled_kernels_warm():
    """The planner starts it before tracing: afterwards a TRW-S solve starts compiled, and the
    warm-up is started once per process (without numba there is nothing to load: None)."""
    thread = trws.warm_up_in_background()
    if not HAS_NUMBA:
        assert thread is None
        return
    assert thread is trws.warm_up_in_background()  # once
    thread.join(timeout=120)
    assert not thread.is_alive() and trws_compiled.warm()
    assert trws.TRWS(_mixed_problem(3), kernel="auto").edges is not None


def test_bound_reads_the_exact_sums_of_the_messages(compiled):
    """The sweeps keep each state's message sum by adding changes; a message that once carried a forbidden
    state's stand-in cost (``big``) leaves rounding behind. The bound must use the sums of the messages
    as they are (otherwise it is not a bound for any messages), so it recomputes them."""
    p = _mixed_problem(5, n=60)
    x = np.zeros(p.n_vars, dtype=np.int64)
    # messages first carry forbidden costs (a third of the states forbidden), then lose them (the unary
    # changes under them, as the budget row's multiplier changes it)
    some_forbidden = np.where(np.random.default_rng(0).random(p.n_indicators) < 0.3, np.inf, p.unary_flat)

    def run(tr):
        tr.set_unary(some_forbidden)
        for _ in range(5):
            tr.sweep(True, x)
            tr.sweep(False)
        carried = max(float(np.abs(tr.msum_lo).max()), float(np.abs(tr.msum_hi).max()))
        tr.set_unary(p.unary_flat)
        for _ in range(20):
            tr.sweep(True, x)
            tr.sweep(False)
        tr.lower_bound()
        return carried

    tr = trws.TRWS(p, kernel=compiled)
    e = tr.edges
    assert run(tr) > 1e-3 * tr.big  # some message carried a forbidden cost
    lo, hi = np.zeros(p.n_indicators), np.zeros(p.n_indicators)
    for k in range(len(e.eu)):
        u, v = e.eu[k], e.ev[k]
        lo[p.offsets[v] : p.offsets[v + 1]] += e.msg_f[e.vptr[k] : e.vptr[k + 1]]
        hi[p.offsets[u] : p.offsets[u + 1]] += e.msg_b[e.uptr[k] : e.uptr[k + 1]]
    np.testing.assert_allclose(tr.msum_lo, lo, rtol=1e-13, atol=1e-9)
    np.testing.assert_allclose(tr.msum_hi, hi, rtol=1e-13, atol=1e-9)
    numpy_kernel = trws.TRWS(p, kernel="numpy")
    run(numpy_kernel)
    np.testing.assert_allclose(numpy_kernel.msum_lo, tr.msum_lo, rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_forward_constants_are_the_bound_after_a_forward_sweep(compiled, seed):
    """Right after a forward sweep each edge's part of the bound is its message's normalising constant,
    which the sweep records: the cheap bound TRW-S stops on equals the full one."""
    p = _mixed_problem(seed)
    tr = trws.TRWS(p, kernel=compiled)
    x = np.zeros(p.n_vars, dtype=np.int64)
    for _ in range(6):
        tr.sweep(True, x)
        fast, full = tr.lower_bound(after_forward=True), tr.lower_bound()
        assert fast == pytest.approx(full, rel=1e-9, abs=1e-6)
        tr.sweep(False)


def test_edges_given_the_same_corner_share_one_copy(compiled):
    """Factored edges with equal corners (made of the same block and classes, or of equal copies)
    are stored once by the compiled kernel, and sweep exactly as the same problem given dense (each
    edge its own matrix) does."""
    rng = np.random.default_rng(5)
    n, k = 8, 5
    unary = [rng.normal(size=k) for _ in range(n)]
    blocks = rng.uniform(0, 3, size=(3, 4, 4))
    blocks[0, 1, 2] = np.inf
    blocks[2] = blocks[0]  # equal to block 0, not the same block
    shared_rows, shared_cols = rng.integers(0, 4, k), rng.integers(0, 4, k)
    other_rows, other_cols = rng.integers(0, 4, k), rng.integers(0, 4, k)
    u, v = [0, 1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 7]
    block_of = [0, 0, 0, 0, 1, 1, 0, 2]
    rows = np.array([shared_rows] * 4 + [other_rows] * 2 + [other_rows, shared_rows])
    cols = np.array([shared_cols] * 4 + [other_cols] * 2 + [other_cols, shared_cols])
    factored = solvers.PairwiseProblem(unary, [solvers.FactoredStack(u, v, rows, cols, blocks, block_of)])
    dense = solvers.PairwiseProblem(unary, list(factored.edges))
    got, ref = trws.TRWS(factored, kernel=compiled), trws.TRWS(dense, kernel=compiled)
    corners = {(b % 2, r.tobytes(), c.tobytes()): len(np.unique(r)) * len(np.unique(c))
               for b, r, c in zip(block_of, rows, cols, strict=False)}  # blocks 0 and 2 are equal
    assert len(corners) == 3 and len(got.edges.blk) == len(got.edges.blk_t) == sum(corners.values())
    assert len(set(got.edges.bptr[:-1].tolist())) == 3
    _assert_sweeps_alike(got, ref, 6, tol=1e-12)
    best = brute_or_none(dense)
    sol = solvers.solve(factored, "trws", kernel=compiled, reduce=False)
    assert best is not None and sol.energy >= best.energy - TOL and sol.lower_bound <= best.energy + TOL


def _threaded(tr: trws.TRWS, threads: int) -> trws.TRWS:
    """``tr`` with every level of both sweeps dealt to ``threads`` threads in items of a few entries."""
    e = tr.edges
    e.plan_f = trws_compiled.sweep_plan(e.level_ptr_f, e.order_f, e.mu, e.mv, threads, min_entries=0, item_entries=6)
    e.plan_b = trws_compiled.sweep_plan(e.level_ptr_b, e.order_b, e.mv, e.mu, threads, min_entries=0, item_entries=6)
    return tr


def _sweep_state(tr: trws.TRWS, sweeps: int) -> list[np.ndarray]:
    x = np.zeros(tr.p.n_vars, dtype=np.int64)
    seen = []
    for _ in range(sweeps):
        tr.sweep(True, x)
        seen += [x.copy(), tr.edges.lows.copy()]
        tr.sweep(False)
    return seen + [tr.edges.msg_f, tr.edges.msg_b, tr.msum_lo, tr.msum_hi]


@pytest.mark.parametrize("threads", [2, 3])
def test_sweep_plan_deals_every_row_once(threads):
    """Each row of each edge's product in a threaded level is one item's, on one thread; the threads'
    loads are within the longest-processing-time bound (the mean plus the largest item)."""
    rng = np.random.default_rng(threads)
    n_edges = 40
    level = rng.integers(0, 6, n_edges)
    order = np.argsort(level, kind="stable")
    level_ptr = np.searchsorted(level[order], np.arange(7))
    src, dst = rng.integers(1, 30, n_edges), rng.integers(1, 30, n_edges)
    plan = trws_compiled.sweep_plan(level_ptr, order, src, dst, threads, min_entries=500, item_entries=40)
    entries = [int((src * dst)[order[level_ptr[L]:level_ptr[L + 1]]].sum()) for L in range(6)]
    assert plan.threaded.tolist() == [w >= 500 for w in entries] and plan.any_threaded
    for L in range(6):
        at = L * threads
        if not plan.threaded[L]:  # no items: one thread runs the level's edges in order
            assert plan.item_ptr[at + threads] == plan.item_ptr[at]
            continue
        covered = {int(e): np.zeros(dst[e], dtype=int) for e in order[level_ptr[L]:level_ptr[L + 1]]}
        loads = []
        for t in range(threads):
            items = range(plan.item_ptr[at + t], plan.item_ptr[at + t + 1])
            loads.append(sum((plan.item_d1[i] - plan.item_d0[i]) * src[plan.item_e[i]] for i in items))
            for i in items:
                covered[int(plan.item_e[i])][plan.item_d0[i]:plan.item_d1[i]] += 1
        assert all((c == 1).all() for c in covered.values()), L
        largest = max((plan.item_d1[i] - plan.item_d0[i]) * src[plan.item_e[i]]
                      for i in range(plan.item_ptr[at], plan.item_ptr[at + threads]))
        assert max(loads) <= entries[L] / threads + largest
    threaded_edges = sum(int(level_ptr[L + 1] - level_ptr[L]) for L in range(6) if plan.threaded[L])
    assert len(plan.item_e) > threaded_edges  # large products were cut into several items


@pytest.mark.parametrize("seed", range(3))
def test_threaded_sweeps_equal_one_thread_bit_for_bit(compiled, seed):
    """Products dealt to threads in small items (rows of one edge split over threads) leave every
    message, normalising constant and decoded assignment exactly as one thread makes them."""
    p = _mixed_problem(seed, n=60)
    one = trws.TRWS(p, kernel=compiled)
    many = _threaded(trws.TRWS(p, kernel=compiled), 3)
    assert many.edges.plan_f.threaded.all() and len(many.edges.plan_f.item_e) > len(many.edges.eu)
    for got, ref in zip(_sweep_state(many, 6), _sweep_state(one, 6), strict=False):
        np.testing.assert_array_equal(got, ref)


def _sweep_in_child(seed: int, queue) -> None:
    tr = _threaded(trws.TRWS(_mixed_problem(seed, n=60), kernel="numba"), 2)
    queue.put([a.tolist() for a in _sweep_state(tr, 3)])


@pytest.mark.skipif(not HAS_NUMBA or not hasattr(__import__("os"), "fork"), reason="needs numba and fork")
def test_threaded_sweeps_after_fork_and_from_two_threads():
    """A child forked after the parent used the threads sweeps on one thread (GNU OpenMP's pool would
    abort it) with the same result; two Python threads sweeping at once take turns (numba's workqueue
    pool aborts on concurrent launches)."""
    import multiprocessing
    import threading

    p = _mixed_problem(4, n=60)
    ref = [a.tolist() for a in _sweep_state(trws.TRWS(p, kernel="numba"), 3)]
    assert [a.tolist() for a in _sweep_state(_threaded(trws.TRWS(p, kernel="numba"), 2), 3)] == ref
    assert trws_compiled.kernels().gate.owner_pid == __import__("os").getpid()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_sweep_in_child, args=(4, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == ref
    results: list = [None, None]

    def sweep_into(k: int) -> None:
        results[k] = [a.tolist() for a in _sweep_state(_threaded(trws.TRWS(p, kernel="numba"), 2), 3)]

    workers = [threading.Thread(target=sweep_into, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert results == [ref, ref]

"""costmodels.collective_timing: collectives timed on a live gloo group come back as nccl-tests logs
the calibration reads unchanged (the same numbers on every rank, nccl-tests' bandwidth columns)."""

from __future__ import annotations

import pytest

import costmodels
from costmodels.calibration import format_nccl_tests, parse_nccl_tests
from costmodels.collectives import bus_bandwidth_factor

from _dist_utils import run_distributed

SIZES = (1024, 64 * 1024)


def _timing_worker(rank: int, world: int) -> list:
    from costmodels.collective_timing import time_collectives

    logs = time_collectives(sizes_bytes=SIZES, warmup=1, iters=3)
    return [(log.kind, log.ranks, [(r.size_bytes, r.oop_time_us, r.oop_algbw_GBps, r.oop_busbw_GBps) for r in log.rows])
            for log in logs]


@pytest.mark.slow
def test_timed_collectives_are_logs_the_calibration_fits() -> None:
    per_rank = run_distributed(_timing_worker, 2)
    assert per_rank[0] == per_rank[1]  # the slowest rank's time, agreed by all
    kinds = [k for k, _, _ in per_rank[0]]
    assert kinds == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    logs = []
    for kind, ranks, rows in per_rank[0]:
        assert ranks == 2 and [r[0] for r in rows] == list(SIZES)
        for size, t_us, algbw, busbw in rows:
            assert t_us > 0
            assert algbw == pytest.approx(size / (t_us * 1e3))
            assert busbw == pytest.approx(algbw * bus_bandwidth_factor(kind, 2))
        # written in nccl-tests' format and read back: the same times (what `apmodel calibrate` reads)
        text = format_nccl_tests(kind, 2, [(size, t) for size, t, _, _ in rows])
        log = parse_nccl_tests(text)
        assert [r.oop_time_us for r in log.rows] == pytest.approx([t for _, t, _, _ in rows], rel=1e-3)
        logs.append((log, 0))
    base = costmodels.NCCLCollectives(costmodels.Topology((2,), costmodels.device("cpu")))
    cal = costmodels.Calibration.fit(base, logs)
    for kind, _, rows in per_rank[0]:
        for size, t_us, _, _ in rows:  # the calibrated model reproduces every timed point
            assert cal.factor(kind, 0, size) * base.time_us(kind, size, 0) == pytest.approx(t_us, rel=1e-3)


def test_unknown_kind_is_named() -> None:
    from costmodels.collective_timing import time_collectives

    with pytest.raises(ValueError, match="broadcast"):
        time_collectives(kinds=("broadcast",))


#: The extra compute one rank runs before each timed call in the skew test, µs.
INJECTED_SKEW_US = 20_000.0


def _skewed_worker(rank: int, world: int) -> list[float]:
    import time

    from costmodels import collective_timing

    def work_of_rank(busy_us, group, device, sync):  # rank 1 arrives INJECTED_SKEW_US after rank 0
        return lambda: time.sleep(INJECTED_SKEW_US / 1e6) if rank == 1 else None

    back_to_back = collective_timing.time_collectives(kinds=("all_reduce",), sizes_bytes=(1024,), warmup=1, iters=5)
    collective_timing._fixed_work = work_of_rank
    after_work = collective_timing.time_collectives(kinds=("all_reduce",), sizes_bytes=(1024,), warmup=1, iters=5,
                                                    busy_us=1.0)
    return [back_to_back[0].rows[0].oop_time_us, after_work[0].rows[0].oop_time_us]


@pytest.mark.slow
def test_collectives_timed_after_compute_include_the_wait_for_the_last_rank() -> None:
    # rank 0 waits the injected skew for rank 1 at every call, rank 1 not at all: the average
    # rank's stall is the collective plus half the skew (the number a step pays per collective)
    per_rank = run_distributed(_skewed_worker, 2)
    assert per_rank[0] == per_rank[1]
    alone_us, after_us = per_rank[0]
    assert INJECTED_SKEW_US / 2 <= after_us <= INJECTED_SKEW_US / 2 + alone_us + 5_000.0


def test_fixed_work_is_refused_below_zero() -> None:
    from costmodels.collective_timing import time_collectives

    with pytest.raises(ValueError, match="busy_us=-1"):
        time_collectives(busy_us=-1.0)

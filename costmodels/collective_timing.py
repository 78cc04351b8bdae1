"""Time collectives on a live process group, the way nccl-tests does, to calibrate the collective
model to the machine a mesh runs on (gloo over a CPU host's loopback, or NCCL where nccl-tests is
not installed).

:func:`time_collectives` runs each collective kind at each message size on every rank of a
``torch.distributed`` group and returns one :class:`~costmodels.calibration.NcclTestsLog` per kind,
as :func:`~costmodels.calibration.parse_nccl_tests` would read it from nccl-tests' output, so
:meth:`Calibration.fit <costmodels.calibration.Calibration.fit>` takes it unchanged. Sizes follow
nccl-tests: an all-reduce's size is its buffer, an all-gather's its gathered output, a
reduce-scatter's its full input, an all-to-all's the buffer each rank sends (on a CPU group timed
as DTensor runs it there: an all-gather of every rank's buffer, gloo having no all-to-all). A
size's time is the median of ``iters`` back-to-back calls after ``warmup`` calls (each call waited
for), the largest over the ranks (the slowest rank is the collective's time), the same on every
rank; a kind's times are then made non-decreasing in size (isotonic regression), as a
collective's time is.

``busy_us`` > 0 times each call as a training step meets it: every rank first computes the same
fixed work (matmuls sized to take about ``busy_us`` on the slowest rank), then calls the
collective; a rank's time runs from the end of its own work to the end of the collective, and a
size's time is the mean over the ranks of their medians. That mean is the collective plus the
wait for the last rank to arrive (the ranks' compute differs from run to run: a shared host's
scheduler, the memory bus, caches), which back-to-back calls never see and a step pays at every
collective on its critical path.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import isotonic_regression

from .calibration import NcclTestsLog, NcclTestsRow
from .collectives import bus_bandwidth_factor

#: Kinds :func:`time_collectives` can run (those a plan's redistributions issue).
TIMED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: Default message sizes, bytes: 1 KiB to 16 MiB in factors of 4 (the latency-bound sizes and the
#: per-layer gathers of small and mid-size models).
DEFAULT_SIZES_BYTES = tuple(2**10 * 4**i for i in range(8))
#: Side of the fp32 square matmul repeated as the compute before each call when ``busy_us`` > 0:
#: 256 (~0.3 ms on one CPU core, a few µs on a GPU) keeps the work's granularity well under a
#: step's gap between two collectives.
BUSY_MATMUL_SIDE = 256


def _call(kind: str, group: Any, size_bytes: int, itemsize: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A function running one ``kind`` collective of nccl-tests' ``size_bytes`` on ``group``."""
    n = dist.get_world_size(group)
    elems = max(size_bytes // itemsize // n * n, n)
    if kind == "all_reduce":
        buf = torch.ones(elems, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out = torch.empty(elems, dtype=dtype, device=device)
        shard = torch.ones(elems // n, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(out, shard, group=group)
    if kind == "reduce_scatter":
        full = torch.ones(elems, dtype=dtype, device=device)
        shard = torch.empty(elems // n, dtype=dtype, device=device)
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if kind == "all_to_all" and device.type == "cpu":
        # as DTensor runs a CPU mesh's all-to-all (gloo has none): every rank gathers the whole
        # buffer of every rank and keeps its chunk (torch.distributed.tensor._collective_utils)
        gathered = torch.empty(elems * n, dtype=dtype, device=device)
        mine = torch.ones(elems, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(gathered, mine, group=group)
    if kind == "all_to_all":
        send = torch.ones(elems, dtype=dtype, device=device)
        received = torch.empty(elems, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(received, send, group=group)
    raise ValueError(f"time_collectives: kind {kind!r} is not one of {TIMED_KINDS}")


def _non_decreasing_in_size(times_us: np.ndarray, sizes_bytes: Sequence[int]) -> np.ndarray:
    """The closest times (least squares) that do not fall as the size grows (isotonic
    regression): a larger message never takes less time, but medians on a busy host do (a 64 KiB
    all-reduce timed slower than a 1 MiB one), and a planner would buy the noise."""
    order = np.argsort(np.asarray(sizes_bytes), kind="stable")
    fitted = np.empty_like(times_us)
    fitted[order] = isotonic_regression(times_us[order]).x
    return fitted


def _fixed_work(busy_us: float, group: Any, device: torch.device,
                sync: Callable[[], None]) -> Callable[[], None]:
    """The same matmul work on every rank of ``group``, about ``busy_us`` long on its slowest rank."""
    a = torch.randn(BUSY_MATMUL_SIDE, BUSY_MATMUL_SIDE, device=device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a @ a
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    count = torch.tensor([max(1, round(busy_us / statistics.median(times)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)  # the slowest rank's count: busy_us there
    repeats = int(count.item())

    def work() -> None:
        for _ in range(repeats):
            a @ a
        sync()
    return work


def time_collectives(group: Any = None, kinds: Sequence[str] = TIMED_KINDS,
                     sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, *, warmup: int = 3, iters: int = 10,
                     dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                     busy_us: float = 0.0) -> list[NcclTestsLog]:
    """Measure ``kinds`` at ``sizes_bytes`` on ``group`` (default: the world); call on every rank.

    ``device``: where the buffers live (default: the current CUDA device for NCCL, else the CPU).
    ``busy_us``: each call after that much compute on every rank (see the module's docstring); 0:
    back to back. Returns one log per kind, rows in ``sizes_bytes`` order, times in µs, identical on
    every rank.
    """
    for kind in kinds:
        if kind not in TIMED_KINDS:
            raise ValueError(f"time_collectives: kind {kind!r} is not one of {TIMED_KINDS}")
    if warmup < 0 or iters < 1 or not busy_us >= 0:
        raise ValueError(f"time_collectives: warmup={warmup} must be >= 0, iters={iters} >= 1 and "
                         f"busy_us={busy_us} >= 0")
    if device is None:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    itemsize = torch.empty((), dtype=dtype).element_size()
    ranks = dist.get_world_size(group)
    work = _fixed_work(busy_us, group, device, sync) if busy_us > 0 else (lambda: None)
    medians_us: list[float] = []
    for kind in kinds:
        for size in sizes_bytes:
            run = _call(kind, group, int(size), itemsize, dtype, device)
            for _ in range(warmup):
                work()
                run()
            sync()
            times = []
            for _ in range(iters):
                work()
                start = time.perf_counter()
                run()
                sync()
                times.append((time.perf_counter() - start) * 1e6)
            medians_us.append(statistics.median(times))
    combined = torch.tensor(medians_us, dtype=torch.float64, device=device)
    if busy_us > 0:  # the stall of the average rank: the collective and the wait for the last to arrive
        dist.all_reduce(combined, op=dist.ReduceOp.SUM, group=group)
        combined /= ranks
    else:  # back to back, the ranks arrive together: the slowest rank's time is the collective's
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
    per_kind = np.asarray(combined.tolist()).reshape(len(kinds), len(sizes_bytes))
    logs = []
    for kind, times_us in zip(kinds, per_kind, strict=True):
        times_us = _non_decreasing_in_size(times_us, sizes_bytes)
        rows = []
        for line, (size, t) in enumerate(zip(sizes_bytes, times_us, strict=True)):
            t = float(t)
            algbw = size / (t * 1e3)
            busbw = algbw * bus_bandwidth_factor(kind, ranks)
            rows.append(NcclTestsRow(size_bytes=int(size), count=int(size) // itemsize, dtype=str(dtype).replace("torch.", ""),
                                     redop="sum" if kind in ("all_reduce", "reduce_scatter") else "none", root=-1,
                                     oop_time_us=t, oop_algbw_GBps=algbw, oop_busbw_GBps=busbw,
                                     ip_time_us=t, ip_algbw_GBps=algbw, ip_busbw_GBps=busbw, line=line + 1))
        busy = f", after {busy_us:g} µs of compute" if busy_us > 0 else ""
        logs.append(NcclTestsLog(kind=kind, ranks=ranks, rows=rows,
                                 source=f"time_collectives({kind}, {dist.get_backend(group)}, {ranks} ranks{busy})"))
    return logs

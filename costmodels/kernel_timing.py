"""Time kernels on the local device: the kernel set a compute profile is fitted to, and the timer.

A kernel set is a list of rows in the format of ``profiles/h200_kernels.json`` (``op``, ``shapes``,
``dtype``; see :func:`costmodels.measurements.row_calls`): a matmul grid with misaligned dimensions,
memory-bound ops of several sizes (elementwise, transcendental, dtype conversion, reductions,
norms, softmax and log-softmax), embedding forward and backward, fused attention where the device
has it, and the smallest sizes, which measure the launch floor. On a GPU it is the H200 file's
rows (the quick set: those that move at most :data:`CUDA_QUICK_MAX_BYTES` and do at most
:data:`CUDA_QUICK_MAX_FLOPS`); on a CPU a smaller set of the same kinds, in fp32 (CPU training's
dtype) with a few bf16 matmuls and conversions.

Every row is run as the ATen calls :func:`~costmodels.measurements.row_calls` prices, on real tensors
(:func:`materialize`), so what is timed is exactly what is predicted. The method
(:data:`METHOD`, :func:`time_interleaved`): a few passes over the whole set, in each a warm-up per
kernel, then repeats of back-to-back calls and their median time per call; a kernel's time is
the smallest of its per-pass medians (load from other processes only adds time). Timed with
``torch.cuda.Event`` on CUDA and ``time.perf_counter_ns`` on a CPU (garbage collection paused,
host allocator warmed; with one thread, repeats during which the thread was descheduled are
discarded, see :data:`UNDISTURBED_CPU_SHARE`). On CUDA the small elementwise rows
are also replayed from a CUDA graph (``meas_graph_us``).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from . import measurements as mr
from .compute import op_name, tensors_in
from .hardware import DeviceSpec
from .hardware import device as _device

logger = logging.getLogger(__name__)

#: Timing of a kernel set: this many passes over all its kernels, interleaved; a kernel's time
#: is the smallest of its per-pass medians, so that a burst of load from another process (which
#: only ever adds time) must last through every pass of a kernel to bias it...
PASSES = 3
#: ... in each pass, per kernel, a warm-up of at least this many seconds and calls...
WARMUP_S = 0.01
WARMUP_MIN_CALLS = 3
#: ... then this many repeats of back-to-back calls, each about this long (at least one call),
#: of which the pass keeps the median.
REPEATS = 5
REPEAT_S = 0.005
#: The same for ``quick`` (tests): shorter.
QUICK_WARMUP_S = 0.002
QUICK_REPEATS = 3
QUICK_REPEAT_S = 0.0015
#: Most calls in one repeat (tiny kernels would otherwise need millions).
MAX_CALLS_PER_REPEAT = 20_000
#: On a CPU with one intra-op thread (the kernel runs on the calling thread): a repeat whose
#: thread CPU time is below this share of its wall time was descheduled for another process, and
#: is discarded and run again, up to MAX_ATTEMPTS x REPEATS times. A kernel with no undisturbed
#: repeat (longer than a scheduler slice on a loaded machine) takes its repeats' thread CPU time.
UNDISTURBED_CPU_SHARE = 0.9
MAX_ATTEMPTS = 4
#: Calls captured in one CUDA graph for ``meas_graph_us`` (as in the H200 file: "captured 20x").
GRAPH_CALLS = 20
#: Elementwise row ops replayed from a CUDA graph, up to this many elements (the H200 file's
#: graph rows: add, mul_scalar, copy_ up to 2**24 elements).
GRAPH_OPS = frozenset({"add", "mul_scalar", "copy_"})
GRAPH_MAX_ELEMENTS = 2**24
#: The GPU quick set: H200 rows that move at most 256 MiB and do at most 2e11 FLOPs.
CUDA_QUICK_MAX_BYTES = 256 * 2**20
CUDA_QUICK_MAX_FLOPS = 2e11
#: Largest share of the GPU's free memory a row's tensors may take (larger rows are skipped).
CUDA_MEMORY_SHARE = 0.5
#: Host block allocated and freed once before CPU timings (bytes). glibc serves blocks above its
#: mmap threshold with fresh pages (a page fault per 4 KiB on every call); freeing an mmapped block
#: raises the threshold to that block's size, up to 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX,
#: glibc malloc/malloc.c). A training loop reaches that state after its first step; 31 MiB puts the
#: measurement there too. The CPU kernel set keeps fresh outputs below it.
HOST_ALLOCATOR_WARM_BYTES = 31 * 2**20

#: GPU names (substring of ``torch.cuda.get_device_name()``) -> ``costmodels.device`` names.
CUDA_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100_sxm"), ("A100", "a100_80gb_sxm"), ("B200", "b200"))

METHOD = ("ATen calls of each row run back to back on real tensors; {passes} interleaved passes over the "
          "kernel set, in each a warm-up of >= {warmup_ms:g} ms and >= {warmup_calls} calls, then {repeats} "
          "repeats of ~{repeat_ms:g} ms of back-to-back calls (at least one) and the median of their mean "
          "time per call; a kernel's time is the smallest of its {passes} per-pass medians; timed with {clock}")


def method_text(device_type: str, quick: bool) -> str:
    """The timing method, in words, as recorded in a measurement file and a profile."""
    clock = ("torch.cuda.Event (elapsed_time between events around the calls, then synchronize); "
             f"meas_graph_us: the same calls captured {GRAPH_CALLS}x in a CUDA graph and replayed (first pass)"
             if device_type == "cuda" else
             "time.perf_counter_ns, garbage collection paused, after warming the host allocator; with one "
             f"thread, a repeat whose thread CPU time is under {UNDISTURBED_CPU_SHARE:.0%} of its wall time "
             f"(descheduled for another process) is discarded and run again (up to {MAX_ATTEMPTS}x; a kernel "
             "never undisturbed takes its thread CPU time)")
    return METHOD.format(passes=PASSES, warmup_ms=1e3 * (QUICK_WARMUP_S if quick else WARMUP_S),
                         warmup_calls=WARMUP_MIN_CALLS, repeats=QUICK_REPEATS if quick else REPEATS,
                         repeat_ms=1e3 * (QUICK_REPEAT_S if quick else REPEAT_S), clock=clock)


# ----------------------------------------------------------------------------------------
# The local device
# ----------------------------------------------------------------------------------------
def local_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def local_spec(dev: torch.device, device_name: str | None = None) -> DeviceSpec:
    """The :class:`DeviceSpec` a profile measured on ``dev`` is for: ``device_name`` if given, else
    "cpu" on a CPU and the spec whose name the GPU's name contains (:data:`CUDA_DEVICE_NAMES`)."""
    if device_name is not None:
        spec = _device(device_name)
        if (spec.arch == "cpu") != (dev.type == "cpu"):
            raise ValueError(f"--device-name {device_name!r} is a {'CPU' if spec.arch == 'cpu' else 'GPU'}, "
                             f"but the kernels run on {describe_device(dev)}")
        return spec
    if dev.type == "cpu":
        return _device("cpu")
    name = torch.cuda.get_device_name(dev)
    for key, spec_name in CUDA_DEVICE_NAMES:
        if key in name:
            return _device(spec_name)
    raise ValueError(f"cannot tell which device spec {name!r} is; pass --device-name (see `apmodel devices`)")


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (recorded as a measurement's date)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def describe_device(dev: torch.device) -> str:
    """The hardware in words: GPU name, or CPU model and core count."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU {model} ({os.cpu_count()} logical cores)"


def cpu_cache_MiB(level: int = 2) -> float | None:
    """Size (MiB) of cpu0's data or unified cache of ``level``, from
    ``/sys/devices/system/cpu/cpu0/cache``; None when the OS does not say."""
    units = {"K": 2**-10, "M": 1.0, "G": 2**10}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if int((d / "level").read_text()) != level or (d / "type").read_text().strip() == "Instruction":
                continue
            text = (d / "size").read_text().strip()
            return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text) / 2**20
    return None


def cache_MiB(dev: torch.device) -> float | None:
    """The cache a profile's ``l2_MiB`` describes on ``dev`` (MiB): a GPU's L2, a CPU's per-core
    L2 (:func:`cpu_cache_MiB`); None when unknown."""
    if dev.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        return size / 2**20 if size else None
    return cpu_cache_MiB(level=2)


def warm_host_allocator() -> None:
    """Allocate and free :data:`HOST_ALLOCATOR_WARM_BYTES` on the host, so that later CPU blocks
    below that size come from the heap, as in a training loop's steady state (see the constant)."""
    block = torch.empty(HOST_ALLOCATOR_WARM_BYTES, dtype=torch.uint8)
    del block


def parallel_units(dev: torch.device, threads: int) -> int:
    """Parallel units of the device: SMs of a GPU, the measurement's threads on a CPU."""
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).multi_processor_count)
    return max(1, int(threads))


@contextlib.contextmanager
def threads_set(threads: int | None) -> Iterator[int]:
    """Run with ``threads`` CPU threads (torch intra-op), restored afterwards; yields the count."""
    before = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------
# Kernel sets
# ----------------------------------------------------------------------------------------
def _mm(m: int, k: int, n: int, dtype: str = "float32") -> dict[str, Any]:
    return {"op": "mm", "shapes": [[m, k], [k, n]], "dtype": dtype}


def _cpu_rows(quick: bool) -> list[dict[str, Any]]:
    """The CPU kernel set (see the module docstring); ``quick``: fewer sizes, for tests. Fresh
    outputs stay below :data:`HOST_ALLOCATOR_WARM_BYTES` (above it every call page-faults)."""
    f32, b16 = "float32", "bfloat16"
    sizes = (64, 192, 512) if quick else (32, 128, 512, 1024)
    rows = [_mm(16, 16, 16)] + [_mm(m, k, n) for m in sizes for k in sizes for n in sizes]
    base = 256 if quick else 1024
    # misaligned leading dimensions: odd (4-byte pitch), 2 mod 4 (8-byte pitch), and an odd m
    rows += [_mm(base, base, base - 1), _mm(base, base - 1, base), _mm(base, base, base - 2),
             _mm(base - 1, base, base)]
    rows.append({"op": "mm_tt", "shapes": [[base, base], [base, base]], "dtype": f32})
    rows.append({"op": "bmm", "shapes": [[8, 128, 64], [8, 64, 128]], "dtype": f32})
    rows += [_mm(64, 64, 64, b16), _mm(128, 128, 128, b16)] + ([] if quick else [_mm(256, 256, 256, b16)])
    # memory-bound ops; the smallest size measures the launch floor
    numels = (2**10, 2**13, 2**16, 2**18, 2**20) if quick else (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22)
    for n in numels:
        rows += [{"op": "add", "shapes": [[n], [n]], "dtype": f32},
                 {"op": "mul_scalar", "shapes": [[n]], "dtype": f32},
                 {"op": "copy_", "shapes": [[n], [n]], "dtype": f32}]
    for n in numels[::2]:
        rows += [{"op": "silu", "shapes": [[n]], "dtype": f32},
                 {"op": "gelu", "shapes": [[n]], "dtype": f32},
                 {"op": "sum", "shapes": [[n]], "dtype": f32},
                 {"op": "to_fp32", "shapes": [[n]], "dtype": b16}]
    norm_shapes = ((16, 64), (64, 128), (256, 128), (1024, 512)) if quick else \
        ((16, 64), (64, 128), (256, 128), (256, 1024), (2048, 512), (2048, 2048))
    for shape in norm_shapes:
        rows += [{"op": kind, "shapes": [list(shape)], "dtype": f32}
                 for kind in ("rms_norm", "layer_norm", "softmax", "log_softmax")]
    for shape in ((64, 128), (1024, 256)) if quick else ((64, 128), (1024, 256), (4096, 1024)):
        rows.append({"op": "sum_dim0", "shapes": [list(shape)], "dtype": f32})
    for shape in ((256, 1000), (512, 4000)) if quick else ((256, 1000), (1024, 4000), (2048, 2000)):
        rows.append({"op": "cross_entropy_fp32", "shapes": [list(shape)], "dtype": f32})
    for vocab, dim, tokens in ((1000, 64, 16), (5000, 128, 512), (20000, 256, 2048)) if quick else \
            ((1000, 64, 16), (5000, 128, 512), (16000, 256, 2048), (30000, 256, 8192)):
        rows.append({"op": "embedding", "shapes": [[vocab, dim], [tokens]], "dtype": f32})
        rows.append(_embedding_backward_row(vocab, dim, tokens, f32))
    att: tuple[tuple[int, int, int, int], ...] = ((1, 2, 16, 16), (1, 4, 128, 32), (2, 4, 128, 64)) if quick else \
        ((1, 2, 16, 16), (1, 4, 128, 32), (2, 8, 256, 64), (1, 8, 512, 128), (4, 4, 1024, 64))
    for att_shape in att:
        for kind in ("sdpa_flash_fwd", "sdpa_flash_fwd_plus_bwd"):
            rows.append({"op": kind, "shapes": [list(att_shape)], "dtype": f32, "causal": True})
    for r in rows:
        r["device_type"] = "cpu"
        r["harness"] = "aten"
    return rows


def _embedding_backward_row(vocab: int, dim: int, tokens: int, dtype: str) -> dict[str, Any]:
    """An ``embedding_dense_backward`` row; ``bytes`` (table + gradient rows + int64 indices)
    carries the table size, as in the H200 file."""
    isz = mr.DTYPES_BY_NAME[dtype].itemsize
    return {"op": "embedding_dense_backward", "shapes": [[tokens, dim], [tokens]], "dtype": dtype,
            "bytes": vocab * dim * isz + tokens * dim * isz + tokens * 8}


def _cuda_rows(quick: bool) -> list[dict[str, Any]]:
    """The GPU kernel set: the rows of the shipped H200 measurements (their shapes only)."""
    keep = ("op", "shapes", "dtype", "causal", "flops", "bytes")
    rows = []
    for r in mr.load_measurements(device="h200")["rows"]:
        if quick and (float(r.get("bytes", 0)) > CUDA_QUICK_MAX_BYTES or float(r.get("flops", 0)) > CUDA_QUICK_MAX_FLOPS):
            continue
        row = {k: r[k] for k in keep if k in r}
        row["device_type"] = "cuda"
        row["harness"] = "aten"
        rows.append(row)
    return rows


def kernel_rows(device_type: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """The kernels a profile of a ``device_type`` ("cpu" or "cuda") device is fitted to, as
    measurement rows without timings."""
    if device_type == "cpu":
        return _cpu_rows(quick)
    if device_type == "cuda":
        return _cuda_rows(quick)
    raise ValueError(f"no kernel set for device type {device_type!r} (cpu or cuda)")


# ----------------------------------------------------------------------------------------
# Real tensors for meta calls
# ----------------------------------------------------------------------------------------
def _index_bound(op: Any, args: tuple) -> int:
    """Exclusive upper bound of the integer index arguments of ``op`` (rows of the table an
    embedding reads, classes of a loss); 1 (all zeros) for other ops."""
    name = op_name(op)
    if name == "embedding" and isinstance(args[0], torch.Tensor):
        return int(args[0].shape[0])
    if name == "embedding_dense_backward":
        return int(args[2])
    if name.startswith("nll_loss") and isinstance(args[0], torch.Tensor):
        return int(args[0].shape[-1])
    return 1


def materialize(calls: Sequence[mr.Call], dev: torch.device, seed: int = 0) -> list[tuple[Any, tuple, dict]]:
    """``(op, args, kwargs)`` on real tensors of ``dev`` for meta ``calls``: each meta tensor
    becomes a tensor of the same shape, strides and dtype (normal values; indices within the
    table or class count they index); a call's outputs feed the later calls that used them."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    real: dict[int, torch.Tensor] = {}

    def conv(x: Any, bound: int) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) in real:
                return real[id(x)]
            if x.device.type != "meta":
                return x
            t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=dev)
            if t.is_floating_point():
                t.normal_(generator=gen)
            elif t.dtype == torch.bool:
                t.fill_(False)
            else:
                t.random_(0, max(1, bound), generator=gen)
            real[id(x)] = t
            return t
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y, bound) for y in x)
        if isinstance(x, dict):
            return {k: conv(v, bound) for k, v in x.items()}
        return x

    out: list[tuple[Any, tuple, dict]] = []
    for c in calls:
        bound = _index_bound(c.op, c.args)
        args = conv(c.args, bound)
        kwargs = conv(c.kwargs, bound)
        result = c.op(*args, **kwargs)
        _link(c.out, result, real)
        out.append((c.op, args, kwargs))
    return out


def _link(meta_out: Any, real_out: Any, real: dict[int, torch.Tensor]) -> None:
    if isinstance(meta_out, torch.Tensor) and isinstance(real_out, torch.Tensor):
        real[id(meta_out)] = real_out
    elif isinstance(meta_out, (list, tuple)) and isinstance(real_out, (list, tuple)):
        for m, r in zip(meta_out, real_out, strict=False):
            _link(m, r, real)


def runner(seq: Sequence[tuple[Any, tuple, dict]]) -> Callable[[], None]:
    """A function that runs the calls ``seq`` back to back (what the timer times)."""
    if len(seq) == 1:
        op, args, kwargs = seq[0]

        def run_one() -> None:
            op(*args, **kwargs)
        return run_one

    def run_all() -> None:
        for op, args, kwargs in seq:
            op(*args, **kwargs)
    return run_all


# ----------------------------------------------------------------------------------------
# The timer
# ----------------------------------------------------------------------------------------
def time_samples_us(run: Callable[[], None], dev: torch.device, *, quick: bool = False) -> list[float]:
    """One pass of the timer over ``run``: warm-up, then the mean time (µs) per call of each repeat
    of back-to-back calls (see :data:`METHOD`)."""
    warmup_s, repeats, repeat_s = ((QUICK_WARMUP_S, QUICK_REPEATS, QUICK_REPEAT_S) if quick
                                   else (WARMUP_S, REPEATS, REPEAT_S))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    n = 0
    while n < WARMUP_MIN_CALLS or time.perf_counter() - t0 < warmup_s:
        run()
        n += 1
        if cuda:  # the GPU's time, not the queue's
            torch.cuda.synchronize(dev)
    per_call_s = (time.perf_counter() - t0) / n
    calls = max(1, min(MAX_CALLS_PER_REPEAT, int(round(repeat_s / max(per_call_s, 1e-9)))))
    samples: list[float] = []
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(repeats):
                start.record()
                for _ in range(calls):
                    run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / calls)
        elif torch.get_num_threads() > 1:
            for _ in range(repeats):
                t = time.perf_counter_ns()
                for _ in range(calls):
                    run()
                samples.append((time.perf_counter_ns() - t) / 1e3 / calls)
        else:
            cpu_only: list[float] = []
            for _ in range(MAX_ATTEMPTS * repeats):
                c, t = time.thread_time_ns(), time.perf_counter_ns()
                for _ in range(calls):
                    run()
                wall, cpu = time.perf_counter_ns() - t, time.thread_time_ns() - c
                if cpu >= UNDISTURBED_CPU_SHARE * wall:
                    samples.append(wall / 1e3 / calls)
                    if len(samples) == repeats:
                        break
                else:
                    cpu_only.append(cpu / 1e3 / calls)
            if not samples:
                samples = cpu_only
    finally:
        if gc_enabled:
            gc.enable()
    return samples


def time_us(run: Callable[[], None], dev: torch.device, *, quick: bool = False) -> float:
    """The smallest over :data:`PASSES` passes of the median of :func:`time_samples_us` (one
    kernel, passes back to back: :func:`time_interleaved` is the robust form)."""
    return min(float(statistics.median(time_samples_us(run, dev, quick=quick))) for _ in range(PASSES))


def time_graph_us(run: Callable[[], None], dev: torch.device, *, quick: bool = False) -> float:
    """Time (µs) of one call of ``run`` replayed from a CUDA graph of :data:`GRAPH_CALLS` calls
    (GPU time only: no CPU cost per call): median of one pass of :func:`time_samples_us`."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_MIN_CALLS):
            run()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            run()
    return float(statistics.median(time_samples_us(graph.replay, dev, quick=quick))) / GRAPH_CALLS


#: Errors that mean "this device cannot run this kernel" (no kernel for the device or dtype, out
#: of memory, arguments a backend refuses): the kernel is skipped, the rest measured.
SKIP_ERRORS = (RuntimeError, NotImplementedError, MemoryError, ValueError)


def time_interleaved(factories: Sequence[Callable[[], Callable[[], None]]], dev: torch.device, *,
                     quick: bool = False, progress: Callable[[int, int], None] | None = None,
                     ) -> list[float | BaseException]:
    """Time several kernels with the same method, interleaved: :data:`PASSES` passes, each builds
    every kernel's ``run = factory()`` (fresh tensors) and takes the median of
    :func:`time_samples_us` of it. Returns each kernel's smallest per-pass median (µs), or the
    error its factory or run raised (from :data:`SKIP_ERRORS`; the kernel is left out of later
    passes). On a CPU the host allocator is warmed first (:func:`warm_host_allocator`).
    ``progress(done, total)`` after each step."""
    if dev.type == "cpu":
        warm_host_allocator()
    samples: list[list[float]] = [[] for _ in factories]
    errors: list[BaseException | None] = [None] * len(factories)
    total, done = PASSES * len(factories), 0
    for _ in range(PASSES):
        for i, factory in enumerate(factories):
            if errors[i] is None:
                try:
                    run = factory()
                    samples[i].append(float(statistics.median(time_samples_us(run, dev, quick=quick))))
                    del run
                except SKIP_ERRORS as e:
                    errors[i] = e
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            done += 1
            if progress is not None:
                progress(done, total)
    return [e if e is not None else min(ss) for ss, e in zip(samples, errors, strict=True)]


# ----------------------------------------------------------------------------------------
# Measuring a kernel set
# ----------------------------------------------------------------------------------------
def _row_bytes(calls: Sequence[mr.Call]) -> int:
    seen: set[int] = set()
    total = 0
    for c in calls:
        for t in tensors_in(c.args) + tensors_in(c.kwargs) + tensors_in(c.out):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _error_text(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def measure_rows(rows: Sequence[Mapping[str, Any]], dev: torch.device, *, quick: bool = False,
                 progress: Callable[[int, int], None] | None = None,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time every row on ``dev`` (:func:`time_interleaved`): ``(measured rows with meas_us [and on
    CUDA meas_graph_us], skipped rows with the reason)``. A row the device cannot run (no such
    kernel, out of memory) is skipped and logged."""
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
    graph_us: dict[int, float] = {}

    def factory(i: int, row: Mapping[str, Any]) -> Callable[[], Callable[[], None]]:
        def build() -> Callable[[], None]:
            calls = mr.row_calls(row)
            if free is not None and _row_bytes(calls) > CUDA_MEMORY_SHARE * free:
                raise MemoryError(f"needs {_row_bytes(calls) / 2**30:.1f} GiB of the GPU's "
                                  f"{free / 2**30:.1f} GiB free")
            run = runner(materialize(calls, dev, seed=i))
            if (dev.type == "cuda" and i not in graph_us and row["op"] in GRAPH_OPS
                    and math.prod(row["shapes"][0]) <= GRAPH_MAX_ELEMENTS):
                try:
                    graph_us[i] = time_graph_us(run, dev, quick=quick)
                except RuntimeError as e:  # capture refused: keep the eager timing
                    graph_us[i] = math.nan
                    logger.warning("CUDA graph of %s failed (%s); eager timing only", mr.describe_row(row), e)
            return run
        return build

    times = time_interleaved([factory(i, r) for i, r in enumerate(rows)], dev, quick=quick, progress=progress)
    measured: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, (row, t) in enumerate(zip(rows, times, strict=True)):
        if isinstance(t, BaseException):
            logger.warning("skipped %s: %s", mr.describe_row(row), _error_text(t))
            skipped.append({"row": mr.describe_row(row), "error": _error_text(t)})
            continue
        out = dict(row)
        out["meas_us"] = t
        if math.isfinite(graph_us.get(i, math.nan)):
            out["meas_graph_us"] = graph_us[i]
        measured.append(out)
        logger.info("kernel %d/%d: %s: %.2f µs%s", i + 1, len(rows), mr.describe_row(row), t,
                    f" (graph {out['meas_graph_us']:.2f} µs)" if "meas_graph_us" in out else "")
    return measured, skipped


def measurements_document(rows: Sequence[Mapping[str, Any]], skipped: Sequence[Mapping[str, Any]],
                          dev: torch.device, spec: DeviceSpec, *, quick: bool, threads: int) -> dict[str, Any]:
    """The JSON document of a measurement (schema :data:`costmodels.measurements.MEASUREMENTS_SCHEMA`,
    loadable with :func:`costmodels.measurements.load_measurements`)."""

    hardware = describe_device(dev)
    software = f"PyTorch {torch.__version__} eager" + (f", {threads} CPU threads" if dev.type == "cpu" else "")
    method = method_text(dev.type, quick)
    return {
        "schema": mr.MEASUREMENTS_SCHEMA,
        "device": spec.name,
        "device_type": dev.type,
        "hardware": hardware,
        "software": software,
        "torch": torch.__version__,
        "threads": threads,
        "date": utc_now(),
        "method": method,
        "kernel_set": "quick" if quick else "full",
        "provenance": {"origin": "apmodel calibrate-compute", "hardware": hardware, "software": software,
                       "method": method},
        "fields": {
            "op": "what was run (see costmodels.measurements.row_calls: mm, mm_tt, bmm, sdpa_<backend>_fwd / "
                  "_fwd_plus_bwd, elementwise / reduction / copy / norm / cross-entropy / embedding ops by name)",
            "shapes": "operand shapes", "dtype": "operand dtype",
            "device_type": "cpu: flash attention rows ran the CPU kernels (_scaled_dot_product_flash_attention_for_cpu)",
            "harness": "aten: the row's ATen calls were run directly (no autograd)",
            "bytes": "embedding_dense_backward: table + gradient rows + int64 indices (gives the table size)",
            "meas_us": "measured µs per call (per row: its calls back to back), eager",
            "meas_graph_us": "CUDA only: the same calls replayed from a CUDA graph (GPU time only)",
        },
        "skipped": list(skipped),
        "rows": [dict(r) for r in rows],
    }


# ----------------------------------------------------------------------------------------
# Recorded calls: the ATen ops a real step runs (held-out checks of a fitted profile)
# ----------------------------------------------------------------------------------------
def map_tensors(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf of its (nested) tuples, lists and dicts."""
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(fn, y) for y in x)
    if isinstance(x, dict):
        return {k: map_tensors(fn, v) for k, v in x.items()}
    return fn(x)


def copy_tensor(x: Any) -> Any:
    """A tensor's copy with the same strides, outside autograd; anything else as is."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x.detach())
    return x


def to_meta(x: Any) -> Any:
    """A meta tensor of ``x``'s shape, strides and dtype (a device: meta); anything else as is."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class RecordedCall(NamedTuple):
    """One ATen call recorded while a step ran: the op and copies of its real arguments and output
    (see ``benchmarks/cpu_compute_check.py``, which records them with a dispatch mode)."""

    op: Any
    args: tuple
    kwargs: dict
    out: Any

    @classmethod
    def copied(cls, op: Any, args: tuple, kwargs: dict, out: Any) -> "RecordedCall":
        """The call with copies of its tensors (the originals may change later in the step)."""
        return cls(op, map_tensors(copy_tensor, args), map_tensors(copy_tensor, kwargs), map_tensors(copy_tensor, out))

    def on_meta(self) -> mr.Call:
        """The call on meta tensors of the same shapes, strides and dtypes (what a model prices)."""
        return mr.Call(self.op, map_tensors(to_meta, self.args), map_tensors(to_meta, self.kwargs),
                       map_tensors(to_meta, self.out))

    def runner(self) -> Callable[[], None]:
        """A function that runs the call on fresh copies of its arguments."""
        return runner([(self.op, map_tensors(copy_tensor, self.args), map_tensors(copy_tensor, self.kwargs))])


def time_recorded(calls: Sequence[RecordedCall], dev: torch.device, *, quick: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> list[float | BaseException]:
    """Time recorded calls with the kernel-set method (:func:`time_interleaved`; fresh copies of
    the arguments in every pass)."""
    return time_interleaved([c.runner for c in calls], dev, quick=quick, progress=progress)

"""Fit a :class:`~costmodels.compute_profile.ComputeProfile` to kernel timings (least squares).

Each measured row (see :func:`costmodels.measurements.row_calls`) is turned into the ATen calls it ran
and priced by :class:`~costmodels.measured.MeasuredCompute` with ``cache="warm"`` (a measurement
replays one op on the same buffers). The fit minimises the squared ``ln(predicted / measured)``
by class, a few interpretable parameters each (see the module docstring of
:mod:`costmodels.measured`), in this order:

1. memory-bound ops (eager and, where measured, CUDA-graph timings): CPU floors, launch gap,
   kernel latency, HBM (or DRAM) and L2 (or last-level cache) bandwidth, traffic factors;
2. embedding backward: fixed time and scatter bandwidth;
3. matmul: CPU floor, kernel latency, bf16 / fp32 rates, alignment efficiencies; the CTA tile
   size by a grid search;
4. attention: per backend and pass the rate at head dim 128, head-dim half point, tail fraction,
   latency; the attention CPU floor and the harness's ``autograd.grad`` CPU time.

A class without rows keeps its starting values, and so does a parameter no row depends on (its
column of the Jacobian is zero): :class:`FitResult` lists them as ``unconstrained``. A backend
without rows (cuDNN on a CPU) is written as ``{"same_as": "flash"}``.

:func:`settings_for` gives the starting point and bounds: the H200 values for GPUs (scaled to the
device by datasheet ratios), wide bounds around a CPU's nominal spec for CPUs (whose rates are
then fitted, not read off a datasheet). ``benchmarks/compute_profile.py`` refits the shipped H200
profile with it; :func:`calibrate_compute` (``apmodel calibrate-compute``) measures the local
device with :mod:`costmodels.kernel_timing` and fits.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import measured as ms
from . import measurements as mr
from .compute import tensors_in
from .compute_profile import thaw
from .hardware import DeviceSpec
from .hardware import device as _device

logger = logging.getLogger(__name__)

#: L2 cache of the GH100 die (H100 SXM5 and H200): 50 MB ("NVIDIA H100 Tensor Core GPU
#: Architecture" whitepaper: "50 MB L2 cache"); NVIDIA's MB here is 2**20 bytes (nvidia-smi /
#: cudaDevAttrL2CacheSize report 52,428,800 B).
GH100_L2_MIB = 50.0
#: Streaming multiprocessors of an H100 SXM5 / H200 SXM (whitepaper: 132 SMs on the SXM5 part).
GH100_SXM_SM_COUNT = 132
#: CTA tile sizes tried for the matmul tile-quantisation term (cuBLAS Hopper kernels use 64-256).
TILE_GRID = (64, 128, 256)
#: Blocking sizes tried on a CPU: 1 (no quantisation) and a multiple of the AVX2 / AVX-512 SGEMM
#: micro-kernel widths (8 / 16 fp32 lanes per vector register).
CPU_TILE_GRID = (1, 16)
#: Starting matmul rate of a CPU, as a fraction of its nominal spec peak (assumption: eager
#: single-op GEMMs of the sizes measured reach a few percent of a nominal socket peak; the fit
#: moves it, in log space, within :data:`CPU_LOG_RANGE`).
CPU_MATMUL_START_FRACTION = 0.05
#: Factor either side of a CPU's starting value that a rate or time may be fitted to.
CPU_LOG_RANGE = 1e4
#: Bounds of a CPU's traffic factors: compute-bound ops (exp, erf in softmax, gelu) run many
#: times slower than their bytes at the memory rate.
CPU_TRAFFIC_BOUNDS = (0.25, 64.0)
#: Residual (in ln(pred/meas)) beyond which a CPU fit weighs a row linearly, not quadratically
#: (soft_l1 loss): a kernel slowed by another process on a shared machine pulls less.
CPU_LOSS_SCALE = 0.1
#: Relative tolerance at which a CPU fit stops (cost and parameters): far below the timings' noise.
CPU_FIT_TOL = 1e-5
#: Per-core L2 cache assumed when the OS does not say (MiB; recent x86 server cores have 1-2 MiB).
DEFAULT_CPU_L2_MIB = 1.0

Log = Callable[[str], None]


def initial_params() -> dict[str, Any]:
    """Starting point of the H200 fit (orders of magnitude read off the data; the fit moves them)."""
    return {
        "launch": {
            "eager_floor_us": {"elementwise": 9.5, "reduction": 13.0, "norm": 14.0, "gather": 15.0,
                               "matmul": 10.8, "attention": 20.0},
            "eager_gap_us": 1.5,
            "kernel_latency_us": {"memory": 1.0, "matmul": 4.0},
        },
        "memory": {
            "hbm_TBps": 4.3, "l2_TBps": 8.0, "l2_MiB": GH100_L2_MIB,
            "traffic": {"elementwise": 1.0, "convert": 2.0, "reduction": 1.0, "rms_norm": 1.3,
                        "layer_norm": 1.6, "softmax": 3.4, "log_softmax": 2.0, "gather": 1.2},
        },
        "matmul": {
            "tflops": {"bf16": 720.0, "fp32": 51.0},
            "tile_m": 128, "tile_n": 128,
            "align_efficiency": {"2": 0.16, "4": 0.32, "8": 0.33},
        },
        "attention": {
            "flash": {"fwd": {"tflops": 350.0, "head_dim_half": 40.0, "tail": 0.5, "latency_us": 5.0},
                      "bwd": {"tflops": 320.0, "head_dim_half": 40.0, "tail": 0.5, "latency_us": 10.0}},
            "cudnn": {"fwd": {"tflops": 660.0, "head_dim_half": 60.0, "tail": 0.3, "latency_us": 5.0},
                      "bwd": {"tflops": 560.0, "head_dim_half": 60.0, "tail": 0.3, "latency_us": 10.0}},
            "efficient": {"same_as": "flash"},
        },
        "embedding_backward": {"fixed_us": 120.0, "scatter_GBps": 150.0},
        "harness": {"autograd_grad_cpu_us": 170.0},
    }


def cpu_initial_params(spec: DeviceSpec, cache_MiB: float) -> dict[str, Any]:
    """Starting point of a CPU fit: eager dispatch of a few µs per op, the spec's nominal memory
    bandwidth, a few percent of its nominal peak for GEMMs (see :data:`CPU_MATMUL_START_FRACTION`);
    ``cache_MiB`` is the per-core L2 cache, which plays the part of a GPU's L2. Every softmax row
    pays the fitted softmax factor (no single-pass kernel: ``softmax_single_pass_max_dim`` 0), and
    transcendental elementwise ops (exp, erf, ...) have their own factor: on a CPU they are
    compute bound."""
    mm_fp32 = spec.peak_flops("fp32") / 1e12 * CPU_MATMUL_START_FRACTION
    mm_bf16 = spec.peak_flops("bf16") / 1e12 * CPU_MATMUL_START_FRACTION
    dram = spec.hbm_TBps * spec.memory_efficiency
    att = {"tflops": mm_fp32 / 2, "head_dim_half": 40.0, "tail": 0.5, "latency_us": 20.0}
    return {
        "launch": {
            "eager_floor_us": {"elementwise": 3.0, "reduction": 4.0, "norm": 5.0, "gather": 5.0,
                               "matmul": 5.0, "attention": 10.0},
            "eager_gap_us": 2.0,
            "kernel_latency_us": {"memory": 1.0, "matmul": 2.0},
        },
        "memory": {
            "hbm_TBps": dram, "l2_TBps": 2 * dram, "l2_MiB": float(cache_MiB),
            "softmax_single_pass_max_dim": 0,
            "traffic": {"elementwise": 1.0, "convert": 2.0, "reduction": 1.0, "rms_norm": 1.3,
                        "layer_norm": 1.6, "softmax": 3.0, "log_softmax": 2.0, "gather": 1.2,
                        "transcendental": 4.0},
        },
        "matmul": {
            "tflops": {"bf16": mm_bf16, "fp32": mm_fp32},
            "tile_m": 1, "tile_n": 1,
            "align_efficiency": {"2": 1.0, "4": 1.0, "8": 1.0},
        },
        "attention": {
            "flash": {"fwd": dict(att), "bwd": dict(att)},
            "cudnn": {"same_as": "flash"},
            "efficient": {"same_as": "flash"},
        },
        "embedding_backward": {"fixed_us": 10.0, "scatter_GBps": 1e3 * dram},
        "harness": {"autograd_grad_cpu_us": 50.0},
    }


# (path, kind, lower, upper): kind "log" fits ln(value) (value > 0), "lin" fits the value.
GROUPS: dict[str, list[tuple[str, str, float, float]]] = {
    "memory": [
        ("launch.eager_floor_us.elementwise", "log", 1.0, 50.0),
        ("launch.eager_floor_us.reduction", "log", 1.0, 50.0),
        ("launch.eager_floor_us.norm", "log", 1.0, 50.0),
        ("launch.eager_floor_us.gather", "log", 1.0, 50.0),
        ("launch.eager_gap_us", "lin", 0.0, 10.0),
        ("launch.kernel_latency_us.memory", "lin", 0.0, 10.0),
        ("memory.hbm_TBps", "log", 0.5, 10.0),
        ("memory.l2_TBps", "log", 0.5, 30.0),
        *[(f"memory.traffic.{k}", "log", 0.5, 8.0) for k in ms.TRAFFIC_KINDS + ms.OPTIONAL_TRAFFIC_KINDS],
    ],
    "embedding_backward": [
        ("embedding_backward.fixed_us", "lin", 0.0, 1000.0),
        ("embedding_backward.scatter_GBps", "log", 1.0, 10000.0),
    ],
    "matmul": [
        ("launch.eager_floor_us.matmul", "log", 1.0, 50.0),
        ("launch.kernel_latency_us.matmul", "lin", 0.0, 20.0),
        ("matmul.tflops.bf16", "log", 10.0, 2000.0),
        ("matmul.tflops.fp32", "log", 1.0, 100.0),
        *[(f"matmul.align_efficiency.{a}", "log", 0.01, 1.0) for a in ms.ALIGN_CLASSES],
    ],
    "attention": [
        ("launch.eager_floor_us.attention", "log", 1.0, 100.0),
        ("harness.autograd_grad_cpu_us", "log", 1.0, 1000.0),
        *[(f"attention.{b}.{p}.{k}", kind, lo, hi)
          for b in ("flash", "cudnn") for p in ("fwd", "bwd")
          for k, kind, lo, hi in (("tflops", "log", 10.0, 2000.0), ("head_dim_half", "log", 1.0, 1000.0),
                                  ("tail", "lin", 0.0, 3.0), ("latency_us", "lin", 0.0, 200.0))],
    ],
}
#: Fit order of the groups (later groups see the earlier groups' fitted values).
GROUP_ORDER = ("memory", "embedding_backward", "matmul", "attention")


@dataclass(frozen=True)
class FitSettings:
    """Where a fit starts and how far it may go: ``initial`` parameters, ``bounds`` overriding
    those of :data:`GROUPS` (path -> (lower, upper)), the ``tile_grid`` searched and the
    ``reference`` device of the profile (its peaks, HBM TB/s and SM count), and the loss."""

    initial: Mapping[str, Any]
    reference: Mapping[str, Any]
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    tile_grid: tuple[int, ...] = TILE_GRID
    #: scipy ``least_squares`` loss: "linear" (plain least squares; the H200 fit) or "soft_l1"
    #: (outliers weigh linearly beyond ``f_scale``: a noisy shared CPU)
    loss: str = "linear"
    f_scale: float = 1.0
    #: scipy ``least_squares`` stopping tolerances on the cost and the parameters (its defaults for
    #: the H200; looser for a CPU, whose timings are noisier than that)
    tol: float = 1e-8


def reference_of(device: str | DeviceSpec, sm_count: int = GH100_SXM_SM_COUNT) -> dict[str, Any]:
    """The ``reference`` block of a profile fitted on ``device`` (``sm_count``: its SMs, or a CPU's
    threads)."""
    spec = _device(device) if isinstance(device, str) else device
    return {"device": spec.name, "peak_tflops": dict(spec.peak_tflops), "hbm_TBps": spec.hbm_TBps,
            "sm_count": int(sm_count)}


def _cpu_bounds(initial: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Bounds of a CPU fit: :data:`CPU_LOG_RANGE` either side of the start for rates and times,
    the GPU bounds for dimensionless factors (traffic, alignment, tail)."""
    out: dict[str, tuple[float, float]] = {}
    for group in GROUPS.values():
        for path, kind, _lo, hi in group:
            try:
                start = float(_get(initial, path))
            except (KeyError, TypeError):
                continue
            if path.startswith("memory.traffic"):
                out[path] = CPU_TRAFFIC_BOUNDS
                continue
            if path.startswith("matmul.align_efficiency") or path.endswith((".tail", ".head_dim_half")):
                continue
            if kind == "log":
                out[path] = (start / CPU_LOG_RANGE, start * CPU_LOG_RANGE)
            else:
                out[path] = (0.0, max(hi, start * CPU_LOG_RANGE))
    return out


def settings_for(device: str | DeviceSpec, *, sm_count: int | None = None,
                 cache_MiB: float | None = None) -> FitSettings:
    """Fit settings for ``device``: the H200 start and bounds for a GPU (rates scaled to the
    device by datasheet ratios), :func:`cpu_initial_params` and wide bounds for a CPU
    (``spec.arch == "cpu"``; ``cache_MiB``: its per-core L2 cache, default
    :data:`DEFAULT_CPU_L2_MIB`)."""
    spec = _device(device) if isinstance(device, str) else device
    if spec.arch == "cpu":
        initial = cpu_initial_params(spec, DEFAULT_CPU_L2_MIB if cache_MiB is None else cache_MiB)
        return FitSettings(initial=initial, reference=reference_of(spec, sm_count or 1),
                           bounds=_cpu_bounds(initial), tile_grid=CPU_TILE_GRID,
                           loss="soft_l1", f_scale=CPU_LOSS_SCALE, tol=CPU_FIT_TOL)
    reference = reference_of(spec, sm_count or GH100_SXM_SM_COUNT)
    initial = initial_params()
    h200 = ms.ComputeProfile(device="h200", params=initial, reference=reference_of("h200"))
    if not h200.matches(spec):
        initial = thaw(h200.scaled_to(spec).params)
    if cache_MiB is not None:
        initial["memory"]["l2_MiB"] = float(cache_MiB)
    return FitSettings(initial=initial, reference=reference)


# ----------------------------------------------------------------------------------------
# The fit
# ----------------------------------------------------------------------------------------
def row_group(op: str) -> str:
    """Fit group of a row op."""
    if op.startswith("mm") or op == "bmm":
        return "matmul"
    if op.startswith("sdpa_"):
        return "attention"
    if op == "embedding_dense_backward":
        return "embedding_backward"
    return "memory"


def _get(d: Mapping[str, Any], path: str) -> Any:
    for part in path.split("."):
        d = d[part]
    return d


def _set(d: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        d = d[part]
    d[parts[-1]] = value


def _has(d: Mapping[str, Any], path: str) -> bool:
    try:
        _get(d, path)
    except (KeyError, TypeError):
        return False
    return True


class Rows:
    """Measured rows with their ATen calls built once."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.rows = list(rows)
        self.calls = [mr.row_calls(r) for r in self.rows]

    def subset(self, pred: Callable[[Mapping[str, Any]], bool]) -> list[int]:
        return [i for i, r in enumerate(self.rows) if pred(r)]


def _profile(params: dict, reference: Mapping[str, Any], device: str) -> ms.ComputeProfile:
    return ms.ComputeProfile(device=device, params=params, reference=reference)


def _residuals(params: dict, reference: Mapping[str, Any], device: DeviceSpec, data: Rows, idx: Sequence[int],
               graph_idx: Sequence[int], graph_weight: float) -> np.ndarray:
    prof = _profile(params, reference, device.name)
    res = []
    eager = ms.MeasuredCompute(device, prof, execution="eager", cache="warm")
    for i in idx:
        r = data.rows[i]
        res.append(math.log(mr.predict_row(eager, r, data.calls[i]) / float(r["meas_us"])))
    if graph_idx:
        graphs = ms.MeasuredCompute(device, prof, execution="graphs", cache="warm")
        for i in graph_idx:
            r = data.rows[i]
            res.append(graph_weight * math.log(mr.predict_row(graphs, r, data.calls[i]) / float(r["meas_graph_us"])))
    return np.asarray(res)


@dataclass
class GroupFit:
    """One group's least-squares result."""

    params: dict
    cost: float
    rows: int
    unconstrained: list[str]


def fit_group(params: dict, reference: Mapping[str, Any], device: str | DeviceSpec, data: Rows, group: str,
              graph_weight: float = 1.0, bounds: Mapping[str, tuple[float, float]] | None = None,
              loss: str = "linear", f_scale: float = 1.0, tol: float = 1e-8) -> GroupFit:
    """Least-squares fit of one group's parameters on its rows. ``bounds`` overrides the (lower,
    upper) bounds of some parameters; parameters the profile does not have (a backend that is
    ``same_as`` another) are left out."""
    from scipy.optimize import least_squares

    spec_dev = _device(device) if isinstance(device, str) else device
    spec = [(path, kind, *(bounds or {}).get(path, (lo, hi))) for path, kind, lo, hi in GROUPS[group]
            if _has(params, path)]
    idx = data.subset(lambda r: row_group(r["op"]) == group and r.get("meas_us") is not None)
    graph_idx = data.subset(lambda r: row_group(r["op"]) == group and r.get("meas_graph_us") is not None)
    params = copy.deepcopy(params)
    if not idx and not graph_idx:
        return GroupFit(params, 0.0, 0, [path for path, *_ in spec])

    def encode(p: dict) -> np.ndarray:
        return np.array([math.log(_get(p, path)) if kind == "log" else float(_get(p, path))
                         for path, kind, _, _ in spec])

    def decode(x: np.ndarray) -> dict:
        p = copy.deepcopy(params)
        for v, (path, kind, _, _) in zip(x, spec, strict=True):
            _set(p, path, float(math.exp(v)) if kind == "log" else float(v))
        return p

    lo = np.array([math.log(a) if kind == "log" else a for _, kind, a, _ in spec])
    hi = np.array([math.log(b) if kind == "log" else b for _, kind, _, b in spec])
    x0 = np.clip(encode(params), lo + 1e-9, hi - 1e-9)
    sol = least_squares(lambda x: _residuals(decode(x), reference, spec_dev, data, idx, graph_idx, graph_weight),
                        x0, bounds=(lo, hi), method="trf", diff_step=1e-4, x_scale=1.0, max_nfev=400,
                        loss=loss, f_scale=f_scale, ftol=tol, xtol=tol)
    jac = np.asarray(sol.jac)
    unconstrained = [path for j, (path, *_) in enumerate(spec) if not np.any(jac[:, j])]
    return GroupFit(decode(sol.x), float(sol.cost), len(idx) + len(graph_idx), unconstrained)


@dataclass
class FitResult:
    """A fitted profile (no provenance yet) and how the fit went: cost and rows per group, the
    parameters no measurement constrained (kept at their starting values), seconds taken."""

    profile: ms.ComputeProfile
    costs: dict[str, float]
    rows: dict[str, int]
    unconstrained: list[str]
    seconds: float


def fit_profile(rows: Rows | Sequence[Mapping[str, Any]], device: str | DeviceSpec,
                settings: FitSettings | None = None, log: Log | None = None) -> FitResult:
    """Fit a profile for ``device`` to measured ``rows`` (dicts with ``meas_us`` and optionally
    ``meas_graph_us``), group by group (:data:`GROUP_ORDER`), the matmul tile by grid search.
    The profile's ``executions`` are "eager", plus "graphs" when rows have CUDA-graph timings."""
    spec = _device(device) if isinstance(device, str) else device
    settings = settings or settings_for(spec)
    data = rows if isinstance(rows, Rows) else Rows(rows)
    say: Log = log or (lambda s: logger.info("%s", s))
    reference = settings.reference
    params = copy.deepcopy(thaw(settings.initial))
    # a backend without measurements (cuDNN on a CPU) takes flash's parameters
    att_rows = {r["op"].split("_")[1] for r in data.rows if r["op"].startswith("sdpa_") and r.get("meas_us") is not None}
    if att_rows and "flash" in att_rows:
        for backend in list(params["attention"]):
            if backend != "flash" and backend not in att_rows and "same_as" not in params["attention"][backend]:
                params["attention"][backend] = {"same_as": "flash"}
    t0 = time.perf_counter()
    costs: dict[str, float] = {}
    counts: dict[str, int] = {}
    unconstrained: list[str] = []

    def run(group: str, p: dict, bounds: Mapping[str, tuple[float, float]]) -> GroupFit:
        return fit_group(p, reference, spec, data, group, bounds=bounds, loss=settings.loss,
                         f_scale=settings.f_scale, tol=settings.tol)

    for group in GROUP_ORDER:
        if group != "matmul":
            res = run(group, params, settings.bounds)
            params = res.params
            extra = f" ({time.perf_counter() - t0:.1f} s)" if group == "memory" else ""
            if group == "attention":
                extra = f" (total {time.perf_counter() - t0:.1f} s)"
            say(f"{group}: cost {res.cost:.4f}{extra}" if res.rows else f"{group}: no rows, starting values kept")
        else:
            best: tuple[float, GroupFit] | None = None
            # a GEMM kernel takes at least as long as an empty (memory) kernel
            lat = params["launch"]["kernel_latency_us"]["memory"]
            mm_bounds = dict(settings.bounds)
            upper = mm_bounds.get("launch.kernel_latency_us.matmul", (0.0, 20.0))[1]
            mm_bounds["launch.kernel_latency_us.matmul"] = (lat, max(upper, lat + 1e-6))
            for tm in settings.tile_grid:
                for tn in settings.tile_grid:
                    trial = copy.deepcopy(params)
                    trial["matmul"]["tile_m"], trial["matmul"]["tile_n"] = tm, tn
                    got = run("matmul", trial, mm_bounds)
                    if not got.rows:
                        break
                    say(f"matmul tile {tm}x{tn}: cost {got.cost:.4f}")
                    if best is None or got.cost < best[0]:
                        best = (got.cost, got)
                if best is None:
                    break
            if best is None:
                res = GroupFit(params, 0.0, 0, [p for p, *_ in GROUPS["matmul"] if _has(params, p)])
                say("matmul: no rows, starting values kept")
            else:
                res = best[1]
            params = res.params
        costs[group] = res.cost
        counts[group] = res.rows
        unconstrained += res.unconstrained
    executions = ["eager"] + (["graphs"] if any(r.get("meas_graph_us") is not None for r in data.rows) else [])
    prof = ms.ComputeProfile(device=spec.name, params=_rounded(params), reference=reference,
                             executions=tuple(executions))
    return FitResult(prof, costs, counts, unconstrained, time.perf_counter() - t0)


def _rounded(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, float):
        return float(f"{x:.5g}")
    return x


# ----------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------
def fit_reports(profile: ms.ComputeProfile, rows: Sequence[Mapping[str, Any]], device: str | DeviceSpec,
                worst: int = 10) -> dict[str, dict[str, Any]]:
    """Predicted vs measured (:func:`costmodels.measurements.fit_report`) in the measurement
    condition, eager and (where the profile has them) CUDA graphs, and eager with the planner's
    default ``cache="cold"``."""
    out = {}
    for mode, fld, cache in (("eager", "meas_us", "warm"), ("graphs", "meas_graph_us", "warm"),
                             ("eager_cold", "meas_us", "cold")):
        execution = mode.split("_")[0]
        if execution not in profile.executions:
            out[mode] = {"rows": 0}
            continue
        model = ms.MeasuredCompute(device, profile, execution=execution, cache=cache)
        out[mode] = mr.fit_report(model, rows, measured=fld, worst=worst)
    return out


def summary(rep: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-sized summary of a :func:`costmodels.measurements.fit_report` (rounded; 5 worst rows)."""
    if not rep.get("rows"):
        return {"rows": 0}
    return {
        "rows": rep["rows"],
        "median_abs_rel_err": round(rep["median_abs_rel_err"], 4),
        "median_abs_log_err": round(rep["median_abs_log_err"], 4),
        "max_factor": round(rep["max_factor"], 3),
        "by_class": {k: {"rows": v["rows"], "median_abs_log_err": round(v["median_abs_log_err"], 4),
                         "max_factor": round(v["max_factor"], 3)} for k, v in rep["by_class"].items()},
        "worst": [{"row": w["row"], "meas_us": round(w["meas_us"], 2), "pred_us": round(w["pred_us"], 2),
                   "ratio": round(w["ratio"], 3)} for w in rep["worst"][:5]],
    }


# ----------------------------------------------------------------------------------------
# Measure the local device and fit
# ----------------------------------------------------------------------------------------
#: What fitted a profile made by :func:`calibrate_compute` (recorded in its provenance).
FITTED_BY = "apmodel calibrate-compute (costmodels.fitting: least squares on ln(pred/meas) by class)"


@dataclass
class Calibrated:
    """Result of :func:`calibrate_compute`: the measurement document (JSON-ready; schema
    :data:`costmodels.measurements.MEASUREMENTS_SCHEMA`), the fitted profile with provenance and fit
    summary, and the reports behind it."""

    measurements: dict[str, Any]
    profile: ms.ComputeProfile
    reports: dict[str, dict[str, Any]]
    fit: FitResult


def _host_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_share(host_processes: int, threads: int) -> float:
    """The share of a core each thread of ``host_processes`` processes of ``threads`` threads gets
    over a step on this host: 1 while there are cores enough, else cores / (processes × threads)
    (the scheduler's fair share). Kernel timings cannot see it (a short kernel runs within one time
    slice, at a whole core's speed); a step of several hundred milliseconds does."""
    return min(1.0, _host_cores() / max(1, host_processes * threads))


def load_like_calibration(*, quick: bool = False, threads: int | None = None) -> None:
    """Time the kernel set :func:`calibrate_compute` times, and discard the times: what the other
    processes of a host run while one of them calibrates, so that its kernels are timed with the
    host's cores and memory as busy as in a training step (every process computing at once). A
    profile fitted alone on a host whose step runs several processes prices that step too fast
    (the kernels of two processes on two cores share the memory bandwidth and the L3 cache)."""
    from . import kernel_timing as kt

    dev = kt.local_device()
    with kt.threads_set(threads):
        kt.measure_rows(kt.kernel_rows(dev.type, quick=quick), dev, quick=quick)


def calibrate_compute(*, quick: bool = False, device_name: str | None = None, threads: int | None = None,
                      measurements_name: str = "(not saved)",
                      progress: Callable[[int, int], None] | None = None,
                      log: Log | None = None, host_processes: int = 1) -> Calibrated:
    """Measure the kernel set of :func:`costmodels.kernel_timing.kernel_rows` on the local device
    (CUDA when present, else the CPU), then fit a profile for it.

    ``device_name``: the :func:`costmodels.device` name of the device (default: recognised from
    the GPU's name, "cpu" on a CPU). ``threads``: CPU threads for the measurement (default: torch's
    setting; recorded, a CPU profile holds for that many). ``progress(done, total)`` is called
    after each kernel of each timing pass. ``measurements_name`` is recorded in the profile's
    provenance. ``host_processes``: processes of this host timing the same kernels at the same time
    (this one included; the others run :func:`load_like_calibration`), recorded: the profile
    prices a step in which that many processes compute at once; where they have fewer cores than
    threads, the kernel times are divided by :func:`cpu_share` before the fit (recorded as
    ``cpu_share``).
    """
    from . import kernel_timing as kt

    say: Log = log or (lambda s: logger.info("%s", s))
    dev = kt.local_device()
    spec = kt.local_spec(dev, device_name)
    with kt.threads_set(threads) as n_threads:
        rows = kt.kernel_rows(dev.type, quick=quick)
        say(f"measuring {len(rows)} kernels on {kt.describe_device(dev)} ({spec.name}; "
            f"{'quick' if quick else 'full'} set; {n_threads} CPU threads)")
        measured, skipped = kt.measure_rows(rows, dev, quick=quick, progress=progress)
    share = cpu_share(host_processes, n_threads) if dev.type == "cpu" else 1.0
    if share < 1.0:  # oversubscribed: a kernel timed within one time slice ran at a whole core's speed
        say(f"{host_processes} processes of {n_threads} thread(s) on {_host_cores()} cores: each runs "
            f"{share:.2f} of the time; kernel times divided by that")
        measured = [{**r, "meas_us": r["meas_us"] / share} for r in measured]
    if skipped:
        say(f"skipped {len(skipped)} kernels the device cannot run (first: {skipped[0]['row']}: {skipped[0]['error']})")
    if not measured:
        raise RuntimeError("no kernel could be measured on this device")
    doc = kt.measurements_document(measured, skipped, dev, spec, quick=quick, threads=n_threads)
    sm_count = kt.parallel_units(dev, n_threads)
    cache = kt.cache_MiB(dev)
    settings = settings_for(spec, sm_count=sm_count, cache_MiB=cache)
    say(f"fitting a profile to {len(measured)} kernels")
    result = fit_profile(measured, spec, settings, log=lambda s: logger.debug("%s", s))
    reports = fit_reports(result.profile, measured, spec)
    prov = {
        "measurements": measurements_name,
        "device": doc["hardware"],
        "device_type": dev.type,
        "torch": doc["torch"],
        "software": doc["software"],
        "date": doc["date"],
        "method": doc["method"],
        "threads": n_threads,
        "host_processes": host_processes,
        "cpu_share": share,
        "kernel_set": "quick" if quick else "full",
        "fitted_by": FITTED_BY,
        "sources": {
            "reference": f"costmodels.device({spec.name!r}) (costmodels/hardware.py); sm_count: "
                         + ("CPU threads of the measurement" if dev.type == "cpu" else "the GPU's multiprocessor count"),
            "memory.l2_MiB": (f"L2 cache size from /sys/devices/system/cpu (fallback: {DEFAULT_CPU_L2_MIB:g} MiB)"
                              if dev.type == "cpu" else "torch.cuda.get_device_properties().L2_cache_size"),
        },
    }
    if dev.type == "cpu":
        prov["note"] = ("CPU: 'hbm' is the rate beyond the L2 cache (L3 and DRAM) and 'l2' the per-core L2; "
                        "rates are fitted, not datasheet; eager only (no CUDA graphs); measured after warming "
                        "the host allocator (steady state of a training loop), fresh outputs below its mmap "
                        "threshold")
    fit = {"condition": "cache warm (each measurement replays one op on the same buffers)",
           "eager": summary(reports["eager"]), "graphs": summary(reports["graphs"]),
           "rows_by_group": result.rows,
           "unconstrained": sorted(result.unconstrained),
           "unconstrained_note": "no measured kernel depends on these parameters: starting values kept"}
    profile = result.profile.replace(provenance=prov, fit=fit)
    return Calibrated(doc, profile, reports, result)


# ----------------------------------------------------------------------------------------
# Held-out checks
# ----------------------------------------------------------------------------------------
def prediction_report(model: Any, calls: Sequence[mr.Call], measured_us: Sequence[float],
                      factor: float = 1.5, worst: int = 10) -> dict[str, Any]:
    """Predicted (``model.time_us`` of each meta call) against measured µs: per call the factor
    ``max(pred/meas, meas/pred)``; overall the median factor, the largest, and the share of calls
    within ``factor``."""
    items: list[dict[str, Any]] = []
    for c, meas in zip(calls, measured_us, strict=False):
        pred = float(model.time_us(c.op, c.args, c.kwargs, c.out))
        items.append({"op": str(c.op), "shapes": [list(t.shape) for t in tensors_in(c.args)],
                      "meas_us": float(meas), "pred_us": pred,
                      "factor": max(pred / meas, meas / pred) if pred > 0 else math.inf})
    if not items:
        return {"ops": 0}
    factors: list[float] = sorted(float(it["factor"]) for it in items)
    return {"ops": len(items), "median_factor": mr.median_of_sorted(factors), "max_factor": factors[-1],
            "within": sum(f <= factor for f in factors) / len(factors), "factor": factor,
            "worst": sorted(items, key=lambda it: -it["factor"])[:worst], "items": items}

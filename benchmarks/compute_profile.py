"""Fit the measured compute model's profile to kernel timings, and report predicted vs measured.

    python benchmarks/compute_profile.py                 # evaluate the shipped h200 profile (fast)
    python benchmarks/compute_profile.py --fit           # refit, print the table, don't write
    python benchmarks/compute_profile.py --fit --write   # refit and rewrite costmodels/profiles/
                                                         #   h200.json and the derived h100_sxm.json
    python benchmarks/compute_profile.py --json -        # only the JSON report on stdout
    python benchmarks/compute_profile.py --execution graphs   # rows with CUDA-graph timings

The measurements are ``costmodels/profiles/<device>_kernels.json`` (or ``--measurements PATH``);
each row is turned into the ATen calls it ran (:func:`costmodels.measured.row_calls`) and priced by
:class:`costmodels.MeasuredCompute`. The fit is least squares on ``ln(predicted / measured)``,
by class, a few interpretable parameters each (see the module docstring of costmodels.measured):

1. memory-bound ops (eager and CUDA-graph timings): CPU floors, launch gap, kernel latency, HBM and
   L2 bandwidth, traffic factors;
2. embedding backward: fixed time and scatter bandwidth;
3. matmul: CPU floor, kernel latency, bf16 / fp32 rates, alignment efficiencies; CTA tile size by a
   grid search;
4. attention: per backend and pass the rate at head dim 128, head-dim half point, tail fraction,
   latency; the attention CPU floor and the harness's autograd.grad CPU time.

The table reports the median absolute relative error |pred/meas - 1|, the median absolute log
error, the largest factor and the worst rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import numpy as np  # noqa: E402

import costmodels as cm  # noqa: E402
from costmodels import measured as ms  # noqa: E402

#: L2 cache of the GH100 die (H100 SXM5 and H200): 50 MB ("NVIDIA H100 Tensor Core GPU
#: Architecture" whitepaper: "50 MB L2 cache"); NVIDIA's MB here is 2**20 bytes (nvidia-smi /
#: cudaDevAttrL2CacheSize report 52,428,800 B).
GH100_L2_MIB = 50.0
#: Streaming multiprocessors of an H100 SXM5 / H200 SXM (whitepaper: 132 SMs on the SXM5 part).
GH100_SXM_SM_COUNT = 132
#: CTA tile sizes tried for the matmul tile-quantisation term (cuBLAS Hopper kernels use 64-256).
TILE_GRID = (64, 128, 256)


def initial_params() -> dict[str, Any]:
    """Starting point of the fit (orders of magnitude read off the data; the fit moves them)."""
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
        *[(f"memory.traffic.{k}", "log", 0.5, 8.0) for k in ms.TRAFFIC_KINDS],
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


def _row_group(op: str) -> str:
    if op.startswith("mm") or op == "bmm":
        return "matmul"
    if op.startswith("sdpa_"):
        return "attention"
    if op == "embedding_dense_backward":
        return "embedding_backward"
    return "memory"


def _get(d: dict, path: str) -> Any:
    for part in path.split("."):
        d = d[part]
    return d


def _set(d: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        d = d[part]
    d[parts[-1]] = value


def reference_of(device: str) -> dict[str, Any]:
    spec = cm.device(device)
    return {"device": spec.name, "peak_tflops": dict(spec.peak_tflops), "hbm_TBps": spec.hbm_TBps,
            "sm_count": GH100_SXM_SM_COUNT}


class _Rows:
    """Measured rows with their ATen calls built once."""

    def __init__(self, rows: Sequence[dict]) -> None:
        self.rows = list(rows)
        self.calls = [ms.row_calls(r) for r in self.rows]

    def subset(self, pred: Callable[[dict], bool]) -> list[int]:
        return [i for i, r in enumerate(self.rows) if pred(r)]


def _profile(params: dict, reference: dict, device: str) -> ms.ComputeProfile:
    return ms.ComputeProfile(device=device, params=params, reference=reference)


def _residuals(params: dict, reference: dict, device: str, data: _Rows, idx: Sequence[int],
               graph_idx: Sequence[int], graph_weight: float) -> np.ndarray:
    prof = _profile(params, reference, device)
    res = []
    eager = ms.MeasuredCompute(device, prof, execution="eager", cache="warm")
    for i in idx:
        r = data.rows[i]
        res.append(math.log(ms.predict_row(eager, r, data.calls[i]) / float(r["meas_us"])))
    if graph_idx:
        graphs = ms.MeasuredCompute(device, prof, execution="graphs", cache="warm")
        for i in graph_idx:
            r = data.rows[i]
            res.append(graph_weight * math.log(ms.predict_row(graphs, r, data.calls[i]) / float(r["meas_graph_us"])))
    return np.asarray(res)


def fit_group(params: dict, reference: dict, device: str, data: _Rows, group: str,
              graph_weight: float = 1.0, bounds: dict[str, tuple[float, float]] | None = None) -> tuple[dict, float]:
    """Least-squares fit of one group's parameters on its rows; returns (params, cost).
    ``bounds`` overrides the (lower, upper) bounds of some parameters."""
    from scipy.optimize import least_squares

    spec = [(path, kind, *(bounds or {}).get(path, (lo, hi))) for path, kind, lo, hi in GROUPS[group]]
    idx = data.subset(lambda r: _row_group(r["op"]) == group)
    graph_idx = data.subset(lambda r: _row_group(r["op"]) == group and r.get("meas_graph_us") is not None)
    params = copy.deepcopy(params)

    def encode(p: dict) -> np.ndarray:
        return np.array([math.log(_get(p, path)) if kind == "log" else float(_get(p, path))
                         for path, kind, _, _ in spec])

    def decode(x: np.ndarray) -> dict:
        p = copy.deepcopy(params)
        for v, (path, kind, _, _) in zip(x, spec):
            _set(p, path, float(math.exp(v)) if kind == "log" else float(v))
        return p

    lo = np.array([math.log(a) if kind == "log" else a for _, kind, a, _ in spec])
    hi = np.array([math.log(b) if kind == "log" else b for _, kind, _, b in spec])
    x0 = np.clip(encode(params), lo + 1e-9, hi - 1e-9)
    sol = least_squares(lambda x: _residuals(decode(x), reference, device, data, idx, graph_idx, graph_weight),
                        x0, bounds=(lo, hi), method="trf", diff_step=1e-4, x_scale=1.0, max_nfev=400)
    return decode(sol.x), float(sol.cost)


def fit(data: _Rows, device: str, log: Callable[[str], None]) -> ms.ComputeProfile:
    reference = reference_of(device)
    params = initial_params()
    t0 = time.perf_counter()
    params, cost = fit_group(params, reference, device, data, "memory")
    log(f"memory: cost {cost:.4f} ({time.perf_counter() - t0:.1f} s)")
    params, cost = fit_group(params, reference, device, data, "embedding_backward")
    log(f"embedding_backward: cost {cost:.4f}")
    best: tuple[float, dict] | None = None
    for tm in TILE_GRID:
        for tn in TILE_GRID:
            trial = copy.deepcopy(params)
            trial["matmul"]["tile_m"], trial["matmul"]["tile_n"] = tm, tn
            # a GEMM kernel takes at least as long as an empty (memory) kernel
            lat = params["launch"]["kernel_latency_us"]["memory"]
            trial, cost = fit_group(trial, reference, device, data, "matmul",
                                    bounds={"launch.kernel_latency_us.matmul": (lat, 20.0)})
            log(f"matmul tile {tm}x{tn}: cost {cost:.4f}")
            if best is None or cost < best[0]:
                best = (cost, trial)
    assert best is not None
    params = best[1]
    params, cost = fit_group(params, reference, device, data, "attention")
    log(f"attention: cost {cost:.4f} (total {time.perf_counter() - t0:.1f} s)")
    return _profile(_rounded(params), reference, device)


def _rounded(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, float):
        return float(f"{x:.5g}")
    return x


def with_provenance(prof: ms.ComputeProfile, meas: dict, report: dict, report_graphs: dict,
                    measurements_name: str) -> ms.ComputeProfile:
    prov = {
        "measurements": measurements_name,
        "gpu": meas.get("gpu"), "software": meas.get("software"), "method": meas.get("method"),
        "fitted_by": "benchmarks/compute_profile.py --fit --write (least squares on ln(pred/meas) by class)",
        "sources": {
            "memory.l2_MiB": "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 50 MB L2 (GH100, also H200)",
            "reference.sm_count": "H100 SXM5 / H200 SXM: 132 SMs (NVIDIA H100 whitepaper)",
            "reference.peak_tflops/hbm_TBps": "costmodels/hardware.py (datasheets)",
        },
    }
    fit = {"condition": "cache warm (each measurement replays one op on the same buffers)",
           "eager": _summary(report), "graphs": _summary(report_graphs)}
    return prof.replace(provenance=prov, fit=fit)


def _summary(rep: dict) -> dict:
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


def print_table(rep: dict, title: str, worst: int, out: Any = None) -> None:
    out = sys.stdout if out is None else out
    print(f"\n{title}: {rep['rows']} rows, median |pred/meas-1| = {rep['median_abs_rel_err']:.1%}, "
          f"median |ln(pred/meas)| = {rep['median_abs_log_err']:.3f}, largest factor {rep['max_factor']:.2f}x",
          file=out)
    print(f"  {'class':<18} {'rows':>5} {'med|ln|':>8} {'max factor':>10}", file=out)
    for k, v in rep["by_class"].items():
        print(f"  {k:<18} {v['rows']:>5} {v['median_abs_log_err']:>8.3f} {v['max_factor']:>10.2f}", file=out)
    print(f"  worst {worst}:", file=out)
    print(f"  {'row':<58} {'meas µs':>10} {'pred µs':>10} {'pred/meas':>9}", file=out)
    for w in rep["worst"][:worst]:
        print(f"  {w['row'][:58]:<58} {w['meas_us']:>10.1f} {w['pred_us']:>10.1f} {w['ratio']:>9.2f}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="h200", help="device of the measurements (default h200)")
    ap.add_argument("--measurements", default=None, help="measurement JSON (default: the shipped copy)")
    ap.add_argument("--profile", default=None, help="profile to evaluate (default: the built-in one)")
    ap.add_argument("--fit", action="store_true", help="refit the profile from the measurements")
    ap.add_argument("--write", action="store_true",
                    help="with --fit: write <device>.json and the derived h100_sxm.json into --out")
    ap.add_argument("--out", default=str(ms.profiles_dir()), help="folder for --write")
    ap.add_argument("--execution", choices=ms.EXECUTIONS, default=None,
                    help="report only this mode (eager: meas_us, graphs: meas_graph_us)")
    ap.add_argument("--worst", type=int, default=10, help="worst rows to list")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="write the JSON report to PATH; '-' prints only the JSON on stdout")
    args = ap.parse_args(argv)

    quiet = args.json == "-"
    log = (lambda s: print(s, file=sys.stderr)) if quiet else print
    meas = ms.load_measurements(args.measurements, device=args.device)
    data = _Rows(meas["rows"])
    if args.fit:
        prof = fit(data, args.device, log)
    else:
        prof = ms.load_profile(args.profile) if args.profile else ms.builtin_profile(args.device)
        if prof is None:
            raise SystemExit(f"no built-in profile for {args.device!r}; run with --fit")
    # the measurements replay one op on the same buffers: predict them with cache="warm"; the
    # planner's default (cache="cold") is reported too, on the eager rows
    reports = {}
    for mode, field, cache in (("eager", "meas_us", "warm"), ("graphs", "meas_graph_us", "warm"),
                               ("eager_cold", "meas_us", "cold")):
        model = ms.MeasuredCompute(args.device, prof, execution=mode.split("_")[0], cache=cache)
        reports[mode] = ms.fit_report(model, data.rows, measured=field, worst=max(args.worst, 5))
    if args.fit:
        name = Path(args.measurements).name if args.measurements else f"{args.device}_kernels.json"
        prof = with_provenance(prof, meas, reports["eager"], reports["graphs"], name)
        if args.write:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{prof.device}.json").write_text(prof.dumps())
            log(f"wrote {out / (prof.device + '.json')}")
            if args.device == "h200":
                h100 = prof.scaled_to(cm.device("h100"))
                (out / f"{h100.device}.json").write_text(h100.dumps())
                log(f"wrote {out / (h100.device + '.json')} (derived by datasheet ratios)")
    modes = [args.execution] if args.execution else ["eager", "graphs"]
    if args.execution in (None, "eager"):
        modes.append("eager_cold")
    titles = {"eager": "eager, cache warm (meas_us)", "graphs": "CUDA graphs, cache warm (meas_graph_us)",
              "eager_cold": "eager, cache cold as planned (meas_us)"}
    if not quiet:
        for mode in modes:
            print_table(reports[mode], f"{args.device} {titles[mode]}", args.worst)
    result = {
        "device": args.device,
        "profile": prof.source or prof.device,
        "reports": {m: {**_summary(reports[m]), "worst": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in w.items()}
            for w in reports[m]["worst"][:args.worst]]} for m in modes},
        "params": prof.to_dict()["params"],
    }
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

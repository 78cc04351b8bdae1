"""Fit the measured compute model's profile to kernel timings, and report predicted vs measured.

    python benchmarks/compute_profile.py                 # evaluate the shipped h200 profile (fast)
    python benchmarks/compute_profile.py --fit           # refit, print the table, don't write
    python benchmarks/compute_profile.py --fit --write   # refit and rewrite costmodels/profiles/
                                                         #   h200.json and the derived h100_sxm.json
    python benchmarks/compute_profile.py --json -        # only the JSON report on stdout
    python benchmarks/compute_profile.py --execution graphs   # rows with CUDA-graph timings

The measurements are ``costmodels/profiles/<device>_kernels.json`` (or ``--measurements PATH``);
each row is turned into the ATen calls it ran (:func:`costmodels.measurements.row_calls`) and priced by
:class:`costmodels.MeasuredCompute`. The fit is :func:`costmodels.fitting.fit_profile` (least
squares on ``ln(predicted / measured)`` by class, see :mod:`costmodels.fitting`); this script is a
thin command line over it (``apmodel calibrate-compute`` is the other one: it measures the local
device first).

The table reports the median absolute relative error |pred/meas - 1|, the median absolute log
error, the largest factor and the worst rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import costmodels as cm  # noqa: E402
from costmodels import fitting  # noqa: E402
from costmodels import measured as ms  # noqa: E402
from costmodels import measurements as mr  # noqa: E402


def fit(data: fitting.Rows, device: str, log: Callable[[str], None]) -> ms.ComputeProfile:
    """Refit the profile of ``device`` (the H200 settings of :func:`costmodels.fitting.settings_for`)."""
    return fitting.fit_profile(data, device, fitting.settings_for(device), log=log).profile


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
           "eager": fitting.summary(report), "graphs": fitting.summary(report_graphs)}
    return prof.replace(provenance=prov, fit=fit)


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


def whole_steps(prof: ms.ComputeProfile, device: str) -> dict[str, Any] | None:
    """Measured / predicted for the whole steps shipped for ``device`` (eager, cache cold as planned)."""
    from costmodels import whole_steps as ws

    if not (ms.profiles_dir() / f"{device}_steps.json").is_file():
        return None
    model = ms.MeasuredCompute(device, prof)
    preds = [ws.predict_step(model, step) for step in ws.load_steps(device=device)]
    return {"spearman_distinct_calls": ws.spearman(preds),
            "steps": [{"case": p.step.case, "calls": p.step.n_calls, "measured_us": p.step.measured_us,
                       "predicted_us": p.predicted_us, "host_us": p.host_us, "gpu_us": p.gpu_us,
                       "bound": p.bound, "ratio": p.ratio, "spearman": ws.spearman([p])} for p in preds]}


def print_steps(steps: dict[str, Any]) -> None:
    print("\nwhole steps (forward + backward, eager bf16): measured / predicted")
    print(f"{'case':58s} {'calls':>5s} {'meas ms':>8s} {'pred ms':>8s} {'ratio':>6s} {'bound':>5s} {'rho':>5s}")
    for r in steps["steps"]:
        print(f"{r['case'][:58]:58s} {r['calls']:5d} {r['measured_us'] / 1e3:8.2f} {r['predicted_us'] / 1e3:8.2f} "
              f"{r['ratio']:6.3f} {r['bound']:>5s} {r['spearman']:5.2f}")
    print(f"Spearman over the distinct calls of all steps: {steps['spearman_distinct_calls']:.3f}")


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
    meas = mr.load_measurements(args.measurements, device=args.device)
    data = fitting.Rows(meas["rows"])
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
        reports[mode] = mr.fit_report(model, data.rows, measured=field, worst=max(args.worst, 5))
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
    steps = whole_steps(prof, args.device)
    if not quiet:
        for mode in modes:
            print_table(reports[mode], f"{args.device} {titles[mode]}", args.worst)
        if steps:
            print_steps(steps)
    result = {
        "steps": steps,
        "device": args.device,
        "profile": prof.source or prof.device,
        "reports": {m: {**fitting.summary(reports[m]), "worst": [
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

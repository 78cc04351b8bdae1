"""Table of modelled collective times and bus bandwidths by message size and mesh axis.

    python benchmarks/costmodels.py --mesh 4x8 --device h100
    python benchmarks/costmodels.py --mesh 8 --device h100 --kinds all_reduce --json costmodels.json
    python benchmarks/costmodels.py --mesh 8 --json | jq .rows[0]
    python benchmarks/costmodels.py --logs            # held to the published nccl-tests runs

``--logs [DIR]`` (default ``tests/data/nccl_published``) compares the model with every published
log listed in DIR/logs.json: measured / predicted per log (median, worst row) and per size class,
with NCCL's tuning table alone ("before"), with the defaults ("after"), and refitted without the
log itself ("held out": the fit on the other logs predicting this one).

Sizes are nccl-tests sizes (whole buffer); times in µs; bus bandwidth in GB/s (1e9 B/s),
computed as nccl-tests does. ``--calibration`` applies a saved calibration JSON.

``--json PATH`` prints the tables and writes the results to PATH as JSON (like the other
benchmark scripts); ``--json`` alone, or ``--json -``, prints only the JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# This file is named like the package; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import costmodels as cm  # noqa: E402


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _fmt_size(n: int) -> str:
    for unit, m in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= m:
            return f"{n / m:g} {unit}"
    return f"{n} B"


def run(mesh: tuple[int, ...], device: str, gpus_per_node: int, kinds: list[str],
        sizes: list[int], calibration: str | None = None) -> dict:
    topo = cm.Topology(mesh, cm.device(device), gpus_per_node=gpus_per_node)
    comm: cm.CommModel = cm.NCCLCollectives(topo)
    if calibration:
        comm = cm.CalibratedCollectives(comm, cm.Calibration.load(calibration))
    base = comm if isinstance(comm, cm.NCCLCollectives) else comm.base
    rows = []
    t0 = time.perf_counter()
    for axis, link in enumerate(topo.axes):
        for kind in kinds:
            for size in sizes:
                t = comm.time_us(kind, size, axis)
                choice = base.choose(kind, size, axis)
                busbw = 0.0 if t == 0 else size / (t * 1e3) * cm.bus_bandwidth_factor(kind, link.size)
                rows.append({"axis": axis, "axis_size": link.size, "nodes": link.nodes,
                             "kind": kind, "size_bytes": size, "time_us": t, "busbw_GBps": busbw,
                             "algorithm": choice.algorithm if choice else None,
                             "protocol": choice.protocol if choice else None})
    model_s = time.perf_counter() - t0
    return {"mesh": list(mesh), "device": topo.device.name, "gpus_per_node": gpus_per_node,
            "axes": [{"axis": i, "size": a.size, "nodes": a.nodes, "ranks_per_node": a.ranks_per_node,
                      "bandwidth_GBps": a.bandwidth_GBps, "bus_GBps": a.bus_GBps}
                     for i, a in enumerate(topo.axes)],
            "rows": rows, "model_s": model_s}


def run_published(directory: Path) -> dict:
    """Measured / predicted for every published log: NCCL's table, the defaults, held out."""
    from costmodels import nccl_fit

    logs = nccl_fit.load_published_logs(directory)
    t0 = time.perf_counter()
    before = nccl_fit.compare(logs, *nccl_fit.nccl_table_constants())
    after = nccl_fit.compare(logs)
    held_out = []
    for i in range(len(logs)):
        measured, net = nccl_fit.fit(logs[:i] + logs[i + 1:])
        held_out.extend(nccl_fit.compare([logs[i]], measured, net))
    fit_s = time.perf_counter() - t0

    def summary(c: "nccl_fit.LogComparison") -> dict:
        return {"median": c.median, "worst": c.worst, "classes": c.by_class()}

    rows = [{"id": log.id, "kind": log.log.kind, "gpu": log.gpu, "ranks": log.ranks, "nodes": log.nodes,
             "rows": len(log.log.rows), "source": log.source, "before": summary(b), "after": summary(a),
             "held_out": summary(h)}
            for log, b, a, h in zip(logs, before, after, held_out, strict=False)]
    return {"directory": str(directory), "logs": rows, "fit_s": fit_s}


def _print_published(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Collective model vs published nccl-tests runs (measured / predicted; > 1: "
                        "the model is optimistic)", title_justify="left")
    for col in ("log", "nodes x GPUs", "before med", "before worst", "after med", "after worst",
                "<=64KiB", "1-16MiB", ">=256MiB", "held-out med"):
        table.add_column(col, justify="left" if col == "log" else "right", min_width=42 if col == "log" else None)
    for r in result["logs"]:
        classes = r["after"]["classes"]
        table.add_row(r["id"], f"{r['nodes']}x{r['ranks'] // r['nodes']}",
                      f"{r['before']['median']:.2f}", f"{r['before']['worst']:.2f}",
                      f"{r['after']['median']:.2f}", f"{r['after']['worst']:.2f}",
                      *(f"{classes[c]:.2f}" if c in classes else "-" for c in ("<=64KiB", "1-16MiB", ">=256MiB")),
                      f"{r['held_out']['median']:.2f}")
    Console(width=max(Console().width, 160)).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="4x8", help="mesh shape, e.g. 8 or 4x8 (default 4x8)")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--kinds", default="all_gather,reduce_scatter,all_reduce,all_to_all",
                    help="comma-separated collective kinds")
    ap.add_argument("--min", default="8", help="smallest size (e.g. 8, 1K, 1M)")
    ap.add_argument("--max", default="1G", help="largest size")
    ap.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    ap.add_argument("--calibration", default=None, help="calibration JSON to apply")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write the results as JSON to PATH (tables still printed); "
                         "without PATH, or with -, print only the JSON object on stdout")
    ap.add_argument("--logs", nargs="?", const=str(_HERE.parent / "tests" / "data" / "nccl_published"),
                    default=None, metavar="DIR",
                    help="compare with the published nccl-tests logs listed in DIR/logs.json "
                         "(default: tests/data/nccl_published)")
    args = ap.parse_args(argv)
    if args.logs is not None:
        result = run_published(Path(args.logs))
        if args.json == "-":
            print(json.dumps(result))
            return 0
        if args.json is not None:
            Path(args.json).write_text(json.dumps(result, indent=1))
        _print_published(result)
        return 0

    try:
        mesh = tuple(int(x) for x in args.mesh.lower().split("x"))
    except ValueError:
        ap.error(f"--mesh {args.mesh!r}: expected axis sizes joined by 'x', e.g. 8 or 4x8")
    json_path = None if args.json in (None, "-") else Path(args.json)
    if json_path is not None and not json_path.parent.is_dir():  # fail before the work, not after
        ap.error(f"--json {args.json!r}: directory {str(json_path.parent)!r} does not exist")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in cm.KINDS:
            ap.error(f"unknown kind {k!r}; choose from {', '.join(cm.KINDS)}")
    sizes, s = [], _size(args.min)
    while s <= _size(args.max):
        sizes.append(s)
        s *= max(2, args.factor)
    result = run(mesh, args.device, args.gpus_per_node, kinds, sizes, args.calibration)
    if args.json == "-":
        print(json.dumps(result))
        return 0
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))

    from rich.console import Console
    from rich.table import Table

    console = Console()
    for ax in result["axes"]:
        table = Table(title=f"{result['device']} mesh {'x'.join(map(str, mesh))}: axis {ax['axis']} "
                            f"(size {ax['size']}, {ax['nodes']} node(s), {ax['ranks_per_node']}/node, "
                            f"ring bus {ax['bus_GBps']:.0f} GB/s)")
        table.add_column("size", justify="right")
        for k in kinds:
            table.add_column(f"{k} µs", justify="right")
            table.add_column("busbw GB/s", justify="right")
            table.add_column("algo", justify="left")
        by = {(r["kind"], r["size_bytes"]): r for r in result["rows"] if r["axis"] == ax["axis"]}
        for size in sizes:
            cells = [_fmt_size(size)]
            for k in kinds:
                r = by[(k, size)]
                cells += [f"{r['time_us']:.1f}", f"{r['busbw_GBps']:.1f}",
                          f"{r['algorithm']}/{r['protocol']}" if r["algorithm"] else "-"]
            table.add_row(*cells)
        console.print(table)
    if json_path is not None:
        console.print(f"results written to {json_path}", markup=False, highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

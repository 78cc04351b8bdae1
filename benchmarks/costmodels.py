"""Table of modelled collective times and bus bandwidths by message size and mesh axis.

    python benchmarks/costmodels.py --mesh 4x8 --device h100
    python benchmarks/costmodels.py --mesh 8 --device h100 --kinds all_reduce --json costmodels.json
    python benchmarks/costmodels.py --mesh 8 --json | jq .rows[0]

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
    args = ap.parse_args(argv)

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
        console.print(f"results written to {json_path}", markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

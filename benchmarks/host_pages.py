"""The first touch of fresh host pages, measured here against the CPU device's price.

    python benchmarks/host_pages.py                 # table
    python benchmarks/host_pages.py --json pages.json

Times ``torch.zeros`` of 8 to 64 MiB on one thread (median of ``--repeats``, after the host
allocator is warmed as a training loop's first step warms it: ``costmodels.kernel_timing.
warm_host_allocator``) and prices each on the built-in ``cpu`` device with and without its fresh
pages (``DeviceSpec.fresh_pages_from_bytes``). Blocks below glibc's mmap threshold (32 MiB) come
from the heap; from it up, every allocation maps fresh pages and the fill faults them in. The
fitted rate is the blocks' time from the threshold up, less the same bytes at the heap blocks'
fill rate; ``costmodels.hardware.CPU_FRESH_PAGES_GBPS`` is the figure the price uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import costmodels  # noqa: E402
from costmodels.hardware import CPU_FRESH_PAGES_GBPS, GLIBC_MMAP_THRESHOLD_MAX_BYTES  # noqa: E402
from costmodels.kernel_timing import warm_host_allocator  # noqa: E402

SIZES_MIB = (8, 16, 24, 31, 32, 48, 64)


def _median_ms(nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.zeros(nbytes // 4, dtype=torch.float32)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    warm_host_allocator()
    cpu = costmodels.device("cpu")
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib * 2**20
        rows.append({"MiB": mib, "measured_ms": _median_ms(nbytes, repeats),
                     "fresh_pages_priced_ms": cpu.fresh_pages_us(nbytes) / 1e3})
    heap = [r for r in rows if r["MiB"] * 2**20 < GLIBC_MMAP_THRESHOLD_MAX_BYTES]
    fresh = [r for r in rows if r["MiB"] * 2**20 >= GLIBC_MMAP_THRESHOLD_MAX_BYTES]
    heap_ms_per_mib = statistics.median(r["measured_ms"] / r["MiB"] for r in heap)
    fault_ms_per_mib = statistics.median((r["measured_ms"] - heap_ms_per_mib * r["MiB"]) / r["MiB"] for r in fresh)
    fitted = 2**20 / (fault_ms_per_mib * 1e-3) / 1e9
    return {"rows": rows, "heap_fill_ms_per_MiB": heap_ms_per_mib, "fresh_pages_GBps_measured": fitted,
            "fresh_pages_GBps_priced": CPU_FRESH_PAGES_GBPS, "measured_over_priced_time": CPU_FRESH_PAGES_GBPS / fitted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout only)")
    args = ap.parse_args(argv)
    result = measure(args.repeats)
    if args.json != "-":
        table = Table(title="torch.zeros on one thread: measured, and the fresh pages the cpu device prices")
        for col in ("MiB", "measured ms", "fresh pages priced ms"):
            table.add_column(col, justify="right")
        for r in result["rows"]:
            table.add_row(str(r["MiB"]), f"{r['measured_ms']:.2f}", f"{r['fresh_pages_priced_ms']:.2f}")
        console = Console()
        console.print(table)
        console.print(f"fresh pages: {result['fresh_pages_GBps_measured']:.2f} GB/s measured, "
                      f"{result['fresh_pages_GBps_priced']:.2f} GB/s priced")
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

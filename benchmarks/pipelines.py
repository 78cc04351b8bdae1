"""The README's pipeline tables in one run: each command planned with ``apmodel plan --json``, every
pipeline degree it priced read off its ``pipeline`` record.

    python benchmarks/pipelines.py                      # every run below (about 15 minutes here)
    python benchmarks/pipelines.py --only 405b-16x8x8   # the runs whose name starts so
    python benchmarks/pipelines.py --json pipelines.json

Each run is a separate ``apmodel plan`` process (a run's planning time is its own, wall clock,
imports included). Per run the table shows, per degree: the schedule it was priced under, the step
(µs), the bubble, the point-to-point time, each stage's weight sync, the peak per device on the
fullest rank and whether it fits; the chosen degree is marked. Degree 1 is the whole-mesh plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

logger = logging.getLogger("benchmarks.pipelines")

ROOT = Path(__file__).resolve().parent.parent

#: Common arguments of the H100 runs (8 GPUs per node, the pipeline on mesh axis 0).
_H100 = ("--device", "h100", "--gpus-per-node", "8", "--pp-axis", "0")
#: The runs, by name: ``apmodel plan`` arguments (``--json`` added).
RUNS: dict[str, tuple[str, ...]] = {
    "70b-4x8x8": ("--model", "llama3-70b", "--mesh", "4x8x8", *_H100, "--seq", "4096", "--batch", "64"),
    "70b-4x8x8-auto": ("--model", "llama3-70b", "--mesh", "4x8x8", *_H100, "--seq", "4096", "--batch", "64",
                       "--pp-schedule", "auto"),
    "405b-4x8x8": ("--model", "llama3-405b", "--mesh", "4x8x8", *_H100, "--seq", "4096", "--batch", "64",
                   "--pp-schedule", "auto"),
    "405b-4x8x8-ac": ("--model", "llama3-405b", "--mesh", "4x8x8", *_H100, "--seq", "4096", "--batch", "64",
                      "--pp-schedule", "auto", "--ac", "selective"),
    "405b-16x8x8": ("--model", "llama3-405b", "--mesh", "16x8x8", *_H100, "--seq", "8192", "--batch", "256",
                    "--pp-schedule", "auto"),
    "405b-16x8x8-ac": ("--model", "llama3-405b", "--mesh", "16x8x8", *_H100, "--seq", "8192", "--batch", "256",
                       "--pp-schedule", "auto", "--ac", "selective"),
    "dsv3-16x8x8": ("--model", "deepseek-v3", "--mesh", "16x8x8", *_H100, "--seq", "4096", "--batch", "256",
                    "--pp-schedule", "auto"),
    "70b-a100-8x8-ac": ("--model", "llama3-70b", "--mesh", "8x8", "--pp-axis", "0", "--device", "a100",
                        "--gpus-per-node", "8", "--seq", "4096", "--batch", "32", "--ac", "selective",
                        "--pp-schedule", "auto"),
    "70b-a100-8x8": ("--model", "llama3-70b", "--mesh", "8x8", "--pp-axis", "0", "--device", "a100",
                     "--gpus-per-node", "8", "--seq", "4096", "--batch", "32", "--pp-schedule", "auto"),
    **{f"70b-4x8x8-b{b}-m{m}": ("--model", "llama3-70b", "--mesh", "4x8x8", *_H100, "--seq", "4096", "--batch",
                                str(b), "--pp-degrees", "4", "--microbatches", str(m))
       for b in (64, 128) for m in (8, 16, 32)},
}


def run(name: str, args: tuple[str, ...]) -> dict[str, Any]:
    """One ``apmodel plan --json`` process: its pipeline record and wall time (seconds)."""
    cmd = [sys.executable, "-m", "apmodel.cli", "plan", *args, "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        logger.warning("%s failed (exit %d): %s", name, done.returncode, tail)
        return {"name": name, "command": "apmodel plan " + " ".join(args), "error": tail, "seconds": seconds}
    out = json.loads(done.stdout)
    pipe = out.get("pipeline") or {}
    degrees = []
    for alt in pipe.get("alternatives", []):
        degrees.append({k: alt.get(k) for k in ("degree", "schedule", "objective_us", "bubble_us", "p2p_us",
                                                "peak_bytes", "fits", "weight_sync", "stages", "note")})
    return {"name": name, "command": "apmodel plan " + " ".join(args), "seconds": seconds,
            "objective_us": out.get("objective_us"), "degree": pipe.get("degree"), "schedule": pipe.get("schedule"),
            "microbatches": pipe.get("microbatches"), "degrees": degrees}


#: The columns of one priced degree, in both tables.
COLUMNS = ("degree", "schedule", "stages (layers)", "step µs", "bubble", "p2p µs", "weights", "peak", "chosen")


def _cells(r: dict[str, Any], d: dict[str, Any]) -> list[str]:
    """One degree ``d`` of run ``r`` as the tables show it (:data:`COLUMNS`): the peak per device
    on the fullest rank, "over" past the memory limit; the chosen degree marked with its change
    against the whole-mesh plan."""
    base = next((x["objective_us"] for x in r["degrees"] if x["degree"] == 1), None)
    piped = d["degree"] > 1
    peak = "" if d["peak_bytes"] is None else f"{d['peak_bytes'] / 1e9:.1f} GB" + (" (over)" if d["fits"] is False
                                                                                  else "")
    mark = ""
    if d["degree"] == r["degree"]:
        gain = f" ({100 * (d['objective_us'] / base - 1):+.1f}%)" if base is not None and piped else ""
        mark = f"yes{gain}"
    return [str(d["degree"]), d.get("schedule") or "–", _stages(d), f"{d['objective_us']:,.0f}",
            f"{100 * (d['bubble_us'] or 0) / d['objective_us']:.1f}%" if piped else "–",
            f"{d['p2p_us'] or 0:,.0f}" if piped else "–", " ".join(s[0] for s in d.get("weight_sync") or []),
            peak, mark]


def _table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="pipeline degrees priced (µs per step; peak per device, fullest rank)")
    for col in ("run", *COLUMNS, "s"):
        table.add_column(col, justify="left" if col in ("run", "schedule", "stages (layers)", "weights") else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["name"], "", "", "", r["error"][:60], "", "", "", "", "", f"{r['seconds']:.1f}")
            continue
        for i, d in enumerate(r["degrees"]):
            table.add_row(r["name"] if i == 0 else "", *_cells(r, d), f"{r['seconds']:.1f}" if i == 0 else "")
    return table


def _stages(d: dict[str, Any]) -> str:
    stages = d.get("stages") or []
    if d["degree"] == 1 or not stages:
        return "no pipelining" if d["degree"] == 1 else ""
    if len(stages) > 4:
        sizes = [b - a + 1 for a, b in stages]
        return f"{len(stages)} stages of {min(sizes)}-{max(sizes)}"
    return ", ".join(f"{a}-{b}" for a, b in stages)


def markdown(results: list[dict[str, Any]]) -> str:
    """The README's table: a row per run and degree (:func:`_cells`), the chosen degree's step and
    mark in bold, then each run's command and planning seconds."""
    lines = ["| run | " + " | ".join(COLUMNS) + " |", "|---|---:|---|---|---:|---:|---:|---|---:|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | | | {r['error']} | | | | | |")
            continue
        for i, d in enumerate(r["degrees"]):
            cells = _cells(r, d)
            if d["degree"] == r["degree"]:  # bold: the step and the mark (its change left plain)
                cells[3] = f"**{cells[3]}**"
                cells[8] = "**yes**" + cells[8][len("yes"):]
            lines.append(f"| {r['name'] if i == 0 else ''} | " + " | ".join(cells) + " |")
    lines += ["", "```bash"]
    lines += [f"{r['command']} --json   # {r['name']}: {r['seconds']:.1f} s" for r in results]
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run names starting with this (repeatable)")
    parser.add_argument("--json", help="write the results here ('-' for stdout only)")
    parser.add_argument("--markdown", help="also write the README's table (markdown) here")
    parser.add_argument("--from-json", help="read the results of an earlier run instead of planning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.json and args.json != "-" and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: the directory {Path(args.json).resolve().parent} does not exist")
    names = [n for n in RUNS if not args.only or any(n.startswith(p) for p in args.only)]
    if not names:
        parser.error(f"--only {args.only}: no run matches; runs: {', '.join(RUNS)}")
    results = []
    if args.from_json:
        results = [r for r in json.loads(Path(args.from_json).read_text(encoding="utf-8")) if r["name"] in names]
    for name in names if not args.from_json else []:
        logger.info("%s: apmodel plan %s", name, " ".join(RUNS[name]))
        results.append(run(name, RUNS[name]))
        logger.info("%s: %.1f s", name, results[-1]["seconds"])
    if args.markdown:
        Path(args.markdown).write_text(markdown(results) + "\n", encoding="utf-8")
    if args.json != "-":
        Console(width=160).print(_table(results))
    if args.json:
        text = json.dumps(results, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text, encoding="utf-8")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

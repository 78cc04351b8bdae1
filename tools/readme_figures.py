"""Check or regenerate the README's planner figures from the commands that produce them.

    python tools/readme_figures.py --check          # exit 1, with the differences, if a figure is stale
    python tools/readme_figures.py                  # rewrite the stale figures in README.md
    python tools/readme_figures.py --only main-job  # one figure (--list names them)

Each figure names the ``apmodel plan`` runs it comes from and the README text it fills: the main
job's printed output (the whole block; its seconds line is the one part not compared, since it is
a timing), or numbers inside prose (a pattern whose groups are the figures). Only deterministic
figures live here (objectives, bytes, node and group counts: the same on every run of one torch
release); timings come from the benchmarks, each quoted with its command. ``.ci/run`` runs the
check.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: The main job, as the README's first command runs it.
MAIN_JOB = ("--model", "llama3-8b", "--mesh", "4x8", "--device", "h100", "--gpus-per-node", "8",
            "--seq", "2048", "--batch", "8")
#: Terminal width the README's printed output was taken at (rich wraps tables to it).
COLUMNS = 143
#: The line of the printed output that holds seconds (not compared by --check).
TIMING_LINE = re.compile(r"^│ trace / build / solve / total \(s\).*$", re.MULTILINE)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _pct(new: float, base: float, digits: int = 1) -> str:
    return f"{(new / base - 1) * 100:.{digits}f}"


@dataclass(frozen=True)
class ProseFigure:
    """Numbers in README prose: ``pattern`` (a regex matching once) has one group per figure;
    ``values`` reads them off the ``--json`` output of each run in ``runs`` (name -> CLI args)."""

    name: str
    runs: Mapping[str, tuple[str, ...]]
    pattern: str
    values: Callable[[Mapping[str, dict[str, Any]]], Sequence[str]]


@dataclass(frozen=True)
class BlockFigure:
    """A fenced ``text`` block that is a command's printed output, after the line ``heading``."""

    name: str
    argv: tuple[str, ...]
    heading: str


def _wrapped(pattern: str) -> str:
    """``pattern`` with each space matching any run of white space (the README's prose wraps)."""
    return pattern.replace(" ", r"\s+")


_AC = {"none": MAIN_JOB, **{p: (*MAIN_JOB, "--ac", p) for p in ("selective", "full")}}  # none: the default

FIGURES: tuple[ProseFigure | BlockFigure, ...] = (
    BlockFigure("main-job", MAIN_JOB, "## What the main job prints"),
    ProseFigure(
        "activation-checkpointing", _AC,
        r"saved activations (\S+) / (\S+) / (\S+)\s+GB per device, peak (\S+) / (\S+) / (\S+) GB, compute (\S+) / (\S+) / "
        r"(\S+) µs \(\+(\d+)% / \+(\d+)%;[^)]*\), objective \+(\S+)% / \+(\S+)%; (\S+) / (\S+) / (\S+)\s+nodes, "
        r"(\S+) / (\S+) / (\S+) groups",
        lambda j: [
            *(_gb(j[p]["memory"]["activations_bytes"]) for p in _AC),
            *(_gb(j[p]["memory"]["peak_bytes"]) for p in _AC),
            *(f"{j[p]['compute_us']:,.0f}" for p in _AC),
            *(_pct(j[p]["compute_us"], j["none"]["compute_us"], 0) for p in ("selective", "full")),
            *(_pct(j[p]["objective_us"], j["none"]["objective_us"]) for p in ("selective", "full")),
            *(f"{j[p]['nodes']:,}" for p in _AC),
            *(f"{j[p]['groups']:,}" for p in _AC),
        ]),
    ProseFigure(
        "mixed-precision",
        {"default": MAIN_JOB, "mixed": (*MAIN_JOB, "--mixed-precision"),
         "mixed+selective": (*MAIN_JOB, "--mixed-precision", "--ac", "selective")},
        _wrapped(r"runs, (\S+) nodes instead of (\S+), objective \(the step, with overlap\) (\S+) µs \(\+(\S+)%\), saved "
                 r"activations (\S+) GB instead of (\S+) \([^)]*\); with `--ac selective` (\S+) µs, activations (\S+) GB, "
                 r"peak (\S+) GB"),
        lambda j: [
            f"{j['mixed']['nodes']:,}", f"{j['default']['nodes']:,}", f"{j['mixed']['objective_us']:,.1f}",
            _pct(j["mixed"]["objective_us"], j["default"]["objective_us"]),
            _gb(j["mixed"]["memory"]["activations_bytes"]), _gb(j["default"]["memory"]["activations_bytes"]),
            f"{j['mixed+selective']['objective_us']:,.1f}", _gb(j["mixed+selective"]["memory"]["activations_bytes"]),
            _gb(j["mixed+selective"]["memory"]["peak_bytes"]),
        ]),
)


class Runner:
    """Runs ``apmodel plan`` once per distinct argument list (JSON or printed output)."""

    def __init__(self) -> None:
        self._done: dict[tuple[Any, ...], Any] = {}

    def _run(self, argv: tuple[str, ...]) -> str:
        env = {**os.environ, "COLUMNS": str(COLUMNS), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", "apmodel.cli", "plan", *argv], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"apmodel plan {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return proc.stdout

    def json(self, argv: tuple[str, ...]) -> dict[str, Any]:
        key = ("json", *argv)
        if key not in self._done:
            self._done[key] = json.loads(self._run((*argv, "--json")))
        return self._done[key]

    def printed(self, argv: tuple[str, ...]) -> str:
        key = ("text", *argv)
        if key not in self._done:
            self._done[key] = self._run(argv)
        return self._done[key]


def _block_span(text: str, heading: str) -> tuple[int, int]:
    """Start and end offsets of the first ```text block after ``heading`` (its contents only)."""
    at = text.index(heading)
    start = text.index("```text\n", at) + len("```text\n")
    return start, text.index("```", start)


def regenerate(text: str, figure: ProseFigure | BlockFigure, runner: Runner) -> str:
    """``text`` with ``figure`` as its commands print it now."""
    if isinstance(figure, BlockFigure):
        start, end = _block_span(text, figure.heading)
        return text[:start] + runner.printed(figure.argv) + text[end:]
    matches = list(re.finditer(figure.pattern, text))
    if len(matches) != 1:
        raise ValueError(f"figure {figure.name!r}: its pattern matches {len(matches)} places in the README, not 1")
    m = matches[0]
    values = list(figure.values({name: runner.json(argv) for name, argv in figure.runs.items()}))
    if len(values) != len(m.groups()):
        raise ValueError(f"figure {figure.name!r}: {len(values)} values for {len(m.groups())} groups")
    out, last = [], m.start()
    for i, value in enumerate(values, start=1):
        out += [text[last:m.start(i)], value]
        last = m.end(i)
    return text[:m.start()] + "".join(out) + text[last:]


def _comparable(text: str) -> str:
    return TIMING_LINE.sub("│ trace / build / solve / total (s) │ (a timing)", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale figures (exit 1 if any)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="this figure only (repeatable)")
    ap.add_argument("--list", action="store_true", help="name the figures and the runs they come from")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    known = {f.name: f for f in FIGURES}
    if args.list:
        for f in FIGURES:
            runs = [f.argv] if isinstance(f, BlockFigure) else list(f.runs.values())
            print(f.name + ": " + "; ".join("apmodel plan " + " ".join(r) for r in runs))
        return 0
    unknown = [n for n in args.only if n not in known]
    if unknown:
        ap.error(f"unknown figure(s) {unknown}; known: {sorted(known)}")
    text = args.readme.read_text(encoding="utf-8")
    runner = Runner()
    new = text
    stale = []
    for figure in (known[n] for n in args.only) if args.only else FIGURES:
        before = new
        new = regenerate(new, figure, runner)
        if _comparable(new) == _comparable(before):
            new = before  # current (a block's seconds line stays as measured)
        else:
            stale.append(figure.name)
            if args.check:
                diff = difflib.unified_diff(_comparable(before).splitlines(), _comparable(new).splitlines(),
                                            "README.md", f"README.md ({figure.name} now)", lineterm="", n=1)
                print("\n".join(diff))
    if args.check:
        if stale:
            print(f"stale figures: {', '.join(stale)} (python tools/readme_figures.py rewrites them)", file=sys.stderr)
        return 1 if stale else 0
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
    print(f"{args.readme}: rewrote {', '.join(stale) or 'nothing (every figure current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibration of a collective model against nccl-tests logs.

1. :func:`parse_nccl_tests` reads the table that ``all_gather_perf``, ``reduce_scatter_perf``,
   ``all_reduce_perf``, ``alltoall_perf`` (and ``broadcast_perf``) print::

       #       size    count   type  redop  root   time  algbw  busbw #wrong   time  algbw  busbw #wrong
       #        (B) (elements)                     (us) (GB/s) (GB/s)          (us) (GB/s) (GB/s)
               1024      256  float    sum    -1  12.34   0.08   0.15      0  12.01   0.09   0.15      0

   (out-of-place columns, then in-place). Lines starting with ``#`` are comments.
2. :meth:`Calibration.fit` computes, per (collective, mesh axis), the ratio of measured to
   modelled time at every logged size; the correction is piecewise linear in log2(size),
   interpolated between sizes and held constant beyond the ends.
3. :class:`CalibratedCollectives` multiplies any CommModel's times by the correction.

Calibrations are saved as versioned JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .collectives import KINDS, bus_bandwidth_factor

CALIBRATION_FORMAT = "apmodel.costmodels.calibration"
CALIBRATION_VERSION = 1

#: nccl-tests binary name -> our collective kind
NCCL_TESTS_BINARIES = {
    "all_gather_perf": "all_gather", "reduce_scatter_perf": "reduce_scatter",
    "all_reduce_perf": "all_reduce", "alltoall_perf": "all_to_all", "broadcast_perf": "broadcast",
}
_KIND_IN_TEXT = re.compile(r"(all_gather_perf|reduce_scatter_perf|all_reduce_perf|alltoall_perf|broadcast_perf)")
_RANK_LINE = re.compile(r"^#\s*Rank\s+\d+\s", re.IGNORECASE)


@dataclass(frozen=True)
class NcclTestsRow:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    oop_time_us: float
    oop_algbw_GBps: float
    oop_busbw_GBps: float
    ip_time_us: float
    ip_algbw_GBps: float
    ip_busbw_GBps: float
    line: int


@dataclass
class NcclTestsLog:
    kind: str | None
    ranks: int | None
    rows: list[NcclTestsRow] = field(default_factory=list)
    source: str = "<text>"


def _num(tok: str, what: str, lineno: int, src: str) -> float:
    try:
        return float(tok)
    except ValueError:
        raise ValueError(f"{src}: line {lineno}: {what} {tok!r} is not a number") from None


def _is_file(s: str) -> bool:
    try:
        return Path(s).is_file()
    except (OSError, ValueError):
        return False


def parse_nccl_tests(text_or_path: str | Path, kind: str | None = None) -> NcclTestsLog:
    """Parse an nccl-tests log (a path or the text itself).

    The collective kind is taken from ``kind``, else from the binary name in the text or
    the file name. A data line that does not have the expected columns raises ValueError
    naming its line number.
    """
    src = "<text>"
    if isinstance(text_or_path, Path) or (isinstance(text_or_path, str) and "\n" not in text_or_path
                                          and _is_file(text_or_path)):
        path = Path(text_or_path)
        src = str(path)
        text = path.read_text()
    else:
        text = str(text_or_path)
    if kind is None:
        m = _KIND_IN_TEXT.search(text) or _KIND_IN_TEXT.search(src)
        kind = NCCL_TESTS_BINARIES[m.group(1)] if m else None
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{src}: unknown collective kind {kind!r}")
    log = NcclTestsLog(kind=kind, ranks=None, source=src)
    ranks = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if _RANK_LINE.match(line):
                ranks += 1
            continue
        toks = line.split()
        # 13 columns with "root", 12 in old versions without it
        if len(toks) == 13:
            size, count, dtype, redop, root = toks[:5]
            rest = toks[5:]
        elif len(toks) == 12:
            size, count, dtype, redop = toks[:4]
            root, rest = "-1", toks[4:]
        else:
            raise ValueError(f"{src}: line {lineno}: expected 12 or 13 columns "
                             f"(size count type redop [root] time algbw busbw #wrong x2), "
                             f"got {len(toks)}: {line[:80]!r}")
        if not size.isdigit() or not count.isdigit():
            raise ValueError(f"{src}: line {lineno}: size/count must be integers, got {size!r} {count!r}")
        vals = [_num(t, name, lineno, src) for t, name in zip(
            (rest[0], rest[1], rest[2], rest[4], rest[5], rest[6]),
            ("out-of-place time", "out-of-place algbw", "out-of-place busbw",
             "in-place time", "in-place algbw", "in-place busbw"))]
        if vals[0] <= 0 or vals[3] <= 0:
            raise ValueError(f"{src}: line {lineno}: times must be > 0")
        log.rows.append(NcclTestsRow(int(size), int(count), dtype, redop, int(_num(root, "root", lineno, src)),
                                     vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], lineno))
    if not log.rows:
        raise ValueError(f"{src}: no data lines found (is this an nccl-tests log?)")
    log.ranks = ranks or None
    return log


def format_nccl_tests(kind: str, ranks: int, rows: Iterable[tuple[int, float]],
                      header: str = "", dtype: str = "float", itemsize: int = 4) -> str:
    """Write (size_bytes, time_us) rows in nccl-tests' table format (used to produce the
    synthetic example logs; ``header`` lines are emitted as ``#`` comments)."""
    binary = {v: k for k, v in NCCL_TESTS_BINARIES.items()}[kind]
    redop = "sum" if kind in ("all_reduce", "reduce_scatter") else "none"
    root = "0" if kind == "broadcast" else "-1"
    out = [f"# {line}" for line in header.splitlines()]
    out.append(f"# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 ({binary})")
    for r in range(ranks):
        out.append(f"#  Rank {r:2d} Group  0 Pid {1000 + r} on node0 device {r} [0x00] synthetic")
    out.append("#")
    out.append("#                                                              out-of-place                       in-place")
    out.append("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong")
    out.append("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)")
    fac = bus_bandwidth_factor(kind, ranks)
    for size, t in rows:
        elems = size // itemsize
        count = elems // ranks if kind in ("all_gather", "reduce_scatter", "all_to_all") else elems
        algbw = size / (t * 1e3)
        cols = f"{t:8.2f} {algbw:7.2f} {algbw * fac:7.2f} {0:6d}"
        out.append(f"{size:12d}  {count:12d}  {dtype:>8s}  {redop:>6s}  {root:>6s}  {cols}  {cols}")
    out.append("# Out of bounds values : 0 OK")
    return "\n".join(out) + "\n"


@dataclass
class CorrectionCurve:
    """Multiplicative correction, piecewise linear in log2(size), clamped at the ends."""

    log2_sizes: list[float]
    factors: list[float]

    def __post_init__(self) -> None:
        if len(self.log2_sizes) != len(self.factors) or not self.factors:
            raise ValueError("correction curve needs equally many (>=1) sizes and factors")
        if any(b <= a for a, b in zip(self.log2_sizes, self.log2_sizes[1:])):
            raise ValueError("correction curve sizes must be strictly increasing")
        if any(not (f > 0 and math.isfinite(f)) for f in self.factors):
            raise ValueError("correction factors must be finite and > 0")
        self._x = np.asarray(self.log2_sizes, dtype=float)
        self._y = np.asarray(self.factors, dtype=float)

    def __call__(self, nbytes: float) -> float:
        return float(np.interp(math.log2(max(nbytes, 1.0)), self._x, self._y))


class Calibration:
    """Per-(collective, axis) correction curves, fitted from nccl-tests logs."""

    def __init__(self, curves: dict[tuple[str, int], CorrectionCurve] | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self.curves: dict[tuple[str, int], CorrectionCurve] = dict(curves or {})
        self.meta: dict[str, Any] = dict(meta or {})

    def factor(self, kind: str, axis: int, nbytes: float) -> float:
        c = self.curves.get((kind, axis))
        return 1.0 if c is None else c(nbytes)

    @classmethod
    def fit(cls, base: Any, logs: Iterable[tuple[NcclTestsLog, int]], *,
            use: str = "out_of_place", min_bytes: int = 1) -> "Calibration":
        """Fit corrections of ``base`` (a CommModel) to ``(log, axis)`` pairs.

        ``use``: "out_of_place", "in_place" or "min" (of the two) measured time.
        """
        if use not in ("out_of_place", "in_place", "min"):
            raise ValueError(f"use must be 'out_of_place', 'in_place' or 'min', got {use!r}")
        points: dict[tuple[str, int], dict[int, list[float]]] = {}
        for log, axis in logs:
            if log.kind is None:
                raise ValueError(f"{log.source}: collective kind unknown; pass kind= to parse_nccl_tests")
            for r in log.rows:
                if r.size_bytes < min_bytes:
                    continue
                meas = {"out_of_place": r.oop_time_us, "in_place": r.ip_time_us,
                        "min": min(r.oop_time_us, r.ip_time_us)}[use]
                model = float(base.time_us(log.kind, r.size_bytes, axis))
                if model <= 0:
                    raise ValueError(f"{log.source}: line {r.line}: model time is 0 for "
                                     f"{log.kind} on axis {axis} (axis of size 1?)")
                points.setdefault((log.kind, axis), {}).setdefault(r.size_bytes, []).append(meas / model)
        curves = {}
        for key, by_size in points.items():
            sizes = sorted(by_size)
            facs = [float(np.exp(np.mean(np.log(by_size[s])))) for s in sizes]  # geometric mean
            curves[key] = CorrectionCurve([math.log2(s) for s in sizes], facs)
        return cls(curves, {"mesh_shape": list(getattr(base, "mesh_shape", []) or [])})

    # --- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "meta": self.meta,
            "curves": [{"kind": k, "axis": a, "log2_sizes": c.log2_sizes, "factors": c.factors}
                       for (k, a), c in sorted(self.curves.items())],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "<json>") -> "Calibration":
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"{source}: not a calibration file (field 'format' must be {CALIBRATION_FORMAT!r})")
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"{source}: unsupported calibration version {data.get('version')!r} "
                             f"(this code reads version {CALIBRATION_VERSION})")
        curves = {}
        for i, c in enumerate(data.get("curves", [])):
            try:
                kind, axis = c["kind"], int(c["axis"])
                if kind not in KINDS:
                    raise ValueError(f"unknown kind {kind!r}")
                curves[(kind, axis)] = CorrectionCurve([float(x) for x in c["log2_sizes"]],
                                                       [float(x) for x in c["factors"]])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{source}: curves[{i}]: {e}") from e
        return cls(curves, data.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        return cls.from_json(data, str(path))


class CalibratedCollectives:
    """Wraps a CommModel: ``time_us = base.time_us(...) x calibration.factor(...)``."""

    def __init__(self, base: Any, calibration: Calibration) -> None:
        self.base = base
        self.calibration = calibration
        self.mesh_shape = tuple(getattr(base, "mesh_shape", ()))
        self.topo = getattr(base, "topo", None)
        self.redistribution_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        t = self.base.time_us(kind, nbytes, axis)
        return t * self.calibration.factor(kind, axis, nbytes) if t else t

    def __repr__(self) -> str:
        return f"CalibratedCollectives({self.base!r}, {len(self.calibration.curves)} curves)"

"""Calibration of a collective model against nccl-tests logs.

1. :func:`parse_nccl_tests` reads the table that ``all_gather_perf``, ``reduce_scatter_perf``,
   ``all_reduce_perf``, ``alltoall_perf`` (and ``broadcast_perf``) print::

       #       size    count   type  redop  root   time  algbw  busbw #wrong   time  algbw  busbw #wrong
       #        (B) (elements)                     (us) (GB/s) (GB/s)          (us) (GB/s) (GB/s)
               1024      256  float    sum    -1  12.34   0.08   0.15      0  12.01   0.09   0.15      0

   (out-of-place columns, then in-place). Lines starting with ``#`` are comments.
2. :meth:`Calibration.fit` computes, per (collective, mesh axis), the ratio of measured to
   modelled time at every logged size; the correction is piecewise linear in log2(size),
   interpolated between sizes and held constant beyond the ends. A log must have been measured
   on as many ranks as the axis it is fitted for has (else :class:`CalibrationMismatch`).
3. :class:`CalibratedCollectives` multiplies any CommModel's times by the correction. It refuses
   curves fitted on a rank count other than the size of the axis they are applied to (unless
   ``allow_other_sizes=True``), and reports message sizes outside the measured range, which get
   the correction at the nearest measured size, once per (collective, axis).

Calibrations are saved as versioned JSON; each curve records the mesh shape, axis, rank count and
message-size range (bytes) it was fitted on.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .collectives import KINDS, bus_bandwidth_factor

logger = logging.getLogger(__name__)

CALIBRATION_FORMAT = "apmodel.costmodels.calibration"
#: 2: every curve records mesh_shape, ranks, min_bytes and max_bytes (version 1 files are still
#: read, see :meth:`Calibration.from_json`)
CALIBRATION_VERSION = 2

#: nccl-tests binary name -> our collective kind
NCCL_TESTS_BINARIES = {
    "all_gather_perf": "all_gather", "reduce_scatter_perf": "reduce_scatter",
    "all_reduce_perf": "all_reduce", "alltoall_perf": "all_to_all", "broadcast_perf": "broadcast",
}
_KIND_IN_TEXT = re.compile(r"(all_gather_perf|reduce_scatter_perf|all_reduce_perf|alltoall_perf|broadcast_perf)")
_KIND_IN_FILE_NAME = {kind: re.compile(rf"(?<![a-z]){pattern}(?![a-z])", re.IGNORECASE) for kind, pattern in (
    ("all_gather", "all_?gather"), ("reduce_scatter", "reduce_?scatter"), ("all_reduce", "all_?reduce"),
    ("all_to_all", "all_?to_?all"), ("broadcast", "broadcast"))}
_RANK_LINE = re.compile(r"^#\s*Rank\s+\d+\s", re.IGNORECASE)
#: the units line under the column names: "#  (B)  (elements)  (us)  (GB/s) ..."
_UNITS_LINE = re.compile(r"^#\s*\(B\)\s+\(elements\)")
#: what launchers put before each line of output: SkyPilot's "(head, rank=0, pid=3808) ",
#: Open MPI's --tag-output "[1,0]<stdout>:", srun -l's "0: "
_LAUNCHER_PREFIX = re.compile(r"^(?:\([^)]*\)\s*)?(?:\[\d+,\d+\]<std(?:out|err)>:\s*)?(?:\d+:\s+)?")


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


#: Collectives whose nccl-tests rows name a reduction (the redop column; "none" for the others).
_REDUCING = frozenset({"all_reduce", "reduce_scatter"})


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
    if isinstance(text_or_path, Path) or (isinstance(text_or_path, str) and "\n" not in text_or_path):
        # one line is a path (a log has a header and data lines): a missing file is named as such,
        # not parsed as log text
        path = Path(text_or_path)
        if not _is_file(str(path)):
            raise FileNotFoundError(f"nccl-tests log {str(path)!r} does not exist or is not a file "
                                    "(pass a path to a log, or the log's text itself)")
        src = str(path)
        text = path.read_text()
    else:
        text = str(text_or_path)
    m = _KIND_IN_TEXT.search(text) or _KIND_IN_TEXT.search(src)
    named = NCCL_TESTS_BINARIES[m.group(1)] if m else None
    if named is None and src != "<text>":  # a file named after its collective: "..._all_reduce.txt"
        in_name = {k for k, pat in _KIND_IN_FILE_NAME.items() if pat.search(Path(src).name)}
        named = in_name.pop() if len(in_name) == 1 else None
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{src}: unknown collective kind {kind!r}")
    if kind is not None and named is not None and named != kind:
        origin = m.group(1) if m else "its file name"
        raise ValueError(f"{src}: the log is from {origin} ({named}), not {kind}: fit it as {named} "
                         f"(--kind {named}) or give an nccl-tests log of {kind}")
    kind = kind or named
    log = NcclTestsLog(kind=kind, ranks=None, source=src)
    ranks = 0
    time_scale = 1.0  # to µs; the units line says "(us)" (or "(ms)" in a few builds)
    skipped = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _LAUNCHER_PREFIX.sub("", raw.strip(), count=1).strip()
        if not line:
            continue
        if line.startswith("#"):
            if _RANK_LINE.match(line):
                ranks += 1
            elif _UNITS_LINE.match(line):
                time_scale = 1e3 if "(ms)" in line else 1.0
            continue
        toks = line.split()
        if not toks[0].isdigit():
            # not a table row: "NCCL version ...", a shell prompt, the command, NCCL INFO lines
            skipped += 1
            continue
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
             "in-place time", "in-place algbw", "in-place busbw"), strict=True)]
        if vals[0] <= 0 or vals[3] <= 0:
            raise ValueError(f"{src}: line {lineno}: times must be > 0")
        vals[0] *= time_scale
        vals[3] *= time_scale
        log.rows.append(NcclTestsRow(int(size), int(count), dtype, redop, int(_num(root, "root", lineno, src)),
                                     vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], lineno))
    if not log.rows:
        raise ValueError(f"{src}: no data lines found (is this an nccl-tests log?)")
    if skipped:
        logger.debug("%s: %d line(s) that are neither comments nor table rows skipped", src, skipped)
    # the reduction column tells reducing collectives from the others when no binary is named
    reducing = {r.redop for r in log.rows} - {"none"}
    if kind in _REDUCING and not reducing:
        raise ValueError(f"{src}: {kind} was asked, but every row has redop 'none' (an all-gather, all-to-all or "
                         "broadcast log)")
    if kind is not None and kind not in _REDUCING and reducing:
        raise ValueError(f"{src}: {kind} was asked, but the rows reduce ({', '.join(sorted(reducing))}): an "
                         "all-reduce or reduce-scatter log")
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


#: Size classes (name, smallest and largest bytes, inclusive) in which fits are summarised:
#: latency-bound messages, the 1-16 MiB that per-layer weight gathers and activation collectives
#: move, and bandwidth-bound transfers.
SIZE_CLASSES: tuple[tuple[str, int, int], ...] = (
    ("<=64KiB", 0, 64 * 2**10), ("1-16MiB", 2**20, 16 * 2**20), (">=256MiB", 256 * 2**20, 2**62))


def size_class_medians(rows: Iterable[tuple[int, float]]) -> dict[str, float]:
    """Median of the values of (bytes, value) rows in each :data:`SIZE_CLASSES` class that has rows."""
    rows = list(rows)
    out = {}
    for name, lo, hi in SIZE_CLASSES:
        inside = [v for n, v in rows if lo <= n <= hi]
        if inside:
            out[name] = float(np.median(inside))
    return out


def measured_time_us(row: "NcclTestsRow", use: str) -> float:
    """A row's measured µs: ``use`` is "out_of_place", "in_place" or "min" (of the two)."""
    return {"out_of_place": row.oop_time_us, "in_place": row.ip_time_us,
            "min": min(row.oop_time_us, row.ip_time_us)}[use]


def _require_comm_model(where: str, base: Any) -> None:
    if not callable(getattr(base, "time_us", None)):
        raise TypeError(f"{where}: base must be a collective model with time_us(kind, nbytes, axis) "
                        f"(costmodels.NCCLCollectives), got {type(base).__name__}")


class CalibrationMismatch(ValueError):
    """A calibration or an nccl-tests log does not fit the mesh axis it is used for (rank count)."""


@dataclass
class CorrectionCurve:
    """Multiplicative correction, piecewise linear in log2(size), clamped at the ends.

    ``ranks`` and ``mesh_shape``: the axis size and mesh the curve was fitted on (``None`` when
    unknown: such a curve is applied to any axis). ``min_bytes``/``max_bytes``: the measured
    message-size range; default: the sizes of the first and last knot.
    """

    log2_sizes: list[float]
    factors: list[float]
    ranks: int | None = None
    mesh_shape: tuple[int, ...] | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if len(self.log2_sizes) != len(self.factors) or not self.factors:
            raise ValueError("correction curve needs equally many (>=1) sizes and factors")
        if any(b <= a for a, b in zip(self.log2_sizes, self.log2_sizes[1:], strict=False)):
            raise ValueError("correction curve sizes must be strictly increasing")
        if any(not (f > 0 and math.isfinite(f)) for f in self.factors):
            raise ValueError("correction factors must be finite and > 0")
        if self.ranks is not None:
            if not isinstance(self.ranks, (int, np.integer)) or self.ranks < 1:
                raise ValueError(f"correction curve ranks must be a positive integer, got {self.ranks!r}")
            self.ranks = int(self.ranks)
        if self.mesh_shape is not None:
            self.mesh_shape = tuple(int(n) for n in self.mesh_shape)
        # exact byte counts: 2 ** log2(size) need not round-trip to the integer size
        if self.min_bytes is None:
            self.min_bytes = round(2.0 ** self.log2_sizes[0])
        if self.max_bytes is None:
            self.max_bytes = round(2.0 ** self.log2_sizes[-1])
        if not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError(f"correction curve byte range {self.min_bytes} – {self.max_bytes} is empty")
        self._x = np.asarray(self.log2_sizes, dtype=float)
        self._y = np.asarray(self.factors, dtype=float)

    def __call__(self, nbytes: float) -> float:
        return float(np.interp(math.log2(max(nbytes, 1.0)), self._x, self._y))

    @property
    def byte_range(self) -> tuple[int, int]:
        """The measured message sizes (bytes), first and last; set by ``__post_init__``."""
        assert self.min_bytes is not None and self.max_bytes is not None
        return self.min_bytes, self.max_bytes


class Calibration:
    """Per-(collective, axis) correction curves, fitted from nccl-tests logs.

    :meth:`factor` clamps sizes outside a curve's measured range silently; the reporting of
    clamped sizes is :class:`CalibratedCollectives`' job.
    """

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
        """Fit corrections of ``base`` (a CommModel with ``mesh_shape``) to ``(log, axis)`` pairs.

        ``use``: "out_of_place", "in_place" or "min" (of the two) measured time. Every log must
        have run on as many ranks as ``base.mesh_shape[axis]``: a curve measured on 8 ranks says
        nothing reliable about a 4-rank axis (different ring length, maybe another fabric), so
        a mismatch, or a log that does not say its rank count, raises :class:`CalibrationMismatch`.
        """
        if use not in ("out_of_place", "in_place", "min"):
            raise ValueError(f"use must be 'out_of_place', 'in_place' or 'min', got {use!r}")
        mesh = tuple(int(n) for n in (getattr(base, "mesh_shape", None) or ()))
        _require_comm_model("Calibration.fit", base)
        logs = list(logs)
        for i, item in enumerate(logs):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], NcclTestsLog)
                    and isinstance(item[1], int) and not isinstance(item[1], bool)):
                raise TypeError(f"Calibration.fit: logs must be (NcclTestsLog, mesh axis) pairs such as "
                                f"[(parse_nccl_tests(path), 0)]; item {i} is {type(item).__name__} {item!r:.80}")
        points: dict[tuple[str, int], dict[int, list[float]]] = {}
        for log, axis in logs:
            if log.kind is None:
                raise ValueError(f"{log.source}: collective kind unknown; pass kind= to parse_nccl_tests")
            if not 0 <= axis < len(mesh):
                raise ValueError(f"{log.source}: axis {axis} is not an axis of mesh {mesh} "
                                 f"of the model being calibrated ({type(base).__name__})")
            if log.ranks is None:
                raise CalibrationMismatch(
                    f"{log.source}: the log does not say how many ranks it ran on (no '# Rank' lines); "
                    f"set log.ranks to fit it for axis {axis} of mesh {mesh} (size {mesh[axis]})")
            if log.ranks != mesh[axis]:
                raise CalibrationMismatch(
                    f"{log.source}: {log.kind} log ran on {log.ranks} ranks, but axis {axis} of mesh "
                    f"{mesh} has size {mesh[axis]}; measure on {mesh[axis]} ranks or fit for an axis "
                    f"of size {log.ranks}")
            for r in log.rows:
                if r.size_bytes < min_bytes:
                    continue
                meas = measured_time_us(r, use)
                model = float(base.time_us(log.kind, r.size_bytes, axis))
                if model <= 0:
                    raise ValueError(f"{log.source}: line {r.line}: model time is 0 for "
                                     f"{log.kind} on axis {axis} (axis of size 1?)")
                points.setdefault((log.kind, axis), {}).setdefault(r.size_bytes, []).append(meas / model)
        curves = {}
        for key, by_size in points.items():
            sizes = sorted(by_size)
            facs = [float(np.exp(np.mean(np.log(by_size[s])))) for s in sizes]  # geometric mean
            curves[key] = CorrectionCurve([math.log2(s) for s in sizes], facs, ranks=mesh[key[1]],
                                          mesh_shape=mesh, min_bytes=sizes[0], max_bytes=sizes[-1])
        return cls(curves, {"mesh_shape": list(mesh)})

    def fit_report(self, base: Any, logs: Iterable[tuple[NcclTestsLog, int]], *,
                   use: str = "out_of_place") -> list[dict[str, Any]]:
        """How well ``base`` and ``base`` calibrated by this fit reproduce each log, per size class.

        One row per (log, size class): ``before`` and ``after``, the median measured / predicted
        ratio without and with the calibration, and ``worse``: whether the calibrated model is
        further from 1 than the base (it can be where several logs of one collective and axis
        disagree and the fit averages them).
        """
        calibrated = CalibratedCollectives(base, self, allow_other_sizes=True)
        out = []
        for log, axis in logs:
            kind = log.kind
            if kind is None:
                raise ValueError(f"{log.source}: collective kind unknown; pass kind= to parse_nccl_tests")
            before = size_class_medians((r.size_bytes, measured_time_us(r, use) / base.time_us(kind, r.size_bytes, axis))
                                        for r in log.rows)
            after = size_class_medians((r.size_bytes, measured_time_us(r, use) / calibrated.time_us(kind, r.size_bytes, axis))
                                       for r in log.rows)
            for name in before:
                worse = abs(math.log(after[name])) > abs(math.log(before[name])) + 1e-9
                out.append({"source": log.source, "kind": kind, "axis": axis, "size_class": name,
                            "before": before[name], "after": after[name], "worse": worse})
        return out

    # --- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "meta": self.meta,
            "curves": [{"kind": k, "axis": a,
                        "mesh_shape": None if c.mesh_shape is None else list(c.mesh_shape),
                        "ranks": c.ranks, "min_bytes": c.min_bytes, "max_bytes": c.max_bytes,
                        "log2_sizes": c.log2_sizes, "factors": c.factors}
                       for (k, a), c in sorted(self.curves.items())],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "<json>") -> "Calibration":
        """Read a calibration written by :meth:`to_json` (version 2, or version 1).

        Version 1 files lack the per-curve fields; they are read with a fallback rather than
        refused, because they hold what the fields record: the size range is the first and
        last knot of each curve, and ``meta.mesh_shape`` is the mesh the curves were fitted
        against, so ``ranks`` is that mesh's axis size. What version 1 never checked is that a
        log ran on that many ranks; a warning says so. A version 1 file without a usable
        ``meta.mesh_shape`` is refused (refit it with ``apmodel calibrate``).
        """
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"{source}: not a calibration file (field 'format' must be {CALIBRATION_FORMAT!r})")
        version = data.get("version")
        if version not in (1, CALIBRATION_VERSION):
            raise ValueError(f"{source}: unsupported calibration version {version!r} "
                             f"(this code reads versions 1 and {CALIBRATION_VERSION})")
        meta = data.get("meta", {})
        curves = {}
        for i, c in enumerate(data.get("curves", [])):
            try:
                kind, axis = c["kind"], int(c["axis"])
                if kind not in KINDS:
                    raise ValueError(f"unknown kind {kind!r}")
                log2_sizes = [float(x) for x in c["log2_sizes"]]
                factors = [float(x) for x in c["factors"]]
                if version == 1:
                    curve = CorrectionCurve(log2_sizes, factors)  # range: the curve's ends
                    mesh = meta.get("mesh_shape") if isinstance(meta, dict) else None
                    if not isinstance(mesh, list) or not 0 <= axis < len(mesh):
                        raise ValueError(f"version 1 file without a mesh shape covering axis {axis} "
                                         f"(meta.mesh_shape = {mesh!r}); refit it with `apmodel calibrate`")
                    curve.mesh_shape = tuple(int(n) for n in mesh)
                    curve.ranks = curve.mesh_shape[axis]
                else:
                    mesh_shape = None if c["mesh_shape"] is None else tuple(int(n) for n in c["mesh_shape"])
                    ranks = None if c["ranks"] is None else int(c["ranks"])
                    curve = CorrectionCurve(log2_sizes, factors, ranks=ranks, mesh_shape=mesh_shape,
                                            min_bytes=int(c["min_bytes"]), max_bytes=int(c["max_bytes"]))
                    if mesh_shape is not None and ranks is not None and (
                            not 0 <= axis < len(mesh_shape) or mesh_shape[axis] != ranks):
                        raise ValueError(f"ranks {ranks} is not the size of axis {axis} of mesh_shape {list(mesh_shape)}")
                curves[(kind, axis)] = curve
            except KeyError as e:
                raise ValueError(f"{source}: curves[{i}]: missing field {e}") from e
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: curves[{i}]: {e}") from e
        if version == 1 and curves:
            logger.warning("%s: calibration version 1: rank counts and size ranges are taken from the mesh "
                           "shape and curve ends; the logs' own rank counts were never checked "
                           "(refit with `apmodel calibrate` to record them)", source)
        return cls(curves, meta)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        return cls.from_json(data, str(path))


class CalibratedCollectives:
    """Wraps a CommModel: ``time_us = base.time_us(...) x calibration.factor(...)``.

    A curve fitted on ``ranks`` ranks applies only to a mesh axis of that size (or one the
    base's mesh does not have): otherwise :class:`CalibrationMismatch`, unless
    ``allow_other_sizes`` (then a warning, and the curves are applied as they are). Curves
    without a recorded rank count, or a base without ``mesh_shape``, are not checked.

    Message sizes (bytes) outside a curve's measured range get the correction at the nearest
    measured size; the first such size per (kind, axis) logs a warning, and ``clamped[(kind,
    axis)]`` keeps the fitted range and the smallest / largest size requested outside it.
    """

    def __init__(self, base: Any, calibration: Calibration, *, allow_other_sizes: bool = False) -> None:
        if not isinstance(calibration, Calibration):
            raise TypeError(f"CalibratedCollectives: calibration must be a Calibration (Calibration.load(path) for a "
                            f"saved file), got {type(calibration).__name__}")
        _require_comm_model("CalibratedCollectives", base)
        self.base = base
        self.calibration = calibration
        self.mesh_shape = tuple(getattr(base, "mesh_shape", ()))
        self.topo = getattr(base, "topo", None)
        self.redistribution_cache = None
        self.allow_other_sizes = allow_other_sizes
        self.clamped: dict[tuple[str, int], dict[str, int | float]] = {}
        mismatches = self._mismatches()
        if mismatches and not allow_other_sizes:
            raise CalibrationMismatch("; ".join(mismatches) + ". Refit the calibration on this mesh, "
                                      "or pass allow_other_sizes=True to apply it anyway")
        for m in mismatches:
            logger.warning("%s; applied anyway (allow_other_sizes=True)", m)

    def _mismatches(self) -> list[str]:
        """One line per curve whose fitted rank count is not the size of its axis here."""
        if not self.mesh_shape:
            return []
        out = []
        for (kind, axis), c in sorted(self.calibration.curves.items()):
            if c.ranks is None:
                continue
            fitted = f"calibration of {kind} on axis {axis} was fitted on {c.ranks} ranks" + (
                f" (mesh {c.mesh_shape})" if c.mesh_shape is not None else "")
            if not 0 <= axis < len(self.mesh_shape):
                out.append(f"{fitted}, but mesh {self.mesh_shape} has no axis {axis}")
            elif self.mesh_shape[axis] != c.ranks:
                out.append(f"{fitted}, but axis {axis} of mesh {self.mesh_shape} has size {self.mesh_shape[axis]}")
        return out

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Base time (µs) times the correction for ``kind`` on ``axis`` at ``nbytes`` bytes."""
        t = self.base.time_us(kind, nbytes, axis)
        if not t:
            return t
        curve = self.calibration.curves.get((kind, axis))
        if curve is None:
            return t
        lo, hi = curve.byte_range
        if not lo <= nbytes <= hi:
            self._note_clamp(kind, axis, nbytes, curve)
        return t * curve(nbytes)

    def _note_clamp(self, kind: str, axis: int, nbytes: float, curve: CorrectionCurve) -> None:
        rec = self.clamped.get((kind, axis))
        if rec is None:
            lo, hi = curve.byte_range
            self.clamped[(kind, axis)] = {"fitted_min_bytes": lo, "fitted_max_bytes": hi,
                                          "requested_min_bytes": nbytes, "requested_max_bytes": nbytes}
            logger.warning("calibration of %s on axis %d was measured on %d – %d bytes; %s bytes is outside, "
                           "so the correction at the nearest measured size is used (further sizes outside "
                           "this range for %s on axis %d are not reported again)",
                           kind, axis, curve.min_bytes, curve.max_bytes, f"{nbytes:g}", kind, axis)
            return
        rec["requested_min_bytes"] = min(rec["requested_min_bytes"], nbytes)
        rec["requested_max_bytes"] = max(rec["requested_max_bytes"], nbytes)

    def __repr__(self) -> str:
        return f"CalibratedCollectives({self.base!r}, {len(self.calibration.curves)} curves)"

"""The collective model held to published nccl-tests runs, and the fit of its measured constants.

A *published log* is an nccl-tests log as it was posted, with what the post says about the
system (GPU, ranks, nodes, source) in a ``logs.json`` beside it. :func:`compare` prices every row
of every log with :class:`~costmodels.collectives.NCCLCollectives` on a 1-D mesh of the log's
rank count (``ranks / nodes`` GPUs per node) and returns measured / predicted ratios, per row, per
log and per size class; :func:`fit` chooses the :class:`~costmodels.collectives.MeasuredNccl`
constants and the network efficiency that minimise the squared log ratios over all logs, each
log weighted equally (so a 32-row log does not outvote a 3-row one). ``benchmarks/costmodels.py
--logs DIR`` prints both, with a leave-one-log-out refit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .calibration import SIZE_CLASSES as SIZE_CLASSES  # re-exported: the classes comparisons use
from .calibration import NcclTestsLog, measured_time_us, parse_nccl_tests, size_class_medians
from .collectives import MeasuredNccl, NCCLCollectives
from .hardware import NET_EFFICIENCY, RAW_NIC_EFFICIENCY, device
from .topology import Topology

#: The constants :func:`fit` varies, with their bounds: wide enough not to decide the result.
FITTED_FIELDS: tuple[tuple[str, float, float], ...] = (
    ("launch_us", 0.0, 40.0), ("ll_bw_fraction", 0.05, 0.5), ("nvls_latency_us", 0.0, 120.0),
    ("nvls_algbw_fraction", 0.4, 0.8), ("tree_algbw_ratio", 0.3, 1.0),
    ("all_to_all_bw_fraction", 0.5, 1.3), ("all_to_all_peer_us", 0.3, 20.0))
NET_EFFICIENCY_BOUNDS = (0.6, 1.0)


@dataclass(frozen=True)
class PublishedLog:
    """One nccl-tests run as posted: the parsed log and the system it ran on."""

    id: str
    log: NcclTestsLog
    gpu: str
    ranks: int
    nodes: int
    source: str
    column: str = "out_of_place"

    def measured_us(self) -> list[tuple[int, float]]:
        """(size in bytes, measured µs) of every row, from the column the post reports."""
        return [(r.size_bytes, measured_time_us(r, self.column)) for r in self.log.rows]


@dataclass(frozen=True)
class LogComparison:
    """Measured / predicted time of every row of one log (> 1: the model is optimistic)."""

    log: PublishedLog
    rows: tuple[tuple[int, float, float], ...]  # (bytes, measured µs, predicted µs)

    @property
    def ratios(self) -> list[float]:
        return [m / p for _, m, p in self.rows]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def worst(self) -> float:
        return max(self.ratios, key=lambda r: abs(math.log(r)))

    def by_class(self) -> dict[str, float]:
        """Median ratio in each size class (:data:`SIZE_CLASSES`) that has rows."""
        return size_class_medians((n, m / p) for n, m, p in self.rows)


def load_published_logs(directory: str | Path) -> list[PublishedLog]:
    """Read ``logs.json`` and the logs it lists from ``directory``.

    Each entry names its ``file``, the collective ``kind``, ``gpu`` (a device name), ``ranks``,
    ``nodes`` and ``source``; the log is read by :func:`parse_nccl_tests`, and its kind and rank
    count (where it prints ``# Rank`` lines) must agree with the entry.
    """
    directory = Path(directory)
    index = directory / "logs.json"
    try:
        entries = json.loads(index.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{index}: no logs.json in {directory} (it lists the logs and their systems)") from None
    out = []
    for i, e in enumerate(entries):
        try:
            log = parse_nccl_tests(directory / e["file"], kind=e["kind"])
            ranks, nodes = int(e["ranks"]), int(e["nodes"])
            if log.ranks is not None and log.ranks != ranks:
                raise ValueError(f"the log prints {log.ranks} Rank lines, the entry says ranks = {ranks}")
            if nodes < 1 or ranks % nodes:
                raise ValueError(f"ranks = {ranks} is not a multiple of nodes = {nodes}")
            log.ranks = ranks
            out.append(PublishedLog(str(e["id"]), log, str(e["gpu"]), ranks, nodes, str(e.get("source", "")),
                                    str(e.get("column", "out_of_place"))))
        except KeyError as err:
            raise ValueError(f"{index}: entry {i}: missing field {err}") from None
        except ValueError as err:
            raise ValueError(f"{index}: entry {i} ({e.get('id', '?')}): {err}") from None
    return out


def model_for(log: PublishedLog, measured: MeasuredNccl | None = None,
              net_efficiency: float = NET_EFFICIENCY) -> NCCLCollectives:
    """The collective model of the log's system: a 1-D mesh of its ranks, ranks / nodes per node."""
    topo = Topology((log.ranks,), device(log.gpu), gpus_per_node=log.ranks // log.nodes,
                    net_efficiency=net_efficiency)
    return NCCLCollectives(topo, measured=measured)


def compare(logs: Sequence[PublishedLog], measured: MeasuredNccl | None = None,
            net_efficiency: float = NET_EFFICIENCY) -> list[LogComparison]:
    """Measured / predicted for every row of every log under the given constants."""
    out = []
    for log in logs:
        comm = model_for(log, measured, net_efficiency)
        kind = log.log.kind
        assert kind is not None  # load_published_logs passes the entry's kind
        out.append(LogComparison(log, tuple((n, t, comm.time_us(kind, n, 0)) for n, t in log.measured_us())))
    return out


def nccl_table_constants() -> tuple[MeasuredNccl, float]:
    """NCCL's own tuning model with nothing measured added: the constants before the fit."""
    return MeasuredNccl.nccl_tuning_table(), RAW_NIC_EFFICIENCY


def fit(logs: Sequence[PublishedLog], start: MeasuredNccl | None = None) -> tuple[MeasuredNccl, float]:
    """The :data:`FITTED_FIELDS` and network efficiency that minimise the squared log ratios.

    Each log's rows weigh 1 / sqrt(rows), so every log counts equally; a soft-L1 loss keeps a
    noisy row (nccl-tests' first size often carries a warm-up) from pulling the fit.
    """
    from scipy.optimize import least_squares

    if not logs:
        raise ValueError("fit() needs at least one published log")
    start = start or MeasuredNccl()
    names = [f for f, _, _ in FITTED_FIELDS]
    x0 = [getattr(start, f) if getattr(start, f) is not None else 0.5 * (lo + hi) for f, lo, hi in FITTED_FIELDS]
    x0.append(NET_EFFICIENCY)
    lower = [lo for _, lo, _ in FITTED_FIELDS] + [NET_EFFICIENCY_BOUNDS[0]]
    upper = [hi for _, _, hi in FITTED_FIELDS] + [NET_EFFICIENCY_BOUNDS[1]]
    x0 = list(np.clip(x0, lower, upper))

    def with_values(x: Sequence[float] | np.ndarray) -> MeasuredNccl:
        changes: dict[str, Any] = {name: float(v) for name, v in zip(names, x, strict=False)}
        return dataclasses.replace(start, **changes)

    def residuals(x: np.ndarray) -> np.ndarray:
        measured = with_values(x[:-1])
        res: list[float] = []
        for cmp in compare(logs, measured, float(x[-1])):
            w = 1.0 / math.sqrt(len(cmp.rows))
            res.extend(w * math.log(r) for r in cmp.ratios)
        return np.asarray(res)

    # the loss has a local minimum where the tree loses to the ring everywhere; start on both sides
    tree = names.index("tree_algbw_ratio")
    best: Any = None
    for tree_start in (0.5, 0.8):
        x = list(x0)
        x[tree] = tree_start
        sol = least_squares(residuals, x, bounds=(lower, upper), loss="soft_l1", f_scale=0.1)
        if best is None or sol.cost < best.cost:
            best = sol
    return with_values(best.x[:-1]), float(best.x[-1])

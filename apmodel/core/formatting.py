"""One way to write numbers and strategies, shared by the terminal tables and the HTML report.

Torch-free at import (the command line's ``--help`` stays quick).
"""

from __future__ import annotations

import math
from typing import Any


def fmt_us(x: float | None) -> str:
    """A time in µs with thousands separators and one decimal; ``—`` for none or not finite."""
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:,.1f}"


def fmt_bytes(b: float | None) -> str:
    """A byte count in binary units (GiB, MiB, KiB, B); ``—`` for none."""
    if b is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b:.0f} B"


def strategy_str(strategy: Any) -> str:
    """``outputs ← inputs`` of a node strategy, placements as strings (``—`` for non-tensors)."""
    from apmodel.core import placements as pl

    def one(ps: Any) -> str:
        return ", ".join("—" if p is None else pl.tuple_to_str(p) for p in ps)

    return f"{one(strategy.outputs)} ← {one(strategy.inputs)}" if strategy.inputs else one(strategy.outputs)

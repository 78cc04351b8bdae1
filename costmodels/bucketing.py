"""Collectives merged into buckets: what one collective of a bucket costs.

A training program that buckets its collectives (FSDP2 and DDP do; apmodel's native lowering
merges runs of independent all-gathers, reduce-scatters and all-reduces of one process group and
dtype up to a size cap, with Inductor's bucketing passes) issues one collective per bucket. The
bucket pays the collective's fixed latency once, so a small collective inside it costs its share
of the bucket's time, not the time it would take alone.

:class:`BucketedCollectives` wraps a CommModel with that price. For a collective of ``nbytes``
merged into a bucket of ``bucket_bytes``::

    time_us = min(T(nbytes), nbytes / bucket_bytes * T(bucket_bytes))

where ``T`` is the wrapped model's time. A collective at least as large as the bucket pays its own
time (it fills buckets by itself). The share assumes the bucket fills: the caller gives the
bucket size the program reaches, e.g. the smaller of the program's cap and the bytes that kind of
collective moves in a step (all of a model's parameters, for FSDP's gathers of a small model).
Times are in µs, sizes in bytes.

:class:`SharedCollectives` prices collectives that serve several units of work at once (a pipeline
stage's weights, gathered and reduced once per step of ``shares`` microbatches) per unit.
"""

from __future__ import annotations

import math
from typing import Any

#: the kinds the bucketing passes merge (torch._inductor.fx_passes.bucketing has passes for these
#: three); all-to-all and broadcast are priced alone
BUCKETED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class BucketedCollectives:
    """A CommModel pricing ``BUCKETED_KINDS`` as their share of a ``bucket_bytes`` bucket.

    Args:
        base: the CommModel of one collective alone (``time_us(kind, nbytes, axis)``).
        bucket_bytes: the size (bytes) of the bucket a collective is merged into; > 0.
    """

    def __init__(self, base: Any, bucket_bytes: float) -> None:
        if not (bucket_bytes > 0 and math.isfinite(bucket_bytes)):
            raise ValueError(f"BucketedCollectives: bucket_bytes must be a finite number > 0, got {bucket_bytes!r}")
        self.base = base
        self.bucket_bytes = float(bucket_bytes)
        self.mesh_shape: tuple[int, ...] = tuple(base.mesh_shape)
        self.topo = getattr(base, "topo", None)
        # costmodels.redistribution keeps its caches on the comm object: these prices are not the
        # base's, so the caches must be this object's own
        self.redistribution_cache = None
        self.redistribution_matrix_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Time (µs) of one ``kind`` collective of ``nbytes`` bytes on mesh ``axis`` in a bucket."""
        alone = self.base.time_us(kind, nbytes, axis)
        if kind not in BUCKETED_KINDS or nbytes >= self.bucket_bytes:
            return alone
        share = nbytes / self.bucket_bytes * self.base.time_us(kind, self.bucket_bytes, axis)
        return min(alone, share)

    def __repr__(self) -> str:
        return f"BucketedCollectives({self.base!r}, bucket_bytes={self.bucket_bytes:.0f})"


class SharedCollectives:
    """A CommModel pricing every collective as its share of work it serves ``shares`` times: a
    pipeline stage gathers its parameters and reduces their gradients once per step, for all of
    its ``shares`` microbatches, so a plan of one microbatch prices them divided by ``shares``.

    Args:
        base: the CommModel of one collective (``time_us(kind, nbytes, axis)``).
        shares: how many units of work each collective serves; >= 1.
    """

    def __init__(self, base: Any, shares: float) -> None:
        if not (shares >= 1 and math.isfinite(shares)):
            raise ValueError(f"SharedCollectives: shares must be a finite number >= 1, got {shares!r}")
        self.base = base
        self.shares = float(shares)
        self.mesh_shape: tuple[int, ...] = tuple(base.mesh_shape)
        self.topo = getattr(base, "topo", None)
        self.redistribution_cache = None  # these prices are not the base's: caches of their own
        self.redistribution_matrix_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Time (µs) of one ``kind`` collective of ``nbytes`` bytes on mesh ``axis``, per share."""
        return self.base.time_us(kind, nbytes, axis) / self.shares

    def __repr__(self) -> str:
        return f"SharedCollectives({self.base!r}, shares={self.shares:g})"

"""Collectives whose output lands in fresh host pages: what a CPU process pays on top.

A collective allocates its output (functional collectives return a new tensor). On a host whose
allocator maps blocks from a threshold up afresh on every allocation (glibc's malloc, under
PyTorch's CPU allocator: :data:`costmodels.hardware.GLIBC_MMAP_THRESHOLD_MAX_BYTES`), writing a
large output first faults its pages in, at ``DeviceSpec.fresh_pages_GBps``. Timed collectives
(``costmodels.collective_timing``) reuse their buffers, so a calibration leaves that cost out, and
the compute model charges it for ops' outputs (``DeviceSpec.fresh_pages_us``); this wrapper charges
it for collectives' outputs. On a GPU (a caching allocator) the spec has no threshold and nothing
is added. Times in µs, sizes in bytes (nccl-tests sizes, as every CommModel takes them).
"""

from __future__ import annotations

from typing import Any

from .hardware import DeviceSpec


def output_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes of the output one rank allocates for a ``kind`` collective of nccl-tests size
    ``nbytes`` over ``ranks`` ranks. An all-to-all on a host mesh runs as DTensor runs it there (no
    gloo all-to-all): every rank gathers every rank's whole buffer, ``ranks`` times its size."""
    if kind == "reduce_scatter":
        return nbytes / ranks
    if kind == "all_to_all":
        return nbytes * ranks
    return nbytes


class FreshPageCollectives:
    """A CommModel adding the first touch of each collective's output
    (``spec.fresh_pages_us(output_bytes(...))``) to ``base``'s time.

    Args:
        base: the CommModel (``time_us(kind, nbytes, axis)``).
        spec: the device whose host allocator the outputs come from.
        mesh_shape: the mesh the axes index (ranks per axis).
    """

    def __init__(self, base: Any, spec: DeviceSpec, mesh_shape: tuple[int, ...]) -> None:
        self.base = base
        self.spec = spec
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.topo = getattr(base, "topo", None)
        # costmodels.redistribution caches prices on the comm object: these are not the base's
        self.redistribution_cache = None
        self.redistribution_matrix_cache = None

    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Time (µs) of one ``kind`` collective of ``nbytes`` on mesh ``axis``, its output's fresh pages included."""
        alone = self.base.time_us(kind, nbytes, axis)
        if alone == 0.0:  # an axis of one rank moves nothing
            return 0.0
        return alone + self.spec.fresh_pages_us(output_bytes(kind, nbytes, self.mesh_shape[axis]))

    def __repr__(self) -> str:
        return f"FreshPageCollectives({self.base!r}, {self.spec.name})"

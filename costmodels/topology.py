"""Mapping of device-mesh axes onto a cluster of nodes.

Ranks are numbered row-major over ``mesh_shape`` and filled into nodes of ``gpus_per_node``
consecutive ranks, so the innermost (last) mesh axes fill a node first. For each mesh axis
we look at the group of ranks that differ only in that axis' coordinate and count how many
nodes it spans:

* all ranks in one node        -> intra-node axis: fabric (NVLink/NVSwitch) bandwidth;
* one rank per node            -> inter-node axis: the NIC of one GPU;
* several ranks on several nodes -> mixed axis: a ring crosses each node boundary once per
  channel and NCCL spreads channels over the NICs of the ranks in the node, so the
  bottleneck is ``min(fabric, ranks_per_node x NIC)``.

Bandwidths are per GPU per direction in GB/s (1 GB/s = 1e9 B/s), latencies in µs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import NET_EFFICIENCY, DeviceSpec
from .hardware import device as _device


@dataclass(frozen=True)
class AxisLink:
    """Communication figures of one mesh axis."""

    index: int
    size: int               # ranks in one group along this axis
    nodes: int              # nodes one group spans
    ranks_per_node: int     # ranks of one group inside one node
    intra_GBps: float       # fabric line rate per GPU, one direction
    inter_GBps: float       # NIC line rate per GPU, one direction
    intra_latency_us: float  # extra latency per intra-node hop (on top of NCCL's table)
    inter_latency_us: float  # extra latency per inter-node hop (on top of NCCL's table)
    fabric_kind: str        # "nvswitch" | "nvlink" | "pcie" | "shm"
    nvls: bool              # NVLink SHARP usable (single node, NVSwitch gen 3+)
    ring_efficiency: float  # ring/Simple bus bandwidth / fabric line rate
    net_efficiency: float   # achievable / NIC line rate

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def bandwidth_GBps(self) -> float:
        """Bottleneck line rate per GPU for a ring over this axis, GB/s."""
        if self.nodes == 1:
            return self.intra_GBps
        return min(self.intra_GBps, self.ranks_per_node * self.inter_GBps)

    @property
    def bus_GBps(self) -> float:
        """Achievable ring bus bandwidth (Simple protocol), GB/s."""
        if self.nodes == 1:
            return self.intra_GBps * self.ring_efficiency
        return min(self.intra_GBps * self.ring_efficiency,
                   self.ranks_per_node * self.inter_GBps * self.net_efficiency)

    @property
    def latency_us(self) -> float:
        """Extra per-hop latency of the slowest link the axis uses, µs."""
        return self.inter_latency_us if self.nodes > 1 else self.intra_latency_us


class Topology:
    """``Topology(mesh_shape, device, gpus_per_node=8)``; every mesh axis gets its own
    :class:`AxisLink` (``topo.axis(i)``). Bandwidth/latency keyword arguments override the
    device's defaults (per GPU, one direction, GB/s; µs). ``strides``: the rank distance between
    neighbours along each axis, for a sub-mesh whose ranks are not numbered row-major over its own
    shape (default: row-major)."""

    def __init__(self, mesh_shape: tuple[int, ...] | list[int], device: DeviceSpec | str,
                 gpus_per_node: int = 8, *, intra_GBps: float | None = None,
                 intra_latency_us: float | None = None, inter_GBps: float | None = None,
                 inter_latency_us: float | None = None, nvls: bool | None = None,
                 net_efficiency: float = NET_EFFICIENCY, strides: tuple[int, ...] | None = None) -> None:
        shape = tuple(int(s) for s in mesh_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
        if strides is not None and (len(strides) != len(shape) or any(int(s) < 1 for s in strides)):
            raise ValueError(f"strides {strides!r}: expected one positive rank stride per mesh axis of {shape}")
        #: rank distance between neighbours along each axis: row-major over ``mesh_shape`` unless
        #: given (a sub-mesh of a larger mesh, e.g. the stage mesh of a pipeline, keeps its parent's)
        self.strides: tuple[int, ...] = (tuple(int(s) for s in strides) if strides is not None
                                         else tuple(math.prod(shape[i + 1:]) for i in range(len(shape))))
        if int(gpus_per_node) < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        self.mesh_shape: tuple[int, ...] = shape
        if not isinstance(device, (str, DeviceSpec)):
            raise TypeError(f"Topology: device must be a device name (\"h100\", \"h200\", ...) or a DeviceSpec, "
                            f"got {type(device).__name__}")
        self.device: DeviceSpec = _device(device) if isinstance(device, str) else device
        self.gpus_per_node = int(gpus_per_node)
        fab = self.device.fabric
        self.intra_GBps = float(intra_GBps if intra_GBps is not None else fab.GBps)
        self.inter_GBps = float(inter_GBps if inter_GBps is not None else self.device.nic_GBps)
        self.intra_latency_us = float(intra_latency_us if intra_latency_us is not None
                                      else fab.extra_latency_us)
        self.inter_latency_us = float(inter_latency_us if inter_latency_us is not None
                                      else self.device.nic_latency_us)
        nvls_ok = fab.nvls if nvls is None else bool(nvls)
        self.axes: tuple[AxisLink, ...] = tuple(
            self._make_axis(i, nvls_ok, net_efficiency) for i in range(len(shape)))

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def axis(self, i: int) -> AxisLink:
        if not isinstance(i, int) or not -len(self.axes) <= i < len(self.axes):
            raise ValueError(f"mesh axis {i!r} out of range for mesh {self.mesh_shape}")
        return self.axes[i]

    def _make_axis(self, i: int, nvls_ok: bool, net_eff: float) -> AxisLink:
        size = self.mesh_shape[i]
        stride = self.strides[i]
        # the group containing rank 0; every group has the same shape (row-major layout)
        nodes = len({(j * stride) // self.gpus_per_node for j in range(size)})
        ppn = max(1, size // nodes)
        fab = self.device.fabric
        return AxisLink(
            index=i, size=size, nodes=nodes, ranks_per_node=ppn,
            intra_GBps=self.intra_GBps, inter_GBps=self.inter_GBps,
            intra_latency_us=self.intra_latency_us, inter_latency_us=self.inter_latency_us,
            fabric_kind=fab.kind, nvls=nvls_ok and nodes == 1 and fab.kind == "nvswitch",
            ring_efficiency=fab.ring_efficiency, net_efficiency=net_eff)

    def __repr__(self) -> str:
        return (f"Topology(mesh_shape={self.mesh_shape}, device={self.device.name!r}, "
                f"gpus_per_node={self.gpus_per_node})")

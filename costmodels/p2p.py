"""Point-to-point transfers: one rank sends a buffer to one other rank (a pipeline stage handing
its activations to the next, or the gradients back).

NCCL runs a send/recv pair as one kernel on each side over the direct path between the two GPUs:
NVLink inside a node, the GPU's own NIC between nodes. The price is ``latency + nbytes / bandwidth``
with

* bandwidth: the link's line rate per GPU and direction times the efficiency the collective model
  uses for it: :attr:`AxisLink.ring_efficiency` on the intra-node fabric (NCCL's Simple protocol),
  :attr:`AxisLink.net_efficiency` on a NIC (both fitted to published nccl-tests logs, see
  :mod:`costmodels.collectives`);
* latency: the launch and handshake every NCCL kernel pays (:attr:`MeasuredNccl.launch_us`) plus
  one peer exchange of NCCL's point-to-point path (:attr:`MeasuredNccl.all_to_all_peer_us`, the
  per-peer latency fitted to the one-node all-to-all log, which NCCL runs as n-1 send/recv pairs)
  plus the link's extra latency.

Every pair of a pipeline boundary sends at once; each GPU has its own NIC (H100/H200 HGX nodes: one
400 Gb/s NIC per GPU), so pairs do not share bandwidth. Times in µs, sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import MeasuredNccl
from .topology import Topology

#: Peer-exchange latency (µs) when the measured model has none (NCCL's tuning table alone):
#: NCCL's ``hwLat[NET][Ring][Simple]`` from ``tuning.cc``, one network hop.
TABLE_PEER_LATENCY_US = 14.0


@dataclass(frozen=True)
class PeerLink:
    """The path between two ranks: whether it leaves the node, its bandwidth and extra latency."""

    inter_node: bool
    GBps: float
    """achievable bandwidth, GB/s (1 GB/s = 1e3 bytes per µs), one direction"""
    latency_us: float
    """launch, one peer exchange and the link's extra latency, µs"""


def peer_link(topo: Topology, src: int, dst: int, measured: MeasuredNccl | None = None) -> PeerLink:
    """The link between global ranks ``src`` and ``dst`` of ``topo`` (ranks fill nodes of
    ``topo.gpus_per_node`` consecutive ranks, as :class:`Topology` assumes). ``measured``: the
    collective model's fitted constants (default: :class:`MeasuredNccl`'s)."""
    if src == dst:
        raise ValueError(f"peer_link: ranks {src} and {dst} are the same rank")
    m = measured or MeasuredNccl()
    peer = m.all_to_all_peer_us if m.all_to_all_peer_us is not None else TABLE_PEER_LATENCY_US
    launch = 0.0 if topo.device.arch == "cpu" else m.launch_us  # as NCCLCollectives: no GPU kernel on a CPU
    if src // topo.gpus_per_node != dst // topo.gpus_per_node:
        return PeerLink(True, topo.inter_GBps * topo.axes[0].net_efficiency, launch + peer + topo.inter_latency_us)
    return PeerLink(False, topo.intra_GBps * topo.device.fabric.ring_efficiency, launch + peer + topo.intra_latency_us)


def send_recv_us(nbytes: float, link: PeerLink) -> float:
    """µs to move ``nbytes`` from one rank to another over ``link`` (0 for nothing to send)."""
    if nbytes <= 0:
        return 0.0
    return link.latency_us + nbytes / (link.GBps * 1e3)

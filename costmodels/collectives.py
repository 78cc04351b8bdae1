"""NCCL-like collective cost model.

For one collective over one mesh axis we price every (algorithm, protocol) pair NCCL could
use -- ring, tree, NVLS (NVLink SHARP, single-node NVSwitch) and PAT (one rank per node)
crossed with the LL, LL128 and Simple protocols -- as ``latency + nbytes / algbw`` and
take the fastest, as NCCL's tuner does (``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime`` in
NCCL's ``src/graph/tuning.cc``). The structure and the constants below (base latencies,
per-hop hardware latencies, protocol bandwidth fractions and caps) are facts published in
that file (NCCL 2.2x); the code is our own and simplified: no channel counts (we start
from the achievable ring bus bandwidth of the axis instead), no tree correction table, no
CollNet.

``nbytes`` is the whole buffer as nccl-tests reports its "size": the gathered output of
all_gather, the input of reduce_scatter, the (per-rank) buffer of all_reduce, broadcast and
all_to_all. Times are in µs. Bandwidths in GB/s = 1e9 B/s = 1e3 B/µs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .topology import AxisLink, Topology

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")

# --- protocols / algorithms --------------------------------------------------------------
LL, LL128, SIMPLE = "LL", "LL128", "Simple"
PROTOCOLS = (LL, LL128, SIMPLE)
RING, TREE, NVLS, PAT = "ring", "tree", "nvls", "pat"

# NCCL tuning.cc, baseLat[algo][proto] (µs): Tree {6.8, 14.0, 8.4}, Ring {6.6, 14.0, 8.4},
# NVLS {0, 0, 0}.
BASE_LATENCY_US = {
    TREE: {LL: 6.8, LL128: 14.0, SIMPLE: 8.4},
    RING: {LL: 6.6, LL128: 14.0, SIMPLE: 8.4},
    NVLS: {SIMPLE: 0.0},
}
# NCCL tuning.cc, hwLat[hw][algo][proto] (µs per hop):
#   NVLINK: Tree {.6, 1.25, 4.0}, Ring {.6, 1.9, 3.4}, NVLS {0, 0, 25}
#   PCI:    Tree {1.0, 1.9, 4.0}, Ring {1.0, 2.5, 5.7}
#   NET:    Tree {5.0, 8.5, 14},  Ring {2.7, 4.0, 14.0}, NVLS {0, 0, 18}
HW_LATENCY_US = {
    "nvlink": {TREE: {LL: 0.6, LL128: 1.25, SIMPLE: 4.0}, RING: {LL: 0.6, LL128: 1.9, SIMPLE: 3.4}},
    "pci": {TREE: {LL: 1.0, LL128: 1.9, SIMPLE: 4.0}, RING: {LL: 1.0, LL128: 2.5, SIMPLE: 5.7}},
    "net": {TREE: {LL: 5.0, LL128: 8.5, SIMPLE: 14.0}, RING: {LL: 2.7, LL128: 4.0, SIMPLE: 14.0},
            NVLS: {SIMPLE: 18.0}},
}
HW_LATENCY_US_NVLS = 25.0  # NCCL tuning.cc hwLat[NVLINK][NVLS][Simple]
# NCCL tuning.cc getNetOverhead(): 1 µs per network step on x86 Intel (2 on AMD), x3 for
# Simple. Inter-node rings pay max(intra hop latency, this) on their intra-node steps.
NET_OVERHEAD_US = 1.0
NET_OVERHEAD_SIMPLE_FACTOR = 3.0

# Protocol bandwidth fractions (NCCL tuning.cc "model refinements"):
#: LL sends 8-byte lines of 4 B data + 4 B flag: ring busBw * .5, capped at llMaxBw.
LL_BW_FRACTION = 0.5
#: Tree bus bandwidth -> algorithm bandwidth in NCCL's model: every byte goes up and down the tree.
TREE_ALGBW_RATIO = 0.5
#: NVLS all-reduce algorithm bandwidth / NVLink line rate before the fit: published 8 x H100 NVLS
#: all-reduce reaches ~275 GB/s algbw on 450 GB/s links (NVIDIA/nccl-tests issue #212), 0.61.
NVLS_ALGBW_FRACTION_PUBLISHED = 0.60
#: LL128 sends 128-byte lines with 120 B of data; NCCL uses 0.92 ("120.0/128.0").
LL128_BW_FRACTION = 0.92
#: Tree all-reduce: busBw * .92; tree LL: busBw / 3.8; tree LL128 (single node): 7/9.
TREE_BW_FRACTION = 0.92
TREE_LL_BW_FRACTION = 1.0 / 3.8
TREE_LL128_BW_FRACTION_1NODE = 7.0 / 9.0
TREE_LL128_BW_FRACTION_NNODE = 120.0 / 128.0
#: PAT (all-gather/reduce-scatter with one rank per node): busBw * .75.
PAT_BW_FRACTION = 0.75
# NCCL tuning.cc llMaxBws (GB/s, total over channels): single node by GPU generation,
# multi-node by CPU (Intel row: 39.0 for 2 nodes, 20.4 for more).
LL_MAX_BUS_GBPS_1NODE = {"ampere": 87.7, "hopper": 141.0, "blackwell": 2 * 141.0, "cpu": 20.0}
LL_MAX_BUS_GBPS_2NODES = 39.0
LL_MAX_BUS_GBPS_NNODES = 20.4


@dataclass(frozen=True)
class MeasuredNccl:
    """What NCCL's tuning table leaves out, fitted to published nccl-tests runs.

    The defaults are :func:`costmodels.nccl_fit.fit` over the nine logs in
    ``tests/data/nccl_published/`` (one node of 8 H100 over NVSwitch: all-reduce, all-gather,
    reduce-scatter, all-to-all in bf16, all-reduce in fp32; 2 and 4 nodes of 8 H100 over 400 Gb/s
    InfiniBand, all-reduce; 2 nodes of 8 H200 over RoCE, all-reduce and all-gather), rounded.
    Each comment names the logs that decide the value; ``python benchmarks/costmodels.py --logs``
    reprints the fit, per log, with a leave-one-log-out refit. All logs are Hopper runs: Ampere and
    Blackwell use the same values, an assumption until their logs are fitted.
    """

    #: µs every GPU collective pays on top of the algorithm's latency: the kernel launch and the
    #: ranks' handshake, which nccl-tests' times include and NCCL's tuner leaves out. Decided by
    #: the smallest sizes of the 2-node logs (25 µs at 8-128 B, 28 µs at 1 KiB) and the one-node
    #: 1 MiB rows (43-47 µs).
    launch_us: float = 10.0
    #: LL's bus bandwidth as a fraction of the ring's (NCCL's model: 0.5, 4 B of data per 8 B line;
    #: the tree's LL is scaled by the same measured / NCCL ratio).
    #: The 64 KiB-1 MiB rows of the 2-node logs, and the one-node 1 MiB rows, which LL at 0.5 would
    #: make 2.5x faster than measured.
    ll_bw_fraction: float = 0.07
    #: NVLS all-reduce latency (µs) and algorithm bandwidth / NVLink line rate: the one-node H100
    #: all-reduce logs from 16 MiB up (algbw 265-273 GB/s on 450 GB/s links at >= 1 GiB).
    nvls_latency_us: float = 34.2
    nvls_algbw_fraction: float = 0.57
    #: multi-node tree all-reduce: algorithm bandwidth / tree bus bandwidth. NCCL's model says 0.5
    #: (every byte goes up and down the tree); on 2 nodes the tree is a chain whose up and down
    #: traffic use opposite directions of each link (NVLSTree on Hopper): the 2-node H100 IB and
    #: H200 RoCE all-reduce logs reach algbw 250-260 GB/s, above any ring over the same NICs.
    tree_algbw_ratio: float = 0.84
    #: most nodes on which the tree's LL128 and Simple protocols are priced (LL always is): the
    #: 4-node H100 all-reduce follows the ring (LL128, then Simple) from 2 MiB to 8 GiB, where the
    #: tree would be 1.5-2.5x faster than measured.
    tree_max_nodes: int = 2
    #: all-to-all (NCCL point-to-point, no tuner): bus bandwidth / ring bus bandwidth, and the
    #: latency (µs) of each of the n-1 peer exchanges: the one-node H100 all-to-all log (75 µs
    #: flat from 1 to 8 MiB, 395 GB/s algbw at 8 GiB).
    all_to_all_bw_fraction: float = 0.95
    all_to_all_peer_us: float | None = 6.5

    @classmethod
    def nccl_tuning_table(cls) -> "MeasuredNccl":
        """NCCL's tuning model alone: no launch, NCCL's LL, NVLS and tree figures, every tree."""
        return cls(launch_us=0.0, ll_bw_fraction=LL_BW_FRACTION, nvls_latency_us=HW_LATENCY_US_NVLS,
                   nvls_algbw_fraction=NVLS_ALGBW_FRACTION_PUBLISHED, tree_algbw_ratio=TREE_ALGBW_RATIO,
                   tree_max_nodes=1 << 30,
                   all_to_all_bw_fraction=1.0, all_to_all_peer_us=None)


@dataclass(frozen=True)
class AlgoChoice:
    algorithm: str
    protocol: str
    latency_us: float
    algbw_GBps: float

    def time_us(self, nbytes: float) -> float:
        return self.latency_us + nbytes / (self.algbw_GBps * 1e3)


def bus_bandwidth_factor(kind: str, n: int) -> float:
    """busbw = algbw x factor, as nccl-tests computes it."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)


class NCCLCollectives:
    """Collective times over the axes of a :class:`Topology`: ``time_us(kind, nbytes, axis)``.

    ``algorithms`` / ``protocols`` restrict the search (like NCCL_ALGO / NCCL_PROTO).
    """

    def __init__(self, topo: Topology, *, algorithms: tuple[str, ...] | None = None,
                 protocols: tuple[str, ...] | None = None, measured: MeasuredNccl | None = None) -> None:
        if not isinstance(topo, Topology):
            raise TypeError(f"NCCLCollectives needs a Topology, got {type(topo).__name__}")
        self.topo = topo
        self.mesh_shape = topo.mesh_shape
        self.measured = measured if measured is not None else MeasuredNccl()
        self._algos = frozenset(algorithms or (RING, TREE, NVLS, PAT))
        self._protos = frozenset(protocols or PROTOCOLS)
        bad = (self._algos - {RING, TREE, NVLS, PAT}) | (self._protos - set(PROTOCOLS))
        if bad:
            raise ValueError(f"unknown NCCL algorithm/protocol name(s): {sorted(bad)}")
        # per-instance caches (no module-level state)
        self._choices = functools.lru_cache(maxsize=None)(self._candidates)
        self.redistribution_cache = None  # filled by costmodels.redistribution on first use
        self.redistribution_matrix_cache = None  # likewise (costmodels.redistribution_matrix)

    # --- public ----------------------------------------------------------------------
    def time_us(self, kind: str, nbytes: float, axis: int) -> float:
        """Time in µs of one ``kind`` collective of ``nbytes`` (nccl-tests size) over ``axis``."""
        cands = self._choices(kind, axis)
        if not cands:
            return 0.0
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return min(c.latency_us + nbytes / (c.algbw_GBps * 1e3) for c in cands)

    def choose(self, kind: str, nbytes: float, axis: int) -> AlgoChoice | None:
        """The (algorithm, protocol) NCCL would pick, or None for an axis of size 1."""
        cands = self._choices(kind, axis)
        return min(cands, key=lambda c: c.time_us(nbytes)) if cands else None

    def candidates(self, kind: str, axis: int) -> tuple[AlgoChoice, ...]:
        return self._choices(kind, axis)

    def bus_bandwidth_GBps(self, kind: str, nbytes: float, axis: int) -> float:
        """Modelled nccl-tests bus bandwidth (GB/s) at this size."""
        t = self.time_us(kind, nbytes, axis)
        n = self.topo.axis(axis).size
        return 0.0 if t == 0 else nbytes / (t * 1e3) * bus_bandwidth_factor(kind, n)

    # --- model -------------------------------------------------------------------------
    def _candidates(self, kind: str, axis: int) -> tuple[AlgoChoice, ...]:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
        link = self.topo.axis(axis)
        n = link.size
        if n <= 1:
            return ()
        out: list[AlgoChoice] = []
        if kind == "all_to_all":
            return tuple(self._all_to_all(link))
        for algo in (RING, TREE, NVLS, PAT):
            if algo not in self._algos:
                continue
            for proto in PROTOCOLS:
                if proto not in self._protos:
                    continue
                c = self._price(kind, algo, proto, link)
                if c is not None and c.algbw_GBps > 0:
                    out.append(c)
        if not out:
            raise ValueError(f"no NCCL algorithm/protocol enabled for {kind} on axis {axis}")
        return tuple(out)

    def _hw(self, link: AxisLink) -> str:
        return "nvlink" if link.fabric_kind in ("nvswitch", "nvlink") else "pci"

    def _arch(self) -> str:
        return self.topo.device.arch

    def _price(self, kind: str, algo: str, proto: str, link: AxisLink) -> AlgoChoice | None:
        n, nodes, ppn = link.size, link.nodes, link.ranks_per_node
        gpu = self._arch() != "cpu"
        if not gpu and (algo != RING or proto != SIMPLE):
            return None  # host collectives: one plain ring
        if algo == TREE and (kind != "all_reduce"
                             or (nodes > self.measured.tree_max_nodes and proto != LL)):
            return None
        if algo == NVLS and (kind != "all_reduce" or proto != SIMPLE or not link.nvls):
            return None
        if algo == PAT and (kind not in ("all_gather", "reduce_scatter") or proto != SIMPLE
                            or ppn != 1 or nodes != n):
            return None
        if algo != RING and kind == "broadcast":
            return None

        bus = link.bus_GBps
        ll_cap = (LL_MAX_BUS_GBPS_1NODE.get(self._arch(), 141.0) if nodes == 1
                  else LL_MAX_BUS_GBPS_2NODES if nodes == 2 else LL_MAX_BUS_GBPS_NNODES)
        if algo == RING:
            if proto == LL:
                bus = min(ll_cap, bus * self.measured.ll_bw_fraction)
            elif proto == LL128:
                bus = bus * LL128_BW_FRACTION
        elif algo == TREE:
            bus = bus * TREE_BW_FRACTION
            if proto == LL:
                bus = min(bus * TREE_LL_BW_FRACTION * self.measured.ll_bw_fraction / LL_BW_FRACTION, ll_cap)
            elif proto == LL128:
                bus = bus * (TREE_LL128_BW_FRACTION_1NODE if nodes == 1 else TREE_LL128_BW_FRACTION_NNODE)
        elif algo == PAT:
            bus = bus * PAT_BW_FRACTION

        # bus bandwidth -> algorithm bandwidth
        if algo == RING:
            nsteps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, n)
            algbw = bus * n / nsteps
        elif algo == NVLS:
            algbw = link.intra_GBps * self.measured.nvls_algbw_fraction
        elif algo == TREE:
            algbw = bus * (TREE_ALGBW_RATIO if nodes == 1 else self.measured.tree_algbw_ratio)
        else:  # PAT: bus bandwidth as all-gather/reduce-scatter
            algbw = bus * n / (n - 1)

        # latency
        hw = self._hw(link)
        base = BASE_LATENCY_US.get(algo, {}).get(proto, 0.0)
        intra_lat = HW_LATENCY_US[hw].get(algo, HW_LATENCY_US[hw][RING]).get(proto, 0.0) + link.intra_latency_us
        net_tab = HW_LATENCY_US["net"]
        inter_lat = (net_tab[TREE][proto] if ppn == 1 else net_tab.get(algo, net_tab[RING]).get(proto, 0.0))
        inter_lat += link.inter_latency_us * (2 if proto == SIMPLE else 1)
        if algo == RING:
            if kind == "broadcast":
                lat = base + (inter_lat if nodes > 1 else intra_lat)
            else:
                nsteps = 2 * (n - 1) if kind == "all_reduce" else n - 1
                n_inter = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
                if nodes > 1:
                    ovh = NET_OVERHEAD_US * (NET_OVERHEAD_SIMPLE_FACTOR if proto == SIMPLE else 1.0)
                    intra_lat = max(intra_lat, ovh)
                lat = base + (nsteps - n_inter) * intra_lat + n_inter * inter_lat
        elif algo == TREE:
            lat = base + 2 * ((ppn - 1) * intra_lat + _log2i(nodes) * inter_lat)
        elif algo == NVLS:
            lat = self.measured.nvls_latency_us + link.intra_latency_us
        else:  # PAT: NCCL's fit "8 + log2(nNodes) * interLat/3.5 + nRanks * 2.8"
            lat = 8.0 + _log2i(nodes) * inter_lat / 3.5 + n * 2.8
        return AlgoChoice(algo, proto, lat + self._launch_us(), algbw)

    def _all_to_all(self, link: AxisLink) -> list[AlgoChoice]:
        n, nodes = link.size, link.nodes
        hw = self._hw(link)
        out = []
        protos = (SIMPLE,) if self._arch() == "cpu" else tuple(p for p in (LL, SIMPLE) if p in self._protos) or (SIMPLE,)
        for proto in protos:
            bus = link.bus_GBps * self.measured.all_to_all_bw_fraction
            if nodes > 1:
                # off-node traffic leaves through the NIC of each rank
                off = (n - link.ranks_per_node) / (n - 1)
                bus = min(link.intra_GBps * link.ring_efficiency,
                          link.inter_GBps * link.net_efficiency / max(off, 1e-9))
            if proto == LL:
                bus = min(bus * self.measured.ll_bw_fraction, LL_MAX_BUS_GBPS_1NODE.get(self._arch(), 141.0))
            hop = (HW_LATENCY_US["net"][RING][proto] + link.inter_latency_us if nodes > 1
                   else HW_LATENCY_US[hw][RING][proto] + link.intra_latency_us)
            if self.measured.all_to_all_peer_us is not None:
                hop = self.measured.all_to_all_peer_us + (link.inter_latency_us if nodes > 1 else link.intra_latency_us)
            lat = BASE_LATENCY_US[RING][proto] + (n - 1) * hop + self._launch_us()
            out.append(AlgoChoice("p2p", proto, lat, bus * n / (n - 1)))
        return out

    def _launch_us(self) -> float:
        return 0.0 if self._arch() == "cpu" else self.measured.launch_us

    def __repr__(self) -> str:
        return f"NCCLCollectives({self.topo!r})"

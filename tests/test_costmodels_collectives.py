"""NCCL-like collective model: shape of the curves and sanity against published figures."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import costmodels as cm
from costmodels.collectives import KINDS

GiB, MiB = 2**30, 2**20


@pytest.fixture(scope="module")
def h100x8():
    return cm.NCCLCollectives(cm.Topology((8,), cm.device("h100"), gpus_per_node=8))


@pytest.fixture(scope="module")
def h100_4x8():
    return cm.NCCLCollectives(cm.Topology((4, 8), cm.device("h100"), gpus_per_node=8))


@settings(max_examples=200, deadline=None, derandomize=True)  # the same examples every run
@given(kind=st.sampled_from(KINDS), axis=st.sampled_from([0, 1]),
       a=st.integers(0, 2**34), b=st.integers(0, 2**34),
       dev=st.sampled_from(["h100", "a100", "b200", "cpu"]))
def test_time_never_falls_with_size(kind, axis, a, b, dev):
    comm = cm.NCCLCollectives(cm.Topology((4, 8), dev, gpus_per_node=8))
    lo, hi = sorted((a, b))
    assert 0 < comm.time_us(kind, lo, axis) <= comm.time_us(kind, hi, axis)


def test_time_grows_over_a_sweep(h100_4x8):
    for kind in KINDS:
        for axis in (0, 1):
            ts = [h100_4x8.time_us(kind, 2**k, axis) for k in range(3, 35)]
            assert all(x <= y for x, y in zip(ts, ts[1:], strict=False))
            assert ts[-1] > 100 * ts[0]


def test_inter_node_axis_costs_more_than_intra_node(h100_4x8):
    # axis 0 (4 ranks, one per node, 50 GB/s NICs) vs axis 1 (8 ranks on NVSwitch)
    for kind in KINDS:
        for nbytes in (64 * MiB, GiB):
            assert h100_4x8.time_us(kind, nbytes, 0) > h100_4x8.time_us(kind, nbytes, 1)
    # same group size, to compare like with like: (8 nodes x 1) vs (1 node x 8)
    inter = cm.NCCLCollectives(cm.Topology((8, 8), "h100")).time_us("all_reduce", GiB, 0)
    intra = cm.NCCLCollectives(cm.Topology((8, 8), "h100")).time_us("all_reduce", GiB, 1)
    assert inter > 5 * intra


def test_all_reduce_is_about_reduce_scatter_plus_all_gather(h100_4x8):
    # Large messages. A ring all-reduce *is* a reduce-scatter followed by an all-gather:
    # within 5% on the inter-node axis (ring/Simple only there).
    for nbytes in (256 * MiB, GiB, 4 * GiB):
        ar = h100_4x8.time_us("all_reduce", nbytes, 0)
        rs_ag = h100_4x8.time_us("reduce_scatter", nbytes, 0) + h100_4x8.time_us("all_gather", nbytes, 0)
        assert ar == pytest.approx(rs_ag, rel=0.05)
        # Intra-node NVSwitch: NVLS (in-switch reduction) makes all-reduce cheaper than
        # RS + AG, but by no more than ~30% (480 vs 370 GB/s bus bandwidth published).
        ar = h100_4x8.time_us("all_reduce", nbytes, 1)
        rs_ag = h100_4x8.time_us("reduce_scatter", nbytes, 1) + h100_4x8.time_us("all_gather", nbytes, 1)
        assert 0.70 * rs_ag <= ar <= 1.05 * rs_ag
    ring_only = cm.NCCLCollectives(h100_4x8.topo, algorithms=("ring",))
    ar = ring_only.time_us("all_reduce", GiB, 1)
    rs_ag = ring_only.time_us("reduce_scatter", GiB, 1) + ring_only.time_us("all_gather", GiB, 1)
    assert ar == pytest.approx(rs_ag, rel=0.05)


def test_small_messages_are_latency_dominated(h100_4x8):
    for kind in KINDS:
        for axis in (0, 1):
            t8 = h100_4x8.time_us(kind, 8, axis)
            t4k = h100_4x8.time_us(kind, 4096, axis)
            assert t4k <= 1.10 * t8            # 512x the bytes, < 10% more time
            choice = h100_4x8.choose(kind, 8, axis)
            assert choice.latency_us > 0.99 * t8
            assert t8 >= 5.0                    # NCCL's base latencies are several µs


def test_axis_of_size_one_costs_nothing():
    comm = cm.NCCLCollectives(cm.Topology((1, 8), "h100"))
    for kind in KINDS:
        assert comm.time_us(kind, GiB, 0) == 0.0
        assert comm.time_us(kind, GiB, 1) > 0.0


def test_published_h100_nvswitch_figures(h100x8):
    # docs/design.md, "Published figures": 8 x H100 over NVSwitch, nccl-tests all_reduce bus
    # bandwidth ~369-370 GB/s with ring (NVLS off) and up to ~480 GB/s with NVLS.
    busbw = h100x8.bus_bandwidth_GBps("all_reduce", GiB, 0)
    assert 350.0 <= busbw <= 480.0
    ring = cm.NCCLCollectives(h100x8.topo, algorithms=("ring", "tree"))
    assert ring.bus_bandwidth_GBps("all_reduce", GiB, 0) == pytest.approx(370.0, rel=0.05)
    # ring all-gather / reduce-scatter reach ~370 GB/s bus bandwidth at large sizes
    assert h100x8.bus_bandwidth_GBps("all_gather", 4 * GiB, 0) == pytest.approx(370.0, rel=0.05)
    # all-gather of 1 MiB takes tens of µs (latency-bound: NCCL base + 7 hops)
    assert 10.0 <= h100x8.time_us("all_gather", MiB, 0) < 100.0
    # ring + LL for small all-reduces, NVLS + Simple from ~1 MiB (with LL at its measured
    # bandwidth, LL128 takes the sizes between)
    for nbytes in (8, 1024, 64 * 1024):
        c = h100x8.choose("all_reduce", nbytes, 0)
        assert (c.algorithm, c.protocol) == ("ring", "LL")
    for nbytes in (MiB, 4 * MiB, 256 * MiB, 16 * GiB):
        c = h100x8.choose("all_reduce", nbytes, 0)
        assert (c.algorithm, c.protocol) == ("nvls", "Simple")


def test_no_nvls_without_nvswitch_sharp():
    a100 = cm.NCCLCollectives(cm.Topology((8,), "a100"))
    assert all(c.algorithm != "nvls" for c in a100.candidates("all_reduce", 0))
    # A100 (NCCL caps sm80 at 235 GB/s bus bandwidth)
    assert a100.bus_bandwidth_GBps("all_reduce", 4 * GiB, 0) == pytest.approx(235.0, rel=0.05)
    inter = cm.NCCLCollectives(cm.Topology((2, 8), "h100"))
    assert all(c.algorithm != "nvls" for c in inter.candidates("all_reduce", 0))


def test_bad_arguments(h100x8):
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        h100x8.time_us("allreduce", 1024, 0)
    with pytest.raises(ValueError, match="mesh axis 3"):
        h100x8.time_us("all_reduce", 1024, 3)
    with pytest.raises(ValueError, match="nbytes"):
        h100x8.time_us("all_reduce", -1, 0)
    with pytest.raises(ValueError, match="unknown NCCL"):
        cm.NCCLCollectives(h100x8.topo, algorithms=("butterfly",))


def test_bus_bandwidth_factor_matches_nccl_tests():
    assert cm.bus_bandwidth_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert cm.bus_bandwidth_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert cm.bus_bandwidth_factor("broadcast", 8) == 1.0
    assert math.isclose(cm.bus_bandwidth_factor("all_reduce", 1), 0.0)

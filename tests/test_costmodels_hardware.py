"""Device table, registry and file loading (costmodels.hardware, costmodels.topology)."""

import json

import pytest

import costmodels as cm
from costmodels.hardware import BUILTIN_DEVICES


def test_builtin_devices_and_aliases():
    for name in ("h100", "h200", "a100", "b200", "cpu", "H100-SXM", "a100_80gb_sxm"):
        assert isinstance(cm.device(name), cm.DeviceSpec)
    assert cm.device("h100") is cm.device("h100_sxm")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        cm.device("tpu")


def test_datasheet_figures_in_si_units():
    h100 = cm.device("h100")
    # NVIDIA H100 SXM datasheet: 1,979 TFLOP/s bf16 *with sparsity* -> ~989 dense; 3.35 TB/s
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12, rel=1e-3)
    assert h100.peak_flops("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert h100.hbm_bytes_per_s == pytest.approx(3.35e12)
    assert h100.hbm_capacity_bytes == 80 * 2**30
    assert h100.fabric.GBps == 450.0 and h100.fabric.nvlink_gen == 4 and h100.fabric.nvls
    assert cm.device("h200").hbm_TBps == 4.8
    a100 = cm.device("a100")
    assert a100.peak_flops("bf16") == pytest.approx(312e12)
    assert "fp8" not in a100.peak_tflops
    assert a100.peak_flops("fp8") == a100.peak_flops("bf16")  # falls back to the next wider type
    assert not a100.fabric.nvls
    b200 = cm.device("b200")
    assert b200.peak_flops("bf16") > h100.peak_flops("bf16") and b200.fabric.GBps == 900.0


def test_overrides_do_not_leak():
    slow = cm.device("h100", hbm_TBps=1.0)
    assert slow.hbm_TBps == 1.0 and cm.device("h100").hbm_TBps == 3.35
    reg = cm.DeviceRegistry()
    reg.register(slow.replace(name="h100_slow"))
    assert reg.get("h100_slow").hbm_TBps == 1.0
    assert "h100_slow" not in cm.DeviceRegistry()  # a fresh registry has only built-ins
    assert "h100_slow" not in BUILTIN_DEVICES
    with pytest.raises(ValueError, match="already registered"):
        reg.register(slow.replace(name="h100_slow"))
    with pytest.raises(TypeError):
        cm.device("h100").peak_tflops["bf16"] = 1.0  # read-only table
    # specs are values: equal and hashable (usable as cache keys)
    assert cm.device("h100", hbm_TBps=1.0) == slow and hash(cm.device("h100", hbm_TBps=1.0)) == hash(slow)
    assert len({cm.device("h100"), cm.device("h100_sxm"), slow}) == 2


def test_load_devices_toml_and_json(tmp_path):
    toml = tmp_path / "devs.toml"
    toml.write_text('[devices.mygpu]\nbase = "h100"\nhbm_TBps = 2.5\n'
                    'peak_tflops = { bf16 = 500.0 }\nfabric = { GBps = 200.0 }\n')
    reg = cm.load_devices(toml)
    d = reg.get("mygpu")
    assert d.hbm_TBps == 2.5 and d.peak_tflops["bf16"] == 500.0
    assert d.peak_tflops["fp32"] == 67.0 and d.fabric.GBps == 200.0
    assert cm.device("mygpu", registry=reg) is d

    js = tmp_path / "devs.json"
    js.write_text(json.dumps({"devices": {"tiny": {
        "peak_tflops": {"fp32": 1.0}, "hbm_TBps": 0.05, "hbm_GiB": 8,
        "fabric": {"kind": "pcie", "GBps": 16.0}, "arch": "ampere"}}}))
    reg.load(js)
    assert reg.get("tiny").fabric.kind == "pcie" and reg.get("mygpu").hbm_TBps == 2.5


def test_load_devices_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[devices.x]\nbase = "h100"\nhbm_bandwidth = 3\n')
    with pytest.raises(ValueError, match=r"devices\.x.*hbm_bandwidth"):
        cm.load_devices(bad)
    neg = tmp_path / "neg.json"
    neg.write_text('{"devices": {"y": {"base": "h100", "hbm_TBps": -1}}}')
    with pytest.raises(ValueError, match=r"devices\.y.*hbm_TBps"):
        cm.load_devices(neg)
    with pytest.raises(FileNotFoundError):
        cm.load_devices(tmp_path / "missing.toml")


def test_topology_maps_inner_axes_into_nodes():
    topo = cm.Topology((4, 8), cm.device("h100"), gpus_per_node=8)
    inner, outer = topo.axis(1), topo.axis(0)
    assert (inner.nodes, inner.ranks_per_node, inner.spans_nodes) == (1, 8, False)
    assert (outer.nodes, outer.ranks_per_node, outer.spans_nodes) == (4, 1, True)
    assert inner.bandwidth_GBps == 450.0 and outer.bandwidth_GBps == 50.0
    # a mixed axis (2 ranks per node over 2 nodes) is limited by min(fabric, 2 NICs)
    mixed = cm.Topology((4, 2), "h100", gpus_per_node=4).axis(0)
    assert (mixed.nodes, mixed.ranks_per_node) == (2, 2)
    assert mixed.bandwidth_GBps == 100.0
    assert cm.Topology((2, 2, 2), "h100", gpus_per_node=4).axis(0).spans_nodes
    with pytest.raises(ValueError, match="mesh_shape"):
        cm.Topology((0, 8), "h100")
    with pytest.raises(ValueError, match="mesh axis 2"):
        topo.axis(2)


def test_protocols_and_load_object():
    topo = cm.Topology((8,), "h100")
    assert isinstance(cm.NCCLCollectives(topo), cm.CommModel)
    assert isinstance(cm.RooflineCompute("h100"), cm.ComputeModel)
    assert cm.load_object("costmodels.collectives:NCCLCollectives") is cm.NCCLCollectives
    assert cm.load_object("costmodels:Topology") is cm.Topology
    with pytest.raises(ValueError, match="package.module:Name"):
        cm.load_object("costmodels.Topology")
    with pytest.raises(ValueError, match="no attribute"):
        cm.load_object("costmodels:Nope")
    with pytest.raises(ValueError, match="cannot import"):
        cm.load_object("no_such_pkg_xyz:A")

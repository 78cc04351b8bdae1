"""Calibration against nccl-tests logs: parsing, fitting, JSON, wrapping."""

import json
import logging
import math
from pathlib import Path

import pytest

import costmodels as cm
from apmodel.entry.api import cost_context

DATA = Path(__file__).parent / "data"
KIND_FILES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]


@pytest.fixture(scope="module")
def h100x8():
    return cm.NCCLCollectives(cm.Topology((8,), cm.device("h100"), gpus_per_node=8))


@pytest.fixture(scope="module")
def nccl_table_h100x8():
    # the model the synthetic logs were generated with: NCCL's tuning table, nothing measured added
    return cm.NCCLCollectives(cm.Topology((8,), cm.device("h100"), gpus_per_node=8),
                              measured=cm.MeasuredNccl.nccl_tuning_table())


def shipped_factor(size):
    # the known correction written into the synthetic logs' headers
    return 1.4 + (0.95 - 1.4) * (math.log2(size) - 3) / 27


@pytest.mark.parametrize("kind", KIND_FILES)
def test_shipped_synthetic_logs_parse(kind):
    path = DATA / f"nccl_tests_synthetic_h100x8_{kind}.txt"
    assert "SYNTHETIC" in path.read_text().splitlines()[0]
    log = cm.parse_nccl_tests(path)
    assert log.kind == kind and log.ranks == 8
    assert [r.size_bytes for r in log.rows] == [2**k for k in range(3, 31)]
    big = log.rows[-1]
    assert big.oop_algbw_GBps == pytest.approx(big.size_bytes / (big.oop_time_us * 1e3), rel=0.01)
    assert big.oop_busbw_GBps == pytest.approx(big.oop_algbw_GBps * cm.bus_bandwidth_factor(kind, 8), rel=0.01)


def test_fit_recovers_known_factors_from_shipped_logs(nccl_table_h100x8):
    logs = [(cm.parse_nccl_tests(DATA / f"nccl_tests_synthetic_h100x8_{k}.txt"), 0) for k in KIND_FILES]
    cal = cm.Calibration.fit(nccl_table_h100x8, logs)
    for k in KIND_FILES:
        for e in range(3, 31):
            assert cal.factor(k, 0, 2**e) == pytest.approx(shipped_factor(2**e), rel=0.05), (k, e)
        # between logged sizes: interpolated in log-size
        s = 3 * 2**20
        assert cal.factor(k, 0, s) == pytest.approx(shipped_factor(s), rel=0.05)
        # beyond the ends: held constant
        assert cal.factor(k, 0, 1) == pytest.approx(cal.factor(k, 0, 8))
        assert cal.factor(k, 0, 2**40) == pytest.approx(cal.factor(k, 0, 2**30))
    assert cal.factor("broadcast", 0, 1024) == 1.0  # not calibrated


def test_round_trip_with_other_factors_and_axes(tmp_path):
    comm = cm.NCCLCollectives(cm.Topology((2, 8), "h100"))
    truth = {0: lambda s: 2.0 if s < 2**16 else 1.2, 1: lambda s: 0.8 + 0.02 * math.log2(s)}
    logs = []
    for axis, n in ((0, 2), (1, 8)):
        sizes = [2**k for k in range(4, 32, 2)]
        text = cm.format_nccl_tests("all_gather", n,
                                    [(s, comm.time_us("all_gather", s, axis) * truth[axis](s)) for s in sizes])
        f = tmp_path / f"ag_axis{axis}.log"
        f.write_text(text)
        logs.append((cm.parse_nccl_tests(f), axis))
    cal = cm.Calibration.fit(comm, logs)
    for axis in (0, 1):
        for k in range(4, 32, 2):
            assert cal.factor("all_gather", axis, 2**k) == pytest.approx(truth[axis](2**k), rel=0.05)
    # JSON round trip
    path = tmp_path / "cal.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "apmodel.costmodels.calibration" and data["version"] == 2
    # each curve records what it was fitted on
    recorded = {c["axis"]: (c["mesh_shape"], c["ranks"], c["min_bytes"], c["max_bytes"]) for c in data["curves"]}
    assert recorded == {0: ([2, 8], 2, 16, 2**30), 1: ([2, 8], 8, 16, 2**30)}
    back = cm.Calibration.load(path)
    for axis in (0, 1):
        for s in (16, 1000, 2**20, 2**31):
            assert back.factor("all_gather", axis, s) == pytest.approx(cal.factor("all_gather", axis, s))
    # the wrapped model reproduces the "measured" times
    calibrated = cm.CalibratedCollectives(comm, back)
    assert isinstance(calibrated, cm.CommModel)
    for axis in (0, 1):
        s = 2**20
        assert calibrated.time_us("all_gather", s, axis) == \
            pytest.approx(comm.time_us("all_gather", s, axis) * truth[axis](s), rel=0.05)
    assert calibrated.time_us("all_reduce", 2**20, 1) == comm.time_us("all_reduce", 2**20, 1)


GOOD = cm.format_nccl_tests("all_reduce", 4, [(1024, 20.0), (2048, 21.0), (4096, 22.0)])


def test_malformed_log_names_the_line():
    lines = GOOD.splitlines()
    first_data = next(i for i, l in enumerate(lines) if not l.startswith("#"))
    bad = list(lines)
    bad[first_data + 1] = bad[first_data + 1].rsplit(None, 3)[0]     # truncated row
    with pytest.raises(ValueError, match=rf"line {first_data + 2}: expected 12 or 13 columns"):
        cm.parse_nccl_tests("\n".join(bad))
    bad = list(lines)
    bad[first_data + 2] = bad[first_data + 2].replace("22.00", "2x.00", 1)
    with pytest.raises(ValueError, match=rf"line {first_data + 3}: out-of-place time '2x.00'"):
        cm.parse_nccl_tests("\n".join(bad))
    with pytest.raises(ValueError, match="no data lines"):
        cm.parse_nccl_tests("# only a comment\n")


def test_parse_accepts_real_nccl_tests_layout():
    # the column layout nccl-tests 2.x prints (with N/A in #wrong when -c 0)
    text = """# nThread 1 nGpus 1 minBytes 8 maxBytes 128 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 0 graph: 0
#
#  Rank  0 Group  0 Pid  12345 on    host0 device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  12346 on    host0 device  1 [0x2a] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    10.53    0.00    0.00    N/A    10.41    0.00    0.00    N/A
         128            32     float     sum      -1    10.60    0.01    0.01    N/A    10.57    0.01    0.01    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.005
"""
    log = cm.parse_nccl_tests(text, kind="all_reduce")
    assert log.ranks == 2 and [r.oop_time_us for r in log.rows] == [10.53, 10.60]
    assert log.rows[0].ip_time_us == 10.41 and log.rows[1].line == 10
    with pytest.raises(ValueError, match="unknown collective kind"):
        cm.parse_nccl_tests(text, kind="allreduce")


def test_bad_calibration_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"format": "apmodel.costmodels.calibration", "version": 99, "curves": []}))
    with pytest.raises(ValueError, match="unsupported calibration version 99"):
        cm.Calibration.load(p)
    p.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a calibration file"):
        cm.Calibration.load(p)
    curve = {"kind": "all_reduce", "axis": 0, "mesh_shape": [8], "ranks": 8, "min_bytes": 4, "max_bytes": 8,
             "log2_sizes": [3, 2], "factors": [1, 1]}
    p.write_text(json.dumps({"format": "apmodel.costmodels.calibration", "version": 2, "curves": [curve]}))
    with pytest.raises(ValueError, match=r"curves\[0\].*increasing"):
        cm.Calibration.load(p)
    curve.update(log2_sizes=[2, 3], ranks=4)
    p.write_text(json.dumps({"format": "apmodel.costmodels.calibration", "version": 2, "curves": [curve]}))
    with pytest.raises(ValueError, match=r"curves\[0\]: ranks 4 is not the size of axis 0 of mesh_shape \[8\]"):
        cm.Calibration.load(p)
    del curve["ranks"]
    p.write_text(json.dumps({"format": "apmodel.costmodels.calibration", "version": 2, "curves": [curve]}))
    with pytest.raises(ValueError, match=r"curves\[0\]: missing field 'ranks'"):
        cm.Calibration.load(p)


# ------------------------------------------------------------------ where a calibration applies
def shipped_logs(*kinds):
    return [cm.parse_nccl_tests(DATA / f"nccl_tests_synthetic_h100x8_{k}.txt") for k in kinds]


@pytest.fixture(scope="module")
def cal_8(h100x8):
    """all_gather and all_reduce curves fitted on a 1-D mesh of 8 (8 B .. 1 GiB)."""
    return cm.Calibration.fit(h100x8, [(log, 0) for log in shipped_logs("all_gather", "all_reduce")])


def test_fit_refuses_a_log_of_another_rank_count():
    comm = cm.NCCLCollectives(cm.Topology((4, 8), "h100"))
    (log,) = shipped_logs("all_gather")
    with pytest.raises(cm.CalibrationMismatch, match=r"nccl_tests_synthetic_h100x8_all_gather\.txt: all_gather log "
                                                     r"ran on 8 ranks, but axis 0 of mesh \(4, 8\) has size 4"):
        cm.Calibration.fit(comm, [(log, 0)])
    cal = cm.Calibration.fit(comm, [(log, 1)])  # the 8-rank axis
    assert cal.curves[("all_gather", 1)].ranks == 8 and cal.curves[("all_gather", 1)].mesh_shape == (4, 8)


def test_fit_refuses_a_log_without_its_rank_count():
    comm = cm.NCCLCollectives(cm.Topology((4,), "h100"))
    text = "\n".join(l for l in cm.format_nccl_tests("all_reduce", 4, [(1024, 20.0), (2048, 21.0)]).splitlines()
                     if "Rank" not in l)
    log = cm.parse_nccl_tests(text)
    assert log.ranks is None
    with pytest.raises(cm.CalibrationMismatch, match=r"<text>: the log does not say how many ranks it ran on.*"
                                                     r"set log\.ranks to fit it for axis 0 of mesh \(4,\) \(size 4\)"):
        cm.Calibration.fit(comm, [(log, 0)])
    log.ranks = 4
    assert cm.Calibration.fit(comm, [(log, 0)]).curves[("all_reduce", 0)].ranks == 4


def test_applying_to_an_axis_of_another_size_is_refused(cal_8, caplog):
    comm = cm.NCCLCollectives(cm.Topology((2, 4), "h100"))
    with pytest.raises(cm.CalibrationMismatch, match=r"calibration of all_gather on axis 0 was fitted on 8 ranks "
                                                     r"\(mesh \(8,\)\), but axis 0 of mesh \(2, 4\) has size 2.*"
                                                     r"allow_other_sizes=True"):
        cm.CalibratedCollectives(comm, cal_8)
    with caplog.at_level(logging.WARNING, logger="costmodels.calibration"):
        forced = cm.CalibratedCollectives(comm, cal_8, allow_other_sizes=True)
    assert "applied anyway" in caplog.text
    assert forced.time_us("all_gather", 2**20, 0) == pytest.approx(
        comm.time_us("all_gather", 2**20, 0) * cal_8.factor("all_gather", 0, 2**20))
    # an axis the mesh does not have
    cal_2d = cm.Calibration({("all_reduce", 1): cm.CorrectionCurve([3.0, 30.0], [1.0, 1.0], ranks=8, mesh_shape=(2, 8))})
    with pytest.raises(cm.CalibrationMismatch, match=r"fitted on 8 ranks \(mesh \(2, 8\)\), but mesh \(8,\) has no axis 1"):
        cm.CalibratedCollectives(cm.NCCLCollectives(cm.Topology((8,), "h100")), cal_2d)
    # same size elsewhere: fine
    cm.CalibratedCollectives(cm.NCCLCollectives(cm.Topology((8, 4), "h100")), cal_8)


def test_cost_context_checks_a_calibration_file(cal_8, tmp_path):
    path = tmp_path / "cal.json"
    cal_8.save(path)
    with pytest.raises(cm.CalibrationMismatch, match="has size 2"):
        cost_context((2, 4), calibration=path)
    ctx = cost_context((8,), calibration=path)
    assert ctx.comm.time_us("all_gather", 2**20, 0) > 0 and ctx.comm.clamped == {}


def test_sizes_outside_the_measured_range_are_clamped_and_reported_once(caplog):
    comm = cm.NCCLCollectives(cm.Topology((8,), "h100"))
    sizes = [2**k for k in range(6, 10)]  # 64 B .. 512 B
    log = cm.parse_nccl_tests(cm.format_nccl_tests(
        "all_reduce", 8, [(s, comm.time_us("all_reduce", s, 0) * (2.0 - 0.1 * i)) for i, s in enumerate(sizes)]))
    cal = cm.Calibration.fit(comm, [(log, 0)])
    curve = cal.curves[("all_reduce", 0)]
    assert (curve.min_bytes, curve.max_bytes) == (64, 512)
    calibrated = cm.CalibratedCollectives(comm, cal)
    with caplog.at_level(logging.WARNING, logger="costmodels.calibration"):
        inside = calibrated.time_us("all_reduce", 256, 0)
        assert calibrated.clamped == {} and not caplog.records
        for s in (2**30, 2**20, 2**31, 8):
            assert calibrated.time_us("all_reduce", s, 0) == pytest.approx(
                comm.time_us("all_reduce", s, 0) * cal.factor("all_reduce", 0, 512 if s > 512 else 64))
    assert inside == pytest.approx(comm.time_us("all_reduce", 256, 0) * cal.factor("all_reduce", 0, 256))
    warnings = [r for r in caplog.records if "measured on 64 – 512 bytes" in r.getMessage()]
    assert len(warnings) == 1 and "1.07374e+09 bytes is outside" in warnings[0].getMessage()
    assert calibrated.clamped == {("all_reduce", 0): {"fitted_min_bytes": 64, "fitted_max_bytes": 512,
                                                      "requested_min_bytes": 8, "requested_max_bytes": 2**31}}
    # uncalibrated kinds are neither corrected nor reported
    assert calibrated.time_us("all_gather", 2**30, 0) == comm.time_us("all_gather", 2**30, 0)
    assert list(calibrated.clamped) == [("all_reduce", 0)]


def test_version_1_files_are_read_with_a_fallback(tmp_path, caplog):
    p = tmp_path / "v1.json"
    v1 = {"format": "apmodel.costmodels.calibration", "version": 1, "meta": {"mesh_shape": [8]},
          "curves": [{"kind": "all_reduce", "axis": 0, "log2_sizes": [3.0, 9.0], "factors": [1.2, 1.1]}]}
    p.write_text(json.dumps(v1))
    with caplog.at_level(logging.WARNING, logger="costmodels.calibration"):
        cal = cm.Calibration.load(p)
    assert "version 1" in caplog.text
    c = cal.curves[("all_reduce", 0)]
    assert (c.ranks, c.mesh_shape, c.min_bytes, c.max_bytes) == (8, (8,), 8, 512)
    with pytest.raises(cm.CalibrationMismatch, match="fitted on 8 ranks"):
        cm.CalibratedCollectives(cm.NCCLCollectives(cm.Topology((4,), "h100")), cal)
    del v1["meta"]
    p.write_text(json.dumps(v1))
    with pytest.raises(ValueError, match=r"curves\[0\]: version 1 file without a mesh shape covering axis 0"):
        cm.Calibration.load(p)


def test_a_log_of_another_collective_or_a_missing_path_is_named(tmp_path):
    """`--kind all_reduce` on an all-gather log once fitted all-reduce factors from all-gather
    rows, and a missing path was parsed as log text ("expected 12 or 13 columns ... got 1")."""
    gather = DATA / "nccl_tests_synthetic_h100x8_all_gather.txt"
    with pytest.raises(ValueError, match=r"the log is from all_gather_perf \(all_gather\), not all_reduce"):
        cm.parse_nccl_tests(gather, kind="all_reduce")
    # no binary named: the reduction column tells them apart
    anonymous = tmp_path / "log.txt"
    anonymous.write_text(gather.read_text().replace("all_gather_perf", "some_perf"))
    with pytest.raises(ValueError, match=r"all_reduce was asked, but every row has redop 'none'"):
        cm.parse_nccl_tests(anonymous, kind="all_reduce")
    assert cm.parse_nccl_tests(anonymous, kind="all_gather").kind == "all_gather"
    reduce = (DATA / "nccl_tests_synthetic_h100x8_all_reduce.txt").read_text().replace("all_reduce_perf", "x_perf")
    with pytest.raises(ValueError, match=r"all_to_all was asked, but the rows reduce \(sum\)"):
        cm.parse_nccl_tests(reduce, kind="all_to_all")
    for missing in ("all_reduce_perf.log", tmp_path / "nowhere.log"):
        with pytest.raises(FileNotFoundError, match=r"nccl-tests log '.*\.log' does not exist or is not a file"):
            cm.parse_nccl_tests(missing)


def test_fit_report_says_where_the_calibration_is_worse_than_the_default():
    # two runs of one collective on one axis that disagree (1.5x and 0.8x the model): the fit
    # averages them, which helps the first and hurts the second; the report says which
    comm = cm.NCCLCollectives(cm.Topology((8,), "h100"))
    sizes = [2**k for k in range(3, 31, 3)]
    runs = [cm.parse_nccl_tests(cm.format_nccl_tests(
        "all_gather", 8, [(s, f * comm.time_us("all_gather", s, 0)) for s in sizes]), kind="all_gather")
        for f in (1.5, 0.8)]
    pairs = [(log, 0) for log in runs]
    cal = cm.Calibration.fit(comm, pairs)
    report = cal.fit_report(comm, pairs)
    assert {r["size_class"] for r in report} == {"<=64KiB", "1-16MiB", ">=256MiB"}
    first, second = ([r for r in report if r["before"] == pytest.approx(f, rel=0.02)] for f in (1.5, 0.8))
    assert len(first) == len(second) == 3
    assert not any(r["worse"] for r in first) and all(r["worse"] for r in second)
    # one run alone: the calibration reproduces it, nothing is worse
    alone = cm.Calibration.fit(comm, pairs[:1]).fit_report(comm, pairs[:1])
    assert all(r["after"] == pytest.approx(1.0, rel=0.01) and not r["worse"] for r in alone)

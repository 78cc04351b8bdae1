"""The collective model held to published nccl-tests runs, and the log reader on logs as posted.

The logs in tests/data/nccl_published/ are real runs (H100 / H200, one to four nodes), copied as
they were posted; logs.json records each one's system and, as the independent check of the reader,
its row count and first and last rows as read by hand.
"""

import dataclasses
import json
from pathlib import Path

import pytest

import costmodels as cm
from costmodels import nccl_fit

PUBLISHED = Path(__file__).parent / "data" / "nccl_published"

#: The acceptance bands: per log, the median of measured / predicted; per size class, its median.
LOG_MEDIAN_BAND = (0.85, 1.2)
SIZE_CLASS_BAND = (0.7, 1.4)


@pytest.fixture(scope="module")
def logs():
    return nccl_fit.load_published_logs(PUBLISHED)


def _out_of_band(comparisons):
    bad = []
    for c in comparisons:
        if not LOG_MEDIAN_BAND[0] <= c.median <= LOG_MEDIAN_BAND[1]:
            bad.append(f"{c.log.id}: median {c.median:.2f}")
        for name, r in c.by_class().items():
            if not SIZE_CLASS_BAND[0] <= r <= SIZE_CLASS_BAND[1]:
                bad.append(f"{c.log.id} {name}: {r:.2f}")
    return bad


def test_every_posted_log_reads_as_recorded(logs):
    entries = {e["id"]: e for e in json.loads((PUBLISHED / "logs.json").read_text())}
    assert len(logs) == len(entries) == 9
    for log in logs:
        e = entries[log.id]
        rows = log.log.rows
        assert log.log.kind == e["kind"] and len(rows) == e["rows"], log.id
        for row, want in ((rows[0], e["first_row"]), (rows[-1], e["last_row"])):
            assert (row.size_bytes, row.oop_time_us, row.ip_time_us) == (
                want["size_bytes"], want["oop_time_us"], want["ip_time_us"]), log.id


def test_default_collective_model_matches_every_published_log(logs):
    comparisons = nccl_fit.compare(logs)
    assert _out_of_band(comparisons) == []
    # the classes a plan's collectives live in are all covered by some log
    covered = {name for c in comparisons for name in c.by_class()}
    assert covered == {name for name, _, _ in nccl_fit.SIZE_CLASSES}


def test_nccl_tuning_table_alone_misses_the_published_logs(logs):
    # the check can fail: NCCL's tuner constants without the measured ones fall outside the bands
    measured, net = nccl_fit.nccl_table_constants()
    bad = _out_of_band(nccl_fit.compare(logs, measured, net))
    assert any("4node" in b and "1-16MiB" in b for b in bad), bad
    assert any("h200_2node_all_reduce: median" in b for b in bad), bad


def test_defaults_are_the_fit_rounded(logs):
    fitted, net = nccl_fit.fit(logs)
    defaults = cm.MeasuredNccl()
    for name, _, _ in nccl_fit.FITTED_FIELDS:
        assert getattr(fitted, name) == pytest.approx(getattr(defaults, name), rel=0.05), name
    assert net == pytest.approx(cm.hardware.NET_EFFICIENCY, abs=0.01)


def test_leaving_a_one_node_log_out_still_predicts_it(logs):
    # fit to the others, predict the held-out one: the constants are not tuned to one log
    held = next(i for i, log in enumerate(logs) if log.id == "h100_1node_bf16_all_gather")
    fitted, net = nccl_fit.fit(logs[:held] + logs[held + 1:])
    (c,) = nccl_fit.compare([logs[held]], fitted, net)
    assert LOG_MEDIAN_BAND[0] <= c.median <= LOG_MEDIAN_BAND[1]


def test_a_missing_field_in_logs_json_is_named(tmp_path):
    entries = json.loads((PUBLISHED / "logs.json").read_text())[:1]
    del entries[0]["nodes"]
    (tmp_path / "logs.json").write_text(json.dumps(entries))
    (tmp_path / entries[0]["file"]).write_text((PUBLISHED / entries[0]["file"]).read_text())
    with pytest.raises(ValueError, match=r"logs.json: entry 0: missing field 'nodes'"):
        nccl_fit.load_published_logs(tmp_path)


# --- the reader on logs as launchers and shells leave them ----------------------------------

TABLE = cm.format_nccl_tests("all_reduce", 4, [(1024, 20.0), (2048, 21.0), (4096, 22.0)])


@pytest.mark.parametrize("prefix", ["0: ", "[1,0]<stdout>:", "(head, rank=0, pid=3808) [1,0]<stdout>:"])
def test_launcher_prefixes_are_read_through(prefix):
    text = "\n".join(prefix + line for line in TABLE.splitlines())
    log = cm.parse_nccl_tests(text, kind="all_reduce")
    assert [r.oop_time_us for r in log.rows] == [20.0, 21.0, 22.0] and log.ranks == 4


def test_version_lines_prompts_and_commands_are_skipped():
    lines = TABLE.splitlines()
    noisy = ["user@node01:~$ mpirun -np 4 ./build/all_reduce_perf -b 1K -e 4K -f 2 -g 1",
             "NCCL version 2.26.2+cuda12.8", "node01:1234:1234 [0] NCCL INFO Bootstrap : Using eth0"]
    text = "\n".join(noisy[:1] + lines[:3] + noisy[1:] + lines[3:])
    log = cm.parse_nccl_tests(text)
    assert log.kind == "all_reduce" and [r.size_bytes for r in log.rows] == [1024, 2048, 4096]


def test_a_broken_table_row_is_refused_with_its_line_number():
    lines = TABLE.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith("2048"))
    lines[i] = lines[i].replace("21.00", "21.0x", 1)
    with pytest.raises(ValueError, match=rf"line {i + 1}: out-of-place time '21.0x'"):
        cm.parse_nccl_tests("\n".join(lines))
    with pytest.raises(ValueError, match="no data lines"):
        cm.parse_nccl_tests("NCCL version 2.26.2\nuser@host:~$ ls\n")


def test_times_in_milliseconds_are_read_as_microseconds():
    text = TABLE.replace("(us)", "(ms)")
    log = cm.parse_nccl_tests(text)
    assert [r.oop_time_us for r in log.rows] == [20000.0, 21000.0, 22000.0]


def test_a_multi_gpu_per_process_log_counts_its_ranks():
    # `-g 8`: one process, eight Rank lines
    log = cm.parse_nccl_tests(PUBLISHED / "nccltests290_h100_1node_all_reduce.txt")
    assert log.kind == "all_reduce" and log.ranks == 8


def test_the_fitted_model_changes_the_plan_prices_it_should():
    # what the fit changes for planning: one-node small collectives now cost ~20-25 µs, where
    # NCCL's table said ~11-15 (the measured floor), and 2-node tree all-reduces run faster
    topo = cm.Topology((8,), "h100")
    now = cm.NCCLCollectives(topo)
    table = cm.NCCLCollectives(topo, measured=cm.MeasuredNccl.nccl_tuning_table())
    for kind in ("all_reduce", "all_gather"):
        assert 18.0 <= now.time_us(kind, 8, 0) <= 30.0
        assert now.time_us(kind, 8, 0) > 1.5 * table.time_us(kind, 8, 0)
    two = cm.Topology((16,), "h100", gpus_per_node=8)
    assert cm.NCCLCollectives(two).time_us("all_reduce", 2**30, 0) < 0.85 * cm.NCCLCollectives(
        cm.Topology((16,), "h100", gpus_per_node=8, net_efficiency=0.92),
        measured=cm.MeasuredNccl.nccl_tuning_table()).time_us("all_reduce", 2**30, 0)
    # a measured constant set is a value: changing one field prices differently
    slower = dataclasses.replace(cm.MeasuredNccl(), launch_us=20.0)
    assert cm.NCCLCollectives(topo, measured=slower).time_us("all_gather", 8, 0) == pytest.approx(
        now.time_us("all_gather", 8, 0) + 10.0)

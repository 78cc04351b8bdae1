"""The planner benchmark's frontier table: child processes measured, targets checked (no planning)."""

import json
import sys

from _helpers import benchmark_script

#: Bytes the child below allocates and touches: well above an idle interpreter's resident set.
CHILD_ALLOC_BYTES = 200 * 2**20


def _load():
    return benchmark_script("planner")


def test_run_child_reads_its_peak_rss_and_stdout():
    bench = _load()
    code = f"b = bytearray({CHILD_ALLOC_BYTES}); print('{{\"ok\": 1}}')"
    run = bench.run_child([sys.executable, "-c", code], timeout_s=60)
    assert run.returncode == 0 and not run.timed_out
    assert run.maxrss_bytes >= CHILD_ALLOC_BYTES
    assert bench._plan_json("banner\n" + run.stdout) == {"ok": 1}


def test_a_child_reporting_its_own_peak_is_believed_over_ru_maxrss():
    """On Linux ``ru_maxrss`` keeps the forking parent's high-water mark across ``exec``; a frontier
    child reports its own (``VmHWM``) on stderr, and that is the figure used."""
    bench = _load()
    code = f"import sys; sys.stderr.write('{bench.PEAK_TAG} 12345\\n')"
    assert bench.run_child([sys.executable, "-c", code], timeout_s=60).maxrss_bytes == 12345
    # the frontier's own wrapper around the CLI reports a plausible peak (an interpreter with apmodel's
    # CLI loaded: tens of MB at least)
    run = bench.run_child([sys.executable, "-c", bench.PEAK_REPORTING_CLI, "devices"], timeout_s=120)
    assert run.returncode == 0, run.stderr
    assert bench.PEAK_TAG in run.stderr and 10 * 2**20 < run.maxrss_bytes < 4 * 2**30


def test_run_child_kills_at_timeout():
    run = _load().run_child([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    assert run.timed_out and run.returncode != 0 and run.wall_s < 30


def _plan(total_s, peak_bytes, bound_us=100.0):
    return {"nodes": 10, "trace_s": 1.0, "build_s": 1.0, "solve_s": total_s - 2.0, "total_s": total_s,
            "objective_us": 100.0, "lower_bound_us": bound_us, "status": "feasible",
            "memory": {"peak_bytes": peak_bytes}, "memory_limit_bytes": 77e9, "warnings": []}


def test_frontier_row_checks():
    bench = _load()
    by_name = {w.name: w for w in bench.FRONTIER_WORKLOADS}
    big = by_name["llama3-405b"]
    ok = bench.ChildRun(0, 50.0, 2**30, json.dumps(_plan(40.0, 30e9)), "")
    row = bench.frontier_row(big, ok, None)
    assert row["checks"] == {"time": True, "rss": True, "fit": True} and row["passed"] is True
    assert row["gpus"] == 8 * 8 * 16
    heavy = bench.ChildRun(0, 90.0, 5 * 2**30, json.dumps(_plan(70.0, 90e9)), "")
    assert bench.frontier_row(big, heavy, None)["checks"] == {"time": False, "rss": False, "fit": False}
    unseeded = by_name["llama3-8b-unseeded"]
    loose = bench.ChildRun(0, 20.0, 2**30, json.dumps(_plan(10.0, 1e9, bound_us=99.0)), "")
    assert bench.frontier_row(unseeded, loose, None)["checks"] == {"time": True, "gap": False}
    failed = bench.ChildRun(1, 5.0, 2**29, "", "Traceback ...\nValueError: out of memory: use --ac full\n")
    row = bench.frontier_row(big, failed, None)
    assert row["passed"] is False and "out of memory" in row["error"]
    info = bench.frontier_row(by_name["qwen3-32b"], ok, None)
    assert info["checks"] == {} and info["passed"] is None


def test_frontier_only_table_and_json(tmp_path, monkeypatch, capsys):
    bench = _load()
    seen = []

    def fake_run_child(cmd, timeout_s, cwd=None):
        seen.append(cmd)
        return bench.ChildRun(0, 3.0, 2**29, json.dumps(_plan(2.2, 11e9)), "")

    monkeypatch.setattr(bench, "run_child", fake_run_child)
    out = tmp_path / "frontier.json"
    result = bench.main(["--frontier-only", "--frontier", "llama3-8b,qwen3-32b", "--json", str(out)])
    assert [c[c.index("--model") + 1] for c in seen] == ["llama3-8b", "qwen3-32b"]
    assert all("--json" in c and c[c.index("--mesh") + 1] in ("4x8", "8x8") for c in seen)
    assert result["end_to_end"] == result["scalability"] == result["replanning"] == []
    text = capsys.readouterr().out
    assert "Frontier" in text and "load average" in text and "pass" in text
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["frontier"]] == ["llama3-8b", "qwen3-32b"]
    assert len(data["load_average"]["start"]) == 3 and data["frontier"][0]["passed"] is True

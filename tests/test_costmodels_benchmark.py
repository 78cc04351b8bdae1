"""The collective-table benchmark script runs and prints JSON."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "costmodels.py"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_costmodels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_json(capsys):
    assert _load().main(["--mesh", "2x8", "--device", "h100", "--max", "1M", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == [2, 8] and len(out["axes"]) == 2
    rows = out["rows"]
    assert {r["kind"] for r in rows} == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert all(r["time_us"] > 0 for r in rows)


def test_benchmark_table(capsys):
    assert _load().main(["--mesh", "8", "--device", "b200", "--kinds", "all_reduce", "--max", "64K"]) == 0
    assert "all_red" in capsys.readouterr().out

"""The collective-table benchmark script runs and prints JSON."""

import json

from _helpers import benchmark_script


def _load():
    return benchmark_script("costmodels")


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

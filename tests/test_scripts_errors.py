"""The example and benchmark scripts: documented options and clear errors (run as subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str):
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_costmodels_benchmark_json_path_writes_file_and_prints_table(tmp_path):
    """README: the benchmark scripts "print a table and write JSON (`--json PATH`)"."""
    out = tmp_path / "costmodels.json"
    proc = run("benchmarks/costmodels.py", "--mesh", "8", "--kinds", "all_reduce", "--max", "64K", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce" in proc.stdout and str(out) in proc.stdout  # the table, then where the JSON went
    data = json.loads(out.read_text())
    assert data["mesh"] == [8] and {r["kind"] for r in data["rows"]} == {"all_reduce"}
    # --json alone (or -) keeps printing the bare JSON object for pipes
    proc = run("benchmarks/costmodels.py", "--mesh", "8", "--kinds", "all_reduce", "--max", "1K", "--json", "-")
    assert proc.returncode == 0 and json.loads(proc.stdout)["mesh"] == [8]


def test_costmodels_benchmark_bad_json_dir_fails_first(tmp_path):
    proc = run("benchmarks/costmodels.py", "--json", str(tmp_path / "nope" / "x.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "nope" in proc.stderr.splitlines()[-1] and "does not exist" in proc.stderr


@pytest.mark.parametrize("mesh,world,expect", [
    ("2x3", "4", "--mesh 2x3 has 6 devices but the world size is 4 processes"),
    ("2y2", "4", "--mesh '2y2': expected axis sizes"),
    (None, None, "WORLD_SIZE is not set"),
])
def test_train_llama_checks_mesh_against_world_size(mesh, world, expect):
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    if world is not None:
        env["WORLD_SIZE"] = world
    args = ["--mesh", mesh] if mesh else []
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), *args], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert expect in proc.stderr.splitlines()[-1]


def test_pipelines_benchmark_names_what_is_wrong(tmp_path):
    proc = run("benchmarks/pipelines.py", "--only", "no-such-run")
    assert proc.returncode == 2 and "no-such-run" in proc.stderr.splitlines()[-1] and "70b-4x8x8" in proc.stderr
    proc = run("benchmarks/pipelines.py", "--json", str(tmp_path / "nope" / "x.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr.splitlines()[-1]

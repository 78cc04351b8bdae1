"""Plan files: malformed input is a PlanFileError naming the field; diff refuses incomparable
plans; the warnings a plan carries; a hypothesis fuzzer over mutated plan files."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apmodel
import apmodel.models
from apmodel.core import placements as pl
from apmodel.result.plans import Plan, PlanFileError, PlanMismatch, diff

OVERRIDES = dict(n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=8)


def _tiny_step() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.device("meta"):
        m = apmodel.models.build("llama3-debug", **OVERRIDES)
    return m, apmodel.models.sample_inputs(apmodel.models.config("llama3-debug", **OVERRIDES), 4, 8, device="meta")


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    m, inputs = _tiny_step()
    return apmodel.plan(m, (2, 2), inputs)


@pytest.fixture(scope="module")
def valid_text(tiny_plan) -> str:
    return json.dumps(tiny_plan.to_json())


def _valid(text: str) -> dict[str, Any]:
    return json.loads(text)


def _first_node(d: dict[str, Any]) -> str:
    return next(iter(d["node_strategy"]))


def _first_param(d: dict[str, Any]) -> str:
    return next(iter(d["param_placements"]))


# --------------------------------------------------------------------------- named errors
def _set(path: tuple, value: Any):
    def mutate(d: dict[str, Any]) -> None:
        target = d
        keys = [k(d) if callable(k) else k for k in path]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return mutate


def _delete(key: str):
    return lambda d: d.pop(key)


BAD = [
    # (mutation, expected message fragment)
    (_set(("mesh_shape",), "abc"), "field 'mesh_shape' must be a non-empty list of positive ints, got 'abc'"),
    (_set(("mesh_shape",), [2, 0]), "field 'mesh_shape'"),
    (_set(("mesh_shape",), [2, True]), "field 'mesh_shape'"),
    (_set(("mesh_shape",), []), "field 'mesh_shape'"),
    (_set(("mesh_shape",), [2, 2, 2]), "has 2 tokens, the mesh has 3 axes"),
    (_set(("mesh_shape",), [4]), "has 2 tokens, the mesh has 1 axes"),
    (_set(("node_strategy",), {}), "field 'node_strategy' is empty"),
    (_set(("node_strategy",), []), "field 'node_strategy' must be an object"),
    (_set(("node_strategy", _first_node), "S(0)R"), "field \"node_strategy['primals_1']\" must be an object"),
    (_set(("node_strategy", _first_node, "out"), []), ".out\" must be a non-empty list"),
    (_set(("node_strategy", _first_node, "out"), ["S(0)S(1)R"]), "has 3 tokens, the mesh has 2 axes"),
    (_set(("node_strategy", _first_node, "out"), ["S(x)R"]), "malformed placement string"),
    (_set(("node_strategy", _first_node, "out"), [7]), ".out[0]\" must be a placement string"),
    (_set(("param_placements",), "S(0)R"), "field 'param_placements' must be an object"),
    (_set(("param_placements", _first_param), None), "must be a placement string"),
    (_set(("param_placements", _first_param), "RRR"), "has 3 tokens, the mesh has 2 axes"),
    (_set(("objective_us",), [1.0]), "field 'objective_us' must be a number (µs), got [1.0]"),
    (_set(("objective_us",), "12"), "field 'objective_us' must be a number"),
    (_set(("comm_us",), None), "field 'comm_us' must be a number"),
    (_set(("fingerprint",), 12), "field 'fingerprint' must be a string"),
    (_set(("comm_by_collective",), {"all_gather@axis0": "x"}), "field \"comm_by_collective['all_gather@axis0']\""),
    (_set(("per_layer",), []), "field 'per_layer' must be an object"),
    (_set(("sizes",), {"nodes": 1.5}), "field \"sizes['nodes']\" must be an integer"),
    (_set(("solver",), "trws"), "field 'solver' must be an object"),
    (_set(("warnings",), "careful"), "field 'warnings' must be a list of strings"),
    (_set(("version",), True), "plan format version True is not supported"),
    (_set(("format",), "other"), "not an apmodel plan file"),
    (_delete("node_strategy"), "missing field 'node_strategy'"),
    (_delete("objective_us"), "missing field 'objective_us'"),
    # what an edit alone changes: the file disagrees with itself (issue 43: each was read without a word)
    (_set(("mesh_shape",), [2, 3]), "field 'mesh_shape' [2, 3] disagrees with 'workload.mesh' [2, 2], the mesh it was "
                                    "planned on: the file was edited or is corrupt: restore it or re-plan"),
    (_set(("objective_us",), -1.0), "field 'objective_us' must be a time >= 0 (µs), got -1.0"),
    (_set(("comm_us",), -0.5), "field 'comm_us' must be a time >= 0 (µs), got -0.5"),
    (_set(("objective_us",), 1.0), "field 'objective_us' 1.0 disagrees with 'overlap.step_us'"),
    (_set(("comm_by_collective",), {"all_gather@axis0": -3.0}), "field \"comm_by_collective['all_gather@axis0']\" must "
                                                                 "be a number >= 0"),
    (_set(("comm_by_collective",), {"all_gather@axis2": 3.0}), "names mesh axis 2, outside mesh (2, 2)"),
    (_set(("memory", "peak_bytes"), -1), "field \"memory['peak_bytes']\" must be a number of bytes >= 0"),
    (_set(("fingerprint",), "edited"), "field 'fingerprint' must be the 64 hex digits of the graph's sha256, got "
                                       "'edited': the file was edited"),
    (_set(("structure_fingerprint",), "0" * 63 + "g"), "field 'structure_fingerprint' must be the 64 hex digits"),
    (_set(("param_placements", "not.a.param"), "RR"), "field \"param_placements['not.a.param']\" places a parameter "
                                                      "the planned model does not have"),
    (lambda d: d["param_placements"].pop(_first_param(d)), "field 'param_placements' does not place parameter"),
    (_set(("sizes", "nodes"), 7), "\"sizes['nodes']\" says the graph has 7"),
    (_set(("workload", "gpus_per_node"), 3), "field 'workload.gpus_per_node': 3 lays mesh (2, 2) onto nodes unevenly"),
    (_set(("objectve_us",), 1.0), "unknown field 'objectve_us' (a plan file holds format, version, mesh_shape"),
]


@pytest.mark.parametrize("mutate,message", BAD, ids=[m for _, m in BAD])
def test_malformed_plan_is_a_named_error(valid_text, mutate, message):
    d = _valid(valid_text)
    mutate(d)
    with pytest.raises(PlanFileError) as e:
        Plan.from_json(d, "plan.json")
    assert str(e.value).startswith("plan.json: ") and message in str(e.value), str(e.value)


def test_load_refuses_unreadable_files(valid_text, tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(valid_text[: len(valid_text) // 2])
    with pytest.raises(PlanFileError, match="not valid JSON"):
        Plan.load(p)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanFileError, match="not UTF-8"):
        Plan.load(p)
    p.write_text("[" * 100_000)
    with pytest.raises(PlanFileError):
        Plan.load(p)
    with pytest.raises(PlanFileError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")


def test_roundtrip_and_old_files_without_warnings(tiny_plan, valid_text, tmp_path):
    loaded = Plan.from_json(_valid(valid_text))
    assert loaded.node_strategy == tiny_plan.node_strategy and loaded.warnings == tiny_plan.warnings == []
    tiny_plan.warnings.append("a note")
    try:
        path = tmp_path / "p.json"
        tiny_plan.save(path)
        assert Plan.load(path).warnings == ["a note"]
    finally:
        tiny_plan.warnings.pop()
    old = _valid(valid_text)
    del old["warnings"], old["compute_us"], old["sizes"]
    plan = Plan.from_json(old)
    assert plan.warnings == [] and math.isnan(plan.compute_us)


# --------------------------------------------------------------------------- diff
def _one_axis(d: dict[str, Any]) -> dict[str, Any]:
    """The same plan cut to its first mesh axis (a plan for another mesh)."""
    d = copy.deepcopy(d)
    d["mesh_shape"] = d["workload"]["mesh"] = d["mesh_shape"][:1]
    d["comm_by_collective"] = {k: v for k, v in d["comm_by_collective"].items() if k.endswith("@axis0")}
    cut = lambda s: None if s is None else pl.tuple_to_str(pl.parse(s)[:1])  # noqa: E731
    d["param_placements"] = {k: cut(v) for k, v in d["param_placements"].items()}
    d["node_strategy"] = {k: {"out": [cut(p) for p in v["out"]], "in": [cut(p) for p in v["in"]]}
                          for k, v in d["node_strategy"].items()}
    return d


def test_diff_refuses_other_mesh_or_graph_unless_allowed(tiny_plan, valid_text):
    d = _valid(valid_text)
    same = Plan.from_json(d)
    assert diff(tiny_plan, same) == []
    other_mesh = Plan.from_json(_one_axis(d))
    with pytest.raises(PlanMismatch, match=r"mesh \(2, 2\) vs \(2,\)"):
        diff(tiny_plan, other_mesh)
    rows = diff(tiny_plan, other_mesh, allow_mismatch=True)
    assert {r["kind"] for r in rows} == {"param", "node"} and all(set(r) == {"kind", "name", "a", "b"} for r in rows)
    d["structure_fingerprint"] = "0" * 64
    with pytest.raises(PlanMismatch, match="graph structure"):
        diff(tiny_plan, Plan.from_json(d))
    assert diff(tiny_plan, Plan.from_json(d), allow_mismatch=True) == []


# --------------------------------------------------------------------------- warnings
class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _mse(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out * out).mean()


def _mlp_plan(mesh: tuple[int, ...], loss_fn=_mse) -> Plan:
    with torch.device("meta"):
        m = TinyMLP()
    return apmodel.plan(m, mesh, (torch.randn(16, 32, device="meta"),), loss_fn=loss_fn)


def test_a_sharded_scalar_loss_plan_has_no_warnings(tiny_plan):
    assert tiny_plan.warnings == []


def test_warning_all_replicated_when_nothing_divides(caplog):
    with caplog.at_level(logging.WARNING, logger="apmodel.result.plans"):
        plan = _mlp_plan((3,))  # 16, 32, 64: nothing divisible by 3
    assert len(plan.warnings) == 1
    assert "replicates everything" in plan.warnings[0] and "axis 0 (size 3)" in plan.warnings[0]
    assert "no candidate" in plan.warnings[0]
    assert plan.warnings[0] in caplog.text


def test_warning_names_the_idle_axis():
    plan = _mlp_plan((2, 7))
    assert len(plan.warnings) == 1, plan.warnings
    assert plan.warnings[0].startswith("mesh axis 1 (size 7): nothing is sharded") and "no candidate" in plan.warnings[0]


def test_warning_non_scalar_output():
    plan = _mlp_plan((4,), loss_fn=None)
    assert any(w.startswith("model output") and "(16, 32)" in w and "not a scalar loss" in w for w in plan.warnings)
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).warnings == plan.warnings


# --------------------------------------------------------------------------- fuzzing
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
PLACEMENT_TEXT = st.text(alphabet="RSP()0123 ,x-", max_size=14)


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _check_result(plan: Plan) -> None:
    """What a plan that loads must satisfy."""
    ndim = len(plan.mesh_shape)
    assert ndim >= 1 and all(isinstance(s, int) and s > 0 for s in plan.mesh_shape)
    assert plan.node_strategy and all(isinstance(w, str) for w in plan.warnings)
    for s in plan.node_strategy.values():
        assert s.outputs and all(p is None or len(p) == ndim for p in (*s.outputs, *s.inputs))
    assert all(len(p) == ndim for p in plan.param_placements.values())
    assert all(isinstance(getattr(plan, k), float) for k in ("objective_us", "compute_us", "comm_us"))
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(plan.to_json(), sort_keys=True)


def _load_dict(d: Any) -> None:
    try:
        plan = Plan.from_json(d, "fuzz.json")
    except PlanFileError as e:
        assert str(e).startswith("fuzz.json: "), str(e)
        return
    _check_result(plan)


FUZZ = settings(max_examples=200, deadline=None, derandomize=True,  # the same examples every run
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(data=st.data())
def test_fuzz_plan_dict(valid_text, data):
    d = _valid(valid_text)
    paths = _paths(d)
    top = [(k,) for k in d]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(top) | st.sampled_from(paths), label="path")
        parent = d
        try:
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
        action = data.draw(st.sampled_from(["delete", "json", "placement", "wrap"]), label="action")
        if action == "delete":
            del parent[path[-1]]
        elif action == "json":
            parent[path[-1]] = data.draw(JSON, label="value")
        elif action == "placement":
            parent[path[-1]] = data.draw(PLACEMENT_TEXT, label="placement")
        else:  # a value of the wrong container type
            parent[path[-1]] = [parent[path[-1]]] if not isinstance(parent[path[-1]], list) else {"x": parent[path[-1]]}
    _load_dict(d)


@FUZZ
@given(value=JSON)
def test_fuzz_plan_any_json(value):
    _load_dict(value)
    _load_dict({"format": "apmodel-plan", "version": 1, "mesh_shape": [2], "fingerprint": "f",
                "structure_fingerprint": "s", "objective_us": 1.0, "param_placements": {}, "node_strategy": value})


@FUZZ
@given(data=st.data())
def test_fuzz_plan_file_text(valid_text, data):
    kind = data.draw(st.sampled_from(["truncate", "splice", "bytes"]), label="kind")
    raw = valid_text.encode()
    if kind == "truncate":
        blob = raw[: data.draw(st.integers(0, len(raw)), label="cut")]
    elif kind == "splice":
        at = data.draw(st.integers(0, len(raw)), label="at")
        blob = raw[:at] + data.draw(st.binary(max_size=8), label="junk") + raw[at + data.draw(st.integers(0, 8)):]
    else:
        blob = data.draw(st.binary(max_size=200), label="bytes")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.json"
        path.write_bytes(blob)
        try:
            plan = Plan.load(path)
        except PlanFileError as e:
            assert str(e).startswith(str(path)), str(e)
            return
    _check_result(plan)


# --- validated in full on load: ranks, finite numbers, regular files -------------------------------
def test_a_placement_sharding_a_dimension_the_tensor_lacks_is_refused(valid_text):
    d = _valid(valid_text)
    node = next(k for k, v in d["node_strategy"].items() if v["out_ndim"][0] == 2)
    d["node_strategy"][node]["out"][0] = "S(7)R"
    with pytest.raises(PlanFileError, match=rf"node_strategy\['{node}'\]\.out\[0\].*S\(7\)R shards dimension 7 "
                                            r"of a tensor of rank 2"):
        Plan.from_json(d, "edited.json")
    d = _valid(valid_text)
    fqn = next(k for k, r in d["param_ndim"].items() if r == 1)  # a norm weight
    d["param_placements"][fqn] = "S(1)S(0)"
    with pytest.raises(PlanFileError, match=rf"param_placements\['{re.escape(fqn)}'\].*shards dimension 1 of a tensor of rank 1"):
        Plan.from_json(d, "edited.json")
    d = _valid(valid_text)
    del d["node_strategy"][node]["in_ndim"]
    with pytest.raises(PlanFileError, match="'out_ndim' and 'in_ndim' come together"):
        Plan.from_json(d, "edited.json")


@pytest.mark.parametrize("field,value", [("objective_us", float("nan")), ("comm_us", float("inf")),
                                         ("timings", {"solve_s": float("nan")}),
                                         ("memory", {"peak_bytes": float("inf")})])
def test_numbers_that_are_not_finite_are_refused(valid_text, field, value):
    d = _valid(valid_text)
    d[field] = value
    with pytest.raises(PlanFileError, match=rf"edited.json: field .{{0,2}}{field}.* must be a finite number"):
        Plan.from_json(d, "edited.json")


def test_a_version_1_file_still_loads_without_rank_checks(valid_text):
    d = _valid(valid_text)
    d["version"] = 1
    del d["param_ndim"]
    for v in d["node_strategy"].values():
        del v["out_ndim"], v["in_ndim"]
    plan = Plan.from_json(d, "old.json")
    assert plan.node_strategy and not plan.node_ranks
    assert Plan.from_json(plan.to_json(), "again.json").node_strategy == plan.node_strategy


def test_a_fifo_is_refused_not_read(tmp_path):
    import os

    from apmodel.frontend.config import ConfigError, load_config

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(PlanFileError, match="not a regular file"):
        Plan.load(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)


def test_replay_refuses_an_edited_fingerprint_or_says_it_differs(valid_text, tmp_path, caplog):
    """apmodel.plan(..., replay=path) read a plan file with an edited fingerprint without a word."""
    path = tmp_path / "edited.json"
    d = _valid(valid_text)
    d["fingerprint"] = "edited"
    path.write_text(json.dumps(d))
    m, inputs = _tiny_step()
    with pytest.raises(PlanFileError, match=rf"^{re.escape(str(path))}: field 'fingerprint' must be the 64 hex digits"):
        apmodel.plan(m, (2, 2), inputs, replay=path)
    # a well-formed fingerprint of another graph: replay takes other shapes of the same structure, and says so
    d["fingerprint"] = "0" * 64
    path.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING, logger="apmodel.result.plans"):
        replayed = apmodel.plan(m, (2, 2), inputs, replay=path)
    said = [r.getMessage() for r in caplog.records if "replayed plan" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("replayed plan was made for a graph with fingerprint 000000000000, "
                                                 f"this model traces to {replayed.fingerprint[:12]}"), said
    assert "the plan file was edited: re-plan" in said[0]
    assert replayed.node_strategy == Plan.from_json(_valid(valid_text)).node_strategy
    caplog.clear()
    path.write_text(valid_text)  # the file as written: replayed without a warning
    with caplog.at_level(logging.WARNING, logger="apmodel.result.plans"):
        apmodel.plan(m, (2, 2), inputs, replay=path)
    assert not [r for r in caplog.records if "replayed plan" in r.getMessage()]

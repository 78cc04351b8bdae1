"""The TOML configuration loader: malformed files are a ConfigError naming the key; a hypothesis
fuzzer over mutated valid configurations (as tables and as text)."""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apmodel.core import placements as pl
from apmodel.frontend.config import _SCHEMA, Config, ConfigError, load_config, parse_config, parse_config_text
from apmodel.frontend.workloads import parse_mesh
from apmodel.problem import constraints as C
from apmodel.problem.pricing import DTYPES

EXAMPLE = Path(__file__).parent.parent / "examples" / "apmodel.toml"

# Every key the loader knows, with a valid value.
FULL: dict[str, Any] = {
    "workload": {"model": "llama3-8b", "mesh": "4x8", "seq": 2048, "batch": 8, "layers": 32},
    "pricing": {"device": "h100", "dtype": "bf16", "mixed_precision": True, "execution": "eager", "gpus_per_node": 8,
                "topology": {"intra_GBps": 450.0, "inter_GBps": 50.0, "intra_latency_us": 0.0,
                             "inter_latency_us": 0.0, "nvls": True},
                "calibration": "calibration.json", "compute_profile": "profile.json",
                "compute_model": "mypkg.costs:MyCompute", "comm_model": "mypkg.costs:MyCollectives", "bucket_mb": 25.0,
                "weight_microbatches": 1, "overlap": True, "inflight_mb": 64.0, "optimizer": "sgd", "ac": "selective",
                "memory_limit_bytes": 7e10},
    "search": {"param_policy": "full_shard", "replicate_axes": [0], "param_memory_fraction": 0.25,
               "merge_copies": True, "flow_coupling": True, "seeding": True, "seed_radius": 2,
               "seed_widen_inputs": False, "input_placements": ["S(0)R", "default"], "output_placements": ["RR"]},
    "pipeline": {"pp_axis": 0, "pp_degrees": [1, 2, 4], "microbatches": 8, "pp_schedule": "interleaved"},
    "solving": {"solver": "trws", "time_limit": 60.0, "solver_options": {"max_iters": 300}, "seed_solver": "highs"},
    "constraints": [
        {"fix": "layers.*.attention.wo.weight", "placement": "S(0)S(1)"},
        {"forbid": "output.weight", "placement": "RR", "on": "input:1", "name": "no"},
        {"linear": "few", "terms": [["layers.*.ffn_norm.weight", "RR", 1.0]], "sense": "<=", "rhs": 4},
    ],
}
FULL_TEXT = """
[workload]
model = "llama3-8b"
mesh = "4x8"
seq = 2048
batch = 8
layers = 32

[solving]
solver = "trws"
time_limit = 60.0
solver_options = { max_iters = 300 }
seed_solver = "highs"

[pricing]
device = "h100"
dtype = "bf16"
mixed_precision = true
execution = "eager"
gpus_per_node = 8
calibration = "calibration.json"
compute_profile = "profile.json"
compute_model = "mypkg.costs:MyCompute"
comm_model = "mypkg.costs:MyCollectives"
bucket_mb = 25.0
weight_microbatches = 1
overlap = true
inflight_mb = 64.0
optimizer = "sgd"
ac = "selective"
memory_limit_bytes = 7e10

[pricing.topology]
intra_GBps = 450.0
inter_GBps = 50.0
intra_latency_us = 0.0
inter_latency_us = 0.0
nvls = true

[search]
param_policy = "full_shard"
replicate_axes = [0]
param_memory_fraction = 0.25
merge_copies = true
flow_coupling = true
seeding = true
seed_radius = 2
seed_widen_inputs = false
input_placements = ["S(0)R", "default"]
output_placements = ["RR"]

[pipeline]
pp_axis = 0
pp_degrees = [1, 2, 4]
microbatches = 8
pp_schedule = "interleaved"

[[constraints]]
fix = "layers.*.attention.wo.weight"
placement = "S(0)S(1)"
[[constraints]]
forbid = "output.weight"
placement = "RR"
on = "input:1"
name = "no"
[[constraints]]
linear = "few"
terms = [["layers.*.ffn_norm.weight", "RR", 1.0]]
sense = "<="
rhs = 4
"""


#: FULL_TEXT as earlier versions spelled it (sections by kind of setting, memory_limit_GB, bucket_MB, ...).
OLD_FULL_TEXT = """
[workload]
model = "llama3-8b"
mesh = "4x8"
seq = 2048
batch = 8
layers = 32

[solver]
backend = "trws"
time_limit = 60.0
options = { max_iters = 300 }
seed_backend = "highs"

[device]
name = "h100"
dtype = "bf16"
mixed_precision = true
execution = "eager"

[topology]
gpus_per_node = 8
intra_GBps = 450.0
inter_GBps = 50.0
intra_latency_us = 0.0
inter_latency_us = 0.0
nvls = true

[cost]
calibration = "calibration.json"
compute_profile = "profile.json"
compute_model = "mypkg.costs:MyCompute"
comm_model = "mypkg.costs:MyCollectives"
bucket_MB = 25.0
overlap = true
inflight_mb = 64.0

[planner]
param_policy = "full_shard"
replicate_axes = [0]
param_memory_fraction = 0.25
optimizer = "sgd"
ac = "selective"
memory_limit_GB = 70.0
merge_copies = true
flow_coupling = true
seeding = true
seed_radius = 2
seed_widen_inputs = false
input_placements = ["S(0)R", "default"]
output_placements = ["RR"]

[pipeline]
axis = 0
degrees = [1, 2, 4]
microbatches = 8
schedule = "interleaved"

"""


def test_old_configs_load_as_the_new_keys_with_a_warning_each(caplog):
    with caplog.at_level("WARNING", logger="apmodel.frontend.config"):
        old = parse_config_text(OLD_FULL_TEXT, "old.toml")
    # weight_microbatches came after the old names: the old files never had it
    new = parse_config_text(FULL_TEXT.split("[[constraints]]")[0].replace("weight_microbatches = 1\n", ""), "old.toml")
    assert old == new
    assert "deprecated keys, read as their new names" in caplog.text
    assert "'planner.memory_limit_GB' -> 'pricing.memory_limit_bytes' (GB then, bytes now" in caplog.text
    assert "'cost.bucket_MB' -> 'pricing.bucket_mb'" in caplog.text
    assert "'topology.nvls' -> 'pricing.topology.nvls'" in caplog.text
    assert len(caplog.records) == 1  # one warning per file, naming every old key


def test_valid_configs_load(tmp_path):
    # FULL holds every key but the second storage budget (param_budget_ratio excludes param_memory_fraction)
    keys = {(section, key) for section, body in _SCHEMA.items() for key in body}
    assert keys - {(s, k) for s, body in FULL.items() if s != "constraints" for k in body} == {
        ("search", "param_budget_ratio")}
    assert parse_config(copy.deepcopy(FULL)) == parse_config_text(FULL_TEXT)
    cfg = parse_config(copy.deepcopy(FULL), base_dir=tmp_path)
    assert cfg.options["calibration"] == str(tmp_path / "calibration.json") and len(cfg.constraints) == 3
    assert cfg.options["compute_profile"] == str(tmp_path / "profile.json")
    load_config(EXAMPLE)


BAD = [
    ('[workload]\nmesh = "4y8"\n', "workload.mesh"),
    ('[workload]\nmesh = "0x4"\n', "workload.mesh"),
    ('[workload]\nmodel = ""\n', "workload.model"),
    ('[pricing]\ndtype = "int4"\n', "pricing.dtype"),
    ('[pricing]\noptimizer = "lion"\n', "pricing.optimizer"),
    ('[pricing]\nmemory_limit_bytes = 0\n', "pricing.memory_limit_bytes"),
    ('[solving]\ntime_limit = nan\n', "solving.time_limit"),
    ('[solving]\ntime_limit = inf\n', "solving.time_limit"),
    ('[pricing.topology]\ninter_GBps = 0\n', "pricing.topology"),
    ('[pricing]\ntopology = { intra_latency_us = -1.0 }\n', "pricing.topology"),
    ('[pricing.topology]\nintra = 1.0\n', "unknown key 'intra'"),
    ('[pricing]\ncompute_model = "mypkg.costs.MyCompute"\n', "pricing.compute_model"),
    ('[planner]\nmemory_limit_GB = 0\n', "planner.memory_limit_GB"),  # an old key, named as written
    ('[planner]\nmemory_limit_bytes = 1\n', "unknown key 'planner.memory_limit_bytes'"),
    ('[[constraints]]\nfix = "a"\nplacement = "S(x)R"\n', "constraints[0].placement"),
    ('[[constraints]]\nfix = "a"\nplacement = "RR"\non = "inputx3"\n', "constraints[0].on"),
    ('[[constraints]]\nlinear = "x"\nterms = [["a", "Q", 1.0]]\nsense = "<="\nrhs = 1\n', "constraints[0].terms[0]"),
    ('[[constraints]]\nlinear = "x"\nterms = [["a", "R", nan]]\nsense = "<="\nrhs = 1\n', "constraints[0].terms[0]"),
    ('[[constraints]]\nlinear = "x"\nterms = []\nsense = ["<="]\nrhs = 1\n', "constraints[0].sense"),
    ('[[constraints]]\nlinear = "x"\nterms = []\nsense = "<="\nrhs = inf\n', "constraints[0].rhs"),
    ("[workload\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(text, key):
    with pytest.raises(ConfigError) as e:
        parse_config_text(text, "apmodel.toml")
    assert str(e.value).startswith("apmodel.toml: ") and key in str(e.value), str(e.value)


def test_unreadable_config_files(tmp_path):
    p = tmp_path / "c.toml"
    p.write_bytes(b"[solving]\nsolver = \"\xff\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)
    p.write_text("a = " + "[" * 50_000)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="table of sections"):
        parse_config(["not", "a", "table"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- fuzzing
TOML_VALUE = st.recursive(
    st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=12)
    | st.datetimes() | st.dates() | st.times(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# values that pass the type check but may break a range or format check
NEAR_VALID = st.sampled_from([0, -1, 1, 2**63 - 1, 0.0, -0.5, 1.5, math.inf, -math.inf, math.nan, "", " ", "4x8",
                              "x", "RR", "S(0)", "S(-1)", "input:", "input:2", "free", "bf16", "a:b", ":", [], [-1],
                              [True], [0, 1], {}, {"fix": "a"}, True, False])


def _check_result(cfg: Config) -> None:
    """What a configuration that loads must satisfy."""
    options = cfg.plan_options()  # every value set is one the planning options take
    for name, value in cfg.options.items():
        if name == "pp_degrees":  # kept sorted and distinct
            value = sorted(set(value))
        assert getattr(options, name) == (tuple(value) if isinstance(value, list) else value), name
        for v in value.values() if isinstance(value, dict) else [value]:
            assert not (isinstance(v, float) and math.isnan(v)), (name, v)
    for attr in ("model", "mesh", "seq", "batch", "layers"):
        v = getattr(cfg, attr)
        assert v is None or isinstance(v, str if attr in ("model", "mesh") else int) and not isinstance(v, bool), attr
    assert all(isinstance(c, (C.Fix, C.Forbid, C.Linear)) for c in cfg.constraints)
    # and the values the command line would use next are usable
    if cfg.mesh is not None:
        parse_mesh(cfg.mesh)
    assert options.dtype in DTYPES
    assert options.time_limit is None or 0 < options.time_limit < math.inf
    topo = options.topology
    assert all(topo.get(k) is None or 0 < topo[k] < math.inf for k in ("intra_GBps", "inter_GBps"))
    assert all(topo.get(k) is None or 0 <= topo[k] < math.inf for k in ("intra_latency_us", "inter_latency_us"))
    for c in cfg.constraints:
        for placement in [c.placement] if not isinstance(c, C.Linear) else [t[1] for t in c.terms]:
            pl.parse(placement)
        if isinstance(c, C.Linear):
            assert math.isfinite(c.rhs) and all(math.isfinite(t[2]) for t in c.terms)


def _parse(d: Any) -> None:
    try:
        cfg = parse_config(d, "fuzz.toml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.toml: "), str(e)
        return
    _check_result(cfg)


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


PATHS = _paths(FULL)
# derandomized: the same examples every run, so the suite cannot fail on one run and pass on the next
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_fuzz_config_tables(data):
    d = copy.deepcopy(FULL)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(PATHS), label="path")
        parent = d
        try:
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
        if not isinstance(parent, (dict, list)):
            continue  # an earlier mutation replaced a table by a string (which also indexes)
        action = data.draw(st.sampled_from(["delete", "value", "near", "rename"]), label="action")
        if action == "delete":
            del parent[path[-1]]
        elif action == "value":
            parent[path[-1]] = data.draw(TOML_VALUE, label="value")
        elif action == "near":
            parent[path[-1]] = data.draw(NEAR_VALID, label="value")
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8), label="key")] = parent.pop(path[-1])
    _parse(d)


@FUZZ
@given(value=TOML_VALUE)
def test_fuzz_config_any_value(value):
    _parse(value)
    _parse({"constraints": value})
    for section in _SCHEMA:
        _parse({section: value})


@FUZZ
@given(data=st.data())
def test_fuzz_config_text(data):
    source = data.draw(st.sampled_from([FULL_TEXT, EXAMPLE.read_text()]), label="source")
    raw = source.encode()
    kind = data.draw(st.sampled_from(["truncate", "splice", "bytes", "text"]), label="kind")
    if kind == "truncate":
        blob = raw[: data.draw(st.integers(0, len(raw)), label="cut")]
    elif kind == "splice":
        at = data.draw(st.integers(0, len(raw)), label="at")
        junk = data.draw(st.binary(max_size=8) | st.sampled_from([b"=", b"[", b"]", b'"', b"\n", b"nan", b"{"]))
        blob = raw[:at] + junk + raw[at + data.draw(st.integers(0, 8), label="drop"):]
    elif kind == "bytes":
        blob = data.draw(st.binary(max_size=200), label="bytes")
    else:
        blob = data.draw(st.text(alphabet='[]{}="\n .,=abc1-_:#', max_size=80), label="text").encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.toml"
        path.write_bytes(blob)
        try:
            cfg = load_config(path)
        except ConfigError as e:
            assert str(e).startswith(str(path)), str(e)
            return
    _check_result(cfg)

"""The ``apmodel`` configuration file (TOML): solver, device, topology, cost models, constraints.

Every section and key is optional; command-line flags override the file. An unknown key, or a
value of the wrong type, raises ``ConfigError`` naming the file and the key (``solver.time_limit``)::

    [workload]            # what to plan (the command line may give these instead)
    model = "llama3-8b"   # a preset of apmodel.models, or "package.module:factory"
    mesh = "4x8"
    seq = 2048
    batch = 8
    layers = 32           # override of the preset's n_layers

    [solver]
    backend = "trws"      # a name of solvers.available()
    time_limit = 60.0     # seconds
    options = { max_iters = 300 }   # passed to the backend

    [device]
    name = "h100"         # costmodels.device() name
    dtype = "bf16"        # pricing dtype: bf16 | fp16 | fp32 | fp8
    mixed_precision = true  # fp32 master weights and gradient reductions (default: priced so for bf16/fp16; set: also traced and run so)
    execution = "eager"   # eager | graphs (CUDA-graph replay: no launch cost per op; GPU profiles only)

    [topology]
    gpus_per_node = 8
    intra_GBps = 450.0    # per GPU, one direction (overrides the device's fabric)
    inter_GBps = 50.0     # per GPU NIC, one direction
    intra_latency_us = 0.0
    inter_latency_us = 0.0
    nvls = true

    [cost]
    calibration = "calibration.json"           # from `apmodel calibrate`; relative to this file
    compute_profile = "compute_profile.json"   # from `apmodel calibrate-compute`; relative to this file
    compute_model = "mypkg.costs:MyCompute"     # constructed with the DeviceSpec
    comm_model = "mypkg.costs:MyCollectives"    # constructed with the Topology

    [planner]
    param_policy = "full_shard"   # or "free"
    replicate_axes = []           # mesh axes on which parameters stay replicated (HSDP)
    param_memory_fraction = 0.25  # optional per-device parameter budget (instead of full_shard)
    param_budget_ratio = 0.125    # or the paper's storage budget "high": mean local/global ratio per tensor
    optimizer = "adamw"           # optimizer state in the memory model: adamw | sgd | none
    ac = "selective"              # activation checkpointing: none (default) | selective | full
    memory_limit_GB = 70.0        # per-device memory limit (default: the device's HBM less 10%)

    [[constraints]]
    fix = "layers.*.attention.wo.weight"
    placement = "S(0)S(1)"
    [[constraints]]
    forbid = "output.weight"
    placement = "RR"
    on = "output"                 # or "input:J"
    [[constraints]]
    linear = "few_replicated_norms"
    terms = [["layers.*.ffn_norm.weight", "RR", 1.0]]
    sense = "<="
    rhs = 4
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from apmodel import constraints as C
from apmodel import placements as pl
from apmodel.options import TOPOLOGY_KEYS, OptionsError, PlanOptions


class ConfigError(ValueError):
    """A configuration file is malformed; the message names the file and the key."""


@dataclass
class Config:
    """Everything the configuration file can set (``None`` = not set, use the default)."""

    # [workload]
    model: str | None = None
    mesh: str | None = None
    seq: int | None = None
    batch: int | None = None
    layers: int | None = None
    # [solver]
    solver: str | None = None
    time_limit: float | None = None
    solver_options: dict[str, Any] = field(default_factory=dict)
    # [device]
    device: str | None = None
    dtype: str | None = None
    execution: str | None = None
    # [topology]
    gpus_per_node: int | None = None
    intra_GBps: float | None = None
    inter_GBps: float | None = None
    intra_latency_us: float | None = None
    inter_latency_us: float | None = None
    nvls: bool | None = None
    # [cost]
    calibration: str | None = None
    compute_profile: str | None = None
    compute_model: str | None = None
    comm_model: str | None = None
    # [planner]
    param_policy: str | None = None
    replicate_axes: list[int] | None = None
    param_memory_fraction: float | None = None
    param_budget_ratio: float | None = None
    optimizer: str | None = None
    ac: str | None = None
    memory_limit_GB: float | None = None
    mixed_precision: bool | None = None
    # [[constraints]]
    constraints: list[Any] = field(default_factory=list)
    source: str = "<defaults>"

    def topology_overrides(self) -> dict[str, Any]:
        """Keyword arguments for ``costmodels.Topology`` beyond mesh, device and gpus_per_node."""
        return {k: getattr(self, k) for k in TOPOLOGY_KEYS if getattr(self, k) is not None}

    def plan_options(self) -> PlanOptions:
        """The planning options this configuration sets; what it leaves unset keeps the default
        of :class:`~apmodel.options.PlanOptions` (the one place defaults live)."""
        values = {
            "device": self.device, "gpus_per_node": self.gpus_per_node, "dtype": self.dtype,
            "mixed_precision": self.mixed_precision, "compute_model": self.compute_model,
            "comm_model": self.comm_model, "calibration": self.calibration,
            "compute_profile": self.compute_profile, "execution": self.execution,
            "topology": self.topology_overrides(), "optimizer": self.optimizer, "ac": self.ac,
            "memory_limit_bytes": None if self.memory_limit_GB is None else self.memory_limit_GB * 1e9,
            "param_policy": self.param_policy,
            "replicate_axes": None if self.replicate_axes is None else tuple(self.replicate_axes),
            "param_memory_fraction": self.param_memory_fraction, "param_budget_ratio": self.param_budget_ratio,
            "solver": self.solver,
            "time_limit": self.time_limit, "solver_options": self.solver_options,
        }
        return PlanOptions(**{k: v for k, v in values.items() if v is not None})


# section -> key -> (Config field, expected type(s), description for errors)
_SCHEMA: dict[str, dict[str, tuple[str, tuple[type, ...], str]]] = {
    "workload": {
        "model": ("model", (str,), "a string"),
        "mesh": ("mesh", (str,), 'a string like "4x8"'),
        "seq": ("seq", (int,), "an integer"),
        "batch": ("batch", (int,), "an integer"),
        "layers": ("layers", (int,), "an integer"),
    },
    "solver": {
        "backend": ("solver", (str,), "a string"),
        "time_limit": ("time_limit", (int, float), "a number of seconds"),
        "options": ("solver_options", (dict,), "a table"),
    },
    "device": {
        "name": ("device", (str,), "a string"),
        "dtype": ("dtype", (str,), "a string"),
        "mixed_precision": ("mixed_precision", (bool,), "true or false"),
        "execution": ("execution", (str,), '"eager" or "graphs"'),
    },
    "topology": {
        "gpus_per_node": ("gpus_per_node", (int,), "an integer"),
        "intra_GBps": ("intra_GBps", (int, float), "a number (GB/s)"),
        "inter_GBps": ("inter_GBps", (int, float), "a number (GB/s)"),
        "intra_latency_us": ("intra_latency_us", (int, float), "a number (µs)"),
        "inter_latency_us": ("inter_latency_us", (int, float), "a number (µs)"),
        "nvls": ("nvls", (bool,), "true or false"),
    },
    "cost": {
        "calibration": ("calibration", (str,), "a path"),
        "compute_profile": ("compute_profile", (str,), "a path to a compute profile JSON file"),
        "compute_model": ("compute_model", (str,), 'a dotted name "package.module:Name"'),
        "comm_model": ("comm_model", (str,), 'a dotted name "package.module:Name"'),
    },
    "planner": {
        "param_policy": ("param_policy", (str,), '"full_shard" or "free"'),
        "replicate_axes": ("replicate_axes", (list,), "a list of mesh axes"),
        "param_memory_fraction": ("param_memory_fraction", (int, float), "a number in (0, 1]"),
        "param_budget_ratio": ("param_budget_ratio", (int, float), "a number in (0, 1]"),
        "optimizer": ("optimizer", (str,), '"adamw" or "sgd"'),
        "ac": ("ac", (str,), '"none", "selective" or "full"'),
        "memory_limit_GB": ("memory_limit_GB", (int, float), "a number of GB (1e9 bytes) per device"),
    },
}

#: PlanOptions field -> the TOML key that sets it (for the options' own error messages).
_TOML_KEYS: dict[str, str] = {
    **{attr: f"{section}.{key}" for section, keys in _SCHEMA.items() for key, (attr, _, _) in keys.items()},
    "memory_limit_bytes": "planner.memory_limit_GB",
}

_CONSTRAINT_KEYS = {
    "fix": {"fix", "placement", "on", "name"},
    "forbid": {"forbid", "placement", "on", "name"},
    "linear": {"linear", "terms", "sense", "rhs"},
}


# "4x8", "4,8", "4×8" or "8": what ``apmodel.workloads.parse_mesh`` reads
_MESH_AXIS = re.compile(r"\s*[0-9]+\s*")
_ON = re.compile(r"output|input(:[0-9]+)?")
_OBJECT_SPEC = re.compile(r"[^:]+:[^:]+")


def _short(v: Any, limit: int = 80) -> str:
    """``repr`` of a bad value, cut so a huge value does not flood the message."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _check_type(src: str, key: str, value: Any, types: tuple[type, ...], what: str) -> Any:
    # bool is an int in Python; do not accept true for a number (or 1 for a bool)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and isinstance(value, str) and not value.strip():
        ok = False  # an empty name or path is never meant
    if not ok:
        raise ConfigError(f"{src}: key {key!r} must be {what}, got {_short(value)}")
    return value


def _check_placement(src: str, key: str, value: str) -> None:
    """Syntax only: the number of mesh axes is known once the mesh is."""
    try:
        pl.parse(value)
    except ValueError as e:
        raise ConfigError(f"{src}: key {key!r}: {e}") from None


def _check_finite(src: str, key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{src}: key {key!r} must be a finite number, got {value!r}")


def _check_mesh(src: str, text: str) -> None:
    parts = text.lower().replace(",", "x").replace("×", "x").split("x")
    if not (1 <= len(parts) <= 4 and all(_MESH_AXIS.fullmatch(p) and int(p) > 0 for p in parts)):
        raise ConfigError(f"{src}: key 'workload.mesh' must be 1 to 4 positive axis sizes joined by 'x' "
                          f"(e.g. \"8\" or \"4x8\"), got {_short(text)}")


def _parse_constraint(src: str, i: int, entry: Any) -> C.Fix | C.Forbid | C.Linear:
    where = f"constraints[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{src}: {where} must be a table, got {entry!r}")
    kinds = [k for k in _CONSTRAINT_KEYS if k in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{src}: {where} needs exactly one of the keys 'fix', 'forbid', 'linear', got {sorted(entry)}")
    kind = kinds[0]
    unknown = sorted(set(entry) - _CONSTRAINT_KEYS[kind])
    if unknown:
        raise ConfigError(f"{src}: unknown key {where}.{unknown[0]!r} (a {kind!r} constraint takes {sorted(_CONSTRAINT_KEYS[kind])})")
    if kind in ("fix", "forbid"):
        pattern = _check_type(src, f"{where}.{kind}", entry[kind], (str,), "a glob over parameter FQNs or node names")
        if "placement" not in entry:
            raise ConfigError(f"{src}: {where}.placement is missing (e.g. placement = \"S(0)R\")")
        placement = _check_type(src, f"{where}.placement", entry["placement"], (str,), 'a placement string like "S(0)R"')
        on = _check_type(src, f"{where}.on", entry.get("on", "output"), (str,), '"output" or "input:J"')
        if not _ON.fullmatch(on):
            raise ConfigError(f"{src}: key {where}.on must be \"output\" or \"input:J\", got {_short(on)}")
        _check_placement(src, f"{where}.placement", placement)
        name = _check_type(src, f"{where}.name", entry.get("name", f"config {where}: {kind} {pattern} {placement}"), (str,), "a string")
        ctor = C.fix if kind == "fix" else C.forbid
        return ctor(pattern, placement, on=on, name=name)
    name = _check_type(src, f"{where}.linear", entry["linear"], (str,), "a name for the constraint")
    for key in ("terms", "sense", "rhs"):
        if key not in entry:
            raise ConfigError(f"{src}: {where}.{key} is missing")
    terms = _check_type(src, f"{where}.terms", entry["terms"], (list,), "a list of [pattern, placement, coefficient]")
    parsed = []
    for j, t in enumerate(terms):
        if not (isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[1], str)
                and isinstance(t[2], (int, float)) and not isinstance(t[2], bool)):
            raise ConfigError(f"{src}: key {where}.terms[{j}] must be [pattern, placement, coefficient], got {_short(t)}")
        _check_placement(src, f"{where}.terms[{j}]", t[1])
        _check_finite(src, f"{where}.terms[{j}]", t[2])
        parsed.append((t[0], t[1], float(t[2])))
    sense = entry["sense"]
    if not isinstance(sense, str) or sense not in ("<=", ">=", "=="):
        raise ConfigError(f"{src}: key {where}.sense must be \"<=\", \">=\" or \"==\", got {_short(sense)}")
    rhs = _check_type(src, f"{where}.rhs", entry["rhs"], (int, float), "a number")
    _check_finite(src, f"{where}.rhs", rhs)
    return C.linear(name, parsed, sense, float(rhs))


def parse_config(data: dict[str, Any], source: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate a parsed TOML document; relative file paths are resolved against ``base_dir``."""
    cfg = Config(source=source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a configuration must be a table of sections, got {_short(data)}")
    for section, body in data.items():
        if section == "constraints":
            if not isinstance(body, list):
                raise ConfigError(f"{source}: key 'constraints' must be an array of tables ([[constraints]])")
            cfg.constraints = [_parse_constraint(source, i, e) for i, e in enumerate(body)]
            continue
        schema = _SCHEMA.get(section)
        if schema is None:
            known = sorted([*_SCHEMA, "constraints"])
            raise ConfigError(f"{source}: unknown key {section!r} (known sections: {', '.join(known)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: key {section!r} must be a table ([{section}])")
        for key, value in body.items():
            if key not in schema:
                raise ConfigError(f"{source}: unknown key '{section}.{key}' (known: {', '.join(sorted(schema))})")
            attr, types, what = schema[key]
            _check_type(source, f"{section}.{key}", value, types, what)
            setattr(cfg, attr, value)
    if cfg.replicate_axes is not None:
        if not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in cfg.replicate_axes):
            raise ConfigError(f"{source}: key 'planner.replicate_axes' must list non-negative integers, got {_short(cfg.replicate_axes)}")
    if cfg.mesh is not None:
        _check_mesh(source, cfg.mesh)
    if cfg.compute_profile is not None and not cfg.compute_profile.lower().endswith(".json"):
        raise ConfigError(f"{source}: key 'cost.compute_profile' must be a path to a JSON file "
                          f"(from `apmodel calibrate-compute`), got {_short(cfg.compute_profile)}")
    for key in ("compute_model", "comm_model"):
        v = getattr(cfg, key)
        if v is not None and not _OBJECT_SPEC.fullmatch(v):
            raise ConfigError(f"{source}: key 'cost.{key}' must look like \"package.module:Name\", got {_short(v)}")
    for key in ("seq", "batch", "layers"):
        v = getattr(cfg, key)
        if v is not None and v < 1:
            raise ConfigError(f"{source}: key 'workload.{key}' must be >= 1, got {v}")
    for key in ("intra_GBps", "inter_GBps"):  # bandwidths divide message sizes
        v = getattr(cfg, key)
        if v is not None and not 0 < v < math.inf:
            raise ConfigError(f"{source}: key 'topology.{key}' must be a finite number > 0, got {v}")
    for key in ("intra_latency_us", "inter_latency_us"):
        v = getattr(cfg, key)
        if v is not None and not 0 <= v < math.inf:
            raise ConfigError(f"{source}: key 'topology.{key}' must be a finite number >= 0, got {v}")
    try:  # the planning options' own checks (ranges, policies), reported under their TOML keys
        cfg.plan_options()
    except OptionsError as e:
        raise ConfigError(f"{source}: key '{_TOML_KEYS.get(e.option or '', e.option)}': {e}") from None
    if cfg.calibration is not None and base_dir is not None and not Path(cfg.calibration).is_absolute():
        cfg.calibration = str(base_dir / cfg.calibration)
    if cfg.compute_profile is not None and base_dir is not None and not Path(cfg.compute_profile).is_absolute():
        cfg.compute_profile = str(base_dir / cfg.compute_profile)
    return cfg


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML configuration file (see the module docstring for its keys)."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO or a device would block the read
        raise ConfigError(f"{path}: not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")  # TOML is UTF-8, whatever the locale says
    except OSError as e:
        raise ConfigError(f"{path}: cannot read configuration file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a TOML file (not UTF-8 text: {e.reason} at byte {e.start})") from None
    return parse_config_text(text, str(path), path.parent)


def parse_config_text(text: str, source: str = "<config>", base_dir: Path | None = None) -> Config:
    """Parse and validate TOML text (what :func:`load_config` does after reading the file)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid TOML: nested too deeply") from None
    return parse_config(data, source, base_dir)


def merge(cfg: Config, **flags: Any) -> Config:
    """A copy of ``cfg`` with every flag that is not ``None`` taking precedence."""
    return dataclasses.replace(cfg, **{k: v for k, v in flags.items() if v is not None})

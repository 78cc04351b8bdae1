"""The ``apmodel`` configuration file (TOML): the workload, every planning option, constraints.

Every section and key is optional; command-line flags override the file. An unknown key, or a
value of the wrong type or out of range, raises ``ConfigError`` naming the file and the key
(``solving.time_limit``). The keys of the planning options, their types, ranges and defaults are
not listed here: they are declared once, on :class:`~apmodel.core.options.PlanOptions`, and the
README's options table lists them. Each option's section is its group (``[pricing]``,
``[search]``, ``[pipeline]``, ``[solving]``: the panels of ``apmodel plan --help``) and its key
is its name (the flag's and the Python keyword's). Beside them, ``[workload]`` names what to plan
(its keys are the flags ``--model``, ``--mesh``, ...) and ``[[constraints]]`` adds user
constraints::

    [workload]            # what to plan (the command line may give these instead)
    model = "llama3-8b"   # a preset of apmodel.models, or "package.module:factory"
    mesh = "4x8"
    seq = 2048
    batch = 8
    layers = 32           # override of the preset's n_layers

    [solving]             # solver, time_limit, solver_options = { max_iters = 300 }, seed_solver
    solver = "trws"
    [pricing]             # device, gpus_per_node, ac, memory_limit_bytes, ...
    gpus_per_node = 8
    ac = "selective"
    [pricing.topology]    # the topology's overrides (intra_GBps, ...)
    inter_GBps = 50.0

    [[constraints]]
    fix = "layers.*.attention.wo.weight"
    placement = "S(0)S(1)"
    [[constraints]]
    forbid = "output.weight"
    placement = "RR"
    on = "output"                 # or "input:J"
    [[constraints]]
    output = "feed_forward.w2"    # a module's N-D output (glob over module paths)
    placement = "P,S1"            # the paper's notation, or "PS(1)"
    [[constraints]]
    linear = "few_replicated_norms"
    terms = [["layers.*.ffn_norm.weight", "RR", 1.0]]
    sense = "<="
    rhs = 4

``examples/apmodel.toml`` is a commented example. The keys of earlier versions
(:data:`~apmodel.core.options.OLD_TOML_KEYS`: ``[planner] memory_limit_GB``, ``[cost] bucket_MB``,
``[solver] backend``, ...) are still read, each with a logged warning naming its new key.
"""

from __future__ import annotations

import logging
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

from apmodel.core import placements as pl
from apmodel.core.option_spec import BadValue, OptionSpec
from apmodel.core.options import OLD_TOML_KEYS, OptionsError, PlanOptions, option_spec, toml_keys
from apmodel.frontend.workloads import WORKLOAD_KEYS, WorkloadError, parse_mesh
from apmodel.problem import constraints as C

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration file is malformed; the message names the file and the key."""


@dataclass
class Config:
    """What a configuration file sets: the workload (``None``: not set), the planning options it
    sets (``options``: :class:`~apmodel.core.options.PlanOptions` field -> value, in the field's units;
    what it leaves out keeps the field's default) and the constraints."""

    model: str | None = None
    mesh: str | None = None
    seq: int | None = None
    batch: int | None = None
    layers: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    constraints: list[Any] = field(default_factory=list)
    source: str = "<defaults>"

    def plan_options(self) -> PlanOptions:
        """The planning options this configuration sets; the rest keep the defaults of
        :class:`~apmodel.core.options.PlanOptions` (the one place defaults live)."""
        return PlanOptions(**self.options)


#: section -> key -> (Config attribute or PlanOptions field, sub-key of a ``keys`` option or None, spec):
#: every key a configuration may hold but the constraints and the old keys, generated from the declarations.
_SCHEMA: dict[str, dict[str, tuple[str, str | None, OptionSpec]]] = {
    "workload": {key: (key, None, spec) for key, spec in WORKLOAD_KEYS.items()},
}
for (_section, _key), _entry in toml_keys().items():
    _SCHEMA.setdefault(_section, {})[_key] = _entry

_CONSTRAINT_KEYS = {
    "fix": {"fix", "placement", "on", "name"},
    "forbid": {"forbid", "placement", "on", "name"},
    "linear": {"linear", "terms", "sense", "rhs"},
    "output": {"output", "placement", "name"},
}


_ON = re.compile(r"output|input(:[0-9]+)?")


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
    """The mesh as the command line reads it (:func:`apmodel.frontend.workloads.parse_mesh`, the one parser)."""
    try:
        parse_mesh(text, "key 'workload.mesh'")
    except WorkloadError as e:
        raise ConfigError(f"{src}: {e}") from None


def _parse_output(src: str, where: str, entry: dict) -> C.FixOutput:
    """``output = "layers.*.attention.wo"``, ``placement = "S0,S1"``: a module's N-D output."""
    pattern = _check_type(src, f"{where}.output", entry["output"], (str,), "a glob over module paths")
    if "placement" not in entry:
        raise ConfigError(f"{src}: {where}.placement is missing (e.g. placement = \"S0,S1\")")
    placement = _check_type(src, f"{where}.placement", entry["placement"], (str,), 'a placement like "S0,S1"')
    try:  # syntax only: the number of mesh axes is known once the mesh is
        pl.parse_notation(placement, None)
    except ValueError as e:
        raise ConfigError(f"{src}: key {where}.placement: {e}") from None
    name = _check_type(src, f"{where}.name", entry.get("name", f"config {where}: output {pattern} {placement}"),
                       (str,), "a string")
    return C.fix_output(pattern, placement, name=name)


def _parse_constraint(src: str, i: int, entry: Any) -> C.Fix | C.Forbid | C.Linear | C.FixOutput:
    where = f"constraints[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{src}: {where} must be a table, got {entry!r}")
    kinds = [k for k in _CONSTRAINT_KEYS if k in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{src}: {where} needs exactly one of the keys 'fix', 'forbid', 'linear', 'output', "
                          f"got {sorted(entry)}")
    kind = kinds[0]
    unknown = sorted(set(entry) - _CONSTRAINT_KEYS[kind])
    if unknown:
        raise ConfigError(f"{src}: unknown key {where}.{unknown[0]!r} (a {kind!r} constraint takes {sorted(_CONSTRAINT_KEYS[kind])})")
    if kind == "output":
        return _parse_output(src, where, entry)
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


def toml_key_of(name: str) -> str:
    """The TOML key that sets option ``name`` (``pricing.memory_limit_bytes`` for ``memory_limit_bytes``)."""
    try:
        return option_spec(name).toml
    except OptionsError:
        return name


_OLD_SECTIONS = {key.partition(".")[0] for key in OLD_TOML_KEYS} - set(_SCHEMA)


def _old_key(source: str, section: str, key: str, value: Any, schema: dict[str, tuple[str, str | None, OptionSpec]],
             renamed: list[str]) -> tuple[str, str | None, OptionSpec, Any]:
    """A key of an earlier version (:data:`~apmodel.core.options.OLD_TOML_KEYS`): its option, sub-key,
    spec and value in today's unit, the rename noted in ``renamed``; else a ConfigError."""
    old = OLD_TOML_KEYS.get(f"{section}.{key}")
    if old is None:
        known = sorted(schema) or sorted(k.partition(".")[2] for k in OLD_TOML_KEYS if k.startswith(section + "."))
        raise ConfigError(f"{source}: unknown key '{section}.{key}' (known: {', '.join(known)})")
    renamed.append(f"'{section}.{key}' -> '{old.new_toml()}'" + (f" ({old.note})" if old.note else ""))
    spec = option_spec(old.option)
    return old.option, old.sub, spec.keys[old.sub] if old.sub else spec, old.convert(value)


def parse_config(data: dict[str, Any], source: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate a parsed TOML document; relative file paths are resolved against ``base_dir``."""
    cfg = Config(source=source)
    renamed: list[str] = []  # keys of an earlier version, warned about once per file
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a configuration must be a table of sections, got {_short(data)}")
    for section, body in data.items():
        if section == "constraints":
            if not isinstance(body, list):
                raise ConfigError(f"{source}: key 'constraints' must be an array of tables ([[constraints]])")
            cfg.constraints = [_parse_constraint(source, i, e) for i, e in enumerate(body)]
            continue
        schema = _SCHEMA.get(section, {})
        if section not in _SCHEMA and section not in _OLD_SECTIONS:
            known = sorted([*_SCHEMA, "constraints"])
            raise ConfigError(f"{source}: unknown key {section!r} (known sections: {', '.join(known)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: key {section!r} must be a table ([{section}])")
        for key, value in body.items():
            if key in schema:
                name, sub, spec = schema[key]
            else:
                name, sub, spec, value = _old_key(source, section, key, value, schema, renamed)
            try:
                read = spec.read(value)
            except BadValue as e:
                raise ConfigError(f"{source}: key '{section}.{key}' must be {e.what}, got {_short(value)}") from None
            if section == "workload":
                setattr(cfg, name, read)
            elif sub is not None:
                cfg.options.setdefault(name, {})[sub] = read
            elif isinstance(read, dict) and spec.kind == "keys":  # beside an old [topology] section's keys
                cfg.options[name] = {**cfg.options.get(name, {}), **read}
            else:
                cfg.options[name] = read
    if renamed:
        logger.warning("%s: deprecated keys, read as their new names (rename them): %s", source, "; ".join(renamed))
    if cfg.mesh is not None:
        _check_mesh(source, cfg.mesh)
    try:  # the planning options' own checks (ranges, policies), reported under their TOML keys
        cfg.plan_options()
    except OptionsError as e:
        raise ConfigError(f"{source}: key '{toml_key_of(e.option or '')}': {e}") from None
    if base_dir is not None:
        for name, value in cfg.options.items():
            if option_spec(name).relative and not Path(value).is_absolute():
                cfg.options[name] = str(base_dir / value)
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

"""Every planning option is declared once, on ``PlanOptions``, and reaches every front end from there.

The tests walk ``dataclasses.fields(PlanOptions)`` and add nothing by hand: each option has a flag
of ``apmodel plan``, a key of the TOML configuration and a row of the README's table, and a value
set through the TOML key or through the flag lands in ``PlanOptions`` alike. Sample values come
from each option's declaration (its kind, choices and range).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import apmodel.cli as cli
from apmodel.cli import app
from apmodel.core.options import (
    TABLE_END,
    TABLE_START,
    OptionsError,
    OptionSpec,
    PlanOptions,
    default_of,
    option_spec,
    options_table,
)
from apmodel.frontend.config import _SCHEMA, parse_config_text

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [f.name for f in dataclasses.fields(PlanOptions)]


def _toml(value: Any) -> str:
    """A TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"


def _sample(spec: OptionSpec, default: Any) -> Any:
    """A surface value of the option other than its default, from its declaration."""
    if spec.kind == "str":
        if spec.registry:
            import solvers

            return next(b for b in solvers.available() if b != default)
        return next(c for c in spec.choices if c != default) if spec.choices else "some-name"
    if spec.kind == "path":
        return "some/file" + spec.suffix
    if spec.kind == "object":
        return "mypkg.costs:Model"
    if spec.kind in ("int", "float"):
        b = spec.bounds()
        lo, hi = (0.0, math.inf) if b is None else (b[0], b[2])
        value = lo + 1 if math.isinf(hi) else (lo + hi) / 2
        value = int(value) if spec.kind == "int" else value + 0.5 * math.isinf(hi)
        return value if value != default else value + 1
    if spec.kind == "bool":
        return default is not True
    if spec.kind == "ints":  # the two smallest values in range
        low = 0 if spec.bounds() is None else int(spec.bounds()[0])  # type: ignore[index]
        return [low, low + 1]
    if spec.kind == "placements":
        return ["S(0)R", "default"]
    if spec.kind == "table":
        return {"max_iters": 3}
    return {key: _sample(sub, None) for key, sub in spec.keys.items()}


def _flag_args(spec: OptionSpec, value: Any) -> list[str]:
    if spec.kind == "bool":
        return [spec.flag if value else f"--no-{spec.flag[2:]}"]
    if spec.kind in ("table", "keys"):
        return [a for k, v in value.items() for a in (spec.flag, f"{k}={_toml(v)}")]
    if isinstance(value, list):
        return [a for v in value for a in (spec.flag, str(v))]
    return [spec.flag, str(value)]


def _toml_text(spec: OptionSpec, value: Any) -> str:
    if spec.kind == "keys":  # a table of its own: [pricing.topology]
        return f"[{spec.toml}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in value.items())
    return f"[{spec.section}]\n{spec.key} = {_toml(value)}\n"


def _plan_flags() -> dict[str, Any]:
    """The click parameters of ``apmodel plan`` by flag (both halves of a --x/--no-x flag)."""
    import typer.main

    command = typer.main.get_command(app).commands["plan"]  # type: ignore[attr-defined]
    return {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts)}


def _readme_rows() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index(TABLE_START):readme.index(TABLE_END)]
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", table, flags=re.M)}


@pytest.fixture
def planned_options(monkeypatch):
    """Run ``apmodel plan`` up to the planning call and return the options it would plan with."""
    seen: list[PlanOptions] = []

    def capture(cfg, **kwargs):
        seen.append(cfg.plan_options())
        raise cli.CLIError("stopped before planning")

    monkeypatch.setattr(cli, "run_plan", capture)

    def run(*args: str) -> PlanOptions:
        seen.clear()
        res = CliRunner().invoke(app, ["plan", "--model", "llama3-debug", "--mesh", "2x2", *args])
        assert seen, res.output
        return seen[0]

    return run


@pytest.mark.parametrize("name", FIELDS)
def test_every_option_has_a_flag_a_toml_key_and_a_readme_row(name):
    spec = option_spec(name)
    flags = _plan_flags()
    assert spec.flag in flags, f"{name}: no flag {spec.flag} on apmodel plan"
    assert flags[spec.flag].name == name
    assert spec.help and spec.help in flags[spec.flag].help
    assert _SCHEMA[spec.section][spec.key][0] == name, f"{name}: TOML key {spec.toml} sets another option"
    row = _readme_rows().get(name)
    assert row is not None, f"{name}: no row in the README's options table (python tools/options_table.py)"
    assert f"`{spec.flag_text()}`" in row and f"`{spec.toml_text().split(', ')[0]}`" in row


def test_flags_and_toml_keys_are_each_one_options():
    flags = [option_spec(n).flag for n in FIELDS]
    assert len(set(flags)) == len(flags)
    keys = [(s, k) for s, body in _SCHEMA.items() for k in body]
    assert len(set(keys)) == len(keys) == sum(len(body) for body in _SCHEMA.values())
    assert set(_readme_rows()) == set(FIELDS)  # and no row of an option that is gone


@pytest.mark.parametrize("name", FIELDS)
def test_an_option_set_by_toml_or_by_flag_lands_alike(name, planned_options, tmp_path):
    spec = option_spec(name)
    value = _sample(spec, default_of(name))
    from_toml = parse_config_text(_toml_text(spec, value)).plan_options()
    from_flag = planned_options(*_flag_args(spec, value))
    assert getattr(from_flag, name) == getattr(from_toml, name) != default_of(name)
    assert from_flag == from_toml == PlanOptions(**{name: getattr(from_toml, name)})  # nothing else moved
    config = tmp_path / "apmodel.toml"  # and through --config, where a relative path is the file's
    config.write_text(_toml_text(spec, value), encoding="utf-8")
    from_file = getattr(planned_options("--config", str(config)), name)
    assert from_file == (str(tmp_path / value) if spec.relative else getattr(from_toml, name))


def test_a_flag_overrides_the_configuration(planned_options, tmp_path):
    config = tmp_path / "apmodel.toml"
    config.write_text('[pricing]\nac = "full"\noptimizer = "sgd"\n[pricing.topology]\ninter_GBps = 10.0\n',
                      encoding="utf-8")
    opts = planned_options("--config", str(config), "--ac", "selective", "--topology", "intra_GBps=100")
    assert (opts.ac, opts.optimizer) == ("selective", "sgd")
    assert opts.topology == {"inter_GBps": 10.0, "intra_GBps": 100.0}  # flags' keys over the file's


@pytest.mark.parametrize("args,expect", [
    (["--ac", "some"], "--ac 'some': expected one of none, selective, full"),
    (["--time-limit", "0"], "--time-limit 0.0: expected a finite number > 0 (seconds)"),
    (["--memory-limit-bytes", "-1"], "--memory-limit-bytes -1.0: expected a number > 0 (bytes)"),
    (["--topology", "nvls=2"], "--topology 'nvls=2': expected true or false"),
    (["--topology", "intra=1"], "--topology 'intra=1': unknown key 'intra'"),
    (["--solver-options", "max_iters"], "--solver-options 'max_iters': expected KEY=VALUE"),
    (["--seed-radius", "-1"], "--seed-radius -1: expected an integer >= 0"),
    (["--bucket-mb", "-1"], "--bucket-mb -1.0: expected a finite number >= 0 (MB, 2^20 bytes)"),
    (["--compute-profile", "profile.txt"], "--compute-profile 'profile.txt': expected a path to a .json file"),
    (["--seed-solver", "nope"], "--seed-solver 'nope' is not an available backend"),
])
def test_a_bad_flag_is_one_line_naming_it(args, expect):
    res = CliRunner().invoke(app, ["plan", "--model", "test_cli:exploding_factory", "--mesh", "2", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert expect in res.stderr.replace("\n", ""), res.stderr


def test_the_placement_model_takes_the_options_marked_for_it():
    """``model_kwargs`` are exactly PlacementModel's keyword arguments: the search passes them whole."""
    from apmodel.problem.placement_model import PlacementModel

    params = inspect.signature(PlacementModel.__init__).parameters
    keywords = {n for n, p in params.items() if p.kind == inspect.Parameter.KEYWORD_ONLY}
    assert set(PlanOptions().model_kwargs()) == keywords
    for name in keywords:
        assert params[name].default == default_of(name) or name in ("input_placements", "output_placements"), name


def test_api_values_are_checked_from_the_declarations():
    for name in FIELDS:
        spec = option_spec(name)
        if spec.choices:
            with pytest.raises(OptionsError, match=name):
                PlanOptions(**{name: "no-such-value"})
        if spec.kind in ("int", "float") and spec.range:
            with pytest.raises(OptionsError, match=name):
                PlanOptions(**{name: -1})
    with pytest.raises(OptionsError, match="inter_GBps"):
        PlanOptions(topology={"inter_GBps": 0.0})


def test_the_table_is_generated():
    table = options_table()
    for name in FIELDS:
        assert f"| `{name}` |" in table


# ------------------------------------------------------------------------------- one name per option
#: The functions that take options as keywords (explicitly or through ``**option_values``).
def _option_functions() -> list[Any]:
    import apmodel
    from apmodel.entry import api
    from apmodel.lowering import lower
    from apmodel.solve.pipeline import PipelineOptions

    return [apmodel.plan, apmodel.parallelize, api.parallelize_pipeline, api.build_model, api.cost_context,
            api.placement_model, api.solve_model, lower, PipelineOptions]


#: Units an option's name may carry, and the unit its declaration must then say its value is in.
_NAME_UNITS = {"_bytes": "bytes", "_mb": "MB", "_gb": "GB", "_s": "seconds", "_us": "µs"}


@pytest.mark.parametrize("name", FIELDS)
def test_every_option_has_one_name_across_field_toml_flag_and_keyword(name):
    """The field's name is the option's TOML key (in its group's section), its flag (dashes for
    underscores) and its keyword; its ``--help`` panel is its TOML section; a unit in the name is
    the unit of its value; old spellings are only read (hidden flags, **kwargs), never declared."""
    from apmodel.cli.flags import help_panel
    from apmodel.core.option_spec import GROUPS
    from apmodel.core.options import OLD_FLAGS, OLD_KEYWORDS, OLD_TOML_KEYS, make_options

    spec = option_spec(name)
    section = spec.group
    # TOML: one key sets the option, its name, in the section of its group
    setting = [(s, k) for s, body in _SCHEMA.items() for k, entry in body.items() if entry[0] == name]
    assert setting == [(section, name)], f"{name}: set by TOML keys {setting}"
    assert parse_config_text(_toml_text(spec, _sample(spec, default_of(name)))).options.keys() == {name}
    # flag: one visible flag, the name with dashes, in the --help panel of its TOML section
    params = [p for p in set(_plan_flags().values()) if p.name == name]
    flag = "--" + name.replace("_", "-")
    assert len(params) == 1 and params[0].opts == [flag] and not params[0].hidden, f"{name}: flags {params}"
    if spec.kind == "bool":
        assert params[0].secondary_opts == [f"--no-{flag[2:]}"]
    assert params[0].rich_help_panel == help_panel(section) and f"[{section}]" in help_panel(section)
    old_params = [p for p in _plan_flags().values() if p.name != name and p.name.startswith("old_")
                  and OLD_FLAGS[p.opts[0]].option == name]
    assert all(p.hidden for p in old_params)
    # README: the row sits in its group's table
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index(TABLE_START):readme.index(TABLE_END)]
    group_table = table.split(f"**{GROUPS[section]}**")[1].split("**")[0]
    assert f"| `{name}` | `{spec.flag_text()}` | `{spec.toml_text().split(', ')[0]}`" in group_table
    # keyword: every function that takes options takes it by this name, and no old name of any option
    assert getattr(make_options(**{name: getattr(PlanOptions(), name)}), name) == getattr(PlanOptions(), name)
    old_names = {*OLD_KEYWORDS, *(f[2:].replace("-", "_") for f in OLD_FLAGS),
                 *(k.partition(".")[2] for k, old in OLD_TOML_KEYS.items() if old.sub is None)}
    # an old TOML key may be another option's name (solver); "options" and "name" (solver.options,
    # device.name) were never keywords: "options" is the PlanOptions argument
    old_names -= {*FIELDS, "options", "name"}
    for function in _option_functions():
        parameters = inspect.signature(function).parameters
        assert not old_names & set(parameters), f"{function.__qualname__} takes {old_names & set(parameters)}"
    # unit: a name that carries one is in that unit
    for suffix, unit in _NAME_UNITS.items():
        if name.endswith(suffix):
            assert spec.unit.startswith(unit), f"{name}: named in {unit}, declared in {spec.unit!r}"


def test_old_toml_keys_are_read_with_a_warning_naming_the_new_key(caplog):
    from apmodel.core.options import OLD_TOML_KEYS

    for old_key, old in OLD_TOML_KEYS.items():
        spec = option_spec(old.option)
        sub = spec.keys[old.sub] if old.sub else spec
        value = _sample(sub, None if old.sub else default_of(old.option))
        section, _, key = old_key.partition(".")
        caplog.clear()
        with caplog.at_level("WARNING", logger="apmodel.frontend.config"):
            opts = parse_config_text(f"[{section}]\n{key} = {_toml(value)}\n", "old.toml").plan_options()
        new_text = (f"[{spec.toml}]\n{old.sub} = {_toml(value)}\n" if old.sub else
                    f"[{spec.section}]\n{spec.key} = {_toml(old.convert(value))}\n")
        assert opts == parse_config_text(new_text).plan_options() != PlanOptions(), old_key
        assert f"'{old_key}' -> '{old.new_toml()}'" in caplog.text, caplog.text
    # the old unit: GB then, bytes now
    assert parse_config_text("[planner]\nmemory_limit_GB = 70\n").plan_options().memory_limit_bytes == 70e9
    with pytest.raises(Exception, match="planner.memory_limit_GB"):  # a bad old value names the key as written
        parse_config_text("[planner]\nmemory_limit_GB = 0\n")


def test_old_flags_are_read_with_a_warning_naming_the_new_flag(planned_options, caplog):
    with caplog.at_level("WARNING", logger="apmodel.cli.flags"):
        opts = planned_options("--memory-limit-gb", "70", "--replicate-axis", "0", "--solver-option", "max_iters=3",
                               "--input-placement", "S(0)R")
    assert opts == PlanOptions(memory_limit_bytes=70e9, replicate_axes=(0,), solver_options={"max_iters": 3},
                               input_placements=("S(0)R",))
    for old, new in (("--memory-limit-gb", "--memory-limit-bytes"), ("--replicate-axis", "--replicate-axes"),
                     ("--solver-option", "--solver-options"), ("--input-placement", "--input-placements")):
        assert f"{old} is deprecated: use {new}" in caplog.text
    assert _plan_flags()["--memory-limit-gb"].hidden and not _plan_flags()["--memory-limit-bytes"].hidden


def test_old_keywords_and_record_keys_are_read_with_a_warning_naming_the_new_name(caplog):
    from apmodel.core.options import make_options

    with pytest.warns(DeprecationWarning, match="memory_limit= is deprecated: use memory_limit_bytes="):
        assert make_options(memory_limit=5e9).memory_limit_bytes == 5e9
    with pytest.warns(DeprecationWarning, match="bucket_cap_mb= is deprecated: use bucket_mb="):
        assert make_options(bucket_cap_mb=0).bucket_mb == 0
    with pytest.raises(OptionsError, match="give memory_limit_bytes="):
        make_options(memory_limit=1.0, memory_limit_bytes=2.0)
    with caplog.at_level("WARNING", logger="apmodel.core.options"):
        assert PlanOptions.from_record({"memory_limit_GB": 70}).memory_limit_bytes == 70e9
    assert "'memory_limit_GB' is read as 'memory_limit_bytes'" in caplog.text


def test_workload_keys_have_one_name_too():
    """``[workload]`` keys and the flags that give them are one declaration (``WORKLOAD_KEYS``)."""
    from apmodel.frontend.workloads import WORKLOAD_KEYS

    flags = _plan_flags()
    for key, spec in WORKLOAD_KEYS.items():
        assert spec.name == key and spec.toml == f"workload.{key}" and _SCHEMA["workload"][key][0] == key
        assert flags[f"--{key}"].name == key and spec.help in flags[f"--{key}"].help.replace("\\[", "[")  # rich markup

"""The planning options' flags, generated from their declarations on :class:`~apmodel.core.options.PlanOptions`.

:func:`with_option_flags` gives a command one flag per option (``--ac``, ``--[no-]seeding``,
``--topology KEY=VALUE``...; ``apmodel plan`` all of them, ``apmodel calibrate`` the device's),
grouped in ``--help`` by the options' groups, which are their TOML sections, and hands the command
what was given as ``option_flags`` (field -> raw value, ``None`` where not given); the flags of
earlier versions (:data:`~apmodel.core.options.OLD_FLAGS`) are hidden and read with a warning;
:func:`options_from_flags` reads those with the same checks as the TOML configuration
(:meth:`~apmodel.core.option_spec.OptionSpec.read`), naming the flag in its errors.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Any, Callable, List, Mapping, Optional

import typer
from rich.markup import escape

from apmodel.cli.errors import CLIError
from apmodel.core.option_spec import GROUPS, BadValue, OptionSpec
from apmodel.core.options import OLD_FLAGS, OldName, default_text, option_specs
from apmodel.frontend.workloads import WORKLOAD_KEYS

logger = logging.getLogger(__name__)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The Python type click parses each kind of option's value into (lists: a repeated flag).
_ANNOTATIONS: dict[str, Any] = {
    "str": Optional[str], "path": Optional[str], "object": Optional[str], "int": Optional[int],
    "float": Optional[float], "bool": Optional[bool], "ints": Optional[List[str]],
    "placements": Optional[List[str]], "table": Optional[List[str]], "keys": Optional[List[str]],
}


def _call(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)()


def flag_help(name: str, spec: OptionSpec) -> str:
    """``--help``'s text of an option: its help, values, default and TOML key."""
    text = spec.help
    if spec.help_from:
        text += f" Backends: {_call(spec.help_from)}."
    if spec.choices:
        text += f" One of: {', '.join(spec.choices)}."
    return f"{text} Default: {default_text(name, spec).strip('`')}. TOML: {spec.toml_text()}."


def help_panel(group: str) -> str:
    """The ``--help`` panel of a group's flags: the group, named with its TOML section (escaped: rich markup)."""
    return escape(f"{GROUPS[group]} options ([{group}] in --config)")


def _parameter(name: str, spec: OptionSpec) -> inspect.Parameter:
    decls = [f"{spec.flag}/--no-{spec.flag[2:]}"] if spec.kind == "bool" else [spec.flag]
    info = typer.Option(None, *decls, help=flag_help(name, spec), rich_help_panel=help_panel(spec.group),
                        metavar="KEY=VALUE" if spec.kind in ("table", "keys") else None, show_default=False)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=_ANNOTATIONS[spec.kind])


def workload_flag(name: str, *short: str) -> Any:
    """The flag of a ``[workload]`` key (:data:`~apmodel.frontend.workloads.WORKLOAD_KEYS`: one declaration
    for the file and the command line)."""
    spec = WORKLOAD_KEYS[name]
    text = spec.help + (f" Default: {spec.default_doc}." if spec.default_doc else "") + f" TOML: {spec.toml}."
    return typer.Option(None, spec.flag, *short, min=1 if spec.kind == "int" else None, help=escape(text))


def _old_parameter(flag: str, spec: OptionSpec) -> inspect.Parameter:
    """A hidden flag of an earlier version (:data:`~apmodel.core.options.OLD_FLAGS`)."""
    info = typer.Option(None, flag, hidden=True, show_default=False)
    return inspect.Parameter(_old_param_name(flag), inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=_ANNOTATIONS[spec.kind])


def _old_param_name(flag: str) -> str:
    return "old_" + flag[2:].replace("-", "_")


def _take_old_flag(flag: str, old: OldName, raw: Any, flags: dict[str, Any]) -> None:
    """Read a given old flag as its option's, with a warning naming the new flag."""
    new = option_specs()[old.option].flag
    logger.warning("%s is deprecated: use %s%s", flag, new, f" ({old.note})" if old.note else "")
    if isinstance(raw, (list, tuple)):  # a repeated flag: the old values beside the new ones
        flags[old.option] = [*(flags[old.option] or []), *raw]
    elif flags[old.option] is None:
        flags[old.option] = old.convert(raw)
    else:
        raise CLIError(f"{flag} and {new} are one option: give {new}")


def with_option_flags(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the command gets one flag per planning option (``names``; default: all of them)
    and receives what was given as ``option_flags`` (field -> raw value, ``None`` where not given)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        specs = {n: s for n, s in option_specs().items() if not names or n in names}
        old_flags = {f: old for f, old in OLD_FLAGS.items() if old.option in specs}
        if set(names) - set(specs):
            raise TypeError(f"{command.__name__}: {sorted(set(names) - set(specs))} are not planning options")
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != "option_flags"]
        clash = {p.name for p in own} & set(specs)
        if clash:
            raise TypeError(f"{command.__name__}: parameters {sorted(clash)} are planning options already")

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            flags = {name: kwargs.pop(name, None) for name in specs}
            for flag, old in old_flags.items():
                raw = kwargs.pop(_old_param_name(flag), None)
                if raw is not None and raw != []:
                    _take_old_flag(flag, old, raw, flags)
            return command(**kwargs, option_flags=flags)

        params = sorted([*own, *(_parameter(n, s) for n, s in specs.items()),
                         *(_old_parameter(f, specs[old.option]) for f, old in old_flags.items())],
                        key=lambda p: p.kind)  # keyword-only last
        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _key_values(flag: str, items: list[str]) -> dict[str, tuple[str, Any]]:
    """``["max_iters=300", "nvls=false"]`` -> ``{"max_iters": ("max_iters=300", 300), ...}``:
    each value read as a TOML value (a bare word is a string)."""
    out: dict[str, tuple[str, Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or not text.strip():
            raise CLIError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        out[key.strip()] = (item, value)
    return out


def _ints(flag: str, items: list[str]) -> list[int]:
    """``["1,2", "4"]`` -> ``[1, 2, 4]``; a word that is not an integer is a :class:`CLIError`."""
    out = []
    for item in items:
        for word in str(item).split(","):
            try:
                out.append(int(word))
            except ValueError:
                raise CLIError(f"{flag} {item!r}: expected integers, once per flag or comma-separated (1,2,4)") from None
    return out


def options_from_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The options the flags give (field -> value in the field's units), checked as the TOML
    configuration's are; a bad value is a :class:`CLIError` naming the flag."""
    specs = option_specs()
    out: dict[str, Any] = {}
    for name, raw in flags.items():
        if raw is None or (isinstance(raw, (list, tuple)) and not raw):
            continue
        spec = specs[name]
        if spec.kind in ("table", "keys"):
            entries = _key_values(spec.flag, list(raw))
            if spec.kind == "table":
                out[name] = {key: value for key, (_, value) in entries.items()}
                continue
            values = {}
            for key, (item, value) in entries.items():
                if key not in spec.keys:
                    raise CLIError(f"{spec.flag} {item!r}: unknown key {key!r} (known: {', '.join(spec.keys)})")
                try:
                    values[key] = spec.keys[key].read(value)
                except BadValue as e:
                    raise CLIError(f"{spec.flag} {item!r}: expected {e.what}") from None
            out[name] = values
            continue
        if spec.kind == "ints":  # once per value, or comma-separated: --pp-degrees 1,2,4
            raw = _ints(spec.flag, raw)
        try:
            out[name] = spec.read(list(raw) if isinstance(raw, (list, tuple)) else raw)
        except BadValue as e:
            shown = " ".join(map(str, raw)) if isinstance(raw, (list, tuple)) else raw
            raise CLIError(f"{spec.flag} {shown!r}: expected {spec.what(quote=False) if spec.choices else e.what}") from None
    return out

"""How an option of a planning run is declared: :class:`OptionSpec` (the metadata of one
:class:`~apmodel.core.options.PlanOptions` field: help, group, kind, choices, range) and
:func:`option`, which attaches it to a field. The CLI flags (:mod:`apmodel.cli.flags`), the TOML
schema (:mod:`apmodel.frontend.config`), the value checks and the README's options table are generated
from these declarations. This module imports no torch.

**One name per option.** An option's name is its field's, and every surface spells it so: the
TOML key (``[<group>] <name>``: the TOML section is the option's group, which is also its
``--help`` panel), the flag (``--<name>`` with dashes) and the keyword of every function that
takes it. A spec therefore declares neither a TOML key nor a flag: both are derived from
``name`` and ``group`` (:attr:`OptionSpec.toml`, :attr:`OptionSpec.flag`).
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field
from typing import Any, Mapping, TypeGuard

#: The groups of the options, in the order the README and ``apmodel plan --help`` show them; each is
#: also the TOML section of its options (``[pricing]``, ``[search]``, ...).
GROUPS = {"pricing": "Pricing", "search": "Search space", "pipeline": "Pipeline", "solving": "Solving"}
#: The TOML sections a spec may sit in: the groups, and ``[workload]`` (what to plan; not an option).
SECTIONS = {**GROUPS, "workload": "Workload"}


class BadValue(ValueError):
    """A value given on a surface (TOML, a flag) is not what its option takes: ``what`` it must be."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


# ------------------------------------------------------------------------------- the specs
#: What a value is, on the surfaces (TOML, flags), for each ``OptionSpec.kind``.
KINDS = ("str", "path", "object", "int", "float", "bool", "ints", "placements", "table", "keys")
_OBJECT_SPEC = re.compile(r"[^:]+:[^:]+")
_RANGE = re.compile(r"\s*([\[(])\s*(-?inf|-?[0-9.e+-]+)\s*,\s*(-?inf|-?[0-9.e+-]+)\s*([\])])\s*")


def is_int(v: Any) -> TypeGuard[int]:
    """A JSON/TOML integer, not a bool (``true`` is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A JSON/TOML number: int or float, not a bool (``true`` is not a count)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class OptionSpec:
    """The declaration of one option (a :class:`PlanOptions` field's metadata; :func:`option`).

    ``kind`` is what a value is on the surfaces (:data:`KINDS`): ``str``, ``path`` (a file; with
    ``suffix``; ``relative``: read relative to the configuration file), ``object`` (a dotted name
    ``"package.module:Name"``), ``int``, ``float`` (``unit``: the unit the value is in, on
    every surface), ``bool`` (flag ``--x/--no-x``), ``ints`` (integers; a repeated flag, or comma-separated), ``placements``
    (one placement string per input or output, ``"default"`` for the default; a repeated flag),
    ``table`` (free keys; ``--flag KEY=VALUE``, repeated) and ``keys`` (the sub-keys ``keys``, a TOML
    table such as ``[pricing.topology]``; ``--flag KEY=VALUE``, repeated). ``range`` is an
    interval such as ``"(0, 1]"`` or ``"[0, inf)"`` (of each item for ``ints``). ``default_doc`` says
    what a ``None`` default means; ``python`` what the Python API takes beyond the surfaces (values
    of another type are not checked against ``choices``); ``help_from`` names a function
    (``"module:function"``) whose text ``--help`` appends; ``registry`` one (``"module:function"``)
    listing the backends the option may name, checked before planning (:meth:`PlanOptions.check_available`);
    ``model``: the option is a keyword argument of the placement model (:meth:`PlanOptions.model_kwargs`).
    ``name`` is the field's name (bound by :func:`apmodel.core.options.option_spec`; ``""`` for the
    sub-keys of a ``keys`` option); the TOML key and the flag are derived from it and ``group``.
    """

    help: str
    kind: str = "str"
    group: str = "pricing"
    choices: tuple[str, ...] = ()
    range: str = ""
    unit: str = ""
    suffix: str = ""
    relative: bool = False
    default_doc: str = ""
    python: str = ""
    help_from: str = ""
    registry: str = ""
    model: bool = False
    keys: Mapping[str, "OptionSpec"] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option kind {self.kind!r} is not one of {KINDS}")
        if self.group not in SECTIONS:
            raise ValueError(f"option group {self.group!r} is not one of {tuple(SECTIONS)}")
        if self.range and _RANGE.fullmatch(self.range) is None:
            raise ValueError(f"option range {self.range!r}: expected an interval such as '(0, 1]' or '[0, inf)'")

    # ------------------------------------------------------------------------ the names
    @property
    def section(self) -> str:
        """The TOML section: the option's group."""
        return self.group

    @property
    def key(self) -> str:
        """The TOML key within the section: the option's name."""
        return self.name

    @property
    def toml(self) -> str:
        """``section.key``, e.g. ``pricing.ac`` (``""`` for a sub-key of a ``keys`` option)."""
        return f"{self.group}.{self.name}" if self.name else ""

    @property
    def flag(self) -> str:
        """The flag: the name with dashes, e.g. ``--memory-limit-bytes``."""
        return "--" + self.name.replace("_", "-") if self.name else ""

    # ------------------------------------------------------------------------ reading
    def bounds(self) -> tuple[float, bool, float, bool] | None:
        """``(low, low_open, high, high_open)`` of ``range``."""
        m = _RANGE.fullmatch(self.range) if self.range else None
        if m is None:
            return None
        return float(m.group(2)), m.group(1) == "(", float(m.group(3)), m.group(4) == ")"

    def in_range(self, v: float) -> bool:
        """Whether ``v`` lies in ``range``; NaN never does."""
        b = self.bounds()
        if b is None:
            return not (isinstance(v, float) and math.isnan(v))
        lo, lo_open, hi, hi_open = b
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)

    def range_text(self) -> str:
        """``" in (0, 1]"``, ``" > 0"``, ``" >= 1"`` (finiteness is said by :meth:`what`)."""
        b = self.bounds()
        if b is None:
            return ""
        lo, lo_open, hi, _ = b
        if math.isinf(hi):
            return f" {'>' if lo_open else '>='} {lo:g}"
        return f" in {self.range.strip()}"

    def what(self, quote: bool = True) -> str:
        """What a value must be, for error messages (``quote``: choices as TOML strings)."""
        k = self.kind
        if k == "str":
            if self.registry:
                return f"a backend of {self.registry.replace(':', '.')}()"
            if self.choices:
                return "one of " + ", ".join(f'"{c}"' if quote else c for c in self.choices)
            return "a string"
        if k == "path":
            return f"a path to a {self.suffix} file" if self.suffix else "a path"
        if k == "object":
            return 'a dotted name "package.module:Name"'
        if k == "int":
            return f"an integer{self.range_text()}"
        if k == "float":
            b = self.bounds()
            finite = "a finite number" if b is not None and math.isinf(b[2]) and b[3] else "a number"
            return f"{finite}{self.range_text()}" + (f" ({self.unit})" if self.unit else "")
        if k == "bool":
            return "true or false"
        if k == "ints":
            return f"a list of integers{self.range_text()}"
        if k == "placements":
            return 'a list of placement strings such as "S(0)R" ("default": the default placement)'
        if k == "table":
            return "a table"
        return "a table of " + ", ".join(self.keys)

    def read(self, value: Any) -> Any:
        """A surface value (TOML, or a flag's) as the field holds it; :class:`BadValue` if it is not
        :meth:`what` the option takes. ``keys`` options read each sub-key with its own spec."""
        k = self.kind
        if k in ("str", "path", "object"):
            if not isinstance(value, str) or not value.strip():  # an empty name or path is never meant
                raise BadValue(self.what())
            if self.choices and value not in self.choices:
                raise BadValue(self.what())
            if k == "path" and self.suffix and not value.lower().endswith(self.suffix):
                raise BadValue(self.what())
            if k == "object" and not _OBJECT_SPEC.fullmatch(value):
                raise BadValue(self.what())
            return value
        if k == "int":
            if not is_int(value) or not self.in_range(value):
                raise BadValue(self.what())
            return value
        if k == "float":
            if not is_number(value) or not self.in_range(value):
                raise BadValue(self.what())
            return float(value)
        if k == "bool":
            if not isinstance(value, bool):
                raise BadValue(self.what())
            return value
        if k == "ints":
            if not isinstance(value, (list, tuple)) or not all(is_int(a) and self.in_range(a) for a in value):
                raise BadValue(self.what())
            return tuple(value)
        if k == "placements":
            if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
                raise BadValue(self.what())
            from apmodel.core import placements as pl  # torch: only when placements are given

            out: list[str | None] = []
            for p in value:
                if p == "default":
                    out.append(None)
                    continue
                try:
                    pl.parse(p)
                except ValueError as e:
                    raise BadValue(f"{self.what()}; {e}") from None
                out.append(p)
            return tuple(out)
        if not isinstance(value, dict):
            raise BadValue(self.what())
        if k == "keys":
            unknown = sorted(set(value) - set(self.keys))
            if unknown:
                raise BadValue(f"{self.what()} (unknown key {unknown[0]!r})")
            return {key: self.keys[key].read(v) for key, v in value.items()}
        return dict(value)

    def flag_text(self) -> str:
        """The flag as ``--help`` and the README write it: ``--[no-]seeding``, ``--topology KEY=VALUE``."""
        if self.kind == "bool":
            return f"--[no-]{self.flag[2:]}"
        if self.kind in ("table", "keys"):
            return f"{self.flag} KEY=VALUE"
        return self.flag

    def toml_text(self) -> str:
        """The TOML key(s): ``pricing.ac``; for ``keys`` each sub-key (``pricing.topology.nvls``)."""
        if self.kind == "keys":
            return ", ".join(f"{self.toml}.{k}" for k in self.keys)
        return self.toml


#: the dataclass field metadata key holding a field's :class:`OptionSpec`
SPEC_KEY = "apmodel.option"


def spec_of(f: Any) -> OptionSpec | None:
    """The declaration of dataclass field ``f`` (None for a field not declared with :func:`option`)."""
    return f.metadata.get(SPEC_KEY)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, help: str, **spec: Any) -> Any:
    """A :class:`PlanOptions` field with its declaration (:class:`OptionSpec` keywords; no TOML key
    and no flag: both are the field's name, in its group's section)."""
    metadata = {SPEC_KEY: OptionSpec(help=help, **spec)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)

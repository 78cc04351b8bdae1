"""Plan files: the format's version and fields, and the one validation every reader of a plan file
goes through (:meth:`apmodel.result.plans.Plan.from_json` and :meth:`~apmodel.result.plans.Plan.load`).

:func:`plan_fields` turns the JSON object :meth:`~apmodel.result.plans.Plan.to_json` writes into the
keyword arguments of :class:`~apmodel.result.plans.Plan`, checking each field's type and range as it
reads it and then what the file says twice (:func:`check_consistent`); any problem raises
:class:`PlanFileError` naming the source and the field.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from apmodel.candidates.strategies import Strategy
from apmodel.core import placements as pl
from apmodel.core.option_spec import is_int, is_number
from apmodel.core.options import default_of, node_layout_problem

#: the plan file's messages keep the logger they had when this was part of apmodel.result.plans
logger = logging.getLogger("apmodel.result.plans")

#: Version of the plan file format; bump on incompatible changes. 2: every node strategy records
#: the rank of each tensor it places (``out_ndim`` / ``in_ndim``) and ``param_ndim`` that of each
#: parameter, so a placement sharding a dimension the tensor lacks is refused on load. Version 1
#: files (no ranks) are still read; their placements are checked against the mesh only.
#: 3: a plan with pipeline stages (``pipeline``: degree, schedule, microbatches, stages, price,
#: alternatives); written only for such plans, so a reader of versions 1-2 refuses what it cannot
#: run, and plans without a pipeline stay version 2.
PLAN_FORMAT_VERSION = 2
PIPELINE_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
#: Every top-level field a plan file may hold (what :meth:`Plan.to_json` writes); any other is refused.
PLAN_FIELDS = ("format", "version", "mesh_shape", "fingerprint", "structure_fingerprint", "workload", "objective_us",
               "compute_us", "comm_us", "comm_by_collective", "per_layer", "solver", "sizes", "timings",
               "param_placements", "param_ndim", "node_strategy", "warnings", "memory", "pipeline", "overlap")
#: What :func:`apmodel.graph.capture.capture` and :func:`structure_fingerprint` write: a sha256 in hex.
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
#: How an error about a field that only an edit can make ends: what to do about it.
_EDITED = "the file was edited or is corrupt: restore it or re-plan"


class PlanFileError(ValueError):
    """A plan file (or plan JSON object) is malformed; the message names the source and the field."""


def _short(v: Any, limit: int = 80) -> str:
    """``repr`` of a bad value, cut so a huge value does not flood the error message."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _bad(source: str, where: str, what: str, got: Any) -> PlanFileError:
    return PlanFileError(f"{source}: field {where!r} must be {what}, got {_short(got)}")


def placements_to_json(p: Any) -> str | None:
    """A placement tuple as its string (``"S(0)R"``), None for a value that is not placed."""
    return None if p is None else pl.tuple_to_str(p)


def _placements_from_json(s: Any, where: str, ndim: int | None = None, source: str = "plan file", *, optional: bool = True):
    """Parse one placement string; ``ndim`` (the mesh's axis count) checks the number of tokens."""
    if s is None and optional:
        return None
    if not isinstance(s, str):
        what = "a placement string like 'S(0)R'" + (" or null" if optional else "")
        raise _bad(source, where, what, s)
    try:
        return pl.parse(s, ndim)
    except ValueError as e:
        raise PlanFileError(f"{source}: field {where!r}: {e}") from None


@dataclass(frozen=True)
class TensorRanks:
    """The rank of each output and input of a node (None where it is not a tensor)."""

    outputs: tuple[int | None, ...]
    inputs: tuple[int | None, ...]


def strategy_to_json(s: Strategy, ranks: TensorRanks | None = None) -> dict[str, list[Any]]:
    d: dict[str, list[Any]] = {"out": [placements_to_json(p) for p in s.outputs],
                               "in": [placements_to_json(p) for p in s.inputs]}
    if ranks is not None:
        d["out_ndim"], d["in_ndim"] = list(ranks.outputs), list(ranks.inputs)
    return d


def _check_rank(placement: Any, rank: Any, where: str, source: str) -> None:
    """A placement sharding dimension d needs a tensor of rank > d (None: not a tensor, no placement)."""
    if placement is None:
        return
    if rank is None:
        raise PlanFileError(f"{source}: field {where!r}: {pl.tuple_to_str(placement)} places a value that is not a tensor")
    for p in placement:
        dim = getattr(p, "dim", None)
        if dim is not None and not 0 <= dim < rank:
            raise PlanFileError(f"{source}: field {where!r}: {pl.tuple_to_str(placement)} shards dimension {dim} of a "
                                f"tensor of rank {rank}")


def _ranks_from_json(d: dict, key: str, count: int, where: str, source: str) -> list[int | None] | None:
    ranks = d.get(key)
    if ranks is None:
        return None
    if not isinstance(ranks, list) or len(ranks) != count or not all(r is None or (is_int(r) and r >= 0) for r in ranks):
        raise _bad(source, f"{where}.{key}", f"a list of {count} tensor ranks (non-negative ints or null)", ranks)
    return ranks


def strategy_from_json(d: Any, where: str, ndim: int | None = None, source: str = "plan file") -> Strategy:
    """A :class:`Strategy` from ``{"out": [...], "in": [...]}`` (with ``out_ndim`` / ``in_ndim``, the
    tensors' ranks, checked against the placements); PlanFileError names ``where`` if malformed."""
    if not isinstance(d, dict) or not isinstance(d.get("out"), list) or not isinstance(d.get("in"), list):
        raise _bad(source, where, "an object with 'out' and 'in' lists of placement strings", d)
    if not d["out"]:
        raise _bad(source, f"{where}.out", "a non-empty list (every node has an output)", d["out"])
    strategy = Strategy(
        outputs=tuple(_placements_from_json(p, f"{where}.out[{i}]", ndim, source) for i, p in enumerate(d["out"])),
        inputs=tuple(_placements_from_json(p, f"{where}.in[{i}]", ndim, source) for i, p in enumerate(d["in"])),
    )
    if ("out_ndim" in d) != ("in_ndim" in d):
        raise PlanFileError(f"{source}: field {where!r}: 'out_ndim' and 'in_ndim' come together (or neither)")
    for side, placements in (("out", strategy.outputs), ("in", strategy.inputs)):
        ranks = _ranks_from_json(d, f"{side}_ndim", len(placements), where, source)
        for i, (placement, rank) in enumerate(zip(placements, ranks or (), strict=False)):
            _check_rank(placement, rank, f"{where}.{side}[{i}]", source)
    return strategy


def _finite(source: str, where: str, value: float) -> float:
    if not math.isfinite(value):
        raise _bad(source, where, "a finite number", value)
    return value


def _str_keyed(source: str, where: str, value: Any, what: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _bad(source, where, what, value)
    return value


def _number_map(source: str, where: str, value: Any, *, ints: bool = False) -> dict[str, Any]:
    """A ``{name: number}`` object (``ints``: integers only) of finite numbers >= 0 (costs, times,
    counts), checked entry by entry."""
    ok = is_int if ints else is_number
    what = "an object of integers" if ints else "an object of numbers"
    for k, v in _str_keyed(source, where, value, what).items():
        if not ok(v):
            raise _bad(source, f"{where}[{k!r}]", "an integer" if ints else "a number", v)
        _finite(source, f"{where}[{k!r}]", float(v))
        if v < 0:
            raise _bad(source, f"{where}[{k!r}]", "a number >= 0", v)
    return {k: (int(v) if ints else float(v)) for k, v in value.items()}


def collective_key(kind: str, axes: Sequence[int], region: str | None = None) -> str:
    """The key of :attr:`Plan.comm_by_collective`: ``"all_gather@axis0"``; a ``local_map``
    region's own collective names the region and may span axes: ``"all_to_all (moe)@axis0+1"``."""
    label = kind if region is None else f"{kind} ({region})"
    return f"{label}@axis{'+'.join(map(str, axes))}"


def parse_collective_key(key: str) -> tuple[str, str | None, tuple[int, ...]]:
    """``(kind, region or None, mesh axes)`` of a :func:`collective_key`."""
    label, _, axes = key.partition("@axis")
    kind, _, region = label.partition(" (")
    return kind, region[:-1] or None, tuple(int(a) for a in axes.split("+") if a.isdecimal())


# ---------------------------------------------------------------------------------------------
# reading a plan file


def read_plan_json(path: str | Path) -> Any:
    """The JSON object in the file at ``path``; PlanFileError says why when it cannot be read."""
    if Path(path).exists() and not Path(path).is_file():  # a FIFO or a device would block the read
        raise PlanFileError(f"{path}: not a regular file")
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise PlanFileError(f"{path}: cannot read plan file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise PlanFileError(f"{path}: not a plan file (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise PlanFileError(f"{path}: not a plan file (JSON nested too deeply)") from None


def _check_header(data: Any, source: str) -> None:
    """The format marker, a readable version, no unknown field and every required one."""
    if not isinstance(data, dict) or data.get("format") != "apmodel-plan":
        raise PlanFileError(f"{source}: not an apmodel plan file (missing \"format\": \"apmodel-plan\")")
    version = data.get("version")
    if not is_int(version) or version not in READABLE_VERSIONS:
        raise PlanFileError(f"{source}: plan format version {_short(version)} is not supported (this apmodel reads "
                            f"{', '.join(map(str, READABLE_VERSIONS))})")
    unknown = [k for k in data if k not in PLAN_FIELDS]
    if unknown:
        raise PlanFileError(f"{source}: unknown field {_short(unknown[0])} (a plan file holds {', '.join(PLAN_FIELDS)}): "
                            "remove it, or read the file with the apmodel that wrote it")
    if version == 1:
        logger.info("%s: plan format version 1 records no tensor ranks; its placements are checked against the "
                    "mesh only (save it again to record them)", source)
    required = ["mesh_shape", "fingerprint", "structure_fingerprint", "node_strategy", "param_placements", "objective_us"]
    for key in required:
        if key not in data:
            raise PlanFileError(f"{source}: missing field {key!r}")


def _identity_fields(data: dict, source: str) -> tuple[int, ...]:
    """The mesh shape (returned) and the two fingerprints, checked."""
    raw_mesh = data["mesh_shape"]
    if not isinstance(raw_mesh, list) or not raw_mesh or not all(is_int(x) and x > 0 for x in raw_mesh):
        raise _bad(source, "mesh_shape", "a non-empty list of positive ints", raw_mesh)
    for key in ("fingerprint", "structure_fingerprint"):
        if not isinstance(data[key], str):
            raise _bad(source, key, "a string", data[key])
        if not _FINGERPRINT.fullmatch(data[key]):
            raise PlanFileError(f"{source}: field {key!r} must be the 64 hex digits of the graph's sha256, got "
                                f"{_short(data[key])}: {_EDITED}")
    return tuple(raw_mesh)


def _placement_fields(data: dict, source: str, ndim: int) -> dict[str, Any]:
    """``node_strategy``, ``node_ranks``, ``param_placements`` and ``param_ndim``, the placements
    checked against the mesh's axis count and the tensors' recorded ranks."""
    raw_nodes = _str_keyed(source, "node_strategy", data["node_strategy"], "an object mapping node names to strategies")
    if not raw_nodes:
        raise PlanFileError(f"{source}: field 'node_strategy' is empty: a plan places at least one node")
    nodes = {k: strategy_from_json(v, f"node_strategy[{k!r}]", ndim, source) for k, v in raw_nodes.items()}
    node_ranks = {k: TensorRanks(tuple(v["out_ndim"]), tuple(v["in_ndim"]))
                  for k, v in raw_nodes.items() if v.get("out_ndim") is not None and v.get("in_ndim") is not None}
    raw_params = _str_keyed(source, "param_placements", data["param_placements"], "an object mapping parameter names to placement strings")
    params = {k: _placements_from_json(v, f"param_placements[{k!r}]", ndim, source, optional=False) for k, v in raw_params.items()}
    param_ndim = _number_map(source, "param_ndim", data.get("param_ndim", {}), ints=True)
    for k, placement in params.items():
        if k in param_ndim:
            _check_rank(placement, param_ndim[k], f"param_placements[{k!r}]", source)
    return {"node_strategy": nodes, "node_ranks": node_ranks, "param_placements": params, "param_ndim": param_ndim}


def _step_times(data: dict, source: str) -> dict[str, float]:
    """``objective_us`` (required), ``compute_us`` and ``comm_us`` (NaN: not recorded)."""
    numbers = {}
    for key in ("objective_us", "compute_us", "comm_us"):
        if key not in data:  # only objective_us is required (checked by _check_header); NaN: not recorded
            numbers[key] = float("nan")
            continue
        if not is_number(data[key]):
            raise _bad(source, key, "a number (µs)", data[key])
        numbers[key] = _finite(source, key, float(data[key]))
        if numbers[key] < 0:
            raise _bad(source, key, "a time >= 0 (µs)", data[key])
    return numbers


def _pipeline_field(data: dict, source: str) -> dict[str, Any] | None:
    if data.get("pipeline") is None:
        return None
    from apmodel.result.pipeline_record import PipelineChoice, PipelineError

    try:
        return PipelineChoice.from_json(data["pipeline"], source).to_json()
    except PipelineError as e:
        raise PlanFileError(str(e)) from None


def _memory_field(data: dict, source: str) -> dict[str, float | None]:
    memory = _str_keyed(source, "memory", data.get("memory", {}), "an object of byte counts")
    for k, v in memory.items():
        if v is not None and not is_number(v):
            raise _bad(source, f"memory[{k!r}]", "a number of bytes or null", v)
        if v is not None:
            _finite(source, f"memory[{k!r}]", float(v))
            if v < 0:
                raise _bad(source, f"memory[{k!r}]", "a number of bytes >= 0 or null", v)
    return {k: (None if v is None else float(v)) for k, v in memory.items()}


def _overlap_field(data: dict, source: str) -> dict[str, Any]:
    overlap = dict(_str_keyed(source, "overlap", data.get("overlap", {}), "an object"))
    for k, v in overlap.items():
        if k == "enabled":
            if not isinstance(v, bool):
                raise _bad(source, "overlap['enabled']", "true or false", v)
        elif not is_number(v) or float(v) < 0:
            raise _bad(source, f"overlap[{k!r}]", "a number >= 0", v)
        else:
            _finite(source, f"overlap[{k!r}]", float(v))
    return overlap


def plan_fields(data: Any, source: str) -> dict[str, Any]:
    """The keyword arguments of :class:`~apmodel.result.plans.Plan` that the plan file object ``data``
    holds, each field checked as it is read (in the order below, so the first problem is the one
    reported), then against each other (:func:`check_consistent`)."""
    _check_header(data, source)
    mesh_shape = _identity_fields(data, source)
    placed = _placement_fields(data, source, len(mesh_shape))
    numbers = _step_times(data, source)
    solver = dict(_str_keyed(source, "solver", data.get("solver", {}), "an object"))
    for k, v in solver.items():
        if isinstance(v, float) and math.isnan(v):
            raise _bad(source, f"solver[{k!r}]", "a number that is not NaN", v)
    per_layer = _str_keyed(source, "per_layer", data.get("per_layer", {}), "an object of {compute_us, comm_us} objects")
    warnings = data.get("warnings", [])  # absent in files written before warnings existed
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise _bad(source, "warnings", "a list of strings", warnings)
    pipeline = _pipeline_field(data, source)
    memory = _memory_field(data, source)
    overlap = _overlap_field(data, source)
    fields: dict[str, Any] = dict(
        mesh_shape=mesh_shape,
        fingerprint=data["fingerprint"],
        structure_fingerprint=data["structure_fingerprint"],
        node_strategy=placed["node_strategy"],
        param_placements=placed["param_placements"],
        objective_us=numbers["objective_us"],
        compute_us=numbers["compute_us"],
        comm_us=numbers["comm_us"],
        comm_by_collective=_number_map(source, "comm_by_collective", data.get("comm_by_collective", {})),
        per_layer={k: _number_map(source, f"per_layer[{k!r}]", v) for k, v in per_layer.items()},
        solver=solver,
        sizes=_number_map(source, "sizes", data.get("sizes", {}), ints=True),
        timings=_number_map(source, "timings", data.get("timings", {})),
        workload=dict(_str_keyed(source, "workload", data.get("workload", {}), "an object")),
        warnings=list(warnings),
        memory=memory,
        node_ranks=placed["node_ranks"],
        param_ndim=placed["param_ndim"],
        pipeline=pipeline,
        overlap=overlap,
    )
    check_consistent(fields, source)
    return fields


def check_consistent(fields: dict[str, Any], source: str) -> None:
    """What a plan file says twice must agree: the fields an edit changes alone are refused, naming
    them (each field's own type and range are checked as it is read). From the file alone, not the
    model's graph: whether the fingerprint is this model's is checked where a model is at hand
    (:meth:`Plan.check_compatible`: replay, explain, report). ``fields``: :func:`plan_fields`'s."""
    mesh = tuple(fields["mesh_shape"])
    workload = fields["workload"]
    recorded = workload.get("mesh")
    if recorded is not None and (not isinstance(recorded, list) or tuple(recorded) != mesh):
        raise PlanFileError(f"{source}: field 'mesh_shape' {list(mesh)} disagrees with 'workload.mesh' "
                            f"{_short(recorded)}, the mesh it was planned on: {_EDITED}")
    gpus = workload.get("gpus_per_node")
    if is_int(gpus) and gpus >= 1 and gpus != default_of("gpus_per_node"):  # the default only warns when planning
        problem = node_layout_problem(mesh, gpus)
        if problem is not None:
            raise PlanFileError(f"{source}: field 'workload.gpus_per_node': {gpus} {problem}, and re-plan")
    for key in fields["comm_by_collective"]:
        outside = [a for a in parse_collective_key(key)[2] if a >= len(mesh)]
        if outside:
            raise PlanFileError(f"{source}: field \"comm_by_collective[{key!r}]\" names mesh axis {outside[0]}, "
                                f"outside mesh {mesh}: {_EDITED}")
    step, objective = fields["overlap"].get("step_us"), fields["objective_us"]
    if step is not None and not math.isclose(step, objective, rel_tol=1e-9, abs_tol=1e-9):
        raise PlanFileError(f"{source}: field 'objective_us' {objective!r} disagrees with 'overlap.step_us' "
                            f"{step!r} (the same step time): {_EDITED}")
    nodes = fields["sizes"].get("nodes")
    if nodes is not None and nodes != len(fields["node_strategy"]):
        raise PlanFileError(f"{source}: field 'node_strategy' places {len(fields['node_strategy'])} nodes, but "
                            f"\"sizes['nodes']\" says the graph has {nodes}: {_EDITED}")
    param_placements, param_ndim = fields["param_placements"], fields["param_ndim"]
    if param_ndim:  # every parameter of the planned model (empty: a version 1 file, saved again or not)
        extra = sorted(set(param_placements) - set(param_ndim))
        if extra:
            raise PlanFileError(f"{source}: field \"param_placements[{extra[0]!r}]\" places a parameter the planned "
                                f"model does not have (field 'param_ndim' records its parameters): {_EDITED}")
        missing = sorted(set(param_ndim) - set(param_placements))
        if missing:
            raise PlanFileError(f"{source}: field 'param_placements' does not place parameter {missing[0]!r} of the "
                                f"planned model (field 'param_ndim' records it): {_EDITED}")

"""Every option of a planning run in one frozen object, each declared once, here.

:class:`PlanOptions` holds what the planner searches over (parameter storage policy, replicated
axes, seeding), how it prices a plan (device, topology, pricing dtype, mixed precision, cost
models, calibration, compute profile, execution mode, optimizer, memory limit) and how it solves
(backend, time limit, backend options). The Python API, the CLI (through the TOML configuration
and its flags), the recipes and the benchmarks all build one, and a plan file records it as its
``workload`` (:meth:`PlanOptions.to_record`), from which ``apmodel explain`` and ``apmodel report``
rebuild the model (:meth:`PlanOptions.from_record`).

Each field carries its whole declaration in its metadata (:class:`~apmodel.core.option_spec.OptionSpec`, made by
:func:`option`): default, help text, group, kind of value, allowed values or range, unit. The
option has one name, the field's: its TOML key is ``[<group>] <name>``, its flag ``--<name>``
(dashes for underscores), its keyword ``<name>``; the group is also its ``--help`` panel.
Spellings of earlier versions (:data:`OLD_TOML_KEYS`, :data:`OLD_FLAGS`, :data:`OLD_KEYWORDS`,
:data:`OLD_RECORD_KEYS`) are still read, with a warning naming the new name.
Everything else is generated from it:

* the flags of ``apmodel plan`` (and of ``apmodel calibrate`` for the device's; :mod:`apmodel.cli.flags`),
  read with the same checks as the TOML keys and named in their errors,
* the TOML schema and its validation (:mod:`apmodel.frontend.config`),
* the checks of :meth:`PlanOptions.__post_init__` (allowed values, ranges, sub-keys),
* the README's options tables (:func:`options_table`; ``python tools/options_table.py`` rewrites
  them between ``<!-- options-table:start -->`` and ``<!-- options-table:end -->``;
  ``tests/test_readme.py`` checks they are current).

The pipeline passes the options object whole: :mod:`apmodel.solve.search` and :mod:`apmodel.problem.seeding` read
what they need from it, and the placement model gets the fields marked ``model=True`` as its
keyword arguments (:meth:`PlanOptions.model_kwargs`).

**Adding an option** is a one-place change:

1. add a field to :class:`PlanOptions`, in its group (``group="pricing"``, ``"search"``,
   ``"pipeline"`` or ``"solving"``), declared with :func:`option`::

       microbatches: int | None = option(
           None, help="Microbatches per step.", group="pipeline", kind="int", range="[1, inf)",
           default_doc="the number of stages")

   (its TOML key is then ``pipeline.microbatches`` and its flag ``--microbatches``; ``choices=``
   for a closed set of strings, ``kind="bool"`` for a ``--x/--no-x`` flag, ``"ints"`` (each item
   in ``range``) or ``"placements"`` for a repeated flag, ``"table"`` for ``--flag KEY=VALUE``; a
   new group, and so a new TOML section, is one entry of :data:`~apmodel.core.option_spec.GROUPS`);
2. read it where the pipeline needs it (``options.microbatches``); cross-field checks go in
   ``__post_init__``, checks against the mesh in :meth:`PlanOptions.check_mesh`;
3. run ``python tools/options_table.py`` to regenerate the README's table.

``tests/test_options.py`` then checks, for every field and without a list of its own, that it has
one name across field, TOML key, flag and keyword, that its ``--help`` panel is its TOML section,
that it has a README row, and that a value set through the TOML key and through the flag lands in
``PlanOptions`` alike.

**Renaming an option** keeps the old spelling readable: add it to :data:`OLD_TOML_KEYS`,
:data:`OLD_FLAGS`, :data:`OLD_KEYWORDS` (and :data:`OLD_RECORD_KEYS` when plan files recorded it).

This module imports no torch: the CLI validates options before the slow imports.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import warnings
from collections import Counter
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Literal, Mapping, Sequence, get_args

from apmodel.core.option_spec import GROUPS, BadValue, OptionSpec, is_number, option, spec_of
from apmodel.core.schedules import SCHEDULES

logger = logging.getLogger(__name__)

ParamPolicy = Literal["full_shard", "free"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd-nomomentum", "none"]
#: Activation checkpointing policies (:mod:`apmodel.graph.checkpointing`).
ACPolicy = Literal["none", "selective", "full"]
Execution = Literal["eager", "graphs"]
PricingDtype = Literal["bf16", "fp16", "fp32", "fp8"]

PARAM_POLICIES: tuple[str, ...] = get_args(ParamPolicy)
#: ``parallelize``'s default ``device``: the live mesh's hardware (:mod:`apmodel.frontend.machine`); not a
#: value the options themselves take.
DEVICE_AUTO = "auto"
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
AC_POLICIES: tuple[str, ...] = get_args(ACPolicy)
EXECUTIONS: tuple[str, ...] = get_args(Execution)
PRICING_DTYPES: tuple[str, ...] = get_args(PricingDtype)
#: Bytes per element of each pricing dtype (``torch.<dtype>.itemsize``; fp8 is e4m3).
PRICING_DTYPE_BYTES: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
#: The torch dtype each pricing dtype names (the one table of dtype names in apmodel).
TORCH_DTYPE_NAMES: Mapping[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                                        "fp8": "float8_e4m3fn"}


def torch_dtype(name: str) -> Any:
    """``torch.bfloat16`` for ``"bf16"`` and so on (torch imported here, not at module load)."""
    import torch

    if name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(TORCH_DTYPE_NAMES)}")
    return getattr(torch, TORCH_DTYPE_NAMES[name])


def _groups_alike(mesh_shape: Sequence[int], gpus_per_node: int, axis: int) -> bool:
    """Whether every group of devices along ``axis`` (ranks numbered row-major, ``gpus_per_node``
    consecutive ranks per node) spreads over nodes alike, as the topology prices them all by the
    group of rank 0. A group's spread depends only on its first rank modulo ``gpus_per_node``, so
    the first ranks are enumerated modulo it, not one by one."""
    g = gpus_per_node
    strides = [math.prod(mesh_shape[i + 1:]) for i in range(len(mesh_shape))]
    firsts = {0}
    for i, (size, stride) in enumerate(zip(mesh_shape, strides, strict=True)):
        if i != axis:  # c * stride modulo g repeats after g steps
            firsts = {(r + c * stride) % g for r in firsts for c in range(min(size, g))}
    spreads = {tuple(sorted(Counter((r + j * strides[axis]) // g for j in range(mesh_shape[axis])).values()))
               for r in firsts}
    return len(spreads) == 1


def uneven_node_axis(mesh_shape: Sequence[int], gpus_per_node: int) -> int | None:
    """The first mesh axis whose device groups spread over nodes differently under
    ``gpus_per_node`` (see :func:`_groups_alike`), or None when every axis's groups are alike."""
    if gpus_per_node >= math.prod(mesh_shape):  # one node holds the whole mesh
        return None
    return next((a for a in range(len(mesh_shape)) if not _groups_alike(mesh_shape, gpus_per_node, a)), None)


def node_layout_problem(mesh_shape: Sequence[int], gpus_per_node: int) -> str | None:
    """Why ``gpus_per_node`` cannot lay ``mesh_shape`` onto nodes the cost model can price (what
    follows the value in a message, with the values that can), or None when it can."""
    axis = uneven_node_axis(mesh_shape, gpus_per_node)
    if axis is None:
        return None
    world = math.prod(mesh_shape)
    fitting = [d for d in range(1, min(world, 1024)) if world % d == 0 and uneven_node_axis(mesh_shape, d) is None]
    return (f"lays mesh {tuple(mesh_shape)} onto nodes unevenly: the device groups along mesh axis {axis} span nodes "
            f"differently (ranks numbered row-major), which the cost model cannot price; use "
            f"{', '.join(map(str, fitting))} or a value >= {world}")


@functools.lru_cache(maxsize=64)
def _warn_default_nodes(mesh_shape: tuple[int, ...], gpus_per_node: int, label: str) -> None:
    """Once per mesh: the default ``gpus_per_node`` is a guess the user did not make, so a mesh it
    does not fit is priced as it lays out (rank 0's groups), with a warning rather than an error."""
    logger.warning("%s %d (the default) %s", label, gpus_per_node, node_layout_problem(mesh_shape, gpus_per_node))


#: Hamming radius of split-dimension seeding (:mod:`apmodel.problem.seeding`); the AutoParallel paper's
#: default (§4.3, r = 2).
DEFAULT_SEED_RADIUS = 2

#: Param dtypes a mixed-precision step can compute in (the reduce dtype is always fp32).
MIXED_PARAM_DTYPES = ("bf16", "fp16")

#: Pipeline schedules: the ones :mod:`apmodel.core.schedules` declares (Schedule1F1B,
#: ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV), and "auto": each degree priced
#: under every one, the cheapest that fits kept.
PP_SCHEDULES = (*SCHEDULES, "auto")


def _dtype_name(dtype: Any) -> str:
    """A pricing dtype as a plan file records it: the option's name, or a torch dtype's name
    without the ``torch.`` prefix (``"bfloat16"``)."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def run_precision_of(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """:attr:`PlanOptions.run_precision` of a plan file's ``workload`` record."""
    recorded = str(record.get("dtype"))
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(recorded, recorded)  # torch names
    if record.get("mixed_precision") is True and dtype in MIXED_PARAM_DTYPES:
        return (str(dtype), "fp32")
    return None


class OptionsError(ValueError):
    """An option has a value the planner cannot use; the message names the option, and so does
    ``option`` (the :class:`PlanOptions` field), for front ends that call it something else."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def _sub(help: str, kind: str, range: str = "", unit: str = "") -> OptionSpec:
    """The spec of a sub-key of a ``keys`` option (no name of its own: a key of the option's table)."""
    return OptionSpec(help=help, kind=kind, range=range, unit=unit)


#: The topology's keys a configuration may override (``costmodels.Topology`` keyword arguments).
TOPOLOGY_SPECS: Mapping[str, OptionSpec] = {
    "intra_GBps": _sub("GB/s per GPU, one direction, inside a node", "float", "(0, inf)", "GB/s"),
    "inter_GBps": _sub("GB/s per GPU NIC, one direction, across nodes", "float", "(0, inf)", "GB/s"),
    "intra_latency_us": _sub("extra µs per intra-node hop", "float", "[0, inf)", "µs"),
    "inter_latency_us": _sub("extra µs per inter-node hop", "float", "[0, inf)", "µs"),
    "nvls": _sub("NVLink SHARP in-switch reductions, true or false", "bool"),
}
TOPOLOGY_KEYS = tuple(TOPOLOGY_SPECS)


@dataclass(frozen=True)
class PlanOptions:
    """What to search, how to price and how to solve; every field is declared here, once.

    Each field's metadata (:func:`option_spec`) holds its help, group and allowed values (its TOML
    key and flag are its name);
    the README's options table lists them (:func:`options_table`). A few take more in Python than
    on the surfaces: ``device`` a ``DeviceSpec``, ``dtype`` a torch dtype, ``mixed_precision`` a
    pair ``(param dtype, reduce dtype)`` such as ``("bf16", "fp32")`` (which sets ``dtype``; see
    :attr:`run_precision`), ``compute_model`` / ``comm_model`` objects, ``memory_limit_bytes``
    ``math.inf`` (no limit), ``input_placements`` / ``output_placements`` torch placements.
    """

    # pricing
    device: Any = option(
        "h100", help="Target device of the cost model (see `apmodel devices`).",
        python="or a costmodels DeviceSpec")
    gpus_per_node: int = option(
        8, help="GPUs per node: which mesh axes cross the network.", kind="int", range="[1, inf)")
    dtype: PricingDtype | Any = option(
        "bf16", help="Pricing dtype of compute and parameter gathers.",
        choices=PRICING_DTYPES, python="or a torch dtype")
    mixed_precision: bool | tuple[str, str] | None = option(
        None, help="fp32 master weights, gradients, optimizer state and gradient reductions beside bf16/fp16 "
                   "compute and gathers.", kind="bool",
        default_doc="priced so for bf16/fp16, the step run in the model's dtype; given: also traced and run so",
        python="or a pair (\"bf16\", \"fp32\"), which sets dtype")
    compute_model: Any = option(
        None, help="A replacement compute model, constructed with the DeviceSpec.", kind="object", default_doc="the device's", python="or an object")
    comm_model: Any = option(
        None, help="A replacement collective model, constructed with the Topology.", kind="object", default_doc="the device's", python="or an object")
    compute_profile: str | None = option(
        None, help="Compute profile (from `apmodel calibrate-compute`) for the measured compute model; in a "
                   "configuration, relative to its file.",
        kind="path", suffix=".json", relative=True, default_doc="the device's built-in profile")
    execution: Execution = option(
        "eager", help="Execution mode the measured compute model prices: eager (a launch cost per op) or graphs "
                      "(CUDA-graph replay).", choices=EXECUTIONS)
    calibration: str | None = option(
        None, help="Collective calibration (from `apmodel calibrate`); in a configuration, relative to its file.", kind="path", relative=True, default_doc="none")
    bucket_mb: float = option(
        25.0, help="Bucket size of the native program's merged collectives: a parameter's gathers and its "
                   "gradient's reductions are priced as their share of one bucket, and parallelize runs "
                   "them so (0: each alone, as the interpreter runs them).", kind="float", range="[0, inf)",
        unit="MB, 2^20 bytes")
    weight_microbatches: int = option(
        1, help="Microbatches that share each parameter gather and gradient reduction: those collectives are "
                "priced divided by this (a pipeline stage's plan, whose weights are synchronised once per step; "
                "the pipeline sets it to its microbatches).", kind="int", range="[1, inf)")
    overlap: bool = option(
        True, help="Price the step as the native program runs it: each collective issued as soon as its input "
                   "exists and waited just before its first reader, parameter gathers prefetched, so "
                   "communication hides behind computation where the dependencies allow (the objective is "
                   "the simulated step); off: compute and communication summed, each collective waited as "
                   "issued, and parallelize runs so.", kind="bool")
    inflight_mb: float = option(
        100.0, help="Most bytes of collectives in flight at once in the overlapped program (prefetched "
                    "parameter gathers, gradient reductions not yet waited); a collective larger than this "
                    "runs alone.", kind="float", range="(0, inf)",
        unit="MB, 2^20 bytes")
    topology: Mapping[str, Any] = option(
        default_factory=dict, help="Overrides of the device's topology: " + "; ".join(
            f"{k} ({s.help})" for k, s in TOPOLOGY_SPECS.items()) + ".", kind="keys", keys=TOPOLOGY_SPECS, default_doc="the device's")
    optimizer: Optimizer = option(
        "adamw", help="Optimizer whose state the memory model counts.",
        choices=OPTIMIZERS, model=True)
    ac: ACPolicy = option(
        "none", help="Activation checkpointing: selective (matmul and attention outputs saved, the rest of each "
                     "layer recomputed in backward) or full (each layer recomputed from its input); the "
                     "recomputation is priced and lowered (apmodel.graph.checkpointing).", choices=AC_POLICIES)
    memory_limit_bytes: float | None = option(
        None, help="Per-device memory limit in bytes (8e10: 80 GB); inf: none. Bytes on every surface (TOML, "
                   "flag, Python, the plan file), so that no value is rescaled between them.", kind="float",
        range="(0, inf]", unit="bytes", default_doc="the device's HBM less 10%")
    # search space
    param_policy: ParamPolicy = option(
        "full_shard", help="Parameter storage: full_shard (every parameter stored with the largest sharding it "
                           "admits, on all axes but replicate_axes) or free.", group="search", choices=PARAM_POLICIES, model=True)
    replicate_axes: tuple[int, ...] = option(
        (), help="Mesh axes on which parameters stay replicated (HSDP); the flag comma-separated (0,1) or "
                 "once per axis.", group="search", kind="ints", range="[0, inf)", model=True)
    param_memory_fraction: float | None = option(
        None, help="Per-device parameter budget, a fraction of the model's parameter bytes (instead of "
                   "param_policy).",
        group="search", kind="float", range="(0, 1]", default_doc="none", model=True)
    param_budget_ratio: float | None = option(
        None, help="Storage budget 'high' of the AutoParallel paper: mean local/global ratio over parameter "
                   "tensors (Appendix C; instead of param_policy).", group="search", kind="float", range="(0, 1]", default_doc="none", model=True)
    merge_copies: bool = option(
        True, help="Merge the copies of repeated layers into one decision (apmodel.problem.clustering).", group="search", kind="bool", model=True)
    flow_coupling: bool = option(
        True, help="Merge the producers a clustered node reads alike (paper §4.3; with merge_copies).", group="search", kind="bool", model=True)
    seeding: bool | None = option(
        None, help="Split-dimension seeding: solve each mesh axis alone, then search near that plan "
                   "(apmodel.problem.seeding).", group="search", kind="bool",
        default_doc="on for meshes of 3+ axes")
    seed_radius: int | None = option(
        None, help="Hamming radius of the seeded search.",
        group="search", kind="int", range="[0, inf)", default_doc="2 on 3 axes, one less than the axes beyond")
    seed_widen_inputs: bool = option(
        False, help="Under seeding, full-mesh rules also take input placements from the seed's ball (no longer a "
                    "restriction of the whole space).", group="search", kind="bool")
    input_placements: Sequence[Any] | None = option(
        None, help="Placement of each step input, in order; the flag once per input.", group="search", kind="placements",
        default_doc="the batch dimension sharded on axis 0", python="or torch placements", model=True)
    output_placements: Sequence[Any] | None = option(
        None, help="Placement of each forward output, in order; the flag once per output.", group="search", kind="placements",
        default_doc="replicated scalars, batch-sharded others", python="or torch placements", model=True)
    # pipeline
    pp_axis: int | None = option(
        None, help="Mesh axis that may carry pipeline stages: every allowed degree is priced (stage split, "
                   "schedule, transfers, memory) and the cheapest that fits chosen (apmodel.solve.pipeline).", group="pipeline", kind="int", range="[0, inf)",
        default_doc="no pipeline")
    pp_degrees: tuple[int, ...] = option(
        (), help="Pipeline degrees allowed, divisors of the axis size (1: no pipelining, the axis joins the SPMD "
                 "plan); the flag comma-separated (1,2,4) or once per degree.", group="pipeline", kind="ints", range="[1, inf)",
        default_doc="every divisor of the axis size")
    microbatches: int | None = option(
        None, help="Microbatches per step of a pipeline (must divide the batch).", group="pipeline", kind="int", range="[1, inf)",
        default_doc="the smallest divisor of the batch that is at least twice the largest degree")
    pp_schedule: str = option(
        "1f1b", help="Pipeline schedule: 1f1b (Schedule1F1B), interleaved (ScheduleInterleaved1F1B, two stages "
                     "per rank), zbv (ScheduleZBVZeroBubble) or dualpipev (ScheduleDualPipeV): two stages per rank "
                     "in a V, the backward split into input and weight gradients; auto: every schedule priced with "
                     "each degree, the cheapest that fits chosen.", group="pipeline",
        choices=PP_SCHEDULES)
    # solving
    solver: str = option(
        "trws", help="Solver backend of the plan (solvers.register adds one).", group="solving",
        registry="solvers:available", help_from="solvers.backends:help_text")
    time_limit: float | None = option(
        None, help="Time limit of each solve, the seeding solves included.", group="solving", kind="float", range="(0, inf)", unit="seconds",
        default_doc="the backend's")
    solver_options: Mapping[str, Any] = option(
        default_factory=dict, help="Options passed to the backend (solver, not seed_solver), e.g. max_iters=300.", group="solving", kind="table", default_doc="none")
    seed_solver: str = option(
        "highs", help="Backend of the per-axis seeding solves (exact by default: each is small).", group="solving", registry="solvers:available")

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, here
        set_(self, "replicate_axes", tuple(int(a) for a in self.replicate_axes))
        set_(self, "pp_degrees", tuple(sorted({int(d) for d in self.pp_degrees})))
        set_(self, "topology", dict(self.topology))
        set_(self, "solver_options", dict(self.solver_options))
        if self.device == DEVICE_AUTO:  # resolved by apmodel.frontend.machine before options are made
            raise OptionsError("device 'auto' prices the hardware of a live mesh: it is apmodel.parallelize's "
                               "default; planning without processes names the device (see `apmodel devices`)",
                               "device")
        if isinstance(self.mixed_precision, (tuple, list)):  # ("bf16", "fp32"): FSDP2's policy pair
            pair = tuple(self.mixed_precision)
            if len(pair) != 2 or pair[0] not in MIXED_PARAM_DTYPES or pair[1] != "fp32":
                raise OptionsError(
                    f"mixed_precision {self.mixed_precision!r}: expected (param dtype, reduce dtype) with the param "
                    f"dtype one of {', '.join(MIXED_PARAM_DTYPES)} and the reduce dtype 'fp32'", "mixed_precision"
                )
            if self.dtype not in (pair[0], PlanOptions.dtype):  # an explicit dtype that says otherwise
                raise OptionsError(f"mixed_precision {self.mixed_precision!r} computes in {pair[0]}, but dtype is "
                                   f"{_dtype_name(self.dtype)!r}: give one of them", "mixed_precision")
            set_(self, "dtype", pair[0])
            set_(self, "mixed_precision", True)
        elif self.mixed_precision is not None and not isinstance(self.mixed_precision, bool):
            raise OptionsError(f"mixed_precision {self.mixed_precision!r}: expected true, false or a pair ('bf16', 'fp32')", "mixed_precision")
        for f in dataclasses.fields(self):
            _check_field(f.name, option_spec(f.name), getattr(self, f.name))
        if self.param_memory_fraction is not None and self.param_budget_ratio is not None:
            raise OptionsError("param_memory_fraction and param_budget_ratio are two storage budgets: give one", "param_budget_ratio")

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with ``changes``; an unknown option name is an :class:`OptionsError`."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise OptionsError(f"unknown planning option {unknown[0]!r} (options: {', '.join(option_names())})")
        return dataclasses.replace(self, **changes)

    def check_mesh(self, mesh_shape: Sequence[int], label: Callable[[str], str] = str) -> None:
        """Options that name mesh axes must name axes of ``mesh_shape``; ``gpus_per_node`` must lay it
        onto nodes alike (:func:`node_layout_problem`; the default only warns). ``label`` names an
        option in the error (the CLI's flags)."""
        # a collective model object comes with its own topology (a pipeline stage's, on the full mesh's strides)
        topology_priced = self.comm_model is None or isinstance(self.comm_model, str)
        problem = node_layout_problem(mesh_shape, self.gpus_per_node) if topology_priced else None
        if problem is not None and self.gpus_per_node == default_of("gpus_per_node"):
            _warn_default_nodes(tuple(mesh_shape), self.gpus_per_node, label("gpus_per_node"))
        elif problem is not None:
            raise OptionsError(f"{label('gpus_per_node')} {self.gpus_per_node} {problem}", "gpus_per_node")
        outside = [a for a in self.replicate_axes if a >= len(mesh_shape)]
        if outside:
            raise OptionsError(f"replicate_axes {list(self.replicate_axes)} name an axis outside mesh {tuple(mesh_shape)}")
        if self.pp_axis is not None and self.pp_axis >= len(mesh_shape):
            raise OptionsError(f"pp_axis {self.pp_axis} is out of range for mesh {tuple(mesh_shape)} "
                               f"(axes 0..{len(mesh_shape) - 1})", "pp_axis")

    def seed_radius_for(self, n_axes: int) -> int:
        """The Hamming radius of the seeded search on a mesh of ``n_axes`` axes: ``seed_radius``,
        else the paper's 2 on 3 axes and ``n_axes - 1`` beyond: on 4 axes radius 2 stops above the
        unseeded optimum and radius 3 reaches it (the README's seeding table, *Benchmarks*)."""
        return self.seed_radius if self.seed_radius is not None else max(DEFAULT_SEED_RADIUS, n_axes - 1)

    def check_available(self, label: Callable[[str], str] = str) -> None:
        """Options naming a backend (``registry``) name an available one: checked before planning,
        not at construction (a backend may be registered after the options are made). ``label``
        names an option in the error (the CLI's flags)."""
        for name, spec in option_specs().items():
            if spec.registry:
                module, _, function = spec.registry.partition(":")
                available = getattr(importlib.import_module(module), function)()
                value = getattr(self, name)
                if value not in available:
                    raise OptionsError(f"{label(name)} {value!r} is not an available backend: {available}", name)

    def uses_seeding(self, n_axes: int) -> bool:
        """Whether a mesh of ``n_axes`` axes is searched seeded: ``seeding``, else on for 3+ axes."""
        return n_axes >= 3 if self.seeding is None else bool(self.seeding)

    def model_kwargs(self) -> dict[str, Any]:
        """The options the placement model takes, as its keyword arguments (the fields marked
        ``model=True``; :class:`~apmodel.problem.placement_model.PlacementModel` names them alike)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if option_spec(f.name).model}

    @property
    def run_precision(self) -> tuple[str, str] | None:
        """``(param dtype, reduce dtype)`` a lowered step runs in: parameters kept in their own
        (master) dtype are cast to the param dtype for compute (their all-gathers carry it),
        parameter gradients are cast to the reduce dtype before they are reduced. Set only when
        ``mixed_precision`` is asked for explicitly (``True`` or a pair) with a bf16/fp16 ``dtype``;
        ``None``: the step runs in the model's dtype."""
        return run_precision_of({"dtype": _dtype_name(self.dtype), "mixed_precision": self.mixed_precision})

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the pricing dtype."""
        return PRICING_DTYPE_BYTES[self.dtype] if isinstance(self.dtype, str) else int(self.dtype.itemsize)

    @property
    def device_name(self) -> str:
        return self.device if isinstance(self.device, str) else getattr(self.device, "name", str(self.device))

    def to_record(self) -> dict[str, Any]:
        """The JSON-safe record a plan file keeps (its ``workload`` beside model, batch, seq, mesh).

        Cost-model objects are recorded by class name (they cannot be rebuilt from a file); dotted
        names, paths and every plain option round-trip through :meth:`from_record`."""
        record: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "device":
                value = self.device_name
            elif f.name == "dtype":
                value = _dtype_name(value)
            elif f.name in ("compute_model", "comm_model") and value is not None and not isinstance(value, str):
                value = f"<object {type(value).__module__}.{type(value).__qualname__}>"
            elif f.name in ("input_placements", "output_placements") and value is not None:
                value = [None if p is None else str(p) for p in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            record[f.name] = value
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PlanOptions":
        """The options a plan file recorded (keys of other kinds, e.g. ``model``, are ignored).

        Plans saved before this record existed keep their meaning: keys of earlier versions
        (:data:`OLD_RECORD_KEYS`: ``memory_limit_GB``, 1e9 bytes) are read with a logged warning,
        a plan without ``bucket_mb`` was priced with every collective alone (0), one without
        ``overlap`` serially, and other missing keys take today's defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in names and v is not None}
        for key, old in OLD_RECORD_KEYS.items():
            if record.get(key) is not None and old.option not in values:
                logger.warning("the plan file's workload key %r is read as %r (its name since; %s)", key,
                               old.option, old.note or "same value")
                values[old.option] = old.convert(record[key])
        if "bucket_mb" not in record:  # a plan from before bucket pricing: every collective priced alone
            values["bucket_mb"] = 0.0
        if "overlap" not in record:  # a plan from before overlap pricing: priced and run serially
            values["overlap"] = False
        for key in ("compute_model", "comm_model"):
            if isinstance(values.get(key), str) and values[key].startswith("<object "):
                raise OptionsError(f"the plan was priced with a {key} object ({values[key][8:-1]}) that a plan file "
                                   f"cannot rebuild; pass it again")
        for key in ("input_placements", "output_placements"):
            values.pop(key, None)  # recorded for reading; placement objects are not rebuilt from text
        return cls(**values)


def _check_field(name: str, spec: OptionSpec, value: Any) -> None:
    """The checks a spec implies on a field's value as the Python API gives it (allowed values,
    ranges, sub-keys); the surfaces check types too (:meth:`OptionSpec.read`)."""
    if value is None:
        return
    if spec.choices and (isinstance(value, str) or not spec.python) and value not in spec.choices:
        raise OptionsError(f"{name} {value!r}: expected one of {', '.join(spec.choices)}", name)
    if spec.kind in ("int", "float") and spec.range:
        if not is_number(value) or not spec.in_range(value):
            raise OptionsError(f"{name} must be {spec.what()}, got {value!r}", name)
    if spec.kind == "ints" and spec.range and not all(is_number(a) and spec.in_range(a) for a in value):
        raise OptionsError(f"{name} {list(value)}: expected {spec.what()}", name)
    if spec.kind == "keys":
        unknown = sorted(set(value) - set(spec.keys))
        if unknown:
            raise OptionsError(f"{name} key {unknown[0]!r} is not one of {', '.join(spec.keys)}", name)
        for key, v in value.items():
            try:
                spec.keys[key].read(v)
            except BadValue as e:
                raise OptionsError(f"{name} key {key!r} must be {e.what}, got {v!r}", name) from None


# ------------------------------------------------------------------------------- lookups
def option_names() -> list[str]:
    """Names of every planning option (the keyword arguments ``apmodel.plan`` accepts)."""
    return [f.name for f in dataclasses.fields(PlanOptions)]


@functools.lru_cache(maxsize=None)
def option_spec(name: str) -> OptionSpec:
    """The declaration of option ``name``, bound to it (``spec.name``: its TOML key and flag)."""
    for f in dataclasses.fields(PlanOptions):
        if f.name == name:
            spec = spec_of(f)
            if not isinstance(spec, OptionSpec):
                raise TypeError(f"PlanOptions.{name} has no option(...) declaration")
            return dataclasses.replace(spec, name=name)
    raise OptionsError(f"unknown planning option {name!r} (options: {', '.join(option_names())})")


def option_specs() -> dict[str, OptionSpec]:
    """Every option's declaration, in field order."""
    return {f.name: option_spec(f.name) for f in dataclasses.fields(PlanOptions)}


def default_of(name: str) -> Any:
    """The default of option ``name`` (its field's)."""
    f = next(f for f in dataclasses.fields(PlanOptions) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def toml_keys() -> dict[tuple[str, str], tuple[str, str | None, OptionSpec]]:
    """``(section, key) -> (field, None, spec)`` of every TOML key an option takes: its group and name."""
    return {(spec.section, spec.key): (name, None, spec) for name, spec in option_specs().items()}


def make_options(options: PlanOptions | None = None, **changes: Any) -> PlanOptions:
    """``options`` (default: all defaults) with ``changes``; unknown names are named in the error,
    old ones (:data:`OLD_KEYWORDS`) taken with a ``DeprecationWarning``."""
    changes = renamed_keywords(changes)
    return (options or PlanOptions()).replace(**changes) if changes else (options or PlanOptions())


# ------------------------------------------------------------------------------- old names
@dataclass(frozen=True)
class OldName:
    """A spelling of an option in an earlier version, still read with a warning naming the new one.

    ``option``: the field; ``sub``: a sub-key of a ``keys`` option (the old ``[topology]`` section
    held the topology's keys directly); ``scale``: an old value times it is the field's (the old
    ``memory_limit_GB`` took 1e9 bytes); ``note``: what the warning adds."""

    option: str
    sub: str | None = None
    scale: float = 1.0
    note: str = ""

    def convert(self, value: Any) -> Any:
        return value * self.scale if self.scale != 1.0 and is_number(value) else value

    def new_toml(self) -> str:
        spec = option_spec(self.option)
        return f"{spec.toml}.{self.sub}" if self.sub else spec.toml


_GB = "GB then, bytes now: 70 GB is 7e10"
#: TOML keys (``section.key``) of earlier versions: sections by kind of setting, before the
#: sections became the options' groups and the keys their names.
OLD_TOML_KEYS: Mapping[str, OldName] = {
    "device.name": OldName("device"), "device.dtype": OldName("dtype"),
    "device.mixed_precision": OldName("mixed_precision"), "device.execution": OldName("execution"),
    "topology.gpus_per_node": OldName("gpus_per_node"),
    **{f"topology.{k}": OldName("topology", sub=k) for k in TOPOLOGY_KEYS},
    **{f"cost.{k}": OldName(k) for k in ("compute_model", "comm_model", "compute_profile", "calibration", "overlap",
                                         "inflight_mb")},
    "cost.bucket_MB": OldName("bucket_mb"),
    "planner.optimizer": OldName("optimizer"), "planner.ac": OldName("ac"),
    "planner.memory_limit_GB": OldName("memory_limit_bytes", scale=1e9, note=_GB),
    **{f"planner.{k}": OldName(k) for k in ("param_policy", "replicate_axes", "param_memory_fraction",
                                            "param_budget_ratio", "merge_copies", "flow_coupling", "seeding",
                                            "seed_radius", "seed_widen_inputs", "input_placements",
                                            "output_placements")},
    "pipeline.axis": OldName("pp_axis"), "pipeline.degrees": OldName("pp_degrees"),
    "pipeline.schedule": OldName("pp_schedule"),
    "solver.backend": OldName("solver"), "solver.time_limit": OldName("time_limit"),
    "solver.options": OldName("solver_options"), "solver.seed_backend": OldName("seed_solver"),
}
#: Flags of earlier versions (``apmodel plan``): hidden, read with a warning.
OLD_FLAGS: Mapping[str, OldName] = {
    "--memory-limit-gb": OldName("memory_limit_bytes", scale=1e9, note=_GB),
    "--replicate-axis": OldName("replicate_axes"), "--input-placement": OldName("input_placements"),
    "--output-placement": OldName("output_placements"), "--solver-option": OldName("solver_options"),
}
#: Keyword arguments of earlier versions (``apmodel.plan(memory_limit=)``, ``parallelize(bucket_cap_mb=)``,
#: ``parallelize_pipeline(schedule=)``).
OLD_KEYWORDS: Mapping[str, OldName] = {
    "memory_limit": OldName("memory_limit_bytes"), "bucket_cap_mb": OldName("bucket_mb"),
    "schedule": OldName("pp_schedule"),
}
#: Keys of a plan file's ``workload`` record of earlier versions (:meth:`PlanOptions.from_record`).
OLD_RECORD_KEYS: Mapping[str, OldName] = {"memory_limit_GB": OldName("memory_limit_bytes", scale=1e9, note=_GB)}


def renamed_keywords(values: Mapping[str, Any], stacklevel: int = 4) -> dict[str, Any]:
    """``values`` (option keywords) with the names of earlier versions (:data:`OLD_KEYWORDS`)
    replaced by the options' names, each with a ``DeprecationWarning`` naming the new one; both
    spellings of one option is an :class:`OptionsError`."""
    out = dict(values)
    for old, new in OLD_KEYWORDS.items():
        if old not in out:
            continue
        if new.option in out:
            raise OptionsError(f"{old}= and {new.option}= are one option: give {new.option}=", new.option)
        warnings.warn(f"the keyword {old}= is deprecated: use {new.option}=", DeprecationWarning, stacklevel=stacklevel)
        out[new.option] = new.convert(out.pop(old))
    return out


# ------------------------------------------------------------------------------- the docs
def default_text(name: str, spec: OptionSpec) -> str:
    """The README's default: the field's, or what an empty one means (``default_doc``)."""
    value = default_of(name)
    if value is None or value == {} or value == ():
        return spec.default_doc or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _values_text(spec: OptionSpec) -> str:
    """The README's values: the choices, else what a value must be."""
    if spec.choices:
        return ", ".join(f"`{c}`" for c in spec.choices)
    return spec.what(quote=False)


def options_table() -> str:
    """The README's options table (Markdown), one table per group: every option with its Python
    keyword, flag, TOML key, default, values and what it does."""
    specs = option_specs()
    lines: list[str] = []
    for group, title in GROUPS.items():
        lines += ["", f"**{title}**", "",
                  "| option (Python) | flag | TOML key | default | values | what it does |",
                  "|---|---|---|---|---|---|"]
        for name, spec in specs.items():
            if spec.group != group:
                continue
            values = _values_text(spec) + (f"; in Python also {spec.python[3:]}" if spec.python.startswith("or ")
                                           else f"; {spec.python}" if spec.python else "")
            cells = [f"`{name}`", f"`{spec.flag_text()}`", ", ".join(f"`{k}`" for k in spec.toml_text().split(", ")),
                     default_text(name, spec), values, spec.help]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines[1:]) + "\n"


#: The markers around the generated table in README.md.
TABLE_START, TABLE_END = "<!-- options-table:start -->", "<!-- options-table:end -->"


def with_options_table(readme: str) -> str:
    """``readme`` with the text between :data:`TABLE_START` and :data:`TABLE_END` regenerated."""
    start, end = readme.find(TABLE_START), readme.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {TABLE_START} ... {TABLE_END} block")
    return readme[: start + len(TABLE_START)] + "\n" + options_table() + readme[end:]

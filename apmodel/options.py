"""Every option of a planning run in one frozen object, with its defaults in one place.

:class:`PlanOptions` holds what the planner searches over (parameter storage policy, replicated
axes, seeding), how it prices a plan (device, topology, pricing dtype, mixed precision, cost
models, calibration, compute profile, execution mode, optimizer, memory limit) and how it solves
(backend, time limit, backend options). The Python API, the CLI (through the TOML configuration
and its flags), the recipes and the benchmarks all build one, and a plan file records it as its
``workload`` (:meth:`PlanOptions.to_record`), from which ``apmodel explain`` and ``apmodel report``
rebuild the model (:meth:`PlanOptions.from_record`).

This module imports no torch: the CLI validates options before the slow imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

ParamPolicy = Literal["full_shard", "free"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd-nomomentum", "none"]
#: Activation checkpointing policies (:mod:`apmodel.checkpointing`).
ACPolicy = Literal["none", "selective", "full"]
Execution = Literal["eager", "graphs"]
PricingDtype = Literal["bf16", "fp16", "fp32", "fp8"]

PARAM_POLICIES: tuple[str, ...] = get_args(ParamPolicy)
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

#: Topology keys a configuration may override (``costmodels.Topology`` keyword arguments).
TOPOLOGY_KEYS = ("intra_GBps", "inter_GBps", "intra_latency_us", "inter_latency_us", "nvls")

#: Hamming radius of split-dimension seeding (:mod:`apmodel.seeding`); the AutoParallel paper's
#: default (§4.3, r = 2).
DEFAULT_SEED_RADIUS = 2


#: Param dtypes a mixed-precision step can compute in (the reduce dtype is always fp32).
MIXED_PARAM_DTYPES = ("bf16", "fp16")


def _dtype_name(dtype: Any) -> str:
    """A pricing dtype as a plan file records it: the option's name, or a torch dtype's name
    without the ``torch.`` prefix (``"bfloat16"``)."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def run_precision_of(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """:attr:`PlanOptions.run_precision` of a plan file's ``workload`` record."""
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(record.get("dtype"), record.get("dtype"))  # torch names
    if record.get("mixed_precision") is True and dtype in MIXED_PARAM_DTYPES:
        return (str(dtype), "fp32")
    return None


class OptionsError(ValueError):
    """An option has a value the planner cannot use; the message names the option, and so does
    ``option`` (the :class:`PlanOptions` field), for front ends that call it something else."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class PlanOptions:
    """What to search, how to price and how to solve; every field has its default here.

    Pricing:
        device: target accelerator (a ``costmodels.device`` name or a ``DeviceSpec``).
        gpus_per_node: devices per node: which mesh axes cross the network.
        dtype: pricing dtype of compute and parameter gathers.
        mixed_precision: fp32 master parameters, gradients, optimizer state and gradient
            reductions beside ``dtype`` compute. ``None`` (default): priced so for bf16/fp16, and
            :func:`apmodel.parallelize` runs the step in the model's own dtype; ``True`` or a
            pair ``(param dtype, reduce dtype)`` such as ``("bf16", "fp32")`` (which sets
            ``dtype``): priced so and run so (see :attr:`run_precision`); ``False``: off.
        compute_model / comm_model: replacements (an object, or ``"package.module:Name"``
            constructed with the device spec / topology); ``None``: the device's defaults.
        compute_profile: a compute profile JSON (``apmodel calibrate-compute``) for the
            measured compute model.
        execution: ``"eager"`` or ``"graphs"`` (CUDA-graph replay: no launch cost per op).
        calibration: a collective calibration JSON (``apmodel calibrate``).
        topology: overrides of the topology (:data:`TOPOLOGY_KEYS`).
        optimizer: optimizer state in the memory model.
        ac: activation checkpointing: ``"none"``, ``"selective"`` (matmul and attention outputs
            saved, the rest of each layer recomputed in backward) or ``"full"`` (each layer
            recomputed from its input); the recomputation is priced, the saved activations shrink
            (:mod:`apmodel.checkpointing`).
        memory_limit_bytes: per-device memory limit (``None``: the device's HBM less a reserve;
            ``math.inf``: no limit).

    Search space:
        param_policy: ``"full_shard"`` (parameters stored fully sharded) or ``"free"``.
        replicate_axes: mesh axes on which parameters stay replicated (HSDP).
        param_memory_fraction: per-device parameter budget, a fraction of the model's bytes.
        param_budget_ratio: the paper's storage budget ``high``: the average local/global ratio
            over parameter tensors (Appendix C); instead of ``param_policy``.
        merge_copies / flow_coupling: model reductions (see :class:`~apmodel.placement_model.PlacementModel`).
        seeding: split-dimension seeding (``None``: on for meshes of 3+ axes), ``seed_radius``
            (``None``: :meth:`seed_radius_for` the mesh), ``seed_widen_inputs`` (see
            :mod:`apmodel.seeding`).
        input_placements / output_placements: fixed placements of the step's inputs / outputs.

    Solving:
        solver: a backend of ``solvers.available()``; ``time_limit`` (s); ``solver_options``.
    """

    # pricing
    device: Any = "h100"
    gpus_per_node: int = 8
    dtype: PricingDtype | Any = "bf16"
    mixed_precision: bool | tuple[str, str] | None = None
    compute_model: Any = None
    comm_model: Any = None
    compute_profile: str | None = None
    execution: Execution = "eager"
    calibration: str | None = None
    topology: Mapping[str, Any] = field(default_factory=dict)
    optimizer: Optimizer = "adamw"
    ac: ACPolicy = "none"
    memory_limit_bytes: float | None = None
    # search space
    param_policy: ParamPolicy = "full_shard"
    replicate_axes: tuple[int, ...] = ()
    param_memory_fraction: float | None = None
    param_budget_ratio: float | None = None
    merge_copies: bool = True
    flow_coupling: bool = True
    seeding: bool | None = None
    seed_radius: int | None = None
    seed_widen_inputs: bool = False
    input_placements: Sequence[Any] | None = None
    output_placements: Sequence[Any] | None = None
    # solving
    solver: str = "trws"
    time_limit: float | None = None
    solver_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, here
        set_(self, "replicate_axes", tuple(int(a) for a in self.replicate_axes))
        set_(self, "topology", dict(self.topology))
        set_(self, "solver_options", dict(self.solver_options))
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
        if self.param_policy not in PARAM_POLICIES:
            raise OptionsError(f"param_policy {self.param_policy!r}: expected one of {', '.join(PARAM_POLICIES)}", "param_policy")
        if self.ac not in AC_POLICIES:
            raise OptionsError(f"ac {self.ac!r}: expected one of {', '.join(AC_POLICIES)}", "ac")
        if self.optimizer not in OPTIMIZERS:
            raise OptionsError(f"optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}", "optimizer")
        if self.execution not in EXECUTIONS:
            raise OptionsError(f"execution {self.execution!r}: expected one of {', '.join(EXECUTIONS)}", "execution")
        if isinstance(self.dtype, str) and self.dtype not in PRICING_DTYPES:
            raise OptionsError(f"dtype {self.dtype!r} is not one of {sorted(PRICING_DTYPES)}", "dtype")
        if self.seed_radius is not None and self.seed_radius < 0:
            raise OptionsError(f"seed_radius must be >= 0, got {self.seed_radius!r}", "seed_radius")
        if any(a < 0 for a in self.replicate_axes):
            raise OptionsError(f"replicate_axes {list(self.replicate_axes)}: mesh axes are >= 0", "replicate_axes")
        if self.memory_limit_bytes is not None and not self.memory_limit_bytes > 0:
            raise OptionsError(f"memory_limit must be a positive number of bytes, got {self.memory_limit_bytes!r}", "memory_limit_bytes")
        for name in ("param_memory_fraction", "param_budget_ratio"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise OptionsError(f"{name} must be in (0, 1], got {value!r}", name)
        if self.param_memory_fraction is not None and self.param_budget_ratio is not None:
            raise OptionsError("param_memory_fraction and param_budget_ratio are two storage budgets: give one", "param_budget_ratio")
        if self.time_limit is not None and not 0 < self.time_limit < math.inf:
            raise OptionsError(f"time_limit must be a finite number of seconds > 0, got {self.time_limit!r}", "time_limit")
        if self.gpus_per_node < 1:
            raise OptionsError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}", "gpus_per_node")
        unknown = sorted(set(self.topology) - set(TOPOLOGY_KEYS))
        if unknown:
            raise OptionsError(f"topology key {unknown[0]!r} is not one of {', '.join(TOPOLOGY_KEYS)}", "topology")

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with ``changes``; an unknown option name is an :class:`OptionsError`."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise OptionsError(f"unknown planning option {unknown[0]!r} (options: {', '.join(option_names())})")
        return dataclasses.replace(self, **changes)

    def check_mesh(self, mesh_shape: Sequence[int]) -> None:
        """Options that name mesh axes must name axes of ``mesh_shape``."""
        outside = [a for a in self.replicate_axes if a >= len(mesh_shape)]
        if outside:
            raise OptionsError(f"replicate_axes {list(self.replicate_axes)} name an axis outside mesh {tuple(mesh_shape)}")

    def seed_radius_for(self, n_axes: int) -> int:
        """The Hamming radius of the seeded search on a mesh of ``n_axes`` axes: ``seed_radius``,
        else the paper's 2 on 3 axes and ``n_axes - 1`` beyond. Measured on LLaMA-3 8B, mesh
        (2,2,2,4), seq 2048, batch 8: radius 2 stops 2.5% above the unseeded optimum (214.1K vs
        209.0K µs), radius 3 reaches it in 55 s end to end, against 140 s for the whole space (2 cores)."""
        return self.seed_radius if self.seed_radius is not None else max(DEFAULT_SEED_RADIUS, n_axes - 1)

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

        Plans saved before this record existed keep their meaning: ``memory_limit_GB`` (1e9
        bytes) and missing keys take today's defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in names and v is not None}
        if "memory_limit_GB" in record and record["memory_limit_GB"] is not None and "memory_limit_bytes" not in values:
            values["memory_limit_bytes"] = float(record["memory_limit_GB"]) * 1e9
        for key in ("compute_model", "comm_model"):
            if isinstance(values.get(key), str) and values[key].startswith("<object "):
                raise OptionsError(f"the plan was priced with a {key} object ({values[key][8:-1]}) that a plan file "
                                   f"cannot rebuild; pass it again")
        for key in ("input_placements", "output_placements"):
            values.pop(key, None)  # recorded for reading; placement objects are not rebuilt from text
        return cls(**values)


def option_names() -> list[str]:
    """Names of every planning option (the keyword arguments ``apmodel.plan`` accepts)."""
    return [f.name for f in dataclasses.fields(PlanOptions)]


def make_options(options: PlanOptions | None = None, **changes: Any) -> PlanOptions:
    """``options`` (default: all defaults) with ``changes``; unknown names are named in the error."""
    return (options or PlanOptions()).replace(**changes) if changes else (options or PlanOptions())

"""The hardware a live mesh runs on, as planning options: what ``parallelize(device="auto")``
prices (its default).

* CUDA meshes: the GPU's name mapped to a device spec (:data:`costmodels.kernel_timing.CUDA_DEVICE_NAMES`;
  an unknown GPU is priced as :data:`FALLBACK_GPU`, with a warning naming it), GPUs per node from
  the launcher (``LOCAL_WORLD_SIZE``) or the visible devices.
* CPU meshes (gloo): the ``cpu`` device spec at fp32, its collective model corrected by collectives
  timed now on each mesh axis's live process group (every rank takes part; nccl-tests' method,
  :func:`costmodels.collective_timing.time_collectives`), and its compute model fitted once per
  machine to kernels timed on this process's thread count while the host's other processes time
  them too (a step's conditions: every process computing at once), cached on disk.

The cache is :func:`cache_dir`: ``$APMODEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/apmodel``, else
``~/.cache/apmodel``; deleting the directory (or a file in it) clears it, and the next
``parallelize`` measures again. Only the planning rank (the mesh's first) fits and writes; the
other ranks time collectives and kernels with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from apmodel.core.options import default_of

logger = logging.getLogger(__name__)

#: The device spec an unrecognised GPU is priced as (a warning names the GPU).
FALLBACK_GPU = "h100"
#: Environment variable naming the cache directory (compute profiles, collective timings).
CACHE_ENV = "APMODEL_CACHE_DIR"
#: Message sizes the CPU collectives are timed at, bytes: 4 B (a loss's all-reduce) to 16 MiB in
#: factors of 4, so that a small model's collectives fall inside the measured range.
TIMED_SIZES_BYTES = tuple(4 * 4**i for i in range(12))
#: Compute every rank runs before each timed collective, µs (``time_collectives(busy_us=...)``):
#: a step's collectives follow compute, and the ranks arrive apart. Measured on 2 gloo processes
#: (docs/design.md, *Calibrated as a step runs*), a 1 MiB all-gather took about 1.5 ms more after
#: 1, 4 or 16 ms of compute than back to back, not growing with the compute: 4 ms is inside that range.
STEP_GAP_US = 4000.0


@dataclass(frozen=True)
class Machine:
    """What a live mesh runs on, as planning option values, and that in words for the plan file."""

    options: dict[str, Any]
    """option values (``device``, ``gpus_per_node``, and on CPUs ``dtype``, ``calibration``, ``compute_profile``)"""
    description: str


def cache_dir() -> Path:
    """Where measured profiles are kept (see the module's docstring); created on first use."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "apmodel"
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"device='auto' keeps measured profiles in {path}, which cannot be created ({e.strerror}): "
                      f"set {CACHE_ENV} to a writable directory, or pass device= explicitly") from e
    return path


def _write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file, so that a concurrent reader never sees half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def _local_world_size(default: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else default


def _is_planner(mesh: DeviceMesh) -> bool:
    """Whether this process is the rank that plans (the mesh's first, as :func:`plan_on_one_rank`)."""
    return not dist.is_initialized() or dist.get_rank() == int(mesh.mesh.flatten()[0])


def detect(mesh: DeviceMesh, given: dict[str, Any]) -> Machine:
    """The options pricing ``mesh``'s hardware; ``given`` (the caller's option values) win over
    what is detected. Call on every rank of the mesh (CPU meshes time collectives on all). A mesh
    made for planning, without process groups, has no hardware to look at: it is priced as
    :func:`apmodel.plan` prices by default."""
    if not dist.is_initialized():
        device = default_of("device")
        return Machine({"device": device} | given, f"{device}, the default (no process group to measure)")
    if mesh.device_type == "cuda":
        return _gpu(given)
    if mesh.device_type == "cpu":
        return _cpu(mesh, given)
    logger.warning("device='auto': no device spec for mesh device type %r; pricing %s", mesh.device_type, FALLBACK_GPU)
    return Machine({"device": FALLBACK_GPU} | given,
                   f"{FALLBACK_GPU} (mesh device type {mesh.device_type!r} not recognised)")


def _gpu(given: dict[str, Any]) -> Machine:
    from costmodels.kernel_timing import CUDA_DEVICE_NAMES

    name = torch.cuda.get_device_name()
    device = next((spec for key, spec in CUDA_DEVICE_NAMES if key in name), None)
    if device is None:
        logger.warning("device='auto': no device spec for GPU %r; pricing it as %s (pass device= to choose; "
                       "`apmodel devices` lists them)", name, FALLBACK_GPU)
        device = FALLBACK_GPU
    per_node = _local_world_size(torch.cuda.device_count())
    options = {"device": device, "gpus_per_node": per_node}
    return Machine(options | given, f"{name} as {device}, {per_node} GPUs per node")


def _cpu(mesh: DeviceMesh, given: dict[str, Any]) -> Machine:
    from costmodels.calibration import Calibration
    from costmodels.collective_timing import time_collectives

    world = mesh.size()
    options: dict[str, Any] = {"device": "cpu", "gpus_per_node": _local_world_size(world)}
    if not given.get("mixed_precision"):  # CPU programs run in fp32 unless a mixed-precision policy is asked for
        options["dtype"] = "fp32"
    options |= given
    notes = [f"CPU processes ({world} ranks, {torch.get_num_threads()} thread(s) each)"]
    shape = "x".join(map(str, mesh.shape))
    communicating = [axis for axis in range(mesh.ndim) if mesh.shape[axis] > 1]  # an axis of one rank sends nothing
    if "calibration" not in given and communicating:
        logger.info("device='auto': timing collectives on each axis of the %s mesh", shape)
        logs = [(log, axis) for axis in communicating
                for log in time_collectives(mesh.get_group(axis), sizes_bytes=TIMED_SIZES_BYTES, busy_us=STEP_GAP_US)]
        path = cache_dir() / f"collectives-{platform.node() or 'host'}-{shape}.json"
        if _is_planner(mesh):
            fitted = Calibration.fit(_base_comm_model(mesh, options), logs)
            _write_atomically(path, json.dumps(fitted.to_json(), indent=1))
        options["calibration"] = str(path)
        notes.append("collectives timed on the live process groups")
    if "compute_profile" not in given:
        host_processes = _local_world_size(world)
        path = compute_profile_path(host_processes)
        if not path.exists():
            # every process of the host times the kernels at once (a step's conditions: all of them
            # computing); the planning rank fits and writes
            from costmodels.fitting import calibrate_compute, load_like_calibration

            threads = torch.get_num_threads()
            if _is_planner(mesh):
                logger.info("device='auto': fitting the CPU compute model (once per machine, %d processes timing "
                            "together) into %s", host_processes, path)
                _write_atomically(path, calibrate_compute(quick=True, threads=threads,
                                                          host_processes=host_processes).profile.dumps())
            else:
                load_like_calibration(quick=True, threads=threads)
        options["compute_profile"] = str(path)
        notes.append(f"compute profile {path.name}")
    return Machine(options, ", ".join(notes))


def compute_profile_path(host_processes: int = 1) -> Path:
    """The cached CPU compute profile of this machine at this process's thread count and torch,
    timed with ``host_processes`` processes computing at once."""
    from costmodels.kernel_timing import describe_device

    threads = torch.get_num_threads()
    key = f"{describe_device(torch.device('cpu'))}|{threads}|{host_processes}|{torch.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / f"compute-cpu-{threads}t-{host_processes}p-{digest}.json"


def _base_comm_model(mesh: DeviceMesh, options: dict[str, Any]) -> Any:
    """The uncalibrated collective model of the CPU device on ``mesh``'s shape (what the timings correct)."""
    from apmodel.core.options import PlanOptions
    from apmodel.problem.pricing import build_cost_context  # lazy: the cost models are heavy to import

    plain = {k: v for k, v in options.items() if k in ("device", "gpus_per_node", "topology")}
    return build_cost_context(tuple(mesh.shape), PlanOptions(**plain)).comm.model

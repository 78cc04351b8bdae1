"""Accelerator specifications and a registry of them.

Units are in the field names:

* ``*_tflops``  dense (no structured sparsity) throughput, 1 TFLOP/s = 1e12 FLOP/s
* ``hbm_TBps``  memory bandwidth, 1 TB/s = 1e12 B/s (decimal, as NVIDIA quotes it)
* ``hbm_GiB``   memory capacity, 1 GiB = 2**30 B. NVIDIA's "80GB"/"141GB"/"180GB" HBM
  capacities are binary in practice (``nvidia-smi`` reports 81,559 MiB for an H100 80GB),
  so we store them as GiB.
* ``*_GBps``    link bandwidth per GPU per direction, 1 GB/s = 1e9 B/s. NVIDIA quotes NVLink
  as the bidirectional total ("900 GB/s" for NVLink 4); we store half of it.
* ``*_us``      microseconds.

Every figure names its source. Figures that no datasheet gives (kernel launch floor,
achievable fractions of peak) are named constants below, labelled as assumptions to
calibrate.

There is no module-level mutable state: :data:`BUILTIN_DEVICES` is a read-only mapping and
user devices live in :class:`DeviceRegistry` objects.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------
# Achievable fractions of peak (assumptions; recalibrate per cluster)
# ----------------------------------------------------------------------------------------
#: Fraction of dense tensor-core peak a large, well-shaped cuBLAS GEMM reaches. Public
#: H100 SXM bf16 GEMM measurements reach ~650-750 of 989 TFLOP/s; we take 0.70.
MATMUL_EFFICIENCY = 0.70
#: Fraction of HBM peak that a streaming elementwise kernel reaches (STREAM-like copies
#: on H100/A100 reach ~85-90% of the datasheet bandwidth); we take 0.85.
MEMORY_EFFICIENCY = 0.85
#: Minimum time of one CUDA kernel (launch + ramp), µs. Order of magnitude of the
#: back-to-back kernel gap on recent NVIDIA GPUs; not a datasheet figure.
GPU_LAUNCH_FLOOR_US = 2.0
#: Minimum time of one operator on a CPU (dispatcher overhead of an eager ATen op), µs.
CPU_LAUNCH_FLOOR_US = 5.0
#: Share of a hidden collective's time the computation still loses to it on a GPU: NCCL's kernels
#: take a few SMs and some HBM bandwidth from the matmuls they run beside (a few per cent in
#: overlapped FSDP and TP traces); taken as 0.05.
GPU_OVERLAP_SLOWDOWN = 0.05
#: The same on CPU processes over gloo: the collective's copies, reductions and socket transfers run
#: on the cores the computation uses. Measured on a 2-core host (torch 2.13, one intra-op thread per
#: process): all-gathers, reduce-scatters and all-reduces of 256 KiB issued ahead of matmuls on 2
#: and 4 gloo processes hid 0.26-0.38 of their serial time (serial 24.3-51.7 ms, overlapped
#: 20.5-47.3 ms, computation alone 12.6-34.8 ms a round): taken as 0.65.
CPU_OVERLAP_SLOWDOWN = 0.65
#: Host blocks at least this large (bytes) are fresh pages on every allocation with glibc's malloc,
#: PyTorch's CPU allocator underneath: blocks from the mmap threshold up are mmapped and unmapped on
#: free, and the dynamic threshold stops rising at DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1024 * 1024 *
#: sizeof(long) = 32 MiB on 64-bit (glibc malloc/malloc.c; mallopt(3), M_MMAP_THRESHOLD). Below it a
#: training loop's blocks come from the heap after its first step (costmodels.kernel_timing.
#: HOST_ALLOCATOR_WARM_BYTES warms the measurements the same way).
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20
#: Rate (GB/s) at which the kernel hands a CPU process fresh zeroed pages on first touch. Measured
#: on the 2-core development host (torch 2.13, one thread): torch.zeros of 32 and 64 MiB took 11.67
#: and 23.59 ms against 0.36 ms for 16 MiB (heap blocks), and 0.82 / 1.69 ms with MALLOC_MMAP_MAX_=0
#: (no mmapped blocks): ~10.9 ms per 32 MiB of page faults, 3.1 GB/s.
CPU_FRESH_PAGES_GBPS = 3.1

#: Ring (Simple protocol) bus bandwidth as a fraction of the NVLink line rate.
#: H100: nccl-tests reach ~370 GB/s bus bandwidth on 450 GB/s NVLink 4 (docs/design.md,
#: "Published figures"): 370 / 450 = 0.82.
RING_EFFICIENCY_HOPPER = 370.0 / 450.0
#: A100: NCCL's own tuning model caps sm80 bus bandwidth at 235 GB/s (NCCL tuning.cc,
#: "if (compCap80) busBw = std::min(busBw, 235.0f)"); NVLink 3 is 300 GB/s per direction.
RING_EFFICIENCY_AMPERE = 235.0 / 300.0
#: Inter-node (InfiniBand / RoCE) achievable fraction of NIC line rate for NCCL's rings and
#: trees, fitted with the collectives' measured constants (costmodels.collectives.MeasuredNccl)
#: to the 2- and 4-node logs in tests/data/nccl_published/ (0.79; a raw ib_write_bw reaches
#: ~0.92 of a 400 Gb/s ConnectX-7, which NCCL's protocol overheads do not).
NET_EFFICIENCY = 0.79
#: What the collective model assumed before the fit: ib_write_bw on a 400 Gb/s ConnectX-7 reaches
#: ~46 of 50 GB/s.
RAW_NIC_EFFICIENCY = 0.92


@dataclass(frozen=True)
class FabricSpec:
    """Intra-node GPU-to-GPU fabric of one accelerator model.

    ``GBps`` is the per-GPU bandwidth in one direction (1 GB/s = 1e9 B/s).
    ``kind`` is "nvswitch" (all-to-all NVLink through switches), "nvlink" (direct links),
    "pcie" or "shm" (host shared memory, for CPU meshes). ``nvls`` says whether NVLink
    SHARP (in-switch reductions, NVSwitch gen 3+) is available. ``ring_efficiency`` is the
    ring/Simple bus bandwidth as a fraction of ``GBps``.
    """

    kind: str
    GBps: float
    nvlink_gen: int | None = None
    nvls: bool = False
    ring_efficiency: float = RING_EFFICIENCY_HOPPER
    extra_latency_us: float = 0.0


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model. See the module docstring for units."""

    name: str
    #: dense peak by dtype key ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64"); tensor cores
    #: for fp8/bf16/fp16/tf32; "fp32" is the non-tensor (CUDA-core) rate.
    peak_tflops: Mapping[str, float]
    hbm_TBps: float
    hbm_GiB: float
    fabric: FabricSpec
    #: inter-node NIC bandwidth per GPU, one direction (1 GB/s = 1e9 B/s)
    nic_GBps: float = 50.0
    #: extra inter-node latency per hop on top of NCCL's network latency table, µs
    nic_latency_us: float = 0.0
    launch_floor_us: float = GPU_LAUNCH_FLOOR_US
    matmul_efficiency: float = MATMUL_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    #: NCCL generation used to pick NCCL's per-architecture caps: "ampere", "hopper",
    #: "blackwell", or "cpu" (no NCCL; a host-memory collective library)
    arch: str = "hopper"
    #: fraction of a collective's time that the computation still loses while the collective
    #: runs behind it (see costmodels.overlap.simulate)
    overlap_slowdown: float = GPU_OVERLAP_SLOWDOWN
    #: outputs of at least this many bytes get fresh pages on every allocation (a host allocator
    #: that maps and unmaps large blocks); None: a caching allocator, as PyTorch's CUDA one
    fresh_pages_from_bytes: int | None = None
    #: rate of those fresh pages' first touch, GB/s (used when ``fresh_pages_from_bytes`` is set)
    fresh_pages_GBps: float = CPU_FRESH_PAGES_GBPS

    def fresh_pages_us(self, nbytes: float) -> float:
        """Time (µs) the first touch of a freshly allocated block of ``nbytes`` costs: 0 below
        ``fresh_pages_from_bytes`` (or without it), else ``nbytes`` at ``fresh_pages_GBps``."""
        if self.fresh_pages_from_bytes is None or nbytes < self.fresh_pages_from_bytes:
            return 0.0
        return nbytes / (self.fresh_pages_GBps * 1e3)

    def __post_init__(self) -> None:
        if not self.peak_tflops:
            raise ValueError(f"device {self.name!r}: peak_tflops is empty")
        for k, v in self.peak_tflops.items():
            if not (v > 0):
                raise ValueError(f"device {self.name!r}: peak_tflops[{k!r}] must be > 0, got {v}")
        for f in ("hbm_TBps", "hbm_GiB", "nic_GBps"):
            if not (getattr(self, f) > 0):
                raise ValueError(f"device {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if not 0 <= self.overlap_slowdown <= 1:
            raise ValueError(f"device {self.name!r}: overlap_slowdown must lie in [0, 1], got {self.overlap_slowdown}")
        if not self.fresh_pages_GBps > 0:
            raise ValueError(f"device {self.name!r}: fresh_pages_GBps must be > 0, got {self.fresh_pages_GBps}")
        if not (0 < self.matmul_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ValueError(f"device {self.name!r}: efficiencies must lie in (0, 1]")
        # freeze the mapping so that a DeviceSpec cannot be mutated through it
        object.__setattr__(self, "peak_tflops", MappingProxyType(dict(self.peak_tflops)))

    def __hash__(self) -> int:  # the peak table is a mapping; hash its items
        return hash((self.name, tuple(sorted(self.peak_tflops.items())), self.hbm_TBps,
                     self.hbm_GiB, self.fabric, self.nic_GBps, self.launch_floor_us))

    # --- derived, in SI units -----------------------------------------------------------
    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_TBps * 1e12

    @property
    def hbm_capacity_bytes(self) -> int:
        return int(self.hbm_GiB * 2**30)

    def peak_flops(self, dtype_key: str) -> float:
        """Dense peak in FLOP/s for a dtype key; falls back to the fp32 rate when the dtype
        has no entry (e.g. fp8 on an A100 runs no faster than its fp16 path; we use the
        nearest wider type that exists)."""
        for key in _FALLBACK.get(dtype_key, (dtype_key,)):
            if key in self.peak_tflops:
                return self.peak_tflops[key] * 1e12
        raise KeyError(f"device {self.name!r} has no peak for dtype {dtype_key!r}")

    def replace(self, **changes: Any) -> "DeviceSpec":
        return dataclasses.replace(self, **changes)


_FALLBACK = {
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "tf32": ("tf32", "fp32"),
    "fp32": ("fp32",),
    "fp64": ("fp64", "fp32"),
}

# ----------------------------------------------------------------------------------------
# Built-in devices
# ----------------------------------------------------------------------------------------
# NVIDIA quotes tensor-core throughput "with sparsity"; the dense figure is half of it.

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP64 34 TF, FP32 67 TF,
# TF32 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF* (* with sparsity), GPU memory 80GB,
# 3.35 TB/s, NVLink 900 GB/s; HGX H100 has 4 third-gen NVSwitch (NVLink SHARP). DGX H100:
# 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU.
_H100 = DeviceSpec(
    name="h100_sxm",
    peak_tflops={"fp64": 34.0, "fp32": 67.0, "tf32": 989.4 / 2, "bf16": 1978.9 / 2,
                 "fp16": 1978.9 / 2, "fp8": 3957.8 / 2},
    hbm_TBps=3.35, hbm_GiB=80.0,
    fabric=FabricSpec(kind="nvswitch", GBps=900.0 / 2, nvlink_gen=4, nvls=True,
                      ring_efficiency=RING_EFFICIENCY_HOPPER),
    nic_GBps=400e9 / 8 / 1e9, arch="hopper",
)
# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM (FP8 3,958 TF*,
# BF16 1,979 TF*, TF32 989 TF*, FP32 67 TF, FP64 34 TF), 141GB HBM3e, 4.8 TB/s, NVLink 900 GB/s.
_H200 = _H100.replace(name="h200", hbm_TBps=4.8, hbm_GiB=141.0)
# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): FP64 9.7 TF, FP32 19.5 TF,
# TF32 156 TF (312* sparse), BF16/FP16 312 TF (624*), no FP8; 80GB HBM2e, 2,039 GB/s;
# NVLink 600 GB/s; HGX A100 NVSwitch gen 2 (no NVLink SHARP). DGX A100: 8x ConnectX-6
# 200 Gb/s = 25 GB/s per GPU.
_A100 = DeviceSpec(
    name="a100_80gb_sxm",
    peak_tflops={"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    hbm_TBps=2.039, hbm_GiB=80.0,
    fabric=FabricSpec(kind="nvswitch", GBps=600.0 / 2, nvlink_gen=3, nvls=False,
                      ring_efficiency=RING_EFFICIENCY_AMPERE),
    nic_GBps=200e9 / 8 / 1e9, arch="ampere",
)
# NVIDIA HGX B200 / DGX B200 datasheet, 8 GPUs: FP8 72 PF*, FP16/BF16 36 PF*, TF32 18 PF*,
# FP32 600 TF, FP64 296 TF, 1,440 GB HBM3e at 64 TB/s, NVLink 5 1.8 TB/s per GPU (NVSwitch
# gen 4, NVLink SHARP), 8x ConnectX-7 400 Gb/s. Per GPU: divide by 8; dense: halve the
# starred (sparse) figures.
_B200 = DeviceSpec(
    name="b200",
    peak_tflops={"fp64": 296.0 / 8, "fp32": 600.0 / 8, "tf32": 18000.0 / 8 / 2,
                 "bf16": 36000.0 / 8 / 2, "fp16": 36000.0 / 8 / 2, "fp8": 72000.0 / 8 / 2},
    hbm_TBps=64.0 / 8, hbm_GiB=1440.0 / 8,
    fabric=FabricSpec(kind="nvswitch", GBps=1800.0 / 2, nvlink_gen=5, nvls=True,
                      ring_efficiency=RING_EFFICIENCY_HOPPER),
    nic_GBps=400e9 / 8 / 1e9, arch="blackwell",
)
# Nominal host CPU for local (gloo / fake) meshes: a 16-core AVX-512 server socket,
# ~2 TFLOP/s fp32 (16 cores x 2 FMA units x 16 lanes x 2 FLOP x ~2 GHz), ~100 GB/s DRAM,
# 128 GiB, shared-memory "fabric" ~20 GB/s, 10 Gb/s Ethernet between hosts. Nominal,
# not a datasheet: override for your machine.
_CPU = DeviceSpec(
    name="cpu",
    peak_tflops={"fp32": 2.0, "bf16": 2.0, "fp16": 1.0, "fp64": 1.0},
    hbm_TBps=0.1, hbm_GiB=128.0,
    fabric=FabricSpec(kind="shm", GBps=20.0, nvlink_gen=None, nvls=False,
                      ring_efficiency=0.8, extra_latency_us=5.0),
    nic_GBps=10e9 / 8 / 1e9, nic_latency_us=20.0,
    launch_floor_us=CPU_LAUNCH_FLOOR_US, matmul_efficiency=0.6, memory_efficiency=0.7,
    arch="cpu", overlap_slowdown=CPU_OVERLAP_SLOWDOWN, fresh_pages_from_bytes=GLIBC_MMAP_THRESHOLD_MAX_BYTES,
)

#: Read-only table of built-in devices, by canonical name.
BUILTIN_DEVICES: Mapping[str, DeviceSpec] = MappingProxyType(
    {d.name: d for d in (_H100, _H200, _A100, _B200, _CPU)})

#: Accepted aliases (lower case, "-" and " " read as "_").
ALIASES: Mapping[str, str] = MappingProxyType({
    "h100": "h100_sxm", "h100_sxm5": "h100_sxm", "h100_80gb": "h100_sxm",
    "h200_sxm": "h200", "a100": "a100_80gb_sxm", "a100_80gb": "a100_80gb_sxm",
    "a100_sxm": "a100_80gb_sxm", "b200_sxm": "b200", "host": "cpu",
})


def _canon(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class DeviceRegistry:
    """A set of named devices: the built-ins plus whatever the user adds.

    >>> reg = DeviceRegistry()
    >>> reg.register(reg.get("h100").replace(name="h100_slow", hbm_TBps=2.0))
    """

    def __init__(self, devices: Mapping[str, DeviceSpec] | None = None,
                 include_builtins: bool = True) -> None:
        self._devices: dict[str, DeviceSpec] = dict(BUILTIN_DEVICES) if include_builtins else {}
        self._aliases: dict[str, str] = dict(ALIASES) if include_builtins else {}
        for spec in (devices or {}).values():
            self.register(spec, overwrite=True)

    def names(self) -> list[str]:
        return sorted(self._devices)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._resolve(name) in self._devices

    def _resolve(self, name: str) -> str:
        key = _canon(name)
        return self._aliases.get(key, key)

    def get(self, name: str | DeviceSpec) -> DeviceSpec:
        if isinstance(name, DeviceSpec):
            return name
        if not isinstance(name, str):
            raise TypeError(f"device name must be a str or DeviceSpec, got {type(name).__name__}")
        key = self._resolve(name)
        try:
            return self._devices[key]
        except KeyError:
            raise ValueError(
                f"unknown device {name!r}; known: {', '.join(self.names())}") from None

    def register(self, spec: DeviceSpec, overwrite: bool = False, aliases: tuple[str, ...] = ()) -> None:
        if not isinstance(spec, DeviceSpec):
            raise TypeError(f"register() needs a DeviceSpec, got {type(spec).__name__}")
        key = _canon(spec.name)
        if key in self._devices and not overwrite:
            raise ValueError(f"device {spec.name!r} already registered (pass overwrite=True)")
        self._devices[key] = spec
        self._aliases.pop(key, None)
        for a in aliases:
            self._aliases[_canon(a)] = key

    def load(self, path: str | Path) -> list[str]:
        """Add or override devices from a TOML or JSON file; returns the names loaded.

        File layout (TOML shown; JSON has the same structure)::

            [devices.my_h100]
            base = "h100"               # optional: start from a known device
            hbm_TBps = 3.0              # any DeviceSpec field, units in the name
            peak_tflops = { bf16 = 900.0 }   # merged into the base's table
            fabric = { GBps = 400.0 }        # merged into the base's fabric
        """
        path = Path(path)
        data = _read_config(path)
        devices = data.get("devices")
        if not isinstance(devices, dict) or not devices:
            raise ValueError(f"{path}: expected a non-empty table 'devices'")
        loaded = []
        for name, entry in devices.items():
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: devices.{name} must be a table")
            spec = self._spec_from_entry(path, name, entry)
            self.register(spec, overwrite=True)
            loaded.append(spec.name)
        logger.info("loaded devices %s from %s", loaded, path)
        return loaded

    def _spec_from_entry(self, path: Path, name: str, entry: dict[str, Any]) -> DeviceSpec:
        entry = dict(entry)
        base_name = entry.pop("base", None)
        fields = {f.name for f in dataclasses.fields(DeviceSpec)}
        unknown = set(entry) - fields
        if unknown:
            raise ValueError(f"{path}: devices.{name}: unknown field(s) {sorted(unknown)}; "
                             f"known: {sorted(fields - {'name'})}")
        try:
            if base_name is not None:
                base = self.get(base_name)
                peak = dict(base.peak_tflops)
                peak.update(entry.pop("peak_tflops", {}) or {})
                fab = entry.pop("fabric", None)
                fabric = dataclasses.replace(base.fabric, **fab) if fab else base.fabric
                return dataclasses.replace(base, name=name, peak_tflops=peak, fabric=fabric, **entry)
            fab = entry.pop("fabric", None)
            if not isinstance(fab, dict):
                raise ValueError("needs a 'fabric' table or a 'base' device")
            return DeviceSpec(name=name, fabric=FabricSpec(**fab), **entry)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: devices.{name}: {e}") from e


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"device file not found: {path}")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from e


def device(name: str | DeviceSpec, registry: DeviceRegistry | None = None, **overrides: Any) -> DeviceSpec:
    """Look up a device by name ("h100", "h200", "a100", "b200", "cpu", or any name in
    ``registry``), optionally overriding fields: ``device("h100", hbm_TBps=3.0)``."""
    spec = (registry or DeviceRegistry()).get(name)
    return spec.replace(**overrides) if overrides else spec


def load_devices(path: str | Path, registry: DeviceRegistry | None = None) -> DeviceRegistry:
    """Load devices from a TOML/JSON file into ``registry`` (a new one with the built-ins
    when None) and return the registry."""
    reg = registry if registry is not None else DeviceRegistry()
    reg.load(path)
    return reg

"""Hardware specs and cost models for apmodel: measured and roofline compute, NCCL-like collectives,
redistribution costs and calibration against nccl-tests. Times are in µs, sizes in bytes."""

from .bucketing import BUCKETED_KINDS, BucketedCollectives, SharedCollectives
from .calibration import (
    CalibratedCollectives,
    Calibration,
    CalibrationMismatch,
    CorrectionCurve,
    NcclTestsLog,
    format_nccl_tests,
    parse_nccl_tests,
)
from .collectives import KINDS, MeasuredNccl, NCCLCollectives, bus_bandwidth_factor
from .compute import RooflineCompute
from .fresh_pages import FreshPageCollectives
from .hardware import BUILTIN_DEVICES, DeviceRegistry, DeviceSpec, FabricSpec, device, load_devices
from .measured import (
    BUILTIN_PROFILES,
    EXECUTIONS,
    ComputeProfile,
    MeasuredCompute,
    ProfileError,
    builtin_profile,
    compute_model,
    load_profile,
)
from .protocols import CommModel, ComputeModel, load_object
from .redistribution import redistribution_matrix, redistribution_steps, redistribution_us
from .topology import AxisLink, Topology

__all__ = [
    "AxisLink", "BUCKETED_KINDS", "BucketedCollectives", "FreshPageCollectives", "SharedCollectives", "BUILTIN_DEVICES",
    "MeasuredNccl", "BUILTIN_PROFILES", "ComputeProfile", "EXECUTIONS", "MeasuredCompute",
    "ProfileError", "builtin_profile", "compute_model", "load_profile", "Calibration", "CalibratedCollectives", "CalibrationMismatch",
    "CommModel", "ComputeModel", "CorrectionCurve", "DeviceRegistry", "DeviceSpec", "FabricSpec", "KINDS",
    "NCCLCollectives", "NcclTestsLog", "RooflineCompute", "Topology", "bus_bandwidth_factor",
    "device", "format_nccl_tests", "load_devices", "load_object", "parse_nccl_tests",
    "redistribution_matrix", "redistribution_steps", "redistribution_us",
]

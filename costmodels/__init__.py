"""Hardware specs and cost models for apmodel: roofline compute, NCCL-like collectives,
redistribution costs and calibration against nccl-tests. Times are in µs, sizes in bytes."""

from .calibration import (Calibration, CalibratedCollectives, CorrectionCurve, NcclTestsLog,
                          format_nccl_tests, parse_nccl_tests)
from .collectives import KINDS, NCCLCollectives, bus_bandwidth_factor
from .compute import RooflineCompute
from .hardware import (BUILTIN_DEVICES, DeviceRegistry, DeviceSpec, FabricSpec, device,
                       load_devices)
from .protocols import CommModel, ComputeModel, load_object
from .redistribution import redistribution_matrix, redistribution_steps, redistribution_us
from .topology import AxisLink, Topology

__all__ = [
    "AxisLink", "BUILTIN_DEVICES", "Calibration", "CalibratedCollectives", "CommModel",
    "ComputeModel", "CorrectionCurve", "DeviceRegistry", "DeviceSpec", "FabricSpec", "KINDS",
    "NCCLCollectives", "NcclTestsLog", "RooflineCompute", "Topology", "bus_bandwidth_factor",
    "device", "format_nccl_tests", "load_devices", "load_object", "parse_nccl_tests",
    "redistribution_matrix", "redistribution_steps", "redistribution_us",
]

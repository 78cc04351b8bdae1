"""The compute-profile file format: the fitted parameters of
:class:`~costmodels.measured.MeasuredCompute` for one device, with their provenance (schema
:data:`PROFILE_SCHEMA`), their validation, scaling to another device by datasheet ratios, and the
built-in profiles shipped in ``costmodels/profiles``.

The model that prices ops with a profile is :mod:`costmodels.measured`; the kernel measurements a
profile is fitted to are read by :mod:`costmodels.measurements` and fitted by
:mod:`costmodels.fitting`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .hardware import DeviceSpec
from .hardware import device as _device

#: Version tag of the profile file format read by :meth:`ComputeProfile.from_dict`.
PROFILE_SCHEMA = "apmodel.compute_profile/1"
#: Execution modes: eager PyTorch (CPU issues every op) or CUDA-graph replay (no per-op CPU cost).
EXECUTIONS = ("eager", "graphs")

#: Built-in profiles by canonical device name (files in ``costmodels/profiles``).
BUILTIN_PROFILES: Mapping[str, str] = MappingProxyType({
    "h200": "h200.json",
    "h100_sxm": "h100_sxm.json",
})

#: CPU-floor classes a profile must give for eager execution.
FLOOR_CLASSES = ("elementwise", "reduction", "norm", "gather", "matmul", "attention")
#: Traffic kinds a profile must give (effective passes over the nominal bytes).
TRAFFIC_KINDS = ("elementwise", "convert", "reduction", "rms_norm", "layer_norm", "softmax",
                 "log_softmax", "gather")
#: Traffic kinds a profile may give (absent: priced as elementwise).
OPTIONAL_TRAFFIC_KINDS = ("transcendental",)
#: Alignment classes (bytes) of matmul row pitches; 16-byte pitches run the fast kernels.
ALIGN_CLASSES = (2, 4, 8)


class ProfileError(ValueError):
    """A compute profile is malformed (missing parameter, wrong type or schema)."""


@dataclass(frozen=True)
class ComputeProfile:
    """Fitted parameters of :class:`~costmodels.measured.MeasuredCompute` for one device, with their provenance.

    ``params`` (read-only nested mappings; units in the names):

    * ``launch``: ``eager_floor_us`` (CPU time per op, µs, by class in :data:`FLOOR_CLASSES`),
      ``eager_gap_us`` (per-kernel launch latency hidden by CUDA graphs, µs),
      ``kernel_latency_us`` (GPU time of an empty kernel, µs: ``memory``, ``matmul``).
    * ``memory``: ``hbm_TBps`` and ``l2_TBps`` (achieved, 1 TB/s = 1e12 B/s), ``l2_MiB`` (working
      sets up to this size run at the L2 rate), ``traffic`` (passes by kind in :data:`TRAFFIC_KINDS`,
      optionally :data:`OPTIONAL_TRAFFIC_KINDS`), optionally ``softmax_single_pass_max_dim``
      (longest softmax row priced as one pass, default
      :data:`costmodels.measured.PERSISTENT_SOFTMAX_MAX_DIM`; 0 on a
      CPU, where every softmax row pays the fitted factor). On a CPU, "hbm" is DRAM and "l2" the
      per-core L2 cache.
    * ``matmul``: ``tflops`` by dtype key ("bf16", "fp32"; others fall back as
      :meth:`~costmodels.measured.MeasuredCompute._matmul_rate` says), ``tile_m``/``tile_n`` (CTA tile, elements), ``align_efficiency``
      by pitch alignment in bytes ("2", "4", "8"; 16 and more is 1.0).
    * ``attention``: per backend ("flash", "cudnn"; any backend but flash may say
      ``{"same_as": "flash"}``: "efficient" on GPUs, "cudnn" on a CPU, which has neither) and pass
      ("fwd", "bwd"): ``tflops`` (at head dim 128), ``head_dim_half``, ``tail``, ``latency_us``.
    * ``embedding_backward``: ``fixed_us``, ``scatter_GBps``.
    * ``harness``: ``autograd_grad_cpu_us``, CPU time of the measurement harness's
      ``torch.autograd.grad`` call (only for reproducing fwd+bwd rows; never charged to ops).

    ``reference`` is the device the parameters hold for (its name, dense peak TFLOP/s by dtype,
    HBM TB/s and SM count); used on another :class:`DeviceSpec` the model scales compute rates by
    the ratio of peaks and bandwidths by the ratio of HBM bandwidths.

    ``executions`` are the execution modes the parameters were measured in (:data:`EXECUTIONS`):
    a profile without CUDA-graph timings (every CPU profile) has only "eager", and
    :class:`~costmodels.measured.MeasuredCompute` refuses to price "graphs" with it. Files without the key (the
    built-in H200 profile, fitted with graph timings) have both.
    """

    device: str
    params: Mapping[str, Any]
    reference: Mapping[str, Any]
    provenance: Mapping[str, Any] = field(default_factory=dict)
    fit: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    executions: tuple[str, ...] = EXECUTIONS

    def __post_init__(self) -> None:
        where = self.source or self.device
        _validate_params(self.params, where)
        _validate_reference(self.reference, where)
        execs = self.executions
        if isinstance(execs, str) or not isinstance(execs, (list, tuple)) or not execs \
                or any(e not in EXECUTIONS for e in execs):
            raise ProfileError(f"compute profile {where!r}: executions must be a non-empty list of "
                               f"{', '.join(map(repr, EXECUTIONS))}, got {execs!r}")
        object.__setattr__(self, "executions", tuple(e for e in EXECUTIONS if e in execs))
        for key in ("provenance", "fit"):
            if not isinstance(getattr(self, key), Mapping):
                raise ProfileError(f"compute profile {where!r}: {key} must be a table, got {getattr(self, key)!r}")
        object.__setattr__(self, "params", _freeze(self.params))
        object.__setattr__(self, "reference", _freeze(self.reference))
        object.__setattr__(self, "provenance", _freeze(self.provenance))
        object.__setattr__(self, "fit", _freeze(self.fit))

    # --- I/O ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> "ComputeProfile":
        where = source or "compute profile"
        if not isinstance(data, Mapping):
            raise ProfileError(f"{where}: a compute profile is a JSON object, got {type(data).__name__}")
        if data.get("schema") != PROFILE_SCHEMA:
            raise ProfileError(f"{where}: schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}")
        for key in ("device", "params", "reference"):
            if key not in data:
                raise ProfileError(f"{where}: missing {key!r}")
        return cls(device=str(data["device"]), params=data["params"], reference=data["reference"],
                   provenance=data.get("provenance", {}), fit=data.get("fit", {}), source=source,
                   executions=data.get("executions", EXECUTIONS))

    @classmethod
    def load(cls, path: str | Path) -> "ComputeProfile":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        except UnicodeDecodeError as e:
            raise ProfileError(f"{path}: not a JSON file (not UTF-8 text: {e.reason} at byte {e.start})") from e
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, "device": self.device, "executions": list(self.executions),
                "reference": thaw(self.reference), "provenance": thaw(self.provenance),
                "fit": thaw(self.fit), "params": thaw(self.params)}

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    def replace(self, **changes: Any) -> "ComputeProfile":
        d = {"device": self.device, "params": thaw(self.params), "reference": thaw(self.reference),
             "provenance": thaw(self.provenance), "fit": thaw(self.fit), "source": self.source,
             "executions": self.executions}
        d.update(changes)
        return ComputeProfile(**d)

    # --- device scaling ----------------------------------------------------------------
    def scaled_to(self, spec: DeviceSpec, note: str | None = None) -> "ComputeProfile":
        """This profile moved to ``spec`` by datasheet ratios: matmul and attention rates by the
        ratio of dense peaks (per dtype), HBM bandwidth by the ratio of HBM bandwidths. CPU floors,
        latencies, the L2 rate and capacity, traffic factors and alignment efficiencies are kept
        (same software stack; same die for H100/H200)."""
        p = thaw(self.params)
        ref = self.reference
        hbm_ratio = spec.hbm_TBps / float(ref["hbm_TBps"])
        p["memory"]["hbm_TBps"] = _sig(p["memory"]["hbm_TBps"] * hbm_ratio)
        for key, v in list(p["matmul"]["tflops"].items()):
            p["matmul"]["tflops"][key] = _sig(v * _peak_ratio(spec, ref, key))
        ratio_tc = _peak_ratio(spec, ref, "bf16")
        for passes in p["attention"].values():
            if "same_as" in passes:
                continue
            for ps in passes.values():
                ps["tflops"] = _sig(ps["tflops"] * ratio_tc)
        p["embedding_backward"]["scatter_GBps"] = _sig(p["embedding_backward"]["scatter_GBps"] * hbm_ratio)
        reference = {"device": spec.name, "peak_tflops": dict(spec.peak_tflops),
                     "hbm_TBps": spec.hbm_TBps, "sm_count": ref["sm_count"]}
        prov = thaw(self.provenance)
        prov["derived_from"] = {
            "device": self.device,
            "method": note or ("datasheet ratios: matmul/attention TFLOP/s x peak ratio "
                               f"(bf16 {ratio_tc:.4g}), HBM TB/s x {hbm_ratio:.4g}; CPU floors, latencies, "
                               "L2, traffic and alignment factors unchanged"),
        }
        fit = {"note": f"not fitted on {spec.name}: derived from the {self.device} fit (see provenance.derived_from)"}
        return ComputeProfile(device=spec.name, params=p, reference=reference, provenance=prov,
                              fit=fit, source=f"{self.source or self.device} scaled to {spec.name}",
                              executions=self.executions)

    def matches(self, spec: DeviceSpec) -> bool:
        """True when ``spec`` has this profile's reference peaks and HBM bandwidth."""
        ref = self.reference
        if not math.isclose(spec.hbm_TBps, float(ref["hbm_TBps"]), rel_tol=1e-9):
            return False
        peaks = ref["peak_tflops"]
        return all(k in spec.peak_tflops and math.isclose(spec.peak_tflops[k], float(v), rel_tol=1e-9)
                   for k, v in peaks.items())


def _peak_ratio(spec: DeviceSpec, ref: Mapping[str, Any], key: str) -> float:
    peaks = ref["peak_tflops"]
    ref_key = key if key in peaks else ("bf16" if key != "fp32" else "fp32")
    try:
        return spec.peak_flops(key) / (float(peaks[ref_key]) * 1e12)
    except KeyError:
        return spec.peak_flops("fp32") / (float(peaks.get("fp32", peaks[ref_key])) * 1e12)


def _sig(x: float, digits: int = 5) -> float:
    """``x`` rounded to ``digits`` significant digits (profiles store fitted values so)."""
    return float(f"{x:.{digits}g}")


def _freeze(x: Any) -> Any:
    if isinstance(x, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in x.items()})
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    return x


def thaw(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [thaw(v) for v in x]
    return copy.copy(x)


def _validate_params(p: Mapping[str, Any], where: str) -> None:
    def need(path: str) -> Any:
        node: Any = p
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ProfileError(f"compute profile {where!r}: missing params.{path}")
            node = node[part]
        return node

    def num(path: str, positive: bool = True) -> float:
        v = need(path)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (v <= 0 if positive else v < 0):
            raise ProfileError(f"compute profile {where!r}: params.{path} must be a "
                               f"{'positive' if positive else 'non-negative'} number, got {v!r}")
        return float(v)

    for c in FLOOR_CLASSES:
        num(f"launch.eager_floor_us.{c}")
    num("launch.eager_gap_us", positive=False)
    for c in ("memory", "matmul"):
        num(f"launch.kernel_latency_us.{c}", positive=False)
    for k in ("hbm_TBps", "l2_TBps", "l2_MiB"):
        num(f"memory.{k}")
    for k in TRAFFIC_KINDS:
        num(f"memory.traffic.{k}")
    for k in OPTIONAL_TRAFFIC_KINDS:
        if k in need("memory.traffic"):
            num(f"memory.traffic.{k}")
    if "softmax_single_pass_max_dim" in need("memory"):
        v = need("memory.softmax_single_pass_max_dim")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ProfileError(f"compute profile {where!r}: params.memory.softmax_single_pass_max_dim must be "
                               f"a non-negative integer, got {v!r}")
    num("matmul.tflops.bf16")
    num("matmul.tflops.fp32")
    num("matmul.tile_m")
    num("matmul.tile_n")
    for a in ALIGN_CLASSES:
        num(f"matmul.align_efficiency.{a}")
    att = need("attention")
    if not isinstance(att, Mapping):
        raise ProfileError(f"compute profile {where!r}: params.attention must be a table, got {att!r}")
    for backend, passes in att.items():
        if not isinstance(passes, Mapping):
            raise ProfileError(f"compute profile {where!r}: params.attention.{backend} must be a table, got {passes!r}")
        if "same_as" in passes:
            # another backend's parameters (a device without this backend, e.g. cuDNN on a CPU)
            target = passes["same_as"]
            if backend == "flash" or target == backend or target not in att \
                    or not isinstance(att[target], Mapping) or "same_as" in att[target]:
                raise ProfileError(f"compute profile {where!r}: params.attention.{backend}.same_as must name "
                                   f"another backend with its own parameters, got {target!r}")
    for backend in ("flash", "cudnn"):
        if backend != "flash" and "same_as" in att.get(backend, {}):
            continue
        for ps in ("fwd", "bwd"):
            for k in ("tflops", "head_dim_half"):
                num(f"attention.{backend}.{ps}.{k}")
            for k in ("tail", "latency_us"):
                num(f"attention.{backend}.{ps}.{k}", positive=False)
    for backend, passes in att.items():
        if backend not in ("flash", "cudnn") and "same_as" not in passes:
            for ps in ("fwd", "bwd"):
                for k in ("tflops", "head_dim_half"):
                    num(f"attention.{backend}.{ps}.{k}")
                for k in ("tail", "latency_us"):
                    num(f"attention.{backend}.{ps}.{k}", positive=False)
    num("embedding_backward.fixed_us", positive=False)
    num("embedding_backward.scatter_GBps")
    harness = p.get("harness")
    if harness is not None:
        if not isinstance(harness, Mapping):
            raise ProfileError(f"compute profile {where!r}: params.harness must be a table, got {harness!r}")
        if "autograd_grad_cpu_us" in harness:
            num("harness.autograd_grad_cpu_us", positive=False)


def _validate_reference(ref: Any, where: str) -> None:
    """The ``reference`` device of a profile: peaks by dtype key (TFLOP/s), HBM TB/s, SM count."""
    if not isinstance(ref, Mapping):
        raise ProfileError(f"compute profile {where!r}: reference must be a table, got {ref!r}")
    for key in ("peak_tflops", "hbm_TBps", "sm_count"):
        if key not in ref:
            raise ProfileError(f"compute profile {where!r}: reference needs {key!r}")

    def positive(v: Any) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0

    peaks = ref["peak_tflops"]
    if not isinstance(peaks, Mapping) or not peaks or not all(positive(v) for v in peaks.values()):
        raise ProfileError(f"compute profile {where!r}: reference.peak_tflops must map dtype keys to "
                           f"positive numbers, got {peaks!r}")
    if not positive(ref["hbm_TBps"]):
        raise ProfileError(f"compute profile {where!r}: reference.hbm_TBps must be a positive number, "
                           f"got {ref['hbm_TBps']!r}")
    if not positive(ref["sm_count"]) or int(ref["sm_count"]) != ref["sm_count"]:
        raise ProfileError(f"compute profile {where!r}: reference.sm_count must be a positive integer, "
                           f"got {ref['sm_count']!r}")


def profiles_dir() -> Path:
    """Folder of the built-in profiles and the measurements they were fitted to."""
    return Path(str(resources.files("costmodels").joinpath("profiles")))


def builtin_profile(device: str | DeviceSpec) -> ComputeProfile | None:
    """The built-in profile of a device (by canonical name), or None."""
    name = device.name if isinstance(device, DeviceSpec) else _device(device).name
    fname = BUILTIN_PROFILES.get(name)
    if fname is None:
        return None
    return ComputeProfile.load(profiles_dir() / fname)


def load_profile(profile: str | Path | Mapping[str, Any] | ComputeProfile) -> ComputeProfile:
    """A :class:`ComputeProfile` from itself, a mapping (parsed JSON), a path to a JSON file, or the
    name of a built-in profile ("h200", "h100")."""
    if isinstance(profile, ComputeProfile):
        return profile
    if isinstance(profile, Mapping):
        return ComputeProfile.from_dict(profile)
    if isinstance(profile, str) and not profile.lower().endswith(".json"):
        found = builtin_profile(profile)
        if found is None:
            raise ProfileError(f"no built-in compute profile for {profile!r}; built-in: "
                               f"{', '.join(sorted(BUILTIN_PROFILES))} (or give a JSON file)")
        return found
    path = Path(profile)
    if not path.exists():
        raise FileNotFoundError(f"compute profile not found: {path}")
    return ComputeProfile.load(path)


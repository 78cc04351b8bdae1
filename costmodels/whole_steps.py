"""Whole measured training steps, and the compute model's prediction of them.

A step file (``profiles/h200_steps.json``: four forward + backward steps measured in eager bf16 on
one H200) lists, per step, every distinct ATen call with its argument specs, how often the step
made it and its own measured time, plus ``n_calls`` (every ATen call of the step, views and other
host-only calls included) and ``step_measured_us`` (the whole step between CUDA events).

:func:`predict_step` prices the step as eager PyTorch runs it, one stream:
``max(host time, GPU time + launch gaps)`` (:meth:`MeasuredCompute.stream_us`), where the host
time counts every call of the step. The kernels' host cost is the profile's eager floor by op
class; the ``n_calls - kernels`` calls that launch nothing (views, ``detach``, ``t``, autograd's
bookkeeping) are priced at the profile's elementwise eager floor, because in eager they take the
same path through the dispatcher and autograd. On large steps the GPU side decides and host-only
calls change nothing; on a launch-bound step (``llama3-debug``) they are half the host time.

The spec encoding (the file's ``arg_spec``): ``T`` shape, ``S`` strides, ``D`` dtype of a tensor;
``L`` a list (``tuple``: true for a tuple); ``M`` a dict; ``dtype`` / ``device`` / ``enum`` those
Python values; anything else is a literal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .compute_profile import profiles_dir
from .measured import MeasuredCompute
from .measurements import Call

#: ``enum`` values the step files use
_ENUMS: Mapping[str, Any] = {"strided": torch.strided, "contiguous_format": torch.contiguous_format,
                             "preserve_format": torch.preserve_format, "channels_last": torch.channels_last}


def decode_spec(spec: Any, where: str = "spec") -> Any:
    """The Python value (meta tensors for tensors) that an argument spec describes."""
    if isinstance(spec, list):
        return [decode_spec(x, where) for x in spec]
    if not isinstance(spec, dict):
        return spec
    if "T" in spec:
        try:
            dtype = getattr(torch, spec["D"])
        except AttributeError:
            raise ValueError(f"{where}: unknown dtype {spec['D']!r}") from None
        return torch.empty_strided(spec["T"], spec["S"], dtype=dtype, device="meta")
    if "L" in spec:
        items = [decode_spec(x, where) for x in spec["L"]]
        return tuple(items) if spec.get("tuple") else items
    if "M" in spec:
        return {k: decode_spec(v, f"{where}.{k}") for k, v in spec["M"].items()}
    if set(spec) == {"dtype"}:
        return getattr(torch, spec["dtype"])
    if set(spec) == {"device"}:
        return torch.device(spec["device"])
    if set(spec) == {"enum"}:
        if spec["enum"] not in _ENUMS:
            raise ValueError(f"{where}: unknown enum value {spec['enum']!r}")
        return _ENUMS[spec["enum"]]
    return {k: decode_spec(v, f"{where}.{k}") for k, v in spec.items()}


def _aten_op(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise ValueError(f"op {name!r} is not 'aten.<name>.<overload>'")
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except AttributeError:
        raise ValueError(f"op {name!r} is not an ATen operator of torch {torch.__version__}") from None


@dataclass(frozen=True)
class MeasuredCall:
    """One distinct call of a step: the call on meta tensors, how often it ran, its own time (µs)."""

    name: str
    call: Call
    count: int
    measured_us: float


@dataclass(frozen=True)
class MeasuredStep:
    case: str
    calls: tuple[MeasuredCall, ...]
    n_calls: int            # every ATen call of the step, host-only ones included
    measured_us: float      # the whole step


@dataclass(frozen=True)
class StepPrediction:
    step: MeasuredStep
    predicted_us: float
    host_us: float
    gpu_us: float           # kernels plus launch gaps
    call_us: tuple[float, ...]  # each distinct call alone, as the per-call measurement timed it

    @property
    def ratio(self) -> float:
        """Measured / predicted (> 1: the model is optimistic)."""
        return self.step.measured_us / self.predicted_us

    @property
    def bound(self) -> str:
        return "host" if self.host_us >= self.gpu_us else "GPU"


def load_steps(path: str | Path | None = None, device: str = "h200") -> list[MeasuredStep]:
    """The steps of a step file (by default the one shipped for ``device``)."""
    path = Path(path) if path is not None else profiles_dir() / f"{device}_steps.json"
    data = json.loads(path.read_text())
    steps = []
    for i, case in enumerate(data.get("cases", [])):
        where = f"{path}: cases[{i}]"
        calls = []
        for j, row in enumerate(case["rows"]):
            w = f"{where}.rows[{j}] ({row.get('op')})"
            op = _aten_op(row["op"])
            args = decode_spec(row["args"], w)
            kwargs = decode_spec(row.get("kwargs", {"M": {}}), w)
            out = decode_spec(row["out"], w)
            calls.append(MeasuredCall(row["op"], Call(op, tuple(args), dict(kwargs), out), int(row["count"]),
                                      float(row["meas_us"])))
        kernels = sum(c.count for c in calls)
        if int(case["n_calls"]) < kernels:
            raise ValueError(f"{where}: n_calls {case['n_calls']} is below the {kernels} calls its rows count")
        steps.append(MeasuredStep(str(case["case"]), tuple(calls), int(case["n_calls"]),
                                  float(case["step_measured_us"])))
    if not steps:
        raise ValueError(f"{path}: no cases")
    return steps


def predict_step(model: MeasuredCompute, step: MeasuredStep) -> StepPrediction:
    """The eager step on one stream: every call's host time against kernels plus gaps."""
    distinct = [model.price(c.call.op, c.call.args, c.call.kwargs, c.call.out, None) for c in step.calls]
    prices = [p for p, c in zip(distinct, step.calls, strict=True) for _ in range(c.count)]
    host_only = step.n_calls - len(prices)
    host_only_us = host_only * model.host_only_call_us
    predicted = model.stream_us(prices, extra_cpu_us=host_only_us)
    host = sum(p.cpu_us for p in prices) + host_only_us
    gpu = sum(p.gpu_us for p in prices) + sum(1 for p in prices if p.gpu_us > 0) * model.launch_gap_us
    return StepPrediction(step, predicted, host, gpu, tuple(model.combine(p) for p in distinct))


def spearman(predictions: Sequence[StepPrediction]) -> float:
    """Rank correlation of predicted and measured time over the distinct calls of the steps."""
    from scipy.stats import spearmanr

    pred = [p for sp in predictions for p in sp.call_us]
    meas = [c.measured_us for sp in predictions for c in sp.step.calls]
    return float(spearmanr(pred, meas).statistic)

"""Kernel measurements: a measured row turned into the ATen calls it ran (on meta tensors), its
predicted time under a :class:`~costmodels.measured.MeasuredCompute`, and the predicted-vs-measured
report over a file of rows.

A measurement file (schema :data:`MEASUREMENTS_SCHEMA`) is written by :mod:`costmodels.kernel_timing`
(``apmodel calibrate-compute``) and shipped for the built-in profiles in ``costmodels/profiles``;
:mod:`costmodels.fitting` fits a :class:`~costmodels.compute_profile.ComputeProfile` to one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .compute_profile import profiles_dir
from .measured import MeasuredCompute

#: Version tag of a kernel-measurement file (see :func:`load_measurements`).
MEASUREMENTS_SCHEMA = "apmodel.kernel_measurements/1"

#: The dtypes a measurement row names (its ``dtype`` field).
DTYPES_BY_NAME = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
}



class Call(NamedTuple):
    """One ATen call on meta tensors: ``op(*args, **kwargs) -> out``."""

    op: Any
    args: tuple
    kwargs: dict
    out: Any


def load_measurements(path: str | Path | None = None, device: str = "h200") -> dict[str, Any]:
    """A kernel-measurement file (parsed JSON: header fields and ``rows``); by default the copy
    shipped for ``device`` (``profiles/<device>_kernels.json``)."""
    if path is None:
        path = profiles_dir() / f"{device}_kernels.json"
    data = json.loads(Path(path).read_text())
    if not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: expected a list 'rows'")
    return data


def _call(op: Any, *args: Any, **kwargs: Any) -> Call:
    return Call(op, args, kwargs, op(*args, **kwargs))


def row_calls(row: Mapping[str, Any]) -> list[Call]:
    """The ATen calls (meta tensors) that one measured row ran, in order.

    Row ops (see the file's ``fields``): ``mm``, ``mm_tt`` (both operands transposed views),
    ``bmm``, ``sdpa_<backend>_fwd`` / ``_fwd_plus_bwd``, elementwise ops (``add``, ``mul_scalar``,
    ``copy_``, ``silu``, ``gelu``), ``to_fp32``, ``sum``, ``sum_dim0``, norms, ``softmax``,
    ``log_softmax``, ``cross_entropy_fp32`` (upcast, log-softmax, nll), ``embedding`` and
    ``embedding_dense_backward`` (its table size is recovered from the row's byte count).
    A row with ``"device_type": "cpu"`` ran the CPU kernels of flash attention
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward).
    """
    aten = torch.ops.aten
    kind = row["op"]
    dt = DTYPES_BY_NAME[row["dtype"]]
    shapes = [tuple(int(x) for x in s) for s in row["shapes"]]

    def t(shape: Sequence[int], dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    def idx(shape: Sequence[int]) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=torch.int64, device="meta")

    if kind == "mm":
        return [_call(aten.mm.default, t(shapes[0]), t(shapes[1]))]
    if kind == "mm_tt":
        a = t(shapes[0][::-1]).t()
        b = t(shapes[1][::-1]).t()
        return [_call(aten.mm.default, a, b)]
    if kind == "bmm":
        return [_call(aten.bmm.default, t(shapes[0]), t(shapes[1]))]
    if kind.startswith("sdpa_"):
        return _attention_calls(kind, row, t(shapes[0]))
    if kind == "add":
        return [_call(aten.add.Tensor, t(shapes[0]), t(shapes[1]))]
    if kind == "mul_scalar":
        return [_call(aten.mul.Tensor, t(shapes[0]), 2.0)]
    if kind == "copy_":
        return [_call(aten.copy_.default, t(shapes[0]), t(shapes[1]))]
    if kind == "to_fp32":
        return [_call(aten._to_copy.default, t(shapes[0]), dtype=torch.float32)]
    if kind == "sum":
        return [_call(aten.sum.default, t(shapes[0]))]
    if kind == "sum_dim0":  # column sums: a bias gradient
        return [_call(aten.sum.dim_IntList, t(shapes[0]), [0])]
    if kind == "silu":
        return [_call(aten.silu.default, t(shapes[0]))]
    if kind == "gelu":
        return [_call(aten.gelu.default, t(shapes[0]))]
    if kind == "log_softmax":
        return [_call(aten._log_softmax.default, t(shapes[0]), -1, False)]
    if kind == "rms_norm":
        x = t(shapes[0])
        return [_call(aten._fused_rms_norm.default, x, [x.shape[-1]], t(x.shape[-1:]), 1e-6)]
    if kind == "layer_norm":
        x = t(shapes[0])
        w = t(x.shape[-1:])
        return [_call(aten.native_layer_norm.default, x, [x.shape[-1]], w, w, 1e-5)]
    if kind == "softmax":
        return [_call(aten._softmax.default, t(shapes[0]), -1, False)]
    if kind == "cross_entropy_fp32":
        x = t(shapes[0])
        up = _call(aten._to_copy.default, x, dtype=torch.float32)
        lsm = _call(aten._log_softmax.default, up.out, 1, False)
        nll = _call(aten.nll_loss_forward.default, lsm.out, idx(x.shape[:1]), None, 1, -100)
        return [up, lsm, nll]
    if kind == "embedding":
        return [_call(aten.embedding.default, t(shapes[0]), idx(shapes[1]))]
    if kind == "embedding_dense_backward":
        grad, ind = shapes[0], shapes[1]
        rows, dim = math.prod(ind), grad[-1]
        isz = dt.itemsize
        # bytes = table (num_weights x dim) + gradient rows + int64 indices
        num_weights = (int(row["bytes"]) - rows * dim * isz - rows * 8) // (dim * isz)
        if num_weights <= 0:
            raise ValueError(f"embedding_dense_backward row: cannot recover num_weights from bytes={row['bytes']}")
        return [_call(aten.embedding_dense_backward.default, t(grad), idx(ind), int(num_weights), -1, False)]
    raise ValueError(f"unknown measured op {kind!r}")


def _attention_calls(kind: str, row: Mapping[str, Any], q: torch.Tensor) -> list[Call]:
    """The calls of an ``sdpa_<backend>_fwd`` / ``_fwd_plus_bwd`` row (``q``: the query, key and
    value alike): the backend's forward, then its backward on the forward's outputs."""
    aten = torch.ops.aten
    backend = kind.split("_")[1]
    causal = bool(row.get("causal", False))
    calls = []
    if backend == "flash" and row.get("device_type") == "cpu":
        fwd = _call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.0, causal)
        calls.append(fwd)
        if kind.endswith("_fwd_plus_bwd"):
            o = fwd.out
            calls.append(_call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                               q, q, q, q, o[0], o[1], 0.0, causal))
    elif backend == "flash":
        fwd = _call(aten._scaled_dot_product_flash_attention.default, q, q, q, 0.0, causal)
        calls.append(fwd)
        if kind.endswith("_fwd_plus_bwd"):
            o = fwd.out
            calls.append(_call(aten._scaled_dot_product_flash_attention_backward.default,
                               q, q, q, q, o[0], o[1], o[2], o[3], o[4], o[5], 0.0, causal, o[6], o[7]))
    elif backend == "cudnn":
        fwd = _call(aten._scaled_dot_product_cudnn_attention.default, q, q, q, None, True, 0.0, causal)
        calls.append(fwd)
        if kind.endswith("_fwd_plus_bwd"):
            o = fwd.out
            calls.append(_call(aten._scaled_dot_product_cudnn_attention_backward.default,
                               q, q, q, q, o[0], o[1], o[6], o[7], None, o[2], o[3], o[4], o[5], 0.0, causal))
    elif backend == "efficient":
        fwd = _call(aten._scaled_dot_product_efficient_attention.default, q, q, q, None, True, 0.0, causal)
        calls.append(fwd)
        if kind.endswith("_fwd_plus_bwd"):
            o = fwd.out
            calls.append(_call(aten._scaled_dot_product_efficient_attention_backward.default,
                               q, q, q, q, None, o[0], o[1], o[2], o[3], 0.0, [True, True, True, False], causal))
    else:
        raise ValueError(f"unknown attention backend in row op {kind!r}")
    return calls


def row_harness_cpu_us(model: MeasuredCompute, row: Mapping[str, Any]) -> float:
    """CPU time of the measurement harness outside the ops: ``autograd.grad`` for the fwd+bwd rows
    of a file timed through autograd (``"harness": "autograd"``, the default: the H200 file); none
    for rows that called the ATen ops directly (``"harness": "aten"``, ``apmodel calibrate-compute``)."""
    if row.get("harness", "autograd") == "autograd" and str(row["op"]).endswith("_fwd_plus_bwd"):
        return float(model.profile.params["harness"]["autograd_grad_cpu_us"])
    return 0.0


def predict_row(model: MeasuredCompute, row: Mapping[str, Any], calls: Sequence[Call] | None = None) -> float:
    """Predicted time (µs) of one measured row in ``model``'s execution mode (its ops back to back
    on one stream, see :meth:`MeasuredCompute.stream_us`)."""
    calls = row_calls(row) if calls is None else calls
    prices = [model.price(c.op, c.args, c.kwargs, c.out, None) for c in calls]
    return model.stream_us(prices, extra_cpu_us=row_harness_cpu_us(model, row))


def describe_row(row: Mapping[str, Any]) -> str:
    shapes = "x".join("[" + ",".join(str(v) for v in s) + "]" for s in row["shapes"])
    dt = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(row["dtype"], row["dtype"])
    return f"{row['op']} {shapes} {dt}"


def fit_report(model: MeasuredCompute, rows: Sequence[Mapping[str, Any]], *, measured: str = "meas_us",
               worst: int = 10) -> dict[str, Any]:
    """Predicted vs measured over ``rows`` (those with a ``measured`` field): per-row ratios, the
    median absolute relative error ``|pred/meas - 1|``, the median absolute log error
    ``|ln(pred/meas)|``, the largest factor ``max(pred/meas, meas/pred)`` and the worst rows."""
    items = []
    for r in rows:
        if r.get(measured) is None:
            continue
        pred = predict_row(model, r)
        meas = float(r[measured])
        items.append({"row": describe_row(r), "op": r["op"], "meas_us": meas, "pred_us": pred,
                      "ratio": pred / meas})
    if not items:
        return {"rows": 0}
    rel = sorted(abs(it["ratio"] - 1.0) for it in items)
    logs = sorted(abs(math.log(it["ratio"])) for it in items)
    by_factor = sorted(items, key=lambda it: -abs(math.log(it["ratio"])))
    by_class: dict[str, list[float]] = {}
    for it in items:
        by_class.setdefault(_row_class(it["op"]), []).append(abs(math.log(it["ratio"])))
    return {
        "rows": len(items),
        "median_abs_rel_err": median_of_sorted(rel),
        "median_abs_log_err": median_of_sorted(logs),
        "max_factor": math.exp(logs[-1]),
        "by_class": {k: {"rows": len(v), "median_abs_log_err": median_of_sorted(sorted(v)),
                         "max_factor": math.exp(max(v))} for k, v in sorted(by_class.items())},
        "worst": by_factor[:worst],
        "items": items,
    }


def _row_class(op: str) -> str:
    if op.startswith("mm") or op == "bmm":
        return "matmul"
    if op.startswith("sdpa_"):
        return "attention:" + op.split("_")[1]
    if op.startswith("embedding"):
        return "embedding"
    return "memory"


def median_of_sorted(sorted_vals: Sequence[float]) -> float:
    n = len(sorted_vals)
    if n == 0:
        return math.nan
    mid = n // 2
    return sorted_vals[mid] if n % 2 else 0.5 * (sorted_vals[mid - 1] + sorted_vals[mid])

"""Roofline compute model for ATen operators on per-device (local) shapes.

``time = max(FLOPs / achievable peak, bytes moved / achievable bandwidth) + launch floor``

* FLOPs come from ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm,
  convolution and its backward, the flash / efficient SDPA kernels and their backwards...);
  those ops run on tensor cores at ``peak(dtype) x matmul_efficiency``. Other ops count one
  FLOP per output element on the CUDA-core fp32 rate (they are memory bound anyway).
* ``_grouped_mm`` (one grouped GEMM over row groups: the routed experts of a MoE) is counted as
  the batched GEMM it equals when its groups are equal (:func:`grouped_mm_as_bmm`), the way the
  planner traces the experts (at uniform routing).
* Bytes are the sizes of all input and output tensors (one read, one write), except
  ``embedding`` which reads only the gathered rows.
* Views and metadata ops cost nothing.

Results are cached per (op, shapes, dtypes, non-tensor args, pricing dtype) on the model
object, so repeated calls cost a key build and a dict lookup.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
from torch.utils.flop_counter import flop_registry

from .hardware import DeviceSpec
from .hardware import device as _device

logger = logging.getLogger(__name__)

#: ATen ops (by overload-packet name) that only change metadata: cost 0.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "expand_as",
    "squeeze", "unsqueeze", "slice", "select", "alias", "detach", "view_as", "as_strided",
    "unflatten", "flatten", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "diagonal", "_reshape_alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel",
    "_assert_tensor_metadata", "_assert_async", "view_as_real", "view_as_complex",
})
#: Ops that read a subset of their first tensor argument (bytes = indices + 2 x output).
GATHER_OPS = frozenset({"embedding", "index_select", "gather", "index"})

DTYPE_KEY = {
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
}


#: The grouped GEMM's packet name (``torch._grouped_mm``); its FLOPs are not in torch's registry.
GROUPED_MM = "_grouped_mm"


def grouped_mm_as_bmm(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    """``(groups, m, k, n)`` of the batched GEMM ``[groups, m, k] @ [groups, k, n]`` that
    ``_grouped_mm(a, b, offs)`` computes when its groups are equal (uneven groups: the largest
    share, rows rounded up). The forms: ``a [M, K] @ b [G, K, N]`` (rows grouped: the experts'
    forward and input gradient), ``a [K, M] @ b [M, N] -> [G, K, N]`` (the contraction grouped:
    the weight gradient), ``a [G, M, K] @ b [K, N]`` (columns grouped) and ``[G, M, K] @ [G, K, N]``."""
    if a.dim() == 2 and b.dim() == 3:
        g, k, n = (int(s) for s in b.shape)
        return g, -(-int(a.shape[0]) // g), k, n
    if a.dim() == 3 and b.dim() == 3:
        g, m, k = (int(s) for s in a.shape)
        return g, m, k, int(b.shape[-1])
    if a.dim() == 3 and b.dim() == 2:
        g, m, k = (int(s) for s in a.shape)
        return g, m, k, -(-int(b.shape[1]) // g)
    raise ValueError(f"_grouped_mm of shapes {tuple(a.shape)} and {tuple(b.shape)}: 2-D by 2-D needs the "
                     f"output's group count (use grouped_mm_dims)")


def grouped_mm_dims(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int, int]:
    """:func:`grouped_mm_as_bmm` for every form, the 2-D by 2-D one (``a [K, M] @ b [M, N] -> out
    [G, K, N]``) read from its output."""
    if a.dim() == 2 and b.dim() == 2:
        g, k, n = (int(s) for s in out.shape)
        return g, k, -(-int(a.shape[1]) // g), n
    return grouped_mm_as_bmm(a, b)


def op_name(op: Any) -> str:
    pkt = getattr(op, "overloadpacket", None)
    if pkt is not None:
        return pkt.__name__
    return getattr(op, "__name__", str(op))


class RooflineCompute:
    """``RooflineCompute(device).time_us(op, args, kwargs, out, dtype=None) -> µs``.

    ``fp32_matmul``: "fp32" (PyTorch's default, no TF32) or "tf32" for the rate of fp32
    matmuls.
    """

    def __init__(self, device: DeviceSpec | str, *, fp32_matmul: str = "fp32") -> None:
        self.device: DeviceSpec = _device(device) if isinstance(device, str) else device
        if fp32_matmul not in ("fp32", "tf32"):
            raise ValueError(f"fp32_matmul must be 'fp32' or 'tf32', got {fp32_matmul!r}")
        self.fp32_matmul = fp32_matmul
        dev = self.device
        self._bw = dev.hbm_bytes_per_s * dev.memory_efficiency        # B/s
        self._vector_flops = dev.peak_flops("fp32")                    # FLOP/s, CUDA cores
        self._floor = dev.launch_floor_us
        self._cache: dict[tuple, float] = {}

    # --- public ------------------------------------------------------------------------
    def time_us(self, op: Any, args: tuple, kwargs: dict | None, out: Any,
                dtype: torch.dtype | None = None) -> float:
        """Roofline time in µs of ``op`` on local (per-device) meta tensors."""
        if op is operator.getitem:
            return 0.0
        key = call_key(op, args, kwargs, out, dtype)
        return memoized_time_us(self._cache, key, lambda: self._price(op, args, kwargs or {}, out, dtype))

    def flops(self, op: Any, args: tuple, kwargs: dict | None, out: Any) -> int:
        """FLOPs by torch's flop counter, the grouped GEMM's as its batched GEMM (0 when the op is
        not registered)."""
        ins, outs = tensors_in(args) + tensors_in(kwargs or {}), tensors_in(out)
        if op_name(op) == GROUPED_MM and len(ins) >= 2 and outs:
            g, m, k, n = grouped_mm_dims(ins[0], ins[1], outs[0])
            return 2 * g * m * k * n
        f = flop_registry.get(getattr(op, "overloadpacket", None))
        if f is None:
            return 0
        return int(f(*args, **(kwargs or {}), out_val=out))

    def breakdown(self, op: Any, args: tuple, kwargs: dict | None, out: Any,
                  dtype: torch.dtype | None = None) -> dict[str, float]:
        """Pieces of the roofline: flops, bytes, compute_us, memory_us, total_us."""
        return self._analyse(op, args, kwargs or {}, out, dtype)

    # --- model -------------------------------------------------------------------------
    def _price(self, op: Any, args: tuple, kwargs: dict, out: Any, dtype: torch.dtype | None) -> float:
        return self._analyse(op, args, kwargs, out, dtype)["total_us"]

    def _analyse(self, op: Any, args: tuple, kwargs: dict, out: Any,
                 dtype: torch.dtype | None) -> dict[str, float]:
        name = op_name(op)
        if name in VIEW_OPS or op is operator.getitem:
            return {"flops": 0, "bytes": 0, "compute_us": 0.0, "memory_us": 0.0, "total_us": 0.0}
        ins = tensors_in(args) + tensors_in(kwargs)
        outs = tensors_in(out)
        if not ins and not outs:
            return {"flops": 0, "bytes": 0, "compute_us": 0.0, "memory_us": 0.0, "total_us": 0.0}
        nbytes = self._bytes(name, ins, outs, dtype)
        pkt = getattr(op, "overloadpacket", None)
        f = flop_registry.get(pkt) if pkt is not None else None
        if name == GROUPED_MM and len(ins) >= 2 and outs:
            g, m, k, n = grouped_mm_dims(ins[0], ins[1], outs[0])
            flops = 2 * g * m * k * n
            rate = self._tensor_core_rate(ins, dtype)
        elif f is not None:
            try:
                flops = int(f(*args, **kwargs, out_val=out))
            except Exception as e:  # malformed args for the formula
                raise ValueError(f"cannot count FLOPs of {op}: {e}") from e
            rate = self._tensor_core_rate(ins, dtype)
        else:
            flops = sum(t.numel() for t in outs)
            rate = self._vector_flops
        compute_us = flops / rate * 1e6
        memory_us = nbytes / self._bw * 1e6
        fresh_us = fresh_pages_us(self.device, outs, dtype)
        total = max(compute_us, memory_us) + self._floor + fresh_us
        return {"flops": flops, "bytes": nbytes, "compute_us": compute_us,
                "memory_us": memory_us, "fresh_pages_us": fresh_us, "total_us": total}

    def _tensor_core_rate(self, ins: list[torch.Tensor], dtype: torch.dtype | None) -> float:
        dts = [t.dtype for t in ins if t.is_floating_point()]
        dt = dtype if (dtype is not None and dts) else (dts[0] if dts else torch.float32)
        key = DTYPE_KEY.get(dt, "fp32")
        if key == "fp32":
            key = "tf32" if self.fp32_matmul == "tf32" else "fp32"
        return self.device.peak_flops(key) * self.device.matmul_efficiency

    def _bytes(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
               dtype: torch.dtype | None) -> int:
        def size(t: torch.Tensor) -> int:
            return priced_nbytes(t, dtype)
        out_b = sum(size(t) for t in outs)
        if name in GATHER_OPS and ins:
            # read the gathered rows (= output size) and the indices, write the output
            return sum(size(t) for t in ins[1:]) + 2 * out_b
        return sum(size(t) for t in ins) + out_b

    def cache_info(self) -> int:
        return len(self._cache)


def priced_itemsize(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes per element of ``t`` priced at ``dtype`` (floating tensors) or its own element size."""
    return dtype.itemsize if (dtype is not None and t.is_floating_point()) else t.element_size()


def priced_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``t`` priced at ``dtype`` (see :func:`priced_itemsize`)."""
    return t.numel() * priced_itemsize(t, dtype)


def fresh_pages_us(device: DeviceSpec, outs: list[torch.Tensor], dtype: torch.dtype | None) -> float:
    """Time (µs) the first touch of ``outs``' fresh pages costs on ``device`` (a host allocator that
    maps large blocks afresh: ``DeviceSpec.fresh_pages_from_bytes``; 0 elsewhere)."""
    return sum(device.fresh_pages_us(priced_nbytes(t, dtype)) for t in outs)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(x: Any, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def _flatten_key(x: Any, parts: list, layout: bool) -> None:
    if isinstance(x, torch.Tensor):
        parts.append(x.shape)
        parts.append(x.dtype)
        if layout:
            if x.dim() >= 2 and not x.is_contiguous():
                parts.append(x.stride())
            if x.storage_offset():
                parts.append(("off", x.storage_offset()))
    elif isinstance(x, (tuple, list)):
        parts.append(len(x))
        for y in x:
            _flatten_key(y, parts, layout)
    elif isinstance(x, dict):
        for k in sorted(x):
            parts.append(k)
            _flatten_key(x[k], parts, layout)
    elif isinstance(x, (torch.SymInt, torch.SymFloat)):
        parts.append(str(x))
    else:
        parts.append(x)


def call_key(op: Any, args: tuple, kwargs: dict | None, out: Any, dtype: torch.dtype | None, *,
             layout: bool = False) -> tuple:
    """The cache key of one priced call: op, pricing dtype, argument and output shapes and dtypes,
    non-tensor arguments; with ``layout`` also strides and storage offsets (for models whose price
    depends on the memory layout)."""
    parts: list[Any] = [op, dtype]
    _flatten_key(args, parts, layout)
    if kwargs:
        for k in sorted(kwargs):
            parts.append(k)
            _flatten_key(kwargs[k], parts, layout)
    parts.append("->")
    _flatten_key(out, parts, layout)
    return tuple(parts)


def memoized_time_us(cache: dict, key: tuple, price: Callable[[], float]) -> float:
    """``cache[key]``, priced by ``price()`` on a miss; an unhashable key (a non-tensor argument
    that cannot be hashed) is priced every time."""
    try:
        hit = cache.get(key)
    except TypeError:
        return price()
    if hit is None:
        hit = cache[key] = price()
    return hit

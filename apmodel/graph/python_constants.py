"""Tensors a model builds from Python values in forward, made graph operators so capture keeps them.

Capture traces on the meta device. ``torch.tensor(-1e4, device=x.device)``, ``x[..., [-1]]``
(the index list becomes a tensor) or ``x.new_tensor([1, 2])`` then make a meta tensor in C++:
it has no value, and the tracer sees a tensor it did not create (torch's "Please convert all
Tensors to FakeTensors first"). GPT-Neo's attention mask value, Falcon's last-key index and
similar small constants do this. Under :class:`PythonDataAsFactories` such calls build the same
tensor from factory operators instead: ``full`` for a constant fill, ``arange`` for an evenly
spaced run, a ``stack`` of ``full`` scalars otherwise (up to :data:`MAX_ELEMENTS`). Those are
ordinary graph nodes whose arguments hold the values, so the planner places them and lowering
recreates them on the device the step runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

#: Largest constant built element by element (a stack of scalars); a larger one is an error that
#: names it: pass it to the model as an input or a buffer instead.
MAX_ELEMENTS = 1024


def _values(data: Any, where: str) -> np.ndarray:
    try:
        values = np.asarray(data)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"{where}: cannot read {data!r} as a tensor ({e})") from None
    if values.dtype == object:
        raise ValueError(f"{where}: {type(data).__name__} of non-numbers cannot be a graph constant")
    return values


def _inferred_dtype(values: np.ndarray) -> torch.dtype:
    """The dtype ``torch.tensor`` gives Python data of this kind."""
    kind = values.dtype.kind
    if kind == "b":
        return torch.bool
    if kind in "iu":
        return torch.int64
    if kind == "c":
        return torch.complex64 if torch.get_default_dtype() != torch.float64 else torch.complex128
    return torch.get_default_dtype()


def _on_meta(device: Any) -> bool:
    if device is None:
        return torch.get_default_device().type == "meta"
    return torch.device(device).type == "meta"


def constant_tensor(data: Any, dtype: torch.dtype | None, device: Any, where: str) -> torch.Tensor:
    """The tensor ``torch.tensor(data, dtype=dtype, device=device)`` made of factory operators."""
    values = _values(data, where)
    dtype = dtype or _inferred_dtype(values)
    shape = tuple(values.shape)
    flat = values.reshape(-1).tolist()
    if values.size == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if all(v == flat[0] for v in flat):
        return torch.full(shape, flat[0], dtype=dtype, device=device)
    if values.ndim == 1 and values.dtype.kind in "iu" and len(flat) > 1:
        step = flat[1] - flat[0]
        if step != 0 and all(b - a == step for a, b in zip(flat, flat[1:], strict=False)):
            return torch.arange(flat[0], flat[-1] + step, step, dtype=dtype, device=device)
    if values.size > MAX_ELEMENTS:
        raise ValueError(f"{where}: a constant of {values.size} elements (shape {list(shape)}) built in forward; "
                         f"capture records constants of up to {MAX_ELEMENTS}: pass it as an input or "
                         "register it as a buffer")
    scalars = [torch.full((), v, dtype=dtype, device=device) for v in flat]
    return torch.stack(scalars).reshape(shape)


def _index_item(item: Any, device: torch.device) -> Any:
    """A list or tuple-of-lists index item as a tensor of factory operators (basic items as they are)."""
    if isinstance(item, list):
        return constant_tensor(item, None, device, "an index list")
    return item


class PythonDataAsFactories(TorchFunctionMode):
    """While active, tensors made from Python data on the meta device are built from factory ops."""

    def __torch_function__(self, func: Any, types: Sequence[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            if _on_meta(kwargs.get("device")) and not kwargs.get("requires_grad", False):
                name = f"torch.{func.__name__}({_short(args[0])})"
                return constant_tensor(args[0], kwargs.get("dtype"), kwargs.get("device"), name)
        elif func is torch.Tensor.new_tensor and len(args) >= 2 and not isinstance(args[1], torch.Tensor):
            self_, data = args[0], args[1]
            if self_.device.type == "meta" and not kwargs.get("requires_grad", False):
                return constant_tensor(data, kwargs.get("dtype", self_.dtype), kwargs.get("device", self_.device),
                                       f"Tensor.new_tensor({_short(data)})")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2:
            self_, index = args[0], args[1]
            if self_.device.type == "meta" and _has_list(index):
                index = (tuple(_index_item(i, self_.device) for i in index) if isinstance(index, tuple)
                         else _index_item(index, self_.device))
                args = (self_, index, *args[2:])
        return func(*args, **kwargs)


def _has_list(index: Any) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _short(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 40 else text[:37] + "..."


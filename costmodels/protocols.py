"""Plug-in interfaces for cost models, and loading of user objects by dotted name."""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ComputeModel(Protocol):
    """Prices one ATen op on per-device (local) meta tensors, in µs.

    ``dtype``, when given, overrides the dtype of every floating-point tensor for pricing.
    Views and ``getitem`` must cost 0.
    """

    def time_us(self, op: Any, args: tuple, kwargs: dict, out: Any,
                dtype: Any = None) -> float: ...


@runtime_checkable
class CommModel(Protocol):
    """Prices one collective of ``nbytes`` (nccl-tests size) over one mesh axis, in µs.

    ``kind`` is one of "all_gather", "reduce_scatter", "all_reduce", "all_to_all",
    "broadcast"; an axis of size 1 costs 0. ``mesh_shape`` is needed by
    :func:`costmodels.redistribution_us`.
    """

    mesh_shape: tuple[int, ...]

    def time_us(self, kind: str, nbytes: float, axis: int) -> float: ...


def load_object(spec: str) -> Any:
    """Import ``"package.module:Name"`` (or ``"package.module:Outer.Inner"``) and return it."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"object spec must look like 'package.module:Name', got {spec!r}")
    mod_name, attr = spec.split(":")
    if not mod_name or not attr:
        raise ValueError(f"object spec must look like 'package.module:Name', got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod_name!r} of {spec!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{mod_name!r} has no attribute {attr!r} (from {spec!r})") from None
    return obj

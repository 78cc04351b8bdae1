"""The public API's arguments, checked before any tracing: each misuse named in one line that says
what to do (:func:`apmodel.plan`, :func:`apmodel.parallelize`, :func:`apmodel.build_model`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from apmodel.frontend.workloads import WorkloadError, parse_mesh
from apmodel.graph.capture import CapturedGraph


def mesh_shape_hint(mesh: Any) -> str:
    """How the user's mesh argument reads as a shape, for messages: ``(2, 2)``."""
    if isinstance(mesh, (tuple, list)) and all(isinstance(s, int) for s in mesh):
        return repr(tuple(mesh))
    if isinstance(mesh, str):
        try:
            return repr(parse_mesh(mesh, "mesh"))
        except WorkloadError:
            pass
    return "(2, 2)"


def mesh_shape_argument(mesh_shape: Any, where: str = "apmodel.plan") -> tuple[int, ...]:
    """``mesh_shape`` of :func:`plan`: a sequence of positive ints, or the CLI's ``"4x8"``."""
    if isinstance(mesh_shape, str):
        return parse_mesh(mesh_shape, "mesh_shape")
    if isinstance(mesh_shape, DeviceMesh):
        return tuple(mesh_shape.shape)
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in mesh_shape):
        raise TypeError(f"{where}: mesh_shape must be axis sizes such as (4, 8) or \"4x8\", "
                        f"got {type(mesh_shape).__name__} {mesh_shape!r}")
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"{where}: mesh_shape {tuple(mesh_shape)!r} must be one or more positive axis sizes")
    return tuple(mesh_shape)


def check_step_arguments(where: str, model: Any, sample_inputs: Any, loss_fn: Any, kwargs: Any, targets: Any, *,
                          allow_captured: bool) -> None:
    """The model, inputs, loss and keyword inputs of a step, checked before any tracing."""
    if not isinstance(model, nn.Module) and not (allow_captured and isinstance(model, CapturedGraph)):
        raise TypeError(f"{where}: model must be a torch.nn.Module"
                        f"{' (or a captured graph)' if allow_captured else ''}, got {type(model).__name__}")
    for name, value in (("sample_inputs", sample_inputs), ("targets", targets)):
        if value is None and name == "targets":
            continue
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tuple of the model's positional inputs, got a single "
                            f"Tensor of shape {tuple(value.shape)}: pass ({name.rstrip('s')},) instead")
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{where}: {name} must be a tuple or list, got {type(value).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be callable (e.g. torch.nn.functional.cross_entropy), "
                        f"got {type(loss_fn).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{where}: kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")


def check_parallelize_target(model: Any, mesh: Any, lowering: str, lowerings: Sequence[str]) -> None:
    """:func:`apmodel.parallelize`'s ``lowering`` one of ``lowerings``, its ``mesh`` a real
    DeviceMesh, and its ``model`` not parallelized already."""
    if lowering not in lowerings:
        raise ValueError(f"lowering={lowering!r}: expected one of {', '.join(map(repr, lowerings))}")
    if not isinstance(mesh, DeviceMesh):
        shape = mesh_shape_hint(mesh)
        raise TypeError(
            f"apmodel.parallelize: mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__} {mesh!r}. "
            f"Make one on every rank after torch.distributed.init_process_group: "
            f"torch.distributed.device_mesh.init_device_mesh('cuda', {shape}) ('cpu' with gloo); to plan without "
            f"processes, call apmodel.plan(model, {shape}, sample_inputs)")
    if getattr(model, "_apmodel_program", None) is not None:
        raise ValueError(f"apmodel.parallelize: this {type(model).__name__} has already been parallelized; "
                         "parallelize the original single-device module (or a fresh one built on meta)")

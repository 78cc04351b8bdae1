"""Small helpers shared by test modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, loaded once. Loaded by path: the folder also holds a
    ``costmodels.py``, which would shadow the package if the folder were put on ``sys.path``."""
    key = f"_apmodel_benchmark_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s parameters and buffers (persistent or not) by name: the global values
    to load into a parallelized twin (``apmodel.lowering.load_full_state_dict``)."""
    return {k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())}


class SavedStorages:
    """Bytes of the distinct storages noted (parameters' own excluded): pass :meth:`note` as the
    pack hook of ``torch.autograd.graph.saved_tensors_hooks`` to count what a forward saves."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._bytes: dict[int, int] = {}

    def note(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._params:
            self._bytes[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes.values())


def assert_same_training(got: dict[str, Any], want: dict[str, Any], name: str, rtol: float) -> None:
    """``got`` and ``want`` ({"losses": [...], "grads": {name: full tensor}}) agree: losses to
    ``rtol``, every gradient to ``rtol`` of its largest entry (1e-7 absolute below that)."""
    import pytest

    assert got["losses"] == pytest.approx(want["losses"], rel=rtol), name
    assert got["grads"].keys() == want["grads"].keys() and want["grads"], name
    for k, g in want["grads"].items():
        scale = max(float(g.abs().max()), 1e-12)
        assert float((got["grads"][k] - g).abs().max()) <= rtol * scale + 1e-7, (name, k)


def losses_and_first_grads(model: nn.Module, call: Callable[[nn.Module], torch.Tensor], steps: int) -> dict[str, Any]:
    """Losses of ``steps`` AdamW steps (lr 1e-2) on ``call(model)``, and the whole gradient of every
    parameter after the first (DTensors read whole)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], {}
    for step in range(steps):
        loss = call(model)
        loss.backward()
        if step == 0:
            grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(whole_value(loss.detach()))
    return {"losses": losses, "grads": grads}


def whole_value(x: Any) -> float:
    """A scalar loss as a float, read whole where it is a DTensor."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def train(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], steps: int,
          optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> list[float]:
    """The losses of ``steps`` optimizer steps on ``loss_of(model)`` (AdamW, lr 1e-2, unless
    ``optimizer(params)`` says otherwise); a DTensor loss is read whole."""
    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(whole_value(loss.detach()))
    return losses

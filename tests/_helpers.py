"""Small helpers shared by test modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

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
        losses.append(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()))
    return losses

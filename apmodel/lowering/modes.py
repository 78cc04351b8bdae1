"""A model's modes: the state that changes its step's graph without changing its code.

A lowered program is traced in the modes the model was in (:class:`ModelModes`); a step run in
other modes (a module switched to eval, a parameter frozen) is the plan replayed on another graph
(:meth:`apmodel.lowering.program.LoweredProgram.for_inputs`), and the modes say what changed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch.nn as nn


@dataclass(frozen=True)
class ModelModes:
    """What of a model's state changes its step's graph without changing its code: ``training``
    of each module (``modules()`` order: BatchNorm's statistics, dropout) and ``requires_grad``
    of each parameter (``parameters()`` order: which gradients the step computes)."""

    training: tuple[bool, ...]
    trainable: tuple[bool, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "ModelModes":
        return cls(tuple(m.training for m in model.modules()), tuple(p.requires_grad for p in model.parameters()))

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Any:
        """``model`` (a structural copy of the model these modes were read from) in these modes
        while inside, restored after."""
        before = ModelModes.of(model)
        try:
            self._set(model)
            yield
        finally:
            before._set(model)

    def _set(self, model: nn.Module) -> None:
        for m, training in zip(model.modules(), self.training, strict=True):
            m.training = training
        for p, trainable in zip(model.parameters(), self.trainable, strict=True):
            p.requires_grad_(trainable)

    def describe(self, model: nn.Module, planned: "ModelModes | None") -> str:
        """How these modes differ from ``planned``'s, in words (modules and parameters named)."""
        changes = []
        if planned is None or planned.training != self.training:
            evaluating = [f"{name or '<root>'} ({type(m).__name__})"
                          for (name, m), training in zip(model.named_modules(), self.training, strict=True) if not training]
            changes.append(f"{len(evaluating)} module(s) in eval mode" + _some(evaluating))
        if planned is not None and planned.trainable != self.trainable:
            named = [name for name, _ in model.named_parameters()]
            frozen = [n for n, now, then in zip(named, self.trainable, planned.trainable, strict=True) if then and not now]
            thawed = [n for n, now, then in zip(named, self.trainable, planned.trainable, strict=True) if now and not then]
            if frozen:
                changes.append(f"{len(frozen)} parameter(s) frozen since planning" + _some(frozen))
            if thawed:
                changes.append(f"{len(thawed)} parameter(s) unfrozen since planning" + _some(thawed))
        return "; ".join(changes)


def _some(names: Sequence[str], shown: int = 3) -> str:
    return f" ({', '.join(names[:shown])}{', ...' if len(names) > shown else ''})" if names else ""

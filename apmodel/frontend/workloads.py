"""What to plan: a model, its sample inputs and loss, and the mesh, as one :class:`Workload`.

A workload comes from Python (``apmodel.plan(model, mesh, inputs, ...)``) or from a name
(:func:`load_workload`): a preset of :mod:`apmodel.models` or ``package.module:factory``, a
callable returning ``(model, sample_inputs)`` or ``(model, sample_inputs, loss_fn)``, called inside
``torch.device("meta")`` with those of the keyword arguments ``batch``, ``seq``, ``layers`` its
signature accepts. Without ``loss_fn`` the model's output must be the scalar loss (or take a loss
from the model's own labels).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from apmodel.core.option_spec import OptionSpec

if TYPE_CHECKING:  # torch is imported where a model is built: parsing a mesh stays light
    import torch
    import torch.nn as nn

    from apmodel.graph.capture import CapturedGraph

#: Workload defaults of the command line (the Python API takes the inputs it is given).
DEFAULT_SEQ = 2048
DEFAULT_BATCH = 8


def _workload_key(name: str, help: str, **spec: Any) -> OptionSpec:
    return OptionSpec(help=help, name=name, group="workload", **spec)


#: What to plan, declared once: the ``[workload]`` keys of a configuration file and the flags of
#: ``apmodel plan`` that give them (``--model``, ``--mesh``, ...); not planning options.
WORKLOAD_KEYS: dict[str, OptionSpec] = {s.name: s for s in (
    _workload_key("model", "Preset (llama3-8b, llama3-debug, gpt2, moe-debug, ...), package.module:factory returning "
                           "(model, sample_inputs[, loss_fn]), or a Hugging Face model built from its config: "
                           "hf:gpt2-medium, hf:bert-base, hf:llama-2-7b, ... or hf:/path/to/config.json (needs "
                           "pip install -e '.[hf]')."),
    _workload_key("mesh", "Mesh shape, axis sizes joined by 'x': 8, 4x8, 4x2x4, 2x2x2x4."),
    _workload_key("seq", "Sequence length.", kind="int", range="[1, inf)",
                  default_doc=f"{DEFAULT_SEQ}, or the preset's position table when shorter"),
    _workload_key("batch", "Global batch size.", kind="int", range="[1, inf)", default_doc=str(DEFAULT_BATCH)),
    _workload_key("layers", "Override the preset's number of layers (quick runs).", kind="int", range="[1, inf)"),
)}

#: Largest mesh accepted: checked on the axis sizes before anything is allocated.
MAX_MESH_AXES = 4
MAX_MESH_DEVICES = 2**20


class WorkloadError(ValueError):
    """A workload cannot be built: the message names the model spec or mesh text."""


class TraceFailed(Exception):
    """Building or tracing the training step of a named workload failed.

    ``model`` is the spec the user gave, ``what`` the step that failed, ``cause`` what it raised
    (also chained as ``__cause__``), so that front ends can describe it (data-dependent op, missing rule...)."""

    def __init__(self, model: str, what: str, cause: BaseException) -> None:
        super().__init__(f"model {model!r}: {what}: {type(cause).__name__}: {cause}")
        self.model = model
        self.what = what
        self.cause = cause


def parse_mesh(text: str, flag: str = "--mesh") -> tuple[int, ...]:
    """``"4x8"`` (or ``"4,8"``, ``"8"``) -> ``(4, 8)``; 1 to 4 positive axis sizes, at most 2**20 devices."""
    parts = text.lower().replace(",", "x").replace("×", "x").split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        raise WorkloadError(f"{flag} {text!r}: expected axis sizes joined by 'x', e.g. 8, 4x8 or 2x2x2x4") from None
    if any(s < 1 for s in sizes):
        raise WorkloadError(f"{flag} {text!r}: expected positive axis sizes, e.g. 4x8")
    if len(sizes) > MAX_MESH_AXES:
        raise WorkloadError(f"{flag} {text!r}: {len(sizes)} axes; at most {MAX_MESH_AXES} are supported, e.g. 2x2x2x4")
    devices = math.prod(sizes)
    if devices > MAX_MESH_DEVICES:
        raise WorkloadError(f"{flag} {text!r}: {devices:,} devices; at most {MAX_MESH_DEVICES:,} (2**20) are supported")
    return sizes


@dataclass
class Workload:
    """One training step to plan: ``loss_fn(model(*sample_inputs, **kwargs), *targets)`` on a mesh.

    ``record`` says how to build it again (``model`` spec, ``batch``, ``seq``, ``layers``) and
    becomes part of the plan file's ``workload`` record; empty for a module given from Python
    that is not a preset. ``model`` may also be a step already traced (a ``CapturedGraph``), whose
    inputs and loss it holds."""

    model: nn.Module | CapturedGraph
    mesh_shape: tuple[int, ...]
    sample_inputs: tuple[Any, ...] = ()
    loss_fn: Callable[..., torch.Tensor] | None = None
    kwargs: Mapping[str, Any] | None = None
    targets: Sequence[Any] | None = None
    allow_unused_parameters: bool = False
    record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(int(s) for s in self.mesh_shape)
        if not self.mesh_shape or any(s < 1 for s in self.mesh_shape):
            raise WorkloadError(f"mesh {self.mesh_shape}: expected one or more positive axis sizes")

    @property
    def name(self) -> str:
        traced = getattr(self.model, "workload", None)  # a CapturedGraph of a preset knows its name
        preset = traced.get("model") if isinstance(traced, dict) else None
        return str(self.record.get("model") or preset or type(self.model).__name__)


def default_seq(spec: str | None) -> int:
    """The sequence length a run plans when none is given: :data:`DEFAULT_SEQ`, or the preset's
    position table when that is shorter (``llama3-debug`` holds 512, GPT-2 1,024)."""
    from apmodel import models

    if spec is not None and spec in models.PRESETS:
        return min(DEFAULT_SEQ, int(getattr(models.config(spec), "max_seq_len", DEFAULT_SEQ)))
    return DEFAULT_SEQ


def load_workload(spec: str, mesh_shape: Sequence[int], *, batch: int, seq: int, layers: int | None = None) -> Workload:
    """The :class:`Workload` of a preset name, a ``package.module:factory`` spec or an ``hf:`` spec
    (a Hugging Face model from its config, :mod:`apmodel.frontend.hf`), on the meta device.

    A factory's module must be importable (the CLI puts the working directory on ``sys.path``);
    an exception raised by the factory becomes :class:`TraceFailed` naming it."""
    import torch

    if spec.startswith("hf:"):  # a Hugging Face model from its config (apmodel.frontend.hf)
        from apmodel.frontend import hf

        try:
            step = hf.training_step(spec, batch=batch, seq=seq, layers=layers)
        except hf.HFSpecError as e:
            raise WorkloadError(str(e)) from None
        return Workload(step.model, tuple(mesh_shape), step.sample_inputs, step.loss_fn, kwargs=step.kwargs,
                        record={"model": spec, "batch": batch, "seq": step.seq, "layers": layers})
    record = {"model": spec, "batch": batch, "seq": seq, "layers": layers}
    if ":" in spec:
        import costmodels  # its object loader reads "package.module:name"

        factory = costmodels.load_object(spec)
        if not callable(factory):
            raise WorkloadError(f"model {spec!r} is not callable")
        accepted = inspect.signature(factory).parameters
        kwargs = {k: v for k, v in (("batch", batch), ("seq", seq), ("layers", layers))
                  if k in accepted and v is not None}
        try:
            with torch.device("meta"):
                out = factory(**kwargs)
        except Exception as e:  # user code: say which factory failed, and how
            raise TraceFailed(spec, "the factory raised", e) from e
        if not isinstance(out, tuple) or len(out) not in (2, 3) or not isinstance(out[0], torch.nn.Module):
            raise WorkloadError(f"model {spec!r} must return (model, sample_inputs) or (model, sample_inputs, "
                                f"loss_fn), got {type(out).__name__}")
        inputs = tuple(out[1]) if isinstance(out[1], (tuple, list)) else (out[1],)
        return Workload(out[0], tuple(mesh_shape), inputs, out[2] if len(out) == 3 else None, record=record)
    from apmodel import models

    if spec not in models.PRESETS:
        raise WorkloadError(f"model {spec!r} is neither a preset ({', '.join(sorted(models.PRESETS))}) "
                            "nor 'package.module:factory'")
    overrides = {"n_layers": layers} if layers is not None else {}
    cfg = models.config(spec, **overrides)
    with torch.device("meta"):
        module = models.build(cfg)
    return Workload(module, tuple(mesh_shape), models.sample_inputs(cfg, batch=batch, seq=seq), record=record)

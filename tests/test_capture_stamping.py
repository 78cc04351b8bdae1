"""Capture of repeated layers: a stack of identical layers is traced with three layers and the
others are stamped (apmodel/graph/stamping.py, ``_trace_stamped``). The stamped graph must be the graph
of tracing every layer: the same nodes and names, wiring, values, descriptors and module
metadata, the same labels and fingerprint, and the same plan."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from apmodel.entry.api import plan
from apmodel.graph import stamping, tracing
from apmodel.graph.capture import CapturedGraph, InputSignature, capture
from apmodel.models import build, sample_inputs

B, S = 2, 32

#: node metadata that later stages read (``seq_nr`` is autograd's process-wide counter: it differs
#: between two traces of the same model in one process, and nothing reads it)
META_KEYS = ("nn_module_stack", "fwd_nn_module_stack", "desc", "partitioner_tag", "autograd_backward",
             "is_gradient_acc", "original_aten", "stack_trace")
LABELS = ("roles", "param_fqn", "buffer_fqn", "input_index", "signature", "tied_params", "buffer_update",
          "param_grad", "input_grad", "output_tangent", "is_backward", "fingerprint", "unsupported_ops", "stats")


def _value(v):
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype, tuple(v.stride())
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return repr(v)


def graph_record(gm: fx.GraphModule) -> list[tuple]:
    """Everything a node is, with nodes named, for an exact comparison of two graphs."""
    def named(a):
        return fx.node.map_arg(a, lambda n: f"%{n.name}")

    return [
        (n.name, n.op, str(n.target), repr(named(n.args)), repr(named(n.kwargs)), _value(n.meta.get("val")),
         tuple(repr(n.meta.get(k)) for k in META_KEYS))
        for n in gm.graph.nodes
    ]


def _both(name: str, layers: int, monkeypatch, stacked: int | None = None) -> tuple[CapturedGraph, CapturedGraph]:
    """(stamped, fully traced) captures of preset ``name`` with ``layers`` layers, ``stacked`` of
    them (default all) in the stamped stack."""
    with torch.device("meta"):
        model = build(name, n_layers=layers)
    inputs = sample_inputs(name, B, S)
    calls: list[str] = []
    real = stamping._Template.stamp

    def counting(self, n):
        calls.append(n)
        return real(self, n)

    monkeypatch.setattr(stamping._Template, "stamp", counting)
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 4)
    stamped = capture(model, inputs)
    assert calls == [stacked or layers], "the stack was not stamped"
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    full = capture(model, inputs)
    assert calls == [stacked or layers]
    return stamped, full


def assert_same_capture(a: CapturedGraph, b: CapturedGraph) -> None:
    ra, rb = graph_record(a.gm), graph_record(b.gm)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):
        assert x == y
    for label in LABELS:
        assert getattr(a, label) == getattr(b, label), label


# the MoE models: layer 0 dense, traced as it is
@pytest.mark.parametrize("name, layers, stacked", [("llama3-debug", 4, 4), ("llama3-debug", 7, 7), ("gpt2", 5, 5),
                                                  ("moe-debug", 6, 5), ("deepseek-v3-debug", 6, 5)])
def test_stamped_graph_is_the_traced_graph(name, layers, stacked, monkeypatch):
    stamped, full = _both(name, layers, monkeypatch, stacked)
    assert_same_capture(stamped, full)
    # the stamped module runs: its code is generated from the stamped graph
    assert "def forward" in stamped.gm.code


def test_stamped_plan_is_the_traced_plan(monkeypatch):
    stamped, full = _both("llama3-debug", 5, monkeypatch)
    plans = [plan(cg, (2, 2)) for cg in (stamped, full)]
    assert plans[0].objective_us == plans[1].objective_us
    assert plans[0].node_strategy == plans[1].node_strategy
    assert plans[0].param_placements == plans[1].param_placements
    assert plans[0].fingerprint == plans[1].fingerprint


def test_template_stamps_fewer_layers_as_traced(monkeypatch):
    """The template of three layers stamped down to two is the trace of two layers (the first
    and the last layer meet without a middle one)."""
    def raw(layers):
        with torch.device("meta"):
            model = build("llama3-debug", n_layers=layers)
        step = tracing.TracedStep(model, None, InputSignature(n_args=2))
        return tracing.trace(step, sample_inputs("llama3-debug", B, S), functionalize=False)[0]

    stack = stamping._LayerStack("layers", ["0", "1", "2"])
    two = stamping._Template(raw(3), stack).stamp(2)
    assert graph_record(two) == graph_record(raw(2))


class _Scaled(nn.Module):
    def __init__(self, dim: int, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale + x


class _Stack(nn.Module):
    """Identical layers whose forward may depend on the layer's position or on their number."""

    def __init__(self, n: int, by_index: bool = False, by_count: bool = False, every: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            _Scaled(16, (2.0 if i % every == every - 1 else 1.0) if by_index else 1.0) for i in range(n)
        )
        self.by_count = by_count
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
            if self.by_count:
                x = x / len(self.layers)
        return self.head(x).sum()


@pytest.mark.parametrize("kind", ["plain", "by_index", "by_count"])
def test_layers_that_differ_are_traced(kind, monkeypatch, caplog):
    """Layers whose forward depends on their position (every 4th layer differs: invisible to a
    trace of three layers) or on the number of layers are traced in full; identical ones are
    stamped. Both give the graph of the full trace."""
    with torch.device("meta"):
        model = _Stack(8, by_index=kind == "by_index", by_count=kind == "by_count")
    x = torch.empty(4, 16, device="meta")
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 4)
    with caplog.at_level("INFO", logger="apmodel.graph.capture"):
        a = capture(model, (x,))
    stamped = "stamped the others" in caplog.text
    assert stamped == (kind == "plain"), caplog.text
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    assert_same_capture(a, capture(model, (x,)))


def test_small_or_unequal_stacks_are_not_stamped():
    with torch.device("meta"):
        llama = build("llama3-debug", n_layers=5)
    assert stamping._repeated_stack(llama) is None  # fewer than _STAMP_MIN_LAYERS
    with torch.device("meta"):
        model = _Stack(8)
    model.layers[3] = nn.Sequential(nn.Linear(16, 16))
    assert stamping._repeated_stack(model) is None  # 4 identical layers after the odd one
    # differing layers ahead of a long enough run stay outside it (DeepSeek-MoE's dense first layer)
    with torch.device("meta"):
        model = _Stack(9)
    model.layers[1] = nn.Sequential(nn.Linear(16, 16))
    stack = stamping._repeated_stack(model)
    assert stack.before == ("0", "1") and stack.keys == tuple(map(str, range(2, 9)))
    # a differing last layer: no stack (the truncated template would lose it)
    with torch.device("meta"):
        model = _Stack(9)
    model.layers[8] = nn.Sequential(nn.Linear(16, 16))
    assert stamping._repeated_stack(model) is None
    with torch.device("meta"):
        deepseek = build("deepseek-moe-16b")
    stack = stamping._repeated_stack(deepseek)
    assert stack.path == "layers" and stack.before == ("0",) and len(stack.keys) == 27


class _NormLayer(nn.Module):
    """A layer with a buffer updated in place (BatchNorm's running statistics): traced with
    functionalization, the update is a graph output per layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.lin(x)))


class _NormStack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.layers = nn.Sequential(*(_NormLayer(16) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.proj(x)).square().mean()


@pytest.mark.parametrize("functionalize", [None, True])
def test_buffer_updates_and_functionalized_traces_are_stamped(functionalize, monkeypatch, caplog):
    with torch.device("meta"):
        model = _NormStack(7)
    x = torch.empty(8, 16, device="meta")
    with caplog.at_level("INFO", logger="apmodel.graph.capture"):
        a = capture(model, (x,), functionalize=functionalize)
    assert "stamped the others" in caplog.text
    assert len(a.buffer_update) == 7 * 3  # running mean, running var, batches tracked per layer
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    assert_same_capture(a, capture(model, (x,), functionalize=functionalize))


@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:llama-2-7b", "hf:bert-base"])
def test_hugging_face_stacks_are_stamped(spec, monkeypatch, caplog):
    pytest.importorskip("transformers")
    from apmodel.frontend.workloads import load_workload

    wl = load_workload(spec, (2,), batch=B, seq=S, layers=6)

    def trace() -> CapturedGraph:
        return capture(wl.model, wl.sample_inputs, wl.loss_fn, kwargs=wl.kwargs, targets=wl.targets,
                       allow_unused_parameters=wl.allow_unused_parameters)

    with caplog.at_level("INFO", logger="apmodel.graph.capture"):
        stamped = trace()
    assert "stamped the others" in caplog.text  # six layers: stamped at the default threshold
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    assert_same_capture(stamped, trace())


class _Windowed(nn.Module):
    """Identical layers that read a window of their input whose size depends on the layer's index
    (set after construction, as a config-driven model would): visible only in a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.window = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        y[:, : self.window] = self.lin(x)[:, : self.window]
        return x + y


@pytest.mark.parametrize("window", [16, 8])
def test_layers_differing_in_a_slice_are_traced(window, monkeypatch, caplog):
    with torch.device("meta"):
        model = _Stack(8)
        model.layers = nn.ModuleList(_Windowed() for _ in range(8))
    model.layers[6].window = window
    x = torch.empty(4, 16, device="meta")
    with caplog.at_level("INFO", logger="apmodel.graph.capture"):
        a = capture(model, (x,))
    assert ("stamped the others" in caplog.text) == (window == 16)
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    assert_same_capture(a, capture(model, (x,)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("layers", [6, 9])
def test_a_first_layer_without_input_gradient_is_stamped(layers, monkeypatch, caplog):
    """The model is the stack (an ``nn.Sequential``), and its first layer reads the raw input, so
    its backward has no input gradient and is shorter than the others': stamped all the same."""
    with torch.device("meta"):
        model = nn.Sequential(*(_Block() for _ in range(layers)))
    x, y = torch.empty(4, 16, device="meta"), torch.empty(4, 16, device="meta")

    def loss(out, target):
        return ((out - target) ** 2).mean()

    with caplog.at_level("INFO", logger="apmodel.graph.capture"):
        a = capture(model, (x,), loss, targets=(y,))
    assert "stamped the others" in caplog.text
    monkeypatch.setattr(stamping, "_STAMP_MIN_LAYERS", 10**9)
    assert_same_capture(a, capture(model, (x,), loss, targets=(y,)))

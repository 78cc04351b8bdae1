"""Models apmodel was not written for, planned on a (2, 2) mesh and trained 3 steps on a real
4-process gloo mesh against the same model trained on one device (fp32, loss rel 1e-5).

The zoo (``tests/zoo_models.py``): a CNN with BatchNorm and ``nn.CrossEntropyLoss`` (buffer updates
written back), an ``nn.TransformerEncoder`` classifier, a language model whose output layer is tied
to its embedding (``F.cross_entropy``; the tie must survive), a model with frozen parameters, and
a model called with keyword inputs. Planning runs once in the test process on the meta device; the
plans travel to the workers as JSON files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import apmodel
from apmodel.graph.capture import capture
from apmodel.result.plans import Plan

from _dist_utils import run_distributed
from _helpers import full_weights
from zoo_models import ZOO

MESH = (2, 2)
STEPS = 3
LOSS_RTOL = 1e-5
CASES = {c.name: c for c in ZOO}


def _meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _capture(case):
    args, kwargs, targets = case.step_inputs()
    with torch.device("meta"):
        model = case.build()
    return capture(
        model, tuple(map(_meta, args)), case.loss_fn,
        kwargs={k: _meta(v) for k, v in kwargs.items()}, targets=tuple(map(_meta, targets)),
    )


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoo_plans")
    for case in ZOO:
        plan = apmodel.plan(_capture(case), MESH, device="h100")
        plan.save(out / f"{case.name}.json")
    # the replay test also runs a plan made with activation checkpointing
    apmodel.plan(_capture(CASES["tied_lm"]), MESH, device="h100", ac="selective").save(out / "tied_lm-selective.json")
    return out


def _worker(rank: int, world: int, plan_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from apmodel.lowering import load_full_state_dict, lower

    mesh = dist.init_device_mesh("cpu", MESH)
    results: dict[str, Any] = {}
    for case in ZOO:
        args, kwargs, targets = case.step_inputs()
        ref = case.seeded()
        full = full_weights(ref)
        with torch.device("meta"):
            model = case.build()
        plan = Plan.load(Path(plan_dir) / f"{case.name}.json")
        model = lower(model, mesh, plan, _capture(case))
        model.to_empty(device="cpu")
        load_full_state_dict(model, full)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trained, lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        losses, ref_losses = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = model(*args, *targets, **kwargs)
            loss.backward()
            opt.step()
            ref_opt.zero_grad()
            ref_loss = case.loss_fn(ref(*args, **kwargs), *targets)
            ref_loss.backward()
            ref_opt.step()
            losses.append(loss.full_tensor().item())
            ref_losses.append(ref_loss.item())
        r: dict[str, Any] = {"losses": losses, "ref_losses": ref_losses}
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        ref_state = ref.state_dict()
        r["keys_equal"] = list(state) == list(ref_state)
        r["state_err"] = {
            k: (state[k].double() - ref_state[k].double()).abs().max().item() for k in ref_state if k in state
        }
        r["frozen_unchanged"] = all(
            torch.equal(state[k], full[k]) for k, p in ref.named_parameters() if not p.requires_grad
        )
        if case.name == "tied_lm":
            r["tied"] = model.head.weight is model.tok.weight
        results[case.name] = r
    return results


@pytest.fixture(scope="module")
def zoo_results(plan_dir) -> dict[str, Any]:
    return run_distributed(_worker, 4, str(plan_dir), timeout_s=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_trains_like_one_device(zoo_results, name):
    r = zoo_results[name]
    for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=False)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (name, step, got, want)
    assert r["keys_equal"]
    worst = max(r["state_err"].values())
    assert worst < 1e-4, (name, {k: v for k, v in r["state_err"].items() if v >= 1e-4})
    assert r["frozen_unchanged"]


@pytest.mark.slow
def test_batchnorm_statistics_are_written_back(zoo_results):
    err = zoo_results["cnn_batchnorm"]["state_err"]
    assert err["bn.num_batches_tracked"] == 0
    assert err["bn.running_mean"] < 1e-6 and err["bn.running_var"] < 1e-6


@pytest.mark.slow
def test_tied_weights_stay_tied(zoo_results):
    assert zoo_results["tied_lm"]["tied"]


def test_tied_parameter_is_one_variable_with_summed_gradient():
    captured = _capture(CASES["tied_lm"])
    fqns = sorted(captured.param_fqn.values())
    assert "head.weight" not in fqns and "tok.weight" in fqns
    (node,) = [n for n, f in captured.param_fqn.items() if f == "tok.weight"]
    assert captured.tied_params == {node: ["head.weight"]}
    grad = next(n for n in captured.gm.graph.nodes if n.name == captured.param_grad[node])
    assert grad.target is torch.ops.aten.add.Tensor  # embedding gradient + output-layer gradient


def test_standard_losses_trace_their_backward_on_meta():
    """F.cross_entropy, nn.CrossEntropyLoss, F.nll_loss: the meta trace has the same ops as a CPU trace."""
    losses = {
        "F.cross_entropy": torch.nn.functional.cross_entropy,
        "nn.CrossEntropyLoss": torch.nn.CrossEntropyLoss(),
        "F.nll_loss": lambda out, y: torch.nn.functional.nll_loss(torch.log_softmax(out, -1), y),
    }
    x = torch.randn(BATCH := 8, 16)
    y = torch.randint(0, 4, (BATCH,))
    for name, loss in losses.items():
        ops = {}
        for device in ("meta", "cpu"):
            with torch.device(device):
                torch.manual_seed(0)
                model = torch.nn.Linear(16, 4)
            c = capture(model, (x.to(device),), loss, targets=(y.to(device),))
            ops[device] = [str(n.target) for n in c.gm.graph.nodes if n.op == "call_function"]
            assert len(c.param_grad) == 2, (name, device)
            assert c.stats["backward"] > 0, (name, device)
        assert ops["meta"] == ops["cpu"], name


def test_parameter_without_gradient_is_an_error_unless_allowed():
    class Unused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    with torch.device("meta"):
        model = Unused()
    x = torch.randn(2, 4, device="meta")
    with pytest.raises(ValueError, match=r"unused\.bias, unused\.weight.*allow_unused_parameters"):
        capture(model, (x,), lambda out, x: out.sum())
    c = capture(model, (x,), lambda out, x: out.sum(), allow_unused_parameters=True)
    assert sorted(c.param_grad) != sorted(c.param_fqn)
    model.unused.requires_grad_(False)  # frozen: fine
    capture(model, (x,), lambda out, x: out.sum())


def test_keyword_inputs_are_checked_at_call_time(plan_dir):
    from apmodel.graph.capture import InputSignature

    sig = _capture(CASES["keyword_inputs"]).signature
    assert sig == InputSignature(n_args=1, kwarg_names=("mask",), constant_kwargs=(("scale", 0.5),), n_targets=1)
    args, kwargs, targets = CASES["keyword_inputs"].step_inputs()
    flat = sig.flatten((*args, *targets), kwargs, "f")
    assert flat[1] is kwargs["mask"] and flat[2] is targets[0]
    with pytest.raises(ValueError, match="missing \\['mask'\\]"):
        sig.flatten((*args, *targets), {"scale": 0.5}, "f")
    with pytest.raises(ValueError, match="'scale' is 2.0; it was traced as the constant 0.5"):
        sig.flatten((*args, *targets), {**kwargs, "scale": 2.0}, "f")
    with pytest.raises(ValueError, match="1 model argument\\(s\\) \\+ 1 target"):
        sig.flatten(args, kwargs, "f")


def _plan_then_train_worker(rank: int, world: int) -> dict[str, Any]:
    """What a training script under torchrun does: plan first (before any process group exists),
    then initialise the real group and mesh, then parallelize with the plan and train."""
    import os

    import torch.distributed as dist

    from apmodel.lowering import load_full_state_dict
    from apmodel.models import build, config, sample_inputs

    cfg = dict(n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=8)
    tokens, targets = sample_inputs(config("llama3-debug", **cfg), 4, 8, device="cpu", generator=torch.Generator().manual_seed(3))
    with torch.device("meta"):
        meta_model = build("llama3-debug", **cfg)
    plan = apmodel.plan(meta_model, MESH, (tokens.to("meta"), targets.to("meta")))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=os.environ["APMODEL_TEST_INIT_METHOD"], rank=rank, world_size=world)
    mesh = dist.init_device_mesh("cpu", MESH)
    torch.manual_seed(0)
    ref = build("llama3-debug", **cfg)
    ref.init_weights()
    full = full_weights(ref)
    with torch.device("meta"):
        model = build("llama3-debug", **cfg)
    model = apmodel.parallelize(model, mesh, (tokens, targets), plan=plan)
    model.to_empty(device="cpu")
    load_full_state_dict(model, full)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        losses.append(loss.full_tensor().item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "backend": dist.get_backend(), "rank": dist.get_rank()}


@pytest.mark.slow
def test_plan_before_process_group_then_train_matches_one_device():
    results = run_distributed(_plan_then_train_worker, 4, timeout_s=600, init_group=False)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["backend"] == "gloo"
        for got, want in zip(r["losses"], r["ref_losses"], strict=False):
            assert abs(got - want) <= LOSS_RTOL * abs(want), (got, want)


def _other_shapes_worker(rank: int, world: int, plan_dir: str, ac: str) -> dict[str, Any]:
    """The lowered module replays its plan on other batch and sequence sizes; the losses equal one
    device's, and a batch the plan cannot divide is refused with a clear error. With activation
    checkpointing the step traced at the new shapes is checkpointed the same way."""
    import torch.distributed as dist

    from apmodel.graph.checkpointing import checkpoint
    from apmodel.lowering import load_full_state_dict, lower

    mesh = dist.init_device_mesh("cpu", MESH)
    case = CASES["tied_lm"]
    torch.manual_seed(0)
    ref = case.build()
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        model = case.build()
    name = "tied_lm.json" if ac == "none" else f"tied_lm-{ac}.json"
    model = lower(model, mesh, Plan.load(Path(plan_dir) / name), checkpoint(_capture(case), ac))
    model.to_empty(device="cpu")
    load_full_state_dict(model, full)
    g = torch.Generator().manual_seed(11)
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for batch, seq in [(4, 6), (8, 3), (16, 2), (8, 6)]:  # (8, 6) is the traced shape
        tokens = torch.randint(0, 64, (batch, seq), generator=g)
        labels = torch.randint(0, 64, (batch, seq), generator=g)
        loss = model(tokens, labels)
        loss.backward()
        ref_loss = case.loss_fn(ref(tokens), labels)
        ref_loss.backward()
        out["losses"].append(loss.full_tensor().item())
        out["ref_losses"].append(ref_loss.item())
    out["grad_err"] = max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=False)
    )
    out["variants"] = len(model._apmodel_program.variants)
    try:
        model(torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long))
        out["odd_batch_error"] = None
    except ValueError as e:
        out["odd_batch_error"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_lowered_module_replays_its_plan_on_other_batch_and_sequence_sizes(plan_dir, ac):
    r = run_distributed(_other_shapes_worker, 4, str(plan_dir), ac, timeout_s=600)[0]
    for got, want in zip(r["losses"], r["ref_losses"], strict=False):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (got, want)
    assert r["grad_err"] < 1e-5  # gradients accumulated over the four batches
    assert r["variants"] == 3  # one trace per new shape; the traced shape needs none
    assert r["odd_batch_error"] is not None
    assert "input args[0] has size 3 in dim 0" in r["odd_batch_error"] and "pad it to 4" in r["odd_batch_error"]


class _DataDependent(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.kind == "nonzero":
            return h[h > 0].sum()
        if self.kind == "item":
            return h * h.sum().item()
        return h if h.sum() > 0 else -h  # control flow on a tensor


@pytest.mark.parametrize("kind,op", [("nonzero", "aten.nonzero"), ("item", "_local_scalar_dense"), ("branch", "_local_scalar_dense")])
def test_data_dependent_ops_are_named_with_their_module(kind, op):
    outer = torch.nn.Sequential(torch.nn.Identity(), _DataDependent(kind))
    with torch.device("meta"):
        outer = outer.to_empty(device="meta")
    with pytest.raises(ValueError, match=rf"module '1' \(_DataDependent\) calls .*{op}.*depends on tensor values"):
        capture(outer, (torch.randn(2, 4, device="meta"),), lambda out, x: out.sum())



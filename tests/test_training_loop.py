"""The loop people write around a parallelized module, on a real 2x2 gloo mesh, against the same
loop on one device: evaluation (``no_grad``, ``inference_mode``, ``eval()``) at other batch sizes,
parameters unfrozen after planning, gradient accumulation, ``clip_grad_norm_``, an LR scheduler,
optimizer states sharded like their parameters, and a distributed checkpoint (DCP) saved, loaded
in new processes into a fresh model, optimizer and scheduler, and continued.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_utils import run_distributed
from _helpers import full_weights
from _tiny import fixed_tokens, tiny_llama
from zoo_models import ZOO

MESH = (2, 2)
LOSS_RTOL = 1e-5
CASES = {c.name: c for c in ZOO}


def _loss_value(x: Any) -> float:
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def _parallel_twin(case: Any, mesh: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the case's model parallelized on ``mesh`` with the seeded weights, the seeded model on one device)."""
    import apmodel
    from apmodel.lowering import load_full_state_dict

    args, kwargs, targets = case.step_inputs()
    ref = case.seeded()
    with torch.device("meta"):
        model = case.build()
    model = apmodel.parallelize(model, mesh, args, loss_fn=case.loss_fn, kwargs=kwargs, targets=targets,
                                device="h100")
    model.to_empty(device="cpu")
    load_full_state_dict(model, {k: v.detach().clone() for k, v in ref.state_dict().items()})
    return model, ref


def test_model_modes_name_what_changed_and_are_restored():
    from apmodel.lowering.modes import ModelModes

    model = CASES["cnn_batchnorm"].seeded()
    planned = ModelModes.of(model)
    model.eval()
    model.conv.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    now = ModelModes.of(model)
    text = now.describe(model, planned)
    assert "4 module(s) in eval mode" in text and "bn (BatchNorm2d)" in text
    assert "2 parameter(s) frozen since planning (conv.weight, head.bias)" in text
    twin = CASES["cnn_batchnorm"].seeded()  # a structural copy, as the program's meta twin is
    with now.applied(twin):
        assert ModelModes.of(twin) == now
    assert ModelModes.of(twin) == planned


def test_lower_without_replan_refuses_eval_mode_that_changes_the_graph():
    """A program made by ``lower()`` alone cannot plan the eval graph of a BatchNorm model: it says
    so (planning only; a mesh without process groups)."""
    import apmodel
    from apmodel._torch_private import fake_mesh
    from apmodel.graph.capture import capture
    from apmodel.lowering import lower
    from apmodel.lowering.modes import ModelModes
    from apmodel.result.plans import PlanMismatch

    case = CASES["cnn_batchnorm"]
    args, _, targets = case.step_inputs()
    meta = tuple(x.to("meta") for x in (*args, *targets))
    with torch.device("meta"):
        model = case.build()
    captured = capture(model, meta[:1], case.loss_fn, targets=meta[1:])
    plan = apmodel.plan(captured, (1,), device="h100")
    model = lower(model, fake_mesh((1,)), plan, captured)
    model.eval()
    with pytest.raises(PlanMismatch, match=r"eval mode \(.*bn \(BatchNorm2d\).*use apmodel.parallelize"):
        model._apmodel_program.for_inputs(list(meta), ModelModes.of(model))


def _evaluation_worker(rank: int, world: int) -> dict[str, Any]:
    """Two training steps, then the loss of half a batch in train and eval mode under ``no_grad``
    and in eval mode under ``inference_mode``, beside one device's; the BatchNorm statistics after."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mesh = dist.init_device_mesh("cpu", MESH)
    out: dict[str, Any] = {}
    for name in ("cnn_batchnorm", "tied_lm", "keyword_inputs"):
        case = CASES[name]
        args, kwargs, targets = case.step_inputs()
        model, ref = _parallel_twin(case, mesh)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(*args, *targets, **kwargs).backward()
            opt.step()
            ref_opt.zero_grad()
            case.loss_fn(ref(*args, **kwargs), *targets).backward()
            ref_opt.step()

        def half(xs: Any) -> Any:
            return tuple(x[:4] if isinstance(x, torch.Tensor) else x for x in xs)

        hkw = {k: v[:4] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        r: dict[str, Any] = {}
        for mode in ("train", "eval"):
            model.train(mode == "train")
            ref.train(mode == "train")
            with torch.no_grad():
                got = model(*half(args), *half(targets), **hkw)
                want = case.loss_fn(ref(*half(args), **hkw), *half(targets))
            r[f"no_grad_{mode}"] = (_loss_value(got), want.item())
        with torch.inference_mode():
            got = model(*half(args), *half(targets), **hkw)
            want = case.loss_fn(ref(*half(args), **hkw), *half(targets))
        r["inference_mode_eval"] = (_loss_value(got), want.item())
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        r["state_err"] = max((state[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items())
        prog = model._apmodel_program
        if name == "tied_lm":  # called as model(tokens, labels)
            native = prog.for_inputs([*half(args), *half(targets)]).native
            r["inference_nodes"] = (len(native.inference_graph.graph.nodes), len(native.forward_graph.graph.nodes))
        r["variants"] = len(prog.variants)
        out[name] = r
    # a batch the plan's batch sharding cannot split: refused, saying how to pad
    model, _ = _parallel_twin(CASES["tied_lm"], mesh)
    args, _, targets = CASES["tied_lm"].step_inputs()
    try:
        with torch.no_grad():
            model(args[0][:3], targets[0][:3])
        out["uneven"] = None
    except ValueError as e:
        out["uneven"] = str(e)
    return out


@pytest.fixture(scope="module")
def evaluation() -> dict[str, Any]:
    return run_distributed(_evaluation_worker, 4, timeout_s=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn_batchnorm", "tied_lm", "keyword_inputs"])
@pytest.mark.parametrize("call", ["no_grad_train", "no_grad_eval", "inference_mode_eval"])
def test_forward_only_at_another_batch_size_equals_one_device(evaluation, name, call):
    got, want = evaluation[name][call]
    assert abs(got - want) <= LOSS_RTOL * abs(want), (name, call, got, want)


@pytest.mark.slow
def test_evaluation_leaves_the_state_as_one_device_does(evaluation):
    # train-mode no_grad updates BatchNorm's statistics, eval mode reads them: both as on one device
    for name, r in evaluation.items():
        if isinstance(r, dict):
            assert r["state_err"] < 1e-5, (name, r["state_err"])


@pytest.mark.slow
def test_eval_mode_with_batchnorm_is_its_own_program(evaluation):
    # BatchNorm in eval mode is another graph (running statistics): planned once, beside the half
    # batch in train mode; a model without mode-dependent modules replays the training plan
    assert evaluation["cnn_batchnorm"]["variants"] == 2
    assert evaluation["tied_lm"]["variants"] == 2
    nodes, forward_nodes = evaluation["tied_lm"]["inference_nodes"]
    assert nodes < forward_nodes  # the forward-only graph drops what backward would have read


@pytest.mark.slow
def test_uneven_batch_is_refused_with_how_to_pad(evaluation):
    msg = evaluation["uneven"]
    assert msg is not None and "input args[0] has size 3 in dim 0" in msg and "pad it to 4" in msg


def _thaw_worker(rank: int, world: int) -> dict[str, Any]:
    """A parameter frozen when planned, unfrozen before training: it trains as on one device."""
    import torch.distributed as dist

    mesh = dist.init_device_mesh("cpu", MESH)
    case = CASES["frozen"]
    args, _, targets = case.step_inputs()
    model, ref = _parallel_twin(case, mesh)
    model.frozen.requires_grad_(True)
    ref.frozen.requires_grad_(True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(*args, *targets)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = case.loss_fn(ref(*args), *targets)
        ref_loss.backward()
        ref_opt.step()
        losses.append((_loss_value(loss), ref_loss.item()))
    moved = (model.frozen.weight.full_tensor() - case.seeded().frozen.weight).abs().max().item()
    err = (model.frozen.weight.full_tensor() - ref.frozen.weight).abs().max().item()
    return {"losses": losses, "moved": moved, "err": err}


@pytest.mark.slow
def test_parameter_unfrozen_after_planning_trains_like_one_device():
    r = run_distributed(_thaw_worker, 4, timeout_s=600)[0]
    for got, want in r["losses"]:
        assert abs(got - want) <= LOSS_RTOL * abs(want), r["losses"]
    assert r["moved"] > 1e-3 and r["err"] < 1e-6, r


# --------------------------------------------------------------------------------------------
# the training loop: accumulation, clipping, scheduler, optimizer state, DCP
# --------------------------------------------------------------------------------------------

STEPS, SAVED_AT, MICROBATCHES, MAX_NORM = 4, 2, 2, 0.3


def _microbatches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's microbatches (tokens, targets), the same in every process."""
    tokens, targets = fixed_tokens()
    g = torch.Generator().manual_seed(100 + step)
    shift = torch.randint(0, 64, (MICROBATCHES, 1, 1), generator=g)
    return [((tokens + shift[i]) % 64, (targets + shift[i]) % 64) for i in range(MICROBATCHES)]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _optimizer(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))


def _step(model: torch.nn.Module, opt: Any, sched: Any, step: int, parallel: bool) -> tuple[float, float]:
    """One optimizer step over the step's microbatches; (loss, gradient norm before clipping)."""
    total = 0.0
    for tokens, targets in _microbatches(step):
        loss = (model(tokens, targets) if parallel else _lm_loss(model(tokens), targets)) / MICROBATCHES
        loss.backward()
        total += _loss_value(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    sched.step()
    opt.zero_grad()
    return total, _loss_value(norm)


def _loop_worker(rank: int, world: int, ckpt: str, phase: str) -> dict[str, Any]:
    """``phase``: "whole" (STEPS steps), "save" (SAVED_AT steps, then a DCP checkpoint of the
    model, the optimizer and the scheduler) or "resume" (a fresh model, optimizer and scheduler
    loaded from that checkpoint, then the remaining steps); one device's run beside each."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    import apmodel
    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", MESH)
    tokens, targets = fixed_tokens()
    model = apmodel.parallelize(tiny_llama("meta"), mesh, (tokens,), loss_fn=_lm_loss, targets=(targets,),
                                device="h100")
    model.to_empty(device="cpu")
    ref = tiny_llama("cpu")
    load_full_state_dict(model, full_weights(ref))
    opt, sched = _optimizer(model.parameters())
    ref_opt, ref_sched = _optimizer(ref.parameters())
    first = SAVED_AT if phase == "resume" else 0
    if phase == "resume":
        for step in range(first):  # one device reaches the checkpoint the way the saved run did
            _step(ref, ref_opt, ref_sched, step, parallel=False)
        state = {"model": get_state_dict(model, opt)[0], "optim": get_state_dict(model, opt)[1],
                 "scheduler": sched.state_dict()}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["scheduler"])
    last = SAVED_AT if phase == "save" else STEPS
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(first, last):
        loss, norm = _step(model, opt, sched, step, parallel=True)
        ref_loss, ref_norm = _step(ref, ref_opt, ref_sched, step, parallel=False)
        out["losses"].append(loss)
        out["ref_losses"].append(ref_loss)
        out["norms"].append(norm)
        out["ref_norms"].append(ref_norm)
    if phase == "save":
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state, "scheduler": sched.state_dict()}, checkpoint_id=ckpt)
    out["lr"] = sched.get_last_lr()[0]
    mismatched = []
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if key != "step" and not (isinstance(value, DTensor) and value.placements == p.placements):
                mismatched.append(f"{name}.{key}")
    out["state_not_like_param"] = mismatched
    out["weights_err"] = max((p.full_tensor() - q).abs().max().item()
                             for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return out


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("dcp") / "step2")
    return {phase: run_distributed(_loop_worker, 4, ckpt, phase, timeout_s=600)[0]
            for phase in ("whole", "save", "resume")}


@pytest.mark.slow
def test_accumulated_clipped_scheduled_steps_equal_one_device(loop_runs):
    r = loop_runs["whole"]
    for got, want in zip(r["losses"], r["ref_losses"], strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (r["losses"], r["ref_losses"])
    for got, want in zip(r["norms"], r["ref_norms"], strict=True):  # the total norm over DTensor gradients
        assert abs(got - want) <= 1e-5 * want, (r["norms"], r["ref_norms"])
    assert max(r["norms"]) > MAX_NORM  # clipping was active
    assert r["weights_err"] < 1e-5


@pytest.mark.slow
def test_optimizer_states_are_sharded_like_their_parameters(loop_runs):
    assert loop_runs["whole"]["state_not_like_param"] == []


@pytest.mark.slow
def test_dcp_checkpoint_resumes_in_new_processes_exactly(loop_runs):
    whole, resumed = loop_runs["whole"], loop_runs["resume"]
    assert loop_runs["save"]["losses"] == whole["losses"][:SAVED_AT]
    assert len(resumed["losses"]) == STEPS - SAVED_AT
    for got, want in zip(resumed["losses"], whole["losses"][SAVED_AT:], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed["losses"], whole["losses"])
    assert resumed["lr"] == whole["lr"]  # the scheduler resumed where it stopped
    assert resumed["weights_err"] < 1e-5

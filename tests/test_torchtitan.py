"""torchtitan's own Llama 3 (its debug config, FlexAttention with packed-document masks) planned
by apmodel, and run on a 2x2 gloo mesh: forward-only equal to torchtitan's model on one CPU
(torch's own flex_attention), training equal to the same model with torchtitan's SDPA attention
(one document a row, where the two masks agree; flex_attention has no CPU backward). Skipped
without the ``torchtitan`` extra."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

try:  # the extra absent, or broken by a missing dependency (triton)
    import torchtitan  # noqa: F401
except ImportError as e:
    pytest.skip(f"torchtitan is not importable ({e}): pip install -e '.[torchtitan]'", allow_module_level=True)

from _dist_utils import run_distributed  # noqa: E402
from _helpers import whole_value  # noqa: E402

MESH = (2, 2)
RTOL = 1e-5


def test_llama3_debug_model_is_planned_with_sharded_flex_attention():
    from apmodel.entry import torchtitan as T

    model = T.build_model("llama3", "debugmodel")
    plan = T.plan(model, MESH, 8, 256, device="h100")
    forward = {n: s for n, s in plan.node_strategy.items()
               if n.startswith("flex_attention") and "_backward" not in n}
    assert len(forward) == 6, forward  # one call per layer of the debug model
    # the packed-document mask differs per row ("b"): it travels with a batch-sharded attention
    assert all(n.startswith("flex_attention_mb") for n in forward), forward
    assert all(str(s).split(" <- ")[0] != "RR" for s in forward.values()), forward


def test_deepseek_v3_debug_model_is_planned():
    """Its MoE router opens torch.autocast on the tensors' device: a no-op on meta while traced."""
    from apmodel.entry import torchtitan as T

    model = T.build_model("deepseek_v3", "debugmodel")
    plan = T.plan(model, MESH, 8, 256, device="h100")
    forward = {n: str(s) for n, s in plan.node_strategy.items()
               if n.startswith("flex_attention") and "_backward" not in n}
    assert forward and all(n.startswith("flex_attention_mb") for n in forward), forward
    assert any(n.startswith("_grouped_mm") for n in plan.node_strategy)  # the routed experts


def test_parallelize_fn_takes_the_train_spec_hook_arguments():
    from torchtitan.models.llama3 import model_registry

    from apmodel.entry import torchtitan as T

    theirs = inspect.signature(model_registry("debugmodel").parallelize_fn).parameters
    ours = inspect.signature(T.parallelize_fn).parameters
    assert list(ours) == list(theirs)
    assert all(ours[k].kind == theirs[k].kind for k in theirs)


def _sdpa_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with torchtitan's SDPA inner attention (causal, no masks) in every layer."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    return model


def _gloo_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from apmodel.entry import torchtitan as T
    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", MESH)
    torch.manual_seed(0)
    ref = T.build_model("llama3", "debugmodel", device="cpu")
    weights = {k: v.detach().clone() for k, v in
               list(T.TorchtitanStep(ref).named_parameters()) + list(T.TorchtitanStep(ref).named_buffers())}
    out: dict[str, Any] = {}
    # forward-only, two documents a row: torchtitan's model with torch's flex_attention
    tokens, positions, labels = T.sample_batch(ref, 8, 128, documents=2)
    model = T.parallelize(T.build_model("llama3", "debugmodel"), mesh, tokens, positions, labels, device="h100")
    model.to_empty(device="cpu")
    load_full_state_dict(model, weights)
    model.eval()
    with torch.no_grad():
        got = model(tokens, positions, labels)
        want = T.cross_entropy(T.TorchtitanStep(ref)(tokens, positions), labels)
    out["forward"] = (whole_value(got), want.item())
    # training, one document a row: the SDPA twin is the truth
    tokens, positions, labels = T.sample_batch(ref, 8, 128, documents=1)
    model = T.parallelize(T.build_model("llama3", "debugmodel"), mesh, tokens, positions, labels, device="h100")
    model.to_empty(device="cpu")
    load_full_state_dict(model, weights)
    twin = _sdpa_twin(ref)
    out["train"] = _side_by_side(model, twin, (tokens, positions, labels), lr=0.5, steps=3)
    out["deepseek_v3"] = _deepseek_worker(mesh)
    return out


def _deepseek_worker(mesh: Any) -> dict[str, Any]:
    """DeepSeek-V3's debug model (MLA attention, routed experts): forward-only against torchtitan
    on one CPU, training against its SDPA twin (one document a row)."""
    from apmodel.entry import torchtitan as T
    from apmodel.lowering import load_full_state_dict

    torch.manual_seed(0)
    ref = T.build_model("deepseek_v3", "debugmodel", device="cpu")
    weights = {k: v.detach().clone() for k, v in
               list(T.TorchtitanStep(ref).named_parameters()) + list(T.TorchtitanStep(ref).named_buffers())}
    out: dict[str, Any] = {}
    for documents in (2, 1):
        tokens, positions, labels = T.sample_batch(ref, 4, 128, documents=documents)
        model = T.parallelize(T.build_model("deepseek_v3", "debugmodel"), mesh, tokens, positions, labels,
                              device="h100")
        model.to_empty(device="cpu")
        load_full_state_dict(model, weights)
        if documents == 2:
            model.eval()
            with torch.no_grad():
                got = model(tokens, positions, labels)
                want = T.cross_entropy(T.TorchtitanStep(ref.eval())(tokens, positions), labels)
            out["forward"] = (whole_value(got), want.item())
            continue
        twin = _sdpa_twin(ref.train())
        out["train"] = _side_by_side(model, twin, (tokens, positions, labels), lr=0.1, steps=2)
    return out


def _side_by_side(model: torch.nn.Module, twin: torch.nn.Module, batch: tuple, *, lr: float,
                  steps: int) -> list[tuple[float, float]]:
    """(apmodel's loss, the SDPA twin's loss) of ``steps`` SGD steps of each on ``batch``."""
    from apmodel.entry import torchtitan as T

    tokens, positions, labels = batch
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(twin.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, positions, labels)
        loss.backward()
        opt.step()
        twin_opt.zero_grad()
        want = T.cross_entropy(twin(tokens, positions), labels)
        want.backward()
        twin_opt.step()
        losses.append((whole_value(loss), want.item()))
    return losses


@pytest.fixture(scope="module")
def gloo_runs() -> dict[str, Any]:
    return run_distributed(_gloo_worker, 4, timeout_s=900)[0]


@pytest.mark.slow
def test_llama3_forward_on_gloo_equals_torchtitan_on_one_cpu(gloo_runs):
    got, want = gloo_runs["forward"]
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
def test_llama3_training_on_gloo_equals_the_sdpa_model(gloo_runs):
    losses = gloo_runs["train"]
    assert losses[-1][1] < losses[0][1]
    for got, want in losses:
        assert got == pytest.approx(want, rel=RTOL)


def _trainer_worker(rank: int, world: int) -> list[tuple[float, float]]:
    """The hook called as torchtitan's trainer calls it (a ParallelDims with data parallelism
    only, its training config), then three steps the way the trainer takes them: each rank its
    own rows, ``get_attention_masks``, the loss summed over its rows over the global token count,
    ``backward``, the optimizer. Beside the SDPA twin on the whole batch (one document a row)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from apmodel.entry import torchtitan as T

    mesh = dist.init_device_mesh("cpu", MESH)
    dims = SimpleNamespace(world_mesh=mesh, tp_enabled=False, pp_enabled=False, cp_enabled=False, ep_enabled=False)
    training = SimpleNamespace(local_batch_size=2, seq_len=128)
    module = T.parallelize_fn(T.build_model("llama3", "debugmodel"), parallel_dims=dims, training=training,
                              parallelism=None, compile_config=SimpleNamespace(enable=False), ac_config=None,
                              dump_folder="")
    module.to_empty(device="cpu")
    torch.manual_seed(rank)  # ranks seeded apart: init_weights takes rank 0's values
    module.init_weights(buffer_device=torch.device("cpu"))
    torch.manual_seed(0)
    twin = _sdpa_twin(T.build_model("llama3", "debugmodel", device="cpu"))
    tokens, positions, labels = T.sample_batch(twin, 2 * world, 128, documents=1)
    mine = slice(2 * rank, 2 * rank + 2)
    opt, twin_opt = torch.optim.SGD(module.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        masks = module.get_attention_masks(positions[mine])
        pred = module(tokens[mine], positions=positions[mine], attention_masks=masks)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels[mine].flatten(),
                                                 reduction="sum") / labels.numel()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        twin_opt.zero_grad()
        want = T.cross_entropy(twin(tokens, positions), labels)
        want.backward()
        twin_opt.step()
        losses.append((total.item(), want.item()))
    return losses


@pytest.mark.slow
def test_parallelize_fn_trains_as_torchtitans_trainer_calls_it():
    losses = run_distributed(_trainer_worker, 4, timeout_s=900)[0]
    assert losses[-1][1] < losses[0][1]
    for got, want in losses:
        assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
def test_deepseek_v3_forward_on_gloo_equals_torchtitan_on_one_cpu(gloo_runs):
    got, want = gloo_runs["deepseek_v3"]["forward"]
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
def test_deepseek_v3_training_on_gloo_equals_the_sdpa_model(gloo_runs):
    losses = gloo_runs["deepseek_v3"]["train"]
    assert losses[-1][1] < losses[0][1]
    for got, want in losses:
        assert got == pytest.approx(want, rel=RTOL)

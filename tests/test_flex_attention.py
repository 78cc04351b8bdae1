"""FlexAttention (``torch.nn.attention.flex_attention``) in users' own models: captured as one
region per call (causal and document block masks built in ``forward``), planned with batch or
head sharding, and run on a 2x2 gloo mesh equal to one device (forward-only against torch's own
flex_attention; training against the same model on SDPA with the mask written out, since
flex_attention has no CPU backward in torch 2.13)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _flex_models import FlexLM, lm_loss, tokens

from _dist_utils import run_distributed
from _helpers import whole_value

MESH = (2, 2)
RTOL = 1e-5
#: gloo cases: (mask, key/value heads of 4, the BlockMask passed as an input rather than built in forward)
CASES = {"causal": ("causal", 4, False), "document": ("document", 2, False),
         "document_input": ("document", 2, True)}


def _flex_nodes(plan: Any) -> dict[str, str]:
    return {n: str(s) for n, s in plan.node_strategy.items() if n.startswith("flex_attention")}


@pytest.mark.parametrize("mask, kv_heads", [("causal", 16), ("document", 8)])
def test_flex_attention_is_planned_batch_or_head_sharded(mask, kv_heads):
    import apmodel

    with torch.device("meta"):
        model = FlexLM(vocab=1024, dim=1024, heads=16, kv_heads=kv_heads, mask=mask)
    x, y = tokens(16, 2048, vocab=1024)
    plan = apmodel.plan(model, MESH, (x,), loss_fn=lm_loss, targets=(y,), device="h100")
    nodes = _flex_nodes(plan)
    assert len(nodes) == 4, nodes  # two layers, forward and backward each one node
    forward = [s for n, s in nodes.items() if not n.endswith(("_backward", "_backward_1"))]
    # every forward call sharded on the batch (S(0)) or the heads (S(1)) on some mesh axis
    assert all(s.split(" <- ")[0] != "RR" and set(s.split(" <- ")[0]) - set("R") for s in forward), nodes
    # a document mask differs per batch row: it travels sharded with the batch, a causal one whole
    mask_flag = "b" if mask == "document" else ""
    assert all(n.split("_")[2].startswith("m" + mask_flag) for n in nodes), nodes


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_block_mask_passed_in_is_a_dense_graph_input(how):
    """A BlockMask sample input (made on the CPU, its mask_mod reading CPU document ids) becomes
    one boolean graph input of its dense mask, batch-sharded with the attention that reads it."""
    import apmodel
    from apmodel.graph.capture import capture

    with torch.device("meta"):
        model = FlexLM(vocab=1024, dim=1024, heads=16, kv_heads=8, mask="document")
    x, y = tokens(16, 2048, vocab=1024)
    block_mask = FlexLM(mask="document").block_mask(x)
    call = dict(sample_inputs=(x, block_mask)) if how == "positional" else dict(sample_inputs=(x,),
                                                                                 kwargs={"block_mask": block_mask})
    meta = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in call["sample_inputs"])
    captured = capture(model, meta, lm_loss, kwargs=call.get("kwargs"), targets=(y.to("meta"),))
    masks = [n for n in captured.gm.graph.nodes if captured.roles.get(n.name) == "input"
             and n.meta["val"].dtype == torch.bool]
    assert len(masks) == 1 and tuple(masks[0].meta["val"].shape) == (16, 1, 2048, 2048), masks
    plan = apmodel.plan(model, MESH, call["sample_inputs"], kwargs=call.get("kwargs"), loss_fn=lm_loss,
                        targets=(y,), device="h100")
    forward = [str(s) for n, s in plan.node_strategy.items() if n.startswith("flex_attention") and "_backward" not in n]
    assert forward and all(s.split(" <- ")[1][1:-1].split(", ")[3] == s.split(" <- ")[0] == "S(0)S(0)"
                           for s in forward), forward


@pytest.mark.parametrize("mask, kv_heads", [("causal", 4), ("document", 2)])
def test_region_function_equals_torch_flex_attention(mask, kv_heads):
    """The region's kernel (SDPA on the dense mask) against torch's flex_attention on one CPU,
    forward (flex_attention has no CPU backward): with grouped-query heads, and the document mask."""
    torch.manual_seed(0)
    flex = FlexLM(mask=mask, kv_heads=kv_heads)
    x, _ = tokens(4, 128)
    from apmodel.graph.flex import flex_attention_captured

    with torch.no_grad():
        want = flex(x)
        with flex_attention_captured():  # the same call routed to the region, run eagerly on CPU
            got = flex(x)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5)


def test_fully_masked_query_gives_zeros_as_flex_attention_does():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from apmodel.graph.flex import flex_attention_captured

    def nothing_for_first_row(b, h, q, kv):
        return (q >= kv) & (q > 0)

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    block_mask = create_block_mask(nothing_for_first_row, None, None, 128, 128, device="cpu")
    with torch.no_grad():
        want = flex_attention(q, k, v, block_mask=block_mask)
        with flex_attention_captured():
            got = flex_attention(q, k, v, block_mask=block_mask)
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5)


def test_score_mod_is_refused_by_name():
    from torch.nn.attention.flex_attention import flex_attention

    from apmodel.graph.capture import capture
    from apmodel.graph.flex import FlexAttentionError

    def relative_bias(score, b, h, q, kv):
        return score + (q - kv)

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).view(2, 64, 3, 1, 16).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v, score_mod=relative_bias).sum()

    with torch.device("meta"):
        model = Biased()
    with pytest.raises(FlexAttentionError, match="score_mod 'relative_bias'"):
        capture(model, (torch.empty(2, 64, 16, device="meta"),), None)


def _gloo_worker(rank: int, world: int) -> dict[str, Any]:
    """Per mask: the parallelized model's eval-mode ``no_grad`` loss beside one device's with
    torch's flex_attention, then three SGD steps beside the SDPA twin's."""
    import torch.distributed as dist

    import apmodel
    from apmodel.lowering import load_full_state_dict

    mesh = dist.init_device_mesh("cpu", MESH)
    out: dict[str, Any] = {}
    for case, (mask, kv_heads, given) in CASES.items():
        torch.manual_seed(0)
        ref = FlexLM(mask=mask, kv_heads=kv_heads)
        dense = FlexLM(mask=mask, kv_heads=kv_heads, dense=True)
        dense.load_state_dict(ref.state_dict())
        x, y = tokens(8, 128)
        inputs = (x, ref.block_mask(x)) if given else (x,)  # the BlockMask an input, or built in forward
        with torch.device("meta"):
            model = FlexLM(mask=mask, kv_heads=kv_heads)
        # the heads on one axis, the batch on the other: both alternatives run
        model = apmodel.parallelize(model, mesh, inputs, loss_fn=lm_loss, targets=(y,), device="h100",
                                    constraints=[apmodel.region_as("flex_attention_*", "batch", "heads")])
        model.to_empty(device="cpu")
        load_full_state_dict(model, {k: v.detach().clone() for k, v in ref.state_dict().items()})
        model.eval()
        ref.eval()
        with torch.no_grad():
            got, want = model(*inputs, y), lm_loss(ref(*inputs), y)
            half = (x[:4], ref.block_mask(x[:4])) if given else (x[:4],)  # another batch size: its own program
            got_half, want_half = model(*half, y[:4]), lm_loss(ref(*half), y[:4])
        r: dict[str, Any] = {"forward": (whole_value(got), want.item()), "half": (whole_value(got_half), want_half.item())}
        model.train()
        opt, dense_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(dense.parameters(), lr=0.5)
        r["train"] = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(*inputs, y)
            loss.backward()
            opt.step()
            dense_opt.zero_grad()
            want = lm_loss(dense(x), y)
            want.backward()
            dense_opt.step()
            r["train"].append((whole_value(loss), want.item()))
        out[case] = r
    return out


@pytest.fixture(scope="module")
def gloo_runs() -> dict[str, Any]:
    return run_distributed(_gloo_worker, 4, timeout_s=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_forward_only_on_gloo_equals_torch_flex_attention(gloo_runs, case):
    got, want = gloo_runs[case]["forward"]
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_forward_only_at_half_the_batch_equals_torch_flex_attention(gloo_runs, case):
    got, want = gloo_runs[case]["half"]
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_training_on_gloo_equals_the_sdpa_twin(gloo_runs, case):
    losses = gloo_runs[case]["train"]
    assert losses[-1][1] < losses[0][1]  # the twin learns: the comparison is not of constants
    for got, want in losses:
        assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh runs it)")
@pytest.mark.parametrize("mask, kv_heads", [("causal", 4), ("document", 2)])
def test_cuda_training_equals_torch_flex_attention(mask, kv_heads):
    """On one GPU (a 1-device mesh), three SGD steps of the parallelized model beside the same
    model training through torch's own flex_attention (which has a CUDA backward), fp32."""
    import os
    import tempfile

    import torch.distributed as dist

    import apmodel
    from apmodel.lowering import load_full_state_dict

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if dist.is_nccl_available() else "gloo", store=store, rank=0, world_size=1)
    try:
        mesh = dist.init_device_mesh("cuda", (1,))
        torch.manual_seed(0)
        ref = FlexLM(mask=mask, kv_heads=kv_heads).cuda()
        x, y = (t.cuda() for t in tokens(8, 128))
        with torch.device("meta"):
            model = FlexLM(mask=mask, kv_heads=kv_heads)
        model = apmodel.parallelize(model, mesh, (x,), loss_fn=lm_loss, targets=(y,), device="h100")
        model.to_empty(device="cuda")
        load_full_state_dict(model, {k: v.detach().clone() for k, v in ref.state_dict().items()})
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            ref_opt.zero_grad()
            want = lm_loss(ref(x), y)
            want.backward()
            ref_opt.step()
            losses.append((whole_value(loss), want.item()))
    finally:
        dist.destroy_process_group()
    assert losses[-1][1] < losses[0][1]
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-4)


def test_flex_regions_leave_bucketing_and_overlap_on():
    """A captured flex_attention call issues no collectives of its own (communicates=False): the
    plan's collectives are still priced bucketed and overlapped, as the native program runs them."""
    from apmodel.core.options import PlanOptions
    from apmodel.graph.capture import capture
    from apmodel.graph.regions import region_of
    from apmodel.problem.pricing import build_cost_context

    with torch.device("meta"):
        model = FlexLM()
    x, y = tokens(4, 128)
    captured = capture(model, (x.to("meta"),), lm_loss, targets=(y.to("meta"),))
    regions = {region_of(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"} - {None}
    assert regions and not any(r.communicates for r in regions)
    cost = build_cost_context(MESH, PlanOptions(device="h100"), captured)
    assert cost.bucket_bytes > 0 and cost.overlap

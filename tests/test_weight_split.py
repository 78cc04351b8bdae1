"""The native backward split into its input-gradient and weight-gradient parts
(:mod:`apmodel.lowering.weight_split`, :func:`apmodel.lowering.split_weight_backward`), as a
zero-bubble pipeline's ``I`` and ``W`` actions run it.

Truth: the whole backward of the same lowered stage (a middle stage of the tiny LLaMA: a hidden
state in, a hidden state out) on the same input and output gradient: the input's gradient and
every parameter's gradient, rel 1e-6, with the gradients reduced in each backward and deferred to
the step's reduction; and the input-gradient part alone leaves every ``.grad`` untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

from _dist_utils import run_distributed
from _helpers import full_weights
from _tiny import TINY, TINY_BATCH, TINY_SEQ, tiny_llama

RTOL = 1e-6
LAYERS = 2


def _full(x: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _split_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import apmodel
    from apmodel.lowering import defer_gradient_reduction, load_full_state_dict, reduce_gradients, split_weight_backward
    from apmodel.lowering.pipeline import cut_stage

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TINY_BATCH, TINY_SEQ, TINY["dim"], generator=g)
    upstream = torch.randn(TINY_BATCH, TINY_SEQ, TINY["dim"], generator=g)
    weights = full_weights(tiny_llama("cpu", n_layers=LAYERS))
    module = cut_stage(tiny_llama("meta", n_layers=LAYERS), 0, LAYERS - 1, is_first=False, is_last=False)
    weights = {k: v for k, v in weights.items() if k in dict(module.named_parameters()) | dict(module.named_buffers())}
    lowered = apmodel.parallelize(module, mesh, (x.to("meta").requires_grad_(),), device="h100")  # no calibration run
    lowered.to_empty(device="cpu")
    load_full_state_dict(lowered, weights)
    out: dict[str, Any] = {}
    for mode in ("per_backward", "deferred"):
        if mode == "deferred":
            defer_gradient_reduction(lowered)

        def backward(split: bool, mode: str = mode) -> dict[str, Any]:
            lowered.zero_grad(set_to_none=True)
            xin = x.clone().requires_grad_(True)
            y = _full(lowered(xin))
            r: dict[str, Any] = {}
            if split:
                with split_weight_backward(lowered) as work:
                    y.backward(upstream)
                r["untouched"] = all(p.grad is None for p in lowered.parameters())
                r["parts"] = len(work)
                for part in work:
                    part()
            else:
                y.backward(upstream)
            if mode == "deferred":
                reduce_gradients(lowered)
            r["input"] = xin.grad.clone()
            r["params"] = {n: _full(p.grad).clone() for n, p in lowered.named_parameters() if p.grad is not None}
            return r

        whole, split = backward(False), backward(True)
        native = lowered._apmodel_program.native
        ws = native.weight_split()
        targets = [] if ws is None else [getattr(n.target, "__name__", str(n.target))
                                          for n in ws.weight_part.graph.nodes if n.op == "call_function"]
        out[mode] = {"whole": whole, "split": split, "weight_ops": targets, "n_params": len(list(lowered.parameters()))}
    return out


@pytest.fixture(scope="module")
def split_results() -> dict[str, Any]:
    return run_distributed(_split_worker, 1, timeout_s=300)[0]


@pytest.mark.parametrize("mode", ["per_backward", "deferred"])
def test_split_backward_equals_the_whole_backward(split_results, mode):
    r = split_results[mode]
    whole, split = r["whole"], r["split"]
    assert split["parts"] == 1  # one native step: one weight-gradient part
    assert split["untouched"], "the input-gradient part wrote a parameter's .grad"
    assert any("mm" in t for t in r["weight_ops"]), f"no weight-gradient matmul in the W part: {r['weight_ops']}"
    torch.testing.assert_close(split["input"], whole["input"], rtol=RTOL, atol=0)
    assert set(split["params"]) == set(whole["params"]) and len(whole["params"]) == r["n_params"]
    for name, grad in whole["params"].items():
        torch.testing.assert_close(split["params"][name], grad, rtol=RTOL, atol=0, msg=name)


def test_split_of_a_small_graph_keeps_what_the_weight_part_reads():
    """y = x @ w: the input gradient g @ w.T in the input part; the weight gradient x.T @ g in the
    weight part, reading x and g (kept) and nothing else; a node writing into a buffer that the
    input part reads goes with it."""
    from apmodel.lowering.weight_split import split_weight

    graph = fx.Graph()
    x, w, gout = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("g")
    buf = graph.call_function(torch.ops.aten.empty.memory_format, ([3, 4],), {"device": torch.device("cpu")})
    wt = graph.call_function(torch.ops.aten.t.default, (w,))
    filled = graph.call_function(torch.ops.aten.copy_.default, (buf, wt))  # writes buf; nobody reads its result
    del filled
    gx = graph.call_function(torch.ops.aten.mm.default, (gout, buf))
    xt = graph.call_function(torch.ops.aten.t.default, (x,))
    gw = graph.call_function(torch.ops.aten.mm.default, (xt, gout))
    graph.output((gw, gx))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    split = split_weight(gm, 1)
    assert split is not None and split.n_input_grads == 1 and split.n_weight_nodes == 2
    xv, wv, gv = torch.randn(5, 4), torch.randn(4, 3), torch.randn(5, 3)
    first = split.input_part(xv, wv, gv)
    (gw_split,) = split.weight_part(*first[1:])
    gw_whole, gx_whole = gm(xv, wv, gv)
    torch.testing.assert_close(first[0], gx_whole)
    torch.testing.assert_close(gw_split, gw_whole)
    assert split.n_kept == 2  # x and g

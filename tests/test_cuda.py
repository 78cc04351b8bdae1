"""The lowered module on a real GPU: plan, parallelize and train 3 steps on one CUDA device
(a 1-device mesh over a 1-process NCCL/gloo group) against the same model trained eagerly.

Skipped without CUDA. Planning still traces on the meta device (fake CUDA tensors with autograd
abort a CPU build of torch); the step runs the real CUDA kernels, with flash attention in bf16 and
its reference implementation in fp32 (the CUDA flash kernel refuses fp32).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=256, max_seq_len=32)


@pytest.fixture(scope="module")
def cuda_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if dist.is_nccl_available() else "gloo", store=store, rank=0, world_size=1)
    yield dist.init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallelize_trains_on_one_gpu(cuda_group, dtype):
    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models import build, config, sample_inputs

    tokens, targets = sample_inputs(config("llama3-debug", **CFG), 4, 32, device="cuda",
                                    generator=torch.Generator(device="cuda").manual_seed(0))
    torch.manual_seed(0)
    ref = build("llama3-debug", **CFG).to("cuda")
    ref.init_weights()
    ref = ref.to(dtype)
    with torch.device("meta"):
        model = build("llama3-debug", **CFG).to(dtype)
    model = apmodel.parallelize(model, cuda_group, (tokens, targets))
    model.to_empty(device="cuda")
    load_full_state_dict(model, ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        got, want = loss.full_tensor().float().item(), ref_loss.float().item()
        assert abs(got - want) <= tol * abs(want), (dtype, got, want)


@cuda
def test_native_program_compiles_on_one_gpu(cuda_group):
    """The native program on CUDA: eager and ``torch.compile(fullgraph=True)`` (Inductor, Triton)
    give the same losses over 3 steps (bf16 compute would differ in rounding: fp32 here)."""
    import apmodel
    from apmodel.lowering import load_full_state_dict
    from apmodel.models import build, config, sample_inputs

    tokens, targets = sample_inputs(config("llama3-debug", **CFG), 4, 32, device="cuda",
                                    generator=torch.Generator(device="cuda").manual_seed(0))
    torch.manual_seed(0)
    ref = build("llama3-debug", **CFG).to("cuda")
    ref.init_weights()
    losses = {}
    for compiled in (False, True):
        with torch.device("meta"):
            model = build("llama3-debug", **CFG)
        model = apmodel.parallelize(model, cuda_group, (tokens, targets))
        assert model._apmodel_program.native is not None
        model.to_empty(device="cuda")
        load_full_state_dict(model, ref.state_dict())
        run = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        losses[compiled] = []
        for _ in range(3):
            loss = run(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(float(loss.detach().full_tensor()))
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


@cuda
def test_overlapped_collectives_run_on_nccl_streams(cuda_group):
    """The overlap order on CUDA: functional all-gathers issued ahead of matmuls and waited before
    their readers (NCCL work on its stream, wait_tensor joining it) give the serial order's values;
    both orders are timed (printed, for tools/gpu_check.sh's log)."""
    import time

    import torch.fx as fx

    from apmodel.lowering.native import order_collectives

    group = cuda_group.get_group(0).group_name
    gather, wait = torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default

    def step(w0, w1, x):
        g0 = wait(gather(w0, 1, group))
        h = torch.mm(x, x)
        h = torch.mm(h, g0)
        g1 = wait(gather(w1, 1, group))
        return torch.mm(torch.mm(h, h), g1)

    args = [torch.randn(2048, 2048, device="cuda") for _ in range(3)]
    results, times = {}, {}
    for overlap in (False, True):
        gm = fx.symbolic_trace(step)
        order_collectives(gm, 100.0 if overlap else None, [True, True])
        if overlap:  # the gathers lead: issued before the first matmul
            names = [n.name for n in gm.graph.nodes]
            assert names.index("all_gather_into_tensor_default_1") < names.index("mm")
        for _ in range(3):
            gm(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            out = gm(*args)
        torch.cuda.synchronize()
        times[overlap], results[overlap] = (time.perf_counter() - start) / 20 * 1e3, out
    print(f"overlap check on {torch.cuda.get_device_name(0)}: serial {times[False]:.3f} ms, "
          f"overlapped {times[True]:.3f} ms")
    torch.testing.assert_close(results[True], results[False])

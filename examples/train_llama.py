"""Plan, parallelize and train a small LLaMA-3 on a CPU "cluster" of processes (gloo).

    torchrun --nproc-per-node 4 examples/train_llama.py                 # 1D mesh of 4
    torchrun --nproc-per-node 4 examples/train_llama.py --mesh 2x2      # 2D mesh

Rank 0 plans (the cost model prices an H100 cluster of this mesh shape; the mesh here is made of CPU
processes), every rank receives the plan, and the model, built on the meta device, is lowered onto
the mesh: its parameters become DTensors placed as planned. The weights are then materialised
(``to_empty``) and loaded from a single-device reference model, and both are trained side by side
with AdamW: the log shows the parallel loss next to the single-device loss at every step.

The mesh must use every process: the product of the ``--mesh`` axis sizes must equal the world
size (``--nproc-per-node`` x nodes); this is checked before anything is built or planned.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import apmodel
except ImportError:  # run from a source checkout without installing: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import apmodel
from apmodel.core import placements
from apmodel.lowering import issued_redistributions, load_full_state_dict
from apmodel.models import build, config, sample_inputs
from apmodel.result.plans import Plan

log = logging.getLogger("train_llama")


def mesh_for_world(ap: argparse.ArgumentParser, text: str | None, world: int) -> tuple[int, ...]:
    """The mesh shape of ``--mesh`` (default: 1D over the world); exits via ``ap.error`` naming both sizes."""
    if text is None:
        return (world,)
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        ap.error(f"--mesh {text!r}: expected axis sizes joined by 'x', e.g. 4 or 2x2")
    if any(s < 1 for s in shape):
        ap.error(f"--mesh {text!r}: axis sizes must be positive")
    size = 1
    for s in shape:
        size *= s
    if size != world:
        ap.error(f"--mesh {text} has {size} devices but the world size is {world} processes; "
                 f"they must be equal (e.g. torchrun --nproc-per-node {size}, or a --mesh of {world} devices)")
    return shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 4 or 2x2 (default: world size, 1D)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--device", default="h100", help="accelerator the cost model prices")
    ap.add_argument("--solver", default="trws")
    ap.add_argument("--save-plan", default=None, help="write the plan (JSON) here")
    args = ap.parse_args()
    # torchrun sets WORLD_SIZE: check the mesh against it before the process group and the planner start
    if "WORLD_SIZE" not in os.environ:
        ap.error("WORLD_SIZE is not set: launch with torchrun, e.g. torchrun --nproc-per-node 4 examples/train_llama.py")
    try:
        env_world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        ap.error(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer")
    mesh_shape = mesh_for_world(ap, args.mesh, env_world)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # several processes share this machine's cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s")
    if world != env_world:  # WORLD_SIZE and the process group disagree only if launched oddly
        dist.destroy_process_group()
        ap.error(f"the process group has {world} processes but WORLD_SIZE is {env_world}")
    mesh = dist.init_device_mesh("cpu", mesh_shape)

    cfg = config("llama3-debug", n_layers=args.layers, dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                 ffn_hidden_dim=args.ffn, vocab_size=args.vocab, max_seq_len=args.seq)
    tokens, targets = sample_inputs(cfg, args.batch, args.seq, device="cpu", generator=torch.Generator().manual_seed(0))

    # 1. plan on rank 0, share it (every rank must run the same plan)
    with torch.device("meta"):
        model = build(cfg)
    box: list = [None]
    if rank == 0:
        t0 = time.perf_counter()
        plan = apmodel.plan(model, mesh_shape, (tokens.to("meta"), targets.to("meta")), device=args.device,
                            solver=args.solver)
        log.info("planned in %.1f s: objective %.1f µs (compute %.1f, comm %.1f) on %s x %s",
                 time.perf_counter() - t0, plan.objective_us, plan.compute_us, plan.comm_us, args.device, mesh_shape)
        for fqn, p in plan.param_placements.items():
            log.info("  %-40s %s", fqn, placements.tuple_to_str(p))
        if args.save_plan:
            plan.save(args.save_plan)
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_json(box[0])

    # 2. lower onto the mesh (the model stays on meta), then materialise and load weights
    model = apmodel.parallelize(model, mesh, (tokens, targets), plan=plan)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    reference = build(cfg)  # single-device model with the same weights, for comparison
    reference.init_weights()
    load_full_state_dict(model, dict(reference.named_parameters()) | dict(reference.named_buffers()))

    # 3. train both
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        step_s = time.perf_counter() - t0
        ref_opt.zero_grad()
        ref_loss = reference(tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        value = loss.full_tensor().item()
        if step == 0:
            kinds = Counter(f"{''.join(r.src)}->{''.join(r.dst)}" for r in issued_redistributions(model))
            log.info("step 0 issued %d redistributions: %s", sum(kinds.values()),
                     ", ".join(f"{k} x{n}" for k, n in kinds.most_common()))
        log.info("step %d  loss %.6f  single-device %.6f  |diff| %.2e  (%.2f s)",
                 step, value, ref_loss.item(), abs(value - ref_loss.item()), step_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

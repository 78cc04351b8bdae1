"""Train a model preset on a text file with apmodel's plan: a run, not a check.

    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 200
    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 200 --resume   # from the last checkpoint

The text (default: this repository's README) is read as bytes (vocabulary 256) or through a Hugging
Face ``tokenizers`` file (``--tokenizer examples/data/tokenizer.json``, trained on that README by
``tools/make_tokenizer.py``). Each step draws its batch from a generator seeded by the step number,
so a resumed run sees the batches the uninterrupted run saw. The model is built on meta, planned by
``apmodel.parallelize`` for the mesh's own hardware (``device="auto"``: on CPU processes, gloo
collectives timed now), materialised and initialised, then trained with AdamW, linear warm-up and
cosine decay, gradient clipping; every ``--log-every`` steps the log shows the loss, the learning
rate, tokens/s, MFU (model FLOPs, 6 per parameter and token plus attention's, over the plan's
device peak for every process) and peak memory. Every ``--ckpt-every`` steps model, optimizer and
scheduler are saved with ``torch.distributed.checkpoint``; at the end rank 0 writes the losses
(JSON) and the loss curve (PNG, with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import apmodel
except ImportError:  # run from a source checkout without installing: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import apmodel
from train_llama import mesh_for_world

import costmodels
from apmodel.lowering import load_full_state_dict
from apmodel.models import build, config

log = logging.getLogger("train")
ROOT = Path(__file__).resolve().parents[1]


def read_tokens(path: Path, tokenizer: str | None) -> tuple[torch.Tensor, int]:
    """The text's token ids (int64) and the vocabulary size."""
    text = path.read_text(encoding="utf-8")
    if tokenizer is None:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long), 256
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    return torch.tensor(tok.encode(text).ids, dtype=torch.long), tok.get_vocab_size()


def batch_at(step: int, data: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (tokens, targets): ``batch`` windows of ``seq + 1`` tokens at offsets drawn
    from a generator seeded by the step (the same on every rank and in a resumed run)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def flops_per_token(cfg: object, n_params: int, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12 x layers x dim x seq (PaLM's count)."""
    return 6.0 * n_params + 12.0 * cfg.n_layers * cfg.dim * seq  # type: ignore[attr-defined]


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 4 or 2x2 (default: world size, 1D)")
    ap.add_argument("--preset", default="llama3-debug", help="a LLaMA-family model preset (`apmodel models`); "
                                                               "the size flags below replace its fields")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=192)
    ap.add_argument("--data", type=Path, default=ROOT / "README.md", help="text file to train on")
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizers JSON file (default: bytes)")
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("train_out"), help="checkpoints, losses and the curve")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:
        ap.error("WORLD_SIZE is not set: launch with torchrun, e.g. torchrun --nproc-per-node 4 examples/train.py")
    mesh_shape = mesh_for_world(ap, args.mesh, int(os.environ["WORLD_SIZE"]))

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # several processes share this machine's cores
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s")
    logging.getLogger("apmodel").setLevel(logging.WARNING)  # the run's log, not the planner's
    logging.getLogger("solvers").setLevel(logging.WARNING)
    device = "cuda" if on_gpu else "cpu"
    mesh = dist.init_device_mesh(device, mesh_shape)

    data, vocab = read_tokens(args.data, args.tokenizer)
    cfg = config(args.preset, n_layers=args.layers, dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                 ffn_hidden_dim=args.ffn, vocab_size=vocab, max_seq_len=args.seq)
    tokens, targets = batch_at(0, data, args.batch, args.seq)
    with torch.device("meta"):
        model = build(cfg)
    t0 = time.perf_counter()
    model = apmodel.parallelize(model, mesh, (tokens.to("meta"), targets.to("meta")))
    plan = model._apmodel_program.plan
    log.info("planned in %.1f s for %s: step priced %.1f ms; %s", time.perf_counter() - t0, mesh_shape,
             plan.objective_us / 1e3, plan.workload.get("priced_for", plan.workload.get("device")))
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.device(device):  # the initial weights, whole, the same on every rank: each keeps its shards
        initial = build(cfg)
        initial.init_weights()
    load_full_state_dict(model, dict(initial.named_parameters()) | dict(initial.named_buffers()))
    del initial

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, 1.0, args.warmup, args.steps))
    ckpt_dir = args.out / "checkpoint"
    losses: dict[int, float] = {}
    first = 0
    if args.resume:
        meta_path = args.out / "checkpoint.json"
        if not meta_path.exists():
            ap.error(f"--resume: no checkpoint in {args.out} (write one with --ckpt-every)")
        first = json.loads(meta_path.read_text())["step"]
        model_state, optim_state = get_state_dict(model, opt)  # the layout DCP loads into
        state = {"model": model_state, "optim": optim_state, "scheduler": sched.state_dict()}
        dcp.load(state, checkpoint_id=str(ckpt_dir))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["scheduler"])
        losses = {int(k): v for k, v in json.loads((args.out / "losses.json").read_text()).items() if int(k) < first}
        log.info("resumed at step %d from %s", first, ckpt_dir)

    n_params = sum(p.numel() for p in model.parameters())
    spec = costmodels.device(str(plan.workload.get("device", "h100")))
    peak = spec.peak_flops("fp32") * mesh.size()
    tokens_per_step = args.batch * args.seq
    log.info("%s: %.2f M parameters, %d tokens per step, MFU against %d x %s (%.1f TFLOP/s fp32 each)",
             args.preset, n_params / 1e6, tokens_per_step, mesh.size(), spec.name, spec.peak_flops("fp32") / 1e12)
    args.out.mkdir(parents=True, exist_ok=True)
    window, window_first = time.perf_counter(), first
    for step in range(first, args.steps):
        tokens, targets = batch_at(step, data, args.batch, args.seq)
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[step] = float(loss.detach().full_tensor())
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            rate = tokens_per_step * (done - window_first) / (time.perf_counter() - window)
            mfu = rate * flops_per_token(cfg, n_params, args.seq) / peak
            log.info("step %4d  loss %.4f  lr %.2e  %7.0f tokens/s  MFU %.2f%%  peak mem %.0f MiB", done,
                     losses[step], sched.get_last_lr()[0], rate, 100 * mfu, peak_memory_mib())
            window, window_first = time.perf_counter(), done
        if args.ckpt_every and done % args.ckpt_every == 0 and done < args.steps:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state, "scheduler": sched.state_dict()},
                     checkpoint_id=str(ckpt_dir))
            if rank == 0:
                (args.out / "checkpoint.json").write_text(json.dumps({"step": done}))
                (args.out / "losses.json").write_text(json.dumps(losses))
            log.info("checkpoint at step %d in %s", done, ckpt_dir)
    if rank == 0:
        (args.out / "losses.json").write_text(json.dumps(losses))
        _plot(losses, args.out / "loss.png", f"{args.preset} on {'x'.join(map(str, mesh_shape))} ({device})")
    dist.destroy_process_group()


def _plot(losses: dict[int, float], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return
    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s + 1 for s in steps], [losses[s] for s in steps], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("loss curve in %s", path)


if __name__ == "__main__":
    main()

"""Run a function in N processes joined in one real gloo process group (CPU), for tests.

The processes come from a ``forkserver`` that has torch and apmodel imported once (importing torch in
four fresh processes on a 2-core machine costs ~15 s). Each process uses one intra-op thread:
oversubscribed OpenMP threads make gloo collectives ~10x slower here. The group rendezvous through
a file store in a temporary directory (no port to race for).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

#: Modules the forkserver imports once, so that forked workers start warm.
PRELOAD = ["torch", "torch.distributed.tensor", "apmodel.lowering", "apmodel.capture", "apmodel.plans",
           "apmodel.strategies", "apmodel.models"]


def _child(fn: Callable, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple, init_group: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any
    try:
        if not init_group:  # torchrun-style: the function initialises the group itself
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), APMODEL_TEST_INIT_METHOD=f"file://{store_path}")
            try:
                result = ("ok", fn(rank, world_size, *args))
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
            Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
            return
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report to the parent, which raises it
        result = ("error", traceback.format_exc())
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, init_group: bool = True
) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo group initialised, and
    destroyed after); returns the per-rank results (picklable). A failing rank raises RuntimeError
    with its traceback; a hang past ``timeout_s`` kills the processes and raises TimeoutError.

    ``init_group=False`` runs ``fn`` as torchrun would: no group yet, ``RANK`` and ``WORLD_SIZE``
    set, and the rendezvous address in ``APMODEL_TEST_INIT_METHOD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="apmodel_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, store, tmp, args, init_group), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        results = []
        errors = []
        for r in range(world_size):
            f = Path(tmp, f"rank{r}.pkl")
            if not f.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            status, value = pickle.loads(f.read_bytes())
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if alive and not errors:
            raise TimeoutError(f"{len(alive)} of {world_size} processes still running after {timeout_s} s")
        if errors:
            raise RuntimeError("distributed test failed\n" + "\n".join(errors))
        return results

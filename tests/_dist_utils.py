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
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

#: Modules the forkserver imports once, so that forked workers start warm.
PRELOAD = ["torch", "torch.distributed.tensor", "apmodel.lowering", "apmodel.graph.capture", "apmodel.result.plans",
           "apmodel.candidates.strategies", "apmodel.models"]


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


# ------------------------------------------------------------------------------------------------
# collectives: what a step dispatched against what its plan predicts


class CollectiveRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every functional collective dispatched, as ``(kind, process group name, dtype)``
    in ``.calls``."""

    KINDS = {
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
        "all_to_all_single": "all_to_all",
        "shard_dim_alltoall": "all_to_all",
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._overloadpacket.__name__)
        if kind is not None and func.namespace in ("_c10d_functional", "c10d_functional", "_dtensor"):
            values = list(args) + list((kwargs or {}).values())
            group = [a for a in values if isinstance(a, str)]
            tensor = next((a for a in values if isinstance(a, torch.Tensor)), None)
            self.calls.append((kind, group[-1] if group else "?", None if tensor is None else tensor.dtype))
        return func(*args, **(kwargs or {}))


def predicted_collectives(redists: list, mesh_shape: tuple[int, ...], with_dtype: bool = True) -> Counter:
    """The collectives (``(kind, mesh axis[, dtype])`` -> count) that the redistributions
    ``redists`` decompose into, as the cost model prices them."""
    import costmodels

    comm = costmodels.NCCLCollectives(costmodels.Topology(mesh_shape=mesh_shape, device=costmodels.device("h100"), gpus_per_node=8))
    out: Counter = Counter()
    for r in redists:
        itemsize = torch.empty((), dtype=r.dtype).element_size()
        for kind, axis, _nbytes, _us in costmodels.redistribution_steps(comm, r.global_shape, itemsize, r.src, r.dst):
            out[(kind, axis, r.dtype) if with_dtype else (kind, axis)] += 1
    return out


def gloo_view(c: Counter) -> Counter:
    """gloo has no all-to-all: DTensor falls back to all-gather + local chunk on the same axis."""
    out: Counter = Counter()
    for key, n in c.items():
        out[("all_gather" if key[0] == "all_to_all" else key[0], *key[1:])] += n
    return out

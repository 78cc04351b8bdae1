"""Step time of the program apmodel hands back, against plain PyTorch, DDP and FSDP2, on CPU (gloo).

    python benchmarks/runtime.py                         # tiny and mid LLaMA, every variant
    python benchmarks/runtime.py --models tiny --json runtime.json
    python benchmarks/runtime.py --no-compile            # skip the Inductor variants (minutes)
    python benchmarks/runtime.py --device cuda --json runtime_cuda.json   # one GPU, one process
    python benchmarks/runtime.py --models mid --ranking-only --ranking-worlds 4   # plans ranked, 2 and 4 processes

Each variant trains the same model with AdamW (one intra-op thread per process, as on a shared
2-core machine) and reports the median step (forward, backward, optimizer step) of ``--steps``
steps after ``--warmup``; all variants of one world size are built in the same processes and
their steps interleaved (one step of each per round), so a drift of the machine's speed hits
them alike. Variants:

* one process: plain eager; apmodel on mesh (1,) native eager, native compiled (``torch.compile``,
  Inductor, ``fullgraph=True``), and the interpreter (``lowering="interpret"``);
* ``--world`` processes (default 2): DDP; FSDP2 (``fully_shard`` per block and at the root); apmodel
  on mesh (world,) native eager with its own plan and with the DDP and FSDP recipes' plans (the
  same communication as the baselines: the runtime compared alone), native compiled, interpreter;
  the plan for this machine (below) and the FSDP recipe's plan for this machine (weight traffic
  that can hide) each run with overlap and, the same plan, without (``parallelize(...,
  overlap=False)``).

``--ranking``: every plan of :data:`RANKED_PLANS` (the planner's for this machine and for other
devices, with activation checkpointing, recipes, other bucket sizes) run with overlap, forward and backward only,
its step predicted for this machine (the plan replayed under this machine's costs) against the
measured median; Spearman's rank correlation and measured / predicted per process count
(``--ranking-worlds 4``: also on a 2x2 mesh).

The planner's own plan is priced for H100s and NVLink; on gloo over loopback a collective costs
~300 µs whatever its size, so a plan with more, smaller collectives can lose here and win there.
"plan for this machine" is priced for this machine instead: the CPU device, its collective model
corrected by all-reduce, all-gather, reduce-scatter and all-to-all timed on the benchmark's own
gloo group just before (:func:`costmodels.collective_timing.time_collectives`, then
``Calibration.fit``, as ``apmodel calibrate`` does with nccl-tests logs), its compute model
fitted to kernels timed on one thread (``apmodel calibrate-compute --quick --threads 1``).
Every variant uses AdamW with ``foreach=True`` (torchtitan's default).

``host_us_per_node``: on mesh (1,), the step time apmodel adds to plain eager, divided by the nodes
of the joint forward-backward graph (what a per-node interpreter pays in Python per node).
Models: "tiny" (2 layers, dim 32, vocab 64, batch 8 x 16) and "mid" (4 layers, dim 512, vocab
8192, 21 M parameters, batch 8 x 128).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# This folder has a costmodels.py; make sure "import costmodels" finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

logger = logging.getLogger("benchmarks.runtime")

#: The models: LLaMA config overrides of the "llama3-debug" preset, and (batch, seq).
MODELS: dict[str, tuple[dict[str, int], tuple[int, int]]] = {
    "tiny": (dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=16),
             (8, 16)),
    "mid": (dict(n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1536, vocab_size=8192, max_seq_len=128),
            (8, 128)),
}


def _build(name: str, device: str) -> torch.nn.Module:
    from apmodel.models import build

    fields, _ = MODELS[name]
    with torch.device(device):
        torch.manual_seed(0)
        model = build("llama3-debug", **fields)
    if device != "meta":
        model.init_weights()
    return model


def _batch(name: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    fields, (batch, seq) = MODELS[name]
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, fields["vocab_size"], (batch, seq), generator=g).to(device),
            torch.randint(0, fields["vocab_size"], (batch, seq), generator=g).to(device))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _interleaved_median_ms(steps: list[Callable[[], Any]], warmup: int, repeats: int) -> list[float]:
    """Median time of each of ``steps`` over ``repeats`` rounds, one step of each per round (a
    drift of the shared machine's speed hits every variant alike), after ``warmup`` rounds."""
    import torch.distributed as dist

    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            if dist.is_initialized():
                dist.barrier()
            _synchronize()
            start = time.perf_counter()
            step()
            _synchronize()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _trainer(model: torch.nn.Module, forward: Callable[[], torch.Tensor], optimizer: bool = True) -> Callable[[], float]:
    """One training step; ``optimizer=False``: forward and backward only (what a plan prices)."""
    # foreach: torchtitan's default; the per-tensor loop costs a DTensor dispatch per op and
    # parameter (3.3 ms against 0.75 ms a step on the tiny model), which FSDP2 and apmodel share
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) if optimizer else None

    def step() -> float:
        loss = forward()
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        return 0.0

    return step


def _apmodel_variant(name: str, mesh: Any, lowering: str, compiled: bool, recipe: str | None = None,
                     planned_for: dict[str, Any] | None = None, plan: Any = None, overlap: bool | None = None,
                     optimizer: bool = True, keep: list | None = None) -> tuple[Callable[[], float], int]:
    """apmodel's program for ``mesh``; ``planned_for``: the options of the hardware the plan is priced
    for (None: parallelize's default, ``device="auto"``, the mesh's own hardware); ``plan``: run this plan instead of planning; ``overlap``: as
    ``parallelize``'s; ``optimizer``: False times forward and backward only (what a plan prices);
    ``keep``: gets the plan the program runs."""
    device = mesh.device_type
    import apmodel
    from apmodel.lowering import load_full_state_dict

    tokens, targets = _batch(name, device)
    ref = _build(name, device)
    full = {k: v.detach().clone() for k, v in list(ref.named_parameters()) + list(ref.named_buffers())}
    del ref
    extra: dict[str, Any] = dict(planned_for or {})
    if recipe is not None:  # the same parallelism as the hand-written baseline, to compare runtimes alone
        extra.update(_recipe_options(recipe, tuple(mesh.shape)))
    if plan is not None:
        extra = {"plan": plan}
    if overlap is not None:
        extra.pop("overlap", None)  # how the program runs; the plan keeps how it was priced
    model = apmodel.parallelize(_build(name, "meta"), mesh, (tokens,), targets=(targets,), loss_fn=_loss,
                                lowering=lowering, overlap=overlap, **extra)
    if keep is not None:
        keep.append(model._apmodel_program.plan)
    model.to_empty(device=device)
    load_full_state_dict(model, full)
    nodes = sum(1 for n in model._apmodel_program.captured.gm.graph.nodes if n.op == "call_function")
    run = torch.compile(model, fullgraph=True) if compiled else model
    return _trainer(model, lambda: run(tokens, targets), optimizer), nodes


#: The planning options of the variants planned for H100s (the planner's default target).
H100: dict[str, Any] = {"device": "h100"}

#: The ranking's plans of the model on --world processes, each (label, how it is made): made for
#: this machine (``"here"``) or another device, a recipe's constraints (those that need two mesh
#: axes are left out on one, except tensor parallelism, which one axis takes alone), planning
#: options (activation checkpointing and bucket sizes change the program too). Every entry is a
#: different program: the same plan with another in-flight limit, or the serial optimum where it
#: equals the overlapped one, is priced the same to the µs and would rank noise (the serial optimum
#: is compared in the variants and in tests/test_overlap.py instead).
RANKED_PLANS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("planner, this machine", {"for": "here"}),
    ("planner, this machine, selective AC", {"for": "here", "ac": "selective"}),
    ("planner, this machine, full AC", {"for": "here", "ac": "full"}),
    ("planner, this machine, unbucketed", {"for": "here", "bucket_mb": 0.0}),
    ("planner, H100", {"for": "h100"}),
    ("planner, A100", {"for": "a100"}),
    ("DDP recipe", {"for": "here", "recipe": "ddp"}),
    ("FSDP recipe", {"for": "here", "recipe": "fsdp"}),
    ("FSDP recipe, unbucketed", {"for": "here", "recipe": "fsdp", "bucket_mb": 0.0}),
    ("Megatron TP recipe", {"for": "here", "recipe": "megatron_tp"}),
    ("Megatron TP+SP recipe", {"for": "here", "recipe": "megatron_tp_sp"}),
)
#: Options of RANKED_PLANS passed to the planner as they are.
RANKED_OPTIONS = ("overlap", "inflight_mb", "bucket_mb", "ac")


def _recipe_options(name: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """A recipe's constraints and storage policy on ``mesh_shape``; on one axis a tensor-parallel
    recipe is tensor parallelism alone (its rules with no data-parallel axis)."""
    from apmodel.reading import recipes

    r = recipes.get(name)
    try:
        constraints = r.constraints(mesh_shape)
    except recipes.NotApplicable:
        if not (r.tensor_parallel and len(mesh_shape) == 1):
            raise
        constraints = r.make(mesh_shape)
    return {"constraints": constraints, "param_policy": r.param_policy}


def _ranking(name: str, mesh: Any, here: dict[str, Any], warmup: int, steps: int) -> list[dict[str, Any]]:
    """Each plan of :data:`RANKED_PLANS`, run with overlap: its step priced for this machine (as the
    program runs it; forward and backward) and measured (median, interleaved rounds)."""
    import apmodel
    from apmodel.reading import recipes

    tokens, targets = _batch(name, "cpu")
    made = []
    failed: list[dict[str, Any]] = []
    programs: dict[str, str] = {}  # a program's strategies and run options -> the first label that made it
    for label, how in RANKED_PLANS:
        options = dict(here) if how["for"] == "here" else {"device": how["for"]}
        options.update({k: v for k, v in how.items() if k in RANKED_OPTIONS})
        if "recipe" in how:
            try:
                options.update(_recipe_options(how["recipe"], tuple(mesh.shape)))
            except recipes.NotApplicable:  # a recipe the mesh cannot take
                continue
        keep: list[Any] = []
        try:
            step, _ = _apmodel_variant(name, mesh, "native", False, planned_for=options, optimizer=False, keep=keep,
                                       overlap=True)
        except RuntimeError as e:  # every rank runs the same plan, so every rank skips it alike
            logger.warning("ranking: %s on %s could not run: %s", label, tuple(mesh.shape), str(e).splitlines()[0])
            failed.append({"model": name, "world": torch.distributed.get_world_size(), "plan": label,
                           "error": str(e).splitlines()[0]})
            continue
        run_options = {k: options[k] for k in ("inflight_mb", "bucket_mb", "ac") if k in options}
        program = repr((sorted((k, str(v)) for k, v in keep[0].node_strategy.items()), sorted(run_options.items())))
        if program in programs:  # the same program twice would rank noise against itself
            logger.warning("ranking: %s is the program of %s; left out", label, programs[program])
            failed.append({"model": name, "world": torch.distributed.get_world_size(), "plan": label,
                           "same_as": programs[program]})
            continue
        programs[program] = label
        # the price of the program that runs, on this machine: the plan replayed under this machine's costs
        priced = apmodel.plan(_build(name, "meta"), tuple(mesh.shape), (tokens.to("meta"),),
                              targets=(targets.to("meta"),), loss_fn=_loss, replay=keep[0],
                              param_policy="free", **{**here, **run_options})  # free: any storage replays
        made.append((label, step, priced))
    measured = _interleaved_median_ms([s for _, s, _ in made], warmup, steps)
    world = torch.distributed.get_world_size()
    return [{"model": name, "world": world, "plan": label, "predicted_ms": p.objective_us / 1e3,
             "measured_ms": ms, "serial_predicted_ms": p.overlap.get("serial_us", p.objective_us) / 1e3,
             "hidden_ms": p.overlap.get("hidden_comm_us", 0.0) / 1e3}
            for (label, _, p), ms in zip(made, measured, strict=False)] + failed


def _calibrate_gloo(out_dir: str, mesh: Any) -> dict[str, Any]:
    """Plan options for this machine, measured as ``parallelize(device="auto")`` measures: the CPU
    device with the collective model corrected by collectives timed on each mesh axis's gloo group
    now, each after :data:`STEP_GAP_US` of compute on every rank (``apmodel calibrate`` from live
    timings), and the compute model fitted to kernels timed on one thread now (``apmodel
    calibrate-compute --quick --threads 1``, the benchmark's thread count) while every other
    process times them too. Rank 0 fits and writes both."""
    import torch.distributed as dist

    import costmodels
    from apmodel.core.options import PlanOptions
    from apmodel.frontend.machine import STEP_GAP_US
    from apmodel.problem.pricing import build_cost_context
    from costmodels.collective_timing import time_collectives
    from costmodels.fitting import calibrate_compute, load_like_calibration

    logs = [(log, axis) for axis in range(mesh.ndim)
            for log in time_collectives(mesh.get_group(axis), busy_us=STEP_GAP_US)]
    path = Path(out_dir, "gloo_calibration.json")
    profile = Path(out_dir, "cpu_profile.json")
    world = dist.get_world_size()
    options = {"device": "cpu", "gpus_per_node": world}
    if dist.get_rank() == 0:
        base = build_cost_context(tuple(mesh.shape), PlanOptions(**options)).comm.model
        costmodels.Calibration.fit(base, logs).save(path)
        for log, _ in logs:
            logger.warning("gloo %s, %d ranks: %s", log.kind, log.ranks,
                           ", ".join(f"{r.size_bytes // 1024} KiB {r.oop_time_us:.0f} µs" for r in log.rows))
        profile.write_text(calibrate_compute(quick=True, threads=1, host_processes=world).profile.dumps(),
                           encoding="utf-8")
    else:  # the step's conditions: every process computing at once
        load_like_calibration(quick=True, threads=1)
    dist.barrier()
    return {**options, "dtype": "fp32", "calibration": str(path), "compute_profile": str(profile)}


def _worker(rank: int, world: int, store: str, out_dir: str, names: list[str], compile_: bool, warmup: int,
            steps: int, device: str, ranking: str = "", mesh_2d: bool = False) -> None:
    """``ranking``: "" (the variants), "also" (then the ranking on the last model), "only" (the
    ranking alone, on a 2 x world/2 mesh when world is 4); ``mesh_2d``: the variants on a 2 x
    world/2 mesh too."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    rows: list[dict[str, Any]] = []
    ranked: list[dict[str, Any]] = []
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        two_d = (ranking == "only" or mesh_2d) and world >= 4 and world % 2 == 0
        mesh = init_device_mesh(device, (2, world // 2) if two_d else (world,))
        this_machine = _calibrate_gloo(out_dir, mesh) if device == "cpu" and world > 1 else None
        for name in names if ranking != "only" else []:
            variants = _variants(name, mesh, world, device, compile_, this_machine)
            built = [(label, *make()) for label, make in variants]
            for ms, (label, _, nodes) in zip(_interleaved_median_ms([step for _, step, _ in built], warmup, steps), built, strict=False):
                rows.append({"model": name, "world": world, "mesh": "x".join(map(str, mesh.shape)), "variant": label,
                             "step_ms": ms, "nodes": nodes})
                if rank == 0:
                    logger.warning("%s, %d process(es), %s: %.2f ms", name, world, label, ms)
            del built
        if ranking and this_machine is not None:
            ranked += _ranking(names[-1], mesh, this_machine, warmup, steps)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))
        Path(out_dir, "ranked.json").write_text(json.dumps(ranked))


def _variants(name: str, mesh: Any, world: int, device: str, compile_: bool, this_machine: dict[str, Any] | None,
              ) -> list[tuple[str, Callable[[], tuple[Callable[[], float], int | None]]]]:
    """(label, make) of each variant timed on ``name``: ``make()`` builds its step (and node count)."""
    tokens, targets = _batch(name, device)
    variants: list[tuple[str, Callable[[], tuple[Callable[[], float], int | None]]]] = []
    if world == 1:
        variants.append(("plain eager", lambda: (_plain(name, tokens, targets, device), None)))
    else:
        variants.append(("DDP", lambda: (_ddp(name, tokens, targets), None)))
        variants.append(("FSDP2", lambda: (_fsdp2(name, mesh, tokens, targets), None)))
    variants.append(("apmodel native", lambda: _apmodel_variant(name, mesh, "native", False, planned_for=H100)))
    if this_machine is not None:
        variants.append(("apmodel native, device auto",  # parallelize measures this machine itself
                         lambda: _apmodel_variant(name, mesh, "native", False)))
        kept: list[Any] = []
        variants.append(("apmodel native, plan for this machine",
                         lambda: _apmodel_variant(name, mesh, "native", False, planned_for=this_machine, keep=kept)))
        variants.append(("apmodel native, plan for this machine, overlap off",  # the same plan, run serially
                         lambda: _apmodel_variant(name, mesh, "native", False, plan=kept[0], overlap=False)))
        # a plan whose weight traffic can hide: FSDP's gathers and reductions, priced for this machine
        fsdp_kept: list[Any] = []
        variants.append(("apmodel native, FSDP plan for this machine",
                         lambda: _apmodel_variant(name, mesh, "native", False, "fsdp", planned_for=this_machine,
                                                  keep=fsdp_kept)))
        variants.append(("apmodel native, FSDP plan for this machine, overlap off",
                         lambda: _apmodel_variant(name, mesh, "native", False, plan=fsdp_kept[0], overlap=False)))
    if world > 1:
        variants.append(("apmodel native, DDP plan",
                         lambda: _apmodel_variant(name, mesh, "native", False, "ddp", planned_for=H100)))
        variants.append(("apmodel native, FSDP plan",
                         lambda: _apmodel_variant(name, mesh, "native", False, "fsdp", planned_for=H100)))
    if compile_:
        variants.append(("apmodel native compiled",
                         lambda: _apmodel_variant(name, mesh, "native", True, planned_for=H100)))
    variants.append(("apmodel interpreter", lambda: _apmodel_variant(name, mesh, "interpret", False, planned_for=H100)))
    return variants


def _plain(name: str, tokens: torch.Tensor, targets: torch.Tensor, device: str = "cpu") -> Callable[[], float]:
    model = _build(name, device)
    return _trainer(model, lambda: _loss(model(tokens), targets))


def _ddp(name: str, tokens: torch.Tensor, targets: torch.Tensor) -> Callable[[], float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_build(name, "cpu"))
    local = tokens.shape[0] // dist.get_world_size()
    r = dist.get_rank()
    x, y = tokens[r * local:(r + 1) * local], targets[r * local:(r + 1) * local]
    return _trainer(model, lambda: _loss(model(x), y))


def _fsdp2(name: str, mesh: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Callable[[], float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh.ndim > 1:  # FSDP2 shards over every process (a 2-D mesh would be HSDP's)
        mesh = init_device_mesh(mesh.device_type, (mesh.size(),))
    model = _build(name, "cpu")
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = tokens.shape[0] // dist.get_world_size()
    r = dist.get_rank()
    x, y = tokens[r * local:(r + 1) * local], targets[r * local:(r + 1) * local]
    return _trainer(model, lambda: _loss(model(x), y))


def _run(world: int, names: list[str], compile_: bool, warmup: int, steps: int,
         device: str = "cpu", ranking: str = "", mesh_2d: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The variants' rows, and the ranking's (with ``ranking``, on the last model)."""
    with tempfile.TemporaryDirectory(prefix="apmodel_runtime_") as tmp:
        args = (world, os.path.join(tmp, "store"), tmp, names, compile_, warmup, steps, device, ranking, mesh_2d)
        mp.start_processes(_worker_entry, args=args, nprocs=world, start_method="spawn")
        return json.loads(Path(tmp, "rows.json").read_text()), json.loads(Path(tmp, "ranked.json").read_text())


def ranking_summary(ranked: list[dict[str, Any]]) -> dict[str, Any]:
    """Per world size: Spearman's rank correlation (ties at their mean rank) between predicted and
    measured steps, and measured / predicted."""
    from scipy.stats import spearmanr

    out: dict[str, Any] = {}
    for world in sorted({r["world"] for r in ranked}):
        rows = [r for r in ranked if r["world"] == world and "measured_ms" in r]
        ratios = [r["measured_ms"] / r["predicted_ms"] for r in rows]
        out[str(world)] = {"plans": len(rows), "spearman": float(spearmanr([r["predicted_ms"] for r in rows],
                                                                               [r["measured_ms"] for r in rows]).statistic),
                           "measured_over_predicted_min": min(ratios), "measured_over_predicted_max": max(ratios)}
    return out


def _worker_entry(rank: int, *args: Any) -> None:
    _worker(rank, *args)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios the README quotes: apmodel on mesh (1,) against plain eager, on `world` processes
    against FSDP2 (and parallelize's ``device="auto"`` plan against the plan for this machine
    calibrated by hand), and the host time per joint-graph node apmodel adds to plain eager."""
    out: dict[str, Any] = {}
    by = {(r["model"], r["world"], r["variant"]): r for r in rows}
    for name in sorted({r["model"] for r in rows}):
        plain = by.get((name, 1, "plain eager"))
        s: dict[str, Any] = {}
        for variant in ("apmodel native", "apmodel native, plan for this machine", "apmodel native compiled",
                        "apmodel interpreter", "apmodel native, FSDP plan"):
            one = by.get((name, 1, variant))
            if one and plain:
                s[f"{variant} / plain eager"] = one["step_ms"] / plain["step_ms"]
                s[f"{variant} host_us_per_node"] = max(0.0, one["step_ms"] - plain["step_ms"]) * 1e3 / one["nodes"]
            for (m, w, v), r in by.items():
                if m == name and v == variant and w > 1 and (m, w, "FSDP2") in by:
                    s[f"{variant} / FSDP2 ({w} processes)"] = r["step_ms"] / by[(m, w, "FSDP2")]["step_ms"]
        for (m, w, v), r in by.items():  # parallelize's own measurement of the machine against the benchmark's
            hand = by.get((m, w, "apmodel native, plan for this machine"))
            if m == name and v == "apmodel native, device auto" and hand:
                s[f"device auto / plan for this machine ({w} processes)"] = r["step_ms"] / hand["step_ms"]
            serial = by.get((m, w, v + ", overlap off"))  # the same plan with and without overlap
            if m == name and serial:
                s[f"{v}: overlap on / off ({w} processes)"] = r["step_ms"] / serial["step_ms"]
        out[name] = s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,mid", help="comma-separated: tiny, mid")
    ap.add_argument("--world", type=int, default=2, help="processes of the multi-process variants")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile (Inductor) variants")
    ap.add_argument("--json", default=None, metavar="PATH", help="write rows and ratios as JSON")
    ap.add_argument("--ranking", action="store_true",
                    help="also rank the plans of RANKED_PLANS (last model): predicted against measured steps")
    ap.add_argument("--ranking-only", action="store_true", help="the ranking alone, on --world and --ranking-worlds")
    ap.add_argument("--ranking-worlds", default="", help="comma-separated further process counts for the ranking "
                                                         "alone (e.g. 4: a 2x2 mesh)")
    ap.add_argument("--mesh-2d", action="store_true", help="the multi-process variants on a 2 x world/2 mesh "
                                                          "(world 4: 2x2) instead of a 1D one")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one process on one GPU (NCCL), the one-process variants only")
    args = ap.parse_args(argv)
    args.ranking_worlds = [int(w) for w in args.ranking_worlds.split(",") if w.strip()]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {sorted(MODELS)}")
    rows: list[dict[str, Any]] = []
    ranked: list[dict[str, Any]] = []
    if args.ranking_only:
        for world in [args.world, *args.ranking_worlds]:
            ranked += _run(world, names, False, args.warmup, args.steps, ranking="only")[1]
    else:
        rows = _run(1, names, not args.no_compile, args.warmup, args.steps, args.device)[0]
    if args.device == "cpu" and not args.ranking_only:
        more, ranked = _run(args.world, names, not args.no_compile, args.warmup, args.steps,
                            ranking="also" if args.ranking else "", mesh_2d=args.mesh_2d)
        rows += more
        for world in args.ranking_worlds:
            ranked += _run(world, names, False, args.warmup, args.steps, ranking="only")[1]
    where = "CPU, gloo" if args.device == "cpu" else "CUDA, NCCL"
    table = Table(title=f"median step, AdamW, {args.steps} steps after {args.warmup} (torch {torch.__version__}, {where})")
    for col in ("model", "processes", "variant", "step ms", "graph nodes"):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for r in rows:
        table.add_row(r["model"], str(r["world"]), r["variant"], f"{r['step_ms']:.2f}",
                      "" if r["nodes"] is None else str(r["nodes"]))
    console = Console()
    console.print(table)
    ratios = summarise(rows)
    for name, s in ratios.items():
        for k, v in s.items():
            console.print(f"{name}: {k} = {v:.2f}")
    ranks = ranking_summary(ranked) if ranked else {}
    if ranked:
        table = Table(title="plans ranked: predicted (priced for this machine, with overlap) and measured step, "
                            "forward + backward")
        for col in ("model", "processes", "plan", "predicted ms", "serial ms", "measured ms", "measured / predicted"):
            table.add_column(col, justify="left" if col in ("model", "plan") else "right")
        for r in (r for r in ranked if "measured_ms" in r):
            table.add_row(r["model"], str(r["world"]), r["plan"], f"{r['predicted_ms']:.2f}",
                          f"{r['serial_predicted_ms']:.2f}", f"{r['measured_ms']:.2f}",
                          f"{r['measured_ms'] / r['predicted_ms']:.2f}")
        console.print(table)
        for r in (r for r in ranked if "measured_ms" not in r):
            console.print(f"{r['plan']} ({r['world']} processes): " + (
                f"the program of {r['same_as']}" if "same_as" in r else f"did not run: {r['error']}"))
        for world, s in ranks.items():
            console.print(f"ranking on {world} processes: Spearman {s['spearman']:.2f}, measured / predicted "
                          f"{s['measured_over_predicted_min']:.2f} to {s['measured_over_predicted_max']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios, "ranked": ranked, "ranking": ranks},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

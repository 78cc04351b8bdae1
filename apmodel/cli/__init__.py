"""The ``apmodel`` command: plan, explain, diff, report, calibrate, devices.

    apmodel plan --model llama3-8b --mesh 4x8 --device h100 --seq 2048 --batch 8 --solver trws
    apmodel plan ... --compare-recipes          # price DDP / FSDP / Megatron TP / FSDP+TP too
    apmodel plan ... --json                     # one JSON object on stdout (see docs/design.md)
    apmodel explain plan.json layers.0.attention.wq.weight
    apmodel diff a.json b.json
    apmodel plan ... --report plan.html --png figures/   # a one-page HTML report, its figures as PNGs
    apmodel report plan.json -o plan.html              # the report of a saved plan; two files: a diff
    apmodel calibrate all_gather_perf.log --axis 1 --mesh 4x8 --out calibration.json
    apmodel calibrate-compute --out compute_profile.json   # measure this machine's kernels, fit a profile
    apmodel devices

``--model`` is a preset of :mod:`apmodel.models` or ``package.module:factory``: a callable returning
``(model, sample_inputs)`` or ``(model, sample_inputs, loss_fn)``; it is called inside
``torch.device("meta")`` with those of the keyword arguments ``batch``, ``seq``, ``layers`` that its
signature accepts. Without ``loss_fn`` the model's output must be the scalar loss.

Results go to stdout (rich tables, or JSON with ``--json``); progress and logs go to stderr.
Every failure is one line ``error: ...`` on stderr naming what is wrong, with exit code 2 (``-vv``
shows the traceback instead); all of them go through :func:`error_boundary`.
Heavy imports (torch) happen inside the commands so that ``--help`` is quick.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from apmodel.cli.errors import CLIError, describe_error, error_boundary, results_console
from apmodel.cli.flags import options_from_flags, with_option_flags, workload_flag
from apmodel.cli.output import JSON_KEYS as JSON_KEYS  # the public contract's keys, re-exported
from apmodel.cli.output import plan_json, print_plan
from apmodel.core.formatting import fmt_bytes as _fmt_bytes
from apmodel.core.formatting import fmt_us as _fmt_us
from apmodel.core.formatting import strategy_str as _strategy_str

if TYPE_CHECKING:
    from rich.status import Status

    from apmodel.core.options import PlanOptions

logger = logging.getLogger("apmodel.cli")

app = typer.Typer(
    name="apmodel",
    help="Plan how to split a PyTorch training step across a device mesh.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# ---------------------------------------------------------------------------------- helpers
def _setup_logging(verbose: int) -> None:
    from rich.logging import RichHandler

    level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_apmodel_cli", False):
            root.removeHandler(h)
    handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=verbose >= 1)
    handler._apmodel_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Put the working directory first on ``sys.path`` (as ``python -m`` does) for ``pkg.mod:name``.

    The ``apmodel`` console script runs with its bin directory, not the cwd, on ``sys.path``; a
    model module next to the user would not be found. The entry is removed afterwards so that
    in-process callers (tests) keep their path."""
    cwd = os.getcwd()
    if any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        yield
        return
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module file created moments ago (tests) must be seen
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def check_writable(path: Path, flag: str = "--out") -> None:
    """Raise :class:`CLIError` unless ``path`` can be written: checked before the slow work, not after."""
    if path.is_dir():
        raise CLIError(f"{flag} {str(path)!r} is a directory")
    parent = path.parent
    if not parent.is_dir():
        anc = parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if anc.exists() and not anc.is_dir():
            raise CLIError(f"{flag} {str(path)!r}: {str(anc)!r} is a file, not a directory")
        raise CLIError(f"{flag} {str(path)!r}: directory {str(parent)!r} does not exist")
    ok = os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not ok:
        raise CLIError(f"{flag} {str(path)!r}: permission denied")


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """Send everything written to stdout (Python and C level, e.g. solver banners) to stderr."""
    if not active:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real fd 1
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _Progress:
    """Stage messages: a rich status line on a terminal, INFO logs otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self._status: Status | None = None

    def __enter__(self) -> "_Progress":
        if self.live:
            self._status = self.console.status("starting")
            self._status.__enter__()
        return self

    def stage(self, text: str) -> None:
        logger.info("%s", text)
        if self._status is not None:
            self._status.update(Text(text, style="bold"))  # model names may hold brackets

    def done(self, text: str) -> None:
        if self.live:
            self.console.print(f"[green]✓[/] {text}", highlight=False)

    def __exit__(self, *exc: Any) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)


# ------------------------------------------------------------------------------------ plan
def _merged_config(config: Optional[Path], option_flags: Mapping[str, Any], **workload: Any):
    """The configuration file with the flags over it: the workload's (``None``: not given) and the
    planning options' (:func:`~apmodel.cli.flags.options_from_flags`); workload defaults filled in.
    Option defaults are :class:`~apmodel.core.options.PlanOptions`' own."""
    from apmodel.frontend.config import Config, load_config
    from apmodel.frontend.workloads import DEFAULT_BATCH, default_seq

    cfg = load_config(config) if config is not None else Config()  # ConfigError names file and key
    for key, value in workload.items():
        if value is not None:
            setattr(cfg, key, value)
    for name, value in options_from_flags(option_flags).items():  # a table's keys one by one (--topology)
        cfg.options[name] = {**cfg.options.get(name, {}), **value} if isinstance(value, dict) else value
    if cfg.seq is None:
        cfg.seq = default_seq(cfg.model)
    if cfg.batch is None:
        cfg.batch = DEFAULT_BATCH
    return cfg


def _check_files(cfg) -> None:
    """Every file an option names exists (checked before tracing): say which option and where it came from."""
    from apmodel.core.options import option_specs

    for name, spec in option_specs().items():
        path = cfg.options.get(name) if spec.kind == "path" else None
        if path is not None and not Path(path).is_file():
            where = f"{spec.flag} or key '{spec.toml}' of {cfg.source}"
            raise CLIError(f"{name.replace('_', ' ')} {path!r} ({where}) "
                           f"{'is not a file' if Path(path).exists() else 'does not exist'}")


def run_plan(cfg, *, compare_recipes: bool, out: Optional[Path], progress: _Progress):
    """``apmodel plan``: check the inputs, build the workload, call the API's one planning path.

    Cheap input checks (mesh, ``out``, files, backends, options) come first, before torch is
    imported and the model traced, so that a typo costs no waiting."""
    import solvers  # torch-free
    from apmodel.core.options import option_spec
    from apmodel.frontend.workloads import parse_mesh

    if cfg.model is None:
        raise ValueError("no model: give --model (a preset, package.module:factory or hf:NAME) or [workload] model "
                         "in --config")
    if cfg.mesh is None:
        raise ValueError("no mesh: give --mesh (e.g. 4x8) or [workload] mesh in --config")
    mesh = parse_mesh(cfg.mesh)
    if out is not None:
        check_writable(out)
    _check_files(cfg)
    options = cfg.plan_options()
    options.check_available(lambda name: option_spec(name).flag)
    options.check_mesh(mesh, lambda name: option_spec(name).flag)

    from apmodel.entry.api import plan_workload
    from apmodel.frontend.workloads import TraceFailed, load_workload

    progress.stage(f"tracing {cfg.model} (seq {cfg.seq}, batch {cfg.batch})")
    record = {"config": None if cfg.source == "<defaults>" else str(Path(cfg.source).resolve())}
    try:
        workload = load_workload(cfg.model, mesh, batch=cfg.batch, seq=cfg.seq, layers=cfg.layers)
        result = plan_workload(workload, options, constraints=cfg.constraints, compare_recipes=compare_recipes,
                               record=record, progress=progress)
    except TraceFailed as e:  # data-dependent ops, unsupported ops...: name the model and the op
        raise CLIError(f"--model {e.model!r}: {e.what}: {describe_error(e.cause)}") from e
    except solvers.TimeLimitReached as e:
        hint = "a longer --time-limit" + ("" if options.solver == "trws" else " or --solver trws (approximate, fast)")
        limit = "no" if options.time_limit is None else f"{options.time_limit:g} s"
        raise CLIError(f"solver {options.solver!r} reached its time limit ({limit}) before finding any "
                       f"feasible assignment: try {hint}") from e
    if out is not None:
        try:
            result.plan.save(out)
        except OSError as e:  # checked writable up front; it can still fail (disk full, removed directory)
            raise CLIError(f"--out {str(out)!r}: cannot write the plan: {e.strerror or e}") from e
    return result


@app.command()
@with_option_flags()
def plan(
    model: Optional[str] = workload_flag("model", "-m"),
    mesh: Optional[str] = workload_flag("mesh"),
    seq: Optional[int] = workload_flag("seq"),
    batch: Optional[int] = workload_flag("batch"),
    layers: Optional[int] = workload_flag("layers"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML configuration file (flags override it)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Save the plan (JSON) here."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables."),
    compare_recipes: bool = typer.Option(False, "--compare-recipes", help="Also price DDP, FSDP, HSDP, Megatron TP (+SP), FSDP+TP and, where the model has the regions, FSDP+EP, FSDP+TP+EP and FSDP+TP+CP as forced plans."),
    report_html: Optional[Path] = typer.Option(None, "--report", help="Also write a one-page, self-contained HTML report of the plan here."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write the report's figures as PNGs into this directory (needs matplotlib)."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="-v: INFO logs on stderr; -vv: DEBUG."),
    *,
    option_flags: Mapping[str, Any],
) -> None:
    """Plan a model on a mesh and print the plan (or --json). Every planning option has a flag
    (below, by group) and a key of the --config file; the README's options table lists them."""
    _setup_logging(verbose)
    with error_boundary(verbose), _cwd_importable():
        cfg = _merged_config(config, option_flags, model=model, mesh=mesh, seq=seq, batch=batch, layers=layers)
        _check_report_outputs(report_html, png)
        with _stdout_to_stderr(True), _Progress(True) as progress:
            result = run_plan(cfg, compare_recipes=compare_recipes, out=out, progress=progress)
        _write_report(result.plan, report_html, png, recipes=result.recipes, free_plan=result.free_plan,
                      warnings=result.warnings)
        if json_out:
            typer.echo(json.dumps(plan_json(result, cfg), default=float))
        else:
            print_plan(result, cfg, results_console())
            if out is not None:
                results_console().print(f"plan saved to {out}", highlight=False, markup=False)


# --------------------------------------------------------------------------------- explain
@app.command()
def explain(
    plan_file: Path = typer.Argument(..., exists=True, dir_okay=False, help="A plan saved by `apmodel plan --out`."),
    target: str = typer.Argument(..., help="A graph node name (e.g. mm_3) or a parameter FQN."),
    top: int = typer.Option(20, "--top", min=1, help="Show this many cheapest candidates (and the chosen one)."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="-v: INFO logs on stderr."),
) -> None:
    """Why the plan chose what it chose at one node: every candidate priced with its neighbours fixed."""
    _setup_logging(verbose)
    with error_boundary(verbose), _cwd_importable():
        _explain(plan_file, target, top)


def _explain(plan_file: Path, target: str, top: int) -> None:
    from apmodel.entry.api import attach
    from apmodel.result.plans import Plan

    saved = Plan.load(plan_file)
    with _Progress(True) as progress:
        attach(saved, progress=progress)
    pm = saved.model
    assert pm is not None  # attach sets it
    node = pm.fqn_to_node.get(target, target)
    rows = saved.explain(target)
    by_str = {str(s): s for s in pm.strategies[node]}
    console = results_console()
    n = pm.node_by_name[node]
    console.print(f"[bold]{escape(target)}[/] (node {escape(node)}, {escape(str(n.target))}), {len(rows)} candidates; "
                  f"planned: {_strategy_str(saved.node_strategy[node])}", highlight=False)
    t = Table(title="Candidates, neighbours held at the plan (µs)", title_justify="left")
    for col in ("", "outputs ← inputs", "compute", "comm", "total", "allowed"):
        t.add_column(col, justify="right" if col in ("compute", "comm", "total") else "left")
    shown = [r for i, r in enumerate(rows) if i < top or r["chosen"]]
    for r in shown:
        t.add_row("★" if r["chosen"] else "", _strategy_str(by_str[r["strategy"]]), _fmt_us(r["compute_us"]),
                  _fmt_us(r["comm_us"]), _fmt_us(r["total_us"]), "yes" if r["allowed"] else "no",
                  style="bold" if r["chosen"] else None)
    console.print(t)
    reasons = pm.restriction_reasons(node)
    if reasons:
        console.print("restricted by: " + "; ".join(reasons), style="dim", highlight=False, markup=False)


# ------------------------------------------------------------------------------------ diff
@app.command()
def diff(
    a: Path = typer.Argument(..., exists=True, dir_okay=False, help="First plan file."),
    b: Path = typer.Argument(..., exists=True, dir_okay=False, help="Second plan file."),
    limit: int = typer.Option(40, "--limit", min=0, help="Show at most this many differing nodes."),
) -> None:
    """Compare two plans: objectives, parameter placements, node strategies."""
    with error_boundary():
        _diff(a, b, limit)


def _diff(a: Path, b: Path, limit: int) -> None:
    from apmodel.result.plans import Plan
    from apmodel.result.plans import diff as plan_diff

    pa, pb = Plan.load(a), Plan.load(b)
    console = results_console()
    t = Table(title="Plans", title_justify="left")
    for col in ("", "mesh", "objective µs", "compute µs", "comm µs", "solver"):
        t.add_column(col)
    for label, p in (("a", pa), ("b", pb)):
        staged = p.step_objective_us != p.objective_us  # a pipeline's stage plan: its figures are per microbatch
        t.add_row(escape(f"{label}: {a if label == 'a' else b}"), "x".join(map(str, p.mesh_shape)),
                  _fmt_us(p.step_objective_us) + (" (pipeline step)" if staged else ""),
                  "–" if staged else _fmt_us(p.compute_us), "–" if staged else _fmt_us(p.comm_us),
                  f"{p.solver.get('backend', '?')} {p.solver.get('status', '')}")
    console.print(t)
    step_a, step_b = pa.step_objective_us, pb.step_objective_us
    if step_a > 0:
        console.print(f"b - a: {step_b - step_a:+,.1f} µs ({100 * (step_b - step_a) / step_a:+.2f}%)", highlight=False)
    if pa.fingerprint != pb.fingerprint:
        console.print("[yellow]note:[/] the plans were made for different graphs (fingerprints differ)", highlight=False)
    if tuple(pa.mesh_shape) != tuple(pb.mesh_shape):
        console.print("[yellow]note:[/] the plans were made for different meshes", highlight=False)
    rows = plan_diff(pa, pb, allow_mismatch=True)  # the notes above say what differs; compare by name
    params = [r for r in rows if r["kind"] == "param"]
    nodes = [r for r in rows if r["kind"] == "node"]
    if not rows:
        console.print("identical placements")
        return
    if params:
        t = Table(title=f"Parameters placed differently ({len(params)})", title_justify="left")
        for col in ("parameter", "a", "b"):
            t.add_column(col)
        for r in params:
            t.add_row(escape(r["name"]), escape(str(r["a"])), escape(str(r["b"])))
        console.print(t)
    t = Table(title=f"Nodes with a different strategy ({len(nodes)}, showing {min(limit, len(nodes))})", title_justify="left")
    for col in ("node", "a", "b"):
        t.add_column(col)
    sa, sb = pa.node_strategy, pb.node_strategy
    for r in nodes[:limit]:
        t.add_row(r["name"], _strategy_str(sa[r["name"]]) if r["name"] in sa else "—",
                  _strategy_str(sb[r["name"]]) if r["name"] in sb else "—")
    console.print(t)


# ---------------------------------------------------------------------------------- report
def _check_report_outputs(html_out: Optional[Path], png: Optional[Path], flag: str = "--report") -> None:
    """Fail on an unwritable ``--report`` or ``--png`` before the slow work, not after."""
    import importlib.util

    if html_out is not None:
        check_writable(html_out, flag)
    if png is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise CLIError("--png needs matplotlib: pip install matplotlib (in a checkout: pip install -e '.[report]'; "
                           "installed from a wheel: pip install 'apmodel[report]')")
        if png.exists() and not png.is_dir():
            raise CLIError(f"--png {str(png)!r} is a file, not a directory")
        png.mkdir(parents=True, exist_ok=True)


def _write_report(plan, html_out: Optional[Path], png: Optional[Path], **page: Any) -> None:
    """Write the HTML report and/or the PNG figures of ``plan``; say where on stderr."""
    from apmodel.reading import report

    console = Console(stderr=True, highlight=False)
    if html_out is not None:
        html_out.write_text(report.plan_page(plan, **page), encoding="utf-8")
        console.print(f"report written to {html_out}", markup=False)
    if png is not None:
        paths = report.write_pngs(plan, png, recipes=page.get("recipes"), free_plan=page.get("free_plan"))
        console.print(f"{len(paths)} figures written to {png}", markup=False)


@app.command()
def report(
    plans: list[Path] = typer.Argument(..., exists=True, dir_okay=False, metavar="PLAN", help="A plan file (its report), or two (what changed from the first to the second)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write. Default: the plan file with .html; for two plans A-vs-B.html next to A."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write the figures as PNGs into this directory (one plan; needs matplotlib)."),
    trace: bool = typer.Option(True, "--trace/--no-trace", help="Re-trace the plan's model to show how parameters are used (FSDP or TP); --no-trace shows storage only."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="-v: INFO logs on stderr."),
) -> None:
    """A one-page HTML report of a saved plan, or of the differences between two plans."""
    _setup_logging(verbose)
    with error_boundary(verbose), _cwd_importable():
        _report(plans, out, png, trace)


def _report(plans: list[Path], out: Optional[Path], png: Optional[Path], trace: bool) -> None:
    from apmodel.reading import report as R
    from apmodel.result.plans import Plan

    if len(plans) > 2:
        raise CLIError(f"report takes one plan file (a report) or two (a diff), got {len(plans)}")
    if len(plans) == 2 and png is not None:
        raise CLIError("--png draws the figures of one plan; give one plan file")
    if out is None:
        a = plans[0]
        out = a.with_suffix(".html") if len(plans) == 1 else a.with_name(f"{a.stem}-vs-{plans[1].stem}.html")
    _check_report_outputs(out, png, "--out")
    loaded = [Plan.load(p) for p in plans]
    if len(loaded) == 2:
        out.write_text(R.diff_page(*loaded, names=(str(plans[0]), str(plans[1]))), encoding="utf-8")
        Console(stderr=True, highlight=False).print(f"diff written to {out}", markup=False)
        return
    saved, notes = loaded[0], []
    if trace:
        from apmodel.entry.api import attach

        try:
            with _Progress(True) as progress:
                attach(saved, progress=progress)
        except Exception as e:  # the page is still useful without uses: say why they are missing
            logger.debug("re-tracing failed", exc_info=True)
            notes.append(f"could not re-trace the plan's model, so parameter uses are not shown: {describe_error(e)}")
            logger.warning("%s", notes[-1])
    page = R.plan_page(saved, source=str(plans[0]), notes=notes)
    out.write_text(page, encoding="utf-8")
    Console(stderr=True, highlight=False).print(f"report written to {out}", markup=False)
    if png is not None:
        _write_report(saved, None, png)


# ------------------------------------------------------------------------------- calibrate
@app.command()
@with_option_flags("device", "gpus_per_node")
def calibrate(
    logs: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="nccl-tests output files (one collective each)."),
    out: Path = typer.Option(..., "--out", "-o", help="Write the calibration (JSON) here."),
    axis: list[int] = typer.Option([0], "--axis", min=0, help="Mesh axis the logs were measured on: once for all logs, or once per log in order (intra- and inter-node logs in one calibration)."),
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1, help="Ranks the logs ran on, for logs that do not print '# Rank' lines."),
    kind: str = typer.Option("auto", "--kind", help="Collective: auto (from the log), all_gather, reduce_scatter, all_reduce, all_to_all, broadcast."),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="Mesh shape the axis belongs to. Default: the log's rank count as a 1D mesh."),
    use: str = typer.Option("out_of_place", "--use", help="Measured time to fit: out_of_place, in_place or min."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="-v: INFO logs on stderr."),
    *,
    option_flags: Mapping[str, Any],
) -> None:
    """Fit per-collective correction curves of the NCCL model to nccl-tests logs (of the device
    and nodes --device and --gpus-per-node give, as for `apmodel plan`)."""
    from apmodel.core.options import PlanOptions

    _setup_logging(verbose)
    with error_boundary(verbose):
        options = PlanOptions(**options_from_flags(option_flags))
        _calibrate(logs, out, axes=axis, ranks=ranks, kind=kind, mesh=mesh, options=options, use=use)


def _calibrate(logs: list[Path], out: Path, *, axes: list[int], ranks: Optional[int], kind: str, mesh: Optional[str],
               options: "PlanOptions", use: str) -> None:
    import costmodels
    from apmodel.core.options import option_spec

    device, gpus_per_node = options.device_name, options.gpus_per_node

    check_writable(out)
    if len(axes) not in (1, len(logs)):
        raise ValueError(f"{len(axes)} --axis values for {len(logs)} logs: give one for all logs, "
                         "or one per log in order")
    axes = axes * len(logs) if len(axes) == 1 else axes
    parsed = [costmodels.parse_nccl_tests(p, kind=None if kind == "auto" else kind) for p in logs]
    for p, log in zip(logs, parsed, strict=True):
        if log.kind is None:
            raise ValueError(f"{p}: cannot tell the collective from the log; pass --kind")
        if ranks is not None:
            if log.ranks is not None and log.ranks != ranks:
                raise ValueError(f"{p}: the log prints {log.ranks} '# Rank' lines, but --ranks is {ranks}")
            log.ranks = ranks
    if mesh is not None:
        from apmodel.frontend.workloads import parse_mesh

        shape = parse_mesh(mesh)
    else:
        counts = {log.ranks for log in parsed if log.ranks}
        if len(counts) > 1:
            raise ValueError(f"logs have different rank counts {sorted(counts)}; pass --mesh")
        if not counts:
            raise ValueError(f"{logs[0]}: the log does not say how many ranks it ran on (no '# Rank' lines); "
                             "pass --ranks N or --mesh")
        shape = (counts.pop(),)
    for log, ax in zip(parsed, axes, strict=True):
        if ax >= len(shape):
            raise ValueError(f"--axis {ax} is not an axis of mesh {shape}")
        if log.ranks is None:  # --mesh gives the axis size: the rank count of a log measured on it
            log.ranks = shape[ax]
    options.check_mesh(shape, lambda name: option_spec(name).flag)  # the nodes the logs' axes cross
    base = costmodels.NCCLCollectives(costmodels.Topology(shape, costmodels.device(device), gpus_per_node))
    pairs = list(zip(parsed, axes, strict=True))
    cal = costmodels.Calibration.fit(base, pairs, use=use)
    cal.meta.update({"device": device, "gpus_per_node": gpus_per_node, "mesh_shape": list(shape),
                     "sources": [str(p) for p in logs]})
    cal.save(out)
    console = results_console()
    t = Table(title=f"Calibration of the NCCL model ({escape(device)}, mesh {'x'.join(map(str, shape))})", title_justify="left")
    for col in ("collective", "axis", "sizes", "factor at min", "factor at max", "range"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for (k, ax), c in sorted(cal.curves.items()):
        t.add_row(k, str(ax), f"{_fmt_bytes(2 ** c.log2_sizes[0])} – {_fmt_bytes(2 ** c.log2_sizes[-1])}",
                  f"{c.factors[0]:.3f}", f"{c.factors[-1]:.3f}", f"{min(c.factors):.3f} – {max(c.factors):.3f}")
    console.print(t)
    report = cal.fit_report(base, pairs, use=use)
    t = Table(title="Measured / predicted by size class (median), default model and calibrated", title_justify="left")
    for col in ("log", "collective", "axis", "sizes", "default", "calibrated"):
        t.add_column(col, justify="left" if col in ("log", "collective", "sizes") else "right")
    for r in report:
        t.add_row(escape(Path(r["source"]).name), r["kind"], str(r["axis"]), r["size_class"], f"{r['before']:.3f}",
                  f"{r['after']:.3f}" + (" (worse)" if r["worse"] else ""))
    console.print(t)
    worse = [r for r in report if r["worse"]]
    if worse:
        logger.warning("the calibration is further from the measurements than the default model for %s "
                       "(logs of one collective and axis that disagree are averaged)",
                       ", ".join(f"{Path(r['source']).name} {r['size_class']}" for r in worse))
    console.print(f"calibration saved to {out} (use it with [pricing] calibration = \"{out}\")", highlight=False, markup=False)


@app.command("calibrate-compute")
def calibrate_compute(
    out: Path = typer.Option(..., "--out", "-o", help="Write the fitted compute profile (JSON) here (the configuration's pricing.compute_profile)."),
    measurements_out: Optional[Path] = typer.Option(None, "--measurements-out", help="Write the kernel timings (JSON) here. Default: next to --out, NAME_kernels.json."),
    quick: bool = typer.Option(False, "--quick", help="A few sizes per kernel class (seconds; for tests). The full set takes minutes."),
    device_name: Optional[str] = typer.Option(None, "--device-name", help="Device the profile is for (see `apmodel devices`). Default: recognised from the GPU's name; cpu on a CPU."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads while measuring (default: torch's); a CPU profile holds for this many."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="-v: INFO logs on stderr (every kernel)."),
) -> None:
    """Measure kernels on this machine (its GPU if CUDA is present, else the CPU) and fit a compute profile."""
    _setup_logging(verbose)
    with error_boundary(verbose):
        check_writable(out)
        meas_out = measurements_out if measurements_out is not None else out.with_name(f"{out.stem}_kernels.json")
        check_writable(meas_out, "--measurements-out")
        if meas_out.resolve() == out.resolve():
            raise CLIError("--measurements-out must be another file than --out")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        import costmodels
        from costmodels import fitting

        err = Console(stderr=True)
        with Progress(TextColumn("measuring kernels"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("measure", total=None)
            cal = fitting.calibrate_compute(quick=quick, device_name=device_name, threads=threads,
                                            measurements_name=meas_out.name,
                                            progress=lambda done, total: bar.update(task, completed=done, total=total))
        meas_out.write_text(json.dumps(cal.measurements, indent=1) + "\n", encoding="utf-8")
        out.write_text(cal.profile.dumps(), encoding="utf-8")
        costmodels.compute_model(cal.profile.device, profile=str(out))  # what the planner will load
        logger.info("wrote %s and %s", out, meas_out)
        rep = cal.reports["eager"]
        t = Table(title=f"Compute profile of {escape(cal.profile.device)} ({escape(cal.measurements['hardware'])}): "
                        "fitted vs measured, eager", title_justify="left")
        for col in ("class", "kernels", "median |pred/meas - 1|", "largest factor"):
            t.add_column(col, justify="left" if col == "class" else "right")
        for k, v in rep["by_class"].items():
            t.add_row(escape(k), str(v["rows"]), f"{math.expm1(v['median_abs_log_err']):.1%}", f"{v['max_factor']:.2f}x")
        t.add_row("all", str(rep["rows"]), f"{rep['median_abs_rel_err']:.1%}", f"{rep['max_factor']:.2f}x")
        console = results_console()
        console.print(t)
        notes = [f"{len(cal.measurements['skipped'])} kernels the device cannot run were skipped"] if cal.measurements["skipped"] else []
        if cal.fit.unconstrained:
            notes.append(f"{len(cal.fit.unconstrained)} parameters no kernel constrains kept their starting values "
                         "(profile fit.unconstrained)")
        for note in notes:
            console.print(f"note: {note}", highlight=False, markup=False)
        console.print(f"compute profile saved to {out} (executions: {', '.join(cal.profile.executions)}; "
                      f"use it with [pricing] compute_profile = \"{out}\"); kernel timings saved to {meas_out}",
                      highlight=False, markup=False)


# --------------------------------------------------------------------------------- devices
@app.command()
def devices() -> None:
    """The device registry: peak throughput, memory, fabric, network."""
    with error_boundary():
        _devices()


def _devices() -> None:
    from costmodels.hardware import ALIASES, BUILTIN_DEVICES

    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    t = Table(title="Devices (per GPU; GB/s per direction)", title_justify="left")
    for col in ("name", "aliases", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM TB/s", "HBM GiB", "fabric", "fabric GB/s", "NVLS", "NIC GB/s"):
        t.add_column(col, justify="left" if col in ("name", "aliases", "fabric") else "right")
    for name, d in BUILTIN_DEVICES.items():
        fp8 = d.peak_tflops.get("fp8")
        t.add_row(name, ", ".join(sorted(aliases.get(name, []))), f"{d.peak_flops('bf16') / 1e12:,.0f}",
                  "—" if fp8 is None else f"{fp8:,.0f}", f"{d.hbm_TBps:.2f}", f"{d.hbm_GiB:.0f}",
                  d.fabric.kind, f"{d.fabric.GBps:.0f}", "yes" if d.fabric.nvls else "no", f"{d.nic_GBps:.1f}")
    results_console().print(t)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

"""The plan report: one self-contained HTML page (and PNGs) per plan, and the page of a diff."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import apmodel
from apmodel import models
from apmodel.cli import app
from apmodel.core import placements as pl
from apmodel.core.formatting import fmt_bytes
from apmodel.reading import report, report_data, report_figures
from apmodel.reading.recipes import RecipeResult
from apmodel.reading.roles import param_role, param_uses
from apmodel.result.plans import Plan

OVERRIDES = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=128, max_seq_len=32)
CLI_PLAN = ["plan", "--model", "llama3-debug", "--mesh", "2x2", "--layers", "1", "--seq", "32", "--batch", "8"]
SECTIONS = ("summary", "placements", "time", "memory", "recipes", "warnings")
#: Elements that never have a closing tag in HTML.
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@pytest.fixture(scope="module")
def plan() -> Plan:
    with torch.device("meta"):
        m = models.build("llama3-debug", **OVERRIDES)
    inputs = models.sample_inputs(models.config("llama3-debug", **OVERRIDES), 8, 32, device="meta")
    return apmodel.plan(m, (2, 2), inputs)


@pytest.fixture(scope="module")
def page(plan) -> str:
    return report.plan_page(plan)


@pytest.fixture(scope="module")
def cli_plan(tmp_path_factory):
    """One `apmodel plan ... --out --report --png` run shared by the CLI tests."""
    d = tmp_path_factory.mktemp("cli")
    res = CliRunner().invoke(app, [*CLI_PLAN, "--out", str(d / "p.json"), "--report", str(d / "p.html"),
                                   "--png", str(d / "png")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return d


class Checked(HTMLParser):
    """Parses a page and records unbalanced tags, ids, text and any reference to another resource."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: set[str] = set()
        self.external: list[str] = []
        self.chunks: list[str] = []
        self.feed(text)
        self.close()
        self.errors += [f"<{t}> never closed" for t in self.stack]
        self.text = " ".join(" ".join(self.chunks).split())

    def _attrs(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("src", "href", "xlink:href", "action", "data", "poster"):
            if re.match(r"\s*(https?:)?//", a.get(key, ""), re.I):
                self.external.append(f"<{tag} {key}={a[key]}>")
        if tag == "script" and "src" in a:
            self.external.append(f"<script src={a['src']}>")
        if tag == "link" and a.get("href"):
            self.external.append(f"<link href={a['href']}>")

    def handle_starttag(self, tag, attrs):
        self._attrs(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._attrs(tag, attrs)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else 'nothing'}>")
            if tag in self.stack:  # resynchronise so one slip is reported once
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(tag):]
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.chunks.append(data)


def check_self_contained(text: str) -> Checked:
    doc = Checked(text)
    assert text.startswith("<!DOCTYPE html>")
    assert doc.errors == []
    assert doc.external == []
    assert not re.search(r"url\(|@import|<iframe|<object|<embed", text, re.I)
    return doc


# ------------------------------------------------------------------------------ the page
def test_page_is_well_formed_and_self_contained(page):
    doc = check_self_contained(page)
    assert "<script" not in page  # nothing runs: nothing can fetch
    assert {*SECTIONS, "placement-grid", "time-breakdown", "per-layer", "memory"} <= doc.ids


def test_page_shows_the_plans_numbers_and_placements(plan, page):
    doc = Checked(page)
    text = doc.text
    assert f"Objective {plan.objective_us:,.1f} µs" in text
    assert f"{plan.compute_us:,.1f} µs" in text and f"{plan.comm_us:,.1f} µs" in text
    assert "mesh 2×2" in text and "trws" in text and plan.solver["status"] in text
    for key, us in plan.comm_by_collective.items():
        kind, axis = key.split("@")
        assert f"{kind} axis {axis[4:]}" in text and f"{us:,.1f}" in text
    for fqn, placement in plan.param_placements.items():
        assert fqn in text
        assert re.search(re.escape(fqn) + r" [\d×]+ " + re.escape(pl.tuple_to_str(placement)) + " ", text), fqn
    pm = plan.model
    for node, placements in param_uses(pm, plan.node_strategy, "layers.0.attention.wq.weight", through_views=True):
        assert f"{node}: {''.join(placements)}" in text  # the use the grid colours by
    assert "layers.1" in text and "outside the layers" in text
    assert "Not compared" in text  # no recipes given
    assert "warnings" in doc.ids and ("none" in text if not plan.warnings else plan.warnings[0] in text)
    mem = plan.memory
    assert "peak" in text and fmt_bytes(mem["peak_bytes"]) in text


def test_roles_follow_storage_and_use():
    assert param_role("S(0)", ["R"]) == "fsdp"
    assert param_role("S(1)", ["S(0)"]) == "tp"
    assert param_role("R", ["S(1)"]) == "tp"
    assert param_role("R", ["R"]) == "replicated"
    assert param_role("S(0)", None) == "sharded"  # use unknown
    assert param_role("S(0)", []) == "sharded"  # not read by the forward
    assert [report_data.activation_role(t) for t in ("S(0)", "S(1)", "S(2)", "R", "P")] == ["dp", "sp", "sharded", "replicated", "partial"]


def test_grid_colours_each_axis_by_the_role_the_plan_gives_it(plan):
    blocks, rows = report_data.placement_data(plan)
    by_name = {r.name: r for r in rows}
    for fqn, placement in plan.param_placements.items():
        uses = param_uses(plan.model, plan.node_strategy, fqn, through_views=True)
        for a, p in enumerate(placement):
            used = sorted({u[1][a] for u in uses})
            want = param_role(pl.to_str(p), used)
            assert by_name[fqn].roles[a] == want, (fqn, a)
    layer_rows = [label for b in blocks for label, _ in b.rows]
    assert layer_rows == ["layers.0", "layers.1", "model"]
    svg = report_figures.svg(report.plan_figures(plan)[0])
    for role in {r for row in rows for r in row.roles}:
        assert report.ROLES[role][1] in svg and report.ROLES[role][0] in svg  # fill and legend


def test_plan_file_alone_old_file_and_escaped_warnings(plan, tmp_path):
    data = plan.to_json()
    data.pop("memory")
    data.pop("per_layer")
    data["warnings"] = ["axis 1 <idle> & unused"]
    old = Plan.from_json(data)
    page = report.plan_page(old, source="old.json")
    doc = check_self_contained(page)
    assert "not recorded" in doc.text
    assert "storage placements only" in doc.text and "not known" in doc.text
    assert "from a plan file alone" in doc.text
    assert "axis 1 <idle> & unused" in doc.text and "<idle>" not in page  # escaped, shown
    assert "1 warning" in doc.text
    assert "no per-layer costs" in doc.text


class _HStack(torch.nn.Module):
    """Blocks under ``h.{i}`` (GPT-2's Hugging Face naming), not ``layers.{i}``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(32, 16)
        self.h = torch.nn.ModuleList(torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(16), "up": torch.nn.Linear(16, 32),
                                                          "down": torch.nn.Linear(32, 16)}) for _ in range(3))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for blk in self.h:
            x = x + blk["down"](torch.relu(blk["up"](blk["ln"](x))))
        return self.head(x)


def test_grid_groups_parameters_by_the_models_own_layers(tmp_path):
    """The per-layer grid follows the model's conventions (``h.0``, ``h.1``...), with its model
    attached and from the plan file alone; the axes' reading without the model says only what
    storage and traffic show."""
    from apmodel.reading.roles import emerged

    with torch.device("meta"):
        m = _HStack()
    tokens = torch.zeros(8, 4, dtype=torch.long, device="meta")
    p = apmodel.plan(m, (2,), (tokens,), loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten()), targets=(tokens,))
    want = ["h.0", "h.1", "h.2", "model"]
    blocks, _ = report_data.placement_data(p)
    assert [label for b in blocks for label, _ in b.rows] == want
    assert "ln out" in blocks[0].columns  # the norm's output: ln.weight is a norm weight by the conventions
    p.save(tmp_path / "h.json")
    alone = Plan.load(tmp_path / "h.json")
    assert alone.model is None
    blocks, _ = report_data.placement_data(alone)
    assert [label for b in blocks for label, _ in b.rows] == want
    roles = emerged(alone)
    n = len(alone.param_placements)
    sharded = sum(pl.to_str(v[0]).startswith("S") for v in alone.param_placements.values())
    assert roles["axis0"].startswith(f"parameters stored sharded {sharded}/{n}")
    assert "needs the plan's model" in roles["axis0"] and "FSDP" not in roles["axis0"]
    assert "needs the plan's model" not in emerged(p)["axis0"]


def test_recipe_comparison_section(plan):
    recipes = [RecipeResult("fsdp", "FSDP", "full_shard", objective_us=plan.objective_us * 1.25, compute_us=plan.compute_us,
                            comm_us=plan.objective_us * 1.25 - plan.compute_us, param_bytes=4096.0),
               RecipeResult("ddp", "DDP", "free", status="n/a", reason="the global batch 8 does not split")]
    page = report.plan_page(plan, recipes=recipes)
    doc = check_self_contained(page)
    assert "recipes-chart" in doc.ids
    assert "FSDP" in doc.text and f"{plan.objective_us * 1.25:,.1f}" in doc.text and "+25.0%" in doc.text
    assert "DDP" in doc.text and "n/a" in doc.text and "does not split" in doc.text
    assert "Not compared" not in doc.text


def test_diff_page(plan):
    b = Plan.from_json(plan.to_json())
    fqn = "layers.0.attention.wq.weight"
    b.param_placements[fqn] = pl.parse("RR")
    b.objective_us += 100.0
    b.comm_us += 100.0
    page = report.diff_page(plan, b, names=("a.json", "b.json"))
    doc = check_self_contained(page)
    assert {"summary", "params", "nodes", "diff-time"} <= doc.ids
    assert "Not the same workload" not in doc.text
    assert re.search(re.escape(fqn) + " " + re.escape(pl.tuple_to_str(plan.param_placements[fqn])) + " RR", doc.text)
    assert "+100.0" in doc.text and "1 of 21 parameters stored differently" in doc.text
    assert "0 nodes with a different strategy" in doc.text

    b.structure_fingerprint = "0" * 64  # another graph: say so first, compare by name
    doc = check_self_contained(report.diff_page(plan, b))
    assert "Not the same workload" in doc.text and "graph structure" in doc.text
    assert "allow_mismatch" not in doc.text


def test_report_module_does_not_import_matplotlib():
    code = "import sys, apmodel.reading.report; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ---------------------------------------------------------------------------------- PNGs
def _check_png(path: Path) -> np.ndarray:
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 1000, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 200
    assert float(img[..., :3].std()) > 0.02, f"{path} is blank"
    return img


def test_write_pngs(plan, tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.write_pngs(plan, tmp_path / "figs")
    assert sorted(p.name for p in paths) == ["memory.png", "per-layer.png", "placement-grid.png", "time-breakdown.png",
                                             "timeline-backward.png", "timeline-forward.png"]
    for p in paths:
        _check_png(p)


# ----------------------------------------------------------------------------------- CLI
def test_cli_plan_writes_report_and_pngs(cli_plan):
    doc = check_self_contained((cli_plan / "p.html").read_text(encoding="utf-8"))
    assert set(SECTIONS) <= doc.ids and "llama3-debug" in doc.text
    # every parameter's uses are known (a row says "not known" otherwise; the legend may name the case)
    html = (cli_plan / "p.html").read_text(encoding="utf-8")
    assert "layers.0.attention.wq.weight" in doc.text and "<td>not known</td>" not in html
    pngs = sorted((cli_plan / "png").glob("*.png"))
    assert {p.name for p in pngs} >= {"placement-grid.png", "time-breakdown.png", "memory.png"}
    for p in pngs:
        _check_png(p)


def test_cli_report_of_a_plan_file(cli_plan, tmp_path):
    out = tmp_path / "x.html"
    res = CliRunner().invoke(app, ["report", str(cli_plan / "p.json"), "-o", str(out), "--png", str(tmp_path / "png")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = check_self_contained(out.read_text(encoding="utf-8"))
    assert "<td>not known</td>" not in out.read_text(encoding="utf-8")  # the model was re-traced: uses are shown
    assert "from a plan file alone" in doc.text
    saved = Plan.load(cli_plan / "p.json")
    assert f"Objective {saved.objective_us:,.1f} µs" in doc.text
    assert (tmp_path / "png" / "placement-grid.png").stat().st_size > 1000

    res = CliRunner().invoke(app, ["report", str(cli_plan / "p.json"), "-o", str(tmp_path / "y.html"), "--no-trace"])
    assert res.exit_code == 0, res.output
    assert "<td>not known</td>" in (tmp_path / "y.html").read_text(encoding="utf-8")


def test_cli_report_of_two_plans_is_a_diff(cli_plan, plan, tmp_path):
    other = tmp_path / "api.json"
    plan.save(other)  # two layers instead of one: another graph
    out = tmp_path / "d.html"
    res = CliRunner().invoke(app, ["report", str(cli_plan / "p.json"), str(other), "-o", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = check_self_contained(out.read_text(encoding="utf-8"))
    assert "Not the same workload" in doc.text and "layers.1.attention.wq.weight" in doc.text

    res = CliRunner().invoke(app, ["report", str(other), str(other), str(other)])
    assert res.exit_code == 2 and "error: report takes one plan file" in res.output


def test_cli_report_refuses_a_bad_output_before_work(cli_plan, tmp_path):
    res = CliRunner().invoke(app, ["report", str(cli_plan / "p.json"), "-o", str(tmp_path / "missing" / "x.html")])
    assert res.exit_code == 2 and "does not exist" in res.output
    (tmp_path / "file").write_text("")
    res = CliRunner().invoke(app, [*CLI_PLAN, "--png", str(tmp_path / "file")])
    assert res.exit_code == 2 and "is a file, not a directory" in res.output


# ------------------------------------------------------------------------------- browser
def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium not installed: `apt-get install -y chromium` (.ci/run tries it) to render the page")
    return exe


def test_page_renders_in_a_headless_browser(page, tmp_path):
    exe = _chromium()
    import matplotlib.image

    html_file = tmp_path / "plan.html"
    html_file.write_text(page, encoding="utf-8")
    base = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
            f"--user-data-dir={tmp_path / 'profile'}"]  # a profile of its own: no lock shared with other runs
    dom = subprocess.run([*base, "--dump-dom", html_file.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="placement-grid"' in dom.stdout and "<rect" in dom.stdout and 'id="warnings"' in dom.stdout

    shot = tmp_path / "shot.png"
    run = subprocess.run([*base, "--enable-logging=stderr", "--v=0", "--hide-scrollbars", "--window-size=1200,1800",
                          f"--screenshot={shot}", html_file.as_uri()], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and shot.is_file() and shot.stat().st_size > 0, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines()
              if "Uncaught" in line or (":CONSOLE" in line and html_file.name in line)]
    assert errors == []
    img = matplotlib.image.imread(shot)[..., :3]
    assert img.shape[:2] == (1800, 1200)
    assert float(img.std()) > 0.05, "the screenshot is blank"
    # the grid is on screen: pixels of the FSDP and TP fills (colours no other figure uses)
    colours = {report.ROLES[r][1] for r in ("fsdp", "tp") if f'fill="{report.ROLES[r][1]}"' in page}
    assert colours
    for colour in colours:
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
        hits = int((np.abs(img - rgb).max(axis=-1) < 0.03).sum())
        assert hits > 200, f"{colour}: {hits} pixels"


@pytest.fixture(scope="module")
def moe_plan() -> Plan:
    """moe-debug on (2, 4), its routed experts tensor parallel on axis 0 and expert parallel on axis 1."""
    from apmodel.models import build, sample_inputs

    with torch.device("meta"):
        model = build("moe-debug")
    return apmodel.plan(model, (2, 4), sample_inputs("moe-debug", 8, 256), device="h100",
                        constraints=[apmodel.region_as("routed_experts_*", "tensor_parallel", "expert_parallel")])


def test_expert_parallel_weights_are_labelled_ep_not_tp(moe_plan):
    """Stacked expert weights read sharded by the MoE region's expert-parallel alternative are EP on
    that axis; the same weights split by its tensor-parallel alternative stay TP."""
    plan = moe_plan
    _, table = report_data.placement_data(plan)
    experts = [r for r in table if ".moe.experts." in r.name]
    assert experts and all(r.roles == ["tp", "ep"] for r in experts), [(r.name, r.roles) for r in experts]
    assert "EP" in report.ROLES["ep"][0]


# ------------------------------------------- the page's figures against the plan file and the CLI
#: The main job of the README at two layers (the same figures, a quicker trace).
MAIN_JOB = ["plan", "--model", "llama3-8b", "--mesh", "4x8", "--device", "h100", "--gpus-per-node", "8",
            "--seq", "2048", "--batch", "8", "--layers", "2"]
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


class Tables(HTMLParser):
    """The page's tables as rows of cell texts, by the id of the section holding them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.section = ""
        self.tables: dict[str, list[list[list[str]]]] = {}
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "section":
            self.section = dict(attrs).get("id") or ""
        elif tag == "table":
            self.tables.setdefault(self.section, []).append([])
        elif tag == "tr":
            self.tables[self.section][-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self.section][-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _number(text: str) -> tuple[float, float]:
    """A number as the page writes it ("31,685.9", "177.25 MiB") and half its last digit."""
    value, _, unit = text.strip().partition(" ")
    decimals = len(value.partition(".")[2])
    scale = _UNITS.get(unit, 1)
    return float(value.replace(",", "")) * scale, 0.5 * 10.0 ** -decimals * scale


def _close(text: str, want: float) -> bool:
    got, tol = _number(text)
    return abs(got - want) <= tol * 1.0001


def _bar_tips(page: str, figure: str) -> dict[tuple[str, str], str]:
    """(row, segment) -> the value a bar segment's tooltip gives, in the figure with id ``figure``."""
    svg = re.search(rf'<svg id="{figure}".*?</svg>', page, re.S)
    assert svg, figure
    tips = {}
    for tip in re.findall(r"<rect [^>]*><title>([^<]*)</title></rect>", svg.group(0)):
        m = re.fullmatch(r"(.*?): (.*) ([\d,.]+(?: µs| [KMG]iB| B)) \([\d.]+%\)", html.unescape(tip))
        assert m, tip
        tips[(m.group(1), m.group(2))] = m.group(3).removesuffix(" µs")
    return tips


def _check_page_against_plan(page: str, data: dict) -> None:
    """The page's figures are the plan file's: objective, compute, each collective, each layer, memory."""
    doc = check_self_contained(page)
    objective = data["objective_us"]
    lead = re.search(r"Objective ([\d,.]+) µs per step: compute ([\d,.]+) µs .*?communication ([\d,.]+) µs", doc.text)
    assert lead and _close(lead.group(1), objective)
    assert _close(lead.group(2), data["compute_us"]) and _close(lead.group(3), data["comm_us"])

    step = _bar_tips(page, "time-breakdown")
    want = {"compute": data["compute_us"]}
    for key, us in data["comm_by_collective"].items():
        kind, _, axes = key.partition("@axis")
        want[f"{kind} axis {axes}"] = us
    assert {seg for _, seg in step} == {k for k, v in want.items() if v > 0}
    for (_, seg), text in step.items():
        assert _close(text, want[seg]), (seg, text, want[seg])
    time_table = {r[0]: r[1] for r in Tables(page).tables["time"][0][1:]}
    for seg, us in want.items():
        assert _close(time_table[seg], us), seg
    assert _close(time_table["total"], objective)

    layers = _bar_tips(page, "per-layer")
    assert {row for row, _ in layers} == set(data["per_layer"]) and "other" not in data["per_layer"]
    for (row, seg), text in layers.items():
        assert _close(text, data["per_layer"][row]["compute_us" if seg == "compute" else "comm_us"]), (row, seg)
    shown = sum(_number(t)[0] for t in layers.values())
    # the bars sum to the serial objective (the step hides some of it: the lead and the table say how much)
    assert shown == pytest.approx(data.get("overlap", {}).get("serial_us", objective), abs=0.05 * len(layers) + 1e-6)

    mem = data["memory"]
    bars = _bar_tips(page, "memory")
    for seg, key in (("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
                     ("activations", "activations_bytes")):
        assert _close(bars[("per device", seg)], mem[key]), seg
    mem_table = {r[0]: r[1] for r in Tables(page).tables["memory"][0][1:]}
    for row, key in (("parameters", "params_bytes"), ("peak", "peak_bytes"), ("HBM", "hbm_bytes")):
        assert _close(mem_table[row], mem[key]), row


def _cli_table(output: str, title: str) -> list[list[str]]:
    """The rows of one rich table of the CLI's output (cells stripped), by its title."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.strip()[0] not in "│┃┏┡└┌├╇━┗":
            break
        if line.strip().startswith("│"):
            rows.append([c.strip() for c in line.strip().strip("│").split("│")])
    return rows


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("main")
    res = CliRunner().invoke(app, [*MAIN_JOB, "--compare-recipes", "--out", str(d / "p.json"), "--report", str(d / "p.html")],
                             env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output, json.loads((d / "p.json").read_text()), (d / "p.html").read_text(encoding="utf-8")


def test_main_job_page_shows_the_plans_figures(main_job):
    _, data, page = main_job
    _check_page_against_plan(page, data)


def test_main_job_page_and_cli_agree_on_uses_and_parameter_bytes(main_job):
    """The CLI's "used as" column and the report's grid and table read each parameter alike (one
    function, roles.read_param); the recipe tables give the same objectives and parameter bytes."""
    output, data, page = main_job
    cli = {r[0]: r for r in _cli_table(output, "Parameter placements")}
    assert len(cli) == 12 and "layers.0.attention.wo.weight" in cli and "output.weight" in cli  # layer 0 and 3 more
    table = {r[0]: r for r in Tables(page).tables["placements"][0][1:]}
    tips = {}
    for tip in re.findall(r"<title>([^<]*), axis (\d+): stored ([^,]*), used ([^:]*): [^<]*</title>", page):
        tips[(re.sub(r"^(\w+)\.(\d+)–\d+\.", r"\1.\2.", html.unescape(tip[0])), int(tip[1]))] = tip[3]
    for fqn, (_, _, stored, used_as, _) in cli.items():
        assert table[fqn][2] == stored
        placements = set(used_as.split(", "))
        # the page's table: "op: placements; ..." after views
        assert {u.split(": ")[1] for u in table[fqn][3].split("; ")} == placements, fqn
        tokens = [pl.to_str(p) for p in pl.parse(next(iter(placements)))]
        for a in range(len(tokens)):  # the grid's stripe on each axis: the tokens the CLI's placements hold there
            want = sorted({pl.to_str(pl.parse(p)[a]) for p in placements})
            assert tips[(fqn, a)] == "/".join(want), (fqn, a)

    mem = data["memory"]
    recipes_page = {r[0]: r for r in Tables(page).tables["recipes"][0][1:]}
    recipes_cli = {r[0]: r for r in _cli_table(output, "Found plan versus hand-written recipes") if r[0]}
    assert _close(recipes_page["apmodel (found)"][5], mem["params_bytes"])
    assert _close(recipes_page["apmodel (found)"][2], data["objective_us"])
    priced = [name for name, r in recipes_page.items() if r[2][:1].isdigit()]
    assert len(priced) >= 3
    for name in priced:
        row = next(r for n, r in recipes_cli.items() if name.startswith(n))  # a long title wraps in the terminal
        assert row[2] == recipes_page[name][2] and row[5] == recipes_page[name][5], name


def test_moe_page_shows_the_plans_figures(moe_plan):
    """An MoE plan whose routed experts run expert parallel on axis 1: its page against its JSON,
    the region's own all-to-alls among the figures, its grid no wider than the page."""
    data = moe_plan.to_json()
    page = report.plan_page(moe_plan)
    assert any(" (routed_experts" in k for k in data["comm_by_collective"])
    _check_page_against_plan(page, data)
    grid = re.search(r'<svg id="placement-grid"[^>]*width="([\d.]+)"', page)
    assert grid and float(grid.group(1)) <= report_figures.GRID_MAX_WIDTH


def test_grid_folds_alike_layers_and_wraps_wide_rows():
    """32 layers that read alike are one row; 20 columns on a 4-axis mesh wrap into bands no wider
    than the page; a layer that differs keeps its own row, and every column is drawn."""
    stripe = report_data._Stripe("fsdp", "S(0)→R", "tip")
    other = report_data._Stripe("tp", "S(0)→S(0)", "tip")
    columns = [f"block.w{i}" for i in range(20)]

    def cells(s):
        return [report_data._Cell(f"c{i}", (s,) * 4) for i in range(len(columns))]

    rows = [(f"layers.{i}", cells(other if i == 7 else stripe)) for i in range(32)]
    d = report_figures.layout_grid([report_data.Block("per layer", columns, rows)], (2, 2, 2, 4))
    texts = [s.text for s in d.shapes if isinstance(s, report_figures._Text)]
    assert d.width <= report_figures.GRID_MAX_WIDTH
    bands = sum(t in ("per layer", "per layer (continued)") for t in texts)
    assert bands >= 2 and [t for t in texts if t.startswith("layers.")] == ["layers.0–6", "layers.7", "layers.8–31"] * bands
    assert all(c in texts for c in columns)
    tips = [s.tip for s in d.shapes if isinstance(s, report_figures._Rect) and s.tip]
    assert len(tips) == 3 * 20 * 4

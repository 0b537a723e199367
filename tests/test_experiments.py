"""`checkfree experiment`: the whole path at --quick scale (files, tables, plots, resume), the
distributed-runtime glue, and the pure pieces (traces, targets, time to target).

These check that the machinery produces complete, well-formed results -- not the scientific
conclusion (which needs the full matrix; see experiments/README.md).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from cli.main import main
from experiments.analysis import NOT_REACHED, reference_target, time_to_target
from experiments.spec import ALL_STRATEGIES, Settings, make_spec, paper_p, write_traces

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CELL = re.compile(rf"^(\d+(\.\d+)?(e-?\d+)?( \(.*\))?|{NOT_REACHED}( \(\d+/\d+ seeds\))?)$")


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    """The tokenizer / token cache shared with the other tests of the session (spawned run
    processes inherit the environment)."""
    path = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("CHECKFREE_CACHE", str(path))
    return path


def _tables(md: str) -> dict[str, list[list[str]]]:
    """Markdown tables of a report by the heading above them."""
    out, heading, rows = {}, None, None
    for line in md.splitlines():
        if line.startswith("#"):
            heading, rows = line.lstrip("# ").strip(), None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if rows is None:
                rows = out.setdefault(heading, [])
            if not set(line.replace("|", "").strip()) <= {"-"}:
                rows.append(cells)
        else:
            rows = None
    return out


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC) or data[12:16] != b"IHDR":
        return False
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return width > 100 and height > 100 and data.rstrip(b"\0").endswith(b"IEND\xaeB`\x82")


@pytest.mark.timeout(900)
def test_quick_all_experiments_produce_complete_results_and_resume(tmp_path, cache, capsys):
    out = tmp_path / "results"
    assert main(["experiment", "all", "--quick", "--out", str(out), "--no-progress", "--jobs", "2"]) == 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["strategies"] == ALL_STRATEGIES and len(settings["rates"]) == 2 and settings["seeds"] == [0]

    # every run finished and wrote the run-directory files
    runs = sorted((out / "runs").iterdir())
    assert len(runs) >= 1 + 2 * len(ALL_STRATEGIES)
    for d in runs:
        for f in ("config.json", "metrics.jsonl", "events.jsonl", "summary.json", "spec.json"):
            assert (d / f).is_file(), f"{d.name} lacks {f}"
        assert json.loads((d / "summary.json").read_text())["status"] in ("completed", "budget-exhausted", "aborted")
    # one full and one inner trace per (rate, seed); inner = full without the edge stages
    for rate in settings["rates"]:
        full = (out / f"traces/full-{rate:g}pct-s0.csv").read_text().splitlines()[2:]
        inner = (out / f"traces/inner-{rate:g}pct-s0.csv").read_text().splitlines()[2:]
        assert full, "the quick rates must produce failures"
        assert inner == [x for x in full if x.split(",")[1] in ("1", "2")]

    # the convergence table: every strategy x rate cell present and well-formed
    conv = out / "convergence"
    md = (conv / "table.md").read_text()
    tables = _tables(md)
    hours = tables["Simulated hours to the target validation loss"]
    assert hours[0] == ["strategy", "10% (p=0.1)", "16% (p=0.2)"]
    assert [r[0] for r in hours[1:]] == ["no failures"] + ALL_STRATEGIES
    for row in hours[1:]:
        assert len(row) == 3 and all(CELL.match(c) for c in row[1:]), row
    for name in ("Speed-up vs checkpointing", "Speed-up vs redundant computation", "Failures seen",
                 "Iterations to target", "Run status"):
        table = next(v for k, v in tables.items() if k.startswith(name))
        assert [r[0] for r in table[1:]][-len(ALL_STRATEGIES):] == ALL_STRATEGIES, name
        assert all(len(r) == 3 and all(c and c not in ("missing", "error") for c in r) for r in table[1:]), name
    ratios = next(v for k, v in tables.items() if k.startswith("Speed-up vs checkpointing"))
    assert all(c in ("1.00x", NOT_REACHED) for c in ratios[1][1:])  # checkpoint vs itself
    results = json.loads((conv / "results.json").read_text())
    assert len(results["runs"]) == 1 + 2 * len(ALL_STRATEGIES)
    for r in results["runs"].values():
        assert r["val"] and r["summary"]["status"] and "failures" in r and "loss" in r
    pngs = sorted(conv.glob("*.png"))
    assert {p.name for p in pngs} == {"convergence_val_vs_wallclock.png", "convergence_val_vs_steps.png",
                                      "convergence_time_to_target.png"}
    assert all(_is_png(p) for p in pngs)
    for ablation in ("ablation-init", "ablation-ckpt", "ablation-rate", "ablation-swap"):
        d = out / ablation
        assert (d / "results.json").is_file() and (d / "table.md").is_file(), ablation
        png = d / f"{ablation.replace('-', '_')}.png"
        assert _is_png(png), ablation
        rows = next(iter(_tables((d / "table.md").read_text()).values()))
        assert len(rows) >= 3 and all(len(r) == len(rows[0]) for r in rows), ablation
    init_rows = next(iter(_tables((out / "ablation-init" / "table.md").read_text()).values()))
    assert {r[0].split(" @")[0] for r in init_rows[1:]} == {"no failures", "random", "copy", "uniform", "checkfree",
                                                                        "identity"}

    # an interrupted matrix resumes without redoing finished runs
    victim = next(d for d in runs if d.name.startswith("checkpoint-16pct"))
    (victim / "summary.json").unlink()
    stamps = {d.name: (d / "metrics.jsonl").stat().st_mtime_ns for d in runs if d != victim}
    capsys.readouterr()
    assert main(["experiment", "convergence", "--quick", "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "resuming" in printed and "ran 1 runs" in printed
    assert (victim / "summary.json").is_file()
    assert stamps == {d.name: (d / "metrics.jsonl").stat().st_mtime_ns for d in runs if d != victim}


@pytest.mark.timeout(600)
def test_local_runtime_glue_sets_swarm_runs_beside_the_simulator(tmp_path, cache, monkeypatch):
    """--runtime local: the swarm run gets the same config and trace and lands in the table.
    `checkfree local` is swapped for `checkfree simulate` (same flags, same run-directory
    files) so this stays quick; the real swarm is exercised by the slow test below."""
    real_run = subprocess.run
    seen = []

    def fake(cmd, **kw):
        seen.append(cmd)
        return real_run([("simulate" if c == "local" else c) for c in cmd], **kw)

    monkeypatch.setattr("experiments.runner.subprocess.run", fake)
    out = tmp_path / "results"
    assert main(["experiment", "convergence", "--quick", "--strategies", "checkfree+", "--rates", "16",
                 "--runtime", "local", "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    assert len(seen) == 1 and seen[0][3] == "local" and "--config" in seen[0]
    cfg = json.loads(Path(seen[0][seen[0].index("--config") + 1]).read_text())
    assert cfg["failures"]["trace"].endswith("full-16pct-s0.csv") and cfg["recovery"]["strategy"] == "checkfree+"
    md = (out / "convergence" / "table.md").read_text()
    local = _tables(md)["Distributed runtime (`checkfree local`, real processes and SIGKILLs) vs the simulator"]
    assert [r[0] for r in local[1:3]] == ["local", "sim"]
    assert local[3][0] == "Δ (local - sim)"
    assert float(local[3][8].split()[2]) < 1e-5  # the simulator stand-in reproduces the simulator
    assert local[3][9].startswith("train loss equal to 1e-4 at all")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_runtime_real_swarm(tmp_path, cache):
    out = tmp_path / "results"
    assert main(["experiment", "convergence", "--quick", "--strategies", "checkfree+", "--rates", "16",
                 "--runtime", "local", "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    local = [d for d in (out / "runs").iterdir() if "-local-" in d.name]
    assert len(local) == 1 and json.loads((local[0] / "summary.json").read_text())["status"] == "completed"


# --- pure pieces -----------------------------------------------------------------------------

def test_rate_mapping_and_scaled_intervals():
    s = Settings(rate_scale=20)  # the default
    assert paper_p(16) == 0.004 and s.p(16) == pytest.approx(0.08)
    assert paper_p(20) == pytest.approx(1 - 0.8 ** (91.3 / 3600))
    assert s.ckpt_every == 5 and s.snap_every == 1 and s.scaled_interval(10) == 1


def test_traces_are_nested_across_rates_and_strategies_get_the_right_one(tmp_path):
    s = Settings(preset="tiny", steps=50, rates=[5.0, 16.0], rate_scale=20)
    traces = write_traces(s, tmp_path, s.rates)
    lo = set((tmp_path / traces[(5.0, 0, "full")]).read_text().splitlines()[2:])
    hi = set((tmp_path / traces[(16.0, 0, "full")]).read_text().splitlines()[2:])
    assert lo < hi
    kinds = {name: make_spec(s, tmp_path, traces, name, 16.0, 0).trace_kind for name in ALL_STRATEGIES}
    assert {k for k, v in kinds.items() if v == "inner"} == {"checkfree", "uniform", "copy", "random"}
    a, b = make_spec(s, tmp_path, traces, "checkpoint", 16.0, 0), make_spec(s, tmp_path, traces, "checkpoint", 16.0, 0)
    assert a.name == b.name  # deterministic: a resumed matrix finds its runs
    assert make_spec(s, tmp_path, traces, "checkpoint", 16.0, 0, checkpoint_every=1).name != a.name


def test_time_to_target_interpolates_and_reports_not_reached():
    run = {"val": [{"iteration": 9, "step": 9, "sim_time_s": 100.0, "val_loss": 5.0},
                   {"iteration": 19, "step": 19, "sim_time_s": 200.0, "val_loss": 4.0},
                   {"iteration": 29, "step": 9, "sim_time_s": 300.0, "val_loss": 3.0}]}
    hit = time_to_target(run, 4.5)
    assert hit["sim_time_s"] == pytest.approx(150.0) and hit["iterations"] == pytest.approx(15.0)
    assert time_to_target(run, 5.0)["sim_time_s"] == 100.0
    assert time_to_target(run, 2.0) is None
    s = Settings(steps=40, target_fraction=0.5)
    assert reference_target({"val": run["val"][:2], "spec": {"name": "x"}}, s) == 4.0
    assert reference_target(run, Settings(target=3.3)) == 3.3


def _fake_run(label: str, seed: int, final: float, iters: float | None, rate: float = 16.0) -> dict:
    val = [{"iteration": i, "step": i, "sim_time_s": 10.0 * (i + 1), "val_loss": final + 1.0 / (i + 1) + 0.01 * seed}
           for i in range(5)]
    return {"spec": {"label": label, "strategy": label, "rate": rate, "seed": seed, "runtime": "sim"},
            "final_val_loss": final, "iterations_to_target": iters, "hours": None if iters is None else iters / 100,
            "val": val, "failures": [], "summary": {"status": "completed"}}


def test_tables_report_mean_and_standard_deviation_over_seeds_and_plots_draw_bands(tmp_path):
    from statistics import stdev

    from experiments import plots
    from experiments.analysis import _cell
    from experiments.suite import seeds_table

    runs = [_fake_run("checkfree", s, f, i) for s, f, i in ((0, 4.50, 40.0), (1, 4.60, 44.0), (2, 4.55, 48.0))]
    runs += [_fake_run("random", s, 4.7, None if s == 1 else 50.0) for s in range(3)]
    mean_h, text = _cell(runs[:3])
    assert mean_h == pytest.approx(0.44) and f"± {stdev([0.40, 0.44, 0.48]):.2g}" in text and "(n=3: 0.4 / 0.44 / 0.48)" in text
    assert _cell(runs[:1])[1] == "0.4"  # one seed: no spread
    table = seeds_table(runs)
    assert "| checkfree @ 16% | 0,1,2 | 4.5500 ± 0.05 (n=3: 4.5 / 4.6 / 4.55) | 44.0 ± 4 (n=3: 40 / 44 / 48) |" in table
    assert f"{NOT_REACHED} (2/3 seeds)" in table
    fig, ax = plots.plt.subplots()
    plots.seed_bands(ax, runs, "iterations")
    assert len(ax.collections) == 2  # one band per curve with several seeds
    plots.save(fig, tmp_path / "bands.png")


def test_checkpoint_intervals_are_labelled_alike_in_every_seed():
    """ablation-ckpt: the interval label goes to every seed's runs, so the over-seeds table has one row per
    interval (it once relabelled the first seed's only and split each interval into two rows)."""
    from experiments.suite import label_checkpoint_intervals, seeds_table

    runs = []
    for seed in range(3):
        for every, label in ((1, "checkpoint/1"), (5, "checkpoint")):
            r = _fake_run("checkpoint", seed, 4.5, 50.0 + every, rate=10.0)
            r["spec"]["label"], r["spec"]["config"] = label, {"strategy": {"checkpoint_every": every}}
            runs.append(r)
    label_checkpoint_intervals(runs, 20)
    table = seeds_table(runs)
    assert "| checkpoint every 1 (20 paper it.) @ 10% | 0,1,2 |" in table
    assert "| checkpoint every 5 (100 paper it.) @ 10% | 0,1,2 |" in table and "checkpoint/1" not in table


def test_omega_scope_blocks_runs_get_their_own_names(tmp_path):
    settings = Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2)
    traces = write_traces(settings, tmp_path, settings.rates)
    stage = make_spec(settings, tmp_path, traces, "checkfree", 16.0, 0)
    blocks = make_spec(Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2, omega_scope="blocks"), tmp_path,
                       traces, "checkfree", 16.0, 0)
    assert blocks.config["recovery"]["omega_scope"] == "blocks" and stage.config["recovery"]["omega_scope"] == "stage"
    assert blocks.name != stage.name


def test_dry_run_checks_each_configuration_with_one_step_and_prints_the_cost_model(tmp_path, capsys):
    """--dry-run on a local corpus: config, data and one step per distinct configuration; no results written."""
    (tmp_path / "corpus.txt").write_text("All the world's a stage, and all the men and women merely players. " * 400)
    out = tmp_path / "results"
    assert main(["experiment", "convergence", "--preset", "tiny", "--steps", "8", "--eval-every", "2",
                 "--strategies", "checkfree", "--rates", "16", "--data", str(tmp_path / "corpus.txt"),
                 "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "2 distinct configurations" in printed and printed.count("config, data and one step OK") == 2
    assert "cost model per run (paper-geo)" in printed and "whole matrix (2 runs)" in printed
    assert not (out / "runs").exists()

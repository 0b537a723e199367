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
from experiments.analysis import reference_target, time_to_target
from experiments.tables import NOT_REACHED
from experiments.spec import ALL_STRATEGIES, Settings, make_spec, paper_p, write_traces

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CELL = re.compile(rf"^(\d+(\.\d+)?(e-?\d+)?( ± .*\))?|{NOT_REACHED}|reached in \d+ of \d+ seeds \(.*\))$")


@pytest.fixture
def cache(session_cache, monkeypatch):
    """The tokenizer / token cache shared with the other tests of the session (spawned run
    processes inherit the environment)."""
    path = Path(session_cache)
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
@pytest.mark.processes  # the experiments' runs go to a process pool
def test_quick_all_experiments_produce_complete_results_and_resume(tmp_path, cache, capsys):
    out = tmp_path / "results"
    assert main(["experiment", "all", "--quick", "--out", str(out), "--no-progress", "--jobs", "2"]) == 0
    log = [json.loads(x) for x in (out / "matrix_log.jsonl").read_text().splitlines()]
    settings = log[0]["settings"]
    assert settings["strategies"] == ALL_STRATEGIES and len(settings["rates"]) == 2 and settings["seeds"] == [0]
    # the invocation's log: a start line with the code version and detection time, a line per run, an end line
    assert [x["event"] for x in log] == ["start"] + ["run"] * len(log[0]["pending"]) + ["end"]
    assert len(log[0]["code"]["commit"]) == 40 and isinstance(log[0]["code"]["dirty"], bool)
    assert log[0]["detection_s"] and all(d > 0 for d in log[0]["detection_s"])
    assert {x["name"] for x in log[1:-1]} == set(log[0]["pending"]) and log[-1]["status"] == "completed"
    assert not (out / "settings.json").exists()

    # every run finished and wrote the run-directory files
    runs = sorted((out / "runs").iterdir())
    assert len(runs) >= 1 + 2 * len(ALL_STRATEGIES)
    for d in runs:
        for f in ("config.json", "metrics.jsonl", "events.jsonl", "summary.json", "spec.json", "provenance.json"):
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
        assert r["provenance"]["code"] == log[0]["code"] and r["provenance"]["step_s"] > 0
        assert "hours" not in r  # the records only: every report derives its numbers anew
    checkfree_runs = [r for r in results["runs"].values() if r["spec"]["strategy"] == "checkfree" and r["failures"]]
    assert checkfree_runs and all(len(rec["coefficients"]) == 2 for r in checkfree_runs for rec in r["recoveries"])
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
    log = [json.loads(x) for x in (out / "matrix_log.jsonl").read_text().splitlines()]
    assert log[-3]["event"] == "start" and log[-3]["pending"] == [victim.name] and log[-2]["name"] == victim.name
    assert (victim / "summary.json").is_file()
    assert stamps == {d.name: (d / "metrics.jsonl").stat().st_mtime_ns for d in runs if d != victim}


@pytest.mark.timeout(600)
def test_local_runtime_glue_sets_swarm_runs_beside_the_simulator(tmp_path, cache, monkeypatch):
    """--runtime local: the swarm run gets the same config and trace and lands in the table.
    `checkfree local` is swapped for `checkfree simulate` (same flags, same run-directory
    files) so this stays quick; the real swarm is exercised by the slow test below."""
    real_run = subprocess.run
    seen = []

    def fake(cmd, **kw):  # patches subprocess.run everywhere: record the runtime's launches, not provenance's git
        if cmd[0] == "git":
            return real_run(cmd, **kw)
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


def test_cells_give_mean_spread_and_seeds_and_say_how_many_seeds_reached(tmp_path):
    from statistics import stdev

    from experiments import plots
    from experiments.tables import cell, seeds_table

    runs = [_fake_run("checkfree", s, f, i) for s, f, i in ((0, 4.50, 40.0), (1, 4.60, 44.0), (2, 4.55, 48.0))]
    runs += [_fake_run("random", s, 4.7, None if s == 1 else 50.0) for s in range(3)]
    mean_h, text = cell(runs[:3])
    assert mean_h == pytest.approx(0.44) and f"± {stdev([0.40, 0.44, 0.48]):.2g}" in text and "(n=3: 0.4 / 0.44 / 0.48)" in text
    assert cell(runs[:1])[1] == "0.4"  # one seed: no spread
    # some seeds missed the target: the cell counts the seeds that reached it, in words, with every seed's value
    assert cell(runs[3:]) == (None, f"reached in 2 of 3 seeds (0.5 / {NOT_REACHED} / 0.5)")
    assert cell(runs[4:5]) == (None, NOT_REACHED)
    table = seeds_table(runs)
    assert "| checkfree @ 16% | 0,1,2 | 4.5500 ± 0.05 (n=3: 4.5000 / 4.6000 / 4.5500) | 44.0 ± 4 (n=3: 40.0 / 44.0 / 48.0) |" in table
    assert f"reached in 2 of 3 seeds (50.0 / {NOT_REACHED} / 50.0)" in table
    fig, ax = plots.plt.subplots()
    plots.seed_bands(ax, runs, "iterations")
    assert len(ax.collections) == 2  # one band per curve with several seeds
    plots.save(fig, tmp_path / "bands.png")


def test_checkpoint_intervals_are_labelled_alike_in_every_seed():
    """ablation-ckpt: the interval label goes to every seed's runs, so the over-seeds table has one row per
    interval (it once relabelled the first seed's only and split each interval into two rows)."""
    from experiments.tables import label_checkpoint_intervals, seeds_table

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


def test_omega_scope_blocks_renames_only_the_runs_that_weigh_by_omega(tmp_path):
    """--omega-scope blocks: a CheckFree run with failures gets its own name; runs omega cannot touch (no
    failures, or a rule that does not weigh by it) keep theirs, so both scopes share them."""
    stage_s = Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2)
    blocks_s = Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2, omega_scope="blocks")
    traces = write_traces(stage_s, tmp_path, stage_s.rates)
    stage = make_spec(stage_s, tmp_path, traces, "checkfree", 16.0, 0)
    blocks = make_spec(blocks_s, tmp_path, traces, "checkfree", 16.0, 0)
    assert blocks.config["recovery"]["omega_scope"] == "blocks" and stage.config["recovery"]["omega_scope"] == "stage"
    assert blocks.name != stage.name
    for strategy, rate in (("random", 16.0), ("uniform", 16.0), ("checkfree", 0.0)):
        assert make_spec(blocks_s, tmp_path, traces, strategy, rate, 0).name == \
            make_spec(stage_s, tmp_path, traces, strategy, rate, 0).name, (strategy, rate)


def test_run_names_do_not_change_with_the_cost_model(tmp_path, monkeypatch):
    """The detection time 'auto' is derived from the cost model's step time; the run's name hashes the setting,
    so a new cost model finds the finished runs (and the report prices their clock anew)."""
    from checkfree.costmodel import CostModel

    s = Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2)
    traces = write_traces(s, tmp_path, s.rates)
    before = make_spec(s, tmp_path, traces, "checkfree+", 16.0, 0)
    monkeypatch.setattr(CostModel, "step_s", lambda self: 123.0)
    after = make_spec(s, tmp_path, traces, "checkfree+", 16.0, 0)
    assert after.config["strategy"]["detection_s"] != before.config["strategy"]["detection_s"]
    assert after.name == before.name


def test_dry_run_prints_the_compute_beside_the_simulated_clock(tmp_path, cache, capsys):
    """--dry-run on the small preset and a local corpus: config, data and one step per distinct configuration,
    FLOPs per step = 6 N tokens + attention from the model config, GPU-hours at the stated utilisation; nothing
    written."""
    from checkfree.config import preset

    (tmp_path / "corpus.txt").write_text("All the world's a stage, and all the men and women merely players. " * 400)
    out = tmp_path / "results"
    assert main(["experiment", "convergence", "--preset", "small", "--steps", "8", "--eval-every", "2",
                 "--strategies", "checkfree,redundant", "--rates", "16", "--data", str(tmp_path / "corpus.txt"),
                 "--out", str(out), "--dry-run", "--gpu", "H100", "--mfu", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "3 distinct configurations" in printed and printed.count("config, data and one step OK") == 3
    m, t = preset("small").model, preset("small").train
    n = m.num_layers * (2 * m.d_model ** 2 + 2 * m.d_model * m.kv_heads * m.head_dim + 3 * m.d_model * m.mlp_width) \
        + m.d_model * m.vocab_size  # blocks without norms, and the head
    tokens = t.num_microbatches * t.microbatch_size * m.context_length
    six_n, attention = 6 * n * tokens, 12 * m.num_layers * m.context_length * m.d_model * tokens
    assert f"6·N·tokens = {six_n:.3g} FLOPs + attention 12·L·T·d·tokens = {attention:.3g} FLOPs" in printed
    assert "one H100 (989 TFLOP/s dense BF16 peak) at an assumed 50% utilisation" in printed
    rows = {r[0]: r for r in _tables(printed)[None]} if None in _tables(printed) else \
        {r[0]: r for rows in _tables(printed).values() for r in rows}
    plain, redundant = rows["checkfree"], rows["redundant"]
    assert float(plain[3]) == pytest.approx(six_n + attention, rel=1e-2)
    assert float(redundant[3]) == pytest.approx((six_n + attention) * 4 / 3, rel=1e-2)  # + one forward
    gpu_h = float(plain[4].split()[0])
    evals = 8 // 2
    flops = 8 * (six_n + attention) + evals * preset("small").train.eval_batches * (six_n + attention) / 3 / t.num_microbatches
    assert gpu_h == pytest.approx(flops / (989e12 * 0.5) / 3600, rel=1e-2)
    assert float(redundant[5].split()[0]) > float(plain[5].split()[0])  # + its extra forward per step
    assert "simulated clock per run without failures (paper-geo)" in printed and "GPU-hours of compute on H100 at 50% MFU" in printed
    assert not (out / "runs").exists()


def test_compute_counts_the_training_sequence_length_not_the_position_limit():
    """A model with 8192 positions trained on 256-token sequences costs 256-token FLOPs (SmolLM2's case)."""
    from checkfree.config import preset
    from experiments.compute import estimate

    full = preset("small")
    short = preset("small")
    short.train.seq_len = full.model.context_length // 2
    a, b = estimate(full), estimate(short)
    assert b.tokens_per_step * 2 == a.tokens_per_step
    assert b.six_n_flops * 2 == pytest.approx(a.six_n_flops)
    assert b.attention_flops * 4 == pytest.approx(a.attention_flops)  # 12 L T d per token, T halved too


def test_recipes_use_the_authors_figures_for_each_model(capsys):
    from experiments.recipes import recipe
    from experiments.spec import paper_p

    t2 = recipe("paper-500m-table2")
    assert (t2.preset, t2.rate_scale, t2.steps, t2.ckpt_every) == ("paper-500m", 1.0, 25_000, 100)
    assert [t2.p(r) for r in t2.rates] == [0.0009, 0.002, 0.004]
    assert t2.target_fraction * t2.steps == pytest.approx(10_000)  # the paper's failure-free iterations to target
    fig2 = recipe("paper-500m-fig2")
    assert (fig2.preset, fig2.steps, fig2.p(fig2.init_rate)) == ("paper-500m", 10_000, 0.004)
    small = recipe("paper-124m", steps=5000)
    assert (small.preset, small.ckpt_every, small.rates) == ("paper-124m", 50, [10.0, 16.0])
    assert [small.p(r) for r in small.rates] == [0.0006, 0.001]
    with pytest.raises(ValueError, match="gives failure probabilities for 10 %, 16 % only"):
        paper_p(5, "124m")
    assert main(["experiment", "convergence", "--recipe", "paper-124m", "--dry-run"]) == 2
    assert "needs --steps" in capsys.readouterr().err
    assert main(["experiment", "convergence", "--recipe", "paper-124m", "--steps", "1000", "--rates", "5",
                 "--dry-run"]) == 2
    assert "not 5 %" in capsys.readouterr().err


def test_the_report_prices_the_step_term_anew_and_marks_what_it_cannot(tmp_path, monkeypatch):
    """A run's clock: the step term re-priced by the current cost model, the strategy's terms kept and marked
    † when the cost model's figures they were priced with have changed."""
    from checkfree.costmodel import CostModel
    from experiments import runner
    from experiments.analysis import derive
    from experiments.runner import provenance
    from experiments.tables import cell

    # the code version (a `git` process, which the quick tier's process check would list) is not what this checks
    monkeypatch.setattr(runner, "code_version", lambda: {"commit": None, "dirty": None})
    s = Settings(preset="tiny", steps=4, rates=[16.0], eval_every=2)
    traces = write_traces(s, tmp_path, s.rates)
    spec = make_spec(s, tmp_path, traces, "gemini", 16.0, 0)
    prov = provenance(spec.to_dict(), tmp_path)
    step = prov["step_s"]
    val = [{"iteration": i, "step": i, "sim_time_s": (i + 1) * step + 5.0 * i, "val_loss": 5.0 - i} for i in (1, 3)]
    ref = make_spec(s, tmp_path, traces, "checkfree", 0.0, 0)
    records = {x.name: {"spec": x.to_dict(), "summary": {"status": "completed"}, "provenance": prov,
                        "val": [dict(v) for v in val],
                        "loss": [], "failures": [], "recoveries": [], "fallbacks": 0, "clipped_share": []}
               for x in (spec, ref)}
    now = derive(records, s)["runs"][spec.name]
    assert now["clock_stale"] == [] and [v["sim_time_s"] for v in now["val"]] == pytest.approx([v["sim_time_s"] for v in val])
    monkeypatch.setattr(CostModel, "step_s", lambda self: step + 1.0)
    later = derive(records, s)["runs"][spec.name]
    assert [v["sim_time_s"] for v in later["val"]] == pytest.approx([v["sim_time_s"] + v["iteration"] + 1 for v in val])
    assert "network_idle_s" in later["clock_stale"] and cell([later])[1].endswith("†")
    assert records[spec.name]["val"][0]["sim_time_s"] == val[0]["sim_time_s"]  # the records are not changed


@pytest.mark.processes  # (the invocation log asks `git` for the commit: a process, unless cached already)
def test_an_interrupted_invocation_is_logged_with_every_run_it_finished(tmp_path):
    from experiments.provenance import InvocationLog, logged_runs, read_log

    with pytest.raises(KeyboardInterrupt):
        with InvocationLog(tmp_path, command="checkfree experiment all", settings={"seeds": [0]}, experiments=["x"],
                           runs_in_matrix=3, pending=["a", "b", "c"], detection_s=[0.1]) as inv:
            inv.finished({"name": "a", "status": "completed", "wall_s": 1.0})
            inv.finished({"name": "b", "status": "error", "wall_s": 1.0})
            raise KeyboardInterrupt
    log = read_log(tmp_path)
    assert [x["event"] for x in log] == ["start", "run", "run", "end"] and log[-1]["status"] == "interrupted"
    assert set(logged_runs(log)) == {"a"}  # an error run is redone, so it is not a logged result


def test_readme_says_what_its_result_files_say():
    """Every rendered region of experiments/README.md equals what its renderer makes of the committed result files
    (`checkfree experiment report --readme` rewrites them); and the check catches a changed number."""
    from experiments.readme import regions, render, stale_regions

    root = Path(__file__).resolve().parent.parent
    readme, results = root / "experiments" / "README.md", root / "experiments" / "results"
    text = readme.read_text()
    names = [n for n, _ in regions(text)]
    assert {"small.convergence", "small.paper", "small.findings", "small.omega", "recipes", "pretrained.studies",
            "pretrained.conclusion"} <= set(names)
    rendered = render(text, results)
    differ = [n for n, body in regions(text) if dict(regions(rendered))[n] != body]
    assert not differ, f"run `checkfree experiment report --readme`: regions {differ} differ from the result files"
    body = dict(regions(text))["small.convergence"]
    cell_text = re.search(r"\| checkfree \| ([^|]+) \|", body)[1]
    tampered = text.replace(cell_text, cell_text.replace(cell_text.strip()[0], "9", 1), 1)
    assert stale_regions(tampered, results) == ["small.convergence"]


def test_a_study_without_paired_evaluation_ranks_no_init():
    """The committed studies evaluated each cell once on the run's own validation microbatches, with no paired
    interval: their tables and the README's conclusion order no init (issue 39), and say why."""
    from experiments.pretrained_report import load_results, render_tables, unranked
    from experiments.pretrained_section import conclusion

    root = Path(__file__).resolve().parent.parent / "experiments" / "results"
    for study in ("small", "smollm2"):
        data = load_results(root / "pretrained" / study / "results.json")
        text = render_tables(data)
        assert "smallest first" not in text and unranked(data["study"]) in text
    assert " < " not in conclusion(root) and "1,024 tokens" in conclusion(root)


@pytest.mark.processes  # (it starts OS processes: the quick tier's watch saw them, docs/testing.md)
@pytest.mark.timeout(300)
def test_a_run_that_exhausts_its_iteration_budget_says_so(tmp_path, cache):
    """A rollback strategy capped at its budget ends 'budget-exhausted' (it once ended 'error': the runner called
    the simulator's summary with an argument it no longer takes), with its provenance beside it."""
    from experiments.runner import run_dir, run_one

    s = Settings(preset="tiny", steps=6, rates=[16.0], rate_scale=200, eval_every=2, microbatches=1, eval_batches=1,
                 max_iter_factor=1.0, checkpoint_every=5)
    traces = write_traces(s, tmp_path, s.rates)
    spec = make_spec(s, tmp_path, traces, "checkpoint", 16.0, 0)
    result = run_one(spec.to_dict(), str(tmp_path))
    summary = json.loads((run_dir(tmp_path, spec) / "summary.json").read_text())
    assert result["status"] == summary["status"] == "budget-exhausted", summary.get("error")
    prov = json.loads((run_dir(tmp_path, spec) / "provenance.json").read_text())
    assert prov["code"]["commit"] and prov["step_s"] > 0 and prov["cost_model"]["step_s"] == prov["step_s"]

"""benchmarks.accelerator: the GPU script's dry run on the CPU (every phase, toy sizes), the pack's planning against
the 64 MiB a call may carry, the parts of the GGUF, the comparison of runs, the rendering of its result files, and
the host/device copies of the wire (checkfree.hostcopy) on a CPU."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.accelerator import CALLS, SCIENCE_ITEMS
from benchmarks.accelerator.pack import LIMIT_BYTES, MARGIN_BYTES, join_parts, plan_pack, split_file, tracked_bytes
from benchmarks.accelerator.phases import compare_runs
from benchmarks.accelerator.report import BEGIN, END, NO_RUN, render_docs, render_region, summary_markdown

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
# What `python -m benchmarks.accelerator --pack` wrote (benchmarks/results/accelerator/pack-sizes.json): the files
# each call carries besides the repository, and the GGUF cut between them
SIZES = json.loads((REPO / "benchmarks/results/accelerator/pack-sizes.json").read_text())


def test_the_recorded_pack_fits_each_call_with_this_repository():
    """The correctness phase's call (1) and the science call (2) each within 64 MiB with the repository's files as
    they are now: a repository that grows past what the pack leaves free fails here, before the day."""
    fixed = {int(c): files for c, files in SIZES["fixed"].items()}
    plan = plan_pack(tracked_bytes(REPO), fixed, SIZES["gguf"])
    assert plan.fits, plan.problems
    for c in (1, 2):
        assert plan.totals[c] <= LIMIT_BYTES - MARGIN_BYTES
    assert fixed[1]["site.tar.xz"] > 10 * MiB  # hivemind's p2pd is in it: the pack's call 1 is the full set
    assert {"site.tar.xz", "plays.tar.xz", "manifest.json"} <= set(fixed[1]) and "gguf" not in fixed[1]


def test_plan_cuts_the_gguf_so_both_calls_keep_the_same_room():
    fixed = {1: {"site": 16 * MiB, "plays": 2 * MiB}, 2: {"site": MiB, "plays": 2 * MiB}}
    plan = plan_pack(6 * MiB, fixed, 90 * MiB)
    assert plan.fits and 0 < plan.part1 < 90 * MiB
    room = [LIMIT_BYTES - MARGIN_BYTES - plan.totals[c] for c in (1, 2)]
    assert abs(room[0] - room[1]) <= 1 and min(room) > 0
    assert plan.totals[1] + plan.totals[2] == 2 * 6 * MiB + 21 * MiB + 90 * MiB


def test_plan_says_which_call_does_not_fit():
    fixed = {1: {"site": 30 * MiB}, 2: {"site": MiB}}
    plan = plan_pack(10 * MiB, fixed, 94 * MiB)  # 10 + 30 + 10 + 1 + 94 > 2 x 63.5
    assert not plan.fits and any("call" in p for p in plan.problems)
    assert not plan_pack(70 * MiB, {1: {}, 2: {}}, 0).fits  # a repository alone over the limit
    assert plan_pack(6 * MiB, {1: {"a": MiB}, 2: {}}, 0).part1 == 0


def test_gguf_parts_join_back_or_say_what_is_wrong(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(os.urandom(100_000))
    from benchmarks.accelerator.pack import sha256

    digest = sha256(src)
    split_file(src, 40_000, tmp_path / "p1", tmp_path / "p2")
    assert (tmp_path / "p1").stat().st_size == 40_000 and (tmp_path / "p2").stat().st_size == 60_000
    out = join_parts([tmp_path / "p1", tmp_path / "p2"], tmp_path / "joined.gguf", digest, 100_000)
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(ValueError, match="missing .*p3"):
        join_parts([tmp_path / "p1", tmp_path / "p3"], tmp_path / "x.gguf", digest, 100_000)
    with pytest.raises(ValueError, match="another SHA-256"):
        join_parts([tmp_path / "p2", tmp_path / "p1"], tmp_path / "x.gguf", digest, 100_000)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.joining").exists()


def _session_cache(work: Path, session_cache: str) -> Path:
    """`work` with its token cache (work/cache, a phase's $CHECKFREE_CACHE) the session's: the BPE trained once per
    session, not once per run of the command (about 15 s of CPU each)."""
    work.mkdir(parents=True, exist_ok=True)
    Path(session_cache).mkdir(parents=True, exist_ok=True)
    (work / "cache").symlink_to(session_cache, target_is_directory=True)
    return work


def _run_dir(root: Path, losses: list[float], recoveries: list[dict]) -> Path:
    root.mkdir()
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": x}) + "\n" for i, x in enumerate(losses)))
    (root / "events.jsonl").write_text("".join(json.dumps({"event": "recovery", **r}) + "\n" for r in recoveries))
    return root


def test_compare_runs_holds_losses_and_recoveries_to_the_tolerance(tmp_path):
    rec = {"step": 4, "stage": 2, "method": "average", "sources": [1, 3], "coefficients": [0.4, 0.6]}
    a = _run_dir(tmp_path / "a", [5.0, 4.0, 3.0], [rec])
    close = compare_runs(a, _run_dir(tmp_path / "b", [5.0, 4.0 + 2e-5, 3.0], [rec]), 1e-5)  # relative 5e-6
    assert close["ok"] and close["recoveries_same"] and close["max_coefficient_diff"] == 0
    assert close["max_loss_diff"] == pytest.approx(2e-5 / 4.0, rel=1e-3)
    over = compare_runs(a, _run_dir(tmp_path / "c", [5.0, 4.0 + 1e-4, 3.0], [rec]), 1e-5)  # relative 2.5e-5
    assert not over["ok"]
    far = compare_runs(a, _run_dir(tmp_path / "d", [5.0, 4.1, 3.0], [rec]), 1e-5)
    assert not far["ok"] and far["max_loss_diff"] == pytest.approx(0.1 / 4.1)
    other = compare_runs(a, _run_dir(tmp_path / "e", [5.0, 4.0, 3.0], [{**rec, "method": "copy"}]), 1e-5)
    assert not other["ok"] and not other["recoveries_same"]
    coeff = compare_runs(a, _run_dir(tmp_path / "f", [5.0, 4.0, 3.0], [{**rec, "coefficients": [0.41, 0.59]}]), 1e-5)
    assert not coeff["ok"] and coeff["max_coefficient_diff"] == pytest.approx(0.01)
    short = compare_runs(a, _run_dir(tmp_path / "g", [5.0, 4.0], [rec]), 1e-5)
    assert not short["ok"] and not short["steps_same"]


FIXTURE_CALL1 = {
    "call": 1, "dry_run": False, "code": {"commit": "abc123", "dirty": False}, "started": "2026-12-01T10:00:00+0000",
    "wall_s": 250.0, "caps_s": {"env": 25, "correctness": 110, "speed": 135},
    "phases": {
        "env": {"status": "ok", "cap_s": 25, "wall_s": 12.0, "results": {
            "device_info": {"name": "NVIDIA H200", "capability": "9.0", "multiprocessors": 132, "memory_total": 150e9},
            "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "transformers": "5.17.0", "python": "3.12.3"},
            "peak": {"bf16_tflops": 771.5, "bf16_n": 8192, "fp32_tflops": 51.25, "fp32_n": 4096},
            "transport": {"hivemind": {"ok": True}, "tcp": {"ok": True}, "chosen": "hivemind"}}},
        "correctness": {"status": "ok", "cap_s": 110, "wall_s": 80.0, "results": {
            "setup": {"preset": "small", "steps": 12, "transport": "hivemind", "tolerances": {"fp32": 1e-5, "bf16": 2 ** -8}},
            "checks": {"fp32 checkfree+": {"ok": True, "max_loss_diff": 3.5e-7, "max_val_loss_diff": 0.0,
                                           "recoveries": [{"step": 3, "stage": 2, "method": "average"}],
                                           "recoveries_same": True, "max_coefficient_diff": 1.25e-8}},
            "hf": {"ok": True, "out": {"max_logit_diff": 2.5e-6, "tol": 1e-4, "ok": True, "class": "LlamaForCausalLM"},
                   "in_weights": {"ok": True, "tensors": 75}, "in_runs": {"ok": True}}}},
        "speed": {"status": "stopped at its cap (135 s)", "cap_s": 135, "wall_s": 150.0, "results": {
            "setup": {"preset": "paper-124m", "stages": 4, "microbatches": 8, "microbatch_size": 8, "bf16": True,
                      "steps": 13, "warmup": 3, "tokens_per_step": 32768, "flops_per_step": 2.5e16,
                      "peak_bf16_tflops": 771.5},
            "paths": {"swarm tcp gpipe": {"ok": True, "period_s": 0.4125, "tokens_per_s": 79437.6, "mfu": 0.0786,
                                          "torch_gpipe_over_path": 0.875},
                      "torch 1f1b": {"ok": False, "cut": "20 s left, a path needs ~30 s"}}}}},
}


def test_render_shows_the_numbers_of_the_files(tmp_path):
    results = tmp_path / "benchmarks/results/accelerator"
    results.mkdir(parents=True)
    assert render_region(results) == NO_RUN
    (results / "call1.json").write_text(json.dumps(FIXTURE_CALL1))
    text = render_region(results)
    for expected in ("NVIDIA H200", "771.5 TFLOP/s", "**hivemind**", "| fp32 checkfree+ | yes | 3.50e-07 |",
                     "3/2/average", "2.50e-06", "75 tensors", "| swarm tcp gpipe | 0.4125 | 79,438 | 7.86 % | 0.875 |",
                     "| torch 1f1b | not measured: 20 s left", "stopped at its cap (135 s)", "abc123"):
        assert expected in text, expected
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text(f"# Performance\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    assert render_docs(tmp_path)["docs/performance.md"]  # rewritten once, then unchanged
    assert not any(render_docs(tmp_path).values())
    assert "771.5 TFLOP/s" in page.read_text() and "old" not in page.read_text() and page.read_text().endswith("after\n")
    assert summary_markdown(FIXTURE_CALL1).startswith("# Accelerator run, call 1")


def test_the_summary_names_the_code_that_ran_and_where_that_is_known_from():
    """The pack's manifest names the commit (the device's copy carries the session's git metadata, not the
    code's); a record of the first run, made before the run recorded it itself, takes it from the env phase."""
    from benchmarks.accelerator.report import commit_line

    old = {"code": {"commit": "43616a88bb7c", "dirty": True},
           "phases": {"env": {"results": {"pack": {"code": {"commit": "1bf3f289fd93", "dirty": False}}}}}}
    line = commit_line(old)
    assert line.startswith("Commit 1bf3f289fd93 (clean; from the pack's manifest)") and "43616a88bb" in line
    new = {"code": {"commit": "abc", "dirty": False, "source": "the pack's manifest", "matches_pack": True}}
    assert commit_line(new) == "Commit abc (clean; from the pack's manifest); the code that ran is the pack's, file for file"
    assert "differs from the pack's" in commit_line({"code": {**new["code"], "matches_pack": False}})
    assert commit_line({"code": {"commit": "def", "dirty": True, "source": "git in the checkout that ran"}}) == \
        "Commit def (with changes; from git in the checkout that ran)"
    hf = {"call": "hf", "code": new["code"], "phases": {"correctness": {"status": "ok", "results": {
        "setup": {"only": "hf", "source": ["--preset", "small"], "transport": "hivemind",
                  "tolerances": {"fp32": 1e-5, "logits": 1e-4}},
        "source_run": {"ok": True}, "hf": {"export": {"ok": True}, "out": {"ok": False, "error": "OSError: no GPU\n"},
                                           "in_weights": {"ok": True, "tensors": 75}}}}}}
    md = summary_markdown(hf)
    assert "HF out: **failed**: `OSError: no GPU`" in md and "75 tensors equal" in md and "A run from it: not finished" in md


def test_code_digest_is_the_same_from_git_here_and_from_a_walk_there(tmp_path):
    """What the pack records (git's files here) and what the device computes (a walk of its copy, where ignored
    files never travel and __pycache__ may be left) agree; a changed file changes it."""
    from benchmarks.accelerator.pack import code_digest

    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "notes.md").write_text("not code\n")
    (tmp_path / "scratch.py").write_text("ignored\n")
    (tmp_path / ".gitignore").write_text("scratch.py\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    here = code_digest(tmp_path, git=True)
    (tmp_path / "scratch.py").unlink()  # (not carried to the device)
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    assert code_digest(tmp_path) == here and here["files"] == 2
    (tmp_path / "pkg" / "a.py").write_text("A = 2\n")
    assert code_digest(tmp_path)["sha256"] != here["sha256"]


def test_science_shares_follow_the_measured_plan_and_leave_the_rest_to_the_curves():
    from benchmarks.accelerator.science import MIN_S, SHARES_S, item_caps

    fixed = sum(v for v in SHARES_S.values() if v)
    caps = item_caps(fixed, dry=False)  # exactly the fixed shares: nothing for the curves
    assert caps == {**{k: float(v) for k, v in SHARES_S.items() if v}, "smollm2-curves": 0.0}
    more = item_caps(fixed + 200, dry=False)
    assert more["smollm2-curves"] == 200 and more["fig2-124m"] == SHARES_S["fig2-124m"]
    less = item_caps(fixed / 2, dry=False)  # scaled down together; an item under MIN_S is not started
    assert all(v == 0 or v >= MIN_S for v in less.values()) and sum(less.values()) <= fixed / 2
    assert list(SHARES_S) == list(SCIENCE_ITEMS)


def test_the_default_inits_are_known_and_their_strategies_built(tmp_path):
    """The SmolLM2 study's default inits: every label known to experiments.pretrained and its strategy in this
    build (an unknown one is refused before a call starts, not minutes into the science phase)."""
    from benchmarks.accelerator import DEFAULT_INITS
    from benchmarks.accelerator.main import main
    from experiments.pretrained import available_inits

    inits, missing = available_inits(list(DEFAULT_INITS))
    assert sorted(i.label for i in inits) == sorted(DEFAULT_INITS) and not missing
    with pytest.raises(SystemExit):
        main(["--call", "2", "--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
              "--inits", "copy,nonsense"])
    assert not any(tmp_path.iterdir())  # refused before anything was made


def test_curve_steps_fit_the_time_from_the_measured_step_times():
    from benchmarks.accelerator.science import curve_steps

    measured = {1: 0.29, 14: 0.84}
    # 20 curves, 10 at once: two waves; a step with 10 processes interpolated: 0.29 + 0.55 * 9 / 13 = 0.671 s
    steps = curve_steps(300, 20, 10, 10, measured, spawn_s=30)
    assert steps == 170  # (300 / 2 - 30) / 0.671 = 178.9, down to a multiple of 10
    assert curve_steps(10_000, 20, 10, 10, measured) == 500 and curve_steps(60, 20, 10, 10, measured) == 0
    assert curve_steps(300, 14, 14, 10, measured, spawn_s=0) == 350  # 300 / 0.84 = 357


def test_render_aims_figure_links_at_the_committed_copies(tmp_path):
    results = tmp_path / "benchmarks/results/accelerator"
    (results / "science" / "fig2-124m").mkdir(parents=True)
    (results / "science" / "fig2-124m" / "a.png").write_bytes(b"png")
    rec = {"call": 2, "code": {"commit": "abc", "dirty": False, "source": "the pack's manifest"}, "phases": {
        "science": {"status": "ok", "results": {"fig2-124m": {"status": "ok", "table": "Figures: [a.png](a.png), "
                                                                                          "[b.png](b.png)"}}}}}
    (results / "call2.json").write_text(json.dumps(rec))
    text = render_region(results)
    assert "[a.png](../benchmarks/results/accelerator/science/fig2-124m/a.png)" in text
    assert "b.png (not committed)" in text and "](b.png)" not in text
    assert "](a.png)" in summary_markdown(rec)  # a call's own summary: the links as the study wrote them


def test_performance_page_renders_the_committed_accelerator_results():
    text = (REPO / "docs" / "performance.md").read_text()
    region = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert region == render_region(REPO / "benchmarks/results/accelerator"), \
        "docs/performance.md is stale: python -m benchmarks.accelerator --render"
    from benchmarks.accelerator.report import (HF_CPU_BEGIN, HF_CPU_END, TIMINGS_BEGIN, TIMINGS_END, render_hf_cpu,
                                               render_timings)

    readme = (REPO / "benchmarks/results/accelerator/README.md").read_text()
    for begin, end, render in ((TIMINGS_BEGIN, TIMINGS_END, render_timings), (HF_CPU_BEGIN, HF_CPU_END, render_hf_cpu)):
        assert readme.split(begin, 1)[1].split(end, 1)[0].strip() == \
            render(REPO / "benchmarks/results/accelerator").strip(), "the results README is stale: --render"


def test_hostcopy_leaves_cpu_tensors_as_they_are():
    from checkfree.hostcopy import start_to_host, to_device, to_host

    x, y = torch.randn(3, 4), torch.arange(5)
    host, event = start_to_host([x, y])
    assert event is None and host[0] is x and host[1] is y
    assert asyncio.run(to_host([x]))[0] is x
    assert to_device(x, torch.device("cpu")) is x
    z = to_device(x, torch.device("cpu"), torch.bfloat16)
    assert z.dtype == torch.bfloat16 and torch.equal(z, x.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the accelerator run checks it too)")
def test_hostcopy_round_trips_through_pinned_memory_on_a_gpu():  # pragma: no cover - CPU machines
    from checkfree.hostcopy import to_device, to_host

    dev = torch.device("cuda")
    x = torch.randn(64, 1024)
    on = to_device(x, dev)
    y = (on * 2).contiguous()
    (back,) = asyncio.run(to_host([y]))
    assert back.is_pinned() and torch.equal(back, x * 2)


def test_random_inits_draw_on_the_cpu_whatever_the_global_random_state():
    """A rebuild from a seed gives the same weights in every process and on every device: drawn from its own CPU
    generator, never from the global CPU or CUDA generators (which differ between a swarm's peers and the
    simulator)."""
    from checkfree.recovery import identity_init, random_init

    template = {"blocks.0.attn.wq.weight": torch.zeros(8, 8), "blocks.0.norm.weight": torch.zeros(8)}
    torch.manual_seed(1)
    a = random_init(template, seed=7)
    torch.manual_seed(2)
    torch.randn(100)
    b = random_init(template, seed=7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(random_init(template, seed=8)["blocks.0.attn.wq.weight"], a["blocks.0.attn.wq.weight"])
    assert torch.equal(identity_init(template, seed=7)["blocks.0.attn.wq.weight"], a["blocks.0.attn.wq.weight"])


def test_experiment_settings_on_a_device_get_their_own_run_names(tmp_path):
    from experiments.spec import Settings, make_spec, write_traces

    def spec(**kw):
        s = Settings(preset="tiny", steps=10, rates=[16.0], eval_every=2, **kw)
        return make_spec(s, tmp_path, write_traces(s, tmp_path, [16.0]), "checkfree", 16.0, 0)

    plain = spec()
    assert plain.config["train"]["device"] == "cpu" and not plain.config["train"]["autocast_bf16"]
    assert spec(microbatch_size=8).name == plain.name  # the tiny preset's own microbatch size: the same run
    gpu = spec(device="cuda", autocast_bf16=True, microbatch_size=4)
    assert gpu.name != plain.name and gpu.config["train"]["device"] == "cuda"
    assert gpu.config["train"]["microbatch_size"] == 4 and gpu.config["train"]["autocast_bf16"]


@pytest.mark.timeout(400)
def test_dry_run_runs_every_phase_on_the_cpu(tmp_path, session_cache):
    """`python -m benchmarks.accelerator --dry-run`: both calls, every phase at toy size, everything ok, at most 8
    files back, and the results render."""
    out, work = tmp_path / "out", _session_cache(tmp_path / "work", session_cache)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.accelerator", "--dry-run", "--out", str(out), "--work",
                           str(work)], capture_output=True, text=True, timeout=380,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    took = time.monotonic() - t0
    print(f"dry run: {took:.0f} s")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["call1.json", "call1.log", "call1.md", "call2-science.tar.gz", "call2.json", "call2.log",
                     "call2.md"] and len(files) <= 8
    for call, phases in CALLS.items():
        if call == "hf":  # (not in --call all: the device.sh test runs it)
            continue
        rec = json.loads((out / f"call{call}.json").read_text())
        assert rec["dry_run"] and list(rec["phases"]) == list(phases)
        for name, phase in rec["phases"].items():
            assert phase["status"] == "ok", (name, phase)
    c1 = json.loads((out / "call1.json").read_text())["phases"]
    env = c1["env"]["results"]
    assert env["peak"]["bf16_tflops"] > 0 and env["transport"]["chosen"] in ("hivemind", "tcp")
    cor = c1["correctness"]["results"]
    assert cor["ok"], cor
    plus = cor["checks"]["fp32 checkfree+"]
    assert [(r["stage"], r["method"]) for r in plus["recoveries"]] == [(2, "average"), (0, "copy")]
    assert plus["max_loss_diff"] <= 1e-5 and cor["checks"]["bf16 checkfree+"]["ok"]
    bf16 = cor["checks"]["bf16 checkfree+"]  # the dry run's bf16 case: the simulator twice, and against float32
    assert "floor" in bf16 and 0 < bf16["vs_fp32"]["max_loss_diff"] < 0.1
    assert "hf" not in cor  # (the short dry run: the HF check is call hf's, run by the device.sh test)
    speed = c1["speed"]["results"]
    assert all(r["ok"] and r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in speed["paths"].values()), speed["paths"]
    assert len(speed["paths"]) == 3 and speed["recovery"]["ok"] and speed["recovery"]["recovery_total_s"] > 0
    assert json.loads((out / "call2.json").read_text())["phases"]["env"]["results"]["warm"] is False  # no call-1 part
    sci = json.loads((out / "call2.json").read_text())["phases"]["science"]["results"]
    for item in SCIENCE_ITEMS:
        assert sci[item]["status"] == "ok" and sci[item]["table"], (item, sci[item])
    assert "Immediate damage" in sci["smollm2-damage"]["table"] and sci["smollm2-curves"]["curve_steps"] == 2
    import tarfile

    with tarfile.open(out / "call2-science.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("smollm2-damage/smollm2-damage/results.json") for n in names)
    assert any(n.endswith("smollm2-curves/smollm2-curves/results.json") for n in names)
    assert not any(n.endswith("tokenizer.json") for n in names)
    md = (out / "call1.md").read_text()
    assert "| fp32 checkfree+ | yes |" in md and "dry run" in md


def _gpu_tables() -> list[list[str]]:
    """The rows of benchmarks/README.md's two tables of the GPU run (the caps, the science shares)."""
    text = (REPO / "benchmarks/README.md").read_text().split("## On a GPU", 1)[1].split("**The pack.**", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| call ") and not line.startswith("| item ")]


def test_benchmarks_readme_states_the_caps_and_shares_the_script_has():
    """The caps table of benchmarks/README.md ("On a GPU") is the script's CAPS_S, its science table SHARES_S."""
    from benchmarks.accelerator import CAPS_S, call_key
    from benchmarks.accelerator.science import SHARES_S

    rows = _gpu_tables()
    caps = {(call_key(r[0]), r[1]): int(r[2].removesuffix(" s")) for r in rows if len(r) >= 3 and r[0] in ("1", "2", "hf")}
    assert caps == {(c, p): s for c, cs in CAPS_S.items() for p, s in cs.items()}
    shares = {r[0]: r[1] for r in rows if r[0] in SHARES_S}
    assert shares == {k: (f"{v} s" if v else "the rest") for k, v in SHARES_S.items()}
    assert sum(CAPS_S[1].values()) + sum(CAPS_S[2].values()) == 480  # the 8 minutes the README says
    assert sum(v for v in SHARES_S.values() if v) == CAPS_S[2]["science"]


def test_the_first_runs_figures_in_the_caps_basis_are_those_of_its_files():
    """Every decimal figure in the tables' last column ("the first run", "sized from") is a number of
    timings.json or a call's file (at the digits shown): the basis is read, not retyped."""
    import re

    results = REPO / "benchmarks/results/accelerator"
    values: list[float] = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            values.append(float(x))

    for name in ("timings.json", "call1.json", "call2.json", "callhf.json", "callhf-1.json"):
        walk(json.loads((results / name).read_text()))
    seen = set()
    for row in _gpu_tables():
        for text in re.findall(r"\d+\.\d+", row[-1]):
            digits = len(text.split(".")[1])
            assert any(round(v, digits) == float(text) for v in values), (text, row[-1])
            seen.add(text)
    assert len(seen) >= 10
    from benchmarks.accelerator.phases import PATH_S
    from benchmarks.accelerator.science import SMOLLM2_STEP_S

    t = json.loads((results / "timings.json").read_text())
    assert SMOLLM2_STEP_S == {1: round(t["smollm2"]["trunk"]["step_s"], 2),
                              t["smollm2"]["branch_processes"]: round(t["smollm2"]["branch_step_s_median"], 2)}
    walls = t["call1"]["speed"]["path_s"]
    assert PATH_S["sim"] >= walls["simulator"] and PATH_S["torch"] >= walls["torch gpipe"]
    assert PATH_S["swarm"] >= walls["swarm tcp gpipe"]


@pytest.mark.timeout(200)
def test_device_script_runs_the_focused_hf_call_and_reports_what_fails(tmp_path, session_cache):
    """benchmarks/accelerator/device.sh, the device command of README's "On a GPU", with call hf (the focused HF
    in/out check): the pack's site-packages unpacked first on the path (executable bits kept), the call run into
    $OUT: a run exported, transformers' logits against ours, --init-from equal weights, a swarm = the simulator
    from it. Whatever fails still leaves callhf.json and callhf.md saying what: a missing pack, a failed run."""
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    (src / "cf_site_probe.py").write_text("VALUE = 41\n")
    (src / "tool").write_text("#!/bin/sh\n")
    (src / "tool").chmod(0o755)
    (tmp_path / "pack" / "hf").mkdir(parents=True)
    with tarfile.open(tmp_path / "pack" / "hf" / "site.tar.xz", "w:xz") as tar:
        for p in src.iterdir():
            tar.add(p, arcname=p.name)
    env = {**os.environ, "CF_PACK": str(tmp_path / "pack"), "CF_SITE": str(tmp_path / "site"), "OMP_NUM_THREADS": "1",
           "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = REPO / "benchmarks" / "accelerator" / "device.sh"
    # a failed run (no such data), beside the device command: its record says what failed
    with (tmp_path / "broken.log").open("w") as log:
        broken = subprocess.Popen([sys.executable, "-m", "benchmarks.accelerator", "--call", "hf", "--dry-run", "--out",
                                   str(tmp_path / "out2"), "--work", str(tmp_path / "work2"), "--data",
                                   str(tmp_path / "none"), "--phases", "correctness"],  # (env: the device command's)
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        t0 = time.monotonic()
        work = _session_cache(tmp_path / "work", session_cache)
        done = subprocess.run(["bash", str(script), "hf", "--dry-run", "--work", str(work)],
                              capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
        print(f"call hf, dry run: {time.monotonic() - t0:.0f} s")
        assert broken.wait(timeout=120) == 1, (tmp_path / "broken.log").read_text()[-3000:]
    finally:
        if broken.poll() is None:
            broken.kill()
            broken.wait()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "cf_site_probe.py").is_file() and os.access(tmp_path / "site" / "tool", os.X_OK)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["callhf.json", "callhf.log", "callhf.md"]
    rec = json.loads((tmp_path / "out" / "callhf.json").read_text())
    assert list(rec["phases"]) == ["env", "correctness"] and all(p["status"] == "ok" for p in rec["phases"].values())
    assert "peak" not in rec["phases"]["env"]["results"]  # the light env
    hf = rec["phases"]["correctness"]["results"]["hf"]
    assert hf["ok"] and hf["out"]["max_logit_diff"] < 1e-4 and hf["in_weights"]["tensors"] == hf["in_weights"]["export_tensors"]
    assert hf["in_runs"]["swarm"]["ok"] and hf["in_runs"]["compare"]["max_loss_diff"] <= 1e-5
    md = (tmp_path / "out" / "callhf.md").read_text()
    assert "HF out: transformers' LlamaForCausalLM" in md and "swarm = simulator: yes" in md

    rec = json.loads((tmp_path / "out2" / "callhf.json").read_text())
    assert list(rec["phases"]) == ["correctness"]
    res = rec["phases"]["correctness"]["results"]
    assert not res["source_run"]["ok"] and res["hf"]["ok"] is False and res["ok"] is False
    assert "**failed**" in (tmp_path / "out2" / "callhf.md").read_text()

    missing = subprocess.run(["bash", str(script), "1"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert missing.returncode == 2 and "call1/site.tar.xz is missing" in missing.stderr
    said = json.loads((tmp_path / "out" / "call1.json").read_text())
    assert "call1/site.tar.xz is missing" in said["device_sh"]["error"]
    assert "Failed before any phase ran" in (tmp_path / "out" / "call1.md").read_text()


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_a_run_past_the_phases_time_is_stopped_and_recorded(tmp_path, session_cache):
    """A run still going RECORD_S before the phase's deadline is stopped (SIGTERM) and recorded as not finished,
    with the steps it wrote: call hf's first two tries on the H200 left no trace of the run that did not end."""
    import threading

    from benchmarks.accelerator.phases import RECORD_S, Ctx, _simulate

    # The phase's deadline is moved to RECORD_S from now once the run has written a step (the run reads it as it
    # goes): a fixed time failed under load (its start, imports and the BPE of its data, took over 20 s here at load
    # 7: steps_done 0), and a time long enough for any load (45 s) was that long in every run
    work = _session_cache(tmp_path / "work", session_cache)
    ctx = Ctx("correctness", "hf", True, work, "cpu", "shakespeare", "tcp", [], 1, time.time() + RECORD_S + 110)
    metrics, gone, first = work / "run" / "metrics.jsonl", threading.Event(), ctx.deadline

    def cut_once_it_steps() -> None:
        while not gone.wait(0.2):
            if metrics.is_file() and metrics.read_text().count("\n") >= 1:
                ctx.deadline = time.time() + RECORD_S
                return

    watcher = threading.Thread(target=cut_once_it_steps, daemon=True)
    watcher.start()
    # 20,000 steps: minutes on this CPU (a tiny step takes about 30 ms), so that it runs past its time
    try:
        rec = _simulate(ctx, ["--preset", "tiny", "--steps", "20000", "--eval-every", "0"], work / "run")
    finally:
        gone.set()
        watcher.join()
    assert rec["finished"] is False and rec["ok"] is False and rec["error"].startswith("not finished within")
    assert rec["steps_done"] > 0 and rec["steps_done"] == len(metrics.read_text().splitlines())
    assert ctx.deadline < first  # (moved: the run had written a step)
    assert time.time() < ctx.deadline  # stopped and recorded before the phase's deadline


def test_call_hf_on_the_cpu_passed_within_the_h200s_cap():
    """benchmarks/results/accelerator/README.md, "Call hf": both variants run on the CPU passed, each whole
    correctness phase within the cap of the H200's second try (callhf.json), the swarm equal to the simulator."""
    results = REPO / "benchmarks/results/accelerator"
    h200 = json.loads((results / "callhf.json").read_text())["phases"]["correctness"]["cap_s"]
    files = sorted((results / "cpu").glob("callhf-*.json"))
    assert [f.name for f in files] == ["callhf-checkfree.json", "callhf-snap.json"]
    for f in files:
        cor = json.loads(f.read_text())["phases"]["correctness"]
        hf = cor["results"]["hf"]
        assert cor["status"] == "ok" and cor["wall_s"] < h200 and hf["ok"], f.name
        assert hf["in_runs"]["compare"]["ok"] and hf["in_runs"]["swarm"]["ok"], f.name
    assert "within the 100 s cap of the H200's second try" in (results / "README.md").read_text() and h200 == 100

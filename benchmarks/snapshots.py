"""snap's copies against the rebuilds on a trained model: what a copy costs (bytes sent per step per stage, bytes
its holder keeps) and what it is worth (the immediate damage of a restore, the recovery curve after it), measured
with the pretrained experiment's paired branches (experiments.pretrained: one fine-tuned trunk, a branch per
failed stage and init, evaluated through the simulator's evaluation).

    python -m benchmarks.snapshots --quick --init-from DIR     # < 15 min: 10 steps, int8 copy of step 0 vs CheckFree
    python -m benchmarks.snapshots --current --init-from DIR   # the int8 and int4 copies of step 10 itself
    python -m benchmarks.snapshots --swarm --init-from DIR     # the swarm's step time with and without copies
    python -m benchmarks.snapshots --init-from DIR             # the whole study (hours: see benchmarks/README.md)

DIR is what `checkfree pretrained smollm2 --output DIR` writes. --quick fine-tunes SmolLM2 for 10 steps, fails each
of stages 1 to 4 at step 10 and compares the immediate damage of restoring the stage from its int8 copy of step 0
with CheckFree's rebuild; its last line is `snapshot int8 damage/checkfree damage: X`, the worst ratio over the
stages (each branch evaluates only the stages from the failed one on: the trunk records the inputs the stages
before it hand on, `checkfree.evalinputs`). --current restores the stages from their int8 and int4 copies of the
current step on --quick's trunk (the quantization's damage alone, against issue 42's 0.02 and 0.1 nats); --swarm
runs only the swarm rounds. The whole study adds int4, the full-precision snapshot (float32 with the Adam
moments) and the moments' worth at snapshot periods of 1, 10 and 50 steps, CheckFree pre- and post-clip, identity,
random and copy, 50-step recovery curves at every stage, and the swarm's step time with and without streamed copies
in interleaved rounds (`--rounds`); it writes results.json and the damage-against-bytes frontier (frontier.png).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["quick_study", "full_study", "copy_costs", "damages", "render_section", "render_readme", "update_docs",
           "SECTION_BEGIN", "SECTION_END", "main"]

SECTION_BEGIN = "<!-- rendered by benchmarks.snapshots.render_section from benchmarks/results/snapshots-quick.json -->"
SECTION_END = "<!-- end of the snapshots section -->"
README_BEGIN = "<!-- rendered by benchmarks.snapshots.render_readme from benchmarks/results/snapshots-quick.json -->"
README_END = "<!-- end of the snapshots line -->"
ROOT = Path(__file__).resolve().parent.parent

CURRENT_BEGIN = ("<!-- rendered by benchmarks.snapshots.render_current from benchmarks/results/snapshots-current.json"
                 " -->")
CURRENT_END = "<!-- end of the current-step copies -->"
SWARM_BEGIN = "<!-- rendered by benchmarks.snapshots.render_swarm from benchmarks/results/snapshots-swarm.json -->"
SWARM_END = "<!-- end of the snapshots swarm rounds -->"
SWARM_FILES = ["snapshots-swarm.json", "snapshots-swarm-p10.json"]  # --swarm's default and --swarm-every 10


def swarm_markers(name: str) -> tuple[str, str]:
    """The begin and end markers of benchmarks/README.md's region rendered from benchmarks/results/`name`."""
    if name == SWARM_FILES[0]:
        return SWARM_BEGIN, SWARM_END
    return SWARM_BEGIN.replace(SWARM_FILES[0], name), SWARM_END.replace(" -->", f": {name} -->")

EVAL_TOKENS = 50_000  # held-out tokens every evaluation reads, at least
QUICK_INITS = ["checkfree post/stage", "snap int8 age 10"]
CURRENT_INITS = ["snap int8 age 0", "snap int4 age 0"]  # the copy of the current step: the quantization alone
CURRENT_BOUNDS = {"int8": 0.02, "int4": 0.1}  # issue 42: the most a restore from such a copy may cost (nats)
SWARM_BOUND = 0.03  # issue 42: the swarm's median step time with streamed copies within 3 % of without
FULL_REBUILDS = ["checkfree post/stage", "checkfree pre/stage", "identity", "random", "copy"]


def _eval_batches(study, tokens: int = EVAL_TOKENS) -> int:
    t = study.base["train"]
    return -(-tokens // (t["microbatch_size"] * t["seq_len"]))


def quick_study(init_from: str, jobs: int = 2, tokens: int = EVAL_TOKENS):
    """10 steps of fine-tuning, then each of stages 1-4 fails at step 10: CheckFree vs the int8 copy of step 0."""
    from experiments.pretrained import make_study

    s = make_study("smollm2", init_from=init_from)
    s.name, s.branch_at, s.eval_every, s.seeds = "snapshots-quick", [10], 10, [0]
    s.stages, s.curve_stages, s.recover_steps, s.inits, s.jobs, s.threads = [1, 2, 3, 4], [], 0, QUICK_INITS, jobs, 1
    s.base["train"]["eval_batches"] = _eval_batches(s, tokens)
    s.note = "benchmarks.snapshots --quick: immediate damage only, one data order"
    return s


def current_study(init_from: str, jobs: int = 2, tokens: int = EVAL_TOKENS):
    """The quick study's trunk, each of stages 1-4 restored at step 10 from its int8 and its int4 copy of step 10
    itself: the quantization's damage alone."""
    s = quick_study(init_from, jobs, tokens)
    s.name, s.inits = "snapshots-current", list(CURRENT_INITS)
    s.note = "benchmarks.snapshots --current: copies of the current step (the quantization alone), one data order"
    return s


def full_study(init_from: str, jobs: int = 2, seeds: list[int] | None = None, tokens: int = EVAL_TOKENS):
    """The trade-off study: branch at step 60 (so that a copy 50 steps old exists), 50-step curves at stages 1-4."""
    from experiments.pretrained import SNAP_INITS, make_study

    s = make_study("smollm2", init_from=init_from)
    s.name, s.branch_at, s.eval_every, s.seeds = "snapshots", [60], 10, seeds or [0]
    s.stages, s.curve_stages, s.recover_steps, s.jobs, s.threads = [1, 2, 3, 4], [1, 2, 3, 4], 50, jobs, 1
    s.inits = FULL_REBUILDS + [i.label for i in SNAP_INITS]
    s.base["train"]["eval_batches"] = _eval_batches(s, tokens)
    s.note = "benchmarks.snapshots: the copies' trade-off against the rebuilds"
    return s


def damages(data: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Immediate damage (val right after the recovery minus the trunk's at the branch point), by init and stage,
    the mean over the seeds measured (experiments.pretrained_report's definition)."""
    from experiments.pretrained_report import analyse

    out: dict[str, dict[int, list[float]]] = {}
    for c in analyse(data)["cells"]:
        if c["trunk"] == "plain" and c["damage"] is not None:
            out.setdefault(c["init"], {}).setdefault(c["stage"], []).append(c["damage"])
    return {i: {s: statistics.mean(v) for s, v in by.items()} for i, by in out.items()}


def copy_costs(cfg, fmt: str, moments: bool, every: int) -> dict[str, dict[int, float]]:
    """By stage: the bytes a stage sends per step for its copy (a delta every `every` steps, int8/int4; a full
    copy otherwise), the bytes its holder keeps (the copy and an update being received), and the full-precision
    snapshot's (12 B/parameter: weights and both Adam moments in float32) per step and held, at the same period."""
    from checkfree.snapcodec import CopyFormat, full_precision_nbytes, held_nbytes, stage_shapes, update_nbytes

    f = CopyFormat(fmt, cfg.strategy.snapshot_group, moments)
    out: dict[str, dict[int, float]] = {"sent_per_step": {}, "held": {}, "full_sent_per_step": {}, "full_held": {}}
    for s in range(cfg.num_stages):
        shapes = stage_shapes(cfg, s)
        kind = "delta" if f.differential else "full"
        out["sent_per_step"][s] = update_nbytes(shapes, f, kind) / every
        out["held"][s] = held_nbytes(shapes, f) + update_nbytes(shapes, f, "full")
        full = full_precision_nbytes(shapes)
        out["full_sent_per_step"][s], out["full_held"][s] = full / every, 2 * full
    return out


def first_step_losses(study, work: Path) -> dict[str, float]:
    """The loss of the first step of the study's fine-tuning with the plain routes and with CheckFree+'s swapped
    ones (half of the microbatches through stages a trained model has never seen): one simulator step each."""
    from checkfree.config import config_from_dict
    from checkfree.rundir import read_jsonl
    from checkfree.simulator import Simulator

    out = {}
    for strategy in ("checkfree", "checkfree+"):
        c = json.loads(json.dumps(study.base))
        c["recovery"]["strategy"] = strategy
        c["train"].update(num_steps=1, eval_every=0, eval_batches=1)
        d = work / f"first-step-{strategy}"
        Simulator(config_from_dict(c), d, progress=False).run()
        out[strategy] = read_jsonl(d / "metrics.jsonl")[0]["loss"]
    return out


COST_FORMATS = [("int8", False), ("int8", True), ("int4", False), ("int4", True), ("bf16", False)]


def costs_table(cfg_dict: dict[str, Any], every: int = 10) -> dict[str, dict[str, float]]:
    """Each copy format (with and without the Adam moments) at a period of `every` steps, the worst stage: the bytes
    sent per step and the bytes its holder keeps (the copy and an update being received), each as a fraction of
    one full-precision snapshot's (12 bytes a parameter) at the same period."""
    from checkfree.config import config_from_dict

    cfg = config_from_dict(cfg_dict)
    out = {}
    for fmt, moments in COST_FORMATS:
        c = copy_costs(cfg, fmt, moments, every)
        out[f"{fmt}{' +moments' if moments else ''}"] = {
            "sent": max(c["sent_per_step"][s] / c["full_sent_per_step"][s] for s in c["held"]),
            "held": max(c["held"][s] / (c["full_held"][s] / 2) for s in c["held"])}
    return out


def _costs_line(cfg_dict: dict[str, Any]) -> tuple[float, float]:
    """int8 without moments at a period of 10 steps, the worst stage: bytes sent per step and held, each as a
    fraction of the full-precision snapshot's at the same period."""
    from checkfree.config import config_from_dict

    c = copy_costs(config_from_dict(cfg_dict), "int8", False, 10)
    sent = max(c["sent_per_step"][s] / c["full_sent_per_step"][s] for s in c["held"])
    held = max(c["held"][s] / (c["full_held"][s] / 2) for s in c["held"])
    return sent, held


def render_section(result: dict[str, Any]) -> str:
    """docs/recovery.md's section on what the copies were measured to be worth (every number from `result`)."""
    cf, i8, r = result["checkfree_damage"], result["int8_damage"], result["ratios"]
    rows = "\n".join(f"| {s} | {float(cf[s]):.3f} | {float(i8[s]):+.5f} | {float(r[s]):+.5f} |" for s in sorted(cf))
    fl = result.get("first_step_loss", {})
    sent, held = result["costs_int8_p10"]
    lines = [
        f"`{result['command']}` (commit {result['commit'][:12]}, one data order, {result['eval_tokens']} held-out "
        f"tokens per evaluation, {result['wall_s']:.0f} s): SmolLM2-135M in 6 stages, fine-tuned 10 steps; each of "
        "stages 1 to 4 fails at step 10 and is rebuilt by CheckFree or restored from its int8 copy of step 0 (ten "
        "steps old). Immediate damage: the validation loss right after, minus before: one evaluation per cell, "
        "with no interval.",
        "",
        "| stage | CheckFree damage (nats) | int8 copy damage (nats) | ratio |",
        "|---|---|---|---|",
        rows,
        "",
        f"The worst ratio over the stages: {float(result['worst_ratio']):.5f}. An int8 copy with a delta every 10 "
        f"steps sends at most {sent:.1%} of the full-precision snapshot's bytes per step (weights and Adam moments "
        f"in float32 at the same period), and its holder keeps at most {held:.1%} of that snapshot's memory "
        "(`checkfree.snapcodec`'s sizes, SmolLM2's shapes).",
    ]
    if "costs_p10" in result:
        lines += ["", render_costs(result)]
    if fl:
        lines += ["", f"CheckFree+'s swapped routes on the same model: the first step's loss was "
                      f"{float(fl['checkfree+']):.2f}, against {float(fl['checkfree']):.2f} with the plain routes."]
    return "\n".join(lines)


def render_readme(result: dict[str, Any]) -> str:
    """The README's line on the copies (every number from `result`)."""
    cf = [float(v) for v in result["checkfree_damage"].values()]
    return (f"On SmolLM2, a stage restored from its int8 copy ten steps old lost at most "
            f"{float(result['worst_ratio']):.4f} of what CheckFree's rebuild lost ({min(cf):.2f} to {max(cf):.2f} nats, stages 1 to 4, "
            f"one evaluation each of {result['eval_tokens']} held-out tokens, no interval: "
            "[recovery strategies](docs/recovery.md#snap-a-compressed-copy-at-the-neighbour)).")


def _met(value: float, bound: float) -> str:
    return "met" if value <= bound else "not met"


def render_current(result: dict[str, Any]) -> str:
    """docs/recovery.md's table of the copies of the current step (every number from `result`)."""
    d, worst = result["damage"], result["worst"]
    rows = "\n".join(f"| {s} | {float(d['int8'][s]):+.5f} | {float(d['int4'][s]):+.5f} |" for s in sorted(d["int8"]))
    b = result["bounds"]
    return "\n".join([
        f"`{result['command']}` (commit {result['commit'][:12]}, one data order, {result['eval_tokens']} held-out "
        f"tokens per evaluation, {result['wall_s']:.0f} s): the same fine-tuning; each of stages 1 to 4 fails at step "
        "10 and is restored from its copy of step 10 itself, in int8 (a scale per row) or int4 (a scale per "
        f"{result['group']} values), without the Adam moments: the quantization's damage alone.",
        "",
        "| stage | int8 copy damage (nats) | int4 copy damage (nats) |",
        "|---|---|---|",
        rows,
        "",
        f"The worst over the stages: int8 {float(worst['int8']):+.5f} nats (issue 42's bound: at most "
        f"{b['int8']}: {_met(worst['int8'], b['int8'])}), int4 {float(worst['int4']):+.5f} nats (at most "
        f"{b['int4']}: {_met(worst['int4'], b['int4'])}).",
    ])


def render_costs(result: dict[str, Any]) -> str:
    """The copies' bytes, each format with and without the moments, against the quarter issue 42 allows."""
    c = result["costs_p10"]
    rows = "\n".join(f"| {k} | {v['sent']:.1%} | {_met(v['sent'], 0.25)} | {v['held']:.1%} | "
                     f"{_met(v['held'], 0.25)} |" for k, v in c.items())
    return "\n".join([
        "What each format costs at a period of 10 steps, the worst stage, as a fraction of the full-precision "
        "snapshot's (weights and Adam moments in float32, 12 bytes a parameter, at the same period); the holder "
        "keeps the copy and an update being received, against one such snapshot (the stricter comparison: a "
        "full-precision holder receiving a new snapshot keeps two; `checkfree.snapcodec`'s sizes, SmolLM2's shapes; "
        "issue 42 allows a quarter of each):",
        "",
        "| copy | bytes sent per step | at most a quarter | bytes the holder keeps | at most a quarter |",
        "|---|---|---|---|---|",
        rows,
    ])


def render_swarm(result: dict[str, Any]) -> str:
    """benchmarks/README.md's table of the swarm rounds (every number from `result`)."""
    t, med, every = result["per_round"], result["median"], result.get("every", 1)
    n = len(t["snap"])
    means = result.get("mean_per_round")
    means_note = "" if means is None else " (and the mean: what an update's steps cost on average)"
    rows = "\n".join(f"| {r} | {t['snap'][r]:.3f} | {t['checkfree'][r]:.3f} | {t['snap'][r] / t['checkfree'][r]:.3f} |"
                     for r in range(n))
    lo, hi = min(result["ratios"]), max(result["ratios"])
    return "\n".join([
        f"`{result['command']}` (commit {result['commit'][:12]}, {result['wall_s']:.0f} s, load average "
        f"{result['load'][0]:.1f} before, {result['load'][1]:.1f} after): {n} interleaved rounds (the order of the "
        "two runs swapped every other round) of `checkfree local --init-from DIR --stages 6 --steps "
        f"{result['steps']} --seq-len 128 --microbatch-size 2 --microbatches 2 --no-churn`, SmolLM2-135M, real "
        f"processes: `--strategy snap` with int8 copies, an update every {_every(every)} (`--snapshot-every "
        f"{every}`, the default budget) against `--strategy checkfree` (nothing streamed). Per run the median step "
        f"time over its steps after the first {result['skip']}{means_note}."
        + (f" Runs that failed and were run again: {', '.join(result['retried'])}." if result.get("retried") else ""),
        "",
        "| round | snap s/step | no copies s/step | snap ÷ no copies |",
        "|---|---|---|---|",
        rows,
        "",
        f"Median over the rounds: {med['snap']:.3f} s/step with streamed copies, {med['checkfree']:.3f} without: "
        f"{result['overhead']:+.1%} (per round {lo - 1:+.1%} to {hi - 1:+.1%}); issue 42's bound, within "
        f"{SWARM_BOUND:.0%}: {_met(abs(result['overhead']), SWARM_BOUND)}."
        + ("" if means is None else
           f" Mean step time, median over the rounds: {statistics.median(means['snap']):.3f} s with copies, "
           f"{statistics.median(means['checkfree']):.3f} without "
           f"({statistics.median(means['snap']) / statistics.median(means['checkfree']) - 1:+.1%})."),
    ])


def _every(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def _between(text: str, begin: str, end: str, body: str) -> str:
    i, j = text.index(begin) + len(begin), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def update_docs(result: dict[str, Any] | None = None, root: Path = ROOT, *, current: dict[str, Any] | None = None,
                swarm: dict[str, Any] | None = None, swarm_file: str = SWARM_FILES[0]) -> list[Path]:
    """Rewrite the rendered parts of docs/recovery.md and README.md from the quick benchmark's `result`, of
    docs/recovery.md from the current-step copies' (`current`), of benchmarks/README.md from the swarm rounds'."""
    parts = []
    if result is not None:
        parts += [(root / "docs" / "recovery.md", SECTION_BEGIN, SECTION_END, render_section(result)),
                  (root / "README.md", README_BEGIN, README_END, render_readme(result))]
    if current is not None:
        parts.append((root / "docs" / "recovery.md", CURRENT_BEGIN, CURRENT_END, render_current(current)))
    if swarm is not None:
        parts.append((root / "benchmarks" / "README.md", *swarm_markers(swarm_file), render_swarm(swarm)))
    out = []
    for path, begin, end, body in parts:
        path.write_text(_between(path.read_text(), begin, end, body))
        out.append(path)
    return out


def _run(study, args, command: str, work: str | None = None) -> dict[str, Any]:
    """Run `study` in `args.work`/`work` (its name unless given: another study's directory shares its trunk)."""
    from experiments.pretrained import run_study

    out = run_study(study, Path(args.work) / (work or study.name), Path(args.results), command=command,
                    log=lambda m: print(m, flush=True))
    return json.loads((out / "results.json").read_text())


def _quick(args, command: str) -> int:
    study = quick_study(args.init_from, args.jobs, args.eval_tokens)
    t0 = time.time()
    data = _run(study, args, command)
    d = damages(data)
    cf, snap = d.get("checkfree post/stage", {}), d.get("snap int8 age 10", {})
    stages = sorted(set(cf) & set(snap))
    if stages != [1, 2, 3, 4]:
        print(f"snapshots: missing damage cells (checkfree: {sorted(cf)}, int8: {sorted(snap)}); see "
              f"{args.results}/{study.name}", file=sys.stderr)
        return 1
    print(f"{'stage':>5}  {'checkfree damage':>16}  {'int8 copy damage':>16}  ratio")
    ratios = {}
    for s in stages:
        ratios[s] = snap[s] / cf[s] if cf[s] > 0 else math.inf
        print(f"{s:>5}  {cf[s]:16.4f}  {snap[s]:16.5f}  {ratios[s]:.5f}")
    worst = max(ratios.values())
    result = {"command": command, "commit": data["commit"], "eval_tokens": study.base["train"]["eval_batches"]
              * study.base["train"]["microbatch_size"] * study.base["train"]["seq_len"],
              "checkfree_damage": cf, "int8_damage": snap, "ratios": ratios, "worst_ratio": worst,
              "first_step_loss": first_step_losses(study, Path(args.work) / study.name),
              "costs_int8_p10": _costs_line(study.base), "costs_p10": costs_table(study.base),
              "wall_s": round(time.time() - t0, 1), "machine_load": data["machine"]["loadavg_at_report"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if Path(args.out).resolve() == (ROOT / "benchmarks" / "results" / "snapshots-quick.json").resolve():
        update_docs(json.loads(Path(args.out).read_text()))
    print(f"eval tokens {result['eval_tokens']}, {result['wall_s']:.0f} s, results in {args.out}")
    print(f"snapshot int8 damage/checkfree damage: {worst:.5f}")
    return 0


def _current(args, command: str) -> int:
    """The copies of the current step (int8 and int4): the quick study's trunk (reused from `--work` when the quick
    benchmark ran there), each of stages 1-4 restored from them; the worst damage against issue 42's bounds."""
    from checkfree.config import config_from_dict

    study = current_study(args.init_from, args.jobs, args.eval_tokens)
    t0 = time.time()
    data = _run(study, args, command, work="snapshots-quick")  # the quick study's trunk
    d = damages(data)
    got = {fmt: d.get(f"snap {fmt} age 0", {}) for fmt in CURRENT_BOUNDS}
    if any(sorted(v) != [1, 2, 3, 4] for v in got.values()):
        print(f"snapshots: missing damage cells ({ {k: sorted(v) for k, v in got.items()} }); see "
              f"{args.results}/{study.name}", file=sys.stderr)
        return 1
    print(f"{'stage':>5}  {'int8 damage':>12}  {'int4 damage':>12}")
    for s in range(1, 5):
        print(f"{s:>5}  {got['int8'][s]:12.5f}  {got['int4'][s]:12.5f}")
    worst = {fmt: max(v.values()) for fmt, v in got.items()}
    t = study.base["train"]
    result = {"command": command, "commit": data["commit"],
              "eval_tokens": t["eval_batches"] * t["microbatch_size"] * t["seq_len"],
              "group": config_from_dict(study.base).strategy.snapshot_group, "damage": got, "worst": worst,
              "bounds": dict(CURRENT_BOUNDS), "met": {f: worst[f] <= b for f, b in CURRENT_BOUNDS.items()},
              "wall_s": round(time.time() - t0, 1), "machine_load": data["machine"]["loadavg_at_report"]}
    out = Path(args.out or ROOT / "benchmarks" / "results" / "snapshots-current.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if out.resolve() == (ROOT / "benchmarks" / "results" / "snapshots-current.json").resolve():
        update_docs(current=json.loads(out.read_text()))
    print(f"eval tokens {result['eval_tokens']}, {result['wall_s']:.0f} s, results in {out}")
    print(f"snapshot current-step damage, worst over stages 1-4: int8 {worst['int8']:.5f} (bound "
          f"{CURRENT_BOUNDS['int8']}), int4 {worst['int4']:.5f} (bound {CURRENT_BOUNDS['int4']})")
    return 0


SWARM_SKIP = 2  # steps of each swarm round not timed (the first whole copy streams in the first two or three)
SWARM_TRIES = 3  # runs of a round's `checkfree local` before the rounds give up (a loaded machine can fail a start)


def _swarm_rounds(args) -> dict[str, Any]:
    """The swarm's step time with and without streamed copies: `rounds` interleaved pairs of `checkfree local`
    runs of SmolLM2 in 6 stages without failures, one with snap's int8 copies updated every step, one with
    CheckFree (nothing streamed), their order swapped every other round; per run the median step time after the
    first SWARM_SKIP steps."""
    import subprocess

    from checkfree.rundir import read_jsonl

    times: dict[str, list[float]] = {"snap": [], "checkfree": []}
    base = ["--init-from", args.init_from, "--stages", "6", "--steps", str(args.round_steps), "--seq-len", "128",
            "--microbatch-size", "2", "--microbatches", "2", "--no-churn", "--no-progress", "--eval-every", "0",
            "--no-dashboard"]
    means: dict[str, list[float]] = {"snap": [], "checkfree": []}
    runs = [("snap", ["--strategy", "snap", "--snapshot-every", str(args.swarm_every)]),
            ("checkfree", ["--strategy", "checkfree"])]
    retried: list[str] = []
    for r in range(args.rounds):
        for name, extra in (runs if r % 2 == 0 else runs[::-1]):
            out = Path(args.work) / "rounds" / f"{name}-{r}"
            cmd = [sys.executable, "-m", "checkfree", "local", *base, *extra, "--out", str(out)]
            for attempt in range(SWARM_TRIES):  # (a run that failed, e.g. to start, is run again: `retried`)
                if subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=3600).returncode == 0:
                    break
                if attempt == SWARM_TRIES - 1:
                    raise RuntimeError(f"round {r} {name} failed {SWARM_TRIES} times: {' '.join(cmd)}")
                retried.append(f"{name}-{r}")
                print(f"round {r} {name}: the run failed (logs in {out / 'logs'}), run again", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            steps = [m["step_time_s"] for m in read_jsonl(out / "metrics.jsonl")][SWARM_SKIP:]
            times[name].append(statistics.median(steps))
            means[name].append(statistics.mean(steps))
            print(f"round {r} {name}: median step {times[name][-1]:.3f} s, mean {means[name][-1]:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"per_round": times, "median": med, "overhead": med["snap"] / med["checkfree"] - 1,
            "ratios": [a / b for a, b in zip(times["snap"], times["checkfree"])],
            "mean_per_round": means, "every": args.swarm_every,
            "spread": {k: [min(v), max(v)] for k, v in times.items()}, "steps": args.round_steps, "skip": SWARM_SKIP,
            "retried": retried}


def _swarm(args, command: str) -> int:
    """The swarm rounds alone: benchmarks/results/snapshots-swarm.json, rendered into benchmarks/README.md."""
    import os

    from experiments.pretrained import _commit

    t0, load0 = time.time(), os.getloadavg()[0]
    result = {"command": command, "commit": _commit(), **_swarm_rounds(args)}
    result.update(wall_s=round(time.time() - t0, 1), load=[load0, os.getloadavg()[0]])
    out = Path(args.out or ROOT / "benchmarks" / "results" / "snapshots-swarm.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if out.resolve().parent == (ROOT / "benchmarks" / "results").resolve() and out.name in SWARM_FILES:
        update_docs(swarm=json.loads(out.read_text()), swarm_file=out.name)
    lo, hi = min(result["ratios"]), max(result["ratios"])
    print(f"results in {out}, {result['wall_s']:.0f} s")
    print(f"swarm step time snap/no copies: {1 + result['overhead']:.4f} (per round {lo:.4f}-{hi:.4f}, "
          f"{args.rounds} rounds; bound {1 + SWARM_BOUND:.2f})")
    return 0


E2E_KILLS = [(10, 1), (20, 3), (30, 2)]  # (step, stage): 3 SIGKILLs of serving peers


def _e2e(args) -> dict[str, Any]:
    """The end-to-end must-hold: SmolLM2 fine-tuned 40 steps in 6 stages in the real swarm (`checkfree local`,
    real processes), once without failures, once with 3 SIGKILLs of serving peers and snap's int8 copies streamed,
    once with the same SIGKILLs and CheckFree; validation every 10 steps on the evaluation's held-out tokens."""
    import subprocess

    from checkfree.rundir import read_jsonl

    work = Path(args.work) / "e2e"
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.csv"
    trace.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in E2E_KILLS))
    batches = -(-args.eval_tokens // (2 * 128))
    base = ["--init-from", args.init_from, "--stages", "6", "--steps", "40", "--seq-len", "128",
            "--microbatch-size", "2", "--microbatches", "2", "--eval-every", "10", "--no-progress", "--no-dashboard",
            "--set", f"train.eval_batches={batches}"]
    runs = {"no failures": ["--strategy", "snap", "--no-churn"],
            "snap int8": ["--strategy", "snap", "--trace", str(trace)],
            "checkfree": ["--strategy", "checkfree", "--trace", str(trace)]}
    out: dict[str, Any] = {"kills": E2E_KILLS, "eval_tokens": batches * 256, "runs": {}}
    for name, extra in runs.items():
        d = work / name.replace(" ", "-")
        subprocess.run([sys.executable, "-m", "checkfree", "local", *base, *extra, "--out", str(d)], check=True,
                       timeout=4 * 3600)
        metrics = read_jsonl(d / "metrics.jsonl")
        out["runs"][name] = {"val": [[m["step"], m["val_loss"]] for m in metrics if "val_loss" in m],
                             "loss": [[m["step"], m["loss"]] for m in metrics],
                             "recoveries": [e for e in read_jsonl(d / "events.jsonl")
                                            if e["event"] in ("recovery", "fallback")]}
    final = {k: v["val"][-1][1] for k, v in out["runs"].items()}
    out["final_val"] = final
    out["snap_gap"] = final["snap int8"] - final["no failures"]
    out["checkfree_gap"] = final["checkfree"] - final["no failures"]
    return out


def _frontier(data: dict[str, Any], costs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = damages(data)
    fig, ax = plt.subplots(figsize=(7, 5))
    for init, by in sorted(d.items()):
        x = statistics.mean(costs.get(init, {}).get("sent_per_step", {1: 0.0}).values()) if init in costs else 0.0
        y = statistics.mean(by.values())
        ax.scatter([max(x, 1.0)], [max(y, 1e-5)])
        ax.annotate(init, (max(x, 1.0), max(y, 1e-5)), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes sent per step per stage (rebuilds: 0, drawn at 1)")
    ax.set_ylabel("immediate damage, mean over stages 1-4 (nats)")
    ax.set_title("SmolLM2: damage against bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _full(args, command: str) -> int:
    from checkfree.config import config_from_dict
    from experiments.pretrained import ALL_INITS

    study = full_study(args.init_from, args.jobs, args.seeds, args.eval_tokens)
    data = _run(study, args, command)
    cfg = config_from_dict(study.base)
    costs = {i.label: copy_costs(cfg, i.copy_format, i.copy_moments, max(1, i.copy_age))
             for i in ALL_INITS if i.label in study.inits and i.copy_format is not None}
    result = {"command": command, "commit": data["commit"], "damage": damages(data), "costs": costs}
    if args.rounds:
        result["swarm_step_time"] = _swarm_rounds(args)
    if args.e2e:
        result["e2e"] = _e2e(args)
    out = Path(args.results) / study.name
    (out / "snapshots.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    _frontier(data, costs, out / "frontier.png")
    print(f"snapshots: {out / 'snapshots.json'}, {out / 'frontier.png'}, {out / 'table.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.snapshots", description=__doc__.split("\n\n")[0])
    p.add_argument("--init-from", required=True, metavar="DIR", help="checkfree pretrained smollm2 --output DIR")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="10 steps; the int8 copy of step 0 against CheckFree")
    mode.add_argument("--current", action="store_true",
                      help="the int8 and int4 copies of the current step (the quantization alone), on --quick's "
                           "trunk (reused from --work when --quick ran there)")
    mode.add_argument("--swarm", action="store_true",
                      help="only the swarm rounds: step time with and without streamed copies (--rounds)")
    p.add_argument("--jobs", type=int, default=2, help="branch runs in parallel (one process each)")
    p.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], help="data orders (default 0)")
    p.add_argument("--rounds", type=int, default=5, help="full study: interleaved swarm rounds (0: none)")
    p.add_argument("--round-steps", type=int, default=12, help="steps of each swarm round")
    p.add_argument("--swarm-every", type=int, default=1, metavar="N",
                   help="the swarm rounds' snapshot period (the snap runs' --snapshot-every; 1: an update every step)")
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                   help="full study: the 40-step swarm runs with 3 SIGKILLs (snap int8, CheckFree, no failures)")
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="held-out tokens per evaluation, at least")
    p.add_argument("--work", default="runs/snapshots", help="run directories (large; not committed)")
    p.add_argument("--results", default="experiments/results/pretrained", help="the studies' results")
    p.add_argument("--out", help="--quick, --current, --swarm: the result file (default: benchmarks/results/"
                                 "snapshots-quick.json, snapshots-current.json, snapshots-swarm.json)")
    args = p.parse_args(argv)
    command = "python -m benchmarks.snapshots " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.quick:
        args.out = args.out or "benchmarks/results/snapshots-quick.json"
        return _quick(args, command)
    if args.current:
        return _current(args, command)
    if args.swarm:
        if args.rounds < 1:
            p.error("--swarm needs --rounds >= 1")
        return _swarm(args, command)
    return _full(args, command)


if __name__ == "__main__":
    sys.exit(main())

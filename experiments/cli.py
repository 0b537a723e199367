"""`checkfree experiment`: the paper's comparison at CPU scale (see experiments/README.md).

    checkfree experiment convergence [--quick] [--preset small] [--steps 100] [--rates 5,10,16] ...
    checkfree experiment ablation-init | ablation-ckpt | ablation-rate | ablation-swap [...]
    checkfree experiment all [...]            # the union of the above, one pool of processes
    checkfree experiment convergence --recipe paper-500m-table2 --dry-run   # the paper's scale (experiments.recipes)
    checkfree experiment report --readme [experiments/README.md] [--check]  # rendered regions (experiments.readme)
"""

from __future__ import annotations

import argparse
import shlex
import sys

from checkfree.config import PRESETS
from checkfree.recovery import FALLBACKS

RECIPE_NAMES = ("paper-500m-table2", "paper-500m-fig2", "paper-124m")  # = experiments.recipes.RECIPES (not imported)

__all__ = ["add_parser", "settings_from_args", "run", "run_report"]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _strategies(text: str) -> list[str]:
    from checkfree.strategies import STRATEGIES

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown strategies {bad}; choose from {sorted(STRATEGIES)}")
    return names


def _add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("matrix")
    base = g.add_mutually_exclusive_group()
    base.add_argument("--quick", action="store_true",
                      help="tiny preset, 12 steps, 2 rates, 1 seed, every strategy: the whole path in about a minute")
    base.add_argument("--recipe", choices=sorted(RECIPE_NAMES),
                      help="the paper's experiment at the paper's scale with the authors' failure probabilities, "
                           "steps, checkpoint interval and evaluation (experiments/recipes.py); other flags override")
    g.add_argument("--preset", choices=sorted(PRESETS), help="model/training preset (default small; quick: tiny)")
    g.add_argument("--steps", type=int, help="steps per run (default 100; quick: 12)")
    g.add_argument("--seeds", type=_ints, help="comma-separated seeds (init, data and failure draws; default 0)")
    g.add_argument("--rates", type=_floats, help="the paper's hourly failure rates in percent (default 5,10,16)")
    g.add_argument("--rate-scale", type=float, help="k: paper iterations per CPU step; p per step = k x the "
                   "paper's per-iteration p (default 20; quick: 50)")
    g.add_argument("--strategies", type=_strategies, help="comma-separated strategies (default: all)")
    g.add_argument("--cost-profile", help="simulated wall clock: paper-geo (default) or local")
    g.add_argument("--detection-time", help="failure-detection/recovery delay in s, 'auto' (paper's 30 s "
                   "time-compressed, default) or 'profile' (the cost profile's own)")
    t = g.add_mutually_exclusive_group()
    t.add_argument("--target", type=float, help="fixed target validation loss")
    t.add_argument("--target-fraction", type=float,
                   help="target = the failure-free run's val loss after this fraction of the steps (default 0.5)")
    g.add_argument("--fallback", choices=FALLBACKS, help="unrecoverable (adjacent) failures: abort, random, copy or identity "
                   "(default copy)")
    g.add_argument("--data", help="corpus of every run: a text file or directory, or hf:<dataset> (default: the "
                                  "preset's, Shakespeare)")
    g.add_argument("--omega-scope", choices=("stage", "blocks"),
                   help="CheckFree's omega over the whole stage (default, the authors' reading) or its transformer "
                        "blocks only; runs with blocks get their own names, so both can share a results directory")
    g.add_argument("--lr-scale", type=float,
                   help="LR multiplier of a rebuilt stage (default 1.1, the paper's; the paper-500m recipes: 1.2, the "
                        "authors' 500M config)")
    g.add_argument("--storage-fallback", choices=("yes", "no"),
                   help="redundant/gemini/reft/baft checkpoint too and roll back when copies are lost (default yes)")
    g.add_argument("--max-iter-factor", type=float, help="iteration budget of rollback strategies, x steps (default 3)")
    g.add_argument("--eval-every", type=int, help="steps between validation evaluations (default 5; quick: 2)")
    g.add_argument("--checkpoint-every", type=int, help="checkpoint interval in CPU steps (default 100 / k)")
    g.add_argument("--snapshot-every", type=int, help="gemini/reft/checkfree+snap snapshot interval (default 10 / k)")
    a = p.add_argument_group("ablations")
    a.add_argument("--init-rate", type=float, help="ablation-init's hourly rate, percent (default 16)")
    a.add_argument("--ckpt-rate", type=float, help="ablation-ckpt's hourly rate, percent (default 10)")
    a.add_argument("--ckpt-intervals", type=_ints, help="ablation-ckpt's intervals in paper iterations (default 10,50,100)")
    a.add_argument("--plus-rates", type=_floats, help="ablation-rate's hourly rates (default 0,5,10,16,33)")
    x = p.add_argument_group("execution")
    x.add_argument("--jobs", type=int, help="parallel run processes (default: the cores available)")
    x.add_argument("--threads", type=int, help="torch threads per run process (default 1)")
    x.add_argument("--runtime", choices=("sim", "local"), default="sim",
                   help="local: also run every cell on the distributed runtime (checkfree local: real processes, "
                        "SIGKILLs from the same trace) beside the simulator")
    x.add_argument("--out", help="results directory (default experiments/results/<preset>, quick: .../quick)")
    x.add_argument("--report-only", action="store_true", help="only rewrite tables and plots from finished runs")
    x.add_argument("--dry-run", action="store_true",
                   help="check each distinct configuration of the matrix (config, data loading, one training step) "
                        "and print its compute (FLOPs, GPU-hours) beside the cost model's simulated clock; trains "
                        "nothing and writes no results")
    x.add_argument("--gpu", default="A100", help="--dry-run: the GPU class of the compute estimate (A100, H100, L4)")
    x.add_argument("--mfu", type=float, default=0.4,
                   help="--dry-run: the utilisation (model FLOPs / peak) the compute estimate assumes (default 0.4)")
    x.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="convergence experiments and ablations (the paper's comparison at CPU scale)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    esub = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")

    helps = {"convergence": "every strategy x failure rate x seed: the paper's Table 2, plots",
             "ablation-init": "recovery initialisation: random, copy, uniform, checkfree (paper Fig. 2), identity",
             "ablation-ckpt": "checkpoint every 10/50/100 paper iterations vs CheckFree+ (Fig. 4b)",
             "ablation-rate": "CheckFree+ at several failure rates (Fig. 4a)",
             "ablation-swap": "checkfree vs checkfree+ without failures: the swap's cost (Fig. 4c)",
             "all": "every experiment above, one pool of processes"}
    for name in helps:  # = experiments.suite.EXPERIMENTS + "all" (not imported here: matplotlib is slow to load)
        e = esub.add_parser(name, help=helps[name], description=helps[name])
        _add_options(e)
        e.set_defaults(func=run)
    r = esub.add_parser("report", help="render the regions of a Markdown file from the committed result files",
                        description="Rewrite every `<!-- BEGIN rendered: NAME -->` region of the file from the result "
                                    "files (experiments/readme.py); --check only lists the regions that differ.")
    r.add_argument("--readme", nargs="?", const="experiments/README.md", required=True, metavar="PATH",
                   help="the Markdown file (default experiments/README.md), or all: every file of experiments.readme.DOCUMENTS")
    r.add_argument("--results", default="experiments/results", help="the results root the renderers read")
    r.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region differs")
    r.set_defaults(func=run_report)
    from experiments import pretrained

    e = esub.add_parser("pretrained", help="recovery on a trained network: paired branches from one warm checkpoint",
                        description=pretrained.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pretrained.add_arguments(e)
    e.set_defaults(func=pretrained.main)


def settings_from_args(args: argparse.Namespace):
    from experiments.spec import Settings

    fields = {
        "preset": args.preset, "steps": args.steps, "seeds": args.seeds, "rates": args.rates,
        "rate_scale": args.rate_scale, "strategies": args.strategies, "cost_profile": args.cost_profile,
        "target": args.target, "target_fraction": args.target_fraction, "fallback": args.fallback,
        "omega_scope": args.omega_scope, "data": args.data, "lr_scale": args.lr_scale,
        "max_iter_factor": args.max_iter_factor, "eval_every": args.eval_every,
        "checkpoint_every": args.checkpoint_every, "snapshot_every": args.snapshot_every,
        "init_rate": args.init_rate, "ckpt_rate": args.ckpt_rate, "ckpt_intervals": args.ckpt_intervals,
        "plus_rates": args.plus_rates, "jobs": args.jobs, "threads": args.threads, "runtime": args.runtime,
        "out": args.out,
    }
    if args.detection_time is not None:
        fields["detection"] = args.detection_time if args.detection_time in ("auto", "profile") else \
            float(args.detection_time)
    if args.storage_fallback is not None:
        fields["storage_fallback"] = args.storage_fallback == "yes"
    given = {k: v for k, v in fields.items() if v is not None}
    if args.quick:
        s = Settings.quick_settings(**given)
    elif args.recipe:
        from experiments.recipes import recipe

        s = recipe(args.recipe, **given)
    else:
        if "out" not in given:
            given["out"] = f"experiments/results/{given.get('preset', 'small')}"
        s = Settings(**given)
    _validate(s)
    return s


def _validate(s) -> None:
    from checkfree.costmodel import get_profile
    from experiments.spec import PAPER_MODELS

    get_profile(s.cost_profile)
    if s.paper_model not in PAPER_MODELS:
        raise ValueError(f"unknown paper model {s.paper_model!r}; choose one of {sorted(PAPER_MODELS)}")
    if s.steps < 2:
        raise ValueError(f"--steps must be >= 2, got {s.steps}")
    if not s.seeds:
        raise ValueError("--seeds: at least one seed")
    if any(r <= 0 or r >= 100 for r in s.rates):
        raise ValueError(f"--rates are hourly percentages in (0, 100), got {s.rates}")
    for r in s.rates:
        s.p(r)  # the paper model has a probability for it
    if s.rate_scale <= 0:
        raise ValueError(f"--rate-scale must be positive, got {s.rate_scale}")
    if not 0 < s.target_fraction <= 1:
        raise ValueError(f"--target-fraction must be in (0, 1], got {s.target_fraction}")
    if s.jobs < 1 or s.threads < 1:
        raise ValueError("--jobs and --threads must be >= 1")
    if s.eval_every < 1 or s.eval_every > s.target_fraction * s.steps:
        raise ValueError(f"--eval-every {s.eval_every} must be in 1..{int(s.target_fraction * s.steps)} so that the "
                         f"failure-free run is evaluated before the target step")
    if s.max_iter_factor < 1:
        raise ValueError(f"--max-iter-factor must be >= 1, got {s.max_iter_factor}")
    if not s.strategies:
        raise ValueError("--strategies: at least one strategy")


def run(args: argparse.Namespace) -> int:
    from experiments.suite import EXPERIMENTS, run_experiment

    settings = settings_from_args(args)
    experiments = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    argv = [a for a in sys.argv[1:] if a != "--report-only"]
    command = "checkfree " + " ".join(shlex.quote(a) for a in argv) if argv[:1] == ["experiment"] else ""
    if args.dry_run:
        from experiments.dryrun import dry_run

        return dry_run(experiments, settings, gpu=args.gpu, mfu=args.mfu)
    from checkfree.flags import interrupt_on_signals

    interrupt_on_signals()  # SIGTERM/SIGHUP end the runs like Ctrl-C: the pool's workers with them
    dirs = run_experiment(experiments, settings, progress=not args.no_progress, command=command,
                          report_only=args.report_only)
    for name, d in dirs.items():
        print(f"{name}: {d / 'table.md'}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from experiments.readme import DOCUMENTS, render_file

    paths, results = [Path(p) for p in (DOCUMENTS if args.readme == "all" else [args.readme])], Path(args.results)
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--readme {path}: no such file")
    if not results.is_dir():
        raise ValueError(f"--results {results}: no such directory")
    stale = 0
    for path in paths:
        changed = render_file(path, results, check=args.check)
        stale += len(changed)
        if args.check:
            print(f"{path}: {len(changed)} rendered region(s) differ from {results}" +
                  (": " + ", ".join(changed) if changed else ""))
        else:
            print(f"{path}: {len(changed)} region(s) rewritten" + (": " + ", ".join(changed) if changed else ""))
    return 1 if args.check and stale else 0

"""The swarm on the emulated geo-distributed network against the cost model's prediction of it.

For each configuration, `checkfree local --wan paper-geo` runs a failure-free swarm (stage i in region
i mod 5 of the paper-geo profile; checkfree.wan) and the same swarm on plain loopback, one after the other.
Read from the runs' metrics.jsonl: the median step time after `--warmup` steps, and per stage-to-stage
link the measured one-way delay of the activations and gradients (sender's clock to receiver's: one
machine) against the link's configured latency plus the message's serialization at its bandwidth. The
cost model (`checkfree.costmodel`, profile `costmodel.swarm_profile("paper-geo")`: the same links, this
machine's compute from the `local` calibration, one peer per stage) predicts the step time of the same
configuration; its terms are printed beside it.

    python -m benchmarks.wan            # small, and a wider model (d_model 512) whose links carry more bytes
    python -m benchmarks.wan --quick    # small only, fewer steps: a few minutes

The last line is `wan measured/predicted: X.XX` for the `small` preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from checkfree.config import config_from_dict
from checkfree.costmodel import CostModel
from checkfree.rundir import read_jsonl
from checkfree.wan import WanEmulator

CONFIGS = {
    "small": ["--preset", "small"],
    # 4x the width, 2x the microbatch: activations of 1 MiB per microbatch, so the 0.05 GiB/s link costs ~20 ms
    "wide": ["--preset", "small", "--d-model", "512", "--heads", "8", "--microbatch-size", "8"],
}


def run(name: str, extra: list[str], args, out: Path, wan: bool) -> dict:
    cmd = [sys.executable, "-m", "checkfree", "local", *CONFIGS[name], *extra, "--steps", str(args.steps + args.warmup),
           "--eval-every", "0", "--spares", "0", "--no-churn", "--transport", args.transport, "--out", str(out),
           "--no-progress", *(["--wan", args.wan] if wan else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    metrics = read_jsonl(out / "metrics.jsonl")[args.warmup:]
    delays: dict[tuple[int, int], list[float]] = {}
    for m in metrics:
        for dst, by_src in enumerate(m.get("hop_delay_s") or []):
            for src, d in (by_src or {}).items():
                delays.setdefault((int(src), dst), []).append(d)
    return {"step_s": statistics.median(m["step_time_s"] for m in metrics), "wire_bytes": metrics[-1]["wire_bytes"],
            "losses": [m["loss"] for m in metrics], "delays": {k: statistics.mean(v) for k, v in delays.items()},
            "cfg": config_from_dict(json.loads((out / "config.json").read_text()))}


def terms(cfg) -> tuple[CostModel, list[str]]:
    """The cost model of `cfg` on its emulated network, and a table of its terms."""
    cm = WanEmulator(cfg).model  # the model the swarm's emulated links are read from
    rows = ["| stage | forward s | backward s | link to next: latency ms | GiB/s | activation serialization ms |",
            "|---|---|---|---|---|---|"]
    for i in range(cm.S):
        f, b = cm.compute_s(i, 1.0), cm.compute_s(i, 2.0)
        if i + 1 < cm.S:
            lat, bw = cm.latency_s(i, i + 1), cm.bandwidth_Bps(i, i + 1)
            link = f"{lat * 1e3:.0f} | {bw / 2**30:g} | {cm.activation_bytes / bw * 1e3:.2f}"
        else:
            link = "- | - | -"
        rows.append(f"| {i} | {f:.4f} | {b:.4f} | {link} |")
    return cm, rows


def fitted_compute(cm: CostModel, loopback_s: float) -> CostModel:
    """`cm` with its compute rate set so that the same pipeline without the network's latency and bandwidth
    takes the measured loopback step: the network terms alone are then what the WAN prediction adds."""
    p = cm.profile
    flat = replace(p, latency_s=tuple(tuple(0.0 for _ in r) for r in p.latency_s),
                   bandwidth_Bps=tuple(tuple(float("inf") for _ in r) for r in p.bandwidth_Bps))
    lo, hi = p.flops_per_s / 100, p.flops_per_s * 100
    for _ in range(80):  # the step time falls as the rate rises
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if CostModel(cm.cfg, replace(flat, flops_per_s=mid)).step_s() > loopback_s else (lo, mid)
    return CostModel(cm.cfg, replace(p, flops_per_s=lo))


def report(name: str, wan: dict, loop: dict) -> float:
    cm, rows = terms(wan["cfg"])
    predicted = cm.step_s()
    fit = fitted_compute(cm, loop["step_s"])
    print(f"\n## {name}: M={cm.M}, S={cm.S}, activation {cm.activation_bytes / 2**10:.0f} KiB per microbatch")
    print("\n".join(rows))
    print(f"model: t_f {cm.t_f():.4f} s, t_b {cm.t_b():.4f} s, step {predicted:.3f} s")
    print("\n| link | configured one-way s (latency + serialization) | measured | measured - configured ms |")
    print("|---|---|---|---|")
    for (src, dst), d in sorted(wan["delays"].items()):
        lat, bw = cm.latency_s(src, dst), cm.bandwidth_Bps(src, dst)
        want = lat + cm.activation_bytes / bw
        print(f"| {src} -> {dst} | {want:.4f} | {d:.4f} | {(d - want) * 1e3:+.1f} |")
    same = max(abs(a - b) for a, b in zip(wan["losses"], loop["losses"]))
    print(f"\nstep s: WAN {wan['step_s']:.3f}, loopback {loop['step_s']:.3f}, predicted {predicted:.3f}; "
          f"{wan['wire_bytes'] / 2**20:.2f} MiB on the wire per step ({wan['cfg'].train.wire_dtype}); "
          f"largest loss difference WAN vs loopback {same:.2e}")
    print(f"with the compute rate fitted to the loopback run ({fit.profile.flops_per_s:.3g} FLOP/s against the local "
          f"profile's {cm.profile.flops_per_s:.3g}): predicted {fit.step_s():.3f} s, measured/predicted "
          f"{wan['step_s'] / fit.step_s():.2f} (the network terms alone)")
    ratio = wan["step_s"] / predicted
    print(f"{name}: wan measured/predicted: {ratio:.2f}")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small only, 6 steps")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 12, --quick 6)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--transport", default="hivemind", choices=("hivemind", "libp2p", "tcp"))
    p.add_argument("--wan", default="paper-geo")
    p.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    p.add_argument("--microbatches", type=int, default=None, help="M (default: the preset's)")
    p.add_argument("--wire-dtype", default="float32", help="activations/gradients on the wire (--wire-dtype)")
    p.add_argument("--configs", nargs="*", choices=list(CONFIGS), help="which configurations (default: all; "
                   "--quick: small); the last line needs small")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories here")
    args = p.parse_args()
    args.steps = args.steps or (6 if args.quick else 12)
    extra = ["--schedule", args.schedule, "--wire-dtype", args.wire_dtype] + (
        ["--microbatches", str(args.microbatches)] if args.microbatches else [])
    names = args.configs or (["small"] if args.quick else ["wide", "small"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        ratios = {}
        for name in names:
            wan = run(name, extra, args, root / f"{name}-wan", wan=True)
            loop = run(name, extra, args, root / f"{name}-loopback", wan=False)
            ratios[name] = report(name, wan, loop)
    if "small" in ratios:
        print(f"wan measured/predicted: {ratios['small']:.2f}")


if __name__ == "__main__":
    main()

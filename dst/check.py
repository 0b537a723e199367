"""The invariants checked after every schedule: the swarm's run against the simulator's, given the same faults.

Each check returns the divergences it found, one line each (empty: it holds):

* `same_end`: the same final status and, for an aborted run, the same reason;
* `same_losses`: the same steps (re-runs after a rollback included) with the same losses, to 1e-5 (1e-4 relative
  over a 16- or 8-bit wire: `NARROW_WIRE_LOSS_REL`);
* `same_recoveries`: the same recovery and fallback events: stage, method, sources, coefficients (1e-5; 1e-3
  relative over a 16- or 8-bit wire: `NARROW_WIRE_COEFFICIENTS_REL`),
  restored step, lost steps, fallback and its reason;
* `same_failures`: the same stage failures and lost replicas, by step and stage;
* `accounted`: every failure the swarm recorded stands for a fault that was injected there (none missing, none
  spurious), every failure has a recovery or a fallback, every killed rebuild a retry, every coordinator
  loss a takeover, every healed partition a retired peer;
* `identical_replicas`: the replicas of every stage group (and redundant computation's replicas) end bit-identical.

Leaks (tasks, threads, file descriptors, temporary files) are the harness's (`dst.swarm`) and `dst.run`'s.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch

from checkfree.rundir import read_jsonl
from dst.inject import Fired
from dst.schedule import Kind

__all__ = ["same_end", "same_losses", "same_recoveries", "same_failures", "recorded_lines", "accounted",
           "identical_replicas", "events"]

REL = ABS = 1e-5
# A wire of fewer bits than float32 rounds every activation and gradient that crosses a stage. Float addition is
# not associative, and a last-bit difference that flips one rounding on the wire is a step of the wire's precision in
# that element. A peer's backward passes accumulated into its gradients in the order they arrived (since issue 37 in
# microbatch order, as the simulator's: `StepRun.backward_turn`); a stage group's replicas still each sum their own
# microbatches and the all-reduce adds the sums, an association other than the simulator's. Two runs of one
# schedule differed in their gradient norms (in arrival order), hence in their recovery coefficients, by ~1e-4 (the
# seed-12 soak's schedule #236, bfloat16: 0.483955 to 0.484018 in 5 replays, the simulator 0.484004), while their
# losses, sums over every token of a step, stay within 1e-5. Their coefficients are compared to this tolerance.
NARROW_WIRE_COEFFICIENTS_REL = 1e-3
# The same noise reaches the losses, less (a loss sums every token of a step): in 20 replays of #236 over bfloat16
# they moved in the sixth digit, and once in the seed-41 soak (#974, int8, stage groups) a loss was 1.2e-5 off the
# simulator's (5 replays of it: none diverged, 3 distinct outcomes). Over a narrow wire losses compare to 1e-4.
NARROW_WIRE_LOSS_REL = 1e-4
RECOVERY_KEYS = ("event", "step", "stage", "method", "sources", "source", "fallback", "reason", "rollback_to",
                 "snapshot_step", "lost_steps", "edge_sources")


def events(out: Path, *kinds: str) -> list[dict]:
    path = out / "events.jsonl"
    return [e for e in read_jsonl(path) if e["event"] in kinds] if path.exists() else []


def _close(a: object, b: object, rel: float = REL) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=rel, abs_tol=ABS)
    return a == b


def same_end(swarm: dict | None, sim: dict | None) -> list[str]:
    if swarm is None or sim is None:
        return [f"no summary: swarm {swarm is not None}, simulator {sim is not None}"]
    out = []
    if swarm["status"] != sim["status"]:
        out.append(f"status: swarm {swarm['status']} ({swarm.get('error')}), simulator {sim['status']} "
                   f"({sim.get('error')})")
    elif swarm["status"] != "completed" and swarm.get("error") != sim.get("error"):
        out.append(f"abort reason: swarm {swarm.get('error')!r}, simulator {sim.get('error')!r}")
    return out


def same_losses(swarm_out: Path, sim_out: Path) -> list[str]:
    a, b = read_jsonl(swarm_out / "metrics.jsonl"), read_jsonl(sim_out / "metrics.jsonl")
    steps_a, steps_b = [m["step"] for m in a], [m["step"] for m in b]
    if steps_a != steps_b:
        return [f"steps recorded: swarm {steps_a}, simulator {steps_b}"]
    out, rel = [], REL if _wire_dtype(swarm_out) == "float32" else NARROW_WIRE_LOSS_REL
    for i, (x, y) in enumerate(zip(a, b)):
        for key in ("loss", "val_loss"):
            if key in y and not _close(_num(x.get(key)), _num(y[key]), rel):
                out.append(f"{key} of step {x['step']} (line {i}): swarm {x.get(key)}, simulator {y[key]}")
    return out


def _num(v: object) -> object:
    return float(v) if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf") else v


def _recovery_key(e: dict) -> tuple:
    key = {k: e.get(k) for k in RECOVERY_KEYS}
    if e.get("strategy") == "reft" and key["source"] == "companion":  # the lost member's own copy, which survived it
        key["source"] = "parity"  # (a partition in-process): the same bytes parity decodes; the simulator has no companion
    return tuple(key.values())


def same_recoveries(swarm_out: Path, sim_out: Path) -> list[str]:
    a = events(swarm_out, "recovery", "fallback")
    b = events(sim_out, "recovery", "fallback")
    ka, kb = [_recovery_key(e) for e in a], [_recovery_key(e) for e in b]
    if ka != kb:
        show = lambda ks: "; ".join(", ".join(f"{f}={v}" for f, v in zip(RECOVERY_KEYS, k) if v is not None) for k in ks)
        return [f"recovery events: swarm [{show(ka)}], simulator [{show(kb)}]"]
    out, rel = [], REL if _wire_dtype(swarm_out) == "float32" else NARROW_WIRE_COEFFICIENTS_REL
    for x, y in zip(a, b):
        ca, cb = x.get("coefficients") or [], y.get("coefficients") or []
        if len(ca) != len(cb) or not all(_close(p, q, rel) for p, q in zip(ca, cb)):
            out.append(f"coefficients of the recovery of stage {x['stage']} at step {x['step']}: swarm {ca}, "
                       f"simulator {cb}")
    return out


def _wire_dtype(out: Path) -> str:
    """The run's wire dtype (from its config.json; float32 if it has none)."""
    path = out / "config.json"
    return json.loads(path.read_text())["train"].get("wire_dtype", "float32") if path.exists() else "float32"


def same_failures(swarm_out: Path, sim_out: Path) -> list[str]:
    out = []
    for kind in ("failure", "replica_lost"):
        a = Counter((e["step"], e["stage"]) for e in events(swarm_out, kind))
        b = Counter((e["step"], e["stage"]) for e in events(sim_out, kind))
        if a != b:
            out.append(f"{kind} events (step, stage): swarm {sorted(a.elements())}, simulator {sorted(b.elements())}")
    return out


def recorded_lines(swarm_out: Path, iteration_at, replicas: int) -> list[tuple[int, int, bool, str]]:
    """The failures the swarm recorded, as simulator trace lines with the peer each was: (iteration, stage, whole
    group, peer). A failure of a stage group is the whole group's; a lost replica is one."""
    lines = [(iteration_at(e["time"]), e["stage"], replicas > 1, e.get("peer_id") or "")
             for e in events(swarm_out, "failure")]
    lines += [(iteration_at(e["time"]), e["stage"], False, e["peer_id"]) for e in events(swarm_out, "replica_lost")]
    return sorted(lines)


def accounted(swarm_out: Path, fired: list[Fired], recorded: list[tuple[int, int, bool, str]],
              expected: list[tuple[int, int, bool]]) -> list[str]:
    """Every recorded failure stands for an injected fault and the other way round; the events each fault must
    leave are there."""
    out = []
    got = sorted((it, s, w) for it, s, w, _ in recorded)
    if got != sorted(expected):
        out.append(f"failures recorded (iteration, stage, whole group) {got}, but the faults injected stand for "
                   f"{sorted(expected)}")
    handled = {(e["step"], e["stage"]) for e in events(swarm_out, "recovery", "fallback")}
    aborted = {e["step"] for e in events(swarm_out, "fallback") if e.get("fallback") == "abort"}  # (one for all)
    failures = events(swarm_out, "failure")
    summary = swarm_out / "summary.json"
    if failures and summary.exists() and json.loads(summary.read_text()).get("status") == "aborted":
        # the abort accounts for the failures it ended the run at, also one no plan was made for (every stage
        # lost at once: nothing to recover from, no fallback event, in either runtime)
        aborted.add(max(e["step"] for e in failures))
    for e in failures:
        if (e["step"], e["stage"]) not in handled and e["step"] not in aborted:
            out.append(f"failure of stage {e['stage']} at step {e['step']} has no recovery or fallback")
    retried = {e.get("peer_id") for e in events(swarm_out, "recovery_retry")}
    takeovers = len(events(swarm_out, "coordinator_takeover"))
    retired = {e.get("peer_id") for e in events(swarm_out, "retired")}
    for f in fired:
        if f.fault.kind is Kind.KILL_MID_REBUILD and f.mode != "replica" and f.victims[0] not in retried:
            out.append(f"{f.describe()}: no recovery_retry for the killed replacement")  # (a replica's join: none)
        # (a run that aborted before the partition healed ended while the peer was cut off: it cannot be told; an
        # abort at step st is at iteration st or later, so one before the healing iteration is at a step before it)
        cut_off_to_the_end = any(st < f.iteration + f.fault.span for st in aborted)
        if f.fault.kind is Kind.PARTITION and f.victims[0] not in retired and not cut_off_to_the_end:
            out.append(f"{f.describe()}: the partitioned peer was never retired")
    victims = {v for f in fired for v in f.victims}
    for pid in sorted(retired - victims):
        out.append(f"peer {pid} was retired, but no fault touched it (a healthy peer lost)")
    coordinator_losses = sum(f.fault.kind in (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART) for f in fired)
    if takeovers != coordinator_losses:
        out.append(f"{coordinator_losses} coordinator(s) lost but {takeovers} takeover(s) recorded")
    return out


def _state(daemon) -> dict[str, torch.Tensor]:
    worker = daemon.hosted.worker
    opt = {f"optim/{n}/{k}": v for n, st in worker.optimizer_state().items() for k, v in st.items()
           if isinstance(v, torch.Tensor)}
    return {**worker.state_dict(), **opt}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys {sorted(set(a) ^ set(b))[:4]}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def identical_replicas(daemons: dict, live: set[str], strategy: str) -> list[str]:
    """Every stage group's live replicas hold the same weights and Adam state, bit for bit; under redundant
    computation every replica equals the stage it copies."""
    serving: dict[int, list] = {}
    for pid, d in daemons.items():
        if pid in live and d.hosted.worker is not None:
            serving.setdefault(d.hosted.index, []).append((pid, d))
    out = []
    for stage, group in sorted(serving.items()):
        first = _state(group[0][1])
        for pid, d in group[1:]:
            bad = _differ(first, _state(d))
            if bad:
                out.append(f"stage {stage}: replicas {group[0][0]} and {pid} differ in {bad[:4]}")
    if strategy == "redundant" and all(len(g) == 1 for g in serving.values()):
        for stage, [(pid, d)] in serving.items():
            replica = d.replicas.replica
            if replica is None or replica.index not in serving:
                continue
            want = serving[replica.index][0][1].hosted.worker
            bad = [k for k, v in want.state_dict().items() if not torch.equal(v, replica.state_dict()[k])]
            if bad:
                out.append(f"stage {stage}'s replica of stage {replica.index} differs from it in {bad[:4]}")
    return out

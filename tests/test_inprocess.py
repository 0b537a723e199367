"""The in-process tier (harness/inprocess.py): the real coordinator and peer daemons in one event loop over the
memory network, faults from outside (faults.injector). Each test compares the swarm's run directory
with the simulator's for the same config and failures, in seconds instead of the subprocess tests' minutes."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from checkfree.abft import FaultInjector
from checkfree.failures import FailureSchedule
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator
from harness.inprocess import run_swarm

pytestmark = pytest.mark.timeout(240)


def _cfg(tiny_cfg, strategy: str, steps: int = 6):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy = strategy
    cfg.train.num_steps, cfg.train.eval_every = steps, 3
    return cfg


def _simulate(cfg, out, failures: list[tuple[int, int]]):
    cfg = copy.deepcopy(cfg)
    if failures:
        trace = out.parent / f"{out.name}-trace.csv"
        trace.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in failures))
        cfg.failures.trace = str(trace)
    return Simulator(cfg, out, progress=False).run()


def _events(out, *kinds):
    return [e for e in read_jsonl(out / "events.jsonl") if e["event"] in kinds]


def _same_losses(a, b):
    ma, mb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5), (x["step"], x["loss"], y["loss"])
        if "val_loss" in y:
            assert x["val_loss"] == pytest.approx(y["val_loss"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["checkfree", "checkfree+"])
def test_swarm_in_one_process_equals_the_simulator_through_a_kill(tiny_cfg, tmp_path, strategy):
    """A kill of an intermediate stage (and, under CheckFree+, of the last stage) at step 3: the swarm
    rebuilds it with the same coefficients and goes on with the simulator's losses."""
    cfg = _cfg(tiny_cfg, strategy)
    failures = [(3, 1)] + ([(4, cfg.num_stages - 1)] if strategy == "checkfree+" else [])
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 2, kills=FailureSchedule(failures),
                      save_final=False)
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    assert [(f["step"], f["stage"]) for _, f in swarm.killed] == failures
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    got, want = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    assert [(e["step"], e["stage"]) for e in got] == [(e["step"], e["stage"]) for e in want] == failures
    for g, w in zip(got, want):
        assert g.get("coefficients") == pytest.approx(w.get("coefficients"), rel=1e-5)


def test_omega_over_the_blocks_only_in_one_process_equals_the_simulator(tiny_cfg, tmp_path):
    """--omega-scope blocks: stage 1's replacement averages stages 0 and 2 by their blocks' gradient norms (stage
    0's embedding excluded), in the swarm exactly as in the simulator; the metrics carry both norms (the in-process
    form of test_swarm's real-process test, which is `slow`)."""
    cfg = _cfg(tiny_cfg, "checkfree")
    cfg.train.eval_every = 0
    cfg.recovery.omega_scope = "blocks"
    failures = [(4, 1)]
    run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 1, kills=FailureSchedule(failures), save_final=False)
    _simulate(cfg, tmp_path / "sim", failures)
    swarm, sim = read_jsonl(tmp_path / "swarm" / "metrics.jsonl"), read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    (rec,), (sim_rec,) = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    omega_over_blocks_alike(swarm, sim, rec, sim_rec)


def omega_over_blocks_alike(swarm: list[dict], sim: list[dict], rec: dict, sim_rec: dict) -> None:
    """Stage 1 rebuilt at step 4 with --omega-scope blocks, in a swarm (its metrics and recovery event) as in the
    simulator: the norms of stages 0 and 2's blocks (stage 0's embedding excluded), the same coefficients and
    losses (test_swarm's real-process test checks its run with this too)."""
    assert rec["omega_scope"] == sim_rec["omega_scope"] == "blocks"
    blocks, whole = swarm[3]["block_grad_norms"], swarm[3]["grad_norms"]  # the last step before the failure
    assert rec["norms"] == pytest.approx([blocks[0], blocks[2]], rel=1e-5)
    assert blocks[0] < whole[0]  # stage 0's whole-stage norm includes its embedding
    assert rec["coefficients"] == pytest.approx(sim_rec["coefficients"], rel=1e-4)
    assert [m["loss"] for m in swarm] == pytest.approx([m["loss"] for m in sim], rel=1e-4)
    assert sum((m["block_grad_norms"] for m in swarm), []) == pytest.approx(
        sum((m["block_grad_norms"] for m in sim), []), rel=1e-3)


def test_an_int8_wire_in_one_process_equals_the_simulator_at_a_quarter_of_the_bytes(tiny_cfg, tmp_path):
    """--wire-dtype int8: peers send int8 activations and gradients with row scales (checkfree.wirecodec), the
    simulator applies the same round trip at each stage boundary, so both give the same losses; a step moves about
    a quarter of a float32 step's bytes (the in-process form of test_swarm's real-process test, which is `slow`)."""
    cfg = _cfg(tiny_cfg, "checkfree", steps=4)
    cfg.train.eval_every = 0
    cfg.train.wire_dtype = "int8"
    run_swarm(cfg, tmp_path / "int8", peers=cfg.num_stages, save_final=False)
    _simulate(cfg, tmp_path / "sim", [])
    _same_losses(tmp_path / "int8", tmp_path / "sim")
    f32 = copy.deepcopy(cfg)
    f32.train.wire_dtype, f32.train.num_steps = "float32", 1
    run_swarm(f32, tmp_path / "f32", peers=cfg.num_stages, save_final=False)
    ratio = (read_jsonl(tmp_path / "int8" / "metrics.jsonl")[0]["wire_bytes"]
             / read_jsonl(tmp_path / "f32" / "metrics.jsonl")[0]["wire_bytes"])
    assert 0.2 < ratio < 0.35, ratio


@pytest.mark.parametrize("fault", ["recovery_kills", "rebuild_kills"])
def test_a_replacement_lost_during_its_rebuild_is_replaced_by_the_next_standby(tiny_cfg, tmp_path, fault):
    """Faults from outside (faults.injector, around the coordinator's transport): the standby chosen to rebuild
    stage 1 at step 3 is killed as its ASSIGN leaves (recovery_kills) or SIGKILLs itself after its first weight
    pull (rebuild_kills: its fault hook armed as the ASSIGN leaves); the next standby rebuilds the stage and the
    run keeps the simulator's losses."""
    cfg = _cfg(tiny_cfg, "checkfree")
    failures = [(3, 1)]
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 3, kills=FailureSchedule(failures),
                      save_final=False, **{fault: frozenset({3})})
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    (retry,) = _events(tmp_path / "swarm", "recovery_retry")
    (recovery,) = _events(tmp_path / "swarm", "recovery")
    assert (retry["step"], retry["stage"]) == (recovery["step"], recovery["stage"]) == (3, 1)
    assert retry["peer_id"] in [str(f["peer"]) for _, f in swarm.killed] and recovery["peer_id"] != retry["peer_id"]


def test_peers_armed_through_their_fault_hooks_die_mid_forward_mid_backward_and_mid_commit(tiny_cfg, tmp_path):
    """--chaos-peer-kill: the injector arms a peer through its fault hook's control channel (checkfree.peer_faults;
    no request carries a field for it) as the RUN_STEP (or COMMIT) that reaches it leaves. Stage 1's peer dies at
    its second forward pass of iteration 2, stage 2's at its first backward pass of iteration 3, stage 1's new peer
    as it takes the COMMIT of iteration 4 (the other stages commit: the stage is lost for step 5). The swarm
    recovers each and keeps the simulator's losses."""
    from faults.injector import PeerKill

    cfg = _cfg(tiny_cfg, "checkfree", steps=7)
    kills = (PeerKill("forward", 2, 1, mb=1), PeerKill("backward", 3, 2), PeerKill("commit", 4, 1))
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 3, peer_kills=kills, save_final=False)
    failures = [(2, 1), (3, 2), (5, 1)]
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    assert [f["why"].split(" (")[0] for _, f in swarm.killed] == [
        "peer after its forward pass 2 of step 2", "peer after its backward pass 1 of step 3",
        "peer as it takes the COMMIT of step 4"]
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    assert [(e["step"], e["stage"]) for e in _events(tmp_path / "swarm", "recovery")] == failures
    assert [e["during"] for e in _events(tmp_path / "swarm", "chaos_kill")] == ["forward", "backward", "commit"]


@pytest.mark.parametrize("strategy, fallback, failures", [
    ("identity", "abort", [(3, 1), (3, 2), (4, 1)]),  # adjacent losses too: identity reads no neighbour
    ("checkfree", "identity", [(3, 1), (3, 2)]),  # adjacent losses plain CheckFree cannot average
])
def test_identity_recovery_in_one_process_equals_the_simulator(tiny_cfg, tmp_path, strategy, fallback, failures):
    """Layer drop, as a strategy and as a fallback: the swarm rebuilds the lost stages as pass-throughs (the
    rebuilt blocks' residual output projections zero) and goes on with the simulator's losses and events."""
    cfg = _cfg(tiny_cfg, strategy)
    cfg.recovery.fallback = fallback
    dump = tmp_path / "dump"
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 3, kills=FailureSchedule(failures),
                      dump_dir=str(dump), save_final=False)
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    fields = ("event", "step", "stage", "method", "sources", "fallback", "coefficients", "edges_reinit")
    got, want = ([tuple(e.get(k) for k in fields) for e in _events(out, "recovery", "fallback")]
                 for out in (tmp_path / "swarm", tmp_path / "sim"))
    assert got == want and [(e[1], e[2], e[3]) for e in got] == [(s, st, "identity") for s, st in failures]
    for step, stage in failures:
        rebuilt = load_file(str(dump / f"rebuilt-step{step}-stage{stage}.safetensors"))
        outputs = [v for k, v in rebuilt.items() if k.endswith(("attn.wo.weight", "mlp.w2.weight"))]
        assert len(outputs) == 2 * cfg.model.num_layers // cfg.num_stages and not any(v.any() for v in outputs)


@pytest.mark.parametrize("strategy", ["gemini", "checkpoint"])
def test_rollback_in_one_process_restores_what_the_simulator_does(tiny_cfg, tmp_path, strategy):
    """A kill at step 5 rolls every stage back (gemini: to the snapshot of step 4 held in another peer's
    memory; checkpoint: to the file of step 4): the swarm reports the simulator's rollback, re-runs the lost
    steps and keeps the simulator's losses, the re-run steps included."""
    cfg = _cfg(tiny_cfg, strategy, steps=7)
    cfg.strategy.snapshot_every = cfg.strategy.checkpoint_every = 2
    failures = [(5, 2)]
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 2, kills=FailureSchedule(failures),
                      save_final=False)
    sim = _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    # the measured costs in summary.json, under the simulator's names
    assert swarm.summary["lost_steps"] == sim["lost_steps"] == 1
    assert swarm.summary["bytes_moved"] > 0 and swarm.summary["stall_s"] > 0 and swarm.summary["recovery_s"] > 0
    assert (swarm.summary["extra_memory_bytes"] > 0) == (strategy == "gemini")  # checkpoint: files, not memory
    got, want = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    fields = ("step", "stage", "method", "rollback_to", "lost_steps")
    assert [tuple(e[k] for k in fields) for e in got] == [tuple(e[k] for k in fields) for e in want] \
        == [(5, 2, "rollback", 4, 1)]


def test_uncorrectable_soft_errors_in_the_swarm_redo_the_attempt_then_recover_the_stage(tiny_cfg, tmp_path,
                                                                                    monkeypatch):
    """The swarm's soft-error path (which the subprocess tests never reach: it needs faults a guard cannot
    correct at a chosen stage). The peer of stage 1 puts two faults into one section of every attention call
    (the guard corrects one per section): the attempt fails after the peer's recompute
    (soft_error_skip), the redone attempt too, and the second in a row treats stage 1 as failed
    (soft_error_escalation, checkfree.steprules): it is rebuilt by CheckFree and step 0 then runs; the swarm
    redoes attempts where the simulator skips steps, so no step is lost."""
    import peers.stage
    from checkfree.abft import AttentionGuard

    faulty = FaultInjector.from_schedule([(c, "q", "nan", r, 0) for c in range(64) for r in (0, 5)])
    original, served = peers.stage.make_guard, []

    def make_guard(cfg, stage):  # the first peer to serve stage 1 has the faulty hardware, its replacement not
        if stage == 1 and not served:
            served.append(stage)
            return AttentionGuard(mode="range", injector=faulty)
        return original(cfg, stage)

    monkeypatch.setattr(peers.stage, "make_guard", make_guard)
    cfg = _cfg(tiny_cfg, "checkfree", steps=3)
    cfg.guard.abft = True
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 2, save_final=False)
    assert swarm.summary["status"] == "completed"
    kinds = [(e["event"], e["step"]) for e in _events(tmp_path / "swarm", "soft_error_skip", "soft_error_escalation",
                                                        "recovery")]
    assert kinds == [("soft_error_skip", 0), ("soft_error_skip", 0), ("soft_error_escalation", 0), ("recovery", 0)]
    assert _events(tmp_path / "swarm", "recovery")[0]["stage"] == 1
    assert faulty.injected >= 8 and swarm.summary["soft_errors"]["escalated"] >= 4  # the replaced peer's too
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2] and all(isinstance(m["loss"], float) for m in metrics)
    assert metrics[0]["attempts"] == 3


def test_checkfree_plus_snap_restores_a_lone_stage_exactly_from_its_neighbours_snapshot(tiny_cfg, tmp_path):
    """checkfree+snap in the swarm: every 2 steps each stage's snapshot travels into the next stage's peer. A
    lone kill of stage 1 at step 5 restores stage 1 from stage 2's copy of the step-4 snapshot, bit for bit
    (its embedding and that one's Adam state from stage 0, the live co-holder); nobody rolls back. The kill of
    stage 2 at step 6 restores stage 2 from stage 3's copy of the step-6 snapshot, and takes stage 1's snapshot
    (held by stage 2's peer) with it, so the kill of stage 1 at step 7 is averaged. Same decisions, events and
    losses as the simulator."""
    from checkfree.serialize import state_from_bytes

    cfg = _cfg(tiny_cfg, "checkfree+snap", steps=8)
    cfg.strategy.snapshot_every = 2
    failures = [(5, 1), (6, 2), (7, 1)]
    held: dict[int, bytes] = {}

    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 4, kills=FailureSchedule(failures),
                      save_final=False, dump_dir=str(tmp_path / "dump"), on_kill=lambda sw, f: held.update(
                          {s: b for d in sw.daemons.values() for s, (_, b) in d.snapshots.held.items()
                           if d.hosted.index == s + 1 and f["step"] == 5}))
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    fields = ("step", "stage", "method", "source", "snapshot_step", "lost_steps")
    got, want = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    assert [tuple(e.get(k) for k in fields) for e in got] == [tuple(e.get(k) for k in fields) for e in want]
    assert [(e["step"], e["stage"], e["method"]) for e in got] == [(5, 1, "snapshot"), (6, 2, "snapshot"),
                                                                  (7, 1, "average")]
    snap = state_from_bytes(held[1])["model"]  # stage 1's snapshot of step 4, as stage 2's peer held it
    restored = load_file(str(tmp_path / "dump" / "restored-step5-stage1.safetensors"))
    assert restored.keys() == snap.keys()
    for k, v in snap.items():
        if not k.startswith("embed."):  # the embedding comes from stage 0, the live co-holder
            assert torch.equal(restored[k], v), k


def test_snap_streams_compressed_copies_and_restores_like_the_simulator_when_a_stage_and_then_its_holder_are_lost(
        tiny_cfg, tmp_path):
    """snap in the swarm: every stage streams its int8 copy to the next stage's peer, one part inside each step
    (COPY_PART, acknowledged in the sender's COMMIT). Stage 1 is lost at step 3 and restored from its copy of step
    2 (a whole copy in steps 0-1, a delta in step 2); its holder, stage 2, is lost at step 5 and restored from its
    own copy of step 4, taking stage 1's copy with it; stage 1, lost again at step 6 before a new whole copy
    arrived, is rebuilt by CheckFree: the simulator's decisions, copy steps and losses, and the restored weights
    are the decoded copy the holder kept, bit for bit."""
    from checkfree.serialize import state_from_bytes
    from checkfree.snapcodec import apply_update, restore_state

    cfg = _cfg(tiny_cfg, "snap", steps=8)
    cfg.strategy.snapshot_every = 2
    failures = [(3, 1), (5, 2), (6, 1)]
    held = {}

    def keep(sw, f):  # stage 1's copy as its holder (stage 2's peer) has it, as stage 1 is killed at step 3:
        if f["step"] == 3:  # the copy of step 0 and the complete delta of step 2, applied when asked for
            [d] = [d for d in sw.daemons.values() if d.hosted.index == 2]
            held[1] = apply_update(copy.deepcopy(d.streams.held[1]), state_from_bytes(d.streams.incoming[1].buf))

    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 4, kills=FailureSchedule(failures),
                      save_final=False, dump_dir=str(tmp_path / "dump"), on_kill=keep)
    _simulate(cfg, tmp_path / "sim", failures)
    assert swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    fields = ("step", "stage", "method", "source", "snapshot_step", "copy_format", "fallback")
    got = _events(tmp_path / "swarm", "recovery", "fallback")
    want = _events(tmp_path / "sim", "recovery", "fallback")
    assert [tuple(e.get(k) for k in fields) for e in got] == [tuple(e.get(k) for k in fields) for e in want] == [
        (3, 1, "snapshot", 2, 2, "int8", None), (5, 2, "snapshot", 3, 4, "int8", None),
        (6, 1, "average", None, None, None, "checkfree")]
    assert held[1].step == 2
    restored = load_file(str(tmp_path / "dump" / "restored-step3-stage1.safetensors"))
    decoded = restore_state(held[1])["model"]
    assert restored.keys() == decoded.keys() and all(torch.equal(restored[k], v) for k, v in decoded.items())
    streamed = [e for e in _events(tmp_path / "swarm", "snapshot") if e["kind"] == "stream"]
    assert {(e["stage"], e["step"]) for e in streamed} >= {(s, 0) for s in range(cfg.num_stages)}
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert all(0 < b for m in metrics for b in m["copy_bytes"] if b is not None)


def test_the_swarm_runs_every_strategy_and_refuses_a_bad_combination_before_any_peer_starts(tiny_cfg, tmp_path):
    """Every strategy with every fallback (each a plan the coordinator carries out, checkfree.plans); stage groups
    only with a strategy that keeps no copies of a stage's peer."""
    from checkfree.strategies import STRATEGIES
    from coordinator.common import CoordinatorOptions
    from coordinator.coordinator import Coordinator

    for name in STRATEGIES:
        for fallback in ("abort", "random", "copy"):
            cfg = _cfg(tiny_cfg, name)
            cfg.recovery.fallback = fallback
            Coordinator(cfg, CoordinatorOptions(out=str(tmp_path / name)))
    cfg = _cfg(tiny_cfg, "gemini")
    cfg.train.replicas = 2
    with pytest.raises(ValueError, match="gemini keeps one peer per stage"):
        Coordinator(cfg, CoordinatorOptions(out=str(tmp_path / "bad")))


def test_redundant_computation_promotes_replicas_and_loses_nothing(tiny_cfg, tmp_path):
    """Bamboo in the swarm: each peer holds its ring successor's replica (taken at the start, kept current by
    the successor's gradients at every commit) and runs its forward redundantly. Three non-adjacent kills
    (stages 1, 3, then 0, whose replica the last stage holds) are each repaired by promoting the replica: no
    step is lost and the losses are those of the failure-free swarm run and of the simulator, whose events
    (promoted stage, holder, lost steps) the swarm repeats."""
    cfg = _cfg(tiny_cfg, "redundant", steps=8)
    failures = [(2, 1), (4, 3), (6, 0)]
    clean = run_swarm(cfg, tmp_path / "clean", peers=cfg.num_stages, save_final=False)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 3, kills=FailureSchedule(failures),
                      save_final=False)
    _simulate(cfg, tmp_path / "sim", failures)
    assert clean.summary["status"] == swarm.summary["status"] == "completed"
    _same_losses(tmp_path / "swarm", tmp_path / "clean")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    fields = ("step", "stage", "method", "source", "lost_steps")
    got, want = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    assert [tuple(e.get(k) for k in fields) for e in got] == [tuple(e.get(k) for k in fields) for e in want] == [
        (2, 1, "promote-replica", 0, 0), (4, 3, "promote-replica", 2, 0), (6, 0, "promote-replica", 3, 0)]
    assert swarm.summary["lost_steps"] == 0 and swarm.summary["stall_s"] > 0
    assert swarm.summary["extra_memory_bytes"] > 0 and swarm.summary["bytes_moved"] > 0
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert all(m["attempts"] == 1 for m in metrics)  # the kills land between steps: nothing aborted
    assert all(r > 0 for m in metrics for r in m["redundant_s"])  # every peer forwarded its replica, every step
    assert all(b > 0 for m in metrics for b in m["replica_bytes"])
    serving = {d.hosted.index: d for d in swarm.daemons.values()
               if d.hosted.worker is not None and d.membership.transport.peer_id not in [f["peer"] for _, f in swarm.killed]}
    assert sorted(serving) == list(range(cfg.num_stages))
    for s, d in serving.items():  # after the last commit, every replica equals its stage bit for bit, Adam included
        succ = serving[(s + 1) % cfg.num_stages].hosted.worker
        replica = d.replicas.replica
        assert replica.index == succ.index
        for (n, a), (_, b) in zip(replica.module.state_dict().items(), succ.module.state_dict().items()):
            assert torch.equal(a, b), (s, n)
        for n, st in succ.optimizer_state().items():
            assert all(torch.equal(v, replica.optimizer_state()[n][k]) for k, v in st.items()), (s, n)

def _rolls_back_like_the_simulator_to_the_failure_free_losses(cfg, tmp_path, failures):
    """Run a rollback strategy's swarm with `failures`, a failure-free swarm and the simulator: the swarm makes the
    simulator's rollbacks (targets, lost steps), keeps its losses, and ends each step with the failure-free loss.
    Returns (swarm, simulator summary, the swarm's recovery events)."""
    clean = run_swarm(cfg, tmp_path / "clean", peers=cfg.num_stages, save_final=False)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 3, kills=FailureSchedule(failures),
                      save_final=False)
    sim = _simulate(cfg, tmp_path / "sim", failures)
    assert clean.summary["status"] == swarm.summary["status"] == "completed"
    fields = ("step", "stage", "method", "rollback_to", "lost_steps")
    got, want = _events(tmp_path / "swarm", "recovery"), _events(tmp_path / "sim", "recovery")
    assert [tuple(e.get(k) for k in fields) for e in got] == [tuple(e.get(k) for k in fields) for e in want]
    assert swarm.summary["lost_steps"] == sim["lost_steps"] > 0
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    final = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / "swarm" / "metrics.jsonl")}
    assert [final[s] for s in range(cfg.train.num_steps)] == pytest.approx(
        [m["loss"] for m in read_jsonl(tmp_path / "clean" / "metrics.jsonl")], rel=1e-5)
    return swarm, sim, got



def test_baft_sends_backups_in_the_bubbles_and_rolls_back_like_the_simulator(tiny_cfg, tmp_path):
    """BAFT in the swarm: every stage's backup, taken after a step, travels to its holder part by part in the
    bubbles of the next steps (peers wait for their compute thread to go idle in the step) and counts once every
    part arrived. Three non-adjacent kills roll every stage back to the last complete backup: the same rollback
    targets and lost steps as the simulator, and in the end the losses of the failure-free run."""
    cfg = _cfg(tiny_cfg, "baft", steps=10)
    failures = [(3, 1), (6, 3), (8, 0)]
    swarm, sim, got = _rolls_back_like_the_simulator_to_the_failure_free_losses(cfg, tmp_path, failures)
    assert [e["stage"] for e in got] == [1, 3, 0]
    snapshots = _events(tmp_path / "swarm", "snapshot")
    assert snapshots and all(e["kind"] in ("backup", "memory") and e["complete"] for e in snapshots)
    # after each rollback every stage gives its holder its backup anew (the lost peers held some): at the target
    assert [e["step"] for e in snapshots if e["kind"] == "memory"] == [e["rollback_to"] for e in got]
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert sum(n or 0 for m in metrics for n in m.get("backup_bytes", [])) > 0


@pytest.mark.processes  # ReFT's companion processes are real ones
def test_reft_decodes_a_lost_member_from_its_groups_parity_and_rolls_back_like_the_simulator(tiny_cfg, tmp_path):
    """REFT in the swarm: every 2 steps each stage keeps its snapshot and sends one chunk to every other member of
    its parity group, which XORs them into its parity block. Three kills, one at a time: each lost member's snapshot
    is decoded bit for bit from the survivors' snapshots and parity blocks (the replacement rebuilds its own
    block, so the group is whole for the next loss), every stage rolls back to the snapshot: the simulator's
    rollbacks and lost steps, and in the end the losses of the failure-free run."""
    cfg = _cfg(tiny_cfg, "reft", steps=10)
    cfg.strategy.snapshot_every = 2
    # the second kill comes before the next snapshot: stage 2 is decoded with the parity block that stage 1's
    # replacement rebuilt
    failures = [(3, 1), (4, 2), (8, 0)]
    swarm, sim, got = _rolls_back_like_the_simulator_to_the_failure_free_losses(cfg, tmp_path, failures)
    assert [e["stage"] for e in got] == [1, 2, 0] and all(e["source"] == "parity" for e in got)
    assert [e["rollback_to"] for e in got][:2] == [2, 2]  # no snapshot between the first two kills


def test_reft_companion_keeps_its_peers_snapshot_for_members_only_from_its_peer():
    """The snapshot companion (a real process): its peer stores a snapshot and parity block, a run member fetches
    them byte for byte, a stranger holding the secret cannot overwrite them, a wrong step is refused, and the
    peer's stop ends the process."""
    import asyncio

    from checkfree.net.tcp_transport import RemoteError, TcpTransport
    from checkfree.messages import CompanionStop, CompanionStore
    from peers.companion import companion_id, fetch_snapshot, start_companion

    secret = b"0123456789abcdef-secret"
    proc, addr = start_companion("QmPeer", "127.0.0.1", linger=1.0, secret=secret)
    blob, parity = bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 10
    header = {"step": 4, "stage": 1, "holder": 1, "n": 4, "lengths": [10240, 10240, 10240, 10240]}

    async def main() -> None:
        peer, stranger = TcpTransport("QmPeer", secret=secret), TcpTransport("QmOther", secret=secret)
        for t in (peer, stranger):
            t.add_peer_address(addr)
        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (blob, parity)]
        try:
            await peer.call(companion_id("QmPeer"), CompanionStore.rpc, header, tensors, timeout=10)
            with pytest.raises(RemoteError, match="only peer QmPeer stores"):
                await stranger.call(companion_id("QmPeer"), CompanionStore.rpc, header, tensors[::-1], timeout=10)
            meta, got_blob, got_parity = await fetch_snapshot("QmOther", addr, 4, secret, 10)
            assert (meta.stage, got_blob, got_parity) == (1, blob, parity)
            with pytest.raises(RemoteError, match="no snapshot of step 2"):
                await fetch_snapshot("QmOther", addr, 2, secret, 10)
            await peer.call(companion_id("QmPeer"), CompanionStop.rpc, {}, timeout=10)
        finally:
            await peer.shutdown()
            await stranger.shutdown()

    try:
        asyncio.run(main())
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_baft_spreads_a_backup_over_several_steps_when_the_bubbles_are_short(tiny_cfg, tmp_path, monkeypatch):
    """When the plan needs 3 steps' bubbles for a backup (forced here: the tiny model's backup fits one step),
    each step carries a third of every stage's backup, a backup counts only after its third part arrived, and the
    swarm still makes the simulator's rollbacks and ends with the failure-free losses."""
    from checkfree.strategies import baft

    size_backups = baft.size_backups
    monkeypatch.setattr(baft, "size_backups", lambda *args: dataclasses.replace(size_backups(*args), rounds=3))
    monkeypatch.setattr(baft.BackupSizing, "part_bounds", lambda self, stage, part: (part / 3, (part + 1) / 3))
    cfg = _cfg(tiny_cfg, "baft", steps=12)
    swarm, sim, got = _rolls_back_like_the_simulator_to_the_failure_free_losses(cfg, tmp_path, [(6, 1), (11, 2)])
    # the backup as of step 1 completes after step 3; the one as of step 4 is cut short by the kill at iteration 6
    # (rollback to 1); re-run from 1, the backup as of 2 completes after step 4, the next is cut short again
    assert [e["rollback_to"] for e in got] == [1, 2]
    backups = [e for e in _events(tmp_path / "swarm", "snapshot") if e["kind"] == "backup"]
    assert [e["step"] for e in backups][:2] == [1, 2] and all(e["complete"] for e in backups)
    sent = [m["backup_bytes"] for m in read_jsonl(tmp_path / "swarm" / "metrics.jsonl") if m.get("backup_bytes")]
    whole = swarm.summary["extra_memory_bytes"]
    assert all(0 < n < whole / 4 for per_step in sent for n in per_step)  # a third of a stage's state per step


def test_a_stop_signal_during_a_commit_takes_effect_once_the_step_is_recorded(tiny_cfg, tmp_path, monkeypatch):
    """SIGTERM (the coordinator's stop handler) arriving while step 6 is being committed: the commit is not cut in
    half. The step is recorded, the run stops before step 7, and the save is at step 7, where every peer is
    (before, the save was refused: the peers had committed a step the run had not recorded)."""
    from coordinator.coordinator import Coordinator

    commit = Coordinator._commit

    async def commit_then_stop(self, step):
        # the COMMIT requests are under way (the peers complete them whatever the coordinator does next) when the
        # signal lands: before the fix the coordinator's wait for them was cancelled, the step never recorded
        committing = asyncio.ensure_future(commit(self, step))
        if step == 6:
            self._on_stop_signal(asyncio.current_task())
        return await asyncio.shield(committing)

    monkeypatch.setattr(Coordinator, "_commit", commit_then_stop)
    cfg = _cfg(tiny_cfg, "checkfree", steps=12)
    with pytest.raises(KeyboardInterrupt):
        run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages, save_final=False, save_every=5)
    summary = json.loads((tmp_path / "swarm" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 7
    assert [m["step"] for m in read_jsonl(tmp_path / "swarm" / "metrics.jsonl")] == list(range(7))
    assert sorted(p.name for p in (tmp_path / "swarm" / "saves").iterdir())[-1] == "step-00000007"

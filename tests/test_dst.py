"""Deterministic simulation tests (dst/): the fault wrapper, schedules as data, the bugs generated schedules found
(each kept as its shrunk schedule), and a mutation the search must catch. The soak and the 200-schedule run are
commands (docs/dst.md), not tests."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path

import pytest
import torch

from checkfree.net.errors import TransportError
from checkfree.net.faulty import Crossing, FaultRules, FaultyTransport, Point, Rule, delay, drop, hold, release
from checkfree.net.in_memory import MemoryNetwork, MemoryTransport
from checkfree.protocol import RPC
from dst.run import run_schedule
from dst.schedule import Fault, Kind, Schedule, Setup

pytestmark = pytest.mark.timeout(300)


# ---- the wrapper and the schedule's data ---------------------------------------------------------------------------
def test_fault_rules_drop_delay_and_rewrite_at_named_points():
    """FaultyTransport over the memory network: a rule drops the first PING at SEND (the caller sees an unreachable
    peer), a rule delays a SERVE, a rule rewrites a SEND's header, and every crossing is seen at its point."""
    seen: list[tuple[str, str]] = []

    async def watch(c: Crossing) -> dict | None:
        seen.append((c.point.value, c.rpc))
        return None

    rules = FaultRules([Rule(Point.SEND, RPC.PING, drop("cut")),
                        Rule(Point.SERVE, RPC.PING, delay(0.05)),
                        Rule(Point.SEND, RPC.STATUS, lambda c: _rewritten(c), times=None)])

    async def main() -> None:
        net = MemoryNetwork()
        a, b = (FaultyTransport(FaultyTransport(MemoryTransport(net), watch), rules) for _ in range(2))

        async def echo(header, tensors, peer):
            return {"got": header.get("x")}, tensors

        await b.register(RPC.PING, echo)
        await b.register(RPC.STATUS, echo)
        with pytest.raises(TransportError, match="cut"):
            await a.call(b.peer_id, RPC.PING, {}, timeout=5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply, out = await a.call(b.peer_id, RPC.PING, {"x": 1}, [torch.ones(2)], timeout=5)
        assert reply == {"got": 1} and torch.equal(out[0], torch.ones(2)) and loop.time() - t0 >= 0.05
        assert (await a.call(b.peer_id, RPC.STATUS, {"x": 1}, timeout=5))[0] == {"got": 2}

    asyncio.run(main())
    assert [r.fired for r in rules.rules] == [1, 1, 1]
    assert ("serve", RPC.PING) in seen and ("reply", RPC.STATUS) in seen and ("send", RPC.STATUS) in seen


async def _rewritten(c: Crossing) -> dict:
    return {**c.header, "x": 2}


def test_a_schedule_round_trips_through_json_and_refuses_bad_input():
    s = Schedule(Setup(strategy="checkfree+", stages=3, replicas=2),
                 (Fault(Kind.KILL_MID_FORWARD, 2, stage=1, mb=3), Fault(Kind.PARTITION, 1, stage=0, span=2)))
    assert Schedule.from_json(s.to_json()) == s
    assert "it 2 kill-mid-forward stage 1 mb 3" in s.describe()
    with pytest.raises(ValueError, match="not a dst schedule"):
        Schedule.from_json('{"setup": {"strategy": "checkfree"}, "faults": [{"kind": "meteor", "iteration": 1}]}')


# ---- schedules that diverged once (shrunk), kept as regression tests ----------------------------------------------
def _holds(schedule: Schedule, tmp_path, cache, rules=None) -> None:
    outcome = run_schedule(schedule, tmp_path / "run", cache, rules=rules)
    assert outcome.fired, "the schedule's faults must fire"
    assert not outcome.divergences, "\n".join(outcome.divergences)


@pytest.fixture
def cache(tiny_cfg, tmp_path, monkeypatch):
    """The token cache; and a temporary directory of this test's own, where what a schedule leaves is its own."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tiny_cfg.data.cache_dir


def _stage_of(swarm, pid: str) -> int:
    d = swarm.daemons.get(pid)
    return d.hosted.index if d is not None else -1


def test_the_soaks_leftover_check_takes_torchs_compile_cache_for_torchs(tmp_path):
    """The one-hour soak reported torch's compile cache directory (made by the launcher's own imports, kept by torch
    by design) as a leftover; anything else in the run's temporary directory still is one."""
    from dst.real import Watch, leftovers

    (tmp_path / "torchinductor_root").mkdir()
    watch = Watch(os.getpid())
    assert leftovers("no-such-mark", watch, tmp_path) == []
    (tmp_path / "pymp-x").mkdir()
    assert leftovers("no-such-mark", watch, tmp_path) == ["temporary files left: ['pymp-x']"]


def test_the_real_process_tier_hands_each_fault_kind_to_checkfree_local(tmp_path):
    """The real-process tier (`--tier real`) turns a schedule into `checkfree local`'s chaos flags, which its parser
    takes, and the simulator's failures into the lines it expects; a partition only where network namespaces are
    used. (Running one such schedule, real processes and all, is the slow test below.)"""
    from cli.main import build_parser
    from dst.real import expected_lines, local_args

    schedule = Schedule(Setup(strategy="checkfree+", stages=4, replicas=2, steps=6, fallback="copy"),
                        (Fault(Kind.KILL_BEFORE_STEP, 1, stage=1), Fault(Kind.KILL_GROUP, 2, stage=2),
                         Fault(Kind.KILL_MID_REDUCE, 3, stage=0), Fault(Kind.SIGTERM, 3, stage=3),
                         Fault(Kind.PARTITION, 4, stage=1), Fault(Kind.KILL_MID_REBUILD, 2),
                         Fault(Kind.SLOW, 1, stage=0, delay_ms=20), Fault(Kind.COORDINATOR_RESTART, 4, where="commit"),
                         Fault(Kind.KILL_MID_FORWARD, 1, stage=2, replica=1, mb=3), Fault(Kind.KILL_MID_BACKWARD, 2),
                         Fault(Kind.KILL_MID_COMMIT, 4, stage=3), Fault(Kind.JOIN, 3), Fault(Kind.JOIN, 1)))
    for netns in (True, False):
        args = local_args(schedule, tmp_path, netns)
        parsed = build_parser().parse_args(["local", *args])
        assert parsed.steps == 6 and parsed.replicas == 2 and parsed.strategy == "checkfree+"
        flag = lambda name: args[args.index(name) + 1]  # noqa: E731
        assert Path(flag("--trace")).read_text().split() == ["step,stage", "1,1", "2,2,all"]
        assert flag("--chaos-rebuild-kills") == "2" and flag("--chaos-slow") == "0:0.02@1"
        assert (flag("--kill-coordinator-at"), flag("--kill-coordinator-in"), flag("--coordinator-failover")) == (
            "4", "commit", "restart")
        assert {"--reduce-kill-trace", "--preempt-trace"} <= set(args)
        assert [args[i + 1] for i, a in enumerate(args) if a == "--chaos-peer-kill"] == [
            "forward:1:2:1:3", "backward:2:0:0:0", "commit:4:3:0:0"]
        assert parsed.chaos_peer_kill == ["forward:1:2:1:3", "backward:2:0:0:0", "commit:4:3:0:0"]
        assert flag("--chaos-joins") == "1,3"
        assert ("--netns" in args) is netns and ("--partition-trace" in args) is netns
        assert expected_lines(schedule, netns) == sorted(
            [(1, 1, False), (2, 2, True), (3, 0, False), (1, 2, False), (2, 0, False), (5, 3, False)]
            + ([(4, 1, False)] if netns else []))


def test_a_coordinator_killed_at_a_step_dies_before_that_iterations_faults_fire():
    """Found by the real-process tier (seed 9, #18: checkfree, S = 3, R = 2, the coordinator killed at step 1 with a
    standby, one replica of stage 0 killed at step 1). The launcher SIGKILLed the coordinator when it printed step
    0's line, a race with the coordinator's next iteration: it had armed step 1's replica kill when it died, and the
    standby, whose injector had fired nothing, fired it again on the other replica. Stage 0 lost both replicas where
    the schedule loses one. Now the coordinator asks for its SIGKILL as the iteration of step N starts: after the
    last iteration's partition is healed, before anything of this one; the coordinator that takes over fires it."""
    from types import SimpleNamespace

    from checkfree.failures import FailureSchedule
    from checkfree.protocol import Timeouts
    from coordinator.coordinator import CoordinatorView
    from faults.injector import FaultSchedule, Injector
    from coordinator.members import MembersView

    class Killed(Exception):
        pass

    asked = []

    async def handler(action, fields):
        asked.append((action, fields["step"]))
        if action == "coordinator-dies":
            raise Killed

    schedule = FaultSchedule(kills=FailureSchedule([(1, 0)]), partition=FailureSchedule([(0, 1)]), die_at=1,
                             joins=(0, 0), handler=handler)
    at = {"step": 0}

    def view():
        return CoordinatorView(run_id="r", cfg=None, step=at["step"], iteration=at["step"],
                               groups={s: (f"p{s}",) for s in range(3)}, members=MembersView(
                                   frozenset(), frozenset(), frozenset(), (), None), speeds={}, opened=True,
                               last_attempt=0, timeouts=Timeouts())

    coordinator = SimpleNamespace(view=view, out=SimpleNamespace(event=lambda *a, **k: None))

    async def main():
        injector = Injector(schedule)
        await injector("iteration", coordinator)
        at["step"] = 1
        with pytest.raises(Killed):
            await injector("iteration", coordinator)
        return asked

    assert asyncio.run(main()) == [("join", 0), ("join", 0), ("partition", 0), ("heal", 1), ("coordinator-dies", 1)]


@pytest.mark.processes
def test_an_interrupted_real_tier_stops_its_swarm(tmp_path):
    """`checkfree chaos dst --tier real` stopped by SIGTERM (or Ctrl-C) stops the `checkfree local` it started, in a
    session of its own (it was left running without its parent), and removes its temporary directory."""
    import signal
    import subprocess
    import sys

    from dst.real import _swarm

    before = signal.getsignal(signal.SIGTERM)
    for interrupt in (lambda: os.kill(os.getpid(), signal.SIGTERM), lambda: (_ for _ in ()).throw(KeyboardInterrupt)):
        (tmp := tmp_path / "swarm-tmp").mkdir()
        with open(tmp_path / "log.txt", "w") as log, pytest.raises((SystemExit, KeyboardInterrupt)):
            with _swarm([sys.executable, "-c", "import time; time.sleep(60)"], log,
                        {**os.environ, "TMPDIR": str(tmp)}) as proc:
                interrupt()
        assert proc.poll() is not None and not tmp.exists()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_generated_schedule_holds_in_real_processes(tmp_path, cache):
    """One schedule through `checkfree local` (real processes, SIGKILLs of whole process groups): the same end,
    losses and recoveries as the simulator's, the replicas identical, nothing left behind."""
    from dst.real import run_real

    schedule = Schedule(Setup(strategy="checkfree+", stages=3, replicas=2, steps=5, fallback="copy"),
                        (Fault(Kind.KILL_BEFORE_STEP, 1, stage=1), Fault(Kind.KILL_GROUP, 3, stage=2)))
    outcome = run_real(schedule, tmp_path / "run", cache, timeout=600)
    assert outcome.fired and not outcome.divergences, "\n".join(outcome.divergences)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peers_die_mid_forward_mid_backward_and_mid_commit_in_real_processes(tmp_path, cache):
    """The kills inside a peer's work, in real processes: the coordinator's injector arms each victim's fault hook
    (checkfree.peer_faults) through the control channel of a peer started with --fault-hook, and the victim SIGKILLs
    its own process group at its (mb+1)-th forward pass, its first backward pass, or as it takes the COMMIT. The
    same end, losses and recoveries as the simulator's, nothing left behind. (The quick cover, in one process:
    tests/test_inprocess.py, test_peers_armed_through_their_fault_hooks_die_mid_forward_mid_backward_and_mid_commit.)"""
    from dst.real import run_real

    schedule = Schedule(Setup(strategy="checkfree", stages=4, replicas=1, steps=6, fallback="copy"),
                        (Fault(Kind.KILL_MID_FORWARD, 1, stage=1, mb=1), Fault(Kind.KILL_MID_BACKWARD, 2, stage=2),
                         Fault(Kind.KILL_MID_COMMIT, 3, stage=1)))
    outcome = run_real(schedule, tmp_path / "run", cache, timeout=600)
    assert outcome.fired and not outcome.divergences, "\n".join(outcome.divergences)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "swarm" / "logs").glob("peer*.log"))
    assert [w in logs for w in ("forward pass 2 of step 1", "backward pass 1 of step 2", "COMMIT of step 3")] == [
        True] * 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_takeover_after_a_healed_partition_adopts_every_replica_in_real_processes(tmp_path, cache):
    """Found by the real-process tier (seed 9, #15; copy, S = 2, R = 2, in network namespaces): a replica partitioned
    and healed, then the coordinator SIGKILLed and restarted. Every peer's heartbeat stalled 9 s on the dead
    coordinator's DHT node and expired, and the takeover adopted only some peers (none of a stage, or one replica
    of each); the run aborted where the simulator completes (3 replays in 3). The quick cover:
    `test_a_takeover_adopts_the_peers_whose_heartbeats_it_does_not_read`."""
    from dst.real import netns_available, run_real

    if not netns_available():
        pytest.skip("network namespaces are not available here (the partition needs them)")
    path = Path(__file__).parents[1] / "dst" / "results" / "copy-groups-restart-after-partition-netns-real.json"
    outcome = run_real(Schedule.from_json(path.read_text()), tmp_path / "run", cache, timeout=600)
    assert outcome.fired and not outcome.divergences, "\n".join(outcome.divergences)


def test_the_real_process_soak_fails_over_its_coordinator_early_enough_for_its_deadline_to_reach_it():
    """A soak is stopped by its deadline, long before its last step: with --soak-steps 20000 its failover a third
    of the way in (step 6666) never happened in an hour. It is at step FAILOVER_BY at the latest."""
    from dst.real import FAILOVER_BY, soak_faults

    for steps, at in ((240, 80), (20000, FAILOVER_BY)):
        faults = soak_faults(steps, seed=1, stages=4, netns=False)
        failovers = [f for f in faults if f.kind is Kind.COORDINATOR_FAILOVER]
        assert [f.iteration for f in failovers] == [at]
        steps_with_faults = sorted({f.iteration for f in faults if f.kind is not Kind.COORDINATOR_FAILOVER})
        assert steps_with_faults[0] == 2 and all(3 <= b - a <= 8 for a, b in zip(steps_with_faults, steps_with_faults[1:]))
        assert all(f.kind is not Kind.PARTITION for f in faults)


def test_a_checkfree_plus_gradient_arriving_after_an_abort_is_not_applied(tmp_path, cache):
    """Found by dst (CheckFree+, stage 0 killed mid-backward; 1 run in 10 diverged from step 2 on). The race, made
    certain here: stage 2's COMPONENT_GRAD reply (stage 3's head gradient) is held at stage 2 until the coordinator
    has aborted stage 2's attempt. Stage 2 used to write the aborted attempt's summed head gradient after the
    abort had dropped its gradients; the next attempt added its own on top and the step's update was wrong."""
    schedule = Schedule(Setup(strategy="checkfree+", stages=4, steps=4, schedule="1f1b"),
                        (Fault(Kind.KILL_MID_BACKWARD, 1, stage=0, mb=3),))

    def rules(swarm) -> FaultRules:
        aborted = asyncio.Event()
        return FaultRules([
            Rule(Point.REPLY, RPC.COMPONENT_GRAD, hold(aborted, 10), times=None,
                 when=lambda c: _stage_of(swarm, c.me) == 2 and (c.header["step"], c.header["attempt"]) == (1, 0)),
            Rule(Point.REPLY, RPC.ABORT, release(aborted), when=lambda c: _stage_of(swarm, c.other) == 2, times=None)])

    _holds(schedule, tmp_path, cache, rules)


def test_a_peer_assigned_a_stage_before_it_has_read_its_join_reply_serves_it(tmp_path, cache):
    """Found by dst (a healthy standby retired at the start of a run). The coordinator assigns stages the moment
    it has admitted peers; here the first two peers' JOIN replies are held 0.3 s. They used to refuse the ASSIGN
    ('this peer has not joined a run yet'), and the coordinator retired them: healthy peers lost."""
    schedule = Schedule(Setup(strategy="checkfree", stages=3, steps=3), (Fault(Kind.KILL_BEFORE_STEP, 1, stage=1),))
    _holds(schedule, tmp_path, cache, lambda swarm: FaultRules([Rule(Point.REPLY, RPC.JOIN, delay(0.3), times=2)]))


def test_a_whole_stage_group_lost_mid_step_is_one_stage_failure(tmp_path, cache):
    """Found by dst (shrunk): every replica of stage 2 dies as the coordinator sends RUN_STEP. The coordinator used
    to reroute the first dead replica's microbatches to a sibling that was dead too, recording two replicas
    'lost mid-step' and then a stage failure; the simulator (and the truth) has one stage failure."""
    schedule = Schedule(Setup(strategy="uniform", stages=4, replicas=3, steps=3), (Fault(Kind.KILL_GROUP, 1, stage=2),))
    _holds(schedule, tmp_path, cache)


def test_a_gemini_rollback_names_the_stage_that_held_the_snapshot(tmp_path, cache):
    """Found by dst: the swarm's rollback event named the holder's peer id as its source where the simulator names
    the holder's stage."""
    schedule = Schedule(Setup(strategy="gemini", stages=3, steps=4, every=2), (Fault(Kind.KILL_BEFORE_STEP, 3, stage=1),))
    _holds(schedule, tmp_path, cache)



def test_a_new_coordinator_sees_a_commit_under_way_after_it_not_half_way(tmp_path, cache):
    """Found by dst (reft, the coordinator killed half-way through a commit: a healthy stage recovered, a step lost).
    Made certain here: stage 0's commit of step 1 (redundant computation ships its gradients to the replica's
    holder inside the commit) is held until the new coordinator's ADOPT has reached stage 0. Stage 0 used to
    answer ADOPT with the step still uncommitted, finish the commit, and then refuse the new coordinator's
    COMMIT of the same step as stale: the takeover counted the stage as lagging and recovered it."""
    schedule = Schedule(Setup(strategy="redundant", stages=3, steps=4),
                        (Fault(Kind.COORDINATOR_FAILOVER, 1, where="commit"),))

    def rules(swarm) -> FaultRules:
        adopting = asyncio.Event()
        return FaultRules([
            Rule(Point.SEND, RPC.REPLICA_GRAD, hold(adopting, 20),
                 when=lambda c: _stage_of(swarm, c.me) == 0 and c.header["step"] == 1),
            Rule(Point.SERVE, RPC.ADOPT, release(adopting), when=lambda c: _stage_of(swarm, c.me) == 0)])

    _holds(schedule, tmp_path, cache, rules)


def _reft_plan(stages: int, failed: set[int]):
    """reft's plan (S=`stages`, one parity group) for `failed` lost at step 2, the snapshot of step 1 taken."""
    from checkfree.plans import Copies, Failure
    from dst.run import build_config
    from checkfree.strategies import build_strategy

    strategy = build_strategy(build_config(Setup(strategy="reft", stages=stages, steps=4, every=1)))
    copies = Copies()
    copies.taken(1, {s: (s,) for s in range(stages)})
    copies.lose(failed)
    return strategy.recovery_plan(Failure(2, frozenset(failed), copies))


def test_both_runtimes_word_reft_recoveries_alike():
    """The quick cover of the two reft tests below (marked slow: reft's snapshot companions are processes): both
    runtimes write a plan's events with checkfree.plans.plan_events and abort with abort_if_unrecoverable, so the
    plan decides the words. A decoded member's source is 'parity'; two members of one group lost abort with the
    parity group named."""
    from checkfree.plans import abort_if_unrecoverable, plan_events
    from checkfree.recovery import UnrecoverableFailure

    events = plan_events(_reft_plan(3, {1}), "reft", "blocks", {})
    assert [(name, f["stage"], f["source"]) for name, f in events] == [("recovery", 1, "parity")]
    seen = []
    with pytest.raises(UnrecoverableFailure, match=r"reft cannot recover stage\(s\) \[0, 1\]: .*parity group"):
        abort_if_unrecoverable(_reft_plan(3, {0, 1}), "reft", lambda name, **f: seen.append((name, f["reason"])))
    assert seen and seen[0][0] == "fallback" and "parity group" in seen[0][1]


@pytest.mark.slow
def test_a_rollback_strategy_aborts_with_the_simulators_reason(tmp_path, cache):
    """Found by dst: reft losing two members of one parity group aborts in both runtimes, but the swarm said 'every
    holder of stage(s) [0, 1] failed and no storage fallback is configured' where the simulator names the parity
    group; now both take the reason from the strategy."""
    schedule = Schedule(Setup(strategy="reft", stages=3, steps=4, every=1), (Fault(Kind.KILL_ADJACENT, 2, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_checkfree_plus_snap_records_where_a_restored_stage_took_its_embedding(tmp_path, cache):
    """Found by dst: the swarm's snapshot restore of stage 0 names the live co-holder it took the embedding from
    (edge_sources); the simulator's event did not."""
    schedule = Schedule(Setup(strategy="checkfree+snap", stages=4, steps=5, every=2),
                        (Fault(Kind.KILL_BEFORE_STEP, 3, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_takes_the_snapshot_the_dead_coordinator_owed(tmp_path, cache):
    """Found by dst (baft, gemini): the coordinator dies half-way through committing step 1, after which a snapshot
    is due. The new coordinator completed the commit but never took the snapshot, so the kill at step 3 rolled
    back to step 0 instead of the simulator's step 2."""
    schedule = Schedule(Setup(strategy="gemini", stages=3, steps=5, every=2),
                        (Fault(Kind.COORDINATOR_FAILOVER, 1, where="commit"), Fault(Kind.KILL_BEFORE_STEP, 3, stage=1)))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_keeps_the_peer_a_stage_was_handed_over_to(tmp_path, cache):
    """Found by dst (a SIGTERM, then the coordinator restarted): stage 2's peer leaves and hands its state over to
    a standby, and the coordinator dies before the leaving peer has exited (its SHUTDOWN is held here until the new
    coordinator has reached it). Both claimed stage 2 at the same step; the new coordinator used to keep the
    leaving one and retire the one that took the stage over: a healthy peer lost, then a stage failure."""
    schedule = Schedule(Setup(strategy="checkfree", stages=3, steps=4),
                        (Fault(Kind.SIGTERM, 1, stage=2), Fault(Kind.COORDINATOR_RESTART, 2)))

    def rules(swarm) -> FaultRules:
        adopted = asyncio.Event()

        def leaving(pid: str) -> bool:
            d = swarm.daemons.get(pid)
            return d is not None and d.hosted.state.value == "leaving"

        return FaultRules([Rule(Point.SERVE, RPC.SHUTDOWN, hold(adopted, 20), when=lambda c: leaving(c.me), times=None),
                           Rule(Point.REPLY, RPC.ADOPT, release(adopted), when=lambda c: leaving(c.other), times=None)])

    _holds(schedule, tmp_path, cache, rules)


def test_an_aborting_run_recovers_nothing_first(tmp_path, cache):
    """Found by dst: gemini losing stages 0 and 1 together (stage 0's two holders) aborts in both runtimes, but the
    simulator first rolled stage 1 back and recorded its recovery; an aborted run now recovers nothing first in
    both (redundant computation likewise promotes nothing before it aborts)."""
    schedule = Schedule(Setup(strategy="gemini", stages=3, steps=4, every=1), (Fault(Kind.KILL_ADJACENT, 2, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_a_rollback_before_any_checkpoint_restores_the_initial_state_in_both_records(tmp_path, cache):
    """Found by dst (the 200-schedule run, schedule #1): a failure before the first checkpoint re-initialises every
    stage; the swarm records its source as 'init', the simulator said 'storage'."""
    schedule = Schedule(Setup(strategy="checkpoint", stages=2, steps=3), (Fault(Kind.KILL_BEFORE_STEP, 0, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_that_records_the_last_step_also_evaluates_it(tmp_path, cache):
    """Found by dst (the 200-schedule run, schedule #23): the coordinator dies half-way through committing the last
    step; the new one completed the commit and rebuilt the step's record from the peers, but never ran the
    evaluation due after it: the run ended without its final validation loss."""
    schedule = Schedule(Setup(strategy="checkfree", stages=3, steps=3),
                        (Fault(Kind.COORDINATOR_FAILOVER, 2, where="commit"),))
    _holds(schedule, tmp_path, cache)


def test_redundant_computation_promotes_a_replica_lost_before_the_first_step(tmp_path, cache):
    """Found by dst (the 200-schedule run, schedule #3): a stage lost at step 0 is promoted from the replica the
    swarm took at the start; the simulator, holding no replica yet, re-initialised it and recorded a rollback."""
    schedule = Schedule(Setup(strategy="redundant", stages=2, steps=3), (Fault(Kind.KILL_BEFORE_STEP, 0, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_two_neighbouring_stage_groups_lost_at_once_are_two_stage_failures(tmp_path, cache):
    """Found by dst (the 200-schedule run): every replica of stages 2 and 3 dies as the coordinator sends RUN_STEP.
    The attempt is aborted on the first group; between the attempts, the replicas of the other group that had been
    seen failing were dropped one by one ('lost') although none of their siblings answered either."""
    schedule = Schedule(Setup(strategy="uniform", stages=4, replicas=3, steps=3, fallback="copy"),
                        (Fault(Kind.KILL_ADJACENT, 1, stage=2),))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_prefers_the_replacement_to_a_partitioned_peer_back_from_its_partition(tmp_path, cache):
    """Found by dst (the 200-schedule run, schedule #30): stage 2's peer is partitioned at step 1 and replaced; the
    coordinator dies half-way through committing step 1 (stage 2's replacement not yet committed) as the partition
    heals. Both claim stage 2 at step 1; the new coordinator kept the stale one (no finished step), recovered stage
    2 again and could not record step 1. It now keeps the replacement, whose finished step it commits."""
    schedule = Schedule(Setup(strategy="checkfree+", stages=5, steps=3),
                        (Fault(Kind.PARTITION, 1, stage=2, span=1), Fault(Kind.COORDINATOR_FAILOVER, 1, where="commit")))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_mid_commit_keeps_and_commits_every_replica_of_a_stage_group(tmp_path, cache):
    """Found by dst (a stage group run, the coordinator killed half-way through a commit): the new coordinator
    committed each unfinished stage on its first replica only and retired the others, and rebuilt the step's record
    from one replica per stage: the loss of the step was half the simulator's. Every replica as far as the first is
    kept and committed now, and the record merges every replica's losses."""
    schedule = Schedule(Setup(strategy="checkfree", stages=3, replicas=2, steps=3),
                        (Fault(Kind.COORDINATOR_RESTART, 1, where="commit"),))
    _holds(schedule, tmp_path, cache)


@pytest.mark.slow
def test_reft_records_a_decoded_member_as_restored_from_parity_in_both_runtimes(tmp_path, cache):
    """Found by dst: the swarm records a lost member rebuilt from its group's snapshots and parity blocks as
    `source: parity`; the simulator recorded the lost stage's own number."""
    schedule = Schedule(Setup(strategy="reft", stages=3, steps=4, every=1), (Fault(Kind.KILL_BEFORE_STEP, 2, stage=1),))
    _holds(schedule, tmp_path, cache)


def test_a_handover_under_redundant_computation_hands_over_the_successors_replica_too(tmp_path, cache):
    """Found by dst: stage 2's peer leaves (SIGTERM) and hands its stage over; it also held stage 0's replica, which
    the new peer never took. When stage 0 was lost, its promotion failed on every standby ('this peer holds no
    replica'), each standby was counted dead in turn, and the run failed waiting for a replacement."""
    schedule = Schedule(Setup(strategy="redundant", stages=3, steps=4),
                        (Fault(Kind.SIGTERM, 1, stage=2), Fault(Kind.KILL_BEFORE_STEP, 2, stage=0)))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_keeps_the_snapshots_left_when_a_stage_lost_its_holder(tmp_path, cache):
    """Found by dst: checkfree+snap; the coordinator dies as stages 0 and 1 are lost together. Stage 1's snapshot
    survives on stage 2's peer, stage 0's went with stage 1's peer. The new coordinator kept snapshots only when
    every stage had one, so it restored nothing, averaged both neighbours, and aborted where the simulator restores
    stage 1 from its snapshot and rebuilds stage 0 from it."""
    schedule = Schedule(Setup(strategy="checkfree+snap", stages=4, steps=4, every=1),
                        (Fault(Kind.COORDINATOR_FAILOVER, 2), Fault(Kind.KILL_ADJACENT, 2, stage=0)))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_records_the_rerun_of_a_step_rolled_back_to(tmp_path, cache):
    """Found by dst (the 200-schedule run after the merge of issue 29's parts, checkpoint, schedule #69): the
    coordinator died half-way through committing step 0 again after a rollback to step 0. The new coordinator saw a
    record of step 0 (the first run's) and rebuilt none: the swarm's record lacked a step the simulator has."""
    schedule = Schedule(Setup(strategy="checkpoint", stages=3, steps=3, every=2),
                        (Fault(Kind.KILL_BEFORE_STEP, 1, stage=2), Fault(Kind.COORDINATOR_FAILOVER, 1, where="commit")))
    _holds(schedule, tmp_path, cache)


def test_a_partitioned_peer_must_be_retired_unless_the_run_aborted_before_it_healed(tmp_path):
    """The quick cover of the next test (slow: the cut-off peer's teardown waits out its grace periods): the
    invariant's own words, on a run directory's events."""
    import json

    from dst.check import accounted
    from dst.inject import Fired

    cut = Fired(Fault(Kind.PARTITION, 0, stage=0, span=1), 0, 0, ["mem-1"], [(0, 0, False)])
    failure = {"event": "failure", "step": 0, "stage": 0, "peer_id": "mem-1"}
    for abort_step, complaint in ((0, False), (1, True)):  # before the healing iteration (1), or after it
        (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in (failure, {
            "event": "fallback", "step": abort_step, "stage": 0, "fallback": "abort"})) + "\n")
        problems = accounted(tmp_path, [cut], [(0, 0, False, "mem-1")], [(0, 0, False)])
        assert any("never retired" in p for p in problems) is complaint, problems


@pytest.mark.slow
def test_a_run_that_aborts_while_a_peer_is_cut_off_need_not_retire_it(tmp_path, cache):
    """Found by dst (the same 200-schedule run, shrunk from schedule #69 to another divergence, in the harness): a
    partition of stage 0 under CheckFree (which cannot rebuild the first stage) aborts the run at step 0 in both
    runtimes, before the partition heals; the invariant 'every healed partition a retired peer' took the peer
    nobody could reach for a lost one."""
    schedule = Schedule(Setup(strategy="checkfree", stages=2, steps=3, every=1), (Fault(Kind.PARTITION, 0, stage=0),))
    _holds(schedule, tmp_path, cache)


def test_a_takeover_that_finds_no_stage_served_lets_the_strategy_decide(tmp_path, cache):
    """Found by dst (the second 200-schedule run, schedule #108): the coordinator and every stage's peers died at
    once. The standby found only spare peers, none serving a stage, and waited for one until the harness stopped
    it; the simulator (and the strategy) abort: every stage failed, nothing to recover from. It then failed again,
    nondeterministically (5 replays in 8 at load ~2): when no spare had joined before everything died, no live peer
    knew the run's config and the standby waited for one until the harness stopped it. The standby now reads the
    config from the run directory it shares (8 replays in 8)."""
    schedule = Schedule(Setup(strategy="checkfree", stages=2, steps=3),
                        (Fault(Kind.COORDINATOR_FAILOVER, 0), Fault(Kind.KILL_ADJACENT, 0, stage=0)))
    _holds(schedule, tmp_path, cache)


def test_a_standby_with_a_directory_of_its_own_takes_over_a_run_whose_every_stage_died(tmp_path, cache):
    """Issue 37 item 3, in-process (tests/test_failover.py has it in real processes): the coordinator and every
    stage's peers die at once after step 0, and the standby keeps its copy of the run in a directory of its own (no
    shared disk). It takes over from its copy (the config, step 0's line, the members, where the checkpoints are:
    the coordinator's run directory), every stage is restored from the checkpoint of step 1, and the run ends as
    the simulator's, recorded in the standby's directory."""
    import json

    schedule = Schedule(Setup(strategy="checkpoint", stages=2, steps=3, every=1),
                        (Fault(Kind.COORDINATOR_FAILOVER, 1), Fault(Kind.KILL_ADJACENT, 1, stage=0)))
    outcome = run_schedule(schedule, tmp_path / "run", cache, keep=True, standby_apart=True)
    assert outcome.fired and not outcome.divergences, "\n".join(outcome.divergences)
    standby = tmp_path / "run" / "standby"
    (takeover,) = [e for e in map(json.loads, (standby / "events.jsonl").read_text().splitlines())
                   if e["event"] == "coordinator_takeover"]
    assert (takeover["step"], takeover["stages"], takeover["missing_stages"]) == (1, 0, [0, 1])
    summary = json.loads((standby / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["recoveries"] == 2
    assert not list(standby.glob(".standby-*"))


def test_a_handover_keeps_the_snapshots_the_leaving_peer_held(tmp_path, cache):
    """Found by dst (the 200-schedule run of seed 21, schedule #121, shrunk): gemini, stage 0 killed at step 0
    (rolled back to the initial state), then at step 1 stage 0 killed again as stage 1's peer is SIGTERMed. The
    SIGTERM hands stage 1 over to a standby, without the snapshot of stage 0 that stage 1's peer held: stage 0 has
    no holder left and the swarm aborts, where the simulator restores it from stage 1's copy. Fixed: the handover
    carries the snapshots the leaving peer held (AssignHandover.held, fetched from it), except under ReFT."""
    schedule = Schedule(Setup(strategy="gemini", stages=2, steps=4, every=1),
                        (Fault(Kind.KILL_BEFORE_STEP, 0, stage=0), Fault(Kind.KILL_BEFORE_STEP, 1, stage=0),
                         Fault(Kind.SIGTERM, 1, stage=1)))
    _holds(schedule, tmp_path, cache)


def test_a_peer_adopted_while_it_joins_joins_the_new_coordinator_not_the_dead_one_the_dht_names(tiny_cfg):
    """Found by dst (the seed-41 soak, schedule #200: gemini, the coordinator restarted at step 0; 3 replays in 4
    diverged with "no standby peer joined"): spares looking for the coordinator found the dead one's DHT record
    (it outlives it by up to 3 heartbeat TTLs). The restarted coordinator ADOPTed them meanwhile, but their JOIN
    loop, failing to reach the dead one, forgot the new one and looked again: every ASSIGN of the new coordinator
    was refused ("only the run's coordinator may assign a stage"). A peer ADOPTed while it joins now joins the
    coordinator that adopted it (6 replays in 6; the schedule: dst/results/gemini-restart-no-standby-joined.json)."""
    import time

    from checkfree.messages import Joined, to_wire
    from checkfree.net.in_memory import MemoryDHT
    from checkfree.protocol import Timeouts, coordinator_key, coordinator_record
    from peers.membership import Membership
    from peers.stage import HostedStage

    async def main():
        network = MemoryNetwork()
        new = MemoryTransport(network)

        async def on_join(header, tensors, peer):
            return to_wire(Joined(config=tiny_cfg.to_json(), status="standby")), []

        await new.register(RPC.JOIN, on_join)
        net = Membership("dst", Timeouts(heartbeat_ttl=0.5, rpc_timeout=1.0, step_timeout=2.0, join_timeout=4.0),
                         None, HostedStage(), asyncio.Event())

        class AdoptedMidJoin(MemoryTransport):
            """The new coordinator's ADOPT arrives while this peer's JOIN to the dead one is under way."""
            async def call(self, peer_id, name, header, tensors=(), *, timeout):
                if name == RPC.JOIN and peer_id == "dead":
                    net.adopted_by(new.peer_id)
                return await super().call(peer_id, name, header, tensors, timeout=timeout)

        net.transport = AdoptedMidJoin(network)
        net.dht = MemoryDHT(network, net.transport.peer_id)
        # the dead coordinator's record, still live in the DHT
        net.dht.store(coordinator_key("dst"), coordinator_record(None, "dst", "dead", "memory"),
                      expiration_time=time.time() + 60, subkey="main")
        cfg = await net.join()
        assert cfg is not None and cfg.to_json() == tiny_cfg.to_json()
        assert net.coordinator == new.peer_id
        # told to stop (SIGTERM) while it joins the coordinator that adopted it: it stops, it does not retry it
        network.kill(new.peer_id)
        net.stop.set()
        assert await asyncio.wait_for(net.join(), 5) is None

    asyncio.run(main())


def test_a_takeover_records_the_step_committed_as_a_stage_died_mid_commit(tmp_path, cache):
    """Found by dst (the seed-12 soak, schedule #236, 3 replays in 3): the coordinator restarted half-way through
    committing step 4 as stage 3's peer died mid-commit. The new coordinator completed the commit but did not record
    step 4: it rebuilt a missing record only when every stage's peer reported its last commit. It now does whenever
    the peers' commits hold the loss of every microbatch (the dead stage's figures NaN, as in a record of the old
    coordinator's); the dead stage is recovered at step 5 in both runtimes."""
    schedule = Schedule(Setup(strategy="checkfree+", stages=6, steps=6),
                        (Fault(Kind.KILL_BEFORE_STEP, 0, stage=2), Fault(Kind.JOIN, 3),
                         Fault(Kind.KILL_MID_COMMIT, 4, stage=3), Fault(Kind.COORDINATOR_RESTART, 4, where="commit")))
    _holds(schedule, tmp_path, cache)


CUT_OFF_AT_TAKEOVER = {
    # a stage group's replica: a lost replica, recorded by the new coordinator at the step it takes over at
    "replica": Schedule(Setup(stages=3, replicas=2, steps=5, schedule="1f1b", fallback="copy", every=3),
                        (Fault(Kind.PARTITION, 2, stage=0), Fault(Kind.COORDINATOR_RESTART, 2))),
    # ... that the old coordinator had recorded lost already: not recorded twice
    "replica-recorded": Schedule(Setup(stages=3, replicas=2, steps=5, schedule="1f1b", fallback="copy", every=3),
                                 (Fault(Kind.PARTITION, 2, stage=0, span=2), Fault(Kind.COORDINATOR_RESTART, 3))),
    # a stage's only peer: the stage is unserved after the takeover, a failure the strategy recovers
    "stage": Schedule(Setup(stages=3, steps=5, schedule="1f1b", fallback="copy", every=3),
                      (Fault(Kind.PARTITION, 2, stage=0), Fault(Kind.COORDINATOR_RESTART, 2))),
}


@pytest.mark.parametrize("name", sorted(CUT_OFF_AT_TAKEOVER))
def test_a_peer_cut_off_as_the_coordinator_is_replaced_is_out_of_the_run_and_retired(name, tmp_path, cache):
    """Found by dst (the seed-41 soak, schedule #600: copy, 3 replicas per stage, stage 0's peer partitioned as the
    coordinator restarted; dst/results/copy-groups-partition-at-coordinator-restart.json). The new coordinator could
    not ADOPT the cut-off peer; when it healed, nobody told it to stop, and a replica's loss went unrecorded. Besides,
    a peer's heartbeat named its stage up to half a TTL late, so the takeover read "joining" for a peer serving a
    stage. The heartbeat now changes with the stage; a peer whose heartbeat names a stage but which did not answer
    the ADOPT is out of the run (a lost replica if its group goes on, unless the old coordinator's record names it),
    and is ADOPTed, then retired, once it answers; so is one that comes back later (its heartbeat names a stage, it is
    not a member). Before, "replica" and "stage" diverged ("never retired"; a replica_lost missing); "replica-recorded"
    keeps the fix from recording a loss twice (without the old coordinator's record it did)."""
    _holds(CUT_OFF_AT_TAKEOVER[name], tmp_path, cache)


def test_recovery_coefficients_are_compared_to_the_wires_precision(tmp_path):
    """Over a 16- or 8-bit wire the arrival order of a step's backward passes moves the gradient norms by ~1e-4
    relative from run to run (dst.check.NARROW_WIRE_COEFFICIENTS_REL): such coefficients are compared to 1e-3;
    float32 ones to 1e-5. Swapped coefficients are a divergence over any wire."""
    import json

    from dst.check import same_recoveries

    def run(name: str, wire: str, coefficients: list[float]):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"train": {"wire_dtype": wire}}))
        (out / "events.jsonl").write_text(json.dumps({"event": "recovery", "step": 5, "stage": 3, "method": "average",
                                                      "sources": [2, 4], "coefficients": coefficients}) + "\n")
        return out

    sim = run("sim", "float32", [0.4840038, 0.5159962])
    noisy = [0.4839553, 0.5160447]  # a replay of seed-12 #236 over bfloat16
    assert same_recoveries(run("bf16", "bfloat16", noisy), sim) == []
    assert same_recoveries(run("f32", "float32", noisy), sim) != []
    assert same_recoveries(run("bf16-swapped", "bfloat16", [0.5159962, 0.4840038]), sim) != []


def test_a_stage_whose_peer_dies_as_a_recovery_restores_it_is_a_failure_too(tmp_path, cache):
    """Found by dst (the seed-41 soak at 70873ba, schedule #215, 4 replays in 4): baft, stages 0 and 1 killed at
    once. The swarm saw stage 0's failure first, and its rollback's RESTORE to stage 1's dead peer failed the run
    with a TransportError, where the simulator aborts (baft cannot recover stage 0 without stage 1's backup). A
    stage whose peer dies while a recovery restores it is now a failure too, and the strategy plans again."""
    schedule = Schedule(Setup(strategy="baft", stages=3, steps=4, schedule="1f1b", soft_errors=2),
                        (Fault(Kind.SLOW, 2, stage=1, span=2, delay_ms=23), Fault(Kind.KILL_ADJACENT, 3, stage=0)))
    _holds(schedule, tmp_path, cache)


def test_losses_are_compared_to_the_wires_precision(tmp_path):
    """Over a narrow wire the losses of two runs of one schedule move in the sixth digit (dst.check.NARROW_WIRE_LOSS_REL;
    the seed-41 soak's #974 over int8: 1.2e-5 relative once): they compare to 1e-4 there, to 1e-5 over float32."""
    import json

    from dst.check import same_losses

    def run(name: str, wire: str, loss: float):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"train": {"wire_dtype": wire}}))
        (out / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": loss}) + "\n")
        return out

    sim = run("sim", "float32", 6.004783272743225)
    assert same_losses(run("int8", "int8", 6.00471305847168), sim) == []  # #974's
    assert same_losses(run("f32", "float32", 6.00471305847168), sim) != []
    assert same_losses(run("int8-off", "int8", 6.006), sim) != []  # 2e-4 relative off: still a divergence


def test_a_failure_a_fault_expects_is_not_also_counted_for_a_sigterm_of_the_same_peer():
    """A SIGTERMed peer that a kill takes before it has left fails once: the kill's failure, not the leave's as well
    (the simulator would otherwise be given the failure twice, and the invariant count one the swarm never had)."""
    from dst.inject import Fired
    from dst.run import by_record_only

    recorded = [(1, 2, False, "peer-a")]
    sigterm = Fired(Fault(Kind.SIGTERM, 1, stage=2), 1, 1, ["peer-a"], None)
    kill = Fired(Fault(Kind.KILL_BEFORE_STEP, 1, stage=2), 1, 1, ["peer-a"], [(1, 2, False)])
    slow = Fired(Fault(Kind.SLOW, 0, stage=2), 0, 0, ["peer-a"], [])
    assert by_record_only(recorded, [sigterm, kill]) == []
    assert by_record_only(recorded, [sigterm]) == by_record_only(recorded, [slow, sigterm]) == [(1, 2, False)]
    # a stage a new coordinator finds unserved (no peer in the record): the leaving peer's, then or an iteration later
    assert by_record_only([(2, 2, False, "")], [sigterm]) == [(2, 2, False)]
    assert by_record_only([(3, 2, False, "")], [sigterm]) == []


def test_peers_killed_in_the_crossing_that_restarts_the_coordinator_die(tmp_path, cache):
    """Found by dst (the seed-61 acceptance run, #56: checkpoint, the coordinator restarted and stages 3 and 4 killed
    at the same RUN_STEP): the harness's kill looked for a coordinator by its transport, and the successor started
    by that crossing had none yet: an AttributeError after the first victim, so stage 4's peer lived on and the swarm
    recorded one failure where the simulator had two. The injector's own failures are divergences now ("the fault
    injector failed"), not swallowed by the crossing they happened in."""
    schedule = Schedule(Setup(strategy="checkpoint", stages=5, steps=4, every=2),
                        (Fault(Kind.COORDINATOR_RESTART, 2), Fault(Kind.KILL_ADJACENT, 2, stage=3)))
    _holds(schedule, tmp_path, cache)


def test_an_abort_accounts_for_the_failures_it_ended_the_run_at(tmp_path):
    """Found by dst (the seed-41 soak at 70873ba, schedule #453: redundant, S=2, both stages killed at once): both
    runtimes abort alike ("all 2 stages failed at once; nothing to recover from"), before any plan, so without a
    fallback event; the invariant took the failures for unaccounted. The abort accounts for the failures of the
    step it ended the run at; a completed run's failures still need a recovery or a fallback."""
    import json

    from dst.check import accounted

    out = tmp_path / "swarm"
    out.mkdir()
    (out / "events.jsonl").write_text("".join(json.dumps({"event": "failure", "step": 2, "stage": s}) + "\n"
                                              for s in (0, 1)))
    expected = [(2, 0, False), (2, 1, False)]
    recorded = [(2, 0, False, "a"), (2, 1, False, "b")]
    for status, unaccounted in (("aborted", 0), ("completed", 2)):
        (out / "summary.json").write_text(json.dumps({"status": status}))
        problems = accounted(out, [], recorded, expected)
        assert len([p for p in problems if "has no recovery or fallback" in p]) == unaccounted, problems


def test_a_sigterm_reaches_a_peer_the_harness_has_not_registered_yet(tiny_cfg, tmp_path):
    """Found by dst (the seed-41 soak at 70873ba, schedule #503, under load): over the memory network a new peer
    joined, was assigned stage 3 and sent a step within the 10 ms the harness polls for its transport; the
    SIGTERM fired then failed with a KeyError (reported by the coordinator as the step's failure) and never
    reached the peer, which served on. The harness finds a started peer by its transport until it registers it."""
    from dst.swarm import SimSwarm
    from peers.daemon import PeerDaemon, PeerOptions

    swarm = SimSwarm(tiny_cfg, tmp_path / "swarm", Schedule(Setup(strategy="checkfree", stages=2, steps=3), ()))
    d = PeerDaemon(PeerOptions(run_id="dst", transport="memory"))
    d.membership.transport = MemoryTransport(MemoryNetwork())
    swarm._peers_started.append(d)  # started, its transport made, not in `daemons` yet
    try:
        swarm.terminate(str(d.membership.transport.peer_id))
        assert d.stop.is_set()
    finally:
        d.compute.shutdown(wait=True)


def test_a_step_task_that_outlives_the_abort_of_its_attempt_leaves_the_stage_untouched(tiny_cfg):
    """Found by dst (CheckFree+, stage groups, a replica killed mid-reduce: 3 runs in 5 diverged). ABORT cancels an
    attempt's tasks, but Python 3.11's asyncio.wait_for returns a result that lands together with a cancellation
    and drops the cancellation: a sibling's redo whose input arrived as the attempt was aborted went on to compute
    its microbatch and left its gradient in the stage after ABORT had dropped the gradients. Here the head stage's
    forward task of an attempt already ended (what such a task finds) must not run."""
    from checkfree.pipeline import route
    from peers.daemon import PeerDaemon, PeerOptions
    from peers.step import StepRun

    cfg = copy.deepcopy(tiny_cfg)
    daemon = PeerDaemon(PeerOptions(transport="memory"))
    daemon.hosted.configure(cfg, None)
    last = cfg.num_stages - 1
    daemon.hosted.worker = daemon.hosted.build(last)
    routes = [route(cfg.num_stages, False, 0, mb, cfg.train.num_microbatches) for mb in range(cfg.train.num_microbatches)]
    run = StepRun(0, 0, False, {s: f"p{s}" for s in range(cfg.num_stages)}, routes, remaining=1)
    run.fail("aborted by the coordinator")
    x = torch.randn(cfg.train.microbatch_size, cfg.model.context_length, cfg.model.d_model)
    asyncio.run(daemon.passes._forward_task(run, 0, last, x))
    daemon.compute.shutdown(wait=True)
    assert all(p.grad is None for p in daemon.hosted.worker.module.parameters())

RESULTS = Path(__file__).resolve().parents[1] / "dst" / "results"


def _recorded_schedule(name: str) -> Schedule:
    return Schedule.from_json((RESULTS / f"{name}.json").read_text())


def test_failures_found_with_a_leave_are_planned_before_its_handover(tmp_path, cache):
    """Found by dst (seed 7, divergence #1; issue 37): redundant computation, stages 0, 2 and 3 killed as stage 1's
    peer is SIGTERMed, in one iteration. The handover of stage 1 went first and took stage 2's replica from stage
    2's dead peer: the swarm failed with a TransportError where the simulator aborts with the strategy's reason
    ("stage 0's replica holder 3 failed too, stage 3's replica holder 2 failed too"). The failures found with a
    leave are now planned first, from the copies as they are (the leaving peer serves until its handover)."""
    _holds(_recorded_schedule("redundant-three-killed-one-sigterm-transport-error"), tmp_path, cache)


def test_a_neighbours_replica_cut_off_as_a_group_dies_is_a_lost_replica(tmp_path, cache):
    """Found by dst (seed 7, divergence #2, the class of the seed-41 soak's #600; issue 37): stage groups, stage
    3's whole group killed, a replica of stage 4 cut off and one of stage 0 killed in one iteration. The group step
    stopped at the first lost stage, and the cut-off replica, its failed RUN_STEP unnoted (a partition keeps its
    heartbeat in-process), stayed stage 4's primary: the rebuild of stage 3 pulled from it and failed on every
    standby in turn ("no standby peer joined within join_timeout"), where the simulator records both lost
    replicas and rebuilds stage 3. Every failed call of an attempt is a suspect now, and a recovery pings every
    peer it may lean on before it plans (`Recovery._sweep`); an ASSIGN that failed at a dead source plans again."""
    _holds(_recorded_schedule("checkfree-groups-group-lost-neighbour-replica-partitioned"), tmp_path, cache)


def test_a_baft_handover_takes_the_backup_in_flight_along(tmp_path, cache):
    """Found by dst (seed 20261129, schedule #20, in every replay; issue 37): BAFT, stage 0's peer SIGTERMed at
    iteration 0 hands its stage over while the backup taken after step 0 is in flight; stage 0 is killed at
    iteration 2. The leaving peer took the backup it was sending with it, and the coordinator still named it in
    the backup's place: the backup never sealed, and the rollback went to the initial state where the simulator,
    where a leave loses nothing, rolls back to the backup (steps recorded: swarm [0, 1, 0, 0, 1, 2, 3], simulator
    [0, 1, 1, 1, 2, 3]). The new peer now takes the leaving peer's backups in flight (BACKUP_FETCH) and is noted
    in its place. The quick covers: `test_a_baft_handover_takes_the_backups_in_flight_from_the_leaving_peer`
    (below) and, in tests/test_coordinator_parts.py,
    `test_a_baft_handover_puts_the_new_peer_in_the_leaving_ones_place_in_the_backup_in_flight`."""
    _holds(_recorded_schedule("baft-handover-backup-in-flight"), tmp_path, cache)


def test_a_baft_handover_of_a_backup_holder_takes_the_backup_it_was_to_receive_along(tmp_path, cache):
    """The holder's side of the class above (written, not generated): stage 1's peer, the holder of stage 0's
    backup, SIGTERMed at iteration 0 while the backup taken after step 0 is in flight, stage 0 killed at iteration
    2. Without the fix stage 0's parts went to the peer that had left, the backup never sealed, and the rollback
    went to the initial state (steps recorded: swarm [0, 1, 0, 1, 2, 3], simulator [0, 1, 1, 2, 3], at 562e2b5);
    now the coordinator sends them to the new peer, which restores stage 0 from it."""
    schedule = Schedule(Setup(strategy="baft", stages=3, steps=4),
                        (Fault(Kind.SIGTERM, 0, stage=1), Fault(Kind.KILL_BEFORE_STEP, 2, stage=0)))
    _holds(schedule, tmp_path, cache)


@pytest.mark.slow
def test_a_takeover_keeps_the_peer_assigned_last_not_a_partitioned_one_back(tmp_path, cache):
    """Found by dst (seed 7, divergence #3; issue 37, 4 replays in 4): reft, stage 4's peer partitioned and replaced
    (a rollback), the coordinator killed half-way through committing the re-run step, the partition healed. The
    stale peer and its replacement claimed stage 4 at the same progress; the takeover kept the stale one and
    retired the healthy replacement. A stage's only peer is now the one assigned last (`Adopted.epoch`). The quick
    cover: `test_a_takeover_ranks_the_claimants_of_a_stage_by_their_assignment`."""
    _holds(_recorded_schedule("reft-failover-mid-commit-healthy-peer-retired"), tmp_path, cache)


def test_a_takeover_ranks_the_claimants_of_a_stage_by_their_assignment():
    """One peer per stage: the one assigned last keeps it, however far the other came. A stage group: the replicas
    that came furthest, the one assigned last first among equals."""
    from checkfree.messages import Adopted, Ready
    from coordinator.failover import _rank

    stale = ("stale", Adopted(stage=4, state="serving", next_step=3, omega=0.0, epoch=5))
    new = ("new", Adopted(stage=4, state="serving", next_step=2, omega=0.0, epoch=9,
                          ready=Ready(step=2, attempt=1, losses={})))
    behind = ("behind", Adopted(stage=4, state="serving", next_step=2, omega=0.0, epoch=12))
    for claimants in ([stale, new], [new, stale]):
        _rank(claimants, groups=False)
        assert claimants[0][0] == "new"
        _rank(claimants, groups=True)
        assert claimants[0][0] == "new"  # (the same progress: the one assigned last)
    claimants = [stale, behind]
    _rank(claimants, groups=True)
    assert claimants[0][0] == "stale"  # (a replica that joined later but came less far)


def test_a_peer_backpropagates_its_microbatches_in_order_whatever_order_their_gradients_arrive_in():
    """The seed-41 soak's #974 (issue 37): a peer accumulated its gradients in their arrival order, and float addition
    is not associative: two runs of one schedule differed in their losses (7e-5), and one schedule gave 6 outcomes
    in 20 replays. A backward pass now waits for those of the earlier microbatches this peer computes; an ended
    attempt releases it, and no wait outlasts its timeout."""
    from peers.step import StepRun

    async def main() -> None:
        run = StepRun(0, 0, False, {}, [], remaining=4)
        order: list[int] = []

        async def backward(mb: int) -> None:
            await run.backward_turn(mb, range(4), timeout=10)
            order.append(mb)
            run.mark("backward", mb)

        tasks = [asyncio.create_task(backward(mb)) for mb in (3, 1, 2, 0)]
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert order == [0, 1, 2, 3]
        ended = StepRun(0, 1, False, {}, [], remaining=4)
        waiting = asyncio.create_task(ended.backward_turn(3, range(4), timeout=10))
        await asyncio.sleep(0.01)
        ended.fail("aborted by the coordinator")
        await asyncio.wait_for(waiting, 1)
        late = StepRun(0, 2, False, {}, [], remaining=4)
        await asyncio.wait_for(late.backward_turn(3, range(4), timeout=0.05), 1)

    asyncio.run(main())


# ---- a fixed small set: every fault kind the in-process tier runs, at least once ------------------------------------
FIXED = {
    "mid-forward+mid-commit": Schedule(Setup(strategy="checkfree", stages=4, steps=4),
                                       (Fault(Kind.KILL_MID_FORWARD, 1, stage=1, mb=2),
                                        Fault(Kind.KILL_MID_COMMIT, 2, stage=2))),
    "mid-reduce+partition": Schedule(Setup(strategy="checkfree+", stages=3, replicas=2, steps=4, schedule="1f1b"),
                                     (Fault(Kind.KILL_MID_REDUCE, 1, stage=1, replica=1),
                                      Fault(Kind.PARTITION, 1, stage=0, span=1))),
    "failover-in-commit+rebuild": Schedule(Setup(strategy="checkfree", stages=3, steps=4, wire_dtype="bfloat16"),
                                           (Fault(Kind.COORDINATOR_FAILOVER, 1, where="commit"),
                                            Fault(Kind.KILL_BEFORE_STEP, 2, stage=1),
                                            Fault(Kind.KILL_MID_REBUILD, 2, pulls=1))),
    "restart+sigterm+join+slow": Schedule(Setup(strategy="redundant", stages=3, steps=4, fallback="copy"),
                                          (Fault(Kind.COORDINATOR_RESTART, 2), Fault(Kind.SIGTERM, 1, stage=2),
                                           Fault(Kind.JOIN, 0), Fault(Kind.SLOW, 0, stage=0, span=2, delay_ms=20))),
}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_fixed_schedule_holds_every_invariant(name, tmp_path, cache):
    _holds(FIXED[name], tmp_path, cache)



# ---- mutation: the search must catch a broken recovery ------------------------------------------------------------
def _swap_coefficients(monkeypatch) -> None:
    """The swarm's peers rebuild a lost stage with its two sources' gradient norms swapped (the simulator does not)."""
    import peers.rebuild

    rebuild = peers.rebuild.rebuild_stage

    def swapped(plan, template, blocks, norms, edges, **kwargs):
        if len(norms) == 2:
            a, b = sorted(norms)
            norms = {a: norms[b], b: norms[a]}
        return rebuild(plan, template, blocks, norms, edges, **kwargs)

    monkeypatch.setattr(peers.rebuild, "rebuild_stage", swapped)


def test_swapped_recovery_coefficients_are_caught(tmp_path, cache, monkeypatch):
    """The invariants catch the mutation on one schedule that recovers an intermediate stage (the generated search
    catching it within 50 schedules is the slow test below)."""
    _swap_coefficients(monkeypatch)
    schedule = Schedule(Setup(strategy="checkfree", stages=3, steps=4), (Fault(Kind.KILL_BEFORE_STEP, 2, stage=1),))
    outcome = run_schedule(schedule, tmp_path / "run", cache)
    assert any(d.startswith("coefficients of the recovery of stage 1") for d in outcome.divergences), outcome.divergences


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_search_catches_swapped_coefficients_within_50_schedules(tmp_path, cache, monkeypatch):
    """Generated schedules (seed 0) with the mutation: a divergence within 50 schedules; shrunk, and its replay
    diverges again."""
    from dst.search import explore

    _swap_coefficients(monkeypatch)
    report = explore(50, 0, tmp_path / "dst", cache, stop_at_first=True, shrink_s=300)
    assert report.found, f"no divergence in {report.schedules} schedules"
    found = report.found[0]
    print(f"caught at schedule #{found.index}; shrunk to:\n{found.shrunk.schedule.describe()}")
    assert found.index < 50 and found.shrunk is not None and found.replayed.divergences


def test_the_dst_page_shows_what_the_result_files_say():
    """docs/dst.md includes dst/results/measured.md, rendered from the result files beside it (python -m dst.report
    --write), never typed."""
    from dst.report import MEASURED, render

    assert MEASURED.read_text() == render(), "dst/results/measured.md is stale: python -m dst.report --write"
    assert "<!-- include dst/results/measured.md -->" in (MEASURED.parents[2] / "docs" / "dst.md").read_text()


def test_the_command_runs_generated_schedules_and_replays_one(tmp_path, cache):
    """`checkfree chaos dst` end to end (a subprocess): two generated schedules, then one replayed from its file; the
    last line is the summary, and report.jsonl has a line per schedule."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CHECKFREE_CACHE": cache}
    cmd = [sys.executable, "-m", "checkfree", "chaos", "dst", "--out", str(tmp_path / "out")]
    done = subprocess.run([*cmd, "--schedules", "2", "--seed", "3", "--shrink-seconds", "0"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("dst: 2 schedules, 0 divergences, ") and last.endswith(" faults injected"), last
    assert len((tmp_path / "out" / "report.jsonl").read_text().splitlines()) == 2
    schedule = Schedule(Setup(strategy="checkfree", stages=3, steps=3), (Fault(Kind.KILL_MID_FORWARD, 1, stage=1),))
    (tmp_path / "s.json").write_text(schedule.to_json())
    done = subprocess.run([*cmd, "--replay", str(tmp_path / "s.json"), "--repeat", "2"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "dst: the same outcome in 2 of 2 runs" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "dst: 2 schedules, 0 divergences, 2 faults injected"
    rows = [json.loads(line) for line in (tmp_path / "out" / "report.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == ["replay0", "replay1"] and rows[0]["signature"] == rows[1]["signature"]


@pytest.mark.processes
def test_a_reft_handover_keeps_the_leaving_peers_snapshot_and_parity_block(tmp_path, cache):
    """Found by dst (the seed-12 soak, schedule #103, 3 replays in 3): ReFT, stage 1's peer SIGTERMed at step 1
    hands its stage over; at step 2 stage 5 dies, and the restore of the group's snapshot of step 2 fails: "no own
    snapshot of stage 1 at step 2". A ReFT handover dropped the leaving peer's copies (its snapshot, its parity
    block, its companion). The new peer now takes its snapshot and parity block (REFT_FETCH) and the ledger keeps
    them, as the simulator, where a leave loses nothing."""
    schedule = Schedule(Setup(strategy="reft", stages=6, steps=5, every=1),
                        (Fault(Kind.SIGTERM, 1, stage=1), Fault(Kind.KILL_BEFORE_STEP, 2, stage=5)))
    _holds(schedule, tmp_path, cache)


def test_a_reft_handover_takes_the_snapshot_and_parity_block_from_the_leaving_peer(tiny_cfg):
    """The peer's side of a ReFT handover: its own snapshot and parity block come from the leaving peer
    (REFT_FETCH), kept as its own; another stage's entry of `held` is a snapshot fetched as under other strategies."""
    from checkfree.baselines import Raim5Block
    from peers.daemon import PeerDaemon, PeerOptions

    net = MemoryNetwork()
    source, new = (PeerDaemon(PeerOptions(run_id="r", transport="memory")) for _ in range(2))
    for d in (source, new):
        d.membership.transport = MemoryTransport(net)
        d.hosted.configure(tiny_cfg, None)
        d.hosted.companion = True

    async def main():
        await source._register()
        source.hosted.serve(source.hosted.build(1), 0.0, 3)  # the leaving peer serves stage 1 until it has left
        source.snapshots.keep(1, 3, b"stage 1 at step 3")
        source.snapshots.parity.blocks = {3: Raim5Block(1, 3, b"parity of 1", (17, 17, 17))}
        moved = await new.snapshots.take_held(source.membership.me, {1: 3}, stage=1)
        assert moved == len(b"stage 1 at step 3") + len(b"parity of 1")
        assert new.snapshots.steps_held() == {1: 3} and bytes(new.snapshots.held[1][1]) == b"stage 1 at step 3"
        block = new.snapshots.parity.blocks[3]
        assert (block.holder, block.n, bytes(block.parity), block.state_lengths) == (1, 3, b"parity of 1", (17, 17, 17))

    try:
        asyncio.run(main())
    finally:
        for d in (source, new):
            d.compute.shutdown(wait=True)


def test_a_handover_skips_a_snapshot_the_leaving_peer_no_longer_has(tiny_cfg):
    """The handover's snapshots (AssignHandover.held, from the coordinator's ledger) are fetched from the leaving
    peer one by one: one it no longer has at that step (an incomplete snapshot round replaced it) is skipped, not
    a failed handover (which would turn a lossless leave into a recovery)."""
    from peers.daemon import PeerDaemon, PeerOptions

    net = MemoryNetwork()
    source, new = (PeerDaemon(PeerOptions(run_id="r", transport="memory")) for _ in range(2))
    for d in (source, new):
        d.membership.transport = MemoryTransport(net)
        d.hosted.configure(tiny_cfg, None)

    async def main():
        await source._register()
        source.snapshots.keep(0, 3, b"stage 0 at step 3")
        source.snapshots.keep(1, 4, b"stage 1 at step 4")  # the ledger says step 3: replaced since
        moved = await new.snapshots.take_held(source.membership.me, {0: 3, 1: 3}, stage=1)
        assert moved == len(b"stage 0 at step 3")
        assert new.snapshots.steps_held() == {0: 3} and bytes(new.snapshots.held[0][1]) == b"stage 0 at step 3"

    try:
        asyncio.run(main())
    finally:
        for d in (source, new):
            d.compute.shutdown(wait=True)


def test_a_baft_handover_takes_the_backups_in_flight_from_the_leaving_peer(tiny_cfg):
    """The peer's side of a BAFT handover: the backup the leaving peer was sending (its own stage's) and the parts
    of its predecessor's it was assembling come from it (BACKUP_FETCH), kept here in its place: the rest of its
    own is sent from here, the predecessor's last part completes it here, and BACKUP_COMMIT seals both."""
    from checkfree.messages import BackupCommit, BackupPart, BackupShare
    from peers.daemon import PeerDaemon, PeerOptions

    net = MemoryNetwork()
    source, new, holder = (PeerDaemon(PeerOptions(run_id="r", transport="memory")) for _ in range(3))
    for d in (source, new, holder):
        d.membership.transport = MemoryTransport(net)
        d.hosted.configure(tiny_cfg, None)
    own, pred = bytes(range(200)) * 5, bytes(reversed(range(200))) * 3  # stage 1's backup, stage 0's

    async def main():
        for d in (source, new, holder):
            await d._register()
        source.hosted.serve(source.hosted.build(1), 0.0, 3)  # the leaving peer serves stage 1 until it has left
        source.backups.sending = (3, own)
        await source.backups.on_backup_part(BackupPart(owner=0, step=3, offset=0, total=len(pred)),
                                            [torch.frombuffer(bytearray(pred[:250]), dtype=torch.uint8)], None)
        source.backups.assembling[2] = (2, bytearray(10), {0: 10})  # a backup of another step: not in flight
        moved = await new.backups.take_over(source.membership.me, 3)
        assert moved == len(own) + len(pred)
        assert new.backups.sending == (3, own) and set(new.backups.assembling) == {0}
        new.hosted.serve(new.hosted.build(1), 0.0, 3)
        holder.hosted.serve(holder.hosted.build(2), 0.0, 3)
        await new.backups.on_backup_part(BackupPart(owner=0, step=3, offset=250, total=len(pred)),
                                         [torch.frombuffer(bytearray(pred[250:]), dtype=torch.uint8)], None)
        share = BackupShare(step=3, part=0, holders={1: holder.membership.me}, holder_stages={1: 2},
                            bounds={1: (0.0, 1.0)})
        await new.backups.send_part(share)
        assert (await new.backups.on_backup_commit(BackupCommit(step=3), [], None))[0].held == [0, 1]
        assert (await holder.backups.on_backup_commit(BackupCommit(step=3), [], None))[0].held == [1]
        assert bytes(new.snapshots.held[0][1]) == pred and bytes(new.snapshots.held[1][1]) == own
        assert bytes(holder.snapshots.held[1][1]) == own
        # a leaving peer with nothing in flight at that step: nothing taken, the handover goes on
        assert await holder.backups.take_over(source.membership.me, 5) == 0

    try:
        asyncio.run(main())
    finally:
        for d in (source, new, holder):
            d.compute.shutdown(wait=True)

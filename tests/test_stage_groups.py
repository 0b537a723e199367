"""Stage groups (several replicas per stage) in the in-process tier: the real coordinator and peers, gloo for the
gradient reduce, kills injected at the point a SIGKILL would land (mid-step, mid-reduce, a whole group). Each run
is compared with the simulator's for the same config and trace. The subprocess test with real SIGKILLs is in
tests/test_swarm.py."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkfree.failures import FailureSchedule
from checkfree.stage_groups import hop_table, move, slowest, spread
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator
from harness.inprocess import run_swarm

pytestmark = pytest.mark.timeout(240)


def _cfg(tiny_cfg, strategy: str = "checkfree", replicas: int = 2, steps: int = 5):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy = strategy
    cfg.train.num_steps, cfg.train.eval_every = steps, 0
    cfg.train.replicas = replicas
    return cfg


def _simulate(cfg, out: Path, trace: str = "") -> dict:
    cfg = copy.deepcopy(cfg)
    if trace:
        path = out.parent / f"{out.name}-trace.csv"
        path.write_text("step,stage\n" + trace)
        cfg.failures.trace = str(path)
    return Simulator(cfg, out, progress=False).run()


def _events(out: Path, *kinds: str) -> list[dict]:
    return [e for e in read_jsonl(out / "events.jsonl") if e["event"] in kinds]


def _same_losses(a: Path, b: Path) -> None:
    ma, mb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5), (x["step"], x["loss"], y["loss"])


def _finals(dump: Path, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """The final weights and Adam state of every replica of `stage` that lived to the end, by peer id."""
    out = {}
    for f in sorted(dump.glob(f"final-stage{stage}-*.safetensors")):
        if f.name.endswith("-optim.safetensors"):
            continue
        pid = f.name[len(f"final-stage{stage}-"):-len(".safetensors")]
        out[pid] = {**load_file(str(f)), **{"optim/" + k: v for k, v in
                                            load_file(str(dump / f"final-stage{stage}-{pid}-optim.safetensors")).items()}}
    return out


def _identical(states: dict[str, dict[str, torch.Tensor]]) -> None:
    assert len(states) >= 2, states.keys()
    first, *rest = states.values()
    for other in rest:
        assert first.keys() == other.keys()
        for k in first:
            assert torch.equal(first[k], other[k]), k


def test_spread_balances_by_speed_and_interleaves():
    assert spread(4, ["a", "b"]) == ["a", "b", "a", "b"]
    assert spread(6, ["a", "b"], {"a": 2.0, "b": 1.0}).count("a") == 4  # twice as fast: twice the share
    assert spread(4, ["a", "b"], {"a": 100.0, "b": 1.0}) == ["a", "b", "a", "a"]  # one each: b stays measured
    assert spread(3, ["a", "b", "c", "d"]) == ["a", "b", "c"]  # more replicas than microbatches: some idle
    hops = hop_table([[0, 1], [1, 0]], {0: ["a", "b"], 1: ["c"]})
    assert hops == [["a", "c"], ["c", "b"]]
    assert move(hops, "b", "a") == [1] and hops == [["a", "c"], ["c", "a"]]
    assert slowest({0: ["a"], 1: ["b", "c"]}, 4, {}) == 0  # unmeasured: the fewest replicas
    assert slowest({0: ["a"], 1: ["b", "c"]}, 4, {"a": 10.0, "b": 1.0, "c": 1.0}) == 1  # measured: the slowest


@pytest.mark.parametrize("strategy", ["checkfree", "checkfree+"])
def test_two_replicas_per_stage_train_like_the_simulator_and_stay_identical(tiny_cfg, tmp_path, strategy):
    """No failures: the replicas split every step's microbatches, sum their gradients, and the run's losses are
    the simulator's (one process, the same global batch); every stage's replicas end bit-identical."""
    cfg = _cfg(tiny_cfg, strategy, steps=4)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=2 * cfg.num_stages, save_final=False,
                      dump_dir=str(tmp_path / "dump"))
    _simulate(cfg, tmp_path / "sim")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    for m in read_jsonl(tmp_path / "swarm" / "metrics.jsonl"):
        assert m["replicas"] == [2] * cfg.num_stages and m["attempts"] == 1
        assert all(sum(c) == cfg.train.num_microbatches and len(c) == 2 for c in m["replica_microbatches"])
        assert all(x > 0 for x in m["reduce_s"])
    assert swarm.summary["replicas_lost"] == 0 and swarm.summary["stage_recoveries"] == 0
    for s in range(cfg.num_stages):
        _identical(_finals(tmp_path / "dump", s))


@pytest.mark.parametrize("strategy,stage", [("checkfree", 1), ("checkfree+", 0), ("checkfree+", 3)])
def test_a_replica_lost_mid_step_is_rerouted_without_an_abort(tiny_cfg, tmp_path, strategy, stage):
    """One replica dies after its first forward of step 2: its microbatches are redone by its sibling in the
    same step (no aborted attempt, no recovery) and the losses are those of a run without failures; a standby
    then joins the group with the sibling's exact state (one of the two spares: the other is kept for a stage
    recovery)."""
    cfg = _cfg(tiny_cfg, strategy)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=2 * cfg.num_stages + 2, save_final=False,
                      kills=FailureSchedule([(2, stage)]), dump_dir=str(tmp_path / "dump"))
    _simulate(cfg, tmp_path / "sim")  # no failure at all: a lost replica must not change the run
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    out = tmp_path / "swarm"
    assert not _events(out, "aborted_step", "failure", "recovery")
    (lost,) = _events(out, "replica_lost")
    (rerouted,) = _events(out, "rerouted")
    (done,) = _events(out, "reroute_done")
    assert done["peer_id"] == rerouted["to"] and done["microbatches"] == len(rerouted["microbatches"])
    assert 0 < done["since_lost_s"] < 60
    assert lost["stage"] == stage and lost["step"] == 2 and rerouted["from"] == lost["peer_id"]
    assert rerouted["microbatches"] and rerouted["to"] != lost["peer_id"]
    joined = [e for e in _events(out, "replica_joined") if e["step"] > 2]
    assert joined and joined[0]["stage"] == stage and joined[0]["source"] == rerouted["to"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["attempts"] == 1 for m in metrics)
    assert metrics[2]["replicas"][stage] == 1 and metrics[3]["replicas"][stage] == 2
    assert swarm.summary["replicas_lost"] == 1 and swarm.summary["stage_recoveries"] == 0
    assert swarm.summary["rerouted_microbatches"] == len(rerouted["microbatches"])
    _identical(_finals(tmp_path / "dump", stage))  # the sibling and the newcomer


def test_a_whole_group_lost_is_recovered_by_checkfree_from_the_neighbouring_groups(tiny_cfg, tmp_path):
    """Both replicas of stage 2 die at step 2 (`2,2,all`): a stage failure, rebuilt by CheckFree from the
    neighbouring groups' norms, with the simulator's coefficients and losses."""
    cfg = _cfg(tiny_cfg)
    run_swarm(cfg, tmp_path / "swarm", peers=2 * cfg.num_stages + 1, save_final=False,
              kills=FailureSchedule([(2, 2)], {(2, 2)}))
    _simulate(cfg, tmp_path / "sim", "2,2,all\n")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    (rec,) = _events(tmp_path / "swarm", "recovery")
    (sim,) = _events(tmp_path / "sim", "recovery")
    assert rec["stage"] == 2 and rec["sources"] == [1, 3] == sim["sources"]
    assert rec["coefficients"] == pytest.approx(sim["coefficients"], rel=1e-5)
    assert not _events(tmp_path / "swarm", "replica_lost", "rerouted")


def test_a_replica_killed_mid_reduce_never_leaves_a_partly_summed_gradient(tiny_cfg, tmp_path):
    """Three replicas per stage; one of stage 2's dies after the first of two buckets of step 2's all-reduce (the survivors'
    first bucket is summed, their second is not). They restore their own gradients, the dead one's microbatches
    are redone by a sibling, the smaller group reduces again: the two survivors end bit-identical and the
    losses are the failure-free ones."""
    cfg = _cfg(tiny_cfg, replicas=3)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=3 * cfg.num_stages + 2, save_final=False,
                      reduce_kills=FailureSchedule([(2, 2)]), dump_dir=str(tmp_path / "dump"))
    _simulate(cfg, tmp_path / "sim")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    out = tmp_path / "swarm"
    (kill,) = _events(out, "chaos_kill")
    assert kill["during"] == "reduce" and kill["stage"] == 2
    (lost,) = _events(out, "replica_lost")
    assert lost["peer_id"] == kill["peer_id"] and not _events(out, "aborted_step", "failure")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics[1]["replicas"][2] == 3 and metrics[2]["replicas"][2] == 2
    assert all(m["attempts"] == 1 for m in metrics)
    assert len(_finals(tmp_path / "dump", 2)) == 3  # the survivors and the spare that joined after step 2
    _identical(_finals(tmp_path / "dump", 2))
    assert swarm.summary["replicas_lost"] == 1


def test_a_standby_beyond_the_reserve_joins_the_slowest_stage(tiny_cfg, tmp_path):
    """One peer per stage, stage 2 slowed down, one peer more and no reserve: once every stage's speed is measured
    (after step 0), the extra peer joins stage 2's group with its sibling's exact state; after the next steps both
    replicas of stage 2 are bit-identical, and the losses are still the simulator's."""
    cfg = _cfg(tiny_cfg, replicas=1, steps=4)
    cfg.train.reserve = 0
    run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 1, save_final=False, slow={2: (0.05, 0)},
              dump_dir=str(tmp_path / "dump"))
    _simulate(cfg, tmp_path / "sim")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    (joined,) = _events(tmp_path / "swarm", "replica_joined")
    assert joined["stage"] == 2 and joined["step"] == 1
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert metrics[0].get("replicas", [1] * 4) == [1, 1, 1, 1] and metrics[1]["replicas"] == [1, 1, 2, 1]
    _identical(_finals(tmp_path / "dump", 2))


def test_with_no_standby_left_a_replica_of_another_group_rebuilds_a_lost_stage(tiny_cfg, tmp_path):
    """No spare peer: when stage 2's whole group is lost, a replica of another group lets its stage go and
    rebuilds stage 2 (its group keeps one replica); the run goes on with the simulator's losses."""
    cfg = _cfg(tiny_cfg)
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=2 * cfg.num_stages, save_final=False,
                      kills=FailureSchedule([(2, 2)], {(2, 2)}))
    _simulate(cfg, tmp_path / "sim", "2,2,all\n")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    (moved,) = _events(tmp_path / "swarm", "replica_moved")
    (rec,) = _events(tmp_path / "swarm", "recovery")
    assert moved["to_stage"] == 2 and moved["stage"] != 2 and rec["peer_id"] == moved["peer_id"]
    metrics = read_jsonl(tmp_path / "swarm" / "metrics.jsonl")
    assert sum(metrics[2]["replicas"]) == 2 * cfg.num_stages - 2 and metrics[2]["replicas"][moved["stage"]] == 1
    assert swarm.summary["stage_recoveries"] == 1


def test_a_replica_with_uncorrectable_soft_errors_leaves_its_group_without_a_recovery(tiny_cfg, tmp_path,
                                                                                      monkeypatch):
    """The first replica of stage 1 has faulty hardware (two faults in one guarded section of every attention
    call): its step fails after its recompute, the attempt is redone, and the second failure in a row retires that
    replica (soft_error_escalation). Its sibling holds the same state: the replica leaves the group, no stage is
    recovered, and the losses are the simulator's."""
    import peers.stage
    from checkfree.abft import AttentionGuard, FaultInjector

    faulty = FaultInjector.from_schedule([(c, "q", "nan", r, 0) for c in range(64) for r in (0, 5)])
    original, served = peers.stage.make_guard, []

    def make_guard(cfg, stage):
        if stage == 1 and not served:
            served.append(stage)
            return AttentionGuard(mode="range", injector=faulty)
        return original(cfg, stage)

    monkeypatch.setattr(peers.stage, "make_guard", make_guard)
    cfg = _cfg(tiny_cfg, steps=3)
    cfg.guard.abft = True
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=2 * cfg.num_stages, save_final=False)
    _simulate(cfg, tmp_path / "sim")
    _same_losses(tmp_path / "swarm", tmp_path / "sim")
    out = tmp_path / "swarm"
    kinds = [e["event"] for e in _events(out, "soft_error_skip", "soft_error_escalation", "replica_lost", "recovery")]
    assert kinds == ["soft_error_skip", "soft_error_skip", "soft_error_escalation", "replica_lost"]
    (lost,) = _events(out, "replica_lost")
    assert lost["stage"] == 1 and lost["reason"] == "retired"
    assert read_jsonl(out / "metrics.jsonl")[0]["attempts"] == 3 and swarm.summary["stage_recoveries"] == 0


def test_a_failed_reduce_answers_the_partner_stages_component_gradient_request_at_once(tiny_cfg):
    """Found timing the quick tier (dst's mid-reduce+partition schedule, step 1 took 20 s): under CheckFree+ a
    replica whose REDUCE failed (a sibling died in it) left the partner stage's COMPONENT_GRAD waiting for sums
    that never came, until the caller's RPC timeout; the coordinator's retry waited behind it. The request is
    refused as soon as the REDUCE failed, as a failed step (the partner is alive: nothing to report)."""
    import asyncio

    from checkfree.messages import ComponentGrad, Reduce
    from checkfree.pipeline import route
    from checkfree.protocol import StepFailed
    from peers.daemon import PeerDaemon, PeerOptions
    from peers.step import StepRun

    cfg = _cfg(tiny_cfg, strategy="checkfree+")
    daemon = PeerDaemon(PeerOptions(transport="memory"))
    daemon.hosted.configure(cfg, None)
    daemon.hosted.worker = daemon.hosted.build(1)
    assert daemon.passes.timeouts.step_timeout > 30  # the bound below: a wait for the sums would trip it
    m = cfg.train.num_microbatches
    routes = [route(cfg.num_stages, True, 0, mb, m) for mb in range(m)]
    run = StepRun(0, 0, False, {s: f"p{s}" for s in range(cfg.num_stages)}, routes, remaining=0,
                  hops=[["x"] * len(r) for r in routes], groups={s: [f"p{s}"] for s in range(cfg.num_stages)})
    run.done.set()

    def dies(*_):
        raise StepFailed("the gradient all-reduce of stage 1 failed: a member died")

    daemon.group._reduce = dies

    async def main():
        daemon.steps.start(run)
        with pytest.raises(StepFailed):
            await daemon.group.on_reduce(Reduce(step=0, attempt=0, prefix="g", rank=0, size=2, store=""), [], "c")
        with pytest.raises(StepFailed, match="gradient reduce of stage 1 failed here"):
            await asyncio.wait_for(daemon.passes.on_component_grad(ComponentGrad(step=0, attempt=0, comp="embed"),
                                                                   [], "p0"), 30)

    try:
        asyncio.run(main())
    finally:
        daemon.compute.shutdown(wait=True)


def test_a_pass_that_overtakes_the_reroute_moving_its_hop_here_waits_for_it(tiny_cfg):
    """Seen in the quick tier (CheckFree+, a replica lost mid-step, 1 run in ~10): the coordinator tells every
    other peer of a REROUTE before the sibling taking the lost replica's microbatches, so a neighbour's FORWARD for
    a moved hop reached that sibling first and was refused ('computed by replica <dead>, not by this peer'): the
    step was aborted. Such a pass now waits for the REROUTE; one for a hop that stays a sibling's is still refused
    (after the wait, bounded by rpc_timeout)."""
    import asyncio

    from types import SimpleNamespace

    from checkfree.messages import Forward
    from checkfree.pipeline import route
    from checkfree.protocol import ProtocolError
    from peers.daemon import PeerDaemon, PeerOptions
    from peers.step import StepRun

    cfg = _cfg(tiny_cfg)
    daemon = PeerDaemon(PeerOptions(transport="memory"))
    daemon.hosted.configure(cfg, None)
    daemon.hosted.worker = daemon.hosted.build(1)
    daemon.membership.transport = SimpleNamespace(peer_id="me")  # (no transport started: only its id is read)
    me = daemon.membership.me
    m = cfg.train.num_microbatches
    routes = [route(cfg.num_stages, False, 0, mb, m) for mb in range(m)]
    hops = [[f"s{h.stage}" if h.stage != 1 else ("dead" if mb == 0 else "other") for h in r]
            for mb, r in enumerate(routes)]
    run = StepRun(0, 0, False, {s: f"s{s}" for s in range(cfg.num_stages)}, routes, remaining=0, hops=hops,
                  groups={0: ["s0"], 1: [me, "dead", "other"], 2: ["s2"], 3: ["s3"]})
    daemon.passes.timeouts = dataclasses.replace(daemon.passes.timeouts, rpc_timeout=2.0, heartbeat_ttl=1.0)

    async def main():
        moved = asyncio.create_task(daemon.passes._hop(run, Forward(step=0, attempt=0, mb=0, hop=1)))
        await asyncio.sleep(0)
        assert not moved.done()  # waiting for the REROUTE, not refused
        run.reroute("dead", me, [0], me)
        assert await asyncio.wait_for(moved, 5) == (0, 1)
        with pytest.raises(ProtocolError, match="computed by replica other"):
            await daemon.passes._hop(run, Forward(step=0, attempt=0, mb=1, hop=1))

    try:
        asyncio.run(main())
    finally:
        daemon.compute.shutdown(wait=True)

"""Integration tests of the distributed runtime: real processes, real hivemind P2P on
loopback, real SIGKILLs (through `checkfree local`). The equivalence and SIGKILL-recovery tests
run over both RPC transports (`--transport hivemind` and `--transport libp2p`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkfree.recovery import checkfree_average
from checkfree.rundir import read_jsonl
from swarmrun import events, local as _local, run as _run, simulate as _simulate, trace as _trace

pytestmark = pytest.mark.timeout(400)


def _companions_left() -> list[int]:
    """This test session's reft snapshot companions still running."""
    mark = f"CHECKFREE_TEST_SESSION={os.environ['CHECKFREE_TEST_SESSION']}".encode()
    found = []
    for pid in subprocess.run(["pgrep", "-f", "peers.companion"], capture_output=True, text=True).stdout.split():
        try:
            if mark in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                found.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return found


def _swarm_with_references(tmp_path, cache, name: str, args: list[str], failures: list[str]):
    """`checkfree local` with `failures` (3 spares), and the simulator with (tmp_path/sim) and without them
    (tmp_path/clean); returns the swarm's run directory."""
    proc, out = _local(tmp_path, name, *args, *failures, cache=cache, spares=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _simulate(tmp_path, "sim", *args, *failures, cache=cache)
    _simulate(tmp_path, "clean", *args, cache=cache)
    return out


def _recoveries(out, fields: tuple[str, ...]) -> list[tuple]:
    """The run's recovery events, each as the tuple of `fields`."""
    return [tuple(e.get(k) for k in fields) for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovery"]


@pytest.fixture(scope="module")
def cache(session_cache):
    return session_cache


# tcp is slow (CI time): tests/test_benchmarks.py's vs-torch test trains tcp swarms (GPipe and 1F1B) whose losses must
# equal torch's pipeline step by step, and tests/test_tcp_transport.py covers the transport itself
# libp2p is slow too (CI time): a libp2p swarm still runs in tests/test_auth.py (with strangers refused), the transport
# in tests/test_libp2p_transport.py and tests/test_transport_contract.py, and 1F1B swarms against the simulator in
# tests/test_dst.py's generated schedules (the in-process tier)
@pytest.mark.parametrize("rpc_transport", ["hivemind", pytest.param("libp2p", marks=pytest.mark.slow),
                                           pytest.param("tcp", marks=pytest.mark.slow)], indirect=True)
def test_swarm_equals_simulator_without_failures(tmp_path, cache, rpc_transport):
    """CLI smoke test of `checkfree local`, and the equivalence with the simulator. The libp2p run also
    uses the 1F1B schedule with M=16 (one swarm run covers both; the CI time budget is tight)."""
    args = ["--steps", "10", "--seed", "3", "--eval-every", "5", "--strategy", "checkfree+"]
    one_f_one_b = rpc_transport == "libp2p"
    if one_f_one_b:
        args += ["--schedule", "1f1b", "--microbatches", "16"]
    proc, out = _local(tmp_path, "swarm", *args, "--transport", rpc_transport, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "peers SIGKILLed" in proc.stdout and f"transport {rpc_transport}" in proc.stdout
    ready = (out / "logs" / "coordinator.log").read_text()
    assert (f"transport={rpc_transport} rpc=/ip4/127.0.0.1/" in ready) == (rpc_transport != "hivemind")
    a, b = read_jsonl(out / "metrics.jsonl"), _simulate(tmp_path, "sim", *args, cache=cache)
    assert [m["step"] for m in a] == list(range(10))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5)
        assert x["grad_norms"] == pytest.approx(y["grad_norms"], rel=1e-4, abs=1e-6)
    assert a[4]["val_loss"] == pytest.approx(b[4]["val_loss"], rel=1e-5)
    for m in a:  # every stage reports what it held: GPipe at most the step's M=4 microbatches at once; 1F1B
        # admits at most S=4 at each first hop, and CheckFree+ has two first hops (stages 0 and 1 swap for
        # half the microbatches), so a stage holds at most 2 S = 8 of the M=16
        assert len(m["inflight_peak"]) == 4 and all(1 <= n <= (8 if one_f_one_b else 4) for n in m["inflight_peak"])
        assert all(n > 0 for n in m["activation_peak_bytes"]) and all(n > 2**26 for n in m["peak_rss_bytes"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["failures"] == 0
    # the finished run's weights export into one file that loads as the full model
    env = {**os.environ, "CHECKFREE_CACHE": cache}  # (local's and simulate's: forked by the module's fork server)
    exp = _run(["export", "--run", str(out), "--output", str(tmp_path / "model.safetensors")], env, 120)
    assert exp.returncode == 0, exp.stdout
    from checkfree.export import load_export

    model = load_export(tmp_path / "model.safetensors")
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 512)


# libp2p is slow (CI time): the same recovery runs over hivemind here, and a whole swarm over libp2p (1F1B) in
# test_swarm_equals_simulator_without_failures[libp2p]
# slow (CI time): the quick tier's smoke run (tests/test_smoke.py) SIGKILLs two stages of a real hivemind swarm and
# rebuilds the intermediate one by the same averaging, and test_inprocess's kill test checks plain CheckFree's
# rebuild (coefficients, losses) against the simulator; its SIGTERM handover: dst's in-process schedules draw
# SIGTERMs (handovers) against the simulator, and test_hostile_input signals a real peer process
@pytest.mark.slow
@pytest.mark.parametrize("rpc_transport", ["hivemind", pytest.param("libp2p", marks=pytest.mark.slow)], indirect=True)
def test_sigkill_intermediate_stage_recovered_by_checkfree(tmp_path, cache, rpc_transport):
    """Also: a SIGTERM (preemption notice) of stage 1 at step 3 is a lossless handover, not a failure."""
    dump = tmp_path / "dump"
    proc, out = _local(tmp_path, "kill", "--steps", "12", "--trace", _trace(tmp_path, [(6, 2)]),
                       "--preempt-trace", _trace(tmp_path, [(3, 1)]), "--dump-recovery", str(dump),
                       "--transport", rpc_transport, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 peers SIGKILLed, 1 SIGTERMed" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == 1 and summary["recoveries"] == 1 and math.isfinite(summary["final_loss"])
    events = read_jsonl(out / "events.jsonl")
    (fail,) = [e for e in events if e["event"] == "failure"]
    (rec,) = [e for e in events if e["event"] == "recovery"]
    assert (fail["step"], fail["stage"]) == (6, 2)
    assert (rec["step"], rec["stage"], rec["sources"], rec["method"]) == (6, 2, [1, 3], "average")
    # the replacement's weights are the library's function of what the neighbours held then
    prev = load_file(str(dump / "served-step6-stage1-blocks.safetensors"))
    nxt = load_file(str(dump / "served-step6-stage3-blocks.safetensors"))
    pn = json.loads((dump / "served-step6-stage1-blocks.json").read_text())["omega"]
    nn_ = json.loads((dump / "served-step6-stage3-blocks.json").read_text())["omega"]
    assert rec["norms"] == pytest.approx([pn, nn_]) and pn > 0 and nn_ > 0
    expect = checkfree_average(prev, nxt, prev_norm=pn, next_norm=nn_)
    rebuilt = load_file(str(dump / "rebuilt-step6-stage2.safetensors"))
    assert rebuilt.keys() == expect.keys()
    for k in expect:
        assert torch.equal(rebuilt[k], expect[k]), k
    a, b = nn_ + 1e-4, pn + 1e-4
    assert rec["coefficients"] == pytest.approx([b / (a + b), a / (a + b)])
    losses = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    (leave,) = [e for e in events if e["event"] == "leave"]
    (hand,) = [e for e in events if e["event"] == "handover"]
    assert leave["handover"] and (hand["step"], hand["stage"]) == (3, 1) and hand["bytes"] > 0
    assert hand["source_peer"] == leave["peer_id"] and hand["peer_id"] != leave["peer_id"]


# slow (CI time): the smoke run SIGKILLs stage 0 of a real CheckFree+ swarm (rebuilt by a copy with its embedding),
# test_inprocess's kill test loses CheckFree+'s last stage against the simulator, and the golden check compares
# CheckFree+'s edge recoveries (edge_sources) with the simulator's
@pytest.mark.slow
def test_sigkill_first_and_last_stage_under_checkfree_plus(tmp_path, cache):
    dump = tmp_path / "dump"
    proc, out = _local(tmp_path, "edges", "--steps", "12", "--strategy", "checkfree+",
                       "--trace", _trace(tmp_path, [(4, 0), (8, 3)]), "--dump-recovery", str(dump), cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovery"]
    assert [(e["step"], e["stage"], e["method"], e["sources"]) for e in rec] == [(4, 0, "copy", [1]), (8, 3, "copy", [2])]
    assert rec[0]["edge_sources"] == {"embed": 1} and rec[1]["edge_sources"] == {"head": 2}
    first = load_file(str(dump / "rebuilt-step4-stage0.safetensors"))
    emb = load_file(str(dump / "served-step4-stage1-embed.safetensors"))
    blocks1 = load_file(str(dump / "served-step4-stage1-blocks.safetensors"))
    assert torch.equal(first["embed.weight"], emb["embed.weight"])
    assert all(torch.equal(first[k], v) for k, v in blocks1.items())
    last = load_file(str(dump / "rebuilt-step8-stage3.safetensors"))
    head = load_file(str(dump / "served-step8-stage2-head.safetensors"))
    assert all(torch.equal(last[k], v) for k, v in head.items()) and len(head) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recoveries"] == 2 and summary["fallbacks"] == 0 and math.isfinite(summary["final_loss"])
    # the replacement took the replica's Adam state too and no LR bump for it: at the end of the
    # run both holders still hold bit-identical weights and Adam state of each component
    for comp, holders in (("embed", (0, 1)), ("head", (2, 3))):
        w = [load_file(str(dump / f"final-stage{h}.safetensors")) for h in holders]
        o = [load_file(str(dump / f"final-stage{h}-optim.safetensors")) for h in holders]
        keys = sorted(k for k in w[0] if k.startswith(comp + "."))
        assert keys and keys == sorted(k for k in w[1] if k.startswith(comp + "."))
        for k in keys:
            assert torch.equal(w[0][k], w[1][k]), f"{comp} replicas differ at the end: {k}"
        okeys = sorted(k for k in o[0] if k.startswith(comp + "."))
        assert okeys == sorted(k for k in o[1] if k.startswith(comp + ".")) and len(okeys) == 3 * len(keys)
        for k in okeys:
            assert torch.equal(o[0][k], o[1][k]), f"{comp} Adam state differs at the end: {k}"
    for s in (0, 3):  # the rebuilt blocks train at LR x lr_scale
        assert json.loads((dump / f"final-stage{s}-optim.json").read_text())["lr_scale"] == pytest.approx(1.1)


@pytest.mark.timeout(700)
# slow (CI time): test_inprocess's rollback test runs gemini (snapshots in another peer's memory) and checkpoint (real
# files) between real PeerDaemons and checks the simulator's rollback, the re-run steps and the losses; the golden
# check compares the events
@pytest.mark.slow
def test_rollback_strategies_run_for_real_and_lose_nothing(tmp_path, cache):
    """gemini: snapshots really travel into other peers' memory; checkpoint: real files. A
    SIGKILL rolls every stage back and the lost steps are recomputed: the run ends with the
    weights of a failure-free run (to float tolerance: the swarm's gradient accumulation
    order depends on message arrival)."""
    env = {**__import__("os").environ, "CHECKFREE_CACHE": cache}
    sim = subprocess.run([sys.executable, "-m", "checkfree", "simulate", "--out", str(tmp_path / "sim"),
                          "--no-progress", "--steps", "12", "--strategy", "checkfree"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert sim.returncode == 0, sim.stderr[-2000:]
    ref_losses = [m["loss"] for m in read_jsonl(tmp_path / "sim" / "metrics.jsonl")]
    for strategy, flags, target in (("gemini", ["--snapshot-every", "3"], 6),
                                    ("checkpoint", ["--checkpoint-every", "4"], 4)):
        proc, out = _local(tmp_path, strategy, "--steps", "12", "--strategy", strategy, *flags,
                           "--trace", _trace(tmp_path, [(7, 2)]), cache=cache)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        events = read_jsonl(out / "events.jsonl")
        (rec,) = [e for e in events if e["event"] == "recovery"]
        assert (rec["stage"], rec["method"], rec["rollback_to"], rec["lost_steps"]) == (2, "rollback", target, 7 - target)
        snaps = [e for e in events if e["event"] == "snapshot" and e["complete"]]
        assert snaps and all(e["bytes"] > 0 for e in snaps)
        if strategy == "gemini":
            assert all(e["kind"] == "memory" and e["sent"] > 0 for e in snaps)
        else:
            assert all(e["kind"] == "storage" for e in snaps)
            # the simulator's layout (checkfree.strategies.storage): only the last complete checkpoint, sealed
            assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000012"]
            assert sorted(p.name for p in (out / "checkpoints" / "step-00000012").iterdir()) == [
                f"stage-{i}.bin" for i in range(4)]
        metrics = read_jsonl(out / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(7)) + list(range(target, 12))
        final = {m["step"]: m["loss"] for m in metrics}
        assert [final[s] for s in range(12)] == pytest.approx(ref_losses, rel=1e-5)
        weights = load_file(str(out / "final_weights.safetensors"))
        if strategy == "gemini":
            first = weights
        else:  # two different failure histories, one final state
            for k, v in weights.items():
                torch.testing.assert_close(v, first[k], rtol=1e-4, atol=1e-5)


# slow (CI time): test_inprocess's omega test runs the same failure with --omega-scope blocks between real
# PeerDaemons and checks the same norms, coefficients and losses against the simulator
@pytest.mark.slow
def test_omega_over_the_blocks_only_in_swarm_and_simulator(tmp_path, cache):
    """--omega-scope blocks: stage 1's replacement averages stage 0 and stage 2 by their blocks' gradient norms
    (stage 0's embedding excluded), in the swarm exactly as in the simulator; metrics carry both norms."""
    from swarmrun import simulate

    args = ("--steps", "6", "--trace", _trace(tmp_path, [(4, 1)]), "--omega-scope", "blocks", "--eval-every", "0")
    proc, out = _local(tmp_path, "blocks", *args, cache=cache, spares=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = simulate(tmp_path, "sim", *args, cache=cache)
    swarm = read_jsonl(out / "metrics.jsonl")
    (rec,) = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovery"]
    (sim_rec,) = [e for e in read_jsonl(tmp_path / "sim" / "events.jsonl") if e["event"] == "recovery"]
    from test_inprocess import omega_over_blocks_alike

    omega_over_blocks_alike(swarm, sim, rec, sim_rec)


# slow (CI time): test_inprocess's identity test runs the same adjacent losses (as the strategy and as the fallback)
# between real PeerDaemons and checks the simulator's losses and events and the zeroed output projections
@pytest.mark.slow
def test_identity_for_real_rebuilds_adjacent_losses_as_pass_throughs(tmp_path, cache):
    """`checkfree local --strategy identity` with real SIGKILLs over hivemind, against `checkfree simulate`:
    stages 1 and 2, killed together at step 3, come back as pass-throughs (their blocks' residual output
    projections zero; no neighbour is read), with the simulator's recovery events and losses."""
    dump = tmp_path / "dump"
    args = ("--steps", "5", "--strategy", "identity", "--trace", _trace(tmp_path, [(3, 1), (3, 2)]),
            "--eval-every", "0")
    proc, out = _local(tmp_path, "identity", *args, "--dump-recovery", str(dump), cache=cache, spares=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 peers SIGKILLed" in proc.stdout
    sim = _simulate(tmp_path, "sim", *args, cache=cache)
    fields = ("event", "step", "stage", "method", "sources", "coefficients", "edges_reinit")
    got, want = ([tuple(e.get(k) for k in fields) for e in read_jsonl(d / "events.jsonl")
                  if e["event"] in ("recovery", "fallback")] for d in (out, tmp_path / "sim"))
    assert got == want == [("recovery", 3, s, "identity", [], [], []) for s in (1, 2)]
    for stage in (1, 2):
        rebuilt = load_file(str(dump / f"rebuilt-step3-stage{stage}.safetensors"))
        outputs = [v for k, v in rebuilt.items() if k.endswith(("attn.wo.weight", "mlp.w2.weight"))]
        assert len(outputs) == 4 and not any(v.any() for v in outputs)
    assert [m["loss"] for m in read_jsonl(out / "metrics.jsonl")] == pytest.approx([m["loss"] for m in sim],
                                                                                   rel=1e-5, abs=1e-5)


# slow (CI time): test_inprocess's int8 test runs the same int8 wire between real PeerDaemons (every message encoded
# by the wire format) against the simulator and checks the same quarter of the bytes
@pytest.mark.slow
def test_int8_wire_in_the_swarm_equals_the_simulator(tmp_path, cache):
    """--wire-dtype int8: peers send int8 activations/gradients with row scales (checkfree.wirecodec), the
    simulator applies the same round trip at each stage boundary, so both give the same losses; a step
    moves about a quarter of a float32 step's bytes."""
    from swarmrun import simulate

    args = ("--steps", "4", "--eval-every", "0", "--wire-dtype", "int8")
    proc, out = _local(tmp_path, "int8", *args, cache=cache, spares=0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = simulate(tmp_path, "sim", *args, cache=cache)
    swarm = read_jsonl(out / "metrics.jsonl")
    assert [m["loss"] for m in swarm] == pytest.approx([m["loss"] for m in sim], rel=1e-5)
    proc32, out32 = _local(tmp_path, "f32", "--steps", "1", "--eval-every", "0", cache=cache, spares=0)
    assert proc32.returncode == 0, proc32.stdout[-3000:]
    ratio = swarm[0]["wire_bytes"] / read_jsonl(out32 / "metrics.jsonl")[0]["wire_bytes"]
    assert 0.2 < ratio < 0.35, ratio


# slow (CI time): test_inprocess's snapshot test runs the same restores between real PeerDaemons and checks them bit
# for bit, the golden check compares its events with the simulator's, and SIGKILLed real processes are recovered in
# the quick tier's smoke run (tests/test_smoke.py)
@pytest.mark.slow
def test_checkfree_plus_snap_restores_from_a_neighbours_snapshot_for_real(tmp_path, cache):
    """checkfree+snap with real processes and SIGKILLs: stage 1 restored from stage 2's peer's copy of the
    step-4 snapshot, stage 2 from stage 3's copy of step 6 (taking stage 1's snapshot with it), then stage 1
    averaged; the same events and losses as the simulator. (Bit-exactness of the restore: test_inprocess.)"""
    args = ["--steps", "8", "--strategy", "checkfree+snap", "--snapshot-every", "2",
            "--trace", _trace(tmp_path, [(5, 1), (6, 2), (7, 1)])]
    proc, out = _local(tmp_path, "snap", *args, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _simulate(tmp_path, "sim", *args, cache=cache)
    fields = ("step", "stage", "method", "source", "snapshot_step", "lost_steps")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert got == want == [(5, 1, "snapshot", 2, 4, 0), (6, 2, "snapshot", 3, 6, 0), (7, 1, "average", None, None, None)]
    a, b = read_jsonl(out / "metrics.jsonl"), read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    assert [m["step"] for m in a] == list(range(8))
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)


# slow (CI time): test_inprocess's snap test streams, restores and falls back between real PeerDaemons (the decoded
# copy checked bit for bit, the simulator's events and losses), and SIGKILLed real processes are recovered in
# the quick tier's smoke run (tests/test_smoke.py)
@pytest.mark.slow
def test_snap_streams_compressed_copies_and_restores_from_them_for_real(tmp_path, cache):
    """snap with real processes and SIGKILLs: stage 1 restored from its int4 copy at stage 2's peer, then stage 2
    (its holder) from its own copy at stage 3's, then stage 1, whose copy went with stage 2's peer, rebuilt by
    CheckFree; the simulator's events and losses."""
    args = ["--steps", "8", "--strategy", "snap", "--snapshot-every", "2", "--snapshot-format", "int4",
            "--snapshot-group", "16", "--trace", _trace(tmp_path, [(3, 1), (5, 2), (6, 1)])]
    proc, out = _local(tmp_path, "snap", *args, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _simulate(tmp_path, "sim", *args, cache=cache)
    fields = ("step", "stage", "method", "source", "snapshot_step", "copy_format")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert got == want == [(3, 1, "snapshot", 2, 2, "int4"), (5, 2, "snapshot", 3, 4, "int4")]
    a, b = read_jsonl(out / "metrics.jsonl"), read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
    assert [e["method"] for e in read_jsonl(out / "events.jsonl") if e["event"] == "fallback"] == ["average"]


# slow (CI time): test_inprocess's redundant test runs the same three kills between real PeerDaemons (promotions,
# no attempt aborted, failure-free losses) and the golden check compares the events with the simulator's
@pytest.mark.slow
def test_redundant_computation_for_real_promotes_replicas_and_loses_nothing(tmp_path, cache):
    """Bamboo with real processes: three non-adjacent SIGKILLs (stages 1, 3, 0) each repaired by promoting the
    predecessor's replica; no attempt aborted, no step lost, the simulator's events, and the losses of a
    failure-free run (the simulator's without the trace: redundant computation is lossless)."""
    args = ["--steps", "8", "--strategy", "redundant"]
    failures = ["--trace", _trace(tmp_path, [(2, 1), (4, 3), (6, 0)])]
    out = _swarm_with_references(tmp_path, cache, "red", args, failures)
    fields = ("step", "stage", "method", "source", "lost_steps")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert got == want == [(2, 1, "promote-replica", 0, 0), (4, 3, "promote-replica", 2, 0),
                           (6, 0, "promote-replica", 3, 0)]
    a = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in a] == list(range(8)) and all(m["attempts"] == 1 for m in a)
    for ref in ("sim", "clean"):
        b = read_jsonl(tmp_path / ref / "metrics.jsonl")
        assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5), ref
    assert all(r > 0 for m in a for r in m["redundant_s"]) and all(n > 0 for m in a for n in m["replica_bytes"])


# slow (CI time): test_inprocess's two BAFT tests send the backups in the bubbles between real PeerDaemons and roll
# back like the simulator; the golden check compares the events
@pytest.mark.slow
def test_baft_for_real_rolls_back_to_the_backups_sent_in_the_bubbles(tmp_path, cache):
    """BAFT with real processes: backups travel in the bubbles; three non-adjacent SIGKILLs (iterations 3, 6, 8:
    stages 1, 3, 0) roll every stage back to the last complete backup, as the simulator does (same targets,
    same lost steps), and the run ends with the losses of a failure-free run."""
    args = ["--steps", "10", "--strategy", "baft"]
    failures = ["--trace", _trace(tmp_path, [(3, 1), (6, 3), (8, 0)])]
    out = _swarm_with_references(tmp_path, cache, "baft", args, failures)
    fields = ("step", "stage", "method", "rollback_to", "lost_steps")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert got == want and [g[1] for g in got] == [1, 3, 0] and all(g[4] > 0 for g in got)
    snaps = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "snapshot"]
    assert snaps and all(e["kind"] == "backup" and e["complete"] for e in snaps)
    final = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    clean = [m["loss"] for m in read_jsonl(tmp_path / "clean" / "metrics.jsonl")]
    assert [final[s] for s in range(10)] == pytest.approx(clean, rel=1e-5)


# slow: test_inprocess's reft test covers the same three kills (the rebuilt parity block included) in seconds, and
# the crash test below decodes a SIGKILLed process group from parity with real processes
@pytest.mark.slow
def test_reft_for_real_decodes_lost_members_from_parity(tmp_path, cache):
    """REFT with real processes: snapshots and parity blocks held in the peers' memory; SIGKILLs of stages 1, 2
    (before the next snapshot: decoded with the parity block stage 1's replacement rebuilt) and 0, each decoded
    bit for bit from the group's survivors; the simulator's rollbacks and lost steps; the failure-free losses."""
    args = ["--steps", "10", "--strategy", "reft", "--snapshot-every", "2"]
    failures = ["--trace", _trace(tmp_path, [(3, 1), (4, 2), (8, 0)])]
    out = _swarm_with_references(tmp_path, cache, "reft", args, failures)
    fields = ("step", "stage", "method", "rollback_to", "lost_steps", "source")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert [g[:5] for g in got] == [w[:5] for w in want] and [g[1] for g in got] == [1, 2, 0]
    assert all(g[5] == "parity" for g in got)
    final = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    clean = [m["loss"] for m in read_jsonl(tmp_path / "clean" / "metrics.jsonl")]
    assert [final[s] for s in range(10)] == pytest.approx(clean, rel=1e-5)


# slow until it has passed repeatedly under load with fb03715: its two failures under load had one cause, found at
# 5 CPU burners (load ~8): a REFT_CHUNK lost as the peer adopted its stream with 64 KiB or more already buffered
# (checkfree.net.framed, fixed in fb03715), so a snapshot round was left incomplete (SNAPSHOT timed out after 90 s):
# round 2 gave CI's 'stage 2 also recovered at step 3, both from init' (seen here too); round 4 left incomplete
# explains the rollback's 'no own snapshot of stage 0 at step 2' (inferred, the in-process test reproduces the
# message; an incomplete round no longer takes the rollback's copies away: 029bd7e; the quick covers are
# tests/test_reft_rounds.py and tests/test_framed.py). The companion serving a crashed training process runs only here
@pytest.mark.slow
def test_reft_restores_a_crashed_training_process_from_its_companion_and_a_dead_peer_from_parity(tmp_path, cache):
    """REFT's two kinds of death, with real processes: at iteration 3 only stage 1's training process is SIGKILLed
    (its snapshot companion lives on): the replacement takes the snapshot and parity block from the companion; at
    iteration 6 stage 2's whole process group is SIGKILLed (companion included): the replacement decodes it from
    the group's parity. Both roll every stage back as the simulator does, with its losses; every snapshot round
    completes; no companion process outlives the run."""
    args = ["--steps", "7", "--strategy", "reft", "--snapshot-every", "2"]
    proc, out = _local(tmp_path, "reft-crash", *args, "--crash-trace", _trace(tmp_path, [(3, 1)]),
                       "--trace", _trace(tmp_path, [(6, 2)]), cache=cache, spares=2)  # (a spare for each loss)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rounds = [(e["step"], e["complete"]) for e in events(out, "snapshot")]
    assert all(complete for _, complete in rounds), (rounds, [line for line in (
        out / "logs" / "coordinator.log").read_text().splitlines() if "snapshot of step" in line])
    sim = _simulate(tmp_path, "sim", *args, "--trace", _trace(tmp_path, [(3, 1), (6, 2)]), cache=cache)
    fields = ("step", "stage", "method", "rollback_to", "lost_steps", "source", "restored_from")
    got, want = _recoveries(out, fields), _recoveries(tmp_path / "sim", fields)
    assert [g[:6] for g in got] == [w[:6] for w in want]  # the same plan: decoded from parity
    assert [(g[1], g[6]) for g in got] == [(1, "companion"), (2, None)]  # ...the lost peer's companion served it
    # every step's loss as the simulator's, the steps rolled back and run again included; the simulator's REFT ends
    # with the failure-free run's weights (test_strategies' test_lossless_strategy_matches_failure_free_run)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [m["step"] for m in sim] == [0, 1, 2, 2, 3, 4, 4, 5, 6]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in sim], rel=1e-5)
    assert not _companions_left(), "a snapshot companion outlived the run"


# slow (CI time): test_stage_groups runs the same losses between real PeerDaemons (a replica lost mid-step rerouted,
# one killed mid-reduce, a whole group rebuilt by CheckFree, replicas bit-identical), and
# test_partial_failures' stage-group test reduces with gloo across real processes in network namespaces and loses
# a replica
@pytest.mark.slow
def test_stage_groups_for_real_lose_replicas_without_an_abort(tmp_path, cache):
    """Two replicas per stage as real processes (hivemind, gloo): one replica of stage 1 SIGKILLs its process
    group after its first forward of step 2, one of stage 2 half-way through step 4's all-reduce (rerouted,
    no aborted attempt, no recovery), both replicas of stage 2 are SIGKILLed at step 6 (`6,2,all`: a CheckFree
    recovery from the neighbouring groups). The losses are the simulator's for the same trace, the survivors'
    final states bit-identical within each group, and no process is left behind."""
    trace = tmp_path / "groups.csv"
    trace.write_text("step,stage\n2,1\n6,2,all\n")
    reduce_kill = _trace(tmp_path, [(4, 2)])
    args = ["--steps", "8", "--replicas", "2", "--eval-every", "4", "--trace", str(trace)]
    dump = tmp_path / "dump"
    proc, out = _local(tmp_path, "groups", *args, "--reduce-kill-trace", reduce_kill, "--dump-recovery", str(dump),
                       cache=cache, spares=3)  # 2 refill the groups after steps 2 and 4; 1 is kept for step 6
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 stages x 2 replicas + 3 spares" in proc.stdout and "4 peers SIGKILLed" in proc.stdout
    sim = _simulate(tmp_path, "sim", *args, cache=cache)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(8)) and all(m["attempts"] == 1 for m in metrics)
    for x, y in zip(metrics, sim):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5), (x["step"], x["loss"], y["loss"])
    assert [m["replicas"][1] for m in metrics[:4]] == [2, 2, 1, 2]
    assert [m["replicas"][2] for m in metrics[3:6]] == [2, 1, 2]  # (rebuilt at step 6: a spare joins when one is free)
    events = read_jsonl(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert "aborted_step" not in kinds
    lost = [(e["step"], e["stage"]) for e in events if e["event"] == "replica_lost"]
    assert lost == [(2, 1), (4, 2)]
    assert [(e["step"], e["stage"]) for e in events if e["event"] == "rerouted"] == [(2, 1), (4, 2)]
    (rec,) = [e for e in events if e["event"] == "recovery"]
    (sim_rec,) = [e for e in read_jsonl(tmp_path / "sim" / "events.jsonl") if e["event"] == "recovery"]
    assert (rec["step"], rec["stage"], rec["sources"]) == (6, 2, [1, 3])
    assert rec["coefficients"] == pytest.approx(sim_rec["coefficients"], rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["replicas_lost"], summary["stage_recoveries"]) == (2, 1) and summary["rerouted_microbatches"] > 0
    for stage in range(4):
        finals = sorted(p for p in dump.glob(f"final-stage{stage}-*.safetensors") if "optim" not in p.name)
        assert len(finals) >= (1 if stage == 2 else 2), finals
        first = load_file(str(finals[0]))
        for other in finals[1:]:
            assert all(torch.equal(first[k], v) for k, v in load_file(str(other)).items()), other.name

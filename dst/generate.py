"""Schedules drawn by `hypothesis` (generation and shrinking): a setup, then up to four faults that fit it.

Shrinking moves every choice toward the first option of its list or the low end of its range: the plainest
setup (CheckFree, two stages, one replica, GPipe, float32, three steps) and fewer, earlier faults. Which fault
kinds a setup draws from (`kinds_for`) is where the in-process tier's limits are written down.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from dst.schedule import AVERAGING, KILLS, SWARM_STRATEGIES, Fault, Kind, Schedule, Setup

__all__ = ["setups", "schedules", "kinds_for", "normalise", "MICROBATCHES"]

MICROBATCHES = 4  # the tiny preset's M
# strategies whose protection is taken at or after a commit (a snapshot, a checkpoint, a backup, the gradients
# shipped to a replica): a peer lost half-way through a commit also takes that step's protection with it, which
# the simulator's model (a failure at the start of the next step, after the protection) cannot express. For
# redundant computation this loses a step of the lost stage (docs/dst.md, "Found")
PROTECTED_AFTER_COMMIT = ("checkpoint", "gemini", "reft", "baft", "checkfree+snap", "redundant", "snap")
# snap's streams the simulator cannot follow: a handover streams the copies again (the simulator has none), and a
# new coordinator starts every stream over from a full update (docs/recovery.md, "snap")
RESTREAMED = (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART, Kind.SIGTERM)


def kinds_for(setup: Setup, tier: str = "inprocess") -> list[Kind]:
    """The fault kinds a tier ("inprocess", or "real": `checkfree local`, dst.real.REAL_KINDS) runs for `setup`."""
    kinds = [Kind.KILL_BEFORE_STEP, Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD, Kind.KILL_ADJACENT,
             Kind.KILL_MID_REBUILD, Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART, Kind.PARTITION,
             Kind.SLOW, Kind.SIGTERM, Kind.JOIN]
    if setup.strategy not in PROTECTED_AFTER_COMMIT:
        kinds.append(Kind.KILL_MID_COMMIT)
    if setup.strategy == "baft":  # a takeover loses the backup in flight (docs/dst.md, "Found")
        kinds = [k for k in kinds if k not in (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART)]
    if setup.strategy == "snap":
        kinds = [k for k in kinds if k not in RESTREAMED]
    if tier == "real":
        from dst.real import REAL_KINDS

        kinds = [k for k in kinds if k in REAL_KINDS]
    if setup.replicas > 1:
        kinds += [Kind.KILL_GROUP, Kind.KILL_MID_REDUCE]
    return kinds


@st.composite
def setups(draw: st.DrawFn, tier: str = "inprocess") -> Setup:
    """A setup; the real-process tier's are smaller (S x R + spares processes, each with its DHT and p2pd)."""
    from dst.run import setup_problem

    strategy = draw(st.sampled_from(SWARM_STRATEGIES))
    averaging = strategy in AVERAGING
    real = tier == "real"
    setup = Setup(
        strategy=strategy,
        stages=draw(st.integers(2, 4 if real else 6)),
        replicas=draw(st.integers(1, 2 if real else 3)) if averaging else 1,
        schedule=draw(st.sampled_from(("gpipe", "1f1b"))),
        wire_dtype=draw(st.sampled_from(("float32", "bfloat16", "float16", "int8"))),
        steps=draw(st.integers(3, 7)),
        fallback=draw(st.sampled_from(("abort", "copy", "random"))) if averaging or strategy == "redundant"
        else "abort",
        every=draw(st.integers(1, 3)),
        soft_errors=draw(st.integers(0, 3)),
        **(dict(snap_format=draw(st.sampled_from(("int8", "int4", "bf16", "float32"))),
                snap_moments=draw(st.booleans()), snap_budget=draw(st.sampled_from((0, 4096))),
                snap_rebuild=draw(st.sampled_from(("checkfree", "identity", "random"))))
           if strategy == "snap" else {}),
    )
    why = setup_problem(setup)
    assume(why is None)
    return setup


def normalise(f: Fault, setup: Setup) -> Fault:
    """`f` with the fields its kind does not use at their defaults and the others in range for `setup`."""
    kill = f.kind in KILLS or f.kind in (Kind.PARTITION, Kind.SLOW, Kind.SIGTERM)
    stage = min(f.stage, setup.stages - 2) if f.kind is Kind.KILL_ADJACENT else f.stage
    span = f.span if f.kind in (Kind.PARTITION, Kind.SLOW) else 1
    it = f.iteration
    if f.kind is Kind.PARTITION:  # healed before the last step (the coordinator then retires the peer)
        it = max(0, min(it, setup.steps - 1 - span))
    if f.kind is Kind.KILL_MID_COMMIT:  # seen at the next step (after the last one: in the final evaluation, which
        it = min(it, max(0, setup.steps - 2))  # the simulator's failure clock does not reach)
    return Fault(
        f.kind, it,
        stage=stage if kill else 0,
        replica=f.replica if kill and f.kind not in (Kind.KILL_GROUP, Kind.KILL_ADJACENT) else 0,
        mb=f.mb if f.kind in (Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD) else 0,
        pulls=f.pulls if f.kind is Kind.KILL_MID_REBUILD else 1,
        span=span,
        delay_ms=f.delay_ms if f.kind is Kind.SLOW else 0,
        where=f.where if f.kind in (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART) else "step",
    )


def _hits(f: Fault) -> set[tuple]:
    """What a fault takes: the (iteration its failure is seen at, stage) pairs of its kills, or its kind's slot
    (one coordinator fault per schedule; one rebuild kill per iteration)."""
    if f.kind in (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART):
        return {("coordinator",)}
    if f.kind in (Kind.KILL_MID_REBUILD, Kind.JOIN):
        return {(f.kind.value, f.iteration)}
    seen = f.iteration + 1 if f.kind is Kind.KILL_MID_COMMIT else f.iteration
    stages = [f.stage, f.stage + 1] if f.kind is Kind.KILL_ADJACENT else [f.stage]
    if f.kind is Kind.SIGTERM:  # a leave without a handover is seen at its iteration or the next
        return {(it, s) for it in (seen, seen + 1) for s in stages}
    return {(seen, s) for s in stages}


MID = (Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD, Kind.KILL_MID_REDUCE, Kind.KILL_MID_COMMIT)


def _apart(faults: list[Fault]) -> bool:
    """No two faults take the same stage at the same iteration (the simulator's trace has one failure per
    (iteration, stage)), at most one coordinator fault, and a kill inside a step (or seen after its commit) is the
    only failure of its iteration: another one there aborts the attempt first, so the two would come one after
    the other where the simulator's failures of one iteration come together."""
    taken: set[tuple] = set()
    for f in faults:
        hits = _hits(f)
        if hits & taken:
            return False
        taken |= hits
    for f in faults:
        if f.kind in MID:
            seen = next(iter(_hits(f)))[0]
            if any(g is not f and any(h[0] == seen for h in _hits(g) if isinstance(h[0], int)) for g in faults
                   if g.kind not in (Kind.SLOW, Kind.JOIN, Kind.KILL_MID_REBUILD)):
                return False
    return True


@st.composite
def schedules(draw: st.DrawFn, max_faults: int = 4, tier: str = "inprocess") -> Schedule:
    setup = draw(setups(tier))
    kinds = kinds_for(setup, tier)
    fault = st.builds(
        Fault, kind=st.sampled_from(kinds), iteration=st.integers(0, setup.steps - 1),
        stage=st.integers(0, setup.stages - 1), replica=st.integers(0, setup.replicas - 1),
        mb=st.integers(0, MICROBATCHES - 1), pulls=st.integers(1, 2), span=st.integers(1, 2),
        delay_ms=st.integers(1, 30), where=st.sampled_from(("step", "commit")))
    faults = draw(st.lists(fault.map(lambda f: normalise(f, setup)), min_size=1, max_size=max_faults).filter(_apart))
    return Schedule(setup, tuple(faults))

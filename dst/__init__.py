"""Deterministic simulation tests: generated fault schedules run in the swarm and in the simulator, invariants
checked after each, a divergent schedule shrunk and replayed (`checkfree chaos dst`; docs/dst.md).

A layer above `peers/` and the coordinator's packages (`coordinator/`, `swarm/`, `faults/`, `ops/`) (it runs
coordinators and peers together), like `cli/`:

    dst/schedule.py   a schedule as data: the setup and its faults, each tied to a protocol point
    dst/generate.py   schedules drawn (and shrunk) by hypothesis; which fault kinds each tier runs
    dst/inject.py     the faults acted out where the protocol reaches their point (checkfree.net.faulty)
    dst/swarm.py      the in-process swarm: coordinators and peers in SimProcesses over the memory network
    dst/check.py      the invariants: the swarm's run against the simulator's
    dst/run.py        one schedule end to end, and what it left behind
    dst/search.py     many schedules: generation, shrinking, replay
    dst/real.py       the real-process leg (`checkfree local`) and its soak
    dst/cli.py        `checkfree chaos dst`
"""

"""The in-process tier's harness lives in `benchmarks.inprocess` (benchmarks.control_plane runs it too)."""

from benchmarks.inprocess import TIMEOUTS, InProcessSwarm, run_swarm

__all__ = ["TIMEOUTS", "InProcessSwarm", "run_swarm"]

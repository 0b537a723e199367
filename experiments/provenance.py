"""Where a run's numbers come from: the code version it ran, and the invocation log of a results directory.

Every `checkfree experiment` invocation appends to `<out>/matrix_log.jsonl`: a `start` line
(command, code version, settings, the detection time its runs use, the runs it is about to run), a
`run` line as each run finishes (name, status, wall-clock: written at once, so a killed invocation
loses none), and an `end` line however it ends (`status` completed / interrupted / failed).
`--report-only` appends one `report` line.
Each run directory also gets `provenance.json` (code version, the cost model's figures the run was
priced with), written before `summary.json`, so results.json carries it per run.

The code version is the commit of the repository the experiments are imported from and a dirty
flag: true when a Python file or pyproject.toml differs from that commit (untracked ones too).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["code_version", "InvocationLog", "read_log", "logged_runs"]

_CODE_PATHS = (":(glob)**/*.py", "pyproject.toml")


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


@lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """{"commit": hex or None, "dirty": bool or None} of the code running now (None: not a git checkout)."""
    repo = Path(__file__).resolve().parent.parent
    commit = _git(repo, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(repo, "status", "--porcelain", "--", *_CODE_PATHS)
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not Unix
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())


class InvocationLog:
    """The two lines of one invocation in `<out>/matrix_log.jsonl` (use as a context manager)."""

    def __init__(self, out: Path, *, command: str, settings: dict[str, Any], experiments: list[str],
                 runs_in_matrix: int, pending: list[str], detection_s: list[float | None]) -> None:
        self.path = Path(out) / "matrix_log.jsonl"
        self.id = uuid.uuid4().hex[:12]
        self.t0 = time.time()
        self.runs: list[dict[str, Any]] = []
        self._append({"event": "start", "invocation": self.id, "command": command, "started": _now(),
                      "code": code_version(), "experiments": experiments, "settings": settings,
                      "detection_s": detection_s, "runs_in_matrix": runs_in_matrix, "pending": pending})

    def _append(self, line: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def finished(self, result: dict[str, Any]) -> None:
        """One run done (its {name, status, wall_s}): one `run` line now."""
        run = {k: result.get(k) for k in ("name", "status", "wall_s")}
        self.runs.append(run)
        self._append({"event": "run", "invocation": self.id, **run})

    def __enter__(self) -> InvocationLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "completed" if exc_type is None else \
            "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"
        self._append({"event": "end", "invocation": self.id, "status": status, "ended": _now(),
                      "wall_s": round(time.time() - self.t0), "runs_run": len(self.runs),
                      "errors": sum(1 for r in self.runs if r["status"] == "error"),
                      "load_average_at_end": _loadavg()})

    @staticmethod
    def report_only(out: Path, command: str, settings: dict[str, Any]) -> None:
        """The one line of a `--report-only` invocation."""
        line = {"event": "report", "invocation": uuid.uuid4().hex[:12], "command": command, "started": _now(),
                "code": code_version(), "settings": settings}
        path = Path(out) / "matrix_log.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def read_log(out: Path) -> list[dict[str, Any]]:
    """The lines of `<out>/matrix_log.jsonl` ([] if there is none)."""
    path = Path(out) / "matrix_log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def logged_runs(log: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run name -> the start line of the last invocation that finished it without an error."""
    starts = {x["invocation"]: x for x in log if x.get("event") == "start"}
    return {x["name"]: starts[x["invocation"]] for x in log
            if x.get("event") == "run" and x["status"] != "error" and x["invocation"] in starts}

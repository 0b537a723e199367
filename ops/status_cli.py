"""`checkfree status ADDRESS|RUN_DIR`: a swarm's state as a table in the terminal, from a live coordinator's
dashboard (its /status) or from a run directory's files (a finished run, or one whose files you have)."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path

from ops.status import SwarmStatus, describe, from_run_dir

__all__ = ["add_parser", "run_status", "fetch_status", "render"]

SPARKS = "▁▂▃▄▅▆▇█"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a swarm's state: stages, peers, step rate, loss, failures and recoveries",
                       description="Show a swarm's state as a table: from a running coordinator's dashboard "
                                   "(HOST:PORT or its URL, as printed by `checkfree local` or `checkfree scheduler "
                                   "--dashboard`) or from a run directory (metrics.jsonl, events.jsonl, summary.json, "
                                   "config.json).")
    p.add_argument("target", metavar="ADDRESS|RUN_DIR", help="dashboard address (HOST:PORT or http://HOST:PORT/) or "
                                                             "run directory")
    p.add_argument("--json", action="store_true", help="print the state as JSON (as /status serves it)")
    p.add_argument("--secret-file", help="file holding the run secret, sent as the bearer token a non-local dashboard "
                                         "requires (or set $CHECKFREE_SECRET)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the dashboard's answer")
    p.set_defaults(func=run_status)


def fetch_status(address: str, secret: bytes | None, timeout: float) -> SwarmStatus:
    """A live coordinator's /status. ValueError (one line) when it cannot be read."""
    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    url = base.rstrip("/").removesuffix("/status") + "/status"
    headers = {"Authorization": f"Bearer {secret.decode()}"} if secret else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return SwarmStatus.from_dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        hint = " (give the run secret: --secret-file or $CHECKFREE_SECRET)" if e.code == 401 else ""
        raise ValueError(f"{url}: HTTP {e.code} {e.reason}{hint}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ValueError(f"cannot read {url}: {getattr(e, 'reason', e)} (is the coordinator running with a "
                         "dashboard there?)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{url} did not answer with a swarm's status: {e}") from None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _short(pid: str) -> str:
    return "…" + pid[-8:]


def _sparkline(points: tuple[tuple[int, float], ...], width: int = 60) -> str:
    values = [v for _, v in points]
    if len(values) > width:  # the mean of each of `width` buckets
        values = [sum(b) / len(b) for b in (values[i * len(values) // width:(i + 1) * len(values) // width]
                                            for i in range(width)) if b]
    lo, hi = min(values), max(values)
    return "".join(SPARKS[min(7, int((v - lo) / (hi - lo) * 8)) if hi > lo else 3] for v in values)


def _table(rows: list[list[str]], right: Collection[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def render(s: SwarmStatus) -> str:
    """The state as the terminal table of `checkfree status`."""
    steps = f"{s.step} / {s.num_steps}" if s.num_steps else str(s.step)
    lines = [f"run {s.run_id} · {s.strategy or '?'} · {len(s.stages)} stages: {s.status} ({s.source})",
             f"step {steps} · {_fmt(s.steps_per_s)} steps/s · {_fmt(s.tokens_per_s, 0)} tokens/s · loss "
             f"{_fmt(s.loss, 4)} · val loss {_fmt(s.val_loss, 4)}",
             f"failures {s.counts['failures']} · recoveries {s.counts['recoveries']} · fallbacks {s.counts['fallbacks']}"
             + ("" if s.complete else " (history still being read)")]
    if s.loss_curve:
        lines.append(f"loss {_sparkline(s.loss_curve)}  (steps {s.loss_curve[0][0]}-{s.loss_curve[-1][0]})")
    rows = [["stage", "state", "replica", "peer", "peer state", "mb/s"]]
    for v in s.stages:
        rows += [[str(v.stage), v.state, str(r), _short(p.peer_id), p.state, _fmt(p.microbatches_per_s, 1)]
                 for r, p in enumerate(v.peers)] or [[str(v.stage), v.state, "-", "-", "-", "-"]]
    lines += ["", *_table(rows, right={0, 5})]
    if s.standbys is not None:
        lines.append("standbys: " + (", ".join(_short(p.peer_id) for p in s.standbys) or "none"))
    if s.events:
        rows = [["time", "step", "event", "stage", "peer", "detail"]]
        for e in reversed(s.events):
            when = time.strftime("%H:%M:%S", time.localtime(e["time"])) if isinstance(e.get("time"), float) else ""
            rows.append([when, str(e.get("step", "")), str(e.get("event")), str(e.get("stage", "")),
                         _short(e["peer_id"]) if isinstance(e.get("peer_id"), str) else "", describe(e)])
        lines += ["", "newest events first:", *_table(rows, right={1, 3})]
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    target = Path(args.target)
    if target.is_dir():
        status = from_run_dir(target)
    elif "/" in args.target and not args.target.startswith(("http://", "https://")):
        raise ValueError(f"{args.target}: no such run directory (or give a dashboard's HOST:PORT)")
    else:
        from checkfree.auth import load_secret

        status = fetch_status(args.target, load_secret(args.secret_file), args.timeout)
    print(json.dumps(status.as_dict(), indent=2) if args.json else render(status))
    return 0

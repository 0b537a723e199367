"""The live dashboard (ops/dashboard.py, ops/status.py, ops/history.py, `checkfree status`):
/status, /metrics and the table from a real coordinator in one process; the bearer check of a non-local bind;
the history read from growing files; and the page itself in a real headless Chromium against a `checkfree local`
swarm whose peer is SIGKILLed, seen to update without a reload."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import shutil
import subprocess
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from checkfree.data import build_data
from checkfree.failures import FailureSchedule
from checkfree.rundir import RunWriter, read_jsonl
from cli.main import main
from harness.inprocess import InProcessSwarm
from ops.dashboard import Bind, metrics_text, parse_bind, serve_dashboard
from ops.history import MAX_POINTS, RunHistory
from ops.status import LiveStatus, SwarmStatus, from_run_dir
from ops.status_cli import fetch_status, render
from swarmrun import await_line, kill_group, spawn, trace

pytestmark = pytest.mark.timeout(240)

SECRET = b"s3cret-of-the-run-0123456789"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value} (parsed by prometheus_client's own parser)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def _watch_swarm(cfg, out, failures: list[tuple[int, int]]):
    """Run an in-process swarm (the real Coordinator and peer daemons over the memory network) with its dashboard
    served from the same event loop, polling /status all along; then /status, /metrics and `checkfree status`
    once it has ended."""
    t = cfg.train  # the token cache, made once before any peer needs it (as `checkfree local` does)
    await asyncio.to_thread(build_data, cfg.data, vocab_size=cfg.model.vocab_size,
                            context_length=cfg.model.context_length, seed=t.seed, microbatch_size=t.microbatch_size)
    swarm = InProcessSwarm(cfg, out, cfg.num_stages + 2, {"save_final": False}, {"kills": FailureSchedule(failures)})
    run = asyncio.create_task(swarm.run())
    while swarm.coordinator is None:
        await asyncio.sleep(0)
    seen = []
    source = LiveStatus(swarm.coordinator, out, min_interval=0.0)
    async with serve_dashboard(source, Bind("127.0.0.1", 0), None) as dashboard, aiohttp.ClientSession() as http:
        while not run.done():
            async with http.get(dashboard.url + "status") as r:
                seen.append(await r.json())
            await asyncio.sleep(0.02)
        swarm.summary = await run
        async with http.get(dashboard.url + "status") as r:
            final = await r.json()
        async with http.get(dashboard.url + "metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            metrics = await r.text()
        table = await asyncio.to_thread(lambda: render(fetch_status(dashboard.url.removeprefix("http://"), None, 10)))
    return swarm, seen, final, metrics, table


def test_status_metrics_and_table_of_a_live_coordinator_through_a_kill(tiny_cfg, tmp_path):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.train.num_steps, cfg.train.eval_every = 6, 3
    out = tmp_path / "swarm"
    swarm, seen, final, metrics, table = asyncio.run(_watch_swarm(cfg, out, [(3, 1)]))
    assert swarm.summary["status"] == "completed"
    # while it ran: every stage served by one measured peer, two standbys (before the kill)
    running = [s for s in seen if s["status"] == "running" and s["loss_curve"]]
    assert running, [s["status"] for s in seen]
    first = running[0]
    assert [len(v["peers"]) for v in first["stages"]] == [1] * 4 and len(first["standbys"]) == 2
    assert all(v["state"] == "ok" and v["peers"][0]["state"] == "serving" for v in first["stages"])
    assert all(v["peers"][0]["microbatches_per_s"] > 0 for s in running[-1:] for v in s["stages"])
    # once over: the files' history, the coordinator's table
    records = read_jsonl(out / "metrics.jsonl")
    assert final["status"] == "completed" and final["step"] == 6 and final["complete"]
    assert final["loss"] == pytest.approx(records[-1]["loss"]) and len(final["loss_curve"]) == 6
    assert final["counts"] == {"failures": 1, "recoveries": 1, "fallbacks": 0}
    (killed,) = [f["peer"] for _, f in swarm.killed]
    fail, rec = [e for e in final["events"] if e["event"] in ("failure", "recovery")]
    assert (fail["step"], fail["stage"], fail["peer_id"]) == (3, 1, killed)
    assert (rec["step"], rec["stage"], rec["sources"], len(rec["coefficients"])) == (3, 1, [0, 2], 2)
    assert rec["detail"].startswith("average of stage(s) 0, 2, coefficients ")
    assert final["stages"][1]["peers"][0]["peer_id"] == rec["peer_id"] != killed
    assert final["tokens_per_s"] == pytest.approx(final["steps_per_s"] * cfg.tokens_per_step)
    # /metrics: Prometheus text with the step, the loss, live peers per stage, failures and recoveries
    m = _samples(metrics)
    assert m["checkfree_step", ()] == 6 and m["checkfree_loss", ()] == pytest.approx(final["loss"])
    assert [m["checkfree_live_peers", (("stage", str(s)),)] for s in range(4)] == [1, 1, 1, 1]
    assert m["checkfree_failures_total", ()] == 1 and m["checkfree_recoveries_total", ()] == 1
    assert m["checkfree_tokens_per_second", ()] == pytest.approx(final["tokens_per_s"])
    # the run directory alone tells the same story, and its last known peers are the coordinator's
    files = json.loads(json.dumps(from_run_dir(out).as_dict()))
    for key in ("step", "loss", "counts", "loss_curve", "events"):
        assert files[key] == final[key], key
    assert [v["peers"][0]["peer_id"] for v in files["stages"]] == [v["peers"][0]["peer_id"] for v in final["stages"]]
    # `checkfree status ADDRESS`: a row per stage, the failure and the recovery with its coefficients
    lines = table.splitlines()
    assert lines[0].endswith("4 stages: completed (live)")
    for s, v in enumerate(final["stages"]):
        assert any(line.split()[:3] == [str(s), "ok", "0"] and v["peers"][0]["peer_id"][-8:] in line for line in lines)
    assert any(" failure " in line and f"…{killed[-8:]}" in line for line in lines)
    assert any(" recovery " in line and "coefficients" in line for line in lines)


def _run_dir(path, steps: int = 5) -> None:
    """A small run directory written by the real RunWriter: `steps` steps, a failure and its recovery."""
    w = RunWriter(path, json.dumps({"num_stages": 2}), tokens_per_step=64)
    for step in range(steps):
        w.metric({"step": step, "loss": 5.0 - step / 10, "step_time_s": 0.5})
        if step == 2:
            w.event("failure", step=2, stage=1, peer_id="peer-old")
            w.event("recovery", step=2, stage=1, peer_id="peer-new", method="average", sources=[0], coefficients=[1.0])
    w.summary("completed", run_id="tiny-run")
    w.close()


async def _requests(run_dir) -> tuple[dict, str, int]:
    async def source() -> SwarmStatus:
        return from_run_dir(run_dir)

    async with serve_dashboard(source, Bind("0.0.0.0", 0), SECRET) as dashboard, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{dashboard.runner.addresses[0][1]}/"  # (only ever reached over loopback here)
        tokens = {"none": {}, "wrong": {"Authorization": "Bearer " + "x" * len(SECRET)},
                  "basic": {"Authorization": f"Basic {SECRET.decode()}"},
                  "right": {"Authorization": f"Bearer {SECRET.decode()}"}}
        codes = {}
        for name, headers in tokens.items():
            for path in ("status", "metrics"):
                async with http.get(url + path, headers=headers) as r:
                    codes[name, path] = r.status
        async with http.get(url) as r:
            page = await r.text()
        async with http.post(url + "status", headers=tokens["right"]) as r:
            post = r.status
    return codes, page, post


def test_a_non_local_dashboard_requires_the_run_secret_as_a_bearer_token(tmp_path):
    _run_dir(tmp_path / "run")
    codes, page, post = asyncio.run(_requests(tmp_path / "run"))
    assert codes == {(name, path): 200 if name == "right" else 401
                     for name in ("none", "wrong", "basic", "right") for path in ("status", "metrics")}
    assert "<svg" in page and "tiny-run" not in page  # the page is static: its data comes from /status
    assert post == 405  # read-only


def test_a_public_dashboard_without_a_secret_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CHECKFREE_SECRET", raising=False)
    for command in (["scheduler", "--preset", "tiny"], ["local", "--preset", "tiny"]):
        assert main([*command, "--out", str(tmp_path / "run"), "--dashboard", "0.0.0.0:8080"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "0.0.0.0:8080 is not a loopback address" in err[0], err
        assert main([*command, "--out", str(tmp_path / "run"), "--dashboard", "host:port"]) == 2
        assert "expected HOST:PORT" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written
    assert parse_bind("8080") == Bind("127.0.0.1", 8080) and parse_bind("[::1]:0") == Bind("::1", 0)
    assert parse_bind("localhost:0").local and parse_bind("::1:0").local and not parse_bind("0.0.0.0:0").local


def test_the_history_reads_growing_files_in_bounded_pieces(tmp_path):
    out = tmp_path / "run"
    _run_dir(out, steps=3)
    h = RunHistory(out, max_bytes=60)  # less than a metrics line: one line a poll
    polls = 1
    while not h.poll():
        polls += 1
    assert polls >= 3 and h.steps == 3 and h.counts["failures"] == 1 and h.caught_up
    with open(out / "metrics.jsonl", "a") as f:  # a line being written is read once it is complete
        f.write('{"step": 3, "loss": 4.5, "ti')
        f.flush()
        h.poll()
        assert h.steps == 3
        f.write('me": 1.0}\n')
    h.poll()
    assert (h.steps, h.loss) == (4, 4.5)
    with open(out / "metrics.jsonl", "a") as f:  # a long run: the curve stays bounded, first and newest steps kept
        f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(4, 5000))
    while not h.poll():
        pass
    steps = [s for s, _ in h.curve()]
    assert len(steps) <= MAX_POINTS + 1 and steps[0] == 0 and steps[-1] == 4999 and h.steps == 5000
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 9.0}\n')  # replaced (a resumed run rewrote it)
    h.poll()
    assert h.steps == 1 and h.curve() == [(0, 9.0)]


def test_metrics_text_is_valid_prometheus_for_a_run_directory(tmp_path):
    _run_dir(tmp_path / "run")
    m = _samples(metrics_text(from_run_dir(tmp_path / "run")).decode())
    assert m["checkfree_step", ()] == 5 and m["checkfree_loss", ()] == pytest.approx(4.6)
    assert m["checkfree_failures_total", ()] == 1 and m["checkfree_fallbacks_total", ()] == 0
    assert m["checkfree_run_info", (("run_id", "tiny-run"), ("status", "completed"), ("strategy", "checkfree"))] == 1


# ---- the page in a real browser ------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


@pytest.mark.timeout(420)
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed ({CHROMIUM}; Debian: "
                                                          "apt-get install chromium)")
def test_the_page_shows_a_sigkill_and_its_recovery_without_a_reload(tmp_path, session_cache):
    """A real `checkfree local` swarm (real processes, a SIGKILL at step 8 by --trace); headless Chromium opens the
    printed dashboard address before the failure and sees the failure and its recovery appear while the page stays
    the same document; every stage's row is rendered; a screenshot is taken (tmp_path/dashboard.png)."""
    from playwright.sync_api import sync_playwright

    env = {**os.environ, "CHECKFREE_CACHE": session_cache}
    args = ["local", "--preset", "tiny", "--steps", "12", "--eval-every", "6", "--out", str(tmp_path / "run"),
            "--no-progress", "--spares", "2", "--trace", trace(tmp_path, [(8, 1)]),
            "--chaos-slow", "3:0.1"]  # (at least 0.8 s a step: time for the page to load before the kill)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                        headless=True, args=CHROMIUM_FLAGS)
        proc = spawn(args, env)
        try:
            url = await_line(proc, "swarm: dashboard", 180).split()[2]
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=60_000)  # first render
            page.evaluate("window.sameDocument = true")
            assert page.locator("#stages tbody tr[data-stage]").count() == 4  # every stage's row, served or not yet
            assert page.inner_text("#count-failures") == "0", "the page loaded after the failure: machine overloaded?"
            page.wait_for_selector("#events tr[data-event='recovery']", timeout=240_000)
            assert page.evaluate("window.sameDocument") is True  # updated in place: no reload
            assert page.inner_text("#count-failures") == "1" and page.inner_text("#count-recoveries") == "1"
            killed = page.get_attribute("#events tr[data-event='failure'] td[title]", "title")
            rebuilt = page.get_attribute("#events tr[data-event='recovery'] td[title]", "title")
            assert "average of stage(s) 0, 2, coefficients" in page.inner_text("#events tr[data-event='recovery']")
            page.wait_for_selector(f"tr[data-stage='1'][data-state='ok'] td[data-peer='{rebuilt}']")
            assert killed and rebuilt and killed != rebuilt
            rows = page.locator("#stages tbody tr[data-stage]")
            assert [rows.nth(i).get_attribute("data-state") for i in range(rows.count())] == ["ok"] * 4
            assert page.locator("svg#loss line[data-failure-step='8']").count() == 1
            assert page.locator("#loss-line").get_attribute("points").count(",") >= 8
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert (tmp_path / "dashboard.png").stat().st_size > 20_000
            assert proc.popen.wait(timeout=240) == 0, proc.tail()
        finally:
            browser.close()
            kill_group(proc)
    if keep := os.environ.get("CHECKFREE_KEEP_SCREENSHOT"):  # to look at it
        shutil.copy(tmp_path / "dashboard.png", keep)


@pytest.mark.timeout(420)
def test_the_overhead_benchmark_runs_and_prints_its_side_by_side_ratio(tmp_path, session_cache):
    """benchmarks/dashboard.py --quick: one real `checkfree local` run, polled and idle windows; what it prints
    and writes (structure, never a speed)."""
    env = {**os.environ, "CHECKFREE_CACHE": session_cache}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.dashboard", "--quick", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| steps polled | steps idle | median step ms polled | median step ms idle | ratio polled/idle |" in proc.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["polled_steps"] > 0 and r["idle_steps"] > 0 and r["polled_steps"] + r["idle_steps"] <= 15
    assert math.isfinite(r["ratio_polled_over_idle"]) and r["requests"]["status"] == r["requests"]["metrics"] > 0
    assert r["coordinator_cpu_share"]["polled"] > 0 and r["build_ms"]["status"] > 0


@pytest.mark.timeout(120)
@pytest.mark.processes  # (Chromium)
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed ({CHROMIUM}; Debian: "
                                                          "apt-get install chromium)")
def test_a_long_run_is_drawn_to_the_steps_it_has_run_and_each_peer_shows_how_it_is_reached(tmp_path):
    """`--steps 100000` at step 209 with a failure at step 150: the loss chart's x axis ends where the run is (the
    curve and the failure marker span the chart, not a sliver at its left edge), and every peer says whether the
    coordinator reaches it directly or only through a relay (behind NAT)."""
    import threading

    from playwright.sync_api import sync_playwright

    from ops.status import PeerState, PeerView, StageView

    status = SwarmStatus(
        source="live", run_id="long", status="running", step=209, num_steps=100_000, strategy="checkfree",
        tokens_per_step=1024,
        stages=(StageView(0, (PeerView("12D3KooWdirect000", PeerState.SERVING, 3.0, "direct"),)),
                StageView(1, (PeerView("12D3KooWrelayed00", PeerState.SERVING, 2.0, "relayed"),))),
        standbys=(PeerView("12D3KooWstandby00", PeerState.STANDBY, None, "relayed"),), loss=4.2, val_loss=None,
        steps_per_s=1.0, loss_curve=tuple((i, 6.0 - i / 100) for i in range(209)), val_curve=(),
        counts={"failures": 1, "recoveries": 1, "fallbacks": 0},
        events=({"event": "failure", "step": 150, "stage": 1, "peer_id": "12D3KooWgone0000", "time": 1.0},),
        complete=True, time=1.0)

    async def source() -> SwarmStatus:
        return status

    loop, ready, stop = asyncio.new_event_loop(), threading.Event(), None
    urls = []

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with serve_dashboard(source, Bind("127.0.0.1", 0), None) as dashboard:
            urls.append(dashboard.url)
            ready.set()
            await stop.wait()

    server = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    server.start()
    assert ready.wait(30)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                            headless=True, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page()
                page.goto(urls[0])
                page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=60_000)
                assert page.text_content("#loss-xmax") == "step 209 of 100000"
                x = float(page.get_attribute("svg#loss line[data-failure-step='150']", "x1"))
                assert 600 < x < 700, x  # 150 of 209 steps across the plot (56..888), not at its left edge (~56)
                xs = [float(p.split(",")[0]) for p in page.get_attribute("#loss-line", "points").split()]
                assert xs[0] < 60 and xs[-1] > 880
                assert page.get_attribute("td[data-peer='12D3KooWdirect000'] [data-reach]", "data-reach") == "direct"
                assert page.get_attribute("td[data-peer='12D3KooWrelayed00'] [data-reach]", "data-reach") == "relayed"
                assert page.locator("[data-standby='12D3KooWstandby00'] [data-reach='relayed']").count() == 1
            finally:
                browser.close()
    finally:
        loop.call_soon_threadsafe(stop.set)
        server.join(30)

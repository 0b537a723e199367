"""The coordinator's read-only HTTP view of its swarm, served from the coordinator's own event loop (aiohttp):

    /         an HTML page (ops/dashboard.html: inline script and SVG, nothing fetched from elsewhere) that
              polls /status and redraws itself: stages x replicas, step rate, loss curve, failures, recoveries
    /status   the swarm's state as JSON (ops.status.SwarmStatus.as_dict)
    /metrics  the same in the Prometheus text format (prometheus_client)

It binds to a loopback address unless told otherwise. A non-local bind needs the run secret: every request for
data (/status, /metrics) must then carry `Authorization: Bearer <secret>`; the page itself is static (it holds
no data) and takes the secret from its URL's fragment (`/#token=...`, which browsers never send to a server).
Only GET is served: nothing here changes the run.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from ops.status import PeerState, SwarmStatus

__all__ = ["Bind", "parse_bind", "check_bind", "Dashboard", "serve_dashboard", "metrics_text", "DASHBOARD_LINE"]

log = logging.getLogger(__name__)

DASHBOARD_LINE = "dashboard:"  # the coordinator's output line with the address: `dashboard: http://HOST:PORT/`
StatusSource = Callable[[], Awaitable[SwarmStatus]]


@dataclass(frozen=True)
class Bind:
    host: str
    port: int  # 0: any free port

    @property
    def local(self) -> bool:
        """Whether only this machine can connect (a loopback address)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: it may resolve to anything
            return False


def parse_bind(text: str) -> Bind:
    """`HOST:PORT`, `[IPV6]:PORT` or `PORT` (on 127.0.0.1); port 0 takes any free port."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536 or (sep and not host):
        raise ValueError(f"--dashboard {text!r}: expected HOST:PORT or PORT (0: any free port), e.g. 127.0.0.1:8080")
    return Bind(host, int(port))


def check_bind(bind: Bind, secret: bytes | None) -> Bind:
    """`bind`, unless it is reachable from other machines and there is no secret to require of its clients."""
    if not bind.local and secret is None:
        raise ValueError(f"--dashboard {bind.host}:{bind.port} is not a loopback address: a dashboard reachable "
                         "from other machines needs the run secret (--secret-file or $CHECKFREE_SECRET), which "
                         "its clients send as 'Authorization: Bearer <secret>'")
    return bind


def _metrics(s: SwarmStatus) -> Iterator[Metric]:
    yield InfoMetricFamily("checkfree_run", "the run this coordinator serves",
                           value={"run_id": s.run_id, "strategy": s.strategy or "", "status": s.status})
    yield GaugeMetricFamily("checkfree_step", "the step being run", value=s.step)
    for name, value, what in (("loss", s.loss, "training loss of the newest step"),
                              ("val_loss", s.val_loss, "validation loss of the newest evaluation"),
                              ("steps_per_second", s.steps_per_s, "steps per wall-clock second, newest steps"),
                              ("tokens_per_second", s.tokens_per_s, "tokens trained per wall-clock second")):
        if value is not None:
            yield GaugeMetricFamily(f"checkfree_{name}", what, value=value)
    live = GaugeMetricFamily("checkfree_live_peers", "peers serving each stage (its replicas)", labels=["stage"])
    speed = GaugeMetricFamily("checkfree_peer_microbatches_per_second", "each stage peer's measured compute speed",
                              labels=["stage", "peer"])
    for v in s.stages:
        live.add_metric([str(v.stage)], sum(p.state in (PeerState.SERVING, PeerState.SUSPECT) for p in v.peers))
        for p in v.peers:
            if p.microbatches_per_s is not None:
                speed.add_metric([str(v.stage), p.peer_id], p.microbatches_per_s)
    yield live
    yield speed
    if s.standbys is not None:
        yield GaugeMetricFamily("checkfree_standby_peers", "peers waiting for a stage", value=len(s.standbys))
    for key, what in (("failures", "stages lost"), ("recoveries", "stages recovered by the run's strategy"),
                      ("fallbacks", "stages recovered by a fallback")):
        yield CounterMetricFamily(f"checkfree_{key}", what, value=s.counts[key])


def metrics_text(status: SwarmStatus) -> bytes:
    """`status` in the Prometheus text exposition format."""
    registry = CollectorRegistry(auto_describe=False)

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            return _metrics(status)

    registry.register(_Collector())
    return generate_latest(registry)


class Dashboard:
    """The HTTP server; `await start()` returns its URL, `await stop()` closes it."""

    def __init__(self, source: StatusSource, bind: Bind, secret: bytes | None) -> None:
        self.source, self.bind, self.secret = source, check_bind(bind, secret), secret
        self.page = files("ops").joinpath("dashboard.html").read_bytes()
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _authorized(self, request: web.Request) -> bool:
        if self.bind.local:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return (scheme.lower() == "bearer" and self.secret is not None
                and hmac.compare_digest(token.strip().encode(), self.secret))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/" and not self._authorized(request):
            raise web.HTTPUnauthorized(text="this dashboard needs 'Authorization: Bearer <run secret>'\n",
                                       headers={"WWW-Authenticate": 'Bearer realm="checkfree"'})
        return await handler(request)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page, content_type="text/html", charset="utf-8")

    async def _status(self, request: web.Request) -> web.Response:
        body = json.dumps((await self.source()).as_dict())
        return web.Response(text=body, content_type="application/json", headers={"Cache-Control": "no-store"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics_text(await self.source()), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        app.add_routes([web.get("/", self._page), web.get("/status", self._status), web.get("/metrics", self._metrics)])
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.bind.host, self.bind.port).start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@contextlib.asynccontextmanager
async def serve_dashboard(source: StatusSource, bind: Bind, secret: bytes | None) -> AsyncIterator[Dashboard]:
    """Serve the dashboard while the block runs; prints `dashboard: URL` once it listens."""
    dashboard = Dashboard(source, bind, secret)
    try:
        url = await dashboard.start()
    except OSError as e:  # e.g. the port is taken: the run goes on without its dashboard
        log.warning("dashboard not started: cannot listen on %s:%d: %s", bind.host, bind.port, e)
        yield dashboard
        return
    print(f"{DASHBOARD_LINE} {url} (read-only{'' if bind.local else ', bearer token required'})", flush=True)
    try:
        yield dashboard
    finally:
        await dashboard.stop()

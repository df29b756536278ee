"""The monitor over HTTP: ``/metrics`` (Prometheus text), ``/status`` (JSON), ``/`` (a live page), ``/plots/*.png``.

Inputs:  a callable returning the latest :class:`~p2p_diloco.monitor.SwarmSummary` (or None before the first
         refresh), optionally a :class:`PlotCache` for the page's images, and whether the monitor makes samples
         (``--samples``: the page gets a "Sample" section, filled from the summary's ``sample`` and ``sample_error``).
Output:  a stdlib ``ThreadingHTTPServer`` serving from a daemon thread.
State:   none of its own beyond the server socket; the Prometheus collector reads the latest summary on each
         scrape (its own ``CollectorRegistry``, nothing process-global), the plot cache re-renders at most
         every ``min_age`` seconds.
Failure: :func:`bind` raises :class:`PortInUseError` (a ``ValueError``) with the port and what to try when
         the port is taken; a request for an unknown path gets 404; a failing plot render gets 500 and a log
         line, the server keeps serving.

Prometheus names (prefix ``p2p_diloco_``): ``peers_alive``, ``round``, ``train_loss``, ``eval_loss``,
``tokens_per_second`` (gauges); ``rounds_completed_total``, ``tokens_total``, ``peers_joined_total``,
``peers_left_total``, ``bad_records_total`` (counters); per peer (label ``peer``): ``peer_round``,
``peer_train_loss``, ``peer_tokens_per_second``, ``peer_last_seen_seconds``; and
``monitor_read_seconds``, ``monitor_refresh_timestamp_seconds``.
"""

from __future__ import annotations

import errno
import html
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from p2p_diloco.monitor import SwarmSummary
from p2p_diloco.plots import PLOT_NAMES, render_plots

__all__ = ["PortInUseError", "SummaryCollector", "make_registry", "PlotCache", "MonitorServer", "bind", "page_html"]

log = logging.getLogger("p2p_diloco.monitor")
GetSummary = Callable[[], "SwarmSummary | None"]
PREFIX = "p2p_diloco_"


class PortInUseError(ValueError):
    """The HTTP port is taken (or not ours to bind)."""


class SummaryCollector:
    """Prometheus collector: turns the latest summary into metric families at scrape time."""

    def __init__(self, get_summary: GetSummary) -> None:
        self.get_summary = get_summary

    def collect(self) -> Iterator[Metric]:
        s = self.get_summary()
        if s is None:
            return

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=value)

        yield from gauge("peers_alive", "Peers whose round record has not expired", s.num_peers)
        yield from gauge("round", "Highest round among alive peers", s.round)
        yield from gauge("train_loss", "Token-weighted mean train loss at the current round", s.mean_train_loss)
        yield from gauge("eval_loss", "Mean eval loss of the latest evaluated round", s.eval_loss)
        yield from gauge("tokens_per_second", "Sum of alive peers' inner-loop tokens per second", s.tokens_per_second)
        yield from gauge("monitor_read_seconds", "Duration of the monitor's last DHT read", s.read_seconds)
        yield from gauge("monitor_refresh_timestamp_seconds", "Unix time of the monitor's last refresh", s.time)
        for name, doc, value in (
            ("rounds_completed", "Highest round seen by the monitor", s.rounds_completed),
            ("tokens", "Tokens trained by every peer seen since the monitor started", s.total_tokens),
            ("peers_joined", "Peers that appeared since the monitor started", s.peers_joined),
            ("peers_left", "Peers whose record expired since the monitor started", s.peers_left),
            ("bad_records", "DHT entries refused by the signature/schema check", s.bad_records_total),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        per_peer = {
            "peer_round": ("Peer's latest round", lambda p: p.round),
            "peer_train_loss": ("Peer's train loss in its latest round", lambda p: p.train_loss),
            "peer_tokens_per_second": ("Peer's inner-loop tokens per second", lambda p: p.tokens_per_second),
            "peer_last_seen_seconds": ("Seconds since the peer's latest record", lambda p: p.last_seen_seconds),
            "peer_lost_rounds": (
                "Rounds the peer trained that moved no state (discarded, resynced)",
                lambda p: p.lost_rounds,
            ),
        }
        for name, (doc, get) in per_peer.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["peer"])
            for peer in s.peers.values():
                value = get(peer)
                if value is not None:
                    family.add_metric([peer.peer_id], value)
            yield family


def make_registry(get_summary: GetSummary) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SummaryCollector(get_summary))
    return registry


class PlotCache:
    """PNG bytes of :data:`~p2p_diloco.plots.PLOT_NAMES`, re-rendered at most every ``min_age`` seconds."""

    def __init__(self, history: Path, peer_logs: Sequence[Path] = (), min_age: float = 20.0) -> None:
        self.history, self.peer_logs, self.min_age = Path(history), list(peer_logs), min_age
        self._lock = threading.Lock()
        self._pngs: dict[str, bytes] = {}
        self._rendered = -float("inf")

    def get(self, name: str) -> bytes | None:
        if name not in PLOT_NAMES:
            return None
        with self._lock:  # one render at a time; the page asks for all plots at once
            if time.monotonic() - self._rendered >= self.min_age or name not in self._pngs:
                self._pngs = render_plots(self.history, self.peer_logs)
                self._rendered = time.monotonic()
            return self._pngs.get(name)


def page_html(refresh_ms: int, plots: bool, samples: bool = False) -> str:
    """The page: numbers filled in by JS from ``/status`` every ``refresh_ms``; plots reloaded every 30 s; with
    ``samples`` a "Sample" section (the latest sample's round, checksum, prompt and text, or why there is none)."""
    imgs = "".join(
        f'<img data-src="plots/{n}.png" src="plots/{n}.png" alt="{html.escape(n)}" width="400">' for n in PLOT_NAMES
    )
    page = _PAGE.replace("__REFRESH_MS__", str(int(refresh_ms))).replace("__PLOTS__", imgs if plots else "")
    return page.replace("__SAMPLE__", _SAMPLE if samples else "")


# the model's text is set with textContent (never parsed as HTML): a state can hold any bytes
_SAMPLE = """<div id="sample"><h3>Sample <span id="sample-round"></span></h3>
<pre id="sample-text"><b id="sample-prompt"></b><span id="sample-continuation"></span></pre>
<div id="sample-meta" class="meta">no sample yet</div><div id="sample-error" class="meta"></div></div>
"""


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>p2p_diloco monitor</title>
<style>
body{font-family:sans-serif;margin:1.5em;color:#222} table{border-collapse:collapse;margin:.5em 0}
td,th{padding:.2em .8em;border-bottom:1px solid #ddd;text-align:right} th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left} .big{font-size:1.6em;font-weight:bold} #state{color:#a00}
img{margin:.3em;border:1px solid #ddd}
#sample{margin:1em 0 1.2em} #sample h3{margin:.4em 0}
#sample pre{white-space:pre-wrap;background:#f7f7f7;border:1px solid #ddd;padding:.6em;max-width:60em;margin:.4em 0}
#sample b{color:#555} .meta{color:#666;font-size:.9em} #sample-error{color:#a00}
</style></head><body>
<h2>p2p_diloco swarm <span id="run-id"></span></h2>
<div id="state">waiting for the first refresh...</div>
<table><tr><th>peers alive</th><th>round</th><th>train loss</th><th>eval loss</th><th>tokens/s</th>
<th>total tokens</th><th>rounds</th><th>joined</th><th>left</th><th>bad records</th></tr>
<tr class="big"><td id="num-peers">-</td><td id="round">-</td><td id="train-loss">-</td><td id="eval-loss">-</td>
<td id="tokens-per-second">-</td><td id="total-tokens">-</td><td id="rounds-completed">-</td>
<td id="peers-joined">-</td><td id="peers-left">-</td><td id="bad-records">-</td></tr></table>
<table id="peers"><thead><tr><th>peer</th><th>round</th><th>train loss</th><th>tokens/s</th><th>tokens</th>
<th>group</th><th>lost rounds</th><th>last seen</th></tr></thead><tbody></tbody></table>
__SAMPLE__<div id="plots">__PLOTS__</div>
<p><a href="status">/status</a> &middot; <a href="metrics">/metrics</a> &middot;
updated <span id="updated">never</span></p>
<noscript>This page needs JavaScript; <a href="status">/status</a> has the same numbers.</noscript>
<script>
function fmt(x, d){ return x === null || x === undefined ? "-" : (typeof x === "number" ? x.toFixed(d) : x); }
function int(x){ return x === null || x === undefined ? "-" : Math.round(x).toLocaleString("en-US"); }
function set(id, text){ document.getElementById(id).textContent = text; }
function showSample(x, error){
  set("sample-error", error ? "last attempt failed: " + error : "");
  if (!x) return;
  set("sample-round", "from round " + x.round); set("sample-prompt", x.prompt); set("sample-continuation", x.text);
  set("sample-meta", "the state the swarm vouches for at round " + x.round + " (checksum " + x.checksum +
      "), greedy; made " + new Date(x.time * 1000).toLocaleTimeString() + " in " + fmt(x.seconds, 1) +
      " s (download " + fmt(x.download_seconds, 1) + " s)");
}
async function refresh(){
  try {
    const r = await fetch("status", {cache: "no-store"});
    const s = await r.json();
    if (!s.time) { set("state", "waiting for the first refresh..."); return; }
    set("run-id", "(" + s.run_id + ")");
    set("num-peers", s.num_peers); set("round", fmt(s.round, 0)); set("train-loss", fmt(s.mean_train_loss, 4));
    set("eval-loss", s.eval_loss === null ? "-" : fmt(s.eval_loss, 4) + " @" + s.eval_round);
    set("tokens-per-second", int(s.tokens_per_second)); set("total-tokens", int(s.total_tokens));
    set("rounds-completed", s.rounds_completed); set("peers-joined", s.peers_joined);
    set("peers-left", s.peers_left); set("bad-records", s.bad_records_total);
    set("state", s.error ? "last read failed: " + s.error : (s.num_peers ? "" : "no peers alive yet: waiting"));
    const body = document.querySelector("#peers tbody"); body.innerHTML = "";
    for (const p of Object.values(s.peers)) {
      const row = body.insertRow();
      for (const v of [p.peer_id, p.round, fmt(p.train_loss, 4), int(p.tokens_per_second), int(p.total_tokens),
                       p.group_size, p.lost_rounds, fmt(p.last_seen_seconds, 0) + " s"]) {
        row.insertCell().textContent = v;
      }
    }
    if (document.getElementById("sample")) showSample(s.sample, s.sample_error);
    set("updated", new Date(s.time * 1000).toLocaleTimeString());
  } catch (e) { set("state", "monitor unreachable: " + e); }
}
refresh(); setInterval(refresh, __REFRESH_MS__);
setInterval(function(){ for (const img of document.images) img.src = img.dataset.src + "?t=" + Date.now(); }, 30000);
</script></body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    server: MonitorServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        srv = self.server
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", srv.page.encode())
        elif path == "/status":
            s = srv.get_summary()
            self._send(200, "application/json", json.dumps(s.to_json() if s else {"time": None}).encode())
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(srv.registry))
        elif path.startswith("/plots/") and path.endswith(".png") and srv.plots is not None:
            try:
                png = srv.plots.get(path[len("/plots/") : -len(".png")])
            except Exception as exc:  # noqa: BLE001 - a bad history line must not take the server down
                log.warning("rendering the plots failed: %r", exc)
                self._send(500, "text/plain", b"plot rendering failed\n")
                return
            self._send(200, "image/png", png) if png else self._send(404, "text/plain", b"no such plot\n")
        else:
            self._send(404, "text/plain", b"not found: try /, /status or /metrics\n")

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        log.debug("http: " + format, *args)


class MonitorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_port = False  # newer Pythons set SO_REUSEPORT on HTTPServer: a busy port must fail, not share

    def __init__(
        self,
        host: str,
        port: int,
        get_summary: GetSummary,
        refresh_ms: int,
        plots: PlotCache | None = None,
        samples: bool = False,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.get_summary, self.plots = get_summary, plots
        self.registry = make_registry(get_summary)
        self.page = page_html(refresh_ms, plots is not None, samples)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="monitor-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()


def bind(
    host: str,
    port: int,
    get_summary: GetSummary,
    refresh_ms: int,
    plots: PlotCache | None = None,
    samples: bool = False,
) -> MonitorServer:
    """Bind the server (not yet serving); :class:`PortInUseError` when the port is taken or not permitted."""
    try:
        return MonitorServer(host, port, get_summary, refresh_ms, plots, samples)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            what = "already in use" if exc.errno == errno.EADDRINUSE else "not permitted for this user"
            raise PortInUseError(
                f"cannot serve HTTP on {host}:{port}: the port is {what}; pick another with --port "
                "(0 picks a free one), or stop the process holding it"
            ) from None
        raise PortInUseError(f"cannot serve HTTP on {host}:{port}: {exc}") from None

"""The monitoring peer: read every peer's round record from the DHT, aggregate, show, keep a history.

Inputs:  the signed per-peer records under ``f"{run_id}_metrics"`` (see swarm/records.py), read every
         ``interval`` seconds by a DHT node of its own that trains nothing and writes nothing and runs
         swarm/validators.py's ``make_validators`` (wrapped in swarm/reader.py's ``RejectCounter``); for a closed
         run, the ``authorized`` peer ids (``swarm.authorized_keys``): records of other peers are ignored.
Output:  a :class:`SwarmSummary` per refresh: printed (a redrawn table on a tty, otherwise one status line
         when something changed or a minute passed, and one line per new sample), appended as one JSON line to
         ``DIR/monitor.jsonl``, and served by monitor_http.py (``/status``, ``/metrics``, ``/``). With ``samples``
         (``run_monitor --samples``: monitor_samples.py, in a thread of its own) each summary also carries the latest
         sample of the vouched state and why the last attempt failed, if it did.
State:   :class:`SwarmTracker` keeps what one read cannot tell: peers alive at the last read (to count joins
         and departures), each peer's latest total tokens (departed peers' tokens still count), the latest
         eval loss and the highest round seen. A restarted monitor appends to the same file and takes the
         eval loss, the round count and the sample back from its last line.
Failure: no peers yet -> a summary with ``num_peers == 0`` and a "waiting" line, never an error. Entries
         under the key that fail the guard, signature, schema or bounds check are refused by hivemind inside the
         DHT process; swarm/reader.py's ``RejectCounter`` (a validator wrapper writing to a pipe) lets the host
         count them, and :class:`Monitor` warns once per owner key. Records of unlisted peers in a closed run are
         not counted as bad: logged once per peer id at info level. A read that times out keeps the last
         view, sets ``error`` and retries at the next refresh.

Definitions (what the numbers mean):
  alive            a record whose DHT expiry (``swarm.record_ttl`` after the peer's last publish) has not passed
  round            the highest ``outer_step`` among alive peers (None when none is alive)
  mean_train_loss  token-weighted mean of ``train_loss`` over the alive peers whose record is at ``round``
                   (``round_peers``); non-finite losses are left out and their peers listed in ``non_finite_peers``
  eval_loss        mean eval loss of the latest round any peer evaluated (kept across refreshes: ``eval_round``)
  tokens_per_second  sum of the alive peers' inner-loop throughput (tokens per compute second)
  total_tokens     sum over every peer seen since the monitor started of its latest ``total_tokens``
  rounds_completed the highest ``outer_step`` seen since the monitor started (or in the history it continues)
  peers_joined / peers_left  transitions absent->alive / alive->absent since the monitor started (peers alive
                   at the first read count as joined)
  bad_records      entries refused in this refresh (each refused answer of a DHT node counts once);
                   ``bad_records_total`` since the monitor started
  sample           with --samples: the latest sample (``time``, ``round``, ``checksum``: the vouched state it came
                   from, ``prompt``, ``text``: the greedy continuation, ``seconds``: download + generation,
                   ``download_seconds``), repeated in every line until the next one (a few hundred bytes); None
                   before the first. ``sample_error``: why the last attempt failed (None when it did not)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from hivemind.dht import DHT

from p2p_diloco.swarm.reader import Reading, RejectCounter, read_swarm
from p2p_diloco.swarm.records import PeerRecord, metrics_key

__all__ = [
    "PeerStatus",
    "SwarmSummary",
    "SwarmTracker",
    "current_round",
    "jsonable",
    "render_table",
    "render_line",
    "render_sample",
    "ConsoleView",
    "History",
    "Monitor",
]

log = logging.getLogger("p2p_diloco.monitor")
HISTORY_FILE = "monitor.jsonl"
# --samples (monitor_samples.py; here so that run_monitor's flags need no torch model code)
DEFAULT_EVERY = 300.0  # seconds between samples: a download of the whole state each time (tiny: 5 MB; 150M: 1.2 GB)
DEFAULT_PROMPT = "The function"  # fixed, so samples of successive rounds compare; the offline corpus is Python's docs
DEFAULT_TOKENS = 48


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def jsonable(value: Any) -> Any:
    """``value`` with NaN/inf replaced by None (strict JSON has no NaN), recursively."""
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class PeerStatus:
    """One alive peer as the monitor shows it. Seconds are relative to the refresh time."""

    peer_id: str
    round: int
    train_loss: float | None
    eval_loss: float | None
    tokens: int
    tokens_per_second: float
    total_tokens: int
    group_size: int
    lost_rounds: int  # rounds it trained that moved no state (discarded, resynced): the swarm lost its work
    last_seen_seconds: float  # refresh time minus the record's ``time`` (clamped at 0: clocks differ)
    expires_in_seconds: float | None


@dataclass
class SwarmSummary:
    time: float
    run_id: str
    num_peers: int
    round: int | None
    mean_train_loss: float | None
    round_peers: list[str]
    eval_loss: float | None
    eval_round: int | None
    tokens_per_second: float
    total_tokens: int
    rounds_completed: int
    peers_joined: int
    peers_left: int
    bad_records: int
    bad_records_total: int
    non_finite_peers: list[str] = field(default_factory=list)
    peers: dict[str, PeerStatus] = field(default_factory=dict)
    read_seconds: float | None = None
    error: str | None = None
    sample: dict[str, Any] | None = None  # with --samples: the latest StateSample (monitor_samples.py), as JSON
    sample_error: str | None = None  # with --samples: why the last sample attempt failed (None: it did not)

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON dict (NaN -> None): one line of monitor.jsonl and the body of ``/status``."""
        return jsonable(dataclasses.asdict(self))


def current_round(records: Mapping[str, PeerRecord]) -> tuple[int | None, float | None, list[str], list[str]]:
    """(round, token-weighted mean train loss at that round, peers at that round, peers with a non-finite loss).

    Pure: ``records`` are the alive peers' latest records by peer id. Zero-token records weigh equally.
    """
    if not records:
        return None, None, [], []
    top = max(r.outer_step for r in records.values())
    at_top = sorted(p for p, r in records.items() if r.outer_step == top)
    finite = [(records[p].train_loss, records[p].tokens) for p in at_top if _finite(records[p].train_loss) is not None]
    bad = sorted(p for p, r in records.items() if r.train_loss is not None and not math.isfinite(r.train_loss))
    if not finite:
        return top, None, at_top, bad
    weight = sum(t for _, t in finite)
    if weight > 0:
        mean = sum(loss * t for loss, t in finite) / weight
    else:
        mean = sum(loss for loss, _ in finite) / len(finite)
    return top, mean, at_top, bad


class SwarmTracker:
    """Turns successive reads into summaries; holds the state one read cannot tell (see the module doc)."""

    def __init__(self, run_id: str, resume_from: Mapping[str, Any] | None = None) -> None:
        self.run_id = run_id
        self.alive: set[str] = set()
        self.joined = self.left = self.bad_total = 0
        self.tokens_by_peer: dict[str, int] = {}
        self.eval_round: int | None = None
        self.eval_loss: float | None = None
        self.rounds_completed = 0
        self.last: SwarmSummary | None = None
        if resume_from:  # the last line of the history this monitor continues; anything odd in it is ignored
            eval_round, eval_loss = resume_from.get("eval_round"), resume_from.get("eval_loss")
            if isinstance(eval_round, int) and isinstance(eval_loss, float | int):
                self.eval_round, self.eval_loss = eval_round, float(eval_loss)
            if isinstance(resume_from.get("rounds_completed"), int):
                self.rounds_completed = resume_from["rounds_completed"]

    def update(
        self,
        records: Mapping[str, PeerRecord],
        now: float,
        expirations: Mapping[str, float] | None = None,
        bad: int = 0,
        read_seconds: float | None = None,
    ) -> SwarmSummary:
        """The summary after a read at ``now`` (unix time); records whose expiry has passed are not alive."""
        expirations = expirations or {}
        alive = {p: r for p, r in records.items() if expirations.get(p, math.inf) > now}
        self.joined += len(alive.keys() - self.alive)
        self.left += len(self.alive - alive.keys())
        self.alive = set(alive)
        self.bad_total += bad
        for p, r in alive.items():
            self.tokens_by_peer[p] = max(r.total_tokens, self.tokens_by_peer.get(p, 0))
        evals = [r for r in alive.values() if _finite(r.eval_loss) is not None]
        if evals:
            top = max(r.outer_step for r in evals)
            if self.eval_round is None or top >= self.eval_round:
                at_top = [r.eval_loss for r in evals if r.outer_step == top]
                self.eval_round, self.eval_loss = top, sum(at_top) / len(at_top)
        rnd, mean, round_peers, non_finite = current_round(alive)
        self.rounds_completed = max(self.rounds_completed, rnd or 0)
        peers = {
            p: PeerStatus(
                peer_id=p,
                round=r.outer_step,
                train_loss=r.train_loss,
                eval_loss=r.eval_loss,
                tokens=r.tokens,
                tokens_per_second=r.tokens_per_second,
                total_tokens=r.total_tokens,
                group_size=r.group_size,
                lost_rounds=r.lost_rounds,
                last_seen_seconds=max(0.0, now - r.time),
                expires_in_seconds=expirations[p] - now if p in expirations else None,
            )
            for p, r in sorted(alive.items())
        }
        self.last = SwarmSummary(
            time=now,
            run_id=self.run_id,
            num_peers=len(alive),
            round=rnd,
            mean_train_loss=mean,
            round_peers=round_peers,
            eval_loss=self.eval_loss,
            eval_round=self.eval_round,
            tokens_per_second=sum(r.tokens_per_second for r in alive.values()),
            total_tokens=sum(self.tokens_by_peer.values()),
            rounds_completed=self.rounds_completed,
            peers_joined=self.joined,
            peers_left=self.left,
            bad_records=bad,
            bad_records_total=self.bad_total,
            non_finite_peers=non_finite,
            peers=peers,
            read_seconds=read_seconds,
        )
        return self.last

    def failed(self, now: float, error: str) -> SwarmSummary:
        """The last view, re-stamped, with ``error`` set: a read failed (nothing is counted)."""
        base = self.last or self.update({}, now)
        self.last = dataclasses.replace(base, time=now, error=error, read_seconds=None, bad_records=0)
        return self.last


# ----------------------------------------------------------------------------------------- console


def _num(x: float | None, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else ("nan" if not math.isfinite(x) else fmt.format(x))


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 14 else f"{peer_id[:6]}..{peer_id[-6:]}"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def render_line(s: SwarmSummary) -> str:
    """One status line (non-tty console)."""
    head = f"{_clock(s.time)}  "
    if s.error:
        head += f"[read failed: {s.error}]  "
    if s.num_peers == 0:
        if s.rounds_completed == 0 and s.peers_joined == 0:
            return head + f"no peers yet: waiting for records under {metrics_key(s.run_id)!r} (run id {s.run_id})"
        return head + f"no peers alive (last round {s.rounds_completed}, left {s.peers_left})"
    ev = f"  eval {_num(s.eval_loss)}@r{s.eval_round}" if s.eval_loss is not None else ""
    bad = f"  bad records {s.bad_records_total}" if s.bad_records_total else ""
    return (
        head + f"round {s.round}  peers {s.num_peers} (+{s.peers_joined} -{s.peers_left})  "
        f"loss {_num(s.mean_train_loss)}{ev}  {s.tokens_per_second:,.0f} tok/s  total {s.total_tokens:,} tok{bad}"
    )


def render_sample(sample: Mapping[str, Any]) -> str:
    """One line for a summary's ``sample``."""
    took = _num(sample.get("seconds"), "{:.1f}")
    return (
        f"sample of round {sample.get('round')} (checksum {sample.get('checksum')}, {took}s): "
        f"{sample.get('prompt')!r} -> {sample.get('text')!r}"
    )


def render_table(s: SwarmSummary) -> str:
    """The swarm line, one row per alive peer and the latest sample (tty console; also the page's fallback text)."""
    rows = [render_line(s)]
    if s.peers:
        rows.append(
            f"  {'peer':<16}{'round':>6}{'loss':>9}{'tok/s':>10}{'tokens':>12}{'group':>6}{'lost':>6}{'seen':>7}"
        )
        for p in s.peers.values():
            rows.append(
                f"  {_short(p.peer_id):<16}{p.round:>6}{_num(p.train_loss):>9}{p.tokens_per_second:>10,.0f}"
                f"{p.total_tokens:>12,}{p.group_size:>6}{p.lost_rounds:>6}{p.last_seen_seconds:>6.0f}s"
            )
    if s.sample is not None:
        rows.append("  " + render_sample(s.sample))
    return "\n".join(rows)


class ConsoleView:
    """On a tty: the table, redrawn in place (what was printed above it stays). Otherwise: one status line when
    the view changed (peers, round, eval, bad records, error) or ``heartbeat`` seconds passed, and one line per new
    sample."""

    def __init__(self, stream: TextIO, tty: bool | None = None, heartbeat: float = 60.0) -> None:
        self.stream, self.heartbeat = stream, heartbeat
        self.tty = stream.isatty() if tty is None else tty
        self._last_key: tuple | None = None
        self._last_print = -math.inf
        self._drawn = 0  # lines of the table drawn last time (tty)
        self._sample: tuple | None = None  # the last sample printed (not tty)

    def show(self, s: SwarmSummary) -> None:
        if self.tty:
            text = render_table(s)
            back = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""  # up to the table's first line, clear below
            self.stream.write(back + text + "\n")
            self.stream.flush()
            self._drawn = text.count("\n") + 1
            return
        key = (s.num_peers, s.round, s.eval_round, s.bad_records_total, s.error, tuple(s.peers))
        if key != self._last_key or s.time - self._last_print >= self.heartbeat:
            print(render_line(s), file=self.stream, flush=True)
            self._last_key, self._last_print = key, s.time
        sample = s.sample
        if sample is not None and (sample.get("round"), sample.get("time")) != self._sample:
            print(render_sample(sample), file=self.stream, flush=True)
            self._sample = (sample.get("round"), sample.get("time"))


# ----------------------------------------------------------------------------------------- history + loop


class History:
    """``DIR/monitor.jsonl``: one summary per refresh, appended (a restarted monitor continues the file)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / HISTORY_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def last(self) -> dict[str, Any] | None:
        """The last complete line, or None (missing file, empty, or a torn last line)."""
        if not self.path.exists():
            return None
        with self.path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
            lines = f.read().splitlines()
        for line in reversed(lines):
            try:
                return json.loads(line)
            except ValueError:
                continue
        return None

    def append(self, summary: SwarmSummary) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(summary.to_json()) + "\n")


class Samples(Protocol):
    """What the monitor asks of its sampler (monitor_samples.StateSampler). That module imports torch and
    transformers, which only a monitor with --samples needs, and it imports this one for its defaults: the monitor
    names what it calls, not the class."""

    @property
    def latest(self) -> tuple[Any, str | None]:
        """(the latest sample, with ``to_json()``, or None; why the last attempt failed, or None)."""
        ...

    def resume(self, sample: Any) -> None: ...

    def start(self) -> None: ...


class Monitor:
    """refresh() = read + aggregate + print + append; run() repeats it every ``interval`` s until ``stop`` (and with
    ``samples``, starts their thread: each refresh takes the latest sample into its summary)."""

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        out_dir: Path,
        interval: float,
        rejects: RejectCounter | None = None,
        console: ConsoleView | None = None,
        stop: threading.Event | None = None,
        authorized: Container[str] | None = None,
        samples: Samples | None = None,
    ) -> None:
        self.dht, self.run_id, self.interval, self.rejects = dht, run_id, interval, rejects
        self.authorized, self.samples = authorized, samples
        self.history = History(out_dir)
        last = self.history.last()
        self.tracker = SwarmTracker(run_id, resume_from=last)
        if samples is not None and last is not None:
            samples.resume(last.get("sample"))
        self.console = console
        self.stop = stop or threading.Event()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._latest: SwarmSummary | None = None

    @property
    def latest(self) -> SwarmSummary | None:
        with self._lock:
            return self._latest

    def _warn(self, reading: Reading) -> None:
        for peer in reading.ignored:
            if peer not in self._warned:
                self._warned.add(peer)
                log.info("ignoring records of peer %s: not in swarm.authorized_keys (logged once per peer)", peer)
        for reason, digest in reading.bad:
            if digest in self._warned:
                continue
            self._warned.add(digest)
            whose = f"peer {reading.owners[digest]}'s subkey" if digest in reading.owners else f"owner key {digest}"
            log.warning(
                "ignoring a record under %r for %s: it fails the %s check (counted as bad; warned once per key)",
                metrics_key(self.run_id),
                whose,
                reason,
            )

    def refresh(self) -> SwarmSummary:
        now = time.time()
        try:
            timeout = max(10.0, 2 * self.interval)
            reading = read_swarm(
                self.dht, self.run_id, timeout=timeout, rejects=self.rejects, stop=self.stop, authorized=self.authorized
            )
        except TimeoutError as exc:
            if self.stop.is_set() and self._latest is not None:
                return self._latest  # asked to exit mid-read: nothing new to record
            summary = self.tracker.failed(now, str(exc))
        else:
            self._warn(reading)
            summary = self.tracker.update(
                reading.records, now, reading.expirations, bad=len(reading.bad), read_seconds=reading.seconds
            )
        if self.samples is not None:
            sample, error = self.samples.latest
            summary = dataclasses.replace(summary, sample=sample.to_json() if sample else None, sample_error=error)
        self.history.append(summary)
        with self._lock:
            self._latest = summary
        if self.console is not None:
            self.console.show(summary)
        return summary

    def run(self) -> None:
        if self.samples is not None:
            self.samples.start()  # its own thread: a sample's download and generation never delay a refresh
        while not self.stop.is_set():
            started = time.monotonic()
            self.refresh()
            if not self.dht.is_alive():
                raise RuntimeError("the monitor's DHT process exited unexpectedly")
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

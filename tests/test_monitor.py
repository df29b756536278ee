"""The monitor: aggregation, console, history, Prometheus, HTTP and plots without a network; then run_monitor
as a real process against one live 2-peer swarm (bootstrap + 2 run_peer on 127.0.0.1, shared by the swarm
tests of this module), checked through /status, /metrics, the page in headless Chromium, monitor.jsonl
against the peers' own metrics.jsonl, a garbage record, a departing peer, signals and a restart.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.monitor import DEFAULT_PROMPT, ConsoleView, History, SwarmTracker, current_round, render_line
from p2p_diloco.monitor_http import PlotCache, PortInUseError, bind, make_registry
from p2p_diloco.plots import PLOT_NAMES, render_plots, write_plots
from p2p_diloco.swarm.dht import shutdown_dht, start_dht
from p2p_diloco.swarm.identity import owner_of, peer_id_of
from p2p_diloco.swarm.reader import RejectCounter, parse_entries
from p2p_diloco.swarm.records import PeerRecord, metrics_key
from p2p_diloco.swarm.validators import make_validators
from scripts.procs import Proc, live_group_members, wait_until

ROOT = Path(__file__).resolve().parents[1]
RUN = "monitor-test"
PNG = b"\x89PNG\r\n\x1a\n"


def record(peer_id: str, step: int = 1, **changes) -> PeerRecord:
    fields = dict(
        peer_id=peer_id,
        outer_step=step,
        train_loss=3.0,
        eval_loss=None,
        tokens=100,
        total_tokens=100 * step,
        tokens_per_second=50.0,
        group_size=2,
        checksum="ab",
        compute_seconds=1.0,
        matchmaking_seconds=0.1,
        allreduce_seconds=0.1,
        bytes_sent=1,
        bytes_received=1,
        peak_memory_bytes=1,
        time=1000.0,
    )
    fields.update(changes)
    return PeerRecord(**fields)


# ----------------------------------------------------------------------------------------- no network


@pytest.mark.timeout(30)
def test_current_round_is_a_token_weighted_mean_over_the_peers_at_the_top_round():
    assert current_round({}) == (None, None, [], [])
    recs = {
        "a": record("a", 5, train_loss=2.0, tokens=300),
        "b": record("b", 5, train_loss=4.0, tokens=100),
        "c": record("c", 4, train_loss=9.0, tokens=1000),  # behind: not part of round 5's mean
        "d": record("d", 5, train_loss=float("nan"), tokens=100),
    }
    rnd, mean, at_top, non_finite = current_round(recs)
    assert rnd == 5 and at_top == ["a", "b", "d"] and non_finite == ["d"]
    assert mean == pytest.approx((2.0 * 300 + 4.0 * 100) / 400)
    assert current_round({"z": record("z", 1, tokens=0, train_loss=1.5)})[1] == 1.5


@pytest.mark.timeout(30)
def test_tracker_counts_joins_departures_tokens_eval_and_expiry():
    t = SwarmTracker(RUN)
    s = t.update({}, now=1000.0)
    assert s.num_peers == 0 and s.round is None and "no peers yet" in render_line(s)
    a1, b1 = record("a", 1, time=1001.0, eval_loss=3.5), record("b", 1, time=1001.0, eval_loss=3.7)
    s = t.update({"a": a1, "b": b1}, now=1002.0, expirations={"a": 1010.0, "b": 1010.0})
    assert (s.num_peers, s.round, s.peers_joined, s.peers_left) == (2, 1, 2, 0)
    assert s.eval_loss == pytest.approx(3.6) and s.eval_round == 1
    assert s.peers["a"].last_seen_seconds == pytest.approx(1.0) and s.peers["a"].expires_in_seconds == 8.0
    # b's record expires (its expiry is in the past at the read time), a moves on without an eval
    a2 = record("a", 2, time=1012.0)
    s = t.update({"a": a2, "b": b1}, now=1013.0, expirations={"a": 1020.0, "b": 1010.0}, bad=2)
    assert (s.num_peers, s.round, s.peers_joined, s.peers_left) == (1, 2, 2, 1)
    assert s.total_tokens == 200 + 100  # b's tokens still count after it left
    assert s.eval_loss == pytest.approx(3.6) and s.eval_round == 1  # kept until a newer eval arrives
    assert s.bad_records == 2 and s.bad_records_total == 2 and s.rounds_completed == 2
    s = t.update({}, now=1030.0)
    assert s.num_peers == 0 and s.peers_left == 2 and s.rounds_completed == 2
    assert "no peers alive" in render_line(s)
    failed = t.failed(1031.0, "timeout")
    assert failed.error == "timeout" and failed.time == 1031.0 and "read failed" in render_line(failed)
    json.dumps(failed.to_json(), allow_nan=False)
    resumed = SwarmTracker(RUN, resume_from=s.to_json())
    assert resumed.rounds_completed == 2 and resumed.eval_loss == pytest.approx(3.6)
    odd = SwarmTracker(RUN, resume_from={"eval_round": "x", "eval_loss": None, "rounds_completed": "7"})
    assert odd.rounds_completed == 0 and odd.eval_loss is None


@pytest.mark.timeout(30)
def test_summary_json_has_no_nan_and_console_prints_only_changes(tmp_path):
    t = SwarmTracker(RUN)
    s = t.update({"a": record("a", 3, train_loss=float("inf"))}, now=2000.0)
    data = s.to_json()
    json.dumps(data, allow_nan=False)
    assert data["peers"]["a"]["train_loss"] is None and data["non_finite_peers"] == ["a"]
    out = io.StringIO()
    view = ConsoleView(out, tty=False, heartbeat=60)
    for now in (2000.0, 2001.0, 2002.0):
        view.show(dataclasses.replace(s, time=now))
    view.show(dataclasses.replace(s, time=2070.0))  # heartbeat
    view.show(dataclasses.replace(s, time=2071.0, num_peers=2))  # a change
    assert len(out.getvalue().splitlines()) == 3
    tty = io.StringIO()
    view = ConsoleView(tty, tty=True)
    view.show(s)
    first = tty.getvalue()
    view.show(s)
    assert "round" in first and tty.getvalue()[len(first) :].startswith(f"\x1b[{first.count(chr(10))}F\x1b[J")

    history = History(tmp_path)
    assert history.last() is None
    history.append(s)
    history.append(dataclasses.replace(s, round=4))
    with history.path.open("a") as f:
        f.write('{"torn": ')  # a monitor killed mid-write
    assert history.last()["round"] == 4


def signer() -> tuple[list, bytes, str]:
    """A node's validators, its subkey and the peer id its records carry."""
    validators = make_validators(RUN)
    subkey = validators[0].local_public_key
    return validators, subkey, peer_id_of(owner_of(subkey))


@pytest.mark.timeout(30)
def test_parse_entries_keeps_expiry_and_names_owners():
    (_, key_a, peer_a), (_, key_b, peer_b), (_, key_c, _) = signer(), signer(), signer()
    entries = {
        key_a: ValueWithExpiration(record(peer_a, 1, time=5.0).model_dump(), 100.0),
        key_b: ValueWithExpiration(record(peer_b, 2, time=6.0).model_dump(), 200.0),
        key_c: ValueWithExpiration(record(peer_a, 3, time=7.0).model_dump(), 300.0),  # c reports under a's id
        b"[owner:x]": ValueWithExpiration({"peer_id": "C"}, 300.0),
    }
    records, expirations, owners, bad = parse_entries(entries)
    assert records[peer_a].outer_step == 1 and expirations == {peer_a: 100.0, peer_b: 200.0}
    assert sorted(owners.values()) == sorted([peer_a, peer_b]) and len(bad) == 2
    assert parse_entries("plain")[3] == ["<plain value>"]
    records, expirations, owners, bad = parse_entries(entries, authorized=frozenset({peer_b}))
    assert set(records) == {peer_b} and len(bad) == 2  # a is not listed: ignored, not bad


def _dht_record(value: object, subkey: bytes, signer: list) -> DHTRecord:
    record = DHTRecord(
        DHTID.generate(source=metrics_key(RUN)).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        get_dht_time() + 60,
    )
    return dataclasses.replace(record, value=CompositeValidator(signer).sign_value(record))


@pytest.mark.timeout(30)
def test_reject_counter_validates_like_the_validators_and_reports_refusals():
    (validators_a, key_a, peer_a), (validators_b, _, _) = signer(), signer()
    counter = RejectCounter(make_validators(RUN), RUN)
    now = get_dht_time()
    good = _dht_record(record(peer_a, time=now).model_dump(), key_a, validators_a)
    assert counter.validate(good) and counter.drain() == []
    bad_schema = _dht_record({"peer_id": peer_a, "garbage": True}, key_a, validators_a)
    forged = _dht_record(record(peer_a, 99, time=now).model_dump(), key_a, validators_b)  # b cannot sign for a
    junk_key = _dht_record(record(peer_a, time=now).model_dump(), b"[owner:not a key]", validators_a)
    future = _dht_record(record(peer_a, time=1e18).model_dump(), key_a, validators_a)
    hang = _dht_record({"round": "[signature:xyz]"}, b"evil", validators_a)  # unsigned: would hang readers
    for rec in (bad_schema, forged, junk_key, future, hang):
        assert not counter.validate(rec)
    reports = counter.drain()
    assert [r for r, _ in reports] == ["schema", "signature", "owner-key", "bounds", "signature-text"]
    assert reports[0][1] == reports[1][1] == reports[3][1]  # same owner key: a's
    other_key = dataclasses.replace(bad_schema, key=DHTID.generate(source="other").to_bytes())
    counter.validate(other_key)
    assert counter.drain() == []  # only the run's key is counted


@pytest.mark.timeout(30)
def test_run_monitor_refuses_a_bad_authorized_keys_file_or_config(tmp_path, capsys):
    from peers.run_monitor import main, parse_args, run_config, run_settings

    bad = tmp_path / "keys.txt"
    bad.write_text("not a key\n")
    assert main(["--out", str(tmp_path / "m"), "--authorized-keys", str(bad)]) == 2
    assert "line 1 is not an RSA public key" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "m"), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    _, subkey, peer = signer()
    good = tmp_path / "good.txt"
    good.write_text(f"# the organiser's list\n{owner_of(subkey).decode()}\n")
    args = parse_args(
        ["--out", str(tmp_path), "--config", str(ROOT / "configs" / "tiny.yaml"), "--authorized-keys", str(good)]
    )
    run_id, authorized = run_settings(args, run_config(args))
    assert peer in authorized and authorized.listed == frozenset({peer}) and run_id  # the run id from the config
    bare = parse_args(["--out", str(tmp_path), "--run-id", "x"])
    assert run_settings(bare, run_config(bare)) == ("x", None)


def _fake_summary():
    t = SwarmTracker(RUN)
    return t.update(
        {"a": record("a", 7, eval_loss=2.5), "b": record("b", 7)}, now=1001.0, expirations={"a": 2e9, "b": 2e9}
    )


@pytest.mark.timeout(60)
def test_http_server_metrics_status_page_plots_and_busy_port(tmp_path):
    summary = _fake_summary()
    assert generate_latest(make_registry(lambda: None)) == b""  # before the first refresh: no samples
    History(tmp_path).append(summary)
    server = bind("127.0.0.1", 0, lambda: summary, 1000, PlotCache(tmp_path / "monitor.jsonl"))
    server.start()
    try:
        base = server.url
        with urllib.request.urlopen(base + "metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert families["p2p_diloco_peers_alive"].samples[0].value == 2
        assert families["p2p_diloco_tokens"].type == "counter"
        assert families["p2p_diloco_tokens"].samples[0].name == "p2p_diloco_tokens_total"
        assert {s.labels["peer"] for s in families["p2p_diloco_peer_train_loss"].samples} == {"a", "b"}
        assert "p2p_diloco_peer_last_seen_seconds" in families
        with urllib.request.urlopen(base + "status", timeout=10) as r:
            assert json.loads(r.read())["num_peers"] == 2
        with urllib.request.urlopen(base, timeout=10) as r:
            page = r.read().decode()
        assert 'id="num-peers"' in page and "fetch(" in page
        for name in PLOT_NAMES:
            with urllib.request.urlopen(f"{base}plots/{name}.png", timeout=30) as r:
                assert r.read().startswith(PNG)
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + "nope", timeout=10)
        with pytest.raises(PortInUseError, match="already in use"):
            bind("127.0.0.1", server.server_address[1], lambda: None, 1000)
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_plots_from_history_and_peer_logs(tmp_path):
    t = SwarmTracker(RUN)
    history = History(tmp_path / "mon")
    for step in range(1, 6):
        history.append(t.update({"a": record("a", step, train_loss=5.0 - step / 2)}, now=1000.0 + step * 10))
    for k in range(2):
        d = tmp_path / f"peer{k}"
        d.mkdir()
        lines = [
            json.dumps(dict(record(f"p{k}", s, train_loss=4.0 - s / 3).model_dump(), eval_loss=None)) for s in (1, 2, 3)
        ]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    pngs = render_plots(history.path, [tmp_path / "peer0", tmp_path / "peer1"])
    assert set(pngs) == set(PLOT_NAMES) and all(p.startswith(PNG) and len(p) > 2000 for p in pngs.values())
    empty = render_plots(tmp_path / "missing.jsonl")
    assert all(p.startswith(PNG) for p in empty.values())  # "no data yet" images
    with pytest.raises(FileNotFoundError):
        write_plots(tmp_path / "out", tmp_path / "missing.jsonl", [tmp_path / "nope"])


# ----------------------------------------------------------------------------------------- processes

LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
TTL = 12.0
PEER_SETS = [
    "inner.steps=5",
    "train.rounds=100000",
    "train.eval_every=3",
    "train.checkpoint_every=0",
    "data.eval_batches=1",
    "logging.progress_bar=false",
    "swarm.target_group_size=2",
    "swarm.matchmaking_time=4",
    "swarm.request_timeout=2",
    "swarm.allreduce_timeout=15",
    "swarm.next_chunk_timeout=5",
    "swarm.round_deadline=40",
    "swarm.join_timeout=30",
    "swarm.state_timeout=5",
    f"swarm.record_ttl={TTL}",
    "swarm.linger_seconds=0",
]


# the peers' config and --set: the fingerprint a monitor with --samples checks the state with
SAMPLES = ["--config", str(ROOT / "configs" / "tiny.yaml"), *(x for s in PEER_SETS for x in ("--set", s)),
           "--samples", "--sample-tokens", "16"]  # fmt: skip


def monitor_args(initial: list[str], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "peers.run_monitor", "--initial-peers", *initial, "--out", str(out),
            "--run-id", RUN, "--interval", "1", *LOCAL, *extra]  # fmt: skip


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=15) as r:
        return json.loads(r.read())


def wait_status(url: str, predicate, timeout: float) -> dict:
    seen: list[dict] = []

    def check() -> bool:
        try:
            seen.append(get_json(url + "status"))
        except OSError:
            return False
        return predicate(seen[-1])

    assert wait_until(check, timeout, poll=0.5), f"no /status matching within {timeout}s; last: {seen[-1:]}"
    return seen[-1]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """bootstrap + monitor (started first, so it waits for peers; with --samples) + 2 training peers, for this
    module's tests."""
    tmp = tmp_path_factory.mktemp("swarm")
    procs: list[Proc] = []
    try:
        boot = Proc([sys.executable, "-m", "peers.run_bootstrap", *LOCAL])
        procs.append(boot)
        initial = boot.wait_for_line(r"^--initial-peers ", timeout=90).string.split()[1:]
        # --sample-every 10: a download every round would spend the peers' swarm.max_state_downloads budget
        monitor = Proc(monitor_args(initial, tmp / "mon", "--port", "0", *SAMPLES, "--sample-every", "10"))
        procs.append(monitor)
        url = monitor.wait_for_line(r"^monitor page: (\S+)", timeout=90).group(1)
        waiting = monitor.wait_for_line(r"no peers yet", timeout=30).string
        peers = []
        for k in range(2):
            sets = [x for s in (*PEER_SETS, f"swarm.run_id={RUN}", f"data.shard_index={k}") for x in ("--set", s)]
            args = [sys.executable, "-m", "peers.run_peer", "--config", str(ROOT / "configs" / "tiny.yaml"),
                    "--log-dir", str(tmp / f"peer{k}"), *LOCAL, *sets, "--initial-peers", *initial]  # fmt: skip
            peers.append(Proc(args))
            procs.append(peers[-1])
        ids = [p.wait_for_line(r"^peer (\S+) reachable as", timeout=120).group(1) for p in peers]
        wait_status(url, lambda s: s.get("num_peers") == 2, timeout=150)
        yield dict(tmp=tmp, url=url, monitor=monitor, peers=peers, ids=ids, initial=initial, waiting=waiting, boot=boot)
    finally:  # politely first (a peer stopped by SIGTERM exits as a user's would), then for sure
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            p.kill_group()


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_monitor_fails_clearly_on_unreachable_bootstrap_and_busy_port(spawn, tmp_path):
    dead = ["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPGyfpGya6yDt8sNqjN3Ncx1sFqvwuDE5mTQRqLyDSBYd"]
    proc = spawn(monitor_args(dead, tmp_path / "a", "--join-timeout", "5"))
    assert proc.wait(timeout=45) == 3, proc.describe()
    assert "no initial peer answered" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = spawn(monitor_args(dead, tmp_path / "b", "--port", str(busy.getsockname()[1])))
        assert proc.wait(timeout=30) == 2, proc.describe()
    assert "already in use" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_status_metrics_and_the_page_in_a_browser(swarm, tmp_path):
    assert "waiting for records" in swarm["waiting"]
    status = wait_status(swarm["url"], lambda s: s["num_peers"] == 2 and s["eval_loss"] is not None, timeout=60)
    assert set(status["peers"]) == set(swarm["ids"]) and status["round"] >= 1
    assert status["mean_train_loss"] > 0 and status["tokens_per_second"] > 0 and status["total_tokens"] > 0
    with urllib.request.urlopen(swarm["url"] + "metrics", timeout=15) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert families["p2p_diloco_peers_alive"].samples[0].value in (1, 2)
    assert families["p2p_diloco_tokens"].samples[0].name == "p2p_diloco_tokens_total"

    for _attempt in range(3):  # under load a record can expire for a moment; the page must show what /status shows
        dom = chromium_dom(swarm["url"], tmp_path / "chromium")
        shown = dom.split('id="num-peers">', 1)[-1].split("<", 1)[0]
        if shown == "2":
            break
        time.sleep(2)
    assert shown == "2", dom[:3000]
    assert 'id="updated">never' not in dom  # the numbers came from /status through the page's JS


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_reported_loss_matches_the_peers_own_logs_and_plots_render(swarm, tmp_path):
    wait_status(swarm["url"], lambda s: s["rounds_completed"] >= 4, timeout=90)
    logs = {}
    for k in range(2):
        for line in (swarm["tmp"] / f"peer{k}" / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            logs[(r["peer_id"], r["outer_step"])] = r
    history = [json.loads(line) for line in (swarm["tmp"] / "mon" / "monitor.jsonl").read_text().splitlines()]
    compared = 0
    for h in history:
        for peer_id, p in h["peers"].items():
            own = logs.get((peer_id, p["round"]))
            if own is not None:  # a round the peer logged (a record read back from the DHT is the same round)
                assert p["train_loss"] == pytest.approx(own["train_loss"], rel=1e-12)
                assert p["total_tokens"] == own["total_tokens"]
                compared += 1
        own = [logs.get((p, h["round"])) for p in h["round_peers"]]
        if h["mean_train_loss"] is not None and all(own):
            weight = sum(o["tokens"] for o in own)
            assert h["mean_train_loss"] == pytest.approx(sum(o["train_loss"] * o["tokens"] for o in own) / weight)
    assert compared >= 4

    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "peers.run_monitor", "--plot", str(swarm["tmp"] / "mon"), "--plot-out", str(out),
         "--peer-logs", str(swarm["tmp"] / "peer0"), str(swarm["tmp"] / "peer1")],
        cwd=ROOT, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in PLOT_NAMES:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 2000


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_garbage_record_is_ignored_counted_and_warned_once(swarm):
    before = get_json(swarm["url"] + "status")["bad_records_total"]
    signer = RSASignatureValidator(RSAPrivateKey())  # signs, but runs no schema check: stores garbage
    node = start_dht(swarm["initial"], host_maddrs=LOCAL[1:], join_timeout=30, record_validators=[signer])
    try:
        garbage = {"peer_id": "ghost", "train_loss": "lots"}
        # stored by this node (it runs no schema check); refused by the bootstrap, the peers and the monitor.
        # store()'s answer is the nearest replica's, so it may be False even though garbage now sits in the DHT
        node.store(metrics_key(RUN), garbage, get_dht_time() + 30, subkey=signer.local_public_key)
        status = wait_status(swarm["url"], lambda s: s["bad_records_total"] >= before + 3, timeout=60)
    finally:
        shutdown_dht(node)
    assert "ghost" not in json.dumps(status["peers"]) and status["num_peers"] >= 1
    warnings = [line for line in swarm["monitor"].stderr_lines if "ignoring a record" in line]
    assert len(warnings) == 1 and "schema" in warnings[0], warnings  # once per key, however often it is seen


def chromium_dom(url: str, profile: Path) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("headless Chromium missing: run scripts/install_browser.sh")
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=90,
    ).stdout  # fmt: skip


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_samples_come_from_a_state_the_peers_logged_and_show_in_status_history_console_and_page(swarm, tmp_path):
    """The monitor's --samples (the peers' config and --set give it the fingerprint): its sample's (round, checksum)
    is one the peers logged, and it shows everywhere a summary goes. A client-mode monitor's: the departure test."""
    status = wait_status(swarm["url"], lambda s: s.get("sample") is not None, timeout=90)
    sample = status["sample"]
    assert sample["round"] > 0 and sample["text"] and sample["prompt"] == DEFAULT_PROMPT, sample
    assert sample["seconds"] >= sample["download_seconds"] > 0

    def logged() -> set[tuple[int, str]]:  # a peer announces a new state before its round's log line is written
        lines = [line for k in range(2) for line in (swarm["tmp"] / f"peer{k}" / "metrics.jsonl").open()]
        return {(r["outer_step"], r["checksum"]) for r in map(json.loads, lines)}

    assert wait_until(lambda: (sample["round"], sample["checksum"]) in logged(), 15), (sample, sorted(logged()))
    shown = swarm["monitor"].wait_for_line(r"^sample of round (\d+) \(checksum (\w+)", timeout=15)
    assert int(shown.group(1)) > 0 and (int(shown.group(1)), shown.group(2)) in logged()
    dom = chromium_dom(swarm["url"], tmp_path / "chromium")  # the page's JS filled the section in from /status
    page_round = re.search(r'id="sample-round">from round (\d+)<', dom)
    assert page_round and int(page_round.group(1)) >= sample["round"], dom[:4000]  # this sample, or a newer one
    assert f'id="sample-prompt">{html.escape(DEFAULT_PROMPT)}</b><span id="sample-continuation">' in dom, dom[:4000]
    assert 'id="sample-continuation"></span>' not in dom, dom[:4000]  # a text was shown
    history = [json.loads(line) for line in (swarm["tmp"] / "mon" / "monitor.jsonl").read_text().splitlines()]
    assert sample in [h["sample"] for h in history]


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_departure_shows_after_expiry_then_signals_exit_cleanly_and_a_restart_continues(swarm):
    url, leave, stay_id = swarm["url"], swarm["peers"][1], swarm["ids"][0]
    wait_status(url, lambda s: s["num_peers"] == 2, timeout=60)
    stopped = time.monotonic()
    leave.popen.send_signal(signal.SIGTERM)
    status = wait_status(url, lambda s: set(s["peers"]) == {stay_id}, timeout=TTL + 60)
    took = time.monotonic() - stopped
    print(f"peer departure shown after {took:.1f}s (swarm.record_ttl={TTL:g}s, monitor interval 1s)")
    assert status["num_peers"] == 1 and status["peers_left"] >= 1 and took <= TTL + 45
    assert leave.wait(timeout=60) == 0, leave.describe()

    monitor, history = swarm["monitor"], swarm["tmp"] / "mon" / "monitor.jsonl"

    def last_sample() -> dict | None:  # what a restarted monitor goes on from (none until its first download)
        lines = history.read_text().splitlines() if history.exists() else []
        return json.loads(lines[-1])["sample"] if lines else None

    # this test may run first in its module (pytest -k): the monitor must have downloaded a sample before it stops
    assert wait_until(lambda: last_sample() is not None, 120, poll=0.5), monitor.describe()
    monitor.popen.send_signal(signal.SIGTERM)
    assert monitor.wait(timeout=30) == 0, monitor.describe()
    assert wait_until(lambda: not live_group_members(monitor.pgid), 10), live_group_members(monitor.pgid)
    lines_before = len(history.read_text().splitlines())

    resumed = last_sample()
    assert resumed is not None and resumed["round"] > 0
    # reads, takes no connections, and downloads samples as a client
    again = Proc(monitor_args(swarm["initial"], swarm["tmp"] / "mon", "--client-mode", *SAMPLES, "--sample-every", "3"))

    def seen() -> bool:  # the lone peer alive, and a sample of one of its later rounds (the history's comes first)
        lines = list(again.stdout_lines)
        rounds = [int(m.group(1)) for line in lines if (m := re.match(r"sample of round (\d+) ", line))]
        alone = any(re.search(r"round \d+  peers 1 ", line) for line in lines)
        return alone and max(rounds, default=0) > resumed["round"]

    try:
        assert wait_until(seen, 120, poll=0.5), again.describe()
        again.popen.send_signal(signal.SIGINT)
        assert again.wait(timeout=30) == 0, again.describe()
        assert wait_until(lambda: not live_group_members(again.pgid), 10), live_group_members(again.pgid)
    finally:
        again.kill_group()
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(records) > lines_before and records[-1]["time"] > records[lines_before - 1]["time"]
    assert records[-1]["rounds_completed"] >= records[lines_before - 1]["rounds_completed"]
    assert all(r["sample"] is not None for r in records[lines_before:])  # it went on from the history's sample
    assert all(math.isfinite(r["time"]) for r in records) and os.path.getsize(history) > 0

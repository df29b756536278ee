"""run_bootstrap and p2p_diloco.swarm.dht: address parsing, joining through a bootstrap process, identity,
clean shutdown on SIGTERM, and clear errors (no traceback, bounded time) for bad or unreachable peers."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import pytest
from hivemind.utils import get_dht_time

from p2p_diloco.swarm.dht import (
    EXAMPLE_MADDR,
    NODE_POLICY,
    SwarmSetupError,
    SwarmUnreachableError,
    initial_peers_from_env,
    initial_peers_line,
    known_peers,
    order_maddrs,
    parse_initial_peers,
    shutdown_dht,
    start_dht,
    visible_maddrs,
)
from peers.run_bootstrap import build_parser, main
from scripts.procs import descendants, live_group_members, wait_until

PEER_ID = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"  # a well-formed id that nobody here owns
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
LINE = r"^--initial-peers (\S+( \S+)*)$"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_children(before: set[int]) -> list[tuple[int, str]]:
    """Live descendants of this process not in ``before``; torch's shared-memory manager is expected."""
    found = [(pid, name) for pid, _, name in descendants(os.getpid()) if pid not in before]
    return [(pid, name) for pid, name in found if not name.startswith("torch_shm")]


def bootstrap_args(*extra: str) -> list[str]:
    return [sys.executable, "-m", "peers.run_bootstrap", *extra]


def env_without_peers() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("P2P_DILOCO_INITIAL_PEERS", None)
    return env


# ------------------------------------------------------------------------------------------- unit


@pytest.mark.timeout(10)
def test_parse_initial_peers_accepts_pasted_lines():
    a = f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER_ID}"
    b = f"/ip4/127.0.0.1/tcp/31338/p2p/{PEER_ID}"
    assert parse_initial_peers([a]) == [a]
    assert parse_initial_peers([f"--initial-peers {a}  {b}", f"{b},{a}"]) == [a, b]
    assert parse_initial_peers(["", "  "]) == []
    assert initial_peers_from_env({"P2P_DILOCO_INITIAL_PEERS": f"{a}, {b}"}) == [a, b]
    assert initial_peers_from_env({}) == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad, words",
    [
        ("1.2.3.4:31337", "malformed"),
        ("/ip4/1.2.3.4/tcp/31337", "/p2p/"),
        (f"/ip4/1.2.3.999/tcp/31337/p2p/{PEER_ID}", "malformed"),
        ("/ip4/1.2.3.4/tcp/31337/p2p/Qmnotanid", "malformed"),
        (f"/p2p/{PEER_ID}", "no network address"),
    ],
)
def test_parse_initial_peers_names_the_bad_address(bad, words):
    with pytest.raises(SwarmSetupError) as info:
        parse_initial_peers([f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}", bad])
    message = str(info.value)
    assert bad in message and words in message and EXAMPLE_MADDR in message


@pytest.mark.timeout(10)
def test_copy_paste_line_prefers_reachable_addresses():
    lo, lan = f"/ip4/127.0.0.1/tcp/5/p2p/{PEER_ID}", f"/ip4/192.168.1.2/tcp/5/p2p/{PEER_ID}"
    ip6 = f"/ip6/::1/tcp/5/p2p/{PEER_ID}"
    assert order_maddrs([ip6, lo, lan]) == [lan, lo, ip6]
    assert initial_peers_line([lo, lan]) == f"--initial-peers {lan}"
    assert initial_peers_line([lo]) == f"--initial-peers {lo}"


@pytest.mark.timeout(10)
def test_cli_flags(capsys):
    assert build_parser().parse_args(["--initial_peers", "a", "b"]).initial_peers == ["a", "b"]
    assert build_parser().parse_args([]).initial_peers is None  # absent: env, else a new swarm
    assert main(["--port", "31337", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]) == 2  # bad input, as run_peer
    assert "not both" in capsys.readouterr().err
    assert main(["--port", "70000"]) == 2
    assert "not a TCP port" in capsys.readouterr().err
    assert build_parser().parse_args(["--run-id", "a", "--run-id", "b"]).run_ids == ["a", "b"]
    assert main(["--run-id", "has.dot"]) == 2
    assert "not a run id" in capsys.readouterr().err
    help_text = build_parser().format_help()
    assert "What it validates" in help_text and "NAME_metrics" in help_text and "NAME_fingerprint" in help_text


@pytest.mark.timeout(10)
def test_empty_initial_peers_refused_unless_new_swarm():
    with pytest.raises(SwarmSetupError, match="no initial peers"):
        start_dht([], host_maddrs=LOCAL, join_timeout=5)


@pytest.mark.swarm
@pytest.mark.timeout(30)
def test_start_dht_unreachable_leaves_no_process():
    before = {pid for pid, _, _ in descendants(os.getpid())}
    addr = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{PEER_ID}"
    t0 = time.monotonic()
    with pytest.raises(SwarmUnreachableError) as info:
        start_dht([addr], host_maddrs=LOCAL, join_timeout=5)
    assert time.monotonic() - t0 < 5 * 2 + 5
    message = str(info.value)
    for words in ("no initial peer answered within 5 s", addr, "/p2p/", "firewall", "--announce-maddrs"):
        assert words in message
    assert wait_until(lambda: not new_children(before), 5), new_children(before)


# ------------------------------------------------------------------------------------------- processes


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_bootstrap_serves_peers_and_stops_on_sigterm(spawn):
    boot = spawn(
        bootstrap_args("--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--join-timeout", "10"), env=env_without_peers()
    )
    line = boot.wait_for_line(LINE, timeout=40).group(0)
    maddrs = parse_initial_peers([line])
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)
    assert boot.wait_for_line(r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$", timeout=5).group(0) in maddrs
    assert any(name == "p2pd" for _, name in live_group_members(boot.pgid))

    a = start_dht(maddrs, host_maddrs=LOCAL, join_timeout=10)
    b = None
    try:
        b = start_dht(maddrs, host_maddrs=LOCAL, join_timeout=10)
        assert visible_maddrs(a)[0].startswith("/ip4/127.0.0.1/")
        assert a.store("greeting", "hello", expiration_time=time.time() + 60)
        found = b.get("greeting", latest=True)
        assert found is not None and found.value == "hello"
    finally:
        for dht in (b, a):
            if dht is not None:
                shutdown_dht(dht)

    t0 = time.monotonic()
    os.kill(boot.pid, signal.SIGTERM)
    assert boot.wait(timeout=15) == 0, boot.describe()
    assert time.monotonic() - t0 < 10
    assert wait_until(lambda: not live_group_members(boot.pgid), 5), live_group_members(boot.pgid)
    assert "Traceback" not in boot.stderr, boot.stderr


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_identity_path_keeps_the_peer_id(spawn, tmp_path):
    key = tmp_path / "bootstrap.key"
    ids = []
    for _ in range(2):
        boot = spawn(
            bootstrap_args("--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path", str(key)),
            env=env_without_peers(),
        )
        line = boot.wait_for_line(LINE, timeout=40).group(0)
        ids.append({m.rsplit("/", 1)[-1] for m in parse_initial_peers([line])})
        os.kill(boot.pid, signal.SIGTERM)
        assert boot.wait(timeout=15) == 0, boot.describe()
        assert wait_until(lambda b=boot: not live_group_members(b.pgid), 5)
    assert key.is_file()
    assert len(ids[0]) == 1 and ids[0] == ids[1]


@pytest.mark.swarm
@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    "peers, words",
    [
        (["1.2.3.4:31337"], "malformed initial peer address '1.2.3.4:31337'"),
        (["/ip4/127.0.0.1/tcp/31337"], "no /p2p/<peer id> part"),
        ([""], "without any address"),
        (["UNREACHABLE"], "no initial peer answered within 5 s"),
    ],
    ids=["malformed", "no-peer-id", "empty", "unreachable"],
)
def test_bad_initial_peers_fail_cleanly(spawn, peers, words):
    peers = [f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{PEER_ID}" if p == "UNREACHABLE" else p for p in peers]
    t0 = time.monotonic()
    boot = spawn(
        bootstrap_args("--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--join-timeout", "5", "--initial-peers", *peers),
        env=env_without_peers(),
    )
    rc = boot.wait(timeout=30)
    assert rc == (3 if words.startswith("no initial peer answered") else 2), boot.describe()
    assert time.monotonic() - t0 < 30
    assert words in boot.stderr, boot.describe()
    assert "Traceback" not in boot.stderr, boot.describe()
    assert not boot.stdout_lines, boot.describe()
    assert wait_until(lambda: not live_group_members(boot.pgid), 5), live_group_members(boot.pgid)


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_a_busy_initial_peer_is_asked_again_within_join_timeout():
    """An initial peer that accepts the connection but answers no ping within hivemind's RPC timeout (3 s: its DHT
    process is stopped here, its p2pd is not) fails the first bootstrap; start_dht tries again, and joins once it
    answers (a bootstrap node busy with many peers joining at once failed 7 of 32 so)."""
    first = start_dht([], new_swarm=True, host_maddrs=LOCAL, join_timeout=10)
    joined: list = []
    try:
        os.kill(first.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        resumed = threading.Timer(6.0, os.kill, (first.pid, signal.SIGCONT))
        resumed.start()
        second = start_dht(visible_maddrs(first), host_maddrs=LOCAL, join_timeout=30)
        joined.append(second)
        assert time.monotonic() - t0 > 6.0  # it could not have joined before the initial peer answered
        assert str(first.peer_id) in known_peers(second)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        for dht in [*joined, first]:
            shutdown_dht(dht)


async def _cached_stored_and_k(_dht, node):
    return len(node.protocol.cache), len(node.protocol.storage), node.protocol.bucket_size


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_a_node_keeps_no_copy_of_what_it_reads():
    """dht.NODE_POLICY: a value read is not cached by a reader that is not one of its replicas (nor sent to another
    node), so a lookup of the run's members is answered by the key's replicas only; the search beam is 8 nodes. One
    replica of three nodes here, so that a reader holds no stored copy (with hivemind's defaults it caches one)."""
    nodes = [start_dht([], new_swarm=True, host_maddrs=LOCAL, join_timeout=10, num_replicas=1)]
    try:
        for _ in range(2):
            nodes.append(start_dht(visible_maddrs(nodes[0]), host_maddrs=LOCAL, join_timeout=10, num_replicas=1))
        assert nodes[0].store("members", b"x", get_dht_time() + 60, subkey="a")
        readers = [n for n in nodes if n.run_coroutine(_cached_stored_and_k)[1] == 0]
        assert len(readers) == 2
        found = readers[0].get("members", latest=True)
        assert found is not None and set(found.value) == {"a"}
        assert readers[0].run_coroutine(_cached_stored_and_k) == (0, 0, NODE_POLICY["bucket_size"])
        assert readers[1].run_coroutine(_cached_stored_and_k)[:2] == (0, 0)  # nobody sent it a copy either
    finally:
        for dht in reversed(nodes):
            shutdown_dht(dht)

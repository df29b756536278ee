"""p2p_diloco.swarm.reachability: the mode each flag and check result leads to (and what the console says), the
ports a check may ask about, and the dial-back check itself between real DHT nodes on 127.0.0.1 (each node's DHT
process and p2pd shut down by the fixtures)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hivemind.dht import DHT

from p2p_diloco.swarm import reachability
from p2p_diloco.swarm.dht import shutdown_dht, visible_maddrs
from p2p_diloco.swarm.reachability import MAX_CHECKS_PER_MINUTE, MAX_PORTS, Reachability, check, choose_mode, ports_of

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
CHECKER = "12D3KooWQmaV6yfBfQPDJLCLCm7CkHmRrwBY3UVbnyWtFJzPqoUH"
NOT_REACHABLE = Reachability(False, CHECKER, "203.0.113.7", (31337, 31338))
REACHABLE = Reachability(True, CHECKER, "198.51.100.4", (4242,), ("/ip4/198.51.100.4/tcp/4242",))
UNKNOWN = Reachability(None, detail="no peer answered the check (...PqoUH: TimeoutError)")


# ----------------------------------------------------------------------------------------- choose_mode


@pytest.mark.parametrize("found", [REACHABLE, NOT_REACHABLE, UNKNOWN], ids=["reachable", "not-reachable", "unknown"])
def test_client_mode_flag_wins_over_any_check_result(found):
    mode = choose_mode(True, found)
    assert mode.client
    assert "--client-mode" in mode.line and "never leads" in mode.line


@pytest.mark.parametrize("flag", [None, False], ids=["automatic", "no-client-mode"])
def test_a_reachable_peer_runs_as_a_full_peer_and_says_where_it_was_reached(flag):
    mode = choose_mode(flag, REACHABLE)
    assert not mode.client
    assert "/ip4/198.51.100.4/tcp/4242" in mode.line and "...FJzPqoUH" in mode.line
    assert "full peer" in mode.line


def test_not_reachable_runs_as_a_client_and_says_which_port_to_forward():
    mode = choose_mode(None, NOT_REACHABLE)
    assert mode.client
    assert "203.0.113.7:31337, 203.0.113.7:31338" in mode.line  # what the checker tried
    assert "forward TCP port 31337" in mode.line
    assert "--announce-maddrs /ip4/<public IP>/tcp/31337" in mode.line


def test_no_client_mode_keeps_a_full_peer_when_not_reachable_and_still_says_how_to_fix_it():
    mode = choose_mode(False, NOT_REACHABLE)
    assert not mode.client
    assert "--no-client-mode" in mode.line and "not reachable" in mode.line
    assert "forward TCP port 31337" in mode.line
    assert "--announce-maddrs /ip4/<public IP>/tcp/31337" in mode.line


@pytest.mark.parametrize("flag", [None, False], ids=["automatic", "no-client-mode"])
def test_unknown_reachability_keeps_a_full_peer_and_says_why(flag):
    mode = choose_mode(flag, UNKNOWN)
    assert not mode.client
    assert "no peer answered the check" in mode.line and "full peer" in mode.line
    if flag is None:
        assert "--client-mode" in mode.line  # the way out when others cannot dial this machine after all


# ----------------------------------------------------------------------------------------- ports_of


def test_ports_of_real_multiaddr_lists():
    peer = "12D3KooWQmaV6yfBfQPDJLCLCm7CkHmRrwBY3UVbnyWtFJzPqoUH"
    relay = "12D3KooWHx2vS5SAXTmaZ6TCZ4G7MmB3Ux4J2zW1yWmTpYxmHnLq"
    maddrs = [
        f"/ip4/192.168.1.20/tcp/38111/p2p/{peer}",
        f"/ip4/127.0.0.1/tcp/38111/p2p/{peer}",  # the same port on another interface: once
        f"/ip6/::1/tcp/40001/p2p/{peer}",
        f"/ip4/192.168.1.20/udp/38112/quic/p2p/{peer}",  # not TCP: the checker only opens TCP connections
        f"/ip4/203.0.113.9/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{peer}",  # relayed: the port is the relay's
        "/dns4/example.org/tcp/443/wss",
    ]
    assert ports_of(maddrs) == [38111, 40001, 443]


@pytest.mark.parametrize(
    "maddrs",
    [
        [],
        ["garbage", "", "/", "/tcp", "/tcp/", "/tcp/http", "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/tcp/70000"],
        ["/ip4/1.2.3.4/udp/5000/quic-v1", "/ip4/1.2.3.4/tcp/-1"],
    ],
    ids=["empty", "garbage", "no-tcp"],
)
def test_ports_of_skips_what_is_not_a_direct_tcp_port(maddrs):
    assert ports_of(maddrs) == []


def test_ports_of_keeps_at_most_max_ports_in_order():
    assert ports_of([f"/ip4/10.0.0.1/tcp/{p}" for p in range(5000, 5010)]) == list(range(5000, 5000 + MAX_PORTS))


# ----------------------------------------------------------------------------------------- the check, for real


def _node(initial: list[str] | None = None) -> DHT:
    return DHT(initial_peers=initial, start=True, host_maddrs=LOCAL, await_ready=True)


@pytest.fixture(scope="module")
def server() -> Iterator[DHT]:
    """A DHT node that serves the check (as run_bootstrap and every full peer do)."""
    dht = _node()
    try:
        reachability.serve(dht)
        yield dht
    finally:
        shutdown_dht(dht)


@pytest.fixture(scope="module")
def silent(server: DHT) -> Iterator[DHT]:
    """A DHT node of the same swarm that does not serve the check (an older version)."""
    dht = _node(visible_maddrs(server))
    try:
        yield dht
    finally:
        shutdown_dht(dht)


@pytest.fixture
def asker(server: DHT) -> Iterator[DHT]:
    """A fresh node that joined through ``server`` (fresh: the rate limit counts per asking peer)."""
    dht = _node(visible_maddrs(server))
    try:
        yield dht
    finally:
        shutdown_dht(dht)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_listening_peer_on_127_0_0_1_is_reachable(server, asker):
    maddrs = visible_maddrs(asker)
    port = ports_of(maddrs)[0]
    found = check(asker, [str(server.peer_id)], maddrs, timeout=10.0)
    assert found == Reachability(True, str(server.peer_id), "127.0.0.1", (port,), (f"/ip4/127.0.0.1/tcp/{port}",))
    mode = choose_mode(None, found)
    assert not mode.client and f"reachable at /ip4/127.0.0.1/tcp/{port}" in mode.line


@pytest.mark.timeout(120)
def test_a_port_nobody_listens_on_is_not_reachable(server, asker):
    port = _free_port()
    found = check(asker, [str(server.peer_id)], [f"/ip4/127.0.0.1/tcp/{port}"], timeout=10.0)
    assert found == Reachability(False, str(server.peer_id), "127.0.0.1", (port,), ())
    mode = choose_mode(None, found)
    assert mode.client and f"forward TCP port {port}" in mode.line


@pytest.mark.timeout(120)
def test_a_peer_that_does_not_serve_the_check_leaves_it_unknown_and_the_next_one_decides(server, silent, asker):
    maddrs = visible_maddrs(asker)
    found = check(asker, [str(silent.peer_id)], maddrs, timeout=6.0)
    assert found.reachable is None and found.detail.startswith("no peer answered the check")
    assert f"...{str(silent.peer_id)[-8:]}" in found.detail
    assert not choose_mode(None, found).client  # unknown: a full peer, as before the check existed

    found = check(asker, [str(silent.peer_id), str(server.peer_id)], maddrs, timeout=12.0)
    assert found.reachable is True and found.checked_by == str(server.peer_id)


@pytest.mark.timeout(120)
def test_nothing_to_check_or_nobody_to_ask_is_unknown_not_an_error(server, asker):
    maddrs = visible_maddrs(asker)
    assert check(asker, [str(server.peer_id)], ["/ip4/127.0.0.1/udp/4000/quic"]).detail == (
        "this peer listens on no TCP port"
    )
    assert check(asker, [], maddrs).detail == "no other peer to ask"
    found = check(asker, ["not-a-peer-id"], maddrs, timeout=3.0)
    assert found.reachable is None and "...-peer-id: " in found.detail


@pytest.mark.timeout(120)
def test_serve_answers_at_most_max_checks_per_minute_per_peer(server, asker):
    maddrs, by = visible_maddrs(asker), [str(server.peer_id)]
    answers = [check(asker, by, maddrs, timeout=10.0) for _ in range(MAX_CHECKS_PER_MINUTE)]
    assert [a.reachable for a in answers] == [True] * MAX_CHECKS_PER_MINUTE
    over = check(asker, by, maddrs, timeout=10.0)
    assert over.reachable is None and "declined" in over.detail

    other = _node(visible_maddrs(server))  # the limit is per asking peer: another one is still answered
    try:
        assert check(other, by, visible_maddrs(other), timeout=10.0).reachable is True
    finally:
        shutdown_dht(other)

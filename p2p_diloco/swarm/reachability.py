"""Is this peer reachable from outside? A dial-back check at start, and the mode the peer runs in because of it.

Inputs:  a running DHT node; the peer ids of the peers to ask (the initial peers first: run_bootstrap and every
         full training peer serve the check); ``--client-mode`` / ``--no-client-mode`` / neither (None: automatic).
Output:  ``check(dht, ask, timeout) -> Reachability``: whether a peer that already talks to us could open a NEW TCP
         connection to one of our listening ports at the IP address it sees us at (True: ``reached`` says where;
         False: ``observed`` and ``ports`` say what it tried; None: nobody could check, ``detail`` says why).
         ``choose_mode(flag, reachability) -> Mode``: client or full peer, and the console line that says why.
         ``serve(dht)``: answer other peers' checks (in the DHT process, for as long as it runs).
State:   in the serving DHT process: when each asking peer last asked (at most ``MAX_CHECKS_PER_MINUTE``).
Failure: never raises for network trouble: a peer that does not answer, does not serve the check (an older
         version) or refuses is skipped, and when none answers the result is "unknown" (None), which keeps the peer a
         full one (the pre-check behaviour) and says so.

Why a dial-back and not hivemind's own check: hivemind's bootstrap ping asks the initial peer to ping back, but
libp2p sends that ping over the connection we opened, so a peer behind NAT passes it. Here the checker opens a
plain TCP connection to ``observed IP : port``; a masquerading NAT (no forwarded port) refuses or drops it. The
checker dials only the address it sees the asking connection come from (the asker names ports, never hosts), at
most ``MAX_PORTS`` ports, each with a ``CONNECT_TIMEOUT`` deadline, so the service cannot be used to scan others.
A connection that succeeds proves the port is open at that address, not that our p2pd holds it (a forwarded port
pointing elsewhere would pass); libp2p's own peer id check catches such a mistake at the first real dial.

The check runs over libp2p (handler ``DIALBACK``, message ``p2pd_pb2.PeerInfo``: the request's ``addrs`` are our
multiaddrs as bytes, from which only the TCP ports are read; the answer's ``id`` is the observed IP as text and
its ``addrs`` the ``/ip4/IP/tcp/PORT`` that accepted).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import p2pd_pb2

__all__ = ["DIALBACK", "Mode", "Reachability", "check", "choose_mode", "ports_of", "serve"]

log = logging.getLogger("p2p_diloco.reachability")

DIALBACK = "p2p_diloco.dialback.v1"
CONNECT_TIMEOUT = 3.0  # seconds for one TCP connect of the checker
MAX_PORTS = 4  # ports one check may ask the checker to try
MAX_CHECKS_PER_MINUTE = 6  # per asking peer; more get an empty answer
MAX_ASKED = 4  # peers asked in turn before the result is "unknown"


@dataclass(frozen=True)
class Reachability:
    """What a dial-back check found (see the module docstring)."""

    reachable: bool | None
    checked_by: str = ""  # peer id of the checker that answered
    observed: str = ""  # the IP address it sees us at
    ports: tuple[int, ...] = ()  # the ports it tried
    reached: tuple[str, ...] = ()  # /ip4/IP/tcp/PORT that accepted a connection
    detail: str = ""  # why the result is unknown


@dataclass(frozen=True)
class Mode:
    """How the peer runs: ``client`` (never leads or reduces; contributes and downloads) or a full peer."""

    client: bool
    line: str  # what the console says about it


def ports_of(maddrs: list[str]) -> list[int]:
    """The TCP ports of direct (not relayed) multiaddrs, in order, without duplicates, at most MAX_PORTS."""
    ports: list[int] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or "tcp" not in parts:
            continue
        try:
            port = int(parts[parts.index("tcp") + 1])
        except (IndexError, ValueError):
            continue
        if 0 < port < 65536 and port not in ports:
            ports.append(port)
    return ports[:MAX_PORTS]


def _short(peer: str) -> str:
    return f"...{peer[-8:]}" if len(peer) > 8 else peer


def choose_mode(flag: bool | None, found: Reachability) -> Mode:
    """Client or full peer: an explicit flag wins; otherwise client exactly when the check says not reachable."""
    if flag is True:
        return Mode(
            True,
            "running as a client (--client-mode): never leads a group or reduces; contributes its Δ and "
            "downloads the state through reachable peers",
        )
    if found.reachable is True:
        return Mode(
            False,
            f"reachable at {found.reached[0]} (checked by peer {_short(found.checked_by)}): running as a full peer "
            "(leads groups, reduces, serves the state)",
        )
    if found.reachable is False:
        port = found.ports[0] if found.ports else "N"
        tried = ", ".join(f"{found.observed}:{p}" for p in found.ports) or found.observed
        why = f"peer {_short(found.checked_by)} could not connect to {tried}"
        fix = f"forward TCP port {port} to this machine and pass --announce-maddrs /ip4/<public IP>/tcp/{port}"
        if flag is False:
            return Mode(
                False,
                f"not reachable from outside ({why}), but --no-client-mode: running as a full peer; peers that cannot "
                f"dial this one will fail the rounds they share with it ({fix})",
            )
        return Mode(True, f"not reachable from outside ({why}): running as a client; {fix} to help the swarm")
    if flag is False:
        return Mode(False, f"running as a full peer (--no-client-mode); reachability unknown: {found.detail}")
    return Mode(
        False,
        f"reachability unknown ({found.detail}): running as a full peer; pass --client-mode if others cannot dial "
        "this machine (behind NAT without a forwarded port)",
    )


# ----------------------------------------------------------------------------------------- asking


def check(dht: Any, ask: list[str], maddrs: list[str], timeout: float = 10.0) -> Reachability:
    """Ask the peers in ``ask`` (peer ids, in turn, at most MAX_ASKED) to dial the TCP ports of ``maddrs`` back;
    the first answer decides. Bounded by about ``timeout`` seconds in all."""
    ports = ports_of(maddrs)
    if not ports:
        return Reachability(None, detail="this peer listens on no TCP port")
    ask = list(dict.fromkeys(ask))[:MAX_ASKED]
    if not ask:
        return Reachability(None, detail="no other peer to ask")
    coro = functools.partial(_ask, peers=ask, ports=ports, timeout=timeout / len(ask))
    try:
        future = dht.run_coroutine(coro, return_future=True)
        return future.result(timeout=timeout + 5.0)
    except Exception as exc:  # noqa: BLE001 - a dead DHT process or pipe: nobody checked
        return Reachability(None, detail=f"the check failed here ({type(exc).__name__}: {exc})")


async def _ask(_dht: Any, node: Any, peers: list[str], ports: list[int], timeout: float) -> Reachability:
    """(DHT process) Ask each peer in turn; the first that answers decides."""
    request = p2pd_pb2.PeerInfo(id=b"", addrs=[f"/tcp/{p}".encode() for p in ports])
    problems = []
    for peer in peers:
        try:
            answer = await asyncio.wait_for(
                node.p2p.call_protobuf_handler(PeerID.from_base58(peer), DIALBACK, request, p2pd_pb2.PeerInfo),
                timeout,
            )
        except Exception as exc:  # noqa: BLE001 - not served (older peer), refused, too slow: ask the next
            problems.append(f"{_short(peer)}: {type(exc).__name__}")
            continue
        observed = answer.id.decode(errors="replace")[:64]
        if not observed:
            problems.append(f"{_short(peer)}: declined")
            continue
        reached = tuple(a.decode(errors="replace")[:80] for a in answer.addrs[:MAX_PORTS])
        return Reachability(bool(reached), peer, observed, tuple(ports), reached)
    return Reachability(None, detail="no peer answered the check (" + "; ".join(problems) + ")")


# ----------------------------------------------------------------------------------------- serving


def serve(dht: Any) -> None:
    """Answer other peers' dial-back checks from now on (in ``dht``'s process). Never raises: a DHT that cannot
    take the handler only means nobody is told they are reachable through us (logged)."""
    try:
        dht.run_coroutine(_serve)
    except Exception as exc:  # noqa: BLE001 - not serving the check never stops the peer
        log.warning("cannot serve reachability checks to other peers: %r", exc)


async def _serve(_dht: Any, node: Any) -> None:
    recent: dict[str, list[float]] = {}  # per asking peer: when it asked in the last minute
    limit = asyncio.Semaphore(8)  # concurrent checks

    async def handle(request: p2pd_pb2.PeerInfo, context: P2PContext) -> p2pd_pb2.PeerInfo:
        peer, now = str(context.remote_id), time.monotonic()
        declined = p2pd_pb2.PeerInfo(id=b"")
        times = [t for t in recent.get(peer, []) if now - t < 60.0]
        if len(times) >= MAX_CHECKS_PER_MINUTE:
            return declined
        if len(recent) > 1024:  # forget everyone rather than grow: the limit is a courtesy, not a defence
            recent.clear()
        recent[peer] = [*times, now]
        ports = ports_of([bytes(a).decode(errors="replace") for a in request.addrs[:16]])
        ip = await _observed_ip(node.p2p, context.remote_id)
        if ip is None or not ports:
            return declined
        async with limit:
            ok = await asyncio.gather(*(_connects(ip, p) for p in ports))
        proto = "ip6" if ":" in ip else "ip4"
        reached = [f"/{proto}/{ip}/tcp/{p}".encode() for p, good in zip(ports, ok, strict=True) if good]
        return p2pd_pb2.PeerInfo(id=ip.encode(), addrs=reached)

    await node.p2p.add_protobuf_handler(DIALBACK, handle, p2pd_pb2.PeerInfo)


async def _observed_ip(p2p: Any, peer: PeerID) -> str | None:
    """The IP address of our direct connection to ``peer`` (None: none, or only relayed)."""
    for info in await p2p.list_peers():
        if info.peer_id != peer:
            continue
        for addr in info.addrs:
            parts = str(addr).split("/")
            if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts:
                return parts[2]
    return None


async def _connects(ip: str, port: int) -> bool:
    """Whether a TCP connection to ip:port opens within CONNECT_TIMEOUT (closed at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), CONNECT_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True

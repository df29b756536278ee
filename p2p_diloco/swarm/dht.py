"""Start or join the hivemind DHT, with checked addresses and failures a user can act on.

Inputs:  initial peers as multiaddr strings (``/ip4/1.2.3.4/tcp/31337/p2p/Qm...``), typed by a user on the
         command line or in ``P2P_DILOCO_INITIAL_PEERS``; several per value are allowed (space/comma separated).
Output:  a running :class:`hivemind.dht.DHT` (a forked child process that owns a ``p2pd`` daemon; or, with
         ``in_thread``, a thread of this process that owns one).
State:   the DHT process and its p2pd child; :func:`shutdown_dht` stops both.
Failure: :class:`SwarmSetupError` (a ``ValueError``) for bad input (malformed address, no initial peer, busy
         port, unusable identity file); :class:`SwarmUnreachableError` when no initial peer answered within
         ``join_timeout``. In both cases the DHT process and its p2pd are gone before the error is raised.
         ``bounded``: the result of a DHT call within a deadline, else a default (a lookup that never answers, a
         dead DHT process); it warns once per kind of call and never raises.

hivemind facts this module relies on (hivemind 1.1.12):
- p2pd connects to its bootstrap peers before it reports ready: a refused port fails in under a second with
  ``P2PDaemonError("... failed to connect to bootstrap peers")``; a peer that connects but does not speak the
  DHT protocol fails with ``RuntimeError("DHTNode bootstrap failed ...")`` after ``bootstrap_timeout``.
- a lookup whose answer fails to parse never answers: ``DHTNode`` strips ``[signature:...]`` from every value it
  returns (``RSASignatureValidator.strip_value``, whatever the key), and a stranger's value holding that text is
  no longer valid msgpack; the exception is raised inside the search and the ``DHT.get`` future never resolves.
  Every DHT call a training peer makes therefore goes through ``bounded``.
- ``DHT.shutdown()`` falls back to SIGTERM on the DHT process; the stock DHT process then dies without stopping
  its p2pd. The DHT subclass used here stops its own children on the way out, and the host kills what is
  left of the process tree.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

from hivemind.dht import DHT
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr

from p2p_diloco.swarm.in_thread import ThreadOrProcess

__all__ = [
    "add_initial_peers_argument",
    "bounded",
    "children_ignore_sigint",
    "in_background",
    "ENV_INITIAL_PEERS",
    "EXAMPLE_MADDR",
    "DEFAULT_HOST_MADDRS",
    "SwarmSetupError",
    "SwarmUnreachableError",
    "parse_initial_peers",
    "initial_peers_from_env",
    "start_dht",
    "shutdown_dht",
    "visible_maddrs",
    "order_maddrs",
    "initial_peers_line",
    "known_peers",
    "wait_for_peers",
]

ENV_INITIAL_PEERS = "P2P_DILOCO_INITIAL_PEERS"
EXAMPLE_MADDR = "/ip4/1.2.3.4/tcp/31337/p2p/QmXyZ..."
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
# How a node caches and how wide it searches. Every peer reads the run's members (one key holding every peer's
# announcement) with latest=True, which asks every node of the search's beam (bucket_size of them), and hivemind's
# defaults cache every value a node finds (cache_locally), answer lookups from that cache, and send what they found
# to one more node (cache_nearest): soon every reader held a copy, so each lookup brought back the whole membership
# from up to 20 nodes. Without caches only the key's replicas (num_replicas = 5) answer with it, and a beam of 8 still
# covers them. Measured (scripts/bench/scale.py, 32 peers in groups of 8, 3 rounds, one run each): CPU seconds per
# peer-round 4.96 with hivemind's defaults, 3.02 without caches, 1.89 with bucket_size 8 too; find RPCs per
# peer-round 595, 439, 163; each run 96 peer-rounds, none lost, one state. A routing table of k = 8 contacts per
# bucket still finds any of 256 peers in O(log n) hops.
NODE_POLICY = {"cache_locally": False, "cache_nearest": 0, "bucket_size": 8}
NO_PING_ANSWER = "none of the initial_peers responded to a ping"  # hivemind's words for a bootstrap that got no answer
RETRY_PAUSE = 2.0  # seconds between attempts to join through initial peers that connected but did not answer
_FLAG_TOKENS = {"--initial-peers", "--initial_peers"}

log = logging.getLogger("p2p_diloco.dht")
T = TypeVar("T")


class SwarmSetupError(ValueError):
    """The swarm cannot be started or joined with what the user gave; the message says what to fix."""


class SwarmUnreachableError(SwarmSetupError):
    """No initial peer answered within the join timeout."""


# ----------------------------------------------------------------------------------------- addresses


def _split(values: Iterable[str]) -> list[str]:
    tokens: list[str] = []
    for value in values:
        tokens.extend(t for t in re.split(r"[\s,]+", str(value)) if t and t not in _FLAG_TOKENS)
    return tokens


def parse_initial_peers(values: Sequence[str]) -> list[str]:
    """Check and normalise initial peer multiaddrs; returns plain strs (hivemind wants its own type or str).

    Each value may hold several addresses separated by spaces or commas (a copy-pasted line; a leading
    ``--initial-peers`` token is ignored). Duplicates are dropped, order is kept. Raises
    :class:`SwarmSetupError` naming the first bad address.
    """
    import multiaddr  # the PyPI package: validates what a user typed
    import multiaddr.exceptions

    peers: list[str] = []
    for token in _split(values):
        hint = f"an initial peer looks like {EXAMPLE_MADDR} (copy the whole line a running peer printed)"
        try:
            parsed = multiaddr.Multiaddr(token)
        except (multiaddr.exceptions.Error, ValueError, TypeError) as exc:
            raise SwarmSetupError(f"malformed initial peer address {token!r}: {exc}; {hint}") from None
        names = [p.name for p in parsed.protocols()]
        if "p2p" not in names:
            raise SwarmSetupError(f"initial peer address {token!r} has no /p2p/<peer id> part; {hint}")
        if names.index("p2p") == 0:
            raise SwarmSetupError(
                f"initial peer address {token!r} has a peer id but no network address before it; {hint}"
            )
        text = str(parsed)
        try:
            HivemindMultiaddr(text)["p2p"]  # hivemind parses with its own copy of multiaddr
        except Exception as exc:  # noqa: BLE001 - any parse failure is a user input problem
            raise SwarmSetupError(f"initial peer address {token!r} is not usable by hivemind: {exc}; {hint}") from None
        if text not in peers:
            peers.append(text)
    return peers


def add_initial_peers_argument(parser: Any, help: str = "multiaddrs of running peers") -> None:
    """``--initial-peers`` (also ``--initial_peers``) for an argparse parser; None when not given, so the
    caller can fall back to :func:`initial_peers_from_env`."""
    parser.add_argument(
        "--initial-peers",
        "--initial_peers",
        dest="initial_peers",
        nargs="*",
        default=None,
        metavar="MADDR",
        help=f"{help} (default: ${ENV_INITIAL_PEERS})",
    )


def initial_peers_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """Initial peers from ``$P2P_DILOCO_INITIAL_PEERS`` (space/comma separated); [] when unset or empty."""
    env = os.environ if environ is None else environ
    return parse_initial_peers([env.get(ENV_INITIAL_PEERS, "")])


def _is_loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2]).is_loopback
        except ValueError:
            return False
    return len(parts) > 2 and parts[1] in ("dns", "dns4", "dns6") and parts[2] == "localhost"


def order_maddrs(maddrs: Iterable[Any]) -> list[str]:
    """Addresses as strs, best to hand out first: public/LAN before loopback, ip4 before ip6, relays last."""

    def rank(item: tuple[int, str]) -> tuple[int, int, int, int]:
        index, maddr = item
        return ("p2p-circuit" in maddr, _is_loopback(maddr), not maddr.startswith("/ip4/"), index)

    unique = list(dict.fromkeys(str(m) for m in maddrs))
    return [m for _, m in sorted(enumerate(unique), key=rank)]


def initial_peers_line(maddrs: Iterable[Any]) -> str:
    """The one line to copy to other peers: ``--initial-peers <maddr> [<maddr> ...]``.

    Holds the non-loopback direct addresses when there are any (they also work from the same machine),
    otherwise every address.
    """
    ordered = order_maddrs(maddrs)
    best = [m for m in ordered if not _is_loopback(m) and "p2p-circuit" not in m] or ordered
    return " ".join(["--initial-peers", *best])


def visible_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs (with /p2p/<peer id>) others can use to reach ``dht``, best first."""
    return order_maddrs(dht.get_visible_maddrs())


# ----------------------------------------------------------------------------------------- processes


def _child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; [] elsewhere)."""
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != b"Z":
            children.append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _kill(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_children(grace: float = 2.0) -> None:
    """Terminate this process's children (p2pd), then kill the ones that outlive ``grace`` seconds."""
    children = _child_pids(os.getpid())
    _kill(children, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while children and time.monotonic() < deadline:
        for pid in list(children):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    children.remove(pid)
            except ChildProcessError:
                children.remove(pid)
        time.sleep(0.05)
    _kill(children, signal.SIGKILL)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class _DHT(DHT):
    """A hivemind DHT whose process never leaves its p2pd behind (on failure, SIGTERM or a lost parent)."""

    def run(self) -> None:
        # the fork copied the host's Python signal handlers; make SIGTERM unwind this process instead
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            super().run()
        finally:
            _stop_children()


class _ThreadDHT(ThreadOrProcess, DHT):
    """A hivemind DHT node run as a thread of this process (in_thread.py); its p2pd stops with the node."""

    in_thread = True


def shutdown_dht(dht: DHT, timeout: float = 5.0, graceful: bool = True) -> None:
    """Stop ``dht`` and its p2pd; kills what is still running after ``timeout`` seconds. Idempotent.

    ``graceful=False`` skips the polite request (for a DHT that never became ready and cannot answer it).
    """
    pid = dht.pid
    tree = _descendants(pid) if pid is not None else []
    if graceful:
        _settle_background(timeout)  # the last round's record and announcement, still on their way
        try:
            dht.shutdown_timeout = timeout
            dht.shutdown()  # asks the node to stop; SIGTERM after shutdown_timeout
        except (OSError, ValueError, AssertionError):
            pass  # pipe already closed: the process is gone or going
    elif pid is not None and dht.is_alive():
        dht.terminate()  # _DHT.run turns SIGTERM into SystemExit and stops p2pd on the way out
        dht.join(timeout)
    if pid is not None and dht.is_alive():
        dht.kill()
        dht.join(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    _kill([p for p in tree if _alive(p)], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------------------- start / join


def _unreachable_message(initial_peers: Sequence[str], join_timeout: float, detail: str) -> str:
    tried = "\n".join(f"    {p}" for p in initial_peers)
    return (
        f"no initial peer answered within {join_timeout:g} s.\n"
        f"  tried:\n{tried}\n"
        "  check:\n"
        "    - the address was copied whole, including the /p2p/<peer id> part;\n"
        "    - that peer's TCP port is open on its machine and in every firewall between you;\n"
        "    - if that peer is behind NAT, it must run with --announce-maddrs /ip4/<public IP>/tcp/<port>\n"
        "      (and a forwarded port);\n"
        "    - the bootstrap node (or the peer you copied the address from) is still running.\n"
        f"  (hivemind said: {detail})"
    )


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside this block inherit SIGINT ignored (p2pd too, across exec): Ctrl-C in a terminal
    signals the whole process group, and only the host should react, by shutting its children down in order.
    The host's own handler is restored on exit. Outside the main thread (no signal handling) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_dht(
    initial_peers: Sequence[str],
    *,
    host_maddrs: Sequence[str] | None = None,
    announce_maddrs: Sequence[str] | None = None,
    identity_path: str | None = None,
    client_mode: bool = False,
    join_timeout: float,
    record_validators: Iterable[Any] = (),
    new_swarm: bool = False,
    in_thread: bool = False,
    **dht_kwargs: Any,
) -> DHT:
    """Start a DHT node and join the swarm through ``initial_peers`` (or start a new swarm).

    ``host_maddrs`` default to ``/ip4/0.0.0.0/tcp/0`` (all interfaces, any port). ``join_timeout`` bounds
    the p2pd startup and the bootstrap pings (each); the whole call returns or raises within about
    ``2 * join_timeout + 5`` seconds. ``dht_kwargs`` go to :class:`hivemind.dht.DHT` (and on to DHTNode/P2P), e.g.
    ``use_relay`` / ``use_auto_relay`` (libp2p circuit relays). ``client_mode``: accept no incoming connections
    (behind NAT). ``in_thread``: run the node as a thread of this process, not a child process (in_thread.py: many
    peers in one process).
    """
    if join_timeout <= 0:
        raise SwarmSetupError(f"join_timeout={join_timeout!r} must be > 0 seconds")
    peers = parse_initial_peers(initial_peers)
    if not peers and not new_swarm:
        raise SwarmSetupError(
            f"no initial peers given: pass --initial-peers {EXAMPLE_MADDR} (the line a running peer or "
            f"bootstrap node printed) or set ${ENV_INITIAL_PEERS}"
        )
    host = list(host_maddrs) if host_maddrs else list(DEFAULT_HOST_MADDRS)
    announce = list(announce_maddrs) if announce_maddrs else None
    for label, addrs in (("--host-maddrs", host), ("--announce-maddrs", announce or [])):
        for addr in addrs:
            try:
                HivemindMultiaddr(str(addr))
            except Exception as exc:  # noqa: BLE001
                raise SwarmSetupError(
                    f"malformed {label} address {addr!r}: {exc}; it looks like /ip4/0.0.0.0/tcp/31337"
                ) from None
    if identity_path is not None:
        directory = os.path.dirname(os.path.abspath(identity_path))
        if not os.path.isdir(directory):
            raise SwarmSetupError(f"identity file {identity_path!r}: directory {directory!r} does not exist")

    deadline = time.monotonic() + join_timeout
    for attempt in itertools.count(1):
        with children_ignore_sigint():
            dht = (_ThreadDHT if in_thread else _DHT)(
                initial_peers=peers,
                start=True,
                await_ready=False,
                host_maddrs=host,
                announce_maddrs=announce,
                identity_path=identity_path,
                client_mode=client_mode,
                record_validators=list(record_validators),
                ensure_bootstrap_success=True,
                bootstrap_timeout=join_timeout,
                startup_timeout=join_timeout,
                **{**NODE_POLICY, **dht_kwargs},
            )
        try:
            dht.wait_until_ready(timeout=2 * join_timeout + 5)
            return dht
        except BaseException as exc:
            shutdown_dht(dht, timeout=3.0, graceful=False)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt / SystemExit: cleaned up, pass it on
            text = f"{type(exc).__name__}: {exc}".strip()
            # connected, but no ping answered within hivemind's RPC timeout (3 s): a busy initial peer (a bootstrap
            # node that many peers join at once; 7 of 32 failed so in the scale harness). Try again while
            # join_timeout lasts; a refused or wrong address fails in p2pd, before any ping, and is not retried.
            if NO_PING_ANSWER in text and peers and time.monotonic() + RETRY_PAUSE < deadline:
                log.info("no initial peer answered a ping yet (attempt %d; busy?): trying again", attempt)
                time.sleep(RETRY_PAUSE)
                continue
            _raise_setup_error(text, peers, host, join_timeout, identity_path, exc)
    raise AssertionError("unreachable")


def _raise_setup_error(
    text: str, peers: list[str], host: list[str], join_timeout: float, identity_path: str | None, exc: Exception
) -> NoReturn:
    """The SwarmSetupError (or SwarmUnreachableError) that says what went wrong in a user's words."""
    unreachable = "failed to connect to bootstrap peers" in text or "bootstrap failed" in text
    timed_out = isinstance(exc, TimeoutError) or "failed to start in" in text
    if peers and (unreachable or timed_out):
        raise SwarmUnreachableError(_unreachable_message(peers, join_timeout, text)) from None
    if "already taken by another peer" in text:
        raise SwarmSetupError(
            f"identity file {identity_path!r} is already in use by a running peer (another process started "
            "with the same --identity-path?); give each node its own key file"
        ) from None
    if "address already in use" in text.lower():
        raise SwarmSetupError(f"cannot listen on {' '.join(host)}: the port is already in use ({text})") from None
    raise SwarmSetupError(f"could not start the DHT node: {text}") from None


# ----------------------------------------------------------------------------------------- peers


async def _known_peers(_dht: DHT, node: Any) -> list[str]:
    return [str(p) for p in node.protocol.routing_table.peer_id_to_uid]


async def _refresh(_dht: DHT, node: Any) -> None:
    await node.find_nearest_nodes([node.node_id])


def known_peers(dht: DHT) -> list[str]:
    """Peer ids (base58 strs) in this node's routing table."""
    return dht.run_coroutine(_known_peers)


def wait_for_peers(dht: DHT, n: int, timeout: float, poll: float = 0.2) -> list[str]:
    """Wait until ``dht`` knows at least ``n`` other peers; returns their ids, raises TimeoutError.

    Peers started at the same moment can form separate DHTs (hivemind issue 624); each poll also runs a
    lookup of this node's own id, which pulls in peers that the initial peers know.
    """
    deadline = time.monotonic() + timeout
    while True:
        peers = known_peers(dht)
        if len(peers) >= n:
            return peers
        if time.monotonic() >= deadline:
            raise TimeoutError(f"this DHT node knows {len(peers)} other peers after {timeout:g} s; wanted {n}")
        dht.run_coroutine(_refresh)
        time.sleep(poll)


# ----------------------------------------------------------------------------------------- deadlines

_warned: set[str] = set()


def bounded(call: Callable[[], Any], timeout: float, what: str, default: T) -> Any | T:
    """``call()`` returns a DHT future (``return_future=True``); its result within ``timeout`` seconds, else
    ``default``. A late future is cancelled (the lookup may go on inside the DHT process; its answer is dropped).

    Never raises for DHT trouble: a timeout, a dead DHT process (a closed pipe) or an error set on the future is
    "no answer". The first of each ``what`` (e.g. "reading the run's members") is a warning, later ones are logged
    at debug level, so a DHT that is down for a while costs one line, not one per round.
    """
    future = None
    try:
        future = call()
        return future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct classes before Python 3.11
        if future is not None:
            future.cancel()
        _warn_once(what, f"no answer from the DHT within {timeout:g} s (swarm.dht_timeout): treated as no answer")
    except Exception as exc:  # noqa: BLE001 - a dead DHT pipe, an error inside the lookup: no answer
        _warn_once(what, f"the DHT failed ({type(exc).__name__}: {exc}): treated as no answer")
    return default


def in_background(call: Callable[[], Any], what: str) -> None:
    """``call()`` returns a DHT future (``return_future=True``); do not wait for it. A failure or a store no node took
    is warned about as ``bounded`` does (the first of each ``what``), from the DHT's callback thread. The future is
    held until it is done: hivemind drops the answer to a future nobody references any more (its callbacks too)."""

    def done(future: Any) -> None:
        _held.discard(future)
        try:
            if future.cancelled():
                return
            if future.result() is False:
                _warn_once(what, "no DHT node took it: treated as no answer")
        except Exception as exc:  # noqa: BLE001 - a dead DHT pipe, an error inside the store: no answer
            _warn_once(what, f"the DHT failed ({type(exc).__name__}: {exc}): treated as no answer")

    try:
        future = call()
        _held.add(future)
        future.add_done_callback(done)
    except Exception as exc:  # noqa: BLE001 - a dead DHT pipe: no answer
        _warn_once(what, f"the DHT failed ({type(exc).__name__}: {exc}): treated as no answer")


_held: set[Any] = set()  # the futures in_background has not seen answered yet


def _settle_background(timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the stores ``in_background`` handed to DHT processes (of this process)."""
    deadline = time.monotonic() + timeout
    while _held and time.monotonic() < deadline:
        time.sleep(0.02)


def _warn_once(what: str, message: str) -> None:
    if what in _warned:
        log.debug("%s: %s", what, message)
        return
    _warned.add(what)
    log.warning("%s: %s (further ones are logged at debug level)", what, message)

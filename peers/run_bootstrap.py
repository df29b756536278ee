"""Bootstrap node: a DHT node with a stable address and no model, that gives newcomers a first peer.

Usage (copy-paste):

    # start a new swarm; keep the key file so the peer id (and the printed line) survives restarts
    run_bootstrap --port 31337 --identity-path bootstrap.key
    # it prints one line to hand to every peer, e.g.
    #   --initial-peers /ip4/192.168.1.10/tcp/31337/p2p/QmXyZ...
    run_peer --config configs/tiny.yaml --initial-peers /ip4/192.168.1.10/tcp/31337/p2p/QmXyZ...

    # behind NAT: announce the public address (and forward the TCP port to this machine)
    run_bootstrap --port 31337 --identity-path bootstrap.key --announce-maddrs /ip4/203.0.113.7/tcp/31337

    # a second bootstrap node linked to the first (give peers both lines' addresses)
    run_bootstrap --port 31338 --identity-path bootstrap2.key --initial-peers /ip4/192.168.1.10/tcp/31337/p2p/QmXyZ...

    # same as `python -m peers.run_bootstrap ...` from the repository root

    # a bootstrap node for two runs (it validates both runs' records)
    run_bootstrap --port 31337 --run-id tiny-demo --run-id small-demo

Without --initial-peers it reads $P2P_DILOCO_INITIAL_PEERS, and starts a new swarm when that is unset too.
What it validates (p2p_diloco/swarm/validators.py), on every store it is asked for and every record it reads:
  every key    values up to 64 KiB, subkeys up to 4 KiB, valid msgpack; no "[signature:" text in an unsigned
               record (it would hang every reader's lookup); signed subkeys ([owner:<RSA key>]) writable only
               by their key's signature. hivemind's own averager keys pass.
  each --run-id NAME (default: the default config's swarm.run_id)
               NAME_metrics      signed per-peer round records: exact fields and types, peer_id = the signer's,
                                 a time near this node's clock, finite and bounded numbers
               NAME_fingerprint  signed per-peer announcements: fingerprint, summary, round, states, exact types
Output: the ``--initial-peers ...`` line first (stdout, flushed), then every visible multiaddr, one per line.
Runs until SIGINT/SIGTERM, then shuts the DHT and its p2pd down.
Exit codes (as run_peer and run_monitor): 0 stopped by SIGINT/SIGTERM; 2 bad input (a malformed address, a busy
port, an unusable key file), with one message on stderr; 3 no initial peer answered; 1 anything unexpected
(the DHT process died).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from p2p_diloco.config import SwarmConfig
from p2p_diloco.swarm import reachability
from p2p_diloco.swarm.dht import (
    SwarmSetupError,
    SwarmUnreachableError,
    add_initial_peers_argument,
    initial_peers_from_env,
    initial_peers_line,
    parse_initial_peers,
    shutdown_dht,
    start_dht,
    visible_maddrs,
)
from p2p_diloco.swarm.validators import make_validators


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_bootstrap",
        description="Run a DHT bootstrap node (no model) and print the --initial-peers line for other peers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--host-maddrs", nargs="+", metavar="MADDR", help="multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/PORT)"
    )
    parser.add_argument(
        "--port", type=int, default=0, help="TCP port for the default --host-maddrs (default 0: any free port)"
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="+",
        metavar="MADDR",
        help="addresses to tell others, e.g. /ip4/<public IP>/tcp/<port> behind NAT",
    )
    parser.add_argument(
        "--identity-path",
        metavar="FILE",
        help="private key file, created if missing: keeps the same peer id across restarts",
    )
    add_initial_peers_argument(parser, "other bootstrap nodes to link with")
    parser.add_argument(
        "--run-id",
        dest="run_ids",
        action="append",
        metavar="NAME",
        help="a run whose records this node validates (repeatable; default: "
        f"{SwarmConfig().run_id!r}, the default swarm.run_id); every key gets the guard checks regardless",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=SwarmConfig().join_timeout,
        metavar="SECONDS",
        help="seconds to wait for an initial peer to answer (default %(default)s)",
    )
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _error(message: str, code: int = 2) -> int:
    print(f"run_bootstrap: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.host_maddrs and args.port:
        return _error("give either --host-maddrs or --port, not both (--port sets /ip4/0.0.0.0/tcp/PORT)")
    if not 0 <= args.port <= 65535:
        return _error(f"--port {args.port} is not a TCP port (0..65535; 0 picks a free one)")
    host_maddrs = args.host_maddrs or [f"/ip4/0.0.0.0/tcp/{args.port}"]
    run_ids = args.run_ids or [SwarmConfig().run_id]
    bad = [r for r in run_ids if not r or "." in r or " " in r]
    if bad:
        return _error(f"--run-id {bad[0]!r} is not a run id (a non-empty name without '.' or spaces)")
    validators = make_validators(run_ids, None)  # a fresh signing key: the bootstrap writes nothing

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    dht = None
    try:
        try:
            if args.initial_peers is not None:
                peers = parse_initial_peers(args.initial_peers)
                if not peers:
                    return _error(
                        "--initial-peers was given without any address; drop the flag to start a "
                        "new swarm, or pass /ip4/1.2.3.4/tcp/31337/p2p/Qm... of a running node"
                    )
            else:
                peers = initial_peers_from_env()
            dht = start_dht(
                peers,
                host_maddrs=host_maddrs,
                announce_maddrs=args.announce_maddrs,
                identity_path=args.identity_path,
                join_timeout=args.join_timeout,
                record_validators=validators,
                new_swarm=not peers,
            )
        except SwarmUnreachableError as exc:
            return _error(str(exc), 3)
        except SwarmSetupError as exc:
            return _error(str(exc))
        reachability.serve(dht)  # tell joining peers whether they can be dialled (run_peer's check at start)
        maddrs = visible_maddrs(dht)
        print(initial_peers_line(maddrs), flush=True)
        print("\n".join(maddrs), flush=True)
        print(
            f"run_bootstrap: serving the DHT as {maddrs[0].rsplit('/', 1)[-1] if maddrs else '?'}; "
            "stop with Ctrl-C or SIGTERM",
            file=sys.stderr,
            flush=True,
        )
        while dht.is_alive():
            time.sleep(1.0)
        return _error("the DHT process exited unexpectedly", 1)
    except KeyboardInterrupt:
        print("run_bootstrap: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the shutdown
        if dht is not None:
            shutdown_dht(dht)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())

"""run_peer: a training peer of a p2p_diloco swarm.

Usage:
    # the first peer of a new run (prints nothing to copy: use run_bootstrap for a shareable address)
    run_peer --new-swarm --config configs/tiny.yaml --log-dir runs/peer0
    # a volunteer joining a run: paste the line the organiser's run_bootstrap printed
    run_peer --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/QmXyZ... --config configs/tiny.yaml --log-dir runs/me
    # or: export P2P_DILOCO_INITIAL_PEERS="/ip4/.../p2p/Qm..."; run_peer --config ... --log-dir ...
    # a closed run (swarm.authorized_keys): make a key once, send the printed line to the organiser, train with it
    run_peer --identity-path me.key --print-public-key
    run_peer --identity-path me.key --initial-peers ... --config ... --log-dir runs/me
    # on a machine where other work runs: fewer torch threads than cores (default: the cores this process may use)
    run_peer --initial-peers ... --config ... --log-dir runs/me --threads 1
    # behind NAT: the peer checks at start whether others can dial it and, if not, runs as a client (it trains and
    # contributes, but never leads or reduces); force either way with --client-mode / --no-client-mode
    run_peer --initial-peers ... --config ... --log-dir runs/me --client-mode --use-auto-relay

Exit codes: 0 finished or stopped by SIGINT/SIGTERM; 2 bad input (config, data, address); 3 no initial peer
answered; 1 anything unexpected, or swarm.max_failed_rounds failed rounds in a row (checkpointed first).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import threading
from pathlib import Path

from p2p_diloco.checkpoint import CheckpointError
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.data import DataError
from p2p_diloco.stopping import StopRequest, skip_exit_collection
from p2p_diloco.swarm.dht import (
    SwarmSetupError,
    SwarmUnreachableError,
    add_initial_peers_argument,
    initial_peers_from_env,
    parse_initial_peers,
)
from p2p_diloco.swarm.identity import Identity, IdentityError
from p2p_diloco.swarm.peer import PeerOptions, RoundsFailing, TrainingPeer
from p2p_diloco.threads import add_threads_flag, apply_threads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_peer",
        description="Train with a p2p_diloco swarm.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_initial_peers_argument(p)
    p.add_argument("--new-swarm", action="store_true", help="start a new swarm; no initial peers needed")
    p.add_argument("--config", help="YAML preset, e.g. configs/tiny.yaml (required to train)")
    p.add_argument("--log-dir", type=Path, help="metrics.jsonl, run metadata and checkpoints (required to train)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --log-dir")
    add_threads_flag(p)
    p.add_argument("--host-maddrs", nargs="*", default=None, help="listen addresses (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="*", default=None, help="public addresses, when behind NAT")
    p.add_argument("--identity-path", default=None, help="key file for a stable peer id (created if missing)")
    p.add_argument(
        "--client-mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--client-mode: never lead a group or reduce (others cannot dial this peer, e.g. behind NAT), still "
        "contribute and download the state; --no-client-mode: a full peer whatever the check says; neither: a "
        "dial-back check at start decides (not reachable: client)",
    )
    p.add_argument(
        "--no-relay",
        dest="use_relay",
        action="store_false",
        help="disable libp2p circuit relays (by default peers can reach others through relays)",
    )
    p.add_argument(
        "--use-auto-relay",
        action="store_true",
        help="behind NAT: reserve a slot on a relay (the initial peers) and announce the relayed address",
    )
    p.add_argument(
        "--print-public-key",
        action="store_true",
        help="print the public key of --identity-path (created if missing: with --config, carrying its "
        "swarm.identity_work), the line an organiser adds to a closed run's swarm.authorized_keys, and exit",
    )
    args = p.parse_args(argv)
    if args.print_public_key and not args.identity_path:
        p.error("--print-public-key needs --identity-path FILE: the key this peer will train with")
    if not args.print_public_key and (args.config is None or args.log_dir is None):
        p.error("the following arguments are required to train: --config, --log-dir")
    return args


def print_public_key(identity_path: str, work: int = 0) -> int:
    """Print the key's line (made with ``work`` bits of identity work when the file does not exist yet)."""
    identity = Identity.load(identity_path, work=work)
    print(f"{identity.public_key.decode()} {identity.peer_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a crash in native code (torch, hivemind's threads) prints every thread's Python stack to stderr
    faulthandler.enable()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # hivemind at WARNING unless HIVEMIND_LOGLEVEL asks otherwise (DEBUG shows its matchmaking, to debug a group)
    quiet = ["p2p_diloco.swarm.records"] + ([] if os.environ.get("HIVEMIND_LOGLEVEL") else ["hivemind"])
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    request = StopRequest(
        on_stop=lambda name: logging.getLogger("run_peer").info(
            "%s: finishing or abandoning the current round, then exiting (again: stop now)", name
        ),
        report_hang_after=None,  # a round may rightly take minutes to finish
        second_interrupts=True,  # a second signal raises KeyboardInterrupt: stop now (cleanup still runs)
    )
    try:
        return _run(args, request.event)
    finally:
        request.close()


def _run(args: argparse.Namespace, stop: threading.Event) -> int:
    initial = args.initial_peers if args.initial_peers is not None else initial_peers_from_env()
    try:
        if args.print_public_key:  # with --config: a key with the run's identity work
            cfg = load_config(args.config, args.overrides) if args.config is not None else None
            return print_public_key(args.identity_path, cfg.swarm.identity_work if cfg is not None else 0)
        initial = parse_initial_peers(initial)  # fail fast, before the data and the model are built
        threads = [f"train.threads={args.threads}"] if args.threads is not None else []
        cfg = load_config(args.config, [*args.overrides, *threads])
        apply_threads(cfg.train.threads)  # before the data and the model are built
        opts = PeerOptions(
            initial_peers=initial,
            log_dir=args.log_dir,
            new_swarm=args.new_swarm,
            resume=args.resume,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            identity_path=args.identity_path,
            client_mode=args.client_mode,
            use_relay=args.use_relay,
            use_auto_relay=args.use_auto_relay,
            stop=stop,
        )
        return TrainingPeer(cfg, opts).run()
    except SwarmUnreachableError as exc:
        print(f"run_peer: {exc}", file=sys.stderr)
        return 3
    except RoundsFailing as exc:
        print(f"run_peer: {exc}", file=sys.stderr)
        return 1
    except (CheckpointError, ConfigError, DataError, IdentityError, SwarmSetupError) as exc:
        print(f"run_peer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(skip_exit_collection(main()))

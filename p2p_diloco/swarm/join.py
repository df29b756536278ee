"""Joining a run: the outer state to start from, and the wait for the run's first peers.

Inputs:  the Worker, a StateSync for downloads, this peer's Membership (membership.py), the Config, and PeerOptions
         (the log dir, ``--resume`` / ``--new-swarm``, the stop Event).
Output:  ``first_state``: the worker holds its starting outer state (checkpoint, seed or the swarm's) when it returns;
         ``wait_for_start_peers``: holds round 1 until ``swarm.start_peers`` peers are up; ``PeerOptions``.
State:   none.
Failure: SwarmSetupError when peers hold a trained state but none sent it within ``swarm.join_timeout``, or when a
         newcomer finds the run over (its peers done and gone: ``run_over``); CheckpointError for a checkpoint that
         cannot be resumed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, load_worker_state
from p2p_diloco.config import Config
from p2p_diloco.engine import Worker
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.announcements import poll_pause
from p2p_diloco.swarm.dht import SwarmSetupError
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.sync import StateSync

__all__ = ["PeerOptions", "first_state", "wait_for_start_peers"]

log = logging.getLogger("p2p_diloco.join")


@dataclass
class PeerOptions:
    """How a peer joins, beyond the config (run_peer's command line): where to connect, where to write, how to
    start."""

    initial_peers: list[str]
    log_dir: Path
    new_swarm: bool = False  # the first peer of a run: no initial peers, the state starts from the seed
    resume: bool = False  # continue from the last checkpoint in log_dir
    host_maddrs: list[str] | None = None
    announce_maddrs: list[str] | None = None
    identity_path: str | None = None
    client_mode: bool | None = None  # True: --client-mode, False: --no-client-mode, None: by the reachability check
    use_relay: bool = True  # libp2p circuit relay: reach peers through relays (hivemind's default)
    use_auto_relay: bool = False  # look for relays and announce relayed addresses (behind NAT)
    in_thread: bool = False  # the DHT node and the averager as threads of this process (many peers in one process)
    stop: threading.Event = field(default_factory=threading.Event)


def first_state(worker: Worker, sync: StateSync, members: Membership, cfg: Config, opts: PeerOptions) -> None:
    """Resume from the last checkpoint, start from the seed, or download the swarm's state before round 1."""
    ckpt = latest_checkpoint(Path(opts.log_dir) / "checkpoints") if opts.resume else None
    if ckpt is not None:
        state, _ = load_outer_state(ckpt)
        worker.load_state(state)
        local = load_worker_state(ckpt)
        if local is None:
            log.warning("%s holds no worker state: the inner optimizer starts afresh", ckpt)
        else:
            try:
                worker.restore_local_state(local)
            except ValueError as exc:
                raise CheckpointError(f"{ckpt}: {exc}") from None
        log.info("resumed from %s (round %d, %d batches read)", ckpt, state.round, worker.batches_taken)
        caught_up = _catch_up(sync, state.round, cfg, opts.stop)  # the swarm moved on meanwhile: its state first
        if not caught_up and not opts.stop.is_set():
            log.warning(
                "the swarm holds a state past the checkpoint's round %d, but no peer sent it within "
                "swarm.join_timeout=%gs: training on from the checkpoint (a round resyncs once a holder answers)",
                state.round,
                cfg.swarm.join_timeout,
            )
        return
    if opts.new_swarm:
        log.info("new swarm: the outer state starts from seed %d", cfg.seed)
        return
    if _catch_up(sync, 0, cfg, opts.stop):
        if sync.adopted:
            return
        over = None if opts.stop.is_set() else members.run_over()
        if over is not None:
            raise SwarmSetupError(
                f"run {cfg.swarm.run_id!r} is over: its peers finished at {over} and none of them serves that state "
                "any more, so there is nothing to join (training alone from the seed would be a run of its own). "
                "Start a new run under another swarm.run_id, or ask the organiser to keep the peers up "
                "longer after their last round (swarm.linger_seconds)"
            )
        log.info("no peer of this run holds a trained state the swarm vouches for: starting from seed %d", cfg.seed)
        return
    raise SwarmSetupError(
        f"peers of run {cfg.swarm.run_id!r} exist, but none sent an outer state that enough peers vouch for within "
        f"swarm.join_timeout={cfg.swarm.join_timeout:g}s (the lines above say why each offer was refused): retry, or "
        "raise swarm.join_timeout. If the run is closed (its organiser lists the keys it admits), send the organiser "
        "this peer's key: run_peer --identity-path FILE --print-public-key, then train with that --identity-path. "
        "If it asks for identity work, train with its config's swarm.identity_work (a key with the work is made)"
    )


def _catch_up(sync: StateSync, round: int, cfg: Config, stop: threading.Event) -> bool:
    """Download the swarm's state past ``round`` until swarm.join_timeout; True when there was none to wait for (the
    swarm vouches for no state past ``round``: a lone claim of a trained state, a faulty or lying peer's, is not
    one) or one came. A lone peer moving a round a second serves each state for a second only: a download that
    failed is tried again with the state its holders announce then (seen: a resumed peer's one try failed, and it
    trained 15 rounds behind, losing every round to a resync its holder no longer answered)."""
    deadline = time.monotonic() + cfg.swarm.join_timeout
    while time.monotonic() < deadline and not stop.is_set():
        if sync.download(newer_than=round):
            return True
        if not sync.vouched_past(round):
            return True
        stop.wait(1.0)
    return False


def wait_for_start_peers(members: Membership, cfg: Config, tag: RoundTag, stop: threading.Event) -> None:
    """Hold round 1 until swarm.start_peers peers of this run are up (bounded by swarm.join_timeout). Our heartbeat
    goes on meanwhile at its usual rate: round 1's matchmaking expects only the mates that read as live (refreshing
    only against expiry while waiting, 64 peers began round 1 expecting 17-20 of them, and lost 41 and 61
    peer-rounds in two runs: measured)."""
    want, deadline = cfg.swarm.start_peers, time.monotonic() + cfg.swarm.join_timeout
    announced, most = False, 1
    while want > 1 and time.monotonic() < deadline and not stop.is_set():
        seen = 1 + len(members.mates())
        most = max(most, seen)
        if seen >= want:
            log.info("%d of swarm.start_peers=%d peers are up: starting", seen, want)
            return
        announced = announced or members.announce(tag)  # once stored, the heartbeat keeps it fresh
        stop.wait(poll_pause(seen))  # the more are up, the slower each one asks
    if want > 1:
        log.warning(
            "fewer than swarm.start_peers=%d peers after %.0fs (at most %d read as up at once): starting anyway",
            want,
            cfg.swarm.join_timeout,
            most,
        )

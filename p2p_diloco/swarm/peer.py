"""The training peer: join the swarm, run DiLoCo rounds over hivemind, report them, stop cleanly.

Inputs:  a Config, PeerOptions (initial peers, log dir, network flags), a stop Event (set by signals).
Output:  DIR/metrics.jsonl, the DHT record and a console line per round (report.py), and the same record to
         DIR/tensorboard and DIR/wandb when ``logging`` turns them on (trackers.py); DIR/run_metadata.json;
         DIR/final.json at the end (the state the peer ended on, after the end-of-run heal of a split);
         DIR/checkpoints/round_NNNNNN every ``train.checkpoint_every`` rounds and at exit (the outer state plus
         this worker's inner AdamW state and place in its shard, so --resume loses nothing).
State:   the Worker (model, inner AdamW, OuterState), the peer's Identity (one RSA key: libp2p peer id, DHT signer,
         gather-payload signer; identity.py), the DHT node (running validators.make_validators) and the
         PseudoGradAverager process, the StateSync that guards the outer state, the Membership announcements and
         the Reporter with its Trackers. In a closed run (``swarm.authorized_keys``) the allowed peer ids go to all
         three.
Failure: TrackerError (a ConfigError) at construction when a configured tracker's package is missing, and before
         round 1 when a tracker cannot start (trackers.py); SwarmSetupError / SwarmUnreachableError / CheckpointError
         / IdentityError while joining (bad address, an unusable key file or authorized_keys, a closed run that does
         not list this key, nobody answered, state not downloadable, settings that differ from the swarm's, a
         damaged checkpoint); after joining a round that fails is dropped and the next one starts (engine.py,
         protocol.py say which and why; guard.py backs off, rolls back from a state whose loss stays non-finite, and
         after ``swarm.max_failed_rounds`` failed rounds in a row raises RoundsFailing: checkpoint first, exit 1).
         Any other error after joining: checkpoint first, then it propagates. A state holding NaN/inf is never
         checkpointed.

This module only orchestrates; each concern has its own:
  join.py      the first outer state (resume, seed or download), the wait for round 1's peers
  membership.py  this peer's announcement, compare fingerprints, a split's canonical state (announcements.py:
               what the run's members announce; readiness.py: when they will be ready)
  heal.py      take a split's canonical state, before a round and at the run's end; end a round with the mates
  sync.py      the outer state: serve it, fetch and verify a donor's, adopt it, the outer step under the lock
  engine.py    the round itself (contribute -> averager.reduce -> protocol.decide -> settle), as in the simulator
  guard.py     what a failed round leads to: discard, back off, roll back, give up
  averager.py  the all-reduce; report.py what each round tells the world
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, save_round
from p2p_diloco.config import Config, ConfigError, write_run_metadata
from p2p_diloco.data import DataPipeline, shard_for_peer
from p2p_diloco.engine import Worker
from p2p_diloco.fingerprint import swarm_fingerprint
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundRules, RoundTag
from p2p_diloco.robust import max_round_tokens
from p2p_diloco.rounds import RoundResult
from p2p_diloco.swarm import reachability
from p2p_diloco.swarm.announcements import poll_pause
from p2p_diloco.swarm.averager import PseudoGradAverager
from p2p_diloco.swarm.dht import SwarmSetupError, initial_peers_line, shutdown_dht, start_dht, visible_maddrs
from p2p_diloco.swarm.guard import RoundGuard, RoundsFailing, StopRequested
from p2p_diloco.swarm.heal import Healer
from p2p_diloco.swarm.hooks import HostHooks
from p2p_diloco.swarm.identity import Admission, Identity, read_authorized_keys
from p2p_diloco.swarm.join import PeerOptions, first_state, wait_for_start_peers
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.report import Reporter
from p2p_diloco.swarm.standing import counted_members
from p2p_diloco.swarm.sync import StateSync
from p2p_diloco.swarm.validators import make_validators, owner_subkey
from p2p_diloco.trackers import Trackers, require

__all__ = ["PeerOptions", "RoundsFailing", "StopRequested", "TrainingPeer"]

log = logging.getLogger("p2p_diloco.peer")


class _Pace:
    """Seconds per inner step in this round, from the gaps between steps, leaving out the gap in which an eager
    exchange was settled (its wait is not a step)."""

    def __init__(self, in_flight: int) -> None:
        self.last, self.in_flight = time.monotonic(), in_flight
        self.total, self.count, self.announced = 0.0, 0, False

    def step(self, in_flight: int) -> None:
        now = time.monotonic()
        if in_flight == self.in_flight:
            self.total, self.count = self.total + now - self.last, self.count + 1
        self.last, self.in_flight = now, in_flight

    @property
    def measured(self) -> bool:
        return self.count > 0

    def seconds(self, last_round: float | None) -> float:
        """This round's pace; the last full round's while this one has fewer than 2 steps (a throttled or shared
        machine's first step says little)."""
        if last_round is not None and self.count < 2:
            return last_round
        return self.total / self.count if self.count else (last_round or 0.0)


class TrainingPeer:
    """One training peer: ``run()`` joins, trains until ``train.rounds`` or a stop request, and cleans up."""

    def __init__(self, cfg: Config, opts: PeerOptions, data: DataPipeline | None = None) -> None:
        """``data``: the run's pipeline when the caller built it already (peers of one process share it), else built
        here."""
        if cfg.train.warm_start != "none":
            raise ConfigError(
                f"train.warm_start={cfg.train.warm_start!r} runs in run_simulation only: a swarm starts from a "
                "model instead. Train it first (run_simulation --out DIR --set train.warm_start=... or any run), "
                "export it (run_export --checkpoint DIR --out MODEL) and give every peer --set model.pretrained=MODEL"
            )
        require(cfg.logging)  # a tracker's missing package: one line now, not after the data, the model and the join
        self.cfg, self.opts = cfg, opts
        self.log_dir = Path(opts.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.data = data if data is not None else DataPipeline(cfg.data, cfg.seed)
        self.rules = RoundRules.from_config(cfg.swarm)
        self.dht = None
        self.identity: Identity | None = None
        self.averager: PseudoGradAverager | None = None
        self.worker: Worker | None = None
        self.sync: StateSync | None = None
        self.members: Membership | None = None
        self.reporter: Reporter | None = None
        self.trackers: Trackers | None = None
        self.guard: RoundGuard | None = None
        self.healer: Healer | None = None
        self.peer_id = ""
        self.eval_sets = self.data.eval_sets()
        self._step_seconds: float | None = None  # the last full round's seconds per inner step

    def start(self) -> None:
        """Join the run: our key and DHT node, the worker on our shard, our announcement, the averager, the first
        outer state, and round 1's wait for swarm.start_peers peers (the module docstring lists what may fail)."""
        cfg, s = self.cfg, self.cfg.swarm
        identity, authorized, own_key = self._load_identity()
        self._join_dht(identity, own_key)
        shard = cfg.data.shard_index
        shard = shard if shard is not None else shard_for_peer(self.peer_id, cfg.data.num_shards)
        self.worker = worker = Worker(cfg, self.data.vocab_size, self.data.train_batches(shard, cfg.seed))
        fingerprint, summary = swarm_fingerprint(cfg, worker.model, self.data)
        client = self.dht.client_mode
        self.members = members = Membership(self.dht, cfg, identity, fingerprint, summary, authorized, client)
        members.check()
        # at once, the seed's tag while we may still download: the others then know a peer is coming (a lone peer
        # that read nobody took local steps until we came: 7 rounds in a CI run). lineage.py keeps this round-0 tag
        # from drawing anyone back: it is in every lineage's recent tags until round 8, and apart from all after
        members.announce(worker.tag())
        prefix = f"{s.run_id}_{fingerprint}"
        self._start_averager(prefix, identity, authorized)
        self.sync = sync = StateSync(
            worker,
            self.averager,
            fingerprint,
            s.state_timeout,
            lambda: bool(members.others()),
            vouches=members.vouches,
            quorum=s.state_quorum,
        )
        # vouch for a new state as soon as it is hashed (in the background: the next inner steps need not wait)
        sync.on_change = lambda: worker.tag_soon().add_done_callback(self._vouch)
        threading.Thread(target=self._heartbeat, name="announcements", daemon=True).start()
        first_state(worker, sync, members, cfg, self.opts)
        wait_for_start_peers(members, cfg, sync.tag(), self.opts.stop)
        self.averager.set_state_provider(self.sync.serve)
        # after the DHT and averager processes are forked (a wandb run must not be inherited), before round 1
        self.trackers = Trackers.open(
            cfg.logging, self.log_dir, self.peer_id, s.run_id, cfg.to_dict(), tokens_field="total_tokens"
        )
        public_key = owner_subkey(identity.public_key)
        self.reporter = Reporter(cfg, self.log_dir, self.dht, self.peer_id, public_key, self.trackers)
        self.guard = RoundGuard(
            self.sync, s.rollback_after, s.max_failed_rounds, self.opts.stop.wait, fallback=self._checkpointed_state
        )
        self.healer = Healer(worker, sync, members, cfg, self.opts.stop, self._checkpoint)
        print(f"joined at round {worker.state.round} with checksum {worker.state.checksum()}", flush=True)
        write_run_metadata(
            self.log_dir,
            cfg,
            peer_id=self.peer_id,
            shard_index=shard,
            fingerprint=fingerprint,
            fingerprint_summary=summary,
            torch_threads=torch.get_num_threads(),
            shard_histograms=self.data.histograms(),
        )
        log.info(
            "peer %s: shard %d of %d, %d params, round %d, averaging prefix %s",
            self.peer_id,
            shard,
            cfg.data.num_shards,
            worker.num_params,
            worker.state.round,
            prefix,
        )

    def _load_identity(self) -> tuple[Identity, Admission | None, bool]:
        """This peer's key, whom a closed run admits, and whether the key is the log dir's own (no
        --identity-path). SwarmSetupError when a closed run does not list the key."""
        s = self.cfg.swarm
        listed = read_authorized_keys(s.authorized_keys) if s.authorized_keys else None
        authorized = Admission.of(listed, s.identity_work)
        # no --identity-path: the key is kept in the log dir, so a restarted peer (--resume) has the same peer id,
        # the same shard, and overwrites its own announcement instead of leaving a stale one beside a new one
        own_key = self.opts.identity_path is None
        key_path = self.log_dir / "identity.key" if own_key else self.opts.identity_path
        self.identity = identity = Identity.load(key_path, work=s.identity_work)
        if listed is not None and identity.peer_id not in listed:  # (Identity.load saw to the identity work)
            raise SwarmSetupError(
                f"run {s.run_id!r} is closed and swarm.authorized_keys ({s.authorized_keys}) does not list this "
                f"peer's key; ask the organiser to add this line to it:\n  {identity.public_key.decode()}"
            )
        return identity, authorized, own_key

    def _join_dht(self, identity: Identity, own_key: bool) -> None:
        """Start our DHT node (again in client mode when the reachability check says others cannot dial us) and say
        how others reach us."""
        s = self.cfg.swarm
        validators = make_validators(s.run_id, identity)

        def start(client_mode: bool) -> Any:
            return start_dht(
                self.opts.initial_peers,
                host_maddrs=self.opts.host_maddrs,
                announce_maddrs=self.opts.announce_maddrs,
                identity_path=identity.path,
                client_mode=client_mode,
                join_timeout=s.join_timeout,
                record_validators=validators,
                new_swarm=self.opts.new_swarm,
                check_if_identity_free=not own_key,  # hivemind dials the id to check (seconds); a log dir is ours
                use_relay=self.opts.use_relay,
                use_auto_relay=self.opts.use_auto_relay,
                in_thread=self.opts.in_thread,
            )

        self.dht = start(self.opts.client_mode is True)
        self.peer_id = str(self.dht.peer_id)
        mode = self._choose_mode()
        if mode.client and not self.dht.client_mode:  # hivemind fixes a DHT node's mode at start: start it again
            shutdown_dht(self.dht)
            self.dht = None
            self.dht = start(True)
        print(mode.line, flush=True)
        if self.dht.client_mode:
            print(
                f"peer {self.peer_id} runs as a client: others cannot dial it, so it has no address to hand out",
                flush=True,
            )
        else:
            reachability.serve(self.dht)
            print(f"peer {self.peer_id} reachable as: {initial_peers_line(visible_maddrs(self.dht))}", flush=True)

    def _start_averager(self, prefix: str, identity: Identity, authorized: Admission | None) -> None:
        """Our averager under ``prefix``, asking our Membership about the run (hooks.py), and grouping only with the
        peers it admits."""
        members = self.members
        self.averager = PseudoGradAverager.from_config(
            self.dht,
            self.worker.state.anchor,
            self.cfg.swarm,
            prefix=prefix,
            max_tokens=max_round_tokens(self.cfg),
            identity=identity,
            authorized=authorized,
            in_thread=self.opts.in_thread,
        )
        self.averager.hooks = HostHooks(
            expected_members=members.expected_members,
            group_window=members.group_window,
            group_wait=members.group_wait,
            looking=members.looking,
            alone=members.alone,
            swarm_ahead=members.ahead,
            reachable_members=members.reachable_members,
            stopping=self.opts.stop.is_set,
            silent=members.suspect,
            averaged_with=lambda gathered, dropped: members.standing.count(
                counted_members(gathered.payloads, self.peer_id, dropped)
            ),
        )
        members.admits = self.averager.admits

    def _choose_mode(self) -> reachability.Mode:
        """Client or full peer (``--client-mode`` / ``--no-client-mode`` win; otherwise the dial-back check decides)."""
        flag = self.opts.client_mode
        if flag is True:
            found = reachability.Reachability(None, detail="--client-mode")
        elif self.opts.new_swarm and not self.opts.initial_peers:
            found = reachability.Reachability(None, detail="the first peer of a new swarm has nobody to ask")
        else:
            ask = [m.rsplit("/p2p/", 1)[-1] for m in self.opts.initial_peers if "/p2p/" in m]
            found = reachability.check(self.dht, ask, visible_maddrs(self.dht), timeout=self.cfg.swarm.dht_timeout)
        return reachability.choose_mode(flag, found)

    def _heartbeat(self) -> None:
        """Refresh our announcement while we are up, so peers count us as there (Announcements.LIVE): asked every half
        HEARTBEAT, it stores when nothing was stored for HEARTBEAT seconds, so no two stores are more than 1.5
        HEARTBEAT apart (LIVE is 3 HEARTBEATs)."""
        while not self.opts.stop.wait(Membership.HEARTBEAT / 2) and self.dht is not None:
            self.members.refresh()

    def run_round(self) -> RoundResult | None:
        """One round; None when it changed nothing here (stopped, failed, discarded or resynced). Raises
        RoundsFailing after swarm.max_failed_rounds failed rounds in a row (guard.py)."""
        if self.guard.pause():  # the backoff a failed round owes
            return None
        worker = self.worker
        round = worker.state.round + worker.in_flight + 1  # the round whose inner steps run now
        progress, close = self.reporter.progress(round, worker.device)
        steps = self.cfg.inner.steps
        pace = _Pace(worker.in_flight)

        def on_step(k: int, loss: float) -> None:
            progress(k, loss)
            pace.step(worker.in_flight)
            # when our inner steps will end: who the others wait for (readiness.py). Not while our last exchange is in
            # flight (swarm.overlap eager): we are looking for a group now, as our last announcement says; the
            # first step after it is settled announces instead.
            # (not before its pace is known: a first step's "ends now" would read as ready now to the mates)
            known = pace.measured or self._step_seconds is not None or self.cfg.inner.round_seconds > 0
            if not worker.in_flight and known and (not pace.announced or k == steps // 2):
                self._announce_ready(k + 1, pace.seconds(self._step_seconds))
                pace.announced = True
            if k == steps - 1 and pace.measured:
                self._step_seconds = pace.seconds(None)
            if self.opts.stop.is_set():
                raise StopRequested

        try:
            return self.guard.run(
                round, lambda: worker.run_round(self.averager, self.rules, self.sync, on_step, self.eval_sets)
            )
        except StopRequested:
            return None
        finally:
            close()

    def _vouch(self, hashed: Future) -> None:
        """Announce the state ``hashed`` is the tag of, if it is still ours (called where its hashing ended)."""
        tag = hashed.result()
        if self.worker.state.round == tag.round:
            self.members.announce(tag, wait=False)

    def _announce_ready(self, done: int, pace: float) -> None:
        """Announce when this round's inner steps will end (DHT time, which is the wall clock): the round's end under
        inner.round_seconds; else ``pace`` seconds a step from now on. Mates ready up to half a round later are
        waited for (readiness.py), and at least half of swarm.matchmaking_time (peers of equal speed on a loaded machine
        end their rounds seconds apart; one a few seconds late would otherwise miss the group and arrive a round
        behind); one 2x slower or more is not."""
        now, steps, wait = time.time(), self.cfg.inner.steps, 0.5 * self.cfg.swarm.matchmaking_time
        if self.cfg.inner.round_seconds > 0:
            self.members.expect_ready(self.worker.round_ends_at, 0.2 * self.cfg.inner.round_seconds)
            return
        ready_at = now + pace * (steps - done)
        if self.worker.ends_by is not None:  # a round cut short to end with the mates' (_align)
            ready_at = min(ready_at, max(now, self.worker.ends_by))
        self.members.expect_ready(ready_at, max(0.5 * pace * steps, wait))

    def _linger(self) -> None:
        """Serve the final state for swarm.linger_seconds more, or until every live mate is done on the same state
        (Membership.served_out, read every ``poll_pause`` seconds): a run whose peers end together then ends at once
        (measured: the scale harness's runs of 3 and 4 peers spent 20 of their ~40 s in lingering; then, polled every
        2 s, 2 of the ~20 s of test_adversarial's runs)."""
        linger, final = self.cfg.swarm.linger_seconds, self.sync.tag()
        log.info("done; serving the final state to peers for up to %.0fs more", linger)
        started = time.monotonic()
        while (left := started + linger - time.monotonic()) > 0:
            pause = poll_pause(len(self.members.mates(linger)))  # the mates of the last read
            if self.opts.stop.wait(min(pause, left)):
                return
            if self.members.served_out(final):
                log.info("every live mate is done on this state: leaving after %.0fs", time.monotonic() - started)
                return

    def run(self) -> int:
        """Train until train.rounds or a stop request; always leaves no process behind. Exit code 0 (RoundsFailing
        or another error after joining: checkpointed first, then raised)."""
        try:
            self.start()
            worker = self.worker
            if self.sync.adopted:  # it joined a running swarm: its first round ends with the mates'
                self.healer.align()
            while worker.state.round + worker.in_flight < self.cfg.train.rounds and not self.opts.stop.is_set():
                if self.healer.before_round():
                    self.healer.align()
                started, adopted = time.perf_counter(), self.sync.adopted
                self._settled(self.run_round(), started)
                if self.sync.adopted != adopted:
                    self.healer.align()
            if worker.in_flight:  # swarm.overlap eager: the last exchange (or the one a stop found in flight)
                started = time.perf_counter()
                drain = functools.partial(worker.drain, self.rules, self.sync, self.eval_sets)
                self._settled(self.guard.run(worker.state.round + 1, drain), started)
            if self.opts.stop.is_set():
                log.info("stop requested: leaving at round %d", self.worker.state.round)
            self._checkpoint()
            self.members.finish()  # no mate's matchmaking waits for us from here on
            healed_from = None if self.opts.stop.is_set() else self.healer.at_the_end()
            self._write_final(healed_from)
            if not self.opts.stop.is_set() and self.cfg.swarm.linger_seconds > 0:
                self._linger()
            return 0
        except RoundsFailing as exc:
            saved = self._checkpoint()
            where = f"the checkpoint {saved} holds round {self.worker.state.round}" if saved else "no checkpoint saved"
            raise RoundsFailing(f"{exc} ({where})") from None
        except Exception:
            if self.guard is not None:  # joined: keep what was trained
                log.error("unexpected error: checkpointing before exit")
                try:
                    self._checkpoint()
                except Exception as exc:  # noqa: BLE001 - the original error is the one to report
                    log.error("checkpoint before exit failed: %r", exc)
            raise
        finally:
            self.close()

    def _write_final(self, healed_from: RoundTag | None) -> None:
        """DIR/final.json: the outer state this peer ended on (its round and checksum: the last metrics.jsonl record's,
        unless the heal at the end of the run moved it), and the state it left then, if any."""
        tag = self.sync.tag()
        final = {"round": tag.round, "checksum": tag.checksum, "stopped": self.opts.stop.is_set()}
        if healed_from is not None:
            final["healed_from"] = {"round": healed_from.round, "checksum": healed_from.checksum}
            print(f"the run ended split: moved from {healed_from} to the canonical {tag}", flush=True)
        (self.log_dir / "final.json").write_text(json.dumps(final) + "\n")

    def _settled(self, result: RoundResult | None, started: float) -> None:
        """Report every round trained since the last call: the lost ones (discarded, resynced: Worker.take_lost),
        then the one that moved the outer state, which is announced and checkpointed when due."""
        for lost in self.worker.take_lost():
            self.reporter.report(lost, time.perf_counter() - started)
        if result is None:
            return
        self.reporter.report(result, time.perf_counter() - started)
        self.members.announce(self.sync.tag(), wait=False)  # stored while the next round trains
        every = self.cfg.train.checkpoint_every
        if every and result.outer_step % every == 0:
            self._checkpoint()

    def _checkpoint(self) -> Path | None:
        """Save the outer state and this worker's own state; None when there is nothing (worth) saving."""
        if self.worker is None or self.sync is None or self.worker.state.round == 0:
            return None
        with self.sync.lock:
            state = self.worker.state
            if not state.is_finite():
                log.error("not checkpointing round %d: its outer state holds NaN or inf", state.round)
                return None
            return save_round(
                self.log_dir / "checkpoints",
                state,
                {"peer_id": self.peer_id, "fingerprint": self.members.fingerprint, "config": self.cfg.to_dict()},
                worker_state=self.worker.local_state(),
            )

    def _checkpointed_state(self) -> OuterState | None:
        """The outer state of this peer's last checkpoint, if it is one of this run's (the guard's fallback)."""
        path = latest_checkpoint(self.log_dir / "checkpoints")
        if path is None:
            return None
        try:
            state, meta = load_outer_state(path)
        except CheckpointError as exc:
            log.warning("cannot roll back to the last checkpoint: %s", exc)
            return None
        if meta.get("fingerprint") != self.members.fingerprint:
            log.warning("cannot roll back to %s: it was written with other settings", path)
            return None
        return state

    def close(self) -> None:
        try:
            if self.averager is not None:
                self.averager.shutdown()
                self.averager = None
            if self.worker is not None:
                self.worker.close()
            if self.dht is not None:
                shutdown_dht(self.dht)
                self.dht = None
        finally:  # also when a second Ctrl-C interrupts the shutdown above: the trackers keep what they have
            if self.trackers is not None:
                self.trackers.close()
                self.trackers = None

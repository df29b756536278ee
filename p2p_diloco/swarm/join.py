"""Joining a run: who else is in it, whether their settings match ours, and the outer state to start from.

Inputs:  the DHT node, the Config, this peer's fingerprint and its summary (fingerprint.py), PeerOptions (the
         log dir, ``--resume`` / ``--new-swarm``, the stop Event), a StateSync for downloads.
Output:  ``Membership``: this peer's announcement under ``{run_id}_fingerprint`` (one signed subkey per peer, its
         owner key: only that key can write it, and the key names the peer id, so nobody announces for another peer;
         its fingerprint, its round and the tags of its last 8 outer states, the last one the state
         it holds, and ``client`` when it runs in client mode (it vouches, but is no donor and leads and reduces
         nothing), and ``done`` once its run is over (``finish``: it lingers as a donor, but no matchmaking waits for
         it); refreshed after every change of the state and every round; its settings summary, read only to name
         what differs when a fingerprint does, under ``{run_id}_settings``, stored every half swarm.record_ttl) and
         the others' announcements
         (``vouches``: what sync.py's downloads trust; ``Announcements`` is that reading side alone, for a reader
         that announces nothing: the monitor's samples, monitor_samples.py; ``ahead``: the swarm's state when it has
         left ours too far behind to average with it, which the averager asks before it looks for a group);
         ``first_state``: the worker holds its
         starting outer state (checkpoint, seed or the swarm's) when it returns; ``wait_for_start_peers``: holds
         round 1 until ``swarm.start_peers`` peers are up. In a closed run only the listed peers' announcements count.
State:   our recent tags; the DHT entries, which expire ``swarm.record_ttl`` after the last announcement.
         Every DHT read and write here has a deadline (``swarm.dht_timeout``; dht.bounded): a lookup that never
         answers (a stranger's unparseable value under the key, a dead DHT) reads as "no other peer" and a write
         as not stored, with one warning per kind.
Failure: SwarmSetupError when every other peer of the run has other settings (the message lists each field that
         differs), when peers hold a trained state but none sent it within ``swarm.join_timeout``, or when a
         newcomer finds the run over (its peers done and gone: ``run_over``); CheckpointError for a checkpoint that
         cannot be resumed.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, load_worker_state
from p2p_diloco.config import Config
from p2p_diloco.engine import Worker
from p2p_diloco.fingerprint import fingerprint_differences
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm import lineage
from p2p_diloco.swarm.dht import SwarmSetupError, bounded
from p2p_diloco.swarm.identity import Identity, signer_of
from p2p_diloco.swarm.standing import Standing
from p2p_diloco.swarm.sync import StateSync, Vouches
from p2p_diloco.swarm.validators import MAX_STATES, States, fingerprint_key, owner_subkey, settings_key

__all__ = [
    "POLL_MAX",
    "Announcements",
    "Heal",
    "Membership",
    "PeerOptions",
    "first_state",
    "poll_pause",
    "wait_for_start_peers",
]

log = logging.getLogger("p2p_diloco.join")
POLL_MAX = 10.0  # the most seconds between two reads of the run's members by a peer that waits on the others


def poll_pause(peers: int) -> float:
    """Seconds between two reads of the run's members by a peer waiting on its ``peers`` mates (round 1's start, the
    heal and the linger at the run's end): every read returns every peer's announcement, so n peers polling at a
    fixed rate cost the DHT n^2 records a poll (64 peers at 2 Hz held the scale harness's start for over 600 s,
    measured): 0.5 s, 1/16 s more a peer, at most POLL_MAX."""
    return min(POLL_MAX, 0.5 + max(0, peers) / 16)


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


class Heal(NamedTuple):
    """A split's heal (Membership.canonical): the canonical lineage's state to take, and how many keys must vouch
    for it (``swarm.state_quorum``, or the lineage's keys when fewer)."""

    target: RoundTag
    quorum: int


class Announcements:
    """The run's signed announcements as anyone reads them (see the module docstring): the other peers', their
    settings and the states they vouch for. ``peer_id``: whose own announcement to leave out (a peer's; "" for a
    reader that announces nothing, such as the monitor's samples)."""

    LIVE = 30.0  # an announcement refreshed longer ago than this is a peer that left: it vouches, but is not "there"

    def __init__(
        self, dht: Any, cfg: Config, fingerprint: str, authorized: Container[str] | None = None, peer_id: str = ""
    ) -> None:
        self.dht, self.cfg, self.peer_id = dht, cfg, peer_id
        self.fingerprint, self.authorized = fingerprint, authorized
        self.key = fingerprint_key(cfg.swarm.run_id)
        self.settings_key = settings_key(cfg.swarm.run_id)
        self.timeout = cfg.swarm.dht_timeout
        # mates with our settings read as averaging (live, not done) -> when (monotonic), by any read; one read as
        # gone (not live, or done) is dropped, one missing from a read is kept: a read can come back partial
        self._averaging_seen: dict[str, float] = {}
        self._last_read: tuple[float, dict[str, dict]] | None = None  # (monotonic, _everyone's answer) of the last read
        self.standing = Standing()  # whom our own all-reduces counted: each peer's weight in vouches (standing.py)

    def own_tags(self) -> list[RoundTag]:
        """Our recent tags, the last the state we hold ([]: a reader that holds no state)."""
        return []

    def others(self, max_age: float = 0.0) -> dict[str, dict]:
        """Announcements of the other peers of this run by peer id, whatever their settings ({} when the DHT does
        not answer within ``swarm.dht_timeout``). Only signed ones count, each under its signer's peer id; in a
        closed run, only those of listed peers. Each carries ``"live"``: whether it was refreshed within LIVE
        seconds (read from its DHT expiration, assuming the run's ``swarm.record_ttl``). ``max_age``: the last
        answered read, if it is at most that many seconds old, instead of a new one (each read brings back every
        peer's announcement from each node asked: at 64 peers the DHT's lookups took most of the harness's CPU)."""
        return {peer: v for peer, v in (self._everyone(max_age) or {}).items() if peer != self.peer_id}

    def _everyone(self, max_age: float = 0.0) -> dict[str, dict] | None:
        """``others()`` and our own announcement; None when the DHT did not answer in time."""
        last = self._last_read
        if max_age > 0.0 and last is not None and time.monotonic() - last[0] <= max_age:
            return last[1]
        signed = self._signed(self.key, "the run's members")
        if signed is None:
            return None
        announced_after = get_dht_time() - self.LIVE + self.cfg.swarm.record_ttl  # as an expiration time
        out = {
            peer: {**announcement, "live": isinstance(expires, float) and expires >= announced_after}
            for peer, (announcement, expires) in signed.items()
        }
        now = time.monotonic()
        for peer, v in self._mates_in(out).items():
            if _averages(v):
                self._averaging_seen[peer] = now
            else:
                self._averaging_seen.pop(peer, None)
        self._last_read = (now, out)
        return out

    def settings_of(self, peer: str) -> dict[str, Any] | None:
        """The settings summary ``peer`` stored with its fingerprint (fingerprint.py: the fields it hashes), to name
        what differs from ours; None when it is not found in time or not signed by that peer. A read of its own: only
        a peer whose fingerprint differs needs it."""
        settings = (self._signed(self.settings_key, "the run's settings") or {}).get(peer)
        return None if settings is None else settings[0].get("summary")

    def _signed(self, key: str, what: str) -> dict[str, tuple[dict, Any]] | None:
        """The dictionary values under ``key`` by the peer id that signed each (in a closed run, listed peers' only),
        with their DHT expiration; None when the DHT did not answer within swarm.dht_timeout."""
        found = bounded(
            lambda: self.dht.get(key, latest=True, return_future=True),
            self.timeout,
            f"reading {what} from the DHT",
            None,
        )
        if found is None:
            return None
        entries = getattr(found, "value", None)
        out = {}
        for subkey, item in (entries if isinstance(entries, dict) else {}).items():
            peer, value = signer_of(subkey), getattr(item, "value", None)
            if peer is not None and isinstance(value, dict) and (self.authorized is None or peer in self.authorized):
                out[peer] = (value, getattr(item, "expiration_time", 0.0))
        return out

    def mates(self, max_age: float = 0.0) -> list[dict]:
        """Announcements of the other peers that share our fingerprint (they can average with us); ``max_age``: as
        ``others``."""
        return list(self._mates_in(self._everyone(max_age) or {}).values())

    def _mates_in(self, read: dict[str, dict]) -> dict[str, dict]:
        """The announcements in ``read`` (an ``_everyone`` answer) of the other peers with our settings."""
        return {p: v for p, v in read.items() if p != self.peer_id and v.get("fingerprint") == self.fingerprint}

    def vouches(self, others: dict[str, dict] | None = None) -> Vouches:
        """Which states the other peers with our settings vouch for, and who holds each (sync.StateSync.fetch), with
        each one's weight (``standing``: whom we have averaged with) and our own recent tags. A peer that left (its
        announcement not refreshed within LIVE seconds) still vouches for what it held, but is neither a donor nor
        one of the peers the quorum is taken over. ``others``: a read of ``others()`` to use
        instead of reading the DHT again."""
        out = Vouches(own=self.own_tags())
        for peer, announcement in (self.others() if others is None else others).items():
            if announcement.get("fingerprint") != self.fingerprint:
                continue
            tags = _tags_of(announcement)
            for tag in tags:
                out.vouchers.setdefault(tag, set()).add(peer)
            if announcement["live"]:
                out.live.add(peer)
                if tags and not announcement.get("client"):  # a client-mode peer cannot be dialled to serve it
                    out.holders.setdefault(tags[-1], []).append(peer)
        out.weights = self.standing.weights({p for who in out.vouchers.values() for p in who}, out.live)
        return out


class Membership(Announcements):
    """This peer's announcement in the DHT, and everybody else's (see the module docstring)."""

    HISTORY = MAX_STATES  # the tags of our last states we vouch for
    HEARTBEAT = 10.0  # seconds between refreshes of our announcement while the state does not change (``refresh``)

    def __init__(
        self,
        dht: Any,
        cfg: Config,
        identity: Identity,
        fingerprint: str,
        summary: dict[str, Any],
        authorized: Container[str] | None = None,
        client: bool = False,
    ) -> None:
        super().__init__(dht, cfg, fingerprint, authorized, identity.peer_id)
        self.client, self.summary = client, summary
        # how old a read of the members the matchmaking's questions may share (alone, ahead, reachable_members,
        # expected_members, group_wait, group_window): asked within a second of each other as an exchange begins, each
        # made a read of its own (5 of a peer's 8 reads a round at 16 peers, scale harness); a wait for mates asks
        # again every quarter of matchmaking_time (matchmaking.py), so each of its polls still reads anew
        self.read_reuse = cfg.swarm.matchmaking_time / 4
        self.subkey = owner_subkey(identity.public_key)
        self.states: list[RoundTag] = []  # our recent tags, oldest first
        self.ready_at = 0.0  # when our current inner steps end (DHT time; 0.0: not known)
        self.done = False  # our run is over: we look for no group again (``finish``)
        # how much later than our own round's end a mate may be ready and still be waited for (expect_ready)
        self.patience = cfg.swarm.matchmaking_time
        self._looking_since: float | None = None  # when this round's exchange began looking for a group (DHT time)
        # whether our averager groups with a peer (PseudoGradAverager.admits: not banned); others are never expected
        self.admits: Callable[[str], bool] = lambda peer: True
        # members of a failed attempt that did not answer its vote -> when (DHT time) we were told (``suspect``):
        # expected again once they say when they are ready after that (``_readiness``)
        self._suspects: dict[str, float] = {}
        self._value: dict[str, Any] | None = None  # what we announced last (refresh stores it again)
        self._stored_at = -math.inf  # when (monotonic) we last stored it
        self._settings_at = -math.inf  # when (monotonic) we last stored our settings (``_keep_settings``)
        self._lock = threading.Lock()  # announce runs in the main thread and, once a state is hashed, the hashing one

    def announce(self, tag: RoundTag, wait: bool = True) -> bool:
        """Store (or refresh) our announcement, vouching for ``tag`` and our previous few; False when no DHT node
        took it within the deadline. ``wait=False`` hands it to the DHT process and returns at once (True), and
        stores nothing when the announcement is the one stored within half a HEARTBEAT (a round's state is announced
        as the round settles and again once it is hashed: the same tag, measured as 1 of a peer's 5 stores a round)."""
        with self._lock:
            if not self.states or self.states[-1] != tag:
                self.states = [t for t in self.states if t != tag][-(self.HISTORY - 1) :] + [tag]
            previous = self._value
            self._value = value = {
                "fingerprint": self.fingerprint,
                "round": tag.round,
                "states": [[t.round, t.checksum] for t in self.states],
                "client": self.client,
                "ready_at": self.ready_at,
                "done": self.done,
            }
            same = value == previous and time.monotonic() - self._stored_at < self.HEARTBEAT / 2
        self._keep_settings()
        return True if same and not wait else self._store(value, wait)

    def own_tags(self) -> list[RoundTag]:
        with self._lock:
            return list(self.states)

    def left_lineage(self) -> None:
        """We took a state of another lineage (a split's canonical one): from our next announcement on we vouch for it
        only, not for the tags of the lineage we left. Vouching for both would join the two lineages into one in every
        reader's eyes (lineage.py: a peer whose history holds another's state is on its lineage), and the peers still
        on the one we left would see no split to heal."""
        with self._lock:
            self.states = []

    def expect_ready(self, ready_at: float, patience: float | None = None) -> None:
        """Announce when our current inner steps will end (DHT time), without waiting for the DHT; ``patience``:
        how much later than our own end a mate may be ready and still be waited for (at most half of
        swarm.round_deadline). A revised estimate within swarm.matchmaking_time / 8 of the one announced this round is
        not stored again (the mates' waits are at least half of matchmaking_time)."""
        revised = self._looking_since is None  # a revision of this round's estimate (not the first since looking)
        self._looking_since = None  # a new round's inner steps: not looking for a group
        if patience is not None and math.isfinite(patience):
            self.patience = min(0.5 * self.cfg.swarm.round_deadline, max(0.0, patience))
        if revised and abs(ready_at - self.ready_at) <= self.cfg.swarm.matchmaking_time / 8:
            return  # about what we said: a store costs every node on its way a read of every announcement
        self._say_ready_at(ready_at)

    def looking(self) -> None:
        """Announce that we are ready now and looking for a group (as a round's exchange begins, and again while it
        waits for mates): ``ready_at`` is now, so a mate ending its round meanwhile expects us and does not wait.
        Not stored when the mates read that already: as the exchange begins, when the end we announced is within
        swarm.matchmaking_time / 8 of now; while it waits, until that moment is half of matchmaking_time past (a
        ``ready_at`` more than matchmaking_time past reads as "not known": ``_readiness``). Measured before: a store
        every quarter of matchmaking_time while a wait lasted, each a read of every announcement by each node on its
        way."""
        now, mm = get_dht_time(), self.cfg.swarm.matchmaking_time
        first = self._looking_since is None
        if first:
            self._looking_since = now
        said = now - self.ready_at  # how long ago the moment we announced as our end was
        if -mm / 8 <= said <= (mm / 8 if first else mm / 2):
            return
        self._say_ready_at(now)

    def _say_ready_at(self, ready_at: float) -> None:
        self.ready_at = max(0.0, float(ready_at)) if math.isfinite(ready_at) else 0.0
        with self._lock:
            if self._value is None:
                return
            self._value = value = {**self._value, "ready_at": self.ready_at}
        self._store(value, wait=False)

    def suspect(self, peers: list[str]) -> None:
        """``peers`` did not answer a failed attempt's vote (the averager's ``silent``): from now on, the retry of
        this round included, they are not expected until they announce a ``ready_at`` after now. A dead one's
        announcement reads as live for up to LIVE seconds, with a stale ``ready_at`` that reads as "still finishing
        its exchange": waited for, it held every round open until our patience ran out (measured: two rounds of
        ~18 s after a member was SIGKILLed mid all-reduce; then, suspected from the next round on only, the retry
        of the round it died in, 18 s). A live one says when it is ready again within the round (looking, or its
        next round's end); if it was only slow to answer, the retry may assemble without it (it is no longer
        counted on, though it may still join): it loses this round, where a dead one cost every survivor's."""
        now = get_dht_time()
        for peer in peers:
            self._suspects[peer] = now

    def finish(self) -> bool:
        """Announce that our run is over (we still vouch and, while we linger, serve our state): the mates' matchmaking
        stops expecting us at once, instead of waiting for a peer that will not come while our announcement still
        reads as live (measured with swarm.matchmaking_time=4: a lone peer's rounds took 13 s, not 11, until then).
        False when no DHT node took it within the deadline."""
        with self._lock:
            self.done = True
            if self._value is None:
                return True
            self._value = value = {**self._value, "done": True}
        return self._store(value, wait=True)

    def refresh(self) -> None:
        """Store our last announcement again (it says we are still here), unless we stored it within the last
        HEARTBEAT seconds (every store says so too, and each stored version is one more for every reader to
        verify); the training peer asks every half HEARTBEAT."""
        if self._value is not None and time.monotonic() - self._stored_at >= self.HEARTBEAT:
            self._store(self._value, wait=False)
        self._keep_settings()

    def _keep_settings(self) -> None:
        """Store our settings (fingerprint and summary) under ``{run_id}_settings`` when they were not stored within
        half of swarm.record_ttl, so they never expire while we announce; without waiting."""
        if time.monotonic() - self._settings_at < self.cfg.swarm.record_ttl / 2:
            return
        self._settings_at = time.monotonic()
        value = {"fingerprint": self.fingerprint, "summary": self.summary}
        expires = get_dht_time() + self.cfg.swarm.record_ttl
        try:
            self.dht.store(self.settings_key, value, expires, subkey=self.subkey, return_future=True)
        except Exception as exc:  # noqa: BLE001 - a dead DHT pipe: the next refresh stores them again
            self._settings_at = -math.inf
            log.warning("storing this peer's settings in the DHT failed: %r", exc)

    def _store(self, value: dict[str, Any], wait: bool) -> bool:
        expires = get_dht_time() + self.cfg.swarm.record_ttl
        self._stored_at = time.monotonic()

        def store() -> Any:
            return self.dht.store(self.key, value, expires, subkey=self.subkey, return_future=True)

        if not wait:
            try:
                store()
            except Exception as exc:  # noqa: BLE001 - a dead DHT pipe: the next announcement says it again
                log.warning("announcing this peer in the DHT failed: %r", exc)
            return True
        return bool(bounded(store, self.timeout, "announcing this peer in the DHT", False))

    def _readiness(self) -> tuple[dict[str, float | None], list[float]]:
        """(the live mates this round's matchmaking expects, by peer id, when the others will be ready), as seconds
        from now until their announced ``ready_at``: expected are the ones ready now (looking for a group since at most
        ``swarm.matchmaking_time``: 0), the ones whose round ends at most ``patience`` after ours (after we began
        looking, or from now while our inner steps run), and the ones whose round end is not known (None: not said
        yet, or said longer ago than matchmaking_time: still finishing their last exchange, or their announcement of
        this round is on its way; counting them out closed rounds a second before they came, measured); later is
        later. A peer our averager will not group with (banned: ``admits``) is neither: waiting for it held every
        round open for the whole window (measured: 20 s a round after a lying reducer was banned); nor is one whose run
        is over (``done``), nor a suspect that has not announced a ``ready_at`` since it fell silent (``suspect``).
        From a read at most ``read_reuse`` old."""
        now, window = get_dht_time(), self.cfg.swarm.matchmaking_time
        bound = (self._looking_since if self._looking_since is not None else now) + self.patience
        expected, later = {}, []
        for peer, v in self.others(self.read_reuse).items():
            at = v.get("ready_at", 0.0)
            if v.get("fingerprint") != self.fingerprint or not _averages(v) or not isinstance(at, float):
                continue
            if not self.admits(peer):
                continue
            silent_since = self._suspects.get(peer)
            if silent_since is not None:
                if at <= silent_since:
                    continue
                self._suspects.pop(peer, None)  # it has said when it is ready since: alive
            if at == 0.0 or at < now - window:
                expected[peer] = None
            elif at <= now:
                expected[peer] = 0.0
            elif now < at <= bound:
                expected[peer] = at - now
            elif at > bound:
                later.append(at - now)
        return expected, later

    def expected_members(self) -> int:
        """How many peers will come to this round's matchmaking: us and the live peers with our settings that are
        ready, or whose rounds end at most ``patience`` after ours (``_readiness``: they are waited for,
        ``group_wait``); a peer slower than that is not. The averager assembles a group as soon as that many joined
        (swarm.max_round_peers is only the cap)."""
        return 1 + len(self._readiness()[0])

    def group_wait(self) -> float:
        """Seconds to wait before matchmaking: 0 when a mate is expected this round (the round's leader holds the
        matchmaking open for the expected ones: ``group_window``); with none expected but one later, until that one
        is ready (a straggler that ended after its mates' group formed waits for their next round); else 0. The
        averager asks again as it waits: the answers are estimates, revised as the mates go."""
        expected, later = self._readiness()
        return 0.0 if expected else min(later, default=0.0)

    def group_window(self) -> float:
        """Seconds this round's matchmaking stays open for the expected mates: until the last of them is ready (one
        that has not said when: until our patience runs out), plus half of swarm.matchmaking_time for the joining;
        at least swarm.matchmaking_time x (1 + log2(1 + expected) / 2). The round's leader assembles as soon as all of
        them joined."""
        expected, _ = self._readiness()  # asked right after expected_members: its read
        now, mm = get_dht_time(), self.cfg.swarm.matchmaking_time
        bound = (self._looking_since if self._looking_since is not None else now) + self.patience - now
        last = max((bound if d is None else d for d in expected.values()), default=0.0)
        # many peers arriving at once need longer to settle on one leader (each sees the others' declarations in the
        # DHT seconds late): measured, 12 expected peers in a 5 s window formed 4 groups
        settle = mm * (1.0 + 0.5 * math.log2(1 + len(expected)))
        return max(settle, last + 0.5 * mm)

    def round_end(self) -> float | None:
        """When the live mates' current rounds end (DHT time, the lower median of the ``ready_at`` they announced that
        lie ahead): a peer that took the swarm's state mid-round trains until then, to end with them; None when no mate
        announced an end ahead (a whole round, then: the mates wait for it within their patience)."""
        now = get_dht_time()
        ahead = sorted(
            at for v in self.mates() if _averages(v) and isinstance(at := v.get("ready_at"), float) and at > now
        )
        return ahead[(len(ahead) - 1) // 2] if ahead else None  # the lower median: the earlier of two

    def ahead(self, mine: RoundTag) -> RoundTag | None:
        """The furthest state that ``swarm.state_quorum`` mates vouch for (or all there are, when fewer) and a live
        one holds, when it is more than ``swarm.max_staleness`` rounds past ``mine``: the swarm has averaged on
        without us, so our next Δ would not count in its groups (the averager then resyncs instead of looking for
        one); else None."""
        offers = self.vouches(self.others(self.read_reuse)).offers(self.cfg.swarm.state_quorum, None)
        if offers and offers[0][0].round > mine.round + self.cfg.swarm.max_staleness:
            return offers[0][0]
        return None

    def alone(self) -> bool:
        """Whether we are sure to be the only peer of the run that still averages: the run's members were read (the
        answer holds our own announcement, so the DHT did answer), and every peer with our settings that any read
        showed averaging within the last LIVE seconds has since read as gone (not live, or done). A round then is
        local at once, instead of a matchmaking with nobody (measured: ~11 s a round with swarm.matchmaking_time=4).
        False when not sure: an unanswered read is not "nobody", nor is a mate missing from one read."""
        everyone = self._everyone(self.read_reuse)
        if everyone is None or self.peer_id not in everyone:
            return False
        horizon = time.monotonic() - self.LIVE
        return not any(seen > horizon for seen in list(self._averaging_seen.values()))

    def canonical(self, mine: RoundTag, counting_done: bool = False) -> Heal | None:
        """The state to move to, and the quorum of keys its download needs, when the live peers with our settings (us
        included) hold two or more lineages of the outer state and ours is not the canonical one (lineage.py); else
        None. The canonical lineage's furthest state that the swarm offers (``swarm.state_quorum`` vouch for it, or
        all the lineage's peers when fewer, and a live peer holds it) is the one to take; None when it offers none of
        that lineage's states. Measured before this rule: 16 peers split at round 1 ran two lineages side by side for
        five rounds. ``counting_done``: peers whose run is over count too, while they linger (the heal at the end of a
        run, when every peer is done or about to be). A peer we banned (``admits``) counts for no lineage."""
        others = self.others()
        counts = (lambda v: bool(v.get("live"))) if counting_done else _averages
        histories = {  # a peer our averager banned (a caught liar) offers no lineage to us
            peer: _tags_of(v)
            for peer, v in others.items()
            if v.get("fingerprint") == self.fingerprint and counts(v) and self.admits(peer)
        }
        if not any(histories.values()):
            return None
        histories[self.peer_id] = list(self.states) if self.states and self.states[-1] == mine else [mine]
        chosen = lineage.canonical(histories)
        if chosen is None or self.peer_id in chosen[0]:
            return None
        # the same read, not a second one; keys, as the lineage was chosen (sync.Vouches.offers). A quorum of more keys
        # than the lineage holds could never be met: after a round that failed for all, 3 peers on 3 states (one each)
        # stayed apart to the end, each refusing the canonical one ("fewer than 2 peers vouch for it")
        quorum = min(self.cfg.swarm.state_quorum, len(chosen[0]))
        offers = self.vouches(others).offers(quorum, None, by_standing=False)
        offered = [tag for tag, _ in offers if tag in chosen[1]]
        return Heal(offered[0], quorum) if offered else None  # offers come furthest first

    def finishing(self, last_round: int) -> bool:
        """Whether a live mate with our settings still averages and holds a state at ``last_round`` - 1 or later: its
        last round may still end, on our lineage or on another (a split that only the heal at the end of a run mends).
        A mate further behind is not waited for, nor one whose run is over (``done``), nor one that fell silent in a
        failed attempt's vote and said nothing since (``suspect``: killed, most likely). A mate this read lacks but an
        earlier one showed averaging within LIVE seconds counts as finishing too: a read that misses
        announcements, or that the DHT did not answer, is not "every mate is done" (a guard: the split that ended a run
        on 2 states came from the order of the heal's reads, peer.py, not from a read shown to miss a mate)."""
        others = self.others()
        if self._missing_lately_seen(others):
            return True
        for peer, v in others.items():
            if v.get("fingerprint") != self.fingerprint or not _averages(v):
                continue
            silent_since = self._suspects.get(peer)
            if silent_since is not None and v.get("ready_at", 0.0) <= silent_since:
                continue
            tags = _tags_of(v)
            if tags and tags[-1].round >= last_round - 1:
                return True
        return False

    def served_out(self, final: RoundTag) -> bool:
        """Whether our lingering serves nobody any more: a fresh read answered, every live mate with our settings has
        announced its run over (``done``) and holds ``final``, and no mate an earlier read showed averaging within
        LIVE seconds is missing from it. A mate still training, or done on another state (the heal at the end of a
        run may still take ours), keeps us; so does a read the DHT did not answer."""
        everyone = self._everyone()
        if everyone is None or self.peer_id not in everyone:
            return False
        mates = self._mates_in(everyone)
        if self._missing_lately_seen(mates):
            return False
        return all(v.get("done") and _tags_of(v)[-1:] == [final] for v in mates.values() if v.get("live"))

    def run_over(self) -> RoundTag | None:
        """The furthest state the run's peers finished on, when its run is over: some peer with our settings announced
        itself done on a trained state, and none still averages (live and not done); else None, also when the DHT
        did not answer. A newcomer then has nothing to join (first_state): without this it trained alone from the
        seed, its rounds local, once the done peers had left (measured: 3 peers, 3 rounds, the third 8 s late)."""
        everyone = self._everyone()
        if everyone is None:
            return None
        mates = self._mates_in(everyone).values()
        if any(_averages(v) for v in mates):
            return None
        finals = [tags[-1] for v in mates if v.get("done") for tags in [_tags_of(v)] if tags and tags[-1].round > 0]
        return min(finals, key=lambda tag: (-tag.round, tag.checksum), default=None)  # the furthest; ties alike

    def _missing_lately_seen(self, read: dict[str, dict]) -> bool:
        """Whether a mate that an earlier read showed averaging within LIVE seconds is missing from ``read`` (a read
        can come back partial: missing is not gone)."""
        horizon = time.monotonic() - self.LIVE
        return any(seen > horizon and peer not in read for peer, seen in list(self._averaging_seen.items()))

    def held(self, max_age: float = 0.0) -> collections.Counter[RoundTag]:
        """How many other peers with our settings hold each state (the last tag they announce), read as ``others``."""
        return collections.Counter(
            tags[-1] for v in self.others(max_age).values() if v.get("fingerprint") == self.fingerprint
            for tags in [_tags_of(v)] if tags
        )  # fmt: skip

    def reachable_members(self) -> int | None:
        """How many live peers with our settings accept calls (not client mode): the ones that can lead a group and
        reduce for a client-mode peer. None when not known: the DHT did not answer the read, or a mate an earlier read
        showed averaging is missing from it. Before, either read as 0, and a client-mode peer took a local step with
        "no live peer of the run is reachable" (the likely cause of a NAT'd peer's local round 1 in a CI run, its
        two mates live: not reproduced in 15 runs here)."""
        everyone = self._everyone(self.read_reuse)
        if everyone is None or self._missing_lately_seen(everyone):
            return None
        return sum(1 for v in self._mates_in(everyone).values() if _averages(v) and not v.get("client"))

    def check(self) -> None:
        """Refuse to join a run in which every other peer has other settings; warn about the odd ones out."""
        others = self.others()
        differ = {p: v for p, v in others.items() if v.get("fingerprint") != self.fingerprint}
        if differ and len(differ) == len(others):
            summary = self.settings_of(next(iter(differ)))
            fields = [] if summary is None else fingerprint_differences(self.summary, summary)
            raise SwarmSetupError(
                f"this peer's settings differ from the {len(differ)} peer(s) already in run "
                f"{self.cfg.swarm.run_id!r}, so it would never be grouped with them:\n  "
                + "\n  ".join(fields or ["fingerprint (their settings summary was not found in the DHT)"])
                + "\nUse the same config file and --set overrides as the swarm, or pick another swarm.run_id."
            )
        for peer in differ:
            log.warning("peer %s runs different settings; it will not average with this peer", peer)


def _averages(announcement: dict) -> bool:
    """Whether the announcing peer still comes to matchmakings: it refreshed its announcement lately (``live``) and
    its run is not over (``done``: it may linger as a donor, but looks for no group)."""
    return bool(announcement.get("live")) and not announcement.get("done")


def _tags_of(announcement: dict) -> list[RoundTag]:
    """The tags an announcement vouches for, oldest first (the last is the state its peer holds); [] if malformed."""
    try:
        return [RoundTag(rnd, checksum) for rnd, checksum in States.check(announcement.get("states"))]
    except ValueError:
        return []


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

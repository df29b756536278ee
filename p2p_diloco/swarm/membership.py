"""This peer's announcement in the run: what it vouches for, whether it still averages, and which lineage to hold.

Inputs:  the DHT node, the Config, this peer's Identity, fingerprint and settings summary (fingerprint.py), in a
         closed run the listed peer ids, and whether it runs in client mode.
Output:  ``Membership`` (an Announcements reader, announcements.py, with the Readiness part, readiness.py): this
         peer's announcement under ``{run_id}_fingerprint`` (one signed subkey per peer, its owner key: only that key
         can write it, and the key names the peer id, so nobody announces for another peer; its fingerprint, its
         round and the tags of its last 8 outer states, the last one the state it holds, ``client`` when it runs in
         client mode (it vouches, but is no donor and leads and reduces nothing), ``ready_at``, and ``done`` once
         its run is over (``finish``: it lingers as a donor, but no matchmaking waits for it)), refreshed after
         every change of the state and every round; its settings summary, read only to name what differs when a
         fingerprint does, under ``{run_id}_settings``, stored every half swarm.record_ttl. ``canonical``: the state
         to heal a split to (lineage.py); ``check``: refuse a run whose peers all have other settings.
State:   our recent tags and what we announced last; the DHT entries, which expire ``swarm.record_ttl`` after the
         last announcement.
Failure: a store that no DHT node took within ``swarm.dht_timeout`` returns False (or, not waited for, logs a
         warning: the next announcement says it again); SwarmSetupError from ``check`` when every other peer of the
         run has other settings (the message lists each field that differs).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Container
from typing import Any, NamedTuple

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import Config
from p2p_diloco.fingerprint import fingerprint_differences
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm import lineage
from p2p_diloco.swarm.announcements import Announcements, averages, tags_of
from p2p_diloco.swarm.dht import SwarmSetupError, bounded
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.readiness import Readiness
from p2p_diloco.swarm.validators import MAX_STATES, owner_subkey

__all__ = ["Heal", "Membership"]

log = logging.getLogger("p2p_diloco.membership")


class Heal(NamedTuple):
    """A split's heal (Membership.canonical): the canonical lineage's state to take, and how many keys must vouch
    for it (``swarm.state_quorum``, or the lineage's keys when fewer)."""

    target: RoundTag
    quorum: int


class Membership(Readiness, Announcements):
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
        # how old a read of the members the matchmaking's questions may share (alone, ahead, reachable_members;
        # readiness.py's expected_members, group_wait, group_window): asked within a second of each other as an
        # exchange begins, each made a read of its own (5 of a peer's 8 reads a round at 16 peers, scale harness); a
        # wait for mates asks again every quarter of matchmaking_time (matchmaking.py), so each poll still reads anew
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

    def canonical(self, mine: RoundTag, counting_done: bool = False) -> Heal | None:
        """The state to move to, and the quorum of keys its download needs, when the live peers with our settings (us
        included) hold two or more lineages of the outer state and ours is not the canonical one (lineage.py); else
        None. The canonical lineage's furthest state that the swarm offers (``swarm.state_quorum`` vouch for it, or
        all the lineage's peers when fewer, and a live peer holds it) is the one to take; None when it offers none of
        that lineage's states. Measured before this rule: 16 peers split at round 1 ran two lineages side by side for
        five rounds. ``counting_done``: peers whose run is over count too, while they linger (the heal at the end of a
        run, when every peer is done or about to be). A peer we banned (``admits``) counts for no lineage."""
        others = self.others()
        counts = (lambda v: bool(v.get("live"))) if counting_done else averages
        histories = {  # a peer our averager banned (a caught liar) offers no lineage to us
            peer: tags_of(v)
            for peer, v in others.items()
            if v.get("fingerprint") == self.fingerprint and counts(v) and self.admits(peer)
        }
        if not any(histories.values()):
            return None
        histories[self.peer_id] = list(self.states) if self.states and self.states[-1] == mine else [mine]
        chosen = lineage.canonical(histories)
        if chosen is None or self.peer_id in chosen[0]:
            return None
        # the same read, not a second one; keys, as the lineage was chosen (Vouches.offers). A quorum of more keys
        # than the lineage holds could never be met: after a round that failed for all, 3 peers on 3 states (one each)
        # stayed apart to the end, each refusing the canonical one ("fewer than 2 peers vouch for it")
        quorum = min(self.cfg.swarm.state_quorum, len(chosen[0]))
        offers = self.vouches(others).offers(quorum, None, by_standing=False)
        offered = [tag for tag, _ in offers if tag in chosen[1]]
        return Heal(offered[0], quorum) if offered else None  # offers come furthest first

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

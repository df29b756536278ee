"""When the mates will be ready: this peer's ``ready_at`` announcements and the waits they set for its matchmaking.

Inputs:  the mates' announcements (``ready_at``: when their inner steps end, DHT time; ``done``), read through the
         Membership this class is a part of; the averager's word on which members fell silent in a failed
         attempt's vote (``suspect``) and whom it groups with at all (``admits``).
Output:  ``Readiness``, a part of membership.Membership: it announces when our inner steps end (``expect_ready``)
         and that we are looking for a group (``looking``), and answers the averager's matchmaking
         (matchmaking.py): how many peers will come (``expected_members``), how long to wait before looking
         (``group_wait``) and how long to keep a group open (``group_window``); the peer's: when the mates' rounds end
         (``round_end``, for a peer that took the swarm's state mid-round) and whether a mate's last round may still
         end (``finishing``, at the run's end).
State:   our announced ``ready_at`` and ``patience``, when this round's exchange began looking, and the suspects:
         members silent in a failed attempt's vote, expected again once they announce a ``ready_at`` after it.
         The host class provides ``cfg``, ``fingerprint``, ``others``/``mates`` (announcements.py), ``admits``,
         ``_value``, ``_lock`` and ``_store`` (membership.py).
Failure: none of its own: a read the DHT did not answer expects nobody (matchmaking then waits its usual window);
         a ``ready_at`` store that fails is said again with the next announcement.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import Config
from p2p_diloco.swarm.announcements import averages, tags_of

__all__ = ["Readiness"]


class Readiness:
    """The ``ready_at`` side of this peer's Membership (see the module docstring)."""

    cfg: Config
    fingerprint: str
    read_reuse: float
    ready_at: float  # when our current inner steps end (DHT time; 0.0: not known)
    patience: float  # how much later than our own round's end a mate may be ready and still be waited for
    admits: Callable[[str], bool]
    _looking_since: float | None  # when this round's exchange began looking for a group (DHT time)
    _suspects: dict[str, float]  # members silent in a failed attempt's vote -> when (DHT time) we were told
    _value: dict[str, Any] | None
    _lock: threading.Lock
    others: Callable[..., dict[str, dict]]
    mates: Callable[..., list[dict]]
    _store: Callable[[dict[str, Any], bool], bool]
    _missing_lately_seen: Callable[[dict[str, dict]], bool]

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
            if v.get("fingerprint") != self.fingerprint or not averages(v) or not isinstance(at, float):
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
            at for v in self.mates() if averages(v) and isinstance(at := v.get("ready_at"), float) and at > now
        )
        return ahead[(len(ahead) - 1) // 2] if ahead else None  # the lower median: the earlier of two

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
            if v.get("fingerprint") != self.fingerprint or not averages(v):
                continue
            silent_since = self._suspects.get(peer)
            if silent_since is not None and v.get("ready_at", 0.0) <= silent_since:
                continue
            tags = tags_of(v)
            if tags and tags[-1].round >= last_round - 1:
                return True
        return False

"""The run's signed announcements as anyone reads them: who is in the run, with which settings, holding which states.

Inputs:  the DHT node, the Config, this reader's fingerprint (fingerprint.py), in a closed run the listed peer ids,
         and the peer id whose own announcement to leave out ("" for a reader that announces nothing).
Output:  ``Announcements``: each peer's signed announcement under ``{run_id}_fingerprint`` (membership.py writes
         them: its fingerprint, its round, the tags of its last 8 outer states, the last one the state it holds,
         ``client``, ``ready_at`` and ``done``), each marked ``live`` when refreshed within LIVE seconds; the mates
         (the peers with our settings); ``vouches`` (what sync.py's downloads trust); and the questions a peer asks of
         the run as a whole: ``ahead`` (the swarm's state when it has left ours too far behind to average with it),
         ``alone``, ``reachable_members``, ``held``, ``served_out`` and ``run_over``. The monitor's samples
         (monitor_samples.py) read through this class alone; a training peer through its Membership, which is one.
         ``poll_pause``: how long a peer that waits on its mates pauses between two reads.
State:   the last answered read (questions asked together may share it: ``read_reuse``), and when each mate last
         read as averaging (a read can come back partial: a mate missing from one read is not gone).
Failure: every read has a deadline (``swarm.dht_timeout``; dht.bounded): a lookup that never answers (a stranger's
         unparseable value under the key, a dead DHT) reads as "no other peer", with one warning per kind; the
         questions that must not mistake that for "nobody" (``alone``, ``served_out``, ``reachable_members``) answer
         "not sure" instead.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Container
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import Config
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.dht import bounded
from p2p_diloco.swarm.identity import signer_of
from p2p_diloco.swarm.standing import Standing
from p2p_diloco.swarm.validators import States, fingerprint_key, settings_key
from p2p_diloco.swarm.vouches import Vouches

__all__ = ["POLL_MAX", "Announcements", "averages", "poll_pause", "tags_of"]

POLL_MAX = 10.0  # the most seconds between two reads of the run's members by a peer that waits on the others


def poll_pause(peers: int) -> float:
    """Seconds between two reads of the run's members by a peer waiting on its ``peers`` mates (round 1's start, the
    heal and the linger at the run's end): every read returns every peer's announcement, so n peers polling at a
    fixed rate cost the DHT n^2 records a poll (64 peers at 2 Hz held the scale harness's start for over 600 s,
    measured): 0.5 s, 1/16 s more a peer, at most POLL_MAX."""
    return min(POLL_MAX, 0.5 + max(0, peers) / 16)


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
        # how old a read the questions asked together may share (``ahead``, ``alone``, ``reachable_members``, and
        # readiness.py's): 0, a new read for each; a peer's Membership shares reads within a quarter of a window
        self.read_reuse = 0.0
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
            if averages(v):
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
            tags = tags_of(announcement)
            for tag in tags:
                out.vouchers.setdefault(tag, set()).add(peer)
            if announcement["live"]:
                out.live.add(peer)
                if tags and not announcement.get("client"):  # a client-mode peer cannot be dialled to serve it
                    out.holders.setdefault(tags[-1], []).append(peer)
        out.weights = self.standing.weights({p for who in out.vouchers.values() for p in who}, out.live)
        return out

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
        return all(v.get("done") and tags_of(v)[-1:] == [final] for v in mates.values() if v.get("live"))

    def run_over(self) -> RoundTag | None:
        """The furthest state the run's peers finished on, when its run is over: some peer with our settings announced
        itself done on a trained state, and none still averages (live and not done); else None, also when the DHT
        did not answer. A newcomer then has nothing to join (first_state): without this it trained alone from the
        seed, its rounds local, once the done peers had left (measured: 3 peers, 3 rounds, the third 8 s late)."""
        everyone = self._everyone()
        if everyone is None:
            return None
        mates = self._mates_in(everyone).values()
        if any(averages(v) for v in mates):
            return None
        finals = [tags[-1] for v in mates if v.get("done") for tags in [tags_of(v)] if tags and tags[-1].round > 0]
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
            for tags in [tags_of(v)] if tags
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
        return sum(1 for v in self._mates_in(everyone).values() if averages(v) and not v.get("client"))


def averages(announcement: dict) -> bool:
    """Whether the announcing peer still comes to matchmakings: it refreshed its announcement lately (``live``) and
    its run is not over (``done``: it may linger as a donor, but looks for no group)."""
    return bool(announcement.get("live")) and not announcement.get("done")


def tags_of(announcement: dict) -> list[RoundTag]:
    """The tags an announcement vouches for, oldest first (the last is the state its peer holds); [] if malformed."""
    try:
        return [RoundTag(rnd, checksum) for rnd, checksum in States.check(announcement.get("states"))]
    except ValueError:
        return []

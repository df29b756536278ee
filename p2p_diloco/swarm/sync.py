"""A swarm peer's outer state as shared with the swarm: serve a snapshot, download a vouched-for state, adopt it.

Inputs:  the Worker whose OuterState this guards; the averager (``manifest`` and ``piece`` from donors, see
         download.py; it serves ``serve``'s output to others); this run's fingerprint; ``swarm.state_timeout``;
         a callable that says whether other peers of the run are about; ``vouches``: what the run's signed
         announcements say (vouches.py: which peer holds which (round, checksum) now, and which it held in its last
         rounds); ``swarm.state_quorum``; ``on_change``, called after every change of the state (the peer announces
         the new tag at once, so others may vouch for it).
Output:  ``serve`` (the snapshot other peers download), ``fetch(wanted)`` (the one download path: the furthest state
         that ``state_quorum`` peers, or all there are when fewer, vouch for, or our own, in pieces from its holders
         in parallel: download.py; ``fetch_vouched`` is that path without a worker, which the monitor's samples take
         too: monitor_samples.py), and what the peer does with it: ``download`` (join, resume), ``catch_up``
         and ``resync`` (after a round, see protocol.py), ``take`` (one given state: a split's canonical lineage);
         ``apply_outer`` (the round's outer step, under the lock).
         For rounds that fail (guard.py): ``begin_round``, ``round_ran``, ``discard_round`` and ``last_good``.
State:   the lock that guards the worker's outer state against hivemind's state-serving thread; ``consensus``:
         whether that state came out of a complete group (or the seed, a checkpoint, a download); ``version``,
         bumped by every change made here; the snapshot served for the current version (copied once per state,
         however many peers download it, hashed once into its part digests: the manifest); two CPU copies at most:
         the state the current round started from, and ``last_good``, the last state from which a round's inner
         steps ran with a finite loss. The first is copied at the start of a round whose state changed since the
         last copy (once per applied round: anchor + momentum in fp32, 8 bytes per parameter, ~5 MB for tiny.yaml,
         ~150 MB for small.yaml); the second is that copy, kept by reference. For a model of 150M parameters and
         more, the copy (1.2 GB, and 2.4 GB of host memory for both, 3.6 GB with the served snapshot) is worth
         weighing.
Failure: nothing a donor sends raises here. A state too few peers vouch for, or that too few of the run's live peers
         hold (vouches.py: by standing, standing.py), is not downloaded at all, whatever round it claims (logged:
         "fewer than N peers vouch for it", "too few of the run's peers hold it or held it"); a manifest with
         another fingerprint, round or part count, or whose parts do not hash to the vouched checksum, and a piece
         that does not match the manifest, are logged and refused, and other holders are asked (download.py). The
         checksum is sha256 over the round and the sha256 of each 1 MiB part of the state (state_parts.py), truncated
         to 64 bits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.engine import Worker
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundTag
from p2p_diloco.state_parts import part_digests, state_checksum
from p2p_diloco.swarm.download import download_state
from p2p_diloco.swarm.vouches import Vouches

__all__ = ["Offer", "StateSync", "fetch_vouched"]

log = logging.getLogger("p2p_diloco.sync")


@dataclass
class Offer:
    """A verified outer state from a donor, and whether it came out of a complete group there."""

    state: OuterState
    consensus: bool

    @property
    def tag(self) -> RoundTag:
        return RoundTag(self.state.round, self.state.checksum())


def fetch_vouched(
    averager: Any,
    vouches: Vouches,
    shapes: Sequence[torch.Tensor],
    fingerprint: str,
    quorum: int,
    timeout: float,
    wanted: Callable[[RoundTag], bool] = lambda tag: True,
    mine: RoundTag | None = None,
    by_standing: bool = True,
) -> Offer | None:
    """The furthest state ``vouches`` offers (Vouches.offers: ``quorum`` peers, or all there are when fewer, vouch for
    it) that ``wanted`` accepts and is not ``mine``, in pieces from its holders (download.py); None (logged) when there
    is none within ``timeout``. ``shapes``: tensors of the state's shapes (anchor then momentum; only their shapes are
    read; ``by_standing``: as Vouches.offers). The one download path: StateSync.fetch for a peer, monitor_samples.py
    for the monitor (``mine`` None)."""
    _log_refusals(vouches, quorum, mine, by_standing, wanted)
    deadline = time.monotonic() + timeout
    for tag, donors in vouches.offers(quorum, mine, by_standing):
        if tag == mine or not wanted(tag):
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("no verified outer state within swarm.state_timeout=%gs", timeout)
            return None
        got = download_state(averager, shapes, fingerprint, tag, donors, left)
        if got is not None:
            return Offer(*got)
    return None


def _log_refusals(
    vouches: Vouches, quorum: int, mine: RoundTag | None, by_standing: bool, wanted: Callable[[RoundTag], bool]
) -> None:
    """Say why each state ``wanted`` accepts is not offered (Vouches.refusals)."""
    for tag, why in sorted(vouches.refusals(quorum, mine, by_standing).items()):
        if wanted(tag):
            log.warning("not downloading %s: %s", tag, why)


class StateSync:
    """The outer state of one peer: every change and every download goes through here (see the module doc)."""

    CATCH_UP_RETRY = 1.0  # seconds before a catch-up asks the group's members again
    # a download whose donors all moved on meanwhile (rounds of a second or two) reads the vouches again, this many
    # times at most, this long after the failure (their new state is announced once it is hashed)
    MOVED_ON_RETRIES, MOVED_ON_PAUSE = 3, 0.5

    def __init__(
        self,
        worker: Worker,
        averager: Any,
        fingerprint: str,
        timeout: float,
        peers_present: Callable[[], bool],
        vouches: Callable[[], Vouches] = Vouches,
        quorum: int = 2,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.worker, self.averager, self.fingerprint, self.timeout = worker, averager, fingerprint, timeout
        self.peers_present, self.vouches, self.quorum = peers_present, vouches, quorum
        self.on_change = on_change or (lambda: None)
        self._served: tuple[int, dict[str, Any], list[torch.Tensor]] | None = None  # (version, meta, tensors)
        self.lock = threading.Lock()
        self.consensus = True  # the seed, a checkpoint or a download: nothing local-only yet
        self.version = 0  # bumped by every change of the outer state made here
        self.adopted = 0  # states taken from the swarm (downloads: join, resync, catch-up to a state past the group's)
        self._start: tuple[int, OuterState, bool] | None = None  # (version, copy, consensus) at the round's start
        self._good: tuple[OuterState, bool] | None = None  # the last state a round's inner steps ran from, finite

    # ---------------------------------------------------------------- serving
    def serve(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(metadata, tensors) for a peer downloading our state: one snapshot per state (the lock is held only for
        its copy), hashed once into its part digests (the manifest, ``parts``), served to every downloader until the
        state changes."""
        served = self._served
        if served is not None and served[0] == self.version:
            return served[1], served[2]
        with self.lock:  # the snapshot is the state as it is
            version, snapshot, consensus = self.version, self.worker.state.copy(), self.consensus
        digests = part_digests(snapshot.tensors())  # the manifest (download.py); the checksum hashes them
        meta = {
            "round": snapshot.round,
            "checksum": state_checksum(snapshot.round, digests),
            "fingerprint": self.fingerprint,
            "consensus": consensus,
            "parts": digests,
        }
        self._served = (version, meta, snapshot.tensors())
        return meta, snapshot.tensors()

    def tag(self) -> RoundTag:
        """Our state's tag (``Worker.tag``: hashed once per state, the checksum hashes the whole state)."""
        return self.worker.tag()

    # ---------------------------------------------------------------- fetching
    def fetch(
        self, wanted: Callable[[RoundTag], bool] = lambda tag: True, by_standing: bool = True, quorum: int = 0
    ) -> Offer | None:
        """The furthest state the swarm vouches for (Vouches.offers; ``quorum`` keys or standing, 0: the
        ``swarm.state_quorum`` this was made with) that ``wanted`` accepts and that is not ours, in pieces from its
        holders (``fetch_vouched``); None (logged) when there is none within ``swarm.state_timeout``. When every state
        offered failed, e.g. its holders moved on to the next round's while we asked, it reads the vouches again and
        tries the states offered since (MOVED_ON_RETRIES times at most)."""
        deadline, tried, shapes = time.monotonic() + self.timeout, set(), self.worker.state.tensors()
        quorum = quorum or self.quorum
        untried = lambda tag: tag not in tried and wanted(tag)  # noqa: E731
        for attempt in range(1 + self.MOVED_ON_RETRIES):
            if attempt:
                time.sleep(self.MOVED_ON_PAUSE)
            vouches, mine = self.vouches(), self.tag()
            offered = {tag for tag, _ in vouches.offers(quorum, mine, by_standing) if tag != mine and untried(tag)}
            left = deadline - time.monotonic()
            if not offered or left <= 0:
                if not attempt:  # say why the states we want are not offered (fetch_vouched would)
                    _log_refusals(vouches, quorum, mine, by_standing, wanted)
                return None
            if attempt:
                log.info("the state's holders moved on: trying %s", ", ".join(map(str, sorted(offered))))
            args = (self.fingerprint, quorum, left, untried, mine, by_standing)
            got = fetch_vouched(self.averager, vouches, shapes, *args)
            if got is not None:
                return got
            tried |= offered
        return None

    def vouched_past(self, round: int) -> bool:
        """Whether the swarm vouches for a state some peer holds past ``round`` (one worth waiting for)."""
        return any(tag.round > round for tag, _ in self.vouches().offers(self.quorum, self.tag()))

    # ---------------------------------------------------------------- changing the state
    def adopt(self, offer: Offer, why: str) -> None:
        with self.lock:
            self.worker.load_state(offer.state)
            self.consensus = offer.consensus
            self.version += 1
            self.adopted += 1
        self.on_change()
        log.info("%s: took the outer state at %s", why, offer.tag)

    def apply_outer(self, averaged: list[torch.Tensor], consensus: bool) -> float:
        """The round's outer step with Δ̄; ``consensus`` False after a local step. Returns the outer lr."""
        with self.lock:
            lr = self.worker.apply_outer(averaged)
            self.consensus = consensus
            self.version += 1
        self.on_change()
        return lr

    def download(self, newer_than: int = -1) -> bool:
        """Take the swarm's state if one is offered past round ``newer_than`` (join: any; resume: a newer one)."""
        offer = self.fetch(lambda tag: tag.round > newer_than)
        if offer is None:
            return False
        self.adopt(offer, "download")
        return True

    def take(self, wanted: RoundTag, why: str, quorum: int) -> bool:
        """Take the state ``wanted`` (the canonical lineage's, Membership.canonical) if ``quorum`` keys vouch for it
        (Vouches.offers, not by standing: the lineage was chosen by counting keys); False (logged) when not, or its
        download fails."""
        offer = self.fetch(lambda tag: tag == wanted, by_standing=False, quorum=quorum)
        if offer is None:
            return False
        self.adopt(offer, why)
        return True

    def catch_up(self, group: RoundTag, averaged: list[torch.Tensor]) -> bool:
        """Behind the group, our Δ counted: take the group's pre-round state and apply the same Δ̄ (or take the
        post-round state if the donor applied it already). Ends bitwise equal to the group. Asked twice: right
        after the round the donors may have moved on to the post-round state before announcing it (seen: both
        refused the pre-round state they no longer held), and a second later they vouch for it."""
        wanted = lambda tag: tag == group or tag.round == group.round + 1  # noqa: E731
        offer = self.fetch(wanted)
        if offer is None:
            time.sleep(self.CATCH_UP_RETRY)
            offer = self.fetch(wanted)
        if offer is None:
            return False
        if offer.tag == group:
            with self.lock:
                self.worker.load_state(offer.state)
                self.version += 1
                self.worker.apply_outer(averaged)
                self.consensus = True
            self.on_change()
            return True
        if offer.state.round == group.round + 1:
            self.adopt(offer, "catch up")
            return True
        log.warning("catch up: the state offered (%s) is neither the group's (%s) nor one past it", offer.tag, group)
        return False

    def resync(self, after_local_step: bool) -> bool:
        """Take the swarm's state. After a local step only one that is ahead, or at our round and from a complete
        group; two peers that both stepped alone keep the smaller checksum, so they never swap states."""
        if not after_local_step:
            return self.download()
        if not self.peers_present():
            return False
        mine = self.tag()
        offer = self.fetch(lambda tag: tag.round >= mine.round)
        if offer is None:
            return False
        same_round_better = offer.state.round == mine.round and (offer.consensus or offer.tag.checksum < mine.checksum)
        if offer.state.round > mine.round or same_round_better:
            self.adopt(offer, "resync after a local step")
            return True
        return False

    # ---------------------------------------------------------------- rounds that fail (guard.py)
    def begin_round(self) -> int:
        """Before a round: keep a copy of the state it starts from (copied only when the state changed since the
        last copy). Returns ``version``, which names that state."""
        with self.lock:
            if self._start is None or self._start[0] != self.version:
                state = self.worker.state
                self._start = (self.version, state.copy(), self.consensus)
            return self.version

    def round_ran(self) -> None:
        """The round's inner steps ran with a finite loss: the state it started from becomes ``last_good``."""
        with self.lock:
            if self._start is not None:
                self._good = self._start[1], self._start[2]

    def discard_round(self) -> None:
        """A round failed unexpectedly: θ ← anchor, and if nothing here changed the state since ``begin_round``,
        the anchor and momentum are put back as they were then (an outer step cut short leaves them half done)."""
        with self.lock:
            if self._start is not None and self._start[0] == self.version:
                self.worker.load_state(self._start[1].copy())
                self.consensus = self._start[2]
            else:
                self.worker.reset_params()

    def last_good(self) -> Offer | None:
        """A copy of the last state from which a round's inner steps ran with a finite loss (None before one did)."""
        with self.lock:
            return None if self._good is None else Offer(self._good[0].copy(), self._good[1])

"""A swarm peer's outer state as shared with the swarm: serve a snapshot, fetch and verify a donor's, adopt it.

Inputs:  the Worker whose OuterState this guards, the averager (hivemind's state transfer: ``load_state`` from
         the donor with the highest priority, ``state_sharing_priority`` = our round), this run's fingerprint,
         ``swarm.state_timeout``, and a callable that says whether other peers of the run are about.
Output:  ``serve`` (the snapshot other peers download), ``fetch(accept)`` (the one fetch-and-verify path every
         download takes), and what the peer does with it: ``download`` (join, resume), ``catch_up`` and ``resync``
         (after a round, see protocol.py); ``apply_outer`` (the round's outer step, under the lock). For rounds
         that fail (guard.py): ``begin_round``, ``round_ran``, ``discard_round`` and ``last_good``.
State:   the lock that guards the worker's outer state against hivemind's state-serving thread; ``consensus``:
         whether that state came out of a complete group (or the seed, a checkpoint, a download); ``version``,
         bumped by every change made here; two CPU copies at most: the state the current round started from,
         and ``last_good``, the last state from which a round's inner steps ran with a finite loss. The first is
         copied at the start of a round whose state changed since the last copy (once per applied round:
         anchor + momentum in fp32, 8 bytes per parameter, ~5 MB for tiny.yaml, ~150 MB for small.yaml); the
         second is that copy, kept by reference. For a model of 150M parameters and more, the copy (1.2 GB, and
         2.4 GB of host memory for both) is worth weighing.
Failure: nothing a donor sends raises here: an offer with another fingerprint, another tensor count or shapes,
         a bad round or a checksum that does not match its tensors is logged and refused (None / False).
         The checksum is the donor's own claim about its bytes, so it catches transfer errors, not a lying
         donor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.engine import Worker
from p2p_diloco.outer import OuterState
from p2p_diloco.swarm.protocol import RoundTag

__all__ = ["Offer", "StateSync"]

log = logging.getLogger("p2p_diloco.sync")


@dataclass
class Offer:
    """A verified outer state from a donor, and whether it came out of a complete group there."""

    state: OuterState
    consensus: bool

    @property
    def tag(self) -> RoundTag:
        return RoundTag(self.state.round, self.state.checksum())


class StateSync:
    """The outer state of one peer: every change and every download goes through here (see the module doc)."""

    def __init__(
        self, worker: Worker, averager: Any, fingerprint: str, timeout: float, peers_present: Callable[[], bool]
    ) -> None:
        self.worker, self.averager, self.fingerprint, self.timeout = worker, averager, fingerprint, timeout
        self.peers_present = peers_present
        self.lock = threading.Lock()
        self.consensus = True  # the seed, a checkpoint or a download: nothing local-only yet
        self.version = 0  # bumped by every change of the outer state made here
        self._start: tuple[int, OuterState, bool] | None = None  # (version, copy, consensus) at the round's start
        self._good: tuple[OuterState, bool] | None = None  # the last state a round's inner steps ran from, finite

    # ---------------------------------------------------------------- serving
    def serve(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(metadata, tensors) for a peer downloading our state; the lock is held only for the copy."""
        with self.lock:
            snapshot = self.worker.state.copy()
            consensus = self.consensus
        meta = {
            "round": snapshot.round,
            "checksum": snapshot.checksum(),
            "fingerprint": self.fingerprint,
            "consensus": consensus,
        }
        return meta, snapshot.tensors()

    # ---------------------------------------------------------------- fetching
    def fetch(self) -> Offer | None:
        """The state of the most advanced peer that shares it, verified; None (logged) when there is none."""
        got = self.averager.load_state(self.timeout)
        if got is None:
            return None
        meta, tensors = got
        problem = self._check(meta, tensors)
        if problem:
            log.warning("refused the outer state a peer offered: %s", problem)
            return None
        state = OuterState.from_tensors(tensors, meta["round"])
        if state.checksum() != meta["checksum"]:
            log.warning("refused the outer state a peer offered: it fails its checksum")
            return None
        return Offer(state, bool(meta.get("consensus", True)))

    def _check(self, meta: Any, tensors: list[torch.Tensor]) -> str:
        """Why an offer does not fit this peer ('' when it does)."""
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint:
            return "it comes from a peer with other settings"
        rnd = meta.get("round")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0 or not isinstance(meta.get("checksum"), str):
            return f"its round/checksum metadata is malformed ({str(meta)[:80]})"
        ours = self.worker.state.tensors()
        if len(tensors) != len(ours):
            return f"it holds {len(tensors)} tensors, this model's outer state has {len(ours)}"
        for k, (theirs, mine) in enumerate(zip(tensors, ours, strict=True)):
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
                return f"tensor {k} is {getattr(theirs, 'shape', type(theirs).__name__)}, expected {tuple(mine.shape)}"
        return ""

    # ---------------------------------------------------------------- changing the state
    def advertise(self) -> None:
        """Tell downloaders how far our state is: hivemind serves the highest ``state_sharing_priority`` first."""
        self.averager.state_sharing_priority = float(self.worker.state.round)

    def adopt(self, offer: Offer, why: str) -> None:
        with self.lock:
            self.worker.load_state(offer.state)
            self.consensus = offer.consensus
            self.version += 1
        self.advertise()
        log.info("%s: took the outer state at %s", why, offer.tag)

    def apply_outer(self, averaged: list[torch.Tensor], consensus: bool) -> float:
        """The round's outer step with Δ̄; ``consensus`` False after a local step. Returns the outer lr."""
        with self.lock:
            lr = self.worker.apply_outer(averaged)
            self.consensus = consensus
            self.version += 1
        self.advertise()
        return lr

    def download(self, newer_than: int = -1) -> bool:
        """Take the swarm's state if one is offered past round ``newer_than`` (join: any; resume: a newer one)."""
        offer = self.fetch()
        if offer is None:
            return False
        if offer.state.round <= newer_than:
            log.info("the state offered is at round %d, not past ours (%d); kept ours", offer.state.round, newer_than)
            return False
        self.adopt(offer, "download")
        return True

    def catch_up(self, group: RoundTag, averaged: list[torch.Tensor]) -> bool:
        """One round behind, our Δ counted: take the group's pre-round state and apply the same Δ̄ (or take the
        post-round state if the donor applied it already). Ends bitwise equal to the group."""
        offer = self.fetch()
        if offer is None:
            return False
        if offer.tag == group:
            with self.lock:
                self.worker.load_state(offer.state)
                self.version += 1
                self.worker.apply_outer(averaged)
                self.consensus = True
            self.advertise()
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
        offer, mine = self.fetch(), self.worker.tag()
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
                self.worker.state.copy_to(self.worker.model.parameters())

    def last_good(self) -> Offer | None:
        """A copy of the last state from which a round's inner steps ran with a finite loss (None before one did)."""
        with self.lock:
            return None if self._good is None else Offer(self._good[0].copy(), self._good[1])

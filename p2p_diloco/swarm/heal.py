"""Keeping this peer on the swarm's one outer state: heal a split before a round and at the run's end, and end the
first round after a download with the mates.

Inputs:  the Worker, the StateSync, this peer's Membership (membership.py: ``canonical``, ``finishing``,
         ``round_end``), the Config, the peer's stop Event, and its checkpoint callable.
Output:  ``Healer.before_round`` (took the canonical lineage of a split?), ``Healer.align`` (the next round's inner
         steps end with the mates' current round: ``Worker.end_by``), ``Healer.at_the_end`` (after the last round,
         the state left to take the canonical one, if any).
State:   none of its own.
Failure: a canonical state that the swarm does not offer (too few vouch for it, no holder answers) is not taken:
         before a round, the next round asks again; at the run's end, the heal is asked again every ``poll_pause``
         until no mate is finishing, for at most swarm.round_deadline. A stop ends the wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from p2p_diloco.config import Config
from p2p_diloco.engine import Worker
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.announcements import POLL_MAX, poll_pause
from p2p_diloco.swarm.membership import Heal, Membership
from p2p_diloco.swarm.sync import StateSync

__all__ = ["Healer"]

log = logging.getLogger("p2p_diloco.peer")


class Healer:
    """Heals splits for one training peer (see the module docstring)."""

    def __init__(
        self,
        worker: Worker,
        sync: StateSync,
        members: Membership,
        cfg: Config,
        stop: threading.Event,
        checkpoint: Callable[[], Path | None],
    ) -> None:
        self.worker, self.sync, self.members, self.cfg = worker, sync, members, cfg
        self.stop, self.checkpoint = stop, checkpoint

    def before_round(self) -> bool:
        """Before a round: when the swarm holds two lineages of the outer state (a split) and ours is not the
        canonical one (Membership.canonical), take the canonical one's state; whether we did. Not with an exchange
        in flight (swarm.overlap eager): its round settles on our lineage first."""
        if self.worker.in_flight:
            return False
        mine = self.sync.tag()
        heal = self.members.canonical(mine)
        if heal is None:
            return False
        log.warning("the swarm split: more peers hold the lineage of %s than ours (%s); taking it", heal.target, mine)
        return self.take(heal, "moving to the swarm's canonical lineage", wait=False)

    def take(self, heal: Heal, why: str, wait: bool) -> bool:
        """Take ``heal.target``, a state of another lineage, and announce it at once, vouching for it alone
        (Membership.left_lineage); whether the swarm offered it. ``wait``: until a DHT node stored the announcement."""
        if not self.sync.take(heal.target, why, heal.quorum):
            return False
        self.members.left_lineage()
        self.members.announce(self.sync.tag(), wait=wait)
        return True

    def align(self) -> None:
        """After this peer took the swarm's state (it joined, or resynced), end its next round's inner steps with its
        mates' current round (Membership.round_end), so its Δ counts in their group: a peer a few seconds late, or
        one that spent part of a round downloading, would otherwise arrive a round behind every time and resync again.
        Fixed H only (inner.round_seconds ends every peer's round at the same instant already), not with an exchange
        in flight."""
        if self.cfg.inner.round_seconds > 0 or self.worker.in_flight:
            return
        end = self.members.round_end()
        if end is not None:
            self.worker.end_by = end
            log.info("took the swarm's state mid-round: the next inner steps end with the mates' round, in %.1fs",
                     max(0.0, end - time.time()))  # fmt: skip

    def at_the_end(self) -> RoundTag | None:
        """After our last round (we announced ``done``): while a mate's last round may still end (``finishing``),
        watch for a split, and when our lineage is not the canonical one among the live peers, done ones included,
        take the canonical state, so the run ends on one state. ``before_round`` mends a split before the next round;
        a split in the last round has none (measured: 64 harness peers ended 58 + 6 on two states). At most
        swarm.round_deadline; the tag we left, or None."""
        left, deadline = None, time.monotonic() + self.cfg.swarm.round_deadline
        while not self.stop.is_set():
            mine = self.sync.tag()
            # finishing before canonical, each its own read: mates announce their last state and "done" within
            # moments, so a split judged on a read older than the one that found them done can be missed (seen in 2
            # of 12 runs the other way round: the last read showed the 2 + 2 split, all done, and the peer stayed)
            settled = not self.members.finishing(mine.round)
            heal = self.members.canonical(mine, counting_done=True)
            if heal is not None:
                log.warning("the run ended split: more peers hold the lineage of %s than ours (%s)", heal.target, mine)
                if self.take(heal, "the run ended split: moving to the canonical lineage", wait=True):
                    left = left or mine
                    self.checkpoint()
                    continue
            elif settled:
                held = self.members.held(max_age=5.0)  # from the read canonical() just made
                log.info("the run's end: no mate still finishing; ours is %s, the others read hold %s", mine,
                         ", ".join(f"{tag} x{n}" for tag, n in held.items()) or "nothing")  # fmt: skip
                break
            if time.monotonic() > deadline:
                log.warning("the run's end: mates still finish their last round after %.0fs; not waiting longer",
                            self.cfg.swarm.round_deadline)  # fmt: skip
                break
            self.stop.wait(poll_pause(len(self.members.mates(2 * POLL_MAX))))  # the mates of the last read
        return left

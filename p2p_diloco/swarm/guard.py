"""What a training peer does with a round that fails: discard it, back off, roll back, or checkpoint and give up.

Inputs:  the StateSync of the peer (the state a round starts from, the last good one), ``swarm.rollback_after``,
         ``swarm.max_failed_rounds``, a ``wait(seconds) -> stopped`` (the stop Event's ``wait``: interruptible),
         and optionally ``fallback() -> OuterState | None`` (the peer's last checkpoint) for a rollback when no
         round has run with a finite loss yet. Per round: ``pause()`` before it, ``run(round, attempt)`` around it.
Output:  ``run`` returns what ``attempt`` returned (a RoundResult or None), or None for a failed round.
State:   failed rounds in a row (any kind), non-finite rounds in a row from one outer state (its StateSync
         ``version``), the wait owed before the next attempt, and the exception types whose traceback was logged.
Failure: ``RoundsFailing`` after ``max_failed_rounds`` failed rounds in a row (replayed rounds between them do not
         break the row; a state holding NaN/inf is first replaced by the last good one, so that a checkpoint
         holds that): the caller checkpoints and exits 1.
         StopRequested, KeyboardInterrupt and SystemExit go through untouched and count for nothing.

The policy, per round:
  finite       ``attempt`` returned (a result, or None: discarded by the protocol, resynced): the state the round
               started from becomes the last good one (StateSync.round_ran); counters and backoff reset, unless
               the round only replayed one before the round that failed (after a rollback): a loss that turns
               non-finite at the same round again, whatever state it starts from, still ends in giving up.
  non-finite   NonFiniteLossError / NonFiniteUpdateError (θ was reset by the engine): the round is discarded. After
               ``rollback_after`` of them in a row from the same outer state, the peer takes the last good state
               (else its last checkpoint, else whatever a peer offers) and says so; inner optimizer moments that
               hold NaN/inf are forgotten with it (InnerOptimizer.drop_nonfinite_state).
  error        any other Exception: logged with its type and message (the traceback once per type, later at debug
               level), the round discarded, θ ← anchor and the outer state put back as the round found it.
  backoff      the k-th failed round in a row is followed by a wait of min(backoff_max, backoff x 2^(k-2)) seconds
               (none after the first; 1, 2, 4, ... by default, at least ``backoff`` after a rollback), so a state
               that fails at the first inner step never spins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from p2p_diloco.inner import NonFiniteLossError
from p2p_diloco.outer import NonFiniteUpdateError, OuterState
from p2p_diloco.swarm.sync import Offer, StateSync

__all__ = ["RoundGuard", "RoundsFailing", "StopRequested", "Verdict"]

log = logging.getLogger("p2p_diloco.guard")
T = TypeVar("T")


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived during the inner steps: the round is abandoned."""


class RoundsFailing(RuntimeError):
    """``swarm.max_failed_rounds`` rounds in a row failed; the message says why and what to try."""


@dataclass(frozen=True)
class Verdict:
    """What to do after a failed round."""

    failures: int  # failed rounds in a row, this one included
    nonfinite: int  # non-finite rounds in a row from this round's outer state (0 after an error)
    wait: float  # seconds before the next attempt
    rollback: bool  # take the last good state now
    give_up: bool  # checkpoint and exit


class RoundGuard:
    """The round-failure policy of a training peer (module doc); ``verdict`` alone is the pure part."""

    def __init__(
        self,
        sync: StateSync,
        rollback_after: int,
        max_failed: int,
        wait: Callable[[float], bool],
        fallback: Callable[[], OuterState | None] | None = None,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
    ) -> None:
        self.sync, self.rollback_after, self.max_failed = sync, rollback_after, max_failed
        self.wait, self.fallback = wait, fallback
        self.backoff, self.backoff_max = backoff, backoff_max
        self.failures = 0
        self.nonfinite = 0
        self._anchor: int | None = None  # StateSync.version of the state the non-finite rounds ran from
        self._failed_at = -1  # the round of the state the last failed round ran from
        self._owed = 0.0
        self._traced: set[type] = set()
        self.rollbacks = 0

    # ---------------------------------------------------------------- the policy
    def verdict(self, nonfinite: bool, anchor: int, at_round: int = 0) -> Verdict:
        """Count one failed round from the state ``anchor`` (a StateSync version; ``at_round`` its round) and say
        what follows."""
        self.failures += 1
        self._failed_at = at_round
        if nonfinite:
            self.nonfinite = self.nonfinite + 1 if anchor == self._anchor else 1
            self._anchor = anchor
        else:
            self.nonfinite, self._anchor = 0, None
        streak = self.nonfinite
        rollback = nonfinite and streak >= self.rollback_after
        if rollback:
            self.nonfinite = 0  # counted afresh from the state rolled back to (or again, if there was none)
        wait = 0.0 if self.failures == 1 else min(self.backoff_max, self.backoff * 2 ** (self.failures - 2))
        if rollback:
            wait = max(wait, min(self.backoff, self.backoff_max))
        return Verdict(self.failures, streak, wait, rollback, self.failures >= self.max_failed)

    def succeeded(self, at_round: int) -> None:
        """A round from a state at round ``at_round`` ran with a finite loss: the row of failures ends, unless that
        state is older than the one the last failure ran from (a replay after a rollback)."""
        self._owed = 0.0
        if at_round >= self._failed_at:
            self.failures, self.nonfinite, self._anchor, self._failed_at = 0, 0, None, -1

    # ---------------------------------------------------------------- around a round
    def pause(self) -> bool:
        """Wait what the last failure owes (interruptible); True when a stop was requested meanwhile."""
        owed, self._owed = self._owed, 0.0
        if owed <= 0:
            return False
        log.warning("waiting %.0fs before the next attempt (%d failed rounds in a row)", owed, self.failures)
        return bool(self.wait(owed))

    def run(self, round: int, attempt: Callable[[], T]) -> T | None:
        """``attempt()`` (one round, ``round`` = the outer step it would make) under the policy of the module doc."""
        anchor, at_round = self.sync.begin_round(), self.sync.worker.state.round
        try:
            result = attempt()
        except StopRequested:
            raise
        except (NonFiniteLossError, NonFiniteUpdateError) as exc:
            log.error("round %d discarded: %s", round, exc)
            self._failed(self.verdict(True, anchor, at_round), exc)
            return None
        except Exception as exc:  # noqa: BLE001 - any bug or surprise in a round: discard it, go on
            first = type(exc) not in self._traced
            self._traced.add(type(exc))
            log.error(
                "round %d discarded: unexpected %s: %s; the outer state is put back as the round found it%s",
                round,
                type(exc).__name__,
                exc,
                "" if first else " (traceback at debug level)",
                exc_info=exc if first else None,
            )
            log.debug("round %d: the traceback", round, exc_info=exc)
            self.sync.discard_round()
            self._failed(self.verdict(False, anchor, at_round), exc)
            return None
        self.sync.round_ran()
        self.succeeded(at_round)
        return result

    def _failed(self, verdict: Verdict, exc: Exception) -> None:
        if verdict.give_up:
            if verdict.nonfinite and not self.sync.worker.state.is_finite():
                self._roll_back(verdict.nonfinite)
            raise RoundsFailing(self._advice(verdict, exc))
        if verdict.rollback:
            self._roll_back(verdict.nonfinite)
        self._owed = verdict.wait

    def _roll_back(self, streak: int) -> None:
        worker = self.sync.worker
        here = worker.state.round, worker.state.checksum()
        if worker.inner.drop_nonfinite_state():
            log.warning("the inner optimizer's moments held NaN or inf: forgotten, they start afresh")
        target = self.sync.last_good()
        source = "the last state a round ran from with a finite loss"
        if target is None and self.fallback is not None:
            state = self.fallback()
            if state is not None and state.checksum() != here[1]:
                target, source = Offer(state, True), "the last checkpoint"
        if target is None:
            log.warning(
                "inner loss non-finite for %d rounds from round %d (checksum %s): no earlier good state to roll back "
                "to (no round ran with a finite loss, no other checkpoint); taking a peer's state if one is offered",
                streak,
                *here,
            )
            self.sync.download()
            return
        log.warning(
            "inner loss non-finite for %d rounds from round %d (checksum %s): rolling back to round %d (checksum %s), "
            "%s",
            streak,
            *here,
            target.state.round,
            target.tag.checksum,
            source,
        )
        self.sync.adopt(target, "roll back")
        self.rollbacks += 1

    def _advice(self, verdict: Verdict, exc: Exception) -> str:
        why = f"{verdict.failures} rounds in a row failed (swarm.max_failed_rounds={self.max_failed}); the last: "
        if isinstance(exc, NonFiniteLossError | NonFiniteUpdateError):
            return (
                why + f"{exc}. Rolling back to the last good outer state did not help: lower inner.lr (or outer.lr), "
                "check the data, or rejoin without --resume to download the swarm's state."
            )
        return (
            why + f"unexpected {type(exc).__name__}: {exc}. The log above holds its traceback; --resume continues "
            "from the checkpoint once the cause is fixed (please report it if it is a bug)."
        )

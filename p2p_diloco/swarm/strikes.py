"""Repeat offenders: a sender this member's reducer keeps dropping for pointing against the others is banned.

Inputs:  ``record(judged, dropped)`` once per all-reduce this member's reducer took part in: the senders whose parts
         it judged by direction (robust.py's floor: robust rules, 3 or more senders) and those it dropped in at
         least one part for a cosine below ``swarm.min_cosine``.
Output:  the senders dropped in ``limit`` judged all-reduces in a row, once each time they get there (the caller bans
         them: aggregate.py, for matchmaking.BAN_SECONDS, as a reducer caught lying).
State:   per sender, its drops in a row; a judged all-reduce without a drop clears it. A sender that is not judged
         (a round of 2, or not in our group) keeps its count.
Failure: none (pure bookkeeping).

Why in a row: one part of one round can point away by chance (an honest Δ is noisy: on tiny, by-label shards, the
lowest honest cosine to the median was 0.37, so not at 0 so far), a hostile sender does it every round; the floor has
already counted each dropped part 0, so the ban costs the attacker nothing it had and saves the swarm its parts.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["STRIKES_TO_BAN", "Strikes"]

STRIKES_TO_BAN = 3  # judged all-reduces in a row that dropped a sender before it is banned


class Strikes:
    """Drops in a row per sender (module doc)."""

    def __init__(self, limit: int = STRIKES_TO_BAN, me: str = ""):
        """``me``: our own peer id, never counted: our reducer judges our own part too, and a peer that banned itself
        would refuse every group it is in (seen: a late joiner whose fresh AdamW state made its own part point away
        in its own slice, in its first 3 rounds, left every later group of 3 incomplete)."""
        if limit < 1:
            raise ValueError(f"limit {limit} is invalid: must be >= 1")
        self.limit, self.me = limit, me
        self.in_a_row: dict[str, int] = {}

    def record(self, judged: Iterable[str], dropped: Iterable[str]) -> list[str]:
        """Count one all-reduce; the senders that reached ``limit`` (sorted), whose count starts again."""
        dropped = set(dropped) - {self.me}
        for peer in set(judged) - dropped:
            self.in_a_row.pop(peer, None)
        out = []
        for peer in sorted(dropped):
            self.in_a_row[peer] = self.in_a_row.get(peer, 0) + 1
            if self.in_a_row[peer] >= self.limit:
                out.append(peer)
                del self.in_a_row[peer]
        return out

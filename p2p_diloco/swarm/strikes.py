"""Repeat offenders: a sender this member's reducer keeps dropping for pointing against the others (or lying on one
side of them) is banned.

Inputs:  ``record(judged, dropped)`` once per all-reduce this member's reducer took part in: per sender, how many of
         its parts were judged against the senders' median (robust.py's floor and skew: robust rules, 3 or more
         senders) and how many it dropped for a cosine below ``swarm.min_cosine`` or a skew over ``swarm.max_skew``.
Output:  the senders struck in ``limit`` judged all-reduces in a row, once each time they get there (the caller bans
         them: aggregate.py, for matchmaking.BAN_SECONDS, as a reducer caught lying). A strike: more than half of the
         sender's judged parts dropped.
State:   per sender, its strikes in a row; a judged all-reduce without a strike clears it. A sender that is not
         judged (a round of 2, or not in our group) keeps its count. Our own parts never count (``me``).
Failure: none (pure bookkeeping).

Why in a row, and why more than half of the parts: an honest Δ is noisy, and with short rounds it is mostly noise.
Measured with H = 5 on tiny, 3 peers (tests/test_swarm.py's late joiner): honest senders' parts were dropped now and
then (1 to 3 parts of a round, in 3 rounds in a row at one reducer), and a strike per dropped part banned an honest
peer, which failed every later round of its groups. A sign-flipped Δ points away in nearly every part (73 of 80 on
tiny at H = 25); the floor has already counted each dropped part 0, so the ban costs the attacker nothing it had and
saves the swarm its parts.
"""

from __future__ import annotations

from collections.abc import Mapping

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

    def record(self, judged: Mapping[str, int], dropped: Mapping[str, int]) -> list[str]:
        """Count one all-reduce (parts judged and parts dropped, per sender); the senders that reached ``limit``
        (sorted), whose count starts again."""
        struck = {peer for peer, parts in dropped.items() if peer != self.me and 2 * parts > judged.get(peer, parts)}
        for peer in set(judged) - struck:
            self.in_a_row.pop(peer, None)
        out = []
        for peer in sorted(struck):
            self.in_a_row[peer] = self.in_a_row.get(peer, 0) + 1
            if self.in_a_row[peer] >= self.limit:
                out.append(peer)
                del self.in_a_row[peer]
        return out

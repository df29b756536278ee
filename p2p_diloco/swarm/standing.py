"""A peer's first-hand standing of the others: how many of its rounds counted a pseudo-gradient from each.

Inputs:  ``count(peers)`` after each round this peer applied from a complete group: the members whose Δ that round's
         mean counted (their payload at the group's state, tokens > 0, no part dropped by direction).
Output:  ``weight(peer)``: what a peer's vouch and its holding of a state weigh when this peer chooses a state to
         download (sync.Vouches): FRESH_WEIGHT for a key none of our rounds counted, growing linearly to 1 after
         MATURE_ROUNDS counted rounds. ``weights``: those of a read's peers; while no live peer is one our rounds
         counted (a newcomer, a peer that only ever trained alone, one whose mates all left while it was behind) every
         key weighs 1: we know no one there, so we can only count keys, as before standing existed, and a peer never
         stays locked out of a swarm made of strangers.
State:   rounds counted per peer id, in memory: a restarted peer starts again from knowing nobody.
Failure: none.

Why first-hand: a late joiner cannot tell honest peers from a clique of Sybil keys by anything they sign (each can
sign that the others trained), so standing is only what this peer's own rounds saw; a stranger earns it by sending
pseudo-gradients the group's reducers counted, round after round, which costs what honest training costs. The
weights are all multiples of 1/16, so their sums compare exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from p2p_diloco.protocol import GatherPayload

__all__ = ["FRESH_WEIGHT", "MATURE_ROUNDS", "Standing", "counted_members"]

FRESH_WEIGHT = 0.25  # what an unknown key weighs, once we know some peers
MATURE_ROUNDS = 4  # counted rounds after which a key weighs as much as any


class Standing:
    """Rounds counted per peer, as this peer's own rounds saw them (see the module docstring)."""

    def __init__(self) -> None:
        self.counted: dict[str, int] = {}

    def count(self, peers: Iterable[str]) -> None:
        """One more round counted a Δ from each of ``peers``."""
        for peer in peers:
            self.counted[peer] = self.counted.get(peer, 0) + 1

    def weight(self, peer: str) -> float:
        """``peer``'s weight in vouching and holding states: FRESH_WEIGHT, growing to 1 with the rounds we counted
        from it (MATURE_ROUNDS)."""
        rounds = min(self.counted.get(peer, 0), MATURE_ROUNDS)
        return FRESH_WEIGHT + (1.0 - FRESH_WEIGHT) * rounds / MATURE_ROUNDS

    def weights(self, peers: Iterable[str], live: Iterable[str]) -> dict[str, float]:
        """The weights of ``peers``: ``weight`` each while one of the ``live`` peers is one we counted, else 1."""
        known = any(self.counted.get(peer, 0) for peer in live)
        return {peer: self.weight(peer) if known else 1.0 for peer in peers}


def counted_members(payloads: Mapping[str, GatherPayload], me: str, dropped: Mapping[str, int]) -> list[str]:
    """The members of a complete round that we applied whose Δ its mean counted: at our state (the group's), with
    tokens, and no part of it dropped by direction (``dropped``: ReduceInfo.dropped); not us."""
    ours = payloads.get(me)
    if ours is None:
        return []
    return sorted(
        peer
        for peer, payload in payloads.items()
        if peer != me and payload.tag == ours.tag and payload.tokens > 0 and peer not in dropped
    )

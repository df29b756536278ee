"""A peer's first-hand standing of the others: whom it has averaged with.

Inputs:  ``count(peers)`` after each complete all-reduce this peer took part in (the averager's ``averaged_with`` hook,
         before the round's result is settled): ``counted_members`` of its payloads, the members other than us
         that declared tokens and that our reducer did not drop by direction.
Output:  ``weight(peer)``: what a peer's vouch and its holding of a state weigh when this peer chooses a state to
         download (vouches.py): 1 for a key we have averaged with, FRESH_WEIGHT for a stranger. ``weights``: those of
         a read's peers; while no live peer is one we have averaged with (a newcomer, a peer that only ever trained
         alone, one whose mates all left while it was behind) every key weighs 1: we know no one there, so we can only
         count keys, as before standing existed, and a peer never stays locked out of a swarm of strangers.
State:   the peer ids we have completed an all-reduce with, in memory: a restarted peer starts again from knowing
         nobody.
Failure: none.

Why first-hand: a newcomer cannot tell honest peers from a clique of Sybil keys by anything they sign (each can sign
that the others trained), so standing is only what this peer's own all-reduces saw. A key earns it by completing an
all-reduce with us, its Δ within the norm bound and the direction floor: cheap keys that only announce and vouch
stay strangers. Why not a weight that grows over several rounds (tried first: 1/4, growing to 1 after 4 counted
rounds): the two halves of a split are strangers to each other, and after the round that brought them into one
group, the smaller half weighed the larger half's fresh keys below its own and refused its state; measured, the
end of a run split 2 and 2 stayed on 2 states (tests/test_scale_smoke.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from p2p_diloco.protocol import GatherPayload

__all__ = ["FRESH_WEIGHT", "Standing", "counted_members"]

FRESH_WEIGHT = 0.25  # what a stranger's key weighs, once we have averaged with some live peer


class Standing:
    """The peers we have averaged with, as this peer's own all-reduces saw them (see the module docstring)."""

    def __init__(self) -> None:
        self.known: set[str] = set()

    def count(self, peers: Iterable[str]) -> None:
        """A complete all-reduce counted a Δ from each of ``peers``."""
        self.known.update(peers)

    def weight(self, peer: str) -> float:
        """``peer``'s weight in vouching and holding states: 1 if we have averaged with it, else FRESH_WEIGHT."""
        return 1.0 if peer in self.known else FRESH_WEIGHT

    def weights(self, peers: Iterable[str], live: Iterable[str]) -> dict[str, float]:
        """The weights of ``peers``: ``weight`` each while one of the ``live`` peers is one we averaged with, else 1."""
        anyone = not self.known.isdisjoint(live)
        return {peer: self.weight(peer) if anyone else 1.0 for peer in peers}


def counted_members(payloads: Mapping[str, GatherPayload], me: str, dropped: Mapping[str, int]) -> list[str]:
    """The members of a complete all-reduce whose Δ it counted: with tokens, and no part of it dropped by direction
    by our reducer (``dropped``: ReduceInfo.dropped); not us. Whatever state they were at: a split's two halves that
    meet in one group know each other from then on, and the smaller one takes the larger one's state."""
    return sorted(
        peer for peer, payload in payloads.items() if peer != me and payload.tokens > 0 and peer not in dropped
    )

"""Which outer states the swarm offers a peer to download, from what the run's signed announcements say: pure.

Inputs:  ``Vouches``, built by announcements.py from one read of the run's announcements: per (round, checksum) tag
         the peers that vouch for it (held it in one of their recent rounds) and the peers that hold it now, the live
         peers, each peer's standing in the reader's eyes (standing.py) and the reader's own recent tags.
Output:  ``offers(quorum, mine)``: (tag, donors) for each state the swarm offers, the furthest round first;
         ``refusals``: why each other held state is not offered (logged by sync.py before a download); ``kin``.
State:   none beyond the dataclass's fields: a snapshot of one read.
Failure: nothing raises; a tag too few vouch for, or that a minority holds, is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.lineage import connected

__all__ = ["Vouches"]


@dataclass
class Vouches:
    """What the run's signed announcements say about outer states (swarm/announcements.py builds it).

    ``vouchers[tag]``: the peers that held ``tag`` in one of their recent rounds; ``holders[tag]``: the peers that
    hold it now (the donors to try for it); ``live``: the peers of the run that are still about (self excluded; a
    peer that left still vouches, but is none of the peers "there are"); ``weights``: each peer's standing in the
    reader's eyes (standing.py; 1 when missing); ``own``: the reader's recent tags, the last the state it holds ([]
    for a reader that holds none: the monitor).

    A state is offered when (1) the standing of the peers that vouch for it reaches ``swarm.state_quorum`` (or the
    standing of all live peers, when less), and (2) it is held, or was passed through, by live peers of at least
    half the standing of the run (the reader included, for the states it held), or by as much as any other trained
    state held now (a split's lineages as large as the largest) while its kin weigh as much as any other kin.
    (2) is what keeps a minority of keys from planting a state: they can vouch for anything, and sign any history,
    but cannot make the honest peers hold it.
    Kin: the live peers (and the reader) linked by a trained state that their recent states share (``kin``). A
    round that failed in part leaves its honest members on sibling states, each held by few; kin count them as one:
    measured in CI, 3 honest peers on 2 siblings held by 2 and 1, and 2 Sybil keys (weighing 1 to the honest ones
    after one round together, and to a newcomer) holding a bogus state at round 10**6: the bogus state tied the
    larger sibling, won as the furthest, and a late joiner and an honest peer took it. Sharing a history is cheap
    (Sybils may sign the honest tags), so kin only ever refuse a state, never offer one.
    """

    vouchers: dict[RoundTag, set[str]] = field(default_factory=dict)
    holders: dict[RoundTag, list[str]] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=dict)
    own: list[RoundTag] = field(default_factory=list)

    @property
    def peers(self) -> int:
        """How many other peers of the run are about."""
        return len(self.live)

    def standing(self, peers: Iterable[str], weighed: bool = True) -> float:
        """The peers' standing (``weighed`` False: their number)."""
        return sum(self.weights.get(peer, 1.0) for peer in peers) if weighed else float(len(set(peers)))

    def quorum(self, wanted: int, weighed: bool = True) -> float:
        """``swarm.state_quorum``, or the standing of all the live peers there are when less (1 when none)."""
        there = self.standing(self.live, weighed)
        return min(float(wanted), there) if there > 0 else 1.0

    def support(self, tag: RoundTag) -> float:
        """The standing of the live peers whose recent states hold ``tag``, and the reader's (1) if its own do."""
        held = self.standing(peer for peer in self.vouchers.get(tag, ()) if peer in self.live)
        return held + (1.0 if tag in self.own else 0.0)

    def offers(self, wanted: int, mine: RoundTag | None, by_standing: bool = True) -> list[tuple[RoundTag, list[str]]]:
        """(tag, donors) for every state some peer holds that the swarm offers (see the class docstring), or that is
        our own, the furthest round first. Any other tag is left out, whatever round it claims. ``by_standing``
        False: (1) counts keys, and (2) does not apply: a split's canonical lineage, which membership.py chose by
        lineage.py's rule, counting keys alike on every peer (the other half's peers are strangers to us: by
        standing, they could never vouch for the state we must take)."""
        refused = self.refusals(wanted, mine, by_standing)
        offered = [(tag, donors) for tag, donors in self.holders.items() if donors and tag not in refused]
        return sorted(offered, key=lambda item: (-item[0].round, item[0].checksum))

    def refusals(self, wanted: int, mine: RoundTag | None, by_standing: bool = True) -> dict[RoundTag, str]:
        """Why each tag some peer holds is not offered (a faulty or lying peer, or a minority's state)."""
        quorum, out = self.quorum(wanted, by_standing), {}
        # the trained states peers hold now (an older one's support holds theirs; round 0, the seed, is what every
        # newcomer holds until its download: 4 newcomers at once outweighed the 2 peers of the swarm, measured)
        support = {tag: self.support(tag) for tag in set(self.holders) | set(self.own[-1:])}
        best = max((tag for tag in support if tag.round > 0), key=lambda tag: (support[tag], tag.round), default=None)
        half = 0.5 * (self.standing(self.live) + (1.0 if self.own else 0.0))
        kin = self.kin() if by_standing else {}
        kin_best = max(kin.values(), default=0.0)
        for tag in self.holders:
            if tag == mine:
                continue
            vouched = self.standing(self.vouchers.get(tag, ()), by_standing)
            if vouched < quorum:
                out[tag] = f"fewer than {quorum:g} peers vouch for it (their standing: {vouched:g})"
                continue
            if not by_standing or support[tag] >= half or best is None:
                continue
            few = f"too few of the run's peers hold it or held it (standing {support[tag]:g} of {2 * half:g}; "
            if support[tag] < support[best]:
                out[tag] = few + f"{best} has {support[best]:g})"
            elif tag.round > 0 and kin.get(tag, 0.0) < kin_best:
                out[tag] = few + f"its kin {kin.get(tag, 0.0):g}, other peers' kin {kin_best:g})"
        return out

    def kin(self) -> dict[RoundTag, float]:
        """For each trained state some live peer holds (or the reader does), the standing of its kin: the live peers,
        and the reader (1), linked to its holders through trained states that their recent states share."""
        me = ""  # the reader (no peer id is empty)
        links = [
            [peer for peer in vouchers if peer in self.live] + ([me] if tag in self.own else [])
            for tag, vouchers in self.vouchers.items()
            if tag.round > 0
        ]
        root = connected([*self.live, *([me] if self.own else [])], links)
        weight: dict[str, float] = {}
        for peer, family in root.items():
            weight[family] = weight.get(family, 0.0) + (1.0 if peer == me else self.standing([peer]))
        held = {tag: root[donors[0]] for tag, donors in self.holders.items() if donors and tag.round > 0}
        if self.own and self.own[-1].round > 0:
            held[self.own[-1]] = root[me]
        return {tag: weight[family] for tag, family in held.items()}

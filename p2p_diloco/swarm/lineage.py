"""Which lineage of the outer state a split swarm should keep: pure, from the tags peers announce.

Inputs:  each peer's recent tags, oldest first, the last one the state it holds now (announcements.py reads them
         from the signed announcements of the live peers with our settings, ours included).
Output:  ``lineages``: the peers grouped by lineage, with every tag their histories hold; ``canonical``: the lineage
         to keep (its peers and tags), or None when there is none (a lineage apart from every other is never kept);
         ``connected``: the union-find both this and vouches.Vouches.kin group peers with.
State:   none.
Failure: none: empty input gives no lineage.

Two peers are on one lineage when the state one holds is among the other's recent tags (one is some rounds behind
the other on the same history). Groups that formed apart from one state (a split) make lineages that share no recent
tag. Canonical: the lineage the most peers hold; between lineages as many hold, the one whose state at the latest
round all of them reached has the smallest checksum, which every peer reading the same announcements picks alike; a
lineage with no state at that round (it skipped past it: two bogus keys announcing round 10**6 and nothing before)
loses the tie. Before, such a tie gave no canonical lineage: in a CI run 2 Sybil keys, each in one group of a last
round that split 3 + 2, tied the larger half's 2 honest keys and kept the split from healing. It counts peers' keys,
not the standing the swarm observed from them: docs/trust.md says what that allows.

Halves of a split both hold the rounds since it (each peer vouches for its last 8 states), so their recent rounds
overlap. A lineage whose recent rounds overlap no other lineage's is no half of a split but a peer far behind (a
stale checkpoint, a joiner's seed) or a claim far ahead, and is never canonical: the far-behind catch up by download
(announcements.py's ``ahead``, the group's majority). Before, one peer announcing the seed while it joined tied a
lone peer at round 15 (its history held no round 0), won the tie, and that peer moved to the seed state (seen in a
test's log); 3 such joiners would have outnumbered 2 trained peers.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2p_diloco.protocol import RoundTag

__all__ = ["Lineage", "canonical", "connected", "lineages"]

Lineage = tuple[set[str], set[RoundTag]]  # its peers, every tag in their histories


def lineages(histories: dict[str, list[RoundTag]]) -> list[Lineage]:
    """The peers of ``histories`` (peer -> its recent tags, the last the state it holds; none empty) by lineage."""
    peers = list(histories)
    links = [
        (a, b)
        for i, a in enumerate(peers)
        for b in peers[i + 1 :]
        if histories[a][-1] in histories[b] or histories[b][-1] in histories[a]
    ]
    root = connected(peers, links)
    out: dict[str, Lineage] = {}
    for peer in peers:
        members, tags = out.setdefault(root[peer], (set(), set()))
        members.add(peer)
        tags.update(histories[peer])
    return list(out.values())


def connected(items: Iterable[str], links: Iterable[Iterable[str]]) -> dict[str, str]:
    """Each of ``items`` (and each item of a link) -> the one representative of every item linked to it, directly or
    through others: the items of one link are linked to each other."""
    root = {item: item for item in items}

    def find(item: str) -> str:
        root.setdefault(item, item)
        while root[item] != item:
            root[item] = root[root[item]]
            item = root[item]
        return item

    for link in links:
        first = None
        for item in link:
            first = find(item) if first is None else first
            root[find(item)] = first
    return {item: find(item) for item in list(root)}


def canonical(histories: dict[str, list[RoundTag]]) -> Lineage | None:
    """The lineage to keep among those of ``histories`` (see the module docstring); None when there is none."""
    found = lineages({peer: tags for peer, tags in histories.items() if tags})
    if len(found) > 1:
        found = [one for one in found if any(_overlap(one[1], other[1]) for other in found if other is not one)]
    if not found:
        return None
    most = max(len(members) for members, _ in found)
    tied = [lineage for lineage in found if len(lineage[0]) == most]
    if len(tied) == 1:
        return tied[0]
    common = min(max(tag.round for tag in tags) for _, tags in tied)
    at_common = [(checksum, lineage) for lineage in tied if (checksum := _smallest_checksum(lineage[1], common))]
    return min(at_common, key=lambda item: item[0])[1]  # the lineage whose newest round is ``common`` has one


def _overlap(tags: set[RoundTag], others: set[RoundTag]) -> bool:
    """Whether the rounds of ``tags`` and of ``others`` overlap (each from its oldest to its newest)."""
    rounds, other_rounds = [tag.round for tag in tags], [tag.round for tag in others]
    return min(rounds) <= max(other_rounds) and min(other_rounds) <= max(rounds)


def _smallest_checksum(tags: set[RoundTag], at_round: int) -> str | None:
    """The smallest checksum among ``tags`` at ``at_round``; None when there is none."""
    return min((tag.checksum for tag in tags if tag.round == at_round), default=None)

"""swarm/lineage.py: peers on one history whatever their phase, a split's lineages, and which one is kept."""

from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.lineage import canonical, lineages

S0 = RoundTag(0, "0" * 16)
A1, A2 = RoundTag(1, "a" * 16), RoundTag(2, "a" * 16)
B1, B2 = RoundTag(1, "b" * 16), RoundTag(2, "b" * 16)
C1 = RoundTag(1, "c" * 16)


def test_peers_on_one_history_are_one_lineage_whatever_their_phase():
    found = lineages(
        {
            "ahead": [S0, A1, A2],
            "behind": [S0, A1],  # a round behind on the same history
            "split": [S0, B1, B2],
            "split_behind": [S0, B1],
            "alone": [S0, C1],  # a local step: a lineage of its own
        }
    )
    by_lineage = sorted(sorted(members) for members, _ in found)
    assert by_lineage == [["ahead", "behind"], ["alone"], ["split", "split_behind"]]
    assert next(tags for members, tags in found if "split" in members) == {S0, B1, B2}
    assert len(lineages({"p": [S0], "q": [S0]})) == 1
    assert lineages({}) == []


def test_the_lineage_more_peers_hold_is_kept_and_a_tie_goes_to_the_smaller_checksum():
    assert canonical({"p": [S0, A1], "q": [S0, B1], "r": [S0, B1, B2]})[0] == {"q", "r"}
    assert canonical({"p": [S0, A1, A2], "q": [S0, B1]})[0] == {"p"}  # 1 and 1: a1 < b1 at round 1, both reached it
    assert canonical({"p": [S0, B1, B2], "q": [S0, A1]})[0] == {"q"}  # whatever the order and the phase
    A3 = RoundTag(3, "a" * 16)
    assert canonical({"p": [A1, A3], "q": [B1, B2]})[0] == {"q"}  # p's history holds no round-2 tag: it loses the tie
    bogus = RoundTag(10**6, "0" * 16)  # 2 keys announcing a far-ahead state alone tie the honest halves' 2 keys
    split = {"a": [A1, A2], "b": [A1, A2], "c": [A1, B2], "s1": [bogus], "s2": [bogus]}
    assert canonical(split)[0] == {"a", "b"}
    assert canonical({"p": []}) is None and canonical({}) is None


def test_a_lineage_apart_from_every_other_is_never_kept():
    """A peer far behind (a joiner announcing the seed, a stale checkpoint) or a claim far ahead is no half of a split:
    however many keys hold it, nobody moves to it. Before, a joiner's seed tied a lone peer at round 15 and won."""
    trained = [RoundTag(r, f"{r:016x}") for r in range(8, 16)]  # a peer's last 8 states
    assert canonical({"p": trained, "joiner": [S0]}) is None
    assert canonical({"p": trained, **{f"j{k}": [S0] for k in range(3)}}) is None  # 3 joiners, 1 trained: still none
    stale = [RoundTag(r, "5" * 16) for r in range(1, 7)]
    assert canonical({"p": trained, "q": trained, "stale": stale}) is None  # it catches up by download (ahead)
    split = {"p": trained, "q": [*trained[:-1], RoundTag(15, "0" * 16)], "stale": stale, "r": stale}
    assert canonical(split)[0] == {"q"}  # the split's halves tie (1 and 1): the smaller checksum at 15; stale is out
    bogus = RoundTag(10**6, "0" * 16)
    assert canonical({"p": trained, "s1": [bogus], "s2": [bogus], "s3": [bogus]}) is None
    # halves of a real split overlap, however short one's history: the one that just healed vouches for one state
    assert canonical({"p": trained, "healed": [RoundTag(15, "0" * 16)]})[0] == {"healed"}

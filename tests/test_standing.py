"""Standing (swarm/standing.py) and what it weighs in choosing a state to download (vouches.Vouches), pure."""

from __future__ import annotations

from p2p_diloco.protocol import GatherPayload, RoundTag
from p2p_diloco.swarm.standing import FRESH_WEIGHT, Standing, counted_members
from p2p_diloco.swarm.vouches import Vouches

T0, T1, T2, T3 = (RoundTag(r, f"{r:016x}") for r in range(4))
BOGUS = RoundTag(10**6, "b" * 16)


def vouches(holding: dict[str, list[RoundTag]], weights: dict[str, float] | None = None, own=()) -> Vouches:
    """Live peers -> their recent tags (the last the one they hold)."""
    out = Vouches(live=set(holding), weights=dict(weights or {}), own=list(own))
    for peer, tags in holding.items():
        for tag in tags:
            out.vouchers.setdefault(tag, set()).add(peer)
        out.holders.setdefault(tags[-1], []).append(peer)
    return out


def offered(v: Vouches, mine: RoundTag | None = None, quorum: int = 2) -> list[RoundTag]:
    return [tag for tag, _ in v.offers(quorum, mine)]


def test_a_stranger_weighs_little_once_we_averaged_with_a_live_peer_and_everyone_weighs_one_before():
    standing = Standing()
    assert standing.weights(["stranger"], live=["stranger"]) == {"stranger": 1.0}  # we know nobody: count keys
    standing.count(["a"])
    assert standing.weights(["stranger", "a"], live=["stranger", "a"]) == {"stranger": FRESH_WEIGHT, "a": 1.0}
    assert standing.weights(["stranger", "a"], live=["stranger"]) == {"stranger": 1.0, "a": 1.0}  # "a" left
    assert (FRESH_WEIGHT * 16).is_integer()  # sums of weights compare exactly


def test_every_member_whose_delta_the_mean_counted_earns_standing_whatever_its_state():
    at, behind = RoundTag(5, "a" * 16), RoundTag(4, "c" * 16)
    payloads = {
        "me": GatherPayload(at, 100),
        "honest": GatherPayload(at, 100),
        "other_half": GatherPayload(behind, 100),  # a split's other half, met in one group: known from now on
        "idle": GatherPayload(at, 0),  # no tokens
        "flipped": GatherPayload(at, 100),  # dropped by direction in some part
    }
    assert counted_members(payloads, "me", {"flipped": 2}) == ["honest", "other_half"]


def test_two_sybil_keys_cannot_plant_a_far_ahead_state_on_a_newcomer():
    """3 honest peers and 2 keys of one person vouching for a bogus state they hold: the quorum (2) is met, but the
    state is held by 2 of 5 keys; the newcomer (no standing known: every key weighs 1) takes the honest state."""
    honest = {p: [T0, T1, T2] for p in ("a", "b", "c")}
    v = vouches({**honest, "s1": [T0, T1, BOGUS], "s2": [T0, T1, BOGUS]})  # a history of honest tags costs nothing
    assert offered(v) == [T2]
    assert "too few of the run's peers" in v.refusals(2, None)[BOGUS]
    # the rule before standing: the furthest state with 2 vouchers
    assert max((tag for tag, who in v.vouchers.items() if len(who) >= 2), key=lambda t: t.round) == BOGUS


def test_honest_peers_on_sibling_states_after_a_partial_failure_still_outweigh_two_sybil_keys():
    """CI (stop 44): round 4 failed in part, leaving the 3 honest peers on two siblings of round 3's state, held by 2
    and 1; 2 Sybil keys that had just completed that round with them (weight 1 each) held a bogus state at round
    10**6. It tied the larger sibling, was offered as the furthest, and an honest peer and a late joiner took it.
    The honest peers' kin (linked through round 3) weigh 3 against the Sybils' 2: refused, to each honest peer and to
    a newcomer. Sybils that sign the honest history join the honest kin, so kin never offer what support refuses."""
    big, small = RoundTag(4, "d" * 16), RoundTag(4, "e" * 16)
    sybils = {"s1": [BOGUS], "s2": [BOGUS]}
    honest = {"a": [T2, T3, big], "b": [T2, T3, small], "c": [T2, T3, big]}
    newcomer = vouches(honest | sybils)
    assert BOGUS not in offered(newcomer) and big in offered(newcomer)
    assert "its kin 2, other peers' kin 3" in newcomer.refusals(2, None)[BOGUS]
    known = Standing()
    known.count(["a", "b", "c", "s1", "s2"])  # one complete round together (the reader itself is not read)
    for reader in ("a", "b"):  # on the larger sibling, on the smaller one
        holding = {peer: tags for peer, tags in honest.items() if peer != reader} | sybils
        v = vouches(holding, known.weights(holding, live=holding), own=honest[reader])
        assert BOGUS not in offered(v, mine=honest[reader][-1]), (reader, v.refusals(2, honest[reader][-1]))
    # the rule without kin: the bogus state ties the larger sibling and is offered first
    v = vouches(honest | sybils)
    assert v.support(BOGUS) == v.support(big) == 2.0
    # Sybils that sign the honest history are kin too: refused as before, by support (2 against 3 on one state)
    faked = {s: [T2, T3, BOGUS] for s in sybils}
    assert offered(vouches({p: [T2, T3, big] for p in "abc"} | faked)) == [big]


def test_a_peer_that_knows_the_honest_ones_refuses_as_many_fresh_keys_as_there_are_honest_peers():
    """Half of the keys are Sybils: a newcomer cannot tell (a tie: it may take either), a peer whose rounds counted
    the honest ones weighs the fresh keys at FRESH_WEIGHT each, too little to vouch, and keeps the honest state."""
    holding = {**{p: [T1, T2] for p in ("a", "b", "c")}, **{s: [T1, BOGUS] for s in ("s1", "s2", "s3")}}
    assert BOGUS in offered(vouches(holding))
    veteran = Standing()
    veteran.count(["a", "b", "c"])
    v = vouches(holding, veteran.weights(holding, live=holding), own=[T1])
    assert offered(v, mine=T1) == [T2]
    assert "their standing: 0.75" in v.refusals(2, T1)[BOGUS]  # 3 fresh keys vouch less than the quorum of 2


def test_a_peer_whose_mates_all_left_while_it_was_behind_follows_the_strangers_that_hold_the_run():
    """Every peer our rounds counted left while we were behind; 3 new keys hold the run's state. We know no one
    there, so keys count as they did before standing, and we follow them (weighed as fresh keys against our own
    state, we would stay locked out: nobody counts our stale Δ, so they would never earn standing with us)."""
    veteran = Standing()
    veteran.count(["old1", "old2"])
    holding = {p: [T2, T3] for p in ("new1", "new2", "new3")}
    assert offered(vouches(holding, veteran.weights(holding, live=holding), own=[T0, T1]), mine=T1) == [T3]
    fresh = {p: veteran.weight(p) for p in holding}
    assert offered(vouches(holding, fresh, own=[T0, T1]), mine=T1) == []


def test_a_split_offers_the_lineages_most_peers_hold_and_not_a_smaller_one():
    left, right = RoundTag(3, "1" * 16), RoundTag(3, "2" * 16)
    small = RoundTag(4, "3" * 16)
    holding = {
        **{p: [T1, T2, left] for p in ("a", "b", "c")},
        **{p: [T1, T2, right] for p in ("d", "e", "f")},
        **{p: [RoundTag(3, "4" * 16), small] for p in ("g", "h")},  # furthest, but held by fewest
    }
    got = offered(vouches(holding))
    assert small not in got and {left, right} <= set(got)


def test_a_state_half_the_run_holds_is_offered_while_the_rest_finish_their_round():
    v = vouches({"a": [T1, T2], "b": [T1, T2], "c": [T1], "d": [T1]})
    assert offered(v) == [T2, T1]
    v = vouches({"a": [T1, T2], "b": [T1], "c": [T1]})  # one of three ahead: the others' state, until they follow
    assert offered(v) == [T1]


def test_the_smaller_half_of_a_split_takes_the_larger_ones_state_once_they_met_in_a_group():
    """A round brought both halves into one group: we counted the other half's members, so they weigh as ours,
    and their state (held by 3 against our 2) is offered for the resync the round's vote asked for."""
    ours, theirs = RoundTag(2, "a" * 16), RoundTag(2, "b" * 16)
    holding = {"a2": [T1, ours], "b1": [T1, theirs], "b2": [T1, theirs], "b3": [T1, theirs]}
    met = Standing()
    met.count(["a2", "b1", "b2", "b3"])
    assert offered(vouches(holding, met.weights(holding, live=holding), own=[T1, ours]), mine=ours) == [ours, theirs]
    before = Standing()  # not met yet: strangers, and our half holds more standing
    before.count(["a2"])
    assert offered(vouches(holding, before.weights(holding, live=holding), own=[T1, ours]), mine=ours) == [ours]


def test_newcomers_still_at_the_seed_do_not_outweigh_the_swarm_they_join():
    """4 newcomers at once announce the seed (round 0) until their downloads end; the 2 peers of the swarm hold
    round 10: the seed is no trained state competing with it (measured: one newcomer started from the seed)."""
    seed, trained = RoundTag(0, "e" * 16), RoundTag(10, "1" * 16)
    holding = {"a": [trained], "b": [trained], **{f"new{k}": [seed] for k in range(3)}}
    assert offered(vouches(holding, own=[seed]), mine=seed) == [trained, seed]
    # and a peer of the swarm reads them without fault (the seed is no state it wants, but it is offered)
    assert offered(vouches({k: v for k, v in holding.items() if k != "a"}, own=[trained]), mine=trained)[0] == trained

"""protocol.decide as a table of cases, and the gather payload schema (what the network may send instead)."""

from __future__ import annotations

import pytest

from p2p_diloco.protocol import (
    GATHER_VERSION,
    Action,
    Gathered,
    GatherPayload,
    RoundRules,
    RoundTag,
    decide,
    majority_tag,
    split_groups,
)

A5, B5, A6 = RoundTag(5, "aaaa"), RoundTag(5, "bbbb"), RoundTag(6, "aaaa")
A4, A3 = RoundTag(4, "aaaa"), RoundTag(3, "aaaa")
GARBAGE = ["x", 17, None, {"v": GATHER_VERSION, "round": -1, "checksum": "a", "tokens": 1}]


def group(*tags: RoundTag, garbage: int = 0) -> Gathered:
    """Member 0 is this peer; ``garbage`` more members sent payloads that do not parse."""
    raw: dict = {f"p{k}": GatherPayload(tag, 100).to_wire() for k, tag in enumerate(tags)}
    raw.update({f"g{k}": GARBAGE[k % len(GARBAGE)] for k in range(garbage)})
    return Gathered.parse(raw)


LOCAL, WAIT = RoundRules(1, "local"), RoundRules(1, "wait")
STRICT = RoundRules(0, "local")

# (case, this peer's tag, the group's tags (this peer's first), complete, rules, action, counts, majority)
CASES = [
    ("all agree", A5, group(A5, A5, A5), True, LOCAL, Action.APPLY, True, A5),
    ("a group of one (the simulator)", A5, group(A5), True, LOCAL, Action.APPLY, True, A5),
    ("lone peer, alone_policy local", A5, group(A5), False, LOCAL, Action.LOCAL_STEP, True, None),
    ("lone peer, alone_policy wait", A5, group(A5), False, WAIT, Action.DISCARD, False, None),
    ("incomplete all-reduce, local", A5, group(A5, A5, A5), False, LOCAL, Action.LOCAL_STEP, True, None),
    ("incomplete all-reduce, wait", A5, group(A5, A5, A5), False, WAIT, Action.DISCARD, False, None),
    ("one behind", A4, group(A4, A5, A5), True, LOCAL, Action.CATCH_UP, True, A5),
    ("one behind, max_staleness 0", A4, group(A4, A5, A5), True, STRICT, Action.RESYNC, False, A5),
    ("two behind", A3, group(A3, A5, A5), True, LOCAL, Action.RESYNC, False, A5),
    ("two behind, max_staleness 2", A3, group(A3, A5, A5), True, RoundRules(2), Action.CATCH_UP, True, A5),
    (
        "three behind, max_staleness 2",
        RoundTag(2, "a"),
        group(RoundTag(2, "a"), A5, A5),
        True,
        RoundRules(2),
        Action.RESYNC,
        False,
        A5,
    ),
    ("ahead of the group", A6, group(A6, A5, A5), True, LOCAL, Action.RESYNC, False, A5),
    ("diverged at the same round", B5, group(B5, A5, A5), True, LOCAL, Action.RESYNC, False, A5),
    ("in the majority, one member behind", A5, group(A5, A5, A4), True, LOCAL, Action.APPLY, True, A5),
    ("tie of one round: the smaller checksum wins", B5, group(B5, A5), True, LOCAL, Action.RESYNC, False, A5),
    ("tie, the other side", A5, group(A5, B5), True, LOCAL, Action.APPLY, True, A5),
    ("tie across rounds: one behind, catches up", A4, group(A4, A5), True, LOCAL, Action.CATCH_UP, True, A5),
    ("tie across rounds: the one in sync applies", A5, group(A5, A4), True, LOCAL, Action.APPLY, True, A5),
    ("tie across rounds, max_staleness 0: resync", A4, group(A4, A5), True, STRICT, Action.RESYNC, False, A5),
    (
        "tie of a pair with one behind and one diverged",
        A4,
        group(A4, A5, B5),
        True,
        LOCAL,
        Action.LOCAL_STEP,
        False,
        None,
    ),
    (
        "tie: a far-ahead claim wins nothing",
        A5,
        group(A5, RoundTag(10**6, "f")),
        True,
        LOCAL,
        Action.LOCAL_STEP,
        False,
        None,
    ),
    ("tie of two pairs, alone_policy wait", A5, group(A5, A5, B5, B5), True, WAIT, Action.APPLY, True, A5),
    ("tie of two pairs, the other pair", B5, group(A5, A5, B5, B5), True, WAIT, Action.RESYNC, False, A5),
    ("a majority beside a tie of the rest", A5, group(A5, A5, B5, A4), True, LOCAL, Action.APPLY, True, A5),
    ("malformed payloads do not vote", A4, group(A4, A5, A5, garbage=3), True, LOCAL, Action.CATCH_UP, True, A5),
    ("malformed outvoting nobody", A5, group(A5, garbage=4), True, LOCAL, Action.APPLY, True, A5),
]


@pytest.mark.parametrize(("mine", "gathered", "complete", "rules", "action", "counts", "majority"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_decide(mine, gathered, complete, rules, action, counts, majority):
    decision = decide(mine, gathered, complete, rules)
    assert (decision.action, decision.counts, decision.majority) == (action, counts, majority), decision
    assert decision.reason


def test_every_member_of_a_group_decides_consistently():
    """The same gathered payloads give each member its own action, and all agree on the majority."""
    gathered = group(A5, A5, A4, A3, B5)
    decisions = {p.tag: decide(p.tag, gathered, True, LOCAL) for p in gathered.payloads.values()}
    assert {d.majority for d in decisions.values()} == {A5}
    assert {t: d.action for t, d in decisions.items()} == {
        A5: Action.APPLY,
        A4: Action.CATCH_UP,
        A3: Action.RESYNC,
        B5: Action.RESYNC,
    }
    assert decisions[A5].out_of_sync == 3


def test_a_peer_the_swarm_left_behind_resyncs_and_one_within_max_staleness_does_not():
    """``ahead`` (the swarm's state, read before looking for a group): past max_staleness the round resyncs with
    the reason; within it, or when the reduce was complete anyway, the usual rules decide."""
    behind = decide(A4, group(A4), False, STRICT, ahead=A5)
    assert (behind.action, behind.counts, behind.majority) == (Action.RESYNC, False, A5), behind
    assert "the swarm holds round 5 (aaaa), 1 round(s) past this peer's (round 4 (aaaa))" in behind.reason
    assert decide(A3, group(A3), False, LOCAL, ahead=A5).action is Action.RESYNC
    assert decide(A4, group(A4), False, LOCAL, ahead=A5).action is Action.LOCAL_STEP  # its Δ may still count
    assert decide(A4, group(A4), False, RoundRules(1, "wait"), ahead=A5).action is Action.DISCARD
    assert decide(A5, group(A5, A5), True, STRICT, ahead=A6).action is Action.APPLY  # a group formed: it decides


def test_reasons_name_what_happened():
    assert "2 round(s) behind" in decide(A3, group(A3, A5, A5), True, LOCAL).reason
    assert "ahead" in decide(A6, group(A6, A5, A5), True, LOCAL).reason
    assert "diverged" in decide(B5, group(B5, A5, A5), True, LOCAL).reason
    assert "3 malformed" in decide(A5, group(A5, A5, garbage=3), True, LOCAL).reason
    assert "alone_policy=wait" in decide(A5, group(A5), False, WAIT).reason


def test_majority_needs_a_valid_payload_and_no_tie():
    assert majority_tag(group(garbage=3)) is None
    assert majority_tag(group(A5, B5, A5)) == A5
    assert majority_tag(group(A5, B5)) == A5 == majority_tag(group(B5, A5))  # one round: the smaller checksum
    assert majority_tag(group(A5, RoundTag(5 + 9, "0000"))) is None  # a far-ahead claim in a tie wins nothing
    assert decide(A5, group(garbage=3), True, LOCAL).action is Action.APPLY  # nobody to disagree with


@pytest.mark.parametrize(
    "raw",
    [
        None,
        7,
        "round 5",
        [5, "aaaa"],
        {"state": [5, "aaaa"], "tokens": 10},  # the version-1 payload of earlier releases
        {"v": GATHER_VERSION + 1, "round": 5, "checksum": "aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": 5, "checksum": "aaaa"},
        {"v": GATHER_VERSION, "round": 5, "checksum": "aaaa", "tokens": 10, "extra": 1},
        {"v": GATHER_VERSION, "round": True, "checksum": "aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": 5.0, "checksum": "aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": -1, "checksum": "aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": 2**63, "checksum": "aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": 5, "checksum": "", "tokens": 10},
        {"v": GATHER_VERSION, "round": 5, "checksum": "a" * 65, "tokens": 10},
        {"v": GATHER_VERSION, "round": 5, "checksum": b"aaaa", "tokens": 10},
        {"v": GATHER_VERSION, "round": 5, "checksum": "aaaa", "tokens": float("nan")},
        {"v": GATHER_VERSION, "round": 5, "checksum": "aaaa", "tokens": -3},
    ],
)
def test_malformed_payloads_are_dropped_and_counted(raw):
    assert GatherPayload.from_wire(raw) is None
    gathered = Gathered.parse({"me": GatherPayload(A5, 10).to_wire(), "them": raw})
    assert list(gathered.payloads) == ["me"] and gathered.malformed == 1


def test_payload_round_trip_and_non_string_peer_ids():
    payload = GatherPayload(A5, 1234)
    assert GatherPayload.from_wire(payload.to_wire()) == payload
    gathered = Gathered.parse({"me": payload, 42: payload.to_wire()})  # typed (simulator) and a bad key
    assert gathered.payloads == {"me": payload} and gathered.malformed == 1


def test_round_rules_refuse_what_the_config_refuses():
    for bad in (-1, 9, 1.5, True):
        with pytest.raises(ValueError, match="max_staleness"):
            RoundRules(bad, "local")
    for bad in (-0.5, 9.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="staleness_decay"):
            RoundRules(1, "local", bad)
    with pytest.raises(ValueError, match="alone_policy"):
        RoundRules(1, "sometimes")


def test_a_delayed_delta_counts_at_its_stale_weight_and_the_others_in_full():
    rules = RoundRules(max_staleness=4, staleness_decay=1.0)
    assert [rules.stale_weight(s) for s in range(4)] == [1.0, 0.5, 1 / 3, 0.25]
    assert RoundRules(4, staleness_decay=0.0).stale_weight(3) == 1.0
    gathered = group(A5, A5, A3, RoundTag(0, "old"), B5)  # p2 two behind, p3 five behind, p4 diverged
    assert rules.weight_factors(gathered) == {"p0": 1.0, "p1": 1.0, "p2": 1 / 3}
    assert decide(A3, gathered, True, rules).reason.startswith("2 round(s) behind the group") and "x0.333" in (
        decide(A3, gathered, True, rules).reason
    )
    assert RoundRules(4).weight_factors(group(A5, B5)) == {"p0": 1.0}  # a tie of one round: the smaller checksum
    assert RoundRules(4).weight_factors(group(A5, RoundTag(20, "0000"))) == {}  # no majority: nobody's Δ counts


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 16, 17, 64, 255])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 16])
def test_a_round_splits_into_even_groups_of_at_most_the_width_each_holding_a_reducer(n, width):
    reducers = [k % 3 != 1 for k in range(n)]  # every third member from the second on is a client
    reducers[0] = True
    groups = split_groups(reducers, width)
    assert sorted(i for g in groups for i in g) == list(range(n))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    assert all(any(reducers[i] for i in g) for g in groups)
    if len(groups) == -(-n // width):  # enough reducers for one per group: no group over the width
        assert max(sizes) <= width
    assert groups == split_groups(list(reducers), width)  # every member computes the same


def test_a_round_with_fewer_reducers_than_groups_has_one_group_per_reducer():
    groups = split_groups([True, False, False, False, False, True], 2)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    with pytest.raises(ValueError):
        split_groups([True], 0)

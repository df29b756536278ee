"""Repeat offenders (p2p_diloco/swarm/strikes.py): strikes in a row ban, a clean judged round clears, unjudged keeps,
a strike is more than half of a sender's judged parts dropped, and we never strike ourselves."""

import pytest

from p2p_diloco.swarm.strikes import Strikes


def parts(*names: str, each: int = 1) -> dict[str, int]:
    return dict.fromkeys(names, each)


def test_a_sender_struck_in_three_judged_rounds_in_a_row_is_named_once_and_counted_again():
    strikes = Strikes(limit=3)
    everyone = parts("a", "b", "c", "x")
    assert strikes.record(everyone, parts("x")) == []
    assert strikes.record(everyone, parts("x")) == []
    assert strikes.record(everyone, parts("x", "b")) == ["x"]  # b has one strike: not yet
    assert strikes.in_a_row == {"b": 1}  # x starts again
    assert strikes.record(everyone, parts("x")) == []


def test_a_judged_round_without_a_strike_clears_and_an_unjudged_one_keeps_the_count():
    strikes = Strikes(limit=2)
    assert strikes.record(parts("a", "x"), parts("x")) == []
    assert strikes.record(parts("a", "x"), {}) == []  # judged and kept: the count is cleared
    assert strikes.record(parts("a", "x"), parts("x")) == []
    assert strikes.record(parts("a"), {}) == []  # x not judged (not in our group): its count stays
    assert strikes.record(parts("a", "x"), parts("x")) == ["x"]
    with pytest.raises(ValueError, match="limit"):
        Strikes(limit=0)


def test_a_strike_is_more_than_half_of_the_senders_judged_parts_dropped():
    """An honest Δ of a short round points away in a part now and then (measured: 1 to 3 parts of a round, 3 rounds
    in a row, H = 5); a sign-flipped one in nearly all."""
    strikes = Strikes(limit=2)
    judged = parts("honest", "flipped", each=4)
    for _ in range(3):
        assert strikes.record(judged, {"honest": 2, "flipped": 3}) in ([], ["flipped"])
    assert "honest" not in strikes.in_a_row
    assert Strikes(limit=1).record(judged, {"flipped": 4}) == ["flipped"]


def test_a_peer_never_strikes_itself():
    """Our reducer judges our own part too; a peer that banned itself would refuse every group it is in."""
    strikes = Strikes(limit=2, me="us")
    assert [strikes.record(parts("us", "b"), parts("us", "b")) for _ in range(2)] == [[], ["b"]]

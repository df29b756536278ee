"""Repeat offenders (p2p_diloco/swarm/strikes.py): drops in a row ban, a clean judged round clears, unjudged keeps."""

import pytest

from p2p_diloco.swarm.strikes import Strikes


def test_a_sender_dropped_in_three_judged_rounds_in_a_row_is_named_once_and_counted_again():
    strikes = Strikes(limit=3)
    everyone = {"a", "b", "c", "x"}
    assert strikes.record(everyone, {"x"}) == []
    assert strikes.record(everyone, {"x"}) == []
    assert strikes.record(everyone, {"x", "b"}) == ["x"]  # b has one drop: not yet
    assert strikes.in_a_row == {"b": 1}  # x starts again
    assert strikes.record(everyone, {"x"}) == []


def test_a_judged_round_without_a_drop_clears_and_an_unjudged_one_keeps_the_count():
    strikes = Strikes(limit=2)
    assert strikes.record({"a", "x"}, {"x"}) == []
    assert strikes.record({"a", "x"}, set()) == []  # judged and kept: the count is cleared
    assert strikes.record({"a", "x"}, {"x"}) == []
    assert strikes.record({"a"}, set()) == []  # x not judged (not in our group): its count stays
    assert strikes.record({"a", "x"}, {"x"}) == ["x"]
    with pytest.raises(ValueError, match="limit"):
        Strikes(limit=0)


def test_a_peer_never_strikes_itself():
    """Our reducer judges our own part too; a peer that banned itself would refuse every group it is in."""
    strikes = Strikes(limit=2, me="us")
    assert [strikes.record({"us", "b"}, {"us", "b"}) for _ in range(2)] == [[], ["b"]]

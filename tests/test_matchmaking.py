"""ask_host (swarm/matchmaking.py): a host hook's answer, or the fallback when there is none to trust."""

from __future__ import annotations

from p2p_diloco.swarm.hooks import ask_host


def test_a_hook_answers_with_its_arguments_and_a_missing_failing_or_odd_one_gives_the_fallback() -> None:
    said: list[tuple] = []
    assert ask_host(lambda *a: said.append(a) or 2.5, "wait", 0.0, "x", 3) == 2.5 and said == [("x", 3)]
    assert ask_host(lambda: 4, "wait", 0.0) == 4  # an int where a float is asked: a number still
    assert ask_host(None, "wait", 0.0) == 0.0
    assert ask_host(lambda: 1 / 0, "wait", 0.0) == 0.0
    assert ask_host(lambda: "soon", "wait", 0.0) == 0.0  # not a number
    assert ask_host(lambda: True, "alone", False) is True
    assert ask_host(lambda: None, "alone", False) is False
    assert ask_host(lambda: "anything", "looking", None) == "anything"  # no fallback type: any answer

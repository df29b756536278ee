"""Joining at scale, end to end: four newcomers start at once while two peers train, and each holds the swarm's
outer state (a checksum the donors held at that round) before its first step, downloaded in pieces from both donors
(swarm/download.py). Real run_peer processes on 127.0.0.1, cleaned up by the ``spawn`` fixture (conftest.py)."""

from __future__ import annotations

import pytest
from test_swarm import records, start_peer

from scripts.procs import wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def test_four_newcomers_at_once_all_hold_the_swarm_state_before_their_first_step(spawn, tmp_path):
    # long enough a run for four start-ups at once on a busy machine; the test stops once they have joined
    # start_peers: the first peer trains once the second is up (alone, its rounds would be local and quick)
    sets = ["train.rounds=400", "swarm.target_group_size=6", "swarm.linger_seconds=10", "swarm.start_peers=2"]
    first = start_peer(spawn, [], tmp_path / "a", *sets)
    initial = first.wait_for_line(r"reachable as: --initial-peers ", timeout=60).string.split("--initial-peers ")[1]
    second = start_peer(spawn, initial.split(), tmp_path / "b", *sets)
    second.wait_for_line(r"^round [2-9]/400 ", timeout=120)  # both train
    newcomers = [start_peer(spawn, initial.split(), tmp_path / f"new{k}", *sets) for k in range(4)]
    joined = []
    for peer in newcomers:
        match = peer.wait_for_line(r"joined at round (\d+) with checksum (\w+)", timeout=150)
        joined.append((int(match.group(1)), match.group(2)))

    def donors_held(step: int) -> set[str]:
        """The states the donors held at round ``step``: the one they applied, and the one a resync left them on (a
        lost record's checksum). Newcomers can outnumber the donors in the next round's group: in a fresh-clone CI
        run, 3 newcomers holding round 10 outvoted the donors' round 11, a donor then dropped its round 11 for the
        newcomers' (one state again, the donors' round lost), and the 4th newcomer joined at that round 11."""
        return {r["checksum"] for d in ("a", "b") for r in records(tmp_path / d) if r["outer_step"] == step}

    for step, checksum in joined:  # the swarm's state at that round: one some donor held too
        assert step >= 2, joined
        held = wait_until(lambda s=step, c=checksum: c in donors_held(s), timeout=30)
        assert held, (step, checksum, donors_held(step))
    # the state came in pieces (download.py logs each completed download with its donors)
    logs = "\n".join(line for peer in newcomers for line in peer.stderr_lines + peer.stdout_lines)
    assert "downloaded round" in logs, logs[-3000:]

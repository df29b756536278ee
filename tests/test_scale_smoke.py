"""scripts/bench/scale.py --smoke: 6 real peers in two host processes (DHT node and averager as threads), rounds of two
butterfly groups: every round ends on one state for all of them. And a run whose last round splits (rounds capped at
2 peers, 4 peers) ends on one state all the same: the end-of-run heal.

Runs alone (not with the other bench smokes, which start together): the harness's peers share two cores and their
matchmaking waits on DHT answers, so it is kept off a machine the other smokes load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_case import bench_case

DEADLINE = 420.0  # the smoke's own --timeout is 400 s; it took 46 s alone here


def _harness(out: Path, *args: str) -> dict:
    """Run scale.py with ``args``, writing ``out``; its one case. The run's logs stay beside ``out`` (its workdir)."""
    case = bench_case("scale.py", list(args), out, DEADLINE)
    assert case["problem"] == "", case["problem"]
    return case


def _heal_lines(workdir: Path) -> list[str]:
    """What the peers logged of the end-of-run heal (host*.log in the harness's workdir): to say why a run did not
    end on one state."""
    words = ("run's end", "ended split", "averaged in")
    return [line for log in sorted(workdir.glob("host*.log")) for line in log.read_text().splitlines()
            if any(word in line for word in words)]  # fmt: skip


@pytest.mark.swarm
@pytest.mark.timeout(480)
def test_scale_smoke_ends_every_round_on_one_state(tmp_path: Path) -> None:
    case = _harness(tmp_path / "scale.json", "--smoke")
    assert case["peers"] == 6 and case["rounds_applied"] == case["rounds"] == 2, case
    assert set(case["states_per_round"].values()) == {1} and case["final_states"] == 1, case
    assert 2 in case["groups_per_round"], case  # a round of 6 ran as two butterflies of 3, one mean
    assert case["lost_share"] <= 0.25, case  # measured 0 of 12 alone; a loaded machine may cost a peer a round
    # an attempt's bytes against the 2(n-1)/n bound; a retried round sends them twice (1 run in 10 beside a busy
    # process: every peer retried round 2 after one peer lost the last part of a slice), so it is allowed once
    assert 0.9 < case["median_bytes_per_attempt_over_bound"] < 1.5, case
    assert case["retried_peer_rounds"] <= case["peers"], case


SPLIT_TRIES = 3  # runs of the split case until its one round splits


@pytest.mark.swarm
@pytest.mark.timeout(SPLIT_TRIES * DEADLINE + 60)
def test_a_run_whose_last_round_split_ends_on_one_state(tmp_path: Path) -> None:
    """4 peers, each on its own shard, one round, rounds capped at 2 peers: the last (only) round splits into two
    lineages, and no later round heals it. The peers on the lineage that is not canonical (2 and 2: the smaller
    checksum) take the other's state at the end (final.json says so); before the end-of-run heal, the run ended on 2
    states. The cap does not always split the round: matchmaking may pair 2 peers and leave the other 2 without a
    group (seen once in CI: 2 lost, 1 state), so the case runs again, up to SPLIT_TRIES times, until it splits; every
    run must end on one state."""
    sets = ["--set", "swarm.max_round_peers=2"]
    runs = []
    for attempt in range(SPLIT_TRIES):
        case = _harness(tmp_path / f"scale{attempt}.json", "--peers", "4", "--group", "2", "--per-process", "4",
                        "--rounds", "1", "--h", "2", "--timeout", "400", *sets)  # fmt: skip
        assert case["final_states"] == 1, (case, _heal_lines(Path(case["workdir"])))
        runs.append({k: case[k] for k in ("states_per_round", "lost_peer_rounds", "final_states", "healed_at_end")})
        if case["states_per_round"].get("1", 0) >= 2:  # the round split (the cap makes two rounds of two)
            assert case["healed_at_end"] >= 1, case
            return
    pytest.fail(f"the round did not split in {SPLIT_TRIES} runs, so the heal was not exercised: {runs}")


@pytest.mark.swarm
@pytest.mark.timeout(DEADLINE + 60)
def test_a_run_split_into_lone_peers_ends_on_one_state(tmp_path: Path) -> None:
    """3 peers, one round of one peer each (rounds capped at 1): each ends the round on its own state, three lineages
    of one key. The end-of-run heal takes the canonical one (the smallest checksum) though only its holder vouches
    for it: under swarm.state_quorum 2 that lineage's state was refused, and the run ended on 3 states (measured
    before the fix: final_states 3, healed_at_end 0), as 3 honest peers did in CI after a round that failed for all."""
    case = _harness(tmp_path / "lone.json", "--peers", "3", "--group", "1", "--per-process", "3", "--rounds", "1",
                    "--h", "2", "--timeout", "300", "--set", "swarm.max_round_peers=1",
                    "--set", "swarm.min_group_size=1")  # fmt: skip
    assert case["final_states"] == 1 and case["healed_at_end"] == 2, (case, _heal_lines(Path(case["workdir"])))
    # then none of them lingered its swarm.linger_seconds (20): each left once the others were done on its state
    logs = "\n".join(log.read_text() for log in Path(case["workdir"]).glob("host*.log"))
    assert logs.count("every live mate is done on this state: leaving after") == 3, _heal_lines(Path(case["workdir"]))

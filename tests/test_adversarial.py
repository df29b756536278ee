"""Hostile peers next to honest ones (real processes on 127.0.0.1), each compared with the same swarm all honest.

Every swarm here has 4 peers on shards 0-3 of configs/tiny.yaml; peer 3 is the attacker (tests/attack_peer.py)
or, in the reference run, honest. Pass: every honest peer finishes (exit 0, so within its deadlines) in agreement
with the others, and their final eval loss is within 2% of the all-honest swarm's. The bogus donor's swarm also
has a late joiner, which must join at the honest peers' state (and never at the donor's round 10**6).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from test_swarm import ROOT, TINY, finish, records, start_bootstrap, start_peer

from p2p_diloco.checkpoint import latest_checkpoint, load_outer_state
from p2p_diloco.config import load_config
from scripts.procs import Proc

pytestmark = [pytest.mark.swarm, pytest.mark.adversarial]

ROUNDS = 6
SWARM = [
    f"train.rounds={ROUNDS}",
    f"train.eval_every={ROUNDS}",
    "inner.steps=10",
    "data.num_shards=4",
    "swarm.target_group_size=4",
    "swarm.start_peers=4",
]
ATTACK_PEER = [sys.executable, str(ROOT / "tests" / "attack_peer.py")]


def run_swarm(spawn, out: Path, attack: tuple[str, str] | None, late_joiner: bool = False, attackers: int = 1) -> dict:
    """Run the 4-peer swarm (peer 3 attacks when ``attack`` is given); the honest peers' records and losses.
    ``attackers`` > 1: as many peers on shard 3 attack alike (Sybils of one person), and they come once the honest
    peers train: a state claimed before anyone trained is not told from a trained one (docs/trust.md, still open)."""
    _, initial = start_bootstrap(spawn)
    dirs = [out / f"peer{k}" for k in range(3 + attackers)]
    # with a late joiner there is one peer more: a group target of 4 would split them every round, and two halves that
    # tie have no majority (see the closing note of #10: such splits can leave honest peers diverged)
    start = len(dirs) if attackers == 1 else 3
    everyone = [f"swarm.target_group_size={len(dirs) + 1}", f"swarm.start_peers={start}"]
    linger = ["swarm.linger_seconds=20", *everyone] if late_joiner or attackers > 1 else []
    honest = [start_peer(spawn, initial, d, *SWARM, *linger, f"data.shard_index={k}") for k, d in enumerate(dirs[:3])]
    prefix = [*ATTACK_PEER, *attack] if attack else None
    if attackers > 1:
        honest[0].wait_for_line(rf"^round [1-{ROUNDS}]/{ROUNDS} ", timeout=240)
    thirds = [start_peer(spawn, initial, d, *SWARM, *linger, "data.shard_index=3", prefix=prefix) for d in dirs[3:]]
    joined = None
    if late_joiner:
        honest[0].wait_for_line(rf"^round [2-{ROUNDS}]/{ROUNDS} ", timeout=240)
        for third in thirds:  # each has stored its bogus announcement by then (Membership.announce before the line)
            third.wait_for_line(r"^joined at round", timeout=120)
        late = start_peer(spawn, initial, out / "late", *SWARM, *linger, "data.shard_index=0", "swarm.start_peers=1")
        match = late.wait_for_line(r"joined at round (\d+) with checksum (\w+)", timeout=120)
        joined = {"round": int(match.group(1)), "checksum": match.group(2), "output": late.describe()}
        honest.append(late)
    finish(honest, timeout=240)
    for third in thirds:  # an attacker the others stopped grouping with may still wait for a group: not the test
        third.stop(grace=3)  # a lone attacker reads a DHT whose other nodes left: each read waits dht_timeout
    attacker_output = "\n".join(third.describe() for third in thirds)
    if attack:  # the attacker got as far as training (its attack is what the honest peers met)
        assert "joined at round" in attacker_output, attacker_output[-3000:]
    final = {d.name: [r for r in records(d) if r.get("eval_loss") is not None][-1:] for d in dirs[:3]}
    # a peer that took the swarm's final state by download has no record of that round: its checkpoint says it
    states = {d.name: load_outer_state(latest_checkpoint(d / "checkpoints"))[0] for d in dirs[:3]}
    return {
        "eval_loss": {k: v[0]["eval_loss"] for k, v in final.items() if v},
        "final_round": {k: state.round for k, state in states.items()},
        "final_checksum": {k: state.checksum() for k, state in states.items()},
        "decisions": {d.name: [r.get("decision") for r in records(d)] for d in dirs[:3]},
        "rounds": {  # what each honest peer's rounds came to, and why (printed when the peers end apart)
            d.name: [
                (r["outer_step"], r["group_size"], r["decision"], (r.get("reduce_reason") or "")[:160])
                for r in records(d)
            ]
            for d in dirs[:3]
        },
        "first_records": {d.name: records(d)[:1] for d in dirs[:3]},
        "joined": joined,
        "reasons": [r["reduce_reason"] for d in dirs[:3] for r in records(d) if r.get("reduce_reason")],
        "attacker_output": attacker_output,
        "honest_output": "\n".join(proc.describe() for proc in honest),
        "dropped": _dropped_parts(dirs[:3]),
    }


@pytest.fixture(scope="module")
def all_honest(tmp_path_factory) -> dict:
    started: list[Proc] = []

    def spawn(args, env=None):
        started.append(Proc(args, env=env))
        return started[-1]

    try:
        return run_swarm(spawn, tmp_path_factory.mktemp("honest"), None)
    finally:
        for proc in started:
            proc.kill_group()


ATTACKS = [  # the 1e6 x wire weight attacker of docs/trust.md runs in test_averager.py (the same reducer path)
    ("negate", "1000"),  # -1000 x its Δ
    ("negate", "1.9"),  # -1.9 x its Δ: inside the norm bound (swarm.aggregation_clip 2), against the others' direction
    ("alie", "1"),  # Δ - mean |Δ|: inside the norm bound, with the others' direction, below their median almost always
    ("lie", "100"),  # a reducer returning -100 x its slice's average
    ("hijack", "1000"),  # a signed payload claiming a state 1000 rounds ahead
    ("garbage", "1"),  # malformed gather payloads, garbage under every DHT key the peers read
    ("flood", "20"),  # 20 state downloads a second
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attack", ATTACKS, ids=[f"{a}-{s}" for a, s in ATTACKS])
def test_honest_peers_train_on_despite_an_attacker(spawn, tmp_path, all_honest, attack):
    attacked = run_swarm(spawn, tmp_path, attack)
    check_against_all_honest(attacked, all_honest, attack)
    if attack[0] == "flood":  # the honest peers refused most of it (swarm.max_state_downloads per minute)
        floods = re.findall(r"FLOOD (\{.*\})", attacked["attacker_output"])
        assert floods, attacked["attacker_output"][-2000:]
        last = json.loads(floods[-1])
        assert last["refused"] > last["served"], last
        print("flood:", last)
    if attack in (("negate", "1.9"), ("alie", "1")):  # the honest reducers dropped it (cosine, skew), named, banned it
        attacker = re.search(r"^peer (\S+) (?:reachable|runs)", attacked["attacker_output"], re.M).group(1)
        lines = re.findall(r"part \d+: (\{.*?\}) point\(s\) against", attacked["honest_output"])
        named = {peer for line in lines for peer in ast.literal_eval(line)}
        assert attacker in named and attacker in attacked["dropped"], (named, attacked["dropped"], attacker)
        assert f"banned {attacker} for" in attacked["honest_output"]  # dropped 3 rounds in a row (strikes.py)
        _assert_honest_kept(attacked, {attacker})
    if attack[0] == "lie":
        assert any("returned an average too long to be one" in r for r in attacked["reasons"]), attacked["reasons"]
        # the retry without the liar formed at once: before matchmaking.DECLARE_MARGIN its declarations (a shorter
        # window than the failed attempt's) went unseen in the DHT, and round 1 took 18-31 s of matchmaking, one
        # honest peer in 3 probes left out (a local step, then eval 2.5% over the all-honest swarm). A peer left out
        # of the first attempt waits while the others' attempt fails (a CI check: one peer counted 3 of the 4 at
        # round 1 and led a group of 3, which lost the liar's parts after next_chunk_timeout; the fourth waited
        # 10.6 s), then one matchmaking period at most. One honest peer slow to end round 1 may find it averaged
        # without it and resync (a fresh-clone check here: its inner steps took 4.0 s against 2.8 s, its mates' retry
        # without the liar did not expect it and formed at 2 a second before it was ready): the others' round is
        # what shows the retry
        swarm = load_config(TINY, SWARM).swarm
        bound = swarm.next_chunk_timeout + swarm.matchmaking_time
        first = {k: v[0] if v else {} for k, v in attacked["first_records"].items()}
        late = [k for k, r in first.items() if "no group looked for" in (r.get("reduce_reason") or "")]
        assert len(late) <= 1 and all(first[k].get("decision") == "resync" for k in late), first
        rest = [r for k, r in first.items() if k not in late]
        assert all(r.get("decision") == "apply" and r["matchmaking_seconds"] < bound for r in rest), first


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("attackers", "refusal"), [(1, "fewer than 2 peers vouch"), (2, "too few of the run's")])
def test_a_late_joiner_never_adopts_a_bogus_donors_state(spawn, tmp_path, all_honest, attackers, refusal):
    """One donor of a bogus state far ahead: fewer than swarm.state_quorum peers vouch for it. Two (Sybil keys of one
    person, both vouching for the same bogus state and serving it, coming once the honest peers train): the quorum
    is met, but the state is held by too few of the run's peers against the honest ones' (vouches.Vouches.offers);
    neither the joiner nor an honest peer takes it."""
    attacked = run_swarm(spawn, tmp_path, ("donor", "6"), late_joiner=True, attackers=attackers)
    joined = attacked["joined"]
    # a state an honest peer trained (one of a last round's split halves too: flaky-run, the joiner took the half that
    # peer0 did not train in, and peer0 then healed to it)
    honest = {(r["outer_step"], r["checksum"]) for k in range(3) for r in records(tmp_path / f"peer{k}")}
    assert 2 <= joined["round"] <= ROUNDS and (joined["round"], joined["checksum"]) in honest, joined
    assert refusal in joined["output"], joined["output"][-3000:]
    late = records(tmp_path / "late")  # none when it joined at the last round
    assert all(r["outer_step"] <= ROUNDS for r in late), late
    print("late joiner:", {k: v for k, v in joined.items() if k != "output"}, "rounds it trained:", len(late))
    check_against_all_honest(attacked, all_honest, ("donor", "6"))


def _apart(attacked: dict) -> str:
    """Why the honest peers may have ended on different states: their final checksums, each one's rounds, and what
    their logs said about splits, downloads and the run's end (a CI run ended 1 + 2 apart: its output was not kept)."""
    said = re.compile(r"split|canonical|resync|download|discarded|the run's end|joined at|local step|lineage")
    lines = [line for line in attacked["honest_output"].splitlines() if line.startswith("args:") or said.search(line)]
    rounds = "\n".join(f"{peer}: {rows}" for peer, rows in attacked["rounds"].items())
    return f"{attacked['final_checksum']}\n{rounds}\n" + "\n".join(lines[-120:])


HONEST_DROPS = 2  # parts of one honest peer the floor or the skew bound may drop in a run (none banned)


def _dropped_parts(dirs: list[Path]) -> dict[str, int]:
    """Per sender, the parts the honest peers' reducers dropped by direction or skew, over the run's records."""
    out: dict[str, int] = {}
    for d in dirs:
        for r in records(d):
            for peer, parts in r.get("dropped_by_direction", {}).items():
                out[peer] = out.get(peer, 0) + parts
    return out


def _assert_honest_kept(run: dict, attackers: set[str]) -> None:
    """No honest peer banned, and at most HONEST_DROPS of its parts dropped: an honest part is dropped now and then (a
    small part right after a split round: a fresh-clone check saw one honest part at cosine -0.31 in round 6), but
    a strike needs most of a sender's parts 3 all-reduces in a row (strikes.py)."""
    honest = {peer: parts for peer, parts in run["dropped"].items() if peer not in attackers}
    assert all(parts <= HONEST_DROPS for parts in honest.values()), honest
    assert not [peer for peer in honest if f"banned {peer} for" in run["honest_output"]], honest


def check_against_all_honest(attacked: dict, all_honest: dict, attack: tuple[str, str]) -> None:
    print(json.dumps({"attack": attack, "all_honest": all_honest["eval_loss"], "attacked": attacked["eval_loss"]}))
    _assert_honest_kept(all_honest, set())
    assert set(attacked["final_round"].values()) == {ROUNDS}, attacked
    assert len(set(attacked["final_checksum"].values())) == 1, _apart(attacked)  # the honest peers agree
    reference = next(iter(all_honest["eval_loss"].values()))
    assert attacked["eval_loss"], attacked  # the state they agree on was evaluated by one of them at least
    for peer, loss in attacked["eval_loss"].items():
        assert loss <= 1.02 * reference, (peer, loss, reference)

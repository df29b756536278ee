"""Hostile peers next to honest ones (real processes on 127.0.0.1), each compared with the same swarm all honest.

Every swarm here has 4 peers on shards 0-3 of configs/tiny.yaml; peer 3 is the attacker (tests/attack_peer.py)
or, in the reference run, honest. Pass: every honest peer finishes (exit 0) in agreement with the others, and
their final eval loss is within 2% of the all-honest swarm's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_swarm import ROOT, finish, records, start_bootstrap, start_peer

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


def run_swarm(spawn, out: Path, attack: tuple[str, str] | None) -> dict:
    """Run the 4-peer swarm (peer 3 attacks when ``attack`` is given); the honest peers' records and losses."""
    _, initial = start_bootstrap(spawn)
    dirs = [out / f"peer{k}" for k in range(4)]
    honest = [start_peer(spawn, initial, d, *SWARM, f"data.shard_index={k}") for k, d in enumerate(dirs[:3])]
    prefix = [*ATTACK_PEER, *attack] if attack else None
    third = start_peer(spawn, initial, dirs[3], *SWARM, "data.shard_index=3", prefix=prefix)
    finish(honest, timeout=240)
    third.wait(timeout=60)
    final = {d.name: [r for r in records(d) if r.get("eval_loss") is not None][-1:] for d in dirs[:3]}
    checksums = {d.name: {r["outer_step"]: r["checksum"] for r in records(d)} for d in dirs[:3]}
    return {
        "eval_loss": {k: v[0]["eval_loss"] if v else None for k, v in final.items()},
        "final_round": {k: v[0]["outer_step"] if v else None for k, v in final.items()},
        "checksums": checksums,
        "decisions": {d.name: [r.get("decision") for r in records(d)] for d in dirs[:3]},
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attack", [("negate", "1000"), ("weight", "1e6")], ids=["negate-1000x", "weight-1e6x"])
def test_honest_peers_train_on_despite_an_attacker(spawn, tmp_path, all_honest, attack):
    attacked = run_swarm(spawn, tmp_path, attack)
    print(json.dumps({"attack": attack, "all_honest": all_honest["eval_loss"], "attacked": attacked["eval_loss"]}))
    assert set(attacked["final_round"].values()) == {ROUNDS}, attacked
    finals = {c[ROUNDS] for c in attacked["checksums"].values()}
    assert len(finals) == 1, attacked["checksums"]  # the honest peers agree
    reference = next(iter(all_honest["eval_loss"].values()))
    for peer, loss in attacked["eval_loss"].items():
        assert loss is not None and loss <= 1.02 * reference, (peer, loss, reference)

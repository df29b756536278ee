"""Client mode (peers behind NAT) on 127.0.0.1: a swarm whose only training peers run as clients says why it
cannot average and keeps training with local steps; run_peer processes read through their own outputs, every
process group SIGKILLed at teardown (the ``spawn`` fixture in conftest.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from p2p_diloco.swarm.averager import NO_REACHABLE_MEMBER

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
ROUNDS = 3
OVERRIDES = [  # as tests/test_swarm.py's FAST: short timeouts, so a matchmaking that waited would show as a slow run
    f"train.rounds={ROUNDS}",
    "inner.steps=5",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "data.eval_batches=1",
    "data.num_shards=2",
    "logging.progress_bar=false",
    "swarm.matchmaking_time=10",
    "swarm.request_timeout=3",
    "swarm.allreduce_timeout=15",
    "swarm.round_deadline=90",
    "swarm.join_timeout=30",
    "swarm.state_timeout=15",
    "swarm.linger_seconds=2",
    "swarm.start_peers=2",  # both up before round 1: each sees the other (a client) among the run's members
]


def _records(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(120)
def test_a_swarm_of_only_clients_says_why_and_trains_with_local_steps(spawn, tmp_path):
    """Two --client-mode peers and a bootstrap node (no training peer, so no member that could lead or reduce):
    every round is local at once with NO_REACHABLE_MEMBER as its reason, on the console and in the records; the
    peers finish their rounds well within one matchmaking_time per round, and exit 0."""
    boot = spawn([sys.executable, "-m", "peers.run_bootstrap", *LOCAL])
    initial = boot.wait_for_line(r"^--initial-peers ", timeout=60).string.split()[1:]
    dirs = [tmp_path / f"client{k}" for k in range(2)]
    peers = []
    for k, log_dir in enumerate(dirs):
        sets = [a for o in (*OVERRIDES, f"data.shard_index={k}") for a in ("--set", o)]
        args = ["--config", str(TINY), "--log-dir", str(log_dir), *LOCAL, *sets, "--client-mode"]
        peers.append(spawn([sys.executable, "-m", "peers.run_peer", *args, "--initial-peers", *initial]))
    for peer in peers:
        peer.wait_for_line(r"^running as a client \(--client-mode\)", timeout=60)
        peer.wait_for_line(r"^peer \S+ runs as a client: others cannot dial it", timeout=30)
    for peer in peers:
        assert peer.wait(timeout=90) == 0, peer.describe()

    for peer, log_dir in zip(peers, dirs, strict=True):
        recs = _records(log_dir)
        assert [r["outer_step"] for r in recs] == list(range(1, ROUNDS + 1)), peer.describe()
        assert [r["group_size"] for r in recs] == [1] * ROUNDS
        assert all(NO_REACHABLE_MEMBER in r.get("reduce_reason", "") for r in recs), recs
        # no matchmaking was tried: a round's wait for a group is nothing like swarm.matchmaking_time (10 s)
        assert all(r["matchmaking_seconds"] < 1.0 for r in recs), [r["matchmaking_seconds"] for r in recs]
        said = [line for line in peer.stderr_lines if NO_REACHABLE_MEMBER in line]
        assert len(said) == ROUNDS, peer.describe()
        assert recs[-1]["train_loss"] < recs[0]["train_loss"]  # the local steps still train

"""The swarm end to end: bootstrap + run_peer processes on 127.0.0.1, checked through their own outputs.

Every test starts real processes (own session each), reads their stdout with deadlines and SIGKILLs every
process group it started at teardown (the ``spawn`` fixture in conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from p2p_diloco.checkpoint import latest_checkpoint, load_outer_state
from p2p_diloco.codec import get_codec
from p2p_diloco.config import load_config
from p2p_diloco.export import export_checkpoint
from p2p_diloco.outer import OuterState
from p2p_diloco.sim_reduce import wire_bytes_sent
from p2p_diloco.simulate import simulate
from scripts.procs import Throttle, live_group_members, wait_until

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
FAST = [
    "inner.steps=5",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "data.eval_batches=1",
    "logging.progress_bar=false",
    "swarm.matchmaking_time=10",
    "swarm.request_timeout=3",
    "swarm.allreduce_timeout=15",
    "swarm.next_chunk_timeout=5",
    "swarm.round_deadline=90",
    "swarm.join_timeout=30",
    "swarm.state_timeout=15",
    "swarm.linger_seconds=2",  # peers that finish together need not serve their state for long
]


def _sets(*overrides: str) -> list[str]:
    out = []
    for o in (*FAST, *overrides):
        out += ["--set", o]
    return out


def start_bootstrap(spawn):
    boot = spawn([sys.executable, "-m", "peers.run_bootstrap", *LOCAL])
    line = boot.wait_for_line(r"^--initial-peers ", timeout=60).string
    return boot, line.split()[1:]


def start_peer(
    spawn, initial: list[str], log_dir: Path, *overrides: str, prefix: list[str] | None = None, flags: tuple = ()
):
    args = [
        *(prefix or [sys.executable, "-m", "peers.run_peer"]),
        "--config",
        str(TINY),
        "--log-dir",
        str(log_dir),
        *LOCAL,
        *_sets(*overrides),
        *flags,
    ]
    args += ["--initial-peers", *initial] if initial else ["--new-swarm"]
    return spawn(args)


def records(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checksums_by_step(log_dirs: list[Path], settled: bool = False) -> dict[int, set[str]]:
    """Every checksum the peers recorded at each step; ``settled``: each peer's last record of the step only (a
    round it applied and then left by a resync at the same step counts as the resync's state)."""
    out: dict[int, set[str]] = {}
    for d in log_dirs:
        recs = records(d)
        if settled:
            recs = list({r["outer_step"]: r for r in recs}.values())
        for r in recs:
            out.setdefault(r["outer_step"], set()).add(r["checksum"])
    return out


def resyncs_that_left_steps(recs: list[dict]) -> set[int]:
    """The indices of the resync records after which a peer recorded again steps it had recorded (it left the state
    of those steps for the swarm's); AssertionError when a step was recorded again without such a resync."""
    out = set()
    for i, r in enumerate(recs):
        if any(later["outer_step"] == r["outer_step"] for later in recs[i + 1 :]):
            resync = next((j for j in range(i + 1, len(recs)) if recs[j].get("decision") == "resync"), None)
            assert resync is not None and recs[resync]["outer_step"] <= r["outer_step"], (i, recs)
            out.add(resync)
    return out


def finish(procs, timeout: float) -> None:
    for p in procs:
        rc = p.wait(timeout=timeout)
        assert rc == 0, p.describe()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("compression", "overlap", "tolerance"),
    [
        ("none", "none", 1e-5),
        ("none", "eager", 1e-5),
        ("none", "delayed", 1e-5),
        ("topk3", "eager", 4e-3),
        ("topk1@F2", "eager", 4e-3),
    ],
    ids=["fp32-blocking", "fp32-eager", "fp32-delayed", "topk3-eager", "topk1-fragments2-eager"],
)
def test_three_peers_agree_every_round_and_match_the_simulator(spawn, tmp_path, compression, overlap, tolerance):
    """Bitwise agreement of every member every round, bytes as the codec encodes them, and the simulator's result.
    With a quantizing codec the simulator's mean of a value can differ from a reducer's in the last bit (the senders
    are summed in another order); a value near a rounding boundary then lands one step away (int8: seen 2.4e-5; an
    int4 step of tiny's Δ̄ is up to ~1e-3, times the Nesterov step's (1 + m) lr), hence the looser bound on the
    largest difference there, and the share of values that differ at all must stay small: a simulator that missed
    what the peers do (error feedback, a codec's cut into parts) would move nearly every value. topk3 (3% of each
    part in 2 bits, the means of the parts as their nonzeros in int4) runs with error feedback, as a top-k codec
    always does: each peer's residual is its own, kept from its own Δ. Its bytes depend on the data: the swarm's
    are compared with the simulator's measure of the same rounds. ``@F2``: swarm.fragments 2 (rounds 1 and 3
    exchange one half of the model's tensors, round 2 the other), each fragment's exchange behind the next round's
    inner steps (eager)."""
    boot, initial = start_bootstrap(spawn)
    rounds = [  # swarm.target_group_size as the preset has it (16): the group forms once the 3 live peers are in
        "train.rounds=3",
        "data.num_shards=3",
        "swarm.min_group_size=3",
        "swarm.start_peers=3",
        f"swarm.compression={compression.partition('@F')[0]}",
        f"swarm.fragments={compression.partition('@F')[2] or 1}",
        f"swarm.overlap={overlap}",
        "swarm.overlap_steps=2",  # eager, delayed: round r's Δ̄ is settled after 2 of round r+1's 5 inner steps
    ]
    dirs = [tmp_path / f"peer{k}" for k in range(3)]
    peers = [start_peer(spawn, initial, d, *rounds, f"data.shard_index={k}") for k, d in enumerate(dirs)]
    finish(peers, timeout=200)

    by_step = checksums_by_step(dirs)
    assert sorted(by_step) == [1, 2, 3]
    for step in sorted(by_step):
        print(f"round {step}: " + "  ".join(r["checksum"] for d in dirs for r in records(d) if r["outer_step"] == step))
    assert all(len(c) == 1 for c in by_step.values()), by_step  # every peer, same state, every round
    for d in dirs:
        recs = records(d)
        assert [r["group_size"] for r in recs] == [3, 3, 3]
        assert recs[-1]["train_loss"] < recs[0]["train_loss"]
        for key in (
            "peer_id",
            "tokens",
            "compute_seconds",
            "matchmaking_seconds",
            "allreduce_seconds",
            "comm_wait_seconds",
            "bytes_sent",
            "bytes_received",
            "peak_memory_bytes",
        ):
            assert key in recs[0]
    timing = {
        k: round(sum(r[k] for d in dirs for r in records(d)) / 9, 3)
        for k in ("compute_seconds", "matchmaking_seconds", "allreduce_seconds", "comm_wait_seconds")
    }
    print("mean per-round seconds over 3 peers x 3 rounds:", timing)
    cfg = load_config(TINY, [*FAST, *rounds])
    assert cfg.swarm.target_group_size > 3
    waits = sorted(r["matchmaking_seconds"] for d in dirs for r in records(d) if r["outer_step"] > 1)
    # not the leader's deadline: every member was there. One peer-round of the six may wait it out: seen once in
    # a fresh-clone CI run, int8-eager, the last (drained) exchange, one peer 10.2 s while the two others had
    # joined its group at once (open, in the closing note of 2026-12-01); the rest must not
    assert waits[-2] < cfg.swarm.matchmaking_time / 2, waits

    # the swarm equals the simulator with the same config, seeds and shards
    simulate(cfg, "diloco", 3, tmp_path / "sim")
    sim, _ = load_outer_state(tmp_path / "sim" / "final_state")
    swarm, _ = load_outer_state(latest_checkpoint(dirs[0] / "checkpoints"))
    assert swarm.round == sim.round == 3
    pairs = list(zip(swarm.anchor + swarm.momentum, sim.anchor + sim.momentum))
    diff = max((a - b).abs().max().item() for a, b in pairs)
    differ = sum(int(((a - b).abs() > 1e-6).sum()) for a, b in pairs) / sum(a.numel() for a, _ in pairs)
    print(f"swarm vs simulator ({compression}, overlap {overlap}): max abs difference {diff:.3g}, {differ:.2%} differ")
    assert diff <= tolerance and differ < 0.01

    # the bytes each round handed to the transport: the codec's encoded parts, 2(n-1) x Δ over the group (a top-k
    # codec: as the simulator measured the same rounds' encodings, give or take how the parts fell to reducers)
    shapes = [a.shape for a in swarm.anchor]
    sparse = get_codec(cfg.swarm.compression).sparse or cfg.swarm.fragments > 1
    measured = [r["bytes_sent"] for r in records(tmp_path / "sim")]  # a worker's, each round, in the simulator
    for step in (1, 2, 3):
        expected = 3 * (measured[step - 1] if sparse else wire_bytes_sent(cfg, shapes, 3))
        rows = [
            (r["bytes_sent"], r["bytes_received"], r["reduce_attempts"], r["repaired_slices"])
            for d in dirs
            for r in records(d)
            if r["outer_step"] == step
        ]
        sent = sum(row[0] for row in rows)
        # a repaired slice (repair.py: seen in a fresh-clone check, one member got 95.1% of the results and copied
        # the rest from a mate) adds the copy and loses the replies that broke on the way: the else branch's bounds
        if all(attempts == 1 and repaired == 0 for *_, attempts, repaired in rows):
            assert sent == sum(row[1] for row in rows), (step, rows)  # (sent, received, attempts, repaired)
            print(f"round {step}: {sent} bytes sent by the 3 peers, {sent / expected:.4f} of {expected:.0f}")
            # a part's message framing (some 20 bytes, an empty part's too) weighs more beside a few KB of top-k
            assert (0.95 if sparse else 1.0) <= sent / expected < (1.15 if sparse else 1.03), (step, sent, expected)
        else:  # a failed attempt's bytes count too (some die in its broken streams), then a complete one's
            assert sent >= 0.8 * expected and sum(row[1] for row in rows) >= 0.8 * expected, (step, rows, expected)


@pytest.mark.timeout(240)
def test_budgeted_rounds_end_together_for_peers_of_different_speeds(spawn, tmp_path):
    """inner.round_seconds: a peer made 3x slower (stopped 2/3 of the time, as on a slower GPU) takes fewer steps
    in the same rounds, instead of falling behind: both peers average every round, hold the same state after each,
    and the slow one's Δ counts with its own (smaller) token count."""
    boot, initial = start_bootstrap(spawn)
    sets = [
        "train.rounds=3",
        "inner.steps=1000",
        "inner.round_seconds=5",
        "data.num_shards=2",
        "swarm.min_group_size=2",
        "swarm.start_peers=2",
    ]
    dirs = [tmp_path / "fast", tmp_path / "slow"]
    peers = [start_peer(spawn, initial, d, *sets, f"data.shard_index={k}") for k, d in enumerate(dirs)]
    peers[1].wait_for_line(r"^joined at round 0", timeout=90)
    with Throttle(peers[1].pid, slowdown=3):
        finish(peers, timeout=180)

    by_step = checksums_by_step(dirs)
    assert sorted(by_step) == [1, 2, 3] and all(len(c) == 1 for c in by_step.values()), by_step
    fast, slow = (records(d) for d in dirs)
    assert [r["group_size"] for r in fast] == [r["group_size"] for r in slow] == [2, 2, 2]
    fast_tokens, slow_tokens = sum(r["tokens"] for r in fast[1:]), sum(r["tokens"] for r in slow[1:])
    for label, recs in (("fast", fast), ("slow", slow)):
        print(
            label,
            [
                (
                    r["tokens"],
                    round(r["compute_seconds"], 1),
                    round(r["matchmaking_seconds"], 1),
                    round(r["allreduce_seconds"], 1),
                    round(r["time"] % 100, 1),
                )
                for r in recs
            ],
        )
    assert 0 < slow_tokens < 0.7 * fast_tokens, (slow_tokens, fast_tokens)  # same rounds, fewer steps


@pytest.mark.timeout(240)
def test_fixed_h_fast_peers_do_not_wait_for_a_straggler_whose_delayed_delta_still_counts(spawn, tmp_path):
    """Fixed H with one peer 3x slower: the fast pair averages without waiting for it (groups of 2), and when it
    arrives rounds behind, its Δ counts (max_staleness 6) and it catches up to the group's state (or, when that
    download fails, resyncs); every group's members hold the same state. The slow peer's first Δ arrives 2-4 rounds
    behind: on a 2-core machine the fast pair runs faster while the slow peer is stopped (a CI run with
    max_staleness 3 found it 4 behind, and it rightly resynced instead)."""
    boot, initial = start_bootstrap(spawn)
    sets = [
        "train.rounds=8",
        "inner.steps=60",
        "data.num_shards=3",
        "swarm.max_staleness=6",
        "swarm.start_peers=3",
        "swarm.matchmaking_time=4",
    ]
    dirs = [tmp_path / "fast0", tmp_path / "fast1", tmp_path / "slow"]
    peers = [start_peer(spawn, initial, d, *sets, f"data.shard_index={k}") for k, d in enumerate(dirs)]
    for peer in peers:
        peer.wait_for_line(r"^joined at round 0", timeout=90)
    with Throttle(peers[2].pid, slowdown=3):
        finish(peers[:2], timeout=200)
        # from here on the slow peer is alone (its rounds are local steps, each after a wait for mates): not this test
        peers[2].stop(grace=30)

    fast, slow = [records(d) for d in dirs[:2]], records(dirs[2])
    for label, recs in (("fast0", fast[0]), ("fast1", fast[1]), ("slow", slow)):
        print(
            label, [(r["outer_step"], r["group_size"], r["decision"], round(r["matchmaking_seconds"], 1)) for r in recs]
        )
    grouped = [r for recs in (*fast, slow) for r in recs if r["group_size"] > 1]
    by_step: dict[int, set[str]] = {}
    for r in grouped:
        by_step.setdefault(r["outer_step"], set()).add(r["checksum"])
    assert all(len(c) == 1 for c in by_step.values()), by_step
    assert any(r["group_size"] == 2 for r in fast[0]), fast[0]  # the fast pair did not wait for the slow peer
    # its delayed Δ counted in a group's mean (every member decides that alike), and it took the group's state
    said = [line for line in peers[2].stderr_lines if "round" in line][-40:]
    counted = [line for line in peers[2].stderr_lines if re.search(r"round\(s\) behind the group .*: Δ counts x", line)]
    assert counted, said
    print("counted:", counted)
    assert len(slow) < len(fast[0]), (slow, fast[0])


@pytest.mark.timeout(240)
def test_late_joiner_holds_the_swarm_state_before_its_first_step(spawn, tmp_path):
    # the late joiner may still resync from the others after they finished: they linger for it. Groups form as soon
    # as the live peers are in (a round takes ~0.5 s), so the run is long enough for the joiner's start-up. Eager
    # overlap: the donors serve and vouch for their replicated state while an exchange is in flight, and the
    # joiner's first exchange goes out while nothing is in flight yet.
    sets = ["train.rounds=30", "swarm.target_group_size=3", "swarm.linger_seconds=10"]
    sets += ["swarm.overlap=eager", "swarm.overlap_steps=2"]
    sets += ["swarm.start_peers=2"]  # the first peer trains once the second is up (alone, its rounds would be quick)
    first = start_peer(spawn, [], tmp_path / "a", *sets)
    initial = first.wait_for_line(r"reachable as: --initial-peers ", timeout=60).string.split("--initial-peers ")[1]
    second = start_peer(spawn, initial.split(), tmp_path / "b", *sets)
    second.wait_for_line(r"^round [2-9]/30 ", timeout=120)
    with Throttle(first.pid, 4), Throttle(second.pid, 4):  # under load the joiner's start-up outlasted 30 rounds
        late = start_peer(spawn, initial.split(), tmp_path / "c", *sets)
        match = late.wait_for_line(r"joined at round (\d+) with checksum (\w+)", timeout=90)
    step, checksum = int(match.group(1)), match.group(2)
    assert 2 <= step < 30, late.describe()
    # read after the run: an eager donor serves a round's state from its settle (τ steps into the next round) but
    # writes that round's record when the next round's inner steps end
    finish([first, second, late], timeout=150)
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    donors = checksums_by_step(dirs[:2], settled=True)
    assert donors.get(step) == {checksum}  # the joiner holds the swarm's state for that step
    late_recs = records(tmp_path / "c")
    assert late_recs and late_recs[0]["outer_step"] > step
    # one state at every step, as each peer settled it. Beside a busy process (scripts/flaky.py: 3 of 10 runs, on the
    # tree before kin and after alike) the joiner's first exchange, out of sync, grouped with one donor while the
    # other was late: that donor applied a step or two alone and, in its next exchange, left them for the others'
    # state by one resync. A step left otherwise, or twice, fails.
    by_step = checksums_by_step(dirs, settled=True)
    assert all(len(c) == 1 for c in by_step.values()), by_step
    for d in dirs:
        assert len(resyncs_that_left_steps(records(d))) <= 1, (d.name, records(d))


@pytest.mark.timeout(240)
def test_sigkill_during_allreduce_survivors_finish_in_agreement(spawn, tmp_path):
    boot, initial = start_bootstrap(spawn)
    sets = ["train.rounds=4", "swarm.target_group_size=3", "swarm.part_size_bytes=65536", "swarm.start_peers=3"]
    dirs = [tmp_path / f"peer{k}" for k in range(3)]
    peers = [start_peer(spawn, initial, d, *sets, f"data.shard_index={k}") for k, d in enumerate(dirs[:2])]
    # ~41 parts of 64 KiB per peer per round; dying after 50 sends is inside the second round's all-reduce
    victim = start_peer(
        spawn,
        initial,
        dirs[2],
        *sets,
        "data.shard_index=2",
        prefix=[sys.executable, str(ROOT / "tests" / "fault_peer.py"), "50"],
    )
    died = float(victim.wait_for_line(r"^DYING ", timeout=150).string.split()[1])
    started = time.time()
    finish(peers, timeout=150)
    assert victim.wait(timeout=10) != 0
    by_step = checksums_by_step(dirs[:2])
    assert sorted(by_step) == [1, 2, 3, 4], by_step
    assert all(len(c) == 1 for c in by_step.values()), by_step
    survivors = [r for d in dirs[:2] for r in records(d)]
    hit = [r for r in survivors if r["time"] > died]
    assert hit and all(r["reduce_attempts"] >= 1 for r in hit)
    cfg = load_config(TINY, [*FAST, *sets])
    slowest = max(r["matchmaking_seconds"] + r["allreduce_seconds"] for r in survivors)
    assert slowest <= cfg.swarm.round_deadline + cfg.swarm.allreduce_timeout
    print(
        "after the kill:",
        [
            (
                r["outer_step"],
                r["group_size"],
                r["reduce_attempts"],
                r["reduce_complete"],
                round(r["matchmaking_seconds"] + r["allreduce_seconds"], 2),
            )
            for r in hit
        ],
        f"survivors finished {time.time() - started:.1f}s after the kill",
    )


@pytest.mark.timeout(240)
def test_peers_carry_on_when_the_bootstrap_node_dies(spawn, tmp_path):
    boot, initial = start_bootstrap(spawn)
    dirs = [tmp_path / "a", tmp_path / "b"]
    peers = [
        start_peer(spawn, initial, d, "train.rounds=4", "swarm.target_group_size=2", "swarm.start_peers=2")
        for d in dirs
    ]
    peers[0].wait_for_line(r"^round 1/4 ", timeout=120)
    boot.kill_group()
    finish(peers, timeout=150)
    by_step = checksums_by_step(dirs)
    assert sorted(by_step) == [1, 2, 3, 4] and all(len(c) == 1 for c in by_step.values()), by_step
    assert all(r["group_size"] == 2 for d in dirs for r in records(d))


def _warm_exports(where: Path) -> tuple[Path, Path]:
    """Two warm starts as README's recipe makes them: a data-parallel simulation, exported; the second one step
    longer (the same architecture and config, other weights)."""
    exports = []
    for steps in (3, 4):
        cfg = load_config(TINY, [f"inner.steps={steps}", "train.rounds=1", "data.eval_batches=1"])
        simulate(cfg, "sync", 2, where / f"warm{steps}")
        export_checkpoint(where / f"warm{steps}", where / f"export{steps}")
        exports.append(where / f"export{steps}")
    return exports[0], exports[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("differs", ["width", "warm start"])
def test_peer_with_a_different_model_is_refused_with_the_reason(spawn, tmp_path, differs):
    """A peer started from a warm start (model.pretrained: an export) serves it as round 0; a newcomer whose model
    differs, in width or only in its warm start's weights, is refused with the field named."""
    if differs == "width":
        ours, theirs, field = [], ["model.hidden_size=64"], "hidden_size"
    else:
        warm, other = _warm_exports(tmp_path)
        ours, theirs, field = [f"model.pretrained={warm}"], [f"model.pretrained={other}"], "model.weights_digest"
    first = start_peer(spawn, [], tmp_path / "a", "train.rounds=50", *ours)
    initial = first.wait_for_line(r"reachable as: --initial-peers ", timeout=60).string.split("--initial-peers ")[1]
    if differs == "warm start":  # the run starts from the export's weights
        seed = OuterState.from_params(AutoModelForCausalLM.from_pretrained(warm).parameters())
        assert first.wait_for_line(r"joined at round 0 with checksum (\w+)", timeout=60).group(1) == seed.checksum()
    other = start_peer(spawn, initial.split(), tmp_path / "b", *theirs)
    rc = other.wait(timeout=90)
    assert rc == 2, other.describe()
    assert field in other.stderr and "differ" in other.stderr, other.stderr
    assert "Traceback" not in other.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("initial", "code", "words"),
    [
        (["/ip4/127.0.0.1/tcp/notaport/p2p/QmX"], 2, "malformed"),
        ([], 2, "no initial peers"),
        (
            ["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPGyfpGya6yDt8sNqjN3Ncx1sFqvwuDE5mTQRqLyDSBYd"],
            3,
            "no initial peer answered",
        ),
    ],
)
def test_bad_initial_peers_fail_fast_with_a_message(spawn, tmp_path, initial, code, words):
    args = [
        sys.executable,
        "-m",
        "peers.run_peer",
        "--config",
        str(TINY),
        "--log-dir",
        str(tmp_path),
        *LOCAL,
        "--set",
        "swarm.join_timeout=5",
        "--initial-peers",
        *initial,
    ]
    started = time.monotonic()
    proc = spawn(args, env={"PATH": "/usr/bin:/bin", "P2P_DILOCO_INITIAL_PEERS": ""})
    rc = proc.wait(timeout=90)
    assert rc == code, proc.describe()
    assert words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60


@pytest.mark.timeout(180)
def test_ctrl_c_exits_cleanly_and_resume_continues_from_the_checkpoint(spawn, tmp_path):
    """With eager overlap: the stop finds an exchange in flight (or one settled mid-round), settles it, checkpoints
    and exits 0; the resumed run applies every round once."""
    solo = ["train.rounds=5", "swarm.matchmaking_time=1", "swarm.request_timeout=0.5", "swarm.linger_seconds=0"]
    solo += ["swarm.overlap=eager", "swarm.overlap_steps=2"]
    peer = start_peer(spawn, [], tmp_path / "p", *solo)
    peer.wait_for_line(r"^round 2/5 ", timeout=120)
    os.killpg(peer.pgid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    started = time.monotonic()
    assert peer.wait(timeout=60) == 0, peer.describe()
    assert time.monotonic() - started < 45
    assert "Traceback" not in peer.stderr, peer.stderr  # p2pd got the Ctrl-C too: the averager's shutdown minds it
    assert wait_until(lambda: not live_group_members(peer.pgid), 10), live_group_members(peer.pgid)
    saved = latest_checkpoint(tmp_path / "p" / "checkpoints")
    state, _ = load_outer_state(saved)
    assert state.round >= 2

    again = start_peer(spawn, [], tmp_path / "p", *solo, flags=("--resume",))
    match = again.wait_for_line(r"joined at round (\d+) with checksum (\w+)", timeout=90)
    assert int(match.group(1)) == state.round and match.group(2) == state.checksum()
    assert again.wait(timeout=120) == 0, again.describe()
    resumed = re.search(r"resumed from \S+ \(round (\d+), (\d+) batches read\)", again.stderr)
    assert resumed and int(resumed.group(1)) == state.round and int(resumed.group(2)) > 0, again.stderr
    steps = [r["outer_step"] for r in records(tmp_path / "p")]
    assert steps[-1] == 5 and sorted(set(steps)) == list(range(1, 6)), steps


@pytest.mark.timeout(240)
def test_resumed_peer_that_fell_behind_takes_the_swarm_state_before_its_first_step(spawn, tmp_path):
    # 40 rounds: under CI load the stop reached the second peer only after all of 10 (seen). Of ~1.5 s each (20
    # steps): at 5 (~0.4 s), before donors kept the state a download began on (state_pieces.py), the resumed peer's
    # downloads chased the lone peer's rounds until its download budget ran out (seen)
    sets = ["train.rounds=40", "train.checkpoint_every=1", "swarm.matchmaking_time=3", "swarm.request_timeout=1"]
    sets += ["swarm.linger_seconds=60", "inner.steps=20"]
    first = start_peer(spawn, [], tmp_path / "a", *sets)
    initial = first.wait_for_line(r"reachable as: --initial-peers ", timeout=60).string.split("--initial-peers ")[1]
    second = start_peer(spawn, initial.split(), tmp_path / "b", *sets)
    second.wait_for_line(r"^round \d+/40 ", timeout=120)
    os.killpg(second.pgid, signal.SIGINT)
    assert second.wait(timeout=60) == 0, second.describe()
    saved, _ = load_outer_state(latest_checkpoint(tmp_path / "b" / "checkpoints"))
    assert saved.round <= 37, second.describe()
    first.wait_for_line(rf"^round {saved.round + 2}/40 ", timeout=120)  # the swarm moves on without it

    again = start_peer(spawn, initial.split(), tmp_path / "b", *sets, flags=("--resume",))
    match = again.wait_for_line(r"joined at round (\d+) with checksum (\w+)", timeout=90)
    step, checksum = int(match.group(1)), match.group(2)
    assert step >= saved.round + 2
    for proc in (first, again):
        os.killpg(proc.pgid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.describe()
    assert {r["outer_step"]: r["checksum"] for r in records(tmp_path / "a")}.get(step) == checksum
    assert re.search(rf"resumed from \S+ \(round {saved.round}, [1-9]\d* batches read\)", again.stderr)
    # no round trained on the stale state: none recorded between it and the swarm's, and none applied to reach the
    # swarm's (a round lost at the swarm's state after joining, its mate gone, is recorded at that state: seen in CI)
    steps = [(r["outer_step"], r["lost"]) for r in records(tmp_path / "b")]
    assert not [s for s, lost in steps if saved.round < s < step or (s == step and not lost)], steps

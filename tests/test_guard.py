"""Rounds that fail (swarm/guard.py): a real Worker and StateSync whose outer state is poisoned with NaN roll back
to the last state that trained and back off instead of spinning; unexpected errors put the state back; the
peer gives up (checkpoint, exit 1) only after swarm.max_failed_rounds; a lone run_peer with a NaN anchor at
round 2 rolls back and finishes."""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from test_swarm import records, start_peer

from p2p_diloco.checkpoint import latest_checkpoint, load_outer_state
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.engine import Worker
from p2p_diloco.inner import NonFiniteLossError
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import Gathered, RoundRules
from p2p_diloco.rounds import ReduceInfo
from p2p_diloco.swarm.guard import RoundGuard, RoundsFailing, StopRequested, Verdict
from p2p_diloco.swarm.sync import Offer, StateSync

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


class _SelfReducer:
    """A complete group of one: the mean is this worker's own Δ."""

    def reduce(self, pseudo_grads, weight, payload):
        return pseudo_grads, ReduceInfo(group_size=1, complete=True, attempts=1, gathered=Gathered({"me": payload}))


class _NoPeers:
    """The part of the averager StateSync uses, with nobody to download from."""

    def download(self, peer_id, timeout, max_tensors, max_bytes):
        return "nobody to download from"


def _batches(seed=0, vocab=257, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, shape, generator=g)


def _setup(rollback_after=3, max_failed=10, **kwargs):
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=20", "train.eval_every=0", "data.eval_batches=1"])
    worker = Worker(cfg, 257, _batches())
    sync = StateSync(worker, _NoPeers(), "fp", 1.0, lambda: False)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return False

    guard = RoundGuard(sync, rollback_after, max_failed, wait, **kwargs)
    return worker, sync, guard, waits


def _step(worker, sync, guard):
    """What TrainingPeer.run_round does: pay the backoff, then one round through the guard."""
    assert not guard.pause()
    return guard.run(worker.state.round + 1, lambda: worker.run_round(_SelfReducer(), RoundRules(), sync))


def _theta_is_anchor(worker) -> bool:
    return all(torch.equal(a, p.detach()) for a, p in zip(worker.state.anchor, worker.model.parameters()))


def _poisoned(worker) -> OuterState:
    bad = OuterState.from_tensors(worker.state.tensors(), worker.state.round)
    bad.anchor[0].fill_(math.nan)
    return bad


@pytest.mark.timeout(60)
def test_nan_anchor_rolls_back_to_the_last_state_that_trained_with_backoff(caplog):
    caplog.set_level(logging.INFO)
    worker, sync, guard, waits = _setup()
    assert _step(worker, sync, guard) is not None
    after_first = worker.tag()
    assert _step(worker, sync, guard) is not None  # ran from round 1's state: that one is now the last good one
    sync.adopt(Offer(_poisoned(worker), True), "a donor's poisoned state")  # round 2, NaN anchor
    poisoned = worker.tag()
    next(iter(worker.inner.optimizer.state.values()))["exp_avg"].fill_(math.nan)  # and NaN AdamW moments

    started = time.monotonic()
    for _ in range(3):
        assert _step(worker, sync, guard) is None
    assert time.monotonic() - started < 10  # three failures at the first inner step: fast, but not a spin
    assert worker.tag() == after_first and _theta_is_anchor(worker)
    assert sync.consensus
    line = (
        f"inner loss non-finite for 3 rounds from round 2 (checksum {poisoned.checksum}): rolling back to round 1 "
        f"(checksum {after_first.checksum})"
    )
    assert line in caplog.text, caplog.text
    assert "the inner optimizer's moments held NaN or inf: forgotten" in caplog.text
    assert caplog.text.count("round 3 discarded: inner loss is nan") == 3

    result = _step(worker, sync, guard)  # from the state rolled back to: finite again
    assert result is not None and result.outer_step == 2 and math.isfinite(result.inner.mean_loss)
    assert waits == [1.0, 2.0]  # nothing after the first failure, 1 s after the second, 2 s after the rollback
    assert guard.failures == 3 and guard.rollbacks == 1  # a replay of round 2 does not end the row of failures
    assert _step(worker, sync, guard).outer_step == 3  # past the round that failed: it does
    assert guard.failures == 0 and waits == [1.0, 2.0]  # good rounds owe no wait


@pytest.mark.timeout(60)
def test_unexpected_errors_put_the_state_back_back_off_and_give_up_after_max_failed_rounds(caplog):
    worker, sync, guard, waits = _setup(max_failed=5, backoff_max=3.0)
    assert _step(worker, sync, guard) is not None
    before = worker.tag()

    def outer_step_cut_short():
        with torch.no_grad():
            worker.state.anchor[0].add_(1.0)  # half of an outer step, then a bug
            next(worker.model.parameters()).add_(1.0)  # and θ moved
        raise RuntimeError("boom")

    for k in range(4):
        assert not guard.pause()
        assert guard.run(2, outer_step_cut_short) is None
        assert worker.tag() == before and _theta_is_anchor(worker), k
    assert not guard.pause()
    with pytest.raises(RoundsFailing, match=r"5 rounds in a row failed .*unexpected RuntimeError: boom"):
        guard.run(2, outer_step_cut_short)
    assert worker.tag() == before
    assert waits == [1.0, 2.0, 3.0]  # 1, 2, then capped at backoff_max (4 -> 3)
    traced = [r for r in caplog.records if r.exc_info and "unexpected RuntimeError" in r.getMessage()]
    assert len(traced) == 1  # the traceback once, not once per round
    assert caplog.text.count("round 2 discarded: unexpected RuntimeError: boom") == 5


@pytest.mark.timeout(60)
def test_stop_and_interrupts_pass_through_and_count_for_nothing():
    worker, sync, guard, waits = _setup()
    for exc in (StopRequested, KeyboardInterrupt, SystemExit):

        def attempt(exc=exc):
            raise exc

        with pytest.raises(exc):
            guard.run(1, attempt)
    assert guard.failures == 0 and waits == []


def _nan_loss():
    raise NonFiniteLossError("inner loss is nan: lower inner.lr or check the data")


@pytest.mark.timeout(60)
def test_giving_up_with_a_nan_state_rolls_back_first_and_the_checkpoint_is_the_fallback():
    saved = {}
    worker, sync, guard, waits = _setup(rollback_after=3, max_failed=3, fallback=lambda: saved.get("state"))
    assert _step(worker, sync, guard) is not None  # from round 0's state: that one is the last good one
    saved["state"] = OuterState.from_tensors(worker.state.tensors(), worker.state.round)  # "the checkpoint"
    sync.adopt(Offer(_poisoned(worker), True), "poison")
    guard.run(2, _nan_loss)
    guard.run(2, _nan_loss)
    with pytest.raises(RoundsFailing, match=r"3 rounds in a row failed .*lower inner.lr"):
        guard.run(2, _nan_loss)
    assert worker.state.round == 0 and worker.state.is_finite()  # what the peer then checkpoints

    # with no good round at all, the checkpoint is what the peer rolls back to
    worker, sync, guard, waits = _setup(rollback_after=1, fallback=lambda: saved["state"])
    sync.adopt(Offer(_poisoned(worker), True), "poison")
    guard.run(1, _nan_loss)
    assert worker.tag() == Offer(saved["state"], True).tag and _theta_is_anchor(worker)


@pytest.mark.timeout(60)
def test_a_loss_that_turns_nan_at_the_same_round_from_any_state_still_gives_up():
    worker, sync, guard, waits = _setup()

    def attempt():
        if worker.state.round >= 2:  # round 3, whatever it starts from (its data, its inner lr) turns NaN
            _nan_loss()
        return worker.run_round(_SelfReducer(), RoundRules(), sync)

    ran: list[bool] = []
    with pytest.raises(RoundsFailing, match="10 rounds in a row failed"):
        for _ in range(30):
            assert not guard.pause()
            ran.append(guard.run(worker.state.round + 1, attempt) is not None)
    # two good rounds, then three times: 3 failures, a rollback to round 1 and round 2 replayed, which does not
    # end the row; the 10th failure gives up
    assert ran == [True, True, *([False, False, False, True] * 3)], ran
    assert guard.rollbacks == 3 and worker.state.round == 2 and worker.state.is_finite()
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


def test_verdict_counts_non_finite_rounds_per_state_and_resets_on_success():
    _, _, guard, _ = _setup(rollback_after=3, max_failed=10, backoff=0.5, backoff_max=60.0)
    v = [guard.verdict(True, 7), guard.verdict(True, 7), guard.verdict(True, 8)]  # another state: counted afresh
    assert [x.nonfinite for x in v] == [1, 2, 1] and not any(x.rollback for x in v)
    assert [x.wait for x in v] == [0.0, 0.5, 1.0]
    assert guard.verdict(False, 8).nonfinite == 0  # an error in between ends the streak
    assert [guard.verdict(True, 8).rollback for _ in range(3)] == [False, False, True]
    assert guard.failures == 7 and not guard.verdict(True, 8).give_up
    assert [guard.verdict(True, 8).give_up for _ in range(2)] == [False, True]  # the 10th
    guard.succeeded(0)
    assert guard.verdict(True, 8) == Verdict(failures=1, nonfinite=1, wait=0.0, rollback=False, give_up=False)
    guard.verdict(True, 9, at_round=5)
    guard.succeeded(4)  # a replay of an earlier round: the row goes on
    assert guard.failures == 2
    guard.succeeded(5)
    assert guard.failures == 0


def test_config_checks_the_new_fields():
    with pytest.raises(ConfigError, match="swarm.rollback_after"):
        load_config(TINY, ["swarm.max_failed_rounds=2"])  # rollback_after (3) would never be reached
    with pytest.raises(ConfigError, match="swarm.dht_timeout"):
        load_config(TINY, ["swarm.dht_timeout=0"])
    cfg = load_config(TINY, ["swarm.max_failed_rounds=1", "swarm.rollback_after=1"])
    assert (cfg.swarm.dht_timeout, cfg.swarm.max_failed_rounds, cfg.swarm.rollback_after) == (10.0, 1, 1)


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_lone_peer_with_a_nan_anchor_rolls_back_and_finishes(spawn, tmp_path):
    solo = ["train.rounds=3", "swarm.matchmaking_time=1", "swarm.request_timeout=0.5", "train.checkpoint_every=1"]
    started = time.monotonic()
    nan_peer = [sys.executable, str(ROOT / "tests" / "nan_peer.py"), "2"]
    peer = start_peer(spawn, [], tmp_path / "p", *solo, prefix=nan_peer)
    assert peer.wait(timeout=100) == 0, peer.describe()
    wall = time.monotonic() - started
    print(f"lone peer with a NaN anchor: {wall:.1f}s")
    assert "POISONED 2" in peer.stdout_lines, peer.describe()
    rolled = r"inner loss non-finite for 3 rounds from round 2 \(checksum \w+\): rolling back to round 1 "
    assert re.search(rolled, peer.stderr), peer.stderr
    discarded = re.findall(r"round \d+ discarded", peer.stderr)
    assert len(discarded) == 3, discarded  # no spinning: three attempts, then the rollback
    assert len(re.findall(r"waiting \d+s before the next attempt", peer.stderr)) == 2
    recs = records(tmp_path / "p")
    steps = [r["outer_step"] for r in recs]
    assert steps == [1, 2, 2, 3], steps  # round 2 again, from round 1's state
    assert all(math.isfinite(r["train_loss"]) for r in recs)
    final, _ = load_outer_state(latest_checkpoint(tmp_path / "p" / "checkpoints"))
    assert final.round == 3 and all(torch.isfinite(t).all() for t in final.tensors())
    assert "Traceback" not in peer.stderr

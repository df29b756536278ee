"""The inner phase: time-budgeted rounds (inner.round_seconds) end on the swarm's clock, whatever a peer's speed."""

import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.engine import Worker
from p2p_diloco.inner import lr_at, round_end

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _batches(seed, vocab=257, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, shape, generator=g)


def test_round_end_is_the_next_multiple_and_never_a_sliver_after_the_last_round():
    assert round_end(10.0, 123.4) == 130.0
    assert round_end(10.0, 130.0) == 140.0  # on a boundary: the next one
    # the previous round ended at 130 and its exchange finished early (129.9): the next round ends at 140, not 130
    assert round_end(10.0, 129.9, after=130.0) == 140.0
    assert round_end(10.0, 131.0, after=130.0) == 140.0
    assert round_end(10.0, 145.0, after=130.0) == 150.0  # a long exchange: the boundary after it


def test_negative_round_seconds_is_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="inner.round_seconds"):
        load_config(TINY, ["inner.round_seconds=-1"])


def test_workers_of_different_speeds_end_a_budgeted_round_together_with_the_same_schedule():
    """Two workers, one made ~3x slower (a delay per step, as on a slower GPU): both stop by the round's end
    (plus at most one of their own steps), the fast one takes more steps, and both finish at the lr that the
    round's clock gives, not their step counts (which would put the slow one far earlier in the schedule)."""
    span = 3.0  # seconds a round: several steps each even on a loaded machine (at 1.5 s the slow one took 3)
    sets = ["inner.steps=1000", f"inner.round_seconds={span}", "train.rounds=4", "inner.warmup_steps=0"]
    cfg = load_config(TINY, sets)
    fast, slow = Worker(cfg, 257, _batches(0)), Worker(cfg, 257, _batches(1))
    step_seconds = []

    def slow_step(k: int, loss: float) -> None:
        time.sleep(2 * step_seconds[-1] / len(step_seconds))
        slow_ended.append(time.time())

    time.sleep(round_end(span, time.time()) - time.time() + 0.01)  # each starts its round at its beginning
    t0 = time.time()
    ended = [t0]  # when each step ended (the next one begins there)
    fast_stats = fast.train_inner(lambda k, loss: (ended.append(time.time()), step_seconds.append(ended[-1] - t0)))
    end = fast.round_ends_at
    assert end - span <= t0 < end and ended[-2] < end  # no step began after the round's end
    # the slow worker starts as the fast one's round ends: the next window of the same grid
    time.sleep(max(0.0, end - time.time() + 0.01))
    slow_ended = [time.time()]
    slow_stats = slow.train_inner(slow_step)
    assert slow.round_ends_at == end + span
    # the fast one takes more steps; on a loaded machine (full suite, 2 cores) it once got only 2 steps into the round
    # (its first includes the warm-up), as many as the slow one: strictly more is asserted from 4 steps on, where a
    # worker 3x slower cannot keep up
    assert 1 <= slow_stats.steps <= fast_stats.steps < 1000, (slow_stats.steps, fast_stats.steps)
    assert slow_stats.steps < fast_stats.steps or fast_stats.steps < 4, (slow_stats.steps, fast_stats.steps)
    assert slow_stats.tokens <= fast_stats.tokens

    # the lr of each one's last step is the round's clock when that step began (rounds done 0 + its share of the
    # round) x H, or later: at most the lr of the moment the step before it ended. Bounded by the measured times,
    # not by "the last 10% of the round": on a loaded machine one step can take longer than that
    for worker, stats, ends in ((fast, fast_stats, ended), (slow, slow_stats, slow_ended)):
        began = (ends[-2] - (worker.round_ends_at - span)) / span  # the last step's start, as a share of the round
        # the last step is late in the round: a step stops the round only when one more of them would end past it,
        # so the last one began within two of the longest steps seen of the end (the slow one's sleep included)
        longest = max(b - a for a, b in zip(ends, ends[1:]))
        assert ends[-2] > worker.round_ends_at - 2 * longest - 0.01, (stats.steps, began, longest)
        last_lr = worker.inner.optimizer.param_groups[0]["lr"]
        assert last_lr <= lr_at(1000 * began, cfg.inner, 4 * 1000) * (1 + 1e-9), (stats.steps, last_lr, began)
        finished = (ends[-1] - (worker.round_ends_at - span)) / span  # and no later than the clock as it ended
        assert last_lr >= lr_at(1000 * finished, cfg.inner, 4 * 1000) * (1 - 1e-9), (stats.steps, last_lr, finished)
    # by its step count (a few dozen at most) the slow one would be near the schedule's top; by the clock it is
    # further down the cosine
    by_steps = lr_at(slow_stats.steps, cfg.inner, 4 * 1000)
    assert slow.inner.optimizer.param_groups[0]["lr"] < by_steps


def test_a_round_whose_end_has_all_but_passed_still_takes_one_step():
    cfg = load_config(TINY, ["inner.steps=50", "inner.round_seconds=1"])
    worker = Worker(cfg, 257, _batches(0))
    stats = worker.inner.run(
        worker.batches, 50, 0, worker.autocast, worker.device, deadline=time.time() - 1.0, position=lambda k: 0.0
    )
    assert stats.steps == 1


def test_continue_after_takes_a_copy_of_the_moments_and_a_later_place_in_one_schedule():
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=3"])
    first, a, b = (Worker(cfg, 257, _batches(seed)) for seed in (0, 1, 2))
    first.train_inner()
    saved = first.inner.optimizer.state_dict()
    for w in (a, b):
        w.inner.continue_after(2, saved)
        assert (w.inner.step_offset, w.inner.total_steps) == (2, 8)
    moments = [w.inner.optimizer.state[w.inner.optimizer.param_groups[0]["params"][0]]["exp_avg"] for w in (a, b)]
    assert torch.equal(moments[0], moments[1]) and moments[0].data_ptr() != moments[1].data_ptr()
    a.train_inner()  # a's steps must not move b's moments: each worker has its own copy
    assert not torch.equal(moments[0], moments[1])
    assert a.inner.optimizer.param_groups[0]["lr"] == lr_at(2 + 1, cfg.inner, 8)  # its last step was step 3 of 8

"""The simulator's one-model modes and its warm start: ordinary training for reference and for a start.

Inputs:  a Config, the vocabulary size, the K shards' batch iterators (int64 [B, T]); for the warm start also the
         eval sets and the pool of DiLoCo workers to start from its weights.
Output:  ``Local.round`` (sync: each step the mean gradient of one batch per shard; single: K x H steps, batches in
         turn from the K shards) and ``local_rounds`` (its RoundResults, sync's fp32 gradient all-reduce a step counted
         as bytes); ``warm_start`` (``train.warm_start_steps`` such steps, then every worker starts from the weights:
         what to report of it, see simulate.py's docstring).
State:   Local's one Worker (its anchor mirrors θ after each round: no outer step).
Failure: NonFiniteLossError from the inner steps, as in a Worker's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from p2p_diloco.config import Config
from p2p_diloco.engine import Worker, evaluate
from p2p_diloco.inner import InnerStats
from p2p_diloco.outer import OuterState
from p2p_diloco.rounds import ReduceInfo, RoundResult, fp32_bytes_sent

__all__ = ["Local", "local_rounds", "warm_start"]

log = logging.getLogger("p2p_diloco.simulate")


def _round_robin(iterators: list[Iterator[torch.Tensor]]) -> Iterator[torch.Tensor]:
    while True:
        for it in iterators:
            yield next(it)


class Local:
    """The sync and single modes: one model whose inner optimizer sees every shard."""

    def __init__(
        self, cfg: Config, vocab_size: int, shards: list[Iterator[torch.Tensor]], mode: str, steps: int | None = None
    ) -> None:
        k = len(shards)
        steps_per_round = steps if steps is not None else cfg.inner.steps * (k if mode == "single" else 1)
        cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, steps=steps_per_round))
        self.worker = Worker(cfg, vocab_size, _round_robin(shards))
        self.shards, self.mode, self.steps = shards, mode, steps_per_round

    def round(self) -> InnerStats:
        w = self.worker
        if self.mode == "single":
            stats = w.train_inner()
        else:
            stats = InnerStats()
            start = time.perf_counter()
            for k in range(self.steps):
                losses = []
                for it in self.shards:  # the sum of K shards' gradients, then / K: the mean gradient
                    loss, tokens = w.inner.compute_grads(it, w.autocast, w.device)
                    losses.append(loss)
                    stats.tokens += tokens
                for p in w.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(len(self.shards))
                w.inner.apply(w.state.round * self.steps + k)
                stats.losses.append(sum(losses) / len(losses))
                stats.steps += 1
            stats.seconds = time.perf_counter() - start
        # No outer step here: the anchor mirrors θ so that checksums and comparisons see the model.
        w.state = OuterState(OuterState.from_params(w.model.parameters()).anchor, w.state.momentum, w.state.round + 1)
        return stats


def warm_start(
    cfg: Config,
    vocab_size: int,
    shards: list[Iterator[torch.Tensor]],
    eval_sets: dict[str, torch.Tensor],
    pool: list[Worker],
) -> dict[str, Any]:
    """``train.warm_start_steps`` steps of ordinary training (``train.warm_start``: single or sync) from the seed's
    init; every worker of ``pool`` then starts from its weights (and, ``warm_start_schedule`` continue, from its
    moments and place in one lr schedule). Returns what to report of it."""
    kind, steps, schedule = cfg.train.warm_start, cfg.train.warm_start_steps, cfg.train.warm_start_schedule
    warm_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, rounds=1), inner=dataclasses.replace(cfg.inner, round_seconds=0.0)
    )
    local = Local(warm_cfg, vocab_size, shards, kind, steps=steps)
    if schedule == "continue":  # the first `steps` of one schedule over them and the run's own
        local.worker.inner.total_steps = steps + pool[0].inner.total_steps
    stats = local.round()
    after = evaluate(local.worker.model, eval_sets, cfg.data.batch_size, cfg)
    log.info("warm start: %d %s steps, %d tokens, eval loss %.4f", steps, kind, stats.tokens, after["all"])
    moments = local.worker.inner.optimizer.state_dict()
    for w in pool:
        w.load_state(OuterState.from_params(local.worker.state.anchor))  # a copy each; zero outer momentum
        if schedule == "continue":
            w.inner.continue_after(steps, moments)
    sent = fp32_bytes_sent(pool[0].num_params, len(shards)) * steps if kind == "sync" else 0  # a gradient a step
    return {
        "kind": kind,
        "steps": steps,
        "schedule": schedule,
        "tokens": stats.tokens,
        "bytes_sent_per_worker": sent,
        "eval_loss": after["all"],
        "seconds": stats.seconds,
    }


def local_rounds(
    local: Local, worker: Worker, eval_sets: dict[str, torch.Tensor], step_bytes: int
) -> Iterator[RoundResult]:
    """sync/single: one model, a round of K x H batches each; sync sends one fp32 all-reduce per step."""
    for r in range(1, worker.cfg.train.rounds + 1):
        inner = local.round()
        sent = step_bytes * (local.steps if local.mode == "sync" else 0)
        info = ReduceInfo(group_size=len(local.shards), complete=True, attempts=1, bytes_sent=sent, bytes_received=sent)
        yield RoundResult(r, inner, info, worker.state.checksum(), 0.0, worker.maybe_evaluate(eval_sets))

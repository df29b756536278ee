"""The simulator's rounds of K workers: the same contribute/settle (and launch/drain) as a swarm peer, in one process.

Inputs:  the pool of K Workers, the round's RoundRules, the eval sets (worker 0 evaluates), the Attack and the
         AggregateStats for ``sim_reduce.reduce_round``.
Output:  ``diloco_rounds``: every worker in every round (blocking, or eager/delayed overlap); ``straggler_rounds``:
         fixed H with workers of different speeds, nobody waiting for a slower one (simulate.py's docstring), with
         the simulated seconds since the last group, and each worker's counted tokens and lost rounds added up.
         Each yields worker 0's (or the group's first in-sync member's) RoundResult with every member's inner stats.
State:   straggler_rounds: the latest applied outer state (``_Swarm``), what a catching-up or resyncing worker
         downloads.
Failure: NonFiniteUpdateError when a worker could not apply the round's mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from p2p_diloco.engine import Worker
from p2p_diloco.inner import InnerStats
from p2p_diloco.outer import NonFiniteUpdateError
from p2p_diloco.protocol import Action, Gathered, RoundRules, RoundTag, majority_tag, split_groups
from p2p_diloco.robust import AggregateStats
from p2p_diloco.rounds import Contribution, ReduceInfo, RoundResult
from p2p_diloco.sim_reduce import Attack, reduce_round

__all__ = ["diloco_rounds", "straggler_rounds"]


def diloco_rounds(
    pool: list[Worker],
    rules: RoundRules,
    eval_sets: dict[str, torch.Tensor],
    attack: Attack,
    stats: AggregateStats,
) -> Iterator[RoundResult]:
    """Every round of the K workers through the same contribute/settle (and, with ``swarm.overlap`` eager, the same
    launch/drain) as a swarm peer, with an in-process aggregation (``swarm.aggregation``) standing in for the
    reducers. Eager: round r's mean is settled by each worker after ``swarm.overlap_steps`` of its round r+1 inner
    steps, the last one after the loop."""
    cfg = pool[0].cfg
    sent = 0  # what a worker sent in the round being settled (reduce_round measures it)

    def info(mine: list[Contribution]) -> ReduceInfo:
        gathered = Gathered({f"worker{k}": c.payload for k, c in enumerate(mine)})
        groups = len(split_groups([True] * len(pool), cfg.swarm.target_group_size))
        return ReduceInfo(len(pool), True, 1, bytes_sent=sent, bytes_received=sent, gathered=gathered, groups=groups)

    def drainer(k: int, w: Worker, into: list[RoundResult | None]) -> Callable[[], None]:
        def drain() -> None:
            into[k] = w.drain(rules, eval_sets=eval_sets if k == 0 else None)

        return drain

    launched: list[Contribution] = []
    for _ in range(cfg.train.rounds):
        if cfg.swarm.overlap == "none":
            mine = [w.contribute() for w in pool]
            averaged, sent = reduce_round(cfg, mine, attack, stats)
            results = [
                w.settle(c, averaged, info(mine), rules, eval_sets=eval_sets if k == 0 else None)
                for k, (w, c) in enumerate(zip(pool, mine, strict=True))
            ]
            yield _applied(pool, mine, results)
            continue
        drained: list[RoundResult | None] = [None] * len(pool)
        mine = [w.contribute(drain=drainer(k, w, drained)) for k, w in enumerate(pool)]
        if launched:
            yield _applied(pool, launched, drained)
        futures = [Future() for _ in pool]
        launched = [w.launch(c, lambda _, f=f: f) for w, c, f in zip(pool, mine, futures, strict=True)]
        averaged, sent = reduce_round(cfg, launched, attack, stats)
        for future in futures:
            future.set_result((averaged, info(launched)))
    if launched:
        drained = [None] * len(pool)
        for k, w in enumerate(pool):
            drainer(k, w, drained)()
        yield _applied(pool, launched, drained)


class _Swarm:
    """The simulator's stand-in for the swarm's state sharing (rounds.SharedState) under fixed H with workers of
    different speeds: ``latest`` is the outer state of the last group whose mean was applied, what a peer that
    catches up or resyncs downloads."""

    def __init__(self, worker: Worker) -> None:
        self.latest = worker.state.copy()

    def of(self, worker: Worker) -> _WorkerSync:
        return _WorkerSync(self, worker)


@dataclasses.dataclass
class _WorkerSync:
    swarm: _Swarm
    worker: Worker

    def apply_outer(self, averaged: list[torch.Tensor], consensus: bool) -> float:
        lr = self.worker.apply_outer(averaged)
        if consensus:
            self.swarm.latest = self.worker.state.copy()
        return lr

    def catch_up(self, group: RoundTag, averaged: list[torch.Tensor]) -> bool:
        """The group's post-round state (an in-sync member settles first and leaves it in ``latest``)."""
        if self.swarm.latest.round != group.round + 1:
            return False
        self.worker.load_state(self.swarm.latest.copy())
        return True

    def resync(self, after_local_step: bool) -> bool:
        latest = self.swarm.latest
        if after_local_step and latest.round < self.worker.state.round:
            return False
        self.worker.load_state(latest.copy())
        return True


def straggler_rounds(
    pool: list[Worker],
    rules: RoundRules,
    eval_sets: dict[str, torch.Tensor],
    stats: AggregateStats,
    contributed: list[int],
    lost: list[int],
) -> Iterator[tuple[RoundResult, float]]:
    """Fixed H, workers of different speeds, nobody waiting for a slower one (module doc): (the round as its first
    in-sync member settled it, evaluated there; the simulated seconds since the last group).
    ``contributed[k]`` / ``lost[k]`` are added up: worker k's tokens whose Δ counted, its rounds that did not."""
    cfg, h, eps = pool[0].cfg, pool[0].cfg.inner.steps, 1e-9
    swarm = _Swarm(pool[0])
    names = [f"worker{k}" for k in range(len(pool))]
    work = [w.contribute() for w in pool]  # each worker's round in progress, trained from the state it holds
    ready = [h / w.speed for w in pool]
    now = 0.0
    for _ in range(cfg.train.rounds):
        ordered = sorted(ready)
        at = ordered[1] if len(pool) > 1 else ordered[0]  # the moment two workers are ready
        group = [k for k in range(len(pool)) if ready[k] <= at + eps]
        gathered = Gathered({names[k]: work[k].payload for k in group})
        factors = rules.weight_factors(gathered)
        mine = [work[k] for k in group]
        averaged, sent = reduce_round(cfg, mine, Attack("none", 1.0), stats, [factors.get(names[k]) for k in group])
        top = majority_tag(gathered)
        first = sorted(group, key=lambda k: (work[k].payload.tag != top, k))  # in-sync members settle first
        shown: RoundResult | None = None
        for k in first:
            groups = len(split_groups([True] * len(group), cfg.swarm.target_group_size))
            info = ReduceInfo(
                len(group), True, 1, bytes_sent=sent, bytes_received=sent, gathered=gathered, groups=groups
            )
            result = pool[k].settle(
                work[k], averaged, info, rules, swarm.of(pool[k]), eval_sets=eval_sets if k == first[0] else None
            )
            if names[k] in factors:
                contributed[k] += work[k].inner.tokens
            else:
                lost[k] += 1
            if k == first[0]:
                shown = result
        for k in group:  # every member starts its next round from the group's new state
            work[k] = pool[k].contribute()
            ready[k] = at + h / pool[k].speed
        if shown is None:
            raise NonFiniteUpdateError(f"round {swarm.latest.round}: the group's first member could not apply it")
        shown.inner = _merge([c.inner for c in mine])
        yield shown, at - now
        now = at


def _applied(pool: list[Worker], mine: list[Contribution], results: list[RoundResult | None]) -> RoundResult:
    """Worker 0's result of a round every worker applied (``mine``: their contributions to it), with the inner
    stats of all."""
    if any(r is None or r.decision is not Action.APPLY for r in results):
        raise NonFiniteUpdateError(f"round {pool[0].state.round + 1}: a worker could not apply the mean")
    first = results[0]
    first.inner = _merge([c.inner for c in mine])
    return first


def _merge(stats: list[InnerStats]) -> InnerStats:
    merged = InnerStats()
    for s in stats:
        merged.steps += s.steps
        merged.tokens += s.tokens
        merged.seconds += s.seconds
        merged.losses.extend(s.losses)
        merged.peak_memory_bytes = max(merged.peak_memory_bytes, s.peak_memory_bytes)
    return merged

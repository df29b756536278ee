"""run_simulation: K workers in one process, the numerical reference the swarm is checked against.

Usage:
    run_simulation --config configs/tiny.yaml --mode diloco --workers 4 --out runs/sim
    run_simulation --config configs/tiny.yaml --mode sync --workers 4 --out runs/sync --set inner.steps=50
    run_simulation --config configs/tiny.yaml --workers 3 --speeds 1,1,0.33 --set inner.round_seconds=25 --out runs/t
    run_simulation --config configs/tiny.yaml --out runs/sim --threads 1    # beside other work on a shared machine
    run_simulation --config configs/tiny.yaml --workers 4 --out runs/w --set train.warm_start=sync \
        --set train.warm_start_steps=500                                 # 500 data-parallel steps first, as the paper

Modes (all see the same tokens: K shards x H steps x B x T per round):
    diloco  K workers, H inner steps each, in-process weighted mean of Δ, Nesterov outer step
    fedavg  the same with outer SGD lr 1, momentum 0
    sync    one model; each step averages the K shards' gradients (synchronous data-parallel)
    single  one model; K x H steps per round, batches taken in turn from the K shards

diloco/fedavg aggregate the K Δ with ``robust.aggregate_flat`` under ``swarm.aggregation`` (clip factor
``swarm.aggregation_clip``, parts of ``swarm.part_size_bytes / 4`` values), as the swarm's reducers do; robust rules
weight each worker by ``robust.trusted_weight`` (0 when its wire weight is not the tokens it declared), ``mean`` by the
wire weight as is. ``--attack`` makes workers 0 .. K-1 hostile (``--attackers K``, default 1; diloco/fedavg only):
``negate`` sends -X x its Δ, ``weight`` sends its Δ with wire weight X x its tokens while declaring its tokens, ``alie``
sends μ - X·σ (the coordinate-wise mean and standard deviation of every worker's honest Δ this round: an omniscient
"a little is enough" coalition, arXiv 1902.06156), ``zeros`` sends a Δ of zeros with its tokens (a free-rider)
(X = ``--attack-scale``).

Speeds (diloco/fedavg): ``--speeds`` gives each worker's inner steps per simulated second (default 1 each). The
simulator's clock: with ``inner.round_seconds`` a round takes round_seconds and worker k takes round_seconds x
speed_k steps (at least 1, at most inner.steps), its lr following the round's clock as a swarm peer's does
(engine.Worker.train_inner). With fixed H and equal speeds a round takes H / speed seconds. With fixed H and
unequal speeds nobody waits for a slower worker, as no swarm peer does (join.Membership.expected_members): worker k
is ready H / speed_k seconds after it started its round; a group forms as soon as two workers are ready, with every
worker ready at that moment (a worker ready alone waits for the next one, as a peer does: ``wait_for_group``); each
member's Δ counts as ``protocol.decide`` says (a straggler up to ``swarm.max_staleness`` rounds behind the group at
``RoundRules.stale_weight`` of its tokens, then catches up; further behind it resyncs, its round lost), and every
member starts its next round from the group's new state; the others keep training. ``simulated_seconds`` in
results.json is that clock, for comparisons at equal time; ``contributed_tokens_per_worker`` and
``lost_rounds_per_worker`` say whose work counted.

Warm start (``train.warm_start`` single or sync, ``train.warm_start_steps`` N): before round 1, N steps of ordinary
training of one model from the seed's init (single: one batch a step, in turn from the K shards; sync: each step the
mean gradient of one batch per shard); every worker (every mode) then starts from its weights with zero outer
momentum. ``train.warm_start_schedule`` restart: the warm start has an inner lr schedule of its own over its N steps
and the workers start with fresh inner moments; continue: the warm start is the first N steps of one schedule over N
+ the rounds' steps, and every worker goes on with a copy of its inner moments (so a sync run warm-started this way is
the same run as one without it, step for step). Its tokens are not in
``tokens_per_worker`` (so runs with the same warm start compare at equal tokens after it); results.json's
``warm_start`` has its kind, steps, tokens, the bytes a worker would send in it (sync: an fp32 gradient all-reduce a
step; not in ``bytes_sent_per_worker``), eval loss and seconds, and ``eval_loss_per_round["0"]`` is its eval loss.

Threads: ``--threads N`` (or ``train.threads``; 0, the default: auto) sets torch's CPU threads before anything is
built (p2p_diloco/threads.py): the K workers take turns in this process, so auto gives every one of them all the
cores this process may use. ``simulate()`` itself leaves torch's threads as its caller set them.

Inputs:  a config file + overrides; the data pipeline is built with data.num_shards = K.
Output:  OUT/results.json (final_eval_loss, eval_loss_per_round, tokens_per_worker, simulated_seconds,
         bytes_sent_per_worker (what the swarm would send, fp32 butterfly), wall_seconds, attack (kind, scale,
         worker), aggregation (rule, clip, counts of excluded and clipped worker-parts), ...),
         OUT/final_state/ (the final outer state, see checkpoint.py; sync/single: the model's params),
         OUT/metrics.jsonl (one record per round), OUT/run_metadata.json; the same records to OUT/tensorboard and
         OUT/wandb when ``logging`` turns them on (trackers.py; wandb run named after OUT, its config the resolved
         config plus mode and workers).
Failure: bad config or data, or a configured tracker whose package is missing or that cannot start -> one-line
         message and exit 2, before round 1; a non-finite loss or update -> exit 3 with the round named; results of
         completed rounds stay in metrics.jsonl (and the trackers, closed on every way out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.checkpoint import save_outer_state
from p2p_diloco.codec import get_codec, roundtrip_parts
from p2p_diloco.config import Config, ConfigError, load_config, write_run_metadata
from p2p_diloco.data import DataError, DataPipeline
from p2p_diloco.engine import Worker, evaluate
from p2p_diloco.inner import InnerStats, NonFiniteLossError
from p2p_diloco.outer import NonFiniteUpdateError, OuterState
from p2p_diloco.protocol import Action, Gathered, RoundRules, RoundTag, majority_tag, split_groups
from p2p_diloco.robust import AggregateStats, aggregate_flat, max_round_tokens, trusted_weight
from p2p_diloco.rounds import Contribution, ReduceInfo, RoundResult, fp32_bytes_sent
from p2p_diloco.threads import add_threads_flag, apply_threads
from p2p_diloco.trackers import Trackers, require

__all__ = ["ATTACKS", "MODES", "simulate", "main"]

MODES = ("diloco", "fedavg", "sync", "single")
ATTACKS = ("none", "negate", "weight", "alie", "zeros")  # what workers 0 .. K-1 do in diloco/fedavg (module doc)
log = logging.getLogger("p2p_diloco.simulate")


def _round_robin(iterators: list[Iterator[torch.Tensor]]) -> Iterator[torch.Tensor]:
    while True:
        for it in iterators:
            yield next(it)


class _Local:
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


def _warm_start(
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
    local = _Local(warm_cfg, vocab_size, shards, kind, steps=steps)
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


def simulate(
    cfg: Config,
    mode: str,
    workers: int,
    out: Path,
    attack: str = "none",
    attack_scale: float = 1000.0,
    speeds: list[float] | None = None,
    attackers: int = 1,
) -> dict[str, Any]:
    """Run ``cfg.train.rounds`` rounds of ``mode`` with ``workers`` workers (workers 0 .. attackers-1 doing
    ``attack``, worker k taking ``speeds[k]`` steps per simulated second); write OUT files."""
    if mode not in MODES:
        raise ConfigError(f"--mode {mode!r} is invalid: must be one of {', '.join(MODES)}")
    if attack not in ATTACKS:
        raise ConfigError(f"--attack {attack!r} is invalid: must be one of {', '.join(ATTACKS)}")
    if attack != "none" and mode not in ("diloco", "fedavg"):
        raise ConfigError(f"--attack {attack} needs --mode diloco or fedavg (there is no aggregation in {mode})")
    if attack != "none" and not (attack_scale > 0 and attack_scale < float("inf")):
        raise ConfigError(f"--attack-scale {attack_scale!r} is invalid: must be a finite number > 0")
    if workers < 1:
        raise ConfigError(f"--workers {workers} is invalid: must be >= 1")
    if attack != "none" and not 1 <= attackers < workers:
        raise ConfigError(f"--attackers {attackers} is invalid: must be in [1, {workers - 1}] (some worker is honest)")
    if speeds is not None and (
        len(speeds) != workers
        or not all(math.isfinite(s) and s > 0 for s in speeds)
        or mode not in ("diloco", "fedavg")
    ):
        raise ConfigError(
            f"--speeds {','.join(map(str, speeds))} is invalid: needs --mode diloco or fedavg and one finite speed > 0 "
            f"per worker ({workers})"
        )
    uneven = speeds is not None and len(set(speeds)) > 1 and cfg.inner.round_seconds <= 0
    if uneven and (attack != "none" or cfg.swarm.overlap != "none"):
        raise ConfigError(
            "--speeds of different workers with fixed H (inner.round_seconds 0) are simulated without --attack and "
            "with swarm.overlap none only"
        )
    require(cfg.logging)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_shards=workers, shard_index=None))
    if mode == "fedavg":  # FedAvg is DiLoCo with plain outer SGD at lr 1
        cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, lr=1.0, momentum=0.0, lr_warmup_rounds=0))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = DataPipeline(cfg.data, cfg.seed)
    eval_sets = data.eval_sets()
    shards = [data.train_batches(k, cfg.seed) for k in range(workers)]
    write_run_metadata(
        out, cfg, mode=mode, workers=workers, torch_threads=torch.get_num_threads(), shard_histograms=data.histograms()
    )

    if mode in ("diloco", "fedavg"):
        pool = [Worker(cfg, data.vocab_size, it, speed=(speeds or [1.0] * workers)[k]) for k, it in enumerate(shards)]
        model = pool[0].model
    else:
        local = _Local(cfg, data.vocab_size, shards, mode)
        pool, model = [local.worker], local.worker.model
    num_params = pool[0].num_params
    rules = RoundRules.from_config(cfg.swarm)
    hostile = _Attack(attack, attack_scale, attackers)
    agg_stats = AggregateStats()

    initial = evaluate(model, eval_sets, cfg.data.batch_size, cfg)
    warm: dict[str, Any] | None = None
    if cfg.train.warm_start != "none":
        warm = _warm_start(cfg, data.vocab_size, shards, eval_sets, pool)
    eval_per_round: dict[int, float] = {0: warm["eval_loss"] if warm else initial["all"]}
    bytes_sent, tokens_per_worker, clock = 0, 0, 0.0
    contributed, lost = [0] * len(pool), [0] * len(pool)
    round_clock = cfg.inner.round_seconds if cfg.inner.round_seconds > 0 else cfg.inner.steps / min(speeds or [1.0])
    config = {**cfg.to_dict(), "mode": mode, "workers": workers}
    trackers = Trackers.open(
        cfg.logging, out, out.resolve().name, f"{cfg.swarm.run_id}-sim", config, "tokens_per_worker"
    )
    metrics = (out / "metrics.jsonl").open("w")
    log.info(
        "%s, %d workers, %d params, %d rounds, aggregation %s (clip %g), attack %s; initial eval loss %.4f",
        mode,
        workers,
        num_params,
        cfg.train.rounds,
        cfg.swarm.aggregation,
        cfg.swarm.aggregation_clip,
        f"{attack} x{attack_scale:g} by worker 0" if attack != "none" else "none",
        initial["all"],
    )
    try:
        if uneven:
            rounds = _straggler_rounds(pool, rules, eval_sets, agg_stats, contributed, lost)
        else:
            if mode in ("diloco", "fedavg"):
                synchronous = _diloco_rounds(pool, rules, eval_sets, hostile, agg_stats)
            else:
                synchronous = _local_rounds(local, pool[0], eval_sets, fp32_bytes_sent(num_params, workers))
            rounds = ((result, round_clock) for result in synchronous)
        for r, (result, seconds) in enumerate(rounds, start=1):
            inner, evals = result.inner, result.eval_loss
            tokens_per_worker += inner.tokens // workers
            clock += seconds
            bytes_sent += result.reduce.bytes_sent
            if evals is not None:
                eval_per_round[r] = evals["all"]
            record = {"mode": mode, "tokens_per_worker": tokens_per_worker, **result.record()}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            trackers.write(record)
            log.info(
                "round %d/%d  train %.4f  eval %s  %.0f tok/s  %.1fs elapsed",
                r,
                cfg.train.rounds,
                inner.mean_loss,
                f"{evals['all']:.4f}" if evals else "-",
                inner.tokens_per_second,
                time.perf_counter() - started,
            )
    finally:
        metrics.close()
        trackers.close()

    if mode in ("diloco", "fedavg") and pool[0].fragments.count > 1:
        pool[0].state.copy_to(model.parameters())  # the replicated state, not θ's fragments still to be exchanged
    final = evaluate(model, eval_sets, cfg.data.batch_size, cfg)
    results = {
        "mode": mode,
        "workers": workers,
        "num_params": num_params,
        "rounds": cfg.train.rounds,
        "inner_steps": cfg.inner.steps,
        "initial_eval_loss": initial["all"],
        "warm_start": warm,
        "final_eval_loss": final["all"],
        "final_eval_loss_per_label": {k: v for k, v in final.items() if k != "all"},
        "eval_loss_per_round": {str(k): v for k, v in eval_per_round.items()},
        "tokens_per_worker": tokens_per_worker,
        "speeds": speeds or [1.0] * workers,
        "simulated_seconds": clock,
        "contributed_tokens_per_worker": contributed if uneven else None,
        "lost_rounds_per_worker": lost if uneven else None,
        "bytes_sent_per_worker": bytes_sent,
        "wall_seconds": time.perf_counter() - started,
        "final_checksum": pool[0].state.checksum(),
        "attack": {"kind": attack, "scale": attack_scale if attack != "none" else None, "workers": hostile.workers},
        "aggregation": {
            "rule": cfg.swarm.aggregation if mode in ("diloco", "fedavg") else None,
            "clip": cfg.swarm.aggregation_clip,
            "min_cosine": cfg.swarm.min_cosine,
            **agg_stats.as_dict(),
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    save_outer_state(out / "final_state", pool[0].state, {"mode": mode, "workers": workers})
    return results


@dataclasses.dataclass
class _Attack:
    """What workers 0 .. count-1 send instead of their honest Δ and weight (module doc); ``none``: nothing changes."""

    kind: str
    scale: float
    count: int = 1

    @property
    def workers(self) -> list[int]:
        return [] if self.kind == "none" else list(range(self.count))

    def sent(self, mine: list[Contribution]) -> tuple[list[list[torch.Tensor]], list[float]]:
        """Each worker's Δ and wire weight as a reducer receives them."""
        honest = [c.pseudo_grad for c in mine]
        deltas, wire = list(honest), [float(c.inner.tokens) for c in mine]
        if self.kind == "alie" and len(mine) > 1:  # every colluder sends the same shift along the honest spread
            stacked = [torch.stack(ts) for ts in zip(*honest, strict=True)]
            shifted = [s.mean(dim=0) - self.scale * s.std(dim=0) for s in stacked]
        for k in self.workers if len(mine) > 1 else []:  # a round of one worker has nobody to attack
            if self.kind == "negate":
                deltas[k] = [d.mul(-self.scale) for d in honest[k]]
            elif self.kind == "weight":
                wire[k] = self.scale * wire[k]
            elif self.kind == "zeros":
                deltas[k] = [torch.zeros_like(d) for d in honest[k]]
            elif self.kind == "alie":
                deltas[k] = shifted
        return deltas, wire


def _aggregate(
    cfg: Config,
    mine: list[Contribution],
    attack: _Attack,
    stats: AggregateStats,
    factors: list[float | None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """The reducers' result for this round, as the swarm's wire and reducers make it: each worker's Δ through
    ``swarm.compression`` (parts of ``swarm.part_size_bytes / 4`` values per tensor, as hivemind cuts them),
    ``swarm.aggregation`` over them, and the result through the codec of means (what every member receives;
    ``Codec.mean``). ``factors``: per worker, its weight factor (``RoundRules.weight_factors``), None for one whose Δ
    does not count (it sends weight 0); default: every Δ counts in full. Also returns the bytes a worker sends, as
    the encodings measure (``measured_bytes_sent``)."""
    s = cfg.swarm
    codec, part_values = get_codec(s.compression), s.part_size_bytes // 4
    deltas, wire = attack.sent(mine)
    if factors is not None:
        wire = [w if f is not None else 0.0 for w, f in zip(wire, factors, strict=True)]
    sizes: list[int] = []
    deltas = [roundtrip_parts(d, codec, part_values, sizes) for d in deltas]
    if s.aggregation == "mean":  # as the swarm's plain mean: the wire weight as is
        weights = wire
    else:
        cap = max_round_tokens(cfg)
        weights = [trusted_weight(w, c.payload.tokens, cap) for w, c in zip(wire, mine, strict=True)]
    scale = None if factors is None or all(f in (None, 1.0) for f in factors) else [f or 1.0 for f in factors]
    groups = split_groups([True] * len(mine), s.target_group_size)  # a round of more workers: its groups combined

    def carry(mean: torch.Tensor) -> torch.Tensor:  # a group's mean of a part goes on to the part's round reducer
        return codec.mean.roundtrip(mean)

    averaged = aggregate_flat(
        deltas, weights, s.aggregation, s.aggregation_clip, part_values, stats, scale, groups, carry, s.min_cosine
    )
    mean_sizes: list[int] = []
    averaged = roundtrip_parts(averaged, codec.mean, part_values, mean_sizes)
    return averaged, measured_bytes_sent(sum(sizes) / len(mine), sum(mean_sizes), len(mine))


def measured_bytes_sent(delta_bytes: float, mean_bytes: int, group_size: int) -> int:
    """What one peer of an even butterfly of ``group_size`` sends in a round, from the encoded sizes of its Δ and of
    the group's mean: (n-1)/n of its Δ's parts to the other reducers, and its 1/n of the mean to n-1 members. For a
    dense codec, ``wire_bytes_sent``."""
    if group_size <= 1:
        return 0
    return int((group_size - 1) / group_size * (delta_bytes + mean_bytes))


def wire_bytes_sent(cfg: Config, shapes: list[torch.Size], group_size: int) -> int:
    """What one peer of an even butterfly sends in a round: 2(n-1)/n x the encoded size of Δ (its parts). Exact for
    a dense codec; for a top-k one, an estimate from ``Codec.encoded_size`` (its means' size depends on the data:
    the simulator measures it, ``measured_bytes_sent``)."""
    if group_size <= 1:
        return 0
    codec, part_values = get_codec(cfg.swarm.compression), cfg.swarm.part_size_bytes // 4
    encoded = sum(codec.parts_size(math.prod(shape), part_values) for shape in shapes)
    return int(2 * (group_size - 1) / group_size * encoded)


def _local_rounds(
    local: _Local, worker: Worker, eval_sets: dict[str, torch.Tensor], step_bytes: int
) -> Iterator[RoundResult]:
    """sync/single: one model, a round of K x H batches each; sync sends one fp32 all-reduce per step."""
    for r in range(1, worker.cfg.train.rounds + 1):
        inner = local.round()
        sent = step_bytes * (local.steps if local.mode == "sync" else 0)
        info = ReduceInfo(group_size=len(local.shards), complete=True, attempts=1, bytes_sent=sent, bytes_received=sent)
        yield RoundResult(r, inner, info, worker.state.checksum(), 0.0, worker.maybe_evaluate(eval_sets))


def _diloco_rounds(
    pool: list[Worker],
    rules: RoundRules,
    eval_sets: dict[str, torch.Tensor],
    attack: _Attack,
    stats: AggregateStats,
) -> Iterator[RoundResult]:
    """Every round of the K workers through the same contribute/settle (and, with ``swarm.overlap`` eager, the same
    launch/drain) as a swarm peer, with an in-process aggregation (``swarm.aggregation``) standing in for the
    reducers. Eager: round r's mean is settled by each worker after ``swarm.overlap_steps`` of its round r+1 inner
    steps, the last one after the loop."""
    cfg = pool[0].cfg
    sent = 0  # what a worker sent in the round being settled (_aggregate measures it)

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
            averaged, sent = _aggregate(cfg, mine, attack, stats)
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
        averaged, sent = _aggregate(cfg, launched, attack, stats)
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


def _straggler_rounds(
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
        averaged, sent = _aggregate(cfg, mine, _Attack("none", 1.0), stats, [factors.get(names[k]) for k in group])
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


def _speeds(text: str | None) -> list[float] | None:
    """``--speeds 1,1,0.33`` -> [1.0, 1.0, 0.33]; ConfigError naming the value when it is not a list of numbers."""
    if text is None:
        return None
    try:
        return [float(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--speeds {text!r} is invalid: give one number per worker, e.g. 1,1,0.33") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_simulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML preset, e.g. configs/tiny.yaml")
    parser.add_argument("--mode", choices=MODES, default="diloco")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", required=True, type=Path, help="directory for results.json and metrics.jsonl")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument(
        "--attack", choices=ATTACKS, default="none", help="workers 0 .. K-1 are hostile (diloco/fedavg): module doc"
    )
    parser.add_argument("--attackers", type=int, default=1, metavar="K", help="workers 0 .. K-1 attack (default 1)")
    parser.add_argument(
        "--attack-scale",
        type=float,
        default=1000.0,
        metavar="X",
        help="negate: sends -X x Δ; weight: X x tokens; alie: μ - X·σ",
    )
    parser.add_argument(
        "--speeds",
        default=None,
        metavar="S1,S2,...",
        help="inner steps per simulated second of each worker (module doc)",
    )
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    overrides = [*args.overrides, *([f"train.threads={args.threads}"] if args.threads is not None else [])]
    try:
        cfg = load_config(args.config, overrides)
        apply_threads(cfg.train.threads)  # the workers take turns: one process's worth of threads (threads.py)
        speeds = _speeds(args.speeds)
        results = simulate(
            cfg, args.mode, args.workers, args.out, args.attack, args.attack_scale, speeds, args.attackers
        )
    except (ConfigError, DataError) as exc:
        print(f"run_simulation: {exc}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, NonFiniteUpdateError) as exc:
        print(f"run_simulation: training diverged: {exc}", file=sys.stderr)
        return 3
    print(json.dumps({k: results[k] for k in ("mode", "final_eval_loss", "wall_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

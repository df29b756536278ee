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
"a little is enough" coalition, arXiv 1902.06156), ``alie-balanced`` sends μ - X·σ·s with s a fixed pattern of ±1
(drawn per tensor, the same every round: ALIE's shift with as many coordinates above the median as below),
``zeros`` sends a Δ of zeros with its tokens (a free-rider) (X = ``--attack-scale``).

Speeds (diloco/fedavg): ``--speeds`` gives each worker's inner steps per simulated second (default 1 each). The
simulator's clock: with ``inner.round_seconds`` a round takes round_seconds and worker k takes round_seconds x
speed_k steps (at least 1, at most inner.steps), its lr following the round's clock as a swarm peer's does
(engine.Worker.train_inner). With fixed H and equal speeds a round takes H / speed seconds. With fixed H and
unequal speeds nobody waits for a slower worker, as no swarm peer does (readiness.Readiness.expected_members): worker k
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
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.checkpoint import save_outer_state
from p2p_diloco.config import Config, ConfigError, load_config, write_run_metadata
from p2p_diloco.data import DataError, DataPipeline
from p2p_diloco.engine import Worker, evaluate
from p2p_diloco.inner import NonFiniteLossError
from p2p_diloco.outer import NonFiniteUpdateError
from p2p_diloco.protocol import RoundRules
from p2p_diloco.robust import AggregateStats
from p2p_diloco.rounds import fp32_bytes_sent
from p2p_diloco.sim_local import Local, local_rounds, warm_start
from p2p_diloco.sim_reduce import Attack
from p2p_diloco.sim_rounds import diloco_rounds, straggler_rounds
from p2p_diloco.threads import add_threads_flag, apply_threads
from p2p_diloco.trackers import Trackers, require

__all__ = ["ATTACKS", "MODES", "main", "simulate"]

MODES = ("diloco", "fedavg", "sync", "single")
# what workers 0 .. K-1 do in diloco/fedavg (module doc)
ATTACKS = ("none", "negate", "weight", "alie", "alie-balanced", "zeros")
log = logging.getLogger("p2p_diloco.simulate")


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
    uneven = _check_arguments(cfg, mode, workers, attack, attack_scale, speeds, attackers)
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
        local = Local(cfg, data.vocab_size, shards, mode)
        pool, model = [local.worker], local.worker.model
    num_params = pool[0].num_params
    rules = RoundRules.from_config(cfg.swarm)
    hostile = Attack(attack, attack_scale, attackers)
    agg_stats = AggregateStats()

    initial = evaluate(model, eval_sets, cfg.data.batch_size, cfg)
    warm: dict[str, Any] | None = None
    if cfg.train.warm_start != "none":
        warm = warm_start(cfg, data.vocab_size, shards, eval_sets, pool)
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
            rounds = straggler_rounds(pool, rules, eval_sets, agg_stats, contributed, lost)
        else:
            if mode in ("diloco", "fedavg"):
                synchronous = diloco_rounds(pool, rules, eval_sets, hostile, agg_stats)
            else:
                synchronous = local_rounds(local, pool[0], eval_sets, fp32_bytes_sent(num_params, workers))
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
            "max_skew": cfg.swarm.max_skew,
            **agg_stats.as_dict(),
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    save_outer_state(out / "final_state", pool[0].state, {"mode": mode, "workers": workers})
    return results


def _check_arguments(
    cfg: Config,
    mode: str,
    workers: int,
    attack: str,
    attack_scale: float,
    speeds: list[float] | None,
    attackers: int,
) -> bool:
    """ConfigError naming the argument that ``simulate`` cannot run with; whether the workers run at different
    speeds under fixed H (the straggler rounds)."""
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
    return uneven


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
        help="negate: sends -X x Δ; weight: X x tokens; alie: μ - X·σ; alie-balanced: μ - X·σ·(±1)",
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

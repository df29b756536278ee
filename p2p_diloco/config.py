"""Typed run configuration: YAML preset + ``--set section.field=value`` overrides, validated.

Inputs:  a YAML file (configs/*.yaml) holding some of the sections below, and a list of override
         strings ``section.field=value`` (value parsed as YAML, so ``0.7``, ``true``, ``[0.9, 0.95]``).
Output:  a frozen-by-convention :class:`Config` tree of dataclasses; ``to_dict()`` for JSON dumps.
State:   none.
Failure: :class:`ConfigError` whose message names the field, the bad value and what is allowed
         (unknown key, wrong type, out-of-range number, unknown choice). Nothing else is raised for
         bad user input.

``run_metadata()`` builds the JSON written beside every run's outputs: the resolved config, seeds,
package versions and the git commit of the code.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Config", "ConfigError", "config_from_dict", "load_config", "run_metadata", "write_run_metadata"]


class ConfigError(ValueError):
    """A config value a user supplied is wrong; the message says which and what is allowed."""


@dataclass
class ModelConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 344
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    pretrained: str | None = None  # hub name or local path; overrides the architecture fields
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    autocast: str = "auto"  # auto (bf16 on CUDA, none on CPU) | bf16 | none


@dataclass
class DataConfig:
    source: str = "offline"  # offline | files | hub
    path: str | None = None  # files: file, directory or glob; hub: dataset name (e.g. allenai/c4)
    hub_config: str | None = None  # hub dataset config name (e.g. "en")
    hub_split: str = "train"
    text_field: str = "text"
    label_field: str | None = None  # per-document label for grouping; None: the source decides
    max_documents: int | None = None  # cap on documents read (required for hub streaming)
    tokenizer: str = "byte"  # byte | a transformers tokenizer name or path
    seq_len: int = 128
    batch_size: int = 16
    eval_fraction: float = 0.1
    eval_batches: int = 8
    partition: str = "iid"  # iid | dirichlet | by-label
    dirichlet_alpha: float = 0.5
    num_shards: int = 4
    shard_index: int | None = None  # None: derived from a stable hash of the peer id


@dataclass
class InnerConfig:
    # H: inner steps per round. With round_seconds: the most a round may take (set it a little above what the
    # fastest peer takes), and still the unit of warmup_steps and the schedule (a round counts as H steps of it)
    steps: int = 25
    # > 0: time-budgeted rounds. Every peer trains until the round's end on the swarm's clock (the next multiple
    # of round_seconds in DHT time, the same instant on every peer), then averages: a faster peer takes more
    # steps and weighs more (tokens), a slower one fewer, and nobody waits for anybody. 0: H steps per round.
    round_seconds: float = 0.0
    optimizer: str = "adamw"  # adamw | sgd (sgd exists for the invariant tests)
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.1
    grad_accum: int = 1


@dataclass
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    lr_warmup_rounds: int = 0  # outer lr ramps linearly from 0 over this many rounds


@dataclass
class TrainConfig:
    rounds: int = 40  # rounds to run (each: inner.steps inner steps, one all-reduce, one outer step)
    eval_every: int = 1  # rounds between eval-loss measurements; 0 disables
    checkpoint_every: int = 10  # rounds between checkpoints; 0 disables
    # torch CPU threads of this process (p2p_diloco/threads.py); 0: auto, OMP_NUM_THREADS when set, else the cores
    # this process may use (affinity, cgroup quota). Not in the fingerprint: peers may differ. --threads overrides.
    threads: int = 0
    # Ordinary training before DiLoCo, as the paper warm-starts from 24k ordinary steps (run_simulation only; a swarm
    # warm-starts from a model: model.pretrained, e.g. run_export of such a simulation, README "Warm start").
    # single: warm_start_steps steps of one model from the seed's init, its batches in turn from the workers' shards;
    # sync: warm_start_steps steps each averaging one batch's gradient per shard (data-parallel). Every worker then
    # starts round 1 from its weights with zero outer momentum. warm_start_schedule restart: the warm start has an
    # inner lr schedule of its own (inner.warmup_steps, then cosine over warm_start_steps) and every worker starts with
    # fresh inner moments; continue: one schedule over warm_start_steps + the rounds' steps, and every worker starts
    # with a copy of the warm start's optimizer moments, as one run that turns into DiLoCo at step warm_start_steps
    # (the paper's comparison, whose baseline is one data-parallel run of the same total steps).
    warm_start: str = "none"  # none | single | sync
    warm_start_steps: int = 0
    warm_start_schedule: str = "restart"  # restart | continue


@dataclass
class SwarmConfig:
    run_id: str = "p2p-diloco"
    # A round's matchmaking assembles every peer ready for it, up to max_round_peers; they average in groups of at most
    # target_group_size (each a butterfly all-reduce), whose means are combined part by part, so every peer of the
    # round applies the same Δ̄ (swarm/combine.py). A wider group sends fewer bytes per peer (2(n-1)/n of Δ in one
    # group), opens more streams and fails more often when one member drops. target_group_size is part of the
    # fingerprint (every member must split a round alike); max_round_peers is not.
    target_group_size: int = 64
    max_round_peers: int = 256
    min_group_size: int = 2
    matchmaking_time: float = 15.0  # seconds the leader waits for a group to fill
    request_timeout: float = 5.0
    allreduce_timeout: float = 60.0
    next_chunk_timeout: float = 10.0
    round_deadline: float = 180.0  # seconds for all reduce attempts of one round
    max_reduce_attempts: int = 3
    # A straggler up to max_staleness rounds behind the group still counts (a delayed pseudo-gradient, its tokens x
    # (1 + staleness) ** -staleness_decay) and catches up; further behind, it resyncs and its round is lost. Both
    # are part of the fingerprint. 0 by default: in docs/stragglers.md every counted variant cost eval loss against
    # discarding (+0.9% to +2.8% at full weight, 1 or 2 rounds late; -0.15% to +2.2% at decay 1), although counting
    # recovered part of the straggler's own data when shards differ (by-label: its label -1.6% to -3.5%). Set it to
    # 1 or 2 to keep a slow volunteer's data in the model; decay 1 was the least costly weight.
    max_staleness: int = 0
    staleness_decay: float = 1.0
    alone_policy: str = "local"  # local: take a local outer step | wait: retry until others come
    join_timeout: float = 60.0  # seconds to reach an initial peer and load state
    state_timeout: float = 60.0
    part_size_bytes: int = 2 * 1024 * 1024  # of fp32 values: each part holds part_size_bytes / 4 values, any codec
    # How Δ and the group's mean travel (p2p_diloco/codec.py): none (fp32) | fp16 | bf16 | int8 (blockwise absmax,
    # 128 values per fp32 scale, 1.03 bytes a value) | int4 (64 values a scale, 0.5625 bytes); reducers sum in fp32.
    # Part of the fingerprint. int8 by default: at equal tokens its final eval loss was 0.998 of fp32's (tiny H 100,
    # 3 seeds: 0.996, 0.992, 1.005; small 2 seeds: 1.000, 0.997) for 3.88x fewer bytes (docs/compression.md);
    # fp16/bf16 halve the bytes at the same quality. int4 sends 7.11x fewer bytes than fp32 (1.83x fewer than int8):
    # on small level with int8 (2 seeds: 0.9975 of fp32's loss), on tiny +0.8% over int8 in both seeds: for slow
    # uplinks. topk1 / topk3: 1% / 3% of each part's values, 2 bits each, with error feedback always (the means travel
    # as their nonzeros in int4); run them with outer.momentum 0, outer.lr 3, no outer lr warmup and feedback_decay
    # 0.95 (a peer logs this advice otherwise). Tiny, 4 workers, 40 rounds x H 25, 2 seeds, outer lr 3: topk3 sent
    # 38.1x fewer bytes than fp32 at 0.96x its eval loss, topk1 108.5x at 0.97x (docs/compression.md has the lr
    # sweep); on small topk1 ended at 1.07x (106.5x fewer bytes). Not the default: short of fp32 on small, and each
    # value moves only when it reaches its chunk's top k, so they want many short rounds.
    compression: str = "int8"
    # A lossy codec's error carried into the next round (engine.py): each peer adds to its Δ what the codec left out of
    # the Δ it sent last (kept in its checkpoint, restored on --resume), so over rounds the whole Δ reaches the
    # swarm. Not part of the fingerprint: it changes what one peer sends, not how the group reduces it. Off by
    # default: with int8 and int4 it ended a little worse in all 8 pairs measured (tiny, small, 2 seeds each: +0.01%
    # to +1.5%; docs/compression.md): their rounding is small, and the residual arrives a round late.
    error_feedback: bool = False
    # What of the residual owed is added to the next Δ (SparseLoCo's β: e <- β e + Δ): 1 keeps all of it. Below 1 the
    # residual fades, and with outer.momentum 0 it stands in for the outer momentum (docs/compression.md). Not part of
    # the fingerprint, as error_feedback.
    feedback_decay: float = 1.0
    # Streaming fragments (p2p_diloco/fragments.py, Streaming DiLoCo): the model's tensors in F fragments of about equal
    # size; each round exchanges one of them in turn (round mod F), whose Δ spans the F rounds since it was last
    # exchanged, so a round sends 1/F of the model: set inner.steps to H / F to keep each fragment's period at H.
    # The other tensors go on training and their outer state waits for their turn. Part of the fingerprint. With
    # swarm.overlap eager, a fragment's exchange runs behind the next round's inner steps (Streaming DiLoCo's
    # schedule). 1 (the whole model every round) by default: see docs/compression.md.
    fragments: int = 1
    # none: the peer waits for the round's all-reduce | eager: it sends Δ and goes on at once from the look-ahead
    # (the outer step with its own Δ, on a copy); after overlap_steps inner steps it settles the group's Δ̄ exactly
    # as a blocking round (waiting there if the exchange is not done) and carries overlap_carry of those steps'
    # displacement onto the settled state (engine.py). none by default: at equal tokens eager (int8, τ 5, carry 0.5)
    # ended at 1.0074 (tiny, 3 seeds) and 1.0080 (small, 2 seeds) of blocking's loss, up to 1.018 in one seed
    # (docs/compression.md); turn it on where the exchange takes more than ~1% of a round (home links, big models,
    # short rounds): small at 100 Mbit/s went from 84% to 96% compute utilisation (BENCHMARKS.md items 3 and 7). With
    # fixed H, use it with even rounds (inner.round_seconds, or peers of equal speed): a peer whose rounds end more
    # than matchmaking_time after its mates' misses their groups and resyncs (docs/compression.md).
    # delayed: as eager, from the anchor as it is (no look-ahead), Δ̄ applied when settled (one round late at τ = H);
    # not recommended: at τ 5 it ended at 1.0199 of blocking's loss against eager's 1.0074 (tiny, 3 seeds), at τ = H
    # at 1.57 (docs/compression.md). Not part of the fingerprint: the replicated state moves the same either way.
    overlap: str = "none"
    # eager: inner steps of the next round before the group's Δ̄ is settled (τ): the time the exchange has (the peer
    # waits there for the rest). Each look-ahead step costs a little quality: at equal tokens (int8, mean ratio to
    # blocking fp32 over seeds, docs/compression.md) τ 5 / 10 / 20 cost tiny (H 100) 1.0074 / 1.0059 / 1.0125 and
    # small (H 50) 1.0080 / 1.0105 / 1.0202: the cost grows with τ/H, so the smallest τ that hides the exchange is
    # best, and it depends on the link and the model, which a volunteer cannot know. 0 (auto, the default): each
    # peer sets it after every exchange to the inner steps that exchange took at its pace, a quarter more and one
    # step to spare (H // 10 for the first); > 0: fixed, and a peer that waited logs the τ that would have hidden it.
    overlap_steps: int = 0
    # eager: the share of those steps' displacement kept when θ moves onto the settled state (they ran from the
    # look-ahead, about one outer step off): 0.5 lost less than 1 or 0 (7 of 9 pairs, docs/compression.md).
    overlap_carry: float = 0.5
    record_ttl: float = 120.0  # seconds a peer's DHT record stays fresh
    start_peers: int = 1  # wait (up to join_timeout) until this many peers of the run are up before round 1
    linger_seconds: float = 10.0  # after the last round, serve the state to peers that still resync (at most)
    # How each reducer combines its part of the senders' Δ (p2p_diloco/robust.py; the measurements behind this choice
    # are in docs/robust_aggregation.md). median_filter: a sender whose part norm is over aggregation_clip x the
    # median part norm counts 0 for that part, the rest are averaged. All honest, it was bitwise the plain mean (tiny,
    # 3 seeds; small): the largest honest part norm was 1.3 x (tiny) and 1.54 x (small) the median, hence clip 2. A
    # -1000 x Δ attacker of 4 (mean: diverged in 4 rounds) cost +2.05% eval loss on tiny (3 seeds) and +3.0% on small,
    # the price of losing its tokens (3 honest workers alone: +3.5%); clipping it instead (centered_clip 1: +14%,
    # median_clip 1: +17%) leaves a bounded pull against the honest direction. Robust rules weight a sender by its
    # declared tokens only when its wire weight equals them and one round can hold them, else 0 (a 1e6 x weight
    # attacker: mean +24.5%, robust rules +2.5-2.7%). "mean" trusts every sender (closed runs, the old behaviour).
    aggregation: str = "median_filter"  # mean | median_filter | median_clip | centered_clip
    aggregation_clip: float = 2.0  # x the median part norm (median_*) or median distance to v0 (centered_clip)
    # Direction floor (robust rules only, 3+ senders): a sender whose part has a cosine below min_cosine to the
    # coordinate-wise median of the senders' parts counts 0 for that part. A sign-flipped Δ of honest size passes
    # every norm bound; on tiny (4 workers) honest parts had cosine >= 0.63 to the median (IID) and >= 0.37 (by-label
    # shards), a -1.9 x Δ sender <= -0.08: docs/robust_aggregation.md. 0 keeps any Δ that does not point against the
    # swarm's (zeros have no direction: dropped); larger groups bring honest cosines down (the median is less of one's
    # own), so no higher. Dropped in most of its parts 3 all-reduces in a row: banned (strikes.py). -1: off.
    min_cosine: float = 0.0
    # Sign skew (robust rules only, 3+ senders): a sender whose part lies above the coordinate-wise median in far
    # more of its values than below (or below than above), per sign of the median and relative to the other senders
    # (robust.py), by more than max_skew, counts 0 for that part and strikes as a direction drop does. "A little is
    # enough" (ALIE, μ - z·σ) lies below the median almost everywhere with an honest cosine and norm: on tiny (40
    # rounds x H 25) it cost +7.6% eval loss (1 of 4) and +4.3% (2 of 8), +1.5% and +1.0% with this bound; honest
    # parts reached |skew| 0.03-0.04 alone (IID, by-label; 4 and 8 workers), 0.15 beside the colluders.
    # docs/robust_aggregation.md. 1: off.
    max_skew: float = 0.5
    dht_timeout: float = 10.0  # seconds one DHT read or write of a training peer may take; then "no answer"
    max_failed_rounds: int = 10  # failed rounds in a row (non-finite or an error) before checkpoint + exit 1
    rollback_after: int = 3  # non-finite rounds in a row from one outer state before rolling back from it
    # A downloaded outer state is adopted only when peers of this much standing (or all there are, when less) vouch
    # for its (round, checksum) in their signed announcements (swarm/membership.py), or it equals this peer's own. A key
    # this peer has averaged with weighs 1, a stranger 1/4 (every key 1 until it averaged with a live one: standing.py).
    state_quorum: int = 2
    max_state_downloads: int = 4  # states' worth one peer may download from us per minute (a piece: its share)
    # Closed run: a file of allowed public keys (`run_peer --print-public-key`), one a line. Unlisted peers never
    # share a group with listed ones, get no state from them, and the monitor ignores their records. None: open.
    authorized_keys: str | None = None
    # Identity work (swarm/identity.py): only keys whose peer id hashes to this many leading zero bits are let in
    # (groups, state downloads, vouches, records); a peer grinds such a key when it makes its identity file: about
    # 2**N RSA key generations (~0.05-0.2 s each on one core: N 10 is ~1-3 minutes, once per key). It makes every Sybil
    # key cost that much CPU time; it does not bound an attacker with the time to spend. 0: any key.
    identity_work: int = 0


@dataclass
class LoggingConfig:
    log_every: int = 10  # inner steps between progress log lines (0: per round only)
    progress_bar: bool = True  # tqdm over inner steps when stderr is a tty
    # Trackers fed from each round's metrics.jsonl record (p2p_diloco/trackers.py); pip install -e '.[trackers]'.
    # Not in the fingerprint: each peer logs as it likes.
    tensorboard: bool = False  # event files in LOG_DIR/tensorboard (the simulator: OUT/tensorboard)
    wandb_project: str | None = None  # a wandb run in this project (name: the peer id; group: swarm.run_id)
    wandb_mode: str = "offline"  # offline: LOG_DIR/wandb, nothing leaves the machine (wandb sync uploads it) | online


@dataclass
class Config:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_RENAMED = {"train.outer_steps": "train.rounds"}  # old name -> new name, for a message that says so

_CHOICES = {
    "model.autocast": ("auto", "bf16", "none"),
    "train.warm_start": ("none", "single", "sync"),
    "train.warm_start_schedule": ("restart", "continue"),
    "data.source": ("offline", "files", "hub"),
    "data.partition": ("iid", "dirichlet", "by-label"),
    "inner.optimizer": ("adamw", "sgd"),
    "inner.schedule": ("cosine", "constant"),
    "swarm.alone_policy": ("local", "wait"),
    "swarm.aggregation": ("mean", "median_filter", "median_clip", "centered_clip"),  # = robust.RULES
    "swarm.compression": ("none", "fp16", "bf16", "int8", "int4", "topk1", "topk3"),  # = codec.CODECS
    "swarm.overlap": ("none", "eager", "delayed"),
    "logging.wandb_mode": ("offline", "online"),
}


def _need(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: must be {allowed}")


def _check_ranges(cfg: Config) -> None:
    """Cross-field and range checks, section by section; each failure names the field and what is allowed."""
    for name, value in _flatten(cfg.to_dict()).items():
        if name in _CHOICES:
            _need(value in _CHOICES[name], name, value, "one of " + ", ".join(_CHOICES[name]))
    _check_model(cfg.model)
    _check_data(cfg.data, cfg.model)
    _check_steps(cfg.inner, cfg.outer, cfg.train)
    _check_swarm(cfg.swarm)
    _check_logging(cfg.logging)


def _check_model(m: ModelConfig) -> None:
    """The model's sizes and device."""
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
        _need(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), ">= 1")
    _need(m.hidden_size % m.num_heads == 0, "model.hidden_size", m.hidden_size, "a multiple of model.num_heads")
    _need(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads, "a divisor of model.num_heads")
    _need(
        m.device == "auto" or m.device == "cpu" or m.device.startswith("cuda"),
        "model.device",
        m.device,
        "auto, cpu, cuda or cuda:N",
    )


def _check_data(d: DataConfig, m: ModelConfig) -> None:
    """The data pipeline's sizes, shards and source."""
    _need(d.seq_len >= 2, "data.seq_len", d.seq_len, ">= 2")
    _need(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len, f"<= model.max_seq_len ({m.max_seq_len})")
    _need(d.batch_size >= 1, "data.batch_size", d.batch_size, ">= 1")
    _need(0.0 < d.eval_fraction < 1.0, "data.eval_fraction", d.eval_fraction, "in (0, 1)")
    _need(d.eval_batches >= 1, "data.eval_batches", d.eval_batches, ">= 1")
    _need(d.dirichlet_alpha > 0, "data.dirichlet_alpha", d.dirichlet_alpha, "> 0")
    _need(d.num_shards >= 1, "data.num_shards", d.num_shards, ">= 1")
    if d.shard_index is not None:
        _need(0 <= d.shard_index < d.num_shards, "data.shard_index", d.shard_index, f"in [0, {d.num_shards})")
    if d.max_documents is not None:
        _need(d.max_documents >= 1, "data.max_documents", d.max_documents, ">= 1")
    if d.source in ("files", "hub"):
        _need(bool(d.path), "data.path", d.path, f"set when data.source is {d.source!r}")


def _check_steps(i: InnerConfig, o: OuterConfig, t: TrainConfig) -> None:
    """The inner and outer optimizers and the run's rounds, evals, checkpoints and warm start."""
    _need(i.steps >= 1, "inner.steps", i.steps, ">= 1")
    _need(i.round_seconds >= 0, "inner.round_seconds", i.round_seconds, ">= 0 (0: inner.steps steps per round)")
    _need(i.lr > 0, "inner.lr", i.lr, "> 0")
    _need(len(i.betas) == 2 and all(0 <= b < 1 for b in i.betas), "inner.betas", i.betas, "two numbers in [0, 1)")
    _need(i.weight_decay >= 0, "inner.weight_decay", i.weight_decay, ">= 0")
    _need(i.grad_clip >= 0, "inner.grad_clip", i.grad_clip, ">= 0 (0 disables clipping)")
    _need(i.warmup_steps >= 0, "inner.warmup_steps", i.warmup_steps, ">= 0")
    _need(0 <= i.min_lr_ratio <= 1, "inner.min_lr_ratio", i.min_lr_ratio, "in [0, 1]")
    _need(i.grad_accum >= 1, "inner.grad_accum", i.grad_accum, ">= 1")
    _need(o.lr > 0, "outer.lr", o.lr, "> 0")
    _need(0 <= o.momentum < 1, "outer.momentum", o.momentum, "in [0, 1)")
    _need(o.lr_warmup_rounds >= 0, "outer.lr_warmup_rounds", o.lr_warmup_rounds, ">= 0")
    _need(t.rounds >= 1, "train.rounds", t.rounds, ">= 1")
    _need(t.eval_every >= 0, "train.eval_every", t.eval_every, ">= 0")
    _need(t.checkpoint_every >= 0, "train.checkpoint_every", t.checkpoint_every, ">= 0")
    _need(t.threads >= 0, "train.threads", t.threads, ">= 0 (0: auto, from the cores this process may use)")
    if t.warm_start == "none":
        _need(t.warm_start_steps == 0, "train.warm_start_steps", t.warm_start_steps, "0 with train.warm_start=none "
              "(set train.warm_start=single or sync to warm-start)")  # fmt: skip
        _need(t.warm_start_schedule == "restart", "train.warm_start_schedule", t.warm_start_schedule, "restart with "
              "train.warm_start=none (set train.warm_start=single or sync to warm-start)")  # fmt: skip
    else:
        _need(t.warm_start_steps >= 1, "train.warm_start_steps", t.warm_start_steps, f">= 1 with train.warm_start="
              f"{t.warm_start}")  # fmt: skip


def _check_swarm(s: SwarmConfig) -> None:
    """The swarm's names, group sizes, deadlines, codec, aggregation and failure policy."""
    _need(
        bool(s.run_id) and "." not in s.run_id and " " not in s.run_id,
        "swarm.run_id",
        s.run_id,
        "a non-empty name without '.' or spaces",
    )
    _need(s.state_quorum >= 1, "swarm.state_quorum", s.state_quorum, ">= 1")
    _need(s.max_state_downloads >= 1, "swarm.max_state_downloads", s.max_state_downloads, ">= 1")
    _need(s.min_group_size >= 1, "swarm.min_group_size", s.min_group_size, ">= 1")
    _need(
        s.target_group_size >= s.min_group_size,
        "swarm.target_group_size",
        s.target_group_size,
        f">= swarm.min_group_size ({s.min_group_size})",
    )
    _need(
        s.max_round_peers >= s.target_group_size,
        "swarm.max_round_peers",
        s.max_round_peers,
        f">= swarm.target_group_size ({s.target_group_size})",
    )
    for name in (
        "matchmaking_time",
        "request_timeout",
        "allreduce_timeout",
        "next_chunk_timeout",
        "round_deadline",
        "join_timeout",
        "state_timeout",
        "record_ttl",
    ):
        _need(getattr(s, name) > 0, f"swarm.{name}", getattr(s, name), "> 0 seconds")
    _need(
        s.request_timeout < s.matchmaking_time,
        "swarm.request_timeout",
        s.request_timeout,
        f"< swarm.matchmaking_time ({s.matchmaking_time})",
    )
    _need(s.start_peers >= 1, "swarm.start_peers", s.start_peers, ">= 1")
    _need(s.linger_seconds >= 0, "swarm.linger_seconds", s.linger_seconds, ">= 0 seconds")
    _need(0 <= s.max_staleness <= 8, "swarm.max_staleness", s.max_staleness, "in [0, 8] rounds")
    _need(0 <= s.staleness_decay <= 8, "swarm.staleness_decay", s.staleness_decay, "in [0, 8]")
    _need(
        s.overlap_steps >= 0,
        "swarm.overlap_steps",
        s.overlap_steps,
        ">= 0 inner steps (0: as many as the exchange takes)",
    )
    _need(0 <= s.overlap_carry <= 1, "swarm.overlap_carry", s.overlap_carry, "in [0, 1]")
    _need(s.fragments >= 1, "swarm.fragments", s.fragments, ">= 1")
    _need(0 <= s.identity_work <= 32, "swarm.identity_work", s.identity_work, "in [0, 32] bits")
    _need(s.max_reduce_attempts >= 1, "swarm.max_reduce_attempts", s.max_reduce_attempts, ">= 1")
    _need(s.part_size_bytes >= 1024, "swarm.part_size_bytes", s.part_size_bytes, ">= 1024")
    _need(
        s.aggregation_clip > 0 and s.aggregation_clip < float("inf"),
        "swarm.aggregation_clip",
        s.aggregation_clip,
        "a finite number > 0",
    )
    _need(-1 <= s.min_cosine <= 1, "swarm.min_cosine", s.min_cosine, "in [-1, 1] (-1: off)")
    _need(0 <= s.max_skew <= 1, "swarm.max_skew", s.max_skew, "in [0, 1] (1: off)")
    _need(0 < s.feedback_decay <= 1, "swarm.feedback_decay", s.feedback_decay, "in (0, 1]")
    if s.aggregation == "median_filter":  # below 1 the median sender itself would count 0
        _need(s.aggregation_clip >= 1, "swarm.aggregation_clip", s.aggregation_clip, ">= 1 for median_filter")
    _need(s.dht_timeout > 0, "swarm.dht_timeout", s.dht_timeout, "> 0 seconds")
    _need(s.max_failed_rounds >= 1, "swarm.max_failed_rounds", s.max_failed_rounds, ">= 1")
    _need(
        1 <= s.rollback_after <= s.max_failed_rounds,
        "swarm.rollback_after",
        s.rollback_after,
        f"in [1, swarm.max_failed_rounds ({s.max_failed_rounds})]",
    )


def _check_logging(log: LoggingConfig) -> None:
    """The console and the trackers."""
    _need(log.log_every >= 0, "logging.log_every", log.log_every, ">= 0 (0: a line per round only)")
    project = log.wandb_project
    if project is not None:
        _need(
            bool(project.strip()) and "/" not in project,
            "logging.wandb_project",
            project,
            "a wandb project name (no '/': WANDB_ENTITY names the team), or null",
        )


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the type hint ``hint``; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(name, value, option)
            except ConfigError:
                continue
        allowed = " or ".join("null" if o is type(None) else o.__name__ for o in options)
        raise ConfigError(f"{name}={value!r} has the wrong type: expected {allowed}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}={value!r} has the wrong type: expected a list of {item.__name__}")
        return [_coerce(f"{name}[{k}]", v, item) for k, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{name}={value!r} has the wrong type: expected {hint.__name__}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    for key in unknown:
        if f"{prefix}{key}" in _RENAMED:
            raise ConfigError(f"{prefix}{key} is now called {_RENAMED[prefix + key]} (same meaning): rename it")
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}: allowed keys in {prefix.rstrip('.') or 'the top level'} are "
            + ", ".join(sorted(known))
        )
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, hint)
    return cls(**kwargs)


def _apply_override(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({exc})") from None
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {key} is a value, not a section")
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML), apply ``overrides`` in order, build and validate the config."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (presets live in configs/)")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    for override in overrides:
        _apply_override(tree, override)
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Build and validate a config from a tree of sections, e.g. ``Config.to_dict()`` as a checkpoint carries it."""
    cfg = _build(Config, tree, "")
    _check_ranges(cfg)
    return cfg


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def run_metadata(cfg: Config, **extra: Any) -> dict[str, Any]:
    """Everything needed to reproduce a run: config, seed, versions, git commit, plus ``extra``."""
    versions = {}
    for pkg in ("torch", "transformers", "datasets", "hivemind", "numpy", "p2p_diloco"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "config": cfg.to_dict(),
        "seed": cfg.seed,
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
        **extra,
    }


def write_run_metadata(out_dir: str | Path, cfg: Config, **extra: Any) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "run_metadata.json"
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run_metadata(cfg, **extra), indent=2, default=str))
    tmp.replace(target)
    return target

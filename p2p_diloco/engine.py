"""One worker's DiLoCo round: H inner steps -> pseudo-gradient -> reduce -> decide -> outer step.

Inputs:  a Config, a DataPipeline shard iterator (int64 [B, T] batches), a Reducer, and (in a swarm) a SharedState.
Output:  RoundResult per applied round (inner stats, reduce info, the decision, eval losses, checksum of the
         outer state); None for a round that changed nothing (discarded, or replaced by a downloaded state).
State:   the worker's model θ (on its device), its inner optimizer (kept across rounds), its copy of
         the replicated OuterState (anchor, momentum, round; fp32 CPU) and the number of batches it has
         taken from its shard. ``local_state``/``restore_local_state`` carry the parts no other peer
         holds (AdamW moments, place in the shard) through a checkpoint. With ``swarm.overlap`` eager also the
         exchange in flight (``pending``, one at most) and the look-ahead the inner steps started from (``start``).
         A settled state's checksum is hashed in a background thread (``tag_soon``) while the next inner steps run.
Failure: ``contribute`` raises NonFiniteLossError / NonFiniteUpdateError (or whatever ``on_step`` raises, e.g.
         a stop request) with θ reset to where the inner steps started; ``settle`` never applies a non-finite Δ̄
         (it logs, resets θ and returns None).

Overlap (``swarm.overlap``): none: ``run_round`` = contribute, reduce, settle; the peer waits for the exchange.
eager: the exchange of round t runs in the background while round t+1's inner steps run. They start from the
look-ahead x̂_t, the outer step taken with this peer's own Δ in place of the group's (outer lr and momentum as the
real one), on a copy: the replicated state is not touched. After τ of them (``swarm.overlap_steps``; with 0, the
steps the last exchange took at this peer's pace, ``_adapt``), or at the end of a shorter round, ``drain`` waits for
the group's Δ̄, settles it (the replicated outer state moves exactly as without overlap: x_t = outer_step(x_{t-1},
Δ̄)) and corrects θ: θ ← x_t + c (θ - x̂_t), the steps taken so far carried over from the look-ahead onto the real
state, scaled by c = ``swarm.overlap_carry`` (they were taken from a point about one outer step off: one's own Δ
differs from the group's mean by about the mean's own size, and half of their displacement lost less than all of it
in docs/compression.md). The round's Δ is then x_t - θ at its end, as without overlap: all of its inner steps,
measured from the state it is tagged with. With the exchange done within those τ steps nothing waits; the price is
that τ steps of each round run from x̂_t, not x_t (Streaming DiLoCo, arXiv 2501.18512, likewise trains on while a
synchronisation is in flight and merges the local parameters with the synchronised ones when it arrives). With τ =
0, or with the group's Δ̄ for the look-ahead, it would be the blocking round.
delayed: as eager, but round t+1's inner steps start from x_{t-1}, the anchor as it is (no look-ahead), and Δ̄_t is
applied when settled: with τ = H, one round late (the baseline that eager updates improve on, arXiv 2502.12996).
With ``swarm.fragments`` (fragments.py) the look-ahead and the carry are the fragment's that was sent: the other
tensors train on from θ as it is, their outer state not moving that round (Streaming DiLoCo's schedule: each
fragment's exchange behind the next round's inner steps).
``launch`` sends Δ, tagged with the state it was measured from (the one its Δ̄ is applied to). The outer state, its
checksum, the vote, catch-up, resync and checkpoints see only the replicated state, so they work as without
overlap; after a download (``load_state``) while an exchange is in flight, the steps taken from the downloaded
anchor are the ones carried. The last exchange (or one in flight at a stop) is settled by ``drain`` before the peer
checkpoints and leaves; a crash loses it with the rounds since the last checkpoint, as without overlap.

The seam: this module knows nothing of hivemind. A Reducer takes this worker's Δ, its weight (tokens this
round) and its GatherPayload, and returns the group's weighted mean Δ̄ and a ReduceInfo (with the group's
payloads). ``protocol.decide`` turns that into one action, and ``settle`` carries it out: the same code for the
simulator (simulate.py: an in-process mean over K workers, ``contribute`` for each, then ``settle`` for each)
and for run_peer (``run_round``: hivemind's all-reduce, state downloads through a SharedState).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from p2p_diloco.codec import get_codec, roundtrip_parts
from p2p_diloco.config import Config
from p2p_diloco.fragments import Fragments
from p2p_diloco.inner import InnerOptimizer, InnerStats, round_end
from p2p_diloco.model import autocast, build_model, resolve_device
from p2p_diloco.outer import NonFiniteUpdateError, OuterState, outer_lr_at, pseudo_gradient
from p2p_diloco.protocol import Action, Decision, Gathered, GatherPayload, RoundRules, RoundTag, decide

__all__ = [
    "Contribution",
    "Pending",
    "ReduceInfo",
    "Reducer",
    "RoundResult",
    "SPARSE_OUTER",
    "SharedState",
    "Worker",
    "evaluate",
    "fp32_bytes_sent",
    "sparse_advice",
]

log = logging.getLogger(__name__)


@dataclass
class ReduceInfo:
    """What a reduce did. ``complete`` is False when Δ̄ is only this worker's own Δ (alone/failed).

    ``gathered`` maps each group member's peer id to its gather payload; ``reason`` says why the result is
    local, or notes earlier failed attempts. Seconds and bytes are summed over attempts: ``check_seconds``
    validating the input (shapes, finite, fp32 CPU), ``copy_seconds`` moving it into the transport's buffers and
    the result's finite check, ``matchmaking_seconds`` forming the group, ``allreduce_seconds``
    the exchange itself and the completeness vote; ``wait_seconds`` is how long the worker's training waited for
    the result (all of the reduce with ``swarm.overlap`` none; only what the next inner steps did not hide, eager).
    """

    group_size: int = 1  # members of the round (all of its groups)
    complete: bool = False
    attempts: int = 0
    check_seconds: float = 0.0
    copy_seconds: float = 0.0
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0  # the training thread blocked on this reduce: its exposed communication
    overlap_steps: int = 0  # eager: the inner steps of the next round that ran while it was in flight
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""
    gathered: Gathered = field(default_factory=Gathered)
    ahead: RoundTag | None = None  # the swarm's state, when it was too far ahead of ours to look for a group
    groups: int = 1  # the groups the round ran as (protocol.split_groups): one butterfly each, their means combined
    dropped: dict[str, int] = field(default_factory=dict)  # sender -> parts our reducer dropped by direction


class Reducer(Protocol):
    def reduce(
        self, pseudo_grads: list[torch.Tensor], weight: float, payload: GatherPayload
    ) -> tuple[list[torch.Tensor], ReduceInfo]:
        """The weighted mean of the group's pseudo-gradients (same shapes, fp32 CPU) and what the reduce did;
        ``payload`` reaches every member, and ``ReduceInfo.gathered`` holds every member's. The mean may be the
        reducer's own buffers (the swarm's averager): valid until the next ``reduce``, which settles it first."""
        ...


class SharedState(Protocol):
    """Where the round's outer step and state downloads go in a swarm (swarm/sync.py); the simulator needs none."""

    def apply_outer(self, averaged: list[torch.Tensor], consensus: bool) -> float:
        """The outer step with Δ̄ (under the lock that guards the shared state); returns the outer lr."""
        ...

    def catch_up(self, group: RoundTag, averaged: list[torch.Tensor]) -> bool:
        """Take the group's pre-round state ``group`` and apply ``averaged`` to it (or its post-round state)."""
        ...

    def resync(self, after_local_step: bool) -> bool:
        """Download the swarm's outer state (after a local step: only one that got further)."""
        ...


@dataclass
class Contribution:
    """What a worker brings to a round: Δ, the tokens it was trained on, and the payload for the group."""

    pseudo_grad: list[torch.Tensor]
    payload: GatherPayload
    inner: InnerStats
    # swarm.error_feedback: what the wire's codec leaves out of ``pseudo_grad`` (it minus its round trip), the
    # worker's residual once this round's Δ counted (``Worker.settle``); None without error feedback
    residual: list[torch.Tensor] | None = None


@dataclass
class Pending:
    """An exchange in flight (``swarm.overlap`` eager): the contribution sent and the reduce's future result."""

    mine: Contribution
    result: Future  # -> (averaged, ReduceInfo)
    launched: float = field(default_factory=time.monotonic)
    steps: int = 0  # inner steps taken since it was sent
    finished: float | None = None  # when its result came (time.monotonic)
    state: OuterState | None = None  # the outer state it was sent from (the object: a download replaces it)

    def __post_init__(self) -> None:
        self.result.add_done_callback(lambda _: setattr(self, "finished", time.monotonic()))


_ADVISED: set[str] = set()  # advice already logged by this process (the simulator builds several workers)


# the outer step a top-k codec measured well with (docs/compression.md): its error feedback is the momentum
SPARSE_OUTER = ("outer.momentum=0", "outer.lr=3", "outer.lr_warmup_rounds=0", "swarm.feedback_decay=0.95")


def sparse_advice(cfg: Config) -> str | None:
    """A top-k codec with DiLoCo's outer momentum: what it measured, and the settings that measured well."""
    if not get_codec(cfg.swarm.compression).sparse or cfg.outer.momentum == 0:
        return None
    return (
        f"swarm.compression={cfg.swarm.compression} with outer.momentum={cfg.outer.momentum}: in the simulator this "
        "ended far above fp32 DiLoCo's loss (tiny, topk1 and topk3 selecting per part: 1.32x to 1.69x); the error "
        f"feedback is the momentum: set {' '.join(SPARSE_OUTER)} (tiny, 40 rounds x H 25, 2 seeds: topk3 0.96x and "
        "topk1 0.97x fp32's loss; docs/compression.md)"
    )


def fp32_bytes_sent(num_params: int, group_size: int) -> int:
    """Bytes one peer sends in a butterfly all-reduce of fp32 values: 2(n-1)/n x size."""
    if group_size <= 1:
        return 0
    return int(2 * (group_size - 1) / group_size * num_params * 4)


@dataclass
class RoundResult:
    outer_step: int  # rounds applied after this one
    inner: InnerStats
    reduce: ReduceInfo
    hashed: str | Future  # the outer state's checksum, or its hashing in the background (-> RoundTag)
    outer_lr: float
    eval_loss: dict[str, float] | None = None
    decision: Action = Action.APPLY
    lost_reason: str | None = None  # a round trained whose Δ̄ did not move this state: why (Worker.lost)

    @property
    def checksum(self) -> str:
        """The checksum of the outer state this round left (waits for its hashing if that still runs)."""
        return self.hashed if isinstance(self.hashed, str) else self.hashed.result().checksum

    def record(self) -> dict[str, Any]:
        """The flat per-round metrics record (metrics.jsonl)."""
        rec = {
            "outer_step": self.outer_step,
            "train_loss": self.inner.mean_loss,
            "tokens": self.inner.tokens,
            "tokens_per_second": self.inner.tokens_per_second,
            "compute_seconds": self.inner.seconds,
            "compute_started": self.inner.started,
            "peak_memory_bytes": self.inner.peak_memory_bytes,
            "group_size": self.reduce.group_size,
            "groups": self.reduce.groups,
            "reduce_complete": self.reduce.complete,
            "reduce_attempts": self.reduce.attempts,
            "matchmaking_seconds": self.reduce.matchmaking_seconds,
            "allreduce_seconds": self.reduce.allreduce_seconds,
            "comm_wait_seconds": self.reduce.wait_seconds,
            "overlap_steps": self.reduce.overlap_steps,
            "bytes_sent": self.reduce.bytes_sent,
            "bytes_received": self.reduce.bytes_received,
            "outer_lr": self.outer_lr,
            "checksum": self.checksum,
            "decision": self.decision.value,
            "lost": self.lost_reason is not None,
        }
        if self.lost_reason is not None:
            rec["lost_reason"] = self.lost_reason
        if len(self.reduce.gathered.payloads) > 1:
            rec["group_peers"] = self.reduce.gathered.peers
        if self.reduce.dropped:
            rec["dropped_by_direction"] = self.reduce.dropped
        if self.reduce.gathered.malformed:
            rec["malformed_payloads"] = self.reduce.gathered.malformed
        if self.reduce.reason:
            rec["reduce_reason"] = self.reduce.reason
        if self.eval_loss is not None:
            rec["eval_loss"] = self.eval_loss.get("all")
            rec["eval_loss_per_label"] = {k: v for k, v in self.eval_loss.items() if k != "all"}
        return rec


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, eval_sets: dict[str, torch.Tensor], batch_size: int, cfg: Config
) -> dict[str, float]:
    """Mean next-token loss per eval set (label -> int64 [N, T]); the model is left in train mode."""
    device = next(model.parameters()).device
    model.eval()
    out = {}
    for label, rows in eval_sets.items():
        total, count = 0.0, 0
        for start in range(0, rows.shape[0], batch_size):
            batch = rows[start : start + batch_size].to(device)
            with autocast(device, cfg.model):
                loss = model(input_ids=batch, labels=batch).loss
            total += loss.item() * batch.shape[0]
            count += batch.shape[0]
        out[label] = total / max(count, 1)
    model.train()
    return out


class Worker:
    """A model replica, its inner optimizer and its copy of the outer state."""

    def __init__(
        self, cfg: Config, vocab_size: int, batches: Iterator[torch.Tensor], speed: float | None = None
    ) -> None:
        self.cfg = cfg
        # the simulator's clock: inner steps per simulated second (time-budgeted rounds take round_seconds x speed
        # steps); None: the wall clock, as a swarm peer
        self.speed = speed
        self.device = resolve_device(cfg.model)
        self.model = build_model(cfg.model, vocab_size, cfg.seed)
        self.batches_taken = 0
        self.batches = self._counted(batches)
        total_steps = cfg.train.rounds * cfg.inner.steps
        self.inner = InnerOptimizer(self.model, cfg.inner, total_steps)
        self.state = OuterState.from_params(self.model.parameters())
        # swarm.fragments: which tensors each round exchanges (fragments.py); with 1, all of them every round
        self.fragments = Fragments.of([a.numel() for a in self.state.anchor], cfg.swarm.fragments)
        # swarm.overlap eager: the look-ahead the inner steps started from while an exchange is in flight (fp32 CPU;
        # None: they started at the anchor), and that exchange
        self.start: list[torch.Tensor] | None = None
        self.pending: Pending | None = None
        self._exchanges: ThreadPoolExecutor | None = None
        # the state last hashed, at which round, and its tag (a future: done, or hashing in the background)
        self._hashing: tuple[OuterState, int, Future] | None = None
        self._hasher: ThreadPoolExecutor | None = None
        self.round_ends_at = 0.0  # inner.round_seconds: when the last time-budgeted inner phase had to end
        # fixed H: end the next round's inner steps by this wall time (at least one step), set by a peer that took
        # the swarm's state mid-round (it joined, or resynced) so that it ends with its mates and its Δ counts in their
        # group instead of arriving a round behind; ``ends_by``: the current round's (None: a whole round)
        self.end_by: float | None = None
        self.ends_by: float | None = None
        # eager: the inner steps the next exchange has before it is settled (τ): swarm.overlap_steps, or with 0 the
        # steps the last exchange took at this peer's pace (``_adapt``), H // 10 until one was measured (and in the
        # simulator, whose exchange takes no time)
        self.overlap_steps = cfg.swarm.overlap_steps or max(1, cfg.inner.steps // 10)
        # rounds trained whose Δ̄ did not move this outer state (discarded, resynced), for the caller to report
        # (``take_lost``): every round a peer trains shows in its metrics, whatever became of it
        self.lost: list[RoundResult] = []
        # swarm.error_feedback: the part of earlier rounds' Δ the codec left out, added to the next Δ sent (fp32 CPU;
        # None: nothing owed). Only this worker holds it: it goes into local_state, not the replicated state.
        self.residual: list[torch.Tensor] | None = None
        advice = sparse_advice(cfg)
        if advice and advice not in _ADVISED:
            _ADVISED.add(advice)
            log.warning(advice)

    def _counted(self, batches: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        for batch in batches:
            self.batches_taken += 1
            yield batch

    def local_state(self) -> dict[str, Any]:
        """What only this worker holds: inner optimizer state and how far into its shard it has read; the error
        feedback residual; with fragments, θ (the tensors not exchanged yet trained on past the anchor) and the round
        it belongs to."""
        out = {"inner_optimizer": self.inner.optimizer.state_dict(), "batches_taken": self.batches_taken}
        if self.residual is not None:
            out["residual"] = [r.clone() for r in self.residual]
        if self.fragments.count > 1:
            params = [p.detach().to("cpu", torch.float32).clone() for p in self.model.parameters()]
            if self.pending is not None and self.start is not None:
                # what an exchange in flight leaves as a lost one (``drain``): the tensors it puts back on the anchor
                # with the carried steps, which a resumed peer exchanges again
                only, carry = self._carried(self.pending), self.cfg.swarm.overlap_carry
                params = [
                    a.add(p.sub(s), alpha=carry) if only is None or only[k] else p
                    for k, (p, s, a) in enumerate(zip(params, self.start, self.state.anchor, strict=True))
                ]
            out["params"] = params
            out["params_round"] = self.state.round
        return out

    def restore_local_state(self, saved: dict[str, Any]) -> None:
        """Continue from ``local_state()`` of an earlier run of this worker: same moments, next batches.

        ValueError (naming what differs) when the saved optimizer does not fit this model.
        """
        try:
            params = [p for group in self.inner.optimizer.param_groups for p in group["params"]]
            for index, entry in saved["inner_optimizer"]["state"].items():
                for name, value in entry.items():
                    if torch.is_tensor(value) and value.dim() and value.shape != params[index].shape:
                        raise ValueError(
                            f"{name} of parameter {index} is {list(value.shape)}, the model's is "
                            f"{list(params[index].shape)}"
                        )
            residual = saved.get("residual")  # absent: saved without error feedback (or before it existed)
            if residual is not None:
                shapes = [list(a.shape) for a in self.state.anchor]
                if [list(r.shape) for r in residual] != shapes:
                    raise ValueError(f"the error feedback residual's shapes are not the model's {shapes}")
                residual = [r.to("cpu", torch.float32).clone() for r in residual]
            params = saved.get("params") if saved.get("params_round") == self.state.round else None
            if params is not None and [list(p.shape) for p in params] != [list(a.shape) for a in self.state.anchor]:
                raise ValueError("the saved parameters' shapes are not the model's")
            self.inner.optimizer.load_state_dict(saved["inner_optimizer"])
            skip = int(saved["batches_taken"]) - self.batches_taken
            self.residual = residual
            if params is not None and self.fragments.count > 1:  # saved at this state: the fragments' progress too
                with torch.no_grad():
                    for p, x in zip(self.model.parameters(), params, strict=True):
                        p.copy_(x)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"saved worker state does not fit this model and optimizer: {exc}") from None
        for _ in range(skip):
            next(self.batches)

    @property
    def num_params(self) -> int:
        return sum(a.numel() for a in self.state.anchor)

    def autocast(self):
        return autocast(self.device, self.cfg.model)

    def load_state(self, state: OuterState) -> None:
        """Adopt an outer state received from elsewhere (join, resync, resume, roll back); θ ← its anchor (with an
        exchange in flight, the steps from now on are carried onto the state its drain ends with)."""
        self.state = state
        self.state.copy_to(self.model.parameters())
        if self.start is not None:
            self.start = [a.clone() for a in state.anchor]

    def reset_params(self) -> None:
        """θ ← where this round's inner steps started: the look-ahead while an exchange is in flight (eager), else the
        anchor."""
        if self.start is None:
            self.state.copy_to(self.model.parameters())
            return
        with torch.no_grad():
            for p, x in zip(self.model.parameters(), self.start, strict=True):
                p.copy_(x)

    @property
    def in_flight(self) -> int:
        """1 while an exchange is in flight (its round's inner steps ran, its outer step is still to come), else 0."""
        return 0 if self.pending is None else 1

    def train_inner(self, on_step: Callable[[int, float], None] | None = None) -> InnerStats:
        """H inner steps from the current θ; the schedule continues at (rounds done or in flight) x H.

        With ``end_by`` set (fixed H), the steps stop before that wall time (at least one; the peer then ends its round
        with its mates'). ``inner.round_seconds`` > 0: steps until the round's end on the swarm's clock
        (``inner.round_end``: the next multiple of round_seconds in wall-clock time, which is hivemind's DHT time), at
        most H. A step's place in the schedule is the share of the round's time gone, (rounds done + share) x H: the
        same lr for every peer at the same moment of the same round, whatever its speed. A simulated worker
        (``speed``) takes round_seconds x speed steps (at least 1, at most H) on the simulator's clock instead."""
        h, span = self.cfg.inner.steps, self.cfg.inner.round_seconds
        try:
            done = (self.state.round + self.in_flight) * h
            if span <= 0:  # fixed H, or fewer steps to end with the mates (``end_by``: after a join or a download)
                self.ends_by, self.end_by = self.end_by, None
                return self.inner.run(self.batches, h, done, self.autocast, self.device, on_step, deadline=self.ends_by)
            if self.speed is not None:  # simulated: step k ends at (k + 1) / speed seconds into the round
                steps = min(h, max(1, math.floor(span * self.speed + 1e-9)))

                def simulated(k: int) -> float:
                    return done + h * min(1.0, (k + 1) / self.speed / span)

                return self.inner.run(
                    self.batches, steps, done, self.autocast, self.device, on_step, position=simulated
                )
            self.round_ends_at = end = round_end(span, time.time(), self.round_ends_at)

            def position(k: int) -> float:
                return done + h * min(1.0, max(0.0, 1.0 - (end - time.time()) / span))

            return self.inner.run(
                self.batches, h, done, self.autocast, self.device, on_step, deadline=end, position=position
            )
        except Exception:
            self.reset_params()
            raise

    def active(self) -> list[bool]:
        """Per tensor: whether this round exchanges it (swarm.fragments: the round's fragment; else all)."""
        return self.fragments.active(self.state.round)

    def pseudo_grad(self) -> list[torch.Tensor]:
        """Δ = anchor - θ (eager: called once the exchange before is settled and θ carried onto the new anchor); with
        fragments, zeros for the tensors this round does not exchange."""
        try:
            delta = pseudo_gradient(self.state.anchor, self.model.parameters())
        except Exception:
            self.reset_params()
            raise
        if self.fragments.count > 1:
            for d, on in zip(delta, self.active(), strict=True):
                if not on:
                    d.zero_()
        return delta

    def apply_outer(self, avg_delta: list[torch.Tensor]) -> float:
        """Outer step on the anchor with Δ̄, then θ ← anchor. Returns the outer lr used."""
        self._hashed()  # the only change in place: a hashing in the background must have read the state first
        lr = self.outer_lr(self.state.round)
        only = self.active() if self.fragments.count > 1 else None
        try:
            self.state.apply(avg_delta, lr, self.cfg.outer.momentum, self.cfg.outer.nesterov, only)
        finally:
            self.state.copy_to(self.model.parameters(), only)
        return lr

    def tag(self) -> RoundTag:
        """The outer state's (round, checksum), hashed once per state: the state changes only through
        ``load_state`` (a new object) and ``apply_outer`` (its round moves). Hashed here unless ``tag_soon`` started
        it, whose end it then waits for."""
        hashing = self._hashing_of_state()
        if hashing is None:
            hashing = Future()
            hashing.set_result(RoundTag(self.state.round, self.state.checksum()))
            self._remember(hashing)
        return hashing.result()

    def tag_soon(self) -> Future:
        """The outer state's tag as a future: hashed in a background thread (hashlib lets go of the GIL on large
        buffers, so the hashing runs beside the inner steps), or done already when it was hashed before. A
        settled round thus leaves its checksum (0.08 s for the small preset's 19M parameters, more on a loaded
        machine) to the time the next inner steps run; whoever needs it waits (``tag``, RoundResult.checksum)."""
        hashing = self._hashing_of_state()
        if hashing is None:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hashing")
            state, round = self.state, self.state.round
            hashing = self._hasher.submit(lambda: RoundTag(round, state.checksum()))
            self._remember(hashing)
        return hashing

    def cached_tag(self) -> RoundTag | None:
        """The outer state's tag if it was hashed since the state last changed, else None (nothing is hashed)."""
        hashing = self._hashing_of_state()
        return hashing.result() if hashing is not None and hashing.done() else None

    def _hashing_of_state(self) -> Future | None:
        """The tag (future) of the state as it is now, if one was hashed or is being hashed."""
        hashing = self._hashing
        if hashing is not None and hashing[0] is self.state and hashing[1] == self.state.round:
            return hashing[2]
        return None

    def _remember(self, hashing: Future) -> None:
        """``hashing`` is the current state's tag (after any hashing of an earlier state has ended)."""
        self._hashed()
        self._hashing = (self.state, self.state.round, hashing)

    def _hashed(self) -> None:
        """Wait for a hashing in the background, if one runs, and forget it (its result stays with its future)."""
        hashing, self._hashing = self._hashing, None
        if hashing is not None:
            hashing[2].exception()

    def outer_lr(self, round: int) -> float:
        return outer_lr_at(round, self.cfg.outer.lr, self.cfg.outer.lr_warmup_rounds)

    def contribute(
        self, on_step: Callable[[int, float], None] | None = None, drain: Callable[[], Any] | None = None
    ) -> Contribution:
        """H inner steps from θ, then Δ and this round's payload. Raises with θ reset (module doc). With an exchange
        in flight (eager), ``drain`` (settle it: ``Worker.drain`` with the round's rules) runs after
        ``swarm.overlap_steps`` of the steps, or after the last one if the round is shorter, so Δ and the payload's
        tag are of the state it leaves."""
        after, drained = self.overlap_steps, 0.0

        def stepped(k: int, loss: float) -> None:
            nonlocal drained
            if on_step is not None:
                on_step(k, loss)
            if self.pending is not None:
                self.pending.steps = k + 1
                if k + 1 == after and drain is not None:
                    began = time.perf_counter()
                    drain()
                    drained += time.perf_counter() - began

        stats = self.train_inner(stepped if self.pending is not None else on_step)
        stats.seconds -= drained  # compute only: the wait for the exchange and its settling are not inner steps
        if self.pending is not None:
            if drain is None:
                self.reset_params()
                raise RuntimeError("an exchange is in flight: contribute needs its drain")
            drain()
        delta, residual = self.with_feedback(self.pseudo_grad())
        return Contribution(delta, GatherPayload(self.tag(), stats.tokens), stats, residual)

    def with_feedback(self, delta: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """swarm.error_feedback (always with a top-k codec, which sends a few % of Δ): (Δ + feedback_decay x the
        residual owed, what the codec leaves out of that); without it (Δ, None). What the codec leaves out is exact:
        the swarm's parts are encoded as ``roundtrip_parts`` cuts them."""
        s, codec = self.cfg.swarm, get_codec(self.cfg.swarm.compression)
        if not (s.error_feedback or codec.sparse) or s.compression == "none":
            return delta, None
        active = self.active()  # with fragments, the other tensors' residual waits for their turn, untouched
        if self.residual is not None:
            delta = [
                d.add(r, alpha=s.feedback_decay) if on else d
                for d, r, on in zip(delta, self.residual, active, strict=True)
            ]
        carried = roundtrip_parts(delta, codec, s.part_size_bytes // 4)
        owed = [d.sub(c) for d, c in zip(delta, carried, strict=True)]
        if self.residual is not None:
            owed = [o if on else r for o, r, on in zip(owed, self.residual, active, strict=True)]
        return delta, owed

    def settle(
        self,
        mine: Contribution,
        averaged: list[torch.Tensor],
        info: ReduceInfo,
        rules: RoundRules,
        sync: SharedState | None = None,
        eval_sets: dict[str, torch.Tensor] | None = None,
    ) -> RoundResult | None:
        """Carry out ``decide``'s action for this round; a RoundResult when the outer state moved by it."""
        decision = decide(mine.payload.tag, info.gathered, info.complete, rules, info.ahead)
        if decision.action is Action.LOCAL_STEP:
            averaged = mine.pseudo_grad  # whatever the group computed, a local step is our own
        sent = self.fragments.active(mine.payload.tag.round) if self.fragments.count > 1 else None  # its fragment
        done = self._carry_out(decision, averaged, info, sync)
        if done is not None and mine.residual is not None:
            if decision.action is Action.LOCAL_STEP:  # it applied the whole Δ sent: nothing is owed for it
                owed = mine.residual  # with fragments, the other fragments' residual still waits for their turn
                self.residual = (
                    None if sent is None else [r.mul(0) if on else r for r, on in zip(owed, sent, strict=True)]
                )
            elif decision.counts:  # the Δ sent is in the group's mean: what the codec left out of it is owed
                self.residual = mine.residual
        if done is None:
            # θ back to the (possibly downloaded) anchor: with fragments, the lost round's fragment only (a download
            # already put every tensor there)
            self.state.copy_to(self.model.parameters(), sent)
            lost = RoundResult(self.state.round, mine.inner, info, self.tag_soon(), 0.0, None, decision.action)
            lost.lost_reason = decision.reason
            self.lost.append(lost)
            return None
        evals = self.maybe_evaluate(eval_sets)
        return RoundResult(self.state.round, mine.inner, info, self.tag_soon(), done, evals, decision.action)

    def _carry_out(
        self, decision: Decision, averaged: list[torch.Tensor], info: ReduceInfo, sync: SharedState | None
    ) -> float | None:
        """The outer lr of the applied outer step, or None when the round is dropped."""
        label = f"round {self.state.round + 1}"
        if decision.action is Action.DISCARD:
            log.warning("%s discarded: %s (%s)", label, decision.reason, info.reason)
            return None
        if decision.action is Action.RESYNC or (
            decision.action is Action.CATCH_UP and (sync is None or not sync.catch_up(decision.majority, averaged))
        ):
            log.warning("%s discarded: %s; downloading the outer state", label, decision.reason)
            if sync is None or not sync.resync(after_local_step=False):
                log.warning("%s: no state download; will retry after the next round", label)
            return None
        if decision.action is Action.CATCH_UP:
            log.warning("%s: %s; caught up to round %d", label, decision.reason, self.state.round)
            return self.outer_lr(decision.majority.round)
        if decision.action is Action.LOCAL_STEP:
            log.warning("%s: %s%s", label, decision.reason, f" ({info.reason})" if info.reason else "")
        elif decision.out_of_sync:
            log.warning("%s: %s", label, decision.reason)
        consensus = decision.action is Action.APPLY
        try:
            lr = sync.apply_outer(averaged, consensus) if sync is not None else self.apply_outer(averaged)
        except NonFiniteUpdateError as exc:
            log.error("%s discarded: %s", label, exc)
            return None
        if decision.action is Action.LOCAL_STEP and sync is not None and sync.resync(after_local_step=True):
            info.reason += "; resynced from a peer after the local step"
        return lr

    def run_round(
        self,
        reducer: Reducer,
        rules: RoundRules,
        sync: SharedState | None = None,
        on_step: Callable[[int, float], None] | None = None,
        eval_sets: dict[str, torch.Tensor] | None = None,
    ) -> RoundResult | None:
        """A whole round through a Reducer: contribute, reduce, settle (the path run_peer takes). With
        ``swarm.overlap`` eager: contribute (settling the exchange of the round before on the way: ``drain``), then
        send this round's Δ (``launch``); its result is settled by the next call, or by ``drain`` after the last
        round. Returns the result of the round settled in this call."""
        if self.cfg.swarm.overlap == "none":
            mine = self.contribute(on_step)
            started = time.monotonic()
            averaged, info = reducer.reduce(mine.pseudo_grad, float(mine.inner.tokens), mine.payload)
            info.wait_seconds = time.monotonic() - started
            return self.settle(mine, averaged, info, rules, sync, eval_sets)
        settled: list[RoundResult | None] = [None]

        def drain() -> None:
            settled[0] = self.drain(rules, sync, eval_sets, adapt=True)

        mine = self.contribute(on_step, drain)
        if self._exchanges is None:
            self._exchanges = ThreadPoolExecutor(1, thread_name_prefix="exchange")
        self.launch(
            mine,
            lambda sent: self._exchanges.submit(
                reducer.reduce, sent.pseudo_grad, float(sent.inner.tokens), sent.payload
            ),
        )
        return settled[0]

    def launch(self, mine: Contribution, send: Callable[[Contribution], Future]) -> Contribution:
        """Eager: send ``mine`` (tagged with the outer state its Δ was measured from, the one the group's Δ̄ will be
        applied to), and start the next inner steps from the look-ahead: the outer step with our own Δ in place of
        the group's, on a copy (``start``, kept for the correction ``drain`` makes). Delayed: from a copy of the
        anchor."""
        outer = self.cfg.outer
        if self.cfg.swarm.overlap == "delayed":  # from the anchor as it is: Δ̄ comes in when settled
            self.start = [a.clone() for a in self.state.anchor]
        else:
            lr = self.outer_lr(self.state.round)
            self.start = self.state.ahead(mine.pseudo_grad, lr, outer.momentum, outer.nesterov)
        if self.fragments.count > 1:  # the tensors this round does not exchange go on from where θ has them
            with torch.no_grad():
                self.start = [
                    x if on else p.detach().to("cpu", torch.float32).clone()
                    for x, p, on in zip(self.start, self.model.parameters(), self.active(), strict=True)
                ]
        self.reset_params()
        self.pending = Pending(mine, send(mine), state=self.state)
        return mine

    def drain(
        self,
        rules: RoundRules,
        sync: SharedState | None = None,
        eval_sets: dict[str, torch.Tensor] | None = None,
        adapt: bool = False,
    ) -> RoundResult | None:
        """Eager: wait for the exchange in flight and settle it (the outer state moves by the group's Δ̄, or as
        ``decide`` says), then carry the inner steps taken since onto the outer state settled: θ ← anchor + c (θ -
        look-ahead), c = ``swarm.overlap_carry``. None when there is none or it changed nothing. ``adapt``: the
        exchange ran on the wall clock beside the inner steps (a swarm peer's, not the simulator's, which takes no
        time): its time sets the next τ (``_adapt``)."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        params, carry = list(self.model.parameters()), self.cfg.swarm.overlap_carry
        with torch.no_grad():  # θ - look-ahead, into the look-ahead's buffers
            drift = [
                torch.sub(p.detach().to("cpu", torch.float32), s, out=s)
                for p, s in zip(params, self.start, strict=True)
            ]
        self.start = None
        result = None
        try:
            started = time.monotonic()
            averaged, info = pending.result.result()
            info.wait_seconds = time.monotonic() - started
            info.overlap_steps = pending.steps
            if adapt:
                self._adapt(pending, started, info.wait_seconds)
            sent = pending.mine.payload.tag
            if self.tag() != sent:  # a rollback or a download replaced the state the group's Δ̄ belongs to
                log.warning(
                    "round %d: the outer state changed while its exchange was in flight (%s, sent %s): result dropped",
                    sent.round + 1,
                    self.tag(),
                    sent,
                )
                lost = RoundResult(self.state.round, pending.mine.inner, info, self.tag_soon(), 0.0)
                lost.decision, lost.lost_reason = (
                    Action.DISCARD,
                    "the outer state changed while its exchange was in flight",
                )
                self.lost.append(lost)
            else:
                result = self.settle(pending.mine, averaged, info, rules, sync, eval_sets)
        finally:
            only = self._carried(pending)
            self.state.copy_to(params, only)
            with torch.no_grad():
                for k, (p, d) in enumerate(zip(params, drift, strict=True)):
                    if only is None or only[k]:
                        p.add_(d.to(p.device), alpha=carry)
        return result

    def _carried(self, pending: Pending) -> list[bool] | None:
        """Per tensor, whether the drain of ``pending`` puts it on the anchor with the carried steps (None: every
        tensor). With fragments, the fragment it sent: the others keep θ as it is, their outer state did not move;
        unless a download replaced the state since the launch: then every tensor, as without fragments."""
        if self.fragments.count == 1 or self.state is not pending.state:
            return None
        return self.fragments.active(pending.mine.payload.tag.round)

    def _adapt(self, pending: Pending, started: float, waited: float) -> None:
        """After a drain that began at ``started`` and waited ``waited`` s: with ``swarm.overlap_steps`` 0, set the
        next τ to the steps the exchange took at this round's pace, with a quarter more and one step to spare (its
        time varies from round to round: matchmaking, other peers' pace), within [1, H]; with a fixed τ, say when
        the training waited (over 0.1 s) and which τ would have hidden it."""
        if not pending.steps or started <= pending.launched:
            return
        pace = (started - pending.launched) / pending.steps
        took = (pending.finished or started + waited) - pending.launched
        label = f"round {pending.mine.payload.tag.round + 1}"
        if self.cfg.swarm.overlap_steps:
            if waited > 0.1:
                log.info(
                    "%s: waited %.2fs after %d inner steps for the group's Δ̄ (the exchange took %.1fs, %d steps at "
                    "this pace): swarm.overlap_steps=%d would hide it",
                    label,
                    waited,
                    pending.steps,
                    took,
                    math.ceil(took / pace),
                    math.ceil(took / pace) + 1,
                )
            return
        steps = min(self.cfg.inner.steps, max(1, math.ceil(1.25 * took / pace) + 1))
        if steps != self.overlap_steps:
            log.info(
                "%s: the exchange took %.1fs, %.1f inner steps at this pace (%.2fs a step; waited %.2fs): the next "
                "is settled after %d steps, not %d",
                label,
                took,
                took / pace,
                pace,
                waited,
                steps,
                self.overlap_steps,
            )
        self.overlap_steps = steps

    def take_lost(self) -> list[RoundResult]:
        """The rounds lost since the last call (``lost``), oldest first."""
        lost, self.lost = self.lost, []
        return lost

    def close(self) -> None:
        """Let the exchange and hashing threads go (drain first: an exchange still in flight here is abandoned)."""
        if self._exchanges is not None:
            self._exchanges.shutdown(wait=False, cancel_futures=True)
            self._exchanges = None
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def maybe_evaluate(self, eval_sets: dict[str, torch.Tensor] | None) -> dict[str, float] | None:
        every = self.cfg.train.eval_every
        last = self.state.round >= self.cfg.train.rounds
        if eval_sets is None or every == 0 or (self.state.round % every and not last):
            return None
        if self.fragments.count > 1:  # the replicated state, not θ (the fragments not exchanged yet are ahead of it)
            params = [p.detach().clone() for p in self.model.parameters()]
            self.state.copy_to(self.model.parameters())
            try:
                losses = evaluate(self.model, eval_sets, self.cfg.data.batch_size, self.cfg)
            finally:
                with torch.no_grad():
                    for p, x in zip(self.model.parameters(), params, strict=True):
                        p.copy_(x)
        else:
            losses = evaluate(self.model, eval_sets, self.cfg.data.batch_size, self.cfg)
        if not all(math.isfinite(v) for v in losses.values()):
            log.warning("eval loss is not finite: %s", losses)
        return losses

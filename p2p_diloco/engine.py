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

Overlap (``swarm.overlap`` eager or delayed: round t's exchange behind round t+1's inner steps): overlap.py, mixed into
Worker. A round's records (ReduceInfo, Contribution, RoundResult) and the Reducer and SharedState seams: rounds.py.

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
from typing import Any

import torch

from p2p_diloco.codec import get_codec, roundtrip_parts
from p2p_diloco.config import Config
from p2p_diloco.fragments import Fragments
from p2p_diloco.inner import InnerOptimizer, InnerStats, round_end
from p2p_diloco.local_state import LocalStateMixin
from p2p_diloco.model import autocast, build_model, resolve_device
from p2p_diloco.outer import NonFiniteUpdateError, OuterState, outer_lr_at, pseudo_gradient
from p2p_diloco.overlap import OverlapMixin, Pending
from p2p_diloco.protocol import Action, Decision, GatherPayload, RoundRules, RoundTag, decide
from p2p_diloco.rounds import Contribution, ReduceInfo, Reducer, RoundResult, SharedState
from p2p_diloco.state_tags import StateTags

__all__ = ["SPARSE_OUTER", "Worker", "evaluate", "sparse_advice"]

log = logging.getLogger(__name__)


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


class Worker(OverlapMixin, LocalStateMixin):
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
        self.tags = StateTags()  # the outer state's tag, hashed once per state (in the background: ``tag_soon``)
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
        self.tags.settled()  # the only change in place: a hashing in the background must have read the state first
        lr = self.outer_lr(self.state.round)
        only = self.active() if self.fragments.count > 1 else None
        try:
            self.state.apply(avg_delta, lr, self.cfg.outer.momentum, self.cfg.outer.nesterov, only)
        finally:
            self.state.copy_to(self.model.parameters(), only)
        return lr

    def tag(self) -> RoundTag:
        """The outer state's (round, checksum), hashed once per state (state_tags.py): the state changes only through
        ``load_state`` (a new object) and ``apply_outer`` (its round moves)."""
        return self.tags.tag(self.state)

    def tag_soon(self) -> Future:
        """The outer state's tag as a future, hashed in a background thread: a settled round thus leaves its checksum
        (0.08 s for the small preset's 19M parameters, more on a loaded machine) to the time the next inner steps
        run; whoever needs it waits (``tag``, RoundResult.checksum)."""
        return self.tags.soon(self.state)

    def cached_tag(self) -> RoundTag | None:
        """The outer state's tag if it was hashed since the state last changed, else None (nothing is hashed)."""
        return self.tags.cached(self.state)

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

    def take_lost(self) -> list[RoundResult]:
        """The rounds lost since the last call (``lost``), oldest first."""
        lost, self.lost = self.lost, []
        return lost

    def close(self) -> None:
        """Let the exchange and hashing threads go (drain first: an exchange still in flight here is abandoned)."""
        if self._exchanges is not None:
            self._exchanges.shutdown(wait=False, cancel_futures=True)
            self._exchanges = None
        self.tags.close()

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

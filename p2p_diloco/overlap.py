"""Eager and delayed overlap: round t's exchange in flight while round t+1's inner steps run (``swarm.overlap``).

Inputs:  the Worker this mixes into (engine.py): its Config, model θ, outer state, fragments, ``settle`` and ``tag``;
         a ``send`` that starts the reduce of a Contribution and returns its Future (-> (averaged, ReduceInfo)).
Output:  ``launch`` sends this round's Δ and starts the next inner steps from the look-ahead; ``drain`` settles the
         exchange in flight (a RoundResult, or None when it moved nothing) and carries the steps taken since onto
         the settled state.
State:   on the Worker: ``pending`` (the exchange in flight, one at most), ``start`` (the look-ahead its inner steps
         started from, fp32 CPU; None: the anchor), ``overlap_steps`` (τ, adapted with ``swarm.overlap_steps`` 0).
Failure: ``drain`` raises what the reduce raised, with θ already carried onto the outer state as it is; a state
         replaced while its exchange was in flight (a rollback or a download) drops the result as a lost round.

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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import Action, RoundRules
from p2p_diloco.rounds import Contribution, RoundResult, SharedState

if TYPE_CHECKING:
    from p2p_diloco.engine import Worker

__all__ = ["OverlapMixin", "Pending"]

log = logging.getLogger("p2p_diloco.engine")


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


class OverlapMixin:
    """Worker's eager and delayed overlap (the module docstring); mixed into engine.Worker, whose state it uses."""

    def launch(self: Worker, mine: Contribution, send: Callable[[Contribution], Future]) -> Contribution:
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
        self: Worker,
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

    def _carried(self: Worker, pending: Pending) -> list[bool] | None:
        """Per tensor, whether the drain of ``pending`` puts it on the anchor with the carried steps (None: every
        tensor). With fragments, the fragment it sent: the others keep θ as it is, their outer state did not move;
        unless a download replaced the state since the launch: then every tensor, as without fragments."""
        if self.fragments.count == 1 or self.state is not pending.state:
            return None
        return self.fragments.active(pending.mine.payload.tag.round)

    def _adapt(self: Worker, pending: Pending, started: float, waited: float) -> None:
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

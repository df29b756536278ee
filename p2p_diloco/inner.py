"""The inner loop: H local optimizer steps on one worker's shard.

Inputs:  the model (fp32 params on its device), an iterator of int64 [B, T] token batches, InnerConfig,
         the global inner-step index where this round starts (so the lr schedule continues across
         rounds and is the same on every peer that holds the same round).
Output:  the model's params after H steps, and InnerStats (mean loss, tokens, seconds, tokens/s, peak
         memory) for the round; per-step losses for logs.
State:   the optimizer (AdamW moments), kept across rounds on purpose: DiLoCo keeps each worker's inner
         state (diloco-notes.md).
Failure: NonFiniteLossError when a step's loss is NaN/inf (the round must be abandoned, not averaged). The
         gradients of an abandoned step are dropped when the next round starts, so they never leak into it;
         ``drop_nonfinite_state`` forgets optimizer moments that hold NaN/inf (the peer's rollback calls it).

Schedule: linear warmup over ``warmup_steps`` from 0, then cosine decay to ``min_lr_ratio * lr`` at
``total_steps`` (or constant). ``grad_accum`` batches make one step; tokens count all of them. A step's place in
the schedule is its global index, or what ``position`` says (time-budgeted rounds: the swarm's clock, so peers of
different speeds step with the same lr at the same moment; engine.py). With a ``deadline`` the steps stop before one
that would end past it (the last step's duration is the estimate); at least one step is always taken.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from p2p_diloco.config import InnerConfig

__all__ = ["InnerOptimizer", "InnerStats", "NonFiniteLossError", "lr_at", "peak_memory_bytes", "round_end"]


class NonFiniteLossError(FloatingPointError):
    """An inner step produced a NaN or infinite loss."""


def lr_at(step: float, cfg: InnerConfig, total_steps: int) -> float:
    """Learning rate of inner step ``step`` (0-based, counted across rounds; a fraction between two steps is fine)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def round_end(round_seconds: float, now: float, after: float = 0.0) -> float:
    """When a time-budgeted round that starts at ``now`` ends: the first multiple of ``round_seconds`` after
    ``now`` (the same instant for every peer whose clock agrees), and at least ``round_seconds`` after ``after`` (the
    previous round's end: a peer whose exchange finished before that end does not get a sliver of a round)."""
    end = (math.floor(now / round_seconds) + 1) * round_seconds
    while end < after + round_seconds - 1e-6:
        end += round_seconds
    return end


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory since the last reset on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class InnerStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    started: float = 0.0  # wall-clock time (time.time()) the steps began: with overlap, records lag their rounds
    losses: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class InnerOptimizer:
    """AdamW (or plain SGD, for the invariant tests) with clipping, schedule and accumulation."""

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, total_steps: int) -> None:
        self.model, self.cfg, self.total_steps = model, cfg, total_steps
        self.step_offset = 0  # steps that came before this optimizer's step 0 on the same schedule (continue_after)
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
            )
        else:
            self.optimizer = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def compute_grads(
        self, batches: Iterator[torch.Tensor], autocast: Callable, device: torch.device
    ) -> tuple[float, int]:
        """Forward/backward over ``grad_accum`` batches; grads left in ``.grad``. Returns (loss, tokens)."""
        total_loss, tokens = 0.0, 0
        for _ in range(self.cfg.grad_accum):
            batch = next(batches).to(device, non_blocking=True)
            with autocast():
                loss = self.model(input_ids=batch, labels=batch).loss
            (loss / self.cfg.grad_accum).backward()
            total_loss += loss.item() / self.cfg.grad_accum
            tokens += batch.numel()
        if not math.isfinite(total_loss):
            raise NonFiniteLossError(f"inner loss is {total_loss}: lower inner.lr or check the data")
        return total_loss, tokens

    def drop_nonfinite_state(self) -> bool:
        """Forget the optimizer's state (AdamW moments, step counts) if any of it holds NaN/inf; True when it did.

        An inf gradient that passed a finite loss leaves NaN moments behind, and then every later step is NaN
        whatever θ starts from; forgotten moments start afresh at the next step.
        """
        for entry in self.optimizer.state.values():
            for value in entry.values():
                if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    self.optimizer.state.clear()
                    self.optimizer.zero_grad(set_to_none=True)
                    return True
        return False

    def continue_after(self, steps: int, optimizer_state: dict) -> None:
        """Go on from ``steps`` earlier steps of another optimizer of the same model shape: its moments (a copy, from
        its ``state_dict()``) and its place in one schedule that now spans those steps and this one's."""
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # load_state_dict would share its tensors
        self.step_offset += steps
        self.total_steps += steps

    def apply(self, step: float) -> None:
        """Clip, set the scheduled lr for global step ``step`` and take the optimizer step."""
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = lr_at(self.step_offset + step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(
        self,
        batches: Iterator[torch.Tensor],
        steps: int,
        first_step: int,
        autocast: Callable,
        device: torch.device,
        on_step: Callable[[int, float], None] | None = None,
        *,
        deadline: float | None = None,
        position: Callable[[int], float] | None = None,
    ) -> InnerStats:
        """Take ``steps`` optimizer steps starting at global step ``first_step``; with ``deadline`` (a ``time.time()``)
        stop before a step that would end after it (at least one step); ``position(k)``: step k's place in the
        schedule (default ``first_step + k``)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # an abandoned step's grads (NaN loss, stop) must not add up here
        stats = InnerStats(started=time.time())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start, last = time.perf_counter(), 0.0
        for k in range(steps):
            began = time.time()
            if k and deadline is not None and began + last > deadline:
                break
            loss, tokens = self.compute_grads(batches, autocast, device)
            self.apply(first_step + k if position is None else position(k))
            last = time.time() - began
            stats.losses.append(loss)
            stats.tokens += tokens
            stats.steps += 1
            if on_step is not None:
                on_step(k, loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.seconds = time.perf_counter() - start
        stats.peak_memory_bytes = peak_memory_bytes(device)
        return stats

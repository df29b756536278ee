"""The replicated outer state and the outer step (pure torch, no network).

Inputs:  the anchor (fp32 CPU tensors, one per model parameter) and a worker's params θ after H inner
         steps (any dtype/device, same shapes).
Output:  pseudo-gradient Δ = anchor − θ (fp32, CPU, same shapes); the Nesterov outer step applied to
         the anchor with the averaged Δ̄ as its gradient; a checksum of the state.
State:   OuterState = anchor, momentum buffers (fp32 CPU), round (rounds applied so far). The inner lr
         schedule position is derived from ``round`` (round x H), so it needs no field of its own.
         Every peer of a group must hold the identical OuterState after each round.
Failure: NonFiniteUpdateError for a non-finite Δ or Δ̄; nothing is modified when it is raised.

The outer step matches ``torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)`` (single-tensor
path, op for op): buf = m·buf + g;  g' = g + m·buf (Nesterov) or buf;  anchor -= lr·g'.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.state_parts import part_digests, state_checksum

__all__ = [
    "NonFiniteUpdateError",
    "is_finite",
    "OuterState",
    "outer_lr_at",
    "pseudo_gradient",
    "weighted_mean",
]


class NonFiniteUpdateError(FloatingPointError):
    """A pseudo-gradient or averaged pseudo-gradient holds NaN or inf."""


def is_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in ``tensor``: one read, no allocation (its sum: NaN and inf propagate into it). An fp32 sum
    that overflows (values near 1e31 and beyond, which no Δ or state holds) counts as not finite too. 22x faster
    than ``isfinite().all()`` on 50M values, which every round ran 4 times over Δ, Δ̄ and the state."""
    return math.isfinite(float(tensor.sum())) if tensor.is_floating_point() else True


def _check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    for k, t in enumerate(tensors):
        if not is_finite(t):
            raise NonFiniteUpdateError(f"{what} tensor {k} (shape {list(t.shape)}) holds NaN or inf; not applied")


def pseudo_gradient(anchor: Sequence[torch.Tensor], params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = anchor − θ in fp32 on CPU. Raises NonFiniteUpdateError when Δ is not finite."""
    delta = [a - p.detach().to("cpu", torch.float32) for a, p in zip(anchor, params, strict=True)]
    _check_finite(delta, "pseudo-gradient")
    return delta


def weighted_mean(tensor_lists: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Σ w_i·x_i / Σ w_i, per tensor position: the in-process reference for the all-reduce."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    out = []
    for parts in zip(*tensor_lists, strict=True):
        acc = torch.zeros_like(parts[0])
        for w, x in zip(weights, parts, strict=True):
            acc.add_(x, alpha=w / total)
        out.append(acc)
    return out


def outer_lr_at(round: int, lr: float, warmup_rounds: int) -> float:
    """Outer lr of the outer step that ends round ``round + 1`` (``round`` rounds applied before it): a linear
    ramp over ``warmup_rounds``, then constant."""
    if warmup_rounds and round < warmup_rounds:
        return lr * (round + 1) / warmup_rounds
    return lr


@dataclass
class OuterState:
    anchor: list[torch.Tensor]
    momentum: list[torch.Tensor]
    round: int = 0  # rounds applied to this state (metrics.jsonl: outer_step)

    @classmethod
    def from_params(cls, params: Iterable[torch.Tensor]) -> OuterState:
        anchor = [p.detach().to("cpu", torch.float32).clone() for p in params]
        return cls(anchor=anchor, momentum=[torch.zeros_like(a) for a in anchor], round=0)

    def apply(
        self,
        avg_delta: Sequence[torch.Tensor],
        lr: float,
        momentum: float,
        nesterov: bool = True,
        only: Sequence[bool] | None = None,
    ) -> None:
        """One outer SGD step on the anchor with ``avg_delta`` as the gradient: the outer step that ends a round.
        ``only``: per tensor, whether it takes the step (swarm.fragments: the round's fragment); the others' anchor and
        momentum stay as they are. Default: every tensor."""
        _check_finite(avg_delta, "averaged pseudo-gradient")
        for k, (a, buf, g) in enumerate(zip(self.anchor, self.momentum, avg_delta, strict=True)):
            if only is not None and not only[k]:
                continue
            g = g.to(torch.float32)
            if momentum != 0:
                buf.mul_(momentum).add_(g)
                g = g.add(buf, alpha=momentum) if nesterov else buf
            a.add_(g, alpha=-lr)
        self.round += 1

    def ahead(
        self, delta: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool = True
    ) -> list[torch.Tensor]:
        """The anchor an outer step with ``delta`` (already checked finite) would leave, as new tensors, without
        changing the state: eager overlap's look-ahead. Nesterov: anchor - lr((1+m)Δ + m²·buf); heavy ball: anchor -
        lr(Δ + m·buf) (``apply``'s step in closed form: one new tensor and two passes each, equal to it up to fp32
        rounding)."""
        scale = (1 + momentum) if nesterov else 1.0
        on_buf = momentum * momentum if nesterov else momentum
        out = []
        for a, buf, g in zip(self.anchor, self.momentum, delta, strict=True):
            x = a.add(g.to(torch.float32), alpha=-lr * scale)
            if momentum != 0:
                x.add_(buf, alpha=-lr * on_buf)
            out.append(x)
        return out

    def copy_to(self, params: Iterable[torch.Tensor], only: Sequence[bool] | None = None) -> None:
        """θ ← anchor (into the model's params, whatever their device and dtype); ``only``: those tensors alone."""
        with torch.no_grad():
            for k, (p, a) in enumerate(zip(params, self.anchor, strict=True)):
                if only is None or only[k]:
                    p.copy_(a)

    def tensors(self) -> list[torch.Tensor]:
        """Anchor then momentum: the order used for state transfer and checkpoints."""
        return [*self.anchor, *self.momentum]

    def is_finite(self) -> bool:
        """No NaN or inf in the anchor or the momentum (one pass over the state)."""
        return all(is_finite(t) for t in self.tensors())

    def copy(self) -> OuterState:
        """An independent copy (new tensors), e.g. a snapshot to serve or to roll back to."""
        return OuterState.from_tensors(self.tensors(), self.round)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], round: int) -> OuterState:
        if len(tensors) % 2:
            raise ValueError(f"outer state needs anchor and momentum tensors in pairs, got {len(tensors)}")
        half = len(tensors) // 2
        clean = [t.detach().to("cpu", torch.float32).clone() for t in tensors]
        return cls(anchor=clean[:half], momentum=clean[half:], round=round)

    def checksum(self) -> str:
        """sha256 over the round and the digests of the state's parts (state_parts.py): equal on two peers iff
        their states are equal, and checkable part by part by a peer that downloads it."""
        return state_checksum(self.round, part_digests(self.tensors()))

    def whole_checksum(self) -> str:
        """The checksum before protocol 5 (sha256 over round and all bytes): what older checkpoints hold."""
        h = hashlib.sha256(struct.pack("<q", self.round))
        for t in self.tensors():
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

"""A round's records at the engine's seams: what a reduce did, what a worker brings, what a round left.

Inputs:  none (types only); the engine fills them, the Reducer (the simulator's in-process mean, or the swarm's
         averager: swarm/reduce.py) returns a ReduceInfo, the SharedState (swarm/sync.py) takes the outer step.
Output:  ``ReduceInfo`` (one reduce: group, attempts, seconds, bytes, the members' payloads), ``Contribution`` (Δ, its
         payload and inner stats), ``RoundResult`` (one round as metrics.jsonl records it), the ``Reducer`` and
         ``SharedState`` protocols, and ``fp32_bytes_sent`` (the butterfly's byte bound).
State:   none.
Failure: ``RoundResult.checksum`` waits for the state's hashing in the background and raises what it raised.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from p2p_diloco.inner import InnerStats
from p2p_diloco.protocol import Action, Gathered, GatherPayload, RoundTag

__all__ = ["Contribution", "ReduceInfo", "Reducer", "RoundResult", "SharedState", "fp32_bytes_sent"]


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
    dropped: dict[str, int] = field(default_factory=dict)  # sender -> parts our reducer dropped by direction or skew
    group_reads: int = 0  # DHT lookups of the group key's declarations that matchmaking made (swarm/matchmaking.py)
    repaired: int = 0  # reducers' slices whose replies stopped short, copied whole from a mate (swarm/repair.py)


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
            "group_reads": self.reduce.group_reads,
            "repaired_slices": self.reduce.repaired,
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

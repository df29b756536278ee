"""A round of several groups (protocol.split_groups): each part's group means combined by one round reducer.

Inputs:  the round's groups as one group's runner sees them (``RoundGroups``: who reduces each part in each group,
         the parts' lengths, each group's weight cap, the call to another member's ``rpc_combine_part``); this member's
         WireCodec and PayloadBytes (wire.py); the robust rule and clip the groups' means are combined with.
Output:  ``Combiner.combine`` (our group's mean of a part -> the round's mean of it, as the round reducer encoded it:
         ``Settled``), ``Combiner.serve`` (as a round reducer: another group's mean -> the round's, or a refusal);
         ``part_lengths`` and ``part_owners``, the parts and their reducers as hivemind's TensorPartContainer makes
         them, the same on every member of every group.
State:   per attempt, per part this member is the round reducer of: the groups' means received so far.
Failure: a group's mean from a peer that is not that group's reducer of the part, of another length, or a part sent
         twice, is refused (the attempt fails for everyone: the vote); a weight over the group's cap counts 0;
         ``combine`` raises AllreduceException or TimeoutError when the round reducer refuses or does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.robust import combine_groups
from p2p_diloco.swarm.wire import PayloadBytes, WireCodec

__all__ = ["Combiner", "RoundGroups", "Settled", "part_lengths", "part_owners"]

log = logging.getLogger("p2p_diloco.butterfly")


@dataclass(frozen=True)
class Settled:
    """A part of the round's mean as its round reducer encoded it (``serialized``, what every member receives) and
    decoded (``tensor``): members of every group decode the same bytes, so they hold the same values."""

    tensor: torch.Tensor
    serialized: Any  # runtime_pb2.Tensor


def part_lengths(shapes: Sequence[Sequence[int]], part_values: int) -> list[int]:
    """The round's parts, as hivemind's TensorPartContainer cuts every member's tensors (each tensor flattened and
    split into ``part_values`` values, the last shorter): the same on every member of every group."""
    out = []
    for shape in shapes:
        numel = math.prod(shape)
        out += [min(part_values, numel - start) for start in range(0, numel, part_values)]
    return out


def part_owners(lengths: Sequence[int], fractions: Sequence[float]) -> list[int]:
    """Which member of a group (by index) reduces each part, as TensorPartContainer assigns them from the members'
    fractions of the vector (partition.py:66-90: a part between two members goes to the one holding more of it)."""
    total = sum(lengths)
    pivots = (np.cumsum(fractions) / np.sum(fractions) * total).astype(np.int64)
    pivots[-1] = total
    owners, length, member = [], 0, 0
    for size in lengths:
        if length + size > pivots[member]:
            first, overlaps = member, [pivots[member] - length]
            while length + size > pivots[member]:
                member += 1
                overlaps.append(min(length + size, pivots[member]) - pivots[member - 1])
            owners.append(first + int(np.argmax(overlaps)))
        else:
            owners.append(member)
        length += size
    return owners


@dataclass(frozen=True)
class RoundGroups:
    """A round of several groups (protocol.split_groups), as one group's runner sees it.

    ``owners[k][p]``: the peer reducing the round's part ``p`` (``part_lengths``) in group ``k``; ``index``: our group;
    ``lengths``: the parts' lengths; ``caps[k]``: the most weight group k's mean can stand for (its senders' declared
    tokens times their factors, for those whose Δ counts); ``call(peer, request)``: that peer's ``rpc_combine_part``
    (the averager's stub), awaited at most ``timeout`` seconds. Part p's round reducer is ``leader(p)``: its reducer
    in group ``p mod groups``, so the parts' round reducers spread over the groups."""

    index: int
    owners: list[list[Any]]
    lengths: list[int]
    caps: list[float]
    call: Callable[[Any, Any], Awaitable[Any]]
    timeout: float

    def leader(self, part: int) -> Any:
        return self.owners[part % len(self.owners)][part]


class Combiner:
    """One member's part in combining a round's groups: as a group's reducer it sends its group's mean of each part
    it reduces, encoded with the wire codec, to that part's round reducer (``combine``); as a round reducer it takes
    every group's mean of its parts (``serve``; its own group's through the same codec), ``combine_groups`` them in
    group order, encodes the result once and answers every group's reducer with those bytes, which they hand on to
    their members. So each part of the round's mean is computed on one machine and every member of every group holds
    the same bits. A group's mean is refused (the attempt fails) when it comes from a peer that is not that group's
    reducer of the part or does not decode to the part's length; a weight over the group's cap counts 0."""

    def __init__(
        self,
        groups: RoundGroups,
        peer_id: Any,
        group_id: bytes,
        wire: WireCodec,
        payload_bytes: PayloadBytes,
        rule: str,
        clip: float,
    ):
        self.groups, self.peer_id, self.group_id, self.wire = groups, peer_id, group_id, wire
        self.payload_bytes, self.rule, self.clip = payload_bytes, rule, clip
        self._slots: dict[int, tuple[dict[int, tuple[torch.Tensor, float]], asyncio.Future]] = {}

    async def combine(self, part: int, mean: torch.Tensor, weight: float) -> Settled:
        """Our group's ``mean`` of ``part`` (standing for ``weight``) -> the round's mean of it."""
        try:
            return await self._combine(part, mean, weight)
        except Exception as exc:
            log.warning("part %d of the round: no round mean from %s (%r)", part, self.groups.leader(part), exc)
            raise

    async def _combine(self, part: int, mean: torch.Tensor, weight: float) -> Settled:
        loop = asyncio.get_event_loop()
        serialized = await loop.run_in_executor(None, self.wire.means.compress, mean)
        leader = self.groups.leader(part)
        if leader == self.peer_id:
            return await self._offer(part, self.groups.index, self.wire.means.extract(serialized), weight)
        metadata = {"group_id": self.group_id, "part": part, "group": self.groups.index, "weight": float(weight)}
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(metadata), tensor_part=serialized)
        self.payload_bytes.add(PayloadBytes.SENT, request.ByteSize())
        reply = await asyncio.wait_for(self.groups.call(leader, request), self.groups.timeout)
        self.payload_bytes.add(PayloadBytes.RECEIVED, reply.ByteSize())
        if not reply.HasField("tensor_part"):
            raise AllreduceException(f"the round reducer of part {part} refused our group's mean")
        tensor = self.wire.means.extract(reply.tensor_part)
        if tuple(tensor.shape) != (self.groups.lengths[part],):
            raise AllreduceException(f"the round reducer of part {part} sent {tuple(tensor.shape)} values")
        return Settled(tensor, reply.tensor_part)

    async def serve(self, caller: Any, request: Any) -> Any:
        """Another group's mean of a part we are the round reducer of (``request.metadata``: the round's
        ``group_id``, the ``part``, the sender's ``group`` and the ``weight`` its mean stands for) -> the round's mean
        of it, or an empty reply (a refusal)."""
        self.payload_bytes.add(PayloadBytes.RECEIVED, request.ByteSize())
        refused = averaging_pb2.DownloadData()
        try:
            meta = MSGPackSerializer.loads(request.metadata) if len(request.metadata) <= 256 else None
            part, group, weight = int(meta["part"]), int(meta["group"]), float(meta["weight"])
            groups = self.groups
            valid = 0 <= part < len(groups.lengths) and 0 <= group < len(groups.owners) and group != groups.index
            if not valid or groups.owners[group][part] != caller or groups.leader(part) != self.peer_id:
                return refused
            tensor = self.wire.means.extract(request.tensor_part)
            if tuple(tensor.shape) != (groups.lengths[part],):
                return refused
        except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
            return refused
        if not (math.isfinite(weight) and 0 <= weight <= groups.caps[group]):
            weight = 0.0  # a group's mean can stand for no more than its senders' tokens
        try:
            settled = await asyncio.wait_for(self._offer(part, group, tensor, weight), self.groups.timeout)
        except (asyncio.TimeoutError, AllreduceException):
            return refused
        reply = averaging_pb2.DownloadData(tensor_part=settled.serialized)
        self.payload_bytes.add(PayloadBytes.SENT, reply.ByteSize())
        return reply

    async def _offer(self, part: int, group: int, mean: torch.Tensor, weight: float) -> Settled:
        if part not in self._slots:
            self._slots[part] = ({}, asyncio.get_event_loop().create_future())
        means, done = self._slots[part]
        if group in means:
            raise AllreduceException(f"group {group} sent part {part} twice")
        means[group] = (mean, weight)
        if len(means) == len(self.groups.owners) and not done.done():
            order = range(len(self.groups.owners))
            result = combine_groups([means[k][0] for k in order], [means[k][1] for k in order], self.rule, self.clip)
            serialized = self.wire.means.compress(result)
            done.set_result(Settled(self.wire.means.extract(serialized), serialized))
        return await asyncio.shield(done)

"""A reducer's slice that reached a member short, taken whole from a mate that got it: one lost reply, not a retry.

Inputs:  a member's finished butterfly (``ExactRunner``) whose ``failed_reducers`` name reducers whose averaged
         parts stopped coming (a reset stream, a reply cut short) while the others of its group may have got them all;
         its shared-memory tensors holding the butterfly's result; the group's members and modes.
Output:  ``_repair_slices``: the reducers whose slices were copied in from a mate, written over our tensors' range of
         each (the values every member that completed holds, bit for bit), and the values they cover.
         ``rpc_averaged_slice``: that range of this member's averaged vector, for a mate of the same group.
State:   none of its own: a mate serves from hivemind's ``_running_groups`` (its runner, while its attempt is not
         over) and its own vote (``_votes``: only once its own verdict is complete).
Failure: nothing raises. A mate answers an empty reply to an ask that is not one (bytes that do not read as the
         four fields of their types, an empty range), from a peer not in its group, for a reducer that is not in the
         group or whose slice it lost too, for another range than the one it computes, or while it has no complete
         result; the member then asks the next mate and, when none has it, keeps the slice failed: the attempt fails
         and is retried, as before. A mate that sends other values than the rest gets the copy past this step, not
         past the vote: the digest of our vector then differs from the others' and the attempt fails for everyone.

Why: an incomplete all-reduce fails the attempt for every member of the round (the vote), and the retry sends every
Δ again. Measured: a member lost the last part (16 values) of one reducer's slice in a round of 6, and all 6 peers
retried the round, each sending its bytes twice (tests/test_scale_smoke.py, 1 run in 10 beside a busy process). When
the reducer itself is gone nobody holds its slice, and the attempt is retried as before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from p2p_diloco.state_parts import read_values, write_values
from p2p_diloco.swarm.wire import PayloadBytes

log = logging.getLogger("p2p_diloco.averager")

__all__ = ["RepairMixin", "slice_ranges"]


def slice_ranges(part_shapes_by_peer: list[list[torch.Size]]) -> list[tuple[int, int]]:
    """(start, length) of each reducer's slice in the flat vector of a butterfly's tensors, from the shapes of the parts
    hivemind's TensorPartContainer gives each reducer: it hands them consecutive ranges, in the group's order."""
    sizes = [sum(math.prod(shape) for shape in shapes) for shapes in part_shapes_by_peer]
    return [(sum(sizes[:k]), sizes[k]) for k in range(len(sizes))]


def _read_ask(serializer: Any, metadata: bytes) -> tuple[bytes, str, int, int] | None:
    """(group_id, reducer, start, length) of a mate's ask, or None when its bytes are not one: too long, not what
    ``serializer`` reads, not a dict of those four of those types, or an empty or negative range."""
    if len(metadata) > 512:
        return None
    try:
        ask = serializer.loads(metadata)
    except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
        return None
    if not isinstance(ask, dict):
        return None
    group_id, reducer, start, length = (ask.get(key) for key in ("group_id", "reducer", "start", "length"))
    if not (isinstance(group_id, bytes) and isinstance(reducer, str) and type(start) is int and type(length) is int):
        return None  # type(...) is int: a bool is an int too
    if start < 0 or length <= 0:
        return None
    return group_id, reducer, start, length


class RepairMixin:
    """The slice repair of PseudoGradAverager (averager.py), run in its averager process; see the module docstring."""

    async def _repair_slices(self, runner: Any, tensors: list[torch.Tensor], timeout: float) -> dict[str, int]:
        """Copy each failed reducer's slice from a mate of our group that got it whole -> {reducer: values}. The mates
        asked: the group's members that accept calls, but not a reducer whose own stream to us failed (dead or cut
        off, most likely: asking it would cost a timeout); each ask within ``timeout``, all of them within twice
        that."""
        repaired, deadline = {}, time.monotonic() + 2 * timeout
        members = list(runner.ordered_peer_ids)
        servers = [
            p
            for p, m in zip(members, runner.modes, strict=True)
            if m == AveragingMode.NODE and p != self.peer_id and str(p) not in runner.failed_reducers
        ]
        if servers:  # each member starts with another mate: the asks of several spread over the group
            turn = members.index(self.peer_id) % len(servers)
            servers = servers[turn:] + servers[:turn]
        for reducer, lost in list(runner.failed_values.items()):
            start, length = runner.slice_ranges[[str(p) for p in members].index(reducer)]
            for mate in servers:
                left = deadline - time.monotonic()
                if left <= 0:
                    return repaired
                values = await self._ask_slice(mate, runner, reducer, start, length, min(timeout, left))
                if values is not None:
                    write_values(tensors, start, values)
                    repaired[reducer] = lost
                    log.info("took reducer %s's slice (%d values) from mate %s", reducer[-6:], length, str(mate)[-6:])
                    break
        return repaired

    async def _ask_slice(
        self, mate: Any, runner: Any, reducer: str, start: int, length: int, timeout: float
    ) -> torch.Tensor | None:
        """The mate's averaged values of that range, or None (refused, wrong length, not in time)."""
        ask = {"group_id": runner.group_id, "reducer": reducer, "start": start, "length": length}
        meta = self.serializer.dumps(ask)
        try:
            stub = self.get_stub(self._p2p, mate, namespace=self.prefix)
            reply = await stub.rpc_averaged_slice(averaging_pb2.DownloadData(metadata=meta), timeout=timeout)
            runner.payload_bytes.add(PayloadBytes.RECEIVED, reply.ByteSize())
            if not reply.HasField("tensor_part"):
                return None
            values = deserialize_torch_tensor(reply.tensor_part)
        except Exception as exc:  # noqa: BLE001 - a mate that fails is one that does not have it
            log.debug("mate %s gave no slice of %s: %r", mate, reducer, exc)
            return None
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != length:
            return None
        return values

    async def rpc_averaged_slice(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """A mate's request for one reducer's slice of this member's averaged vector: served once this member's own
        verdict on the attempt is complete, when the reducer's slice reached it whole and the range is the one it
        computes too; else an empty reply."""
        refused = averaging_pb2.DownloadData()
        ask = _read_ask(self.serializer, request.metadata)
        if ask is None:
            return refused
        group_id, reducer, start, length = ask
        future = self._running_groups.get(group_id)
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return refused
        if not self.admits(context.remote_id):
            return refused
        runner = future.result()
        members = [str(p) for p in runner.ordered_peer_ids]
        if str(context.remote_id) not in members or reducer not in members or reducer in runner.failed_reducers:
            return refused
        if tuple(runner.slice_ranges[members.index(reducer)]) != (start, length):
            return refused
        mine = self._vote_state(group_id)["mine"]
        try:  # our butterfly is over and judged complete: our tensors hold the round's mean
            verdict, _ = await asyncio.wait_for(asyncio.shield(mine), self.request_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            return refused
        if not verdict or group_id not in self._running_groups:  # over: our host may be writing the next Δ there
            return refused
        values = read_values(self._averaged_tensors, start, start + length)  # no await from the check to the copy
        reply = averaging_pb2.DownloadData(tensor_part=serialize_torch_tensor(values))
        PayloadBytes(self._payload_totals).add(PayloadBytes.SENT, reply.ByteSize())
        return reply

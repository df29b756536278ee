"""One attempt's butterfly all-reduce, changed from hivemind 1.1.12's AllReduceRunner where it was not exact.

Inputs:  what hivemind's runner takes (the member's shared-memory tensors, the group, its weight, timeouts);
         built by ``PseudoGradAverager._aggregate_with_group`` (averager.py) once per group.
Output:  the averaged tensors, bitwise equal on every member whose slices all arrived; the counters the averager
         judges completeness by (``tensor_part_container.failed_size``, the reducer's ``num_parts_received``,
         ``banned_senders``); ``payload_bytes`` {"sent", "received"}.
State:   per attempt: the parts in flight and the byte counters.
Failure: as hivemind's: a reducer that fails leaves its slice with LOCAL values (``failed_size`` > 0; stock
         returns deltas and reports success); a banned or silent sender is left out of that reducer's slice.

What differs from the stock runner:
- reducers send the averaged part itself instead of ``averaged - part`` (allreduce.py:210, :354: members added
  it to their own part and ended up to 1 ulp apart);
- a sender that stalls the reducer's current part longer than ``next_chunk_timeout`` is banned (stock missed a
  sender whose stream broke while the reducer was answering it: the round hung until ``allreduce_timeout``);
- our own slice marks the reducer failed if its local averaging raises (stock: that slice would hang);
- the reducer keeps every sender's part and reduces them together (``robust.aggregate``: a mean whose senders
  are clipped, configured by ``swarm.aggregation``), each with the weight its gather payload declared, if the
  wire weight matches it and one round can hold it, else 0 (stock: the wire weight, whatever it is);
- an averaged part longer than ``2 x aggregation_clip`` x this member's own part of it marks its reducer a liar
  (``lying_reducers``): robust rules never average parts longer than clip x the median, so an honest reducer's
  result stays within that bound (the averager fails the attempt and stops grouping with it);
- payload bytes are counted where messages meet the transport, both as caller (``_get_peer_stub``: our parts
  to each reducer and its averaged parts back) and as handler (``rpc_aggregate_part``: a sender's parts and our
  replies): the protobuf ``ByteSize()`` of each message, before libp2p framing and encryption. The own slice is
  averaged locally and counts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from p2p_diloco.robust import aggregate, trusted_weight

__all__ = ["Aggregation", "ExactRunner", "RobustPartReducer"]


async def _counted(messages: AsyncIterable[Any], counts: Counter[str], key: str) -> AsyncIterator[Any]:
    """``messages`` passed through; ``counts[key]`` grows by each one's protobuf size as it passes."""
    async for message in messages:
        counts[key] += message.ByteSize()
        yield message


class _CountingStub:
    """A groupmate's stub whose ``rpc_aggregate_part`` counts the payload bytes both ways into ``counts``."""

    def __init__(self, stub: Any, counts: Counter[str]):
        self._stub, self._counts = stub, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, inputs: AsyncIterable[Any], **kwargs: Any) -> AsyncIterator[Any]:
        replies = await self._stub.rpc_aggregate_part(_counted(inputs, self._counts, "sent"), **kwargs)
        return _counted(replies, self._counts, "received")


@dataclass(frozen=True)
class Aggregation:
    """How a reducer turns the senders' parts into its slice of the mean (robust.py), and whose weight counts.

    ``declared``: per sender (``sender_peer_ids`` order), the tokens its valid gather payload declares when its Δ
    counts (protocol.decide), else None; a part counts with that many tokens only if the sender's wire weight says
    the same and it is at most ``max_tokens`` (robust.trusted_weight), else with weight 0.
    """

    rule: str
    clip: float
    declared: tuple[int | None, ...]
    max_tokens: int | None = None


class RobustPartReducer(TensorPartReducer):
    """A TensorPartReducer that keeps each sender's current part and reduces them together with robust.aggregate,
    weighting each by its trusted weight instead of the weight it put on the wire."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, aggregation: Aggregation):
        self.aggregation = aggregation
        self.current_parts: dict[int, tuple[torch.Tensor, float]] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self.current_parts = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Keep this sender's part; once every sender of this part is in, all wait for the same reduced part."""
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"part {part_index} from sender {sender_index} is out of range")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException("this reducer finished before the part arrived")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned")
        if part_index != self.current_part_index or sender_index in self.current_parts:
            raise AllreduceException(f"sender {sender_index} sent part {part_index} twice or out of order")
        future = self.current_part_future
        declared = self.aggregation.declared[sender_index]
        trusted = 0.0 if declared is None else trusted_weight(weight, declared, self.aggregation.max_tokens)
        self.current_parts[sender_index] = (tensor_part, trusted)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        senders = sorted(self.current_parts)
        parts = [self.current_parts[i][0] for i in senders]
        weights = [self.current_parts[i][1] for i in senders]
        self.current_part_future.set_result(aggregate(parts, weights, self.aggregation.rule, self.aggregation.clip))
        self.reset_accumulators()


class ExactRunner(AllReduceRunner):
    """AllReduceRunner whose results are the averaged parts themselves (bitwise equal on every member).

    ``aggregation``: the robust reduction and trusted weights of this member's reducer (RobustPartReducer).
    ``payload_bytes["sent"]`` / ``["received"]``: protobuf bytes of the all-reduce messages this member handed to
    the transport / took from it, as sender (``_get_peer_stub``) and as reducer (``rpc_aggregate_part``).
    """

    def __init__(self, aggregation: Aggregation, **kwargs: Any):
        super().__init__(**kwargs)
        container = self.tensor_part_container
        container.return_deltas = False  # a failed reducer's slice keeps the LOCAL values
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer = RobustPartReducer(shapes, len(self.sender_peer_ids), aggregation)
        self.payload_bytes: Counter[str] = Counter(sent=0, received=0)
        # A reducer's averaged part can be no longer than the longest part it may accept: robust rules accept parts
        # up to clip x the median norm. Measured all honest, our own part is within 1.54x the median, so an average
        # over 2 x clip x our part's norm is a lie (for "mean", which accepts anything, there is no bound).
        self.max_ratio = None if aggregation.rule == "mean" else 2.0 * aggregation.clip
        self.own_norms = [[float(part.norm()) for part, _ in parts] for parts in container._input_parts_by_peer]
        self.lying_reducers: set[Any] = set()
        register = container.register_processed_part

        def checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            own, reducer = self.own_norms[peer_index][part_index], self.ordered_peer_ids[peer_index]
            bound = None if self.max_ratio is None or reducer == self.peer_id or own <= 0 else self.max_ratio * own
            if bound is not None and not part.norm() <= bound:
                self.lying_reducers.add(self.ordered_peer_ids[peer_index])
            register(peer_index, part_index, part)

        container.register_processed_part = checked

    def _get_peer_stub(self, peer: Any) -> Any:
        """Our parts to that reducer and its averaged parts back: counted as they pass (allreduce.py:216)."""
        return _CountingStub(super()._get_peer_stub(peer), self.payload_bytes)

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: P2PContext) -> AsyncIterator[Any]:
        """A sender's parts to our reducer and our replies to it (averaged parts or a refusal), counted."""
        requests = _counted(stream, self.payload_bytes, "received")
        async with contextlib.aclosing(super().rpc_aggregate_part(requests, context)) as replies:
            async for reply in replies:
                self.payload_bytes["sent"] += reply.ByteSize()
                yield reply

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        try:
            for part_index, part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, self.weight)
                self.tensor_part_container.register_processed_part(index, part_index, averaged)
        except BaseException:
            self.tensor_part_container.register_failed_reducer(index)  # stock: our own slice would hang
            raise

    async def _handle_missing_senders(self) -> None:
        """Stock: ban senders that never started. Added: ban senders stalling the current part (module doc)."""
        await super()._handle_missing_senders()
        reducer = self.tensor_part_reducer
        while not reducer.finished.is_set():
            part = reducer.current_part_index
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reducer.finished.wait(), timeout=self.sender_timeout)
            if reducer.current_part_index == part and not reducer.finished.is_set():
                for sender_index, peer_id in enumerate(self.sender_peer_ids):
                    if reducer.num_parts_received[sender_index] <= part and peer_id not in self.banned_senders:
                        await self._ban_sender(peer_id)

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        part_index, loop = 0, asyncio.get_event_loop()
        try:
            async for part, weight, compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                    part_index += 1
                except BannedException:
                    break  # the sender was banned in the background; stop aggregating it
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

"""One attempt's butterfly all-reduce, changed from hivemind 1.1.12's AllReduceRunner where it was not exact.

Inputs:  what hivemind's runner takes (the member's shared-memory tensors, the group, its weight, timeouts);
         built by ``PseudoGradAverager._aggregate_with_group`` (aggregate.py) once per group.
Output:  the averaged tensors, bitwise equal on every member whose slices all arrived; the counters the averager
         judges completeness by (``tensor_part_container.failed_size``, the reducer's ``num_parts_received``,
         ``banned_senders``); the payload bytes it sent and received, added to a ``PayloadBytes`` as they pass.
State:   per attempt: the parts in flight.
Failure: as hivemind's: a reducer that fails leaves its slice with LOCAL values (``failed_size`` > 0; stock
         returns deltas and reports success); a banned or silent sender is left out of that reducer's slice.

What differs from the stock runner:
- reducers send the averaged part itself instead of ``averaged - part`` (allreduce.py:210, :354: members added
  it to their own part and ended up to 1 ulp apart);
- a sender that stalls the reducer's current part longer than ``next_chunk_timeout`` is banned (stock missed a
  sender whose stream broke while the reducer was answering it: the round hung until ``allreduce_timeout``);
- our own slice marks the reducer failed if its local averaging raises (stock: that slice would hang);
- a member that answers our parts with BAD_GROUP_ID (it runs no such group: its matchmaking gave up on the group
  its leader then assembled with it, aggregate.py's ``rpc_aggregate_part``) is banned as a sender at once: it will
  send our reducer nothing (stock waited ``sender_timeout`` for it);
- the reducer (part_reducer.py) keeps every sender's part and reduces them together (``robust.aggregate``: a mean
  whose senders are clipped, configured by ``swarm.aggregation``), each with the weight its gather payload declared,
  if the wire weight matches it and one round can hold it, else 0 (stock: the wire weight, whatever it is); a sender
  whose part points against the others' median (``swarm.min_cosine``) or sits on one side of it (``swarm.max_skew``)
  counts 0 and is named in a warning;
- an averaged slice longer than ``2 x aggregation_clip`` x this member's own part of it (times the heaviest
  sender's tokens over ours, when they differ) marks its reducer a liar
  (``lying_reducers``): robust rules never average parts longer than clip x the median, so an honest reducer's
  slice stays within that bound (the averager fails the attempt and stops grouping with it);
- a round of several groups (protocol.split_groups): the runner is one group's butterfly, but its reducer hands each
  part's group mean (``robust.aggregate_counted``, with the weight it counted) to the part's round reducer, one
  member of one group (``RoundGroups.leader``), which combines every group's (``robust.combine_groups``), encodes the
  result once and answers every group's reducer with those bytes; members of all groups receive the same bytes
  (combine.py's ``Combiner``). A group's reducer, or a round reducer, that fails fails the attempt for everyone
  (the vote);
- payload bytes are counted where messages meet the transport (wire.py), both as caller (``_get_peer_stub``: our
  parts to each reducer and its averaged parts back) and as handler (``rpc_aggregate_part``: a sender's parts and
  our replies): the protobuf ``ByteSize()`` of each message, before libp2p framing and encryption. The own slice is
  averaged locally and counts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from p2p_diloco.swarm.combine import Combiner, RoundGroups, Settled
from p2p_diloco.swarm.part_reducer import Aggregation, RobustPartReducer
from p2p_diloco.swarm.repair import slice_ranges
from p2p_diloco.swarm.wire import CountingStub, PayloadBytes, WireCodec, counted_messages

__all__ = ["ExactRunner"]


class _Refused(AllreduceException):
    """A reducer answered our parts with something other than averaged parts (``code``, hivemind's MessageCode)."""

    def __init__(self, peer_id: Any, code: int) -> None:
        super().__init__(f"{peer_id} sent {averaging_pb2.MessageCode.Name(code)}")
        self.code = code


log = logging.getLogger("p2p_diloco.butterfly")


class ExactRunner(AllReduceRunner):
    """AllReduceRunner whose results are the averaged parts themselves (bitwise equal on every member).

    ``aggregation``: the robust reduction and trusted weights of this member's reducer (RobustPartReducer).
    ``payload_bytes``: where the protobuf bytes of the all-reduce messages this member hands to the transport / takes
    from it are added as they pass, as sender (``_get_peer_stub``) and as reducer (``rpc_aggregate_part``): every
    byte of the attempt, whether it completes or not (a fresh counter if None).
    """

    def __init__(
        self,
        aggregation: Aggregation,
        payload_bytes: PayloadBytes | None = None,
        groups: RoundGroups | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        container = self.tensor_part_container
        container.return_deltas = False  # a failed reducer's slice keeps the LOCAL values
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer.finished.set()  # the stock reducer it replaces: unused (else a warning as it goes)
        self.payload_bytes = payload_bytes if payload_bytes is not None else PayloadBytes()
        self.combiner, first_part = None, 0
        if groups is not None and len(groups.owners) > 1:
            mine = groups.owners[groups.index]
            actual = [k for k, parts in enumerate(container._input_parts_by_peer) for _ in parts]
            if [self.ordered_peer_ids[k] for k in actual] != mine:  # never combine parts we do not agree on
                raise AllreduceException("this group's parts are not owned as the round's plan says")
            index = self.ordered_peer_ids.index(self.peer_id)
            first_part = sum(container.num_parts_by_peer[:index])
            self.combiner = Combiner(
                groups, self.peer_id, self.group_id, self.wire, self.payload_bytes, aggregation.rule, aggregation.clip
            )
        self.tensor_part_reducer = RobustPartReducer(
            shapes,
            len(self.sender_peer_ids),
            aggregation,
            self.combiner,
            first_part,
            list(map(str, self.sender_peer_ids)),
        )
        # A reducer's averaged part can be no longer than the longest part it may accept: robust rules accept parts
        # up to clip x the median norm. Compared per reducer's slice (all its parts together), not per part: with
        # non-IID shards one part (an embedding block our shard barely touched, a small tensor) can average to 6.7x
        # our own part (tiny, H=50, 4 shards) while whole slices stayed within 0.88x our own slice; a per-part
        # bound banned honest reducers. Over 2 x clip x our slice's norm, the slice is a lie ("mean" accepts
        # anything: no bound). Senders of unequal tokens (time-budgeted rounds) are bounded per token (robust.py): a
        # sender with w times our tokens may send up to w x our norm, so the bound grows by the heaviest sender's
        # tokens over ours (measured: a 3x slower peer with 6x fewer tokens banned an honest reducer under the plain
        # bound). Without our own declared tokens (our Δ does not count) nothing is judged.
        declared = [t for t in aggregation.declared if t]
        senders = list(self.sender_peer_ids)
        mine = aggregation.declared[senders.index(self.peer_id)] if self.peer_id in senders else None
        if aggregation.rule == "mean" or not mine:
            self.max_ratio = None
        else:
            self.max_ratio = 2.0 * aggregation.clip * max(1.0, max(declared) / mine)
        self.part_shapes_by_peer = [[part.shape for part, _ in parts] for parts in container._input_parts_by_peer]
        # each reducer's (start, length) in the flat vector, kept: the container drops its parts when the all-reduce
        # ends, and repair.py needs them after
        self.slice_ranges = slice_ranges(self.part_shapes_by_peer)
        own_parts = [[float(part.norm()) ** 2 for part, _ in parts] for parts in container._input_parts_by_peer]
        self.own_slice_norms = [math.sqrt(sum(parts)) for parts in own_parts]
        self._slice_sq = [0.0] * len(own_parts)  # per reducer: the squared norm of its averaged parts so far
        self._slice_left = [len(parts) for parts in own_parts]
        self.lying_reducers: set[Any] = set()
        self.failed_reducers: dict[str, str] = {}  # reducer -> why its slice came back incomplete (our end's view)
        self.failed_values: dict[str, int] = {}  # another reducer -> the values of its slice that did not come
        register = container.register_processed_part

        def checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            self._slice_sq[peer_index] += float(part.norm()) ** 2
            self._slice_left[peer_index] -= 1
            own, reducer = self.own_slice_norms[peer_index], self.ordered_peer_ids[peer_index]
            judged = self.max_ratio is not None and reducer != self.peer_id and own > 0
            if (
                judged
                and self._slice_left[peer_index] == 0
                and not math.sqrt(self._slice_sq[peer_index]) <= (self.max_ratio * own)
            ):
                self.lying_reducers.add(reducer)
            register(peer_index, part_index, part)

        container.register_processed_part = checked

    def _get_peer_stub(self, peer: Any) -> Any:
        """Our parts to that reducer and its averaged parts back: counted as they pass (allreduce.py:216)."""
        return CountingStub(super()._get_peer_stub(peer), self.payload_bytes)

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: P2PContext) -> AsyncIterator[Any]:
        """A sender's parts to our reducer and our replies to it (averaged parts or a refusal), counted."""
        requests = counted_messages(stream, self.payload_bytes, PayloadBytes.RECEIVED)
        async with contextlib.aclosing(super().rpc_aggregate_part(requests, context)) as replies:
            async for reply in replies:
                self.payload_bytes.add(PayloadBytes.SENT, reply.ByteSize())
                yield reply

    @property
    def wire(self) -> WireCodec:
        """The codec of this group's parts (the averager's ``compression``: the same on every member)."""
        return self.tensor_part_container.compression

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        """Our parts to one reducer, its averaged parts back; for our own slice, the same encode/decode as the wire
        (our part as the others' reach us, our result as the others receive it), so every member holds the same."""
        index = self.ordered_peer_ids.index(peer_id)
        if peer_id != self.peer_id:
            return await self._exchange_with(peer_id, index)
        codec, sender_index = self.wire.codec, self.sender_peer_ids.index(peer_id)
        try:
            for part_index, part in enumerate(self.parts_for_local_averaging):
                part = codec.roundtrip(part) if codec.name != "none" else part
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, self.weight)
                if isinstance(averaged, Settled):
                    averaged = averaged.tensor
                elif codec.name != "none":
                    averaged = codec.mean.roundtrip(averaged)
                self.tensor_part_container.register_processed_part(index, part_index, averaged)
        except BaseException as exc:
            self.failed_reducers[str(peer_id)] = f"our own slice: {exc!r:.200}"
            self.tensor_part_container.register_failed_reducer(index)  # stock: our own slice would hang
            raise

    async def _exchange_with(self, peer_id: Any, index: int) -> None:
        """Stock (allreduce.py:211-246), decoding with our codec: a reply that is no averaged part of the expected
        shape in it fails that reducer's slice."""
        container = self.tensor_part_container
        shapes = self.part_shapes_by_peer[index]
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0

            def decoded(message: Any) -> torch.Tensor:
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise _Refused(peer_id, message.code)
                return self.wire.means.extract(message.tensor_part)

            async for averaged in amap_in_executor(
                decoded, aiter_with_timeout(stream, self.reducer_timeout), max_prefetch=container.prefetch
            ):
                if part_index >= len(shapes) or averaged.shape != shapes[part_index]:
                    raise AllreduceException(f"{peer_id} sent an averaged part of shape {tuple(averaged.shape)}")
                container.register_processed_part(index, part_index, averaged)
                part_index += 1
            if part_index != container.num_parts_by_peer[index]:
                raise AllreduceException(
                    f"{peer_id} sent {part_index} parts, expected {container.num_parts_by_peer[index]}"
                )
        except BaseException as exc:
            got, total = container._outputs_registered_by_peer[index], container.num_parts_by_peer[index]
            self.failed_reducers[str(peer_id)] = f"{exc!r:.200} after {got} of {total} parts"
            self.failed_values[str(peer_id)] = sum(math.prod(shape) for shape in shapes[got:total])
            container.register_failed_reducer(index)
            if isinstance(exc, _Refused) and exc.code == averaging_pb2.BAD_GROUP_ID and peer_id in self.sender_peer_ids:
                await self._ban_sender(peer_id)  # it runs no such group: it sends our reducer nothing either
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
        """A sender's parts decoded with our codec (one that does not decode bans the sender), our averaged parts
        encoded with it."""
        part_index, loop, wire = 0, asyncio.get_event_loop(), self.wire
        try:
            async for part, weight in amap_in_executor(
                lambda msg: (wire.extract(msg.tensor_part), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                    part_index += 1
                except BannedException:
                    break  # the sender was banned in the background; stop aggregating it
                if isinstance(averaged, Settled):  # the round reducer's bytes, as every member gets them
                    serialized = averaged.serialized
                else:
                    serialized = await loop.run_in_executor(None, wire.means.compress, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

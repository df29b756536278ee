"""How a member's parts travel: a codec as hivemind's compression of them, and the payload bytes counted as they pass.

Inputs:  a codec.Codec (``swarm.compression``); a groupmate's stub (hivemind's ``rpc_aggregate_part`` streams).
Output:  ``WireCodec`` (``compress``: a part as its codec's bytes in a runtime_pb2.Tensor whose dtype names the codec;
         ``extract``: the fp32 values back, CodecError for a part in another format or of another size; ``means``: the
         wire of a group's or a round's mean), ``PayloadBytes`` (sent and received, possibly in shared memory),
         ``CountingStub`` and ``counted_messages`` (messages passed through, each one's protobuf ``ByteSize()``
         added as it passes: payload bytes before libp2p framing and encryption).
State:   PayloadBytes' two int64 totals.
Failure: ``extract`` raises CodecError; counting never raises.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from p2p_diloco.codec import Codec, CodecError

__all__ = ["CountingStub", "PayloadBytes", "WireCodec", "counted_messages"]


_DTYPE_PREFIX = "p2p_diloco/"  # a part's dtype field names our codec, so a part in another format is refused


class WireCodec(CompressionBase):
    """A codec.Codec as hivemind's compression of the parts a member sends (TensorPartContainer calls
    ``compress``). Parts keep ``part_size_bytes / 4`` values whatever the codec (the ratio hivemind sizes parts by
    is 1), so the parts, and the simulator's copy of them, are the same for every codec."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, codec: Codec):
        self.codec = codec
        # the wire of a group's or a round's mean of a part (``Codec.mean``: a top-k codec's means keep every
        # nonzero); this wire itself for a dense codec
        self.means: WireCodec = self if codec.mean == codec else WireCodec(codec.mean)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False) -> Any:
        return runtime_pb2.Tensor(
            buffer=self.codec.encode(tensor),
            size=tuple(tensor.shape),
            dtype=_DTYPE_PREFIX + self.codec.name,
            compression=self.compression_type,
        )

    def extract(self, serialized: Any) -> torch.Tensor:
        """The part's fp32 values; CodecError when it is not this codec's encoding of its stated shape."""
        if serialized.dtype != _DTYPE_PREFIX + self.codec.name:
            raise CodecError(f"a part in {serialized.dtype!r}, expected {_DTYPE_PREFIX + self.codec.name!r}")
        shape = tuple(serialized.size)
        return self.codec.decode(serialized.buffer, math.prod(shape)).view(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


class PayloadBytes:
    """Payload bytes sent and received, counted as messages pass. ``totals``: an int64 tensor [sent, received],
    which may be in shared memory (the averager's host reads it while its process counts); a fresh one if None."""

    SENT, RECEIVED = 0, 1

    def __init__(self, totals: torch.Tensor | None = None):
        self.totals = torch.zeros(2, dtype=torch.int64) if totals is None else totals

    def add(self, key: int, size: int) -> None:
        self.totals[key] += size

    @property
    def sent(self) -> int:
        return int(self.totals[self.SENT])

    @property
    def received(self) -> int:
        return int(self.totals[self.RECEIVED])


async def counted_messages(messages: AsyncIterable[Any], counts: PayloadBytes, key: int) -> AsyncIterator[Any]:
    """``messages`` passed through; ``counts`` grows by each one's protobuf size as it passes."""
    async for message in messages:
        counts.add(key, message.ByteSize())
        yield message


class CountingStub:
    """A groupmate's stub whose ``rpc_aggregate_part`` counts the payload bytes both ways into ``counts``."""

    def __init__(self, stub: Any, counts: PayloadBytes):
        self._stub, self._counts = stub, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, inputs: AsyncIterable[Any], **kwargs: Any) -> AsyncIterator[Any]:
        replies = await self._stub.rpc_aggregate_part(
            counted_messages(inputs, self._counts, PayloadBytes.SENT), **kwargs
        )
        return counted_messages(replies, self._counts, PayloadBytes.RECEIVED)

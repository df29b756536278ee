"""A cap on the size of one stream message this process accepts from a peer (hivemind 1.1.12 has none).

Inputs:  ``install_message_cap(max_bytes)``; importing this module installs MAX_MESSAGE_BYTES (64 MiB).
Output:  hivemind's ``P2P.receive_raw_data`` replaced by a version that reads the 8-byte length header and raises
         :class:`MessageTooLargeError` before reading (or allocating) a body longer than the cap.
State:   the cap, process-wide (``message_cap()``); child processes forked after the import inherit it (the DHT and
         averager processes are forked by hivemind; a process started by spawn/forkserver must import this module).
Failure: a peer that announces a bigger message: on the receiving side of a stream handler, hivemind logs
         "Exception while receiving requests" and closes the stream (the sender's call ends with an error or an
         early end of stream); on the calling side, the call raises MessageTooLargeError. The bytes are never read.

Why: ``P2P.receive_raw_data`` does ``readexactly(int.from_bytes(header))``: a stranger announcing 2**40 bytes makes
the receiver buffer whatever it sends, without bound. Our biggest stream messages are all-reduce parts of
``swarm.part_size_bytes`` (default 2 MiB; serialized tensors plus a few dozen bytes of protobuf) and state-download
chunks (hivemind splits them at 4 MiB), so 64 MiB leaves room for a 16x larger part size and refuses gigabytes.
Unary calls (the DHT's RPCs) go through the daemon's persistent connection, which p2pd already caps at 4 MiB.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p.p2p_daemon import P2P

__all__ = ["MAX_MESSAGE_BYTES", "MessageTooLargeError", "install_message_cap", "message_cap"]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_cap = [MAX_MESSAGE_BYTES]


class MessageTooLargeError(ConnectionError):
    """A peer announced a stream message longer than this process accepts; the stream is given up."""


async def _capped_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > _cap[0]:
        raise MessageTooLargeError(
            f"a peer announced a {length}-byte message; this process accepts at most {_cap[0]} bytes "
            "(p2p_diloco.swarm.limits)"
        )
    return await reader.readexactly(length)


def install_message_cap(max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Make every ``P2P.receive_raw_data`` of this process refuse bodies over ``max_bytes``. Idempotent; a later
    call changes the cap. Raises ValueError for a cap that is not a positive int."""
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int")
    _cap[0] = max_bytes
    if P2P.__dict__.get("receive_raw_data") is not _INSTALLED:
        P2P.receive_raw_data = _INSTALLED


def message_cap() -> int | None:
    """The cap in force, or None when hivemind's uncapped reader is back (someone replaced ours)."""
    return _cap[0] if P2P.__dict__.get("receive_raw_data") is _INSTALLED else None


_INSTALLED = staticmethod(_capped_receive_raw_data)
install_message_cap(MAX_MESSAGE_BYTES)

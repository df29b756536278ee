"""The stream message cap (p2p_diloco/swarm/limits.py) between two real hivemind P2P daemons on 127.0.0.1: a message
under the cap goes through, one over it is refused by the receiver before the body is read (both directions), the
other side sees an error or an early end, nobody hangs (every await has a deadline)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from p2p_diloco.swarm import limits

CAP = 64 * 1024
BIG = 1024 * 1024
DEADLINE = 20.0
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def test_install_is_idempotent_and_checks_its_argument():
    assert limits.message_cap() == limits.MAX_MESSAGE_BYTES  # installed on import
    first = P2P.__dict__["receive_raw_data"]
    try:
        limits.install_message_cap(CAP)
        limits.install_message_cap(CAP)
        assert P2P.__dict__["receive_raw_data"] is first and limits.message_cap() == CAP
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError):
                limits.install_message_cap(bad)
        assert limits.message_cap() == CAP
    finally:
        limits.install_message_cap(limits.MAX_MESSAGE_BYTES)


async def _exchange(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    reads: list[int] = []
    original = asyncio.StreamReader.readexactly

    async def recording(self: asyncio.StreamReader, n: int) -> bytes:
        reads.append(n)
        return await original(self, n)

    monkeypatch.setattr(asyncio.StreamReader, "readexactly", recording)
    handled: list[int] = []
    out: dict[str, object] = {"reads": reads, "handled": handled}
    receiver = await asyncio.wait_for(P2P.create(host_maddrs=LOCAL), DEADLINE)
    sender = None
    try:
        maddrs = await receiver.get_visible_maddrs()
        sender = await asyncio.wait_for(
            P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]), DEADLINE
        )

        async def echo(requests, context: P2PContext):  # noqa: ANN001, ANN202 - hivemind's handler protocol
            async for request in requests:
                handled.append(len(request.buffer))
                yield runtime_pb2.Tensor(buffer=b"r" * int(request.size[0]) if request.size else b"ok")

        await receiver.add_protobuf_handler("echo", echo, runtime_pb2.Tensor, stream_input=True, stream_output=True)

        async def call(payload: bytes, reply: int = 0) -> list[int]:
            request = runtime_pb2.Tensor(buffer=payload, size=[reply] if reply else [])
            stream = await receiver_call(request)
            return [len(r.buffer) async for r in stream]

        async def receiver_call(request: runtime_pb2.Tensor):  # noqa: ANN202
            return await sender.iterate_protobuf_handler(receiver.peer_id, "echo", request, runtime_pb2.Tensor)

        out["small"] = await asyncio.wait_for(call(b"s" * 1000), DEADLINE)
        try:
            out["big"] = await asyncio.wait_for(call(b"b" * BIG), DEADLINE)
        except asyncio.TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - what the sender sees: an error, or (below) an early end
            out["big"] = exc
        try:  # the reply is over the cap: the caller refuses it
            out["big_reply"] = await asyncio.wait_for(call(b"q", reply=BIG), DEADLINE)
        except asyncio.TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001
            out["big_reply"] = exc
        out["after"] = await asyncio.wait_for(call(b"s" * 10), DEADLINE)  # the receiver still serves
    finally:
        if sender is not None:
            await asyncio.wait_for(sender.shutdown(), DEADLINE)
        await asyncio.wait_for(receiver.shutdown(), DEADLINE)
    return out


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_a_message_over_the_cap_is_refused_before_its_body_is_read(monkeypatch):
    limits.install_message_cap(CAP)
    try:
        out = asyncio.run(asyncio.wait_for(_exchange(monkeypatch), 3 * DEADLINE))
    finally:
        limits.install_message_cap(limits.MAX_MESSAGE_BYTES)
    assert out["small"] == [2] and out["after"] == [2]
    assert 1000 in out["handled"] and BIG not in out["handled"]  # the big request never reached the handler
    big = out["big"]
    assert isinstance(big, Exception) or big == [], big  # an error or an empty answer, within the deadline
    assert isinstance(out["big_reply"], limits.MessageTooLargeError), out["big_reply"]
    assert max(out["reads"]) <= CAP, max(out["reads"])  # nobody read (or buffered) a body over the cap
    print(f"over the cap: sender saw {big!r}; caller of a big reply saw {type(out['big_reply']).__name__}")

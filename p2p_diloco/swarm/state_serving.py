"""Our state, served whole to the peers that download it, and a donor's, downloaded with our own bounds.

Inputs:  ``set_state_provider(fn)``: ``fn()`` -> (metadata dict, tensors), called in the host, in hivemind's fetch
         thread, once per serve; ``download(peer_id, timeout, max_tensors, max_bytes)``, from a caller (sync.py)
         that chose the donor; ``max_state_downloads``; ``admits`` (matchmaking.py: a closed run's list, the bans).
Output:  ``download``: the donor's (metadata, tensors), or why not (a line). ``rpc_download_state`` serves our
         state to a peer that may have it, an empty stream to anyone else. ``_in_process`` and ``_settle`` run a
         bounded call in the averager process for the host (also for state_pieces.py); ``_may_download`` charges
         the per-peer budget (also for manifests and pieces).
State:   the provider; ``_closing`` (shutdown sets it: new serves are refused, and shutdown waits up to
         ``SERVE_GRACE`` for the one in progress, in hivemind's state thread, ``_state_thread_of``). In the averager
         process, ``_downloads``: per peer, (when, what share of a state) of its downloads, manifests and pieces of
         the last minute, at most ``max_state_downloads`` states' worth (more get an empty stream); past 1024 peers,
         the 512 that downloaded least recently are forgotten.
Failure: ``download`` never raises: a refusal, a timeout, more tensors or bytes than asked for, a stream that
         stalls for ``next_chunk_timeout``: a line saying why. ``get_current_state`` raises (the peer's download
         fails) when no provider is set or while this peer shuts down. A client-mode averager serves nothing.

State sharing: donors are chosen by the caller (sync.py: peers whose signed announcements vouch for the state),
never from hivemind's unsigned ``all_averagers`` key, and ``download`` reads their stream with our own bounds
(hivemind's ``load_state_from_peers`` reads that key without a deadline inside this process).
``get_current_state`` serves the provider's output without the averager's tensor lock. The stock
one takes it, and an all-reduce holds it all round: measured (200 MB, next_chunk_timeout 2 s), a download from
a donor that was averaging failed with TimeoutError; lock-free, it succeeded first try. Sharing starts with
``set_state_provider``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads rpc stream types by typing's _name

import torch
from hivemind.averaging.averager import _background_thread_fetch_current_state
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

__all__ = ["SERVE_GRACE", "StateServingMixin"]

_STATE_KEY = "p2p_diloco_state"  # wraps the metadata: hivemind drops a state whose metadata is falsy ({})
SERVE_GRACE = 60.0  # how long a shutdown waits for a serve of our state in progress to end


def _state_thread_of(pipe: Any) -> threading.Thread | None:
    """hivemind's host-side thread that serves the state of the averager owning ``pipe`` (it keeps no handle to it:
    found by its target and arguments)."""
    for thread in threading.enumerate():
        target, args = getattr(thread, "_target", None), getattr(thread, "_args", ())
        if target is _background_thread_fetch_current_state and len(args) > 1 and args[1] is pipe:
            return thread
    return None


class StateServingMixin:
    """State serving and download for PseudoGradAverager (averager.py); see the module docstring. Its ``__init__``
    sets what this reads."""

    def set_state_provider(self, fn: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        """Serve ``fn()`` -> (metadata dict, tensors) to peers calling ``load_state``; enables sharing. A client-mode
        averager (behind NAT: nobody can call it) keeps ``fn`` but serves nothing."""
        self._state_provider = fn
        if not self.client_mode:
            self.allow_state_sharing = True

    def get_current_state(self) -> tuple[dict, list[torch.Tensor], None]:
        """Called by hivemind in the host process when a peer downloads our state."""
        if self._state_provider is None:
            raise RuntimeError("no state provider set; this peer has no outer state to share")
        if self._closing.is_set():
            raise RuntimeError("this peer is leaving; ask another holder")
        metadata, tensors = self._state_provider()
        return {_STATE_KEY: metadata}, [t.detach().cpu() for t in tensors], None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Our state, to a listed peer that has not downloaded it ``max_state_downloads`` times in the last minute;
        anyone else gets an empty stream (hivemind's way to say no). The state is a snapshot (sync.py), so a flood
        of downloads never holds the training lock beyond one copy per state."""
        if not self._may_download(str(context.remote_id), 1.0):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def download(
        self, peer_id: str, timeout: float, max_tensors: int, max_bytes: int
    ) -> tuple[dict, list[torch.Tensor]] | str:
        """(metadata, tensors) of ``peer_id``'s state, or why not (a line). Bounded: ``timeout`` for the whole
        download, ``next_chunk_timeout`` between messages, at most ``max_tensors`` tensors and ``max_bytes`` bytes
        of tensor data (what the caller's state holds), plus 1 MiB for metadata and framing."""
        future: MPFuture = MPFuture()
        limits = dict(max_tensors=max_tensors, max_bytes=max_bytes + (1 << 20))
        self._outer_pipe.send(("_download", [], dict(peer_id=peer_id, timeout=timeout, future=future, **limits)))
        try:
            result = future.result(timeout=timeout + 5.0)
        except Exception as e:  # noqa: BLE001 - a dead averager process, a pipe error: no state, and why
            return f"{type(e).__name__}: {e}"
        if isinstance(result, str):
            return result
        metadata, tensors = result
        if not isinstance(metadata, dict) or not isinstance(metadata.get(_STATE_KEY), dict):
            return "the peer sent no state (it serves none, or refused us)"
        return metadata[_STATE_KEY], tensors

    async def _download(self, peer_id: str, timeout: float, future: MPFuture, **limits: int) -> None:
        await self._settle(future, self._fetch_state(PeerID.from_base58(peer_id), **limits), timeout, "state")

    async def _fetch_state(self, peer: PeerID, max_tensors: int, max_bytes: int) -> tuple[Any, list[torch.Tensor]]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors, received = None, [], [], 0
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            received += message.ByteSize()
            if received > max_bytes:
                raise ValueError(f"the peer sent over {max_bytes} bytes, more than this model's state holds")
            if message.metadata:
                if metadata is not None:
                    raise ValueError("the peer sent its metadata twice")
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype starts the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
                if len(tensors) > max_tensors:
                    raise ValueError(f"the peer sent over {max_tensors} tensors")
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return metadata, tensors

    def _in_process(self, method: str, timeout: float, **kwargs: Any) -> Any:
        """Run ``method`` (a coroutine of the averager process) with a deadline; its result or why it failed."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send((method, [], dict(timeout=timeout, future=future, **kwargs)))
        try:
            return future.result(timeout=timeout + 5.0)
        except Exception as e:  # noqa: BLE001 - a dead averager process, a pipe error: nothing, and why
            return f"{type(e).__name__}: {e}"

    async def _settle(self, future: MPFuture, work: Any, timeout: float, what: str) -> None:
        try:
            result: Any = await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            result = f"no complete {what} within {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - whatever the donor did, it is a refused offer
            result = f"{type(e).__name__}: {e}"
        if not future.done():
            future.set_result(result)

    def _may_download(self, peer: str, cost: float) -> bool:
        """Charge ``peer`` ``cost`` (a whole state is 1, a piece its share of the state, at least one part's) if
        its last minute's downloads from us stay within ``max_state_downloads`` states; refuse (False) if not."""
        now = time.monotonic()
        recent = [(t, c) for t, c in self._downloads.get(peer, []) if now - t < 60.0]
        if not self.admits(peer) or sum(c for _, c in recent) + cost > self.max_state_downloads + 1e-9:
            self._downloads[peer] = recent
            return False
        self._downloads[peer] = recent + [(now, cost)]
        if len(self._downloads) > 1024:  # forget the peers that downloaded least recently
            for stale in sorted(self._downloads, key=lambda p: max((t for t, _ in self._downloads[p]), default=0.0))[
                :512
            ]:
                del self._downloads[stale]
        return True

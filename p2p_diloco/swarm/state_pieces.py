"""The state in pieces: a donor's manifest and ranges of its flat state, asked for and served.

Inputs:  asking: ``manifest(peer_id, timeout)`` and ``piece(peer_id, tag, start, end, timeout)``, from
         swarm/download.py (it picks the donors and checks every piece against the manifest's digests). Serving:
         the state our provider serves (state_serving.py) as one flat fp32 vector in parts (state_parts.py).
Output:  ``manifest``: the donor's served metadata with its part digests; ``piece``: its fp32 values [start, end);
         either, or why not (a line). ``rpc_state_manifest`` and ``rpc_download_piece`` serve ours.
State:   in the averager process: ``_served_values``, values in the state we served last, which prices a piece
         before the host is asked; ``_serving``, the state we serve now, and ``_kept``, one state we served before
         it, kept while downloads of it go on (see below). The per-peer download budget is state_serving.py's.
Failure: ``manifest`` and ``piece`` never raise: a refusal, a timeout, more bytes than the piece holds, a stream
         that stalls for ``next_chunk_timeout``, values of the wrong type or count: a line saying why. A request we
         refuse (malformed, not whole parts, over budget, for another state) gets empty metadata or an empty
         stream.

In pieces (swarm/download.py; the state as one flat fp32 vector, state_parts.py): ``manifest`` reads a donor's
served metadata with its part digests (the unary ``rpc_state_manifest``), ``piece`` values [start, end) of it
(``rpc_download_piece``: only whole parts, at most MAX_PIECE_PARTS, of the state asked for while the donor serves
or keeps it, below; an empty stream otherwise). Each peer's downloads from us are charged against
``max_state_downloads`` states a minute: a whole download 1, a manifest MANIFEST_COST, a piece its share of the
state (at least one part; a piece of a state we neither serve nor keep MANIFEST_COST).

A download outlives a round: when our state changes, the one we served before stays served, for pieces only (a
manifest is always the current state's), while a download asked for it within KEEP_SECONDS; of the older states
one is kept, the one asked for last, so serving costs at most one more copy of the state. Before, a download had
to end within one of the donor's rounds: a joiner whose download took longer than a round (a large state on a slow
link) could never join, and in a test a resumed peer chased a lone donor's 0.4 s rounds until its download budget
was spent.
"""

from __future__ import annotations

import math
import time
from typing import Any, AsyncIterator, NamedTuple  # noqa: UP035 - hivemind reads rpc stream types by typing's _name

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2p_diloco.state_parts import PART_VALUES, read_values, total_values
from p2p_diloco.swarm.state_serving import _STATE_KEY

__all__ = ["MANIFEST_COST", "MAX_PIECE_PARTS", "StatePiecesMixin"]

MAX_PIECE_PARTS = 16  # the longest piece a peer serves: 16 MiB (state_parts.PART_BYTES each)
MANIFEST_COST = 1 / 16  # of a state's download budget: 16 manifests a minute per budgeted state
KEEP_SECONDS = 60.0  # a state we served before stays served this long after a download last asked for a piece of it
_PIECE_CHUNK_BYTES = 1 << 20  # stream message size of a piece (hivemind's default, 64 KiB, costs 16x the messages)


class _Served(NamedTuple):
    """A state we serve: its (round, checksum), its tensors, when a download last asked for it (monotonic)."""

    tag: tuple
    tensors: Any
    asked: float


def _tag_of(metadata: Any) -> tuple:
    """(round, checksum) of our served state's metadata (state_serving.py wraps it under _STATE_KEY)."""
    meta = metadata.get(_STATE_KEY, {}) if isinstance(metadata, dict) else {}
    return meta.get("round"), meta.get("checksum")


def _piece_request(raw: bytes, serializer: Any) -> tuple[int, str, int, int] | None:
    """(round, checksum, start, end) of a piece request, or None for anything malformed."""
    try:
        request = serializer.loads(raw) if len(raw) <= 1024 else None
        rnd, checksum, start, end = (request[k] for k in ("round", "checksum", "start", "end"))
    except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
        return None
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rnd, start, end))
    return (rnd, checksum, start, end) if ints and isinstance(checksum, str) else None


def _whole_parts(start: int, end: int, total: int) -> bool:
    """Whether [start, end) is 1 to MAX_PIECE_PARTS whole parts of a state of ``total`` values (the last may be
    short)."""
    aligned = start % PART_VALUES == 0 and (end % PART_VALUES == 0 or end == total)
    return aligned and 0 <= start < end <= total and end - start <= MAX_PIECE_PARTS * PART_VALUES


def _piece_cost(want: tuple[int, str, int, int], total: int) -> float:
    """A piece's charge against the download budget: its share of the state, at least one part's, at most the whole
    state's (1). A state smaller than one part (PART_VALUES) was charged PART_VALUES / total for its one piece: 12
    states for the scale harness's micro model, over any budget, so every donor refused every piece of it."""
    return min(1.0, max(want[3] - want[2], min(PART_VALUES, total)) / max(total, 1))


class StatePiecesMixin:
    """Manifests and pieces for PseudoGradAverager (averager.py); see the module docstring. Uses
    state_serving.py's ``_in_process``, ``_settle`` and ``_may_download``; its ``__init__`` sets what this reads."""

    _served_values = 0  # averager process: values in the state we served last (prices a piece before the host is asked)
    _serving: _Served | None = None  # averager process: the state we serve now
    _kept: _Served | None = None  # averager process: one state we served before it, while downloads of it go on

    def _snapshot(self, now_serving: tuple, tensors: Any, wanted: tuple, now: float) -> Any:
        """Note ``now_serving`` (round, checksum), with its ``tensors``, as the state we serve now; the tensors of
        ``wanted`` when it is that state or the one kept, marked as asked for now; None when neither. When the state
        changed, the older one asked for last within KEEP_SECONDS is kept (one asked for never is not)."""
        serving = self._serving
        if serving is None or serving.tag != now_serving:
            older = [s for s in (serving, self._kept) if s is not None and now - s.asked < KEEP_SECONDS]
            self._kept = max(older, key=lambda s: s.asked, default=None)
            serving = _Served(now_serving, tensors, -math.inf)
        elif self._kept is not None and now - self._kept.asked >= KEEP_SECONDS:
            self._kept = None  # nobody downloads it any more: its copy is freed
        if wanted == now_serving:
            self._serving = _Served(now_serving, tensors, now)
            return tensors
        self._serving = serving
        if self._kept is not None and self._kept.tag == wanted:
            self._kept = _Served(wanted, self._kept.tensors, now)
            return self._kept.tensors
        return None

    def manifest(self, peer_id: str, timeout: float) -> dict | str:
        """The metadata of ``peer_id``'s served state (round, checksum, fingerprint, consensus and ``parts``: its
        part digests, state_parts.py), or why not (a line). One unary call of at most ``timeout`` seconds."""
        result = self._in_process("_manifest", timeout, peer_id=peer_id)
        if isinstance(result, str):
            return result
        if not isinstance(result, dict) or not isinstance(result.get(_STATE_KEY), dict):
            return "the peer sent no manifest (it serves none, or refused us)"
        return result[_STATE_KEY]

    def piece(self, peer_id: str, tag: tuple[int, str], start: int, end: int, timeout: float) -> torch.Tensor | str:
        """Values [start, end) of the flat state ``peer_id`` serves (fp32, state_parts.py), only if that state is
        still ``tag`` (round, checksum); or why not (a line). Bounded like ``download``: ``timeout`` for the piece,
        ``next_chunk_timeout`` between messages, at most the piece's own bytes plus 64 KiB read."""
        request = {"round": tag[0], "checksum": tag[1], "start": start, "end": end}
        return self._in_process("_piece", timeout, peer_id=peer_id, request=request)

    async def _manifest(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        async def call() -> Any:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            response = await stub.rpc_state_manifest(averaging_pb2.DownloadRequest(), timeout=timeout)
            return self.serializer.loads(response.metadata) if response.metadata else None

        await self._settle(future, call(), timeout, "manifest")

    async def _piece(self, peer_id: str, request: dict, timeout: float, future: MPFuture) -> None:
        async def call() -> torch.Tensor | str:
            values = request["end"] - request["start"]
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            stream = await stub.rpc_download_piece(averaging_pb2.DownloadData(metadata=self.serializer.dumps(request)))
            parts, received, cap = [], 0, 4 * values + (1 << 16)
            async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
                received += message.ByteSize()
                if received > cap:
                    raise ValueError(f"the peer sent over {cap} bytes for a piece of {values} values")
                parts.append(message.tensor_part)
            if not parts:
                return "the peer sent no piece (it holds another state now, or refused us)"
            piece = deserialize_torch_tensor(combine_from_streaming(parts))
            if piece.dtype != torch.float32 or piece.numel() != values:
                return f"the peer sent {piece.numel()} {piece.dtype} values, not {values} float32"
            return piece.reshape(-1)

        await self._settle(future, call(), timeout, "piece")

    async def rpc_state_manifest(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """The metadata of our served state, part digests included, to a listed peer within its download budget
        (a manifest costs MANIFEST_COST of a state); anyone else gets empty metadata."""
        if not self._may_download(str(context.remote_id), MANIFEST_COST):
            return averaging_pb2.DownloadData()
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        self._served_values = total_values(tensors)
        tag = _tag_of(self.serializer.loads(metadata))
        self._snapshot(tag, tensors, tag, time.monotonic())  # a download of it begins: kept once the state changes
        return averaging_pb2.DownloadData(metadata=metadata)

    async def rpc_download_piece(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Values [start, end) of the state asked for (round, checksum), if we serve it now or keep it
        (``_snapshot``) and the range is whole parts, at most MAX_PIECE_PARTS of them; charged to the peer's download
        budget as its share of the state (at least one part): MANIFEST_COST for asking, before the host is, and the
        rest once the piece is served. A request for a state we neither serve nor keep costs the asking only: a
        downloader racing a peer whose rounds are shorter than a download (seen: a monitor sampling a lone tiny peer,
        each failed piece asked 3 times) once spent a minute's budget in a few tries at a full share each. Anything
        else, or over budget: an empty stream."""
        want = _piece_request(request.metadata, self.serializer)
        peer, values = str(context.remote_id), self._served_values
        if want is None or (values and not _whole_parts(want[2], want[3], values)):
            return
        if not self._may_download(peer, MANIFEST_COST):  # asking, as a manifest does
            return
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        self._served_values = total_values(tensors)
        rnd, checksum, start, end = want
        tensors = self._snapshot(_tag_of(self.serializer.loads(metadata)), tensors, (rnd, checksum), time.monotonic())
        if tensors is None or not _whole_parts(start, end, total := total_values(tensors)):
            return
        if not self._may_download(peer, max(0.0, _piece_cost(want, total) - MANIFEST_COST)):
            return
        piece = serialize_torch_tensor(read_values(tensors, start, end))
        for part in split_for_streaming(piece, _PIECE_CHUNK_BYTES):
            yield averaging_pb2.DownloadData(tensor_part=part)

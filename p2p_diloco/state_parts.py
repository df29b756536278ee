"""The outer state as one flat fp32 vector cut into fixed parts: what its checksum hashes and what a download moves.

Inputs:  the state's tensors in transfer order (``OuterState.tensors()``: anchor then momentum; fp32, CPU), read as
         one vector of ``total_values`` values; a part is PART_VALUES consecutive values of it (the last one shorter).
Output:  ``part_digests`` (sha256 of each part's bytes, 32 bytes each), ``state_checksum(round, digests)`` (the
         state's checksum: sha256 over the round and the part digests, 16 hex characters); ``read_values`` /
         ``write_values`` (a flat range of the vector, across tensor boundaries) and ``piece_digests`` (the digests of
         a received range that starts at a part boundary).
State:   none (pure torch).
Failure: ValueError for a range outside the vector, a piece that does not start at a part boundary, or a tensor
         that is not fp32.

Why parts: the checksum is a hash over the part digests, so a manifest (the digests) is checked against the vouched
checksum before any part is fetched, and then each part on its own: a newcomer can take parts from many donors and
knows which one sent wrong bytes (swarm/download.py). The part size is part of the checksum, so of the protocol.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "PART_BYTES",
    "PART_VALUES",
    "DIGEST_BYTES",
    "part_count",
    "part_digests",
    "piece_digests",
    "read_values",
    "state_checksum",
    "total_values",
    "write_values",
]

PART_BYTES = 1 << 20  # 1 MiB of fp32: the unit a checksum hashes and a downloader verifies
PART_VALUES = PART_BYTES // 4
DIGEST_BYTES = 32  # sha256


def _fp32(tensors: Sequence[torch.Tensor]) -> None:
    for k, t in enumerate(tensors):
        if t.dtype != torch.float32:
            raise ValueError(f"tensor {k} is {t.dtype}; the outer state is fp32")


def total_values(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def part_count(values: int) -> int:
    """Parts of a vector of ``values`` values (at least 1: an empty state still has its round to hash)."""
    return max(1, -(-values // PART_VALUES))


def _spans(tensors: Sequence[torch.Tensor], start: int, end: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """(flat tensor, first, last) slices of the tensors that together hold values [start, end)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            yield t.reshape(-1), lo - offset, hi - offset
        offset += n
        if offset >= end:
            return


def part_digests(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """sha256 of each PART_BYTES of the tensors' bytes read as one vector (no copy of the state)."""
    _fp32(tensors)
    digests, h, filled = [], hashlib.sha256(), 0
    for t in tensors:
        data = memoryview(t.detach().contiguous().numpy()).cast("B")
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, PART_BYTES - filled)
            h.update(data[pos : pos + take])
            pos, filled = pos + take, filled + take
            if filled == PART_BYTES:
                digests.append(h.digest())
                h, filled = hashlib.sha256(), 0
    if filled or not digests:
        digests.append(h.digest())
    return digests


def piece_digests(values: torch.Tensor) -> list[bytes]:
    """Digests of the parts in ``values``, a flat range that starts at a part boundary (the last may be short)."""
    return part_digests([values.reshape(-1)])


def state_checksum(round: int, digests: Sequence[bytes]) -> str:
    """The outer state's checksum: sha256 over the round and its part digests, truncated to 64 bits (16 hex)."""
    h = hashlib.sha256(struct.pack("<q", round))
    for d in digests:
        h.update(d)
    return h.hexdigest()[:16]


def _check_range(tensors: Sequence[torch.Tensor], start: int, end: int) -> None:
    total = total_values(tensors)
    if not 0 <= start < end <= total:
        raise ValueError(f"values [{start}, {end}) are outside the state's {total}")


def read_values(tensors: Sequence[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """A flat fp32 copy of values [start, end) of the vector."""
    _fp32(tensors)
    _check_range(tensors, start, end)
    return torch.cat([flat[lo:hi] for flat, lo, hi in _spans(tensors, start, end)])


def write_values(tensors: Sequence[torch.Tensor], start: int, values: torch.Tensor) -> None:
    """Copy the flat ``values`` into the vector from ``start`` on (the tensors must be contiguous)."""
    _fp32(tensors)
    values = values.reshape(-1)
    _check_range(tensors, start, start + values.numel())
    pos = 0
    for flat, lo, hi in _spans(tensors, start, start + values.numel()):
        flat[lo:hi].copy_(values[pos : pos + hi - lo])
        pos += hi - lo

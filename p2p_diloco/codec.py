"""Pseudo-gradient codecs: how a part of Δ (or of the group's mean) is written on the wire (pure torch).

Inputs:  a codec name (``swarm.compression``: none, fp16, bf16, int8, int4, topk1, topk3); 1-D fp32 CPU tensors
         (parts of Δ).
Output:  ``Codec.encode(part) -> bytes`` and ``Codec.decode(data, numel) -> fp32 tensor``; ``roundtrip(part)``
         (decode of encode: what every receiver of that part holds); ``encoded_size(numel)``: the bytes (exact for a
         dense codec), and ``parts_size(numel, part_values)`` those of a tensor cut into the swarm's parts;
         ``roundtrip_parts(tensors, part_values)``: whole tensors cut into the swarm's parts (hivemind splits
         each flattened tensor into consecutive parts of ``part_values`` values), each part round-tripped. The
         simulator uses it to apply exactly what the swarm's wire does. ``Codec.mean``: the codec of a group's mean.
State:   none.
Failure: ``CodecError`` for an unknown name, and for bytes that are not an encoding of ``numel`` values (a
         peer sending them is treated as a broken sender by the caller). Encoding assumes finite input
         (the averager refuses non-finite Δ before this); fp16 saturates at +-65504 instead of overflowing.

The dense codecs, bytes per value: ``none`` 4 (fp32 as is); ``fp16`` 2 (round to nearest, saturating); ``bf16`` 2
(round to nearest even: fp32's range, 8 bits of mantissa); ``int8`` 1 + 4 / BLOCK: blockwise absmax, each
block of ``BLOCK`` values scaled by its largest magnitude / 127 (one fp32 scale per block) and rounded to
nearest, so a value's error is at most half its block's step (absmax / 254); ``int4`` 0.5 + 4 / INT4_BLOCK: the
same over blocks of ``INT4_BLOCK`` values with codes -7..7 (step absmax / 7, so an error of up to absmax / 14: ~10%
of a Gaussian part's norm, against int8's ~0.5%), two codes a byte, the low nibble first. A dense codec's mean
travels in the same codec.

The top-k codecs (``SPARSE``: topk1, topk3 send 1% and 3% of each part's values; engine.py always runs them with
error feedback, which carries the rest into later rounds, as SparseLoCo, arXiv 2508.15706): the largest magnitudes of
each chunk of ``TOPK_CHUNK`` values of the part (its share of each chunk, at least one), each in 2 bits (its sign
and the nearer of two magnitudes, the means of the kept magnitudes up to and above their median), their positions as
byte gaps (a gap of 255 or more takes escape bytes): ~1.25 bytes a value sent. A group's mean of top-k parts holds
the union of the senders' positions; it travels as ``sparse4``: its nonzeros in int4 (as the int4 codec writes them,
blocks of INT4_BLOCK nonzeros) with their positions, ~1.6 bytes a nonzero, so a reducer drops no position a sender
sent (a value under half its block's step decodes as 0). In int8 (``sparse8``, until 2026-12-06) the mean was 85% of a
topk1 round's bytes at 4 workers, and the round 88x smaller than fp32's; in int4, 108x (its loss:
docs/compression.md).

Any codec writes a part of zeros as no bytes (and decodes no bytes as zeros): the tensors a round of streaming
fragments leaves out (fragments.py) cost nothing. Decoding is the same IEEE operations on every peer: all receivers of
the same bytes hold bitwise the same values. Every codec is deterministic (no stochastic rounding): the reducer's own
slice goes through the same encode/decode as the slices it sends, which is what keeps a group's outer states bitwise
equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "BLOCK",
    "CODECS",
    "DENSE",
    "INT4_BLOCK",
    "SPARSE",
    "TOPK_CHUNK",
    "Codec",
    "CodecError",
    "get_codec",
    "roundtrip_parts",
]

BLOCK = 128  # int8: values per absmax scale (3% overhead: 1.03 bytes per value)
INT4_BLOCK = 64  # int4: values per absmax scale (0.5625 bytes per value: 7.1x fewer than fp32)
_FP16_MAX = 65504.0


class CodecError(ValueError):
    """An unknown codec name, or bytes that do not decode to the values they claim."""


@dataclass(frozen=True)
class Codec:
    """One wire format for fp32 parts; see the module doc for each."""

    name: str

    @property
    def sparse(self) -> bool:
        """A top-k codec: it sends a few values of each part (the rest is carried by error feedback)."""
        return self.name in SPARSE

    @property
    def mean(self) -> Codec:
        """The codec of a group's mean of a part (what reducers send back): the same as the parts' for a dense codec;
        for a top-k one, ``sparse4``: every nonzero of the mean (the union of the senders' supports) in int4."""
        return Codec(MEAN_OF_SPARSE) if self.sparse else self

    def encoded_size(self, numel: int) -> int:
        """The bytes of ``numel`` values: exact for a dense codec. A sparse one's depend on where its values lie: this
        is the size when no gap between two sent values is 255 or longer (top-k: its k values spread over the part;
        ``sparse4``: every value nonzero, its most)."""
        if self.name == "none":
            return 4 * numel
        if self.name in ("fp16", "bf16"):
            return 2 * numel
        if self.name == "int4":
            return math.ceil(numel / 2) + 4 * math.ceil(numel / INT4_BLOCK)
        if self.sparse:
            k = _topk_count(numel, SPARSE[self.name])
            return 12 + math.ceil(k / 4) + k
        if self.name == MEAN_OF_SPARSE:
            return 4 + math.ceil(numel / 2) + numel + 4 * math.ceil(numel / INT4_BLOCK)
        return numel + 4 * math.ceil(numel / BLOCK)

    def parts_size(self, numel: int, part_values: int) -> int:
        """Encoded bytes of one tensor of ``numel`` values cut into the swarm's parts of ``part_values`` values."""
        full, rest = divmod(numel, part_values)
        return full * self.encoded_size(part_values) + (self.encoded_size(rest) if rest else 0)

    @property
    def bytes_per_value(self) -> float:
        """For sizing parts and estimates: encoded bytes over values, for a part of many blocks."""
        if self.sparse:
            return SPARSE[self.name] * 1.25  # a gap byte and 2 bits a value sent
        dense = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int4": 0.5 + 4.0 / INT4_BLOCK}
        return dense.get(self.name, 1.0 + 4.0 / BLOCK)

    def encode(self, part: torch.Tensor) -> bytes:
        flat = part.detach().reshape(-1).to("cpu", torch.float32)
        if not bool(flat.any()):
            return b""  # an all-zero part (a tensor another fragment's round leaves out): no bytes, any codec
        if self.name == "none":
            return flat.numpy().tobytes()
        if self.name == "fp16":
            return flat.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).numpy().tobytes()
        if self.name == "bf16":
            return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        if self.sparse:
            return _topk_encode(flat, SPARSE[self.name])
        if self.name == MEAN_OF_SPARSE:
            return _nonzeros_encode(flat)
        scales, codes = (_int4_encode if self.name == "int4" else _int8_encode)(flat)
        return scales.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if not data:
            return torch.zeros(numel, dtype=torch.float32)
        if self.sparse:
            return _topk_decode(data, numel, SPARSE[self.name], self.name)
        if self.name == MEAN_OF_SPARSE:
            return _nonzeros_decode(data, numel)
        if len(data) != self.encoded_size(numel):
            raise CodecError(f"{len(data)} bytes are no {self.name} encoding of {numel} values")
        if self.name == "none":
            return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())
        if self.name == "fp16":
            return torch.from_numpy(np.frombuffer(data, dtype=np.float16).copy()).to(torch.float32)
        if self.name == "bf16":
            raw = torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy())
            return raw.view(torch.bfloat16).to(torch.float32)
        int4 = self.name == "int4"  # else int8: the block's fp32 scales, then its codes (int4: two a byte)
        blocks = math.ceil(numel / (INT4_BLOCK if int4 else BLOCK))
        scales = torch.from_numpy(np.frombuffer(data, dtype=np.float32, count=blocks).copy())
        codes = torch.from_numpy(np.frombuffer(data, dtype=np.uint8 if int4 else np.int8, offset=4 * blocks).copy())
        return (_int4_decode if int4 else _int8_decode)(scales, codes, numel)

    def roundtrip(self, part: torch.Tensor) -> torch.Tensor:
        """What a receiver of ``part`` holds: decode(encode(part)), in ``part``'s shape (fp32)."""
        return self.roundtrip_sized(part)[0]

    def roundtrip_sized(self, part: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(``roundtrip(part)``, the bytes of its encoding)."""
        if self.name == "none":
            out = part.detach().to("cpu", torch.float32).clone()
            return out, _fp32_size(out)
        data = self.encode(part)
        return self.decode(data, part.numel()).view(part.shape), len(data)


def _absmax_quantize(flat: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax: each block's scale (its largest magnitude / ``levels``) and the codes of its values, rounded
    to nearest in -levels..levels (fp32, the last block padded with zeros)."""
    numel = flat.numel()
    blocks = math.ceil(numel / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:numel] = flat
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1) / float(levels)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, torch.round(grid / safe[:, None]).clamp_(-levels, levels).view(-1)


def _absmax_values(scales: torch.Tensor, codes: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The first ``numel`` codes, each times its block's scale (fp32)."""
    padded = torch.zeros(scales.numel() * block, dtype=torch.float32)
    padded[:numel] = codes[:numel].to(torch.float32)
    return (padded.view(-1, block) * scales[:, None]).view(-1)[:numel].clone()


def _int8_encode(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, codes = _absmax_quantize(flat, BLOCK, 127)
    return scales, codes.to(torch.int8)[: flat.numel()]


def _int8_decode(scales: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
    return _absmax_values(scales, codes, numel, BLOCK)


def _int4_encode(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, codes = _absmax_quantize(flat, INT4_BLOCK, 7)
    nibbles = codes.add_(8).to(torch.uint8)
    pairs = nibbles[: 2 * math.ceil(flat.numel() / 2)].view(-1, 2)  # an odd count's partner: a padding zero (8)
    return scales, pairs[:, 0] | (pairs[:, 1] << 4)


def _int4_decode(scales: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
    return _absmax_values(scales, nibbles.to(torch.float32) - 8.0, numel, INT4_BLOCK)


def _fp32_size(part: torch.Tensor) -> int:
    """The bytes of ``none``'s encoding of ``part``: 4 a value, none for a part of zeros."""
    return 4 * part.numel() if bool(part.any()) else 0


def _chunk_count(numel: int, density: float) -> int:
    return min(numel, max(1, math.ceil(density * numel)))


def _topk_count(numel: int, density: float) -> int:
    """How many values of a part of ``numel`` a top-k codec sends: ``density`` of each chunk of ``TOPK_CHUNK``
    values (the last one shorter), at least one a chunk."""
    full, rest = divmod(numel, TOPK_CHUNK)
    return full * _chunk_count(TOPK_CHUNK, density) + (_chunk_count(rest, density) if rest else 0)


def _topk_indices(flat: torch.Tensor, density: float) -> torch.Tensor:
    """The positions of each chunk's largest magnitudes (``_topk_count`` in all), ascending (int64)."""
    numel = flat.numel()
    full = numel // TOPK_CHUNK
    out = []
    if full:
        rows = flat[: full * TOPK_CHUNK].abs().view(full, TOPK_CHUNK)
        top = torch.topk(rows, _chunk_count(TOPK_CHUNK, density), dim=1, sorted=False).indices
        out.append((top + torch.arange(full).unsqueeze(1) * TOPK_CHUNK).view(-1))
    if numel > full * TOPK_CHUNK:
        rest = flat[full * TOPK_CHUNK :].abs()
        out.append(torch.topk(rest, _chunk_count(rest.numel(), density), sorted=False).indices + full * TOPK_CHUNK)
    return torch.cat(out).sort().values


def _gaps_encode(indices: np.ndarray) -> bytes:
    """Sorted indices as the gaps between them (the first from -1, less one), a byte each; a gap of 255 or more as
    that many // 255 bytes 255 (escapes) and a last byte of the rest. A gap's last byte is never 255."""
    gaps = np.diff(indices, prepend=-1) - 1
    escapes = gaps // 255
    out = np.full(int(escapes.sum()) + len(gaps), 255, dtype=np.uint8)
    out[np.cumsum(escapes + 1) - 1] = gaps % 255
    return out.tobytes()


def _gaps_decode(data: bytes, count: int, numel: int, name: str) -> torch.Tensor:
    """The ``count`` indices ``_gaps_encode`` wrote in ``data`` (all of it), each below ``numel`` (int64)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(raw != 255)
    if len(ends) != count or (len(raw) and ends[-1] != len(raw) - 1):
        raise CodecError(f"{len(data)} bytes of gaps are no {name} encoding of {count} positions")
    escapes = np.diff(ends, prepend=-1) - 1
    indices = np.cumsum(escapes * 255 + raw[ends].astype(np.int64) + 1) - 1
    if count and indices[-1] >= numel:
        raise CodecError(f"a {name} position {int(indices[-1])} is past the part's {numel} values")
    return torch.from_numpy(indices)


def _topk_encode(flat: torch.Tensor, density: float) -> bytes:
    """The part's k largest magnitudes (``_topk_count``), 2 bits each: a sign, and the nearer of two magnitudes,
    ``low`` and ``high``, the means of the kept magnitudes up to their median and above it. Layout: k (uint32), low,
    high (fp32), the 2-bit codes four a byte (the first in the low bits; bit 0 the sign, bit 1 high), the positions'
    gaps (``_gaps_encode``)."""
    indices = _topk_indices(flat, density)
    k = indices.numel()  # _topk_count(numel, density)
    values = flat[indices]
    magnitudes = values.abs()
    median = magnitudes.kthvalue((k + 1) // 2).values
    above = magnitudes > median
    low = magnitudes[~above].mean()
    high = magnitudes[above].mean() if bool(above.any()) else low
    codes = (values < 0).to(torch.uint8) | (((magnitudes - high).abs() < (magnitudes - low).abs()).to(torch.uint8) << 1)
    padded = torch.zeros(4 * math.ceil(k / 4), dtype=torch.uint8)
    padded[:k] = codes
    quads = padded.view(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    header = np.array([k], dtype=np.uint32).tobytes() + torch.stack([low, high]).numpy().tobytes()
    return header + packed.numpy().tobytes() + _gaps_encode(indices.numpy())


def _topk_decode(data: bytes, numel: int, density: float, name: str) -> torch.Tensor:
    k = _topk_count(numel, density)
    if len(data) < 12 + math.ceil(k / 4) + k or int(np.frombuffer(data, dtype=np.uint32, count=1)[0]) != k:
        raise CodecError(f"{len(data)} bytes are no {name} encoding of {numel} values")
    low, high = np.frombuffer(data, dtype=np.float32, count=2, offset=4)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CodecError(f"a {name} encoding with magnitudes {low}, {high}")
    end = 12 + math.ceil(k / 4)
    indices = _gaps_decode(data[end:], k, numel, name)
    packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=end - 12, offset=12).copy())
    codes = ((packed[:, None] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3).view(-1)[:k]
    magnitudes = torch.where(codes & 2 > 0, torch.tensor(float(high)), torch.tensor(float(low)))
    out = torch.zeros(numel, dtype=torch.float32)
    out[indices] = torch.where(codes & 1 > 0, -magnitudes, magnitudes)
    return out


def _nonzeros_encode(flat: torch.Tensor) -> bytes:
    """``sparse4``, a group's mean of top-k parts: its nonzero values in int4 (as the int4 codec writes them) and
    their positions. Layout: their count (uint32), the int4 scales and codes, the positions' gaps."""
    indices = flat.nonzero().view(-1)
    scales, codes = _int4_encode(flat[indices])
    count = np.array([indices.numel()], dtype=np.uint32).tobytes()
    return count + scales.numpy().tobytes() + codes.numpy().tobytes() + _gaps_encode(indices.numpy())


def _nonzeros_decode(data: bytes, numel: int) -> torch.Tensor:
    count = int(np.frombuffer(data, dtype=np.uint32, count=1)[0]) if len(data) >= 4 else -1
    blocks, packed = math.ceil(count / INT4_BLOCK), math.ceil(count / 2)
    end = 4 + 4 * blocks + packed
    if not 0 <= count <= numel or len(data) < end + count:
        raise CodecError(f"{len(data)} bytes are no {MEAN_OF_SPARSE} encoding of {numel} values")
    scales = torch.from_numpy(np.frombuffer(data, dtype=np.float32, count=blocks, offset=4).copy())
    codes = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=packed, offset=4 + 4 * blocks).copy())
    out = torch.zeros(numel, dtype=torch.float32)
    out[_gaps_decode(data[end:], count, numel, MEAN_OF_SPARSE)] = _int4_decode(scales, codes, count)
    return out


DENSE = ("none", "fp16", "bf16", "int8", "int4")
SPARSE = {"topk1": 0.01, "topk3": 0.03}  # a top-k codec: the share of each part's values it sends
TOPK_CHUNK = 4096  # a top-k codec keeps its share of each chunk of this many values of a part, as SparseLoCo does
MEAN_OF_SPARSE = "sparse4"  # the codec of a group's mean of top-k parts (Codec.mean); not a choice of its own
CODECS = (*DENSE, *SPARSE)


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise CodecError(f"compression {name!r} is unknown: must be one of {', '.join(CODECS)}")
    return Codec(name)


def roundtrip_parts(
    tensors: Sequence[torch.Tensor], codec: Codec, part_values: int, sizes: list[int] | None = None
) -> list[torch.Tensor]:
    """Each tensor as the swarm's receivers hold it: flattened, cut into parts of ``part_values`` values (the
    last one shorter), each part round-tripped through ``codec``; fp32, in the tensor's shape. ``sizes``, when
    given, gets each tensor's encoded bytes (its parts' together) appended."""
    if part_values < 1:
        raise CodecError(f"part_values {part_values} is invalid: must be >= 1")
    out = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
        if codec.name == "none":
            out.append(flat.clone().view(tensor.shape))
            if sizes is not None:
                sizes.append(sum(_fp32_size(part) for part in flat.split(part_values)))
            continue
        parts = [codec.roundtrip_sized(part) for part in flat.split(part_values)]
        if sizes is not None:
            sizes.append(sum(size for _, size in parts))
        out.append((torch.cat([values for values, _ in parts]) if parts else flat.clone()).view(tensor.shape))
    return out

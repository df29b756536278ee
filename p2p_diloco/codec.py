"""Pseudo-gradient codecs: how a part of Δ (or of the group's mean) is written on the wire (pure torch).

Inputs:  a codec name (``swarm.compression``: none, fp16, bf16, int8, int4); 1-D fp32 CPU tensors (parts of Δ).
Output:  ``Codec.encode(part) -> bytes`` and ``Codec.decode(data, numel) -> fp32 tensor``; ``roundtrip(part)``
         (decode of encode: what every receiver of that part holds); ``encoded_size(numel)``: the exact bytes, and
         ``parts_size(numel, part_values)`` those of a tensor cut into the swarm's parts;
         ``roundtrip_parts(tensors, part_values)``: whole tensors cut into the swarm's parts (hivemind splits
         each flattened tensor into consecutive parts of ``part_values`` values), each part round-tripped. The
         simulator uses it to apply exactly what the swarm's wire does.
State:   none.
Failure: ``CodecError`` for an unknown name, and for bytes that are not an encoding of ``numel`` values (a
         peer sending them is treated as a broken sender by the caller). Encoding assumes finite input
         (the averager refuses non-finite Δ before this); fp16 saturates at +-65504 instead of overflowing.

The codecs, bytes per value: ``none`` 4 (fp32 as is); ``fp16`` 2 (round to nearest, saturating); ``bf16`` 2
(round to nearest even: fp32's range, 8 bits of mantissa); ``int8`` 1 + 4 / BLOCK: blockwise absmax, each
block of ``BLOCK`` values scaled by its largest magnitude / 127 (one fp32 scale per block) and rounded to
nearest, so a value's error is at most half its block's step (absmax / 254); ``int4`` 0.5 + 4 / INT4_BLOCK: the
same over blocks of ``INT4_BLOCK`` values with codes -7..7 (step absmax / 7, so an error of up to absmax / 14: ~10%
of a Gaussian part's norm, against int8's ~0.5%; engine.py's error feedback carries it into the next round), two
codes a byte, the low nibble first. Decoding is one multiply per
value, the same IEEE operation on every peer: all receivers of the same bytes hold bitwise the same values.
Every codec is deterministic (no stochastic rounding): the reducer's own slice goes through the same
encode/decode as the slices it sends, which is what keeps a group's outer states bitwise equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BLOCK", "CODECS", "INT4_BLOCK", "Codec", "CodecError", "get_codec", "roundtrip_parts"]

BLOCK = 128  # int8: values per absmax scale (3% overhead: 1.03 bytes per value)
INT4_BLOCK = 64  # int4: values per absmax scale (0.5625 bytes per value: 7.1x fewer than fp32)
_FP16_MAX = 65504.0


class CodecError(ValueError):
    """An unknown codec name, or bytes that do not decode to the values they claim."""


@dataclass(frozen=True)
class Codec:
    """One wire format for fp32 parts; see the module doc for each."""

    name: str

    def encoded_size(self, numel: int) -> int:
        if self.name == "none":
            return 4 * numel
        if self.name in ("fp16", "bf16"):
            return 2 * numel
        if self.name == "int4":
            return math.ceil(numel / 2) + 4 * math.ceil(numel / INT4_BLOCK)
        return numel + 4 * math.ceil(numel / BLOCK)

    def parts_size(self, numel: int, part_values: int) -> int:
        """Encoded bytes of one tensor of ``numel`` values cut into the swarm's parts of ``part_values`` values."""
        full, rest = divmod(numel, part_values)
        return full * self.encoded_size(part_values) + (self.encoded_size(rest) if rest else 0)

    @property
    def bytes_per_value(self) -> float:
        """For sizing parts and estimates: encoded bytes over values, for a part of many blocks."""
        return {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int4": 0.5 + 4.0 / INT4_BLOCK}.get(self.name, 1.0 + 4.0 / BLOCK)

    def encode(self, part: torch.Tensor) -> bytes:
        flat = part.detach().reshape(-1).to("cpu", torch.float32)
        if self.name == "none":
            return flat.numpy().tobytes()
        if self.name == "fp16":
            return flat.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).numpy().tobytes()
        if self.name == "bf16":
            return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        scales, codes = (_int4_encode if self.name == "int4" else _int8_encode)(flat)
        return scales.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
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
        if self.name == "none":
            return part.detach().to("cpu", torch.float32).clone()
        return self.decode(self.encode(part), part.numel()).view(part.shape)


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


CODECS = ("none", "fp16", "bf16", "int8", "int4")


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise CodecError(f"compression {name!r} is unknown: must be one of {', '.join(CODECS)}")
    return Codec(name)


def roundtrip_parts(tensors: Sequence[torch.Tensor], codec: Codec, part_values: int) -> list[torch.Tensor]:
    """Each tensor as the swarm's receivers hold it: flattened, cut into parts of ``part_values`` values (the
    last one shorter), each part round-tripped through ``codec``; fp32, in the tensor's shape."""
    if part_values < 1:
        raise CodecError(f"part_values {part_values} is invalid: must be >= 1")
    out = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
        if codec.name == "none":
            out.append(flat.clone().view(tensor.shape))
            continue
        parts = [codec.roundtrip(part) for part in flat.split(part_values)]
        out.append((torch.cat(parts) if parts else flat.clone()).view(tensor.shape))
    return out

"""The simulator's stand-in for the swarm's reducers: what a round's mean is, and what a worker sends for it.

Inputs:  a Config (``swarm.compression``, ``swarm.aggregation``, its clip, ``swarm.part_size_bytes``,
         ``swarm.target_group_size``, ``swarm.min_cosine``, ``swarm.max_skew``), the round's Contributions, and an
         Attack (what workers 0 .. K-1 send instead: simulate.py's docstring).
Output:  ``reduce_round``: the mean every member receives, made as the swarm's wire and reducers make it (each Δ
         through the codec in parts, the robust rule over them per group, the groups' means combined, the result
         through the codec of means), and the bytes a worker sends; ``measured_bytes_sent`` and ``wire_bytes_sent``,
         a butterfly's bytes from encoded sizes.
State:   none; ``AggregateStats`` (robust.py) counts the excluded and clipped worker-parts.
Failure: none of its own (the codecs and robust.py raise on shapes they cannot take).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from p2p_diloco.codec import get_codec, roundtrip_parts
from p2p_diloco.config import Config
from p2p_diloco.protocol import split_groups
from p2p_diloco.robust import AggregateStats, aggregate_flat, max_round_tokens, trusted_weight
from p2p_diloco.rounds import Contribution

__all__ = ["Attack", "measured_bytes_sent", "reduce_round", "wire_bytes_sent"]


@dataclasses.dataclass
class Attack:
    """What workers 0 .. count-1 send instead of their honest Δ and weight (module doc); ``none``: nothing changes."""

    kind: str
    scale: float
    count: int = 1

    @property
    def workers(self) -> list[int]:
        return [] if self.kind == "none" else list(range(self.count))

    def sent(self, mine: list[Contribution]) -> tuple[list[list[torch.Tensor]], list[float]]:
        """Each worker's Δ and wire weight as a reducer receives them."""
        honest = [c.pseudo_grad for c in mine]
        deltas, wire = list(honest), [float(c.inner.tokens) for c in mine]
        if self.kind.startswith("alie") and len(mine) > 1:  # every colluder sends the same shift along the spread
            stacked = [torch.stack(ts) for ts in zip(*honest, strict=True)]
            shifted = [
                s.mean(dim=0) - self.scale * s.std(dim=0) * _signs(s.shape[1:], k, self.kind == "alie-balanced")
                for k, s in enumerate(stacked)
            ]
        for k in self.workers if len(mine) > 1 else []:  # a round of one worker has nobody to attack
            if self.kind == "negate":
                deltas[k] = [d.mul(-self.scale) for d in honest[k]]
            elif self.kind == "weight":
                wire[k] = self.scale * wire[k]
            elif self.kind == "zeros":
                deltas[k] = [torch.zeros_like(d) for d in honest[k]]
            elif self.kind.startswith("alie"):
                deltas[k] = shifted
        return deltas, wire


def _signs(shape: torch.Size, tensor: int, balanced: bool) -> torch.Tensor | float:
    """ALIE's direction per coordinate: 1 everywhere, or (balanced) a fixed pattern of ±1 drawn from seed ``tensor``,
    the same every round, so the shift accumulates as ALIE's does while half of it lies on each side of the median."""
    if not balanced:
        return 1.0
    draw = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(tensor), dtype=torch.int8)
    return draw.to(torch.float32) * 2 - 1


def reduce_round(
    cfg: Config,
    mine: list[Contribution],
    attack: Attack,
    stats: AggregateStats,
    factors: list[float | None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """The reducers' result for this round, as the swarm's wire and reducers make it: each worker's Δ through
    ``swarm.compression`` (parts of ``swarm.part_size_bytes / 4`` values per tensor, as hivemind cuts them),
    ``swarm.aggregation`` over them, and the result through the codec of means (what every member receives;
    ``Codec.mean``). ``factors``: per worker, its weight factor (``RoundRules.weight_factors``), None for one whose Δ
    does not count (it sends weight 0); default: every Δ counts in full. Also returns the bytes a worker sends, as
    the encodings measure (``measured_bytes_sent``)."""
    s = cfg.swarm
    codec, part_values = get_codec(s.compression), s.part_size_bytes // 4
    deltas, wire = attack.sent(mine)
    if factors is not None:
        wire = [w if f is not None else 0.0 for w, f in zip(wire, factors, strict=True)]
    sizes: list[int] = []
    deltas = [roundtrip_parts(d, codec, part_values, sizes) for d in deltas]
    if s.aggregation == "mean":  # as the swarm's plain mean: the wire weight as is
        weights = wire
    else:
        cap = max_round_tokens(cfg)
        weights = [trusted_weight(w, c.payload.tokens, cap) for w, c in zip(wire, mine, strict=True)]
    scale = None if factors is None or all(f in (None, 1.0) for f in factors) else [f or 1.0 for f in factors]
    groups = split_groups([True] * len(mine), s.target_group_size)  # a round of more workers: its groups combined

    def carry(mean: torch.Tensor) -> torch.Tensor:  # a group's mean of a part goes on to the part's round reducer
        return codec.mean.roundtrip(mean)

    averaged = aggregate_flat(
        deltas,
        weights,
        s.aggregation,
        s.aggregation_clip,
        part_values,
        stats,
        scale,
        groups,
        carry,
        s.min_cosine,
        s.max_skew,
    )
    mean_sizes: list[int] = []
    averaged = roundtrip_parts(averaged, codec.mean, part_values, mean_sizes)
    return averaged, measured_bytes_sent(sum(sizes) / len(mine), sum(mean_sizes), len(mine))


def measured_bytes_sent(delta_bytes: float, mean_bytes: int, group_size: int) -> int:
    """What one peer of an even butterfly of ``group_size`` sends in a round, from the encoded sizes of its Δ and of
    the group's mean: (n-1)/n of its Δ's parts to the other reducers, and its 1/n of the mean to n-1 members. For a
    dense codec, ``wire_bytes_sent``."""
    if group_size <= 1:
        return 0
    return int((group_size - 1) / group_size * (delta_bytes + mean_bytes))


def wire_bytes_sent(cfg: Config, shapes: list[torch.Size], group_size: int) -> int:
    """What one peer of an even butterfly sends in a round: 2(n-1)/n x the encoded size of Δ (its parts). Exact for
    a dense codec; for a top-k one, an estimate from ``Codec.encoded_size`` (its means' size depends on the data:
    the simulator measures it, ``measured_bytes_sent``)."""
    if group_size <= 1:
        return 0
    codec, part_values = get_codec(cfg.swarm.compression), cfg.swarm.part_size_bytes // 4
    encoded = sum(codec.parts_size(math.prod(shape), part_values) for shape in shapes)
    return int(2 * (group_size - 1) / group_size * encoded)

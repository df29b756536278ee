"""Robust aggregation of pseudo-gradient parts at a reducer, and the rule for a sender's trusted weight (pure torch).

Inputs:  ``aggregate``: one part per sender (fp32 tensors of one shape: in the swarm a slice of ~part_size_bytes / 4
         values of the flattened Δ, in the simulator the same slices of ``aggregate_flat``), one weight per sender
         (>= 0; 0, negative or non-finite: excluded), a rule (``RULES``) and its clip factor (> 0).
         ``trusted_weight``: the weight a sender put on the wire, the tokens it declared in its gather payload and
         the most tokens one round can hold for this config (``max_round_tokens``).
Output:  the aggregated part (fp32, same shape, a new tensor). Rules:
         ``mean``           Σ w_i·x_i / Σ w_i, accumulated in sender order exactly as ``outer.weighted_mean`` does
                            (acc += x_i · (w_i / Σ w)); the clip factor is ignored. Nothing is bounded.
         ``median_filter``  a sender whose part norm exceeds ``clip`` x the median of the included senders' part
                            norms counts 0 for that part; the weighted mean of the rest (bitwise the ``mean``
                            arithmetic over them). Every kept part is within the bound, so no sender moves the result
                            by more than w_i / Σ w x ``clip`` x the median norm, and a grossly scaled part (-1000 x Δ)
                            costs only its own tokens instead of a clipped pull against the honest direction.
         ``median_clip``    each sender's part is scaled down to at most ``clip`` x the median of the included senders'
                            part norms, then the weighted mean (unclipped senders: bitwise the ``mean`` arithmetic).
                            Senders of unequal weight (time-budgeted rounds: a faster peer trains more tokens, and its
                            Δ is longer) are compared per token: sender i's bound is ``clip`` x the median of the
                            senders' norm / weight, times w_i. Equal weights take the plain median of norms (the same
                            bound, without the rounding). Per token errs toward the light senders: a Δ grows at most
                            about linearly with steps, so a short run's norm per token is if anything higher, and
                            dropping a light sender costs little; a per-norm bound dropped the heavy one of a pair.
         ``centered_clip``  CenteredClip (Karimireddy et al. 2021; hivemind's CenteredClipAccumulator, BTARD):
                            v0 = the coordinate-wise median of the included parts, τ = ``clip`` x the median of
                            ||x_i − v0||, then ``CENTERED_CLIP_ITERS`` fixed iterations
                            v ← v + Σ w_i·clip(x_i − v, τ) / Σ w_i with clip(z, τ) = z·min(1, τ/||z||); in fp64.
         Medians of norms are the *lower* median (index (m − 1) // 2 of m sorted values): large values are what an
         attacker can push without limit, and the lower median stays an honest value while at most m // 2 of m
         senders are hostile (the upper median only while fewer than m / 2 are: not 1 of 2, not 2 of 4). The
         coordinate-wise median v0 is the usual midpoint median and counts senders, not weights: weights are capped
         by ``trusted_weight`` anyway, and with 2 senders of unequal weight a weighted median sits on the heavier
         one, which makes τ = 0 and drops the other sender entirely.
         Direction (every rule but ``mean``, with ``min_cosine`` > -1 and 3 or more included senders): a sender whose
         part's cosine to the coordinate-wise median of the included senders' parts is below ``min_cosine``
         counts 0 for that part, before the rule runs. A sign-flipped Δ of honest size passes every norm bound but
         points away from the others': on tiny (4 workers, H 25) honest parts had cosine 0.63-0.95 to the median
         (IID) and 0.37-0.94 (by-label shards), a -1.9 x Δ sender -0.85 to -0.08 (docs/robust_aggregation.md). A
         part of norm 0 beside a median that is not (a free-rider's zeros) has no direction: cosine -1, dropped by
         any floor; a median of norm 0 judges nobody (cosine 0). Two senders are not judged (the median is their
         midpoint: neither can be told from the other).
         Sign skew (the same senders, with ``max_skew`` < 1): over the coordinates where that median is positive, a
         sender's side skew (above − below) / (above + below), counting its values above and below the median (ties
         left out), less the (midpoint) median of the senders' side skews there; the same over the coordinates where
         the median is negative (no side skew when a side has fewer than ``SKEW_MIN_VALUES`` untied values; none
         relative when fewer than 3 senders have one). Its skew is the smaller of the two relative side skews when
         both have one sign (with that sign), else 0. A sender whose |skew| exceeds ``max_skew`` counts 0 for that
         part. An honest Δ is above the median about as often as below; "a little is enough" (ALIE: μ − z·σ
         coordinate by coordinate) is below it nearly everywhere, on both sides, while its cosine and norm look
         honest (SignGuard's observation, arXiv 2109.05872): side skews near −1 and −1. The sides are taken apart
         because an honest Δ longer than the others is above the median where it is positive and below where it is
         negative (+1 and −1: skew 0): in a part where nearly every value has one sign (a norm's gains, a bias) one
         skew over all values read ±0.5-0.72 for honest peers in a real swarm. Both sides must agree because an
         honest Δ can lie on one side of the median on one side alone: with sparse gradients (embedding rows that
         most peers' batches miss, the scale harness's micro model) 16 honest senders had side skews like +0.17
         and +0.97, which their mean (then the rule) dropped in 6 of 1056 sender-parts. The senders' median is
         taken out because colluders below the median push the honest senders above it: with 1 of 3 they are
         above at every untied value (+1), with k of m (k < m / 2) about (m − 2k) / (m − k) more often than below;
         relative to the median, honest senders stay near 0 and the colluders near −1 − that, while they are fewer
         than half.
         Measured: docs/robust_aggregation.md.
         ``trusted_weight`` returns the declared tokens when the wire weight equals them and 0 < tokens <= the round's
         maximum, else 0.0 (the sender is excluded from every part).
         The default (config.py: ``swarm.aggregation`` median_filter, ``swarm.aggregation_clip`` 2) and the
         measurements that chose it: docs/robust_aggregation.md.
State:   none; pass an ``AggregateStats`` to count exclusions, clipping and the lowest cosine across calls.
Failure: a part with NaN or inf is excluded (weight 0) and counted in ``stats.excluded_nonfinite``, never propagated;
         a part with no included sender at all comes back as zeros (``stats.empty_parts``): the reducer must answer
         every member, and a zero part moves nothing (median_filter with clip < 1 can get there: config.py refuses
         it). ValueError for caller errors only (no parts, mismatched
         lengths or shapes, unknown rule, clip <= 0 for a clipping rule).
Determinism: the same inputs in the same order give bitwise the same output on one machine (norms are summed in
         fp64 and every accumulation runs in sender order). Only one reducer computes each part and every member
         takes its result, so nothing needs to agree across machines.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CENTERED_CLIP_ITERS",
    "RULES",
    "SKEW_MIN_VALUES",
    "AggregateStats",
    "Judgement",
    "aggregate",
    "aggregate_counted",
    "aggregate_flat",
    "combine_groups",
    "cosines_to_median",
    "dropped",
    "judge_against_median",
    "max_round_tokens",
    "trusted_weight",
]

RULES = ("mean", "median_filter", "median_clip", "centered_clip")
CENTERED_CLIP_ITERS = 5  # with one clipped sender of m the error shrinks by ~1/m per iteration: 5 are plenty
SKEW_MIN_VALUES = 64  # fewer untied values on a side: no skew (by chance alone an honest one is ~1/sqrt(n))


class Judgement(NamedTuple):
    """One sender's part against the coordinate-wise median of the included senders' parts (module doc)."""

    cosine: float
    skew: float


@dataclass
class AggregateStats:
    """Counts over ``aggregate`` calls: ``parts`` aggregated; sender-parts excluded for their weight, for non-finite
    values or (median_filter) for a norm over the bound; sender-parts clipped (median_clip: scaled down;
    centered_clip: clipped in the last iteration); parts that had no included sender (returned as zeros);
    ``max_ratio``, the largest part norm over the median norm (median_*) or distance to v0 over the median distance
    (centered_clip) seen: how close the senders came to the clip factor (clean runs: the headroom it leaves);
    ``excluded_direction``, sender-parts below ``min_cosine``, and ``min_cosine_kept``, the lowest cosine of a part
    that was kept (1.0 until one is judged): how close honest senders came to the floor; ``excluded_skew``,
    sender-parts (not already below the floor) whose |skew| exceeds ``max_skew``, and ``max_skew_kept``, the largest
    |skew| of a part that was kept."""

    parts: int = 0
    excluded_weight: int = 0
    excluded_nonfinite: int = 0
    excluded_outlier: int = 0
    clipped: int = 0
    empty_parts: int = 0
    max_ratio: float = 0.0
    excluded_direction: int = 0
    min_cosine_kept: float = 1.0
    excluded_skew: int = 0
    max_skew_kept: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)

    def saw(self, values: Sequence[float], median: float) -> None:
        top = max(values)
        ratio = top / median if median > 0 else (0.0 if top == 0 else math.inf)
        self.max_ratio = max(self.max_ratio, ratio)


def max_round_tokens(cfg) -> int:  # cfg: p2p_diloco.config.Config (not imported: this module stays dependency-free)
    """The most tokens one round's Δ can be trained on: H steps x grad_accum batches x B x T."""
    return cfg.inner.steps * cfg.inner.grad_accum * cfg.data.batch_size * cfg.data.seq_len


def trusted_weight(wire_weight: float, declared_tokens: int, max_tokens: int | None) -> float:
    """The weight a reducer may use for a sender: its declared tokens if the wire weight equals them and
    0 < tokens <= ``max_tokens`` (None: no bound); anything else (a weight that disagrees with the declaration, a
    declaration no round can hold, NaN) counts 0.0."""
    try:
        ok = (
            math.isfinite(wire_weight)
            and float(wire_weight) == float(declared_tokens)
            and 0 < declared_tokens
            and (max_tokens is None or declared_tokens <= max_tokens)
        )
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return float(declared_tokens) if ok else 0.0


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _bounds(norms: list[float], weights: list[float], clip: float) -> tuple[list[float], float, list[float]]:
    """(the values the median is taken over, that median, each sender's norm bound): plain norms when the weights
    are equal, else norms per unit of weight, each bound scaled back by its sender's weight (module doc)."""
    if len(set(weights)) == 1:
        median = _lower_median(norms)
        return norms, median, [clip * median] * len(norms)
    per_weight = [n / w for n, w in zip(norms, weights, strict=True)]
    median = _lower_median(per_weight)
    return per_weight, median, [clip * median * w for w in weights]


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def _mean(parts: list[torch.Tensor], weights: list[float], total: float, scales: list[float]) -> torch.Tensor:
    acc = torch.zeros_like(parts[0])
    for x, w, s in zip(parts, weights, scales, strict=True):
        acc.add_(x, alpha=w / total if s == 1.0 else w / total * s)
    return acc


def cosines_to_median(parts: Sequence[torch.Tensor]) -> list[float]:
    """Each part's cosine to the coordinate-wise (midpoint) median of all of them, in fp64: -1.0 for a part of
    norm 0 (no direction) beside a median that is not, 0.0 for every part when the median has norm 0."""
    return [j.cosine for j in judge_against_median(parts)]


def judge_against_median(parts: Sequence[torch.Tensor]) -> list[Judgement]:
    """Each part's cosine to the coordinate-wise (midpoint) median of all of them (``cosines_to_median``) and its sign
    skew against that median, relative to the senders' median skew (module doc), in fp64."""
    # one row per coordinate: sorting rows of m values is ~3-5x faster than sorting along the senders' axis
    ordered = torch.stack([p.to(torch.float32) for p in parts], dim=1).sort(dim=1).values
    m = ordered.shape[1]
    centre = (ordered[:, (m - 1) // 2].to(torch.float64) + ordered[:, m // 2].to(torch.float64)) * 0.5
    del ordered
    centre_norm = float(torch.linalg.vector_norm(centre))
    sides = [(mask, centre[mask]) for mask in (centre > 0, centre < 0)]
    cosines: list[float] = []
    raw: list[tuple[float, float] | None] = []
    for x in parts:
        x = x.to(torch.float64)
        raw.append(_side_skews(x, sides))
        norm = float(torch.linalg.vector_norm(x))
        if centre_norm == 0:
            cosines.append(0.0)
        else:
            cosines.append(float(torch.dot(x, centre)) / (norm * centre_norm) if norm > 0 else -1.0)
    known = [r for r in raw if r is not None]
    if len(known) < 3:
        return [Judgement(c, 0.0) for c in cosines]
    typical = [statistics.median(r[side] for r in known) for side in (0, 1)]  # the midpoint median
    return [
        Judgement(c, 0.0 if r is None else _agreeing(r[0] - typical[0], r[1] - typical[1]))
        for c, r in zip(cosines, raw, strict=True)
    ]


def _side_skews(x: torch.Tensor, sides: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float] | None:
    """(above − below) / (above + below) of x's values against the median, on its positive and its negative side;
    None when a side has fewer than SKEW_MIN_VALUES of x's values off the median."""
    per_side = []
    for mask, middle in sides:
        values = x[mask]  # one gather per side, not one per comparison
        above, below = int((values > middle).sum()), int((values < middle).sum())
        if above + below < SKEW_MIN_VALUES:
            return None
        per_side.append((above - below) / (above + below))
    return per_side[0], per_side[1]


def _agreeing(a: float, b: float) -> float:
    """The smaller of two side skews when both have one sign (with it), else 0: a shift moves both sides."""
    if a * b <= 0:
        return 0.0
    return min(a, b) if a > 0 else max(a, b)


def _centered_clip(
    parts: list[torch.Tensor], weights: list[float], total: float, clip: float, stats: AggregateStats | None
) -> torch.Tensor:
    xs = torch.stack(parts).to(torch.float64)  # fp64: x_i − v cannot overflow for any finite fp32 input
    m = xs.shape[0]
    ordered = xs.sort(dim=0).values
    v = ordered[(m - 1) // 2] * 0.5 + ordered[m // 2] * 0.5
    del ordered
    dists = [float(torch.linalg.vector_norm(x - v)) for x in xs]
    median = _lower_median(dists)
    tau = clip * median
    if stats is not None:
        stats.saw(dists, median)
    clipped = 0
    for _ in range(CENTERED_CLIP_ITERS):
        step = torch.zeros_like(v)
        clipped = 0
        for x, w in zip(xs, weights, strict=True):
            z = x - v
            nz = float(torch.linalg.vector_norm(z))
            scale = 1.0 if nz <= tau else tau / nz
            clipped += scale < 1.0
            step.add_(z, alpha=w / total * scale)
        v.add_(step)
    if stats is not None:
        stats.clipped += clipped
    return v.to(torch.float32)


def aggregate(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    rule: str,
    clip: float,
    stats: AggregateStats | None = None,
    factors: Sequence[float] | None = None,
    min_cosine: float = -1.0,
    max_skew: float = 1.0,
) -> torch.Tensor:
    """The robust weighted mean of one part from each sender (module doc); fp32, same shape, a new tensor.

    ``factors`` (default all 1): what each sender's weight is multiplied by in the mean, not in the bounds: a
    delayed Δ (protocol.RoundRules.stale_weight) is judged per declared token like any other and counts less.
    ``min_cosine`` (-1: off) and ``max_skew`` (1: off): the direction floor and the sign skew of the module doc."""
    return aggregate_counted(parts, weights, rule, clip, stats, factors, min_cosine, max_skew=max_skew)[0]


def aggregate_counted(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    rule: str,
    clip: float,
    stats: AggregateStats | None = None,
    factors: Sequence[float] | None = None,
    min_cosine: float = -1.0,
    judged: dict[int, Judgement] | None = None,
    max_skew: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """``aggregate``, and the weight its result stands for: the senders' weights (times their factors) it counted, 0.0
    when it counted none. What a group's reducer hands on when a round spans several groups (``combine_groups``).
    ``judged``, when given, is filled with the Judgement of each sender judged against the median, by its index in
    ``parts`` (those below ``min_cosine`` or over ``max_skew`` were dropped: ``dropped``); untouched when nobody was
    judged."""
    if rule not in RULES:
        raise ValueError(f"aggregation rule {rule!r} is unknown: must be one of {', '.join(RULES)}")
    if rule != "mean" and not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"aggregation clip {clip!r} is invalid: must be a finite number > 0")
    if not parts or len(parts) != len(weights):
        raise ValueError(f"need one weight per part and at least one part, got {len(parts)} parts, {len(weights)}")
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"parts differ in shape: {sorted({tuple(p.shape) for p in parts})}")
    if factors is not None and (len(factors) != len(parts) or not all(0 < f <= 1 for f in factors)):
        raise ValueError(f"need one factor in (0, 1] per part, got {list(factors)}")
    if not -1.0 <= min_cosine <= 1.0:
        raise ValueError(f"min_cosine {min_cosine!r} is invalid: must be in [-1, 1]")
    if not 0.0 <= max_skew <= 1.0:
        raise ValueError(f"max_skew {max_skew!r} is invalid: must be in [0, 1]")
    kept: list[torch.Tensor] = []
    kept_w: list[float] = []
    kept_f: list[float] = []
    kept_i: list[int] = []
    for i, (x, w, f) in enumerate(zip(parts, weights, factors or [1.0] * len(parts), strict=True)):
        w = float(w)
        if not (w > 0 and math.isfinite(w)):
            if stats is not None:
                stats.excluded_weight += 1
            continue
        x = x.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(x).all()):
            if stats is not None:
                stats.excluded_nonfinite += 1
            continue
        kept.append(x)
        kept_w.append(w)
        kept_f.append(float(f))
        kept_i.append(i)
    if stats is not None:
        stats.parts += 1
    if rule != "mean" and (min_cosine > -1.0 or max_skew < 1.0) and len(kept) >= 3:
        verdicts = judge_against_median(kept)
        along = [k for k, j in enumerate(verdicts) if not dropped(j, min_cosine, max_skew)]
        if stats is not None:
            away = sum(j.cosine < min_cosine for j in verdicts)
            stats.excluded_direction += away
            stats.excluded_skew += len(kept) - len(along) - away
            stats.min_cosine_kept = min([stats.min_cosine_kept] + [verdicts[k].cosine for k in along])
            stats.max_skew_kept = max([stats.max_skew_kept] + [abs(verdicts[k].skew) for k in along])
        if judged is not None:
            judged.update(zip(kept_i, verdicts, strict=True))
        kept, kept_w, kept_f = [kept[k] for k in along], [kept_w[k] for k in along], [kept_f[k] for k in along]
    if not kept:
        if stats is not None:
            stats.empty_parts += 1
        return torch.zeros(shape, dtype=torch.float32), 0.0
    mean_w = kept_w if factors is None else [w * f for w, f in zip(kept_w, kept_f, strict=True)]
    total = float(sum(mean_w))
    if rule == "mean":
        return _mean(kept, mean_w, total, [1.0] * len(kept)), total
    if rule == "median_filter":
        norms = [_norm(x) for x in kept]
        seen, median, bounds = _bounds(norms, kept_w, clip)
        inside = [k for k, (n, b) in enumerate(zip(norms, bounds, strict=True)) if n <= b]  # clip >= 1: never empty
        if stats is not None:
            stats.saw(seen, median)
            stats.excluded_outlier += len(kept) - len(inside)
            stats.empty_parts += not inside
        if not inside:
            return torch.zeros(shape, dtype=torch.float32), 0.0
        kept, mean_w = [kept[k] for k in inside], [mean_w[k] for k in inside]
        counted = float(sum(mean_w))
        return _mean(kept, mean_w, counted, [1.0] * len(kept)), counted
    if rule == "median_clip":
        norms = [_norm(x) for x in kept]
        seen, median, bounds = _bounds(norms, kept_w, clip)
        scales = [1.0 if n <= b else b / n for n, b in zip(norms, bounds, strict=True)]
        if stats is not None:
            stats.saw(seen, median)
            stats.clipped += sum(s < 1.0 for s in scales)
        return _mean(kept, mean_w, total, scales), total
    return _centered_clip(kept, mean_w, total, clip, stats), total


def dropped(judgement: Judgement, min_cosine: float, max_skew: float) -> bool:
    """Whether a judged sender's part counts 0: it points against the median, or lies on one side of it more than the
    other senders do (``max_skew`` 1: never)."""
    return judgement.cosine < min_cosine or (max_skew < 1.0 and abs(judgement.skew) > max_skew)


def combine_groups(
    means: Sequence[torch.Tensor], weights: Sequence[float], rule: str, clip: float, stats: AggregateStats | None = None
) -> torch.Tensor:
    """One part of the round's mean from its groups' parts (each ``aggregate_counted`` over one group's senders, with
    the weight it counted), in group order: Σ W_k·m_k / Σ W_k, exactly the mean over every sender the groups counted.
    Under a robust rule a group's part whose norm exceeds ``clip`` x the lower median of the groups' part norms counts
    0: a group's reducer that lies about its mean moves nothing (group means of honest senders lie far closer
    together than single senders' parts do). Non-finite parts and weights count 0; none left: zeros."""
    if not means or len(means) != len(weights):
        raise ValueError(f"need one weight per group mean and at least one, got {len(means)} and {len(weights)}")
    kept = [
        (m.detach().to("cpu", torch.float32), float(w))
        for m, w in zip(means, weights, strict=True)
        if float(w) > 0 and math.isfinite(float(w)) and bool(torch.isfinite(m).all())
    ]
    if rule != "mean" and len(kept) > 1:
        norms = [_norm(m) for m, _ in kept]
        median = _lower_median(norms)
        if stats is not None:
            stats.saw(norms, median)
        inside = [k for k, n in enumerate(norms) if n <= clip * median]
        if stats is not None:
            stats.excluded_outlier += len(kept) - len(inside)
        kept = [kept[k] for k in inside]
    if not kept:
        return torch.zeros(means[0].shape, dtype=torch.float32)
    total = float(sum(w for _, w in kept))
    return _mean([m for m, _ in kept], [w for _, w in kept], total, [1.0] * len(kept))


def aggregate_flat(
    vectors: list[list[torch.Tensor]],
    weights: Sequence[float],
    rule: str,
    clip: float,
    part_values: int,
    stats: AggregateStats | None = None,
    factors: Sequence[float] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    carry: Callable[[torch.Tensor], torch.Tensor] | None = None,
    min_cosine: float = -1.0,
    max_skew: float = 1.0,
) -> list[torch.Tensor]:
    """Each sender's tensors flattened and concatenated, cut into consecutive parts of ``part_values`` values,
    ``aggregate`` per part, reshaped back to the first sender's shapes (fp32). The simulator's stand-in for the
    swarm's reducers: their parts are cut per reducer span, so the boundaries (and clipping) differ slightly.
    ``groups``: the senders' indices per group when a round spans several (protocol.split_groups): each part is then
    ``aggregate_counted`` per group, each group's part passed through ``carry`` (the wire codec, as a group's reducer
    sends it on), and ``combine_groups`` over them."""
    if part_values < 1:
        raise ValueError(f"part_values {part_values} is invalid: must be >= 1")
    if not vectors:
        raise ValueError("need at least one sender")
    shapes = [t.shape for t in vectors[0]]
    if not shapes:
        return []
    for k, v in enumerate(vectors):
        if [t.shape for t in v] != shapes:
            raise ValueError(f"sender {k} holds tensors of shapes {[list(t.shape) for t in v]}, sender 0 {shapes}")
    if groups is not None and sorted(i for g in groups for i in g) != list(range(len(vectors))):
        raise ValueError(f"groups {[list(g) for g in groups]} must hold each of the {len(vectors)} senders once")
    flats = [torch.cat([t.detach().to("cpu", torch.float32).reshape(-1) for t in v]) for v in vectors]
    total = flats[0].numel()
    out = torch.empty(total, dtype=torch.float32)
    for start in range(0, total, part_values):
        end = min(start + part_values, total)
        if groups is None or len(groups) == 1:
            part = [f[start:end] for f in flats]
            out[start:end] = aggregate(part, weights, rule, clip, stats, factors, min_cosine, max_skew)
            continue
        means, counted = [], []
        for group in groups:
            mean, weight = aggregate_counted(
                [flats[i][start:end] for i in group],
                [weights[i] for i in group],
                rule,
                clip,
                stats,
                None if factors is None else [factors[i] for i in group],
                min_cosine,
                max_skew=max_skew,
            )
            means.append(mean if carry is None else carry(mean))
            counted.append(weight)
        out[start:end] = combine_groups(means, counted, rule, clip, stats)
    return [piece.view(shape) for piece, shape in zip(out.split([math.prod(s) for s in shapes]), shapes, strict=True)]

"""Robust aggregation (p2p_diloco/robust.py): the plain mean is the reference mean, hostile parts are bounded,
non-finite parts never propagate, the weight rule, determinism, and the flat round trip the simulator uses."""

import math

import pytest
import torch

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.outer import weighted_mean
from p2p_diloco.robust import (
    RULES,
    SKEW_MIN_VALUES,
    AggregateStats,
    aggregate,
    aggregate_counted,
    aggregate_flat,
    combine_groups,
    cosines_to_median,
    judge_against_median,
    max_round_tokens,
    trusted_weight,
)
from p2p_diloco.simulate import simulate

ROBUST = [r for r in RULES if r != "mean"]
SHAPES = [(7, 5), (3,), (4, 2, 3), (1,)]


def _senders(n=4, shapes=SHAPES, seed=0, spread=0.3):
    """n Δ that share a common direction plus per-sender noise, like honest workers' pseudo-gradients."""
    g = torch.Generator().manual_seed(seed)
    common = [torch.randn(s, generator=g) for s in shapes]
    return [[c + spread * torch.randn(c.shape, generator=g) for c in common] for _ in range(n)]


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("part_values", [1, 5, 13, 1000])
def test_mean_rule_is_bitwise_the_reference_weighted_mean(part_values):
    vectors = _senders()
    weights = [100.0, 300.0, 250.0, 7.0]
    expected = weighted_mean(vectors, weights)
    got = aggregate_flat(vectors, weights, "mean", 1.0, part_values)
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("rule", ROBUST)
@pytest.mark.parametrize("clip", [1.0, 2.0])
def test_a_minus_1000x_sender_among_four_is_bounded(rule, clip):
    honest = [_flat(v) for v in _senders()]
    attacker = -1000.0 * honest[0]
    parts = [attacker, *honest[1:]]
    w = [1.0] * 4
    stats = AggregateStats()
    got = aggregate(parts, w, rule, clip, stats)
    honest_mean = sum(honest[1:]) / 3
    norms = sorted(float(p.norm()) for p in parts)
    median_norm = norms[1]  # the lower median of 4
    if rule == "median_filter":
        # parts over clip x the median norm (the attacker's, by far) count 0: the mean of the others
        inside = [p for p in parts if float(p.norm()) <= clip * median_norm]
        assert len(inside) <= 3 and not any(p is attacker for p in inside)
        assert torch.equal(got, aggregate(inside, [1.0] * len(inside), "mean", clip))
        assert stats.excluded_outlier == 4 - len(inside)
        if clip == 2.0:  # honest norms are within 10% of each other
            assert len(inside) == 3
    elif rule == "median_clip":
        # exactly: every part scaled to at most clip x the median norm, then the mean; the attacker's share of the
        # result is at most clip x median norm / 4
        bound = clip * median_norm
        scaled = [p * min(1.0, bound / float(p.norm())) for p in parts]
        assert torch.allclose(got, sum(scaled) / 4, atol=1e-5)
        assert float((got - sum(scaled[1:]) / 4).norm()) <= bound / 4 * (1 + 1e-5)
    else:
        # the attacker moves the result at most ~ τ / 3 (τ = clip x the median distance to v0) off the honest mean
        v0 = torch.stack(parts).sort(dim=0).values[1:3].mean(dim=0)
        tau = clip * sorted(float((p - v0).norm()) for p in parts)[1]
        assert float((got - honest_mean).norm()) <= tau / 2
        assert stats.clipped >= 1
    plain = aggregate(parts, w, "mean", clip)
    assert float((plain - honest_mean).norm()) > 100 * float((got - honest_mean).norm())


@pytest.mark.parametrize("rule", RULES)
def test_non_finite_parts_are_excluded_and_counted(rule):
    parts = [_flat(v) for v in _senders(3)]
    bad = parts[1].clone()
    bad[3] = float("nan")
    worse = parts[2].clone()
    worse[0] = float("inf")
    stats = AggregateStats()
    got = aggregate([parts[0], bad, worse, parts[1]], [1.0, 1.0, 1.0, 1.0], rule, 2.0, stats)
    assert torch.isfinite(got).all()
    assert stats.excluded_nonfinite == 2 and stats.parts == 1
    assert torch.allclose(got, (parts[0] + parts[1]) / 2, atol=1e-6)


@pytest.mark.parametrize("rule", RULES)
def test_zero_bad_weights_exclude_and_no_sender_gives_zeros(rule):
    parts = [_flat(v) for v in _senders(3)]
    stats = AggregateStats()
    got = aggregate(parts, [0.0, float("nan"), 5.0], rule, 1.0, stats)
    assert torch.allclose(got, parts[2]) and stats.excluded_weight == 2
    empty = aggregate(parts, [0.0, -1.0, 0.0], rule, 1.0, stats)
    assert torch.equal(empty, torch.zeros_like(parts[0])) and stats.empty_parts == 1


def test_weight_rule():
    cap = 12800
    assert trusted_weight(12800.0, 12800, cap) == 12800.0
    assert trusted_weight(100.0, 100, cap) == 100.0
    assert trusted_weight(1e6 * 12800, 12800, cap) == 0.0  # weight != declared tokens
    assert trusted_weight(12801.0, 12801, cap) == 0.0  # more than one round can hold
    assert trusted_weight(0.0, 0, cap) == 0.0
    assert trusted_weight(-5.0, -5, cap) == 0.0
    assert trusted_weight(1e9, 10**9, None) == 1e9 and trusted_weight(2.0, 1, None) == 0.0  # None: no bound
    assert trusted_weight(float("nan"), 100, cap) == 0.0
    assert trusted_weight(float("inf"), 100, cap) == 0.0
    cfg = load_config("configs/tiny.yaml")
    assert max_round_tokens(cfg) == 25 * 1 * 8 * 64


@pytest.mark.parametrize("rule", RULES)
def test_deterministic(rule):
    parts = [_flat(v) for v in _senders(5, seed=3, spread=2.0)]
    parts[4] = parts[4] * -1000
    w = [3.0, 1.0, 2.0, 5.0, 4.0]
    a = aggregate(parts, w, rule, 1.0)
    b = aggregate([p.clone() for p in parts], list(w), rule, 1.0)
    assert torch.equal(a, b) and a.dtype == torch.float32


@pytest.mark.parametrize("rule", ROBUST)
def test_robust_rules_leave_a_clean_group_near_the_mean(rule):
    vectors = _senders(4, spread=0.1)
    w = [1.0, 2.0, 3.0, 4.0]
    got = aggregate_flat(vectors, w, rule, 4.0, 11)  # a large clip: nobody is clipped
    ref = weighted_mean(vectors, w)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, ref))
    same = aggregate_flat([vectors[0]] * 3, [1.0] * 3, rule, 1.0, 11)  # identical senders: their Δ
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(same, vectors[0]))


@pytest.mark.parametrize("rule", RULES)
def test_aggregate_flat_round_trip_and_two_senders(rule):
    vectors = _senders(2)
    assert [t.shape for t in aggregate_flat(vectors, [10.0, 15.0], rule, 2.0, 4)] == [torch.Size(s) for s in SHAPES]
    got = aggregate_flat(vectors, [10.0, 15.0], rule, 2.0, 1000)
    # two senders of unequal weight: v0 is their midpoint (a count median), so neither is dropped, and with clip 2
    # neither is clipped (norms per token within 1.5x): the weighted mean
    assert all(torch.allclose(a, (2 * x + 3 * y) / 5, atol=1e-5) for a, x, y in zip(got, *vectors))
    assert sum(t.numel() for t in got) == sum(math.prod(s) for s in SHAPES)


def test_caller_errors():
    parts = [torch.zeros(3), torch.zeros(3)]
    with pytest.raises(ValueError, match="unknown"):
        aggregate(parts, [1.0, 1.0], "trimmed", 1.0)
    with pytest.raises(ValueError, match="clip"):
        aggregate(parts, [1.0, 1.0], "centered_clip", 0.0)
    with pytest.raises(ValueError, match="shape"):
        aggregate([torch.zeros(3), torch.zeros(4)], [1.0, 1.0], "mean", 1.0)
    with pytest.raises(ValueError, match="one weight per part"):
        aggregate(parts, [1.0], "mean", 1.0)


def test_config_and_simulator_options_are_checked(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["swarm.aggregation=median_clip", "swarm.aggregation_clip=2"])
    assert cfg.swarm.aggregation == "median_clip" and cfg.swarm.aggregation_clip == 2.0
    with pytest.raises(ConfigError, match="swarm.aggregation="):
        load_config("configs/tiny.yaml", ["swarm.aggregation=trimmed"])
    with pytest.raises(ConfigError, match="swarm.aggregation_clip"):
        load_config("configs/tiny.yaml", ["swarm.aggregation_clip=0"])
    with pytest.raises(ConfigError, match="--attack"):
        simulate(cfg, "sync", 2, tmp_path, attack="negate")
    with pytest.raises(ConfigError, match="--attack"):
        simulate(cfg, "diloco", 2, tmp_path, attack="flood")


def test_stats_record_the_headroom_of_a_clean_group():
    parts = [_flat(v) for v in _senders(4, spread=0.1)]
    stats = AggregateStats()
    got = aggregate(parts, [1.0] * 4, "median_filter", 2.0, stats)
    assert torch.equal(got, aggregate(parts, [1.0] * 4, "mean", 2.0))  # nobody over the bound: the mean itself
    assert 1.0 <= stats.max_ratio < 1.2 and stats.excluded_outlier == 0
    with pytest.raises(ConfigError, match=">= 1 for median_filter"):
        load_config("configs/tiny.yaml", ["swarm.aggregation=median_filter", "swarm.aggregation_clip=0.5"])


@pytest.mark.parametrize("rule", ["median_filter", "median_clip"])
def test_senders_of_unequal_tokens_are_bounded_per_token_so_the_longer_delta_of_more_steps_counts(rule):
    """Time-budgeted rounds: a fast peer trained 6x the tokens of a slow one and its Δ is 4x longer. Bounded by the
    plain norms, the pair's lower median (the slow one's) would drop or shrink the fast one; per token both are in."""
    direction = torch.linspace(-1.0, 1.0, 64)
    slow, fast = direction.clone(), 4.0 * direction + 0.01
    got = aggregate([slow, fast], [1.0, 6.0], rule, 2.0)
    assert torch.allclose(got, (slow + 6.0 * fast) / 7.0, atol=1e-6)
    # a sender far over its share stays bounded: 50x the Δ for 6x the tokens counts at most clip x 6 = 12x (per
    # token: clip x the median of 1 and 50 / 6), dropped (median_filter) or scaled down to it (median_clip)
    stats = AggregateStats()
    hostile = aggregate([slow, 50.0 * direction], [1.0, 6.0], rule, 2.0, stats)
    assert float(hostile.norm()) <= (1.0 + 6.0 * 12.0) / 7.0 * float(direction.norm()) * (1 + 1e-6)
    assert stats.excluded_outlier or stats.clipped


@pytest.mark.parametrize("rule", ["mean", *ROBUST])
def test_a_delayed_delta_counts_at_its_factor_and_is_bounded_per_declared_token(rule):
    """A straggler's Δ (factor 1/3: two rounds stale at staleness_decay 1) counts a third of its tokens in the mean,
    but is judged against the others per declared token: with its weight cut to a third first, its norm per unit
    weight would be 3x the median and median_filter (clip 2) would drop it."""
    direction = torch.linspace(-1.0, 1.0, 64)
    parts = [direction.clone(), 1.02 * direction, 0.98 * direction + 0.01]
    got = aggregate(parts, [100.0, 100.0, 100.0], rule, 2.0, factors=[1.0, 1.0, 1 / 3])
    expected = (parts[0] + parts[1] + parts[2] / 3) / (2 + 1 / 3)
    assert torch.allclose(got, expected, atol=1e-6)
    plain = aggregate(parts, [100.0, 100.0, 100.0], rule, 2.0)
    assert torch.equal(aggregate(parts, [100.0] * 3, rule, 2.0, factors=[1.0] * 3), plain)  # factors 1: bitwise
    with pytest.raises(ValueError, match="factor"):
        aggregate(parts, [100.0] * 3, rule, 2.0, factors=[1.0, 0.0, 1.0])


@pytest.mark.parametrize("rule", RULES)
def test_a_round_of_several_groups_gives_every_senders_weighted_mean(rule):
    """Groups' means combined by the weight each counted equal the one-group result (similar senders of similar
    weights, inside every bound, so every rule is the weighted mean); to fp32 rounding: the sums run in another
    order."""
    senders = _senders(7, spread=0.05)
    # robust rules bound unequal senders per token, which can drop a light sender in one grouping and not another
    weights = [1.0, 2.0, 3.0, 1.0, 5.0, 2.0, 4.0] if rule == "mean" else [1.0] * 7
    flat = aggregate_flat(senders, weights, rule, 2.0, 6)
    groups = [[0, 3, 6], [1, 4], [2, 5]]
    grouped = aggregate_flat(senders, weights, rule, 2.0, 6, groups=groups)
    tolerance = 1e-6 if rule != "centered_clip" else 0.05  # CenteredClip moves v0 by the group's own median
    for a, b in zip(flat, grouped, strict=True):
        assert torch.allclose(a, b, atol=tolerance, rtol=0), float((a - b).abs().max())


def test_median_filter_counts_only_the_weight_of_the_senders_it_kept():
    parts = [torch.ones(4), torch.ones(4) * 1.1, torch.ones(4) * 50.0]
    mean, counted = aggregate_counted(parts, [2.0, 3.0, 4.0], "median_filter", 2.0)
    assert counted == 5.0 and torch.allclose(mean, torch.full((4,), (2 * 1 + 3 * 1.1) / 5))
    assert aggregate_counted(parts, [0.0, 0.0, 0.0], "mean", 2.0)[1] == 0.0


def test_combining_groups_drops_a_group_mean_far_longer_than_the_others():
    """A group's reducer that lies about its mean (here 100x) counts 0 under a robust rule; mean trusts it."""
    honest = [torch.ones(8), torch.ones(8) * 1.2, torch.ones(8) * 0.9]
    liar = torch.ones(8) * 100.0
    means, weights = [*honest, liar], [1.0, 1.0, 1.0, 1.0]
    robust = combine_groups(means, weights, "median_filter", 2.0)
    assert torch.allclose(robust, torch.full((8,), (1 + 1.2 + 0.9) / 3))
    assert float(combine_groups(means, weights, "mean", 2.0).mean()) > 20
    assert torch.equal(combine_groups([torch.ones(3)], [0.0], "mean", 2.0), torch.zeros(3))  # nothing counted
    one = torch.randn(5)
    assert torch.equal(combine_groups([one], [3.0], "median_filter", 2.0), one)  # one group: its mean, bitwise


@pytest.mark.parametrize("rule", ROBUST)
def test_a_sign_flipped_sender_of_honest_size_counts_zero_by_direction_alone(rule):
    """-Δ has exactly an honest norm, so no norm bound sees it; its cosine to the senders' median is negative and
    the direction floor drops it: the result is the rule over the three honest senders, bitwise."""
    honest = [_flat(v) for v in _senders(4, spread=1.0)]  # noise as large as the shared direction
    parts = [-honest[0], *honest[1:]]
    cosines = cosines_to_median(parts)
    assert cosines[0] < 0 < min(cosines[1:])
    stats = AggregateStats()
    got = aggregate(parts, [1.0] * 4, rule, 2.0, stats, min_cosine=0.0)
    assert torch.equal(got, aggregate(honest[1:], [1.0] * 3, rule, 2.0))
    assert stats.excluded_direction == 1 and stats.min_cosine_kept == min(cosines[1:])
    judged: dict = {}  # by index in the call's parts: a sender of weight 0 is not judged
    aggregate_counted([honest[0], *parts], [0.0] + [1.0] * 4, rule, 2.0, None, None, 0.0, judged)
    assert {k: j.cosine for k, j in judged.items()} == {k + 1: c for k, c in enumerate(cosines)}
    without = aggregate(parts, [1.0] * 4, rule, 2.0)  # off (-1): the flipped sender pulls the result back
    honest_mean = sum(honest[1:]) / 3
    assert float((without - honest_mean).norm()) > 10 * float((got - honest_mean).norm())


def test_the_direction_floor_keeps_an_honest_group_and_judges_only_three_or_more_senders():
    honest = [_flat(v) for v in _senders(4, spread=1.0)]
    stats = AggregateStats()
    assert torch.equal(
        aggregate(honest, [1.0] * 4, "median_filter", 2.0, stats, min_cosine=0.0),
        aggregate(honest, [1.0] * 4, "mean", 2.0),
    )
    assert stats.excluded_direction == 0 and 0 < stats.min_cosine_kept < 1
    pair = [honest[0], -honest[0]]  # two senders: the median is their midpoint, neither is judged
    assert torch.equal(
        aggregate(pair, [1.0, 1.0], "median_filter", 2.0, stats, min_cosine=0.9),
        aggregate(pair, [1.0, 1.0], "mean", 2.0),
    )
    flipped = [-honest[0], *honest[1:]]  # the mean rule trusts everyone: no floor
    assert torch.equal(
        aggregate(flipped, [1.0] * 4, "mean", 2.0, min_cosine=0.0), aggregate(flipped, [1.0] * 4, "mean", 2.0)
    )
    zeros, ones = torch.zeros(5), torch.ones(5)
    assert cosines_to_median([zeros, ones, ones]) == pytest.approx([-1.0, 1.0, 1.0])  # zeros: no direction
    assert cosines_to_median([zeros, zeros, ones]) == [0.0, 0.0, 0.0]  # a median of norm 0 judges nobody
    free_rider = [torch.zeros_like(honest[0]), *honest[1:]]
    stats = AggregateStats()
    got = aggregate(free_rider, [1.0] * 4, "median_filter", 2.0, stats, min_cosine=0.0)
    assert torch.equal(got, aggregate(honest[1:], [1.0] * 3, "mean", 2.0)) and stats.excluded_direction == 1
    with pytest.raises(ValueError, match="min_cosine"):
        aggregate(honest, [1.0] * 4, "median_filter", 2.0, min_cosine=1.5)
    with pytest.raises(ConfigError, match=r"swarm.min_cosine.*\[-1, 1\]"):
        load_config("configs/tiny.yaml", ["swarm.min_cosine=-2"])


@pytest.mark.parametrize("rule", ROBUST)
def test_an_alie_sender_sits_below_the_median_and_the_skew_bound_drops_it(rule):
    """ALIE (μ − σ of the honest senders, coordinate by coordinate) points with the swarm (cosine > 0: the floor keeps
    it) but lies below the median almost everywhere; |skew| > max_skew counts it 0: the rule over the honest three,
    bitwise. Honest senders stay near 0 skew. Off (1): kept."""
    honest = [_flat(v) for v in _senders(3, shapes=[(40, 10)], spread=1.0)]
    stacked = torch.stack(honest)
    alie = stacked.mean(dim=0) - stacked.std(dim=0)
    parts = [alie, *honest]
    verdicts = judge_against_median(parts)
    assert verdicts[0].cosine > 0 and verdicts[0].skew < -0.8
    stats = AggregateStats()
    got = aggregate(parts, [1.0] * 4, rule, 2.0, stats, min_cosine=0.0, max_skew=0.5)
    assert torch.equal(got, aggregate(honest, [1.0] * 3, rule, 2.0))
    assert stats.excluded_skew == 1 and stats.excluded_direction == 0
    assert stats.max_skew_kept == max(abs(j.skew) for j in verdicts[1:]) < 0.5
    kept = AggregateStats()
    assert not torch.equal(aggregate(parts, [1.0] * 4, rule, 2.0, kept, min_cosine=0.0), got)  # off: it counts
    assert kept.excluded_skew == 0 and kept.max_skew_kept > 0.8


@pytest.mark.parametrize("rule", ROBUST)
def test_one_alie_sender_of_three_is_dropped_and_the_honest_two_it_pushes_above_the_median_are_not(rule):
    """With 3 senders the median is one of them at every coordinate: an ALIE sender below it everywhere leaves the two
    honest ones above it at every untied value (raw skew +1 each). Relative to the senders' median skew (+1) the
    honest ones are at 0 and ALIE at -2: it alone counts 0."""
    honest = [_flat(v) for v in _senders(2, shapes=[(100, 10)], spread=1.0)]
    stacked = torch.stack(honest)
    alie = stacked.mean(dim=0) - stacked.std(dim=0) - stacked.std(dim=0).max()  # below both, everywhere
    verdicts = judge_against_median([*honest, alie])
    assert [j.skew for j in verdicts] == [0.0, 0.0, -2.0]
    stats = AggregateStats()
    got = aggregate([*honest, alie], [1.0] * 3, rule, 2.0, stats, min_cosine=-1.0, max_skew=0.5)
    assert torch.equal(got, aggregate(honest, [1.0] * 2, rule, 2.0)) and stats.excluded_skew == 1


def test_the_skew_needs_enough_values_on_each_side_and_a_longer_honest_delta_or_a_balanced_shift_pass_it():
    """Fewer than SKEW_MIN_VALUES untied values where the median is positive or where it is negative: skew 0 (a part
    of one sign cannot tell a shift from a longer Δ). A sender longer than the others everywhere is above the median
    where it is positive and below where it is negative: skew 0. ALIE's shift with a ±1 pattern (alie-balanced) lies
    on both sides of the median: the bound does not see it (its known limit)."""
    signs = torch.tensor([1.0, -1.0]).repeat(SKEW_MIN_VALUES)  # half positive, half negative
    lengths = [signs * v for v in (1, 2, 3)]
    assert [j.skew for j in judge_against_median(lengths)] == [0.0, 0.0, 0.0]
    shifted = [signs * 2 + v for v in (-0.5, 0.0, 0.5)]  # raw -1, none (the median itself: all ties), +1
    assert [j.skew for j in judge_against_median(shifted)] == [0.0, 0.0, 0.0]  # 2 raw skews: no median skew to judge by
    four = [signs * 2 + v for v in (-0.5, 0.1, 0.2, 0.3)]  # raw -1, -1, +1, +1: median 0
    assert [j.skew for j in judge_against_median(four)] == [-1.0, -1.0, 1.0, 1.0]
    one_sign = [torch.full((4 * SKEW_MIN_VALUES,), v) for v in (1.0, 2.0, 3.0)]
    assert [j.skew for j in judge_against_median(one_sign)] == [0.0, 0.0, 0.0]
    few = [signs[: SKEW_MIN_VALUES + 2] * 2 + v for v in (-0.5, 0.0, 0.5)]  # 33 values on each side
    assert [j.skew for j in judge_against_median(few)] == [0.0, 0.0, 0.0]
    honest = [_flat(v) for v in _senders(3, shapes=[(40, 10)], spread=1.0)]
    stacked = torch.stack(honest)
    pattern = torch.randint(0, 2, stacked.shape[1:], generator=torch.Generator().manual_seed(0)) * 2 - 1
    balanced = stacked.mean(dim=0) - stacked.std(dim=0) * pattern
    assert abs(judge_against_median([balanced, *honest])[0].skew) < 0.5
    with pytest.raises(ValueError, match="max_skew"):
        aggregate(honest, [1.0] * 3, "median_filter", 2.0, max_skew=1.5)
    with pytest.raises(ConfigError, match=r"swarm.max_skew.*\[0, 1\]"):
        load_config("configs/tiny.yaml", ["swarm.max_skew=-0.1"])


def test_a_sender_on_one_side_of_the_median_where_it_is_negative_only_is_honest_a_shift_on_both_sides_is_not():
    """Sparse gradients (the scale harness's micro model, embedding rows most peers' batches miss): honest senders
    had side skews like +0.17 where the median is positive and +0.97 where it is negative; their mean (0.57) was
    over the bound. Only a sender off to one side on both sides is shifted; one side alone skews 0."""
    signs = torch.tensor([1.0, -1.0]).repeat(4 * SKEW_MIN_VALUES)
    gen = torch.Generator().manual_seed(0)
    honest = [signs * 2 + 0.1 * torch.randn(signs.shape, generator=gen) for _ in range(6)]
    shorter_where_negative = honest[0].clone()
    shorter_where_negative[signs < 0] = -1.5  # above the others' -2 ± 0.1 everywhere there, as before elsewhere
    verdicts = judge_against_median([shorter_where_negative, *honest[1:]])
    assert abs(verdicts[0].skew) < 0.25
    stats = AggregateStats()
    aggregate([shorter_where_negative, *honest[1:]], [1.0] * 6, "median_filter", 2.0, stats, max_skew=0.5)
    assert stats.excluded_skew == 0
    shifted = honest[0] - 0.5  # below the others on both sides
    assert judge_against_median([shifted, *honest[1:]])[0].skew < -0.8


def test_the_simulator_runs_a_coalition_and_the_floor_drops_a_free_riders_zeros(tmp_path):
    """``--attackers 2 --attack zeros`` in a 4-worker round: each zero part is dropped by direction (3+ senders), the
    results name the attackers; an ALIE coalition's Δ lies below the median (dropped by the skew bound) yet points
    with the swarm (the floor alone keeps it); the options are checked."""
    cfg = load_config("configs/tiny.yaml", ["train.rounds=1", "inner.steps=2", "train.eval_every=0"])
    zeros = simulate(cfg, "diloco", 4, tmp_path / "zeros", attack="zeros", attackers=2)
    parts = zeros["aggregation"]["parts"]
    assert zeros["attack"]["workers"] == [0, 1] and zeros["aggregation"]["excluded_direction"] == 2 * parts
    bounded = simulate(cfg, "diloco", 4, tmp_path / "bounded", attack="alie", attack_scale=1.0)  # max_skew 0.5
    assert bounded["aggregation"]["excluded_skew"] == bounded["aggregation"]["parts"]  # every part of the attacker's
    cfg.swarm.max_skew = 1.0  # off: the floor alone keeps it (it points with the swarm)
    alie = simulate(cfg, "diloco", 4, tmp_path / "alie", attack="alie", attack_scale=1.0)
    assert alie["aggregation"]["excluded_direction"] == 0 and alie["aggregation"]["min_cosine_kept"] > 0
    assert alie["aggregation"]["excluded_skew"] == 0 and alie["aggregation"]["max_skew_kept"] > 0.8
    with pytest.raises(ConfigError, match="--attackers 4"):
        simulate(cfg, "diloco", 4, tmp_path / "all", attack="zeros", attackers=4)

"""The round agreement: what a peer tells its group about its outer state, and what it does after the all-reduce.

Words (one per thing, in code, metrics and docs):
  round       H inner steps, one all-reduce of the pseudo-gradients, one outer step. ``RoundTag.round`` and
              ``OuterState.round`` count the rounds applied to an outer state (metrics.jsonl calls it
              ``outer_step``, the field name the monitor and users read).
  outer step  the Nesterov update of the anchor that ends a round.
  step        an inner optimizer step; H of them per round.

Inputs:  this peer's :class:`RoundTag` before the round; the group's gather payloads (from the network, any
         value, or typed from the simulator); whether the all-reduce was complete; :class:`RoundRules`.
Output:  :class:`GatherPayload` and its wire form (a versioned msgpack-able dict); :class:`Gathered` (the valid
         payloads by peer id, and how many entries were dropped); :class:`Decision` (one action and its reason).
State:   none; every function here is pure and imports no network code.
Failure: nothing from the network raises: a malformed entry is dropped and counted. ``ValueError`` only for
         RoundRules that the config validation would have refused.

``decide`` is the only place that decides a round. The averager process calls it before the butterfly (to send
weight 0 when this peer's Δ will not count), the round (engine.py) after it; both see the same gathered
payloads, so every member of a group reaches the same view of who counts. Its table:

  all-reduce  this peer's tag vs the group's majority tag    action      Δ counts  afterwards
  complete    equal (or no other valid payload)              apply       yes       outer step with Δ̄
  complete    1 to max_staleness rounds behind               catch_up    yes, at   take the group's pre-round
                                                                        a stale   state, apply the same Δ̄
                                                                        weight
  complete    further behind, ahead or diverged              resync      no        discard the round, download
                                                                                  the outer state
  complete    no majority: the most common tags tie          as incomplete: local_step or discard, and nobody's
              (unless one is the furthest round and the                   Δ counts in the group's mean
              others at most MAX_STALENESS behind it: then
              it is the majority; or all are of one round:
              then the smallest checksum is)
  incomplete  the swarm is ahead: a state that state_quorum  resync      no        not sent to any group (it would
              peers vouch for is more than max_staleness                          not count, and would split the
              rounds past ours (``ahead``, from the DHT)                          mates' group); download the state
  incomplete  alone, no group, or a failed all-reduce        local_step  own Δ     alone_policy local: outer step
                                                                                  with the own Δ, then take a
                                                                                  peer's state that got further
  incomplete  (the same)                                     discard     -         alone_policy wait
The majority tag is the one most valid payloads carry. A tie is no majority: otherwise one peer claiming a
far-ahead round would win every group of two (threat-model.md), so a tied group's mean is not applied by anyone.
Except a tie across rounds within MAX_STALENESS: that is a straggler grouped with a peer in sync (seen in a group
of two, where the tie made both take local steps and fall out of sync), so the furthest round wins and the
straggler catches up or resyncs. A liar gains nothing by it: claiming a round up to MAX_STALENESS ahead makes its
partner catch up to a state nobody else vouches for (refused: it resyncs, as after a tie), and one behind makes its
Δ count at a stale weight at most, less than claiming the partner's own tag (which it can read in the DHT) would.

A delayed Δ (a straggler's, trained from an outer state ``s`` rounds older than the group's: ``staleness``) counts
in the group's mean with ``RoundRules.stale_weight(s)`` = (1 + s) ** -staleness_decay times its tokens (1 for an
in-sync member); every reducer computes the same factor from the same gathered tags. The defaults and the
measurement that chose them: docs/stragglers.md.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Action",
    "Decision",
    "GATHER_VERSION",
    "GatherPayload",
    "Gathered",
    "MAX_STALENESS",
    "RoundRules",
    "RoundTag",
    "decide",
    "majority_tag",
    "split_groups",
]

GATHER_VERSION = 2  # bump when GatherPayload's wire form changes (peers of another version never vote alike)
_MAX_COUNT = 2**53  # rounds and tokens beyond this are not plausible (and not exact as floats)
_MAX_CHECKSUM_CHARS = 64
MAX_STALENESS = 8  # swarm.max_staleness at most: a peer catches up to a state its group vouches for (8 recent tags)
_ALONE_POLICIES = ("local", "wait")


@dataclass(frozen=True, order=True)
class RoundTag:
    """Which outer state a peer holds: rounds applied to it and its checksum (``OuterState.checksum``)."""

    round: int
    checksum: str

    def __str__(self) -> str:
        return f"round {self.round} ({self.checksum})"


@dataclass(frozen=True)
class GatherPayload:
    """What each member sends its group with its Δ: the tag of its outer state before the round, and the tokens
    its Δ was trained on (its weight)."""

    tag: RoundTag
    tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"v": GATHER_VERSION, "round": self.tag.round, "checksum": self.tag.checksum, "tokens": self.tokens}

    def signed_bytes(self, prefix: str, peer_id: str) -> bytes:
        """What the author signs (swarm/reduce.py; checked in swarm/aggregate.py): the payload, bound to its author
        and to the run's averaging prefix, so a leader can neither forge a member's payload nor move one to another
        member or run."""
        return f"gather/{GATHER_VERSION}/{prefix}/{peer_id}/{self.tag.round}/{self.tag.checksum}/{self.tokens}".encode()

    @classmethod
    def from_wire(cls, raw: Any) -> GatherPayload | None:
        """The payload, or None when ``raw`` is not one of this version (wrong type, keys, bounds)."""
        if not isinstance(raw, dict) or set(raw) != {"v", "round", "checksum", "tokens"} or raw["v"] != GATHER_VERSION:
            return None
        rnd, checksum, tokens = raw["round"], raw["checksum"], raw["tokens"]
        if not (_count(rnd) and _count(tokens) and isinstance(checksum, str)):
            return None
        if not 0 < len(checksum) <= _MAX_CHECKSUM_CHARS:
            return None
        return cls(RoundTag(rnd, checksum), tokens)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT


@dataclass(frozen=True)
class Gathered:
    """The group's valid payloads by peer id (this peer's included), and how many entries were dropped."""

    payloads: Mapping[str, GatherPayload] = field(default_factory=dict)
    malformed: int = 0

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> Gathered:
        """From ``{peer id: wire payload}`` as decoded off the network; anything unusable is dropped and counted.

        A value that is already a :class:`GatherPayload` (the simulator's) is taken as it is.
        """
        payloads: dict[str, GatherPayload] = {}
        malformed = 0
        for peer, value in raw.items():
            payload = value if isinstance(value, GatherPayload) else GatherPayload.from_wire(value)
            if payload is None or not isinstance(peer, str):
                malformed += 1
            else:
                payloads[peer] = payload
        return cls(payloads, malformed)

    @property
    def peers(self) -> list[str]:
        return sorted(self.payloads)


@dataclass(frozen=True)
class RoundRules:
    """The config values ``decide`` reads (``swarm.max_staleness``, ``swarm.staleness_decay``,
    ``swarm.alone_policy``)."""

    max_staleness: int = 0
    alone_policy: str = "local"
    staleness_decay: float = 1.0

    def __post_init__(self) -> None:
        if not (_count(self.max_staleness) and self.max_staleness <= MAX_STALENESS):
            raise ValueError(f"max_staleness={self.max_staleness!r} must be an int in [0, {MAX_STALENESS}]")
        if not (isinstance(self.staleness_decay, int | float) and 0 <= self.staleness_decay <= 8):
            raise ValueError(f"staleness_decay={self.staleness_decay!r} must be a number in [0, 8]")
        if self.alone_policy not in _ALONE_POLICIES:
            raise ValueError(f"alone_policy={self.alone_policy!r} must be one of {', '.join(_ALONE_POLICIES)}")

    @classmethod
    def from_config(cls, swarm: Any) -> RoundRules:
        """From a SwarmConfig (or anything with the same three fields)."""
        return cls(
            max_staleness=swarm.max_staleness,
            alone_policy=swarm.alone_policy,
            staleness_decay=swarm.staleness_decay,
        )

    def stale_weight(self, staleness: int) -> float:
        """The factor a Δ trained ``staleness`` rounds behind the group counts with (1.0 in sync; module doc)."""
        return 1.0 if staleness <= 0 else (1.0 + staleness) ** -float(self.staleness_decay)

    def weight_factors(self, gathered: Gathered) -> dict[str, float]:
        """{peer id: its weight factor} for the members whose Δ counts in the group's mean (``decide``), the same
        on every member of the group; the others are absent (weight 0)."""
        top = majority_tag(gathered) if gathered.payloads else None
        out = {}
        for peer, payload in gathered.payloads.items():
            if decide(payload.tag, gathered, True, self).counts and top is not None:
                out[peer] = self.stale_weight(top.round - payload.tag.round)
        return out


class Action(str, enum.Enum):
    APPLY = "apply"
    CATCH_UP = "catch_up"
    RESYNC = "resync"
    LOCAL_STEP = "local_step"
    DISCARD = "discard"


@dataclass(frozen=True)
class Decision:
    """What to do with a round. ``counts``: whether this peer's Δ is part of the group's mean; ``majority``: the
    group's tag (None when the all-reduce was incomplete); ``out_of_sync``: members whose tag is not it."""

    action: Action
    reason: str
    counts: bool
    majority: RoundTag | None = None
    out_of_sync: int = 0


def majority_tag(gathered: Gathered, within: int = MAX_STALENESS) -> RoundTag | None:
    """The tag more valid payloads carry than any other; None when there is none (no valid payload, or a tie). A
    tie between a furthest round and tags at most ``within`` rounds behind it goes to the furthest: those are
    stragglers (a group of two: one in sync, one delayed), while a far-ahead claim still wins nothing. A tie between
    tags of one round (a swarm split into two lineages, as many peers on each) goes to the smaller checksum, which
    every member picks alike: the other lineage resyncs, so a split heals in one round instead of lasting (before,
    both sides took local steps)."""
    ranked = Counter(p.tag for p in gathered.payloads.values()).most_common()
    if not ranked:
        return None
    tied = [tag for tag, n in ranked if n == ranked[0][1]]
    if len(tied) == 1:
        return tied[0]
    if len({tag.round for tag in tied}) == 1:  # two lineages of one round, as many on each: the smaller checksum
        return min(tied, key=lambda tag: tag.checksum)
    furthest = max(tied, key=lambda tag: tag.round)
    behind = [furthest.round - tag.round for tag in tied if tag != furthest]
    return furthest if all(0 < b <= within for b in behind) else None


def _alone(why: str, rules: RoundRules, counts: bool) -> Decision:
    """No group result to use: what ``alone_policy`` says."""
    if rules.alone_policy == "wait":
        return Decision(Action.DISCARD, f"{why}; alone_policy=wait discards the round", False)
    return Decision(Action.LOCAL_STEP, f"{why}; taking a local outer step with the own Δ", counts)


def decide(
    mine: RoundTag, gathered: Gathered, complete: bool, rules: RoundRules, ahead: RoundTag | None = None
) -> Decision:
    """The one decision of a round for the peer holding ``mine``; see the module docstring for the table.
    ``ahead``: the swarm's state, when the reduce found it more than ``max_staleness`` rounds past ``mine`` and
    so looked for no group (swarm/matchmaking.py)."""
    dropped = f"; {gathered.malformed} malformed payload(s) dropped" if gathered.malformed else ""
    if not complete:
        if ahead is not None and ahead.round - mine.round > rules.max_staleness:
            reason = f"the swarm holds {ahead}, {ahead.round - mine.round} round(s) past this peer's ({mine}): resync"
            return Decision(Action.RESYNC, reason, False, ahead)
        return _alone("no complete all-reduce", rules, True)
    top = majority_tag(gathered) if gathered.payloads else mine
    if top is None:
        return _alone(f"the group's tags tie, so there is no majority{dropped}", rules, False)
    odd = sum(1 for p in gathered.payloads.values() if p.tag != top)
    if mine == top:
        note = f"; {odd} member(s) out of sync catch up or resync" if odd else ""
        return Decision(Action.APPLY, f"in sync with the group at {top}{note}{dropped}", True, top, odd)
    behind = top.round - mine.round
    if 0 < behind <= rules.max_staleness:
        weight = rules.stale_weight(behind)
        reason = f"{behind} round(s) behind the group ({mine} vs {top}): Δ counts x{weight:.3g}, then catch up{dropped}"
        return Decision(Action.CATCH_UP, reason, True, top, odd)
    if behind > 0:
        where = f"{behind} round(s) behind"
    elif behind < 0:
        where = f"{-behind} round(s) ahead of"
    else:
        where = "diverged from"
    reason = f"this peer's state ({mine}) is {where} the group's majority ({top}): resync{dropped}"
    return Decision(Action.RESYNC, reason, False, top, odd)


def split_groups(reducers: list[bool], width: int) -> list[list[int]]:
    """The members of one round (by index in the round's agreed order) split into groups of at most ``width`` that
    each run their own butterfly; a round of more than ``width`` members combines its groups' means part by part
    (swarm/combine.py), so every member still applies one mean. ``reducers[i]``: whether member i can reduce (client
    mode cannot). Groups are as even as can be (sizes differ by one at most), and the reducers are spread first, so
    every group holds one (with fewer reducers than ceil(n / width), there are that many groups, wider than
    ``width``). Pure and deterministic: every member computes the same groups from the same round."""
    if width < 1:
        raise ValueError(f"width={width!r} must be >= 1")
    n, nodes = len(reducers), [i for i, r in enumerate(reducers) if r]
    count = max(1, min(-(-n // width), len(nodes)))
    groups: list[list[int]] = [[] for _ in range(count)]
    order = nodes + [i for i, r in enumerate(reducers) if not r]
    for k, member in enumerate(order):
        groups[k % count].append(member)
    return [sorted(g) for g in groups]

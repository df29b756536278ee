"""A reducer's slice of the mean in one attempt: each sender's part kept, judged and reduced together (robust.py).

Inputs:  ``Aggregation``: the robust rule and clip, each sender's declared tokens (from its signed gather payload), the
         staleness factors and the direction bounds; per part, every sender's tensor and wire weight, as hivemind's
         runner hands them over (``accumulate_part``).
Output:  per part, one mean that every sender awaits (bitwise the same bytes for all), or, in a round of several
         groups, the round reducer's combination of every group's mean (combine.py's ``Combiner``); ``judged`` and
         ``pointed_away``: per sender, the parts judged against the median and those dropped (strikes.py).
State:   the current part's (tensor, trusted weight) per sender, reset after each part.
Failure: a part out of range, twice, out of order or of the wrong shape raises AllreduceException (hivemind then
         treats the sender as failed); a banned sender's part raises BannedException. A sender whose weight is not
         the one it declared counts 0 (robust.trusted_weight); one that points away from the median counts 0 and is
         named in a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from p2p_diloco.robust import Judgement, aggregate_counted, dropped, trusted_weight
from p2p_diloco.swarm.combine import Combiner

__all__ = ["Aggregation", "RobustPartReducer"]

log = logging.getLogger("p2p_diloco.butterfly")  # one logger for the all-reduce's parts (butterfly.py, combine.py)


@dataclass(frozen=True)
class Aggregation:
    """How a reducer turns the senders' parts into its slice of the mean (robust.py), and whose weight counts.

    ``declared``: per sender (``sender_peer_ids`` order), the tokens its valid gather payload declares when its Δ
    counts (protocol.decide), else None; a part counts with that many tokens only if the sender's wire weight says
    the same and it is at most ``max_tokens`` (robust.trusted_weight), else with weight 0. ``factors``: per sender,
    what its weight is multiplied by in the mean (a delayed Δ: protocol.RoundRules.weight_factors), None: all 1.
    ``min_cosine``, ``max_skew``: robust.py's direction floor (-1: off) and sign skew bound (1: off).
    """

    rule: str
    clip: float
    declared: tuple[int | None, ...]
    max_tokens: int | None = None
    factors: tuple[float, ...] | None = None
    min_cosine: float = -1.0
    max_skew: float = 1.0


class RobustPartReducer(TensorPartReducer):
    """A TensorPartReducer that keeps each sender's current part and reduces them together with robust.aggregate,
    weighting each by its trusted weight instead of the weight it put on the wire. A sender the direction floor or
    the sign skew bound drops is named in a warning (``names``: the senders' peer ids, in sender order)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        aggregation: Aggregation,
        combiner: Combiner | None = None,
        first_part: int = 0,
        names: Sequence[str] = (),
    ):
        self.aggregation, self.combiner, self.first_part = aggregation, combiner, first_part
        self.names = list(names)
        self.judged: dict[str, int] = {}  # senders whose parts were judged against the median: how many (strikes.py)
        self.pointed_away: dict[str, int] = {}  # and the parts it dropped of each, where it dropped any
        self.current_parts: dict[int, tuple[torch.Tensor, float]] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self.current_parts = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Keep this sender's part; once every sender of this part is in, all wait for the same reduced part."""
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"part {part_index} from sender {sender_index} is out of range")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException("this reducer finished before the part arrived")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned")
        if part_index != self.current_part_index or sender_index in self.current_parts:
            raise AllreduceException(f"sender {sender_index} sent part {part_index} twice or out of order")
        if tensor_part.shape != self.part_shapes[part_index]:
            raise AllreduceException(
                f"sender {sender_index} sent part {part_index} of shape {tuple(tensor_part.shape)}"
            )
        future = self.current_part_future
        declared = self.aggregation.declared[sender_index]
        trusted = 0.0 if declared is None else trusted_weight(weight, declared, self.aggregation.max_tokens)
        self.current_parts[sender_index] = (tensor_part, trusted)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        result = await future
        return await asyncio.shield(result) if isinstance(result, asyncio.Future) else result

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        senders = sorted(self.current_parts)
        parts = [self.current_parts[i][0] for i in senders]
        weights = [self.current_parts[i][1] for i in senders]
        how = self.aggregation
        factors = None if how.factors is None else [how.factors[i] for i in senders]
        judged: dict[int, Judgement] = {}
        mean, counted = aggregate_counted(
            parts, weights, how.rule, how.clip, None, factors, how.min_cosine, judged, how.max_skew
        )
        part = self.first_part + self.current_part_index
        self._judge(part, {self._name(senders[k]): j for k, j in judged.items()})
        if self.combiner is None:
            self.current_part_future.set_result(mean)
        else:  # our group's mean of this part goes to the part's round reducer: every member awaits the round's mean
            self.current_part_future.set_result(asyncio.ensure_future(self.combiner.combine(part, mean, counted)))
        self.reset_accumulators()

    def _name(self, sender: int) -> str:
        return self.names[sender] if sender < len(self.names) else f"sender {sender}"

    def _judge(self, part: int, judged: dict[str, Judgement]) -> None:
        """Keep who was judged against the median in this part and who was dropped; name the dropped in a warning (a
        rare, hostile event) with their cosine and skew."""
        for name in judged:
            self.judged[name] = self.judged.get(name, 0) + 1
        how = self.aggregation
        away = {
            name: (round(j.cosine, 3), round(j.skew, 3))
            for name, j in judged.items()
            if dropped(j, how.min_cosine, how.max_skew)
        }
        if not away:
            return
        for name in away:
            self.pointed_away[name] = self.pointed_away.get(name, 0) + 1
        log.warning(
            "part %d: %s point(s) against the other senders' median or lie on one side of it ((cosine, skew): "
            "cosine < swarm.min_cosine %g or |skew| > swarm.max_skew %g): counted 0",
            part,
            away,
            how.min_cosine,
            how.max_skew,
        )

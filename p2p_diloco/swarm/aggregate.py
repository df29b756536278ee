"""One attempt in the averager process: the group's signed payloads, this member's butterfly, its own verdict.

Inputs:  hivemind's ``GroupInfo`` of the group its matchmaking assembled (the members, their modes, and each one's
         gathered bytes: its signed GatherPayload), our shared-memory buffers (our pseudo-grads, copied in by
         reduce.py) and the step's weight; ``rules`` (protocol.RoundRules), ``aggregation``, ``aggregation_clip``,
         ``max_tokens``, ``identity``, ``group_width`` (the config's target_group_size).
Output:  ``_aggregate_with_group`` (hivemind's hook, overridden) returns the step's result to the host (reduce.py):
         ``complete`` (this member's verdict and the vote, vote.py), the members' payloads (``gathered``), the
         round's size and number of groups, when the group was assembled (``t_group``), the reason, the members
         that did not answer the vote (``silent``), the senders our reducer dropped by direction with their parts
         (``dropped``), and the bans with the seconds each has left. When complete, the
         buffers hold the round's mean.
State:   ``_banned`` (a reducer caught lying, or a sender our reducer dropped by direction in STRIKES_TO_BAN
         all-reduces in a row (``_strikes``, strikes.py), goes in for BAN_SECONDS; matchmaking.py reads it); hivemind's
         ``_running_groups`` (the runner of each group in flight: ``rpc_combine_part`` serves from it).
Failure: nothing raises out of the attempt: a payload that does not decode or is not signed by its member is
         dropped and counted (``Gathered``); a group holding an unlisted or banned peer is left before any part is
         sent (PermissionError, as the reason); any other error is the reason. The verdict is then False, and the
         vote still runs. ``rpc_combine_part`` answers what it cannot serve with an empty reply;
         ``rpc_aggregate_part`` refuses (BAD_GROUP_ID) parts of a group this member does not run within
         ``request_timeout``.

Signatures: every member's payload must carry a valid signature by the key its peer id stands for (``_opened``),
else it is dropped and counted: a leader relays the group's payloads, so it can drop one, never forge one, nor pass
one member's off as another's. A member whose Δ does not count (``protocol.decide``, before the butterfly) sends
weight 0: it serves as a reducer and contributes nothing.

Completeness (hivemind 1.1.12 returns success for a partly failed all-reduce). ``_aggregate_with_group``
(hivemind's averager.py:514) is overridden; it runs ``ExactRunner`` and then every member judges its own view:
``tensor_part_container.failed_size == 0`` (a failed reducer's slice keeps LOCAL values, partition.py:128-136)
and its own reducer got every part of every sender, nobody banned (``sender_failed_after`` all inf,
``num_parts_received`` full; a banned sender is silently left out of the rest of that slice, partition.py:248,
invisible to other members). A reducer's slice whose replies stopped short for this member only (a reset stream)
is first copied whole from a mate that got it (repair.py), so one lost reply costs no retry. The members then agree
on their verdicts (vote.py). ``ExactRunner`` (butterfly.py)
is the all-reduce of one attempt: averaged parts bitwise equal on every member, stalled senders banned, payload
bytes counted.

Groups: a round of more than ``target_group_size`` members runs as several groups (protocol.split_groups;
``_plan``), each its own butterfly, whose means each part's round reducer combines (combine.Combiner,
``rpc_combine_part``): one mean for the whole round, bitwise equal on every member of every group, and one vote over
all of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads rpc stream types by typing's _name

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter, azip, enter_asynchronously

from p2p_diloco.protocol import Gathered, GatherPayload, split_groups
from p2p_diloco.swarm.butterfly import ExactRunner
from p2p_diloco.swarm.combine import RoundGroups, part_lengths, part_owners
from p2p_diloco.swarm.identity import peer_id_of, verify
from p2p_diloco.swarm.matchmaking import BAN_SECONDS
from p2p_diloco.swarm.part_reducer import Aggregation
from p2p_diloco.swarm.strikes import STRIKES_TO_BAN
from p2p_diloco.swarm.vote import _digest
from p2p_diloco.swarm.wire import PayloadBytes

log = logging.getLogger("p2p_diloco.averager")

__all__ = ["AggregateMixin"]

REGISTER_POLL = 0.05  # seconds between looks for a group a part names that this member has not registered yet


@dataclass(frozen=True)
class _Plan:
    """One member's butterfly in a round (``PseudoGradAverager._plan``): its members and their modes, the share of
    the vector each reduces, and how the round's groups combine (None: the round is one group)."""

    members: list[Any]
    modes: list[AveragingMode]
    fractions: list[int]
    groups: RoundGroups | None


class AggregateMixin:
    """The averager process's side of one attempt, for PseudoGradAverager (averager.py); see the module docstring.
    Its ``__init__`` sets what this reads."""

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        """Run the stock butterfly, judge this member's view of it, then agree with the group (rpc_vote)."""
        t_group, gathered, reason, verdict, runner, digest = time.monotonic(), Gathered(), "", False, None, b""
        groups, dropped, repaired = 1, {}, {}
        vote = self._vote_state(group_info.group_id, group_info.peer_ids)["mine"]
        modes = [AveragingMode.NODE] * group_info.group_size
        try:
            _, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            modes = [AveragingMode(m) for m in mode_ids]
            members = zip(group_info.peer_ids, user_bytes, strict=True)
            gathered = Gathered.parse({str(p): self._opened(str(p), self._decode(b)) for p, b in members})
            strangers = [str(p) for p in group_info.peer_ids if not self.admits(p)]
            if strangers:  # never send a part to, or take one from, a peer that is not listed or was caught lying
                raise PermissionError(f"the group holds {len(strangers)} unlisted or banned peer(s)")
            factors = self.rules.weight_factors(gathered)  # the members whose Δ counts (protocol.decide)
            if str(self.peer_id) not in factors:
                kwargs["weight"] = 0.0  # out of sync with the group: serve as a reducer, contribute nothing
            plan = self._plan(group_info, modes, gathered, factors)
            members = plan.members
            senders = [str(p) for p, m in zip(members, plan.modes, strict=True) if m != AveragingMode.AUX]
            declared = tuple(gathered.payloads[p].tokens if p in factors else None for p in senders)
            stale = tuple(factors.get(p, 1.0) for p in senders)
            aggregation = Aggregation(
                self.aggregation,
                self.aggregation_clip,
                declared,
                self.max_tokens,
                stale if min(stale) < 1 else None,
                self.min_cosine,
                self.max_skew,
            )
            groups = len(plan.groups.owners) if plan.groups is not None else 1
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = ExactRunner(
                    aggregation=aggregation,
                    payload_bytes=PayloadBytes(self._payload_totals),
                    groups=plan.groups,
                    p2p=self._p2p,
                    servicer_type=type(self),
                    prefix=self.prefix,
                    tensors=local_tensors,
                    group_id=group_info.group_id,
                    ordered_peer_ids=members,
                    peer_fractions=plan.fractions,
                    modes=plan.modes,
                    **kwargs,
                )
                self._running_groups[group_info.group_id].set_result(runner)
                async for tensor, averaged in azip(as_aiter(*local_tensors), runner):
                    tensor.copy_(averaged)
                if runner.failed_values and not runner.lying_reducers:  # a reply cut short: a mate may hold it
                    repaired = await self._repair_slices(runner, list(local_tensors), self.request_timeout_s)
                digest = _digest(local_tensors)
            container, reducer = runner.tensor_part_container, runner.tensor_part_reducer
            dropped = dict(reducer.pointed_away)
            for peer in self._strikes.record(reducer.judged, dropped):
                self._banned[peer] = time.monotonic() + BAN_SECONDS
                log.warning(
                    "banned %s for %.0fs: its parts pointed against the others' in %d all-reduces in a row",
                    peer,
                    BAN_SECONDS,
                    STRIKES_TO_BAN,
                )
            if runner.lying_reducers:
                liars = sorted(str(p) for p in runner.lying_reducers)
                for liar in liars:
                    self._banned[liar] = time.monotonic() + BAN_SECONDS
                reason = f"reducer(s) {', '.join(p[-6:] for p in liars)} returned an average too long to be one: banned"
            elif container.failed_size > sum(repaired.values()):
                why = "; ".join(
                    f"{peer[-6:]}: {text}" for peer, text in runner.failed_reducers.items() if peer not in repaired
                )
                reason = f"{container.failed_size} of {container.total_size} values lost their reducer ({why})"
            elif runner.banned_senders or any(math.isfinite(x) for x in reducer.sender_failed_after):
                reason = "this peer's reducer dropped a sender mid-round"
            elif any(n != reducer.num_parts for n in reducer.num_parts_received):
                reason = f"this peer's reducer got {reducer.num_parts_received} of {reducer.num_parts} parts"
            else:
                verdict = True
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            if not vote.done():
                vote.set_result((verdict, digest))
        deadline = t_group + self.allreduce_timeout - 1.0
        against, silent = await self._collect_votes(group_info, modes, verdict, digest, deadline)
        return dict(
            complete=verdict and not against,
            gathered=gathered,
            group_size=group_info.group_size,
            groups=groups,
            t_group=t_group,
            reason=reason or "members without a complete result: " + ", ".join(against),
            silent=silent,  # members that did not answer the vote: dead or cut off (reduce.py: suspects)
            repaired=len(repaired),  # reducers' slices copied from a mate (repair.py)
            dropped=dropped,  # sender -> parts our reducer dropped for pointing against the others (robust.py)
            # the host's copy of the bans (it is another process): seconds each has left
            banned={p: until - time.monotonic() for p, until in self._banned.items()},
        )

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's (averager.py:581), but a part for a group this member does not run is refused (BAD_GROUP_ID)
        once ``_running_group`` gives up on it. Stock waits for the next group this member registers (the leader may
        begin before its BEGIN_ALLREDUCE reached us): a member whose matchmaking gave up on the group its leader then
        assembled with it (a group formed on one side only) registers none until its next attempt, so every
        sender's reducer waited ``next_chunk_timeout`` for it and the attempt failed for all, late (seen: both peers
        of a 2-peer run lost the round). Refused, the senders end the attempt at once (butterfly.py) and retry."""
        request = await anext(stream)
        future = await self._running_group(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _running_group(self, group_id: bytes) -> asyncio.Future | None:
        """The runner future of ``group_id`` once this member registers that group; None when it will not. A mate's
        part or a group's mean can come before this member took in its own BEGIN_ALLREDUCE (the leader and faster
        mates begin first): it is waited for up to ``request_timeout``, and longer, up to ``next_chunk_timeout``,
        while the group is forming here (``_forming``). Refusing after ``request_timeout`` alone cost 64 peers (32 a
        process on 2 cores, the scale harness) rounds 2 to 4 in a row: followers busy for over 5 s before
        registering were refused by their mates, who banned them as senders and failed the attempt. A member whose
        matchmaking gave up on the group (a group formed on its leader's side only) is in no group: refused after
        ``request_timeout``, as before."""
        start = time.monotonic()
        while group_id not in self._running_groups:
            waited = time.monotonic() - start
            if waited >= self.request_timeout_s and (not self._forming(group_id) or waited >= self._chunk_timeout):
                return None
            await asyncio.sleep(REGISTER_POLL)
        return self._running_groups[group_id]

    @property
    def _chunk_timeout(self) -> float:
        return self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout_s

    def _forming(self, group_id: bytes) -> bool:
        """Whether this member is about to register ``group_id``: hivemind's matchmaking here was accepted by a leader
        or leads followers (the group has not begun here yet), or just returned that group (matchmaking.py's
        ``_assembled``: between look_for_group's return and the step's registration)."""
        try:
            matchmaking = self._matchmaking
        except AttributeError:  # not built yet
            return False
        forming = matchmaking.was_accepted_to_group.is_set() or bool(matchmaking.current_followers)
        return group_id in self._assembled or (matchmaking.is_looking_for_group and forming)

    def _plan(
        self, group_info: GroupInfo, modes: list[AveragingMode], gathered: Gathered, factors: dict[str, float]
    ) -> _Plan:
        """This member's butterfly in the round: the whole round when it fits in one group (``group_width``: the
        config's target_group_size), else its group of the round (protocol.split_groups) and how the groups' means
        are combined part by part (combine.RoundGroups). The vector is shared evenly among a group's reducers
        (client-mode members reduce nothing), which every member computes alike: declared bandwidths are not used."""
        peers = list(group_info.peer_ids)
        reducers = [m != AveragingMode.CLIENT for m in modes]

        def fractions(members: Sequence[int]) -> list[int]:
            return list(hagenbach_bishoff(self.total_size, [1.0 if reducers[i] else 0.0 for i in members]))

        split = split_groups(reducers, self.group_width)
        if len(split) == 1:
            return _Plan(peers, modes, fractions(range(len(peers))), None)
        me = peers.index(self.peer_id)
        index = next(k for k, members in enumerate(split) if me in members)
        lengths = part_lengths(self.shapes, int(self.allreduce_kwargs["part_size_bytes"] / 4))
        owners = [[peers[members[i]] for i in part_owners(lengths, fractions(members))] for members in split]
        caps = [
            sum(gathered.payloads[p].tokens * factors[p] for p in (str(peers[i]) for i in members) if p in factors)
            for members in split
        ]

        async def call(peer: Any, request: Any) -> Any:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            return await stub.rpc_combine_part(request, timeout=self.allreduce_kwargs["reducer_timeout"])

        timeout = self.allreduce_kwargs["reducer_timeout"]
        groups = RoundGroups(index, owners, lengths, caps, call, timeout)
        mine = split[index]
        return _Plan([peers[i] for i in mine], [modes[i] for i in mine], fractions(mine), groups)

    async def rpc_combine_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Another group's mean of a part this peer is the round reducer of -> the round's mean of it, once every
        group's came (combine.Combiner); an empty reply for a round we are not running, or from a peer not
        admitted."""
        refused = averaging_pb2.DownloadData()
        try:
            group_id = self.serializer.loads(request.metadata)["group_id"] if len(request.metadata) <= 256 else None
        except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
            group_id = None
        if not isinstance(group_id, bytes) or not self.admits(context.remote_id):
            return refused
        future = await self._running_group(group_id)  # the caller's group may have begun a moment before ours
        if future is None:
            return refused
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            return refused
        if getattr(runner, "combiner", None) is None:
            return refused
        return await runner.combiner.serve(context.remote_id, request)

    def _decode(self, user_bytes: Any) -> Any:
        """One member's gather payload off the wire, or None when it does not decode (then dropped, counted)."""
        try:
            return self.serializer.loads(user_bytes)
        except Exception:  # noqa: BLE001 - whatever a member sent, it must not break the round
            return None

    def _opened(self, peer_id: str, raw: Any) -> Any:
        """A member's wire payload without its signature when its author signed it, else None (then dropped and
        counted). The signing key must be the one the member's peer id stands for: a leader that relays the
        group's payloads cannot forge one, nor pass one member's off as another's."""
        if self.identity is None:
            return raw
        if not isinstance(raw, dict) or not isinstance(raw.get("key"), bytes) or not isinstance(raw.get("sig"), bytes):
            return None
        wire = {k: v for k, v in raw.items() if k not in ("key", "sig")}
        payload = GatherPayload.from_wire(wire)
        if payload is None or peer_id_of(raw["key"]) != peer_id:
            return None
        return wire if verify(raw["key"], payload.signed_bytes(self.prefix, peer_id), raw["sig"]) else None

"""The completeness vote: every member's verdict on an attempt, agreed across the whole round.

Inputs:  this member's verdict on the attempt and the digest of its averaged vector (aggregate.py), the members and
         their modes, a deadline (the group's start plus ``allreduce_timeout``, less 1 s); the verdicts other
         members push to us (``rpc_vote``).
Output:  ``_collect_votes``: the members that did not confirm a complete result with our digest (empty: agreed),
         and those of them that did not answer at all (reduce.py makes them suspects, readiness.py).
         ``rpc_vote`` answers its caller with this node's group view.
State:   ``_votes`` (averager process): per group id, for the 16 most recent groups, our verdict, our group view (a
         node's), the verdicts heard, a change event, and the members once known.
Failure: nothing raises: a member that is dead, silent until the deadline, or sends what does not parse counts as
         a "no". A vote for a group that this peer neither runs nor recently voted in, or from a peer that is not
         one of its members (once they are known), is answered False and not kept.

Every member pushes its verdict by the unary RPC ``rpc_vote`` to every member that accepts calls (all of them,
unless some run in client mode: below), which answers with its own: the attempt is complete only if every member's
verdict is True; a member that is dead or silent until ``allreduce_timeout`` counts as False. Residual risk: a
member dying inside the vote (about 10 ms) after answering some peers only; the per-round checksum comparison of
outer states is the backstop.

Client mode (averager.py): a client's vote goes to the group's nodes only, and each node answers with its group
view: its own verdict combined with every client's (``_collect_votes``), so two clients that cannot reach each
other still agree. A client thus trusts the nodes' views for the other clients' verdicts: in a group whose only
node is hostile, that node could tell one client "all complete" while another client's result differed (the
per-round checksum comparison of outer states is the backstop).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

__all__ = ["VoteMixin"]


def _digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """blake2b over the bytes of the averaged vector (16 bytes): equal on two members iff their results are."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().numpy())
    return h.digest()


def _vote_message(group_id: bytes, verdict: bool, digest: bytes) -> averaging_pb2.AveragingData:
    """A verdict on the wire: ``weight`` 1.0 / 0.0, the digest as a uint8 tensor part."""
    part = serialize_torch_tensor(torch.tensor(list(digest), dtype=torch.uint8))
    return averaging_pb2.AveragingData(group_id=group_id, weight=float(verdict), tensor_part=part)


def _read_vote(message: Any) -> tuple[bool, bytes]:
    """(verdict, digest) of a vote message; (False, b"") for anything that does not parse."""
    try:
        digest = bytes(deserialize_torch_tensor(message.tensor_part).to(torch.uint8).tolist())
        return message.weight == 1.0, digest
    except Exception:  # noqa: BLE001 - a member's garbage is a "no", never an error in our round
        return False, b""


class VoteMixin:
    """The vote of PseudoGradAverager (averager.py), run in its averager process; see the module docstring. Its
    ``__init__`` sets what this reads."""

    def _vote_state(self, group_id: bytes, members: Sequence[Any] | None = None) -> dict[str, Any]:
        """Per group: this peer's verdict and, on a node, its group view (futures of (complete, digest); see
        ``_collect_votes``), verdicts pushed to us by others, a change event, and the members (once known)."""
        if group_id not in self._votes:
            loop = asyncio.get_event_loop()
            self._votes[group_id] = dict(
                mine=loop.create_future(), view=loop.create_future(), heard={}, changed=asyncio.Event(), members=None
            )
            if len(self._votes) > 16:  # keep the verdicts of recent groups only
                self._votes.popitem(last=False)
        state = self._votes[group_id]
        if members is not None:
            state["members"] = {str(p) for p in members}
        return state

    async def _collect_votes(
        self, group_info: GroupInfo, modes: list[AveragingMode], verdict: bool, digest: bytes, deadline: float
    ) -> tuple[list[str], list[str]]:
        """Exchange verdicts; return (the members that did not confirm a complete result, each with why: empty when
        agreed; the peer ids of those that did not answer at all: dead, or cut off).

        A verdict is (complete?, digest of the member's averaged vector): a member counts as confirming only with
        a True verdict and the same digest as ours, so a reducer that sent different members different results
        fails the attempt. Client-mode members (behind NAT) accept no calls, and two of them cannot reach each
        other, so the verdicts travel through the members that accept calls ("nodes"; a group always holds one,
        its leader): every member pushes its verdict to every node (``rpc_vote``), and a node answers with its
        GROUP VIEW: True only if its own verdict is and every client member pushed True with the node's digest
        (it waits for them until ``deadline``, unless its own verdict is False: then the view is False at once; the
        view is fixed once, so every caller gets the same answer). A
        node confirms the attempt when every other node's view and every client's push agree with it; a client
        when every node's view does (which covers the other clients).
        """
        state = self._vote_state(group_info.group_id, group_info.peer_ids)
        request = _vote_message(group_info.group_id, verdict, digest)
        others = [(p, m) for p, m in zip(group_info.peer_ids, modes, strict=True) if p != self.peer_id]
        callable_peers = [p for p, m in others if m != AveragingMode.CLIENT]
        clients = [str(p) for p, m in others if m == AveragingMode.CLIENT]

        async def ask(peer: Any) -> bool:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            timeout = max(0.5, deadline - time.monotonic())
            return _read_vote(await stub.rpc_vote(request, timeout=timeout)) == (True, digest)

        asks = asyncio.gather(*map(ask, callable_peers), return_exceptions=True)
        against: list[str] = []
        if self.mode != AveragingMode.CLIENT:  # a node: hear every client, then fix the view it answers with
            # (our own "no" makes the view "no" whatever the clients say: then it is fixed at once. A client that
            # never sent its parts, gone from the group, had every node wait for its vote until the deadline)
            while verdict and not all(c in state["heard"] for c in clients) and time.monotonic() < deadline:
                state["changed"].clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(state["changed"].wait(), timeout=deadline - time.monotonic())
            heard = dict(state["heard"])
            against += [f"{p[-6:]}(no)" for p in clients if p in heard and heard[p] != (True, digest)]
            unheard = [p for p in clients if p not in heard] if verdict else []  # silent: only when waited for
            against += [f"{p[-6:]}(silent)" for p in unheard]
            if not state["view"].done():
                state["view"].set_result((verdict and not against, digest))
        answers = await asks
        against = [
            f"{str(p)[-6:]}({'no' if a is False else type(a).__name__})"
            for p, a in zip(callable_peers, answers, strict=True)
            if a is not True
        ] + against
        silent = [str(p) for p, a in zip(callable_peers, answers, strict=True) if isinstance(a, BaseException)]
        if self.mode != AveragingMode.CLIENT:
            silent += unheard
        return against, silent

    async def rpc_vote(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """Record the caller's verdict; answer with this node's group view once fixed (False if not in time).

        Only for a group this peer is in, from a member of it: anything else is answered False and not kept, so a
        flood of made-up group ids cannot push the live group's verdicts out.
        """
        refused = _vote_message(request.group_id, False, b"")
        if request.group_id not in self._running_groups and request.group_id not in self._votes:
            return refused
        state = self._vote_state(request.group_id)
        if state["members"] is not None and str(context.remote_id) not in state["members"]:
            return refused
        state["heard"][str(context.remote_id)] = _read_vote(request)
        state["changed"].set()
        try:
            verdict, digest = await asyncio.wait_for(asyncio.shield(state["view"]), timeout=self.allreduce_timeout)
        except asyncio.TimeoutError:
            verdict, digest = False, b""
        return _vote_message(request.group_id, verdict, digest)

"""One round's ``reduce`` on the host side: the checks, attempts on freshly copied buffers, retries, the account.

Inputs:  ``reduce(pseudo_grads, weight, payload)`` (averager.py says what each must be); ``identity`` signs our
         payload (``_sign``: bound to our peer id and the run's prefix); ``round_deadline`` and
         ``max_reduce_attempts``; the matchmaking hooks (matchmaking.py: whether the swarm has left us behind,
         when the next mate will be ready, how many will come and for how long); ``silent``, told the members of a
         failed attempt that did not answer its vote (Membership.suspect); ``averaged_with``, told each complete
         attempt's payloads and direction drops (standing.py), before the round's result is settled.
Output:  ``(averaged, ReduceInfo)``: the shared-memory buffers of the first complete attempt whose mean is finite,
         else copies of the local pseudo-grads, with the attempts, the reason (what each failed attempt and each
         wait came to, in order), the group's payloads, and the timing and byte counts below.
State:   none of its own. It copies our pseudo-grads into the shared-memory buffers before each attempt, reads the
         shared payload byte totals (``_payload_totals``: the averager process's runners add to them), and keeps
         the host's copy of the bans (``_banned``: each step's result carries the averager process's, with the
         seconds each has left). Importing it quiets hivemind's traceback for a group not found (reduce says why in
         one line).
Failure: ``ValueError`` for non-finite input, weight <= 0 or wrong shapes, before any network work. Network failures
         never raise: hivemind's errors (but KeyboardInterrupt and SystemExit) and a dead averager process end an
         attempt, with the reason. An attempt whose all-reduce failed or was incomplete is retried at once; one where
         no group formed (or whose mean was not finite, or with no averager process) only after a wait for a mate
         that will be ready (``_wait_for_group``), or while a mate is still expected this round (``_mates_expected``:
         a mate that came late, or a leader that assembled a group we had given up on, is then met in the next
         attempt; before, the peer took a local step and lost the round); any retry only while
         ``max_reduce_attempts`` and ``round_deadline`` leave room for a whole attempt and the swarm has not left
         this peer behind (``_left_behind``). Once the host asks us to stop (``stopping``: Ctrl-C, SIGTERM), an
         attempt still matchmaking is given up within a quarter of matchmaking_time and no other is made; one whose
         all-reduce began runs to its end (the group's mean needs our part). A client-mode peer that no live peer
         of the run can lead (``reachable_members`` says 0) returns the local result at once, with
         ``NO_REACHABLE_MEMBER`` as the reason; a peer sure to be the only one of the run that averages
         (``alone``), with ``ALONE``.

Timing: ``matchmaking_seconds`` runs from ``step`` to the start of ``_aggregate_with_group`` in the averager
process (the group is assembled; a group smaller than the expected size forms only at the leader's
``matchmaking_time`` deadline); ``allreduce_seconds`` from there to the end of the vote. Both are summed over
attempts. ``bytes_sent`` / ``bytes_received`` are MEASURED payload bytes, also summed over attempts: the
protobuf size of every all-reduce message this member handed to the transport / took from it, before libp2p
framing and encryption (``ExactRunner`` adds them to shared counters as they pass, so a failed attempt's bytes
count too; the vote's few bytes are not counted). A member reducing
``m`` of ``S`` values in a group of ``n`` sends ``S - m`` values to the other reducers and its averaged
slice to ``n - 1`` members, ``(S - m) + (n - 1) m`` values (about ``2 (n - 1) / n`` of the vector) in the wire
codec (``compression``: codec.py; 4 bytes a value for none, 1.03 for int8), and receives as much; the messages
add a few dozen bytes each to that.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from p2p_diloco.outer import is_finite
from p2p_diloco.protocol import Gathered, GatherPayload
from p2p_diloco.rounds import ReduceInfo
from p2p_diloco.swarm.hooks import ask_host

__all__ = ["ALONE", "NO_REACHABLE_MEMBER", "ReduceMixin"]

log = logging.getLogger("p2p_diloco.averager")
NO_REACHABLE_MEMBER = (
    "no group: this peer runs as a client (not reachable from outside) and no live peer of the run is reachable, "
    "so nobody can lead a group or reduce; rounds stay local until a reachable peer joins (one with a forwarded "
    "port and --announce-maddrs, or a public address)"
)

ALONE = "alone: no other peer of the run averages now (its members were read: none live with these settings)"
STOPPING = "a stop was requested: no group looked for"


class _Stopping(Exception):
    """The host asked us to stop while the step was still matchmaking: the attempt is given up."""


class _NoGroupIsNotAnError(logging.Filter):
    """hivemind logs a full traceback each time no group forms; reduce() reports that itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


logging.getLogger("hivemind.averaging.averager").addFilter(_NoGroupIsNotAnError())


class ReduceMixin:
    """The host side of ``PseudoGradAverager.reduce``; see the module docstring. A part of PseudoGradAverager
    (averager.py), whose ``__init__`` sets what it reads."""

    def _check_inputs(self, pseudo_grads: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight={weight!r} must be a finite number > 0")
        if len(pseudo_grads) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} pseudo-gradient tensors, got {len(pseudo_grads)}")
        out = []
        for i, (grad, shape) in enumerate(zip(pseudo_grads, self.shapes, strict=True)):
            if tuple(grad.shape) != shape:
                raise ValueError(f"pseudo_grads[{i}] has shape {tuple(grad.shape)}, expected {shape}")
            grad = grad.detach().to("cpu", torch.float32)
            if not is_finite(grad):
                raise ValueError(f"pseudo_grads[{i}] is not finite (NaN or inf); refusing to average it")
            out.append(grad)
        return out

    def reduce(
        self, pseudo_grads: Sequence[torch.Tensor], weight: float, payload: GatherPayload | None = None
    ) -> tuple[list[torch.Tensor], ReduceInfo]:
        """Weighted mean over a complete group, or the local pseudo-gradients; never a partial mean."""
        start = time.monotonic()
        grads = self._check_inputs(pseudo_grads, weight)
        gather = self._sign(payload) if payload is not None else None
        alone = Gathered({str(self.peer_id): payload} if payload is not None else {})
        info = ReduceInfo(gathered=alone, check_seconds=time.monotonic() - start)
        notes: list[str] = []
        if self.client_mode and self._no_reachable_member():
            info.group_size, info.reason = 1, NO_REACHABLE_MEMBER
            return [g.clone() for g in grads], info
        if self._alone():
            info.group_size, info.reason = 1, ALONE
            return [g.clone() for g in grads], info
        attempt_budget = 2 * self.matchmaking_time + self.request_timeout_s + self.allreduce_timeout
        mine = payload.tag if isinstance(payload, GatherPayload) else None
        if not self._left_behind(mine, info):
            self._say_looking()
            self._wait_for_group(start + self.round_deadline - attempt_budget, info, notes, mine)
        while info.ahead is None and info.attempts < self.max_reduce_attempts:
            if self._stopping():
                notes.append(f"{STOPPING} before attempt {info.attempts + 1}")
                break
            if info.attempts and time.monotonic() + attempt_budget > start + self.round_deadline:
                notes.append(f"no time for attempt {info.attempts + 1} within round_deadline={self.round_deadline}s")
                break
            info.attempts += 1
            averaged, why, retry = self._attempt(grads, float(weight), gather, info)
            if averaged is not None:
                info.complete, info.reason = True, "; ".join(notes)
                ask_host(self.hooks.averaged_with, "recording whom we averaged with", None, info.gathered, info.dropped)
                return averaged, info
            notes.append(f"attempt {info.attempts}: {why}")
            if self._stopping():  # the loop's first check ends it, without the DHT reads below (slow once mates left)
                continue
            # nobody came, but peers will be ready later (they began their round while we looked): wait, retry
            if self._left_behind(mine, info):
                break
            if (
                not retry
                and not self._wait_for_group(start + self.round_deadline - attempt_budget, info, notes, mine)
                and not self._mates_expected()
            ):
                break
        if info.ahead is not None:
            notes.append(f"the swarm holds {info.ahead}, past this peer's {mine}: no group looked for")
        info.group_size, info.complete, info.reason = 1, False, "; ".join(notes)
        return [g.clone() for g in grads], info

    def _sign(self, payload: GatherPayload) -> Any:
        """Our payload's wire form, signed with our key (bound to our peer id and this run's prefix)."""
        wire = payload.to_wire()
        if self.identity is not None and isinstance(payload, GatherPayload):
            message = payload.signed_bytes(self.prefix, self.identity.peer_id)
            wire = {**wire, "key": self.identity.public_key, "sig": self.identity.sign(message)}
        return wire

    def _attempt(
        self, grads: list[torch.Tensor], weight: float, gather: Any, info: ReduceInfo
    ) -> tuple[list[torch.Tensor] | None, str, bool]:
        """One step on freshly copied buffers -> (averaged or None, why not, whether a retry makes sense)."""
        if not self.is_alive():
            return None, "the averager process is not running", False
        t0 = time.monotonic()
        with self.get_tensors() as shared:
            for buf, grad in zip(shared, grads, strict=True):
                buf.copy_(grad)
        info.copy_seconds += time.monotonic() - t0
        window = self._expect_members()
        t0, control, totals, reads = time.monotonic(), None, self._payload_totals.clone(), int(self._group_reads)
        # hivemind starts the all-reduce at the leader's deadline; a follower whose own step times out at the
        # same moment leaves a group the others then run without it. One more matchmaking period of slack.
        find_timeout = window + self.matchmaking_time + self.request_timeout_s
        try:
            control = self.step(weight=weight, gather=gather, timeout=find_timeout, allow_retries=False, wait=False)
            out = self._result_of(control, time.monotonic() + find_timeout + self.allreduce_timeout + 5.0)
        except BaseException as e:  # hivemind may raise asyncio.CancelledError
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            began = control is not None and control.began_allreduce
            if control is not None and not control.done():
                control.cancel()
            self._count_since(info, totals, reads)  # a failed all-reduce's bytes were sent all the same
            if not began:
                info.matchmaking_seconds += time.monotonic() - t0
                return None, f"no group formed ({type(e).__name__}: {e})", False
            info.allreduce_seconds += time.monotonic() - t0
            return None, f"all-reduce failed ({type(e).__name__}: {e})", True
        info.matchmaking_seconds += out["t_group"] - t0
        info.allreduce_seconds += time.monotonic() - out["t_group"]
        info.repaired += out.get("repaired", 0)
        self._count_since(info, totals, reads)
        for peer, left in out.get("banned", {}).items():  # the averager process banned them: admits() says so too
            self._banned[peer] = max(self._banned.get(peer, 0.0), time.monotonic() + left)
        if not out["complete"]:
            self._report_silent(out.get("silent", []))
            return None, f"incomplete all-reduce in a group of {out['group_size']}: {out['reason']}", True
        t0 = time.monotonic()
        with self.get_tensors() as shared:  # the mean itself, not a copy: nothing writes there until our next step
            averaged = list(shared)
        finite = all(is_finite(t) for t in averaged)
        info.copy_seconds += time.monotonic() - t0
        if not finite:
            return None, "the group's average is not finite", False
        info.group_size, info.groups, info.gathered = out["group_size"], out["groups"], out["gathered"]
        info.dropped = out.get("dropped", {})
        log.info("averaged in a round of %d peer(s), %d group(s)", info.group_size, info.groups)
        return averaged, "", False

    def _report_silent(self, peers: list[str]) -> None:
        """Tell the host (``silent``, e.g. Membership.suspect) which members of a failed attempt did not answer its
        vote; a hook that raises is logged and ignored."""
        if peers:
            ask_host(self.hooks.silent, "reporting silent members", None, peers)

    def _result_of(self, control: Any, deadline: float) -> Any:
        """The step's result, by ``deadline`` (monotonic; TimeoutError after it). While it is still matchmaking, say
        every quarter of matchmaking_time that we are looking (``looking``): a mate that reads our announcement then
        still expects us (Membership._readiness), where a ``ready_at`` gone stale would read as averaging since. A stop
        the host asked for (``stopping``) while it is still matchmaking ends it (``_Stopping``)."""
        while True:
            try:
                return control.result(timeout=max(0.0, min(self.matchmaking_time / 4, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if not control.began_allreduce:
                    if self._stopping():
                        raise _Stopping(STOPPING) from None
                    self._say_looking()

    def _count_since(self, info: ReduceInfo, totals: torch.Tensor, reads: int) -> None:
        """Add the payload bytes counted since ``totals`` (a copy of the byte totals) and the group key reads since
        ``reads`` to ``info``. An attempt the host gave up on while its runner still ran counts the rest with the
        next attempt."""
        sent, received = (self._payload_totals - totals).tolist()
        info.bytes_sent += sent
        info.bytes_received += received
        info.group_reads += int(self._group_reads) - reads

"""Whether, when, at what size and with whom this peer looks for a group: hivemind's matchmaking, steered.

Inputs:  the host's hooks (``self.hooks``, hooks.HostHooks, set by the training peer from its Membership; each None:
         not asked): ``expected_members`` (how many peers, us included, will come to this round), ``group_window``
         (how long to hold the matchmaking open for them), ``group_wait`` (seconds until the next peer will be ready
         when none is now), ``looking`` (say that we are ready and looking now), ``alone`` (sure that no other peer
         of the run averages now), ``swarm_ahead`` (the swarm's state when it is past ours by more than
         max_staleness), ``reachable_members`` (client mode: the live peers that accept calls), ``stopping`` (a stop
         was asked for: look no more); ``min_group_size``, ``max_round_peers``, ``matchmaking_time``,
         ``round_deadline``; ``authorized`` (a closed run's peer ids) and the bans.
Output:  for reduce.py: ``_wait_for_group`` (waited, and may look now?), ``_left_behind``, ``_alone``,
         ``_no_reachable_member``, ``_say_looking``; ``_expect_members`` sets the round's size and window in the
         averager process (``_set_group_target``, read by the next step). ``admits(peer)``: whether ``peer`` may
         average with us and download our state.
State:   ``_banned``: reducers caught lying -> until when (monotonic) we refuse them. aggregate.py bans them for
         ``BAN_SECONDS`` in the averager process; the host keeps a copy from each step's result. Like unlisted
         peers of a closed run, they are refused as followers (``rpc_join_group``), never asked to lead us (the
         ``_matchmaking`` setter), a group holding one is left before any part is sent (aggregate.py), and they
         get no state (state_serving.py, state_pieces.py). In the averager process, hivemind's Matchmaking
         (``_matchmaking``: its leader requests filtered as it is set; the host has none), whose group size and
         window ``_set_group_target`` changes.
Failure: a hook that raises counts as not asked (logged at debug level): matchmaking goes ahead as without it.
         A follower we refuse gets PROTOCOL_VIOLATION; a leader we will not ask is passed over as one that
         refused us.

Declarations: hivemind's DHT keeps, of two values under one key and subkey, the one that expires later, and refuses
an equal or earlier one. Every attempt of ours declares itself under the same group key (the run's prefix, no
group bits), expiring ``window`` seconds after it starts; a retry or the next round whose window is shorter than the
last one's remainder went unseen until that declaration expired. Measured (lie-100 attack test, debug logs): after
the first attempt failed 1 s into a 20 s window, the 3 honest peers' retries (17.9 s) saw nobody for 18 s, one was
left out and took a local step. ``_set_group_target`` stretches such a window to end ``DECLARE_MARGIN`` after the
last declaration (``_declared_until``, which the ``_matchmaking`` setter records): a group still assembles as soon as
its expected members are in.

Reads: hivemind's matchmaking re-reads the group key's declarations whenever its queue of leaders to ask is empty
(``PotentialLeaders.pop_next_leader`` triggers ``_update_queue_periodically``), so a peer waiting for others, a
leader most of all, read the DHT back to back, each read a lookup on several nodes. Measured (3 tiny peers, 6 rounds
of H 5): 75-208 reads per averager process, 240-765 find RPCs sent by each peer's DHT node. ``READ_PAUSE`` paces the
reads to 4 a second at most (the ``_matchmaking`` setter): 8 reads per averager process and ~175 find RPCs per node in
the same run, and the rounds' matchmaking took as long (0.13-0.21 s a round on average, either way). Each reduce counts
its reads (``ReduceInfo.group_reads``, metrics.jsonl).

Round size: before each attempt ``expected_members()`` (the training peer: us and the run's live peers with our
settings) tells the averager process to assemble the round at that many members (within ``min_group_size`` and
``max_round_peers``), so a leader starts as soon as everyone that will come is in, not at ``matchmaking_time``. How
a round of more than ``target_group_size`` members runs: aggregate.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads rpc stream types by typing's _name

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.protocol import RoundTag
from p2p_diloco.rounds import ReduceInfo
from p2p_diloco.swarm.hooks import ask_host

__all__ = ["BAN_SECONDS", "MatchmakingMixin"]

log = logging.getLogger("p2p_diloco.averager")
BAN_SECONDS = 600.0  # how long a reducer caught lying is kept out of our groups
DECLARE_MARGIN = 0.5  # seconds a declaration ends after our previous one at the least (module docstring)
READ_PAUSE = 0.25  # seconds between two reads of the group key's declarations at the least (module docstring)


class MatchmakingMixin:
    """When, at what size and with whom PseudoGradAverager (averager.py) groups; see the module docstring. Its
    ``__init__`` sets what this reads."""

    def _wait_for_group(self, until: float, info: ReduceInfo, notes: list[str], mine: RoundTag | None) -> bool:
        """Wait while no mate is ready but one will be (``group_wait``), if that is before ``until`` (monotonic).
        The mates' round ends are estimates, revised as they go and early when they speed up, so the wait asks
        again every quarter of matchmaking_time, and says meanwhile that we are looking (``looking``): a mate that
        ends its round during the wait then expects us, and we join it within that quarter. The wait ends early
        when the swarm has left ``mine`` behind (``_left_behind``). The wait counts as matchmaking. Whether it
        waited, and may look for a group now."""
        began, expected = time.monotonic(), 0.0
        while not self._closing.is_set() and not self._stopping():
            if expected and self._left_behind(mine, info):
                break
            delay = self._ask_group_wait()
            if delay <= 0.0 or time.monotonic() + delay > until:
                break
            if not expected:
                expected = delay
                log.info("no peer is ready to average now; waiting up to %.1fs for the next one", delay)
            self._say_looking()
            self._closing.wait(min(delay, self.matchmaking_time / 4))
        waited = time.monotonic() - began
        if not expected:
            return False
        info.matchmaking_seconds += waited
        notes.append(f"waited {waited:.1f}s for the next peer to be ready (expected in {expected:.1f}s)")
        return not self._closing.is_set() and not self._stopping() and info.ahead is None

    def _left_behind(self, mine: RoundTag | None, info: ReduceInfo) -> bool:
        """Whether the swarm holds a state too far past ``mine`` for our Δ to count (``swarm_ahead``; it goes to
        ``info.ahead``); False when that is not known."""
        ahead = None if mine is None else ask_host(self.hooks.swarm_ahead, "where the swarm is", None, mine)
        if isinstance(ahead, RoundTag) and ahead.round > mine.round + self.rules.max_staleness:
            info.ahead = ahead
            log.info("the swarm holds %s, past this peer's %s: resyncing instead of looking for a group", ahead, mine)
        return info.ahead is not None

    def _ask_group_wait(self) -> float:
        """``group_wait``'s answer; 0 when there is none or it fails (then matchmaking goes ahead now)."""
        return float(ask_host(self.hooks.group_wait, "when peers are ready", 0.0))

    def _say_looking(self) -> None:
        """Tell the mates we are ready now and looking for a group (``looking``), if anyone listens; when it fails
        they read our last announcement, as before."""
        ask_host(self.hooks.looking, "announcing that this peer is looking for a group", None)

    def _mates_expected(self) -> bool:
        """Whether a mate is expected at this round's matchmaking (``expected_members`` counts another peer than us):
        an attempt that found no group is then tried again, time permitting (reduce.py). False when not known."""
        return int(ask_host(self.hooks.expected_members, "the expected members", 1)) > 1

    def _stopping(self) -> bool:
        """Whether the host asked this peer to stop (``stopping``): no group is looked for from then on."""
        return bool(ask_host(self.hooks.stopping, "whether this peer is stopping", False))

    def _alone(self) -> bool:
        """Whether we are sure no other peer of the run averages now (``alone``); False when not known."""
        return bool(ask_host(self.hooks.alone, "whether this peer is alone", False))

    def _no_reachable_member(self) -> bool:
        """Whether no live peer of the run can lead a group for us (client mode; ``reachable_members`` says 0)."""
        return ask_host(self.hooks.reachable_members, "the reachable members", None) == 0

    def _expect_members(self) -> float:
        """Tell the averager process how many members to assemble the round at and how long to hold its matchmaking
        open for them: the expected count, within [min_group_size, max_round_peers] (a leader whose group holds that
        many starts at once), and ``group_window`` (until the last expected peer is ready), within
        [matchmaking_time, round_deadline / 2]. Every peer declares that window, so the first to arrive leads and
        keeps the round open for the others (hivemind's matchmaking: the earliest expiration leads; a later peer
        whose window ends sooner takes the group over, the followers redirected to it). Returns the window."""
        expected, window = self.target_group_size_cap, self.matchmaking_time
        try:
            if self.hooks.expected_members is not None:
                expected = int(self.hooks.expected_members())
            if self.hooks.group_window is not None:
                window = min(max(float(self.hooks.group_window()), self.matchmaking_time), self.round_deadline / 2)
        except Exception as exc:  # noqa: BLE001 - not knowing who will come only costs the wait
            log.debug("expected members or their window unknown (%r): assembling at max_round_peers", exc)
        size = max(self.matchmaking_kwargs["min_group_size"], min(self.target_group_size_cap, expected))
        self._outer_pipe.send(("_set_group_target", [], dict(size=size, window=window)))
        log.info("looking for this round's group: %d peer(s) expected, open for up to %.1fs", size, window)
        return window

    async def _set_group_target(self, size: int, window: float | None = None) -> None:
        """(averager process) Assemble groups at ``size`` members from now on, holding the matchmaking open for
        ``window`` seconds at most (the next step reads both)."""
        matchmaking = self._matchmaking
        matchmaking.target_group_size = matchmaking.potential_leaders.target_group_size = size
        if window is not None:  # ending after the last declaration, or the DHT refuses the new one (module docstring)
            window = max(window, self._declared_until - get_dht_time() + DECLARE_MARGIN)
            matchmaking.min_matchmaking_time = matchmaking.potential_leaders.min_matchmaking_time = window

    def admits(self, peer: Any) -> bool:
        """Whether ``peer`` may average with us and download our state: listed (in a closed run), not banned."""
        peer = str(peer)
        until = self._banned.get(peer)  # the reduce thread and the main thread (Membership) both ask
        if until is not None and until < time.monotonic():
            self._banned.pop(peer, None)
        return (self.authorized is None or peer in self.authorized) and peer not in self._banned

    @property
    def _matchmaking(self) -> Any:
        if "_matchmaking_" not in self.__dict__:  # the host process: hivemind builds it in the averager process
            raise AttributeError("_matchmaking")
        return self.__dict__["_matchmaking_"]

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Any) -> None:
        """hivemind builds its Matchmaking in the averager process; as a follower ours never asks a leader that is
        unlisted or banned to take it (it answers None, as for a leader that refused, and the search goes on),
        each declaration's expiration is recorded (``_declared_until``) and the declarations are read at most every
        ``READ_PAUSE`` seconds, each read counted (``_group_reads``): module docstring. The id of each group it
        returns, led or joined, is kept in ``_assembled`` (the last 8): the step registers it a moment later."""
        keys = matchmaking.group_key_manager
        ask, lead = matchmaking._request_join_group, matchmaking.leader_assemble_group
        declare, read = keys.declare_averager, keys.get_averagers
        self._assembled: deque[bytes] = deque(maxlen=8)  # the groups our matchmaking last returned (aggregate.py)
        last_read = -float("inf")

        def remembered(group: Any) -> Any:
            if group is not None:
                self._assembled.append(group.group_id)
            return group

        async def ask_admitted(leader: Any) -> Any:
            return remembered(await ask(leader) if self.admits(leader) else None)

        async def lead_recorded(*args: Any, **kw: Any) -> Any:
            return remembered(await lead(*args, **kw))

        async def declare_recorded(group_key: str, peer_id: Any, expiration_time: float, *args: Any, **kw: Any) -> Any:
            self._declared_until = max(self._declared_until, expiration_time)
            return await declare(group_key, peer_id, expiration_time, *args, **kw)

        async def read_paced(*args: Any, **kw: Any) -> Any:
            nonlocal last_read
            await asyncio.sleep(last_read + READ_PAUSE - time.monotonic())
            last_read = time.monotonic()
            self._group_reads += 1
            return await read(*args, **kw)

        matchmaking._request_join_group, matchmaking.leader_assemble_group = ask_admitted, lead_recorded
        keys.declare_averager, keys.get_averagers = declare_recorded, read_paced
        self.__dict__["_matchmaking_"] = matchmaking

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, closed to peers that a closed run does not list."""
        if not self.admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

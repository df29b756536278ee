"""What the training peer tells its averager about the run, and how the averager asks it.

Inputs:  callables the host (swarm/peer.py) sets after the averager starts, most of them Membership's
         (membership.py, readiness.py, announcements.py), each None until set.
Output:  ``HostHooks``: the questions the averager asks the host as a round's reduce goes (matchmaking.py, reduce.py)
         and what it tells it; ``ask_host``: one question's answer, or a fallback.
State:   none: the hooks live in the host process only (the averager process never asks them).
Failure: a hook that is not set, raises or answers something of the wrong type counts as not asked (logged at debug
         level): the averager then does what it did before the hook existed; not knowing only costs a wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2p_diloco.protocol import Gathered, RoundTag

__all__ = ["HostHooks", "ask_host"]

log = logging.getLogger("p2p_diloco.averager")


@dataclass
class HostHooks:
    """The host's side of a reduce, each None until the host sets it (not asked)."""

    # how many peers (us included) will come to this round's matchmaking (e.g. the run's live members); a leader then
    # assembles as soon as that many joined, instead of at matchmaking_time
    expected_members: Callable[[], int] | None = None
    # how long this round's matchmaking stays open for the peers expected in it (e.g. Membership.group_window: until
    # the last of them is ready); None: matchmaking_time
    group_window: Callable[[], float] | None = None
    # seconds until the next peer of the run will be ready to average when none is now (e.g. Membership.group_wait);
    # reduce waits that long before matchmaking, and again after a matchmaking that found nobody, within
    # round_deadline, instead of averaging alone
    group_wait: Callable[[], float] | None = None
    # say that this peer is ready to average now and looking for a group (e.g. Membership.looking); called as reduce
    # begins and every quarter of matchmaking_time while it waits, so that mates ending their rounds meanwhile expect
    # it, rather than reading its round's end as "averaging since"
    looking: Callable[[], None] | None = None
    # whether this peer is sure to be the only one of the run that averages now (e.g. Membership.alone); a round is
    # then local at once, without a matchmaking that cannot succeed
    alone: Callable[[], bool] | None = None
    # the swarm's state when it is more than max_staleness rounds past the given tag (ours), else None (e.g.
    # Membership.ahead); asked as reduce begins and while it waits: a peer the swarm has left behind looks for no
    # group, since its Δ would not count and its joining would split its mates' group
    swarm_ahead: Callable[[RoundTag], RoundTag | None] | None = None
    # client mode only: how many live peers of the run accept calls (can lead and reduce); at 0 a round is local at
    # once, with the reason, instead of a matchmaking that cannot succeed
    reachable_members: Callable[[], int | None] | None = None
    # whether a stop was requested (e.g. the peer's Ctrl-C event's is_set): a reduce still looking for a group gives
    # up (its all-reduce, once begun, still ends: the group's mean needs our part)
    stopping: Callable[[], bool] | None = None
    # told the members of a failed attempt that did not answer its vote (dead or cut off; e.g. Membership.suspect, so
    # that the retry and later rounds do not wait for them)
    silent: Callable[[list[str]], None] | None = None
    # told each complete all-reduce's gathered payloads and the senders our reducer dropped by direction (e.g. the
    # peer's Standing, swarm/standing.py: whom we have averaged with)
    averaged_with: Callable[[Gathered, dict[str, int]], None] | None = None


def ask_host(hook: Callable[..., Any] | None, what: str, fallback: Any, *args: Any) -> Any:
    """The answer of ``hook(*args)``, one of the HostHooks; ``fallback`` when the hook is not set (None), raises
    (logged at debug level with ``what``), or answers something that is neither a number nor of ``fallback``'s type
    (any answer counts when ``fallback`` is None). Not knowing only costs a wait: the averager then does what it did
    before the hook existed."""
    if hook is None:
        return fallback
    try:
        answer = hook(*args)
    except Exception as exc:  # noqa: BLE001 - a host hook's failure must not fail the round
        log.debug("%s: unknown (%r)", what, exc)
        return fallback
    if fallback is not None and not isinstance(answer, type(fallback) | int):
        log.debug("%s: unknown (answered %r)", what, answer)
        return fallback
    return answer

"""Fault injection for the swarm tests: kill a peer's whole process group in the middle of an all-reduce.

Inputs:  ``after`` (how many messages this peer may hand to other peers' reducers) and ``on_die`` (called with
         that count just before the kill, e.g. to print a ``DYING`` line the test waits for).
Output:  none; hivemind's ``AllReduceRunner._generate_input_for_peer`` is patched in this process.
State:   one counter, over the whole run (every all-reduce and every reducer together), in the process that
         runs the all-reduce. Install the hook BEFORE the averager process forks (before ``run_peer``'s main
         or ``PseudoGradAverager(...)``): the forked averager inherits the patched class and a fresh copy of the
         counter, which is the copy that counts.
Failure: none raised; the peer (its process group: host, DHT, p2pd, averager) dies by SIGKILL, so the other
         members see a peer vanish mid-transfer.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["install_kill_after_sends"]


def install_kill_after_sends(after: int, on_die: Callable[[int], None] | None = None) -> None:
    """SIGKILL this process group once ``after`` tensor-part messages went to other reducers (whole-run count).

    A message counts when the sender has taken it (the generator is resumed after yielding it), so the peer
    dies with exactly ``after`` messages handed over and the rest of its parts never sent.
    """
    if after < 1:
        raise ValueError(f"after={after} must be >= 1")
    from hivemind.averaging.allreduce import AllReduceRunner

    original = AllReduceRunner._generate_input_for_peer
    sent = [0]

    async def generate(self: Any, peer_index: int) -> AsyncIterator[Any]:
        async for message in original(self, peer_index):
            yield message
            sent[0] += 1  # resumed: the previous message was taken by the sender
            if sent[0] >= after:
                if on_die is not None:
                    on_die(sent[0])
                os.killpg(os.getpgrp(), signal.SIGKILL)

    AllReduceRunner._generate_input_for_peer = generate

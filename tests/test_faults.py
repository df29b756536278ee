"""tests/faults.py: the kill hook counts messages over the whole run and SIGKILLs the group after exactly N."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from faults import install_kill_after_sends

from scripts.procs import Proc, live_group_members, wait_until

TESTS = Path(__file__).resolve().parent

# a stand-in for hivemind's sender generator (10 messages per reducer), the hook on top of it, two reducers' streams
CHILD = f"""
import asyncio, sys
sys.path.insert(0, {str(TESTS)!r})
from hivemind.averaging.allreduce import AllReduceRunner

async def fake(self, peer_index):
    for k in range(10):
        yield (peer_index, k)

AllReduceRunner._generate_input_for_peer = fake
from faults import install_kill_after_sends
install_kill_after_sends(12, lambda sent: print(f"DYING {{sent}}", flush=True))

async def drain(peer_index):
    async for message in AllReduceRunner._generate_input_for_peer(None, peer_index):
        print("SENT", *message, flush=True)

async def main():
    await drain(1)
    await drain(2)

asyncio.run(main())
print("SURVIVED", flush=True)
"""


@pytest.mark.timeout(60)
def test_kill_after_sends_counts_over_the_whole_run_and_kills_the_group():
    proc = Proc([sys.executable, "-c", CHILD])
    try:
        rc = proc.wait(timeout=45)
    finally:
        proc.kill_group()
    assert rc == -9, proc.describe()
    # all 10 messages to reducer 1, then 2 of reducer 2's: one count over the whole run, not per generator call
    sent = [*(f"SENT 1 {k}" for k in range(10)), "SENT 2 0", "SENT 2 1"]
    assert proc.stdout_lines == [*sent, "DYING 12"], proc.describe()
    assert wait_until(lambda: not live_group_members(proc.pgid), 10), live_group_members(proc.pgid)


def test_kill_after_sends_refuses_a_count_below_one():
    with pytest.raises(ValueError, match="after=0"):
        install_kill_after_sends(0)

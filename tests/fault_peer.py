"""run_peer with a fault injected: SIGKILL of the whole peer (process group) in the middle of an all-reduce.

Usage: python tests/fault_peer.py KILL_AFTER_SENDS run_peer-args...
The peer dies after it has handed KILL_AFTER_SENDS tensor parts to other peers' reducers (counted over the
whole run), i.e. while the all-reduce of a chosen round is in flight. Prints ``DYING <unix time>`` first.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def install(after_sends: int) -> None:
    from hivemind.averaging.allreduce import AllReduceRunner

    original = AllReduceRunner._generate_input_for_peer
    sent = [0]

    async def generate(self, peer_index):  # runs in the averager process, which forks after this patch
        async for message in original(self, peer_index):
            yield message
            sent[0] += 1
            if sent[0] >= after_sends:
                print(f"DYING {time.time()}", flush=True)
                os.killpg(os.getpgrp(), signal.SIGKILL)

    AllReduceRunner._generate_input_for_peer = generate


if __name__ == "__main__":
    install(int(sys.argv[1]))
    from peers.run_peer import main

    sys.exit(main(sys.argv[2:]))

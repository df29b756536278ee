"""run_peer with a fault injected: SIGKILL of the whole peer (process group) in the middle of an all-reduce.

Usage:   python tests/fault_peer.py KILL_AFTER_SENDS run_peer-args...
Output:  run_peer's own output, plus ``DYING <unix time>`` on stdout just before the kill.
State:   the hook of tests/faults.py, installed before run_peer starts its averager process.
Failure: the peer dies after it has handed KILL_AFTER_SENDS tensor parts to other peers' reducers (counted over
         the whole run), i.e. while the all-reduce of a chosen round is in flight; exit code -9 (SIGKILL).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # peers, p2p_diloco of this working tree

from faults import install_kill_after_sends  # noqa: E402  (tests/, this file's directory, is sys.path[0])


def _say_dying(sent: int) -> None:
    print(f"DYING {time.time()}", flush=True)


if __name__ == "__main__":
    install_kill_after_sends(int(sys.argv[1]), _say_dying)
    from p2p_diloco.stopping import skip_exit_collection
    from peers.run_peer import main

    sys.exit(skip_exit_collection(main(sys.argv[2:])))

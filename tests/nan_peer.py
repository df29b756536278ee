"""run_peer with a poisoned outer state: right after the outer step that ends round R, the anchor holds NaN.

Usage:   python tests/nan_peer.py R run_peer-args...
Output:  run_peer's own output, plus ``POISONED <R>`` on stdout when the state was poisoned (once per run).
State:   ``Worker.apply_outer`` patched in this process (the training loop's; the averager process never steps):
         the first time an outer step leaves the state at round R, the first anchor tensor is filled with NaN and
         θ is reset to it, so every inner step from that state has a NaN loss.
Failure: nothing added; what the peer does with the NaN anchor (discard, back off, roll back) is what tests look at.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # peers, p2p_diloco of this working tree


def install_poison(at_round: int) -> None:
    from p2p_diloco.engine import Worker

    original = Worker.apply_outer
    done = [False]

    def apply_outer(self: Worker, *args: Any, **kwargs: Any) -> float:
        lr = original(self, *args, **kwargs)
        if not done[0] and self.state.round == at_round:
            done[0] = True
            self.state.anchor[0].fill_(math.nan)
            self.state.copy_to(self.model.parameters())
            print(f"POISONED {at_round}", flush=True)
        return lr

    Worker.apply_outer = apply_outer


if __name__ == "__main__":
    install_poison(int(sys.argv[1]))
    from p2p_diloco.stopping import skip_exit_collection
    from peers.run_peer import main

    sys.exit(skip_exit_collection(main(sys.argv[2:])))

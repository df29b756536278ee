"""run_peer as a hostile volunteer: it follows the protocol but lies about its pseudo-gradient or its weight.

Usage:   python tests/attack_peer.py ATTACK SCALE run_peer-args...
         ATTACK negate: it sends -SCALE x its Δ (e.g. 1000);
                weight: it sends its Δ with SCALE x its tokens as the all-reduce weight, while its gather payload
                        declares the true tokens (e.g. 1e6).
Output:  run_peer's own output, plus ``ATTACKING <attack> <scale>`` on stdout before run_peer starts.
State:   the patch, installed in this process before run_peer builds its averager (so the forked averager has it).
Failure: as run_peer's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # peers, p2p_diloco of this working tree


def install(attack: str, scale: float) -> None:
    import p2p_diloco.engine as engine
    from p2p_diloco.swarm.averager import PseudoGradAverager

    if attack == "negate":
        honest = engine.pseudo_gradient

        def pseudo_gradient(anchor, params):  # type: ignore[no-untyped-def]
            return [-scale * d for d in honest(anchor, params)]

        engine.pseudo_gradient = pseudo_gradient
    elif attack == "weight":
        reduce = PseudoGradAverager.reduce

        def heavy(self, pseudo_grads, weight, *args, **kwargs):  # type: ignore[no-untyped-def]
            return reduce(self, pseudo_grads, weight * scale, *args, **kwargs)

        PseudoGradAverager.reduce = heavy
    else:
        raise SystemExit(f"attack_peer.py: unknown attack {attack!r} (negate or weight)")


if __name__ == "__main__":
    install(sys.argv[1], float(sys.argv[2]))
    print(f"ATTACKING {sys.argv[1]} {sys.argv[2]}", flush=True)
    from peers.run_peer import main

    sys.exit(main(sys.argv[3:]))

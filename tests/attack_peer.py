"""run_peer as a hostile volunteer: it follows the protocol except for one behaviour.

Usage:   python tests/attack_peer.py ATTACK SCALE run_peer-args...
         ATTACK negate:  it sends -SCALE x its Δ (e.g. 1000);
                alie:    it sends Δ - SCALE x mean |Δ| of each tensor: "a little is enough" (every coordinate shifted
                         one way by about the spread, its own Δ standing in for the honest mean and spread it cannot
                         see);
                weight:  it sends its Δ with SCALE x its tokens as the all-reduce weight, while its gather payload
                         declares the true tokens (e.g. 1e6);
                lie:     as a reducer it returns -SCALE x the true average of its slice, to every member;
                hijack:  its signed gather payload claims a state SCALE rounds ahead of its own;
                donor:   it serves a bogus outer state at round 10**SCALE (its checksum and manifest matching its
                         bytes) to every downloader and announces that state as the one it holds; two donors serve
                         the same state (Sybils vouching for it together);
                flood:   a thread downloads every other peer's state SCALE times a second;
                garbage: its gather payloads are malformed (a number, wrong types, by turns), and a second DHT node
                         it runs without validators stores garbage under every key the peers read, every 2 s.
Output:  run_peer's own output, plus ``ATTACKING <attack> <scale>`` on stdout before run_peer starts; flood prints
         ``FLOOD {"served": n, "refused": m}`` every 10 downloads.
State:   the patch, installed in this process before run_peer builds its averager (so the forked averager has it).
Failure: as run_peer's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # peers, p2p_diloco of this working tree

ATTACKS = ("negate", "alie", "weight", "lie", "hijack", "donor", "flood", "garbage")


def install(attack: str, scale: float) -> None:
    import torch

    import p2p_diloco.engine as engine
    import p2p_diloco.swarm.part_reducer as part_reducer
    from p2p_diloco.outer import OuterState
    from p2p_diloco.protocol import GatherPayload, RoundTag
    from p2p_diloco.state_parts import part_digests
    from p2p_diloco.swarm.averager import PseudoGradAverager
    from p2p_diloco.swarm.membership import Membership
    from p2p_diloco.swarm.peer import TrainingPeer
    from p2p_diloco.swarm.sync import StateSync

    if attack == "negate":
        honest = engine.pseudo_gradient

        def pseudo_gradient(anchor, params):  # type: ignore[no-untyped-def]
            return [-scale * d for d in honest(anchor, params)]

        engine.pseudo_gradient = pseudo_gradient
    elif attack == "alie":
        honest = engine.pseudo_gradient

        def shifted(anchor, params):  # type: ignore[no-untyped-def]
            return [d - scale * d.abs().mean() for d in honest(anchor, params)]

        engine.pseudo_gradient = shifted
    elif attack == "weight":
        reduce = PseudoGradAverager.reduce

        def heavy(self, pseudo_grads, weight, *args, **kwargs):  # type: ignore[no-untyped-def]
            return reduce(self, pseudo_grads, weight * scale, *args, **kwargs)

        PseudoGradAverager.reduce = heavy
    elif attack == "lie":
        aggregate_counted = part_reducer.aggregate_counted

        def lying(*args, **kwargs):  # type: ignore[no-untyped-def]
            mean, counted = aggregate_counted(*args, **kwargs)
            return -scale * mean, counted

        part_reducer.aggregate_counted = lying
    elif attack == "hijack":
        sign = PseudoGradAverager._sign

        def far_ahead(self, payload):  # type: ignore[no-untyped-def]
            claim = GatherPayload(RoundTag(payload.tag.round + int(scale), "f" * 16), payload.tokens)
            return sign(self, claim)

        PseudoGradAverager._sign = far_ahead
    elif attack == "donor":
        bogus: dict[str, object] = {}

        def bogus_state(template: list[torch.Tensor]) -> OuterState:
            if "state" not in bogus:
                tensors = [torch.full_like(t, 3.0) for t in template]
                bogus["state"] = OuterState.from_tensors(tensors, 10 ** int(scale))
            return bogus["state"]  # type: ignore[return-value]

        def serve(self):  # type: ignore[no-untyped-def]
            state = bogus_state(self.worker.state.tensors())
            parts = part_digests(state.tensors())  # a manifest that hashes to the checksum it announces
            meta = {"round": state.round, "checksum": state.checksum(), "fingerprint": self.fingerprint}
            return {**meta, "consensus": True, "parts": parts}, state.tensors()

        announce = Membership.announce

        def announce_bogus(self, tag, wait=True):  # type: ignore[no-untyped-def]
            worker = PEER["peer"].worker  # type: ignore[attr-defined]
            state = bogus_state(worker.state.tensors())
            return announce(self, RoundTag(state.round, state.checksum()), wait)

        StateSync.serve = serve
        Membership.announce = announce_bogus
    elif attack == "flood":
        flood = _flood
        _after_start(TrainingPeer, lambda peer: threading.Thread(target=flood, args=(peer, scale), daemon=True).start())
    elif attack == "garbage":
        sign, turn = PseudoGradAverager._sign, [0]

        def malformed(self, payload):  # type: ignore[no-untyped-def]
            turn[0] += 1
            wire = sign(self, payload)
            return 17 if turn[0] % 2 else {**wire, "round": "three", "tokens": -1}

        PseudoGradAverager._sign = malformed
        _after_start(TrainingPeer, lambda peer: threading.Thread(target=_litter, args=(peer,), daemon=True).start())
    else:
        raise SystemExit(f"attack_peer.py: unknown attack {attack!r} (one of {', '.join(ATTACKS)})")
    start = TrainingPeer.start

    def registered(self):  # type: ignore[no-untyped-def]
        PEER["peer"] = self  # its worker exists before the first announcement
        start(self)

    TrainingPeer.start = registered


PEER: dict[str, object] = {}


def _after_start(cls, then) -> None:  # type: ignore[no-untyped-def]
    start = cls.start

    def patched(self):  # type: ignore[no-untyped-def]
        start(self)
        then(self)

    cls.start = patched


def _flood(peer, per_second: float) -> None:  # type: ignore[no-untyped-def]
    counts = {"served": 0, "refused": 0}
    tensors = peer.worker.state.tensors()
    size = sum(t.numel() * t.element_size() for t in tensors)
    while not peer.opts.stop.is_set():
        for other in list(peer.members.others()):
            got = peer.averager.download(other, 5.0, len(tensors), size)
            counts["refused" if isinstance(got, str) else "served"] += 1
            if sum(counts.values()) % 10 == 0:
                print(f"FLOOD {json.dumps(counts)}", flush=True)
            time.sleep(1.0 / per_second)


def _litter(peer) -> None:  # type: ignore[no-untyped-def]
    """A node without validators, storing what a careless or hostile node may store under every key we read."""
    from hivemind.dht import DHT
    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.swarm.dht import visible_maddrs

    dht = DHT(initial_peers=visible_maddrs(peer.dht), start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    run, prefix = peer.cfg.swarm.run_id, peer.averager.prefix
    keys = [f"{run}_fingerprint", f"{run}_metrics", f"{prefix}.all_averagers", f"{prefix}.0b"]
    values = [b"x[signature:abc]", {"round": "[signature:x]"}, 1e18, {"fingerprint": 7, "states": "x" * 100_000}]
    while not peer.opts.stop.is_set():
        for key in keys:
            for k, value in enumerate(values):
                dht.store(key, value, get_dht_time() + 60, subkey=f"junk{k}", return_future=True)
        time.sleep(2.0)


if __name__ == "__main__":
    install(sys.argv[1], float(sys.argv[2]))
    print(f"ATTACKING {sys.argv[1]} {sys.argv[2]}", flush=True)
    from p2p_diloco.stopping import skip_exit_collection
    from peers.run_peer import main

    sys.exit(skip_exit_collection(main(sys.argv[3:])))

"""Joining at scale: how long newcomers take to download the outer state, from one donor against several.

Usage:
    python scripts/bench/join.py [--config configs/small.yaml] [--donors 3] [--newcomers 4] [--repeats 2]
    python scripts/bench/join.py --smoke [--out DIR/join.json]   # tiny.yaml, 1 repeat

Setup: real PseudoGradAverager peers on 127.0.0.1, all started from this process (each its own DHT, p2pd and
averager process): ``--donors`` donors serving the same outer state (the config's model, round 5) and
``--newcomers`` newcomers. Each case runs swarm/download.py's ``download_state`` (what a joining peer runs) in one
thread per newcomer, all at once. Join time: from the start of a newcomer's download to holding the verified state.
Cases, side by side in one run (the machine is shared and noisy: compare the ratios): 1 newcomer and
``--newcomers`` at once, each from 1 donor and from ``--donors``; the cases alternate over ``--repeats``.
Output: scripts/bench/results/join.json (``--out`` elsewhere; ``--smoke`` without ``--out``: a temporary directory);
rows: the median join time of each case with ``--donors`` against the same case from one donor (ratio: lower is
better). Failure: a download that returns no state raises (non-zero exit); every peer is shut down in a finally.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import benchlib  # noqa: F401 - puts the repository root on sys.path
import torch
from benchlib import Recorder, fill_defaults, median
from hivemind.dht import DHT

from p2p_diloco.config import load_config
from p2p_diloco.engine import Worker
from p2p_diloco.swarm.averager import PseudoGradAverager
from p2p_diloco.swarm.download import download_state
from p2p_diloco.swarm.protocol import RoundTag

DEFAULTS = dict(config="configs/small.yaml", donors=3, newcomers=4, repeats=2)
SMOKE = dict(config="configs/tiny.yaml", donors=2, newcomers=2, repeats=1)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
AVERAGER = dict(
    target_group_size=2,
    min_group_size=2,
    matchmaking_time=4.0,
    request_timeout=1.0,
    allreduce_timeout=60.0,
    next_chunk_timeout=15.0,
    part_size_bytes=2 << 20,
    round_deadline=60.0,
    max_reduce_attempts=1,
    max_state_downloads=1000,  # the bench downloads the same state many times a minute
)


def _batches(vocab: int = 257):
    while True:
        yield torch.randint(0, vocab, (2, 16))


class Peer:
    def __init__(self, initial: list[str], serve=None) -> None:
        self.dht = DHT(start=True, host_maddrs=LOCAL, initial_peers=initial)
        self.averager = PseudoGradAverager(self.dht, [torch.zeros(4)], "join-bench", **AVERAGER)
        if serve is not None:
            self.averager.set_state_provider(serve)
        self.peer_id = str(self.dht.peer_id)

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def close(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


def _case(newcomers: list[Peer], donors: list[Peer], ours: list[torch.Tensor], tag: RoundTag) -> list[float]:
    """Join seconds of each newcomer, all downloading at once."""
    times: list[float | None] = [None] * len(newcomers)

    def join(k: int) -> None:
        t0 = time.monotonic()
        got = download_state(newcomers[k].averager, ours, "bench", tag, [d.peer_id for d in donors], 600.0)
        if got is not None and got[0].checksum() == tag.checksum:
            times[k] = time.monotonic() - t0

    threads = [threading.Thread(target=join, args=(k,)) for k in range(len(newcomers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(t is None for t in times):
        raise RuntimeError(f"a newcomer got no state from {len(donors)} donor(s)")
    return [float(t) for t in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="the model's config (configs/small.yaml)")
    p.add_argument("--donors", type=int, default=None, help="donors of the several-donor cases (3)")
    p.add_argument("--newcomers", type=int, default=None, help="newcomers joining at once (4)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each case (2)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/join.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    if args.donors < 2 or args.newcomers < 1 or args.repeats < 1:
        p.error("need --donors >= 2, --newcomers >= 1, --repeats >= 1")
    rec = Recorder("join", vars(args) | {"out": str(args.out)}, smoke=args.smoke)
    worker = Worker(load_config(benchlib.ROOT / args.config, []), 257, _batches())
    state = worker.state.copy()
    state.round = 5
    meta_cache: dict[str, object] = {}

    def serve():
        if not meta_cache:
            from p2p_diloco.state_parts import part_digests, state_checksum

            digests = part_digests(state.tensors())
            meta_cache.update(
                round=state.round,
                checksum=state_checksum(state.round, digests),
                fingerprint="bench",
                consensus=True,
                parts=digests,
            )
        return dict(meta_cache), state.tensors()

    tag = RoundTag(state.round, state.checksum())
    size_mb = 4 * sum(t.numel() for t in state.tensors()) / 2**20
    peers: list[Peer] = []
    try:
        peers.append(Peer([], serve))
        donors = [peers[0]] + [Peer(peers[0].maddrs(), serve) for _ in range(args.donors - 1)]
        peers += donors[1:]
        known = [a for d in donors for a in d.maddrs()]
        newcomers = [Peer(known) for _ in range(args.newcomers)]
        peers += newcomers
        _case(newcomers[:1], donors, [torch.empty_like(t) for t in state.tensors()], tag)  # warm up connections
        results: dict[tuple[int, int], list[float]] = {}
        for _ in range(args.repeats):
            for n in sorted({1, args.newcomers}):
                for d in (1, args.donors):
                    ours = [torch.empty_like(t) for t in state.tensors()]
                    times = _case(newcomers[:n], donors[:d], ours, tag)
                    results.setdefault((n, d), []).extend(times)
                    print(f"{n} newcomer(s), {d} donor(s): join seconds {[round(t, 2) for t in times]}", flush=True)
        for n in sorted({1, args.newcomers}):
            one, several = median(results[(n, 1)]), median(results[(n, args.donors)])
            rec.add(
                figure=f"join time, {n} newcomer(s) at once, {args.donors} donors ({size_mb:.0f} MB state)",
                value=round(several, 2),
                unit="s (median)",
                reference="1 donor",
                reference_value=round(one, 2),
                ratio=round(several / one, 3),
                ratio_kind="lower is better",
                worst=round(max(results[(n, args.donors)]), 2),
                worst_one_donor=round(max(results[(n, 1)]), 2),
            )
        rec.data["join_seconds"] = {f"{n}x{d}": v for (n, d), v in results.items()}
        rec.notes.append("in-process peers on 127.0.0.1; each newcomer's download runs in its own thread")
    finally:
        for peer in peers:
            peer.close()
    path = rec.write(args.out)
    for r in rec.rows:
        print(f"{r['figure']}: {r['value']} s vs {r['reference_value']} s from 1 donor (x{r['ratio']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

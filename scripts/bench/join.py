"""Joining at scale: how long newcomers take to download the outer state, from one donor against several.

Usage:
    python scripts/bench/join.py [--config configs/small.yaml] [--donors 3] [--newcomers 4] [--repeats 2]
    python scripts/bench/join.py --netlab [--rate 100] [--verbose]   # as root: each peer in its own shaped namespace
    python scripts/bench/join.py --smoke [--out DIR/join.json]   # tiny.yaml, 1 repeat

Setup: real PseudoGradAverager peers, all started from this process (each its own DHT, p2pd and averager
process): ``--donors`` donors serving the same outer state (the config's model, round 5) and ``--newcomers``
newcomers. Each case runs swarm/download.py's ``download_state`` (what a joining peer runs) in one thread per
newcomer, all at once. Join time: from the start of a newcomer's download to holding the verified state.
Cases, side by side in one run (the machine is shared and noisy: compare the ratios): 1 newcomer and
``--newcomers`` at once, each from 1 donor and from ``--donors``; the cases alternate over ``--repeats``.
Links: without ``--netlab`` every peer listens on 127.0.0.1 (the CPU is the bottleneck). With ``--netlab`` (root;
scripts/bench/netns.py, ../shared/docs/network-lab.md) each peer sits in its own home namespace on the lab's
bridge, its egress capped by tbf at ``--rate`` Mbit/s and its ingress not capped (``shape_ingress=False``: a home
line downloads faster than it uploads), so a donor's upload is the bottleneck: one donor serves S bytes to n
newcomers in n x S x 8 / rate seconds at best, d donors in n x S x 8 / (d x rate) (the "wire" figure of each row,
at the link rate measured with one TCP transfer from a donor's home to a newcomer's). Each peer's DHT, p2pd and
averager processes are started from a thread that entered its home's namespace (setns), so they live there; this
process's own threads stay in the host's namespace and talk to them through pipes and unix sockets only.
Output: scripts/bench/results/join.json (``--out`` elsewhere; ``--smoke`` without ``--out``: a temporary directory);
rows: the median join time of each case with ``--donors`` against the same case from one donor (ratio: lower is
better); with ``--netlab`` also the bytes each donor's link sent per case; the count of pieces that failed and
were asked for again (download.py's MAX_FAILURES). Failure: a download that returns no
state raises (non-zero exit); every peer is shut down in a finally, the lab's namespaces deleted after. Exit code
3 (nothing written) when ``--netlab`` is asked for and namespaces cannot be used here (not root, refused).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import benchlib  # noqa: F401 - puts the repository root on sys.path
import torch
from benchlib import Recorder, exit_on_sigterm, fill_defaults, median
from hivemind.dht import DHT
from netns import Lab, LabError, unavailable

from p2p_diloco.config import load_config
from p2p_diloco.engine import Worker
from p2p_diloco.protocol import RoundTag
from p2p_diloco.state_parts import part_digests, state_checksum
from p2p_diloco.swarm.averager import PseudoGradAverager
from p2p_diloco.swarm.download import download_state

DEFAULTS: dict[str, Any] = dict(config="configs/small.yaml", donors=3, newcomers=4, repeats=2, rate=100.0)
SMOKE: dict[str, Any] = dict(config="configs/tiny.yaml", donors=2, newcomers=2, repeats=1)
LOCAL = "127.0.0.1"
CLONE_NEWNET = 0x40000000
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
T = TypeVar("T")


def _batches(vocab: int = 257) -> Iterator[torch.Tensor]:
    while True:
        yield torch.randint(0, vocab, (2, 16))


def in_netns(ns: str | None, make: Callable[[], T]) -> T:
    """``make()``, run in a thread that first entered network namespace ``ns`` (``ip netns``'s
    /var/run/netns/<ns>), so the processes it forks (a DHT and its p2pd, an averager) live in ``ns``; the calling
    thread stays where it is. ``ns`` None: ``make()`` here."""
    if ns is None:
        return make()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Retries(logging.Handler):
    """Counts download.py's "asking again" lines: pieces that failed (not wrong) and were fetched again."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "asking again" in record.getMessage()


class Peer:
    def __init__(self, initial: list[str], serve: Callable[[], Any] | None = None, host: str = LOCAL) -> None:
        self.dht = DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial)
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


def _start_peers(
    args: argparse.Namespace, serve: Callable[[], Any], lab: Lab | None, peers: list[Peer]
) -> tuple[list[Peer], list[Peer]]:
    """(donors, newcomers), each appended to ``peers`` as soon as it runs (so the caller closes it). In a lab,
    donor k sits in home k and newcomer j in home ``donors`` + j."""

    def home(k: int) -> tuple[str | None, str]:
        return (lab.homes[k].ns, lab.homes[k].ip) if lab else (None, LOCAL)

    donors: list[Peer] = []
    for k in range(args.donors):
        ns, ip = home(k)
        initial = donors[0].maddrs() if donors else []
        donors.append(in_netns(ns, lambda initial=initial, ip=ip: Peer(initial, serve, ip)))
        peers.append(donors[-1])
    known = [a for d in donors for a in d.maddrs()]
    newcomers: list[Peer] = []
    for j in range(args.newcomers):
        ns, ip = home(args.donors + j)
        newcomers.append(in_netns(ns, lambda ip=ip: Peer(known, None, ip)))
        peers.append(newcomers[-1])
    return donors, newcomers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="the model's config (configs/small.yaml)")
    p.add_argument("--donors", type=int, default=None, help="donors of the several-donor cases (3)")
    p.add_argument("--newcomers", type=int, default=None, help="newcomers joining at once (4)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each case (2)")
    p.add_argument("--netlab", action="store_true", help="each peer in its own namespace, egress capped (root)")
    p.add_argument("--rate", type=float, default=None, help="--netlab: each home's egress in Mbit/s (100)")
    p.add_argument("--verbose", action="store_true", help="print the downloads' own lines (progress every 5 s)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/join.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    if args.donors < 2 or args.newcomers < 1 or args.repeats < 1 or args.rate <= 0:
        p.error("need --donors >= 2, --newcomers >= 1, --repeats >= 1, --rate > 0")
    exit_on_sigterm()
    retries, console, sync_log = _Retries(), logging.StreamHandler(), logging.getLogger("p2p_diloco.sync")
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))  # run_peer's
    sync_log.addHandler(retries)
    sync_log.addHandler(console)
    sync_log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    if args.netlab:
        reason = unavailable()
        if reason:
            print(f"join: --netlab not run: {reason}", file=sys.stderr)
            return 3
    rec = Recorder("join", vars(args) | {"out": str(args.out)}, smoke=args.smoke)
    worker = Worker(load_config(benchlib.ROOT / args.config, []), 257, _batches())
    state = worker.state.copy()
    state.round = 5
    digests = part_digests(state.tensors())
    meta = dict(round=state.round, checksum=state_checksum(state.round, digests), fingerprint="bench", consensus=True)

    def serve() -> tuple[dict[str, Any], list[torch.Tensor]]:
        return dict(meta, parts=digests), state.tensors()

    tag = RoundTag(state.round, state.checksum())
    size_bytes = 4 * sum(t.numel() for t in state.tensors())
    size_mb = size_bytes / 2**20
    homes = args.donors + args.newcomers
    results: dict[tuple[int, int], list[float]] = {}
    sent: dict[str, list[list[int]]] = {}  # "n x d" -> per repeat, the bytes each donor's link sent
    link: dict[str, Any] | None = None
    peers: list[Peer] = []
    # under hivemind's file_system sharing (HIVEMIND_MEMORY_SHARING_STRATEGY; swarm/shm.py) the first share starts
    # this process's torch_shm_manager, which must run here, not in a home that the lab kills at its end (a later
    # share, or exit, would then abort this process); with file descriptors, our default, it costs nothing
    torch.zeros(1).share_memory_()
    with Lab(homes, args.rate, shape_ingress=False) if args.netlab else contextlib.nullcontext() as lab:
        try:
            if lab is not None:
                try:  # a donor's home to a newcomer's: what one donor's upload can carry
                    link = lab.throughput(0, args.donors, int(args.rate * 1e6 / 8 * 1.5))
                    print(f"link measured {link['mbit_per_s']:.1f} Mbit/s (donor home -> newcomer home)", flush=True)
                except (LabError, OSError, ValueError) as exc:
                    link = {"problem": str(exc)}
            donors, newcomers = _start_peers(args, serve, lab, peers)
            _case(newcomers[:1], donors, [torch.empty_like(t) for t in state.tensors()], tag)  # warm up connections
            for _ in range(args.repeats):
                for n in sorted({1, args.newcomers}):
                    for d in (1, args.donors):
                        ours = [torch.empty_like(t) for t in state.tensors()]
                        before = [lab.counters(k)["tx_bytes"] for k in range(d)] if lab else []
                        times = _case(newcomers[:n], donors[:d], ours, tag)
                        results.setdefault((n, d), []).extend(times)
                        line = f"{n} newcomer(s), {d} donor(s): join seconds {[round(t, 2) for t in times]}"
                        if lab is not None:
                            out = [lab.counters(k)["tx_bytes"] - b for k, b in enumerate(before)]
                            sent.setdefault(f"{n}x{d}", []).append(out)
                            line += f"; MB sent per donor {[round(b / 2**20) for b in out]}"
                        print(line, flush=True)
        finally:
            for peer in peers:
                peer.close()
    mbit = link.get("mbit_per_s") if link else None
    where = f"{args.rate:g} Mbit/s egress per home" if args.netlab else "127.0.0.1"
    for n in sorted({1, args.newcomers}):
        one, several = median(results[(n, 1)]), median(results[(n, args.donors)])
        extra: dict[str, Any] = {}
        figure = f"join time, {n} newcomer(s) at once, {args.donors} donors ({size_mb:.0f} MiB state, {where})"
        if mbit:
            wire = n * size_bytes * 8 / (mbit * 1e6)
            extra = dict(wire_seconds_one_donor=round(wire, 2), wire_seconds=round(wire / args.donors, 2))
            figure += f"; wire time at the measured {mbit:.0f} Mbit/s: {wire / args.donors:.1f} s vs {wire:.1f} s"
        rec.add(
            figure=figure,
            value=round(several, 2),
            unit="s (median)",
            reference="1 donor",
            reference_value=round(one, 2),
            ratio=round(several / one, 3),
            ratio_kind="lower is better",
            worst=round(max(results[(n, args.donors)]), 2),
            worst_one_donor=round(max(results[(n, 1)]), 2),
            **extra,
        )
    rec.data["join_seconds"] = {f"{n}x{d}": v for (n, d), v in results.items()}
    rec.data.update(state_bytes=size_bytes, failed_pieces_asked_again=retries.count)
    if retries.count:
        rec.notes.append(
            f"{retries.count} piece(s) failed and were asked for again (download.py's MAX_FAILURES; a stream cut "
            "short before its last message is the failure seen on shaped links)"
        )
    if args.netlab:
        rec.data.update(link=link, bytes_sent_per_donor=sent)
        rec.notes.append(
            f"Each peer in its own network namespace on the lab's bridge, its egress capped by tbf at {args.rate:g} "
            "Mbit/s, its ingress not capped (scripts/bench/netns.py, shape_ingress=False); wire time = newcomers x "
            "state bytes x 8 / (donors x the rate measured with one TCP transfer from a donor's home to a "
            "newcomer's): the least time the donors' uploads need. Each newcomer's download runs in its own thread "
            "of this process; the peers' DHT, p2pd and averager processes run in their homes."
        )
    else:
        rec.notes.append("in-process peers on 127.0.0.1; each newcomer's download runs in its own thread")
    path = rec.write(args.out)
    for r in rec.rows:
        print(f"{r['figure']}: {r['value']} s vs {r['reference_value']} s from 1 donor (x{r['ratio']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

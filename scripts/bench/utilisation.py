"""Item 3: compute utilisation of training peers: the share of a peer's wall time spent in inner steps.

Usage:
    python scripts/bench/utilisation.py                          # tiny and small, H in {10, 100, 500}
    python scripts/bench/utilisation.py --case tiny:configs/tiny.yaml --h 100 --rounds 3 --peers 3
    python scripts/bench/utilisation.py --h 100 --setting '' --setting swarm.overlap=eager,swarm.overlap_steps=5
    python scripts/bench/utilisation.py --smoke [--out DIR/utilisation.json]   # 2 tiny peers, H=2, 2 rounds

Each case starts a bootstrap node and ``--peers`` real ``run_peer`` processes on 127.0.0.1 (one data shard
each) with the preset's own swarm settings (``target_group_size`` 16 or 32: the group forms once the run's
live peers are in, as a volunteer's would; ``swarm.start_peers = peers`` only holds round 1, which is not
counted, until all are up; no evaluation or checkpoints, so only the round's own work counts). ``--set
swarm.compression=int8 --set swarm.overlap=eager`` measures those settings. From each peer's metrics.jsonl, over
rounds 2..R-1 (``benchlib.steady_rounds``: the first one also absorbs the peers' staggered start-up, and the last
one's exchange has nothing to overlap with), each round's period running from its inner steps' start to the next
round's:
    utilisation (wall)   = sum(compute_seconds) / (start of round R's inner steps - start of round 2's)
    utilisation (rounds) = sum(compute_seconds) / sum(round_seconds)
The wall figure is the stricter one (it also counts the work between one round's inner steps and the next's), and
the table shows it, averaged over peers, with the per-round breakdown (compute, matchmaking = waiting for the group,
all-reduce, the rest). compute_seconds is inner steps only: with eager overlap, the wait for the exchange at
``swarm.overlap_steps`` and its settling are left out of it (engine.Worker.contribute). A run of a single round (the
default for small at H=500, whose round takes minutes on CPU) gives that round's compute_seconds / round_seconds and
is labelled so: it includes waiting for the other peers' start-up. Peers run with one torch thread each: ``peers``
processes share this machine's cores, so compute is slower than on a dedicated core and the figures are what this
machine gives. The small config runs at batch 1 x 32 on CPU (its own 16 x 256 takes about 1 s per step per core):
less compute per round makes its utilisation figures lower bounds for the real batch.
Output: scripts/bench/results/utilisation.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``: a
temporary directory). Failure: a swarm run past ``--timeout`` or a peer that exits non-zero is killed (every
process group) and noted in the case's ``problem``; a case without 2 rounds on record is listed as not measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    Recorder,
    exit_on_sigterm,
    fill_defaults,
    log_tail,
    overlap_label,
    read_jsonl,
    run_overrides,
    start_swarm,
    steady_rounds,
)

# name:config[:k=v,k=v]; rounds per H (rounds 2..R-1 are counted when there are 3 or more)
DEFAULT_CASES = [
    "tiny:configs/tiny.yaml",
    "small:configs/small.yaml:data.batch_size=1,data.seq_len=32",
]
DEFAULT_ROUNDS = {"tiny": {10: 5, 100: 4, 500: 3}, "small": {10: 4, 100: 3, 500: 1}}
DEFAULTS: dict[str, Any] = {"case": DEFAULT_CASES, "h": [10, 100, 500], "peers": 3, "timeout": 600.0, "setting": [""]}
SMOKE: dict[str, Any] = {
    # tiny.yaml's next_chunk_timeout (10 s), not the slack's 30: in 2 of 14 smoke runs 4-6 side by side on 2 cores
    # (and in two fresh-clone suites) only one of the two peers formed round 1's group (hivemind's matchmaking under
    # load; the other's attempt found none); that one then waited 30 s for the other's parts and lost the round
    "case": ["tiny:configs/tiny.yaml:data.batch_size=2,data.seq_len=32,swarm.next_chunk_timeout=10"],
    "h": [2],
    "rounds": 2,
    "peers": 2,
    "timeout": 120.0,
    "setting": [""],
}


def swarm_overrides(h: int, rounds: int, peers: int) -> list[str]:
    # the machine's cores are shared by every peer: the communication timeouts are widened so that a slow
    # round is measured rather than failed (a case's own settings come after these, and win)
    slack = ["swarm.allreduce_timeout=120", "swarm.next_chunk_timeout=30", "swarm.round_deadline=900"]
    return [*run_overrides(h, rounds, peers, "util"), *slack]


def analyse(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Utilisation of one peer from its metrics.jsonl records.

    With 2+ rounds: over ``steady_rounds`` (rounds 2..R-1 with their whole periods; 2 rounds: round 2 up to its
    record), and summed round_seconds.
    With 1 round: that round's compute_seconds / round_seconds (``first_round_only``: it includes waiting
    for the other peers' start-up).
    """
    if not records:
        return None
    first_only = len(records) < 2
    later, wall = (records, 0.0) if first_only else steady_rounds(records)
    compute = sum(r["compute_seconds"] for r in later)
    rounds = sum(r["round_seconds"] for r in later)
    wall = rounds if first_only else wall
    mm = sum(r["matchmaking_seconds"] for r in later)
    ar = sum(r["allreduce_seconds"] for r in later)
    waited = sum(r.get("comm_wait_seconds", r["matchmaking_seconds"] + r["allreduce_seconds"]) for r in later)
    n = len(later)
    return {
        "first_round_only": first_only,
        "rounds_counted": n,
        "counted_steps": [r["outer_step"] for r in later],
        "utilisation_wall": compute / wall if wall > 0 else None,
        "utilisation_rounds": compute / rounds if rounds > 0 else None,
        "compute_per_round": compute / n,
        "matchmaking_per_round": mm / n,
        "allreduce_per_round": ar / n,
        "other_per_round": (wall - compute - mm - ar) / n,
        "exposed_per_round": (wall - compute) / n,  # everything that is not inner steps: what overlap must hide
        "comm_wait_per_round": waited / n,  # of it, waiting for the exchange (all of it without overlap)
        "wall_per_round": wall / n,
        "matchmaking_by_step": {r["outer_step"]: r["matchmaking_seconds"] for r in later},
        "first_round": {k: records[0][k] for k in ("compute_seconds", "matchmaking_seconds", "allreduce_seconds")},
        "group_sizes": [r["group_size"] for r in records],
        "overlap_steps": [r.get("overlap_steps", 0) for r in later],  # eager: inner steps each exchange had
        "complete": [r["reduce_complete"] for r in records],
        "attempts": [r["reduce_attempts"] for r in records],
        "tokens_per_second": sum(r["tokens_per_second"] for r in later) / n,
        "tokens_per_round": sum(r["tokens"] for r in later) / n,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
    }


def protocol_matchmaking(stats: list[dict[str, Any]]) -> float | None:
    """Mean over counted rounds of the smallest matchmaking time in the group: the peer that was ready last
    waited for nobody, so its matchmaking is the protocol's own latency; the rest of the others' matchmaking
    is waiting for that peer (a straggler wait)."""
    steps = set.intersection(*(set(s["matchmaking_by_step"]) for s in stats)) if stats else set()
    if not steps:
        return None
    return sum(min(s["matchmaking_by_step"][k] for s in stats) for k in steps) / len(steps)


def run_case(
    name: str, config: str, sets: list[str], h: int, rounds: int, peers: int, timeout: float, workdir: Path
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]  # several settings of one case and H run one after the other
    dirs = [workdir / f"{name}_h{h}_{run}_peer{k}" for k in range(peers)]
    overrides = [*swarm_overrides(h, rounds, peers), *sets]
    per_peer = [[f"data.shard_index={k}"] for k in range(peers)]
    t0 = time.monotonic()
    boot, procs = start_swarm(config, overrides, dirs, per_peer)
    problem = ""
    try:
        deadline = t0 + timeout
        for k, p in enumerate(procs):
            left = deadline - time.monotonic()
            try:
                rc = p.wait(timeout=max(1.0, left))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the budget is spent
                problem = f"peer {k} still running after {timeout:.0f}s; stopped"
                break
            if rc != 0:
                problem = f"peer {k} exited with {rc}: {p.describe(10)}"
    finally:
        for p in [*procs, boot]:
            p.kill_group()
    per_peer_stats = [analyse(read_jsonl(d / "metrics.jsonl")) for d in dirs]
    ok = [s for s in per_peer_stats if s is not None]

    def mean(key: str) -> float | None:
        vals = [s[key] for s in ok if s[key] is not None]
        return sum(vals) / len(vals) if vals else None

    proto = protocol_matchmaking(ok)
    eager = "swarm.overlap=eager" in sets
    for st in ok:  # the same peer without its waits for slower peers: what a swarm of equal peers would get
        steps = set.intersection(*(set(o["matchmaking_by_step"]) for o in ok))
        wait = sum(st["matchmaking_by_step"][k] - min(o["matchmaking_by_step"][k] for o in ok) for k in steps)
        compute, wall = st["compute_per_round"] * st["rounds_counted"], st["wall_per_round"] * st["rounds_counted"]
        st["straggler_wait"] = wait
        st["utilisation_without_straggler_wait"] = compute / (wall - wait) if wall > wait else None
        if eager:  # matchmaking runs beside the next inner steps: a wait for slower peers is not told apart
            st["straggler_wait"] = st["utilisation_without_straggler_wait"] = None
    return {
        "case": name,
        "config": config,
        "overrides": sets,
        "h": h,
        "rounds": rounds,
        "peers": peers,
        "wall_seconds": time.monotonic() - t0,
        "problem": problem,
        "per_peer": per_peer_stats,
        "log_tail": log_tail(procs),
        "utilisation_wall": mean("utilisation_wall"),
        "utilisation_wall_min": min((s["utilisation_wall"] for s in ok), default=None),
        "utilisation_rounds": mean("utilisation_rounds"),
        "utilisation_without_straggler_wait": mean("utilisation_without_straggler_wait"),
        "compute_per_round": mean("compute_per_round"),
        "matchmaking_per_round": mean("matchmaking_per_round"),
        "matchmaking_protocol_per_round": proto,
        "tokens_per_round": mean("tokens_per_round"),
        "first_round_only": any(s["first_round_only"] for s in ok),
        "allreduce_per_round": mean("allreduce_per_round"),
        "exposed_per_round": mean("exposed_per_round"),
        "comm_wait_per_round": mean("comm_wait_per_round"),
        "other_per_round": mean("other_per_round"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", default=None, help="name:config[:k=v,k=v] (repeatable; tiny, small)")
    p.add_argument("--h", type=int, nargs="+", default=None, help="inner steps per round (10 100 500)")
    p.add_argument(
        "--rounds", type=int, default=None, help="rounds per run (default: tiny 4/3/2, small 3/2/1 for H 10/100/500)"
    )
    p.add_argument("--peers", type=int, default=None, help="run_peer processes per swarm (3)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per swarm run (600)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra overrides for every peer")
    p.add_argument(
        "--setting",
        action="append",
        default=None,
        help="k=v,k=v overrides measured as one more case of every --case and H (repeatable; '' = none)",
    )
    p.add_argument("--item", default="utilisation", help="result name (results/<item>.json)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/<item>.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    rec = Recorder(args.item, vars(args), smoke=args.smoke)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench_util_") as tmp:
        for spec, setting in ((c, s) for s in args.setting for c in args.case):
            name, config, *rest = spec.split(":")
            sets = [s for s in (rest[0].split(",") if rest else []) if s] + list(args.overrides)
            sets += [s for s in setting.split(",") if s]
            for h in args.h:
                rounds = args.rounds or DEFAULT_ROUNDS.get(name, {}).get(h, 2)
                print(f"utilisation: {name} H={h}, {rounds} rounds, {args.peers} peers", flush=True)
                c = run_case(name, config, sets, h, rounds, args.peers, args.timeout, Path(tmp))
                cases.append(c)
                u = c["utilisation_wall"]
                counted = f"{rounds - 1} round{'s' if rounds > 2 else ''} counted"
                if c["first_round_only"]:
                    counted = "1 round only: includes waiting for the other peers' start-up"
                print(
                    f"  utilisation {u if u is None else round(u, 4)} (rounds-based {c['utilisation_rounds']}),"
                    f" {c['wall_seconds']:.0f}s {c['problem'][:300]}",
                    flush=True,
                )
                if u is None:
                    rec.notes.append(f"{name} H={h}: not measured ({c['problem'] or 'fewer than 2 rounds'})")
                    continue
                settings = ", ".join(sets) if sets else "preset defaults"
                u_nsw = c["utilisation_without_straggler_wait"]
                nsw = "-" if u_nsw is None else f"{100 * u_nsw:.1f}% without waiting for slower peers"
                proto = c["matchmaking_protocol_per_round"]  # None when the peers counted no round in common
                proto = "-" if proto is None else f"{proto:.2f}s"
                rec.add(
                    figure=f"{name}, H={h}, {args.peers} peers ({settings}): compute share of wall ({nsw}); per "
                    f"round compute {c['compute_per_round']:.1f}s, exposed {c['exposed_per_round']:.2f}s (waiting "
                    f"for the exchange {c['comm_wait_per_round']:.2f}s); the exchange: matchmaking "
                    f"{c['matchmaking_per_round']:.2f}s (protocol {proto}), "
                    f"all-reduce {c['allreduce_per_round']:.2f}s; {c['tokens_per_round']:,.0f} tokens a round a peer "
                    f"({counted}){overlap_label(c['per_peer'])}",
                    value=u,
                    unit="share",
                    reference="all wall time in inner steps",
                    reference_value=1.0,
                    ratio=u,
                    ratio_kind="utilisation (target >= 0.99 at H=100)",
                    min_over_peers=c["utilisation_wall_min"],
                    rounds_based=c["utilisation_rounds"],
                    without_straggler_wait=c["utilisation_without_straggler_wait"],
                )
    rec.data["cases"] = cases
    rec.notes.append(
        "Utilisation = sum of compute_seconds (inner steps only) over rounds 2..R-1 divided by the wall time from "
        "round 2's inner steps' start to round R's (every counted round with its whole period; the start-up round and "
        "the last exchange, which nothing follows to hide, are out), averaged over the peers (rounds-based figure and "
        "per-peer minimum in the JSON). No evaluation, no checkpoints. Peers share the machine's cores (1 torch "
        "thread each), so their compute speeds differ from round to round and with fixed H the faster ones wait for "
        "the slowest; 'without waiting for slower peers' (blocking rounds only) removes, per round, each peer's "
        "matchmaking beyond the group's smallest (the protocol's own latency, paid by the last peer to arrive). "
        "'exposed' = wall - compute: everything the peer did besides inner steps (waiting for the exchange, "
        "pseudo-gradient, copies and finite checks, outer step, the checksum of the outer state); with "
        "swarm.overlap=eager the exchange's matchmaking and all-reduce run during the next inner steps, and only the "
        "wait at swarm.overlap_steps remains. inner.round_seconds cases: every peer trains until the round's end on "
        "the clock (H is then the cap), so nobody waits for a slower peer."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

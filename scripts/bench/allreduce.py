"""Item 2: one averaging round of the pseudo-gradient all-reduce against torch.distributed gloo all_reduce.

Usage:
    python scripts/bench/allreduce.py [--sizes 1000000 10000000 50000000] [--peers 2 3 4] [--reps 3]
    python scripts/bench/allreduce.py --smoke [--out DIR/allreduce.json]   # 2 peers, 20k params, 1 + 1 repeats

For each number of peers n, n worker processes start on 127.0.0.1 (this file with ``--worker``). Each holds
a hivemind DHT, one ``PseudoGradAverager`` per size (the class run_peer uses, configured like run_peer:
no compression, 2 MiB parts, ``target_group_size = min_group_size = n`` so a group forms when full) and a
gloo process group over the same n processes. Per size and repeat, every worker:
  A. gloo barrier, then ``averager.reduce([Δ], weight=1, payload)`` (its payload declares that weight;
     matchmaking + butterfly all-reduce + the completeness vote); the wall time of the call, and its phases
     as ReduceInfo reports them: input checks (``check_seconds``), copies into the shared buffers and of the
     result out (``copy_seconds``),
     ``matchmaking_seconds``, ``allreduce_seconds``; the wall time not in any of them is kept as ``unaccounted``;
  B. gloo barrier, then ``dist.all_reduce`` of the same fp32 tensor (the reference), and checks that
     gloo's mean equals hivemind's (max abs difference recorded).
A and B alternate (A/B/A/B...), so both see the same machine load. The first repeat of each size is a
warm-up and is not counted.

Bytes per peer, three ways (all recorded; the table shows the first):
  payload  ReduceInfo.bytes_sent: the protobuf bytes this peer's averager handed to p2pd (tensor parts to
           reducers and averaged parts back, measured by the averager itself; no libp2p framing/encryption;
           ReduceInfo.bytes_received is recorded too);
  tcp      bytes_sent of the TCP sockets of this peer's p2pd (kernel tcp_info via ``ss``): what went on the
           wire, libp2p framing, encryption and DHT chatter included;
  estimate the fp32 formula 2(n-1)/n x 4 bytes x size for the group that formed (``fp32_bytes_sent``: equal
           slices, no framing, one attempt), computed here.
The reference is the butterfly's lower bound 2(n-1)/n x 4 bytes x size; gloo's own TCP bytes are recorded too.
Output: scripts/bench/results/allreduce.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``: a
temporary directory). Failure: a group that stalls past ``--timeout`` or a worker that dies is killed (its process
group) and noted in ``problems``; the sizes it did not finish are listed as not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    Proc,
    Recorder,
    descendants,
    exit_on_sigterm,
    fill_defaults,
    free_port,
    median,
    single_thread_env,
    tcp_bytes_by_pid,
)

AVERAGER_SETTINGS: dict[str, Any] = {
    "matchmaking_time": 10.0,
    "request_timeout": 3.0,
    "allreduce_timeout": 120.0,
    "next_chunk_timeout": 30.0,
    "part_size_bytes": 2 * 1024 * 1024,
    "round_deadline": 300.0,
    "max_reduce_attempts": 3,  # SwarmConfig default (see the note on attempts in the report)
}
DEFAULTS: dict[str, Any] = {"sizes": [1_000_000, 10_000_000, 50_000_000], "peers": [2, 3, 4], "reps": 3, "warmup": 1}
SMOKE: dict[str, Any] = {"sizes": [20_000], "peers": [2], "reps": 1, "warmup": 1, "timeout": 90.0}


# ------------------------------------------------------------------------------------------------ worker


def _emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def worker(cfg: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hivemind.dht import DHT

    from p2p_diloco.engine import fp32_bytes_sent
    from p2p_diloco.swarm.averager import PseudoGradAverager
    from p2p_diloco.swarm.dht import wait_for_peers
    from p2p_diloco.swarm.protocol import GatherPayload, RoundTag

    rank, world, sizes = cfg["rank"], cfg["world"], cfg["sizes"]
    dht = DHT(initial_peers=cfg.get("initial_peers") or None, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    _emit("READY", {"maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    wait_for_peers(dht, world - 1, timeout=120)
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = {s: torch.randn(s, generator=gen, dtype=torch.float32) for s in sizes}
    averagers = {
        s: PseudoGradAverager(
            dht,
            [grads[s]],
            f"bench{s}n{world}",
            target_group_size=world,
            min_group_size=world,
            **cfg["averager"],
        )
        for s in sizes
    }
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    p2pd = [p for p, _, name in descendants(dht.pid) if name == "p2pd"]
    _emit("STARTED", {"p2pd": p2pd, "pid": os.getpid()})
    for size in sizes:
        averager = averagers[size]
        for rep in range(cfg["warmup"] + cfg["reps"]):
            # A: the hivemind round
            tcp0 = _tcp_sent(p2pd)
            dist.barrier()
            t0 = time.perf_counter()
            averaged, info = averager.reduce([grads[size]], 1.0, GatherPayload(RoundTag(rep, "bench"), 1))
            hm_wall = time.perf_counter() - t0
            dist.barrier()  # every peer's sends are done before the TCP counters are read
            time.sleep(0.2)
            tcp1 = _tcp_sent(p2pd)
            # B: gloo all_reduce of the same tensor
            buf = grads[size].clone()
            g0 = _tcp_sent([os.getpid()])
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            gloo_wall = time.perf_counter() - t0
            dist.barrier()
            g1 = _tcp_sent([os.getpid()])
            buf /= world
            diff = float((averaged[0] - buf).abs().max()) if info.complete else None
            _emit(
                "RESULT",
                {
                    "rank": rank,
                    "size": size,
                    "rep": rep,
                    "warmup": rep < cfg["warmup"],
                    "hivemind_wall": hm_wall,
                    "check_seconds": info.check_seconds,
                    "copy_seconds": info.copy_seconds,
                    "matchmaking_seconds": info.matchmaking_seconds,
                    "allreduce_seconds": info.allreduce_seconds,
                    "complete": info.complete,
                    "group_size": info.group_size,
                    "reason": info.reason,
                    "estimate_bytes": fp32_bytes_sent(size, info.group_size),
                    "payload_bytes": info.bytes_sent,
                    "payload_bytes_received": info.bytes_received,
                    "tcp_bytes": tcp1 - tcp0,
                    "gloo_wall": gloo_wall,
                    "gloo_tcp_bytes": g1 - g0,
                    "max_abs_diff_vs_gloo": diff,
                },
            )
            del averaged
    dist.barrier()
    dist.destroy_process_group()
    for averager in averagers.values():
        averager.shutdown()
    dht.shutdown()
    _emit("DONE", {"rank": rank})


def _tcp_sent(pids: list[int]) -> int:
    table = tcp_bytes_by_pid()
    return sum(table.get(p, {}).get("sent", 0) for p in pids)


# ------------------------------------------------------------------------------------------------ coordinator


def run_group(
    world: int, sizes: list[int], reps: int, warmup: int, timeout: float, workdir: Path
) -> tuple[list[dict[str, Any]], str]:
    """Start ``world`` workers, collect their RESULT records; returns (records, problem or "")."""
    env = single_thread_env(1)
    port = free_port()
    base = {
        "world": world,
        "sizes": sizes,
        "reps": reps,
        "warmup": warmup,
        "gloo_port": port,
        "averager": AVERAGER_SETTINGS,
    }
    me = str(Path(__file__).resolve())
    procs: list[Proc] = []
    records: list[dict[str, Any]] = []
    problem = ""
    deadline = time.monotonic() + timeout
    try:
        first = Proc([sys.executable, me, "--worker", json.dumps({**base, "rank": 0})], env=env)
        procs.append(first)
        ready = json.loads(first.wait_for_line(r"^READY ", timeout=120).string.split(" ", 1)[1])
        for rank in range(1, world):
            cfg = {**base, "rank": rank, "initial_peers": ready["maddrs"]}
            procs.append(Proc([sys.executable, me, "--worker", json.dumps(cfg)], env=env))
        done = set()
        while len(done) < world:
            if time.monotonic() > deadline:
                problem = f"stopped after {timeout:.0f}s (the budget for {world} peers)"
                break
            for rank, p in enumerate(procs):
                if rank in done:
                    continue
                line = p.next_line(0.2)
                if line is None:
                    if not p.alive() and p._queue.empty():
                        problem = f"worker {rank} exited early (rc {p.popen.poll()}): {p.describe(15)}"
                        done.add(rank)
                    continue
                if line.startswith("RESULT "):
                    records.append(json.loads(line.split(" ", 1)[1]))
                    rec = records[-1]
                    if rank == 0:
                        print(
                            f"  n={world} size={rec['size']:>9,} rep={rec['rep']} hivemind {rec['hivemind_wall']:.2f}s"
                            f" (check {rec['check_seconds']:.3f} + copy {rec['copy_seconds']:.3f}"
                            f" + mm {rec['matchmaking_seconds']:.2f} + ar {rec['allreduce_seconds']:.2f})"
                            f" gloo {rec['gloo_wall']:.3f}s complete={rec['complete']}",
                            flush=True,
                        )
                elif line.startswith("DONE "):
                    done.add(rank)
            if problem and "exited early" in problem:
                break
    except RuntimeError as exc:
        problem = str(exc)[:2000]
    finally:
        for p in procs:
            p.kill_group()
    if any(r["reason"] for r in records):  # keep the workers' logs (hivemind warns on stderr) for diagnosis
        problem = problem or ""
        for rank, p in enumerate(procs):
            tail = [line for line in p.stderr_lines if "WARN" in line or "ERROR" in line][-15:]
            if tail:
                records.append({"rank": rank, "diagnostics": tail})
    return records, problem


def mean(values: Any) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")


def summarise(world: int, size: int, recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    timed = [r for r in recs if r.get("size") == size and not r["warmup"]]
    reps = sorted({r["rep"] for r in timed})
    full = [rep for rep in reps if len([r for r in timed if r["rep"] == rep]) == world]
    if not full:
        return None
    by_rep = {rep: [r for r in timed if r["rep"] == rep] for rep in full}
    hm = [max(r["hivemind_wall"] for r in rs) for rs in by_rep.values()]
    gl = [max(r["gloo_wall"] for r in rs) for rs in by_rep.values()]
    every = [r for rs in by_rep.values() for r in rs]
    bound = 2 * (world - 1) / world * 4 * size
    diffs = [r["max_abs_diff_vs_gloo"] for r in every if r["max_abs_diff_vs_gloo"] is not None]
    return {
        "peers": world,
        "params": size,
        "reps": len(full),
        "round_seconds": median(hm),
        "round_seconds_all": hm,
        "matchmaking_seconds": median(r["matchmaking_seconds"] for r in every),
        "allreduce_seconds": median(r["allreduce_seconds"] for r in every),
        "gloo_seconds": median(gl),
        "gloo_seconds_all": gl,
        "complete_rounds": sum(r["complete"] for r in every),
        "peer_rounds": len(every),
        "group_sizes": sorted({r["group_size"] for r in every}),
        "bytes_lower_bound": bound,
        # per-peer bytes depend on the slice each peer reduces (load balancing): the mean over peers is the figure
        "payload_bytes": mean(r["payload_bytes"] for r in every),
        "payload_bytes_max": max(r["payload_bytes"] for r in every),
        "payload_bytes_received": mean(r["payload_bytes_received"] for r in every),
        "tcp_bytes": mean(r["tcp_bytes"] for r in every),
        "estimate_bytes": mean(r["estimate_bytes"] for r in every),
        "gloo_tcp_bytes": mean(r["gloo_tcp_bytes"] for r in every),
        # ReduceInfo's host-side phases: input checks + copies into the shared buffers and of the result out
        "check_seconds": median(r["check_seconds"] for r in every),
        "copy_seconds": median(r["copy_seconds"] for r in every),
        "host_overhead_seconds": median(r["check_seconds"] + r["copy_seconds"] for r in every),
        # the reduce() wall time that no phase reports (thread hand-offs, retries' bookkeeping)
        "unaccounted_seconds": median(
            r["hivemind_wall"]
            - r["check_seconds"]
            - r["copy_seconds"]
            - r["matchmaking_seconds"]
            - r["allreduce_seconds"]
            for r in every
        ),
        "max_abs_diff_vs_gloo": max(diffs) if diffs else None,
        "reasons": sorted({r["reason"] for r in every if r["reason"]}),
        "retried_peer_rounds": sum(1 for r in every if r["reason"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=None, help=f"parameters per tensor ({DEFAULTS['sizes']})")
    p.add_argument("--peers", type=int, nargs="+", default=None, help=f"group sizes ({DEFAULTS['peers']})")
    p.add_argument("--reps", type=int, default=None, help="timed repeats per size, after the warm-up (3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repeats per size first (1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per number of peers (420)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/allreduce.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), {**DEFAULTS, "timeout": 420.0}, SMOKE)
    exit_on_sigterm()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    rec = Recorder("allreduce", {k: v for k, v in vars(args).items() if k != "worker"}, smoke=args.smoke)
    summaries: list[dict[str, Any]] = []
    problems: dict[str, str] = {}
    diagnostics: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
        for world in args.peers:
            print(f"allreduce: {world} peers, sizes {args.sizes}", flush=True)
            recs, problem = run_group(world, args.sizes, args.reps, args.warmup, args.timeout, Path(tmp))
            diagnostics += [{"peers": world, **r} for r in recs if "diagnostics" in r]
            if problem:
                problems[str(world)] = problem
                print(f"  problem: {problem[:500]}", flush=True)
            for size in args.sizes:
                s = summarise(world, size, recs)
                if s is None:
                    rec.notes.append(f"{world} peers x {size:,} params: not measured ({problem or 'no records'})")
                    continue
                summaries.append(s)
    for s in summaries:
        n, size = s["peers"], s["params"]
        label = f"{n} peers, {size / 1e6:g}M params"
        rec.add(
            figure=f"{label}: round wall s (matchmaking {s['matchmaking_seconds']:.2f} + all-reduce "
            f"{s['allreduce_seconds']:.2f} + host-side copies/checks {s['host_overhead_seconds']:.2f} + other "
            f"{s['unaccounted_seconds']:.2f})"
            + (
                f"; {s['retried_peer_rounds']} of {s['peer_rounds']} peer-rounds retried after a detected "
                "incomplete all-reduce"
                if s["retried_peer_rounds"]
                else ""
            ),
            value=s["round_seconds"],
            unit="s",
            reference="gloo all_reduce, same tensor and processes",
            reference_value=s["gloo_seconds"],
            ratio=s["round_seconds"] / s["gloo_seconds"] if s["gloo_seconds"] > 0 else None,
            ratio_kind="x slower (lower is better)",
            group="allreduce_time",
        )
        rec.add(
            figure=f"{label}: bytes sent per peer, mean over peers (payload; p2pd TCP "
            f"{s['tcp_bytes'] / s['bytes_lower_bound']:.4f}x the bound)",
            value=s["payload_bytes"],
            unit="B",
            reference="butterfly lower bound 2(n-1)/n x 4 B x size",
            reference_value=s["bytes_lower_bound"],
            ratio=s["payload_bytes"] / s["bytes_lower_bound"],
            ratio_kind="x the bound (1.0 is optimal)",
            group="allreduce_bytes",
        )
    rec.data["summaries"] = summaries
    rec.data["diagnostics"] = diagnostics
    rec.data["problems"] = problems
    rec.data["averager_settings"] = AVERAGER_SETTINGS
    rec.notes.append(
        "Worker processes run with 1 torch thread each; all peers share this machine's cores and loopback. "
        "Round wall = slowest peer's reduce() call after a common gloo barrier; gloo = slowest rank's all_reduce. "
        "The phases are ReduceInfo's, medians over peers and repeats: matchmaking, all-reduce (with the "
        "completeness vote), host-side copies/checks = check_seconds (input shapes and finite check) + copy_seconds "
        "(copy into the shared buffers, copy of the result out and its finite check); other = the rest of the "
        "reduce() call's wall time."
    )
    rec.notes.append(
        "Bytes: 'payload' = ReduceInfo.bytes_sent, the protobuf bytes each averager handed to p2pd (measured by "
        "the averager); 'p2pd TCP' = bytes_sent of that peer's p2pd TCP sockets from the kernel (ss), libp2p "
        "framing, encryption and DHT traffic included; the fp32 formula's estimate is in results/allreduce.json."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Item 2: one averaging round of the pseudo-gradient all-reduce against torch.distributed gloo all_reduce,
per wire codec, and with the round overlapped with compute.

Usage:
    python scripts/bench/allreduce.py [--sizes 1000000 10000000 50000000] [--peers 2 3 4] [--reps 3]
        [--codec-peers 3] [--codec-sizes 10000000 50000000] [--codecs none fp16 bf16 int8]
        [--overlap-codecs none int8] [--overlap-factor 1.5 | --compute-seconds C]
    python scripts/bench/allreduce.py --smoke [--out DIR/allreduce.json]   # 2 peers, 20k params, 1 + 1 repeats

The default run takes about 6 minutes on the 2-core CPU machine (load average 4-10 from other jobs); ``--smoke``
about 20 s (2 peers, 20k params, the four codecs, overlap for none and int8).

For each number of peers n, n worker processes start on 127.0.0.1 (this file with ``--worker``). Each holds
a hivemind DHT, one ``PseudoGradAverager`` per (size, codec) (the class run_peer uses, configured like run_peer:
2 MiB parts, ``target_group_size = min_group_size = n`` so a group forms when full; ``compression`` = the codec;
each its own ``prefix``), one at a time (started for its rounds, shut down after them: after one round a
50M-parameter averager process holds about 600 MB, and the machine is shared), and a gloo process group over the
same n processes. Three measurements, all in the same processes:

1. fp32 sweep (codec none; every size in ``--sizes``, every n in ``--peers``). Per size and repeat, every worker:
  A. gloo barrier, then ``averager.reduce([Δ], weight=1, payload)`` (its payload declares that weight;
     matchmaking + butterfly all-reduce + the completeness vote); the wall time of the call, and its phases
     as ReduceInfo reports them: input checks (``check_seconds``), the copy into the shared buffers and the
     result's finite check (``copy_seconds``; until the result was handed over in place, also its copy out: the
     rows of results/allreduce.json, see its supplementary ``result_in_place``),
     ``matchmaking_seconds``, ``allreduce_seconds``; the wall time not in any of them is kept as ``unaccounted``;
  B. gloo barrier, then ``dist.all_reduce`` of the same fp32 tensor (the reference), and checks that
     gloo's mean equals hivemind's (max abs difference recorded).
  A and B alternate (A/B/A/B...), so both see the same machine load. The first repeat of each size is a
  warm-up and is not counted.
2. Codecs (only n in ``--codec-peers``, default 3, and sizes in ``--codec-sizes``, default 10M and 50M: all four
  codecs x both sizes x 2-4 peers would not fit the ~12 min budget of this item). The same A/B steps for every codec
  in ``--codecs``, codec after codec (none, fp16, bf16, int8: each its warm-up and repeats, A/B alternating, so each
  codec's ratio to gloo is taken under the load of its own repeats); codec none is the fp32 sweep's row for that
  (n, size). Figures: round wall vs gloo's fp32 all_reduce of the same tensor; payload bytes per peer vs gloo's
  fp32 bytes (the butterfly's fp32 bound
  2(n-1)/n x 4 B x size, which is also what gloo's ring moves per rank), and vs the codec's expected butterfly size
  2(n-1)/n x sum of ``Codec(name).encoded_size(part)`` over the 2 MiB parts hivemind cuts the vector into (exact
  up to protobuf framing: the mean over the group's peers does not depend on which peer reduces which part).
  A compressed codec's mean is not gloo's fp32 mean: its max abs difference is recorded, not checked.
3. Overlap (same n and sizes, codecs ``--overlap-codecs``: none and int8; fp16/bf16 on request, ~1 min each at
  50M). Like engine.py's ``swarm.overlap=eager`` (Worker.launch / drain): each worker submits ``averager.reduce``
  to a ``ThreadPoolExecutor(1)`` and meanwhile its main thread runs
  a compute stand-in (a loop of 256x256 fp32 ``torch.mm`` on 1 thread, the inner steps' place) for a fixed C
  seconds, then waits for the result: exposed communication = that wait (ReduceInfo.wait_seconds, as drain()
  measures it). C per size = ``--overlap-factor`` (1.5) x the largest, over the overlap codecs, median blocking round
  wall of step 2 for that size (the slowest peer's, agreed across workers by a gloo MAX), or ``--compute-seconds``.
  Per codec a fresh averager (its own prefix), its first repeat a warm-up; per repeat: the stand-in alone for C s on
  every worker (no all-reduce: its throughput reference), the overlapped round, and gloo's all_reduce (the reference
  for the exposed time; same processes, fp32).
  Figure: exposed per round (slowest peer) / gloo's all_reduce wall (the issue's target: at most 1.0x with
  overlap). The stand-in's slowdown (matmuls/s alone over matmuls/s overlapped) is reported with it.
  Caveat for a CPU-only machine with few cores (this one: 2 cores for n workers, each with its averager process and
  p2pd): the stand-in competes with the averager and p2pd for the cores, so the all-reduce runs slower in the
  background than blocking (it may then not fit in C) and the compute itself slows down; on a GPU the inner steps
  would leave the CPU to the all-reduce. The slowdown figure says how much compute the overlap cost here.

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
temporary directory): ``summaries`` (fp32 sweep), ``codecs`` (step 2), ``overlap`` (step 3). Failure: a group that
stalls past ``--timeout`` or a worker that dies is killed (its process group) and noted in ``problems``; the sizes
it did not finish are listed as not measured.
"""

from __future__ import annotations

import argparse
import json
import logging
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

from p2p_diloco.codec import CODECS, DENSE, Codec  # noqa: E402

CODEC_NAMES = tuple(CODECS)
AVERAGER_SETTINGS: dict[str, Any] = {
    "matchmaking_time": 10.0,
    "request_timeout": 3.0,
    "allreduce_timeout": 120.0,
    "next_chunk_timeout": 30.0,
    "part_size_bytes": 2 * 1024 * 1024,
    "round_deadline": 300.0,
    "max_reduce_attempts": 3,  # SwarmConfig default (see the note on attempts in the report)
}
DEFAULTS: dict[str, Any] = {
    "sizes": [1_000_000, 10_000_000, 50_000_000],
    "peers": [2, 3, 4],
    "reps": 3,
    "warmup": 1,
    "codec_peers": [3],
    "codec_sizes": [10_000_000, 50_000_000],
    "codecs": list(DENSE),  # the estimate is exact for these (a top-k codec's means depend on the data)
    "overlap_codecs": ["none", "int8"],
    "overlap_factor": 1.5,
}
SMOKE_AVERAGER: dict[str, Any] = {"allreduce_timeout": 20.0, "next_chunk_timeout": 10.0, "round_deadline": 100.0}
SMOKE: dict[str, Any] = {  # tests/test_bench_smoke.py runs it beside 10 other smokes on 2 cores: kept short
    "sizes": [20_000],
    "peers": [2],
    "reps": 1,
    "warmup": 1,
    "timeout": 200.0,
    "codec_peers": [2],
    "codec_sizes": [20_000],
    "codecs": ["none", "int8"],
    "overlap_codecs": ["none", "int8"],
}
STANDIN_DIM = 256  # the compute stand-in: torch.mm of two DIM x DIM fp32 matrices per iteration (~1 ms, 1 thread)


# ------------------------------------------------------------------------------------------------ worker


def _emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def _trail(what: str) -> None:
    """One line on stderr per phase: the parent quotes a stalled worker's last one in its report."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def plan(cfg: dict[str, Any]) -> list[tuple[int, list[str], list[str]]]:
    """[(size, codecs of its blocking rounds, codecs of its overlapped rounds)] in the order the workers run them."""
    sweep, codec_sizes = set(cfg["sizes"]), set(cfg["codec_sizes"])
    out = []
    for size in sorted(sweep | codec_sizes):
        if size in codec_sizes:
            codecs = ["none", *[c for c in cfg["codecs"] if c != "none"]]
            out.append((size, codecs, [c for c in codecs if c in cfg["overlap_codecs"]]))
        else:
            out.append((size, ["none"], []))
    return out


def worker(cfg: dict[str, Any]) -> None:
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hivemind.dht import DHT

    from p2p_diloco.protocol import GatherPayload, RoundTag
    from p2p_diloco.rounds import fp32_bytes_sent
    from p2p_diloco.swarm.averager import PseudoGradAverager
    from p2p_diloco.swarm.dht import wait_for_peers

    rank, world = cfg["rank"], cfg["world"]
    # the averager's own account of each round (its group, votes, failures) on stderr, quoted when a worker stalls
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s", "%H:%M:%S"))
    logging.getLogger("p2p_diloco").addHandler(handler)
    logging.getLogger("p2p_diloco").setLevel(logging.INFO)
    steps = plan(cfg)
    dht = DHT(initial_peers=cfg.get("initial_peers") or None, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    _emit("READY", {"maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    wait_for_peers(dht, world - 1, timeout=120)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    p2pd = [p for p, _, name in descendants(dht.pid) if name == "p2pd"]
    _emit("STARTED", {"p2pd": p2pd, "pid": os.getpid()})
    pool = ThreadPoolExecutor(1, thread_name_prefix="exchange")  # as Worker.run_round with swarm.overlap eager
    mat_a, mat_b = torch.randn(STANDIN_DIM, STANDIN_DIM), torch.randn(STANDIN_DIM, STANDIN_DIM)
    mat_c = torch.empty(STANDIN_DIM, STANDIN_DIM)

    def standin(seconds: float) -> tuple[int, float]:
        """The compute stand-in: matmuls for ``seconds``; (iterations, seconds it took)."""
        n, t0 = 0, time.perf_counter()
        while True:
            torch.mm(mat_a, mat_b, out=mat_c)
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return n, elapsed

    def exchange(averager: Any, grad: torch.Tensor, rep: int, done: dict[str, float]) -> Any:
        """The exchange thread's job (Worker.run_round: ``submit(reducer.reduce, ...)``), noting when it ended."""
        out = averager.reduce([grad], 1.0, GatherPayload(RoundTag(rep, "bench"), 1))
        done["t"] = time.perf_counter()
        return out

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def gloo_round(grad: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        """B: gloo all_reduce of the same fp32 tensor -> (mean, wall, this process's TCP bytes sent)."""
        buf = grad.clone()
        g0 = _tcp_sent([os.getpid()])
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        wall = time.perf_counter() - t0
        dist.barrier()
        g1 = _tcp_sent([os.getpid()])
        buf /= world
        return buf, wall, g1 - g0

    def info_fields(info: Any, size: int) -> dict[str, Any]:
        return {
            "check_seconds": info.check_seconds,
            "copy_seconds": info.copy_seconds,
            "matchmaking_seconds": info.matchmaking_seconds,
            "allreduce_seconds": info.allreduce_seconds,
            "complete": info.complete,
            "group_size": info.group_size,
            "reason": info.reason,
            "attempts": info.attempts,
            "estimate_bytes": fp32_bytes_sent(size, info.group_size),
            "payload_bytes": info.bytes_sent,
            "payload_bytes_received": info.bytes_received,
        }

    def diffs(averaged: torch.Tensor, reference: torch.Tensor, complete: bool) -> dict[str, Any]:
        if not complete:
            return {"max_abs_diff_vs_gloo": None, "max_abs_gloo": None}
        return {
            "max_abs_diff_vs_gloo": float((averaged - reference).abs().max()),
            "max_abs_gloo": float(reference.abs().max()),
        }

    def start(size: int, codec: str, grad: torch.Tensor, prefix: str) -> Any:
        _trail(f"starting the {codec} averager ({prefix})")
        averager = PseudoGradAverager(
            dht,
            [grad],
            prefix,
            target_group_size=world,
            min_group_size=world,
            compression=codec,
            **cfg["averager"],
        )
        _trail("averager started; waiting for the other workers' (gloo barrier)")
        dist.barrier()  # every peer's averager is up before the first round
        return averager

    def stop(averager: Any) -> None:
        _trail("waiting for the other workers before the averager's shutdown (gloo barrier)")
        dist.barrier()
        averager.shutdown()
        _trail("averager shut down")

    gen = torch.Generator().manual_seed(1000 + rank)
    for size, codecs, overlap_codecs in steps:
        grad = torch.randn(size, generator=gen, dtype=torch.float32)
        walls: dict[str, list[float]] = {}  # per codec: the slowest peer's blocking wall per timed repeat
        # one averager at a time: after a round a 50M-parameter averager process keeps ~3x the vector (600 MB)
        for codec in codecs:
            averager = start(size, codec, grad, f"bench{size}n{world}{codec}")
            walls[codec] = []
            for rep in range(cfg["warmup"] + cfg["reps"]):
                # A: the hivemind round, blocking
                tcp0 = _tcp_sent(p2pd)
                dist.barrier()
                _trail(f"blocking round {rep} ({codec})")
                t0 = time.perf_counter()
                averaged, info = averager.reduce([grad], 1.0, GatherPayload(RoundTag(rep, "bench"), 1))
                hm_wall = time.perf_counter() - t0
                dist.barrier()  # every peer's sends are done before the TCP counters are read
                time.sleep(0.2)
                tcp1 = _tcp_sent(p2pd)
                # B: gloo all_reduce of the same fp32 tensor
                reference, gloo_wall, gloo_bytes = gloo_round(grad)
                round_wall = slowest(hm_wall)
                if rep >= cfg["warmup"]:
                    walls[codec].append(round_wall)
                _emit(
                    "RESULT",
                    {
                        "phase": "blocking",
                        "codec": codec,
                        "rank": rank,
                        "size": size,
                        "rep": rep,
                        "warmup": rep < cfg["warmup"],
                        "hivemind_wall": hm_wall,
                        **info_fields(info, size),
                        "tcp_bytes": tcp1 - tcp0,
                        "gloo_wall": gloo_wall,
                        "gloo_tcp_bytes": gloo_bytes,
                        **diffs(averaged[0], reference, info.complete),
                    },
                )
                del averaged, reference
            stop(averager)
        if overlap_codecs:
            compute = cfg.get("compute_seconds") or cfg["overlap_factor"] * max(
                median(walls[c]) for c in overlap_codecs
            )
        for codec in overlap_codecs:
            # a fresh averager (its own prefix: the blocking one's DHT records may outlive it); warm-up repeat first
            averager = start(size, codec, grad, f"bench{size}n{world}{codec}overlap")
            for rep in range(cfg["warmup"] + cfg["reps"]):
                # the stand-in alone, every worker at once: its throughput without an all-reduce
                dist.barrier()
                n_alone, t_alone = standin(compute)
                # the overlapped round: reduce in the exchange thread, the stand-in meanwhile, then wait
                done: dict[str, float] = {}
                dist.barrier()
                _trail(f"overlapped round {rep} ({codec})")
                t0 = time.perf_counter()
                future = pool.submit(exchange, averager, grad, rep, done)
                n_over, t_over = standin(compute)
                t1 = time.perf_counter()
                averaged, info = future.result()
                info.wait_seconds = time.perf_counter() - t1  # as Worker.drain measures it
                background = done["t"] - t0
                dist.barrier()
                reference, gloo_wall, _ = gloo_round(grad)
                _emit(
                    "RESULT",
                    {
                        "phase": "overlap",
                        "codec": codec,
                        "rank": rank,
                        "size": size,
                        "rep": rep,
                        "warmup": rep < cfg["warmup"],
                        "compute_seconds": compute,
                        "exposed_seconds": info.wait_seconds,
                        "background_wall": background,
                        "standin_alone_iters": n_alone,
                        "standin_alone_seconds": t_alone,
                        "standin_overlap_iters": n_over,
                        "standin_overlap_seconds": t_over,
                        **info_fields(info, size),
                        "gloo_wall": gloo_wall,
                        **diffs(averaged[0], reference, info.complete),
                    },
                )
                del averaged, reference
            stop(averager)
        del grad
    dist.barrier()
    dist.destroy_process_group()
    pool.shutdown(wait=True)
    dht.shutdown()
    _emit("DONE", {"rank": rank})


def _tcp_sent(pids: list[int]) -> int:
    table = tcp_bytes_by_pid()
    return sum(table.get(p, {}).get("sent", 0) for p in pids)


# ------------------------------------------------------------------------------------------------ coordinator


def run_group(world: int, cfg: dict[str, Any], timeout: float, workdir: Path) -> tuple[list[dict[str, Any]], str]:
    """Start ``world`` workers, collect their RESULT records; returns (records, problem or "")."""
    env = single_thread_env(1)
    port = free_port()
    base = {**cfg, "world": world, "gloo_port": port}
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
                where = "; ".join(
                    f"worker {rank}: {sum(r['rank'] == rank for r in records)} results, last said"
                    f" {[line[-300:] for line in p.stderr_lines[-8:]] or 'nothing'}"
                    for rank, p in enumerate(procs)
                )
                problem = f"stopped after {timeout:.0f}s (the budget for {world} peers; {where})"
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
                    if rank == 0:
                        print(_progress(world, records[-1]), flush=True)
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
        for rank, p in enumerate(procs):
            tail = [line for line in p.stderr_lines if "WARN" in line or "ERROR" in line][-15:]
            if tail:
                records.append({"rank": rank, "diagnostics": tail})
    return records, problem


def _progress(world: int, rec: dict[str, Any]) -> str:
    head = f"  n={world} size={rec['size']:>9,} {rec['codec']:>4} rep={rec['rep']}"
    if rec["phase"] == "overlap":
        return (
            f"{head} overlap: stand-in {rec['compute_seconds']:.2f}s ({rec['standin_overlap_iters']} mm vs"
            f" {rec['standin_alone_iters']} alone), reduce in background {rec['background_wall']:.2f}s, exposed"
            f" {rec['exposed_seconds']:.3f}s, gloo {rec['gloo_wall']:.3f}s complete={rec['complete']}"
        )
    return (
        f"{head} hivemind {rec['hivemind_wall']:.2f}s (check {rec['check_seconds']:.3f} + copy"
        f" {rec['copy_seconds']:.3f} + mm {rec['matchmaking_seconds']:.2f} + ar {rec['allreduce_seconds']:.2f})"
        f" gloo {rec['gloo_wall']:.3f}s {rec['payload_bytes'] / 1e6:.1f} MB complete={rec['complete']}"
    )


def mean(values: Any) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")


def _full_reps(world: int, recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """{rep: its records} for the timed repeats that every one of the ``world`` peers reported."""
    timed = [r for r in recs if not r["warmup"]]
    reps = sorted({r["rep"] for r in timed})
    by_rep = {rep: [r for r in timed if r["rep"] == rep] for rep in reps}
    return {rep: rs for rep, rs in by_rep.items() if len(rs) == world}


def expected_codec_bytes(size: int, world: int, codec: str, part_size_bytes: int) -> float:
    """Mean payload bytes per peer of one butterfly round with ``codec``: 2(n-1)/n x the encoded size of the whole
    vector, cut into hivemind's parts (part_size_bytes / 4 values each: WireCodec's ratio is 1). Each peer sends
    every part it does not reduce and its reduced parts to the n-1 others, so the mean over the group is that,
    whichever peer reduces which part; protobuf framing (a few dozen bytes per part) not included."""
    return 2 * (world - 1) / world * Codec(codec).parts_size(size, part_size_bytes // 4)


def summarise(world: int, size: int, recs: list[dict[str, Any]], codec: str = "none") -> dict[str, Any] | None:
    mine = [r for r in recs if r.get("size") == size and r.get("codec") == codec and r.get("phase") == "blocking"]
    by_rep = _full_reps(world, mine)
    if not by_rep:
        return None
    hm = [max(r["hivemind_wall"] for r in rs) for rs in by_rep.values()]
    gl = [max(r["gloo_wall"] for r in rs) for rs in by_rep.values()]
    every = [r for rs in by_rep.values() for r in rs]
    bound = 2 * (world - 1) / world * 4 * size
    diffs = [r["max_abs_diff_vs_gloo"] for r in every if r["max_abs_diff_vs_gloo"] is not None]
    scale = [r["max_abs_gloo"] for r in every if r.get("max_abs_gloo")]
    return {
        "peers": world,
        "params": size,
        "codec": codec,
        "reps": len(by_rep),
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
        "expected_codec_bytes": expected_codec_bytes(size, world, codec, AVERAGER_SETTINGS["part_size_bytes"]),
        # per-peer bytes depend on the slice each peer reduces (load balancing): the mean over peers is the figure
        "payload_bytes": mean(r["payload_bytes"] for r in every),
        "payload_bytes_max": max(r["payload_bytes"] for r in every),
        "payload_bytes_received": mean(r["payload_bytes_received"] for r in every),
        "tcp_bytes": mean(r["tcp_bytes"] for r in every),
        "estimate_bytes": mean(r["estimate_bytes"] for r in every),
        "gloo_tcp_bytes": mean(r["gloo_tcp_bytes"] for r in every),
        # ReduceInfo's host-side phases: input checks + the copy into the shared buffers and the result's check
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
        "max_rel_diff_vs_gloo": max(diffs) / max(scale) if diffs and scale else None,
        "reasons": sorted({r["reason"] for r in every if r["reason"]}),
        "retried_peer_rounds": sum(1 for r in every if r["reason"]),
        "attempts_max": max(r["attempts"] for r in every),  # payload bytes are summed over a round's attempts
    }


def summarise_overlap(world: int, size: int, codec: str, recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    mine = [r for r in recs if r.get("size") == size and r.get("codec") == codec and r.get("phase") == "overlap"]
    by_rep = _full_reps(world, mine)
    if not by_rep:
        return None
    every = [r for rs in by_rep.values() for r in rs]
    exposed = [max(r["exposed_seconds"] for r in rs) for rs in by_rep.values()]
    gloo = [max(r["gloo_wall"] for r in rs) for rs in by_rep.values()]
    background = [max(r["background_wall"] for r in rs) for rs in by_rep.values()]
    # per peer and repeat: matmuls per second alone over matmuls per second while the reduce ran
    slowdown = [
        (r["standin_alone_iters"] / r["standin_alone_seconds"])
        / (r["standin_overlap_iters"] / r["standin_overlap_seconds"])
        for r in every
    ]
    return {
        "peers": world,
        "params": size,
        "codec": codec,
        "reps": len(by_rep),
        "compute_seconds": every[0]["compute_seconds"],
        "exposed_seconds": median(exposed),
        "exposed_seconds_all": exposed,
        "exposed_seconds_peer_mean": median(mean(r["exposed_seconds"] for r in rs) for rs in by_rep.values()),
        "gloo_seconds": median(gloo),
        "gloo_seconds_all": gloo,
        "background_round_seconds": median(background),
        "background_allreduce_seconds": median(r["allreduce_seconds"] for r in every),
        "background_matchmaking_seconds": median(r["matchmaking_seconds"] for r in every),
        "standin_slowdown": median(slowdown),
        "standin_slowdown_all": slowdown,
        "standin_alone_iters_per_s": median(r["standin_alone_iters"] / r["standin_alone_seconds"] for r in every),
        "standin_overlap_iters_per_s": median(r["standin_overlap_iters"] / r["standin_overlap_seconds"] for r in every),
        "complete_rounds": sum(r["complete"] for r in every),
        "peer_rounds": len(every),
        "payload_bytes": mean(r["payload_bytes"] for r in every),
        "reasons": sorted({r["reason"] for r in every if r["reason"]}),
    }


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB"


def _retried(s: dict[str, Any]) -> str:
    if not s.get("retried_peer_rounds"):
        return ""
    return f"; {s['retried_peer_rounds']} of {s['peer_rounds']} peer-rounds retried after a detected incomplete round"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=None, help=f"fp32 sweep: params ({DEFAULTS['sizes']})")
    p.add_argument("--peers", type=int, nargs="+", default=None, help=f"fp32 sweep: group sizes ({DEFAULTS['peers']})")
    p.add_argument("--reps", type=int, default=None, help="timed repeats per size, after the warm-up (3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repeats per size first (1)")
    p.add_argument("--codec-peers", type=int, nargs="*", default=None, help="group sizes of the codec/overlap runs (3)")
    p.add_argument("--codec-sizes", type=int, nargs="*", default=None, help=f"their params ({DEFAULTS['codec_sizes']})")
    p.add_argument("--codecs", nargs="+", choices=CODEC_NAMES, default=None, help="codecs compared (all; none always)")
    p.add_argument(
        "--overlap-codecs", nargs="*", choices=CODEC_NAMES, default=None, help="overlapped rounds (none int8)"
    )
    p.add_argument("--overlap-factor", type=float, default=None, help="compute stand-in = this x blocking round (1.5)")
    p.add_argument("--compute-seconds", type=float, default=None, help="compute stand-in seconds (overrides factor)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per number of peers (900)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/allreduce.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), {**DEFAULTS, "timeout": 900.0}, SMOKE)
    exit_on_sigterm()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    rec = Recorder("allreduce", {k: v for k, v in vars(args).items() if k != "worker"}, smoke=args.smoke)
    summaries: list[dict[str, Any]] = []
    codec_summaries: list[dict[str, Any]] = []
    overlap: list[dict[str, Any]] = []
    problems: dict[str, str] = {}
    diagnostics: list[dict[str, Any]] = []
    # a smoke's stalled all-reduce gives up within seconds and is retried (attempts are in the records), where the
    # full run's 120 s timeout would eat the smoke's whole budget (seen twice in CI's suite)
    averager_settings = {**AVERAGER_SETTINGS, **(SMOKE_AVERAGER if args.smoke else {})}
    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
        for world in sorted(set(args.peers) | set(args.codec_peers)):
            cfg = {
                "sizes": args.sizes if world in args.peers else [],
                "codec_sizes": args.codec_sizes if world in args.codec_peers else [],
                "codecs": args.codecs,
                "overlap_codecs": args.overlap_codecs,
                "overlap_factor": args.overlap_factor,
                "compute_seconds": args.compute_seconds,
                "reps": args.reps,
                "warmup": args.warmup,
                "averager": averager_settings,
            }
            steps = plan(cfg)
            print(f"allreduce: {world} peers, " + "; ".join(f"{s:,}: {'/'.join(c)}" for s, c, _ in steps), flush=True)
            recs, problem = run_group(world, cfg, args.timeout, Path(tmp))
            diagnostics += [{"peers": world, **r} for r in recs if "diagnostics" in r]
            recs = [r for r in recs if "diagnostics" not in r]
            if problem:
                problems[str(world)] = problem
                print(f"  problem: {problem[:500]}", flush=True)
            for size, codecs, overlap_codecs in steps:
                for codec in codecs:
                    s = summarise(world, size, recs, codec)
                    if s is None:
                        rec.notes.append(
                            f"{world} peers x {size:,} params, codec {codec}: not measured ({problem or 'no records'})"
                        )
                        continue
                    if codec == "none" and size in cfg["sizes"]:
                        summaries.append(s)
                    if size in cfg["codec_sizes"]:
                        codec_summaries.append(s)
                for codec in overlap_codecs:
                    o = summarise_overlap(world, size, codec, recs)
                    if o is None:
                        rec.notes.append(
                            f"{world} peers x {size:,} params, codec {codec} overlapped: not measured "
                            f"({problem or 'no records'})"
                        )
                        continue
                    overlap.append(o)
    for s in summaries:
        n, size = s["peers"], s["params"]
        label = f"{n} peers, {size / 1e6:g}M params"
        rec.add(
            figure=f"{label}: round wall s (matchmaking {s['matchmaking_seconds']:.2f} + all-reduce "
            f"{s['allreduce_seconds']:.2f} + host-side copies/checks {s['host_overhead_seconds']:.2f} + other "
            f"{s['unaccounted_seconds']:.2f})" + _retried(s),
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
    fp32 = {(s["peers"], s["params"]): s for s in codec_summaries if s["codec"] == "none"}
    swept = {(s["peers"], s["params"]) for s in summaries}
    for s in codec_summaries:
        n, size, codec = s["peers"], s["params"], s["codec"]
        if codec == "none" and (n, size) in swept:
            continue  # the fp32 sweep's rows
        label = f"{n} peers, {size / 1e6:g}M params, codec {codec}"
        base = fp32.get((n, size))
        versus = f"; codec none {base['round_seconds']:.2f} s" if base and codec != "none" else ""
        rec.add(
            figure=f"{label}: round wall s (matchmaking {s['matchmaking_seconds']:.2f} + all-reduce "
            f"{s['allreduce_seconds']:.2f} + host-side {s['host_overhead_seconds']:.2f}{versus})" + _retried(s),
            value=s["round_seconds"],
            unit="s",
            reference="gloo fp32 all_reduce, same tensor and processes",
            reference_value=s["gloo_seconds"],
            ratio=s["round_seconds"] / s["gloo_seconds"] if s["gloo_seconds"] > 0 else None,
            ratio_kind="x slower (lower is better)",
            group="allreduce_codec_time",
        )
        rec.add(
            figure=f"{label}: payload bytes sent per peer, mean over peers "
            f"({s['payload_bytes'] / s['expected_codec_bytes']:.4f}x the codec's expected butterfly size "
            f"{_mib(s['expected_codec_bytes'])})",
            value=s["payload_bytes"],
            unit="B",
            reference="gloo's fp32 bytes = butterfly fp32 bound 2(n-1)/n x 4 B x size",
            reference_value=s["bytes_lower_bound"],
            ratio=s["payload_bytes"] / s["bytes_lower_bound"],
            ratio_kind="x fp32's bytes (lower is better)",
            group="allreduce_codec_bytes",
        )
    for o in overlap:
        n, size, codec = o["peers"], o["params"], o["codec"]
        base = next((s for s in codec_summaries if (s["peers"], s["params"], s["codec"]) == (n, size, codec)), None)
        blocking = f"blocking round {base['round_seconds']:.2f} s, " if base else ""
        rec.add(
            figure=f"{n} peers, {size / 1e6:g}M params, codec {codec}, overlapped with {o['compute_seconds']:.2f} s "
            f"of compute stand-in: exposed communication per round, slowest peer ({blocking}in the background "
            f"{o['background_round_seconds']:.2f} s; stand-in slowdown vs alone {o['standin_slowdown']:.2f}x)",
            value=o["exposed_seconds"],
            unit="s",
            reference="gloo fp32 all_reduce, same tensor and processes",
            reference_value=o["gloo_seconds"],
            ratio=o["exposed_seconds"] / o["gloo_seconds"] if o["gloo_seconds"] > 0 else None,
            ratio_kind="x gloo (target <= 1.0 with overlap)",
            group="allreduce_overlap",
        )
    rec.data["summaries"] = summaries
    rec.data["codecs"] = codec_summaries
    rec.data["overlap"] = overlap
    rec.data["diagnostics"] = diagnostics
    rec.data["problems"] = problems
    rec.data["averager_settings"] = averager_settings
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
    if codec_summaries:
        rec.notes.append(
            "Codecs (swarm.compression) at "
            + ", ".join(f"{n}" for n in sorted(set(args.codec_peers)))
            + " peers only, sizes "
            + ", ".join(f"{s / 1e6:g}M" for s in args.codec_sizes)
            + ", one PseudoGradAverager per codec, codec after codec, each with its own A/B gloo reference. Bytes: "
            "payload vs "
            "gloo's fp32 bytes (the fp32 bound 2(n-1)/n x 4 B x size, which gloo's ring also moves per rank); the "
            "figure text gives payload vs the codec's expected butterfly size (2(n-1)/n x the encoded size of the "
            "vector's 2 MiB parts, codec.Codec.encoded_size). Encoding and decoding run in the averager process "
            "on the same cores as everything else: on loopback a codec saves bytes that cost little, so its wall "
            "time can exceed fp32's."
        )
    if overlap:
        rec.notes.append(
            "Overlap (swarm.overlap eager, as Worker.launch/drain): averager.reduce runs in a ThreadPoolExecutor(1) "
            "while the main thread runs a compute stand-in (256x256 fp32 matmuls, 1 thread) for a fixed C s "
            + (
                f"(--compute-seconds {args.compute_seconds:g})"
                if args.compute_seconds
                else f"(C = {args.overlap_factor:g} x the largest median blocking round wall of the overlapped codecs "
                "for that size)"
            )
            + "; exposed = the wait for the result after the stand-in (ReduceInfo.wait_seconds), slowest peer, "
            "median over repeats, against gloo's fp32 all_reduce of the same tensor measured right after. "
            "On this CPU-only machine the stand-in competes with the averager processes and p2pd for the same "
            "cores (n workers on " + str(os.cpu_count()) + " cores): the all-reduce runs slower in the background "
            "than blocking, and the stand-in slows down too (its slowdown: matmuls/s with every worker running it "
            "alone, measured in the same repeat, over matmuls/s while the reduce ran)."
        )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

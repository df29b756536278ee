"""Item 14: the swarm at 16 to 256 peers on one machine: many real peers per process, each with its own p2pd.

Usage:
    python scripts/bench/scale.py --peers 16                  # 16 peers, 8 per process, 4 rounds
    python scripts/bench/scale.py --peers 64 --group 16 --per-process 32 --rounds 4 --merge-pages --p2pd-gogc 50
    python scripts/bench/scale.py --smoke                     # 6 peers in groups of 3, 2 rounds (CI)

Each peer is a real TrainingPeer (swarm/peer.py: its DHT node, its averager with the round's matchmaking, groups
and vote, its announcements, state downloads, healing), only lighter: its DHT node and averager run as threads of a
host process (swarm/in_thread.py, ``--per-process`` peers per process sharing one DataPipeline) and its model is a
micro Llama (hidden 16, one layer: ~10k parameters, tiny tensors) taking ``--h`` steps of 2 x 16 tokens a round.
Every peer keeps its own p2pd (a libp2p identity is one daemon). A bootstrap node starts first, then the host
processes one after another, each once the previous one's peers are up (all at once, 128 peers overloaded the machine
at start: load 262, p2pd connects to the bootstrap node timed out); a peer that fails before joining starts once more
(``start_retries``). Round 1 waits until every peer is up (swarm.start_peers). Figures, from every peer's
metrics.jsonl and final.json and the hosts' counters, written under ``--case`` (default: the peer count) into
scripts/bench/results/scale.json (``--out`` elsewhere):
    rounds_per_minute     rounds applied per minute of the run, from the first round's end to the last's
    lost_share            peer-rounds trained whose Δ moved no state (lost records, local steps) / all trained
    states_per_round      per outer step, distinct checksums among the peers' counted records (1: one state)
    off_majority          counted peer-rounds whose state is not its round's most common one (a split's minority:
                          the lineage the swarm then left, so their Δ is not in the final state either)
    final_states          distinct checksums among the states the peers ended on (final.json, after the end-of-run
                          heal; the last record's when a peer wrote none); healed_at_end: peers that heal moved
    bytes_per_round       median payload bytes a peer sent in a counted round, and that over the 2(n-1)/n bound
                          (the round's n, in the wire codec: sim_reduce.wire_bytes_sent); a round's failed attempts
                          count too, so ``median_bytes_per_attempt_over_bound`` divides by its reduce attempts, and
                          ``retried_peer_rounds`` counts the counted peer-rounds that took more than one
    dht_per_peer_round    DHT reads and writes per peer per round, from every DHT call of the host processes
                          (announcements, records, vouches, the averager's matchmaking), and the RPCs they cost
                          (``find``: a lookup asked of one node, ``store``: a record sent to one node, replicas
                          and caching included)
    cpu_per_peer_round    CPU seconds per peer-round: the host processes and their p2pd daemons (the bootstrap
                          node's too), sampled each second from /proc; ``_after_start``: only what they used once
                          every peer was up (the rounds, the end-of-run heal and linger)
    memory                the machine's peak memory in use (MemTotal - MemAvailable) over the run, less before it;
                          per peer; and the peak summed PSS of the processes, split by command (python: the host
                          processes and the bootstrap node; p2pd: the daemons)
What fits here: a p2pd holds 60-70 MB even idle, all of it private: hivemind's p2pd is a UPX-packed binary, so each
daemon unpacks its code and constants (~25 MB: text 11, rodata 14) into anonymous memory instead of sharing one file
mapping; busy with a round's connections it grew to ~86 MB of RSS (16 peers). ``--merge-pages`` lets the kernel merge
identical pages (KSM): an idle daemon's Pss 62 -> 35 MB; ``--p2pd-gogc 50`` collects Go's heap at 1.5x its live size
instead of 2x (a busy daemon's RSS 86 -> 74 MB, its CPU +15%). The Python processes' summed Pss is ~17.5 MB a peer
at 32 a process (64 peers: 1121 MB, the interpreters of two hosts and the bootstrap node included; tracemalloc: a
peer's Python objects ~2 MB, the rest native). Machine memory a peer at 64
peers: 129-138 MB at 16 a process with neither (2026-12-05/06), 88 MB at 32 a process with both (2026-12-07).
At 128 peers (32 a process, both on, 2026-12-07) memory fitted (~12.8 GB in use at the peak: ~100 MB a peer) but
two cores did not: load average ~150 once all were up, DHT reads timing out (hivemind logged ~3500 unretrieved
TimeoutErrors), peers reading themselves "alone", rounds of 1-7 peers: of the 349 peer-rounds recorded in 23 minutes
37 counted, 163 were local steps and 149 resyncs; stopped by hand, no result written. 256 peers would need ~26 GB.
``--p2pd-memory-limit`` under a daemon's live heap (24MiB) does not shrink it: Go's collector then runs without pause
(~6% of a core per idle daemon).
Logs: each host process writes its peers' account (p2p_diloco at INFO; with ``--matchmaking-log`` also hivemind's
matchmaking at DEBUG) to ``host<first peer>.log`` in the run's workdir, named in the result (``--keep DIR``: DIR, kept;
else a temporary directory, removed once the result is written).
Failure: a host process that exits non-zero or a run over ``--timeout`` is noted in ``problem``; every process
group is killed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RESULTS_DIR,
    Proc,
    cpu_seconds,
    ended_on,
    exit_on_sigterm,
    fill_defaults,
    healed_at_end,
    ksmd_cpu_seconds,
    mark_mergeable,
    merging_pages,
    proc_memory,
    read_final,
    read_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts.procs import descendants  # noqa: E402

TINY = str(ROOT / "configs" / "tiny.yaml")
DEFAULTS = {"peers": 16, "group": 16, "per_process": 8, "rounds": 4, "h": 3, "timeout": 1500.0}
SMOKE = {"peers": 6, "group": 3, "per_process": 3, "rounds": 2, "h": 2, "timeout": 400.0}
COUNTED = ("apply", "catch_up")
START_RETRIES = 1  # a peer that fails before joining (p2pd could not reach the bootstrap node in time) starts again
MICRO = [
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.intermediate_size=32",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "data.batch_size=2",
    "data.eval_batches=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.threads=1",
    "logging.progress_bar=false",
    "logging.log_every=0",
    "swarm.part_size_bytes=4096",
    "swarm.linger_seconds=20",
    "swarm.record_ttl=300",
]


def overrides(args: argparse.Namespace, run_id: str) -> list[str]:
    """Every peer's --set: the micro model, the run's size and timeouts that a loaded machine of many peers needs."""
    return [
        *MICRO,
        f"inner.steps={args.h}",
        f"train.rounds={args.rounds}",
        f"data.num_shards={args.peers}",
        f"swarm.target_group_size={args.group}",
        f"swarm.run_id={run_id}",
        f"swarm.start_peers={args.peers}",
        "swarm.matchmaking_time=15",
        "swarm.request_timeout=5",
        "swarm.allreduce_timeout=120",
        "swarm.next_chunk_timeout=30",
        "swarm.round_deadline=400",
        "swarm.dht_timeout=30",
        "swarm.join_timeout=600",
        "swarm.state_timeout=120",
        *args.set,
    ]


# ------------------------------------------------------------------------------------------------ host process


def _say(line: str) -> None:
    """A line of the host's protocol on stdout, as one write that starts a line: the peers' threads print to this
    stdout too, and print() writes a line's text and its newline apart (CI once read "...checksum acfff112HOSTUP")."""
    sys.stdout.write(f"\n{line}\n")
    sys.stdout.flush()


def host(args: argparse.Namespace) -> int:
    """Run peers ``--first`` .. ``--first + --count - 1`` as threads of this process until they finish."""
    if args.merge_pages:  # before any p2pd starts: they inherit it
        mark_mergeable()
    from hivemind.dht import DHT

    from p2p_diloco.config import load_config
    from p2p_diloco.data import DataPipeline
    from p2p_diloco.swarm import peer as peer_module
    from p2p_diloco.swarm.peer import PeerOptions, TrainingPeer
    from p2p_diloco.threads import apply_threads

    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
        filename=Path(args.workdir) / f"host{args.first}.log",
    )
    logging.getLogger("p2p_diloco").setLevel(logging.INFO)  # the peers' account of each round, one file per host
    if args.matchmaking_log:  # hivemind's account of leaders and followers, into the same file
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("in_root_logger")
        logging.getLogger("hivemind").setLevel(logging.WARNING)
        logging.getLogger("hivemind.averaging").setLevel(logging.DEBUG)
    from hivemind.dht.protocol import DHTProtocol

    calls: Counter[str] = Counter({"get": 0, "store": 0, "find_rpc": 0, "store_rpc": 0})
    for name in ("get", "store"):  # every DHT read and write of these peers (ours and the averager's matchmaking)
        original = getattr(DHT, name)

        def counted(self: Any, key: Any, *a: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            calls[f"{_name} {key_kind(key)}"] += 1
            return _original(self, key, *a, **kw)

        setattr(DHT, name, counted)
    for name in ("call_find", "call_store"):  # the RPCs they cost, one per node asked
        original = getattr(DHTProtocol, name)

        async def counted_rpc(self: Any, *a: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            calls[_name[5:] + "_rpc"] += 1
            return await _original(self, *a, **kw)

        setattr(DHTProtocol, name, counted_rpc)
    if args.dht_policy:  # another cache policy of the DHT nodes than the peers' (dht.NODE_POLICY), to compare
        import p2p_diloco.swarm.dht as dht_module

        dht_module.NODE_POLICY = json.loads(args.dht_policy)
    if args.p2pd_memory_limit:  # the p2pd daemons inherit it: Go's soft memory limit
        os.environ["GOMEMLIMIT"] = args.p2pd_memory_limit
    if args.p2pd_gogc:  # and this: how far Go lets its heap grow past the live heap before collecting (100: 2x)
        os.environ["GOGC"] = str(args.p2pd_gogc)
    cfg = load_config(TINY, json.loads(args.sets))
    apply_threads(1)
    data = DataPipeline(cfg.data, cfg.seed)
    results: dict[int, str] = {}
    up = threading.Semaphore(0)  # released per peer: when it waits for the others (swarm.start_peers) or gave up
    retried: list[int] = []
    waits = peer_module.wait_for_start_peers

    def wait_for_start_peers(*a: Any, **kw: Any) -> None:
        up.release()
        waits(*a, **kw)

    peer_module.wait_for_start_peers = wait_for_start_peers

    def run(k: int) -> None:
        opts = PeerOptions(
            initial_peers=args.initial,
            log_dir=Path(args.workdir) / f"peer{k}",
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            client_mode=False,
            in_thread=True,
        )
        own = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shard_index=k))  # one shard per peer
        for attempt in range(1 + START_RETRIES):
            peer = TrainingPeer(own, opts, data)
            try:
                results[k] = str(peer.run())
                return
            except Exception as exc:  # noqa: BLE001 - reported by the host, the others go on
                results[k] = f"{type(exc).__name__}: {exc}"
                if peer.guard is None and attempt < START_RETRIES:  # it failed before joining: start it again
                    retried.append(k)
                    logging.getLogger("p2p_diloco").warning("peer %d failed to start (%s); again", k, results[k])
                    continue
                if peer.guard is None:
                    up.release()
                logging.getLogger("p2p_diloco").error("peer %d failed: %s", k, results[k])  # now, not at the end
                return

    threads = [
        threading.Thread(target=run, args=(k,), name=f"peer{k}") for k in range(args.first, args.first + args.count)
    ]
    for t in threads:
        t.start()
        time.sleep(0.5)  # p2pd start-ups one after the other
    for _ in threads:
        up.acquire()
    _say("HOSTUP")  # the driver starts the next host process now
    for t in threads:
        t.join()
    _say("HOST " + json.dumps({"results": results, "dht_calls": calls, "start_retries": retried}))
    return 0 if all(r == "0" for r in results.values()) else 1


def key_kind(key: Any) -> str:
    """A DHT key without what varies by run and round: 'fingerprint', 'settings', 'metrics', 'matchmaking' (the
    averager's group keys), 'averagers' (its '.all_averagers' key)."""
    name = str(key).split("_")[-1]  # keys are '<run_id>_<field>', the averager's '<run_id>_<fingerprint>.<suffix>'
    if "." in name:
        suffix = name.split(".")[-1]
        return "matchmaking" if suffix.startswith("0b") else suffix
    return name


# ------------------------------------------------------------------------------------------------ driver


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def _used() -> int:
    m = _meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def summarize(
    args: argparse.Namespace,
    records: list[list[dict[str, Any]]],
    dht_calls: dict[str, int],
    cpu: dict[str, float],
    finals: list[dict[str, Any] | None] | None = None,
) -> dict:
    """The figures of the module docstring from every peer's metrics.jsonl records and final.json (None: none)."""
    from p2p_diloco.config import load_config
    from p2p_diloco.data import DataPipeline
    from p2p_diloco.model import build_model
    from p2p_diloco.sim_reduce import wire_bytes_sent

    by_step: dict[int, Counter[str]] = {}
    ends: list[float] = []
    for recs in records:
        for r in recs:
            if not r.get("lost") and r["decision"] in COUNTED:
                by_step.setdefault(r["outer_step"], Counter())[r["checksum"]] += 1
                ends.append(r["time"])
    # counted on a lineage the swarm then left: not the most common state of their round (a split's minority)
    off_majority = sum(sum(c.values()) - c.most_common(1)[0][1] for c in by_step.values())
    finals = finals or [None] * len(records)
    ended = ended_on(records, finals)
    trained = sum(len(recs) for recs in records)
    lost = sum(1 for recs in records for r in recs if r.get("lost") or r["decision"] == "local_step")
    counted = [r for recs in records for r in recs if not r.get("lost") and r["group_size"] > 1]
    cfg = load_config(TINY, overrides(args, "x"))
    shapes = [p.shape for p in build_model(cfg.model, DataPipeline(cfg.data, cfg.seed).vocab_size, 0).parameters()]
    bounds = [wire_bytes_sent(cfg, shapes, r["group_size"]) for r in counted]
    ratios = [r["bytes_sent"] / bound for r, bound in zip(counted, bounds, strict=True)]
    attempts = [max(1, r.get("reduce_attempts", 1)) for r in counted]
    rounds = max(by_step, default=0)
    minutes = (max(ends) - min(ends)) / 60 if len(ends) > 1 else None
    return {
        "rounds_applied": rounds,
        "rounds_per_minute": (rounds - 1) / minutes if minutes else None,
        "peer_rounds_trained": trained,
        "lost_peer_rounds": lost,
        "lost_share": lost / trained if trained else None,
        "off_majority_peer_rounds": off_majority,
        "lost_or_off_majority_share": (lost + off_majority) / trained if trained else None,
        "states_per_round": {str(k): len(v) for k, v in sorted(by_step.items())},
        "final_states": len(set(ended)),
        "healed_at_end": healed_at_end(finals),
        "group_sizes": sorted({r["group_size"] for recs in records for r in recs}),
        "groups_per_round": sorted({r.get("groups", 1) for r in counted}),
        "median_bytes_sent": statistics.median(r["bytes_sent"] for r in counted) if counted else None,
        "median_bytes_over_bound": statistics.median(ratios) if ratios else None,
        "median_bytes_per_attempt_over_bound": (
            statistics.median(x / n for x, n in zip(ratios, attempts, strict=True)) if ratios else None
        ),
        "retried_peer_rounds": sum(n > 1 for n in attempts),
        "dht_per_peer_round": {k: v / max(1, trained) for k, v in dht_calls.items()},
        "cpu_seconds": cpu,
        "cpu_per_peer_round": sum(cpu.values()) / trained if trained else None,
    }


def drive(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"scale{int(time.time())}"
    sets = json.dumps(overrides(args, run_id))
    local = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    before, peak, pss, stop = _used(), [0], [0], threading.Event()
    pss_split: list[dict[str, int]] = [{}]  # at the peak: summed Pss by command name (python: the hosts, p2pd)
    cpu_seen: dict[int, tuple[str, float]] = {}  # pid -> (command name, its CPU seconds when last seen)
    boot = Proc([sys.executable, "-m", "peers.run_bootstrap", *local])
    hosts: list[Proc] = []

    def sample() -> None:
        while not stop.wait(1.0):
            peak[0] = max(peak[0], _used() - before)
            pids = [boot.pid, *(h.pid for h in hosts)]
            named = {**{p: "python" for p in pids}, **{c: name for q in pids for c, _, name in descendants(q)}}
            by_name: Counter[str] = Counter()
            for p, name in named.items():
                by_name[name] += (proc_memory(p) or {}).get("Pss", 0)
            if sum(by_name.values()) > pss[0]:
                pss[0], pss_split[0] = sum(by_name.values()), dict(by_name)
            for p, name in named.items():
                if (seconds := cpu_seconds(p)) is not None:
                    cpu_seen[p] = (name, seconds)

    problem, started, cpu_at_start = "", time.monotonic(), None
    dht_calls: Counter[str] = Counter({"get": 0, "store": 0, "find_rpc": 0, "store_rpc": 0})
    start_retries, ksmd_before = 0, ksmd_cpu_seconds()
    try:
        initial = boot.wait_for_line(r"^--initial-peers ", timeout=90).string.split()[1:]
        threading.Thread(target=sample, daemon=True).start()
        for first in range(0, args.peers, args.per_process):
            if hosts:  # one host process's peers start at a time: all at once overloaded the machine at 128
                hosts[-1].wait_for_line(r"^HOSTUP", timeout=max(1.0, args.timeout - (time.monotonic() - started)))
            count = min(args.per_process, args.peers - first)
            hosts.append(
                Proc(
                    [
                        sys.executable,
                        __file__,
                        "--host",
                        "--first",
                        str(first),
                        "--count",
                        str(count),
                        "--workdir",
                        str(workdir),
                        "--sets",
                        sets,
                        *(["--matchmaking-log"] if args.matchmaking_log else []),
                        *(["--dht-policy", args.dht_policy] if args.dht_policy else []),
                        *(["--p2pd-memory-limit", args.p2pd_memory_limit] if args.p2pd_memory_limit else []),
                        *(["--merge-pages"] if args.merge_pages else []),
                        *(["--p2pd-gogc", str(args.p2pd_gogc)] if args.p2pd_gogc else []),
                        "--initial",
                        *initial,
                    ]
                )  # fmt: skip
            )
        hosts[-1].wait_for_line(r"^HOSTUP", timeout=max(1.0, args.timeout - (time.monotonic() - started)))
        time.sleep(1.5)  # the sampler's next reading: every peer is up, round 1 begins
        cpu_at_start = sum(seconds for _, seconds in cpu_seen.values())
        for h in hosts:
            line = h.wait_for_line(r"^HOST ", timeout=max(1.0, args.timeout - (time.monotonic() - started)))
            report = json.loads(line.string[5:])
            for key, value in report["dht_calls"].items():
                dht_calls[key] += value
            start_retries += len(report["start_retries"])
            bad = {k: r for k, r in report["results"].items() if r != "0"}
            if bad:  # one line per distinct failure, with the peers it hit (a whole message each is unreadable)
                reasons = Counter(r.splitlines()[0] for r in bad.values())
                problem += "; ".join(f"{n} peer(s) failed: {why}" for why, n in reasons.items()) + "; "
    except Exception as exc:  # noqa: BLE001 - recorded; everything is killed below
        problem += f"{type(exc).__name__}: {exc}; " + " | ".join(h.describe(5) for h in hosts[:2])
    finally:
        stop.set()
        for p in [*hosts, boot]:
            p.kill_group()
    records = [read_jsonl(workdir / f"peer{k}" / "metrics.jsonl") for k in range(args.peers)]
    finals = [read_final(workdir / f"peer{k}" / "final.json") for k in range(args.peers)]
    cpu: dict[str, float] = {}
    for name, seconds in cpu_seen.values():
        cpu[name] = round(cpu.get(name, 0.0) + seconds, 1)
    if args.merge_pages:  # the kernel's share of the run: its page merging
        cpu["ksmd"] = round(ksmd_cpu_seconds() - ksmd_before, 1)
    out = summarize(args, records, dht_calls, cpu, finals)
    out.update(
        peers=args.peers,
        group=args.group,
        per_process=args.per_process,
        rounds=args.rounds,
        h=args.h,
        sets=args.set,
        dht_policy=args.dht_policy,
        p2pd_memory_limit=args.p2pd_memory_limit,
        merge_pages=args.merge_pages,
        p2pd_gogc=args.p2pd_gogc,
        start_retries=start_retries,
        seconds=round(time.monotonic() - started, 1),
        # the rounds' own cost: after every peer was up (their start-up - keys, p2pd, the DHT's bootstrap - left out)
        cpu_per_peer_round_after_start=(
            (sum(cpu.values()) - cpu_at_start) / out["peer_rounds_trained"]
            if cpu_at_start is not None and out["peer_rounds_trained"]
            else None
        ),
        memory={
            "machine_peak_bytes": peak[0],
            "machine_peak_per_peer_bytes": peak[0] / args.peers,
            "pss_peak_bytes": pss[0],
            "pss_peak_by_command": pss_split[0],
        },
        problem=problem,
        workdir=str(workdir),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=None, help="peers in the run (16)")
    p.add_argument("--group", type=int, default=None, help="swarm.target_group_size (16)")
    p.add_argument("--per-process", type=int, default=None, help="peers per host process (8)")
    p.add_argument("--rounds", type=int, default=None, help="train.rounds (4)")
    p.add_argument("--h", type=int, default=None, help="inner steps per round (3)")
    p.add_argument("--set", action="append", default=[], help="another --set for every peer (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole run (1500)")
    p.add_argument("--case", default=None, help="the name the run is written under (default: the peer count)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/scale.json)")
    p.add_argument("--smoke", action="store_true", help=f"a short check of this script: {SMOKE}")
    p.add_argument("--keep", type=Path, default=None, help="work in DIR and keep it (default: a temp dir)")
    p.add_argument("--matchmaking-log", action="store_true", help="hivemind's matchmaking at debug level in host*.log")
    p.add_argument("--dht-policy", help="JSON: the peers' DHT node cache settings instead of dht.NODE_POLICY")
    p.add_argument("--p2pd-memory-limit", help="GOMEMLIMIT for the peers' p2pd, e.g. 24MiB (default none)")
    p.add_argument("--p2pd-gogc", type=int, help="GOGC for the peers' p2pd, e.g. 50 (default Go's: 100)")
    p.add_argument(
        "--merge-pages",
        action="store_true",
        help="let the kernel merge the peers' identical pages (KSM; root, Linux 6.7+): one copy of p2pd's code",
    )
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--sets", help=argparse.SUPPRESS)
    p.add_argument("--initial", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host:
        return host(args)
    args = fill_defaults(args, DEFAULTS, SMOKE)
    exit_on_sigterm()
    with merging_pages() if args.merge_pages else contextlib.nullcontext():
        result = drive(args)
    print(json.dumps(result, indent=1))
    path = args.out or (Path(tempfile.mkdtemp()) / "scale.json" if args.smoke else RESULTS_DIR / "scale.json")
    found = json.loads(path.read_text()) if path.exists() else {"item": "scale", "cases": {}}
    found["cases"][args.case or str(args.peers)] = {**result, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=2))
    print(f"wrote {path}")
    if args.keep is None:  # the peers' logs and metrics (~1 MB a run): --keep to look at them
        shutil.rmtree(result["workdir"], ignore_errors=True)
    return 0 if not result["problem"] else 1


if __name__ == "__main__":
    sys.exit(main())

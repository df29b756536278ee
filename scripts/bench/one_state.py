"""Item 13: one swarm, one state. Real run_peer processes on 127.0.0.1; does every round end with one state?

Usage:
    python scripts/bench/one_state.py --peers 6 --group 3 --rounds 12            # 6 peers in groups of 3
    python scripts/bench/one_state.py --peers 16 --group 4 --rounds 6 --case wide
    python scripts/bench/one_state.py --peers 3 --rounds 6 --set inner.round_seconds=4 --client 2 --case budgeted
    python scripts/bench/one_state.py --peers 3 --rounds 3 --late 2:8 --case late  # peer 2 starts 8 s after the rest
    python scripts/bench/one_state.py --peers 4 --rounds 60 --churn 3:22:10 --case churn  # peer 3 SIGKILLed and
                                                  # restarted (same log dir, same key) every 22 s, 10 times
    python scripts/bench/one_state.py --smoke                                     # 4 peers in groups of 2, 3 rounds

Each case starts a bootstrap and ``--peers`` tiny-preset peers (one shard each, no eval), trains ``--rounds`` rounds
and reads every peer's metrics.jsonl (every round a peer trains is a line: counted, or lost with its decision). Per
case, written under its name into scripts/bench/results/one_state.json (``--out`` elsewhere):
    states_per_round      per outer step, how many distinct checksums the peers' counted records hold
    final_states          distinct checksums the peers ended on (final.json: after the end-of-run heal; else the
                          last record's)
    healed_at_end         peers that took the canonical lineage's state after their last round
    lost_peer_rounds      rounds a peer trained whose Δ moved no state that survived: lost records and local steps,
                          as a share of all peer-rounds trained
    contributed           per peer, the rounds whose Δ counted in a group of 2 or more (apply, catch_up)
    groups                per outer step, the groups the round ran as (protocol.split_groups)
    bytes_per_round       median payload bytes a peer sent in a round, and the 2(n-1)/n bound in the wire codec
    peak_rss_bytes        the largest sum of every process's RSS (bootstrap, peers and their children), sampled 1/s
    peak_pss_bytes        the same in PSS (shared pages split among their processes: what the machine gives)
    churn                 with ``--churn K:SECONDS:TIMES`` (peer K SIGKILLed, with its whole process group, SECONDS
                          after each start, or later once that life printed its first round, at most FIRST_ROUND s;
                          and started again with the same command, log dir and key, TIMES times; its
                          last life runs to the end): per life, its seconds, the rounds it trained, the rounds that
                          counted in a group of 2 or more, and the seconds from its start to the first that counted
                          (None: none did); ``locked_out`` counts the lives but the last that lasted SECONDS and
                          counted no round
Failure: a peer that exits non-zero or does not finish within ``--timeout`` is noted in the case's ``problem``; every
process group is killed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RESULTS_DIR,
    Proc,
    ended_on,
    exit_on_sigterm,
    fill_defaults,
    healed_at_end,
    log_tail,
    proc_memory,
    read_final,
    read_jsonl,
    single_thread_env,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.procs import ProcessOutputError, descendants  # noqa: E402

TINY = "configs/tiny.yaml"
DEFAULTS = {"peers": 6, "group": 3, "rounds": 12, "h": 10, "timeout": 900.0, "case": "default"}
SMOKE = {"peers": 4, "group": 2, "rounds": 3, "h": 3, "timeout": 300.0, "case": "smoke"}
COUNTED = ("apply", "catch_up")
FIRST_ROUND = 60.0  # --churn: the longest wait for a life's first round before its kill, from its start (seconds)


def contributed(record: dict[str, Any]) -> bool:
    """A round whose Δ counted in a group of 2 or more."""
    return not record.get("lost") and record["decision"] in COUNTED and record["group_size"] > 1


def machine_memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) of ``pids`` and all their descendants, summed (bytes). RSS counts the pages a forked child shares
    with its parent once per process; PSS splits them, so it sums to what the processes take from the machine."""
    rss = pss = 0
    for pid in {*pids, *(c for p in pids for c, _, _ in descendants(p))}:
        mem = proc_memory(pid) or {}
        rss, pss = rss + mem.get("VmRSS", 0), pss + mem.get("Pss", 0)
    return rss, pss


def summarize(records: list[list[dict[str, Any]]], finals: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The case's figures (module doc) from each peer's metrics.jsonl records and final.json (None: none)."""
    by_step: dict[int, set[str]] = {}
    groups: dict[int, int] = {}
    for recs in records:
        for r in recs:
            if not r.get("lost") and r["decision"] in COUNTED:
                by_step.setdefault(r["outer_step"], set()).add(r["checksum"])
                groups[r["outer_step"]] = max(groups.get(r["outer_step"], 1), r.get("groups", 1))
    trained = sum(len(recs) for recs in records)
    lost = sum(1 for recs in records for r in recs if r.get("lost") or r["decision"] == "local_step")
    sent = [r["bytes_sent"] for recs in records for r in recs if r["group_size"] > 1 and not r.get("lost")]
    return {
        "states_per_round": {str(k): len(v) for k, v in sorted(by_step.items())},
        "final_states": len(set(ended_on(records, finals))),
        "healed_at_end": healed_at_end(finals),
        "peer_rounds_trained": trained,
        "lost_peer_rounds": lost,
        "lost_share": lost / trained if trained else None,
        "contributed": [sum(1 for r in recs if contributed(r)) for recs in records],
        "groups": {str(k): v for k, v in sorted(groups.items())},
        "group_sizes": sorted({r["group_size"] for recs in records for r in recs}),
        "median_bytes_sent": statistics.median(sent) if sent else None,
    }


def churn_spec(text: str) -> tuple[int, float, int]:
    """``--churn K:SECONDS:TIMES`` as (peer, seconds, times); argparse shows the error."""
    try:
        k, every, times = text.split(":")
        spec = int(k), float(every), int(times)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K:SECONDS:TIMES (e.g. 3:22:10)") from None
    if spec[0] < 0 or spec[1] <= 0 or spec[2] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: K >= 0, SECONDS > 0 and TIMES >= 1")
    return spec


def lives(records: list[dict[str, Any]], starts: list[float], ended: float) -> list[dict[str, Any]]:
    """Per life of a churned peer (``starts``: the wall times it was started, ``ended``: the run's end), the rounds its
    metrics.jsonl holds from that life (by their ``time``; a restart appends to the same file)."""
    out = []
    for k, begin in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else ended
        mine = [r for r in records if begin <= float(r["time"]) < end]
        counted = [r for r in mine if contributed(r)]
        out.append(
            {
                "seconds": round(end - begin, 1),
                "trained": len(mine),
                "counted": len(counted),
                "first_counted_after": round(float(counted[0]["time"]) - begin, 1) if counted else None,
            }
        )
    return out


def run_case(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = single_thread_env(1)
    local = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    sets = [
        f"inner.steps={args.h}",
        f"train.rounds={args.rounds}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "logging.progress_bar=false",
        f"data.num_shards={args.peers}",
        f"swarm.target_group_size={args.group}",
        f"swarm.run_id=one{int(time.time())}",
        "swarm.join_timeout=120",
        "swarm.state_timeout=60",
        "swarm.linger_seconds=5",
        *args.set,
    ]
    late = dict((int(k), float(s)) for k, s in (item.split(":") for item in args.late))
    churned, every, times = args.churn if args.churn else (None, 0.0, 0)
    starts: list[float] = []  # wall times the churned peer was started
    boot = Proc([sys.executable, "-m", "peers.run_bootstrap", *local], env=env)
    procs: list[Proc] = []
    peak, stop = [0, 0], threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            rss, pss = machine_memory([boot.pid, *(p.pid for p in procs)])
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)

    sampler = threading.Thread(target=sample, daemon=True)
    problem, dirs, started = "", [workdir / f"peer{k}" for k in range(args.peers)], time.monotonic()
    order = sorted(range(args.peers), key=lambda k: late.get(k, 0.0))
    try:
        initial = boot.wait_for_line(r"^--initial-peers ", timeout=90).string.split()[1:]
        sampler.start()
        t0 = time.monotonic()
        for k in order:
            time.sleep(max(0.0, t0 + late.get(k, 0.0) - time.monotonic()))
            peer_sets = [*sets, f"data.shard_index={k}"]
            flags = ["--client-mode"] if k in args.client else []
            cmd = [sys.executable, "-m", "peers.run_peer", "--config", TINY, "--log-dir", str(dirs[k]), *local]
            for s in peer_sets:
                cmd += ["--set", s]
            procs.append(Proc([*cmd, *flags, "--initial-peers", *initial], env=env))
            if k == churned:
                starts.append(time.time())
        if churned is not None:  # kill and start again, with the same command (log dir, key), every ``every`` s
            index = order.index(churned)
            for _ in range(times):
                time.sleep(max(0.0, starts[-1] + every - time.time()))
                with contextlib.suppress(ProcessOutputError):  # not before this life's first round (FIRST_ROUND):
                    # under load a start-up took over 25 s (CI), and a life killed before any round measures no lock-out
                    procs[index].wait_for_line(r"^round \d+/", timeout=max(0.0, starts[-1] + FIRST_ROUND - time.time()))
                again = procs[index].args
                procs[index].kill_group()
                procs[index] = Proc(again, env=env)
                starts.append(time.time())
                print(f"churn: peer {churned} restarted ({len(starts) - 1} of {times})", file=sys.stderr, flush=True)
        for k, p in zip(order, procs, strict=True):
            rc = p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
            if rc != 0:
                problem += f"peer {k} exited with {rc}: {p.describe(10)}; "
    except Exception as exc:  # noqa: BLE001 - recorded with the case; everything is killed below
        problem += f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        for p in [*procs, boot]:
            p.kill_group()
        if args.keep is not None:  # every peer's stderr beside its metrics
            for k, p in zip(order, procs, strict=False):
                (dirs[k] / "stderr.log").write_text(p.stderr)
    out = summarize([read_jsonl(d / "metrics.jsonl") for d in dirs], [read_final(d / "final.json") for d in dirs])
    out.update(peers=args.peers, group=args.group, rounds=args.rounds, sets=args.set, late=args.late)
    if churned is not None:
        life = lives(read_jsonl(dirs[churned] / "metrics.jsonl"), starts, time.time())
        locked = sum(1 for x in life[:-1] if x["counted"] == 0 and x["seconds"] >= every - 1)
        out["churn"] = {"peer": churned, "every": every, "times": times, "lives": life, "locked_out": locked}
    out.update(
        client=args.client, peak_rss_bytes=peak[0], peak_pss_bytes=peak[1], seconds=round(time.monotonic() - started, 1)
    )
    out["problem"] = problem
    lossy = [
        k for k, d in zip(order, dirs, strict=False) if any(r.get("lost") for r in read_jsonl(d / "metrics.jsonl"))
    ]
    out["log_tails"] = {str(k): tail for k, tail in zip(order, log_tail(procs, 25), strict=False) if k in lossy}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=None, help="run_peer processes (6)")
    p.add_argument("--group", type=int, default=None, help="swarm.target_group_size (3)")
    p.add_argument("--rounds", type=int, default=None, help="train.rounds (12)")
    p.add_argument("--h", type=int, default=None, help="inner steps per round (10)")
    p.add_argument("--set", action="append", default=[], help="another --set for every peer (repeatable)")
    p.add_argument("--late", action="append", default=[], help="K:SECONDS: peer K starts that much later")
    p.add_argument("--churn", type=churn_spec, default=None, help="K:SECONDS:TIMES: kill peer K, start it again")
    p.add_argument("--client", action="append", type=int, default=[], help="peer K runs with --client-mode")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole case (900)")
    p.add_argument("--case", default=None, help="the name the case is written under")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/one_state.json)")
    p.add_argument("--keep", type=Path, default=None, help="keep every peer's log dir under this directory")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    if args.churn and args.churn[0] >= args.peers:
        p.error(f"--churn names peer {args.churn[0]}, but there are {args.peers} peers (0 to {args.peers - 1})")
    exit_on_sigterm()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        case = run_case(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_one_state_") as tmp:
            case = run_case(args, Path(tmp))
    print(json.dumps(case, indent=1))
    path = args.out or (Path(tempfile.mkdtemp()) / "one_state.json" if args.smoke else RESULTS_DIR / "one_state.json")
    found = json.loads(path.read_text()) if path.exists() else {"item": "one_state", "cases": {}}
    found["cases"][args.case] = {**case, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=2))
    print(f"wrote {path}")
    return 0 if not case["problem"] else 1


if __name__ == "__main__":
    sys.exit(main())

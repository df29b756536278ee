"""Item 7: communication on shaped links: a swarm whose peers each sit behind a tbf-capped link.

Usage (as root: it builds network namespaces, see scripts/bench/netns.py and ../shared/docs/network-lab.md):
    python scripts/bench/netlab.py                      # tiny and small x 20/100/500 Mbit/s x 10 settings (long)
    python scripts/bench/netlab.py --case tiny:configs/tiny.yaml --rate 100 --setting '' --rounds 3
    python scripts/bench/netlab.py --setting 'swarm.compression=int8,swarm.overlap=eager' --setting ''
    python scripts/bench/netlab.py --smoke [--out DIR/netlab.json]   # 2 tiny peers, 100 Mbit/s, H=2, 2 rounds

For each rate, one lab: a "wan" namespace holding a bridge, and one "home" namespace per peer with a veth into
the bridge, its egress and the bridge port towards it both capped at the rate by tbf (what a peer sends and
what it receives are each limited to the rate, as on a symmetric home line). The link is first calibrated with
one TCP transfer between two homes (Python sockets; "link measured"). Then, for each case (preset) and each
setting (a list of ``--set`` overrides, e.g. ``swarm.compression=int8,swarm.overlap=eager``; '' = the preset's
own), a bootstrap node runs in the wan namespace on the bridge address and ``--peers`` ``run_peer`` processes
run each in its own home, listening on its home address: every byte between peers crosses two capped links.
The preset's own swarm settings apply (group size, matchmaking time, timeouts); the benchmark only sets H,
rounds, one data shard per peer, no evaluation or checkpoints, no lingering, a fresh run id, start-up
timeouts, and ``swarm.start_peers = peers`` so round 1 starts once every peer is up.

From each peer's metrics.jsonl, over rounds 2..R-1 (``benchlib.steady_rounds``: the first one absorbs the start-up,
the last one's exchange has nothing to overlap with; each round's period runs from its inner steps' start to the
next round's; with 2 rounds, round 2 up to its record):
    compute s per round   = mean compute_seconds (inner steps only)
    round wall s          = (start of round R's inner steps - start of round 2's) / rounds counted
    exposed comm s        = round wall - compute (matchmaking + all-reduce + the rest of the round's work)
    utilisation           = sum(compute_seconds) / (time of the last record - time of the first record)
    sent per round        = mean bytes_sent (payload the averager handed to p2pd)
    wire time             = sent x 8 / rate: the least time the capped link needs for it
    peak send rate        = the most any peer's link sent in 1 s (netns.TxSampler: its namespace's counters every
                            0.1 s over the whole run, start-up included; on a capped link at most the cap)
averaged over the peers. The JSON also has each home's kernel link counters for the case (bytes on the wire,
all traffic included; tbf drops) and the all-reduce goodput (sent x 8 / allreduce_seconds).
Settings are checked against the config schema first: a setting whose keys the config does not know (yet)
is listed as not measured with the config's message, and no processes are started for it.
Output: scripts/bench/results/netlab.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``: a temporary
directory), rewritten after every case so a stopped sweep keeps what it measured (``"complete": false`` until
the end). Failure: a swarm past ``--timeout`` or a peer exiting non-zero is killed and noted in the case's
``problem``; a case whose all-reduce failed in some counted rounds says so in its figure (those peers took
local steps). Exit code 3 (and nothing written) when network namespaces cannot be used here (not root, refused).
Run time on 2 cores: the smoke run about 25-45 s; a tiny case about 45-70 s; a small case 3-9 min (20 Mbit/s
fp32: every round's all-reduce times out twice). The full default sweep (60 cases) takes hours, which is why it
is not one of run_all.py's items (each gets 900 s there) and needs to be run on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RESULTS_DIR,
    Proc,
    Recorder,
    exit_on_sigterm,
    fill_defaults,
    log_tail,
    overlap_label,
    read_jsonl,
    run_overrides,
    single_thread_env,
    steady_rounds,
)
from netns import Lab, LabError, TxSampler, unavailable  # noqa: E402

ITEM = "netlab"
EXIT_GRACE = 15.0  # seconds a peer may take to exit after every peer recorded its last round
DEFAULT_CASES = [
    "tiny:configs/tiny.yaml",
    "small:configs/small.yaml:data.batch_size=1,data.seq_len=32",
]
DEFAULT_SETTINGS = [
    f"swarm.compression={c},swarm.overlap={o}"
    for c in ("none", "fp16", "bf16", "int8", "int4")
    for o in ("none", "eager")
]
DEFAULTS: dict[str, Any] = {
    "case": DEFAULT_CASES,
    "rate": [20.0, 100.0, 500.0],
    "setting": DEFAULT_SETTINGS,
    "h": 100,
    "rounds": 4,
    "peers": 3,
    "timeout": 900.0,
    "calibrate_seconds": 1.5,
}
SMOKE: dict[str, Any] = {
    "case": ["tiny:configs/tiny.yaml"],
    "rate": [100.0],
    "setting": [""],
    "h": 2,
    "rounds": 2,
    "peers": 2,
    "timeout": 75.0,
    "calibrate_seconds": 0.5,
}


def parse_setting(setting: str) -> list[str]:
    """'k=v,k=v' -> ['k=v', 'k=v']; '' -> [] (the preset's own)."""
    return [s.strip() for s in setting.split(",") if s.strip()]


def setting_label(sets: list[str]) -> str:
    return ", ".join(s.removeprefix("swarm.") for s in sets) if sets else "preset defaults"


def swarm_overrides(h: int, rounds: int, peers: int) -> list[str]:
    return run_overrides(h, rounds, peers, "netlab")


def config_problem(config: str, overrides: list[str]) -> str:
    """'' when the config accepts ``overrides``, else its message (e.g. an unknown key)."""
    from p2p_diloco.config import ConfigError, load_config

    try:
        load_config(config, overrides)
    except ConfigError as exc:
        return str(exc)
    return ""


def analyse(records: list[dict[str, Any]], rate_mbit: float) -> dict[str, Any] | None:
    """One peer's figures over ``steady_rounds`` of its metrics.jsonl (None with fewer than 2 rounds on record)."""
    if len(records) < 2:
        return None
    later, wall = steady_rounds(records)
    n = len(later)
    compute = sum(r["compute_seconds"] for r in later)
    mm = sum(r["matchmaking_seconds"] for r in later)
    ar = sum(r["allreduce_seconds"] for r in later)
    sent = sum(r["bytes_sent"] for r in later) / n
    received = sum(r["bytes_received"] for r in later) / n
    return {
        "rounds_counted": n,
        "counted_steps": [r["outer_step"] for r in later],
        "compute_per_round": compute / n,
        "wall_per_round": wall / n,
        "exposed_per_round": (wall - compute) / n,
        "matchmaking_per_round": mm / n,
        "allreduce_per_round": ar / n,
        "other_per_round": (wall - compute - mm - ar) / n,
        "utilisation": compute / wall if wall > 0 else None,
        "bytes_sent_per_round": sent,
        "bytes_received_per_round": received,
        "wire_seconds_per_round": sent * 8 / (rate_mbit * 1e6),
        "allreduce_goodput_mbit": (sent * 8 / (ar / n) / 1e6) if ar > 0 else None,
        "group_sizes": [r["group_size"] for r in records],
        "overlap_steps": [r.get("overlap_steps", 0) for r in later],  # eager: inner steps each exchange had
        "complete": [r["reduce_complete"] for r in records],
        "complete_counted": sum(bool(r["reduce_complete"]) for r in later),
        "reasons": [r.get("reduce_reason") for r in records],
        "attempts": [r["reduce_attempts"] for r in records],
        "first_round": {k: records[0][k] for k in ("compute_seconds", "matchmaking_seconds", "allreduce_seconds")},
    }


def _lines(path: Path) -> int:
    """Complete lines in ``path`` (0 when it does not exist yet): records written so far."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def wait_for_peers(
    procs: list[Proc],
    dirs: list[Path],
    rounds: int,
    deadline: float,
    exit_grace: float,
    exits: dict[int, dict[str, Any]],
) -> str:
    """Wait until every peer exited, the deadline passed, or every peer has recorded all its rounds and
    ``exit_grace`` seconds went by (the rest are then stopped with SIGTERM: their shutdown is not what this
    measures, but how long it took is noted in ``exits``). Returns the problem ('' when none)."""
    problem, all_recorded = "", None
    while True:
        now = time.time()
        for k, p in enumerate(procs):
            if k not in exits and not p.alive():
                exits[k] = {"rc": p.wait(timeout=10), "time": now}
        if len(exits) == len(procs):
            break
        if time.monotonic() > deadline:
            running = [k for k in range(len(procs)) if k not in exits]
            problem = f"peers {running} still running at the case's timeout; stopped"
            break
        if all_recorded is None and all(_lines(d / "metrics.jsonl") >= rounds for d in dirs):
            all_recorded = time.monotonic()
        if all_recorded is not None and time.monotonic() - all_recorded > exit_grace:
            break
        time.sleep(0.25)
    running = {k: p for k, p in enumerate(procs) if k not in exits}
    for p in running.values():  # SIGTERM all at once, then SIGKILL what is left after 10 s
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pgid, signal.SIGTERM)
    until = time.monotonic() + 10
    while any(p.alive() for p in running.values()) and time.monotonic() < until:
        time.sleep(0.1)
    for k, p in running.items():
        sigterm_worked = not p.alive()
        p.kill_group()
        exits[k] = {"rc": p.popen.poll(), "time": time.time(), "stopped": True, "sigterm_worked": sigterm_worked}
    for k, p in enumerate(procs):
        last = read_jsonl(dirs[k] / "metrics.jsonl")[-1:]
        if last:
            exits[k]["seconds_after_last_record"] = round(exits[k]["time"] - last[0]["time"], 2)
        if exits[k]["rc"] not in (0, None) and not exits[k].get("stopped") and not problem:
            problem = f"peer {k} exited with {exits[k]['rc']}: {p.describe(10)}"
    return problem


def run_case(
    lab: Lab,
    name: str,
    config: str,
    sets: list[str],
    h: int,
    rounds: int,
    timeout: float,
    workdir: Path,
    exit_grace: float = EXIT_GRACE,
) -> dict[str, Any]:
    """One swarm in ``lab``: bootstrap in the wan namespace, one run_peer per home; every process killed after."""
    peers = len(lab.homes)
    rate = lab.homes[0].rate_mbit
    assert rate is not None
    tag = f"{name}_{rate:g}mbit_{uuid.uuid4().hex[:6]}"
    dirs = [workdir / f"{tag}_peer{k}" for k in range(peers)]
    given = dict(s.split("=", 1) for s in sets if "=" in s)  # a setting may set its own H and rounds (fragments)
    h, rounds = int(given.get("inner.steps", h)), int(given.get("train.rounds", rounds))
    overrides = [*swarm_overrides(h, rounds, peers), *sets]
    env = single_thread_env()
    py = sys.executable
    t0 = time.monotonic()
    problem, initial = "", []
    exits: dict[int, dict[str, Any]] = {}
    before = [lab.counters(k) for k in range(peers)]
    procs: list[Proc] = []
    peaks: list[float | None] = [None] * peers
    boot = lab.spawn(lab.wan, [py, "-m", "peers.run_bootstrap", "--host-maddrs", f"/ip4/{lab.wan_ip}/tcp/0"], env)
    try:
        initial = boot.wait_for_line(r"^--initial-peers ", timeout=90).string.split()[1:]
        if not all(f"/ip4/{lab.wan_ip}/" in m for m in initial):
            problem = f"the bootstrap's addresses are not the lab's ({lab.wan_ip}): {initial}"
        for k, home in enumerate(lab.homes):
            args = [py, "-m", "peers.run_peer", "--config", config, "--log-dir", str(dirs[k])]
            args += ["--host-maddrs", f"/ip4/{home.ip}/tcp/0"]
            for o in [*overrides, f"data.shard_index={k}"]:
                args += ["--set", o]
            procs.append(lab.spawn(home.ns, [*args, "--initial-peers", *initial], env))
        with TxSampler([p.popen.pid for p in procs]) as sampler:  # `ip netns exec` execs the peer: same pid
            problem = wait_for_peers(procs, dirs, rounds, t0 + timeout, exit_grace, exits) or problem
        peaks = sampler.peak_mbit(1.0)
    except Exception as exc:  # noqa: BLE001 - a bootstrap that never printed its line: noted, the sweep goes on
        problem = problem or f"{type(exc).__name__}: {exc}"
    finally:
        for p in [*procs, boot]:
            p.kill_group()
    after = [lab.counters(k) for k in range(peers)]
    links = [{key: a[key] - b.get(key, 0) for key in a} for a, b in zip(after, before, strict=True)]
    stats = [analyse(read_jsonl(d / "metrics.jsonl"), rate) for d in dirs]
    ok = [s for s in stats if s is not None]

    def mean(key: str) -> float | None:
        vals = [s[key] for s in ok if s[key] is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "case": name,
        "config": config,
        "setting": sets,
        "rate_mbit": rate,
        "h": h,
        "rounds": rounds,
        "peers": peers,
        "initial_peers": initial,
        "wall_seconds": time.monotonic() - t0,
        "problem": problem,
        "measured": bool(ok),
        "per_peer": stats,
        "log_tail": log_tail(procs),
        "links": links,
        "exits": [exits.get(k) for k in range(peers)],
        **{
            key: mean(key)
            for key in (
                "utilisation",
                "compute_per_round",
                "wall_per_round",
                "exposed_per_round",
                "matchmaking_per_round",
                "allreduce_per_round",
                "other_per_round",
                "bytes_sent_per_round",
                "bytes_received_per_round",
                "wire_seconds_per_round",
                "allreduce_goodput_mbit",
            )
        },
        "peak_tx_mbit": peaks,  # per peer: the most its link sent in any 1 s of the run
        "peak_tx_mbit_max": max((x for x in peaks if x is not None), default=None),
        "utilisation_min": min((s["utilisation"] for s in ok if s["utilisation"] is not None), default=None),
        "rounds_counted": min((s["rounds_counted"] for s in ok), default=0),
        "incomplete_rounds": sum(s["rounds_counted"] - s["complete_counted"] for s in ok),  # over peers
    }


def _peak(c: dict[str, Any]) -> str:
    peak = c.get("peak_tx_mbit_max")
    return "" if peak is None else f", peak send rate {peak:.1f} Mbit/s over 1 s"


def add_row(rec: Recorder, c: dict[str, Any], link_mbit: float | None) -> None:
    rate = c["rate_mbit"]
    sent = c["bytes_sent_per_round"]
    measured = f", link measured {link_mbit:.0f}" if link_mbit else ""
    n = c["rounds_counted"]
    counted = f"{n} round{'s' if n != 1 else ''} counted"
    if c["incomplete_rounds"]:
        counted += (
            f"; all-reduce FAILED in {c['incomplete_rounds']} of {n * c['peers']} peer-rounds counted (a peer whose "
            "round failed took a local step: compute share is not that of a training swarm)"
        )
    figure = (
        f"{c['case']}, {rate:g} Mbit/s{measured}, {c['peers']} peers, H={c['h']}, {setting_label(c['setting'])}: "
        f"compute share of wall; per round compute {c['compute_per_round']:.2f}s, exposed communication "
        f"{c['exposed_per_round']:.2f}s (matchmaking {c['matchmaking_per_round']:.2f}s, all-reduce "
        f"{c['allreduce_per_round']:.2f}s, other {c['other_per_round']:.2f}s); sent {sent / 2**20:.2f} MiB/peer/"
        f"round = wire time {c['wire_seconds_per_round']:.2f}s at {rate:g} Mbit/s{_peak(c)} ({counted})"
        f"{overlap_label(c['per_peer'])}"
    )
    rec.add(
        figure=figure,
        value=c["utilisation"],
        unit="share",
        reference="all wall time in inner steps",
        reference_value=1.0,
        ratio=c["utilisation"],
        ratio_kind="utilisation (higher is better)",
        exposed_seconds=c["exposed_per_round"],
        wire_seconds=c["wire_seconds_per_round"],
        bytes_sent_per_round=sent,
        min_over_peers=c["utilisation_min"],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", default=None, help="name:config[:k=v,k=v] (repeatable; tiny, small)")
    p.add_argument("--rate", type=float, action="append", default=None, help="Mbit/s per link (repeatable; 20 100 500)")
    p.add_argument(
        "--setting",
        action="append",
        default=None,
        help="comma-separated --set overrides for one run, '' = the preset's own (repeatable; default: "
        "swarm.compression in none/fp16/bf16/int8 x swarm.overlap in none/eager)",
    )
    p.add_argument("--h", type=int, default=None, help="inner steps per round (100)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per run: 2..R-1 counted (4)")
    p.add_argument("--peers", type=int, default=None, help="run_peer processes, one per home namespace (3)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per swarm run (900)")
    p.add_argument("--calibrate-seconds", type=float, default=None, help="length of the link calibration (1.5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra overrides for every peer")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/netlab.json)")
    p.add_argument("--smoke", action="store_true", help=f"a short check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    reason = unavailable()
    if reason:
        print(f"netlab: not run: {reason}", file=sys.stderr)
        return 3
    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="bench_smoke_netlab_")) / "netlab.json" if args.smoke else None
        out = out or RESULTS_DIR / f"{ITEM}.json"
    rec = Recorder(ITEM, vars(args), smoke=args.smoke)
    cases: list[dict[str, Any]] = []
    calibration: dict[str, Any] = {}
    rec.data.update(cases=cases, calibration=calibration, complete=False)
    plan = []
    for spec in args.case:
        name, config, *rest = spec.split(":")
        base = [s for s in (rest[0].split(",") if rest else []) if s] + list(args.overrides)
        for setting in args.setting:
            sets = [*base, *parse_setting(setting)]
            plan.append((name, config, sets, config_problem(config, sets)))
    with tempfile.TemporaryDirectory(prefix="bench_netlab_") as tmp:
        for rate in args.rate:
            if all(problem for *_, problem in plan):
                break
            print(f"netlab: {rate:g} Mbit/s, {args.peers} homes", flush=True)
            with Lab(homes=args.peers, rate_mbit=rate) as lab:
                link = None
                if args.peers >= 2:
                    try:
                        nbytes = int(rate * 1e6 / 8 * args.calibrate_seconds)
                        calibration[f"{rate:g}"] = link = lab.throughput(0, 1, nbytes)
                        print(f"  link measured {link['mbit_per_s']:.1f} Mbit/s", flush=True)
                    except (LabError, OSError, ValueError) as exc:
                        calibration[f"{rate:g}"] = {"problem": str(exc)}
                for name, config, sets, problem in plan:
                    label = f"{name} {rate:g} Mbit/s {setting_label(sets)}"
                    if problem:
                        cases.append({"case": name, "rate_mbit": rate, "setting": sets, "problem": problem})
                        cases[-1]["measured"] = False
                        rec.notes.append(f"{label}: not measured (config: {problem})")
                        print(f"  {label}: skipped: {problem}", flush=True)
                        continue
                    print(f"  {label}: H={args.h}, {args.rounds} rounds", flush=True)
                    c = run_case(lab, name, config, sets, args.h, args.rounds, args.timeout, Path(tmp))
                    cases.append(c)
                    u, lags = c["utilisation"], [e.get("seconds_after_last_record") for e in c["exits"] if e]
                    lag = max((x for x in lags if x is not None), default=None)
                    stopped = [k for k, e in enumerate(c["exits"]) if e and e.get("stopped")]
                    print(
                        f"    utilisation {u if u is None else round(u, 4)}, exposed {c['exposed_per_round']}, "
                        f"sent/round {c['bytes_sent_per_round']}, {c['wall_seconds']:.0f}s; exit {lag}s after the "
                        f"last round{f', peers {stopped} stopped' if stopped else ''} {c['problem'][:300]}",
                        flush=True,
                    )
                    if u is None:
                        rec.notes.append(f"{label}: not measured ({c['problem'] or 'fewer than 2 rounds'})")
                    else:
                        add_row(rec, c, link["mbit_per_s"] if link else None)
                    rec.write(out)
    rec.data["complete"] = True
    rec.notes.append(
        "Each peer runs in its own network namespace behind a veth whose egress, and the bridge port towards it, "
        "are capped by tbf at the rate (the link measured with one TCP transfer between two homes is given); the "
        "bootstrap sits on the bridge. The preset's own swarm settings apply (group size, matchmaking time, "
        "timeouts); round 1 starts once every peer is up. Over the rounds after the first, averaged over peers: "
        "utilisation = sum of compute_seconds / wall between the first and last round's record; exposed "
        "communication = round wall - compute (matchmaking + all-reduce + the rest of the round's work); sent = "
        "payload bytes the averager handed to p2pd per round; wire time = sent x 8 / rate, the least time the "
        "capped link needs. With swarm.overlap=eager a round's all-reduce runs during the next round's compute, "
        "so matchmaking + all-reduce can exceed the exposed time and 'other' can be negative. A peer still running "
        f"{EXIT_GRACE:g} s after every peer recorded its last round is stopped (SIGTERM; noted in the case's "
        "'exits'): shutdown is not measured. Peers share this machine's cores (1 torch thread each)."
    )
    path = rec.write(out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

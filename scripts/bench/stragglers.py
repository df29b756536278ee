"""Item 9: a swarm with one slow peer, fixed H against time-budgeted rounds (inner.round_seconds), at equal wall time.

Fixed H: nobody waits for the slow peer (it announces a later round end, readiness.py); by default (max_staleness 1) its
Δ, 2-3 rounds late, is discarded, and in the last case (max_staleness 4) it counts as a delayed Δ.

Usage:
    python scripts/bench/stragglers.py                        # tiny, 3 peers, one 3x slower, 120 s per swarm
    python scripts/bench/stragglers.py --seconds 120 --slowdown 3 --round-seconds 1.5 --max-steps 40
    python scripts/bench/stragglers.py --smoke [--out DIR/stragglers.json]   # 2 peers, 9 s, 2 of the 5 swarms

Five swarms, one after the other, each of ``--peers`` real ``run_peer`` processes on 127.0.0.1 (tiny preset, one
data shard each, the preset's swarm settings; inner.schedule constant so a run stopped by the clock is not
compared at different points of a cosine): all peers equal or the last one ``--slowdown`` times slower (stopped
for 1 - 1/slowdown of every 0.1 s, scripts.procs.Throttle, as on a slower GPU), with fixed H (``--h`` steps a
round) or with ``inner.round_seconds`` (``--max-steps`` as inner.steps: the cap, above what the fast peers take in a
round, and the unit of the lr warmup, as a user would set it; 1.5 s on this machine is about the 25 steps of fixed H
plus the exchange). Each swarm trains for
``--seconds`` from the moment its last peer has joined; then every peer is stopped (SIGINT: it checkpoints and
exits) and the first (fast) peer's outer state is evaluated on the preset's eval set. Per peer, from its
metrics.jsonl and stderr:
    rounds in a group   rounds whose Δ counted in a group of 2 or more (decision apply or catch_up)
    rounds lost         rounds the peer trained whose work did not reach a group: local steps and discarded rounds
                        (a discarded or resynced round writes no record; its WARN line says so)
    tokens contributed  tokens of the rounds in a group
    utilisation         sum of compute_seconds / the swarm's training seconds
Output: scripts/bench/results/stragglers.json (``--out`` elsewhere; ``--smoke`` without ``--out``: a temporary
directory). Failure: a peer that does not join, or exits non-zero, is noted in the case's ``problem`` and every
process group is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    Recorder,
    exit_on_sigterm,
    fill_defaults,
    read_jsonl,
    run_overrides,
    start_swarm,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.procs import Throttle  # noqa: E402

TINY = "configs/tiny.yaml"
DEFAULTS = {"peers": 3, "seconds": 120.0, "slowdown": 3.0, "h": 25, "round_seconds": 1.5, "max_steps": 40}
SMOKE_CASES = (1, 4)  # --smoke: the two swarms of its one row (fixed H, a slow peer; max_staleness default / 4)
SMOKE = {"peers": 2, "seconds": 9.0, "slowdown": 3.0, "h": 5, "round_seconds": 2.0, "max_steps": 40}
COUNTED = ("apply", "catch_up")
STALE = "swarm.max_staleness=4"  # a 3x slower peer reaches a group 2-3 rounds behind: its Δ counts (protocol.py)


def peer_stats(records: list[dict[str, Any]], stderr: str, seconds: float) -> dict[str, Any]:
    in_group = [r for r in records if r["decision"] in COUNTED and r["group_size"] > 1]
    local = [r for r in records if r["decision"] == "local_step"]
    discarded = len(re.findall(r"round \d+ discarded", stderr))
    return {
        "rounds_recorded": len(records),
        "rounds_in_group": len(in_group),
        "rounds_lost": len(local) + discarded,
        "local_steps": len(local),
        "discarded": discarded,
        "tokens_contributed": sum(r["tokens"] for r in in_group),
        "tokens_trained": sum(r["tokens"] for r in records),
        "utilisation": sum(r["compute_seconds"] for r in records) / seconds,
        "last_round": records[-1]["outer_step"] if records else 0,
    }


def eval_loss(log_dir: Path, config: str, overrides: list[str]) -> float | None:
    """The eval loss (mean over the preset's eval sets) of the outer state in ``log_dir``'s last checkpoint."""
    from p2p_diloco.checkpoint import latest_checkpoint, load_outer_state
    from p2p_diloco.config import load_config
    from p2p_diloco.data import DataPipeline
    from p2p_diloco.engine import evaluate
    from p2p_diloco.model import build_model

    path = latest_checkpoint(log_dir / "checkpoints")
    if path is None:
        return None
    cfg = load_config(config, overrides)
    data = DataPipeline(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.vocab_size, cfg.seed)
    state, _ = load_outer_state(path)
    state.copy_to(model.parameters())
    losses = evaluate(model, data.eval_sets(), cfg.data.batch_size, cfg)
    return sum(losses.values()) / len(losses)


def run_case(name: str, sets: list[str], slow: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    dirs = [workdir / f"{name}_peer{k}" for k in range(args.peers)]
    overrides = [
        *run_overrides(args.h, 100_000, args.peers, "strag"),
        "inner.schedule=constant",
        "train.checkpoint_every=0",
        *sets,
    ]
    per_peer = [[f"data.shard_index={k}"] for k in range(args.peers)]
    boot, procs = start_swarm(TINY, overrides, dirs, per_peer)
    problem, seconds = "", args.seconds
    try:
        for p in procs:
            p.wait_for_line(r"^joined at round", timeout=180)
        started = time.monotonic()
        with Throttle(procs[-1].pid, args.slowdown) if slow else contextlib.nullcontext():
            time.sleep(args.seconds)
        seconds = time.monotonic() - started
        for p in procs:
            p.popen.send_signal(signal.SIGINT)
        for k, p in enumerate(procs):
            rc = p.wait(timeout=120)
            if rc != 0:
                problem += f"peer {k} exited with {rc}: {p.describe(10)}; "
    except Exception as exc:  # noqa: BLE001 - recorded with the case; everything is killed below
        problem += f"{type(exc).__name__}: {exc}"
    finally:
        for p in [*procs, boot]:
            p.kill_group()
    peers = [peer_stats(read_jsonl(d / "metrics.jsonl"), p.stderr, seconds) for d, p in zip(dirs, procs, strict=True)]
    loss = eval_loss(dirs[0], TINY, overrides)
    return {
        "case": name,
        "slow_peer": slow,
        "overrides": sets,
        "seconds": seconds,
        "eval_loss": loss,
        "problem": problem,
        "per_peer": peers,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=None, help="run_peer processes per swarm (3)")
    p.add_argument("--seconds", type=float, default=None, help="training seconds per swarm (120)")
    p.add_argument("--slowdown", type=float, default=None, help="how many times slower the slow peer is (3)")
    p.add_argument("--h", type=int, default=None, help="inner steps per round with fixed H (25, the preset's)")
    p.add_argument("--round-seconds", type=float, default=None, help="inner.round_seconds of the budgeted runs (1.5)")
    p.add_argument("--max-steps", type=int, default=None, help="inner.steps of the budgeted runs: the cap (40)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/stragglers.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    rec = Recorder("stragglers", vars(args), smoke=args.smoke)
    budget = [f"inner.round_seconds={args.round_seconds}", f"inner.steps={args.max_steps}"]
    plan = [
        ("fixed H, equal peers", [], False),
        (f"fixed H, one peer {args.slowdown:g}x slower", [], True),
        ("round_seconds, equal peers", budget, False),
        (f"round_seconds, one peer {args.slowdown:g}x slower", budget, True),
        (f"fixed H, one peer {args.slowdown:g}x slower, its delayed Δ counted", [STALE], True),
    ]
    cases, run = [], {}
    chosen = SMOKE_CASES if args.smoke else range(len(plan))  # the smoke: one swarm per slow-peer code path
    with tempfile.TemporaryDirectory(prefix="bench_strag_") as tmp:
        for k in chosen:
            name, sets, slow = plan[k]
            print(f"stragglers: {name}, {args.peers} peers, {args.seconds:g}s", flush=True)
            c = run_case(f"case{k}", sets, slow, args, Path(tmp))
            c["label"] = name
            cases.append(c)
            run[k] = c
            for j, s in enumerate(c["per_peer"]):
                print(f"  peer {j}{' (slow)' if slow and j == args.peers - 1 else ''}: {s}", flush=True)
            print(f"  eval loss {c['eval_loss']} {c['problem'][:300]}", flush=True)
    rec.data["cases"] = cases
    for base, test in ((0, 1), (2, 3), (0, 3), (0, 4), (1, 4)):
        if base not in run or test not in run:
            continue  # --smoke leaves the equal-peer swarms out
        b, t = run[base], run[test]
        if b["eval_loss"] is None or t["eval_loss"] is None:
            rec.notes.append(f"{t['label']} vs {b['label']}: not measured ({t['problem'] or b['problem']})")
            continue
        slow = t["per_peer"][-1]
        rec.add(
            figure=f"{t['label']} vs {b['label']}: eval loss after {args.seconds:g}s (slow peer: "
            f"{slow['rounds_in_group']} rounds in a group, {slow['rounds_lost']} lost, "
            f"{slow['tokens_contributed']:,} tokens contributed of {slow['tokens_trained']:,} trained)",
            value=t["eval_loss"],
            unit="loss",
            reference=b["label"],
            reference_value=b["eval_loss"],
            ratio=t["eval_loss"] / b["eval_loss"],
            ratio_kind="eval loss ratio (lower is better)",
        )
    rec.notes.append(
        "Equal wall time: each swarm trains for the same seconds from its last peer's join, then stops; the eval "
        "loss is the first (fast) peer's outer state on the preset's eval set. The slow peer is stopped 2/3 of "
        "each 0.1 s (SIGSTOP/SIGCONT of its training process; its DHT and averager processes run). All peers "
        "share this machine's 2 cores, so 'equal' peers differ a little from round to round too."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Item 12: run_simulation's wall time alone and beside busy processes, by torch thread setting.

Usage:
    python scripts/bench/threads.py                       # tiny, 2 workers, 2 rounds; alone and beside 1 busy loop
    python scripts/bench/threads.py --busy 1 --rounds 2 --repeats 2 --case default --case 1
    python scripts/bench/threads.py --smoke [--out DIR/threads.json]   # 1 round of 2 steps, 2 cases

Each case is one ``run_simulation`` process (``--config``, ``--workers``, ``--rounds`` rounds, no evaluation or
checkpoints) started with OMP_NUM_THREADS, MKL_NUM_THREADS and OMP_WAIT_POLICY removed from its environment:
    default          torch's own choice (run_simulation with its thread setting skipped: what it did before
                     train.threads existed)
    auto             ``--threads 0``: the cores this process may use (p2p_diloco/threads.py)
    1                ``--threads 1``
    default-passive  torch's own choice with OMP_WAIT_POLICY=PASSIVE (threads sleep instead of spinning at a barrier)
Each case runs alone and at once again beside ``--busy`` processes that each spin one core (``while True: pass``,
started for that run and killed after it), so both runs of a pair see nearly the same machine; the cases take turns,
``--repeats`` pairs each (the median counts). The figure is results.json's ``wall_seconds`` (data, model, rounds; not
the Python start-up); a run past ``--timeout`` is killed and counts as that many seconds, a lower bound. Per case:
the run beside the busy processes against the same case alone; and beside them, --threads 1 against torch's
default; and alone, torch's default against 1 thread (why auto does not split the cores among run_simulation's
workers).
Output: scripts/bench/results/threads.json (``--out`` elsewhere; ``--smoke`` without ``--out``: a temporary
directory). Failure: a run that exits non-zero stops the script (exit 1), its busy processes killed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Recorder, exit_on_sigterm, fill_defaults, load_now, median  # noqa: E402

CASES = ("default", "auto", "1", "default-passive")
LABELS = {
    "default": "torch's default",
    "auto": "--threads 0 (auto)",
    "1": "--threads 1",
    "default-passive": "torch's default with OMP_WAIT_POLICY=PASSIVE",
}
DEFAULTS: dict[str, Any] = {"case": list(CASES), "busy": 1, "rounds": 2, "workers": 2, "repeats": 1, "overrides": []}
SMOKE: dict[str, Any] = {
    "case": ["default", "1"],
    "rounds": 1,
    "workers": 2,
    "overrides": ["inner.steps=2", "data.batch_size=2", "data.seq_len=32", "data.eval_batches=1"],
}
# run_simulation with its own thread setting skipped: torch's default, as before train.threads
DEFAULT_MAIN = (
    "import sys; import p2p_diloco.simulate as s; s.apply_threads = lambda *a, **k: None; "
    "sys.exit(s.main(sys.argv[1:]))"
)


def command(case: str, args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    sets = [f"train.rounds={args.rounds}", "train.eval_every=0", "train.checkpoint_every=0", *args.overrides]
    cli = ["--config", args.config, "--workers", str(args.workers), "--out", str(out)]
    cli += [a for s in sets for a in ("--set", s)]
    if case in ("default", "default-passive"):
        if case == "default-passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return [sys.executable, "-c", DEFAULT_MAIN, *cli], env
    return [sys.executable, "-m", "p2p_diloco.simulate", *cli, "--threads", "0" if case == "auto" else case], env


def run_once(case: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run; a run past ``--timeout`` is killed and counts as ``--timeout`` seconds (a lower bound)."""
    argv, env = command(case, args, out)
    load = load_now()["loadavg"]
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        return {
            "wall_seconds": args.timeout,
            "timed_out": True,
            "torch_threads": None,
            "busy_warning": False,
            "load_before": load,
        }
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    meta = json.loads((out / "run_metadata.json").read_text())
    return {
        "wall_seconds": results["wall_seconds"],
        "timed_out": False,
        "torch_threads": meta["torch_threads"],
        "busy_warning": "the machine is busy" in proc.stderr,
        "load_before": load,
    }


def run_pairs(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Each case alone and then at once beside ``--busy`` spinning processes (started for that run only, so the two
    runs of a pair see nearly the same machine), every case in turn, ``--repeats`` times."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"alone": {}, "busy": {}}
    for k in range(args.repeats):
        for case in args.case:
            for block in ("alone", "busy"):
                spinners = [_spinner() for _ in range(args.busy if block == "busy" else 0)]
                try:
                    time.sleep(0.5 if spinners else 0)
                    r = run_once(case, args, tmp / f"{block}_{case}_{k}")
                finally:
                    for sp in spinners:
                        sp.kill()
                        sp.wait()
                runs[block].setdefault(case, []).append(r)
                print(
                    f"  {LABELS[case]:46s} {block:5s}: {r['wall_seconds']:6.1f} s"
                    f"{' (timed out)' if r['timed_out'] else ''}, {r['torch_threads']} threads"
                    f"{', warned' if r['busy_warning'] else ''} (load {r['load_before'][0]:.1f})",
                    flush=True,
                )
    return {
        block: {
            c: {
                "wall_seconds": median(r["wall_seconds"] for r in rs),
                "timed_out": any(r["timed_out"] for r in rs),
                "torch_threads": next((r["torch_threads"] for r in rs if r["torch_threads"] is not None), None),
                "runs": rs,
            }
            for c, rs in cases.items()
        }
        for block, cases in runs.items()
    }


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _threads(n: int | None) -> str:
    return "threads unknown: timed out" if n is None else f"{n} thread{'s' if n != 1 else ''}"


def _secs(run: dict[str, Any]) -> str:
    return " (timed out: a lower bound)" if run["timed_out"] else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=CASES, default=None, help=f"repeatable (default: all of {CASES})")
    p.add_argument("--busy", type=int, default=None, help="spinning processes beside each case's second run (1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per run (2)")
    p.add_argument("--workers", type=int, default=None, help="run_simulation --workers (2)")
    p.add_argument("--repeats", type=int, default=None, help="pairs of runs per case, the median counts (1)")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="SECTION.FIELD=VALUE")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take, then a lower bound (120)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/threads.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    rec = Recorder("threads", vars(args), smoke=args.smoke)
    print(f"threads: {args.config}, {args.workers} workers, {args.rounds} rounds, alone / beside {args.busy} busy")
    with tempfile.TemporaryDirectory(prefix="bench_threads_") as tmp:
        blocks = run_pairs(args, Path(tmp))
    rec.data["blocks"] = blocks
    alone, beside = blocks["alone"], blocks["busy"]
    what = f"{Path(args.config).stem}, {args.workers} workers, {args.rounds} round{'s' if args.rounds != 1 else ''}"
    for case in args.case:
        a, b = alone[case], beside[case]
        rec.add(
            figure=f"{what}, {LABELS[case]} ({_threads(b['torch_threads'])}): wall time beside {args.busy} busy "
            f"process(es){_secs(b)}",
            value=b["wall_seconds"],
            unit="s",
            reference="the same alone",
            reference_value=a["wall_seconds"],
            ratio=b["wall_seconds"] / a["wall_seconds"],
            ratio_kind="x the time alone",
        )
    if "default" in args.case and "1" in args.case:
        rec.add(
            figure=f"{what}, beside {args.busy} busy process(es): --threads 1{_secs(beside['1'])}",
            value=beside["1"]["wall_seconds"],
            unit="s",
            reference=f"torch's default ({_threads(beside['default']['torch_threads'])}){_secs(beside['default'])}",
            reference_value=beside["default"]["wall_seconds"],
            ratio=beside["default"]["wall_seconds"] / beside["1"]["wall_seconds"],
            ratio_kind="x faster",
        )
        rec.add(
            figure=f"{what}, alone: torch's default ({_threads(alone['default']['torch_threads'])})",
            value=alone["default"]["wall_seconds"],
            unit="s",
            reference="--threads 1",
            reference_value=alone["1"]["wall_seconds"],
            ratio=alone["1"]["wall_seconds"] / alone["default"]["wall_seconds"],
            ratio_kind="x faster",
        )
    rec.notes.append(
        "Each run is a fresh run_simulation process; wall_seconds from its results.json. The busy processes each spin "
        "one core in pure Python. Between torch's OpenMP parallel regions the idle threads spin by default, so they "
        "look busy to the scheduler: beside a busy process, the thread that shares its core gets part of it and every "
        "op waits for that thread. OMP_WAIT_POLICY=PASSIVE (threads sleep instead) frees a core for it, at the cost of "
        "waking the threads for every op. auto sees the affinity and the cgroup quota, not other processes: here it "
        "picks what torch picks. The machine is shared, so other load shows in each run's load_before."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run tests N times and report each one's pass rate: how a flaky test is found before CI finds it.

    python scripts/flaky.py --runs 5                       # the multi-process tests (-m swarm), 5 times
    python scripts/flaky.py --runs 5 --load 1 -- tests/test_averager.py -k kill
                                                           # the same beside one busy process

Inputs:  ``--runs N``; ``--load K`` busy processes (a spinning Python loop each) beside every run, as a loaded CI
         machine would be; the pytest arguments after ``--`` (default ``-m swarm``: every test that starts peers).
Output:  one line per test: passes/runs, the pass rate and the slowest run's seconds, flaky and failing ones first;
         the runs' junit files under ``--out`` (a temporary folder by default). Exit status 0 when every test passed
         every run, 1 otherwise, 2 when a run collected no test.
State:   none; the busy processes are killed (by PID) when the runs end or the script is interrupted.
Failure: a pytest run that crashes (no junit file) is named and left out of the rates; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def outcomes(junit: Path) -> dict[str, tuple[bool, float]]:
    """test id -> (passed, seconds) from one junit file; skipped tests are left out."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if "skipped" in tags:
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out[name] = ("failure" not in tags and "error" not in tags, float(case.get("time", 0.0)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="how many times to run the tests (default 5)")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside every run (default 0)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs' junit files")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest, after -- (default: -m swarm)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        parser.error("--runs must be >= 1 and --load >= 0")
    out = args.out or Path(tempfile.mkdtemp(prefix="flaky-"))
    out.mkdir(parents=True, exist_ok=True)
    pytest_args = args.pytest_args or ["-m", "swarm"]
    results: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    crashed: list[int] = []  # runs that wrote no junit file: no test's outcome is known for them
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
    try:
        for run in range(1, args.runs + 1):
            junit = out / f"run{run}.xml"
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args]
            rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
            print(f"run {run}/{args.runs}: pytest exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
            if rc == 5:
                print("no test was collected: check the pytest arguments", file=sys.stderr)
                return 2
            if not junit.exists():
                print(f"run {run} wrote no junit file (pytest crashed): no outcome of it counts", flush=True)
                crashed.append(run)
                continue
            for name, outcome in outcomes(junit).items():
                results[name].append(outcome)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    ranked = sorted(results.items(), key=lambda item: (sum(ok for ok, _ in item[1]) / len(item[1]), item[0]))
    for name, runs in ranked:
        passed = sum(ok for ok, _ in runs)
        slowest = max(seconds for _, seconds in runs)
        print(f"{passed}/{len(runs)}  {100 * passed / len(runs):5.1f}%  {slowest:6.1f} s  {name}")
    if crashed:
        print(f"runs that crashed (left out of the rates above): {crashed}")
    print(f"junit files: {out}")
    return 0 if not crashed and all(ok for runs in results.values() for ok, _ in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

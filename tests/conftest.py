"""Shared test setup: the repository root on sys.path (for ``peers``, ``scripts.procs`` and the working tree's
``p2p_diloco`` ahead of any installed copy), and a fixture that cleans up child processes (and, when the test
failed, prints the tail of each one's output: CI keeps nothing else of a failed swarm)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.procs import WARM_START_VARIABLE, Proc  # noqa: E402

# peers start forked from a process that has their modules imported (scripts/zygote.py): ~5 s of CPU less each;
# P2P_DILOCO_WARM_START=0 runs the suite on fresh interpreters
os.environ.setdefault(WARM_START_VARIABLE, "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two tests at a time (pytest -n 2): torch's idle OpenMP threads spin, so a test that trains in this process
    # with 2 threads beside the other worker's test ran several times slower (BENCHMARKS.md item 12); 1 thread
    # each, as the peers the tests start already have (scripts/procs.py sets their OMP_NUM_THREADS=1). The
    # variable too: the simulator and the engine call threads.apply_threads, whose auto would set 2 again (the
    # swarm-equals-simulator test's simulation of 9 worker-rounds took 81 s beside the bench smokes, 1.3 s without)
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

TAIL_LINES = 60  # of each stream of each child, printed when a test fails


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture's teardown can see whether the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture
def spawn(request):
    """``spawn(args, env=None) -> Proc``; every process group it started is SIGKILLed at teardown, and when the
    test failed the last TAIL_LINES lines of each child's stdout and stderr are printed (pytest shows them with the
    failure)."""
    started: list[Proc] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env=env)
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        proc.kill_group()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for k, proc in enumerate(started):
            print(f"\n===== child {k} of {request.node.name}\n{proc.describe(TAIL_LINES)}", file=sys.stderr)

"""A benchmark script run from a test: its one case, read from the result file it wrote (scripts/bench/*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.procs import Proc

ROOT = Path(__file__).resolve().parents[1]


def bench_case(script: str, args: list[str], out: Path, deadline: float) -> dict:
    """Run ``scripts/bench/<script>`` with ``args``, writing ``out`` and keeping the run's directory beside it
    (``--keep``: its peers' logs, for a failure's message); fail the test when it does not exit 0 within
    ``deadline`` seconds. Returns the result file's one case."""
    argv = [sys.executable, str(ROOT / "scripts" / "bench" / script), *args, "--out", str(out)]
    proc = Proc([*argv, "--keep", str(out.with_suffix(""))], cwd=ROOT)
    try:
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{script} {' '.join(args)} did not finish within {deadline:.0f} s\n{proc.describe(40)}")
        assert rc == 0, proc.describe(40)
    finally:
        if proc.alive():
            proc.stop(grace=20.0)
        proc.kill_group()
    (case,) = json.loads(out.read_text())["cases"].values()
    return case

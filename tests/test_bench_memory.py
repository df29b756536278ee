"""The memory benchmark's process-tree sampler (scripts/bench/memory.py) on a real child that execs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
_saved_path = list(sys.path)
sys.path.insert(0, str(BENCH))
import memory  # noqa: E402

sys.path[:] = _saved_path


def test_a_child_that_execs_is_sampled_under_its_new_name():
    """hivemind forks python and then execs p2pd: the sampler must name the process by what it became.

    It used to keep the name of its first sample, so a p2pd caught between fork and exec read as "other
    (python)" and the p2pd role went missing (a CI failure of test_memory_smoke).
    """
    code = "import os, time; time.sleep(0.6); os.execv('/bin/sleep', ['sleep', '5'])"
    # A shell in between roots the sampled tree away from pytest's own children; "; :" keeps it from exec'ing.
    shell = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c "{code}"; :'])
    sampler = memory.TreeSampler(shell.pid, period=0.05)
    seen: list[str] = []
    try:
        sampler.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "sleep" not in seen:
            seen = [e["name"] for e in list(sampler.procs.values()) if e["pid"] != shell.pid]
            time.sleep(0.05)
    finally:
        sampler.stop()
        for pid in [e["pid"] for e in sampler.procs.values() if e["pid"] != shell.pid]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shell.kill()
        shell.wait(timeout=10)
    assert seen == ["sleep"], seen
    roles = sampler.roles()
    assert set(roles) == {"host (run_peer)", "other (sleep)"}, roles

"""scripts/bench/benchlib.py: a benchmark stopped by SIGTERM still cleans up, even when the signal comes twice."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BODY = """
import sys, time
sys.path.insert(0, {bench!r})
from benchlib import exit_on_sigterm
exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("cleaning", flush=True)
    time.sleep(1.0)  # the second SIGTERM lands here
    open({done!r}, "w").write("cleaned up")
"""


@pytest.mark.timeout(60)
def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    done = tmp_path / "done"
    code = BODY.format(bench=str(ROOT / "scripts" / "bench"), done=str(done))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "cleaning"  # inside the finally block now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert done.read_text() == "cleaned up"
    finally:
        proc.kill()
        proc.wait(timeout=10)

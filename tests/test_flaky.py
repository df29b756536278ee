"""scripts/flaky.py: a test that passes every other run is reported at 50%, a steady one at 100%, and the exit
status says that not every run passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUBJECT = """
from pathlib import Path

COUNTER = Path(__file__).with_name("count")


def test_every_other_run():
    n = int(COUNTER.read_text()) if COUNTER.exists() else 0
    COUNTER.write_text(str(n + 1))
    assert n % 2 == 0


def test_steady():
    assert True
"""


@pytest.mark.timeout(120)
def test_flaky_reports_each_tests_pass_rate(tmp_path):
    subject = tmp_path / "test_subject.py"
    subject.write_text(SUBJECT)
    cmd = [sys.executable, "scripts/flaky.py", "--runs", "2", "--out", str(tmp_path / "junit"), "--", str(subject)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any("1/2" in line and "50.0%" in line and "test_every_other_run" in line for line in lines), done.stdout
    assert any("2/2" in line and "100.0%" in line and "test_steady" in line for line in lines), done.stdout
    assert len(list((tmp_path / "junit").glob("run*.xml"))) == 2


@pytest.mark.timeout(60)
def test_flaky_says_when_no_test_was_collected(tmp_path):
    empty = tmp_path / "test_none.py"
    empty.write_text("")
    done = subprocess.run([sys.executable, "scripts/flaky.py", "--runs", "1", "--", str(empty)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 2 and "no test was collected" in done.stderr, done.stdout + done.stderr

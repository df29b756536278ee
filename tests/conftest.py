"""Shared test setup: the repository root on sys.path (for ``peers``, ``scripts.procs`` and the working tree's
``p2p_diloco`` ahead of any installed copy), and a fixture that cleans up child processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.procs import Proc  # noqa: E402


@pytest.fixture
def spawn():
    """``spawn(args, env=None) -> Proc``; every process group it started is SIGKILLed at teardown."""
    started: list[Proc] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env=env)
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        proc.kill_group()

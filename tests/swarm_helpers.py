"""Process helpers for the swarm tests: p2p_diloco.procs (children in their own session, lines read with
deadlines, a kill of the whole process group that tests can check left nothing behind), plus test recipes."""

from __future__ import annotations

import sys

from p2p_diloco.procs import Proc, descendants, live_group_members, wait_until

__all__ = ["Proc", "bootstrap_args", "live_descendants", "live_group_members", "wait_until"]


def live_descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live descendant of ``pid``."""
    return [(child, name) for child, _, name in descendants(pid)]


def bootstrap_args(*extra: str) -> list[str]:
    return [sys.executable, "-m", "peers.run_bootstrap", *extra]

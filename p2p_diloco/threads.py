"""How many CPU threads torch uses: chosen from the cores this process may use, not from the machine's.

Inputs:  ``train.threads`` (or ``--threads``): N > 0 uses N threads; 0 (auto) uses OMP_NUM_THREADS when it is set
         (the launcher's choice: scripts/local_swarm.sh and scripts/procs.py give each peer 1), else the cores
         this process may use (its CPU affinity, capped by the cgroup CPU quota where there is one: a container
         started with ``--cpus 2`` on a 64-core host gets 2, where torch's own default would start 32-64 threads),
         divided among the processes that share them, at least 1.
Output:  :func:`apply_threads` sets ``torch.set_num_threads`` (and the inter-op pool where torch still allows it)
         and logs the choice once: ``torch threads: 2 (2 cores available, 1 worker)``. :func:`auto_threads`,
         :func:`cgroup_quota`, :func:`choose_threads`, :func:`cpu_times`, :func:`busy_cpus` and
         :func:`busy_warning` are the parts that decide, taking their inputs as arguments (the cgroup directory, the
         affinity, the environment, /proc/stat's text).
State:   none of its own; torch's thread settings are process-wide.
Failure: ValueError for a negative count or fewer than 1 worker; an unreadable cgroup file counts as no quota.

Why it matters on a shared machine: between torch's OpenMP parallel regions the idle threads spin (busy-wait) by
default, so they look busy to the scheduler. Beside a process that keeps one core busy, the thread that shares that
core gets part of it and every op waits for that thread. On this project's 2-core machine (BENCHMARKS.md item 12,
scripts/bench/threads.py) run_simulation on tiny with 2 threads took 3.0x as long beside one busy process as alone,
with 1 thread 1.0x; OMP_WAIT_POLICY=PASSIVE (threads sleep instead of spinning) removed the slowdown too but made
the run alone 1.8x slower, so it is not set here.
The affinity and the quota do not show other processes, so auto does not count them (a count that followed the
load at start-up would change from run to run); instead, in auto, :func:`apply_threads` looks at the machine's CPUs
for 0.2 s (/proc/stat) and warns when other work leaves fewer idle than the threads it chose, and says what
``--threads`` to try.

Workers: run_simulation's K workers take turns in one process (each worker's inner steps, then the next's), so
each of them uses every core while it runs and a simulation counts as 1 worker here; splitting the cores K ways
would only leave them idle (1 thread instead of 2 made tiny 1.5x slower on 2 idle cores). ``workers`` is for a
caller that runs several trainings at the same time (simulations in parallel processes, several peers sharing
one machine without OMP_NUM_THREADS): each gets cores // workers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "add_threads_flag",
    "apply_threads",
    "auto_threads",
    "busy_cpus",
    "busy_warning",
    "cgroup_quota",
    "choose_threads",
    "cpu_times",
]

log = logging.getLogger("p2p_diloco.threads")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")
BUSY_SAMPLE_SECONDS = 0.2  # how long auto looks at the machine's CPUs for the busy warning


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup CPU quota in cores (quota / period), or None when there is none or it cannot be read.

    cgroup v2: ``root/cpu.max`` holds ``"max 100000"`` (no quota) or ``"200000 100000"`` (2 cores). cgroup v1:
    ``root/cpu/cpu.cfs_quota_us`` (-1: no quota) and ``root/cpu/cpu.cfs_period_us``.
    """
    try:
        fields = (root / "cpu.max").read_text().split()
        if fields and fields[0] != "max" and len(fields) == 2:
            return _ratio(fields[0], fields[1])
        if fields:
            return None
    except (OSError, ValueError):
        pass
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def auto_threads(affinity: int, quota: float | None, workers: int = 1) -> int:
    """``min(affinity, floor(quota))`` cores (at least 1) divided among ``workers``, at least 1.

    The quota is rounded down: threads beyond it are throttled together with the others at the end of each period.
    """
    if workers < 1:
        raise ValueError(f"workers={workers} is invalid: must be >= 1")
    cores = _usable(affinity, quota)
    return max(1, cores // workers)


def _usable(affinity: int, quota: float | None) -> int:
    cores = max(1, affinity)
    if quota is not None and quota > 0:
        cores = min(cores, max(1, math.floor(quota)))
    return cores


def choose_threads(
    requested: int,
    affinity: int,
    quota: float | None,
    workers: int = 1,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """The thread count for ``requested`` (0: auto) and why, as the log line shows it after the count."""
    if requested < 0:
        raise ValueError(f"threads={requested} is invalid: must be >= 0 (0: auto, from the cores available)")
    if requested > 0:
        return requested, "set by --threads or train.threads"
    omp = (env if env is not None else os.environ).get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    cores = _usable(affinity, quota)
    limit = f", cgroup quota {quota:g}" if quota is not None and math.floor(quota) < max(1, affinity) else ""
    plural = "s" if workers != 1 else ""
    return auto_threads(affinity, quota, workers), f"{cores} cores available{limit}, {workers} worker{plural}"


def cpu_times(stat_text: str) -> tuple[int, int] | None:
    """(busy, total) time of all CPUs together from the text of /proc/stat (its ``cpu`` line, in ticks: user,
    nice, system, idle, iowait, irq, softirq, steal; idle and iowait are not busy); None without that line."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            ticks = [int(x) for x in line.split()[1:9]]
            total = sum(ticks)
            return total - ticks[3] - ticks[4], total
    return None


def busy_cpus(before: tuple[int, int], after: tuple[int, int], cpus: int) -> float:
    """How many of ``cpus`` CPUs were busy between two :func:`cpu_times` readings."""
    elapsed = after[1] - before[1]
    return 0.0 if elapsed <= 0 else cpus * (after[0] - before[0]) / elapsed


def busy_warning(threads: int, cpus: int, busy: float) -> str | None:
    """A warning when other work keeps ``busy`` of the machine's ``cpus`` CPUs busy and leaves fewer idle than
    ``threads``; None otherwise."""
    idle = cpus - busy
    if threads <= 1 or idle >= threads - 0.5:
        return None
    suggest = max(1, math.floor(idle + 0.5))
    return (
        f"the machine is busy (other work keeps {busy:.1f} of {cpus} CPUs busy): with {threads} torch threads each "
        f"op waits for a thread that shares a core with that work, which can make training several times slower; "
        f"try --threads {suggest}"
    )


def _other_busy_cpus(cpus: int) -> float | None:
    """CPUs busy with other work now: /proc/stat over BUSY_SAMPLE_SECONDS while this process sleeps (it has not
    started any work yet); None where there is no /proc/stat. Instantaneous, unlike the load average, which still
    counts work that ended a minute ago."""
    try:
        before = cpu_times(PROC_STAT.read_text())
        time.sleep(BUSY_SAMPLE_SECONDS)
        after = cpu_times(PROC_STAT.read_text())
    except (OSError, ValueError):
        return None
    return None if before is None or after is None else busy_cpus(before, after, cpus)


def apply_threads(requested: int, workers: int = 1) -> int:
    """Choose (see :func:`choose_threads`), set torch's intra-op threads and, where still allowed, its inter-op
    threads; log the choice; return the count."""
    import torch

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    threads, why = choose_threads(requested, affinity, quota, workers)
    torch.set_num_threads(threads)
    try:  # raises once inter-op work has started or it was set before; the inter-op pool is idle in training
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        log.debug("torch inter-op threads left at %d (already in use)", torch.get_num_interop_threads())
    log.info("torch threads: %d (%s)", threads, why)
    cores = _usable(affinity, quota)
    if threads > cores:
        log.warning("%d torch threads on %d cores wait for each other: try --threads %d", threads, cores, cores)
    elif requested == 0 and threads > 1:
        cpus = os.cpu_count() or affinity
        busy = _other_busy_cpus(cpus)
        warning = busy_warning(threads, cpus, busy) if busy is not None else None
        if warning:
            log.warning(warning)
    return threads


def add_threads_flag(parser: Any) -> None:
    """``--threads N`` on a command line (run_peer, run_simulation): None when not given, so train.threads holds."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (overrides train.threads; 0: auto, the cores this process may use, or OMP_NUM_THREADS "
        "when set); on a machine where other work runs, give the cores it leaves free",
    )

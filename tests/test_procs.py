"""scripts/procs.py: lines read with deadlines, errors that carry the child's output, a group kill that leaves
nothing behind (a grandchild included); a throttled process runs slower and is left running."""

import os
import sys
import time

import pytest

from scripts.procs import Proc, ProcessOutputError, Throttle, descendants, live_group_members, wait_until

# prints a line, starts a grandchild that sleeps in the same process group, then waits for stdin lines
CHILD = """
import subprocess, sys, time
print("ready", flush=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("warn", file=sys.stderr, flush=True)
for line in sys.stdin:
    print("echo " + line.strip(), flush=True)
"""


def test_lines_deadlines_and_a_group_kill_that_leaves_nothing():
    proc = Proc([sys.executable, "-c", CHILD], stdin=True)
    try:
        assert proc.wait_for_line(r"^ready$", timeout=30).string == "ready"
        assert wait_until(lambda: len(descendants(proc.pid)) == 1, 10), descendants(proc.pid)
        assert {pid for pid, _ in live_group_members(proc.pgid)} == {proc.pid, descendants(proc.pid)[0][0]}
        proc.send("hello")
        assert proc.wait_for_line(r"^echo (\w+)$", timeout=30).group(1) == "hello"
        with pytest.raises(ProcessOutputError, match="no stdout line matching 'never'") as err:
            proc.wait_for_line("never", timeout=0.3)
        assert "warn" in str(err.value) and proc.stderr == "warn"  # the message carries the child's output
        assert proc.alive()
    finally:
        proc.kill_group()
    assert not proc.alive()
    assert wait_until(lambda: not live_group_members(proc.pgid), 10), live_group_members(proc.pgid)


def test_stdout_closing_first_is_reported_and_threads_default_to_one():
    bare = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for env, threads in ((bare, "1"), ({**bare, "OMP_NUM_THREADS": "3"}, "3")):
        proc = Proc([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], env=env)
        try:
            assert proc.next_line(timeout=30) == threads
            with pytest.raises(ProcessOutputError, match="stdout closed"):
                proc.wait_for_line("more", timeout=30)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill_group()


# counts busy loops; prints the count every time a line comes on stdin
COUNTER = """
import sys, threading
count = [0]
def spin():
    while True:
        count[0] += 1
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    print(count[0], flush=True)
"""


def test_a_throttled_process_makes_a_fraction_of_a_siblings_progress_and_is_continued_after():
    procs = [Proc([sys.executable, "-c", COUNTER], stdin=True) for _ in range(2)]
    try:
        for proc in procs:
            proc.wait_for_line(r"^ready$", timeout=30)

        def counts() -> list[int]:
            for proc in procs:
                proc.send("count")
            return [int(proc.wait_for_line(r"^\d+$", timeout=30).string) for proc in procs]

        with Throttle(procs[1].pid, slowdown=4, period=0.05):
            before = counts()
            time.sleep(2.0)
            after = counts()
        free, throttled = (a - b for a, b in zip(after, before))
        assert throttled < 0.6 * free, (throttled, free)  # 1/4 of the time running (the sibling shares 2 cores)
        time.sleep(0.5)
        assert counts()[1] > after[1]  # running again: not left stopped
    finally:
        for proc in procs:
            proc.kill_group()


# what a program can see of how it was started
PROBE = """
import os, random, sys
print(repr((sys.argv, os.getcwd(), os.environ.get("PROBE"), sys.path[0], __name__, os.getsid(0) == os.getpid())))
print(random.random(), os.getppid(), flush=True)
code = sys.stdin.readline().strip()
if code == "raise":
    raise ValueError("from the probe")
if code == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(code))
"""


@pytest.mark.parametrize("how", ["-c", "script"])
def test_a_warm_child_runs_as_a_fresh_interpreter_would(tmp_path, how):
    """scripts/zygote.py forks the child from a process with the peers' modules imported: it must see the same
    argv, working directory, environment, sys.path[0] and session as a fresh interpreter, draw other random
    numbers than its siblings, and end with the same exit status."""
    from scripts.procs import _warm_starter

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = [sys.executable, "-c", PROBE, "x"] if how == "-c" else [sys.executable, str(script), "x"]
    env = {**os.environ, "PROBE": "p"}

    def run(warm: bool, code: str) -> tuple[str, float, int, int, str]:
        proc = Proc(args, env=env, stdin=True, cwd=tmp_path, warm=warm)
        try:
            seen = proc.next_line(timeout=60)
            draw, parent = proc.next_line(timeout=30).split()
            proc.send(code)
            return seen, float(draw), int(parent), proc.wait(timeout=30), proc.stderr
        finally:
            proc.kill_group()

    cold, warm = run(False, "3"), run(True, "3")
    assert warm[0] == cold[0] and warm[3] == cold[3] == 3, (cold, warm)
    assert warm[2] == _warm_starter().server.pid != cold[2]  # forked by the zygote, not started afresh
    assert run(True, "3")[1] != warm[1]  # its own random seed, not the zygote's
    for code, status in (("raise", 1), ("interrupt", -2)):
        cold, warm = run(False, code), run(True, code)
        assert warm[3] == cold[3] == status, (code, cold, warm)
        assert warm[4].splitlines()[-1] == cold[4].splitlines()[-1], (cold[4], warm[4])


def test_a_warm_peer_entry_point_prints_what_a_fresh_one_does():
    """``python -m peers.run_peer --help`` forked from the zygote: the same text and exit code as a fresh one."""
    outs = []
    for warm in (False, True):
        proc = Proc([sys.executable, "-m", "peers.run_peer", "--help"], warm=warm)
        try:
            assert proc.wait(timeout=60) == 0
            outs.append((proc.stdout_lines, proc.stderr))
        finally:
            proc.kill_group()
    assert outs[0] == outs[1] and "run_peer" in "\n".join(outs[0][0])


def test_a_warm_child_killed_holding_an_imported_lock_does_not_block_its_siblings():
    """hivemind makes multiprocessing locks at import (MPFuture's, SharedBytes'); forked from one zygote, every
    peer would share them, and one SIGKILLed while holding one would block the rest for good (seen: peers' DHT nodes
    stopped starting). Each warm child gets its own, as a fresh interpreter does."""
    take = "from hivemind.utils.mpfuture import MPFuture; print(MPFuture._update_lock.acquire(timeout=10), flush=True)"
    holder = Proc([sys.executable, "-c", take + "; import time; time.sleep(60)"], warm=True)
    try:
        assert holder.next_line(timeout=60) == "True"
    finally:
        holder.kill_group()  # SIGKILL while it holds the lock
    sibling = Proc([sys.executable, "-c", take], warm=True)
    try:
        assert sibling.next_line(timeout=60) == "True", sibling.describe()
    finally:
        sibling.kill_group()

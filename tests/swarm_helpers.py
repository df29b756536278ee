"""Process helpers for swarm tests: children in their own session, lines read with a timeout, and a kill of
the whole process group (the DHT child and p2pd included) that tests can check left nothing behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(command name, state, pgid) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 1 :].split()
    return name, fields[0], int(fields[3])


def live_group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process in group ``pgid`` that is not a zombie."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None and info[2] == pgid and info[1] != "Z":
                out.append((int(entry), info[0]))
    return out


def live_descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live (non-zombie) descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 1 :].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
            names[int(entry)] = raw[raw.index("(") + 1 : raw.rindex(")")]
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, names[child]))
            todo.append(child)
    return out


def wait_until(predicate, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    """One torch/OpenMP thread per child: several peers share this machine's cores, and OpenMP threads that
    spin-wait for descheduled siblings make an oversubscribed peer many times slower."""
    merged = dict(os.environ if env is None else env)
    merged.setdefault("OMP_NUM_THREADS", "1")
    return merged


class Proc:
    """A child process in its own session; stdout lines go to a queue, stderr is collected."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = args
        self.popen = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=_child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.popen.pid  # a session leader's pgid is its pid
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.popen.stdout, self.stdout_lines, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr, self.stderr_lines, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream, sink: list[str], to_queue: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            sink.append(line)
            if to_queue:
                self._queue.put(line)
        if to_queue:
            self._queue.put(None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        """The first new stdout line matching ``pattern`` (re.search); AssertionError on timeout or EOF."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no stdout line matching {pattern!r} within {timeout} s\n{self.describe()}")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"stdout closed before a line matching {pattern!r}\n{self.describe()}")
            match = regex.search(line)
            if match:
                return match

    def next_line(self, timeout: float) -> str | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait(self, timeout: float) -> int:
        rc = self.popen.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=5)
        return rc

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    def describe(self) -> str:
        return (
            f"args: {self.args}\nrc: {self.popen.poll()}\nstdout:\n"
            + "\n".join(self.stdout_lines)
            + "\nstderr:\n"
            + self.stderr
        )

    def kill_group(self) -> None:
        """SIGKILL every process of the group, then reap the leader."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def bootstrap_args(*extra: str) -> list[str]:
    return [sys.executable, "-m", "peers.run_bootstrap", *extra]

"""Child processes of a local swarm, for the tests and the benchmarks: start, read, stop, leave nothing behind.

Not part of the installed library: the tests import it as ``scripts.procs`` (tests/conftest.py puts the
repository root on sys.path) and scripts/bench/benchlib.py the same way, so there is one copy.

Inputs:  a command line and an environment (torch/OpenMP threads default to 1 per child: several peers share
         one machine's cores, and OpenMP threads spin-waiting for descheduled siblings make an
         oversubscribed peer many times slower).
Output:  a Proc: the child in its own session (so its process group holds its DHT, averager and p2pd
         children), stdout lines on a queue read with deadlines, stdout and stderr kept for messages.
         /proc readers: the live members of a process group, the live descendants of a pid.
         ``Throttle``: one process made N times slower (SIGSTOP/SIGCONT duty cycle), as on a slower GPU.
State:   two reader threads per Proc, one per Throttle; nothing global.
Failure: ProcessOutputError (a RuntimeError, with the child's output) when an expected line does not come
         in time or stdout closes first; ExitTimeout (a subprocess.TimeoutExpired, with the output) when a
         child does not exit in time. kill_group() never raises for a child that is already gone.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

__all__ = ["ExitTimeout", "Proc", "ProcessOutputError", "Throttle", "descendants", "live_group_members", "wait_until"]


class ProcessOutputError(RuntimeError):
    """A child did not print the expected line within its deadline, or closed stdout first."""


class ExitTimeout(subprocess.TimeoutExpired):
    """A child did not exit within its deadline; the message has the tail of its output."""

    def __init__(self, args: list[str], timeout: float, description: str) -> None:
        super().__init__(args, timeout)
        self.description = description

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.description}"


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    merged = dict(os.environ if env is None else env)
    merged.setdefault("OMP_NUM_THREADS", "1")
    return merged


class Proc:
    """A child process in its own session; stdout lines go to a queue, stdout and stderr are collected."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        stdin: bool = False,
        cwd: str | Path | None = None,
    ) -> None:
        self.args = list(args)
        self.popen = subprocess.Popen(
            self.args,
            cwd=cwd,
            env=_child_env(env),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.popen.pid  # a session leader's process group id is its pid
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.popen.stdout, self.stdout_lines, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr, self.stderr_lines, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: IO[str], sink: list[str], to_queue: bool) -> None:
        with stream:  # closed here at EOF: closing it elsewhere would block until this read returns
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

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (needs ``stdin=True``)."""
        if self.popen.stdin is None:
            raise ValueError("this Proc was started without stdin=True")
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        """The next stdout line matching ``pattern`` (re.search); ProcessOutputError on timeout or EOF."""
        deadline, regex = time.monotonic() + timeout, re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProcessOutputError(f"no stdout line matching {pattern!r} within {timeout:g} s\n{self.describe()}")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise ProcessOutputError(f"stdout closed before a line matching {pattern!r}\n{self.describe()}")
            match = regex.search(line)
            if match:
                return match

    def next_line(self, timeout: float) -> str | None:
        """The next stdout line, or None after ``timeout`` seconds (also None once stdout has closed)."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait(self, timeout: float) -> int:
        """The exit code; ExitTimeout (a subprocess.TimeoutExpired that shows the output) after ``timeout`` s."""
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ExitTimeout(self.args, timeout, self.describe(60)) from None
        for t in self._threads:
            t.join(timeout=5)
        return rc

    def alive(self) -> bool:
        return self.popen.poll() is None

    def describe(self, tail: int | None = None) -> str:
        """Command line, exit code and the output (the last ``tail`` lines of each stream, or all)."""
        out = "\n".join(self.stdout_lines[-tail:] if tail else self.stdout_lines)
        err = "\n".join(self.stderr_lines[-tail:] if tail else self.stderr_lines)
        return f"args: {self.args}\nrc: {self.popen.poll()}\nstdout:\n{out}\nstderr:\n{err}"

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group (so it can clean up), then SIGKILL whatever is left after ``grace``."""
        try:
            os.killpg(self.pgid, signal.SIGTERM)
            self.popen.wait(timeout=grace)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL every process of the child's group, reap the leader and close its stdin.

        stdout and stderr close when their reader threads see EOF, once every process holding them is gone. Not
        every such process dies with the group: torch's ``torch_shm_manager`` runs in a session of its own and
        exits by itself about 2 s after its last client (measured); closing the pipes here waited for it, 2 s
        per process killed.
        """
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass


def _stat(pid: int) -> tuple[str, str, int, int] | None:
    """(command name, state, parent pid, process group id) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 1 :].split()
    return raw[raw.index("(") + 1 : raw.rindex(")")], fields[0], int(fields[1]), int(fields[3])


def _live() -> dict[int, tuple[str, str, int, int]]:
    """Every process that is not a zombie, by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None and info[1] != "Z":
                out[int(entry)] = info
    return out


def live_group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live process in group ``pgid``."""
    return [(pid, info[0]) for pid, info in _live().items() if info[3] == pgid]


def descendants(pid: int) -> list[tuple[int, int, str]]:
    """(pid, parent pid, command name) of every live descendant of ``pid``."""
    children: dict[int, list[tuple[int, str]]] = {}
    for child, info in _live().items():
        children.setdefault(info[2], []).append((child, info[0]))
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child, name in children.get(parent, []):
            out.append((child, parent, name))
            todo.append(child)
    return out


def wait_until(predicate: Callable[[], object], timeout: float, poll: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


class Throttle:
    """Make one process ``slowdown`` times slower while in the ``with`` block: it is stopped (SIGSTOP) for
    ``1 - 1/slowdown`` of every ``period`` seconds and runs the rest. Only that pid: a training peer's DHT and
    averager processes keep running, as on a machine with a slower GPU. It is always continued on the way out."""

    def __init__(self, pid: int, slowdown: float, period: float = 0.1):
        if slowdown < 1:
            raise ValueError(f"slowdown={slowdown} must be >= 1")
        self.pid, self.period, self.stopped = pid, period, 1.0 - 1.0 / slowdown
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name=f"throttle-{pid}", daemon=True)

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _cycle(self) -> None:
        try:
            while not self._done.is_set() and self._signal(signal.SIGSTOP):
                self._done.wait(self.period * self.stopped)
                if not self._signal(signal.SIGCONT):
                    return
                self._done.wait(self.period * (1.0 - self.stopped))
        finally:
            self._signal(signal.SIGCONT)

    def __enter__(self) -> Throttle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

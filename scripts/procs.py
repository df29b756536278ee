"""Child processes of a local swarm, for the tests and the benchmarks: start, read, stop, leave nothing behind.

Not part of the installed library: the tests import it as ``scripts.procs`` (tests/conftest.py puts the
repository root on sys.path) and scripts/bench/benchlib.py the same way, so there is one copy.

Inputs:  a command line and an environment (torch/OpenMP threads default to 1 per child: several peers share
         one machine's cores, and OpenMP threads spin-waiting for descheduled siblings make an
         oversubscribed peer many times slower).
Output:  a Proc: the child in its own session (so its process group holds its DHT, averager and p2pd
         children), stdout lines on a queue read with deadlines, stdout and stderr kept for messages. With
         ``warm`` (default: the environment variable P2P_DILOCO_WARM_START=1; the tests set it) a Python child is
         forked from a process that has the peers' modules imported already (scripts/zygote.py: one per process
         that asks, started on first use) instead of starting a fresh interpreter: the same program, ~5 s of CPU
         less a peer. Commands it cannot start that way (not ``sys.executable`` with ``-m``, ``-c`` or a
         script; an environment that differs from the zygote's in what is read at import: threads, PYTHON*,
         CUDA, ...) start fresh.
         /proc readers: the live members of a process group, the live descendants of a pid.
         ``Throttle``: one process made N times slower (SIGSTOP/SIGCONT duty cycle), as on a slower GPU.
State:   two reader threads per Proc, one per Throttle; the zygote and its listening thread, once started
         (closed at exit).
Failure: ProcessOutputError (a RuntimeError, with the child's output) when an expected line does not come
         in time or stdout closes first; ExitTimeout (a subprocess.TimeoutExpired, with the output) when a
         child does not exit in time. kill_group() never raises for a child that is already gone.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
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


ROOT = Path(__file__).resolve().parents[1]
WARM_START_VARIABLE = "P2P_DILOCO_WARM_START"
# environment variables read while torch, transformers and hivemind import: a child whose values differ from the
# zygote's starts fresh
_IMPORT_TIME_PREFIXES = tuple(
    "OMP_ MKL_ OPENBLAS_ GOMP KMP_ PYTHON CUDA TORCH HIVEMIND HF_ TRANSFORMERS TOKENIZERS LD_".split()
)


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    merged = dict(os.environ if env is None else env)
    merged.setdefault("OMP_NUM_THREADS", "1")
    return merged


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


class _Forked:
    """What Proc and its users call on a subprocess.Popen (pid, args, stdin, returncode, poll, wait, send_signal,
    terminate, kill), for a child of the zygote: its exit status comes from the zygote, which reaps it."""

    def __init__(self, pid: int, args: list[str], stdin: IO[str] | None) -> None:
        self.pid, self.args, self.stdin = pid, args, stdin
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, rc: int) -> None:
        self.returncode = rc
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The client of one scripts/zygote.py: asks it to fork children, hears when they end."""

    LOST = 255  # the exit status given to children still running when the zygote itself died

    def __init__(self) -> None:
        self.env = _child_env(None)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "scripts.zygote", "--fd", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.sock = ours
        ours.settimeout(300.0)
        try:
            ready = json.loads(ours.recv(4096) or b"{}")
        except (TimeoutError, ValueError):
            ready = {}
        if not ready.get("ready"):
            self.server.kill()
            raise RuntimeError("the zygote (scripts/zygote.py) did not come up: see its stderr above")
        ours.settimeout(None)
        self._lock = threading.Lock()  # one request at a time
        self._table = threading.Lock()  # the children and the exits heard before their pid
        self._replies: queue.Queue[dict] = queue.Queue()
        self._children: dict[int, _Forked] = {}
        self._ended_early: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._listen, name="zygote-listener", daemon=True).start()

    def accepts(self, args: Sequence[str], env: dict[str, str]) -> bool:
        if len(args) < 2 or args[0] != sys.executable or self._gone:
            return False
        if args[1] in ("-m", "-c"):
            if len(args) < 3:
                return False
        elif args[1].startswith("-") or not args[1].endswith(".py"):
            return False
        return _import_time_env(env) == _import_time_env(self.env)

    def start(self, args: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> _Forked:
        """Fork ``args`` (accepted by ``accepts``) with ``fds`` as its stdin, stdout and stderr."""
        request = json.dumps({"argv": args[1:], "cwd": cwd, "env": env}).encode()
        with self._lock:
            socket.send_fds(self.sock, [request], fds)
            reply = self._replies.get(timeout=60.0)
            if "pid" not in reply:
                raise RuntimeError(f"the zygote did not start {args}: {reply.get('error', reply)}")
        child = _Forked(reply["pid"], args, None)
        with self._table:
            rc = self._ended_early.pop(child.pid, None)
            if rc is None:
                self._children[child.pid] = child
        if rc is not None:
            child._exited(rc)
        return child

    def _listen(self) -> None:
        while True:
            try:
                message = self.sock.recv(4096)
            except OSError:
                message = b""
            if not message:
                break
            news = json.loads(message)
            if "exit" not in news:
                self._replies.put(news)
                continue
            with self._table:
                child = self._children.pop(news["exit"], None)
                if child is None:
                    self._ended_early[news["exit"]] = news["rc"]
            if child is not None:
                child._exited(news["rc"])
        self._gone = True
        self._replies.put({"error": "the zygote is gone"})
        with self._table:
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            child._exited(self.LOST)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _warm_starter() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = _Zygote()
            atexit.register(_zygote.close)
        return _zygote


class Proc:
    """A child process in its own session; stdout lines go to a queue, stdout and stderr are collected."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        stdin: bool = False,
        cwd: str | Path | None = None,
        warm: bool | None = None,
    ) -> None:
        self.args, child_env = list(args), _child_env(env)
        if warm is None:
            warm = os.environ.get(WARM_START_VARIABLE) == "1"
        zygote = _warm_starter() if warm else None
        streams: tuple[IO[str], IO[str]]
        if zygote is not None and zygote.accepts(self.args, child_env):
            self.popen, streams = self._fork(zygote, child_env, stdin, cwd)
        else:
            self.popen = subprocess.Popen(
                self.args,
                cwd=cwd,
                env=child_env,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            streams = (self.popen.stdout, self.popen.stderr)
        self.pgid = self.popen.pid  # a session leader's process group id is its pid
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pump, args=(streams[0], self.stdout_lines, True), daemon=True),
            threading.Thread(target=self._pump, args=(streams[1], self.stderr_lines, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _fork(
        self, zygote: _Zygote, env: dict[str, str], stdin: bool, cwd: str | Path | None
    ) -> tuple[_Forked, tuple[IO[str], IO[str]]]:
        """Start the child from ``zygote`` on fresh pipes; the child's ends are closed here once it has them."""
        stdin_r, stdin_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), None)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            child = zygote.start(self.args, env, str(cwd or os.getcwd()), [stdin_r, out_w, err_w])
        except BaseException:
            for fd in (stdin_w, out_r, err_r):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        if stdin_w is not None:
            child.stdin = open(stdin_w, "w")  # noqa: SIM115 - closed by kill_group
        return child, (open(out_r), open(err_r))  # noqa: SIM115 - closed by the reader threads

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
        every such process dies with the group: torch's ``torch_shm_manager`` (started under hivemind's file_system
        sharing, which p2p_diloco replaces: swarm/shm.py) runs in a session of its own and exits by itself about 2 s
        after its last client (measured); closing the pipes here waited for it, 2 s per process killed.
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

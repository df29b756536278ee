"""A warm start for child Python processes: import the peers' modules once, then fork one child per request.

Why: a peer's imports (torch, transformers, hivemind) cost ~5 s of CPU, and the test suite starts a few hundred
peers on two cores. A child forked from here is running its ``main`` within a fraction of a second, and is otherwise
the process ``python -m ...`` would have been: its own session, the stdin/stdout/stderr it was handed, its argv,
working directory and environment, ``sys.path[0]`` as the interpreter sets it, fresh ``random``/numpy seeds, its own
multiprocessing locks where the imports made process-shared ones (``_shared_locks``: without this, a peer
SIGKILLed while holding one of hivemind's blocked every later peer), atexit handlers and non-daemon threads run on
the way out, and the exit status a fresh interpreter gives (``-N`` when a signal killed it, SIGINT re-raised after
an uncaught KeyboardInterrupt). Forking after these imports is what hivemind itself does for its DHT and averager
processes.

Inputs:  ``--fd N``: a SOCK_SEQPACKET Unix socket. Each request is one message: JSON ``{"argv", "cwd", "env"}``
         (argv without the interpreter: ``["-m", module, ...]``, ``["-c", code, ...]`` or ``[script, ...]``) with
         three file descriptors attached (the child's stdin, stdout, stderr).
Output:  per request, in order, ``{"pid": n}`` or ``{"error": "..."}``; whenever a child ends,
         ``{"exit": pid, "rc": rc}`` (rc as subprocess.Popen reports it). ``{"ready": true}`` once the imports
         are done.
State:   none beyond the modules imported; children are reaped as they end.
Failure: a request it cannot read is answered with an error. It exits when its socket closes (the client is
         gone); children live on in their own sessions, and whoever started them kills them by process group.

Used by scripts/procs.py (``Proc`` with ``warm=True``); not part of the installed library.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading

PRELOAD = ("peers.run_peer", "peers.run_bootstrap", "peers.run_monitor")
MAX_MESSAGE = 1 << 20  # bytes of one request: argv and environment


def _preload() -> list[tuple[object, str]]:
    """Import what the peers import, then forget the entry modules themselves: runpy runs each anew as
    ``__main__`` (an entry module already in sys.modules would make it warn and run a second copy). Returns where the
    imports left a process-shared lock (``_shared_locks``)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
        del sys.modules[name]
    return _shared_locks()


def _shared_locks() -> list[tuple[object, str]]:
    """(owner, attribute) of every multiprocessing lock a module or one of its classes made at import. Such a lock
    is one semaphore for every process forked from here: a peer SIGKILLed while holding one would block every other
    peer that takes it (hivemind's MPFuture and SharedBytes locks, measured: peers' DHT nodes stopped starting after
    a while), where fresh interpreters each make their own. Each child gets new ones (``_fresh_locks``). Any other
    process-shared primitive made at import has no safe copy: the zygote refuses to start."""
    import multiprocessing.synchronize as sync
    import warnings

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading some modules' attributes warns (deprecated aliases)
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            owners = [(module, namespace)] + [
                (value, vars(value))
                for value in list(namespace.values())
                if isinstance(value, type) and value.__module__ == name
            ]
            for owner, attributes in owners:
                for attribute, value in list(attributes.items()):
                    if isinstance(value, sync.Lock | sync.RLock):
                        found.append((owner, attribute))
                    elif isinstance(value, sync.SemLock | sync.Event | sync.Condition | sync.Barrier):
                        raise RuntimeError(
                            f"{name}.{attribute} is a process-shared {type(value).__name__} made at import: forked "
                            "peers would share it; scripts/zygote.py cannot give each its own"
                        )
    return found


def _fresh_locks(locks: list[tuple[object, str]]) -> None:
    """A new lock of the same kind in place of each one ``_shared_locks`` found (in a forked child)."""
    import multiprocessing

    for owner, attribute in locks:
        setattr(owner, attribute, type(getattr(owner, attribute))(ctx=multiprocessing.get_context()))


def _exit_status(status: int) -> int:
    """A waitpid status as Popen.returncode gives it: the exit code, or -N for signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child_main(request: dict) -> int:
    """Run the requested program in this (forked) process, as the interpreter would; its exit code."""
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as problem:
        sys.excepthook(type(problem), problem, problem.__traceback__.tb_next)  # the traceback from the program on
        return -signal.SIGINT if isinstance(problem, KeyboardInterrupt) else 1


def _finish(code: int) -> None:
    """What the interpreter does on the way out: join non-daemon threads, run atexit handlers, flush; then exit
    (re-raising SIGINT after an uncaught KeyboardInterrupt, as CPython does)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join at exit
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _become_child(request: dict, fds: list[int], locks: list[tuple[object, str]]) -> None:
    """In the forked process (the server's own descriptors closed): the requested session, stdio, directory,
    environment and seeds; then run."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_locks(locks)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    _finish(_child_main(request))


def serve(sock: socket.socket, locks: list[tuple[object, str]]) -> None:
    """Answer requests until the socket closes; report each child's exit. ``locks``: what each child makes anew."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            except OSError:
                return
            if not message:
                return
            try:
                request = json.loads(message)
                if len(fds) != 3 or not isinstance(request.get("argv"), list) or not request["argv"]:
                    raise ValueError(f"a request needs argv and 3 file descriptors, got {len(fds)}")
            except ValueError as problem:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": str(problem)}).encode())
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                _become_child(request, fds, locks)
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "rc": _exit_status(status)}).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket to serve")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.fd)
    locks = _preload()
    try:
        serve(sock, locks)
    except (BrokenPipeError, ConnectionResetError):
        pass


if __name__ == "__main__":
    main()

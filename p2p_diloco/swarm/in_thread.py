"""hivemind's child processes (the DHT node, the averager) as threads of this process: many peers in one process.

Inputs:  an ``mp.Process`` subclass of hivemind's (``DHT``, ``DecentralizedAverager``) that mixes in
         :class:`ThreadOrProcess`, with ``in_thread`` set before ``start()``.
Output:  ``start()`` runs the object's ``run()`` (hivemind's event loop) in a daemon thread instead of a forked
         process; ``is_alive``, ``join``, ``terminate`` and ``kill`` answer for the thread. The host and the loop talk
         through hivemind's own pipes, as between processes. With ``in_thread`` False (every real peer) nothing
         changes.
State:   the thread. Each such DHT node still owns its p2pd daemon (a child process of this one): a
         libp2p identity is one daemon.
Failure: a thread cannot be killed: ``terminate``/``kill`` only log; ``join`` then returns with the thread still up
         (it is a daemon, so it never keeps the interpreter alive).

Why: a peer costs a host process, a DHT process and an averager process (each a Python interpreter with torch) plus
its p2pd; the scale harness (scripts/bench/scale.py) runs tens to hundreds of peers on one machine, which only fits
with one interpreter for many of them. hivemind calls ``signal.signal`` as its loops start, which Python refuses
outside the main thread (``allow_in_threads`` makes those calls no-ops there), passes MPFutures through its pipes
(an unpickled copy finished "in the other process" is, here, in the origin's process, so it would finish only
itself: the copy sends the update to the original, as from another process; and a dying copy would take the
original's entry in the table of live futures with it, so the update would find nobody: a copy's death leaves it),
and wakes a future's asyncio waiters
with ``run_until_complete`` on the creator's loop, which asyncio refuses inside another thread's running loop (nobody
awaits on a loop that is not running, so the event is set directly then). Each DHT node's loop spawns its p2pd, and
uvloop refuses a spawn while another loop of the process is forking ("Racing with another loop to spawn a process":
one of 32 peers failed so at start, and the run waited out its join_timeout for it): such a spawn is tried again.
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import logging
import os
import random
import signal as _signal
import threading
from types import ModuleType
from typing import Any

__all__ = ["ThreadOrProcess", "allow_in_threads"]

log = logging.getLogger("p2p_diloco.in_thread")


class _MainThreadSignals(ModuleType):
    """The ``signal`` module, whose ``signal()`` does nothing outside the main thread (where Python refuses it)."""

    def __init__(self) -> None:
        super().__init__("signal")

    def __getattr__(self, name: str) -> Any:
        return getattr(_signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            return _signal.signal(signum, handler)
        return _signal.getsignal(signum)


def _set_event_threadsafe(future: Any) -> None:
    """MPFuture's waker, for a future finished in another thread of this process (module doc)."""
    loop = future._loop
    if loop.is_closed():
        return
    if loop.is_running():
        loop.call_soon_threadsafe(future._aio_event.set)
    else:
        future._aio_event.set()


def _finished_from_a_copy(method: Any, update: Any) -> Any:
    """MPFuture.set_result / set_exception that, called on an unpickled copy of a future made in this process (it
    came through a pipe from another thread: the averager's, the DHT's), sends the update to the original as from
    another process, instead of finishing the copy alone (which nobody waits on)."""
    from hivemind.utils.mpfuture import MPFuture, base

    def finish(self: Any, value: Any) -> None:
        ref = (MPFuture._active_futures or {}).get(self._uid)
        original = ref() if ref is not None else None
        if os.getpid() != self._origin_pid or original is None or original is self:
            return method(self, value)
        if self._state in (base.FINISHED, base.CANCELLED, base.CANCELLED_AND_NOTIFIED):
            raise base.InvalidStateError(f"Can't finish a future that is {self._state} ({self._uid})")
        if update.name == "RESULT":
            self._state_cache[self._state], self._result = base.FINISHED, value
        else:
            self._state_cache[self._state], self._exception = base.FINISHED, value
        self._send_update(update, value)

    finish.in_thread = True
    return finish


def _forgotten_only_by_itself(method: Any) -> Any:
    """MPFuture.__del__ that, for an unpickled copy in the origin's process, leaves the original's entry in the
    process's table of live futures alone. hivemind's drops the entry of the future's uid whenever an object of that
    uid dies in the origin's process; between processes only the original can, but here the copy that the DHT's or
    the averager's thread finished and let go of dies first, so the update on its way to the original found no
    entry and was dropped: the caller then waited out its whole timeout (measured: a round's matchmaking that never
    asked a leader, DHT stores timing out after 30 s, in the scale harness)."""
    from hivemind.utils.mpfuture import MPFuture

    def __del__(self: Any) -> None:
        futures = MPFuture._active_futures
        ref = futures.get(getattr(self, "_uid", None)) if futures is not None else None
        original = ref() if ref is not None else None
        if original is not None and original is not self:
            return  # a copy: the original still waits for its update
        method(self)

    __del__.in_thread = True
    return __del__


def _spawn_again_when_racing(spawn: Any) -> Any:
    """asyncio's create_subprocess_exec, tried again (up to ~5 s) when uvloop refuses it because another thread's
    loop is forking at that moment."""

    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(100):
            try:
                return await spawn(*args, **kwargs)
            except RuntimeError as exc:
                if "Racing with another loop" not in str(exc) or attempt == 99:
                    raise
            await asyncio.sleep(random.uniform(0.01, 0.09))
        raise AssertionError("unreachable")

    create_subprocess_exec.in_thread = True
    return create_subprocess_exec


def allow_in_threads() -> None:
    """Let hivemind's DHT and averager loops run as threads of one process (idempotent)."""
    import hivemind.averaging.averager as averager_module
    import hivemind.dht.dht as dht_module
    from hivemind.utils.mpfuture import MPFuture, UpdateType

    for module in (averager_module, dht_module):
        if not isinstance(module.signal, _MainThreadSignals):
            module.signal = _MainThreadSignals()
    MPFuture._set_event_threadsafe = _set_event_threadsafe
    if not getattr(MPFuture.set_result, "in_thread", False):
        MPFuture.set_result = _finished_from_a_copy(MPFuture.set_result, UpdateType.RESULT)
        MPFuture.set_exception = _finished_from_a_copy(MPFuture.set_exception, UpdateType.EXCEPTION)
    if not getattr(MPFuture.__del__, "in_thread", False):
        MPFuture.__del__ = _forgotten_only_by_itself(MPFuture.__del__)
    if not getattr(asyncio.subprocess.create_subprocess_exec, "in_thread", False):
        asyncio.subprocess.create_subprocess_exec = _spawn_again_when_racing(asyncio.subprocess.create_subprocess_exec)


class ThreadOrProcess:
    """Mix in before an ``mp.Process`` subclass: with ``in_thread`` set, it runs as a thread of this process."""

    in_thread: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.in_thread:
            return super().start()  # type: ignore[misc]
        allow_in_threads()
        self._thread = threading.Thread(target=self.run, name=type(self).__name__, daemon=True)  # type: ignore[attr-defined]
        self._thread.start()

    def is_alive(self) -> bool:
        if not self.in_thread:
            return super().is_alive()  # type: ignore[misc]
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if not self.in_thread:
            return super().join(timeout)  # type: ignore[misc]
        if self._thread is not None:
            self._thread.join(timeout)

    def terminate(self) -> None:
        if not self.in_thread:
            return super().terminate()  # type: ignore[misc]
        log.warning("%s runs as a thread, which cannot be terminated; it is left to end", type(self).__name__)

    def kill(self) -> None:
        if not self.in_thread:
            return super().kill()  # type: ignore[misc]
        self.terminate()

"""SIGINT/SIGTERM turned into a stop request, without taking a lock inside a signal handler; a quick exit after it.

Inputs:  the signals SIGINT and SIGTERM, delivered to the process (Ctrl-C, ``kill``, a supervisor).
Output:  ``StopRequest.event``, a threading.Event set on the first signal, which the roles' loops wait on;
         ``on_stop(name)`` called once, from a helper thread, to say what happens next. ``skip_exit_collection``
         for a role's ``__main__``: no seconds-long garbage collection at interpreter exit.
State:   a socket pair given to ``signal.set_wakeup_fd``, and one daemon thread that reads it. A forked child
         (hivemind's DHT and averager processes) drops the wakeup fd at fork: its own signals (SIGTERM from
         its host's shutdown) must not read as a stop request of the host.
Failure: none raised by the request itself. ``interrupt = True`` makes a signal raise KeyboardInterrupt in the
         main thread instead (for a blocking startup, or a second Ctrl-C meaning "now"). A stop that has not
         ended the process ``report_hang_after`` seconds later dumps every thread's stack to stderr, so a hang
         says where it is; the process is left running for its owner to kill.

Why not ``event.set()`` in the handler: Python runs a handler in the main thread between two bytecodes,
possibly while that thread holds the Event's own (non-reentrant) lock inside ``event.wait()``; the handler's
``set()`` then waits for that lock forever. The roles wait on their stop event once a second, so a signal
could freeze them for good. Here the handler only does what CPython's C-level handler already does (write the
signal number to the wakeup socket); the helper thread sets the event.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

__all__ = ["StopRequest", "skip_exit_collection"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _forget_in_child() -> None:
    """After fork, in the child: its signals must not reach the parent's wakeup socket (an inherited fd)."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass  # not the main thread: nothing was set here


os.register_at_fork(after_in_child=_forget_in_child)


class StopRequest:
    """Install once, from the main thread, before the long work starts; ``close()`` restores the defaults."""

    def __init__(
        self,
        on_stop: Callable[[str], None] | None = None,
        report_hang_after: float | None = 60.0,
        second_interrupts: bool = False,
    ) -> None:
        self.event = threading.Event()
        self.interrupt = False  # read by the handler: True raises KeyboardInterrupt in the main thread
        self._handled = 0
        self._on_stop, self._report_after, self._second_interrupts = on_stop, report_hang_after, second_interrupts
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, self._handler) for sig in STOP_SIGNALS}
        self._thread = threading.Thread(target=self._watch, name="stop-signals", daemon=True)
        self._thread.start()

    def _handler(self, _signum: int, _frame: object) -> None:
        self._handled += 1  # the main thread's own count: a second signal must not wait for the helper thread
        if self.interrupt or (self._second_interrupts and self._handled > 1):
            raise KeyboardInterrupt

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number not in STOP_SIGNALS:
                    continue
                if not self.event.is_set():
                    if self._on_stop is not None:
                        self._on_stop(signal.Signals(number).name)
                    self.event.set()
                    if self._report_after is not None:
                        faulthandler.dump_traceback_later(self._report_after, exit=False, file=sys.stderr)

    def ignore(self) -> None:
        """Signals from now on change nothing (a second Ctrl-C must not interrupt the cleanup)."""
        self.interrupt = self._second_interrupts = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def close(self) -> None:
        """Put the previous handlers and wakeup fd back; stop the hang report and the helper thread."""
        faulthandler.cancel_dump_traceback_later()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._reader.shutdown(socket.SHUT_RDWR)  # wakes the helper thread's recv (forked children hold the writer)
        self._thread.join(timeout=5)
        self._writer.close()
        self._reader.close()


def skip_exit_collection(code: int) -> int:
    """``code``, after telling the collector to leave every object alive now alone at interpreter exit.

    Measured on a tiny peer: after main() returned, the final garbage collection of the objects torch, transformers
    and hivemind leave behind took 2-4 s (py-spy: gc_collect_main), so a peer or monitor asked to stop seemed to hang
    that long. Everything that must be written is closed before main() returns; logging still flushes at exit.
    """
    gc.freeze()
    return code

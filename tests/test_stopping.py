"""StopRequest in real child processes: a signal sets the event, a second one interrupts, a forked child's signal
does not count, a stop that hangs prints where."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from scripts.procs import Proc, wait_until

PRELUDE = """
import os, signal, sys, time
from p2p_diloco.stopping import StopRequest
"""


def child(body: str) -> Proc:
    return Proc([sys.executable, "-c", PRELUDE + textwrap.dedent(body)])


@pytest.mark.timeout(60)
def test_a_signal_sets_the_event_even_while_the_main_thread_waits_on_it_in_a_tight_loop():
    # the old handler called event.set() itself: a signal landing while the main thread held the event's lock
    # inside wait() froze the process; here every one of 20 signals must end its child
    for k in range(20):
        proc = child("""
            request = StopRequest(on_stop=lambda name: print("stop", name, flush=True), report_hang_after=None)
            print("ready", flush=True)
            while not request.event.wait(0.0001):
                pass
            request.close()
            print("done", flush=True)
        """)
        try:
            proc.wait_for_line("^ready$", timeout=20)
            proc.popen.send_signal(signal.SIGTERM if k % 2 else signal.SIGINT)
            proc.wait_for_line(f"^stop {'SIGTERM' if k % 2 else 'SIGINT'}$", timeout=10)
            proc.wait_for_line("^done$", timeout=10)
            assert proc.wait(timeout=10) == 0, proc.describe()
        finally:
            proc.kill_group()


@pytest.mark.timeout(60)
def test_a_second_signal_interrupts_and_the_first_does_not():
    proc = child("""
        request = StopRequest(second_interrupts=True, report_hang_after=None)
        print("ready", flush=True)
        request.event.wait()
        try:
            print("stopping", flush=True)  # the second signal may come as soon as this is out
            time.sleep(30)  # a slow cleanup
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    try:
        proc.wait_for_line("^ready$", timeout=20)
        proc.popen.send_signal(signal.SIGINT)
        proc.wait_for_line("^stopping$", timeout=10)
        proc.popen.send_signal(signal.SIGINT)
        proc.wait_for_line("^interrupted$", timeout=10)
        assert proc.wait(timeout=10) == 0, proc.describe()
    finally:
        proc.kill_group()


@pytest.mark.timeout(60)
def test_a_forked_childs_signal_is_not_a_stop_request_of_its_parent():
    proc = child("""
        request = StopRequest(report_hang_after=None)
        pid = os.fork()
        if pid == 0:  # as hivemind's DHT process: it has a SIGTERM handler of its own
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            time.sleep(30)
            os._exit(1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("parent stop", request.event.wait(1.0), flush=True)
    """)
    try:
        assert proc.wait_for_line("^child exit ", timeout=20).string == "child exit 0"
        assert proc.wait_for_line("^parent stop ", timeout=10).string == "parent stop False"
        assert proc.wait(timeout=10) == 0, proc.describe()
    finally:
        proc.kill_group()


@pytest.mark.timeout(60)
def test_a_stop_that_does_not_end_the_process_prints_its_stacks():
    proc = child("""
        request = StopRequest(report_hang_after=0.5)
        print("ready", flush=True)
        request.event.wait()
        print("stuck", flush=True)
        time.sleep(30)
    """)
    try:
        proc.wait_for_line("^ready$", timeout=20)
        proc.popen.send_signal(signal.SIGTERM)
        proc.wait_for_line("^stuck$", timeout=10)
        assert wait_until(lambda: any("<string>" in line for line in proc.stderr_lines), 10), proc.describe()
        assert "Thread" in proc.stderr and proc.alive()  # every thread's stack; the process is left running
    finally:
        proc.kill_group()

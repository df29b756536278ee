"""Network lab plumbing: network namespaces joined by a bridge, each home's link capped by a tbf qdisc.

Usage (as root; the lab lives only as long as the ``with`` block):

    from netns import Lab, unavailable
    reason = unavailable()                    # None, or why namespaces cannot be used here (not root, refused)
    with Lab(homes=3, rate_mbit=100) as lab:  # or rate_mbit=[100, 20, None] per home (None: unshaped)
        lab.spawn(lab.wan, ["python", "-m", "peers.run_bootstrap", "--host-maddrs", f"/ip4/{lab.wan_ip}/tcp/0"])
        lab.spawn(lab.homes[0].ns, [...])      # a Proc inside home 0's namespace
        lab.throughput(0, 1, 5 * 2**20)        # bytes/s of a TCP transfer home 0 -> home 1

    python scripts/bench/netns.py probe       # prints whether the lab can run here (exit 0) or why not (exit 1)
    python scripts/bench/netns.py leftovers [--delete]   # namespaces of dead labs (ours only: nl<pid>-...)

Shape (see ../shared/docs/network-lab.md)::

    ns "nl<pid>-<tag>-w":  bridge br0 10.A.B.1/24 (the internet between homes; the bootstrap runs here)
      port p<k> (tbf at the home's rate: caps what home k receives, when shape_ingress)
        veth  ==  ns "nl<pid>-<tag>-h<k>": wan0 10.A.B.<11+k>/24, tbf at the home's rate (caps what it sends)
      or, for a home in ``nat``:
        veth  ==  ns "nl<pid>-<tag>-r<k>" (router): wan0 10.A.B.<11+k>/24, lan0 192.168.<k+1>.1/24, masquerade,
                  new connections from wan0 dropped
                  veth  ==  ns "nl<pid>-<tag>-h<k>": wan0 192.168.<k+1>.2/24, default route via the router

A.B come from this process's pid (one /24 per lab; the namespaces are private stacks, so two labs never see
each other anyway). Every namespace has its loopback up (p2pd and hivemind also talk to 127.0.0.1). The veth
pairs are created straight inside the namespaces (``ip -n HOME link add ... peer name p<k> netns WAN``), so no
interface ever appears in the host's own namespace and nothing is routed to the host's interfaces.

Cleanup: ``close()`` (run by ``__exit__``, so also on Ctrl-C, SystemExit and errors) kills the process group of
every Proc it spawned, then every process still inside one of the lab's namespaces (``ip netns pids``: they can
only be ours), then deletes the namespaces (the veths, bridge and qdiscs go with them). It never raises.
Creating a lab that fails half-way deletes what it had made before the error propagates.
tbf: ``rate R burst B latency 400ms`` with B = max(32 kbit, R x 1 ms): 32 kbit is enough below ~100 Mbit/s, but
a 4 KB bucket at 500 Mbit/s refills every 64 us and the link then delivers less than its rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import BENCH_DIR, Proc, single_thread_env  # noqa: E402

__all__ = ["Home", "Lab", "LabError", "TxSampler", "delete", "leftovers", "tbf_args", "unavailable"]

PREFIX = "nl"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-(w|h\d+|r\d+)$")


class LabError(RuntimeError):
    """An ``ip``/``tc`` command of the lab failed (the message holds the command and its stderr)."""


def _run(args: Sequence[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise LabError(f"{' '.join(args)} -> rc {res.returncode}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def tbf_args(dev: str, rate_mbit: float) -> list[str]:
    """``tc`` arguments for the root tbf qdisc of ``dev`` at ``rate_mbit`` Mbit/s (burst: see the docstring)."""
    burst_kbit = max(32, int(rate_mbit))  # R x 1 ms, in kbit
    rate, burst = f"{rate_mbit:g}mbit", f"{burst_kbit}kbit"
    return ["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "400ms"]


def unavailable(nat: bool = False) -> str | None:
    """None when this machine can run a lab (root, ``ip``/``tc`` present, a namespace with a shaped veth can be
    made; with ``nat``, also ``nft`` for the NAT homes); otherwise the reason, for a skip message."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    if nat and shutil.which("nft") is None:
        return "NAT homes need nftables: scripts/install_lab.sh (apt-get install -y nftables)"
    try:
        with Lab(homes=1, rate_mbit=10):
            pass
    except (LabError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot build a network namespace lab here: {exc}"
    return None


@dataclass
class Home:
    ns: str
    ip: str  # the home's own address (behind NAT: 192.168.<k+1>.2, which nobody outside can route to)
    rate_mbit: float | None  # None: unshaped
    router: str | None = None  # behind NAT: the namespace of its masquerading router
    public_ip: str | None = None  # the address others see it at (its router's on the bridge; else ``ip``)


class Lab:
    """``homes`` namespaces on one bridge (see the module docstring). ``rate_mbit``: one rate for all, or one
    per home (None: no tbf on that home's link). ``shape_ingress``: also cap the bridge port towards each home.
    ``nat``: the homes (indices) that sit behind their own masquerading router: ns ``-r<k>`` holds the bridge
    address 10.A.B.<11+k> and NATs the home's 192.168.<k+1>.0/24 behind it (nftables; new connections from the
    bridge side are dropped, no port is forwarded), so the home reaches everyone and nobody reaches it."""

    def __init__(
        self,
        homes: int,
        rate_mbit: float | None | Sequence[float | None] = None,
        shape_ingress: bool = True,
        nat: Sequence[int] = (),
    ) -> None:
        if not 1 <= homes <= 200:
            raise ValueError(f"homes={homes}: must be 1..200")
        rates = list(rate_mbit) if isinstance(rate_mbit, (list, tuple)) else [rate_mbit] * homes
        if len(rates) != homes:
            raise ValueError(f"{len(rates)} rates for {homes} homes")
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}-{secrets.token_hex(2)}"
        net = f"10.{(pid >> 8) & 255}.{pid & 255}"
        self.wan, self.wan_ip = f"{self.tag}-w", f"{net}.1"
        self.homes = [
            Home(f"{self.tag}-h{k}", f"192.168.{k + 1}.2", r, f"{self.tag}-r{k}", f"{net}.{11 + k}")
            if k in set(nat)
            else Home(f"{self.tag}-h{k}", f"{net}.{11 + k}", r, None, f"{net}.{11 + k}")
            for k, r in enumerate(rates)
        ]
        if nat and shutil.which("nft") is None:
            raise LabError("NAT homes need nftables (apt-get install -y nftables)")
        self.shape_ingress = shape_ingress
        self.procs: list[Proc] = []
        self._made: list[str] = []

    # ------------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in [self.wan, *(h.ns for h in self.homes), *(h.router for h in self.homes if h.router)]:
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        w = self.wan
        _run(["ip", "-n", w, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", w, "addr", "add", f"{self.wan_ip}/24", "dev", "br0"])
        _run(["ip", "-n", w, "link", "set", "br0", "up"])
        for k, h in enumerate(self.homes):
            port = f"p{k}"
            edge = h.router or h.ns  # the namespace whose wan0 sits on the bridge
            _run(["ip", "-n", edge, "link", "add", "wan0", "type", "veth", "peer", "name", port, "netns", w])
            _run(["ip", "-n", w, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", w, "link", "set", port, "up"])
            _run(["ip", "-n", edge, "addr", "add", f"{h.public_ip}/24", "dev", "wan0"])
            _run(["ip", "-n", edge, "link", "set", "wan0", "up"])
            if h.router:
                self._build_nat(k, h)
            if h.rate_mbit is not None:
                _run(["tc", "-n", h.ns, *tbf_args("wan0", h.rate_mbit)])
                if self.shape_ingress:
                    _run(["tc", "-n", w, *tbf_args(port, h.rate_mbit)])
        for h in self.homes:  # addresses are usable at once on a veth, but wait for the bridge to forward
            self._wait_reachable(h.ns, self.wan_ip)

    def _build_nat(self, k: int, h: Home) -> None:
        """Home ``k`` behind its router: a veth home:wan0 <-> router:lan0, masquerade out of the router's wan0."""
        r, gw = h.router, f"192.168.{k + 1}.1"
        _run(["ip", "-n", h.ns, "link", "add", "wan0", "type", "veth", "peer", "name", "lan0", "netns", r])
        _run(["ip", "-n", r, "addr", "add", f"{gw}/24", "dev", "lan0"])
        _run(["ip", "-n", r, "link", "set", "lan0", "up"])
        _run(["ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "wan0"])
        _run(["ip", "-n", h.ns, "link", "set", "wan0", "up"])
        _run(["ip", "-n", h.ns, "route", "add", "default", "via", gw])
        _run(["ip", "netns", "exec", r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        rules = (
            "table ip lab {\n"
            ' chain masq { type nat hook postrouting priority 100; oifname "wan0" masquerade; }\n'
            " chain inbound { type filter hook forward priority 0; policy accept;"
            ' iifname "wan0" ct state new drop; }\n'
            "}\n"
        )
        res = subprocess.run(
            ["ip", "netns", "exec", r, "nft", "-f", "-"], input=rules, capture_output=True, text=True, timeout=20
        )
        if res.returncode != 0:
            raise LabError(f"nft in {r} -> rc {res.returncode}: {res.stderr.strip()}")

    def _wait_reachable(self, ns: str, ip: str, timeout: float = 10.0) -> None:
        """Until a TCP connect from ``ns`` to ``ip``:9 is refused (the bridge forwards) rather than timing out."""
        code = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(0.5)\n"
            "try:\n s.connect((sys.argv[1], 9))\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        while True:
            res = _run(["ip", "netns", "exec", ns, sys.executable, "-c", code, ip], check=False)
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise LabError(f"{ip} not reachable from {ns} after {timeout:g}s: {res.stderr.strip()}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill what runs in the lab, delete its namespaces. Idempotent; never raises. SIGINT and SIGTERM wait
        until it is done (in the main thread), so a second Ctrl-C cannot leave half a lab behind."""
        blocked = threading.current_thread() is threading.main_thread()
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._close()
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def _close(self) -> None:
        for p in self.procs:
            try:
                p.kill_group()
            except Exception:  # noqa: BLE001, S110 - cleanup goes on whatever one child did
                pass
        self.procs = []
        for ns in reversed(self._made):
            _kill_inside(ns)
            for _ in range(5):
                try:
                    if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
                        break
                except (OSError, subprocess.SubprocessError):
                    pass
                time.sleep(0.2)
            else:
                print(f"netns: could not delete namespace {ns}", file=sys.stderr)
        self._made = []

    # ------------------------------------------------------------------------------------------ use

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def spawn(self, ns: str, args: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """A benchlib Proc (own session, repository root as cwd) running ``args`` inside namespace ``ns``;
        killed by close()."""
        proc = Proc([*self.exec_prefix(ns), *args], env=env)
        self.procs.append(proc)
        return proc

    def counters(self, k: int) -> dict[str, int]:
        """Kernel counters of home ``k``'s link (wan0): bytes sent and received on it (everything: TCP/IP
        headers, libp2p framing and encryption, DHT traffic) and its tbf's drops and overlimits."""
        ns = self.homes[k].ns
        link = json.loads(_run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", "wan0"]).stdout)[0]["stats64"]
        out = {"tx_bytes": int(link["tx"]["bytes"]), "rx_bytes": int(link["rx"]["bytes"])}
        qdiscs = json.loads(_run(["tc", "-j", "-s", "-n", ns, "qdisc", "show", "dev", "wan0"]).stdout or "[]")
        tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), None)
        if tbf is not None:
            out.update(tbf_drops=int(tbf.get("drops", 0)), tbf_overlimits=int(tbf.get("overlimits", 0)))
        return out

    def throughput(self, src: int, dst: int, nbytes: int, timeout: float = 60.0) -> dict[str, float]:
        """A TCP transfer of ``nbytes`` from home ``src`` to home ``dst`` (Python sockets, one connection):
        ``{"bytes", "seconds", "mbit_per_s"}``. Seconds run from connect to the receiver's acknowledgement of
        the last byte, measured by the sender."""
        port = 5201
        env = single_thread_env()
        sink = self.spawn(self.homes[dst].ns, [sys.executable, str(BENCH_DIR / "netns.py"), "sink", str(port)], env)
        try:
            sink.wait_for_line(r"^listening", timeout=15)
            res = _run(
                [
                    *self.exec_prefix(self.homes[src].ns),
                    sys.executable,
                    str(BENCH_DIR / "netns.py"),
                    "source",
                    self.homes[dst].ip,
                    str(port),
                    str(nbytes),
                ],
                timeout=timeout,
            )
        finally:
            sink.kill_group()
        seconds = float(res.stdout.split()[-1])
        return {"bytes": nbytes, "seconds": seconds, "mbit_per_s": nbytes * 8 / seconds / 1e6}


class TxSampler:
    """What each home's link sends, sampled every ``period`` seconds in a thread, read from ``/proc/PID/net/dev`` of
    a process inside the home's namespace (the namespace's own counters: no subprocess per sample). ``peak_mbit``:
    each home's largest send rate over any ``window`` seconds (the rate a link must carry not to stretch the busiest
    stretch of the run); None for a home with fewer samples than a window. A process gone mid-run ends its samples."""

    def __init__(self, pids: Sequence[int], dev: str = "wan0", period: float = 0.1) -> None:
        self.pids, self.dev, self.period = list(pids), dev, period
        self.samples: list[list[tuple[float, int]]] = [[] for _ in self.pids]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tx-sampler", daemon=True)

    def __enter__(self) -> TxSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _tx_bytes(self, pid: int) -> int | None:
        try:
            for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
                name, _, fields = line.partition(":")
                if name.strip() == self.dev:
                    return int(fields.split()[8])  # receive: 8 fields, then transmit bytes
        except (OSError, ValueError, IndexError):
            return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for k, pid in enumerate(self.pids):
                sent = self._tx_bytes(pid)
                if sent is not None:
                    self.samples[k].append((time.monotonic(), sent))

    def peak_mbit(self, window: float = 1.0) -> list[float | None]:
        out: list[float | None] = []
        for samples in self.samples:
            best, j = None, 0
            for t, sent in samples:
                while j + 1 < len(samples) and t - samples[j + 1][0] >= window:
                    j += 1
                t0, sent0 = samples[j]
                if t - t0 >= window:
                    rate = (sent - sent0) * 8 / (t - t0) / 1e6
                    best = rate if best is None else max(best, rate)
            out.append(best)
        return out


def _kill_inside(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (one of ours), by pid."""
    try:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for tok in out.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    if out.split():
        time.sleep(0.2)


def delete(names: Sequence[str]) -> None:
    """Kill what runs inside each of these (lab) namespaces and delete them; never raises."""
    for ns in names:
        _kill_inside(ns)
        try:
            _run(["ip", "netns", "del", ns], check=False)
        except (OSError, subprocess.SubprocessError):
            pass


def leftovers() -> list[str]:
    """Namespaces named like a lab's whose creating process (the pid in the name) is gone."""
    try:
        out = _run(["ip", "netns", "list"], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    dead = []
    for name in names:
        m = _NAME.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            dead.append(name)
    return dead


# ------------------------------------------------------------------------------------------ sink / source


def _sink(port: int) -> int:
    """Accept one connection, read to EOF, send back the byte count, exit."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("listening", flush=True)
    conn, _ = srv.accept()
    total = 0
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        total += len(chunk)
    conn.sendall(f"{total}\n".encode())
    conn.close()
    return 0


def _source(host: str, port: int, nbytes: int) -> int:
    """Send ``nbytes`` to ``host:port``, wait for the receiver's count, print the seconds taken."""
    block = b"\0" * (1 << 20)
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            s.sendall(block[:n])
            left -= n
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(64)
            if not chunk:
                break
            reply += chunk
    seconds = time.monotonic() - t0
    if int(reply or b"-1") != nbytes:
        print(f"receiver got {reply!r}, sent {nbytes}", file=sys.stderr)
        return 1
    print(f"{seconds:.6f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Network lab helpers (see the module docstring).")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe", help="can a lab run here?")
    lo = sub.add_parser("leftovers", help="namespaces of labs whose process is gone")
    lo.add_argument("--delete", action="store_true")
    sk = sub.add_parser("sink")
    sk.add_argument("port", type=int)
    so = sub.add_parser("source")
    so.add_argument("host")
    so.add_argument("port", type=int)
    so.add_argument("nbytes", type=int)
    args = p.parse_args(argv)
    if args.cmd == "probe":
        reason = unavailable()
        print(reason or "ok: network namespaces, veth, bridge and tbf work here")
        return 1 if reason else 0
    if args.cmd == "leftovers":
        names = leftovers()
        print("\n".join(names) or "none")
        if args.delete:
            delete(names)
        return 0
    if args.cmd == "sink":
        return _sink(args.port)
    return _source(args.host, args.port, args.nbytes)


if __name__ == "__main__":
    sys.exit(main())

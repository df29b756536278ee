"""Shared helpers of the benchmark suite: machine facts, result files, child processes, /proc and ss readers.

Every benchmark module in scripts/bench/ imports this file (it sits beside them, so ``python
scripts/bench/<item>.py`` finds it); importing it puts the repository root first on sys.path, so the modules get
this working tree's p2p_diloco and the process helpers of scripts/procs.py (the copy the tests use). Nothing here
measures anything by itself.

Result files: ``scripts/bench/results/<item>.json`` = ``{"item", "machine", "started", "finished",
"load_before", "load_after", "wall_seconds", "args", "rows": [...], "notes": [...], ...}``. A row is one line
of BENCHMARKS.md: ``{"figure", "value", "unit", "reference", "reference_value", "ratio", "ratio_kind"}``
(``ratio_kind`` says which way is better, e.g. "higher is better").

Smoke runs (every module's ``--smoke``: tiny sizes, a few seconds, for the tests) carry ``"smoke": true`` and never
land in results/ unless asked: without ``--out`` they go to a fresh temporary directory (``Recorder.write``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as _dt
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
# the repository root first: scripts.procs (the one copy of the process helpers, shared with the tests) and this
# working tree's p2p_diloco rather than an installed copy
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import procs  # noqa: E402
from scripts.procs import descendants  # noqa: E402

__all__ = [
    "BENCH_DIR",
    "ROOT",
    "RESULTS_DIR",
    "Proc",
    "Recorder",
    "cpu_seconds",
    "descendants",
    "ended_on",
    "exit_on_sigterm",
    "fill_defaults",
    "free_port",
    "healed_at_end",
    "ksmd_cpu_seconds",
    "load_now",
    "machine",
    "mark_mergeable",
    "merging_pages",
    "median",
    "proc_memory",
    "read_final",
    "row",
    "single_thread_env",
    "start_swarm",
    "tcp_bytes_by_pid",
]


# ------------------------------------------------------------------------------------------------ facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(pkg: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """CPU model, logical cores, memory, GPU (if torch sees one), library versions."""
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" here
        gpu = None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "hivemind": _version("hivemind"),
        "kernel": platform.release(),
    }


def load_now() -> dict[str, Any]:
    """The 1/5/15-minute load averages and the UTC time: the machine is shared, so every result says it."""
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "utc": _dt.datetime.now(_dt.timezone.utc).isoformat()}


def median(values: Iterable[float]) -> float:
    vals = [float(v) for v in values]
    return statistics.median(vals) if vals else float("nan")


def row(
    figure: str,
    value: float | None,
    unit: str,
    reference: str,
    reference_value: float | None,
    ratio: float | None,
    ratio_kind: str,
    **extra: Any,
) -> dict[str, Any]:
    """One line of the BENCHMARKS.md table (see the module docstring)."""
    return {
        "figure": figure,
        "value": value,
        "unit": unit,
        "reference": reference,
        "reference_value": reference_value,
        "ratio": ratio,
        "ratio_kind": ratio_kind,
        **extra,
    }


class Recorder:
    """Collects a module's rows and notes and writes ``results/<item>.json`` with machine and load facts.

    ``smoke``: a smoke run; its payload says so and, without an explicit path, it is written to a fresh temporary
    directory instead of results/ (a smoke figure must never replace a measured one).
    """

    def __init__(self, item: str, args: dict[str, Any] | None = None, smoke: bool = False) -> None:
        self.item, self.args, self.smoke = item, args or {}, smoke
        self.started, self.t0 = load_now(), time.monotonic()
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.data: dict[str, Any] = {}

    def add(self, **kw: Any) -> None:
        self.rows.append(row(**kw))

    def write(self, path: Path | None = None) -> Path:
        """Write the result file atomically: ``path``, else results/<item>.json (smoke: a temporary directory)."""
        if path is not None:
            target = path
        elif self.smoke:
            target = Path(tempfile.mkdtemp(prefix=f"bench_smoke_{self.item}_")) / f"{self.item}.json"
        else:
            target = RESULTS_DIR / f"{self.item}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        finished = load_now()
        payload = {
            "item": self.item,
            "machine": machine(),
            "started": self.started["utc"],
            "finished": finished["utc"],
            "load_before": self.started["loadavg"],
            "load_after": finished["loadavg"],
            "wall_seconds": round(time.monotonic() - self.t0, 1),
            "args": self.args,
            "smoke": self.smoke,
            "rows": self.rows,
            "notes": self.notes,
            **self.data,
        }
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        tmp.replace(target)
        return target


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any], smoke: dict[str, Any]) -> argparse.Namespace:
    """Set each option in ``defaults`` that is still None: from ``smoke`` when ``args.smoke``, else ``defaults``.

    Options given on the command line win in both modes, so ``--smoke --peers 3`` is a smoke run with 3 peers.
    """
    table = {**defaults, **smoke} if getattr(args, "smoke", False) else defaults
    for key, value in table.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------------------------ processes


def single_thread_env(threads: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must not use more than ``threads`` cores (torch reads OMP_NUM_THREADS)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCH_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if extra:
        env.update(extra)
    return env


class Proc(procs.Proc):
    """A scripts.procs.Proc started from the repository root, as a fresh interpreter: benchmarks measure peers as
    users start them (memory, start-up and join times), also when the tests' warm start (scripts/zygote.py) is on in
    the environment they inherit. Chosen here, per process, not by changing this process's environment at import:
    that turned the warm start off for every test collected after a test module that imports this one (the whole
    suite: collection comes first), which made each peer a test started cost ~5 s of CPU more."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, stdin: bool = False) -> None:
        super().__init__(args, env=env, stdin=stdin, cwd=ROOT, warm=False)

    def describe(self, tail: int | None = 40) -> str:
        """As procs.Proc.describe, but the last 40 lines by default: benchmark children are long-running."""
        return super().describe(tail)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that ``finally`` blocks kill the swarms a module started. Only the first: a
    second one (``timeout`` passes its own on to its child, a user presses twice) would raise again inside those
    blocks and leave the swarm running (seen: a bootstrap node and its p2pd outliving scale.py)."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------ /proc


def proc_memory(pid: int) -> dict[str, int] | None:
    """VmHWM (peak RSS), VmRSS and Pss of ``pid`` in bytes; None when the process is gone."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["Pss"] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return out if "VmRSS" in out else None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, in seconds (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SS_USER = re.compile(r'\("([^"]+)",pid=(\d+),fd=\d+\)')


def tcp_bytes_by_pid() -> dict[int, dict[str, int]]:
    """TCP payload bytes per process from ``ss -tinpH`` (kernel tcp_info bytes_sent / bytes_received).

    Counts bytes of the sockets open now: a connection closed between two readings loses its count. On
    loopback these are the bytes the process handed to TCP (for p2pd: libp2p framing and encryption
    included; the unix socket between Python and p2pd is not TCP and not counted).
    """
    try:
        text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, dict[str, int]] = {}
    pids: list[int] = []
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):  # a socket line; its tcp_info follows on the next line
            pids = sorted({int(m.group(2)) for m in _SS_USER.finditer(line)})
            continue
        sent = re.search(r"\bbytes_sent:(\d+)", line)
        recv = re.search(r"\bbytes_received:(\d+)", line)
        for pid in pids:
            acc = out.setdefault(pid, {"sent": 0, "received": 0, "sockets": 0})
            acc["sent"] += int(sent.group(1)) if sent else 0
            acc["received"] += int(recv.group(1)) if recv else 0
            acc["sockets"] += 1
        pids = []
    return out


# ------------------------------------------------------------------------------------------------ merged pages

KSM = Path("/sys/kernel/mm/ksm")
PR_SET_MEMORY_MERGE = 67  # linux/prctl.h


@contextlib.contextmanager
def merging_pages(pages_to_scan: int = 1000) -> Iterator[None]:
    """Run the kernel's same-page merging (KSM) while the block lasts: identical pages of processes that asked for it
    (:func:`mark_mergeable`) become one copy. Why the many-peer harness wants it: hivemind's p2pd is a UPX-packed
    binary, so each daemon unpacks its ~25 MB of code and constants into private memory, one copy per peer, where an
    unpacked binary's would be one shared file mapping. ``pages_to_scan`` per 20 ms (the kernel's default is 100:
    20 MB/s, a quarter hour to go over 128 peers once; 1000 costs ksmd ~10-20% of a core). The settings found are put
    back afterwards; pages merged stay merged until written. Needs root and a kernel with KSM; else SystemExit with
    what is missing."""
    files = {name: KSM / name for name in ("run", "pages_to_scan")}
    try:
        before = {name: f.read_text().strip() for name, f in files.items()}
        files["pages_to_scan"].write_text(str(pages_to_scan))
        files["run"].write_text("1")
    except OSError as exc:
        raise SystemExit(f"cannot start same-page merging ({exc}): it needs root and a kernel with KSM") from None
    try:
        yield
    finally:
        for name in ("run", "pages_to_scan"):
            files[name].write_text(before[name])


def mark_mergeable() -> None:
    """Offer every page of this process, and of every process it starts from now on (across exec: Linux 6.7 or
    later), to same-page merging (prctl PR_SET_MEMORY_MERGE). SystemExit with the reason when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise SystemExit(f"prctl(PR_SET_MEMORY_MERGE) refused: {os.strerror(code)} (needs Linux 6.4+, 6.7+ for p2pd)")


def ksmd_cpu_seconds() -> float:
    """CPU seconds the kernel's ksmd thread has used since boot (0.0 when there is none)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "ksmd":
                return cpu_seconds(int(comm.parent.name)) or 0.0
        except OSError:
            continue
    return 0.0


# ------------------------------------------------------------------------------------------------ swarms


def start_swarm(
    config: str,
    overrides: Sequence[str],
    log_dirs: Sequence[Path],
    per_peer: Sequence[Sequence[str]] = (),
    threads: int = 1,
    python: str = sys.executable,
) -> tuple[Proc, list[Proc]]:
    """A bootstrap node plus one ``run_peer`` process per log dir, all on 127.0.0.1 (the tests' recipe).

    ``overrides`` go to every peer as ``--set``; ``per_peer[k]`` adds peer k's own. Returns (bootstrap,
    peers); the caller waits for the peers and kill_group()s everything.
    """
    env = single_thread_env(threads)
    local = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    boot = Proc([python, "-m", "peers.run_bootstrap", *local], env=env)
    try:
        line = boot.wait_for_line(r"^--initial-peers ", timeout=90).string
    except BaseException:
        boot.kill_group()
        raise
    initial = line.split()[1:]
    peers = []
    for k, log_dir in enumerate(log_dirs):
        sets: list[str] = []
        for o in (*overrides, *(per_peer[k] if k < len(per_peer) else ())):
            sets += ["--set", o]
        args = [python, "-m", "peers.run_peer", "--config", config, "--log-dir", str(log_dir), *local, *sets]
        peers.append(Proc([*args, "--initial-peers", *initial], env=env))
    return boot, peers


def run_overrides(h: int, rounds: int, peers: int, tag: str) -> list[str]:
    """What every peer of a benchmark swarm gets: the run's length, one shard per peer, no eval, checkpoints or
    lingering, a fresh run id, start-up timeouts, and ``swarm.start_peers = peers`` so that round 1 (which the
    benchmarks do not count) starts once every peer is up; the preset's group size, matchmaking time and
    communication timeouts stay."""
    return [
        f"inner.steps={h}",
        f"train.rounds={rounds}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "logging.progress_bar=false",
        f"data.num_shards={peers}",
        f"swarm.run_id={tag}{uuid.uuid4().hex[:8]}",
        f"swarm.start_peers={peers}",
        "swarm.join_timeout=90",
        "swarm.state_timeout=60",
        "swarm.linger_seconds=0",
    ]


def log_tail(procs: list[Any], lines: int = 40) -> list[list[str]]:
    """Per peer process: its last ``lines`` stderr lines about rounds and joining (why a group broke, a wait)."""
    return [[line for line in p.stderr_lines if "round" in line or "join" in line][-lines:] for p in procs]


def steady_rounds(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """The rounds to count and their wall time: rounds 2..R-1, from when round 2's inner steps started to when round
    R's did, so that every counted round holds its whole period (its inner steps and all until the next round's
    begin: the exchange without overlap; with ``swarm.overlap`` eager the wait for the round before, its settling
    and the send), the start-up in round 1 and the last exchange, which nothing follows to hide it, are left out.
    Records without ``compute_started``, or fewer than 3: rounds 2..R, up to the last record's time."""
    if len(records) >= 3 and all(r.get("compute_started") for r in records[1:]):
        return records[1:-1], float(records[-1]["compute_started"]) - float(records[1]["compute_started"])
    return records[1:], float(records[-1]["time"]) - float(records[1].get("compute_started") or records[0]["time"])


def overlap_label(per_peer: list[dict[str, Any] | None]) -> str:
    """With ``swarm.overlap`` eager: after how many inner steps the counted rounds' exchanges were settled (τ, the
    records' ``overlap_steps``), over all peers; '' without overlap."""
    steps = [t for s in per_peer if s for t in s.get("overlap_steps", []) if t]
    if not steps:
        return ""
    low, high, mean = min(steps), max(steps), sum(steps) / len(steps)
    spread = f"{low}" if low == high else f"{low}-{high} (mean {mean:.1f})"
    return f"; each exchange settled after {spread} inner steps"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_final(path: Path) -> dict[str, Any] | None:
    """A peer's final.json (the state it ended on), or None when it wrote none (it failed) or it is unreadable."""
    try:
        final = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return final if isinstance(final, dict) and isinstance(final.get("checksum"), str) else None


def ended_on(records: list[list[dict[str, Any]]], finals: list[dict[str, Any] | None]) -> list[str]:
    """The checksum each peer ended on: its final.json's (the end-of-run heal may move a peer after its last
    metrics record), else its last record's; peers with neither are left out."""
    return [f["checksum"] if f else recs[-1]["checksum"] for recs, f in zip(records, finals, strict=True) if f or recs]


def healed_at_end(finals: list[dict[str, Any] | None]) -> int:
    """How many peers took the canonical lineage's state after their last round (final.json's ``healed_from``)."""
    return sum(1 for f in finals if f and "healed_from" in f)

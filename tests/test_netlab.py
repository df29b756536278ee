"""The network lab (scripts/bench/netns.py) and its benchmark (scripts/bench/netlab.py).

Needs root and working ``ip netns``; skipped with the reason otherwise. Every namespace a test makes is gone
when it ends (checked), and every process it starts is killed by process group (the ``spawn`` fixture).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import netns  # noqa: E402


@pytest.fixture(scope="module")
def lab_ok():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_tbf_caps_throughput(lab_ok):
    """A 5 MiB TCP transfer between two homes at 20 Mbit/s takes at least half its ideal 2.1 s: the cap holds
    (a fact about the shaping: unshaped, a veth moves this in a few milliseconds)."""
    nbytes, rate = 5 * 2**20, 20
    with netns.Lab(homes=2, rate_mbit=rate) as lab:
        names = {lab.wan, *(h.ns for h in lab.homes)}
        assert names <= _namespaces()
        got = lab.throughput(0, 1, nbytes, timeout=30)
    ideal = nbytes * 8 / (rate * 1e6)
    assert got["seconds"] >= 0.5 * ideal, got
    assert not names & _namespaces(), "the lab's namespaces outlived it"


def test_lab_cleans_up_on_error(lab_ok):
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Lab(homes=1, rate_mbit=10) as lab:
            names = {lab.wan, lab.homes[0].ns}
            lab.spawn(lab.homes[0].ns, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert not names & _namespaces()
    assert not lab.procs


@pytest.mark.swarm
def test_netlab_smoke(lab_ok, spawn, tmp_path):
    """2 tiny peers in their own namespaces behind 100 Mbit/s links, 2 rounds: a measured case, real bytes."""
    out = tmp_path / "netlab.json"
    proc = spawn([sys.executable, str(BENCH / "netlab.py"), "--smoke", "--out", str(out)])
    try:
        rc = proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"netlab --smoke still running after 150 s\n{proc.describe(40)}")
    finally:  # SIGTERM first: netlab then kills its swarm and deletes its namespaces itself
        proc.stop(grace=30)
        left = [ns for ns in netns.leftovers() if ns.startswith(f"{netns.PREFIX}{proc.pid}-")]
        netns.delete(left)
    assert not left, f"netlab left namespaces behind: {left}"
    assert rc == 0, proc.describe(40)
    data = json.loads(out.read_text())
    assert data["complete"] and data["smoke"]
    measured = [c for c in data["cases"] if c["measured"]]
    assert measured, data["cases"]
    c = measured[0]
    assert c["problem"] == "", c["problem"]
    assert c["rounds_counted"] >= 1
    assert c["bytes_sent_per_round"] > 0
    assert 0 < c["utilisation"] <= 1
    assert c["initial_peers"] and all("/ip4/10." in m for m in c["initial_peers"])  # the lab, not loopback
    assert all(s is not None and max(s["group_sizes"]) == 2 for s in c["per_peer"])  # peers found each other
    assert all(link["tx_bytes"] > c["bytes_sent_per_round"] for link in c["links"])  # through the lab's links
    assert data["rows"] and data["rows"][0]["value"] == c["utilisation"]

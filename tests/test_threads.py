"""torch's CPU threads: the auto rule from a given affinity, quota, workers and environment; the cgroup files it
reads; the busy-machine warning; and ``--threads`` reaching torch in a real run_simulation process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.threads import (
    apply_threads,
    auto_threads,
    busy_cpus,
    busy_warning,
    cgroup_quota,
    choose_threads,
    cpu_times,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
QUICK = [  # one round of two steps at a small batch: seconds on 2 cores
    "train.rounds=1",
    "inner.steps=2",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "data.batch_size=2",
    "data.seq_len=32",
    "data.eval_batches=1",
]


def bare_env() -> dict[str, str]:
    """This environment without OMP_NUM_THREADS, so the child's count comes from its flags alone."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


@pytest.fixture
def torch_threads():
    """Put torch's intra-op threads back as the test found them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    ("affinity", "quota", "workers", "expected"),
    [
        (2, None, 1, 2),  # this machine: every core
        (64, 2.0, 1, 2),  # a container with --cpus 2 on a big host: the quota, not the host's cores
        (64, 1.5, 1, 1),  # a fractional quota rounds down
        (64, 0.5, 1, 1),  # at least 1
        (4, 8.0, 1, 4),  # a quota above the affinity changes nothing
        (8, None, 3, 2),  # three trainings at once: 8 // 3 each
        (2, None, 4, 1),  # more trainings than cores: 1 each, never 0
    ],
)
def test_auto_is_the_usable_cores_divided_among_workers(affinity, quota, workers, expected) -> None:
    assert auto_threads(affinity, quota, workers) == expected


def test_auto_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="workers=0"):
        auto_threads(2, None, 0)


def test_choose_explicit_count_wins_over_the_environment() -> None:
    assert choose_threads(3, 2, None, env={"OMP_NUM_THREADS": "1"}) == (3, "set by --threads or train.threads")


def test_choose_auto_takes_omp_num_threads_when_set() -> None:
    # the launchers' convention (scripts/local_swarm.sh, scripts/procs.py: 1 per peer) keeps working
    assert choose_threads(0, 8, None, env={"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS=1")


@pytest.mark.parametrize("omp", ["", "0", "abc", "-2"])
def test_choose_auto_ignores_an_unusable_omp_num_threads(omp: str) -> None:
    assert choose_threads(0, 2, None, env={"OMP_NUM_THREADS": omp}) == (2, "2 cores available, 1 worker")


def test_choose_auto_says_where_the_count_came_from() -> None:
    assert choose_threads(0, 2, None, env={}) == (2, "2 cores available, 1 worker")
    assert choose_threads(0, 64, 2.0, workers=2, env={}) == (1, "2 cores available, cgroup quota 2, 2 workers")


def test_choose_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match=r"threads=-1 is invalid: must be >= 0"):
        choose_threads(-1, 2, None, env={})


# ------------------------------------------------------------------ the cgroup quota
@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2.0),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "300000\n"}, None),  # no period: unreadable, so no quota
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota_from_v2_and_v1_files(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota(tmp_path) == expected


# ------------------------------------------------------------------ the busy-machine warning
def test_busy_warning_when_other_work_leaves_fewer_idle_cpus_than_threads() -> None:
    warning = busy_warning(threads=2, cpus=2, busy=1.0)
    assert warning is not None and "keeps 1.0 of 2 CPUs busy" in warning and "--threads 1" in warning
    assert busy_warning(threads=2, cpus=2, busy=0.3) is None  # nearly idle
    assert busy_warning(threads=1, cpus=2, busy=5.0) is None  # nothing to give up
    assert "--threads 1" in busy_warning(threads=4, cpus=4, busy=9.0)  # at least 1


def test_busy_cpus_from_two_proc_stat_readings() -> None:
    #            user nice system idle iowait irq softirq steal guest guest_nice
    before = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\nintr 1 2 3\n"
    after = "cpu  200 0 100 850 50 0 0 0 0 0\ncpu0 100 0 50 425 25 0 0 0 0 0\nintr 4 5 6\n"
    assert cpu_times(before) == (150, 1000) and cpu_times(after) == (300, 1200)
    assert busy_cpus(cpu_times(before), cpu_times(after), cpus=2) == pytest.approx(1.5)  # 150 of 200 ticks
    assert busy_cpus((5, 10), (5, 10), cpus=2) == 0.0  # no time passed
    assert cpu_times("intr 1 2 3\n") is None


# ------------------------------------------------------------------ applied
def test_apply_sets_torch_and_logs_the_choice_once(torch_threads, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="p2p_diloco.threads"):
        assert apply_threads(1) == 1
    assert torch.get_num_threads() == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch threads:")]
    assert lines == ["torch threads: 1 (set by --threads or train.threads)"]


def test_apply_again_after_parallel_work_does_not_raise(torch_threads) -> None:
    torch.ones(256, 256) @ torch.ones(256, 256)  # the inter-op pool can no longer be resized after this
    apply_threads(1)
    apply_threads(1)
    assert torch.get_num_threads() == 1


@pytest.mark.timeout(180)
def test_threads_flag_reaches_torch_in_a_run_simulation_process(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    sets = [arg for s in [*QUICK, "train.threads=2"] for arg in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.simulate", "--config", str(TINY), "--workers", "2", "--out", str(out)]
        + [*sets, "--threads", "1"],  # the flag beats --set train.threads
        cwd=ROOT,
        env=bare_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "run_metadata.json").read_text())
    assert meta["torch_threads"] == 1  # torch.get_num_threads() inside simulate()
    assert meta["config"]["train"]["threads"] == 1
    assert "torch threads: 1 (set by --threads or train.threads)" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["p2p_diloco.simulate", "--out", "OUT"], ["peers.run_peer", "--log-dir", "OUT"]])
def test_a_negative_threads_flag_is_refused_with_exit_2(tmp_path: Path, command: list[str]) -> None:
    module, *rest = command
    extra = ["--new-swarm"] if module == "peers.run_peer" else []
    proc = subprocess.run(
        [sys.executable, "-m", module, "--config", str(TINY), *[str(tmp_path) if a == "OUT" else a for a in rest]]
        + [*extra, "--threads", "-1"],
        cwd=ROOT,
        env=bare_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2, proc.stderr
    assert "train.threads=-1 is invalid: must be >= 0 (0: auto" in proc.stderr

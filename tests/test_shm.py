"""p2p_diloco/swarm/shm.py: a peer's processes share tensors by file descriptor, with no torch_shm_manager."""

from __future__ import annotations

import importlib
import os

import torch
import torch.multiprocessing

import p2p_diloco.swarm  # noqa: F401 - what every swarm module imports first
from p2p_diloco.swarm import shm
from scripts.procs import descendants


def test_shared_tensors_go_by_file_descriptor_and_start_no_manager_process():
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    shared = torch.arange(1000, dtype=torch.float32).share_memory_()
    assert shared.is_shared() and shared.sum().item() == 499500.0
    assert [name for *_, name in descendants(os.getpid()) if name == "torch_shm_manag"] == []  # comm: 15 characters


def test_a_strategy_the_user_set_for_hivemind_wins(monkeypatch):
    monkeypatch.setenv("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_system")
    torch.multiprocessing.set_sharing_strategy("file_system")  # as hivemind's import left it
    try:
        importlib.reload(shm)
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    finally:
        monkeypatch.delenv("HIVEMIND_MEMORY_SHARING_STRATEGY")
        importlib.reload(shm)
    assert torch.multiprocessing.get_sharing_strategy() == shm.STRATEGY

"""How tensors are shared between a peer's processes: torch's ``file_descriptor`` strategy, not hivemind's default.

Inputs:  importing this module (``p2p_diloco.swarm`` does, before any other swarm module); the environment variable
         ``HIVEMIND_MEMORY_SHARING_STRATEGY``, when a user set it, wins.
Output:  ``torch.multiprocessing``'s sharing strategy for this process and every process forked after the import
         (the DHT and averager processes hivemind forks).
State:   torch's process-wide strategy.
Failure: none at import. A process that passes more shared tensors at once than its open-file limit allows fails
         with "Too many open files" (each shared storage holds one descriptor); a peer shares a few hundred at most
         (its averaged tensors, and the state a donor serves), against the limit of 1024 or more that Linux gives.

Why: importing hivemind sets ``file_system``, whose shared storages are files in /dev/shm named in a registry that a
``torch_shm_manager`` process keeps: each peer started one, which cost 57 MB of private memory and ~0.25 s of CPU
(measured: Private_Dirty of its smaps_rollup; the test suite started 229 of them), and a SIGKILLed peer left its
/dev/shm/torch_* files behind (hivemind-notes.md). With ``file_descriptor`` a storage is an unlinked shm file
passed as a descriptor: nothing outlives the processes that hold it, and no manager process runs.
"""

from __future__ import annotations

import os

import hivemind.utils.mpfuture  # noqa: F401 - sets file_system on import: ours must come after it
import torch.multiprocessing

STRATEGY = "file_descriptor"

if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
    torch.multiprocessing.set_sharing_strategy(STRATEGY)

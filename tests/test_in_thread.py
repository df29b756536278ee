"""in_thread.py: hivemind futures finished from a copy in another thread of the origin's process reach the original."""

from __future__ import annotations

import gc
import pickle
import threading
from multiprocessing.reduction import ForkingPickler

import torch
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.swarm.in_thread import allow_in_threads


def _copy(future: MPFuture) -> MPFuture:
    """What a pipe between two of hivemind's loops hands the other side: an unpickled copy, same uid."""
    return pickle.loads(ForkingPickler.dumps(future))


def test_a_copy_finished_in_another_thread_finishes_the_original() -> None:
    allow_in_threads()
    future = MPFuture()
    copy = _copy(future)
    threading.Thread(target=copy.set_result, args=(7,)).start()
    assert future.result(timeout=10) == 7


def test_a_copy_that_dies_first_does_not_orphan_the_original() -> None:
    """The DHT's thread lets go of its copy as soon as it is done: its death must not drop the original's entry, or
    the update on its way finds nobody and the caller waits out its timeout."""
    allow_in_threads()
    future = MPFuture()
    early = _copy(future)
    del early
    gc.collect()
    late = _copy(future)
    threading.Thread(target=late.set_exception, args=(RuntimeError("from the other loop"),)).start()
    assert isinstance(future.exception(timeout=10), RuntimeError)


def test_the_original_dying_still_leaves_the_table() -> None:
    allow_in_threads()
    future = MPFuture()
    uid = future._uid
    del future
    gc.collect()
    assert uid not in (MPFuture._active_futures or {})


def test_peers_built_at_once_in_threads_start_from_the_same_weights() -> None:
    from p2p_diloco.config import ModelConfig
    from p2p_diloco.model import build_model

    cfg = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32, max_seq_len=16)
    built: list[list[torch.Tensor]] = []

    def build() -> None:
        for _ in range(5):
            built.append([p.detach().clone() for p in build_model(cfg, 64, seed=3).parameters()])

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(built) == 20
    assert all(all(torch.equal(a, b) for a, b in zip(built[0], other, strict=True)) for other in built[1:])


def test_loops_of_many_threads_spawn_processes_at_once() -> None:
    """Each in-thread DHT node's loop spawns its p2pd; uvloop refuses a spawn while another thread's loop forks
    (without allow_in_threads, 7 of 8 such threads failed here)."""
    import asyncio
    import asyncio.subprocess

    import uvloop

    allow_in_threads()
    errors: list[str] = []

    def spawn_many() -> None:
        async def main() -> None:
            for _ in range(20):
                process = await asyncio.subprocess.create_subprocess_exec("true")
                assert await process.wait() == 0

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(main())
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(exc))
        finally:
            loop.close()

    threads = [threading.Thread(target=spawn_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

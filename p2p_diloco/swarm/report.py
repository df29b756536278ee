"""What a training peer tells the world about its rounds: metrics.jsonl, its DHT record, the console, trackers.

Inputs:  a RoundResult per round trained (applied, or lost: ``lost_reason``) and the round's wall seconds; per inner
         step, (step index, loss).
Output:  one JSON line per round in LOG_DIR/metrics.jsonl (``RoundResult.record()`` plus ``peer_id``, ``time``,
         ``total_tokens``, ``round_seconds``); then the same record to the trackers the config turns on
         (trackers.py: TensorBoard, wandb); the same summary as a signed PeerRecord under
         ``{run_id}_metrics`` (records.py); one console line per round on stdout; inner-step progress (a tqdm bar
         on a terminal, else a log line every ``logging.log_every`` steps).
State:   the tokens this peer has trained on since it started (``total_tokens``).
Failure: a DHT that cannot take the record within ``swarm.dht_timeout`` is logged by ``publish_record`` (once); a
         tracker that fails is logged once and disabled (trackers.py), after metrics.jsonl has its line; nothing
         here stops training.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2p_diloco.config import Config
from p2p_diloco.inner import peak_memory_bytes
from p2p_diloco.rounds import RoundResult
from p2p_diloco.swarm.records import PeerRecord, publish_record
from p2p_diloco.trackers import Trackers

__all__ = ["Reporter"]

log = logging.getLogger("p2p_diloco.peer")


class Reporter:
    def __init__(
        self, cfg: Config, log_dir: Path, dht: Any, peer_id: str, public_key: bytes, trackers: Trackers | None = None
    ) -> None:
        self.cfg, self.log_dir, self.dht, self.peer_id, self.public_key = cfg, log_dir, dht, peer_id, public_key
        self.trackers = trackers if trackers is not None else Trackers([])
        self.total_tokens = 0
        self.lost_rounds = 0  # rounds trained whose Δ̄ did not move this peer's state (discarded, resynced)

    def progress(self, round: int, device: Any) -> tuple[Callable[[int, float], None], Callable[[], None]]:
        """(on_step, close) for the inner steps of ``round``: a tqdm bar on a terminal, else periodic log lines."""
        steps = self.cfg.inner.steps
        if self.cfg.logging.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=steps, desc=f"round {round}", leave=False)

            def on_bar_step(k: int, loss: float) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")

            return on_bar_step, bar.close
        every = self.cfg.logging.log_every
        tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len * self.cfg.inner.grad_accum
        last = [time.perf_counter()]

        def on_step(k: int, loss: float) -> None:
            if every and (k + 1) % every == 0:
                now = time.perf_counter()
                rate, last[0] = every * tokens_per_step / max(now - last[0], 1e-9), now
                memory = peak_memory_bytes(device) / 2**20
                log.info("  step %d/%d  loss %.4f  %.0f tok/s  peak memory %.0f MiB", k + 1, steps, loss, rate, memory)

        return on_step, lambda: None

    def report(self, result: RoundResult, wall: float) -> None:
        """Every round trained, counted or lost (``result.lost_reason``): its line in metrics.jsonl, its DHT record."""
        self.total_tokens += result.inner.tokens
        self.lost_rounds += result.lost_reason is not None
        record = {
            "peer_id": self.peer_id,
            "time": time.time(),
            "total_tokens": self.total_tokens,
            "lost_rounds": self.lost_rounds,
            "round_seconds": wall,
            **result.record(),
        }
        with (self.log_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.write(record)
        publish_record(
            self.dht,
            self.cfg.swarm.run_id,
            self._peer_record(result, record),
            self.cfg.swarm.record_ttl,
            self.public_key,
            timeout=self.cfg.swarm.dht_timeout,
            wait=False,  # the DHT process stores it while the next round trains
        )
        r = result.reduce
        if result.lost_reason is not None:
            print(
                f"round lost ({result.decision.value}): {result.lost_reason}  loss {result.inner.mean_loss:.4f}  "
                f"group {r.group_size}  at round {result.outer_step} with checksum {result.checksum}",
                flush=True,
            )
            return
        evl = f"  eval {record['eval_loss']:.4f}" if record.get("eval_loss") is not None else ""
        print(
            f"round {result.outer_step}/{self.cfg.train.rounds}  loss {result.inner.mean_loss:.4f}{evl}  "
            f"{result.inner.tokens_per_second:,.0f} tok/s  group {r.group_size}  compute {result.inner.seconds:.1f}s"
            f"  comm {r.matchmaking_seconds + r.allreduce_seconds:.1f}s (matchmaking {r.matchmaking_seconds:.1f}s"
            f" + all-reduce {r.allreduce_seconds:.1f}s; waited {r.wait_seconds:.1f}s)  checksum {result.checksum}",
            flush=True,
        )

    def _peer_record(self, result: RoundResult, record: dict[str, Any]) -> PeerRecord:
        return PeerRecord(
            peer_id=self.peer_id,
            outer_step=result.outer_step,
            train_loss=float(result.inner.mean_loss),
            eval_loss=record.get("eval_loss"),
            tokens=result.inner.tokens,
            total_tokens=self.total_tokens,
            tokens_per_second=float(result.inner.tokens_per_second),
            group_size=result.reduce.group_size,
            checksum=result.checksum,
            compute_seconds=float(result.inner.seconds),
            matchmaking_seconds=float(result.reduce.matchmaking_seconds),
            allreduce_seconds=float(result.reduce.allreduce_seconds),
            bytes_sent=int(result.reduce.bytes_sent),
            bytes_received=int(result.reduce.bytes_received),
            peak_memory_bytes=int(result.inner.peak_memory_bytes),
            lost_rounds=self.lost_rounds,
            time=float(record["time"]),
        )

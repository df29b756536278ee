"""The training peer: join the swarm, run DiLoCo rounds over hivemind, stay consistent, stop cleanly.

Inputs:  a Config, PeerOptions (initial peers, log dir, network flags), a stop Event (set by signals).
Output:  DIR/metrics.jsonl (one record per round), DIR/run_metadata.json, DIR/checkpoints/round_NNNNNN
         (every ``train.checkpoint_every`` rounds and at exit; the outer state plus this worker's inner
         AdamW state and place in its shard, so --resume loses nothing), the same round summary in the DHT under
         ``{run_id}_metrics`` (signed, one subkey per peer), and one console line per round.
State:   the Worker (model, inner AdamW, OuterState), the DHT node and the PseudoGradAverager processes.
Failure: SwarmSetupError / SwarmUnreachableError while joining (bad address, nobody answered, state not
         downloadable, settings that differ from the swarm's); everything after joining is handled here:

Round protocol (every wait is bounded by a SwarmConfig deadline):
  1. H inner steps from θ = anchor (a stop request abandons the round: θ is reset, nothing is sent).
  2. Δ = anchor − θ, all-reduced with weight = tokens; the gather payload carries (outer step, checksum of
     the outer state before the round). An incomplete all-reduce is never applied (see averager.py).
  3. The group's gathered (step, checksum) pairs are compared before the butterfly runs: a member in the
     minority (behind, or diverged) averages with weight 0, so Δ̄ is the mean over the in-sync members.
     They apply it and end with bitwise-equal states. A member exactly one round behind (swarm.max_staleness
     1) counts with its delayed Δ, then takes the group's pre-round state and applies the same Δ̄ (bitwise
     equal too); a member further behind or diverged discards its round and downloads the outer state.
  4. Alone or all attempts failed: ``swarm.alone_policy`` = local takes a local outer step with the own Δ
     (logged; a later group puts this peer in the minority, and it resyncs), = wait discards the round.
  5. A non-finite Δ or Δ̄ is never applied: the round is discarded and θ reset to the anchor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco import PROTOCOL_VERSION
from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, load_worker_state, save_round
from p2p_diloco.config import Config, write_run_metadata
from p2p_diloco.data import DataPipeline, shard_for_peer
from p2p_diloco.engine import RoundResult, Worker
from p2p_diloco.inner import InnerStats, NonFiniteLossError, peak_memory_bytes
from p2p_diloco.model import architecture_fingerprint
from p2p_diloco.outer import NonFiniteUpdateError, OuterState, outer_lr_at
from p2p_diloco.swarm.averager import PseudoGradAverager, contributes, majority_state
from p2p_diloco.swarm.dht import SwarmSetupError, initial_peers_line, shutdown_dht, start_dht, visible_maddrs
from p2p_diloco.swarm.records import PeerRecord, make_record_validators, publish_record

__all__ = ["PeerOptions", "TrainingPeer", "swarm_fingerprint"]

log = logging.getLogger("p2p_diloco.peer")


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived during the inner steps: the round is abandoned."""


@dataclass
class PeerOptions:
    initial_peers: list[str]
    log_dir: Path
    new_swarm: bool = False
    resume: bool = False
    host_maddrs: list[str] | None = None
    announce_maddrs: list[str] | None = None
    identity_path: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)


def swarm_fingerprint(cfg: Config, model: torch.nn.Module, vocab_size: int) -> tuple[str, dict[str, Any]]:
    """What must match between peers of one run, and its short hash (part of the averaging prefix)."""
    summary = {
        "protocol": PROTOCOL_VERSION,
        "architecture": architecture_fingerprint(model),
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "tokenizer": cfg.data.tokenizer,
        "vocab_size": vocab_size,
        "seed": cfg.seed,
        "inner.steps": cfg.inner.steps,
        "outer.lr": cfg.outer.lr,
        "outer.momentum": cfg.outer.momentum,
        "outer.nesterov": cfg.outer.nesterov,
        "outer.lr_warmup_rounds": cfg.outer.lr_warmup_rounds,
    }
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:12]
    return digest, summary


class TrainingPeer:
    def __init__(self, cfg: Config, opts: PeerOptions) -> None:
        self.cfg, self.opts = cfg, opts
        self.log_dir = Path(opts.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.data = DataPipeline(cfg.data, cfg.seed)
        self._lock = threading.Lock()  # guards the outer state against the state-sharing thread
        self.dht = self.averager = None
        self.total_tokens = 0
        self.consensus = True  # our outer state came out of a complete group (or the seed, or a download)
        self.rounds_done = 0

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        cfg, s = self.cfg, self.cfg.swarm
        validators, self.public_key = make_record_validators(s.run_id)
        self.dht = start_dht(
            self.opts.initial_peers,
            host_maddrs=self.opts.host_maddrs,
            announce_maddrs=self.opts.announce_maddrs,
            identity_path=self.opts.identity_path,
            join_timeout=s.join_timeout,
            record_validators=validators,
            new_swarm=self.opts.new_swarm,
        )
        self.peer_id = str(self.dht.peer_id)
        print(f"peer {self.peer_id} reachable as: {initial_peers_line(visible_maddrs(self.dht))}", flush=True)
        shard = cfg.data.shard_index
        self.shard = shard if shard is not None else shard_for_peer(self.peer_id, cfg.data.num_shards)
        self.worker = Worker(cfg, self.data.vocab_size, self.data.train_batches(self.shard, cfg.seed))
        self.fingerprint, self.summary = swarm_fingerprint(cfg, self.worker.model, self.data.vocab_size)
        self._check_fingerprints()
        self._announce()
        self.averager = PseudoGradAverager.from_config(
            self.dht, self.worker.state.anchor, s, prefix=f"{s.run_id}_{self.fingerprint}"
        )
        self.eval_sets = self.data.eval_sets()
        self._join()
        self._wait_for_start_peers()
        self.averager.set_state_provider(self._share_state)
        self.averager.state_sharing_priority = float(self.worker.state.step)
        print(f"joined at outer step {self.worker.state.step} with checksum {self.worker.state.checksum()}", flush=True)
        write_run_metadata(
            self.log_dir,
            cfg,
            peer_id=self.peer_id,
            shard_index=self.shard,
            fingerprint=self.fingerprint,
            fingerprint_summary=self.summary,
            shard_histograms=self.data.histograms(),
        )
        log.info(
            "peer %s: shard %d of %d, %d params, outer step %d, averaging prefix %s_%s",
            self.peer_id,
            self.shard,
            cfg.data.num_shards,
            self.worker.num_params,
            self.worker.state.step,
            s.run_id,
            self.fingerprint,
        )

    def _fingerprint_key(self) -> str:
        return f"{self.cfg.swarm.run_id}_fingerprint"

    def _announce(self) -> None:
        value = {"fingerprint": self.fingerprint, "summary": self.summary, "step": self.worker.state.step}
        expires = get_dht_time() + self.cfg.swarm.record_ttl
        self.dht.store(self._fingerprint_key(), value, expires, subkey=self.peer_id)

    def _others(self) -> dict[str, dict]:
        found = self.dht.get(self._fingerprint_key(), latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        return {k: v.value for k, v in entries.items() if k != self.peer_id and isinstance(v.value, dict)}

    def _run_mates(self) -> list[dict]:
        """The announcements of the other peers of this run that share our fingerprint (can average with us)."""
        return [v for v in self._others().values() if v.get("fingerprint") == self.fingerprint]

    def _check_fingerprints(self) -> None:
        others = self._others()
        differ = {p: v for p, v in others.items() if v.get("fingerprint") != self.fingerprint}
        if differ and len(differ) == len(others):
            peer, theirs = next(iter(differ.items()))
            diff = ", ".join(
                f"{k}: theirs {theirs.get('summary', {}).get(k)!r}, ours {v!r}"
                for k, v in self.summary.items()
                if theirs.get("summary", {}).get(k) != v
            )
            raise SwarmSetupError(
                f"this peer's settings differ from the {len(differ)} peer(s) already in run "
                f"{self.cfg.swarm.run_id!r} ({diff or 'fingerprint'}), so it would never be grouped with them. "
                "Use the same config file and --set overrides as the swarm, or pick another swarm.run_id."
            )
        for peer in differ:
            log.warning("peer %s runs different settings; it will not average with this peer", peer)

    def _join(self) -> None:
        """Resume, start from the seed, or download the outer state from a peer before the first step."""
        ckpt = latest_checkpoint(self.log_dir / "checkpoints") if self.opts.resume else None
        if ckpt is not None:
            state, meta = load_outer_state(ckpt)
            self.worker.load_state(state)
            local = load_worker_state(ckpt)
            if local is None:
                log.warning("%s holds no worker state: the inner optimizer starts afresh", ckpt)
            else:
                try:
                    self.worker.restore_local_state(local)
                except ValueError as exc:
                    raise CheckpointError(f"{ckpt}: {exc}") from None
            log.info("resumed from %s (outer step %d, %d batches read)", ckpt, state.step, self.worker.batches_taken)
            # the swarm moved on while we were away: take its state rather than train a stale round
            if max((v.get("step", 0) for v in self._run_mates()), default=0) > state.step:
                self._download_state(min_step=state.step + 1)
            return
        if self.opts.new_swarm:
            log.info("new swarm: the outer state starts from seed %d", self.cfg.seed)
            return
        deadline = time.monotonic() + self.cfg.swarm.join_timeout
        while time.monotonic() < deadline and not self.opts.stop.is_set():
            if self._download_state():
                return
            if not any(v.get("step", 0) > 0 for v in self._others().values()):
                log.info("no peer of this run holds a trained state yet: starting from seed %d", self.cfg.seed)
                return
            time.sleep(1.0)
        raise SwarmSetupError(
            f"peers of run {self.cfg.swarm.run_id!r} exist, but none sent its outer state within "
            f"swarm.join_timeout={self.cfg.swarm.join_timeout:g}s: retry, or raise swarm.join_timeout"
        )

    def _wait_for_start_peers(self) -> None:
        """Hold round 1 until swarm.start_peers peers of this run are up (bounded by swarm.join_timeout)."""
        want, deadline = self.cfg.swarm.start_peers, time.monotonic() + self.cfg.swarm.join_timeout
        while want > 1 and time.monotonic() < deadline and not self.opts.stop.is_set():
            seen = 1 + len(self._run_mates())
            if seen >= want:
                log.info("%d of swarm.start_peers=%d peers are up: starting", seen, want)
                return
            self._announce()
            time.sleep(0.5)
        if want > 1:
            log.warning(
                "fewer than swarm.start_peers=%d peers after %.0fs: starting anyway", want, self.cfg.swarm.join_timeout
            )

    def _share_state(self) -> tuple[dict, list[torch.Tensor]]:
        with self._lock:
            state = self.worker.state
            meta = {
                "outer_step": state.step,
                "checksum": state.checksum(),
                "fingerprint": self.fingerprint,
                "consensus": self.consensus,
            }
            return meta, [t.clone() for t in state.tensors()]

    def _fetch_state(self) -> tuple[OuterState, bool] | None:
        """The outer state of the most advanced peer that shares it, checked (fingerprint, checksum), and whether
        it came out of a complete group (not a local step); or None."""
        got = self.averager.load_state(self.cfg.swarm.state_timeout)
        if got is None:
            return None
        meta, tensors = got
        if meta.get("fingerprint") != self.fingerprint:
            log.warning("state offered by a peer with another fingerprint; ignored")
            return None
        state = OuterState.from_tensors(tensors, int(meta["outer_step"]))
        if state.checksum() != meta.get("checksum"):
            log.warning("downloaded outer state fails its checksum; ignored")
            return None
        return state, bool(meta.get("consensus", True))

    def _adopt(self, state: OuterState, consensus: bool = True) -> None:
        self.consensus = consensus
        with self._lock:
            self.worker.load_state(state)
        self.averager.state_sharing_priority = float(state.step)
        log.info("downloaded the outer state at step %d (checksum %s)", state.step, state.checksum())

    def _download_state(self, min_step: int = 0) -> bool:
        """Adopt the outer state of a peer (the most advanced one sharing) if it is at ``min_step`` or later."""
        fetched = self._fetch_state()
        if fetched is None:
            return False
        state, consensus = fetched
        if state.step < min_step:
            log.info("the state offered is at step %d, behind this peer's %d; kept ours", state.step, min_step)
            return False
        self._adopt(state, consensus)
        return True

    def _resync_after_local_step(self) -> bool:
        """Adopt a peer's state that is ahead, or at our step and from a complete group. Two peers that both
        stepped alone keep the state with the smaller checksum, so they never swap states."""
        fetched, mine = self._fetch_state(), self.worker.state
        if fetched is None:
            return False
        state, consensus = fetched
        same_step_better = state.step == mine.step and (consensus or state.checksum() < mine.checksum())
        if state.step > mine.step or same_step_better:
            self._adopt(state, consensus)
            return True
        return False

    def _catch_up(self, majority: tuple, avg: list[torch.Tensor]) -> bool:
        """One round behind, our Δ counted: take the group's pre-round state and apply the same Δ̄ to it (or
        take its post-round state if the donor already applied it). Ends bitwise equal to the group."""
        fetched = self._fetch_state()
        state = fetched[0] if fetched is not None else None
        if state is not None and (state.step, state.checksum()) == tuple(majority):
            with self._lock:
                self.worker.load_state(state)
                self.worker.apply_outer(avg)
                self.consensus = True
            self.averager.state_sharing_priority = float(self.worker.state.step)
            return True
        if state is not None and state.step == majority[0] + 1:
            self._adopt(state)
            return True
        return False

    # ------------------------------------------------------------------ rounds
    def _on_step(self, bar: Any) -> Any:
        every, tokens_per_step = self.cfg.logging.log_every, self.cfg.data.batch_size * self.cfg.data.seq_len
        last = [time.perf_counter()]

        def on_step(k: int, loss: float) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
            elif every and (k + 1) % every == 0:
                now = time.perf_counter()
                rate = every * tokens_per_step * self.cfg.inner.grad_accum / max(now - last[0], 1e-9)
                last[0] = now
                log.info(
                    "  step %d/%d  loss %.4f  %.0f tok/s  peak memory %.0f MiB",
                    k + 1,
                    self.cfg.inner.steps,
                    loss,
                    rate,
                    peak_memory_bytes(self.worker.device) / 2**20,
                )
            if self.opts.stop.is_set():
                raise StopRequested

        return on_step

    def _inner(self) -> InnerStats:
        bar = None
        if self.cfg.logging.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=self.cfg.inner.steps, desc=f"round {self.worker.state.step + 1}", leave=False)
        try:
            return self.worker.train_inner(self._on_step(bar))
        finally:
            if bar is not None:
                bar.close()

    def run_round(self) -> RoundResult | None:
        """One round; None when it was abandoned (stop request, non-finite values)."""
        w = self.worker
        before = (w.state.step, w.state.checksum())
        try:
            stats = self._inner()
            delta = w.pseudo_grad()
        except StopRequested:
            return None
        except (NonFiniteLossError, NonFiniteUpdateError) as exc:
            log.error("round %d discarded: %s", before[0] + 1, exc)
            return None
        gather = {"state": [before[0], before[1]], "tokens": stats.tokens}
        avg, info = self.averager.reduce(delta, float(stats.tokens), gather=gather)
        if info.complete and info.group_size > 1:
            majority = majority_state(info.gathered)
            stale = majority is not None and majority != before
            if stale and contributes(before, majority, self.cfg.swarm.max_staleness) and self._catch_up(majority, avg):
                log.warning(
                    "round %d: this peer was one round behind; its Δ counted and it caught up to step %d",
                    before[0] + 1,
                    w.state.step,
                )
                evals = w.maybe_evaluate(self.eval_sets)
                lr = outer_lr_at(majority[0], self.cfg.outer.lr, self.cfg.outer.lr_warmup_rounds)
                return RoundResult(w.state.step, stats, info, w.state.checksum(), lr, evals)
            if stale:
                log.warning(
                    "round %d: this peer's state (step %d) differs from its group's majority (step %d): "
                    "discarding the round and downloading the outer state",
                    before[0] + 1,
                    before[0],
                    majority[0],
                )
                if not self._download_state():
                    log.warning("state download failed; will retry next round")
                return None
            odd = sum(1 for g in info.gathered.values() if tuple(g.get("state", ())) != before)
            if odd:
                log.warning(
                    "round %d: %d group member(s) were out of sync; they catch up or resync",
                    before[0] + 1,
                    odd,
                )
        elif self.cfg.swarm.alone_policy == "wait":
            log.warning(
                "round %d: no complete all-reduce (%s); alone_policy=wait discards it", before[0] + 1, info.reason
            )
            w.state.copy_to(w.model.parameters())
            return None
        else:
            log.warning("round %d: no complete all-reduce (%s); taking a local outer step", before[0] + 1, info.reason)
        try:
            with self._lock:
                lr = w.apply_outer(avg)
                self.consensus = info.complete
        except NonFiniteUpdateError as exc:
            log.error("round %d discarded: %s", before[0] + 1, exc)
            return None
        if not info.complete and self._others():
            # others are training: adopt their state if they got past this round (the local step is dropped)
            if self._resync_after_local_step():
                info.reason += "; resynced from a peer after the local step"
        self.averager.state_sharing_priority = float(w.state.step)
        evals = w.maybe_evaluate(self.eval_sets)
        return RoundResult(w.state.step, stats, info, w.state.checksum(), lr, evals)

    def _report(self, result: RoundResult, wall: float) -> None:
        self.total_tokens += result.inner.tokens
        record = {
            "peer_id": self.peer_id,
            "time": time.time(),
            "total_tokens": self.total_tokens,
            "round_seconds": wall,
            **result.record(),
        }
        with (self.log_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        publish_record(
            self.dht,
            self.cfg.swarm.run_id,
            PeerRecord(
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
                time=float(time.time()),
            ),
            self.cfg.swarm.record_ttl,
            self.public_key,
        )
        self._announce()
        r = result.reduce
        evl = f"  eval {record['eval_loss']:.4f}" if record.get("eval_loss") is not None else ""
        print(
            f"round {result.outer_step}/{self.cfg.train.outer_steps}  loss {result.inner.mean_loss:.4f}{evl}  "
            f"{result.inner.tokens_per_second:,.0f} tok/s  group {r.group_size}  compute {result.inner.seconds:.1f}s"
            f"  comm {r.matchmaking_seconds + r.allreduce_seconds:.1f}s (matchmaking {r.matchmaking_seconds:.1f}s"
            f" + all-reduce {r.allreduce_seconds:.1f}s)  checksum {result.checksum}",
            flush=True,
        )

    def run(self) -> int:
        """Train until train.outer_steps or a stop request; always leaves no process behind. Exit code 0."""
        try:
            self.start()
            while self.worker.state.step < self.cfg.train.outer_steps and not self.opts.stop.is_set():
                started = time.perf_counter()
                result = self.run_round()
                if result is None:
                    continue
                self._report(result, time.perf_counter() - started)
                every = self.cfg.train.checkpoint_every
                if every and result.outer_step % every == 0:
                    self._checkpoint()
            if self.opts.stop.is_set():
                log.info("stop requested: leaving at outer step %d", self.worker.state.step)
            self._checkpoint()
            if not self.opts.stop.is_set() and self.cfg.swarm.linger_seconds > 0:
                log.info("done; serving the final state to peers for %.0fs more", self.cfg.swarm.linger_seconds)
                self.opts.stop.wait(self.cfg.swarm.linger_seconds)
            return 0
        finally:
            self.close()

    def _checkpoint(self) -> None:
        if getattr(self, "worker", None) is None or self.worker.state.step == 0:
            return
        with self._lock:
            save_round(
                self.log_dir / "checkpoints",
                self.worker.state,
                {"peer_id": self.peer_id, "fingerprint": self.fingerprint, "config": self.cfg.to_dict()},
                worker_state=self.worker.local_state(),
            )

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        if self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None

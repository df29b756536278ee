"""A peer's log dir with real checkpoints, in seconds: tiny.yaml trained a few local rounds on the offline corpus,
saved as run_peer saves them (LOG/checkpoints/round_NNNNNN with the peer's metadata, the config included)."""

from __future__ import annotations

from pathlib import Path

from p2p_diloco.checkpoint import save_round
from p2p_diloco.config import Config, load_config
from p2p_diloco.data import DataPipeline
from p2p_diloco.engine import Worker

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def train_peer_checkpoints(log_dir: Path, overrides: list[str] | tuple[str, ...] = (), rounds: int = 2) -> Config:
    """``rounds`` local rounds of 10 inner steps, a checkpoint after each; returns the run's config."""
    cfg = load_config(TINY, ["inner.steps=10", f"train.rounds={rounds}", "data.eval_batches=1", *overrides])
    data = DataPipeline(cfg.data, cfg.seed)
    worker = Worker(cfg, data.vocab_size, data.train_batches(0, cfg.seed))
    for _ in range(rounds):
        worker.train_inner()
        worker.apply_outer(worker.pseudo_grad())
        meta = {"peer_id": "QmTestPeer", "fingerprint": "0123456789abcdef", "config": cfg.to_dict()}
        save_round(log_dir / "checkpoints", worker.state, meta, worker_state=worker.local_state())
    worker.close()
    return cfg

"""Atomic save and load of the outer state, and of what only this worker holds.

Inputs:  an OuterState (anchor + momentum, fp32 CPU), a JSON-able metadata dict (round, config, ...) and
         optionally the worker's own state (``Worker.local_state()``: inner AdamW moments and its place
         in its data shard), which no other peer can give back after a restart.
Output:  DIR/outer_state.safetensors (tensors ``anchor.K`` and ``momentum.K``), DIR/outer_state.json
         (``round``, ``checksum``, ``num_tensors`` and the caller's metadata) and, when given,
         DIR/worker_state.pt (torch.save of tensors, numbers and lists only; loaded with
         ``weights_only``). ``latest_checkpoint`` finds the newest ``round_NNNNNN`` directory under a root.
State:   none.
Failure: each file is written to a temporary name and renamed, and the directory is renamed into place
         last, so a save killed half-way never replaces or corrupts the last good checkpoint.
         CheckpointError (with the path and what is wrong) for a missing, partial or inconsistent one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from p2p_diloco.outer import OuterState

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_outer_state",
    "load_worker_state",
    "save_outer_state",
    "save_round",
]

TENSORS, META, WORKER = "outer_state.safetensors", "outer_state.json", "worker_state.pt"
_FALLBACK = "delete that directory to resume from the round before it"

log = logging.getLogger("p2p_diloco.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or does not match what it claims to hold."""


def save_outer_state(
    directory: str | Path,
    state: OuterState,
    metadata: dict[str, Any] | None = None,
    worker_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` (and ``worker_state``) into ``directory`` atomically: it appears whole or not at all."""
    target = Path(directory)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    half = len(state.anchor)
    tensors = {f"anchor.{k}": t.contiguous() for k, t in enumerate(state.anchor)}
    tensors.update({f"momentum.{k}": t.contiguous() for k, t in enumerate(state.momentum)})
    save_file(tensors, str(tmp / TENSORS))
    meta = {**(metadata or {}), "round": state.round, "checksum": state.checksum(), "num_tensors": half}
    (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
    names = [TENSORS, META]
    if worker_state is not None:
        torch.save(worker_state, tmp / WORKER)
        names.append(WORKER)
    for name in names:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def load_outer_state(directory: str | Path) -> tuple[OuterState, dict[str, Any]]:
    """Read a checkpoint written by save_outer_state; verify its checksum."""
    directory = Path(directory)
    if not (directory / TENSORS).is_file() or not (directory / META).is_file():
        raise CheckpointError(f"{directory} is not a complete checkpoint (needs {TENSORS} and {META})")
    try:
        meta = json.loads((directory / META).read_text())
        tensors = load_file(str(directory / TENSORS))
        n = int(meta["num_tensors"])
        anchor = [tensors[f"anchor.{k}"] for k in range(n)]
        momentum = [tensors[f"momentum.{k}"] for k in range(n)]
        rounds = int(meta["round"] if "round" in meta else meta["step"])  # written before the rename: "step"
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # TypeError: META not an object
        raise CheckpointError(f"checkpoint {directory} is unreadable ({exc!r}): {_FALLBACK}") from None
    state = OuterState(anchor=anchor, momentum=momentum, round=rounds)
    if meta.get("checksum") not in (state.checksum(), state.whole_checksum()):  # whole: before protocol 5
        raise CheckpointError(
            f"checkpoint {directory} fails its checksum (the files do not match each other): {_FALLBACK}"
        )
    return state, meta


def load_worker_state(directory: str | Path) -> dict[str, Any] | None:
    """The worker state saved beside the outer state, or None when the checkpoint has none."""
    path = Path(directory) / WORKER
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises pickle, zip and runtime errors for a damaged file
        raise CheckpointError(f"checkpoint file {path} is unreadable ({exc}): delete it to resume without it") from None


def save_round(
    root: str | Path,
    state: OuterState,
    metadata: dict[str, Any] | None = None,
    keep: int = 3,
    worker_state: dict[str, Any] | None = None,
) -> Path:
    """Save as ROOT/round_NNNNNN and keep only the ``keep`` newest rounds."""
    root = Path(root)
    path = save_outer_state(root / f"round_{state.round:06d}", state, metadata, worker_state)
    rounds = sorted(p for p in root.glob("round_*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    for old in rounds[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete ROOT/round_NNNNNN, or None. A newer round directory without its META (not written by
    save_round, which renames a finished .tmp into place, so damaged or left by hand) is skipped with a warning."""
    root = Path(root)
    named = sorted(p for p in root.glob("round_*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    rounds = [p for p in named if (p / META).is_file()]
    for skipped in named[named.index(rounds[-1]) + 1 :] if rounds else named:
        log.warning("skipping %s: it has no %s (incomplete or damaged)", skipped, META)
    return rounds[-1] if rounds else None

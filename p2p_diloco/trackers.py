"""Experiment trackers beside metrics.jsonl: TensorBoard event files and Weights & Biases, both optional.

Inputs:  ``cfg.logging`` (``tensorboard``, ``wandb_project``, ``wandb_mode``), the run's output directory (a peer's
         --log-dir, the simulator's --out), a run name, group and config for wandb; then, once per round, the record
         exactly as it went to metrics.jsonl (``RoundResult.record()`` plus what report.py or simulate.py add).
Output:  every numeric field of each record (ints and floats; not bools, strings, lists; not ``outer_step``, which is
         the step, nor the wall-clock stamps ``time`` and ``compute_started``; ``eval_loss_per_label`` as
         ``eval_loss_per_label/LABEL``) as a scalar at step = ``outer_step``, under the record's own key:
           logging.tensorboard true    OUT/tensorboard/events.out.tfevents.*  (``tensorboard --logdir OUT``); also
                                       ``by_tokens/train_loss`` and ``by_tokens/eval_loss`` at step = the tokens
                                       field (a peer: ``total_tokens``, its own; the simulator: ``tokens_per_worker``),
                                       for comparing runs at equal data
           logging.wandb_project set   a wandb run (name, group, config as given): ``run.log`` of the same scalars
                                       plus ``round``, the x-axis of every chart (``define_metric``); the tokens field
                                       is among the scalars, to pick as x-axis instead. ``logging.wandb_mode``
                                       offline (the default: nothing leaves the machine; OUT/wandb/offline-run-*/,
                                       upload later with ``wandb sync OUT/wandb/offline-run-*``) or online.
State:   the open writers and which of them are still enabled. Closing a wandb tracker also tears down wandb's
         service in this process (``wandb.teardown``, below), so a wandb run the caller itself started ends too.
Failure: :func:`require` raises TrackerError (a ConfigError, so the CLIs print one line and exit 2) when a configured
         tracker's package cannot be imported, naming the pip command; the roles call it before building anything.
         :meth:`Trackers.open` raises TrackerError when a tracker cannot start (an unwritable directory, wandb online
         without a login), before round 1. During the run a tracker whose write fails (disk full, a wandb error) is
         logged once and disabled, and training goes on; the caller writes metrics.jsonl first, which nothing here
         touches. ``close()`` flushes and closes every tracker (also after a failure; it never raises); the roles call
         it on every way out, Ctrl-C included.

Why tensorboardX and not torch.utils.tensorboard: the latter needs the ``tensorboard`` package (the viewer, ~30 MiB
installed with its data server), which a volunteer's training machine does not need; tensorboardX is 0.6 MiB of pure
Python whose dependencies (numpy, protobuf) hivemind and torch already bring. Its low-level ``EventsWriter`` writes
in the caller's thread, once a round (a few hundred bytes, flushed): a failure raises here, where it is caught.
Its ``SummaryWriter`` would write from a thread of its own, which dies silently on an error and then leaves the
training thread blocked on a full queue. wandb's console capture is off: the console stays the terminal's.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from p2p_diloco.config import ConfigError, LoggingConfig

__all__ = ["TrackerError", "Trackers", "require", "scalars"]

log = logging.getLogger("p2p_diloco.trackers")

PIP_EXTRA = "pip install -e '.[trackers]'"  # both trackers, from the checkout (the extra in pyproject.toml)
_NOT_SCALARS = frozenset({"outer_step", "time", "compute_started"})  # the step itself; epoch seconds (float32: ~2 min)
_BY_TOKENS = ("train_loss", "eval_loss")


class TrackerError(ConfigError):
    """A configured tracker cannot be used: its package is missing or it cannot start; the message says what to do."""


def _import(module: str, setting: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(
            f"{setting} needs the {package} package, which cannot be imported here ({exc}): pip install {package} "
            f"(or, in the p2p_diloco checkout, {PIP_EXTRA} for both trackers), or turn the setting off"
        ) from None


def require(cfg: LoggingConfig) -> None:
    """Import the package of every tracker ``cfg`` turns on; TrackerError naming the pip command when one is missing."""
    if cfg.tensorboard:
        _import("tensorboardX", "logging.tensorboard=true", "tensorboardX")
    if cfg.wandb_project is not None:
        _import("wandb", f"logging.wandb_project={cfg.wandb_project!r}", "wandb")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields as ``{tag: float}`` (see the module doc for which and how they are named)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                if _is_number(v):
                    out[f"{key}/{sub}"] = float(v)
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Tracker(Protocol):
    name: str

    def write(self, step: int, values: dict[str, float], tokens: int | None) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        _import("tensorboardX", "logging.tensorboard=true", "tensorboardX")
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        directory.mkdir(parents=True, exist_ok=True)
        # the pid keeps a restarted peer (--resume) from overwriting a file of the same second
        self._writer = EventsWriter(str(directory / "events"), filename_suffix=f".{os.getpid()}")

    def _write(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def write(self, step: int, values: dict[str, float], tokens: int | None) -> None:
        self._write(step, values)
        by_tokens = {f"by_tokens/{k}": values[k] for k in _BY_TOKENS if k in values}
        if tokens is not None and by_tokens:
            self._write(tokens, by_tokens)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, cfg: LoggingConfig, directory: Path, name: str, group: str | None, config: dict) -> None:
        self._wandb = wandb = _import("wandb", f"logging.wandb_project={cfg.wandb_project!r}", "wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.wandb_project,
            mode=cfg.wandb_mode,
            dir=str(directory),
            name=name,
            group=group,
            config=config,
            settings=wandb.Settings(console="off"),
        )
        # round, not wandb's own step, is the x-axis: wandb drops a step lower than the last one (a peer's round
        # can go back after a rollback, guard.py); its own step just counts the log calls
        self._run.define_metric("round")
        self._run.define_metric("*", step_metric="round")

    def write(self, step: int, values: dict[str, float], tokens: int | None) -> None:
        self._run.log({**values, "round": step})

    def close(self) -> None:
        try:
            self._run.finish()
        finally:
            # finish() may return before wandb's service has written the run out (seen offline: a .wandb file of its
            # header alone); teardown waits for it. wandb calls it at exit, "not reliable" with multiprocessing
            # (its docstring), which hivemind uses
            self._wandb.teardown()


class Trackers:
    """The trackers ``cfg`` turns on (possibly none); ``write(record)`` each round, ``close()`` at the end."""

    def __init__(self, trackers: list[_Tracker], tokens_field: str | None = None) -> None:
        self.trackers, self.tokens_field = trackers, tokens_field

    @classmethod
    def open(
        cls,
        cfg: LoggingConfig,
        out_dir: str | Path,
        name: str,
        group: str | None = None,
        config: dict[str, Any] | None = None,
        tokens_field: str | None = None,
    ) -> Trackers:
        """Start every tracker ``cfg`` turns on under ``out_dir``; TrackerError when one cannot start."""
        out, trackers = Path(out_dir), []
        try:
            if cfg.tensorboard:
                trackers.append(_TensorBoard(out / "tensorboard"))
                log.info("TensorBoard event files in %s (tensorboard --logdir %s)", out / "tensorboard", out)
            if cfg.wandb_project is not None:
                trackers.append(_Wandb(cfg, out, name, group, config or {}))
        except BaseException as exc:  # the ones already started are closed, whatever stopped the next one
            cls(trackers).close()
            if isinstance(exc, TrackerError) or not isinstance(exc, Exception):
                raise
            which = "logging.tensorboard" if cfg.tensorboard and not trackers else "logging.wandb_project"
            raise TrackerError(f"{which}: the tracker could not start ({exc!r}); fix that or turn it off") from None
        return cls(trackers, tokens_field)

    def write(self, record: dict[str, Any]) -> None:
        """The record's scalars to every enabled tracker; one that fails is logged once and disabled."""
        if not self.trackers:
            return
        step, values = int(record["outer_step"]), scalars(record)
        tokens = record.get(self.tokens_field) if self.tokens_field else None
        tokens = int(tokens) if _is_number(tokens) and math.isfinite(tokens) else None
        for tracker in list(self.trackers):
            try:
                tracker.write(step, values, tokens)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                log.warning(
                    "%s tracker failed at round %d (%r): disabled for the rest of this run; metrics.jsonl goes on",
                    tracker.name,
                    step,
                    exc,
                )
                self.trackers.remove(tracker)
                self._close(tracker, quiet=True)  # it may well fail again: the warning above says enough

    def close(self) -> None:
        """Flush and close every tracker; never raises (a failure is logged)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            self._close(tracker)

    @staticmethod
    def _close(tracker: _Tracker, quiet: bool = False) -> None:
        try:
            tracker.close()
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s tracker failed to close: %r", tracker.name, exc)

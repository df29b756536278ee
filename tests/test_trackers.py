"""The trackers beside metrics.jsonl: TensorBoard event files and wandb offline runs, read back with their own
readers (TensorBoard's EventAccumulator; wandb's record protobuf); a tracker that fails is dropped and training goes
on; a configured tracker whose package is missing stops a peer before it builds anything, with the pip command; and
a peer's and the simulator's real rounds land in the trackers with the values metrics.jsonl has."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from p2p_diloco.config import LoggingConfig, load_config
from p2p_diloco.trackers import PIP_EXTRA, TrackerError, Trackers, scalars

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
FAST = ["inner.steps=3", "train.rounds=2", "data.eval_batches=1", "train.eval_every=1", "train.checkpoint_every=0"]

RECORDS = [
    {
        "peer_id": "QmPeer",
        "time": 1.7e9,
        "total_tokens": 512,
        "round_seconds": 0.5,
        "outer_step": 1,
        "train_loss": 5.5,
        "tokens": 512,
        "reduce_complete": True,
        "checksum": "ab12",
        "decision": "apply",
        "group_peers": ["a", "b"],
        "eval_loss": 5.25,
        "eval_loss_per_label": {"python": 5.0, "other": 5.5},
    },
    {"total_tokens": 1024, "outer_step": 2, "train_loss": 5.125, "tokens": 512, "checksum": "cd34"},
    {"total_tokens": 1536, "outer_step": 3, "train_loss": float("nan"), "tokens": 512},
]


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard itself reads the event files of ``directory``."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run's .wandb file (a LevelDB-style log of wandb Record protobufs: 32 KiB
    blocks, each chunk under a 7-byte header crc32c:u32, length:u16, type:u8; full=1, first=2, middle=3, last=4),
    after the file's own 7-byte header. wandb ships no Python reader of it any more; the Record type is its own."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    raw, chunks = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk
        if kind in (1, 4):
            raw.append(chunks)
    rows = []
    for item in raw:
        record = wandb_internal_pb2.Record.FromString(item)
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb installed, its caches and settings under tmp_path, never a network call (offline mode, no login)."""
    pytest.importorskip("wandb")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


# ------------------------------------------------------------------ what is written
def test_scalars_are_the_numeric_fields_but_the_step_and_the_clock() -> None:
    assert scalars(RECORDS[0]) == {
        "total_tokens": 512.0,
        "round_seconds": 0.5,
        "train_loss": 5.5,
        "tokens": 512.0,
        "eval_loss": 5.25,
        "eval_loss_per_label/python": 5.0,
        "eval_loss_per_label/other": 5.5,
    }


@pytest.mark.timeout(60)
def test_tensorboard_event_files_hold_every_scalar_at_its_round_and_losses_by_tokens(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    trackers = Trackers.open(LoggingConfig(tensorboard=True), tmp_path, "run", tokens_field="total_tokens")
    for record in RECORDS:
        trackers.write(record)
    trackers.close()
    read = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(read) == set(scalars(RECORDS[0])) | {"by_tokens/train_loss", "by_tokens/eval_loss"}
    assert [step for step, _ in read["train_loss"]] == [1, 2, 3]
    assert [v for _, v in read["train_loss"][:2]] == [5.5, 5.125]  # exact in float32, as TensorBoard keeps them
    assert math.isnan(read["train_loss"][2][1])  # a diverged round shows
    assert read["eval_loss"] == [(1, 5.25)] and read["eval_loss_per_label/python"] == [(1, 5.0)]
    assert read["total_tokens"] == [(1, 512.0), (2, 1024.0), (3, 1536.0)]
    assert [step for step, _ in read["by_tokens/train_loss"]] == [512, 1024, 1536]
    assert read["by_tokens/eval_loss"] == [(512, 5.25)]


@pytest.mark.timeout(60)
def test_wandb_offline_run_holds_every_scalar_with_its_round(tmp_path: Path, wandb_offline: None) -> None:
    cfg = LoggingConfig(wandb_project="p2p-test")
    assert cfg.wandb_mode == "offline"  # the default: nothing leaves the machine unless asked
    trackers = Trackers.open(cfg, tmp_path, "peer-a", "tiny-demo", {"seed": 0}, tokens_field="total_tokens")
    for record in RECORDS[:2]:
        trackers.write(record)
    trackers.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in wandb_history(run_dir)]
    assert rows == [{**scalars(record), "round": record["outer_step"]} for record in RECORDS[:2]]


# ------------------------------------------------------------------ failures
class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def write(self, step: int, values: dict[str, float], tokens: int | None) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_a_tracker_whose_disk_is_full_is_logged_once_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("tensorboardX")
    where = tmp_path / "tensorboard"
    where.mkdir()
    now = int(time.time())
    for second in range(now, now + 5):  # the event file tensorboardX opens next (its naming) is /dev/full
        (where / f"events.out.tfevents.{second}.{socket.gethostname()}.{os.getpid()}").symlink_to("/dev/full")
    trackers = Trackers.open(LoggingConfig(tensorboard=True), tmp_path, "run")
    other = _Recorder()
    trackers.trackers.append(other)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.trackers"):
        for record in RECORDS:
            trackers.write(record)  # never raises
        trackers.close()
    failed = [r.getMessage() for r in caplog.records if "tensorboard tracker failed" in r.getMessage()]
    assert len(failed) == 1 and "round 1" in failed[0] and "No space left" in failed[0], failed
    assert other.steps == [1, 2, 3]  # the other tracker went on


def test_a_tracker_that_cannot_start_is_a_tracker_error(tmp_path: Path) -> None:
    (tmp_path / "tensorboard").write_text("a file where the directory goes")
    pytest.importorskip("tensorboardX")
    with pytest.raises(TrackerError, match="logging.tensorboard: the tracker could not start"):
        Trackers.open(LoggingConfig(tensorboard=True), tmp_path, "run")


@pytest.mark.timeout(120)
def test_a_peer_without_the_package_stops_before_anything_with_the_pip_command(tmp_path: Path) -> None:
    """A real run_peer whose ``import tensorboardX`` fails (None in sys.modules: Python's own way to block one)."""
    block = "import sys; sys.modules['tensorboardX'] = None; from peers.run_peer import main; sys.exit(main())"
    log_dir = tmp_path / "peer"
    args = ["--new-swarm", "--config", str(TINY), "--log-dir", str(log_dir), "--set", "logging.tensorboard=true"]
    proc = subprocess.run([sys.executable, "-c", block, *args], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert "run_peer: logging.tensorboard=true needs the tensorboardX package" in proc.stderr, proc.stderr
    assert "pip install tensorboardX" in proc.stderr and PIP_EXTRA in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    print(proc.stderr.strip().splitlines()[-1])
    assert not log_dir.exists()  # no identity, no DHT, no data built: it stopped first


def test_the_simulator_without_wandb_stops_before_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2p_diloco.simulate import simulate

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, installed or not
    cfg = load_config(TINY, [*FAST, "logging.wandb_project=p2p-test"])
    with pytest.raises(TrackerError, match=r"logging.wandb_project='p2p-test' needs the wandb package.*pip install"):
        simulate(cfg, "diloco", 2, tmp_path / "sim")
    assert not (tmp_path / "sim").exists()


# ------------------------------------------------------------------ the real per-round paths
def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_peers_rounds_reach_the_trackers_as_metrics_jsonl_has_them(tmp_path: Path, request) -> None:
    """A single peer of a new swarm, 2 rounds, in this process (the CLI adds ~5 s of exit), TensorBoard on and, where
    wandb is installed, an offline wandb run too."""
    pytest.importorskip("tensorboardX")
    from p2p_diloco.swarm.peer import PeerOptions, TrainingPeer

    sets = [*FAST, "swarm.linger_seconds=0", "swarm.matchmaking_time=1", "swarm.request_timeout=0.5"]
    sets += ["swarm.min_group_size=1", "logging.tensorboard=true"]
    with_wandb = _has("wandb")
    if with_wandb:
        request.getfixturevalue("wandb_offline")
        sets.append("logging.wandb_project=p2p-test")
    log_dir = tmp_path / "peer"
    opts = PeerOptions(
        initial_peers=[], log_dir=log_dir, new_swarm=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], stop=threading.Event()
    )
    peer = TrainingPeer(load_config(TINY, sets), opts)
    assert peer.run() == 0 and peer.trackers is None  # closed
    metrics = _jsonl(log_dir / "metrics.jsonl")
    assert [r["outer_step"] for r in metrics] == [1, 2]
    read = tensorboard_scalars(log_dir / "tensorboard")
    for key in ("train_loss", "eval_loss", "total_tokens", "bytes_sent"):
        assert read[key] == [(r["outer_step"], pytest.approx(r[key], rel=1e-6)) for r in metrics], key
    assert [s for s, _ in read["by_tokens/train_loss"]] == [r["total_tokens"] for r in metrics]
    if with_wandb:
        (run_dir,) = (log_dir / "wandb").glob("offline-run-*")
        rows = wandb_history(run_dir)
        assert [(row["round"], row["train_loss"], row["eval_loss"]) for row in rows] == [
            (r["outer_step"], r["train_loss"], r["eval_loss"]) for r in metrics
        ]


@pytest.mark.timeout(120)
def test_the_simulators_rounds_reach_tensorboard_as_metrics_jsonl_has_them(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    from p2p_diloco.simulate import simulate

    simulate(load_config(TINY, [*FAST, "logging.tensorboard=true"]), "diloco", 2, tmp_path)
    metrics = _jsonl(tmp_path / "metrics.jsonl")
    read = tensorboard_scalars(tmp_path / "tensorboard")
    assert read["train_loss"] == [(r["outer_step"], pytest.approx(r["train_loss"], rel=1e-6)) for r in metrics]
    assert read["eval_loss"] == [(r["outer_step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in metrics]
    assert [s for s, _ in read["by_tokens/train_loss"]] == [r["tokens_per_worker"] for r in metrics]


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True

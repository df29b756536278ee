"""PNG plots of a run: loss against round and against tokens, peers against time.

Inputs:  the monitor's ``monitor.jsonl`` (one swarm summary per refresh; may be missing) and any number of
         peers' log directories (or their ``metrics.jsonl`` files; one record per round, see swarm/peer.py).
Output:  :func:`render_plots` -> {name: PNG bytes} for every name in :data:`PLOT_NAMES`;
         :func:`write_plots` writes them as ``OUT/<name>.png``. A plot without data says so in the image.
State:   none (matplotlib's object API on the Agg canvas: no pyplot, no global figure state, safe in threads).
Failure: unreadable or torn JSON lines are skipped; a missing file is treated as empty.
         :class:`FileNotFoundError` from :func:`write_plots` only when no input exists at all.

Swarm curve from peer logs: for each round, the token-weighted mean ``train_loss`` over the peers that
logged that step, at x = all peers' tokens through that step.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["PLOT_NAMES", "load_jsonl", "load_peer_logs", "swarm_curve", "render_plots", "write_plots"]

PLOT_NAMES = ("loss_vs_round", "loss_vs_tokens", "peers_vs_time")


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; [] when missing; lines that do not parse are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def load_peer_logs(paths: Iterable[Path]) -> dict[str, list[dict[str, Any]]]:
    """{label: records} from log directories (their metrics.jsonl) or metrics.jsonl files; label = dir name."""
    logs = {}
    for p in map(Path, paths):
        file = p / "metrics.jsonl" if p.is_dir() else p
        label = file.parent.name or str(file)
        logs[label if label not in logs else str(file.parent)] = load_jsonl(file)
    return logs


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def swarm_curve(peer_logs: dict[str, list[dict[str, Any]]]) -> list[tuple[int, float, int]]:
    """(round, token-weighted mean train loss, tokens of all peers through that step), by step."""
    by_step: dict[int, list[tuple[float | None, int]]] = {}
    for records in peer_logs.values():
        for r in records:
            if isinstance(r.get("outer_step"), int):
                by_step.setdefault(r["outer_step"], []).append((_num(r.get("train_loss")), int(r.get("tokens") or 0)))
    out, cumulative = [], 0
    for step in sorted(by_step):
        items = by_step[step]
        cumulative += sum(t for _, t in items)
        finite = [(loss, t) for loss, t in items if loss is not None]
        weight = sum(t for _, t in finite)
        if finite:
            mean = sum(loss * t for loss, t in finite) / weight if weight else sum(x for x, _ in finite) / len(finite)
            out.append((step, mean, cumulative))
    return out


def _last_per_round(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One history record per round (the last one seen at that round), by round."""
    per: dict[int, dict[str, Any]] = {}
    for h in history:
        if isinstance(h.get("round"), int) and _num(h.get("mean_train_loss")) is not None:
            per[h["round"]] = h
    return [per[k] for k in sorted(per)]


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(6, 4), layout="tight")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _finish(fig: Figure, ax: Any, has_data: bool) -> bytes:
    if has_data:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    return _png(fig)


def _loss_vs_round(history: list[dict[str, Any]], peer_logs: dict[str, list[dict[str, Any]]]) -> bytes:
    fig, ax = _axes("loss by round", "round", "loss")
    has = False
    for label, records in sorted(peer_logs.items()):
        pts = [(r["outer_step"], _num(r.get("train_loss"))) for r in records if isinstance(r.get("outer_step"), int)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=0.8, alpha=0.6, label=f"{label} train")
            has = True
    curve = swarm_curve(peer_logs)
    if curve:
        ax.plot([c[0] for c in curve], [c[1] for c in curve], "k-", lw=1.5, label="swarm train (peer logs)")
    per_round = _last_per_round(history)
    if per_round:
        ax.plot(
            [h["round"] for h in per_round],
            [h["mean_train_loss"] for h in per_round],
            "o",
            ms=3,
            color="tab:green",
            label="monitor train",
        )
        has = True
    evals = {}
    for h in history:
        if isinstance(h.get("eval_round"), int) and _num(h.get("eval_loss")) is not None:
            evals[h["eval_round"]] = h["eval_loss"]
    for records in peer_logs.values():
        for r in records:
            if isinstance(r.get("outer_step"), int) and _num(r.get("eval_loss")) is not None:
                evals.setdefault(r["outer_step"], r["eval_loss"])
    if evals:
        xs = sorted(evals)
        ax.plot(xs, [evals[x] for x in xs], "s--", ms=4, color="tab:red", label="eval")
        has = True
    return _finish(fig, ax, has)


def _loss_vs_tokens(history: list[dict[str, Any]], peer_logs: dict[str, list[dict[str, Any]]]) -> bytes:
    fig, ax = _axes("loss by tokens", "tokens trained by the swarm", "train loss")
    has = False
    curve = swarm_curve(peer_logs)
    if curve:
        ax.plot([c[2] for c in curve], [c[1] for c in curve], "k-", lw=1.5, label="swarm (peer logs)")
        has = True
    pts = [(h.get("total_tokens"), _num(h.get("mean_train_loss"))) for h in _last_per_round(history)]
    pts = [(x, y) for x, y in pts if isinstance(x, int) and y is not None]
    if pts:
        ax.plot(*zip(*pts, strict=True), "o", ms=3, label="monitor")
        has = True
    return _finish(fig, ax, has)


def _peers_vs_time(history: list[dict[str, Any]], peer_logs: dict[str, list[dict[str, Any]]]) -> bytes:
    fig, ax = _axes("peers", "minutes", "peers")
    times = [h["time"] for h in history if _num(h.get("time")) is not None]
    rounds: dict[int, list[float]] = {}  # round -> times at which peers logged it
    for records in peer_logs.values():
        for r in records:
            if isinstance(r.get("outer_step"), int) and _num(r.get("time")) is not None:
                rounds.setdefault(r["outer_step"], []).append(r["time"])
    t0 = min(times + [min(ts) for ts in rounds.values()], default=0.0)
    has = False
    if times:
        pts = [((h["time"] - t0) / 60, h.get("num_peers") or 0) for h in history if _num(h.get("time")) is not None]
        ax.step(*zip(*pts, strict=True), where="post", label="monitor: peers alive (records not expired)")
        has = True
    if rounds:
        steps = sorted(rounds, key=lambda k: min(rounds[k]))
        ax.plot(
            [(min(rounds[k]) - t0) / 60 for k in steps],
            [len(rounds[k]) for k in steps],
            ".--",
            ms=4,
            label="peer logs: peers that logged each round",
        )
        has = True
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, has)


def render_plots(history_path: Path | None, peer_dirs: Sequence[Path] = ()) -> dict[str, bytes]:
    """{name: PNG bytes} for :data:`PLOT_NAMES` from a monitor.jsonl (or None) and peers' log dirs."""
    history = load_jsonl(Path(history_path)) if history_path is not None else []
    logs = load_peer_logs(peer_dirs)
    return {
        "loss_vs_round": _loss_vs_round(history, logs),
        "loss_vs_tokens": _loss_vs_tokens(history, logs),
        "peers_vs_time": _peers_vs_time(history, logs),
    }


def write_plots(out_dir: Path, history_path: Path | None, peer_dirs: Sequence[Path] = ()) -> list[Path]:
    """Write ``OUT/<name>.png`` for every plot; returns the paths. FileNotFoundError when no input exists."""
    inputs = ([Path(history_path)] if history_path is not None else []) + [Path(p) for p in peer_dirs]
    if not any(p.exists() for p in inputs):
        raise FileNotFoundError(f"nothing to plot: none of {', '.join(map(str, inputs)) or 'no inputs'} exists")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, png in render_plots(history_path, peer_dirs).items():
        path = out_dir / f"{name}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths

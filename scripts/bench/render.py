"""Render BENCHMARKS.md (repository root) from the JSON results in scripts/bench/results/.

Usage:
    python scripts/bench/render.py [--results scripts/bench/results] [--out BENCHMARKS.md]

Reads ``<item>.json`` for the items inner, allreduce, utilisation, comm_quality, memory (and gpu_inner,
gpu_swarm when gpu.sh ran; netlab, compression_quality, stragglers, join and threads when they ran), plus
``run_all.json`` (total runtime, load). Every table row shows the figure, its reference measured in the same run,
the ratio, the machine and the date. Missing results are listed as not run; results of a ``--smoke`` run (tiny
sizes, to check the scripts) are flagged as such in the text. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS_DIR, ROOT  # noqa: E402

ITEMS = [
    ("inner", "1. Inner-loop efficiency"),
    ("allreduce", "2. Averaging round"),
    ("utilisation", "3. Compute utilisation"),
    ("comm_quality", "4. Communication to quality"),
    ("memory", "5. Memory"),
    ("gpu_inner", "6. GPU: inner loop"),
    ("gpu_swarm", "6. GPU: 2-peer swarm sharing the GPU"),
    ("netlab", "7. Communication on shaped links"),
    ("compression_quality", "8. Quality per codec and overlap"),
    ("stragglers", "9. Uneven peers: one 3x slower"),
    ("join", "10. Joining: state download"),
    ("staleness", "11. A straggler's delayed pseudo-gradient (simulated)"),
    ("threads", "12. Threads on a shared machine"),
]


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "not reached"
    if unit == "B":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value:.3f} s" if value < 1 else f"{value:.2f} s"
    if unit == "share":
        return f"{100 * value:.1f}%"
    if unit.startswith("tok"):
        return f"{value:,.0f} {unit}"
    return f"{value:.4g} {unit}"


def fmt_ratio(r: dict[str, Any]) -> str:
    ratio = r.get("ratio")
    if ratio is None:
        return "-"
    text = f"{ratio:.3f}" if ratio < 10 else f"{ratio:.1f}"
    if r.get("ratio_range"):
        lo, hi = r["ratio_range"]
        text += f" ({lo:.2f}-{hi:.2f})"
    return f"{text} {r.get('ratio_kind', '')}".strip()


def machine_text(m: dict[str, Any]) -> str:
    text = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
    if m.get("gpu"):
        text += f", {m['gpu']}"
    return text


def load(results: Path, item: str) -> dict[str, Any] | None:
    path = results / f"{item}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def findings(found: dict[str, dict[str, Any] | None]) -> list[str]:
    """Where the time and memory go, computed from the results present (no numbers are typed in here)."""
    out = []
    util = found.get("utilisation")
    if util and util.get("cases"):
        cases = [  # blocking rounds: an eager round's matchmaking and all-reduce run beside its inner steps
            c
            for c in util["cases"]
            if c.get("utilisation_wall") is not None and "swarm.overlap=eager" not in c.get("overrides", [])
        ]
        for k, c in enumerate(sorted(cases, key=lambda c: (c["h"] != 100, c["case"]))[:2]):
            waits = (c["matchmaking_per_round"] or 0) - (c["matchmaking_protocol_per_round"] or 0)
            non_compute = c["compute_per_round"] * (1 / c["utilisation_wall"] - 1)
            out.append(
                f"Utilisation, {c['case']} H={c['h']}: {non_compute:.2f} s per round outside inner steps, of which "
                f"{waits:.2f} s waiting in matchmaking for slower peers, {c['matchmaking_protocol_per_round']:.2f} s "
                f"matchmaking protocol, {c['allreduce_per_round']:.2f} s all-reduce and {c['other_per_round']:.2f} s "
                "other per-round work (pseudo-gradient, copies and finite checks, outer step, checksums)."
                + (
                    " The remedy for the wait: every peer trains for the same time instead of the same number of"
                    " steps, inner.round_seconds (item 9)."
                    if k == 0
                    else ""
                )
            )
    strag = found.get("stragglers")
    for c in (strag or {}).get("cases", []):
        peers = c["per_peer"]
        each = "; ".join(
            f"peer {k}{' (slow)' if c['slow_peer'] and k == len(peers) - 1 else ''}: {p['utilisation']:.0%} "
            f"utilisation, {p['rounds_in_group']} rounds in a group, {p['rounds_lost']} lost, "
            f"{p['tokens_contributed']:,} tokens contributed"
            for k, p in enumerate(peers)
        )
        loss = "not measured" if c["eval_loss"] is None else f"{c['eval_loss']:.3f}"
        out.append(f"Uneven peers, {c['label']} ({c['seconds']:.0f} s): eval loss {loss}; {each}.")
    ar = found.get("allreduce")
    if ar and ar.get("summaries"):
        s = max(ar["summaries"], key=lambda s: (s["params"], s["peers"]))
        out.append(
            f"Averaging, {s['peers']} peers x {s['params'] / 1e6:g}M params: the butterfly moves "
            f"{s['payload_bytes'] / s['bytes_lower_bound']:.3f}x the lower bound of bytes, yet the round takes "
            f"{s['round_seconds']:.2f} s against gloo's {s['gloo_seconds']:.2f} s: all-reduce "
            f"{s['allreduce_seconds']:.2f} s (every part is serialised to protobuf, sent through a unix socket to "
            f"p2pd, encrypted, framed, and back), host-side copies and finite checks "
            f"{s['host_overhead_seconds']:.2f} s, matchmaking {s['matchmaking_seconds']:.2f} s. Fewer bytes "
            "(fp16/bf16/int8 codecs) attack the all-reduce."
            + _in_place(ar.get("supplementary", {}).get("result_in_place"))
        )
    mem = found.get("memory")
    if mem and mem.get("rows"):
        host = next((r for r in mem["rows"] if "host process alone" in r["figure"]), None)
        roles = mem.get("roles", {})
        helpers = sum(r["VmHWM"] for k, r in roles.items() if not k.startswith("host"))
        if host:
            out.append(
                f"Memory: the training process itself needs {host['extra_bytes_per_param']:.0f} B/param more than "
                "plain training (anchor, momentum, pseudo-gradient, shared-memory buffer, averaged copy: 4 B each in "
                f"fp32, some of it transient); the helper processes (DHT, p2pd, averager, torch_shm_manager) add "
                f"{helpers / 2**20:.0f} MiB of peak RSS (pages shared with the host counted again), mostly a fixed "
                "cost per process (Python, torch, hivemind), so the whole-tree B/param figures do not scale with the "
                "model: they shrink per parameter as the model grows."
            )
    cq = found.get("comm_quality")
    if cq and cq.get("summary"):
        runs = cq["summary"]["runs"]
        missed = [r["h"] for r in runs.values() if r["mode"] == "diloco" and r["target_crossing"] is None]
        if missed:
            out.append(
                "Communication to quality: DiLoCo at H = " + ", ".join(map(str, missed)) + " did not reach the sync "
                "baseline's final loss +2% at equal tokens on the tiny config (see the rows for the gap); at a loss "
                "every run reaches, the byte savings are in the table."
            )
    return out


def _in_place(found: dict | None) -> str:
    """The host-side copies since the group's mean is handed over in the averager's buffers (allreduce.json's
    supplementary ``result_in_place``: runs A copied out, B in place), as a sentence; "" without it."""
    runs = (found or {}).get("runs", {})
    out = [r["host_overhead_seconds"] for k, r in runs.items() if k.startswith("A")]
    kept = [r["host_overhead_seconds"] for k, r in runs.items() if k.startswith("B")]
    if not (out and kept):
        return ""

    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    return (
        " The host-side part was measured with the mean copied out of the shared buffers; handed over in place it "
        f"takes {sum(out) / sum(kept):.1f}x less ({span(kept)} s against {span(out)} s, 3 peers x 50M params, "
        "allreduce.json supplementary result_in_place)."
    )


def render(results: Path) -> str:
    run_all = load(results, "run_all")
    found = {item: load(results, item) for item, _ in ITEMS}
    first = next((d for d in found.values() if d), None)
    lines = ["# Benchmarks", ""]
    lines.append(
        "Generated by `python scripts/bench/run_all.py` (items 1-5; item 6 is `bash scripts/bench/gpu.sh` on a "
        "machine with one GPU; items 7 and 8 take hours in full and run on their own: `scripts/bench/netlab.py` "
        "as root, `scripts/bench/compression_quality.py`; item 9 is `scripts/bench/stragglers.py`, about 10 minutes; "
        "item 10 is `scripts/bench/join.py --netlab` as root, about "
        "4 minutes; item 11 is `scripts/bench/staleness.py`, about 25 minutes; item 12 is `scripts/bench/threads.py`, "
        "a few minutes; `render.py` rebuilds this page from the results). Every "
        "figure is a ratio against a reference measured in the same run, on the same "
        "machine, interleaved where possible. Raw numbers: `scripts/bench/results/*.json`."
    )
    lines.append("")
    smoke = [item for item, data in (("run_all", run_all), *found.items()) if data and data.get("smoke")]
    if smoke:
        lines.append(
            "**Smoke run** (`--smoke`: tiny sizes, seconds each, to check that the scripts work) for "
            + ", ".join(smoke)
            + ": these figures are not measurements."
        )
        lines.append("")
    if run_all:
        lines.append(
            f"Last full run: {run_all['started'][:16].replace('T', ' ')} UTC, {machine_text(run_all['machine'])}, "
            f"{run_all['machine'].get('memory_gib')} GiB, torch {run_all['machine'].get('torch')}, hivemind "
            f"{run_all['machine'].get('hivemind')}; total runtime {run_all['wall_seconds'] / 60:.1f} min. "
            f"The machine is shared: load average (1/5/15 min) {run_all['load_before']} before, "
            f"{run_all['load_after']} after"
            + (
                f", {run_all['load_min']:.1f}-{run_all['load_max']:.1f} (1 min) sampled during the run"
                if run_all.get("load_max") is not None
                else ""
            )
            + "."
        )
        if run_all.get("failed"):
            lines.append("")
            lines.append("Items that failed or timed out in that run: " + ", ".join(run_all["failed"]) + ".")
        lines.append("")
    elif first:
        lines.append(f"Machine: {machine_text(first['machine'])}.")
        lines.append("")
    lines += [
        "| item | figure | value | reference | reference value | ratio | machine | date |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for item, title in ITEMS:
        data = found[item]
        if data is None:
            continue
        mach = machine_text(data["machine"])
        date = f"{data['finished'][:10]} (load {data['load_before'][0]:.1f}/{data['load_after'][0]:.1f})"
        for r in data["rows"]:
            cells = [
                title,
                r["figure"].replace("|", "/"),
                fmt(r["value"], r["unit"]),
                r["reference"].replace("|", "/"),
                fmt(r["reference_value"], r["unit"]) if r["reference_value"] is not None else "-",
                fmt_ratio(r),
                mach,
                date,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Date column: UTC day of the measurement, with the 1-minute load average before/after that item.")
    lines.append("")
    missing = [title for item, title in ITEMS if found[item] is None]
    if missing:
        lines.append("Not run in the results present: " + "; ".join(missing) + ".")
        if found["gpu_inner"] is None:
            lines.append(
                "Item 6 (GPU) needs a machine with one CUDA GPU: `bash scripts/bench/gpu.sh` (about 5 minutes) "
                "writes results/gpu_inner.json and results/gpu_swarm.json and re-renders this file. It has not been "
                "run yet: no GPU was available where these figures were taken."
            )
        lines.append("")
    lines.append("## How each figure is measured")
    lines.append("")
    for item, title in ITEMS:
        data = found[item]
        if data is None:
            continue
        lines.append(
            f"**{title}** (`scripts/bench/{item if not item.startswith('gpu') else 'gpu.sh'}"
            f"{'' if item.startswith('gpu') else '.py'}`, {data['wall_seconds']:.0f} s)"
        )
        lines.append("")
        for note in data.get("notes", []):
            lines.append(f"- {note}")
        lines.append("")
    facts = findings(found)
    if facts:
        lines.append("## Where the time and memory go (computed from the results above)")
        lines.append("")
        for f in facts:
            lines.append(f"- {f}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    args = p.parse_args(argv)
    text = render(args.results)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

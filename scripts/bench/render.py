"""Render BENCHMARKS.md (repository root) from the JSON results in scripts/bench/results/.

Usage:
    python scripts/bench/render.py [--results scripts/bench/results] [--out BENCHMARKS.md]

Inputs:  ``<item>.json`` in ``--results`` for the items inner, allreduce, utilisation, comm_quality, memory (and
         gpu_inner, gpu_swarm when gpu.sh ran; netlab, compression_quality, stragglers, join, staleness, threads,
         one_state and scale when they ran), plus ``run_all.json`` (total runtime, load); the loss-vs-bytes PNGs of
         scripts/paper_table.py under docs/paper_table/ are linked when they exist. Nothing is measured or rerun here.
Output:  ``--out`` (BENCHMARKS.md): first a one-screen summary, one row per item (1-14): its headline figure against
         its anchor, computed from that item's JSON (never typed in), the target its own rows state (their
         ratio_kind, "target >= 0.98"; items 13 and 14: one state a round), whether it is met (yes, no, "k of n"
         cases) and the UTC day(s) of the run. Then "## Detail": the full table (every row: figure, reference
         measured in the same run, ratio, machine, date), items 13 and 14 per case, how each figure is measured, and
         where the time and memory go.
Failure: a missing results file is "not run" (an unreadable one counts as missing); a file whose fields the summary
         cannot read gets a summary row saying so instead of a figure, and the detail still renders; results of a
         ``--smoke`` run (tiny sizes, to check the scripts) are flagged as not measurements, and smoke cases of
         one_state/scale are left out. A row field missing in the main detail table raises (KeyError).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
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
    ("codecs", "8b. Quality of int4 and error feedback"),
    ("sparse", "8c. Quality of the top-k codecs and fragments (equal tokens, 40 rounds x H 25)"),
    ("stragglers", "9. Uneven peers: one 3x slower"),
    ("join", "10. Joining: state download"),
    ("staleness", "11. A straggler's delayed pseudo-gradient (simulated)"),
    ("threads", "12. Threads on a shared machine"),
]
# an item whose script is not scripts/bench/<item>.py
SCRIPTS = {
    "codecs": "compression_quality.py --codecs none int8 int4 int4+ef int8+ef --seeds 0 1 --out results/codecs.json",
    "sparse": "compression_quality.py --preset tiny --rounds 40 --h 25 --codecs none int8 int4 topk3 topk1 none@F4 "
    "int8@F4 topk3@F4 topk1@F4 --seeds 0 1 --out results/sparse.json",
}


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


# --- the one-screen summary at the top of the page ------------------------------------------------------------------
# One row per item: its headline figure against its anchor, computed here from the item's JSON (no figure is typed
# in), the target as the item's own rows state it (their ratio_kind, e.g. "(target >= 0.98)"), whether it is met, and
# the UTC day(s) of the run. An item without a results file says "not run"; one whose JSON this code cannot read
# says so and points to the detail.

SWARM_ITEMS = [("one_state", "13. One swarm, one state"), ("scale", "14. Many peers on one machine")]
SHORT = {
    "inner": "1. Inner loop",
    "allreduce": "2. Averaging round",
    "utilisation": "3. Compute utilisation",
    "comm_quality": "4. Communication to quality",
    "memory": "5. Memory",
    "gpu": "6. GPU",
    "gpu_inner": "6. GPU: inner loop",
    "gpu_swarm": "6. GPU: 2-peer swarm",
    "netlab": "7. Shaped links",
    "compression_quality": "8. Quality per codec, overlap",
    "stragglers": "9. One peer 3x slower",
    "join": "10. Joining",
    "staleness": "11. Delayed pseudo-gradient",
    "threads": "12. Threads",
    "codecs": "8b. int4, error feedback",
    "sparse": "8c. top-k codecs",
    "one_state": "13. One state",
    "scale": "14. Many peers",
}
# loss against bytes sent, drawn by scripts/paper_table.py from its own simulator runs (linked when present)
PLOTS = ("docs/paper_table/tiny_loss_vs_bytes.png", "docs/paper_table/small_loss_vs_bytes.png")
_TARGET = re.compile(r"target ([<>]=) ?([0-9]*\.?[0-9]+)([^)]*)")


def _x(ratio: float) -> str:
    return f"{ratio:.3f}x" if ratio < 10 else f"{ratio:.1f}x"


def _span(values: list[float], form: Callable[[float], str]) -> str:
    lo, hi = form(min(values)), form(max(values))
    return lo if lo == hi else f"{lo.rstrip('x%')}-{hi}"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


Target = tuple[str, float, str, str]  # operator, bound, the bound as written, the rest of its text ("at H=100")


def _target(rows: list[dict[str, Any]]) -> Target | None:
    """The first target stated in the rows' ratio_kind ("... (target >= 0.99 at H=100)")."""
    for r in rows:
        m = _TARGET.search(r.get("ratio_kind", ""))
        if m:
            return m.group(1), float(m.group(2)), m.group(2), m.group(3).strip()
    return None


def _met(values: list[float], target: Target | None) -> str:
    """ "yes", "no" or "k of n": how many of ``values`` reach ``target``; "-" without one."""
    if target is None or not values:
        return "-"
    op, bound = target[:2]
    hits = sum((v >= bound) if op == ">=" else (v <= bound) for v in values)
    return "yes" if hits == len(values) else "no" if hits == 0 else f"{hits} of {len(values)}"


def _target_text(target: Target | None, unit: str = "") -> str:
    return "-" if target is None else " ".join(x for x in (f"{target[0]} {target[2]}{unit}", target[3]) if x)


Headline = tuple[str, str, str]  # headline, target, met


def _s_inner(d: dict[str, Any]) -> Headline:
    rows = d["rows"]
    target = _target(rows)
    each = ", ".join(f"{_x(r['ratio'])} ({r['figure'].split(' (')[0]})" for r in rows)
    ref = rows[0]["reference"].split(",")[0]
    return f"{rows[0]['unit']}: {each} a {ref}", _target_text(target), _met([r["ratio"] for r in rows], target)


def _s_allreduce(d: dict[str, Any]) -> Headline:
    def ratios(group: str) -> list[float]:
        return [r["ratio"] for r in d["rows"] if r.get("group") == group]

    overlap = [r for r in d["rows"] if r.get("group") == "allreduce_overlap"]
    target = _target(overlap)
    codecs: dict[str, list[float]] = {}
    for c in d.get("codecs", []):
        if c["codec"] != "none":  # fp32: the summaries' rows
            codecs.setdefault(c["codec"], []).append(c["payload_bytes"] / c["bytes_lower_bound"])
    cases = f"{len(d['summaries'])} fp32 cases" + (
        "; codecs " + ", ".join(f"{k} {_span(v, _x)}" for k, v in codecs.items()) if codecs else ""
    )
    parts = [f"payload {_span(ratios('allreduce_bytes'), _x)} the butterfly bound ({cases})"]
    parts.append(f"round wall {_span(ratios('allreduce_time'), _x)} gloo's")
    if overlap:
        parts.append(f"exposed with overlap {_span([r['ratio'] for r in overlap], _x)} gloo's")
    return "; ".join(parts), _target_text(target, "x gloo"), _met([r["ratio"] for r in overlap], target)


def _overrides(overrides: list[str]) -> tuple[bool, bool]:
    """(time-budgeted rounds, eager overlap) of a case's overrides."""
    return (
        any(o.startswith("inner.round_seconds=") for o in overrides),
        any("overlap=eager" in o for o in overrides),
    )


def _s_utilisation(d: dict[str, Any]) -> Headline:
    cases = [c for c in d["cases"] if c.get("utilisation_wall") is not None]
    target = _target(d["rows"])
    parts = []
    for eager in (False, True):
        fixed = [c for c in cases if _overrides(c["overrides"]) == (False, eager)]
        if fixed:
            each = ", ".join(f"{_pct(c['utilisation_wall'])} {c['case']}" for c in fixed)
            parts.append(f"{'eager overlap' if eager else 'blocking'} {each}")
    best = max(cases, key=lambda c: c["utilisation_wall"])
    budgeted, eager = _overrides(best["overrides"])
    how = ", ".join(
        [best["case"]]
        + (["time-budgeted rounds"] if budgeted else [])
        + [o.split(".")[-1] for o in best["overrides"] if o.startswith("swarm.overlap")]
    )
    hs = sorted({c["h"] for c in cases if not any(_overrides(c["overrides"]))})
    head = f"fixed H={'/'.join(map(str, hs))}: " + "; ".join(parts) + f"; best {_pct(best['utilisation_wall'])} ({how})"
    return head, _target_text(target), _met([c["utilisation_wall"] for c in cases], target)


def _s_comm_quality(d: dict[str, Any]) -> Headline:
    runs = d["summary"]["runs"]
    sync = next(r for r in runs.values() if r["mode"] == "sync")
    diloco = sorted((r for r in runs.values() if r["mode"] == "diloco"), key=lambda r: r["h"])
    margin = d["summary"]["target"] / sync["final_eval_loss"] - 1
    reached = [r["target_crossing"] is not None for r in diloco]
    hs = "/".join(str(r["h"]) for r in diloco)
    finals = "/".join(f"{100 * (r['final_eval_loss'] / sync['final_eval_loss'] - 1):+.1f}%" for r in diloco)
    fewer = "/".join(
        _x(sync["common_crossing"]["bytes"] / r["common_crossing"]["bytes"]).rstrip("x")
        for r in diloco
        if r.get("common_crossing") and sync.get("common_crossing")
    )
    head = (
        f"DiLoCo H={hs} vs sync data-parallel: final loss {finals} vs sync's; to the loss every run reaches, "
        f"{fewer}x fewer bytes than sync (expected about H)"
    )
    met = "yes" if all(reached) else "no" if not any(reached) else f"{sum(reached)} of {len(reached)}"
    return head, f"sync's loss +{100 * margin:.0f}%", met


def _s_memory(d: dict[str, Any]) -> Headline:
    rows = [r for r in d["rows"] if r.get("extra_bytes_per_param") is not None]
    host = [r for r in rows if "host process alone" in r["figure"]]
    tree = [r["ratio"] for r in rows if r not in host]
    parts = [
        f"training process {_x(r['ratio'])} a plain AdamW process's peak (+{r['extra_bytes_per_param']:.1f} B/param)"
        for r in host
    ]
    if tree:
        parts.append(f"whole peer tree (DHT, p2pd, averager) {_span(tree, _x)}")
    return f"{rows[0]['figure'].split(' peer ')[0]}: " + "; ".join(parts), "-", "-"


def _s_netlab(d: dict[str, Any]) -> Headline:
    cases = [c for c in d["cases"] if c.get("utilisation") is not None]
    rates = "/".join(f"{r:g}" for r in sorted({c["rate_mbit"] for c in cases}))
    peers = "/".join(str(p) for p in sorted({c["peers"] for c in cases}))
    parts = []
    for eager in (False, True):
        xs = [c["utilisation"] for c in cases if _overrides(c["setting"] + c.get("overrides", []))[1] == eager]
        if xs:
            parts.append(f"{'eager overlap' if eager else 'blocking'} {_span(xs, _pct)}")
    head = f"{peers} peers on {rates} Mbit/s links, utilisation: " + ", ".join(parts) + f" ({len(cases)} cases)"
    return head, "-", "-"


def _s_compression_quality(d: dict[str, Any]) -> Headline:
    ok = [c for c in d["cases"] if c.get("ratio") is not None]
    codec = [c for c in ok if c["overlap"] == "none" and c["compression"] != "none"]
    eager = [c for c in ok if c["overlap"] != "none"]
    parts = []
    if codec:
        names = "/".join(sorted({c["compression"] for c in codec}))
        parts.append(f"{names} {_span([c['ratio'] for c in codec], _x)}")
    if eager:
        taus = sorted({c["tau"] for c in eager})
        parts.append(f"eager overlap τ={taus[0]}-{taus[-1]} {_span([c['ratio'] for c in eager], _x)}")
    presets = "/".join(sorted({c["preset"] for c in ok}))
    head = f"final loss / blocking fp32's, same seed ({presets}, {len(ok)} runs): " + "; ".join(parts)
    return head, "-", "-"


def _s_codecs(d: dict[str, Any]) -> Headline:
    """Per codec: its mean ratio to fp32 per preset, and how many times fewer bytes than fp32 it sent."""
    ok = [c for c in d["cases"] if c.get("ratio") is not None and c["compression"] != "none"]
    fp32 = {c["preset"]: c["mb_sent_per_worker"] for c in d["cases"] if c["compression"] == "none" and c.get("ratio")}
    parts = []
    for codec in sorted({c["compression"] for c in ok}):
        runs = [c for c in ok if c["compression"] == codec]
        means = []
        for preset in sorted({c["preset"] for c in runs}):
            ratios = [c["ratio"] for c in runs if c["preset"] == preset]
            means.append(f"{preset} {_x(sum(ratios) / len(ratios))}")
        fewer = [fp32[c["preset"]] / c["mb_sent_per_worker"] for c in runs if c["preset"] in fp32]
        bytes_ = f", {_span(fewer, _x)} fewer bytes" if fewer else ""
        parts.append(f"{codec} {', '.join(means)}{bytes_}")
    seeds = len({c["seed"] for c in ok})
    return f"mean final loss / blocking fp32's ({seeds} seeds): " + "; ".join(parts), "-", "-"


def _s_stragglers(d: dict[str, Any]) -> Headline:
    base = next(c["label"] for c in d["cases"] if not c["slow_peer"] and not c["overrides"])
    slow = f", one peer {d['args']['slowdown']:g}x slower"
    rows = [r for r in d["rows"] if r["reference"] == base]
    each = ", ".join(f"{_x(r['ratio'])} ({r['figure'].split(' vs ')[0].replace(slow, '')})" for r in rows)
    return f"eval loss after {d['args']['seconds']:g} s{slow} / {base}: {each}", "-", "-"


def _s_join(d: dict[str, Any]) -> Headline:
    parts = []
    for r in d["rows"]:
        m = re.search(r"(\d+) newcomer", r["figure"])
        who = r["figure"] if not m else "1 newcomer" if m.group(1) == "1" else f"{m.group(1)} newcomers at once"
        parts.append(f"{_x(r['value'] / r['wire_seconds'])} the wire time ({who})")
    ratios = _span([r["ratio"] for r in d["rows"]], _x)
    head = (
        f"state download from {d['args']['donors']} donors: " + ", ".join(parts) + f"; {ratios} the time from 1 donor"
    )
    return head, "-", "-"


def _s_staleness(d: dict[str, Any]) -> Headline:
    parts = []
    for part in dict.fromkeys(c["partition"] for c in d["cases"]):
        cases = [c for c in d["cases"] if c["partition"] == part]
        base = next(c for c in cases if len(set(c["speeds"])) == 1)
        kinds: dict[str, list[float]] = {}
        for c in cases:
            if c is not base:
                kinds.setdefault(c["label"].split(",")[0].split(" (")[0], []).append(c["eval_loss"] / base["eval_loss"])
        parts.append(f"{part}: " + ", ".join(f"{k} {_span(v, _x)}" for k, v in kinds.items()))
    return f"eval loss / equal speeds, one worker {d['args']['slowdown']:g}x slower: " + "; ".join(parts), "-", "-"


THREAD_NAMES = {
    "default": "torch's default",
    "auto": "--threads 0",
    "1": "--threads 1",
    "default-passive": "OMP PASSIVE",
}


def _s_threads(d: dict[str, Any]) -> Headline:
    alone, busy = d["blocks"]["alone"], d["blocks"]["busy"]
    each = ", ".join(
        f"{THREAD_NAMES.get(k, k)} {_x(busy[k]['wall_seconds'] / alone[k]['wall_seconds'])}" for k in busy if k in alone
    )
    return f"wall beside {d['args']['busy']} busy process(es) / alone: {each}", "-", "-"


def _s_generic(d: dict[str, Any]) -> Headline:
    rows = [r for r in d["rows"] if r.get("ratio") is not None]
    target = _target(rows)
    head = f"{_span([r['ratio'] for r in rows], _x)} {rows[0]['ratio_kind']} ({len(rows)} rows)"
    return head, _target_text(target), _met([r["ratio"] for r in rows], target)


def _swarm_cases(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured cases of one_state.json or scale.json, by peers; smoke cases (harness checks) are left out."""
    cases = [{"name": k, **c} for k, c in d["cases"].items() if not k.startswith("smoke")]
    return sorted(cases, key=lambda c: (c["peers"], c["name"]))


def _one_every_round(c: dict[str, Any]) -> bool:
    return all(n == 1 for n in c["states_per_round"].values()) and c["final_states"] == 1


def _s_one_state(d: dict[str, Any]) -> Headline:
    cases = _swarm_cases(d)
    ones = [_one_every_round(c) for c in cases]
    worst = max(cases, key=lambda c: c["lost_share"])
    peers = _span([c["peers"] for c in cases], str)
    head = (
        f"{len(cases)} swarms of {peers} run_peer processes: one state every round in {sum(ones)}, one final state "
        f"in {sum(c['final_states'] == 1 for c in cases)}; lost peer-rounds "
        f"{_span([c['lost_share'] for c in cases], lambda x: f'{100 * x:.0f}%')} (worst: {worst['name']})"
    )
    met = "yes" if all(ones) else "no" if not any(ones) else f"{sum(ones)} of {len(ones)}"
    return head, "1 state a round", met


def _failure(problem: str) -> str:
    """A scale run's problem in two words: peers that failed (at start) or the run's own error (timeout...)."""
    return "peers failed" if re.match(r"peers |\d+ peer", problem) else problem.split(":")[0]


def _s_scale(d: dict[str, Any]) -> Headline:
    """One clause per swarm size: runs, how many ended every round on one state, the lost share's span."""
    cases = _swarm_cases(d)
    parts = []
    for peers in sorted({c["peers"] for c in cases}):
        runs = [c for c in cases if c["peers"] == peers]
        ones = sum(_one_every_round(c) for c in runs)
        lost = _span([c["lost_share"] for c in runs], lambda x: f"{100 * x:.0f}%")
        text = f"{peers} peers (groups of {_span([c['group'] for c in runs], str)}): one state every round in {ones} "
        text += f"of {len(runs)} run{'s' * (len(runs) > 1)}, {lost} peer-rounds lost"
        bound = [c["median_bytes_over_bound"] for c in runs if _one_every_round(c)]
        if bound:
            text += f", {_span(bound, lambda x: f'{x:.3f}x')} the byte bound"
        failed = [_failure(c["problem"]) for c in runs if c.get("problem")]
        if failed:
            text += f" ({', '.join(sorted(set(failed)))})"
        parts.append(text)
    ones = [_one_every_round(c) for c in cases]
    met = "yes" if all(ones) else "no" if not any(ones) else f"{sum(ones)} of {len(ones)}"
    return "; ".join(parts), "1 state a round", met


SUMMARISERS: dict[str, Callable[[dict[str, Any]], Headline]] = {
    "inner": _s_inner,
    "allreduce": _s_allreduce,
    "utilisation": _s_utilisation,
    "comm_quality": _s_comm_quality,
    "memory": _s_memory,
    "netlab": _s_netlab,
    "compression_quality": _s_compression_quality,
    "codecs": _s_codecs,
    "sparse": _s_codecs,
    "stragglers": _s_stragglers,
    "join": _s_join,
    "staleness": _s_staleness,
    "threads": _s_threads,
    "one_state": _s_one_state,
    "scale": _s_scale,
}


def _dates(d: dict[str, Any]) -> str:
    """UTC day(s) the item ran: its finished stamp and those of runs merged into it (one level down), or the cases'
    utc stamps (one_state.json, scale.json)."""
    stamps = [d.get("finished")] + [v.get("finished") for v in d.values() if isinstance(v, dict)]
    if isinstance(d.get("cases"), dict):
        stamps += [c.get("utc") for c in d["cases"].values() if isinstance(c, dict)]
    days = sorted({s[:10] for s in stamps if isinstance(s, str)})
    return "-" if not days else days[0] if len(days) == 1 else f"{days[0]} to {days[-1][5:]}"


def summary_row(item: str, data: dict[str, Any] | None) -> list[str]:
    """One summary row: item, headline, target, met, run day(s)."""
    if data is None:
        return [SHORT.get(item, item), "not run", "-", "-", "-"]
    if not isinstance(data, dict):
        return [SHORT.get(item, item), "results file holds no JSON object: see the file", "-", "-", "-"]
    try:
        head, target, met = SUMMARISERS.get(item, _s_generic)(data)
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, ZeroDivisionError, AttributeError) as e:
        head = f"results present, not in the form this summary reads ({type(e).__name__}): see Detail"
        target, met = "-", "-"
    if data.get("smoke"):
        head = "**smoke run, not a measurement**: " + head
    return [SHORT.get(item, item), head.replace("|", "/"), target, met, _dates(data)]


def summary(found: dict[str, dict[str, Any] | None], root: Path = ROOT) -> list[str]:
    """The page's one-screen summary (markdown lines)."""
    lines = [
        "## Summary",
        "",
        "| item | headline, against its anchor | target | met | run (UTC) |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows = []
    for item, _ in ITEMS:
        if item == "gpu_swarm":
            continue
        if item == "gpu_inner":
            gpu = [(k, found.get(k)) for k in ("gpu_inner", "gpu_swarm") if found.get(k)]
            if not gpu:
                rows.append([SHORT["gpu"], "not run (needs one CUDA GPU: `bash scripts/bench/gpu.sh`)", "-", "-", "-"])
            rows += [summary_row(k, d) for k, d in gpu]
            continue
        rows.append(summary_row(item, found.get(item)))
    rows += [summary_row(item, found.get(item)) for item, _ in SWARM_ITEMS]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    note = (
        "Target: as the item's own results state it (13, 14: the question those items ask); met: how many of its "
        "cases reach it (- where none is set). Per-case figures, references and how each is measured: "
        "[Detail](#detail)."
    )
    plots = [p for p in PLOTS if (root / p).is_file()]
    if plots:
        note += (
            " Loss against bytes sent (scripts/paper_table.py's own simulator runs, not item 4's): "
            + ", ".join(f"[{Path(p).stem.replace('_', ' ')}]({p})" for p in plots)
            + "."
        )
    lines += [note, ""]
    return lines


def swarm_detail(found: dict[str, dict[str, Any] | None]) -> list[str]:
    """Items 13 and 14 (one_state.json, scale.json: cases without rows), one table line per case, notes below."""
    try:
        cases = [(title, c) for item, title in SWARM_ITEMS if found.get(item) for c in _swarm_cases(found[item])]
        return _swarm_table(found, cases) if cases else []
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return [f"Items 13 and 14: results present, not in the form this page reads ({type(e).__name__}).", ""]


def _first_line(text: str, limit: int = 300) -> str:
    """A note cut to its first line (a real or an escaped newline) and ``limit`` characters, saying so when cut."""
    line = re.split(r"\n|\\n", text, maxsplit=1)[0]
    if len(line) > limit:
        line = line[:limit].rsplit(" ", 1)[0]
    return line if line == text else f"{line} [...] (whole text in the result file)"


def _peer_memory(case: dict[str, Any]) -> str:
    """The machine's peak memory in use over a scale run, per peer ("-" where not measured), and how it was run when
    that changes it: identical pages merged (--merge-pages), peers per host process."""
    per_peer = (case.get("memory") or {}).get("machine_peak_per_peer_bytes")
    if not per_peer:
        return "-"
    how = [f"{case['per_process']} a process"] if case.get("per_process") else []
    how += ["pages merged"] if case.get("merge_pages") else []
    how += [f"GOGC {case['p2pd_gogc']}"] if case.get("p2pd_gogc") else []
    return fmt(per_peer, "B") + (f" ({', '.join(how)})" if how else "")


def _swarm_table(found: dict[str, dict[str, Any] | None], cases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "### Items 13 and 14, per case (one_state.json, scale.json)",
        "",
        "| item | case | peers, --group | rounds | states per round (most) | final states | peer-rounds lost "
        "| median bytes sent | CPU s a peer-round | machine memory a peer | date |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for title, c in cases:
        spr = max(c["states_per_round"].values(), default=0)
        over = f" ({c['median_bytes_over_bound']:.3f}x the bound)" if c.get("median_bytes_over_bound") else ""
        cells = [
            title,
            c["name"],
            f"{c['peers']}, {c['group']}",
            str(c["rounds"]),
            str(spr),
            str(c["final_states"]),
            f"{c['lost_peer_rounds']} of {c['peer_rounds_trained']} ({100 * c['lost_share']:.0f}%)",
            fmt(c["median_bytes_sent"], "B") + over,
            f"{c['cpu_per_peer_round']:.2f}" if c.get("cpu_per_peer_round") else "-",
            _peer_memory(c),
            str(c.get("utc", "-"))[:10],
        ]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
        case = f"- {c['name']} ({title.split('.')[0]}): "
        if c.get("problem"):  # machine text (a peer's whole error each): its first line; the rest is in the file
            notes.append(case + _first_line(c["problem"]))
        if c.get("note"):  # a person's words, whole
            notes.append(case + c["note"])
    smoke = [f"{k} ({t.split('.')[0]})" for item, t in SWARM_ITEMS for k in (found.get(item) or {}).get("cases", {})]
    smoke = [k for k in smoke if k.startswith("smoke")]
    if smoke:
        notes.append(
            f"- Left out here and in the summary: {', '.join(smoke)}, the harness's smoke check, not a measurement."
        )
    lines += ["", *notes, ""] if notes else [""]
    return lines


def render(results: Path) -> str:
    run_all = load(results, "run_all")
    found = {item: load(results, item) for item, _ in ITEMS + SWARM_ITEMS}
    first = next((d for d in found.values() if d), None)
    lines = ["# Benchmarks", ""]
    lines.append(
        "Generated by `python scripts/bench/run_all.py` (items 1-5; item 6 is `bash scripts/bench/gpu.sh` on a "
        "machine with one GPU; items 7 and 8 take hours in full and run on their own: `scripts/bench/netlab.py` "
        "as root, `scripts/bench/compression_quality.py`; item 9 is `scripts/bench/stragglers.py`, about 10 minutes; "
        "item 10 is `scripts/bench/join.py --netlab` as root, about "
        "4 minutes; item 11 is `scripts/bench/staleness.py`, about 25 minutes; item 12 is `scripts/bench/threads.py`, "
        "a few minutes; items 13 and 14 are `scripts/bench/one_state.py` and `scripts/bench/scale.py`; item 8b is "
        "`scripts/bench/compression_quality.py --codecs`, about 50 minutes; `render.py` "
        "rebuilds this page from the results, measuring nothing). Every "
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
    lines += summary(found)
    lines += ["## Detail", ""]
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
    lines += swarm_detail(found)
    lines.append("## How each figure is measured")
    lines.append("")
    for item, title in ITEMS:
        data = found[item]
        if data is None:
            continue
        script = "gpu.sh" if item.startswith("gpu") else SCRIPTS.get(item, f"{item}.py")
        lines.append(f"**{title}** (`scripts/bench/{script}`, {data['wall_seconds']:.0f} s)")
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

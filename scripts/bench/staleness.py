"""Item 11: the staleness rule for a straggler's delayed Δ, measured in the simulator at equal simulated time.

Usage:
    python scripts/bench/staleness.py                        # tiny, 3 workers, one 3x slower, 40 rounds, iid + by-label
    python scripts/bench/staleness.py --rounds 40 --slowdown 3 --partitions iid,by-label
    python scripts/bench/staleness.py --smoke [--out DIR/staleness.json]   # 3 rounds of 2 steps per case

With fixed H and one worker ``--slowdown`` times slower, nobody waits for it (simulate.py: a group forms as soon as
two workers are ready), so its Δ reaches a group ``slowdown - 1`` rounds late. Cases, each run_simulation on the
tiny preset with ``--workers`` workers for ``--rounds`` rounds of the fast workers (the same simulated seconds):
    equal speeds                  no straggler: the reference
    discarded (max_staleness S-1) the straggler's delayed Δ (S = round(slowdown) - 1 rounds late) never counts: it
                                  resyncs every time
    counted, decay A              max_staleness ``--max-staleness`` (at least S), its Δ at (1 + S) ** -A of its tokens,
                                  for each A of ``--decays``
    round_seconds                 time-budgeted rounds instead (inner.round_seconds = H / fast speed)
for each data partition of ``--partitions`` (by-label: each worker's shard holds other documents, so what the
straggler alone saw is lost when its Δ is). Reported per case: final eval loss (mean and per label), the ratio to
equal speeds, the straggler's contributed tokens and lost rounds.
Output: scripts/bench/results/staleness.json (``--out`` elsewhere; ``--smoke`` without ``--out``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Recorder, exit_on_sigterm, fill_defaults  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from p2p_diloco.config import load_config  # noqa: E402
from p2p_diloco.simulate import simulate  # noqa: E402

TINY = "configs/tiny.yaml"
DEFAULTS = {
    "workers": 3,
    "rounds": 40,
    "h": 25,
    "slowdown": 3.0,
    "max_staleness": 3,
    "decays": "0,0.5,1",
    "partitions": "iid,by-label",
}
SMOKE = {**DEFAULTS, "rounds": 3, "h": 2, "decays": "1", "partitions": "iid"}


def plan(args: argparse.Namespace) -> list[tuple[str, list[str], bool]]:
    """(label, overrides, whether the last worker is slow) per case. A straggler ``slowdown`` times slower reaches
    a group ``round(slowdown) - 1`` rounds behind; max_staleness one less discards its Δ."""
    late = max(1, round(args.slowdown) - 1)
    stale = f"swarm.max_staleness={max(late, args.max_staleness)}"
    cases = [
        ("equal speeds", [], False),
        (f"discarded (max_staleness {late - 1})", [f"swarm.max_staleness={late - 1}"], True),
    ]
    for decay in args.decays.split(","):
        cases.append((f"counted, decay {decay}", [stale, f"swarm.staleness_decay={decay}"], True))
    cases.append(("round_seconds", [f"inner.round_seconds={args.h}"], True))
    return cases


def run_case(sets: list[str], slow: bool, partition: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    overrides = [
        f"inner.steps={args.h}",
        f"train.rounds={args.rounds}",
        f"train.eval_every={args.rounds}",
        f"data.partition={partition}",
        *sets,
    ]
    cfg = load_config(TINY, overrides)
    speeds = [1.0] * (args.workers - 1) + [1.0 / args.slowdown if slow else 1.0]
    r = simulate(cfg, "diloco", args.workers, out, speeds=speeds)
    return {
        "overrides": overrides,
        "speeds": speeds,
        "eval_loss": r["final_eval_loss"],
        "eval_loss_per_label": r["final_eval_loss_per_label"],
        "simulated_seconds": r["simulated_seconds"],
        "contributed_tokens_per_worker": r["contributed_tokens_per_worker"],
        "lost_rounds_per_worker": r["lost_rounds_per_worker"],
        "wall_seconds": r["wall_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=None, help="simulated workers (3); the last is the slow one")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the fast workers (40)")
    p.add_argument("--h", type=int, default=None, help="inner steps per round (25, the preset's)")
    p.add_argument("--slowdown", type=float, default=None, help="how many times slower the slow worker is (3)")
    p.add_argument("--max-staleness", type=int, default=None, help="swarm.max_staleness of the counted cases (3)")
    p.add_argument("--decays", default=None, help="swarm.staleness_decay values, comma-separated (0,0.5,1)")
    p.add_argument("--partitions", default=None, help="data.partition values, comma-separated (iid,by-label)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/staleness.json)")
    p.add_argument("--smoke", action="store_true", help="seconds-long check of this script")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    rec = Recorder("staleness", vars(args), smoke=args.smoke)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench_stale_") as tmp:
        for partition in args.partitions.split(","):
            base = None
            for k, (label, sets, slow) in enumerate(plan(args)):
                print(f"staleness: {partition}, {label}", flush=True)
                c = {
                    "partition": partition,
                    "label": label,
                    **run_case(sets, slow, partition, args, Path(tmp) / f"{partition}{k}"),
                }
                cases.append(c)
                slow_k = args.workers - 1
                tokens, lost = c["contributed_tokens_per_worker"], c["lost_rounds_per_worker"]
                print(f"  eval loss {c['eval_loss']:.4f}  straggler tokens {tokens and tokens[slow_k]}", flush=True)
                if base is None:
                    base = c
                    continue
                rec.add(
                    figure=f"{partition}: {label}, worker {slow_k} {args.slowdown:g}x slower, vs equal speeds "
                    f"({c['simulated_seconds']:g} simulated s; straggler: "
                    + (f"{tokens[slow_k]:,} tokens counted, {lost[slow_k]} rounds lost)" if tokens else "budgeted)"),
                    value=c["eval_loss"],
                    unit="loss",
                    reference=base["label"],
                    reference_value=base["eval_loss"],
                    ratio=c["eval_loss"] / base["eval_loss"],
                    ratio_kind="eval loss ratio (lower is better)",
                )
    rec.data["cases"] = cases
    rec.notes.append(
        "Simulated (run_simulation's clock): equal simulated time, the same data, one seed. A straggler 3x slower "
        "reaches a group 2 rounds behind (fixed H, nobody waits), one 2x slower 1 round behind."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep the outer optimizer at equal tokens and write a table (issue 2, item 9).

Usage:
    python scripts/sweep_outer.py --config configs/tiny.yaml --out runs/sweep_tiny \
        --total-steps 1000 --h 25 100 --lr 0.4 0.7 1.0 --momentum 0.5 0.8 0.9 --warmup 0 5
    python scripts/sweep_outer.py --config configs/small.yaml --out runs/sweep_small --total-steps 400 \
        --h 25 --points 0.7:0.9:0 1.0:0.5:0 --set data.batch_size=4 --set data.seq_len=128

Every run uses --workers (4) workers and the same number of inner steps per worker (--total-steps), so
H x rounds is constant and every mode sees the same tokens. Baselines sync and single are run once;
fedavg and each DiLoCo point once per H. Results already present in OUT are reused (the sweep resumes).
Output: OUT/<name>/results.json per run, OUT/sweep.json and OUT/sweep.md (the table, sorted by loss).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path

from p2p_diloco.config import load_config
from p2p_diloco.simulate import simulate
from p2p_diloco.threads import apply_threads


def _run(name: str, config: str, mode: str, overrides: list[str], workers: int, out: Path) -> dict:
    target = out / name
    if (target / "results.json").is_file():
        return json.loads((target / "results.json").read_text())
    logging.getLogger("sweep").info("run %s", name)
    return simulate(load_config(config, overrides), mode, workers, target)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--total-steps", type=int, required=True, help="inner steps per worker, equal for every run")
    p.add_argument("--h", type=int, nargs="+", default=[25, 100])
    p.add_argument("--lr", type=float, nargs="*", default=[])
    p.add_argument("--momentum", type=float, nargs="*", default=[])
    p.add_argument("--warmup", type=int, nargs="*", default=[0], help="outer lr warmup rounds")
    p.add_argument("--points", nargs="*", default=[], help="explicit lr:momentum:warmup points")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (0: auto, threads.py)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.threads < 0:
        raise SystemExit(f"--threads {args.threads} is invalid: must be >= 0 (0: auto, from the cores available)")
    apply_threads(args.threads)  # the runs go one after the other, in this process
    points = [tuple(float(x) for x in s.split(":")) for s in args.points]
    points += list(itertools.product(args.lr, args.momentum, args.warmup))
    rows = []
    for h in args.h:
        if args.total_steps % h:
            raise SystemExit(f"--total-steps {args.total_steps} is not a multiple of H={h}")
        base = [
            *args.overrides,
            f"inner.steps={h}",
            f"train.rounds={args.total_steps // h}",
            f"train.eval_every={max(1, args.total_steps // h // 4)}",
        ]
        modes = [("fedavg", "fedavg", [])]
        if not args.skip_baselines and h == args.h[0]:
            modes += [("sync", "sync", []), ("single", "single", [])]
        for lr, momentum, warmup in points:
            modes.append(
                (
                    f"diloco lr={lr:g} m={momentum:g} warmup={int(warmup)}",
                    "diloco",
                    [f"outer.lr={lr}", f"outer.momentum={momentum}", f"outer.lr_warmup_rounds={int(warmup)}"],
                )
            )
        for label, mode, extra in modes:
            name = f"H{h}_{label}".replace(" ", "_").replace("=", "")
            res = _run(name, args.config, mode, base + extra, args.workers, args.out)
            rows.append(
                {
                    "H": h if mode not in ("sync", "single") else "-",
                    "run": label,
                    "final_eval_loss": res["final_eval_loss"],
                    "wall_seconds": res["wall_seconds"],
                    "tokens_per_worker": res["tokens_per_worker"],
                    "bytes_sent_per_worker": res["bytes_sent_per_worker"],
                }
            )
            (args.out / "sweep.json").write_text(json.dumps(rows, indent=2))
    lines = ["| H | run | final eval loss | wall s | tokens/worker | MB sent/worker |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["final_eval_loss"]):
        lines.append(
            f"| {r['H']} | {r['run']} | {r['final_eval_loss']:.4f} | {r['wall_seconds']:.0f} | "
            f"{r['tokens_per_worker']} | {r['bytes_sent_per_worker'] / 1e6:.1f} |"
        )
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

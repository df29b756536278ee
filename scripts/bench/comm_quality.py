"""Item 4: bytes each worker sends to reach a target eval loss, DiLoCo at several H against synchronous training.

Usage:
    python scripts/bench/comm_quality.py [--total-steps 300] [--h 10 50 100] [--workers 4] [--jobs 2]
    python scripts/bench/comm_quality.py --smoke [--out DIR/comm_quality.json]   # 2 workers, 4 steps, H=2

Runs ``p2p_diloco.simulate.simulate`` (the numerical reference of the swarm) on configs/tiny.yaml with
``--workers`` workers at equal tokens: every run takes ``--total-steps`` inner steps per worker (DiLoCo:
rounds = total / H; sync: synchronous data-parallel, one gradient all-reduce per step, ``--sync-h`` steps
per round). The eval loss is measured after every round (``data.eval_batches`` raised for a steadier
estimate). Bytes are the simulator's ``bytes_sent`` per round (what one worker sends in an fp32 butterfly
all-reduce: 2(n-1)/n x 4 B x params per all-reduce), summed up to the first round whose eval loss is at or
below the target.
Targets: (1) the sync baseline's final eval loss + 2% (the issue's threshold); (2) the highest final loss
of all runs, so that every run reaches it and the bytes can be compared even when (1) is out of reach.
Runs are deterministic (seeded) and independent of the machine's speed, so they run ``--jobs`` at a time.
Output: scripts/bench/results/comm_quality.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``: a
temporary directory). Failure: a simulation that raises fails the whole item (non-zero exit, no result file).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Recorder, exit_on_sigterm, fill_defaults, read_jsonl  # noqa: E402

DEFAULTS: dict[str, Any] = {"workers": 4, "total_steps": 300, "h": [10, 50, 100], "sync_h": 10, "eval_batches": 16}
SMOKE: dict[str, Any] = {
    "workers": 2,
    "total_steps": 4,
    "h": [2],
    "sync_h": 2,
    "eval_batches": 1,
    "overrides": ["data.batch_size=2", "data.seq_len=32"],
}


def _simulate(name: str, config: str, mode: str, workers: int, overrides: list[str], out: str) -> dict[str, Any]:
    """One simulation in a fresh single-threaded process; returns results.json plus the per-round records."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from p2p_diloco.config import load_config
    from p2p_diloco.simulate import simulate

    target = Path(out) / name
    results = simulate(load_config(ROOT / config, overrides), mode, workers, target)
    return {"name": name, "results": results, "records": read_jsonl(target / "metrics.jsonl")}


def crossing(run: dict[str, Any], threshold: float) -> dict[str, Any] | None:
    """Bytes, tokens and round at the first evaluation at or below ``threshold`` (None: never)."""
    initial = float(run["results"]["eval_loss_per_round"]["0"])
    if initial <= threshold:
        return {"round": 0, "bytes": 0, "tokens": 0, "loss": initial}
    sent = 0
    for r in run["records"]:
        sent += int(r["bytes_sent"])
        loss = r.get("eval_loss")
        if loss is not None and loss <= threshold:
            return {"round": r["outer_step"], "bytes": sent, "tokens": r["tokens_per_worker"], "loss": loss}
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--workers", type=int, default=None, help="simulated workers (4)")
    p.add_argument("--total-steps", type=int, default=None, help="inner steps per worker, equal for every run (300)")
    p.add_argument("--h", type=int, nargs="+", default=None, help="DiLoCo inner steps per round (10 50 100)")
    p.add_argument("--sync-h", type=int, default=None, help="sync steps per round (= evaluation interval; 10)")
    p.add_argument("--eval-batches", type=int, default=None, help="eval batches per evaluation (16)")
    p.add_argument("--margin", type=float, default=0.02, help="target = sync final loss x (1 + margin)")
    p.add_argument("--jobs", type=int, default=2, help="simulations run at once (each single-threaded)")
    p.add_argument("--set", dest="overrides", action="append", default=None, help="config override k=v (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/comm_quality.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), {**DEFAULTS, "overrides": []}, SMOKE)
    exit_on_sigterm()
    for h in [*args.h, args.sync_h]:
        if args.total_steps % h:
            raise SystemExit(f"--total-steps {args.total_steps} is not a multiple of {h}")
    rec = Recorder("comm_quality", vars(args), smoke=args.smoke)
    common = [
        "swarm.compression=none",  # DiLoCo's H against sync, both in fp32 (the codecs are compression_quality.py's)
        *args.overrides,
        "train.eval_every=1",
        "train.checkpoint_every=0",
        f"data.eval_batches={args.eval_batches}",
    ]
    plan = [("sync", "sync", args.sync_h)] + [(f"diloco_h{h}", "diloco", h) for h in args.h]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_cq_") as tmp:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {
                name: pool.submit(
                    _simulate,
                    name,
                    args.config,
                    mode,
                    args.workers,
                    [*common, f"inner.steps={h}", f"train.rounds={args.total_steps // h}"],
                    tmp,
                )
                for name, mode, h in plan
            }
            for name, fut in futures.items():
                runs[name] = fut.result()
                r = runs[name]["results"]
                print(
                    f"comm_quality: {name}: final eval loss {r['final_eval_loss']:.4f}, "
                    f"{r['bytes_sent_per_worker'] / 1e6:.1f} MB sent per worker, {r['wall_seconds']:.0f}s",
                    flush=True,
                )
    sync = runs["sync"]
    target = sync["results"]["final_eval_loss"] * (1 + args.margin)
    common_target = max(run["results"]["final_eval_loss"] for run in runs.values())
    sync_x = crossing(sync, target)
    sync_c = crossing(sync, common_target)
    summary: dict[str, Any] = {"target": target, "common_target": common_target, "runs": {}}
    for name, mode, h in plan:
        run = runs[name]
        res = run["results"]
        summary["runs"][name] = {
            "mode": mode,
            "h": h,
            "final_eval_loss": res["final_eval_loss"],
            "bytes_sent_per_worker": res["bytes_sent_per_worker"],
            "tokens_per_worker": res["tokens_per_worker"],
            "eval_loss_per_round": res["eval_loss_per_round"],
            "target_crossing": crossing(run, target),
            "common_crossing": crossing(run, common_target),
        }
    for name, mode, h in plan:
        if mode != "diloco":
            continue
        s = summary["runs"][name]
        x, c = s["target_crossing"], s["common_crossing"]
        gap = 100 * (s["final_eval_loss"] / sync["results"]["final_eval_loss"] - 1)
        if x is None:
            fig = (
                f"DiLoCo H={h}: bytes/worker to reach sync final loss +{100 * args.margin:g}% ({target:.3f}): "
                f"NOT REACHED in {args.total_steps} steps (final {s['final_eval_loss']:.3f}, {gap:+.1f}% vs sync)"
            )
        else:
            fig = (
                f"DiLoCo H={h}: bytes/worker to reach sync final loss +{100 * args.margin:g}% ({target:.3f}), "
                f"at round {x['round']} ({x['tokens']:,} tokens/worker; final {gap:+.1f}% vs sync)"
            )
        rec.add(
            figure=fig,
            value=None if x is None else x["bytes"],
            unit="B",
            reference=f"sync data-parallel to the same loss (step {sync_x['round'] * args.sync_h if sync_x else '-'})",
            reference_value=None if sync_x is None else sync_x["bytes"],
            ratio=None if x is None or sync_x is None or x["bytes"] == 0 else sync_x["bytes"] / x["bytes"],
            ratio_kind=f"x fewer bytes (expected about H = {h})",
            group="target",
        )
    for name, mode, h in plan:
        if mode != "diloco":
            continue
        c = summary["runs"][name]["common_crossing"]
        rec.add(
            figure=f"DiLoCo H={h}: bytes/worker to reach {common_target:.3f} (the highest final loss of all runs)"
            + ("" if c is None else f", at round {c['round']} ({c['tokens']:,} tokens/worker)"),
            value=None if c is None else c["bytes"],
            unit="B",
            reference=f"sync data-parallel to the same loss (step {sync_c['round'] * args.sync_h if sync_c else '-'})",
            reference_value=None if sync_c is None else sync_c["bytes"],
            ratio=None if c is None or sync_c is None or c["bytes"] == 0 else sync_c["bytes"] / c["bytes"],
            ratio_kind=f"x fewer bytes (expected about H = {h})",
            group="common",
        )
    rec.data["summary"] = summary
    rec.notes.append(
        f"{args.workers} workers, {args.config}, {args.total_steps} inner steps per worker for every run (equal "
        f"tokens), eval loss after every round on {args.eval_batches} eval batches; sync = synchronous "
        f"data-parallel AdamW on the mean gradient of the {args.workers} shards. Bytes are the fp32 butterfly "
        "payload per worker as the simulator counts it (what the swarm's all-reduce would move)."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run benchmark items 1-5 on this machine, then rewrite BENCHMARKS.md.

Usage (from the repository root, in the project's virtual environment):
    python scripts/bench/run_all.py                 # every item, about 15-20 minutes on 2 idle cores
    python scripts/bench/run_all.py --only inner memory
    python scripts/bench/run_all.py --render-only   # re-render BENCHMARKS.md from scripts/bench/results/
    python scripts/bench/run_all.py --smoke [--only inner] [--results DIR]   # every item's --smoke, into DIR

Each item is its own module (scripts/bench/{inner,allreduce,utilisation,comm_quality,memory}.py), run here as a
separate process one after the other (never two at once: they would slow each other down), each writing
scripts/bench/results/<item>.json. A module that fails or exceeds ``--item-timeout`` is killed (its whole
process group) and listed as failed; the others still run. Then render.py writes BENCHMARKS.md. This file
writes results/run_all.json: total runtime, per-item seconds and exit codes, and the load average sampled
every 5 s during the run (the machine may be shared). Item 6 (GPU) is scripts/bench/gpu.sh.

``--results DIR`` puts the item files and run_all.json in DIR and BENCHMARKS.md beside them (``--markdown`` to
choose); by default they are scripts/bench/results/ and the repository's BENCHMARKS.md. ``--smoke`` runs every
item's own ``--smoke`` (seconds each) into a fresh temporary directory unless ``--results`` is given: a smoke run
never touches results/ or BENCHMARKS.md. Exit code 1 when an item failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import BENCH_DIR, RESULTS_DIR, ROOT, Proc, Recorder, single_thread_env  # noqa: E402

ITEMS = ["inner", "allreduce", "utilisation", "comm_quality", "memory"]


def run_item(item: str, extra: list[str], timeout: float) -> dict[str, Any]:
    """Run one module, echoing its output; returns its exit code and seconds (rc None: killed at timeout)."""
    env = single_thread_env(threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.monotonic()
    proc = Proc([sys.executable, str(BENCH_DIR / f"{item}.py"), *extra], env=env)
    rc: int | None = None
    try:
        while True:
            line = proc.next_line(1.0)
            if line is not None:
                print(f"[{item}] {line}", flush=True)
            elif not proc.alive():
                rc = proc.wait(timeout=10)
                break
            if time.monotonic() - t0 > timeout:
                print(f"[{item}] exceeded {timeout:.0f}s: stopped", flush=True)
                break
    finally:
        proc.stop(grace=20.0)  # SIGTERM: the module kills the swarms it started; SIGKILL after 20 s
    if rc not in (0, None):
        print(f"[{item}] exit code {rc}\n{proc.describe(20)}", flush=True)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=ITEMS, default=None, help="run these items only")
    p.add_argument("--render-only", action="store_true")
    p.add_argument(
        "--item-timeout", type=float, default=None, help="seconds before an item is stopped (900; smoke 150)"
    )
    p.add_argument("--results", type=Path, default=None, help="directory for the result files (results/)")
    p.add_argument("--markdown", type=Path, default=None, help="rendered table (BENCHMARKS.md, or DIR's own)")
    p.add_argument("--smoke", action="store_true", help="every item's --smoke, into a temporary directory")
    args = p.parse_args(argv)
    import render

    results = args.results or (Path(tempfile.mkdtemp(prefix="bench_smoke_run_all_")) if args.smoke else RESULTS_DIR)
    markdown = args.markdown or (ROOT / "BENCHMARKS.md" if args.results is None and not args.smoke else None)
    markdown = markdown or results / "BENCHMARKS.md"
    render_args = ["--results", str(results), "--out", str(markdown)]
    if args.render_only:
        return render.main(render_args)
    timeout = args.item_timeout or (150.0 if args.smoke else 900.0)
    items = args.only or ITEMS
    rec = Recorder("run_all", {"items": items, "results": str(results)}, smoke=args.smoke)
    loads: list[float] = []
    stop = threading.Event()

    def sample_load() -> None:
        while not stop.is_set():
            loads.append(os.getloadavg()[0])
            stop.wait(5.0)

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    per_item = {}
    try:
        for item in items:
            print(f"=== {item}", flush=True)
            extra = ["--out", str(results / f"{item}.json"), *(["--smoke"] if args.smoke else [])]
            per_item[item] = run_item(item, extra, timeout)
    finally:
        stop.set()
        sampler.join(timeout=6)
    failed = [item for item, r in per_item.items() if r["rc"] != 0]
    rec.data.update(
        {
            "items": per_item,
            "failed": failed,
            "load_min": min(loads) if loads else None,
            "load_max": max(loads) if loads else None,
            "load_mean": sum(loads) / len(loads) if loads else None,
        }
    )
    path = rec.write(results / "run_all.json")
    print(f"wrote {path}; total {sum(r['seconds'] for r in per_item.values()):.0f}s")
    render.main(render_args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Item 1: tokens/s of run_peer's inner loop against a bare PyTorch AdamW loop, same model, batch and device.

Usage:
    python scripts/bench/inner.py                       # tiny + small (small with a CPU-sized batch)
    python scripts/bench/inner.py --case small:configs/small.yaml --device cuda --steps 50 --pairs 7
    python scripts/bench/inner.py --smoke [--out DIR/inner.json]   # tiny at batch 2 x 32, 2 pairs of 2 steps

A = ``Worker.train_inner`` (``InnerOptimizer.run``: the code run_peer runs, batches drawn from the data
pipeline's shard iterator, lr schedule, clipping, ``loss.item()`` per step, an ``on_step`` callback that
checks a stop flag as run_peer's does). B = the bare loop a user would write: forward, backward, the same
clipping, ``optimizer.step()``, ``zero_grad``, the same autocast, batches of the same shape already on the
device, no per-step host sync, no schedule. B drives the SAME model and the same torch AdamW object as A
(two separate model instances differed by a few percent in speed on CPU whichever loop drove them, which
would have been measured as loop overhead). Blocks of ``--steps`` steps run A/B, B/A, A/B, ...
(``--pairs`` pairs after one warm-up block each); each pair gives a ratio A/B of tokens/s and the table
shows the median ratio. On CUDA it also reports MFU and peak memory of each side.
Output: scripts/bench/results/inner.json (``--out`` to write elsewhere; a ``--smoke`` run without ``--out`` writes
to a temporary directory and prints the path). Failure: an exception (non-zero exit) if a case cannot run.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Recorder, exit_on_sigterm, fill_defaults, median  # noqa: E402

DEFAULT_CASES = [
    "tiny:configs/tiny.yaml",
    "small:configs/small.yaml:data.batch_size=2,data.seq_len=64",
]
SMOKE = {"case": ["tiny:configs/tiny.yaml:data.batch_size=2,data.seq_len=32"], "steps": 2, "pairs": 2}
# dense bf16 peak FLOP/s by GPU name fragment (vendor datasheets); BENCH_PEAK_TFLOPS overrides
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def peak_flops(device: Any) -> float | None:
    env = os.environ.get("BENCH_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def flops_per_token(model: Any, seq_len: int) -> float:
    """6 N (N without the input embedding) + 12 L d T for attention (the PaLM appendix formula)."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def run_case(name: str, config: str, sets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from p2p_diloco.config import load_config
    from p2p_diloco.data import DataPipeline
    from p2p_diloco.engine import Worker
    from p2p_diloco.model import autocast

    overrides = [*sets, f"inner.steps={args.steps}", f"model.device={args.device}"]
    cfg = load_config(ROOT / config, overrides)
    data = DataPipeline(cfg.data, cfg.seed)
    worker = Worker(cfg, data.vocab_size, data.train_batches(0, cfg.seed))
    device = worker.device
    bare, opt, i = worker.model, worker.inner.optimizer, cfg.inner  # plain torch.nn.Module and torch.optim.AdamW
    source = data.train_batches(1, cfg.seed)
    batches = [next(source).to(device) for _ in range(16)]
    stop = threading.Event()

    def on_step(k: int, loss: float) -> None:  # what run_peer's callback does without a progress bar
        if stop.is_set():
            raise KeyboardInterrupt

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def side_a() -> tuple[float, float, int, int]:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        stats = worker.train_inner(on_step)
        sync()
        mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return time.perf_counter() - t0, time.process_time() - c0, stats.tokens, mem

    def side_b() -> tuple[float, float, int, int]:
        bare.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0, c0, tokens = time.perf_counter(), time.process_time(), 0
        for k in range(args.steps):
            batch = batches[k % len(batches)]
            with autocast(device, cfg.model):
                loss = bare(input_ids=batch, labels=batch).loss
            loss.backward()
            if i.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(bare.parameters(), i.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += batch.numel()
        sync()
        mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return time.perf_counter() - t0, time.process_time() - c0, tokens, mem

    side_a()
    side_b()  # warm-up: allocator, kernels, optimizer state
    pairs = []
    for k in range(args.pairs):
        order = ("a", "b") if k % 2 == 0 else ("b", "a")
        got = {s: (side_a() if s == "a" else side_b()) for s in order}
        (ta, ca, na, ma), (tb, cb, nb, mb) = got["a"], got["b"]
        pairs.append(
            {
                "a_tps": na / ta,
                "b_tps": nb / tb,
                "wall_ratio": (na / ta) / (nb / tb),
                "a_cpu_tps": na / ca,
                "b_cpu_tps": nb / cb,
                "cpu_ratio": (na / ca) / (nb / cb),
                "a_mem": ma,
                "b_mem": mb,
            }
        )
        print(
            f"  {name} pair {k}: run_peer loop {na / ta:,.0f} tok/s ({na / ca:,.0f} per CPU-s), bare "
            f"{nb / tb:,.0f} tok/s ({nb / cb:,.0f} per CPU-s), ratio wall {pairs[-1]['wall_ratio']:.3f} "
            f"CPU {pairs[-1]['cpu_ratio']:.3f}",
            flush=True,
        )
    # on CPU the headline uses CPU time (tokens per CPU-second of this process): on a shared machine the
    # wall clock also measures how much of a core the scheduler gave us; on CUDA the wall clock is the figure
    key = "wall" if device.type == "cuda" else "cpu"
    a_tps = median(p["a_tps" if key == "wall" else "a_cpu_tps"] for p in pairs)
    b_tps = median(p["b_tps" if key == "wall" else "b_cpu_tps"] for p in pairs)
    fpt = flops_per_token(bare, cfg.data.seq_len)
    peak = peak_flops(device)
    return {
        "case": name,
        "config": config,
        "overrides": sets,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "params": worker.num_params,
        "optimizer": type(opt).__name__,
        "batch": [cfg.data.batch_size, cfg.data.seq_len],
        "steps_per_block": args.steps,
        "pairs": pairs,
        "clock": key,
        "median_ratio": median(p[f"{key}_ratio"] for p in pairs),
        "min_ratio": min(p[f"{key}_ratio"] for p in pairs),
        "max_ratio": max(p[f"{key}_ratio"] for p in pairs),
        "median_wall_ratio": median(p["wall_ratio"] for p in pairs),
        "median_cpu_ratio": median(p["cpu_ratio"] for p in pairs),
        "a_tokens_per_second": a_tps,
        "b_tokens_per_second": b_tps,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "a_mfu": a_tps * fpt / peak if peak and key == "wall" else None,
        "b_mfu": b_tps * fpt / peak if peak and key == "wall" else None,
        "a_peak_memory_bytes": max(p["a_mem"] for p in pairs),
        "b_peak_memory_bytes": max(p["b_mem"] for p in pairs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--case",
        action="append",
        default=None,
        help="name:config[:k=v,k=v] (repeatable; default: tiny, and small with batch 2 x 64 for CPU)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="inner steps per block (default: CPU tiny 10, small 3; CUDA 50)"
    )
    p.add_argument("--pairs", type=int, default=None, help="A/B pairs after the warm-up (median ratio reported; 16)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared machine)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/inner.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), {"case": DEFAULT_CASES, "pairs": 16}, SMOKE)
    exit_on_sigterm()
    import torch

    torch.set_num_threads(args.threads)
    cases = args.case
    rec = Recorder("inner" if args.device == "cpu" else "gpu_inner", vars(args), smoke=args.smoke)
    results = []
    for spec in cases:
        name, config, *rest = spec.split(":")
        sets = [s for s in (rest[0].split(",") if rest else []) if s]
        # short blocks, many pairs: A and B see nearly the same machine state; fixed costs per block are tiny
        steps_default = 50 if args.device.startswith("cuda") else (10 if "tiny" in config else 3)
        case_args = argparse.Namespace(**{**vars(args), "steps": args.steps or steps_default})
        print(f"inner: {name} ({config} {' '.join(sets)}), {case_args.steps} steps per block", flush=True)
        r = run_case(name, config, sets, case_args)
        results.append(r)
        batch = f"batch {r['batch'][0]}x{r['batch'][1]}"
        extra = ""
        if r["a_mfu"] is not None:
            extra = f", MFU {100 * r['a_mfu']:.1f}% vs {100 * r['b_mfu']:.1f}%"
        if r["device"].startswith("cuda"):
            a_gib, b_gib = r["a_peak_memory_bytes"] / 2**30, r["b_peak_memory_bytes"] / 2**30
            extra += f", peak GPU memory {a_gib:.2f} vs {b_gib:.2f} GiB"
        rec.add(
            figure=f"{name} ({r['params'] / 1e6:.2f}M params, {batch}, {r['device']}, {r['threads']} thread"
            f"{'s' if r['threads'] > 1 else ''}): inner-loop tokens/s{extra} (wall-clock ratio "
            f"{r['median_wall_ratio']:.3f})",
            value=r["a_tokens_per_second"],
            unit="tok/CPU-s" if r["clock"] == "cpu" else "tok/s",
            reference="bare PyTorch AdamW loop, same model/batch/device",
            reference_value=r["b_tokens_per_second"],
            ratio=r["median_ratio"],
            ratio_kind=f"median of {len(r['pairs'])} A/B pairs, {r['clock']} clock (target >= 0.98)",
            ratio_range=[r["min_ratio"], r["max_ratio"]],
        )
    rec.data["cases"] = results
    rec.notes.append(
        "A/B blocks alternate (A,B then B,A ...); each pair's ratio uses back-to-back blocks, so slow drifts of the "
        "shared machine's load cancel; tokens/s columns are medians over the pairs. On CPU the ratio uses tokens per "
        "CPU-second of the (single-threaded) process, because wall-clock tokens/s on a shared 2-core machine mostly "
        "measures the scheduler; the wall-clock ratio is given beside it."
    )
    path = rec.write(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

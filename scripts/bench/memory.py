"""Item 5: peak memory of a training peer (its whole process tree) against plain training of the same model.

Usage:
    python scripts/bench/memory.py [--case small:configs/small.yaml:data.batch_size=2,data.seq_len=64] [--rounds 3]
    python scripts/bench/memory.py --smoke [--out DIR/memory.json]   # tiny, 2 rounds of H=2, 2 plain steps

Reference: a process (this file with ``--plain``) that trains the same model on the same batch shape with a
bare AdamW loop (as in inner.py) for ``--steps`` steps; its VmHWM (peak resident set) from /proc.
Peer: a 2-peer swarm of ``run_peer`` processes (so the all-reduce really runs) for ``--rounds`` rounds of H
steps; peer 0's process tree is sampled every 0.2 s: per process VmHWM / VmRSS (/proc/<pid>/status) and
Pss (/proc/<pid>/smaps_rollup; shared pages split between the processes that map them). Roles: the
run_peer host process (model, AdamW, outer state, pseudo-gradients), the DHT process (forked child), its
p2pd daemon (Go), the averager process (forked child holding the shared-memory buffers).
Figures: the tree's peak = sum of the processes' VmHWM (an upper bound: pages shared between the host and
its forked children count twice) and the peak of the sampled sum of Pss (no double counting; a short spike
between two samples can be missed); extra bytes per parameter = (tree peak - plain peak) / parameters.
GPU memory: on a CUDA machine gpu.sh reports torch's peak allocation; this module measures host memory.
Output: scripts/bench/results/memory.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``: a
temporary directory). Failure: the plain reference not reporting within ``--timeout`` raises (non-zero exit); a
swarm peer that exits non-zero or outlives ``--timeout`` is killed (every process group) and noted as ``problem``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    ROOT,
    Proc,
    Recorder,
    descendants,
    exit_on_sigterm,
    fill_defaults,
    proc_memory,
    single_thread_env,
    start_swarm,
)

DEFAULT_CASE = "small:configs/small.yaml:data.batch_size=2,data.seq_len=64"
DEFAULTS: dict[str, Any] = {"case": DEFAULT_CASE, "h": 10, "rounds": 3, "steps": 20, "timeout": 300.0}
SMOKE: dict[str, Any] = {
    "case": "tiny:configs/tiny.yaml:data.batch_size=2,data.seq_len=32",
    "h": 2,
    "rounds": 2,
    "steps": 2,
    "timeout": 120.0,
}


def plain(config: str, sets: list[str], steps: int) -> None:
    """The reference: bare AdamW training of the same model; prints its own VmHWM at the end."""
    import torch

    torch.set_num_threads(1)
    from p2p_diloco.config import load_config
    from p2p_diloco.data import DataPipeline
    from p2p_diloco.model import build_model, count_params

    cfg = load_config(ROOT / config, sets)
    data = DataPipeline(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.vocab_size, cfg.seed)
    i = cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=i.lr, betas=tuple(i.betas), weight_decay=i.weight_decay)
    batches = data.train_batches(0, cfg.seed)
    for _ in range(steps):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    mem = proc_memory(os.getpid()) or {}
    print("PLAIN " + json.dumps({"params": count_params(model), **mem}), flush=True)


class TreeSampler:
    """Samples a process tree's memory every ``period`` seconds in a thread; keeps per-process maxima."""

    def __init__(self, root: int, period: float = 0.2) -> None:
        self.root, self.period = root, period
        self.procs: dict[int, dict[str, Any]] = {}
        self.peak_pss_sum = 0
        self.peak_rss_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = [(self.root, 0, "run_peer")] + descendants(self.root)
            pss_sum = rss_sum = 0
            for pid, parent, name in tree:
                mem = proc_memory(pid)
                if mem is None:
                    continue
                entry = self.procs.get(pid)
                if entry is None or entry["name"] != name:
                    # A new process, or one that exec'd since the last sample (hivemind forks p2pd from python,
                    # then execs it): exec starts a new address space, so the pre-exec maxima are dropped.
                    entry = self.procs[pid] = {"pid": pid, "parent": parent, "name": name}
                entry["VmHWM"] = max(entry.get("VmHWM", 0), mem.get("VmHWM", 0))
                entry["peak_Pss"] = max(entry.get("peak_Pss", 0), mem.get("Pss", 0))
                entry["peak_VmRSS"] = max(entry.get("peak_VmRSS", 0), mem.get("VmRSS", 0))
                pss_sum += mem.get("Pss", 0)
                rss_sum += mem.get("VmRSS", 0)
            self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
            self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
            self._stop.wait(self.period)

    def roles(self) -> dict[str, dict[str, int]]:
        """Group the sampled processes: host, dht, p2pd, averager, other."""
        p2pd_parents = {e["parent"] for e in self.procs.values() if e["name"] == "p2pd"}
        out: dict[str, dict[str, int]] = {}
        for e in self.procs.values():
            if e["pid"] == self.root:
                role = "host (run_peer)"
            elif e["name"] == "p2pd":
                role = "p2pd"
            elif e["pid"] in p2pd_parents:
                role = "dht process"
            elif e["parent"] == self.root and e["name"].startswith("python"):
                role = "averager process"
            else:
                role = f"other ({e['name']})"
            acc = out.setdefault(role, {"processes": 0, "VmHWM": 0, "peak_Pss": 0})
            acc["processes"] += 1
            acc["VmHWM"] += e.get("VmHWM", 0)
            acc["peak_Pss"] += e.get("peak_Pss", 0)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=f"name:config[:k=v,k=v] ({DEFAULT_CASE})")
    p.add_argument("--h", type=int, default=None, help="inner steps per round of the swarm (10)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the swarm (3)")
    p.add_argument("--steps", type=int, default=None, help="steps of the plain reference (20)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed for each of the two runs (300)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/memory.json)")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    name, config, *rest = args.case.split(":")
    sets = [s for s in (rest[0].split(",") if rest else []) if s]
    if args.plain:
        plain(config, sets, args.steps)
        return 0

    rec = Recorder("memory", vars(args), smoke=args.smoke)
    me = str(Path(__file__).resolve())
    ref = Proc(
        [sys.executable, me, "--plain", "--case", args.case, "--steps", str(args.steps)], env=single_thread_env()
    )
    ref_sampler = TreeSampler(ref.pid)
    ref_sampler.start()
    try:
        plain_mem = json.loads(ref.wait_for_line(r"^PLAIN ", timeout=args.timeout).string.split(" ", 1)[1])
        ref.wait(timeout=30)
    finally:
        ref_sampler.stop()
        ref.kill_group()
    plain_mem["peak_Pss"] = max(ref_sampler.peak_pss_sum, plain_mem.get("Pss", 0))
    print(f"memory: plain training peak RSS {plain_mem['VmHWM'] / 2**20:.0f} MiB", flush=True)

    overrides = [
        *sets,
        f"inner.steps={args.h}",
        f"train.rounds={args.rounds}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "logging.progress_bar=false",
        "data.num_shards=2",
        f"swarm.run_id=mem{uuid.uuid4().hex[:8]}",
        "swarm.target_group_size=2",
        "swarm.min_group_size=2",
        "swarm.start_peers=2",  # round 1 once both are up: a peer alone trains locally, and a smoke run is short
        "swarm.matchmaking_time=30",
        "swarm.request_timeout=5",
        "swarm.allreduce_timeout=120",
        "swarm.next_chunk_timeout=30",
        "swarm.round_deadline=600",
        "swarm.linger_seconds=2",
    ]
    with tempfile.TemporaryDirectory(prefix="bench_mem_") as tmp:
        dirs = [Path(tmp) / f"peer{k}" for k in range(2)]
        boot, peers = start_swarm(config, overrides, dirs, [[f"data.shard_index={k}"] for k in range(2)])
        sampler = TreeSampler(peers[0].pid)
        sampler.start()
        problem = ""
        try:
            for k, proc in enumerate(peers):
                rc = proc.wait(timeout=args.timeout)
                if rc != 0:
                    problem = f"peer {k} exited with {rc}: {proc.describe(10)}"
        except Exception as exc:  # noqa: BLE001 - subprocess.TimeoutExpired
            problem = f"timeout: {exc}"
        finally:
            sampler.stop()
            for proc in [*peers, boot]:
                proc.kill_group()
        metrics = (
            [json.loads(x) for x in (dirs[0] / "metrics.jsonl").read_text().splitlines()]
            if (dirs[0] / "metrics.jsonl").exists()
            else []
        )
    roles = sampler.roles()
    params = plain_mem["params"]
    tree_hwm = sum(r["VmHWM"] for r in roles.values())
    host_hwm = roles.get("host (run_peer)", {}).get("VmHWM", 0)
    ref_hwm, ref_pss = plain_mem["VmHWM"], plain_mem["peak_Pss"]
    for label, value, ref_label, ref_value in (
        ("whole tree, sum of per-process VmHWM", tree_hwm, "VmHWM", ref_hwm),
        ("whole tree, peak of sampled sum of Pss", sampler.peak_pss_sum, "peak Pss", ref_pss),
        ("host process alone, VmHWM", host_hwm, "VmHWM", ref_hwm),
    ):
        rec.add(
            figure=f"{name} ({params / 1e6:.1f}M params) peer peak memory, {label}: "
            f"+{(value - ref_value) / params:.1f} B/param"
            + (" (fixed per-process costs included)" if label.startswith("whole tree") else ""),
            value=value,
            unit="B",
            reference=f"plain training process (bare AdamW loop), {ref_label}",
            reference_value=ref_value,
            ratio=value / ref_value,
            ratio_kind="x the plain peak (lower is better)",
            extra_bytes_per_param=(value - ref_value) / params,
        )
    shares = {role: {**r, "share_of_tree": r["VmHWM"] / tree_hwm if tree_hwm else None} for role, r in roles.items()}
    rec.add(
        figure="share of the peer tree's peak (VmHWM) by process: "
        + ", ".join(f"{role} {100 * s['share_of_tree']:.0f}%" for role, s in shares.items() if s["share_of_tree"]),
        value=tree_hwm - host_hwm,
        unit="B",
        reference="whole peer tree, sum of VmHWM",
        reference_value=tree_hwm,
        ratio=(tree_hwm - host_hwm) / tree_hwm if tree_hwm else None,
        ratio_kind="share outside the host process (DHT + p2pd + averager)",
    )
    rec.data.update(
        {
            "params": params,
            "plain": plain_mem,
            "roles": shares,
            "processes": list(sampler.procs.values()),
            "peak_pss_sum": sampler.peak_pss_sum,
            "peak_rss_sum": sampler.peak_rss_sum,
            "problem": problem,
            "rounds_done": len(metrics),
            "group_sizes": [m["group_size"] for m in metrics],
        }
    )
    rec.notes.append(
        f"Swarm of 2 run_peer processes, {args.rounds} rounds of H={args.h}, batch from {args.case}; peer 0's tree "
        "sampled every 0.2 s. Plain reference: one process, same model and batch, bare AdamW loop. Host memory "
        "only (CPU run); GPU memory is reported by gpu.sh on a CUDA machine."
    )
    if problem:
        rec.notes.append(f"problem: {problem[:500]}")
    path = rec.write(args.out)
    print(f"wrote {path}")
    for role, s in shares.items():
        print(f"  {role}: VmHWM {s['VmHWM'] / 2**20:.0f} MiB, peak Pss {s['peak_Pss'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Item 8: quality at equal tokens of the wire codecs and of eager overlap, in the simulator (tiny and small).

Usage:
    python scripts/bench/compression_quality.py      # tiny and small, 31 runs (~75 CPU-min: ~40 min on 2 idle cores)
    python scripts/bench/compression_quality.py --preset tiny --jobs 2 --seeds 0 1 2 3
    python scripts/bench/compression_quality.py --preset small --rounds 6 --h 50 --taus 2 5
    python scripts/bench/compression_quality.py --smoke [--out DIR/compression_quality.json]  # tiny, 2 cases, 3 rounds
    python scripts/bench/compression_quality.py --codecs none int8 int4 int4+ef --seeds 0 1   # blocking, these only

Each case is one ``python -m p2p_diloco.simulate --mode diloco --workers 4`` run (a fresh single-threaded process,
``--jobs`` at a time; runs are seeded and deterministic, so running them side by side changes only their wall time)
with ``swarm.compression`` (p2p_diloco/codec.py: what each worker's Δ and the group's mean go through on the wire),
``swarm.overlap`` (engine.py: eager = the all-reduce of round t runs during round t+1's first τ inner steps, which
start from the look-ahead and are carried onto the group's state once it is settled), ``swarm.overlap_steps`` (τ)
and ``seed`` set per case, at the preset's own outer optimizer. Every case of a preset has the same rounds x H inner
steps per worker (equal tokens). Cases per preset:
    seed 0: blocking (overlap none) with compression none, fp16, bf16, int8; eager with none at τ_rec; eager with
            int8 at every τ of ``--taus``
    every other seed of ``--seeds``: blocking none, blocking int8, eager int8 at τ_rec (the key comparisons, to see
            the seed-to-seed noise)
    with ``--delayed``, also: delayed int8 (engine.py: eager without the look-ahead) at τ_rec on every seed, and at
            τ = H (Δ̄ one round late) on seed 0
With ``--codecs``, the plan is instead each listed codec, blocking, at every seed (a ``+ef`` suffix: with
``swarm.error_feedback``, engine.py: the codec's loss carried into the next round's Δ). A top-k codec (topk1, topk3:
error feedback always) runs with ``SPARSE_OUTER``, the outer step engine.sparse_advice names (``--set`` after it
overrides it: ``--set outer.momentum=0.9`` for DiLoCo's). ``@F<n>`` after a codec runs it with streaming fragments
(``swarm.fragments`` n, fragments.py: a round exchanges 1/n of the model; at the same H each fragment's period is
n x H); ``--eager`` runs each listed codec also with eager overlap at τ_rec (with fragments: each fragment's exchange
behind the next round's first τ inner steps, Streaming DiLoCo's schedule).
τ_rec is ``--tau-rec`` (default 10; the simulator's exchange takes no time, so a case sets τ: the swarm's default
``swarm.overlap_steps`` 0 adapts it to the measured exchange). Each case's final eval loss is compared with
the blocking none run of the same preset and seed ("ratio"); the seeds table gives each combination's mean ratio. A
seed changes the model's initialisation, the shards' order and the eval split (data.py hashes the seed into it), so
absolute losses of different seeds are not comparable; their ratios are.
MB sent per worker: the simulator's bytes_sent_per_worker (what one peer of a 4-peer butterfly sends: 2(n-1)/n x
the encoded size of Δ per round, codec and part framing included), in 10^6 bytes.
Output: scripts/bench/results/compression_quality.json (``--out`` to write elsewhere; ``--smoke`` without ``--out``:
a temporary directory), rewritten after every case (``"complete": false`` until the end), plus markdown tables
on stdout. A run that diverges (the simulator's exit 3) is recorded as diverged; a config error (exit 2) as not
measured. Failure: any other failing run makes the exit status 1 (the other cases still run and are written).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS_DIR, ROOT, Recorder, exit_on_sigterm, fill_defaults, single_thread_env  # noqa: E402

from p2p_diloco.engine import SPARSE_OUTER  # noqa: E402

WORKERS = 4
TAU_REC = 10  # τ of the seed comparisons
# name -> config, rounds, H, overrides, overlap depths τ to check, seeds; H = 100 is the utilisation target's
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": "configs/tiny.yaml",
        "rounds": 10,
        "h": 100,
        "overrides": ["data.eval_batches=16", "train.eval_every=5"],
        "taus": [1, 5, 10, 25],
        "seeds": [0, 1, 2],
    },
    # small at batch 1 x 32 (its own 16 x 256 takes about 1 s a step a core; see utilisation.py), the inner warmup
    # scaled to the short run (the preset's 100 steps would be a third of it), eval on 32 rows of each label
    # (eval batches are of data.batch_size rows) at the start and the end only
    "small": {
        "config": "configs/small.yaml",
        "rounds": 6,
        "h": 50,
        "overrides": [
            "data.batch_size=1",
            "data.seq_len=32",
            "data.eval_batches=32",
            "inner.warmup_steps=50",
            "train.eval_every=0",
        ],
        "taus": [2, 5, 10],
        "seeds": [0, 1],
    },
}
DEFAULTS: dict[str, Any] = {"preset": ["tiny", "small"], "jobs": 2}
SMOKE: dict[str, Any] = {"preset": ["tiny"], "rounds": 3, "h": 4, "taus": [2], "seeds": [0], "jobs": 2}
SMOKE_OVERRIDES = ["data.batch_size=2", "data.seq_len=32", "data.eval_batches=1", "train.eval_every=0"]


# peak RSS of one run (MiB) before any run of the preset has finished; then the largest seen is used
PEAK_MIB = {"tiny": 700, "small": 3700}
MARGIN_MIB = 1024  # left free when a run starts beside others (the machine is shared: an OOM kill costs a rerun)
RETRIES = 2  # reruns of a case killed by SIGKILL (the OOM killer, most likely)


def mem_available_mib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


CODEC_ORDER = ("none", "fp16", "bf16", "int8", "int8+ef", "int4", "int4+ef", "topk3", "topk1")


def codec_label(text: str) -> str:
    """A ``--codecs`` entry: a CODEC_ORDER name, optionally ``@F<n>`` for swarm.fragments n (``topk3@F4``)."""
    name, _, fragments = text.partition("@F")
    if name not in CODEC_ORDER or (fragments and not (fragments.isdigit() and int(fragments) >= 1)):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(CODEC_ORDER)}, optionally @F<fragments>")
    return text


def label_order(label: str) -> tuple[int, int]:
    name, _, fragments = label.partition("@F")
    return CODEC_ORDER.index(name), int(fragments or 1)


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    compression: str  # a codec, with "+ef" for swarm.error_feedback on
    overlap: str
    tau: int  # swarm.overlap_steps (0 for blocking)
    seed: int
    role: str  # why it is in the plan: codec, eager, tau, seed, delayed

    @property
    def name(self) -> str:
        over = f"+{self.overlap}{self.tau}" if self.overlap != "none" else ""
        return f"{self.preset}/{self.compression}{over}/s{self.seed}"

    def key(self) -> tuple[str, str, str, int, int]:
        return (self.preset, self.compression, self.overlap, self.tau, self.seed)


def plan(preset: str, taus: list[int], tau_rec: int, seeds: list[int], delayed: int = 0) -> list[Case]:
    """The module doc's cases for one preset, seed 0 first; ``delayed``: H, to add the delayed cases (0: none)."""
    out: list[Case] = []
    if delayed:
        out += [Case(preset, "int8", "delayed", tau_rec, seed, "delayed") for seed in seeds]
        out.append(Case(preset, "int8", "delayed", delayed, seeds[0], "delayed"))
    for seed in seeds:
        if seed == seeds[0]:
            out += [Case(preset, c, "none", 0, seed, "codec") for c in ("none", "fp16", "bf16", "int8")]
            out.append(Case(preset, "none", "eager", tau_rec, seed, "eager"))
            out += [Case(preset, "int8", "eager", t, seed, "tau") for t in dict.fromkeys([tau_rec, *taus])]
        else:
            out += [
                Case(preset, "none", "none", 0, seed, "seed"),
                Case(preset, "int8", "none", 0, seed, "seed"),
                Case(preset, "int8", "eager", tau_rec, seed, "seed"),
            ]
    return out


def codec_plan(preset: str, codecs: list[str], seeds: list[int], eager: int = 0) -> list[Case]:
    """``--codecs``: each codec (``+ef``: with error feedback) blocking, at every seed; ``eager``: τ, to run each also
    with eager overlap (0: blocking only)."""
    overlaps = [("none", 0), *([("eager", eager)] if eager else [])]
    return [Case(preset, c, o, tau, seed, "codec") for seed in seeds for c in codecs for o, tau in overlaps]


def overrides_for(case: Case, args: argparse.Namespace) -> list[str]:
    spec = PRESETS[case.preset]
    rounds = args.rounds or spec["rounds"]
    h = args.h or spec["h"]
    base = SMOKE_OVERRIDES if args.smoke else spec["overrides"]
    eager = [f"swarm.overlap_steps={case.tau}"] if case.overlap != "none" else []
    sparse = list(SPARSE_OUTER) if case.compression.startswith("topk") else []  # the outer step sparse_advice names
    codec, _, fragments = case.compression.partition("@F")
    return [
        *base,
        *sparse,
        *args.overrides,
        f"inner.steps={h}",
        f"train.rounds={rounds}",
        "train.checkpoint_every=0",
        f"swarm.compression={codec.removesuffix('+ef')}",
        f"swarm.error_feedback={codec.endswith('+ef')}",
        f"swarm.fragments={fragments or 1}",
        f"swarm.overlap={case.overlap}",
        *eager,
        f"seed={case.seed}",
    ]


class Runner:
    """Up to ``jobs`` simulator processes at once, each in its own session; os.wait4 gives each one's CPU time."""

    def __init__(self, jobs: int, workdir: Path) -> None:
        self.jobs, self.workdir = jobs, workdir
        self.running: dict[int, tuple[Case, subprocess.Popen, float, Path, Any]] = {}
        self.peak_mib = dict(PEAK_MIB)

    def fits(self, case: Case) -> bool:
        """Whether ``case`` may start now: always when nothing runs, else when its expected peak RSS (plus the
        margin, plus what the runs started in the last minute may still grow by) is available."""
        if not self.running:
            return True
        young = sum(
            self.peak_mib.get(c.preset, 0) for c, _, t0, _, _ in self.running.values() if time.monotonic() - t0 < 60
        )
        return mem_available_mib() >= self.peak_mib.get(case.preset, 1024) + MARGIN_MIB + young

    def start(self, case: Case, args: argparse.Namespace) -> None:
        out = self.workdir / case.name.replace("/", "_")
        sets: list[str] = []
        for o in overrides_for(case, args):
            sets += ["--set", o]
        cmd = [
            sys.executable, "-m", "p2p_diloco.simulate", "--config", PRESETS[case.preset]["config"],
            "--mode", "diloco", "--workers", str(WORKERS), "--out", str(out), *sets,
        ]  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        log = (out / "simulate.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=single_thread_env(1), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.running[proc.pid] = (case, proc, time.monotonic(), out, log)

    def wait_one(self, timeout: float | None = None) -> tuple[Case, dict[str, Any]] | None:
        """Wait until a run ends: its case and record (status, results, wall and CPU seconds, log tail); None when
        none ended within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            for pid in list(self.running):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done == 0:
                    continue
                case, proc, t0, out, log = self.running.pop(pid)
                log.close()
                rc = os.waitstatus_to_exitcode(status)
                proc.returncode = rc  # reaped here, not by Popen
                record = self._record(case, rc, time.monotonic() - t0, usage, out)
                self.peak_mib[case.preset] = max(self.peak_mib.get(case.preset, 0), record["peak_rss_mib"])
                return case, record
            time.sleep(0.5)
        return None

    @staticmethod
    def _record(case: Case, rc: int, wall: float, usage: Any, out: Path) -> dict[str, Any]:
        tail = (out / "simulate.log").read_text(errors="replace").splitlines()[-15:]
        rec: dict[str, Any] = {
            "case": case.name,
            **dataclasses.asdict(case),
            "rc": rc,
            "wall_seconds": round(wall, 1),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024),
        }
        if rc == 0:
            res = json.loads((out / "results.json").read_text())
            rec.update(
                status="ok",
                final_eval_loss=res["final_eval_loss"],
                initial_eval_loss=res["initial_eval_loss"],
                eval_loss_per_round=res["eval_loss_per_round"],
                bytes_sent_per_worker=res["bytes_sent_per_worker"],
                mb_sent_per_worker=res["bytes_sent_per_worker"] / 1e6,
                tokens_per_worker=res["tokens_per_worker"],
                num_params=res["num_params"],
                rounds=res["rounds"],
                inner_steps=res["inner_steps"],
                simulator_wall_seconds=round(res["wall_seconds"], 1),
                aggregation=res.get("aggregation"),  # what the robust rule excluded or clipped over the run
            )
        else:
            rec.update(
                status={3: "diverged", 2: "not measured (config error)", -9: "killed"}.get(rc, "failed"),
                final_eval_loss=None,
                log_tail=tail,
            )
        return rec

    def kill_all(self) -> None:
        for pid, (_, _, _, _, log) in list(self.running.items()):
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            log.close()
        self.running.clear()


def add_ratios(records: dict[tuple, dict[str, Any]]) -> None:
    for (preset, _, _, _, seed), r in records.items():
        ref = records.get((preset, "none", "none", 0, seed))
        ref_loss = ref.get("final_eval_loss") if ref else None
        loss = r.get("final_eval_loss")
        r["reference_loss"] = ref_loss
        r["ratio"] = loss / ref_loss if loss is not None and ref_loss else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def setting(compression: str, overlap: str, tau: int) -> str:
    return f"{compression}" + (f" + {overlap} τ={tau}" if overlap != "none" else "")


def tables(records: dict[tuple, dict[str, Any]], presets: list[str]) -> str:
    lines: list[str] = []
    for preset in presets:
        seeds = sorted({k[4] for k in records if k[0] == preset})
        if not seeds:
            continue
        rows = [r for k, r in records.items() if k[0] == preset and k[4] == seeds[0]]
        rows.sort(key=lambda r: (r["overlap"] != "none", r["tau"], label_order(r["compression"])))
        lines += [
            f"\n{preset} (seed {seeds[0]}; ratio = final eval loss / blocking none's)\n",
            "| setting | final eval loss | ratio | MB sent/worker | wall s | status |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {setting(r['compression'], r['overlap'], r['tau'])} | {fmt(r.get('final_eval_loss'), '.4f')} "
                f"| {fmt(r.get('ratio'), '.4f')} | {fmt(r.get('mb_sent_per_worker'), '.2f')} "
                f"| {r['wall_seconds']:.0f} | {r['status']} |"
            )
        if len(seeds) > 1:
            combos = sorted(
                {k[1:4] for k in records if k[0] == preset and k[4] != seeds[0]}, key=lambda c: (c[1], c[0])
            )
            lines += [
                f"\n{preset}: every seed (final eval loss, ratio to blocking none of the same seed)\n",
                "| seed | " + " | ".join(setting(*c) for c in combos) + " |",
                "|---|" + "---|" * len(combos),
            ]
            for seed in seeds:
                cells = []
                for c in combos:
                    r = records.get((preset, *c, seed))
                    if r is None or r.get("final_eval_loss") is None:
                        cells.append("-" if r is None else r["status"])
                    else:
                        cells.append(f"{r['final_eval_loss']:.4f} (x{fmt(r.get('ratio'), '.4f')})")
                lines.append(f"| {seed} | " + " | ".join(cells) + " |")
            means = []
            for c in combos:
                ratios = [records[(preset, *c, s)].get("ratio") for s in seeds if (preset, *c, s) in records]
                ratios = [x for x in ratios if x is not None]
                means.append(f"x{sum(ratios) / len(ratios):.4f} ({len(ratios)} seeds)" if ratios else "-")
            lines.append("| mean ratio | " + " | ".join(means) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=None, help="presets (tiny small)")
    p.add_argument("--rounds", type=int, default=None, help="rounds for every preset (tiny 10, small 6)")
    p.add_argument("--h", type=int, default=None, help="inner steps per round for every preset (tiny 100, small 50)")
    p.add_argument("--taus", type=int, nargs="*", default=None, help="overlap depths τ of eager int8 at seed 0")
    p.add_argument("--tau-rec", type=int, default=TAU_REC, help=f"τ of the seed comparisons ({TAU_REC})")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="seeds for every preset (tiny 0 1 2, small 0 1)")
    p.add_argument("--jobs", type=int, default=None, help="simulations at once, one thread each (2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override k=v (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/compression_quality.json)")
    p.add_argument(
        "--resume", action="store_true", help="keep the finished cases of the --out file that have the same settings"
    )
    p.add_argument("--delayed", action="store_true", help="also the delayed overlap cases (module doc)")
    p.add_argument("--eager", action="store_true", help="with --codecs: each codec also eager at τ_rec")
    p.add_argument("--codecs", nargs="+", type=codec_label, default=None, help="only these codecs, blocking")
    p.add_argument("--smoke", action="store_true", help=f"seconds-long check of this script: {SMOKE}")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, SMOKE)
    exit_on_sigterm()
    rec = Recorder("compression_quality", vars(args), smoke=args.smoke)
    target = args.out  # one file, rewritten after every case (a smoke run without --out: one temporary directory)
    if target is None:
        target = (
            Path(tempfile.mkdtemp(prefix="bench_smoke_compression_quality_")) / "compression_quality.json"
            if args.smoke
            else RESULTS_DIR / "compression_quality.json"
        )
    tau_rec = args.tau_rec
    settings = {}
    for preset in args.preset:
        spec = PRESETS[preset]
        settings[preset] = {
            "config": spec["config"],
            "rounds": args.rounds or spec["rounds"],
            "h": args.h or spec["h"],
            "overrides": [*(SMOKE_OVERRIDES if args.smoke else spec["overrides"]), *args.overrides],
            "taus": spec["taus"] if args.taus is None else args.taus,
            "tau_rec": tau_rec,
            "seeds": spec["seeds"] if args.seeds is None else args.seeds,
        }
    if args.smoke:  # 2 cases: the reference and eager int8
        queue = [Case("tiny", "none", "none", 0, 0, "codec"), Case("tiny", "int8", "eager", 2, 0, "tau")]
    elif args.codecs:
        order = sorted(args.preset, key=lambda n: n != "small")
        eager = tau_rec if args.eager else 0
        queue = [c for preset in order for c in codec_plan(preset, args.codecs, settings[preset]["seeds"], eager)]
    else:  # the longest runs first (small), so that the short ones fill the end
        queue = [
            c
            for preset in sorted(args.preset, key=lambda n: n != "small")
            for c in plan(
                preset,
                settings[preset]["taus"],
                tau_rec,
                settings[preset]["seeds"],
                settings[preset]["h"] if args.delayed else 0,
            )
        ]
    records: dict[tuple, dict[str, Any]] = {}
    rec.data.update(complete=False, workers=WORKERS, presets=settings, cases=[])
    if args.resume and target.exists():
        old = json.loads(target.read_text())
        same = {n for n, spec in old.get("presets", {}).items() if spec == settings.get(n)}
        for r in old.get("cases", []):
            case = Case(r["preset"], r["compression"], r["overlap"], r["tau"], r["seed"], r["role"])
            if r["preset"] in same and r["status"] in ("ok", "diverged"):
                records[case.key()] = r
        queue = [c for c in queue if c.key() not in records]
        print(f"compression_quality: resumed {len(records)} finished runs from {target}", flush=True)
    total = len(queue) + len(records)
    started = time.monotonic()
    failed = 0
    attempts: dict[tuple, int] = {}
    print(f"compression_quality: {total} runs, {args.jobs} at a time", flush=True)

    def publish() -> None:
        add_ratios(records)
        rec.rows.clear()
        for r in records.values():
            rec.add(
                figure=f"{r['preset']}: final eval loss, {setting(r['compression'], r['overlap'], r['tau'])}, "
                f"seed {r['seed']} ({r['status']})",
                value=r.get("final_eval_loss"),
                unit="loss",
                reference=f"blocking, compression none, seed {r['seed']}",
                reference_value=r.get("reference_loss"),
                ratio=r.get("ratio"),
                ratio_kind="loss / reference: lower is better",
                case=r["case"],
                mb_sent_per_worker=r.get("mb_sent_per_worker"),
                wall_seconds=r["wall_seconds"],
            )
        rec.data["cases"] = list(records.values())
        rec.write(target)

    with tempfile.TemporaryDirectory(prefix="bench_compq_") as tmp:
        runner = Runner(args.jobs, Path(tmp))
        try:
            while queue or runner.running:
                while queue and len(runner.running) < args.jobs:
                    ready = next((c for c in queue if runner.fits(c)), None)
                    if ready is None:
                        break  # not enough free memory beside the runs in progress: checked again below
                    queue.remove(ready)
                    attempts[ready.key()] = attempts.get(ready.key(), 0) + 1
                    runner.start(ready, args)
                idle = bool(queue) and len(runner.running) < args.jobs
                got = runner.wait_one(timeout=20.0 if idle else None)
                if got is None:
                    continue
                case, r = got
                r["attempts"] = attempts[case.key()]
                if r["status"] == "killed" and attempts[case.key()] <= RETRIES:
                    print(
                        f"compression_quality: {case.name} was killed (SIGKILL: the OOM killer?) after "
                        f"{r['wall_seconds']:.0f} s, peak {r['peak_rss_mib']} MiB; starting it again",
                        flush=True,
                    )
                    queue.insert(0, case)
                    continue
                records[case.key()] = r
                if r["status"] in ("failed", "killed"):
                    failed += 1
                add_ratios(records)
                print(
                    f"compression_quality: [{len(records)}/{total}] {case.name}: {r['status']}, final eval loss "
                    f"{fmt(r.get('final_eval_loss'), '.4f')} (x{fmt(r.get('ratio'), '.4f')} of blocking none), "
                    f"{fmt(r.get('mb_sent_per_worker'), '.2f')} MB/worker, {r['wall_seconds']:.0f} s "
                    f"(cpu {r['cpu_seconds']:.0f} s); {(time.monotonic() - started) / 60:.1f} min elapsed",
                    flush=True,
                )
                if r["status"] in ("failed", "killed"):
                    print("\n".join(r.get("log_tail", [])), flush=True)
                publish()
        finally:
            runner.kill_all()
    text = tables(records, args.preset)
    rec.data["complete"] = True
    rec.data["tables_markdown"] = text
    rec.notes.append(
        f"{WORKERS} workers, p2p_diloco.simulate --mode diloco, equal tokens within a preset, the preset's outer "
        f"optimizer (a top-k codec: {' '.join(SPARSE_OUTER)}; @F<n>: swarm.fragments n); final eval loss on "
        "data.eval_batches x data.batch_size rows per eval label (the preset overrides). ratio = final eval loss / "
        "that of the blocking run without compression of the same seed. MB = "
        "10^6 bytes sent per worker in the whole run (the simulator's count of the butterfly's payload with the "
        "case's codec). Wall seconds are this machine's, with --jobs runs side by side."
    )
    publish()
    path = rec.write(target)
    print(text)
    print(f"\nwrote {path} ({(time.monotonic() - started) / 60:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

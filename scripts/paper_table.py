"""The DiLoCo paper's comparisons on this build, at equal tokens, as one resumable script (issue 13, item 4).

Usage:
    python scripts/paper_table.py                       # tiny, every group; docs/paper_table.md + plots
    python scripts/paper_table.py --preset small        # configs/small.yaml, batch 4 x 64, its own group list
    python scripts/paper_table.py --preset tiny --groups main warm --jobs 2
    python scripts/paper_table.py --smoke --out /tmp/pt --doc /tmp/pt/table.md   # seconds; what the tests run

Every run is one ``run_simulation`` process (``--threads 1``; ``--jobs`` of them at a time) with the same inner steps
per worker (``steps``), so H x rounds is constant and every method sees the same tokens. Groups:
    main     K = 4 IID: single worker (one model, K x the steps), synchronous data-parallel (each step the mean
             gradient of K shards), DiLoCo at H in {10, 50, 100, 500}, FedAvg (outer SGD lr 1, no momentum) at H 50
    warm     the same after a warm start: the first ``warm`` steps data-parallel (train.warm_start=sync), then the
             method for the rest, so the tokens stay equal
    noniid   DiLoCo H 50 and data-parallel with by-label and Dirichlet (alpha 0.5) shards, eval per label
    workers  DiLoCo H 50 and data-parallel with K in {2, 8}
    gap      item 5's attempts at closing the gap to main's data-parallel run, at its total steps, with plain outer SGD
             at lr 1 (PLAIN_OUTER): DiLoCo at H 5, and at H 5 and 10 after a warm start of ``warm`` data-parallel steps
             that the run continues (warm_start_schedule continue: the same lr schedule and inner moments: the
             baseline's own first steps); data-parallel, H 5 and the warm-started H 10 again with seed 1 (another
             init, data order and eval split)
The outer optimizer is the sweep's choice (docs/outer_sweep.md): the config's own (0.7/0.9, a 5-round ramp on tiny)
up to H 50; from H 100, where 10 rounds or fewer remain, tiny's H 100 winner 1.0/0.5 without a ramp. H values that do
not divide the steps are left out (small: H 500).

Output: OUT/<run>/ (results.json, metrics.jsonl of each run: a run with results.json is not run again, so a stopped
table resumes), OUT/table.json, and ``--doc`` (docs/paper_table.md): the tables, each loss beside its ratio to
the data-parallel run of the same cohort (group, workers, shards, seed), and the papers' figures as ratios to their
own data-parallel baseline; plots beside it (``<doc stem>/<preset>_loss_vs_tokens.png``, ``..._loss_vs_bytes.png``).
A run that fails is reported with its exit code and the tail of its log, and left out of the tables; the others
still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The papers' figures (shared/docs/diloco-notes.md) as ratios to their own data-parallel baseline. DiLoCo (arXiv
# 2311.08105, 150M, 8 workers, H 500, after 24k ordinary steps) reports perplexity: the loss ratio is ln/ln.
PAPER = {
    "diloco_150m": {
        "dp": 15.30,
        "single": 16.23,
        "diloco": 15.02,
        "workers": {4: 15.18, 8: 15.02, 16: 14.91},
        "iid": 15.08,
    },  # the non-IID 8-worker run is "diloco"; "iid" the same with IID shards
    "scaling_35m": {"dp": 3.485, "diloco": {1: 3.482, 2: 3.508, 4: 3.554, 8: 3.621}},  # eval loss, from scratch
}


@dataclasses.dataclass(frozen=True)
class Preset:
    config: str
    steps: int  # inner steps per worker, every run
    warm: int  # data-parallel steps of the warm group's warm start (part of ``steps``)
    sets: tuple[str, ...] = ()
    hs: tuple[int, ...] = (10, 50, 100, 500)


PRESETS = {
    "tiny": Preset("configs/tiny.yaml", steps=1000, warm=500),
    "small": Preset(
        "configs/small.yaml", steps=400, warm=200, sets=("data.batch_size=4", "data.seq_len=64"), hs=(10, 50, 100)
    ),
    "smoke": Preset("configs/tiny.yaml", steps=4, warm=2, sets=("data.eval_batches=1",), hs=(2,)),
}
GROUPS = ("main", "warm", "noniid", "workers", "gap")


@dataclasses.dataclass(frozen=True)
class Run:
    group: str
    label: str
    mode: str
    workers: int
    h: int | None  # None: sync and single, whose H is only the eval cadence
    sets: tuple[str, ...]

    @property
    def cohort(self) -> tuple[str, int, str, str]:
        """What its data-parallel baseline shares with it: the group (gap: main's, the plain run of the same total
        steps), the workers, the shards' partition and the seed."""
        sets = dict(x.split("=", 1) for x in self.sets)
        group = "main" if self.group == "gap" else self.group
        return group, self.workers, sets.get("data.partition", "iid"), sets.get("seed", "0")

    @property
    def name(self) -> str:
        return f"{self.group}-{self.label}".replace(" ", "_").replace("=", "").replace(",", "")


# The gap group's outer step: plain SGD at lr 1 (small.yaml's own, the small sweep's winner). Outer momentum at small
# H is an outer lr of up to lr / (1 - m) every few steps: tiny's 0.7/0.9 at H 5 ended at 1.55 x data-parallel.
PLAIN_OUTER = ("outer.lr=1.0", "outer.momentum=0.0", "outer.lr_warmup_rounds=0")


def _outer(h: int) -> tuple[str, ...]:
    return () if h <= 50 else ("outer.lr=1.0", "outer.momentum=0.5", "outer.lr_warmup_rounds=0")


def plan(preset: Preset, groups: list[str]) -> list[Run]:
    """The runs of ``groups``, in the order they are run (the baselines first)."""
    mid = 50 if 50 in preset.hs else preset.hs[len(preset.hs) // 2]
    runs: list[Run] = []

    def add(group: str, label: str, mode: str, workers: int, h: int | None, steps: int, *extra: str) -> None:
        cadence = h if h is not None else mid
        if steps % cadence:
            return
        rounds = steps // cadence
        sets = (*preset.sets, f"inner.steps={cadence}", f"train.rounds={rounds}",
                f"train.eval_every={max(1, rounds // 5)}", *extra)  # fmt: skip
        runs.append(Run(group, label, mode, workers, h, sets))

    for group in groups:
        warm = ("train.warm_start=sync", f"train.warm_start_steps={preset.warm}") if group == "warm" else ()
        steps = preset.steps - (preset.warm if warm else 0)
        if group in ("main", "warm"):
            add(group, "data-parallel", "sync", 4, None, steps, *warm)
            add(group, "single worker", "single", 4, None, steps, *warm)
            for h in preset.hs:
                add(group, f"DiLoCo H={h}", "diloco", 4, h, steps, *warm, *_outer(h))
            add(group, f"FedAvg H={mid}", "fedavg", 4, mid, steps, *warm)
        elif group == "noniid":
            for part in ("by-label", "dirichlet"):
                extra = (f"data.partition={part}", "data.dirichlet_alpha=0.5")
                add(group, f"data-parallel {part}", "sync", 4, None, steps, *extra)
                add(group, f"DiLoCo H={mid} {part}", "diloco", 4, mid, steps, *extra, *_outer(mid))
        elif group == "workers":
            for k in (2, 8):
                add(group, f"data-parallel K={k}", "sync", k, None, steps)
                add(group, f"DiLoCo H={mid} K={k}", "diloco", k, mid, steps, *_outer(mid))
        elif group == "gap":
            if "main" not in groups:  # the baseline
                add("main", "data-parallel", "sync", 4, None, preset.steps)
            cont = ("train.warm_start=sync", f"train.warm_start_steps={preset.warm}",
                    "train.warm_start_schedule=continue")  # fmt: skip
            add(group, "DiLoCo H=5", "diloco", 4, 5, preset.steps, *PLAIN_OUTER)
            add(group, "data-parallel seed 1", "sync", 4, None, preset.steps, "seed=1")  # another init and data order
            add(group, "DiLoCo H=5 seed 1", "diloco", 4, 5, preset.steps, "seed=1", *PLAIN_OUTER)
            for h, seed in ((5, 0), (10, 0), (10, 1)):
                label = f"DiLoCo H={h} warm {preset.warm} continued" + (f" seed {seed}" if seed else "")
                seeded = (f"seed={seed}",) if seed else ()
                add(group, label, "diloco", 4, h, preset.steps - preset.warm, *cont, *PLAIN_OUTER, *seeded)
        else:
            raise SystemExit(f"--groups: {group!r} is not a group (one of {', '.join(GROUPS)})")
    return runs


def run_one(run: Run, preset: Preset, out: Path) -> dict[str, Any]:
    """One simulation in its own process, unless OUT/<run>/results.json exists; returns its results (or the error)."""
    target = out / run.name
    done = target / "results.json"
    if done.is_file():
        return {**json.loads(done.read_text()), "cached": True}
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "p2p_diloco.simulate", "--config", str(ROOT / preset.config), "--mode", run.mode,
           "--workers", str(run.workers), "--out", str(target), "--threads", "1",
           *[x for s in run.sets for x in ("--set", s)]]  # fmt: skip
    with (target / "log.txt").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False).returncode
    if rc != 0 or not done.is_file():
        tail = (target / "log.txt").read_text(errors="replace").splitlines()[-8:]
        return {"error": f"exit {rc}", "log_tail": tail}
    return json.loads(done.read_text())


def execute(runs: list[Run], preset: Preset, out: Path, jobs: int) -> dict[str, dict[str, Any]]:
    """Every run, ``jobs`` at a time, with a progress line per finished run (done/total, elapsed, ETA)."""
    results: dict[str, dict[str, Any]] = {}
    started, todo = time.monotonic(), [r for r in runs if not (out / r.name / "results.json").is_file()]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} cached, {len(todo)} to run, {jobs} at a time", flush=True)
    for r in runs:
        if r not in todo:
            results[r.name] = run_one(r, preset, out)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, r, preset, out): r for r in todo}
        for n, future in enumerate(as_completed(futures), start=1):
            r = futures[future]
            res = results[r.name] = future.result()
            elapsed = time.monotonic() - started
            eta = elapsed / n * (len(todo) - n)
            what = f"eval {res['final_eval_loss']:.4f}" if "error" not in res else f"FAILED ({res['error']})"
            print(f"[{n}/{len(todo)}] {r.name}: {what}  ({elapsed / 60:.1f} min elapsed, ~{eta / 60:.1f} min left)",
                  flush=True)  # fmt: skip
    return results


def _paper_ratio(perplexity: float) -> float:
    """A perplexity of the DiLoCo paper as a loss ratio to its data-parallel run's (ln / ln)."""
    return math.log(perplexity) / math.log(PAPER["diloco_150m"]["dp"])


def _paper_rows() -> list[str]:
    d, s = PAPER["diloco_150m"], PAPER["scaling_35m"]
    rows = [
        "| paper | setting | single worker | DiLoCo |",
        "|---|---|---|---|",
        f"| DiLoCo (2311.08105) | 150M, 8 workers, H 500, warm start (perplexity {d['dp']} data-parallel) | "
        f"{_paper_ratio(d['single']):.4f} | {_paper_ratio(d['diloco']):.4f} |",
        "| DiLoCo (2311.08105) | 150M, H 500, workers 4 / 8 / 16 | | "
        + " / ".join(f"{_paper_ratio(v):.4f}" for v in d["workers"].values())
        + " |",
        f"| Scaling laws (2503.09799) | 35M from scratch, M = 1 / 2 / 4 / 8 (loss {s['dp']} data-parallel) | | "
        + " / ".join(f"{v / s['dp']:.4f}" for v in s["diloco"].values())
        + " |",
    ]
    return rows


TABLE_HEAD = (
    "| run | K | H | final eval loss | ÷ data-parallel | worst label | MB sent | tokens | wall s |"  # per worker
)


def _ratio(runs: list[Run], results: dict[str, dict[str, Any]], pick) -> str:
    """The best (lowest) ratio to data-parallel among the runs ``pick`` selects, with its label; "-" if none ran."""
    found = [(results[r.name]["final_eval_loss"] / b, r.label) for r in runs if pick(r) and "error" not in
             results[r.name] and (b := baseline(r, runs, results))]  # fmt: skip
    return f"{min(found)[0]:.4f} ({min(found)[1]})" if found else "-"


def side_by_side(runs: list[Run], results: dict[str, dict[str, Any]]) -> list[str]:
    """The papers' ratios to data-parallel and ours for the same comparison, one row each."""
    d, s = PAPER["diloco_150m"], PAPER["scaling_35m"]
    diloco = lambda group, k=4: lambda r: r.mode == "diloco" and r.group == group and r.workers == k  # noqa: E731
    by_label = [r for r in runs if r.group == "noniid" and r.mode == "diloco" and "by-label" in r.label]
    same_h = [r for r in runs if r.group == "main" and r.mode == "diloco" and by_label and r.h == by_label[0].h]
    non_iid = "-"
    if by_label and same_h and all("error" not in results[r.name] for r in (*by_label, *same_h)):
        non_iid = f"{results[by_label[0].name]['final_eval_loss'] / results[same_h[0].name]['final_eval_loss']:.4f}"
    return [
        "| comparison (÷ data-parallel unless said) | DiLoCo paper, 150M | scaling laws, 35M | this build |",
        "|---|---|---|---|",
        f"| single worker, K x the steps | {_paper_ratio(d['single']):.4f} | | "
        f"{_ratio(runs, results, lambda r: r.mode == 'single' and r.group == 'main')} |",
        f"| DiLoCo, 4 workers, from scratch (best H) | | {s['diloco'][4] / s['dp']:.4f} | "
        f"{_ratio(runs, results, diloco('main'))} |",
        f"| DiLoCo, 4 workers, after a warm start (best H) | {_paper_ratio(d['workers'][4]):.4f} (H 500) | | "
        f"{_ratio(runs, results, diloco('warm'))} |",
        f"| DiLoCo, 4 workers, the gap group (best of H 5, continued warm starts) | | | "
        f"{_ratio(runs, results, diloco('gap'))} |",
        f"| DiLoCo, 2 workers | | {s['diloco'][2] / s['dp']:.4f} | {_ratio(runs, results, diloco('workers', 2))} |",
        f"| DiLoCo, 8 workers | {_paper_ratio(d['workers'][8]):.4f} (warm start) | {s['diloco'][8] / s['dp']:.4f} | "
        f"{_ratio(runs, results, diloco('workers', 8))} |",
        f'| FedAvg, 4 workers, from scratch | ("performed poorly") | | '
        f"{_ratio(runs, results, lambda r: r.mode == 'fedavg' and r.group == 'main')} |",
        f"| DiLoCo non-IID ÷ DiLoCo IID, same H | {math.log(d['diloco']) / math.log(d['iid']):.4f} | | "
        f"{non_iid} (by-label) |",
        "",
    ]


def render(preset_name: str, runs: list[Run], results: dict[str, dict[str, Any]], doc: Path) -> str:
    """The markdown for one preset: the papers beside us, then a table per group, each loss with its ratio to its
    data-parallel baseline."""
    lines = [f"## {preset_name}", "", *side_by_side(runs, results)]
    for group in dict.fromkeys(r.group for r in runs):
        members = [r for r in runs if r.group == group]
        lines += [f"### {group}", "", TABLE_HEAD, "|---|---|---|---|---|---|---|---|---|"]
        for r in members:
            res = results[r.name]
            if "error" in res:
                lines.append(f"| {r.label} | {r.workers} | {r.h or '-'} | failed: {res['error']} | | | | | |")
                continue
            base = baseline(r, runs, results)
            ratio = f"{res['final_eval_loss'] / base:.4f}" if base else "-"
            labels = res.get("final_eval_loss_per_label") or {}
            worst = f"{max(labels.values()):.4f}" if labels else "-"
            warm = (res.get("warm_start") or {}).get("tokens", 0) // r.workers
            sent = res["bytes_sent_per_worker"] + _warm_bytes(res, r)
            lines.append(
                f"| {r.label} | {r.workers} | {r.h or '-'} | {res['final_eval_loss']:.4f} | {ratio} | {worst} | "
                f"{sent / 1e6:.1f} | {res['tokens_per_worker'] + warm} | "
                f"{res['wall_seconds']:.0f} |"
            )
        lines.append("")
    plots = _plots(preset_name, runs, results, doc)
    lines += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def _warm_bytes(res: dict[str, Any], run: Run) -> int:
    """What a worker sent in the run's warm start: an fp32 gradient all-reduce a data-parallel step (results.json
    has it; runs cached before it did are counted here the same way)."""
    warm = res.get("warm_start") or {}
    if "bytes_sent_per_worker" in warm or warm.get("kind") != "sync":
        return int(warm.get("bytes_sent_per_worker", 0))
    from p2p_diloco.rounds import fp32_bytes_sent  # torch: only for such a cached run

    return fp32_bytes_sent(res["num_params"], run.workers) * int(warm["steps"])


def _curve(res: dict[str, Any], run: Run) -> tuple[list[float], list[float], list[float]]:
    """(tokens per worker, MB sent per worker, eval loss) at each evaluated round, a warm start's included."""
    rounds = int(res["rounds"])
    per_round_tokens = res["tokens_per_worker"] / rounds
    per_round_bytes = res["bytes_sent_per_worker"] / rounds
    warm = (res.get("warm_start") or {}).get("tokens", 0) / run.workers
    warm_mb = _warm_bytes(res, run) / 1e6
    points = sorted((int(k), v) for k, v in res["eval_loss_per_round"].items())
    return ([warm + k * per_round_tokens for k, _ in points],
            [warm_mb + k * per_round_bytes / 1e6 for k, _ in points], [v for _, v in points])  # fmt: skip


def _plots(preset_name: str, runs: list[Run], results: dict[str, dict[str, Any]], doc: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = doc.parent / doc.stem
    where.mkdir(parents=True, exist_ok=True)
    shown = [r for r in runs if r.group in ("main", "warm", "gap") and "error" not in results[r.name]]
    names = []
    for axis, xlabel, log_x in (("tokens", "tokens per worker", False), ("bytes", "MB sent per worker", True)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in shown:
            tokens, mb, loss = _curve(results[r.name], r)
            xs = tokens if axis == "tokens" else mb
            pairs = [(x, y) for x, y in zip(xs, loss, strict=True) if x > 0 or not log_x]
            style = {"warm": "--", "gap": ":"}.get(r.group, "-")
            ax.plot(
                [x for x, _ in pairs], [y for _, y in pairs], marker=".", linestyle=style, label=f"{r.group}: {r.label}"
            )
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.set_title(f"{preset_name}: eval loss vs {xlabel} (dashed: warm start; dotted: gap group)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = where / f"{preset_name}_loss_vs_{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        names.append(str(path.relative_to(doc.parent)))
    return names


def baseline(run: Run, runs: list[Run], results: dict[str, dict[str, Any]]) -> float | None:
    """The final eval loss of ``run``'s data-parallel baseline, the first sync run of its cohort; None if absent."""
    for r in runs:
        if r.mode == "sync" and r.cohort == run.cohort and "error" not in results[r.name]:
            return results[r.name]["final_eval_loss"]
    return None


def best_ratio(runs: list[Run], results: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    """The best DiLoCo run's final eval loss ÷ its data-parallel baseline's, over every group."""
    best = None
    for r in runs:
        base = baseline(r, runs, results)
        if r.mode == "diloco" and base and "error" not in results[r.name]:
            ratio = results[r.name]["final_eval_loss"] / base
            if best is None or ratio < best[1]:
                best = (f"{r.group}: {r.label}", ratio)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--preset", choices=[k for k in PRESETS if k != "smoke"], default="tiny")
    p.add_argument("--groups", nargs="+", default=list(GROUPS), help=f"any of {', '.join(GROUPS)}")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/paper_table/PRESET)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "paper_table.md")
    p.add_argument("--jobs", type=int, default=2, help="simulations at a time (each one torch thread)")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="run only the runs whose name contains one of these (e.g. DiLoCo_H50 data-parallel); the "
                   "table shows the cached others")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="4 steps of the main group: checks the script, not DiLoCo")
    args = p.parse_args(argv)
    if args.jobs < 1:
        print(f"paper_table: --jobs {args.jobs} must be >= 1", file=sys.stderr)
        return 2
    name = "smoke" if args.smoke else args.preset
    preset, groups = PRESETS[name], (["main"] if args.smoke else args.groups)
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        print(f"paper_table: --groups {bad[0]!r} is not a group (one of {', '.join(GROUPS)})", file=sys.stderr)
        return 2
    out = args.out or ROOT / "runs" / "paper_table" / name
    runs = plan(preset, groups)
    chosen = [r for r in runs if args.only is None or any(text in r.name for text in args.only)]
    if not chosen:
        print(f"paper_table: --only {' '.join(args.only)} matches none of {', '.join(r.name for r in runs)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.only is not None:  # the table: the chosen runs and whatever else is cached
        runs = [r for r in runs if r in chosen or (out / r.name / "results.json").is_file()]
    results = execute(runs, preset, out, args.jobs)
    (out / "table.json").write_text(json.dumps({r.name: {"run": dataclasses.asdict(r), **results[r.name]}
                                                for r in runs}, indent=2))  # fmt: skip
    section = render(name, runs, results, args.doc)
    best = best_ratio(runs, results)
    _write_doc(args.doc, name, section, best)
    print(section)
    if best:
        print(f"best DiLoCo ÷ data-parallel on {name}: {best[1]:.4f} ({best[0]})")
    failed = [r.name for r in runs if "error" in results[r.name]]
    if failed:
        print(f"paper_table: {len(failed)} runs failed: {', '.join(failed)} (logs in {out}/<run>/log.txt)",
              file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


HEADER = """# The paper's comparisons on this build (issue 13, item 4)

Written by `python scripts/paper_table.py` (per preset: `--preset tiny`, `--preset small`); each section is
replaced when its preset is run again, the others are kept. All runs are the in-process simulator (the swarm is
checked against it bitwise, tests/test_swarm.py), at equal tokens per worker within a preset (a warm start's
tokens included). Ratios are final eval loss ÷ the data-parallel run with the same group (gap: main's), workers,
shards and seed; lower is better. "worst label": the highest per-label eval loss. "MB sent" and "tokens" are per
worker, a warm start's included (its data-parallel steps send an fp32 gradient each); "wall s" was measured on a
shared 2-core machine with two or three runs at a time (and pauses): rough only.

## The papers, as ratios to their data-parallel baseline

"""


def _write_doc(doc: Path, name: str, section: str, best: tuple[str, float] | None) -> None:
    """Replace this preset's section in ``doc`` (or start the file), keep the others."""
    marker_start, marker_end = f"<!-- preset {name} -->", f"<!-- end preset {name} -->"
    body = section + (f"\nBest DiLoCo ÷ data-parallel on {name}: **{best[1]:.4f}** ({best[0]}).\n" if best else "")
    block = f"{marker_start}\n{body}\n{marker_end}"
    text = doc.read_text() if doc.is_file() else HEADER + "\n".join(_paper_rows()) + "\n\n"
    if marker_start in text and marker_end in text:
        before, rest = text.split(marker_start, 1)
        text = before + block + rest.split(marker_end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


if __name__ == "__main__":
    sys.exit(main())

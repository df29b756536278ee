"""scripts/paper_table.py in its --smoke mode: real simulations, the table and plots written, a rerun served from
the cache, another preset's section kept, bad flags refused with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "paper_table.py"
PNG = b"\x89PNG\r\n\x1a\n"


def table(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.timeout(300)
def test_smoke_table_runs_caches_and_keeps_other_sections(tmp_path):
    doc, out = tmp_path / "doc" / "paper_table.md", tmp_path / "runs"
    doc.parent.mkdir()
    doc.write_text("# kept\n\n<!-- preset tiny -->\nthe tiny section\n<!-- end preset tiny -->\n")
    first = table("--smoke", "--out", str(out), "--doc", str(doc), "--jobs", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "4 runs, 0 cached, 4 to run" in first.stdout
    text = doc.read_text()
    assert "the tiny section" in text and "<!-- preset smoke -->" in text  # another preset's section is kept
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if "| 4 |" in line}
    assert set(rows) == {"data-parallel", "single worker", "DiLoCo H=2", "FedAvg H=2"}
    assert rows["data-parallel"][4] == "1.0000"  # each loss ÷ the group's data-parallel
    results = json.loads((out / "table.json").read_text())
    for name, res in results.items():
        ratio = res["final_eval_loss"] / results["main-data-parallel"]["final_eval_loss"]
        label = res["run"]["label"]
        assert rows[label][4] == f"{ratio:.4f}" and res["tokens_per_worker"] == 4 * 8 * 64, name  # equal tokens
    assert "Best DiLoCo ÷ data-parallel on smoke" in text
    for name in ("smoke_loss_vs_tokens.png", "smoke_loss_vs_bytes.png"):
        assert (doc.parent / "paper_table" / name).read_bytes().startswith(PNG)

    again = table("--smoke", "--out", str(out), "--doc", str(doc))
    assert again.returncode == 0 and "4 runs, 4 cached, 0 to run" in again.stdout, again.stdout + again.stderr
    assert doc.read_text().count("<!-- preset smoke -->") == 1  # replaced, not appended


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "says"), [(["--jobs", "0"], "--jobs 0 must be >= 1"),
                                              (["--groups", "nope"], "'nope' is not a group"),
                                              (["--only", "nope"], "--only nope matches none of")])  # fmt: skip
def test_bad_flags_are_refused_with_a_message(tmp_path, flags, says):
    proc = table("--out", str(tmp_path), "--doc", str(tmp_path / "d.md"), *flags, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "d.md").exists()


def _plan(preset: str, groups: list[str]) -> list:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import paper_table
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return paper_table.plan(paper_table.PRESETS[preset], groups)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_every_planned_run_takes_the_presets_steps_and_has_a_baseline(preset):
    """Equal tokens: H x rounds (+ a warm start's steps) is the preset's steps for every run of every group; the gap
    group's runs are measured against main's data-parallel run, which is planned with them."""
    runs = _plan(preset, ["main", "warm", "noniid", "workers", "gap"])
    steps = {"tiny": 1000, "small": 400}[preset]
    for r in runs:
        sets = dict(x.split("=", 1) for x in r.sets)
        # per worker (single: its one model takes K x these steps, so it sees the K workers' tokens)
        h, rounds, warm = (int(sets.get(k, 0)) for k in ("inner.steps", "train.rounds", "train.warm_start_steps"))
        assert h * rounds + warm == steps, r.name
        assert any(b.mode == "sync" and b.cohort == r.cohort for b in runs), r.name
    gap = _plan(preset, ["gap"])
    assert [r.name for r in gap if r.group != "gap"] == ["main-data-parallel"]
    assert {r.cohort for r in gap} == {("main", 4, "iid", "0"), ("main", 4, "iid", "1")}
    seeded = [r for r in gap if r.cohort[3] == "1"]
    assert {r.mode for r in seeded} == {"sync", "diloco"}  # a seed-1 run has a seed-1 baseline

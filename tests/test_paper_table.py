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

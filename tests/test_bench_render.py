"""The benchmark table renderer (scripts/bench/render.py) on synthetic results: no timing, no processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
_saved_path = list(sys.path)
sys.path.insert(0, str(BENCH))
import render  # noqa: E402
from benchlib import row  # noqa: E402

sys.path[:] = _saved_path  # scripts/bench holds modules named inner, memory, ...: keep them off the path


def _result(item: str, rows: list[dict]) -> dict:
    return {
        "item": item,
        "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None},
        "started": "2026-01-02T03:04:05+00:00",
        "finished": "2026-01-02T03:05:05+00:00",
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.5, 1.0],
        "wall_seconds": 60.0,
        "rows": rows,
        "notes": [f"how {item} is measured"],
    }


def test_render_rows_units_and_missing_items(tmp_path):
    results = {
        "inner": [row("tiny loop", 12000.0, "tok/s", "bare loop", 12100.0, 0.99, "median ratio", ratio_range=[0.9, 1])],
        "comm_quality": [row("DiLoCo H=10 bytes | target", None, "B", "sync", 3 * 2**20, None, "x fewer")],
        "utilisation": [row("tiny H=100", 0.931, "share", "all compute", 1.0, 0.931, "utilisation")],
    }
    for item, rows in results.items():
        (tmp_path / f"{item}.json").write_text(json.dumps(_result(item, rows)))
    text = render.render(tmp_path)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 3  # header, separator, one line per result row
    assert "12,000 tok/s" in text and "0.990 (0.90-1.00) median ratio" in text
    assert "not reached" in text and "3.0 MiB" in text and "93.1%" in text
    assert "DiLoCo H=10 bytes / target" in text  # a '|' in a figure cannot break the table
    assert "Test CPU, 2 cores" in text and "2026-01-02" in text
    assert "gpu.sh" in text and "Not run" in text  # GPU items absent: said so
    assert "how inner is measured" in text
    assert "Smoke run" not in text


def test_render_flags_smoke_results(tmp_path):
    data = {**_result("inner", [row("tiny loop", 1.0, "tok/s", "bare loop", 1.0, 1.0, "median ratio")]), "smoke": True}
    (tmp_path / "inner.json").write_text(json.dumps(data))
    assert "**Smoke run**" in render.render(tmp_path) and "for inner:" in render.render(tmp_path)

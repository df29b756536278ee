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
    detail = text.split("## Detail", 1)[1]
    table = [line for line in detail.splitlines() if line.startswith("| ")]
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


def _summary(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The summary section's lines, and its table rows by item (cells stripped)."""
    lines = text.split("## Summary", 1)[1].split("## Detail", 1)[0].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines if line.startswith("| ")]
    return lines, {r[0]: r for r in rows[2:]}


def test_summary_headlines_targets_and_not_run(tmp_path):
    inner_kind = "median of 16 A/B pairs, cpu clock (target >= 0.98)"
    inner = [
        row(
            "tiny (0.67M params): tokens/s",
            17000.0,
            "tok/CPU-s",
            "bare PyTorch AdamW loop, same batch",
            1.0,
            0.99,
            inner_kind,
        ),
        row(
            "small (19M params): tokens/s",
            500.0,
            "tok/CPU-s",
            "bare PyTorch AdamW loop, same batch",
            1.0,
            0.97,
            inner_kind,
        ),
    ]
    util_kind = "utilisation (target >= 0.99 at H=100)"
    util_cases = [
        {
            "case": "tiny",
            "h": 100,
            "overrides": [],
            "utilisation_wall": 0.916,
            "compute_per_round": 5.8,
            "matchmaking_per_round": 0.37,
            "matchmaking_protocol_per_round": 0.07,
            "allreduce_per_round": 0.12,
            "other_per_round": 0.05,
        },
        {"case": "tiny", "h": 100, "overrides": ["swarm.overlap=eager"], "utilisation_wall": 0.956},
        {
            "case": "tiny",
            "h": 150,
            "overrides": ["inner.round_seconds=6", "swarm.overlap=eager"],
            "utilisation_wall": 0.995,
        },
    ]
    util = {
        **_result(
            "utilisation",
            [
                row(f"case {k}", c["utilisation_wall"], "share", "all compute", 1.0, c["utilisation_wall"], util_kind)
                for k, c in enumerate(util_cases)
            ],
        ),
        "cases": util_cases,
    }
    one_state_case = {
        "states_per_round": {"1": 1, "2": 1},
        "final_states": 1,
        "lost_peer_rounds": 0,
        "peer_rounds_trained": 32,
        "lost_share": 0.0,
        "median_bytes_sent": 22000,
        "median_bytes_over_bound": 1.071,
        "peers": 16,
        "group": 4,
        "rounds": 2,
        "utc": "2026-01-05T01:00:00Z",
    }
    scale = {
        "item": "scale",
        "cases": {
            "smoke_6": {**one_state_case, "peers": 6, "group": 3, "lost_share": 0.857, "final_states": 5},
            "sixteen": one_state_case,
            "thirtytwo": {
                **one_state_case,
                "peers": 32,
                "group": 8,
                "states_per_round": {"1": 1},
                "final_states": 2,
                "lost_peer_rounds": 53,
                "peer_rounds_trained": 56,
                "lost_share": 0.946,
                "problem": "stopped by hand: summarized from metrics",
                "utc": "2026-01-06T01:00:00Z",
            },
        },
    }
    files = {
        "inner": _result("inner", inner),
        "utilisation": util,
        "netlab": _result("netlab", []),  # no cases: the summary cannot read it
        "scale": scale,
    }
    for item, data in files.items():
        (tmp_path / f"{item}.json").write_text(json.dumps(data))
    text = render.render(tmp_path)
    lines, rows = _summary(text)
    assert text.index("## Summary") < text.index("## Detail") < text.index("| item | figure |")
    assert len(lines) <= 25  # one screen
    assert rows["1. Inner loop"] == [
        "1. Inner loop",
        "tok/CPU-s: 0.990x (tiny), 0.970x (small) a bare PyTorch AdamW loop",
        ">= 0.98",
        "1 of 2",
        "2026-01-02",
    ]
    util_row = rows["3. Compute utilisation"]
    assert util_row[1] == (
        "fixed H=100: blocking 91.6% tiny; eager overlap 95.6% tiny; "
        "best 99.5% (tiny, time-budgeted rounds, overlap=eager)"
    )
    assert util_row[2:4] == [">= 0.99 at H=100", "1 of 3"]
    assert rows["2. Averaging round"][1:] == ["not run", "-", "-", "-"]
    assert rows["6. GPU"][1].startswith("not run")
    assert rows["13. One state"][1] == "not run"
    assert "not in the form this summary reads (KeyError)" in rows["7. Shaped links"][1]
    many = rows["14. Many peers"]
    assert many[1] == (
        "16 peers (groups of 4): one state every round in 1 of 1 run, 0% peer-rounds lost, 1.071x the byte bound; "
        "32 peers (groups of 8): one state every round in 0 of 1 run, 95% peer-rounds lost (stopped by hand)"
    )  # the smoke case is left out
    assert many[2:] == ["1 state a round", "1 of 2", "2026-01-05 to 01-06"]
    assert "smoke_6 (14)" in text.split("## Detail", 1)[1]  # said where it was left out
    assert len(rows) == 16  # items 1-14, 8b and 8c, item 6 as one row while the GPU has not run


def test_summary_reads_every_committed_result():
    """Every results file in scripts/bench/results is read by its summary row (a format change shows here)."""
    text = render.render(BENCH / "results")
    _, rows = _summary(text)
    present = {render.SHORT[p.stem] for p in (BENCH / "results").glob("*.json") if p.stem in render.SHORT}
    assert present and all(rows[name][1] != "not run" for name in present)
    assert "not in the form" not in text


def test_a_long_problem_note_is_cut_to_its_first_line():
    escaped = "peers {'51': \"SwarmUnreachableError: no initial peer answered.\\n  tried: ...\"}"  # a repr: "\\n"
    assert render._first_line(escaped) == (
        "peers {'51': \"SwarmUnreachableError: no initial peer answered. [...] (whole text in the result file)"
    )
    assert render._first_line("timeout\nsecond line").startswith("timeout [...]")
    long = " ".join(["word"] * 200)
    assert len(render._first_line(long)) < 360 and render._first_line("short") == "short"


def test_codecs_summary_gives_each_codec_its_mean_ratio_per_preset_and_its_bytes_against_fp32():
    def case(codec, preset, seed, ratio, mb):
        return {"compression": codec, "preset": preset, "seed": seed, "ratio": ratio, "mb_sent_per_worker": mb}

    cases = [case("none", "tiny", s, 1.0, 40.0) for s in (0, 1)]
    cases += [case("int4", "tiny", 0, 1.01, 5.0), case("int4", "tiny", 1, 0.99, 5.0)]
    cases += [case("int8+ef", "tiny", 0, 1.02, 10.0), {**case("int8+ef", "tiny", 1, None, None), "status": "failed"}]
    head, target, met = render._s_codecs({"cases": cases})
    assert head == (
        "mean final loss / blocking fp32's (2 seeds): int4 tiny 1.000x, 8.000x fewer bytes; int8+ef tiny 1.020x, "
        "4.000x fewer bytes"
    )
    assert (target, met) == ("-", "-")

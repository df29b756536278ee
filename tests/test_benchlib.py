"""scripts/bench/benchlib.py: a benchmark stopped by SIGTERM still cleans up, even when the signal comes twice."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BODY = """
import sys, time
sys.path.insert(0, {bench!r})
from benchlib import exit_on_sigterm
exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("cleaning", flush=True)
    time.sleep(1.0)  # the second SIGTERM lands here
    open({done!r}, "w").write("cleaned up")
"""


@pytest.mark.timeout(60)
def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    done = tmp_path / "done"
    code = BODY.format(bench=str(ROOT / "scripts" / "bench"), done=str(done))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "cleaning"  # inside the finally block now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert done.read_text() == "cleaned up"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_peer_ended_on_its_final_json_state_else_its_last_record_s(tmp_path: Path) -> None:
    """The end-of-run heal moves a peer after its last metrics record: final.json says where it ended."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from benchlib import ended_on, healed_at_end, read_final

    (tmp_path / "healed.json").write_text('{"round": 3, "checksum": "aa", "healed_from": [3, "bb"]}')
    (tmp_path / "garbled.json").write_text("{not json")
    (tmp_path / "no_checksum.json").write_text('{"round": 3}')
    finals = [read_final(tmp_path / f"{name}.json") for name in ("healed", "garbled", "no_checksum", "missing")]
    assert finals[0] == {"round": 3, "checksum": "aa", "healed_from": [3, "bb"]} and finals[1:] == [None, None, None]
    records = [[{"checksum": "bb"}], [{"checksum": "aa"}], [{"checksum": "x"}, {"checksum": "cc"}], []]
    assert ended_on(records, finals) == ["aa", "aa", "cc"]  # the last peer wrote nothing: left out
    assert healed_at_end(finals) == 1

"""A closed run (swarm.authorized_keys), or one that asks for identity work (swarm.identity_work), next to a stranger
who knows its bootstrap address and config: real run_peer processes on 127.0.0.1. The admitted peers train together
and agree; the stranger (unlisted, or with a key without the work) never shares a group with them, gets no state from
them, and is told at join what to do (exit 2)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_swarm import checksums_by_step, finish, records, start_bootstrap, start_peer

from p2p_diloco.swarm.identity import Identity, work_bits

pytestmark = pytest.mark.swarm

ROUNDS = 400  # more than the admitted peers train before they are stopped: they train while the stranger tries
SETS = [f"train.rounds={ROUNDS}", "swarm.target_group_size=3"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("closed_by", ["list", "work"])
def test_a_stranger_never_joins_a_closed_run(spawn, tmp_path, closed_by):
    keys = [tmp_path / f"peer{k}.key" for k in range(3)]
    if closed_by == "list":
        ids = [Identity.load(k).peer_id for k in keys]
        allowed = tmp_path / "authorized_keys"
        allowed.write_text("".join(Identity.load(k).public_key.decode() + "\n" for k in keys[:2]))
        admission = f"swarm.authorized_keys={allowed}"
    else:  # two keys with 4 bits of work (~16 key generations each), the stranger's without them
        ids = [Identity.load(k, work=4).peer_id for k in keys[:2]]
        plain = (Identity.load(tmp_path / f"s{j}.key") for j in range(64))
        stranger = next(i for i in plain if work_bits(i.peer_id) < 4)
        keys[2] = Path(stranger.path)
        ids.append(stranger.peer_id)
        admission = "swarm.identity_work=4"
    # the admitted peers train on until the stranger is gone: started once they are at round 2, it must find them to
    # be refused (under load its start-up alone took over 15 s; a done peer stops lingering once its mates are done)
    closed = [*SETS, admission, "swarm.start_peers=2"]
    _, initial = start_bootstrap(spawn)
    listed = [
        start_peer(spawn, initial, tmp_path / f"peer{k}", *closed, flags=("--identity-path", str(keys[k])))
        for k in range(2)
    ]
    listed[0].wait_for_line(r"^round [2-9]/", timeout=180)
    # the stranger runs the same config without the allowlist or the work (nothing stops it from editing its copy);
    # it gives up after swarm.join_timeout of refusals (30 s by default: here 12, ~4 refused offers under load)
    stranger = start_peer(
        spawn, initial, tmp_path / "peer2", *SETS, "swarm.join_timeout=12", flags=("--identity-path", str(keys[2]))
    )
    rc = stranger.wait(timeout=120)
    for peer in listed:  # the stranger is gone: they have done their part (SIGTERM: checkpoint, exit 0)
        os.kill(peer.pid, signal.SIGTERM)
    finish(listed, timeout=60)
    said = "\n".join(stranger.stderr_lines)
    print("what the stranger sees:\n" + "\n".join(stranger.stderr_lines[-4:]))
    assert rc == 2, stranger.describe()
    assert "the peer sent no manifest" in said and "--print-public-key" in said, said
    assert "Traceback" not in said
    assert closed_by == "list" or "swarm.identity_work" in said, said
    assert not records(tmp_path / "peer2")  # it never trained a round
    by_step = checksums_by_step([tmp_path / "peer0", tmp_path / "peer1"])
    assert len(by_step) >= 2 and sorted(by_step) == list(range(1, len(by_step) + 1)), by_step
    assert all(len(c) == 1 for c in by_step.values()), by_step
    for k in range(2):
        for rec in records(tmp_path / f"peer{k}"):
            assert set(rec.get("group_peers", ids[:2])) <= set(ids[:2]), rec

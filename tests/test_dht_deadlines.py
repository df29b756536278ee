"""Every DHT call of a training peer has a deadline: a stranger's value that hivemind cannot parse inside a lookup
(its ``DHT.get`` never answers) and a dead DHT process read as "no answer" within ``swarm.dht_timeout``, with one
warning per kind of call, and the DHT node goes on working for everything else. Real DHT nodes on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time
from test_records import record

import p2p_diloco.swarm.dht as dht_module
from p2p_diloco.config import load_config
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.dht import shutdown_dht, start_dht, visible_maddrs
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.records import publish_record, read_records
from p2p_diloco.swarm.validators import owner_subkey

pytestmark = pytest.mark.swarm

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
TIMEOUT = 2.0


@pytest.mark.timeout(90)
def test_a_lookup_that_never_answers_and_a_dead_dht_are_bounded(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="p2p_diloco.dht")
    monkeypatch.setattr(dht_module, "_warned", set())  # warnings are once per kind and process: start afresh
    cfg = load_config(TINY, [f"swarm.dht_timeout={TIMEOUT}"])
    run_id = cfg.swarm.run_id
    identity = Identity.load()
    identity.close()
    # A node that signs but lacks the guard (validators.RecordGuard refuses this garbage on store): the worst case,
    # a lookup that never answers. tests/test_validators.py shows the guarded nodes never get there.
    validators, public_key = [RSASignatureValidator(identity.key)], owner_subkey(identity.public_key)
    dhts = []
    try:
        peer = start_dht([], new_swarm=True, host_maddrs=LOCAL, join_timeout=10, record_validators=validators)
        dhts.append(peer)
        members = Membership(peer, cfg, identity, "fp", {"model.hidden_size": 128})
        assert members.announce(RoundTag(0, "seed"))
        stranger = start_dht(visible_maddrs(peer), host_maddrs=LOCAL, join_timeout=10)
        dhts.append(stranger)
        # hivemind strips "[signature:...]" from every value a lookup returns: this one is no longer msgpack then
        expires = get_dht_time() + 60
        assert stranger.store(members.key, {"round": "[signature:x]"}, expires, subkey="evil")

        plain = peer.get(members.key, latest=True, return_future=True)  # as announcements.py reads, without a deadline
        with pytest.raises(concurrent.futures.TimeoutError):
            plain.result(timeout=2 * TIMEOUT)
        plain.cancel()

        started = time.monotonic()
        assert members.others() == {}  # "nobody else": the same as an empty run, within the deadline
        took = time.monotonic() - started
        assert TIMEOUT - 0.5 < took < TIMEOUT + 1.5, took
        assert members.vouches().peers == 0
        warned = [r.getMessage() for r in caplog.records if r.name == "p2p_diloco.dht"]
        assert len(warned) == 1, warned  # one line per kind of call, not one per call
        assert "reading the run's members from the DHT: no answer from the DHT within 2 s" in warned[0]

        # the node itself is fine: writes go through, other keys read back
        assert members.announce(RoundTag(1, "one"))
        assert publish_record(peer, run_id, record(identity.peer_id), ttl=60, public_key=public_key, timeout=TIMEOUT)
        found, bad = read_records(peer, run_id, timeout=10)
        assert set(found) == {identity.peer_id} and bad == 0

        # a dead DHT process: every call returns its "no answer" within the deadline, nothing raises
        shutdown_dht(peer)
        started = time.monotonic()
        assert members.others() == {}
        assert not members.announce(RoundTag(2, "two"))
        late = record(identity.peer_id, step=2)
        assert not publish_record(peer, run_id, late, ttl=60, public_key=public_key, timeout=1)
        took = time.monotonic() - started
        assert took < 2 * TIMEOUT + 1 + 3, took
        print(f"a lookup that never answers: {TIMEOUT:g}s deadline, took {took:.1f}s for 3 calls to a dead DHT")
    finally:
        for dht in reversed(dhts):
            shutdown_dht(dht)

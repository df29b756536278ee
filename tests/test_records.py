"""Signed per-peer records in the DHT: both peers' records are read back, a peer cannot overwrite another's
subkey nor report under another's id, malformed values are refused on store, and what does reach a reader
unparsed is counted. (tests/test_validators.py: the validators themselves, strangers' garbage, the bootstrap.)"""

from __future__ import annotations

import logging
import os
import time

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2p_diloco.swarm import dht as dht_module
from p2p_diloco.swarm.dht import shutdown_dht, start_dht, visible_maddrs, wait_for_peers
from p2p_diloco.swarm.identity import owner_of, peer_id_of
from p2p_diloco.swarm.records import (
    PeerRecord,
    _PeerRecordWire,
    metrics_key,
    parse_records,
    publish_record,
    read_records,
)
from p2p_diloco.swarm.validators import make_validators
from scripts.procs import descendants, wait_until

RUN = "test-run"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def record(peer_id: str, step: int = 1, **changes) -> PeerRecord:
    fields = dict(
        peer_id=peer_id,
        outer_step=step,
        train_loss=2.5,
        eval_loss=None,
        tokens=4096,
        total_tokens=8192,
        tokens_per_second=100.0,
        group_size=2,
        checksum="ab12",
        compute_seconds=3.0,
        matchmaking_seconds=0.5,
        allreduce_seconds=0.25,
        bytes_sent=1000,
        bytes_received=1000,
        peak_memory_bytes=1 << 20,
        time=time.time(),
    )
    fields.update(changes)
    return PeerRecord(**fields)


@pytest.mark.timeout(10)
def test_wire_schema_matches_peer_record():
    assert list(_PeerRecordWire.__fields__) == list(PeerRecord.model_fields)
    # ints given for float fields are dumped as floats, so the strict wire schema accepts them
    dumped = record("p", tokens_per_second=7, compute_seconds=1).model_dump()
    assert isinstance(dumped["tokens_per_second"], float) and isinstance(dumped["compute_seconds"], float)
    _PeerRecordWire.parse_obj(dumped)


def signer_key() -> tuple[bytes, str]:
    """A fresh signer's subkey and the peer id its records must carry (what make_validators gives a node)."""
    subkey = make_validators(RUN)[0].local_public_key
    return subkey, peer_id_of(owner_of(subkey))


@pytest.mark.timeout(10)
def test_parse_records_counts_garbage():
    (key_a, peer_a), (key_b, peer_b), (key_c, _) = signer_key(), signer_key(), signer_key()
    assert key_a != key_b  # a fresh RSA key per call: several DHTs in one process must not share one
    later = get_dht_time() + 60
    entries = {
        key_a: ValueWithExpiration(record(peer_a, step=1, time=100.0).model_dump(), later),
        key_b: ValueWithExpiration(record(peer_b, step=2, time=200.0).model_dump(), later),
        key_c: ValueWithExpiration(record(peer_a, step=9).model_dump(), later),  # c reports under a's id
        b"[owner:xyz]": ValueWithExpiration({"peer_id": "C"}, later),  # missing fields
        b"junk": ValueWithExpiration(record("D").model_dump(), later),  # not an owner subkey
        b"[owner:e]": ValueWithExpiration("not a dict", later),
    }
    records, bad = parse_records(entries)
    assert set(records) == {peer_a, peer_b} and records[peer_a].outer_step == 1
    assert bad == 4
    assert parse_records("plain value") == ({}, 1)
    assert parse_records(entries, max_age=60) == ({}, 4)  # time=100/200: long ago, not bad
    assert set(parse_records(entries, authorized=frozenset({peer_b}))[0]) == {peer_b}


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_records_signed_validated_and_read_back(caplog, monkeypatch):
    monkeypatch.setattr(dht_module, "_warned", set())  # warnings are once per kind and process: start afresh
    before = {pid for pid, _, _ in descendants(os.getpid())}
    validators_a, validators_b = make_validators(RUN), make_validators(RUN)
    key_a, key_b = validators_a[0].local_public_key, validators_b[0].local_public_key
    peer_a, peer_b = peer_id_of(owner_of(key_a)), peer_id_of(owner_of(key_b))
    dhts = []
    try:
        a = start_dht([], new_swarm=True, host_maddrs=LOCAL, join_timeout=10, record_validators=validators_a)
        dhts.append(a)
        b = start_dht(visible_maddrs(a), host_maddrs=LOCAL, join_timeout=10, record_validators=validators_b)
        dhts.append(b)
        wait_for_peers(b, 1, timeout=10)

        rec_a, rec_b = record(peer_a), record(peer_b, train_loss=float("nan"), eval_loss=3.0)
        assert publish_record(a, RUN, rec_a, ttl=60, public_key=key_a)
        assert publish_record(b, RUN, rec_b, ttl=60, public_key=key_b)  # a NaN loss is still reported
        for reader in (a, b):
            records, bad = read_records(reader, RUN, timeout=15)
            assert bad == 0 and set(records) == {peer_a, peer_b}
            assert records[peer_a] == rec_a
            assert records[peer_b].eval_loss == 3.0 and records[peer_b].train_loss != records[peer_b].train_loss

        # a training peer does not wait for the store (wait=False): it lands all the same, and a refused one is
        # warned about from the DHT's callback thread
        later = record(peer_a, step=7)
        assert publish_record(a, RUN, later, ttl=60, public_key=key_a, wait=False)
        deadline = time.monotonic() + 15
        while read_records(b, RUN, timeout=15)[0][peer_a].outer_step != 7:
            assert time.monotonic() < deadline, "the record stored in the background never arrived"
            time.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="p2p_diloco.dht"):
            assert publish_record(b, RUN, record(peer_a, step=98), ttl=60, public_key=key_a, wait=False)
            deadline = time.monotonic() + 15
            while "publishing the round record" not in caplog.text:
                assert time.monotonic() < deadline, "no warning for a refused background store"
                time.sleep(0.2)

        # b cannot write a's subkey (it cannot sign for a's key), nor report under a's id, nor break the schema
        assert not publish_record(b, RUN, record(peer_a, step=99), ttl=60, public_key=key_a)
        assert not publish_record(b, RUN, record(peer_a, step=99), ttl=60, public_key=key_b)
        expires = get_dht_time() + 60
        assert not a.store(metrics_key(RUN), {"peer_id": peer_a}, expires, subkey=key_a)
        wrong_type = dict(rec_a.model_dump(), tokens_per_second=5)  # int where the schema wants a float
        assert not a.store(metrics_key(RUN), wrong_type, expires, subkey=key_a)
        assert not a.store(metrics_key(RUN), "plain", expires)  # a plain value under the dictionary key

        # a node without the validators stores garbage: validating nodes refuse it, readers never see it
        c = start_dht(visible_maddrs(a), host_maddrs=LOCAL, join_timeout=10)
        dhts.append(c)
        c.store(metrics_key(RUN), {"garbage": True}, expires, subkey=b"[owner:nobody]")
        c.store(metrics_key(RUN), {"garbage": True}, expires, subkey=key_a)
        for reader in (a, b):
            records, bad = read_records(reader, RUN, timeout=15)
            assert set(records) == {peer_a, peer_b} and records[peer_a] == later
            assert bad == 0

        # a monitor: client mode, its own validators, reads everything and writes nothing
        monitor = start_dht(
            visible_maddrs(a),
            host_maddrs=LOCAL,
            join_timeout=10,
            client_mode=True,
            record_validators=make_validators(RUN),
        )
        dhts.append(monitor)
        records, bad = read_records(monitor, RUN, timeout=15)
        assert set(records) == {peer_a, peer_b} and bad == 0

        # what reaches a reader unparsed is counted (here: a reader without validators, unsigned garbage)
        other = "other-run"
        c.store(metrics_key(other), {"garbage": True}, expires, subkey=b"[owner:nobody]")
        assert read_records(c, other, timeout=15) == ({}, 1)
    finally:
        for dht in reversed(dhts):
            shutdown_dht(dht)

    def leftovers():
        return [
            (pid, name)
            for pid, _, name in descendants(os.getpid())
            if pid not in before and not name.startswith("torch_shm")
        ]

    assert wait_until(lambda: not leftovers(), 5), leftovers()

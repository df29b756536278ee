"""Signed per-peer records in the DHT: both peers' records are read back, a peer cannot overwrite another's
subkey, malformed values are refused on store, and what does reach a reader unparsed is counted."""

from __future__ import annotations

import os
import time

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2p_diloco.swarm.dht import shutdown_dht, start_dht, visible_maddrs, wait_for_peers
from p2p_diloco.swarm.records import (
    PeerRecord,
    _PeerRecordWire,
    make_record_validators,
    metrics_key,
    parse_records,
    publish_record,
    read_records,
)
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


@pytest.mark.timeout(10)
def test_parse_records_counts_garbage():
    (_, key_a), (_, key_b) = make_record_validators(RUN), make_record_validators(RUN)
    assert key_a != key_b  # a fresh RSA key per call: several DHTs in one process must not share one
    old, new = record("A", step=1, time=100.0), record("A", step=2, time=200.0)
    later = get_dht_time() + 60
    entries = {
        key_a: ValueWithExpiration(old.model_dump(), later),
        key_b: ValueWithExpiration(new.model_dump(), later),  # same peer id, newer: wins
        b"[owner:xyz]": ValueWithExpiration({"peer_id": "C"}, later),  # missing fields
        b"junk": ValueWithExpiration(record("D").model_dump(), later),  # not an owner subkey
        b"[owner:e]": ValueWithExpiration("not a dict", later),
    }
    records, bad = parse_records(entries)
    assert set(records) == {"A"} and records["A"].outer_step == 2
    assert bad == 3
    assert parse_records("plain value") == ({}, 1)
    assert parse_records(entries, max_age=60)[0] == {}  # time=100/200: long ago


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_records_signed_validated_and_read_back():
    before = {pid for pid, _, _ in descendants(os.getpid())}
    validators_a, key_a = make_record_validators(RUN)
    validators_b, key_b = make_record_validators(RUN)
    dhts = []
    try:
        a = start_dht([], new_swarm=True, host_maddrs=LOCAL, join_timeout=10, record_validators=validators_a)
        dhts.append(a)
        b = start_dht(visible_maddrs(a), host_maddrs=LOCAL, join_timeout=10, record_validators=validators_b)
        dhts.append(b)
        wait_for_peers(b, 1, timeout=10)

        rec_a, rec_b = record("peer-a"), record("peer-b", train_loss=float("nan"), eval_loss=3.0)
        assert publish_record(a, RUN, rec_a, ttl=60, public_key=key_a)
        assert publish_record(b, RUN, rec_b, ttl=60, public_key=key_b)  # a NaN loss is still reported
        for reader in (a, b):
            records, bad = read_records(reader, RUN, timeout=15)
            assert bad == 0 and set(records) == {"peer-a", "peer-b"}
            assert records["peer-a"] == rec_a
            assert records["peer-b"].eval_loss == 3.0 and records["peer-b"].train_loss != records["peer-b"].train_loss

        # b cannot write a's subkey (it cannot sign for a's key), nor store values that break the schema
        assert not publish_record(b, RUN, record("peer-a", step=99), ttl=60, public_key=key_a)
        expires = get_dht_time() + 60
        assert not a.store(metrics_key(RUN), {"peer_id": "peer-a"}, expires, subkey=key_a)
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
            assert set(records) == {"peer-a", "peer-b"} and records["peer-a"] == rec_a
            assert bad == 0

        # a monitor: client mode, its own validators, reads everything and writes nothing
        monitor = start_dht(
            visible_maddrs(a),
            host_maddrs=LOCAL,
            join_timeout=10,
            client_mode=True,
            record_validators=make_record_validators(RUN)[0],
        )
        dhts.append(monitor)
        records, bad = read_records(monitor, RUN, timeout=15)
        assert set(records) == {"peer-a", "peer-b"} and bad == 0

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

"""DHT validators (p2p_diloco/swarm/validators.py): unit checks on DHTRecord objects, then real nodes on 127.0.0.1:
a stranger without validators sends garbage straight to a validating node and to the bootstrap process (both refuse
it), stores more of it in its own storage, and readers with validators still get the honest records within their
deadline. Finally hivemind's own matchmaking and all-reduce still work between nodes that run the validators."""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
from test_records import record

from p2p_diloco.swarm import validators
from p2p_diloco.swarm.dht import parse_initial_peers, shutdown_dht, start_dht, visible_maddrs, wait_for_peers
from p2p_diloco.swarm.identity import owner_of, peer_id_of
from p2p_diloco.swarm.records import metrics_key, parse_records, publish_record, read_records
from p2p_diloco.swarm.validators import (
    MAX_VALUE_BYTES,
    CheckedOnce,
    CheckedSchema,
    MetricsBounds,
    RecordGuard,
    Verdicts,
    _RunSchema,
    fingerprint_key,
    make_validators,
    owner_subkey,
    settings_key,
)

RUN = "val-run"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
PLAIN = "stranger-plain"  # a key no schema knows
SETTINGS = {
    "fingerprint": "f00d" * 4,
    "summary": {"model.hidden_size": 128, "inner.lr": 0.001, "data.name": "tiny", "x.flag": True, "y.none": None},
}
FINGERPRINT = {
    "fingerprint": "f00d" * 4,
    "round": 3,
    "states": [[3, "ab12"], [2, "cd34"]],
    "client": False,
    "ready_at": 1.8e9,
    "done": False,
}


def peer_of(signer: RSASignatureValidator) -> str:
    return peer_id_of(owner_of(signer.local_public_key))


def dht_record(key: str, subkey: object, value: object, signer: RSASignatureValidator | None = None, **kw) -> DHTRecord:
    """A record as the DHT validates it: serialized subkey and value, signed by ``signer`` when given."""
    expiration = kw.get("expiration", get_dht_time() + 60)
    raw_value = kw.get("raw_value", MSGPackSerializer.dumps(value))
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), raw_value, expiration)
    return rec if signer is None else DHTRecord(rec.key, rec.subkey, signer.sign_value(rec), rec.expiration_time)


def honest(signer: RSASignatureValidator, step: int = 1, **changes) -> dict:
    return record(peer_of(signer), step=step, **changes).model_dump()


# ----------------------------------------------------------------------------------------- unit


def test_checked_once_gives_the_signature_verdict_and_verifies_a_record_once_per_process(monkeypatch) -> None:
    monkeypatch.setattr(validators, "VERDICTS", Verdicts(memory=3))
    writer = CheckedOnce(RSAPrivateKey())
    reader, other_node = CheckedOnce(RSAPrivateKey()), CheckedOnce(RSAPrivateKey())  # two DHT nodes of one process
    key = fingerprint_key(RUN)
    good = dht_record(key, writer.local_public_key, FINGERPRINT, signer=writer)
    forged = DHTRecord(good.key, good.subkey, good.value.replace(b"f00d", b"beef", 1), good.expiration_time)
    later = dht_record(key, writer.local_public_key, FINGERPRINT, signer=writer, expiration=get_dht_time() + 90)
    verified = []
    original = RSASignatureValidator.validate
    monkeypatch.setattr(RSASignatureValidator, "validate", lambda self, r: verified.append(r) or original(self, r))
    asked = zip([reader, other_node] * 3, (good, good, forged, forged, later, good), strict=True)
    verdicts = [node.validate(r) for node, r in asked]
    assert verdicts == [True, True, False, False, True, True]
    assert verified == [good, forged, later]  # each distinct record once in the process; its expiration is part of it
    reader.validate(dht_record(key, writer.local_public_key, {**FINGERPRINT, "round": 4}, signer=writer))
    kept = [reader.digest(r) in validators.VERDICTS for r in (good, forged, later)]
    assert len(validators.VERDICTS) == 3 and kept == [True, False, True]  # the least recently asked go first


def test_verdicts_stay_right_and_bounded_when_many_node_threads_ask_at_once() -> None:
    """The scale harness runs 32 DHT nodes' event loops as threads of one process, all asking VERDICTS (no lock)."""
    verdicts, errors = Verdicts(memory=50), []
    checked: list[bytes] = []
    together = threading.Barrier(8)

    def ask(worker: int) -> None:
        try:
            together.wait(timeout=30)  # all at once (a loaded machine started each only after the last had ended)
            for i in range(2000):
                # shared digests, more than the memory, each asked twice in a row: a worker alone hits too (the least
                # recently asked go first, so a cycle through 120 alone never hits: a loaded run saw hits == 0)
                digest = ((worker * 7 + i // 2) % 120).to_bytes(2, "little")
                expected = digest[0] % 3 == 0
                got = verdicts.verdict(digest, lambda d=digest, e=expected: checked.append(d) or e)
                if got != expected:
                    errors.append((digest, got))
        except Exception as exc:  # noqa: BLE001 - a race would show up here
            errors.append(exc)

    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to meet the races
    try:
        threads = [threading.Thread(target=ask, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(0.005)
    assert errors == [] and len(verdicts) <= 50
    assert verdicts.hits > 0 and len(checked) < 8 * 2000  # remembered verdicts were used


def test_schema_and_guard_verdicts_are_hivemind_s_and_remembered_per_content(monkeypatch) -> None:
    monkeypatch.setattr(validators, "VERDICTS", Verdicts(memory=64))
    signer = RSASignatureValidator(RSAPrivateKey())
    plain, checked = SchemaValidator(_RunSchema, prefix=RUN), CheckedSchema(_RunSchema, prefix=RUN)
    good = dht_record(fingerprint_key(RUN), signer.local_public_key, FINGERPRINT)
    loose = dht_record(fingerprint_key(RUN), signer.local_public_key, {**FINGERPRINT, "round": 3.0})  # a float
    later = DHTRecord(good.key, good.subkey, good.value, good.expiration_time + 30)  # a heartbeat: same content
    other = dht_record(PLAIN, "s", 1)  # a key the schema does not know: allowed, nothing remembered
    for rec in (good, loose, other):
        assert checked.validate(rec) == plain.validate(rec)
    assert [checked.validate(good), checked.validate(loose)] == [True, False]
    assert checked.validate(later) and validators.VERDICTS.hits == 3  # good, loose and the heartbeat's good
    guard = RecordGuard()
    bad = dht_record(PLAIN, "evil", None, raw_value=b"\xc1")
    assert [guard.validate(r) for r in (good, bad, good, bad)] == [True, False, True, False]
    assert validators.VERDICTS.hits == 5 and validators.VERDICTS.misses == 4


@pytest.mark.timeout(30)
def test_guard_refuses_signature_text_size_and_undecodable_values_and_passes_hivemind_records():
    guard, signer = RecordGuard(), RSASignatureValidator(RSAPrivateKey())
    peer = PeerID.from_base58("QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z").to_bytes()
    assert guard.priority > signer.priority  # sees the value before the signature is stripped
    # hivemind's averager keys: PeerID subkeys, a float priority / a bool looking_for_group; a plain value
    assert guard.validate(dht_record("grads.all_averagers", peer, 1.5))
    assert guard.validate(dht_record("grads.0b", peer, True))
    rec = dht_record("greeting", None, "hello")
    assert guard.validate(DHTRecord(rec.key, DHTProtocol.IS_REGULAR_VALUE, rec.value, rec.expiration_time))
    assert guard.validate(dht_record(metrics_key(RUN), signer.local_public_key, honest(signer), signer))

    cases = {
        "signature-text": dht_record(PLAIN, "evil", {"round": "[signature:xyz]"}),
        "size": dht_record(PLAIN, "evil", "x" * (MAX_VALUE_BYTES + 1)),
        "encoding": dht_record(PLAIN, "evil", None, raw_value=b"\xc1"),  # not msgpack
        "owner-key": dht_record(metrics_key(RUN), b"[owner:nobody]", {"garbage": True}),
    }
    trailing = dht_record(PLAIN, signer.local_public_key, "v", signer)
    cases["encoding "] = DHTRecord(trailing.key, trailing.subkey, b"\x01" + trailing.value, trailing.expiration_time)
    big_subkey = dht_record(PLAIN, b"s" * 5000, 1)
    cases["size "] = big_subkey
    for reason, rec in cases.items():
        assert guard.reason(rec) == reason.strip() and not guard.validate(rec), reason


@pytest.mark.timeout(30)
def test_metrics_bounds_on_records():
    bounds, signer, other = MetricsBounds(RUN), RSASignatureValidator(RSAPrivateKey()), RSASignatureValidator()
    key = metrics_key(RUN)

    def check(value: dict, **kw) -> str | None:
        return bounds.check(dht_record(key, signer.local_public_key, value, **kw))  # stripped: no signature

    now = get_dht_time()
    assert check(honest(signer, time=now)) is None
    assert check(honest(signer, time=now, train_loss=float("nan"), eval_loss=float("inf"))) is None  # diverging: ok
    assert check(honest(signer, time=now - 700), expiration=now + 60) is None  # a record_ttl of 760 s, read late
    assert "signer" in check(honest(other, time=now))  # names another peer
    assert "signer" in check(dict(honest(signer, time=now), peer_id="QmNobody"))
    assert "time" in check(honest(signer, time=1e18))
    assert "time" in check(honest(signer, time=now - 90000), expiration=now + 60)  # claims a lifetime over a day
    assert "time" in check(honest(signer, time=0.0))
    assert "time" in check(dict(honest(signer), time=float("nan")))
    assert "tokens_per_second" in check(honest(signer, time=now, tokens_per_second=float("inf")))
    assert "tokens_per_second" in check(dict(honest(signer, time=now), tokens_per_second=float("nan")))
    assert "compute_seconds" in check(honest(signer, time=now, compute_seconds=1e13))
    assert "outer_step" in check(honest(signer, 2**40, time=now))
    assert "outer_step" in check(dict(honest(signer, time=now), outer_step=1e9))
    assert "tokens" in check(honest(signer, time=now, tokens=2**62))
    assert check(honest(signer, 10**9, time=now)) is None  # big but possible: parse_records judges it
    assert "mapping" in check("plain")
    assert not bounds.validate(dht_record(key, signer.local_public_key, None, raw_value=b"\xc1"))  # never raises
    elsewhere = dht_record("other_metrics", signer.local_public_key, {"anything": 1})
    assert bounds.validate(elsewhere)  # only its run's key


@pytest.mark.timeout(30)
def test_run_schemas_through_the_whole_validator_set():
    validators = make_validators(RUN, None)
    node, signer = CompositeValidator(validators), validators[0]
    other = make_validators(RUN, None)[0]
    assert signer.local_public_key != other.local_public_key  # a fresh key per call
    assert make_validators([RUN, RUN, "run2"])  # several runs, duplicates merged

    def ok(key: str, value: object, by: RSASignatureValidator = signer, subkey: object = None) -> bool:
        sub = by.local_public_key if subkey is None else subkey
        return node.validate(dht_record(key, sub, value, by if owner_of(sub) is not None else None))

    assert ok(metrics_key(RUN), honest(signer, time=get_dht_time()))
    assert ok(metrics_key(RUN), honest(signer, time=get_dht_time(), train_loss=float("nan")))
    assert not ok(metrics_key(RUN), dict(honest(signer, time=get_dht_time()), tokens_per_second=5))  # int
    assert not ok(metrics_key(RUN), honest(other, time=get_dht_time()))  # another peer's id
    assert not ok(metrics_key(RUN), honest(signer, time=get_dht_time()), subkey="plain")  # unsigned subkey

    fp = fingerprint_key(RUN)
    assert ok(fp, FINGERPRINT)
    assert ok(fp, dict(FINGERPRINT, states=[]))
    assert ok(fp, dict(FINGERPRINT, client=True))
    assert ok(fp, dict(FINGERPRINT, ready_at=0.0))
    assert ok(fp, dict(FINGERPRINT, done=True))
    bad = [
        {k: v for k, v in FINGERPRINT.items() if k != "done"},
        dict(FINGERPRINT, done=0),
        {k: v for k, v in FINGERPRINT.items() if k != "client"},  # every field is required (a default is a change)
        {k: v for k, v in FINGERPRINT.items() if k != "ready_at"},
        dict(FINGERPRINT, ready_at=-1.0),
        dict(FINGERPRINT, ready_at=float("inf")),
        dict(FINGERPRINT, ready_at=float("nan")),
        dict(FINGERPRINT, ready_at=5),
        dict(FINGERPRINT, client=1),
        dict(FINGERPRINT, extra=1),
        {k: v for k, v in FINGERPRINT.items() if k != "states"},
        dict(FINGERPRINT, fingerprint="x" * 65),
        dict(FINGERPRINT, fingerprint=5),
        dict(FINGERPRINT, round=-1),
        dict(FINGERPRINT, round=3.0),
        dict(FINGERPRINT, round=True),
        dict(FINGERPRINT, summary=SETTINGS["summary"]),  # the summary is read from the settings key only
        dict(FINGERPRINT, states=[[i, "c"] for i in range(9)]),
        dict(FINGERPRINT, states=[[1, "c", 2]]),
        dict(FINGERPRINT, states=[[-1, "c"]]),
        dict(FINGERPRINT, states=[[True, "c"]]),
        dict(FINGERPRINT, states=[[1, "c" * 65]]),
        dict(FINGERPRINT, states=[[1.0, "c"]]),
        "plain",
    ]
    for value in bad:
        assert not ok(fp, value), value
    assert not ok(fp, FINGERPRINT, subkey="peer-a")  # announcements are signed now
    settings = settings_key(RUN)
    assert ok(settings, SETTINGS) and ok(settings, dict(SETTINGS, summary={"a": float("nan")}))
    for value in [
        {k: v for k, v in SETTINGS.items() if k != "summary"},
        dict(SETTINGS, round=3),  # an announcement's field: not here
        dict(SETTINGS, fingerprint="x" * 65),
        dict(SETTINGS, summary={f"k{i}": i for i in range(65)}),
        dict(SETTINGS, summary={"k" * 65: 1}),
        dict(SETTINGS, summary={"k": "v" * 257}),
        dict(SETTINGS, summary={"k": [1, 2]}),
        dict(SETTINGS, summary={"k": {"nested": 1}}),
        dict(SETTINGS, summary=[["k", 1]]),
    ]:
        assert not ok(settings, value), value
    assert not ok(settings, SETTINGS, subkey="peer-a")  # signed, as announcements
    # a plain key: anything sane, signed or not
    assert ok(PLAIN, {"whatever": [1, 2]}) and ok(PLAIN, 1.5, subkey="plain-subkey")


@pytest.mark.timeout(30)
def test_parse_records_binds_peer_ids_to_signers_honours_authorized_and_drops_far_ahead_steps():
    a, b, c, d = (RSASignatureValidator(RSAPrivateKey()) for _ in range(4))
    later = get_dht_time() + 60

    def entry(signer: RSASignatureValidator, value: dict) -> tuple[bytes, ValueWithExpiration]:
        return signer.local_public_key, ValueWithExpiration(value, later)

    entries = dict([entry(a, honest(a, 5)), entry(b, honest(b, 6)), entry(c, honest(c, 10**9))])
    records, bad = parse_records(entries)
    assert set(records) == {peer_of(a), peer_of(b)} and bad == 1  # c: far above the median of 3
    assert parse_records(dict([entry(a, honest(a, 5)), entry(c, honest(c, 10**9))]))[1] == 0  # 2: no median rule
    forged = dict([entry(a, honest(a)), entry(d, honest(a, 7))])  # d's subkey, a's peer id
    records, bad = parse_records(forged)
    assert set(records) == {peer_of(a)} and records[peer_of(a)].outer_step == 1 and bad == 1
    records, bad = parse_records(entries, authorized=frozenset({peer_of(a)}))
    assert set(records) == {peer_of(a)} and bad == 0  # others are ignored, not bad
    assert parse_records(entries, authorized=frozenset())[0] == {}


# ----------------------------------------------------------------------------------------- real nodes


def _bytes(value: bytes | int) -> bytes:
    # an int stands for a msgpack string of that many bytes, made in the DHT process: hivemind's pipe to the DHT
    # process is non-blocking and drops messages over its buffer (64 KiB) with BlockingIOError
    return value if isinstance(value, bytes) else MSGPackSerializer.dumps("x" * value)


def run(dht, coroutine) -> object:  # noqa: ANN001
    """``dht.run_coroutine`` with a deadline (it has none of its own)."""
    return dht.run_coroutine(coroutine, return_future=True).result(timeout=15)


async def _store_at(peer: str, key: str, subkey: object, value: bytes | int, expiration: float, _dht, node) -> list:
    """In the stranger's DHT process: one rpc_store straight to ``peer``; its store_ok list (None: no answer)."""
    found = await node.protocol.call_store(
        PeerID.from_base58(peer), [DHTID.generate(source=key)], [_bytes(value)], [expiration], subkeys=[subkey]
    )
    return list(found) if found is not None else None


async def _keep(key: str, subkey: object, value: bytes | int, expiration: float, _dht, node) -> bool:
    """In the stranger's DHT process: put the raw record into its own storage (it answers lookups with it)."""
    key_id = DHTID.generate(source=key)
    if subkey is None:
        return node.protocol.storage.store(key_id, _bytes(value), expiration)
    return node.protocol.storage.store_subkey(key_id, subkey, _bytes(value), expiration)


async def _local_subkeys(key: str, _dht, node) -> list:
    """In a node's DHT process: the subkeys its own storage holds under ``key``."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None:
        return []
    value = found.value
    return [subkey for subkey, _ in value.items()] if hasattr(value, "items") else [DHTProtocol.IS_REGULAR_VALUE]


def garbage(now: float) -> list[tuple[str, str, object, bytes | int]]:
    """(name, key, subkey, raw value bytes) a stranger sends: unsigned text that hangs readers, wrong types, huge
    values, undecodable bytes, and values signed by the stranger's own key that break the schema or the bounds."""
    rogue = RSASignatureValidator(RSAPrivateKey())
    victim = RSASignatureValidator(RSAPrivateKey())
    hang = MSGPackSerializer.dumps({"round": "[signature:xyz]"})
    items = []
    for key in (metrics_key(RUN), fingerprint_key(RUN), PLAIN):
        items += [
            (f"{key}: signature text", key, b"evil", hang),  # bytes subkeys: a DHT dict cannot mix str and bytes
            (f"{key}: signature text, owner-less subkey", key, b"[owner:nobody]", hang),
            (f"{key}: huge", key, b"huge", 2 * MAX_VALUE_BYTES),
            (f"{key}: not msgpack", key, b"raw", b"\xc1\xc1"),
        ]
    items.append((f"{PLAIN}: plain value, signature text", PLAIN, None, hang))

    def signed(name: str, key: str, value: object) -> tuple[str, str, object, bytes]:
        rec = dht_record(
            key, rogue.local_public_key, value, rogue, expiration=now + 60
        )  # signed for the store's expiry
        return name, key, rogue.local_public_key, rec.value

    m = metrics_key(RUN)
    items += [
        signed("metrics: wrong types", m, {"peer_id": peer_of(rogue), "train_loss": "lots"}),
        signed("metrics: another peer's id", m, honest(victim, time=now)),
        signed("metrics: time 1e18", m, honest(rogue, time=1e18)),
        signed("metrics: tokens/s inf", m, honest(rogue, time=now, tokens_per_second=float("inf"))),
        signed("metrics: outer_step 1e9 (float)", m, dict(honest(rogue, time=now), outer_step=1e9)),
        signed("metrics: a fingerprint value", m, FINGERPRINT),
        signed("fingerprint: extra key", fingerprint_key(RUN), dict(FINGERPRINT, extra=1)),
        signed("fingerprint: a metrics value", fingerprint_key(RUN), honest(rogue, time=now)),
    ]
    return items


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_stranger_garbage_is_refused_by_peers_and_the_bootstrap_and_readers_never_hang(spawn):
    env = {k: v for k, v in os.environ.items() if k != "P2P_DILOCO_INITIAL_PEERS"}
    boot = spawn([sys.executable, "-m", "peers.run_bootstrap", *("--host-maddrs", LOCAL[0], "--run-id", RUN)], env=env)
    initial = parse_initial_peers([boot.wait_for_line(r"^--initial-peers .*$", timeout=40).group(0)])
    boot_id = initial[0].rsplit("/", 1)[-1]
    dhts = []
    try:
        validators = make_validators(RUN, None)
        peer = start_dht(initial, host_maddrs=LOCAL, join_timeout=10, record_validators=validators)
        dhts.append(peer)
        stranger = start_dht(initial, host_maddrs=LOCAL, join_timeout=10)  # no validators: stores anything
        dhts.append(stranger)
        reader_validators = make_validators(RUN, None)
        reader = start_dht(
            initial, host_maddrs=LOCAL, join_timeout=10, client_mode=True, record_validators=reader_validators
        )
        dhts.append(reader)
        wait_for_peers(peer, 2, timeout=15)
        wait_for_peers(stranger, 2, timeout=15)
        targets = {"bootstrap": boot_id, "peer": str(peer.peer_id)}

        now = get_dht_time()
        expires = now + 60
        # honest writes go through the validating nodes: the peer's own record and announcement, two more peers'
        subkey = validators[0].local_public_key
        assert owner_subkey(owner_of(subkey)) == subkey
        assert publish_record(peer, RUN, record(peer_of(validators[0]), time=now), ttl=60, public_key=subkey)
        assert peer.store(fingerprint_key(RUN), FINGERPRINT, expires, subkey=subkey)
        second, far = RSASignatureValidator(RSAPrivateKey()), RSASignatureValidator(RSAPrivateKey())
        for signer, step in ((second, 2), (far, 10**9)):  # 10**9 passes the validators; readers drop it
            value = honest(signer, step, time=now)
            rec = dht_record(metrics_key(RUN), signer.local_public_key, value, signer, expiration=expires)
            for name, target in targets.items():
                sent = functools.partial(_store_at, target, metrics_key(RUN), signer.local_public_key, rec.value)
                assert run(stranger, functools.partial(sent, expires)) == [True], name
        control = functools.partial(_store_at, boot_id, PLAIN, b"fine", MSGPackSerializer.dumps({"ok": 1}), expires)
        assert run(stranger, control) == [True]  # the bootstrap answers and takes sane records

        # garbage sent straight to each validating node is refused there
        items = garbage(now)
        for name, key, subkey, value in items:
            for target_name, target in targets.items():
                answer = run(stranger, functools.partial(_store_at, target, key, subkey, value, expires))
                assert answer == [False], (target_name, name, answer)
        for key in (metrics_key(RUN), fingerprint_key(RUN)):
            held = run(peer, functools.partial(_local_subkeys, key))
            assert all(owner_of(s) is not None for s in held), held  # only signed subkeys, all of honest writers
        # ... and the stranger keeps all of it in its own storage, where every lookup finds it
        for _, key, subkey, value in items:
            run(stranger, functools.partial(_keep, key, subkey, value, expires))
        assert b"evil" in run(stranger, functools.partial(_local_subkeys, metrics_key(RUN)))

        honest_ids = {peer_of(validators[0]), peer_of(second)}
        for node in (reader, peer):
            started = time.monotonic()
            found, bad = read_records(node, RUN, timeout=10)
            took = time.monotonic() - started
            assert set(found) == honest_ids and bad == 1 and took < 10, (found.keys(), bad, took)  # bad: the 10**9
            found, bad = read_records(node, RUN, timeout=10, authorized=frozenset({peer_of(second)}))
            assert set(found) == {peer_of(second)} and bad == 0
            got = node.get(fingerprint_key(RUN), latest=True, return_future=True).result(timeout=10)
            assert got is not None and list(got.value) == [validators[0].local_public_key]
            assert got.value[validators[0].local_public_key].value == FINGERPRINT
            plain = node.get(PLAIN, latest=True, return_future=True).result(timeout=10)
            assert plain is None or all(v.value == {"ok": 1} for v in plain.value.values()), plain
        print(f"{len(items)} kinds of garbage refused by the peer and the bootstrap; readers answered in {took:.1f} s")
    finally:
        for dht in reversed(dhts):
            shutdown_dht(dht)
        if boot.popen.poll() is None:
            os.kill(boot.pid, signal.SIGTERM)
            assert boot.wait(timeout=15) == 0, boot.describe()
    assert "Traceback" not in boot.stderr, boot.stderr


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_hivemind_matchmaking_and_allreduce_pass_the_validators():
    dhts, averagers = [], []
    try:
        first = start_dht(
            [], new_swarm=True, host_maddrs=LOCAL, join_timeout=10, record_validators=make_validators(RUN)
        )
        dhts.append(first)
        second = start_dht(
            visible_maddrs(first), host_maddrs=LOCAL, join_timeout=10, record_validators=make_validators(RUN)
        )
        dhts.append(second)
        wait_for_peers(second, 1, timeout=10)
        prefix = f"{RUN}_f00d"
        for k, dht in enumerate(dhts):
            averagers.append(
                DecentralizedAverager(
                    [torch.full((64,), float(k))],
                    dht,
                    prefix=prefix,
                    target_group_size=2,
                    min_group_size=2,
                    min_matchmaking_time=3.0,
                    request_timeout=1.0,
                    allreduce_timeout=15.0,
                    next_chunk_timeout=5.0,
                    declare_state_period=1.0,
                    start=True,
                )
            )
        results: list[object] = [None, None]

        def step(k: int) -> None:
            try:
                results[k] = averagers[k].step(timeout=30)
            except Exception as exc:  # noqa: BLE001
                results[k] = exc

        threads = [threading.Thread(target=step, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert all(isinstance(r, dict) and len(r) == 2 for r in results), results  # a group of 2 formed and reduced
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert torch.allclose(tensors[0], torch.full((64,), 0.5)), tensors[0][:4]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the state-sharing declarations went through the validators too
            found = first.get(f"{prefix}.all_averagers", latest=True)
            if found is not None and len(found.value) == 2:
                break
            time.sleep(0.5)
        assert found is not None and len(found.value) == 2 and all(math.isfinite(v.value) for v in found.value.values())
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            shutdown_dht(dht)

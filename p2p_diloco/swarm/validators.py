"""DHT record validators: what every node of the swarm (training peer, monitor, bootstrap) accepts and returns.

Inputs:  hivemind ``DHTRecord`` objects (key = DHTID bytes of the hashed key, subkey and value = msgpack bytes; a
         signed value carries ``[signature:...]`` at its end), handed to ``validate`` by the DHT process whenever a
         remote node asks to store a record and whenever a lookup brings a record back.
Output:  ``make_validators(run_id, identity)`` -> the list to give ``start_dht(record_validators=...)``:
           CheckedOnce            signed subkeys (``[owner:<key>]``) writable only by their key (priority 10;
                                  hivemind's RSASignatureValidator, each record's verdict remembered)
           RecordGuard            every key, hivemind's own included (priority 20, so it sees the raw value)
           CheckedSchema          ``{run_id}_metrics``, ``{run_id}_fingerprint`` and ``{run_id}_settings``
                                  (hivemind's SchemaValidator: pydantic.v1, strict types; each record's verdict
                                  remembered)
           MetricsBounds          ``{run_id}_metrics``: the record is its signer's, with sane numbers (priority -10)
         ``owner_subkey(public_key)`` is the subkey a node signs its records with.
State:   the signing key; ``VERDICTS``, the last verdicts of the pure checks (signature, guard, schema), one memory
         for every DHT node of the process (a peer runs one; the scale harness 16). MetricsBounds reads the clock
         (``get_dht_time``) and is asked every time.
Failure: ``validate`` never raises: a record it cannot parse is refused (False). A refused store makes
         ``DHT.store`` return False on the writer; a refused record in a lookup answer makes the reader drop that
         node's whole answer for the key (hivemind stops at the first bad subkey) and keep the other nodes'.

What RecordGuard refuses, and why (hivemind 1.1.12):
- a value over MAX_VALUE_BYTES (64 KiB) or a subkey over MAX_SUBKEY_BYTES (4 KiB). Our biggest value is a
  settings record: ~1.2 KB in practice, at most ~21 KB by its schema (64 summary entries of 64 + 256 characters,
  the signature); an announcement under ``{run_id}_fingerprint`` is ~0.6 KB (8 states, the signature). Metrics
  records are ~0.6 KB, hivemind's averager values are a float or a bool.
  Subkeys: an owner subkey is ~400 bytes (RSA-2048; ~720 for RSA-4096), a PeerID 38 bytes.
- an unsigned record (no ``[owner:...]`` in key or subkey) whose value holds ``[signature:``: every node's lookup
  strips that text from every value it returns (``RSASignatureValidator.strip_value``), the rest is no longer
  msgpack, the exception is raised inside the search and ``DHT.get`` never resolves.
- a value that is not exactly one msgpack object once the signature is stripped, or a subkey that is not msgpack:
  the same never-resolving lookup, from a node that sends raw bytes.
- an owner subkey whose key is not an RSA public key: RSASignatureValidator would raise inside the lookup.
hivemind's own records pass: ``{prefix}.all_averagers`` (subkey PeerID bytes, value a float priority),
``{prefix}.0b<bits>`` (subkey PeerID bytes, value the bool looking_for_group).

MetricsBounds (``{run_id}_metrics``; it sees the value after the signature was stripped, the schema has checked
the types): the record's ``peer_id`` is ``identity.peer_id_of`` the subkey's owner key (nobody can report under
another peer's id); ``time`` is at most MAX_CLOCK_SKEW (600 s) ahead of this node's clock and at most 600 s plus the
record's own DHT lifetime (``expiration_time - time``, capped at MAX_RECORD_TTL, one day) behind it: hivemind assumes
clocks agree within seconds, and a record read back late is legitimately as old as its lifetime, so a plain
"within 600 s of now" would refuse honest records once ``swarm.record_ttl`` exceeds 600 s; ``tokens_per_second``
and the ``*_seconds`` fields finite, >= 0 and below MAX_RATE (1e12); ``outer_step`` < MAX_STEP (2**40); the other
counts below 2**62. Losses are not bounded: a NaN or infinite loss is how a diverging peer still reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pydantic.v1 as pydantic_v1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.swarm.identity import Identity, peer_id_of, signer_of
from p2p_diloco.swarm.records import _PeerRecordWire, metrics_key

__all__ = [
    "MAX_VALUE_BYTES",
    "MAX_SUBKEY_BYTES",
    "MAX_CLOCK_SKEW",
    "MAX_RECORD_TTL",
    "MAX_RATE",
    "MAX_STEP",
    "MAX_STATES",
    "States",
    "VERDICTS",
    "CheckedOnce",
    "CheckedSchema",
    "RecordGuard",
    "MetricsBounds",
    "fingerprint_key",
    "settings_key",
    "make_validators",
    "owner_subkey",
]

MAX_VALUE_BYTES = 64 * 1024
MAX_SUBKEY_BYTES = 4 * 1024
MAX_CLOCK_SKEW = 600.0  # seconds
MAX_RECORD_TTL = 86400.0  # seconds: the longest DHT lifetime a metrics record may claim (swarm.record_ttl)
MAX_RATE = 1e12  # tokens per second, seconds
MAX_STEP = 2**40
MAX_STATES = 8  # the recent outer states one announcement may vouch for (membership.Membership keeps this many)
MAX_COUNT = 2**62  # tokens, bytes, group size

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_SIGNATURE_RE = re.compile(re.escape(RSASignatureValidator.SIGNATURE_FORMAT).replace(b"_value_", rb"(.+?)"))
_SIGNATURE_TEXT = RSASignatureValidator.SIGNATURE_FORMAT.split(b"_value_")[0]  # b"[signature:"


class Verdicts:
    """The last ``memory`` verdicts of pure record checks, by a digest of what each check reads (its name in front), for
    every DHT node of this process: each lookup of the run's members brings back every peer's announcement from each
    node it asks, unchanged until that peer announces again, and every node of the process checked each anew (at 32
    peers in the scale harness, 16 nodes a process, the checks took ~40% of a host's CPU, py-spy). A stranger's flood
    of distinct records costs at most ``memory`` digests here.

    Thread-safe without a lock: the nodes' event loops run in threads, and each OrderedDict call is atomic under the
    GIL (bytes keys: no Python code runs inside it). A lock taken on every lookup was itself the hot spot: at 64
    peers, 32 a process, 22% of a host's samples waited on it (py-spy), a holder preempted by the GIL's switch
    keeping 31 event loops out. Two threads asking for one new digest at once may both run the check (the same
    verdict); ``hits`` and ``misses`` are exact with one thread, approximate with several."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.hits = self.misses = 0
        self._seen: OrderedDict[bytes, bool] = OrderedDict()

    def verdict(self, digest: bytes, check: Callable[[], bool]) -> bool:
        """The remembered verdict for ``digest``, else ``check()``'s (remembered; the least recently asked go first)."""
        known = self._seen.get(digest)
        if known is not None:
            with contextlib.suppress(KeyError):  # another thread just let it go
                self._seen.move_to_end(digest)
            self.hits += 1
            return known
        self.misses += 1
        verdict = bool(check())
        self._seen[digest] = verdict
        with contextlib.suppress(KeyError):  # another thread emptied it meanwhile
            while len(self._seen) > self.memory:
                self._seen.popitem(last=False)
        return verdict

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._seen

    def __len__(self) -> int:
        return len(self._seen)


VERDICTS = Verdicts(16384)


def _content_digest(check: bytes, record: DHTRecord) -> bytes:
    """What a check of key, subkey and value (not the expiration) reads, as a VERDICTS key."""
    h = hashlib.sha256(check)
    for part in (record.key, record.subkey, record.value):
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def fingerprint_key(run_id: str) -> str:
    return f"{run_id}_fingerprint"


def settings_key(run_id: str) -> str:
    return f"{run_id}_settings"


def owner_subkey(public_key: bytes) -> bytes:
    """The signed subkey of ``public_key`` (``Identity.public_key``): what RSASignatureValidator signs for."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key)


def _decodes(data: bytes) -> bool:
    try:
        MSGPackSerializer.loads(data)  # raises ExtraData for trailing bytes, ValueError/... for garbage
    except Exception:  # noqa: BLE001 - a stranger's bytes
        return False
    return True


# ----------------------------------------------------------------------------------------- every key


class RecordGuard(RecordValidatorBase):
    """Run-agnostic checks of every record (see the module docstring); ``reason`` says why one is refused."""

    def reason(self, record: DHTRecord) -> str | None:
        """None for an acceptable record, else a one-word reason: size, signature-text, encoding or owner-key."""
        key, subkey, value = record.key, record.subkey, record.value
        if not isinstance(key, bytes) or not isinstance(subkey, bytes) or not isinstance(value, bytes):
            return "encoding"
        if len(value) > MAX_VALUE_BYTES or len(subkey) > MAX_SUBKEY_BYTES:
            return "size"
        owners = _OWNER_RE.findall(key) + _OWNER_RE.findall(subkey)
        if not owners:
            if _SIGNATURE_TEXT in value:
                return "signature-text"
            payload = value
        else:
            if any(peer_id_of(owner) is None for owner in set(owners)):
                return "owner-key"
            payload = _SIGNATURE_RE.sub(b"", value)  # what every reader's strip_value will leave
        if subkey not in DHTProtocol.RESERVED_SUBKEYS and not _decodes(subkey):
            return "encoding"
        if not _decodes(payload):
            return "encoding"
        return None

    def validate(self, record: DHTRecord) -> bool:
        return VERDICTS.verdict(_content_digest(b"guard", record), lambda: self._acceptable(record))

    def _acceptable(self, record: DHTRecord) -> bool:
        try:
            return self.reason(record) is None
        except Exception:  # noqa: BLE001 - never raise inside the DHT
            return False

    @property
    def priority(self) -> int:
        return 20  # above RSASignatureValidator (10): validation runs by decreasing priority, before the strip


# ----------------------------------------------------------------------------------------- run schemas


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Checked:
    """A pydantic.v1 field type checked by the subclass's ``check`` (which returns the value unchanged)."""

    @classmethod
    def __get_validators__(cls):  # noqa: ANN206 - pydantic.v1 protocol
        yield cls.check


class _Summary(_Checked):
    """A fingerprint summary: a dict of <= 64 entries, str keys <= 64 chars, JSON scalar values (str <= 256)."""

    @staticmethod
    def check(value: Any) -> Any:
        if not isinstance(value, dict) or len(value) > 64:
            raise ValueError("summary must be a dict of at most 64 entries")
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > 64:
                raise ValueError("summary keys must be str of at most 64 characters")
            if isinstance(v, str):
                if len(v) > 256:
                    raise ValueError("summary strings must be at most 256 characters")
            elif not (v is None or isinstance(v, bool | float) or (_is_int(v) and abs(v) < 2**63)):
                raise ValueError(f"summary value of {k!r} is not a JSON scalar")
        return value  # unchanged: SchemaValidator compares it with the wire value


class States(_Checked):
    """A peer's recent outer states: a list of <= 8 pairs [round int >= 0, checksum str <= 64]. ``check`` raises
    ValueError for anything else (announcements.py reads announcements through it too)."""

    @staticmethod
    def check(value: Any) -> Any:
        if not isinstance(value, list | tuple) or len(value) > MAX_STATES:
            raise ValueError(f"states must be a list of at most {MAX_STATES} pairs")
        for pair in value:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError("each state must be a pair [round, checksum]")
            round_, checksum = pair
            if not (_is_int(round_) and 0 <= round_ < MAX_STEP):
                raise ValueError("a state's round must be an int in [0, 2**40)")
            if not isinstance(checksum, str) or len(checksum) > 64:
                raise ValueError("a state's checksum must be a str of at most 64 characters")
        return value


class _SettingsWire(pydantic_v1.BaseModel):
    """One peer's settings under ``{run_id}_settings``: its fingerprint and the fields it hashes (the summary), read
    only to name what differs when a fingerprint does (swarm/membership.py writes it)."""

    fingerprint: pydantic_v1.constr(strict=True, max_length=64)
    summary: _Summary

    class Config:
        extra = pydantic_v1.Extra.forbid


class _FingerprintWire(pydantic_v1.BaseModel):
    """One peer's announcement under ``{run_id}_fingerprint`` (swarm/membership.py writes it). Read by every
    peer several times a round, by every DHT node on a lookup's way: what is read only once (the settings summary)
    lives under ``{run_id}_settings``."""

    fingerprint: pydantic_v1.constr(strict=True, max_length=64)
    round: pydantic_v1.conint(strict=True, ge=0, lt=MAX_STEP)
    states: States
    # a client-mode peer (not reachable): it vouches, but serves no state. Required like every field: hivemind's
    # SchemaValidator refuses a value that parsing changes, and a filled-in default is a change (every announcement
    # without it was dropped, so joiners saw no member)
    client: pydantic_v1.StrictBool
    # when this peer's current inner steps end, in DHT time (0.0: not known yet): who to expect at a round's
    # matchmaking and when (readiness.Readiness.expected_members, group_wait)
    ready_at: pydantic_v1.confloat(strict=True, ge=0.0, lt=float(MAX_STEP))
    # this peer's run is over (it serves its final state while it lingers, then leaves): no matchmaking waits for it
    done: pydantic_v1.StrictBool

    class Config:
        extra = pydantic_v1.Extra.forbid


class _RunSchema(pydantic_v1.BaseModel):
    # SchemaValidator(prefix=run_id) maps each field to the DHT key f"{run_id}_{field}"
    metrics: dict[BytesWithPublicKey, _PeerRecordWire]
    fingerprint: dict[BytesWithPublicKey, _FingerprintWire]
    settings: dict[BytesWithPublicKey, _SettingsWire]


# ----------------------------------------------------------------------------------------- metrics bounds


def _finite_rate(value: Any) -> bool:
    number = isinstance(value, float | int) and not isinstance(value, bool)
    return number and math.isfinite(value) and 0 <= value < MAX_RATE


class MetricsBounds(RecordValidatorBase):
    """``{run_id}_metrics``: the record is its signer's and its numbers are sane (see the module docstring)."""

    RATES = ("tokens_per_second", "compute_seconds", "matchmaking_seconds", "allreduce_seconds")
    COUNTS = ("tokens", "total_tokens", "group_size", "bytes_sent", "bytes_received", "peak_memory_bytes")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._key = DHTID.generate(source=metrics_key(run_id)).to_bytes()

    def check(self, record: DHTRecord, now: float | None = None) -> str | None:
        """None when ``record`` (its value already stripped of the signature) passes, else what fails."""
        if record.key != self._key:
            return None
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return "a plain value where per-peer subkeys belong"
        subkey = MSGPackSerializer.loads(record.subkey)
        value = MSGPackSerializer.loads(record.value)
        if not isinstance(value, dict):
            return "not a mapping"
        signer = signer_of(subkey)
        if signer is None or value.get("peer_id") != signer:
            return "peer_id is not the signer's"
        now = get_dht_time() if now is None else now
        t = value.get("time")
        if not isinstance(t, float | int) or isinstance(t, bool) or not math.isfinite(t):
            return "time is not a finite number"
        lifetime = min(max(record.expiration_time - t, 0.0), MAX_RECORD_TTL)
        if not (now - MAX_CLOCK_SKEW - lifetime <= t <= now + MAX_CLOCK_SKEW):
            return f"time {t!r} is too far from this node's clock {now:.0f}"
        for name in self.RATES:
            if not _finite_rate(value.get(name)):
                return f"{name} is not finite in [0, {MAX_RATE:g})"
        step = value.get("outer_step")
        if not (_is_int(step) and 0 <= step < MAX_STEP):
            return "outer_step is not an int in [0, 2**40)"
        for name in self.COUNTS:
            count = value.get(name)
            if not (_is_int(count) and 0 <= count < MAX_COUNT):
                return f"{name} is not an int in [0, 2**62)"
        return None

    def validate(self, record: DHTRecord) -> bool:
        try:
            return self.check(record) is None
        except Exception:  # noqa: BLE001 - undecodable bytes: refused, never raised
            return False

    @property
    def priority(self) -> int:
        return -10  # after the signature strip (10) and the schema (0): it reads typed, unsigned values


# ----------------------------------------------------------------------------------------- the set


def _run_ids(run_id: str | Sequence[str]) -> list[str]:
    ids = [run_id] if isinstance(run_id, str) else list(run_id)
    if not ids or not all(isinstance(r, str) and r for r in ids):
        raise ValueError(f"run_id must be a non-empty str or a non-empty sequence of them, got {run_id!r}")
    return list(dict.fromkeys(ids))


class CheckedOnce(RSASignatureValidator):
    """hivemind's RSASignatureValidator whose verdicts VERDICTS remembers. A verdict is a pure function of the bytes
    hivemind signs (key, subkey, value with its signature, expiration), whoever checks it; their SHA-256 is the key.
    Before the memory, at 32 peers in the scale harness 73% of a host's CPU went to RSA verification (py-spy), which
    starved the DHT until its lookups timed out."""

    def digest(self, record: DHTRecord) -> bytes:
        return hashlib.sha256(b"signature" + self._serialize_record(record)).digest()  # the tuple hivemind signs

    def validate(self, record: DHTRecord) -> bool:
        return VERDICTS.verdict(self.digest(record), lambda: super(CheckedOnce, self).validate(record))


class CheckedSchema(SchemaValidator):
    """hivemind's SchemaValidator whose verdicts VERDICTS remembers: a pure function of the record's key, subkey and
    value, and of the schemas and key names this validator holds (merged ones included; ``merge_with``)."""

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._key_id_to_field_name:
            return self._allow_extra_keys  # another key: nothing to parse
        return VERDICTS.verdict(
            _content_digest(self._identity(), record), lambda: super(CheckedSchema, self).validate(record)
        )

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        self.__dict__.pop("_identity_bytes", None)
        return merged

    def _identity(self) -> bytes:
        """What this validator's verdicts depend on beyond the record: its schemas and key names."""
        if "_identity_bytes" not in self.__dict__:
            names = sorted(self._key_id_to_field_name.items())
            schemas = [f"{s.__module__}.{s.__qualname__}:{id(s)}" for s in self._schemas]
            self._identity_bytes = repr(("schema", schemas, names, self._allow_extra_keys)).encode()
        return self._identity_bytes


def make_validators(run_id: str | Sequence[str], identity: Identity | None = None) -> list[RecordValidatorBase]:
    """Everything a node of the run(s) validates with: the signature (signing with ``identity.key``, or a fresh RSA key
    when None: several DHTs in one process must not share one, hivemind keeps only the first RSASignatureValidator),
    the guard, and each run id's schemas and metrics bounds. The node's own subkey is
    ``owner_subkey(identity.public_key)``; with ``identity=None``, ``validators[0].local_public_key``.
    Raises ValueError for an empty run id."""
    key = identity.key if identity is not None else RSAPrivateKey()
    found: list[RecordValidatorBase] = [CheckedOnce(key), RecordGuard()]
    for rid in _run_ids(run_id):
        found.append(CheckedSchema(_RunSchema, allow_extra_keys=True, prefix=rid))
        found.append(MetricsBounds(rid))
    return found

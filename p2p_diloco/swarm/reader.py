"""The monitor's view of the DHT: the run's records with their expiry, and the entries hivemind refused.

Inputs:  the DHT entries under ``f"{run_id}_metrics"`` (see records.py for the wire format); optionally a closed
         run's ``authorized`` peer ids (``identity.read_authorized_keys``).
Output:  :func:`read_swarm` -> :class:`Reading` (records by peer id, each one's DHT expiry, which owner key
         wrote which peer, the (reason, owner digest) of every refused or unparsable entry, and the peer ids
         ignored because they are not authorized).
State:   :class:`RejectCounter`'s pipe, written by the DHT process and drained by the host.
Failure: a lookup slower than ``timeout`` raises ``TimeoutError``. Refused entries never reach the records.

Why a validator wrapper: hivemind runs the validators inside the DHT process; an answer from a node whose
dictionary holds an entry that fails a check is dropped whole and silently (the reader keeps other nodes'
answers), so ``DHT.get`` alone cannot tell the monitor that garbage was there. Only the first failing entry of
each answer is seen (hivemind stops validating a dictionary at its first failure). Reasons: the guard's
(``size``, ``signature-text``, ``encoding``, ``owner-key``: validators.RecordGuard), ``signature``, ``schema``,
``bounds`` (validators.MetricsBounds), ``error`` (a validator raised); ``parse`` for what reached the host and
failed records.screen_records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm.records import PeerRecord, metrics_key, screen_records
from p2p_diloco.swarm.validators import MetricsBounds, RecordGuard

__all__ = ["owner_digest", "RejectCounter", "parse_entries", "Reading", "read_swarm"]


def owner_digest(subkey: Any) -> str:
    """A short stable name for an owner subkey (the RSA public key is ~400 characters)."""
    raw = subkey if isinstance(subkey, bytes) else repr(subkey).encode()
    return hashlib.sha256(raw).hexdigest()[:10]


class RejectCounter(RecordValidatorBase):
    """Runs the record validators and reports each entry they refuse under the run's key.

    hivemind validates in the DHT process and drops a refused answer silently (a whole node's dictionary at a
    time); this wrapper writes ``b"<reason> <owner digest>\\n"`` to a non-blocking pipe the host drains
    (reasons: see the module docstring). Made before the DHT process forks; a full pipe drops reports, never
    blocks the DHT. Validation itself is unchanged: a refused entry is never shown.
    """

    def __init__(self, validators: Iterable[RecordValidatorBase], run_id: str) -> None:
        validators = list(validators)
        self._inner = CompositeValidator(validators)
        # the order CompositeValidator validates in (decreasing priority), to tell which check refused an entry
        self._chain = sorted(validators, key=lambda v: v.priority, reverse=True)
        self._key = DHTID.generate(source=metrics_key(run_id)).to_bytes()
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)

    def _reason(self, record: DHTRecord) -> str:
        for validator in self._chain:
            try:
                if not validator.validate(record):
                    if isinstance(validator, RecordGuard):
                        return validator.reason(record) or "guard"
                    if isinstance(validator, RSASignatureValidator):
                        return "signature"
                    if isinstance(validator, SchemaValidator):
                        return "schema"
                    if isinstance(validator, MetricsBounds):
                        return "bounds"
                    return type(validator).__name__
                record = dataclasses.replace(record, value=validator.strip_value(record))
            except Exception:  # noqa: BLE001 - e.g. a malformed public key raises inside RSAPublicKey.from_bytes
                return "error"
        return "error"

    def validate(self, record: DHTRecord) -> bool:
        try:
            ok = self._inner.validate(record)
        except Exception:  # noqa: BLE001 - e.g. a malformed public key raises inside RSAPublicKey.from_bytes
            ok = False
        if not ok and record.key == self._key:
            reason = self._reason(record)
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
            except Exception:  # noqa: BLE001
                subkey = record.subkey
            try:
                os.write(self._write_fd, f"{reason} {owner_digest(subkey)}\n".encode())
            except OSError:
                pass  # pipe full or closed: the report is lost, the DHT never waits
        return ok

    def sign_value(self, record: DHTRecord) -> bytes:
        return self._inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self._inner.strip_value(record)

    @property
    def priority(self) -> int:
        return 10

    def close_host_end(self) -> None:
        """Call in the host after the DHT process started: only that process writes."""
        try:
            os.close(self._write_fd)
        except OSError:
            pass

    def drain(self) -> list[tuple[str, str]]:
        """(reason, owner digest) of every refusal reported since the last drain."""
        chunks = []
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        lines = b"".join(chunks).decode(errors="replace").splitlines()
        return [tuple(line.split(" ", 1)) for line in lines if " " in line]  # type: ignore[misc]


def parse_entries(
    entries: Any, authorized: Container[str] | None = None
) -> tuple[dict[str, PeerRecord], dict[str, float], dict[str, str], list[str]]:
    """Pure parse of what ``DHT.get`` returned for the key: (records by peer id, their DHT expiry by peer id,
    owner digest -> peer id, owner digests of the bad entries; records.screen_records says which are bad).
    Newest ``time`` wins per peer; peers outside ``authorized`` (when given) are left out, not counted."""
    return _parse(entries, authorized)[:4]


def _parse(
    entries: Any, authorized: Container[str] | None
) -> tuple[dict[str, PeerRecord], dict[str, float], dict[str, str], list[str], list[str]]:
    screened = screen_records(entries, authorized=authorized)
    records: dict[str, PeerRecord] = {}
    expirations: dict[str, float] = {}
    owners: dict[str, str] = {}
    bad = ["<plain value>" if subkey is None else owner_digest(subkey) for subkey in screened.bad]
    for subkey, record, expiration in screened.accepted:
        peer = record.peer_id
        owners[owner_digest(subkey)] = peer
        if peer not in records or record.time > records[peer].time:
            records[peer] = record
            expirations[peer] = expiration
    return records, expirations, owners, bad, sorted(set(screened.ignored))


@dataclass
class Reading:
    records: dict[str, PeerRecord]
    expirations: dict[str, float]
    owners: dict[str, str]
    bad: list[tuple[str, str]]  # (reason, owner digest)
    seconds: float
    ignored: list[str] = dataclasses.field(default_factory=list)  # peer ids outside a closed run's authorized set


def read_swarm(
    dht: DHT,
    run_id: str,
    timeout: float,
    rejects: RejectCounter | None = None,
    stop: threading.Event | None = None,
    authorized: Container[str] | None = None,
) -> Reading:
    """One lookup of the run's key (``latest=True``: asks the network, not a cache). Raises TimeoutError after
    ``timeout`` seconds, or as soon as ``stop`` is set (a monitor asked to exit does not wait for a slow lookup).
    With ``authorized``, records of other peers are ignored (listed in ``Reading.ignored``)."""
    started = time.monotonic()
    future = dht.get(metrics_key(run_id), latest=True, return_future=True)
    deadline = started + timeout
    while True:
        try:
            found = future.result(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            break
        except TimeoutError:
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                future.cancel()
                why = "stopped" if stop is not None and stop.is_set() else f"took over {timeout:g} s"
                raise TimeoutError(f"reading {metrics_key(run_id)!r} from the DHT {why}") from None
    parsed = _parse(found.value, authorized) if found is not None else ({}, {}, {}, [], [])
    records, expirations, owners, unparsed, ignored = parsed
    refused = rejects.drain() if rejects is not None else []
    bad = refused + [("parse", d) for d in unparsed]
    return Reading(records, expirations, owners, bad, time.monotonic() - started, ignored)

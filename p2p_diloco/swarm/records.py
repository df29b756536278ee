"""Per-peer round summaries in the DHT: one signed subkey per peer under ``f"{run_id}_metrics"``.

Inputs:  a :class:`PeerRecord` per finished round, published by the training peer that owns it.
Output:  ``read_records`` -> ({peer_id: PeerRecord}, number of entries that failed to parse); the monitor reads
         this and counts the garbage. ``screen_records`` is the per-entry verdict both build on.
State:   the DHT entries themselves; each expires ``ttl`` seconds after its last publish.
Failure: a malformed or foreign write is refused by every node that runs swarm/validators.py's
         ``make_validators`` (``publish_record`` returns False). A node without them can still store garbage under
         the key; what reaches a reader and does not parse as a PeerRecord, names another peer than its signer, or
         claims a round far ahead of the swarm's is skipped and counted. Records of peers outside a closed run's
         ``authorized`` set are skipped, not counted.

Wire format (what the DHT stores and validates, hivemind 1.1.12):
  key     ``f"{run_id}_metrics"``
  subkey  the writer's ``owner_subkey(identity.public_key)`` (``b"[owner:<RSA public key>]"``); the signature
          validator signs the value on store and every validating node checks the signature, so a peer can write
          only its own subkey. ``peer_id`` must be ``identity.peer_id_of`` that key: the writer's libp2p peer id
          when its DHT runs with the same identity file.
  value   ``PeerRecord.model_dump()``: a msgpack map with exactly the fields below. hivemind's
          ``SchemaValidator`` (pydantic.v1 API; ``_PeerRecordWire`` here, used by validators.py) checks it with strict
          types: an int where a float is expected, a missing or an extra field is refused. Adding a field is
          therefore a wire-format change: old peers refuse records with it. validators.py's ``MetricsBounds`` then
          checks the signer, the clock and the magnitudes.
Facts worth knowing (hivemind 1.1.12, measured or read in its source):
- a node's RSA key defaults to one per process (``RSAPrivateKey.process_wide()``) and a DHT keeps only the
  first ``RSASignatureValidator`` it is given, so several DHTs in one process would share one owner;
  ``make_validators`` makes a fresh key unless given an Identity.
- when a remote node answers a lookup with a dictionary in which any subkey fails validation, the reader
  drops that node's whole dictionary, not just the bad entry (the reader still has other replicas).
- a node without the validators cannot read signed records: it cannot strip the signature, msgpack raises
  ``ExtraData`` inside the DHT process and ``DHT.get`` never returns. Readers (the monitor) must use
  ``make_validators`` too; ``read_records`` has a timeout.
- a NaN loss passes the schema check (the strict-type check compares with ``==``, and the dict comparison
  short-cuts on identity), so a diverging peer still reports.
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import pydantic
import pydantic.v1 as pydantic_v1
from hivemind.dht import DHT
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.swarm.dht import bounded, in_background
from p2p_diloco.swarm.identity import signer_of

__all__ = [
    "PeerRecord",
    "metrics_key",
    "publish_record",
    "read_records",
    "parse_records",
    "screen_records",
    "Screened",
    "MAX_STEP_LEAD",
]

# a record whose outer_step is more than this above the median of at least 3 records is not believed
MAX_STEP_LEAD = 1000


class PeerRecord(pydantic.BaseModel):
    """One peer's summary of its latest round. Units: seconds, bytes, tokens; ``time`` is unix time."""

    model_config = pydantic.ConfigDict(extra="forbid")

    peer_id: str = pydantic.Field(max_length=128)
    outer_step: int = pydantic.Field(ge=0)
    train_loss: float | None  # may be NaN/inf: the monitor should see a diverging peer
    eval_loss: float | None
    tokens: int = pydantic.Field(ge=0)  # this round
    total_tokens: int = pydantic.Field(ge=0)
    tokens_per_second: float = pydantic.Field(ge=0)
    group_size: int = pydantic.Field(ge=0)  # peers in this round's all-reduce group, self included
    checksum: str = pydantic.Field(max_length=128)  # of the outer state after the round
    compute_seconds: float = pydantic.Field(ge=0)
    matchmaking_seconds: float = pydantic.Field(ge=0)
    allreduce_seconds: float = pydantic.Field(ge=0)
    bytes_sent: int = pydantic.Field(ge=0)
    bytes_received: int = pydantic.Field(ge=0)
    peak_memory_bytes: int = pydantic.Field(ge=0)
    lost_rounds: int = pydantic.Field(default=0, ge=0)  # rounds it trained that moved no state (discarded, resynced)
    time: float


_NonNegInt = pydantic_v1.conint(strict=True, ge=0)
_NonNegFloat = pydantic_v1.confloat(strict=True, ge=0.0)


class _PeerRecordWire(pydantic_v1.BaseModel):
    """What DHT nodes accept as a value: :class:`PeerRecord` in hivemind's pydantic.v1 API, strict types."""

    peer_id: pydantic_v1.constr(strict=True, max_length=128)
    outer_step: _NonNegInt
    train_loss: pydantic_v1.StrictFloat | None
    eval_loss: pydantic_v1.StrictFloat | None
    tokens: _NonNegInt
    total_tokens: _NonNegInt
    tokens_per_second: _NonNegFloat
    group_size: _NonNegInt
    checksum: pydantic_v1.constr(strict=True, max_length=128)
    compute_seconds: _NonNegFloat
    matchmaking_seconds: _NonNegFloat
    allreduce_seconds: _NonNegFloat
    bytes_sent: _NonNegInt
    bytes_received: _NonNegInt
    peak_memory_bytes: _NonNegInt
    lost_rounds: _NonNegInt = 0
    time: pydantic_v1.StrictFloat

    class Config:
        extra = pydantic_v1.Extra.forbid


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def publish_record(
    dht: DHT,
    run_id: str,
    record: PeerRecord,
    ttl: float,
    public_key: bytes,
    timeout: float = 10.0,
    wait: bool = True,
) -> bool:
    """Store ``record`` under this peer's subkey for ``ttl`` seconds; True if at least one node took it within
    ``timeout`` seconds. ``wait=False`` hands it to the DHT process and returns True at once (a training peer: the
    store is not the round's work); a failure is then warned about from the DHT's callback thread.

    Never raises for DHT trouble (metrics must not stop training): a dead DHT pipe, an error or no answer in time
    is a warning (the first of its kind; dht.bounded) and False.
    """

    def store() -> Any:
        expires = get_dht_time() + ttl
        return dht.store(metrics_key(run_id), record.model_dump(), expires, subkey=public_key, return_future=True)

    if not wait:
        in_background(store, "publishing the round record")
        return True
    return bool(bounded(store, timeout, "publishing the round record", False))


def read_records(
    dht: DHT,
    run_id: str,
    max_age: float | None = None,
    timeout: float = 30.0,
    authorized: Container[str] | None = None,
) -> tuple[dict[str, PeerRecord], int]:
    """Valid, unexpired records by ``peer_id``, and how many entries under the key were bad (see parse_records).

    ``dht`` must run the validators from ``validators.make_validators`` (any key will do): a node without
    them cannot strip the signatures, and hivemind's ``get`` then fails inside the DHT process and never
    answers; ``timeout`` turns that (and a stalled lookup) into a ``TimeoutError``.
    """
    future = dht.get(metrics_key(run_id), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct classes before Python 3.11
        future.cancel()
        raise TimeoutError(
            f"reading {metrics_key(run_id)!r} from the DHT took over {timeout:g} s "
            "(does this DHT node run validators.make_validators' validators?)"
        ) from None
    if found is None:
        return {}, 0
    return parse_records(found.value, max_age=max_age, authorized=authorized)


@dataclass
class Screened:
    """``screen_records``' verdict. ``accepted``: (subkey, record, DHT expiry) of the entries kept; ``bad``: the
    subkeys of the entries refused (None for a plain value where a per-peer dictionary belongs); ``ignored``: peer
    ids outside ``authorized`` (not bad: a closed run simply does not listen to them)."""

    accepted: list[tuple[Any, PeerRecord, float]] = field(default_factory=list)
    bad: list[Any] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def screen_records(entries: Any, max_age: float | None = None, authorized: Container[str] | None = None) -> Screened:
    """Sort what ``DHT.get`` returned for the key into kept, bad and ignored entries. Pure; never raises.

    Bad: a subkey that is no owner subkey, a value that does not parse as a PeerRecord, a ``peer_id`` that is not
    the signer's (``identity.signer_of(subkey)``: a node without validators may have stored it), and, among at
    least 3 otherwise good records, an ``outer_step`` more than MAX_STEP_LEAD above their median (the steps of a
    record must be near the swarm's). Ignored: peers outside ``authorized`` (when given) and, with ``max_age``,
    records whose ``time`` is older than that many seconds.
    """
    out = Screened()
    if not isinstance(entries, dict):
        out.bad.append(None)
        return out
    now = get_dht_time()
    kept: list[tuple[Any, PeerRecord, float]] = []
    for subkey, item in entries.items():
        signer = signer_of(subkey)
        try:
            record = PeerRecord.model_validate(getattr(item, "value", None))
        except pydantic.ValidationError:
            record = None
        if signer is None or record is None or record.peer_id != signer:
            out.bad.append(subkey)
            continue
        if authorized is not None and record.peer_id not in authorized:
            out.ignored.append(record.peer_id)
            continue
        if max_age is not None and not (math.isfinite(record.time) and now - record.time <= max_age):
            continue
        expiration = getattr(item, "expiration_time", math.inf)
        kept.append((subkey, record, float(expiration) if isinstance(expiration, int | float) else math.inf))
    if len(kept) >= 3:
        ceiling = statistics.median(r.outer_step for _, r, _ in kept) + MAX_STEP_LEAD
        out.bad.extend(subkey for subkey, r, _ in kept if r.outer_step > ceiling)
        kept = [entry for entry in kept if entry[1].outer_step <= ceiling]
    out.accepted = kept
    return out


def parse_records(
    entries: Any, max_age: float | None = None, authorized: Container[str] | None = None
) -> tuple[dict[str, PeerRecord], int]:
    """The parsing half of :func:`read_records`: ``entries`` is the value ``DHT.get`` returned for the key.
    Returns the kept records by ``peer_id`` (newest ``time`` wins) and the number of bad entries (screen_records)."""
    screened = screen_records(entries, max_age=max_age, authorized=authorized)
    records: dict[str, PeerRecord] = {}
    for _, record, _ in screened.accepted:
        previous = records.get(record.peer_id)
        if previous is None or record.time > previous.time:
            records[record.peer_id] = record
    return records, len(screened.bad)

"""Per-peer round summaries in the DHT: one signed subkey per peer under ``f"{run_id}_metrics"``.

Inputs:  a :class:`PeerRecord` per finished round, published by the training peer that owns it.
Output:  ``read_records`` -> ({peer_id: PeerRecord}, number of entries that failed to parse); the monitor reads
         this and counts the garbage.
State:   the DHT entries themselves; each expires ``ttl`` seconds after its last publish.
Failure: a malformed or foreign write is refused by every node that runs :func:`make_record_validators`'s
         validators (``publish_record`` returns False). A node without them can still store garbage under
         the key; what reaches a reader and does not parse as a PeerRecord is skipped and counted.

Wire format (what the DHT stores and validates, hivemind 1.1.12):
  key     ``f"{run_id}_metrics"``
  subkey  the writer's ``RSASignatureValidator.local_public_key`` (``b"[owner:<RSA public key>]"``); the
          validator signs the value on store and every validating node checks the signature, so a peer can
          write only its own subkey.
  value   ``PeerRecord.model_dump()``: a msgpack map with exactly the fields below. hivemind's
          ``SchemaValidator`` (pydantic.v1 API) checks it with strict types: an int where a float is expected,
          a missing or an extra field is refused. Adding a field is therefore a wire-format change: old peers
          refuse records with it.
Facts worth knowing (hivemind 1.1.12, measured or read in its source):
- a node's RSA key defaults to one per process (``RSAPrivateKey.process_wide()``) and a DHT keeps only the
  first ``RSASignatureValidator`` it is given, so several DHTs in one process would share one owner;
  ``make_record_validators`` makes a fresh key unless given one.
- when a remote node answers a lookup with a dictionary in which any subkey fails validation, the reader
  drops that node's whole dictionary, not just the bad entry (the reader still has other replicas).
- a node without the validators cannot read signed records: it cannot strip the signature, msgpack raises
  ``ExtraData`` inside the DHT process and ``DHT.get`` never returns. Readers (the monitor) must use
  ``make_record_validators`` too; ``read_records`` has a timeout.
- a NaN loss passes the schema check (the strict-type check compares with ``==``, and the dict comparison
  short-cuts on identity), so a diverging peer still reports.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any

import pydantic
import pydantic.v1 as pydantic_v1
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.swarm.dht import bounded

__all__ = [
    "PeerRecord",
    "metrics_key",
    "make_record_validators",
    "publish_record",
    "read_records",
    "parse_records",
]


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
    time: pydantic_v1.StrictFloat

    class Config:
        extra = pydantic_v1.Extra.forbid


class _MetricsSchema(pydantic_v1.BaseModel):
    # SchemaValidator(prefix=run_id) maps this field to the DHT key f"{run_id}_metrics"
    metrics: dict[BytesWithPublicKey, _PeerRecordWire]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def make_record_validators(run_id: str, private_key: RSAPrivateKey | None = None) -> tuple[list[Any], bytes]:
    """Validators for ``start_dht(record_validators=...)`` and this node's subkey (its RSA public key).

    Each call makes a fresh RSA key unless ``private_key`` is given: several DHT nodes in one process must
    not share one (hivemind keeps only the first ``RSASignatureValidator`` a DHT is given).
    """
    signer = RSASignatureValidator(private_key if private_key is not None else RSAPrivateKey())
    return [SchemaValidator(_MetricsSchema, allow_extra_keys=True, prefix=run_id), signer], signer.local_public_key


def publish_record(
    dht: DHT, run_id: str, record: PeerRecord, ttl: float, public_key: bytes, timeout: float = 10.0
) -> bool:
    """Store ``record`` under this peer's subkey for ``ttl`` seconds; True if at least one node took it within
    ``timeout`` seconds.

    Never raises for DHT trouble (metrics must not stop training): a dead DHT pipe, an error or no answer in time
    is a warning (the first of its kind; dht.bounded) and False.
    """

    def store() -> Any:
        expires = get_dht_time() + ttl
        return dht.store(metrics_key(run_id), record.model_dump(), expires, subkey=public_key, return_future=True)

    return bool(bounded(store, timeout, "publishing the round record", False))


def read_records(
    dht: DHT, run_id: str, max_age: float | None = None, timeout: float = 30.0
) -> tuple[dict[str, PeerRecord], int]:
    """Valid, unexpired records by ``peer_id``, and how many entries under the key failed to parse.

    ``dht`` must run the validators from :func:`make_record_validators` (any key will do): a node without
    them cannot strip the signatures, and hivemind's ``get`` then fails inside the DHT process and never
    answers; ``timeout`` turns that (and a stalled lookup) into a ``TimeoutError``.
    When two subkeys carry the same ``peer_id`` (a peer restarted with a new key), the newer ``time`` wins.
    ``max_age`` additionally drops records whose ``time`` is older than that many seconds (not counted bad).
    """
    future = dht.get(metrics_key(run_id), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct classes before Python 3.11
        future.cancel()
        raise TimeoutError(
            f"reading {metrics_key(run_id)!r} from the DHT took over {timeout:g} s "
            "(does this DHT node run make_record_validators' validators?)"
        ) from None
    if found is None:
        return {}, 0
    return parse_records(found.value, max_age=max_age)


def parse_records(entries: Any, max_age: float | None = None) -> tuple[dict[str, PeerRecord], int]:
    """The parsing half of :func:`read_records`: ``entries`` is the value ``DHT.get`` returned for the key."""
    if not isinstance(entries, dict):
        return {}, 1  # a plain value where a per-peer dictionary belongs
    now = get_dht_time()
    records: dict[str, PeerRecord] = {}
    bad = 0
    for subkey, item in entries.items():
        value = getattr(item, "value", None)
        if not isinstance(subkey, bytes) or RSASignatureValidator.PUBLIC_KEY_FORMAT[:7] not in subkey:
            bad += 1
            continue
        try:
            record = PeerRecord.model_validate(value)
        except pydantic.ValidationError:
            bad += 1
            continue
        if max_age is not None and not (math.isfinite(record.time) and now - record.time <= max_age):
            continue
        previous = records.get(record.peer_id)
        if previous is None or record.time > previous.time:
            records[record.peer_id] = record
    return records, bad

"""A peer's identity: one RSA key that is at once its libp2p peer id, its DHT signing key and its voice in a round.

Inputs:  an identity file (libp2p's protobuf ``PrivateKey``, the format ``--identity-path`` and p2pd use), or
         none: then a fresh key lives in a private temporary file for as long as the Identity does.
Output:  ``Identity``: ``peer_id`` (what p2pd derives from the key, so a remote peer's id is proof that it holds
         the key), ``public_key`` (OpenSSH text, ``ssh-rsa AAAA...``: what ``--print-public-key`` prints, what
         ``swarm.authorized_keys`` lists and what hivemind's RSASignatureValidator puts in a signed subkey),
         ``sign``. ``peer_id_of(public_key)`` is the peer id that key stands for; ``verify`` checks a signature.
         ``owner_of(subkey)`` is the public key inside a signed subkey (``b"[owner:ssh-rsa ...]"``), ``signer_of``
         the peer id that key stands for.
State:   the private key (in memory, and in the identity file).
         ``work_bits(peer_id)``: the identity work a key carries; ``Admission``: who a run lets in (a closed run's
         list, and ``swarm.identity_work``).
Failure: ``IdentityError`` (a ``ValueError``) for a file that is not a libp2p RSA private key, or one without the
         identity work asked, with the path and what to do in the message. ``peer_id_of``/``verify``/``owner_of``/
         ``work_bits`` never raise on a stranger's bytes: None / False / 0.

Identity work (``swarm.identity_work`` N): a run may ask that a key cost something to make. A key carries the
leading zero bits of ``sha256(WORK_DOMAIN + peer id)``; a run with N admits only keys with at least N (``Admission``:
in groups, state downloads, vouches, records). Making such a key means generating about 2**N RSA keys (``load``
grinds one when it creates the file, showing progress); checking it is one hash. The key itself is the proof, so
nothing new travels on the wire, and a key keeps its work for every run (it is not bound to a run id: a volunteer
grinds once). It makes Sybil keys cost CPU time, about 2**N key generations each; it does not stop one attacker
with that time to spend.

Why one key: a record signed by key K and a gather payload signed by K can both be tied to the libp2p peer whose
id is ``peer_id_of(K)``; nobody can claim another peer's id without its key (libp2p's Noise handshake proves the
key, hivemind's ``context.remote_id`` is that id), so the peer id in a record, a vote or a group is the signer's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

__all__ = [
    "Admission",
    "Identity",
    "IdentityError",
    "owner_of",
    "peer_id_of",
    "read_authorized_keys",
    "signer_of",
    "verify",
    "work_bits",
]

log = logging.getLogger(__name__)
WORK_DOMAIN = b"p2p_diloco identity work\x00"

_OWNER_RE = re.compile(re.escape(RSASignatureValidator.PUBLIC_KEY_FORMAT).replace(b"_key_", rb"(.+?)"))
MAX_PUBLIC_KEY_BYTES = 1024  # an OpenSSH RSA-2048 key is ~380 bytes; RSA-4096 ~720


class IdentityError(ValueError):
    """An identity file that cannot be used; the message names the file and what to do."""


def _key_from_der(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


class Identity:
    """This peer's RSA key, with the file p2pd reads it from (see the module docstring)."""

    def __init__(self, key: RSAPrivateKey, path: str, temporary: bool) -> None:
        self.key, self.path, self._temporary = key, path, temporary
        self.public_key: bytes = key.get_public_key().to_bytes()
        self.peer_id: str = peer_id_of(self.public_key) or ""

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, work: int = 0) -> Identity:
        """The key in ``path`` (created there, mode 0400, when the file does not exist), or a fresh temporary one.
        ``work``: a key created here carries at least that many bits of identity work (``grind``); an existing one
        without them raises IdentityError."""
        if path is None:
            fd, tmp = tempfile.mkstemp(prefix="p2p_diloco_identity_", suffix=".key")
            os.close(fd)
            key = grind(work)
            _write(tmp, key)
            return cls(key, tmp, temporary=True)
        path = str(path)
        if not os.path.exists(path):
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                raise IdentityError(f"identity file {path!r}: directory {directory!r} does not exist")
            key = grind(work)
            _write(path, key)
            os.chmod(path, 0o400)
            return cls(key, path, temporary=False)
        identity = cls._read(path)
        carried = work_bits(identity.peer_id)
        if carried < work:
            raise IdentityError(
                f"identity file {path!r} carries {carried} bits of identity work and the run asks for "
                f"swarm.identity_work={work}: point --identity-path at a path that does not exist yet (a key with the "
                "work is made there, a new peer id), or at a key made for such a run"
            )
        return identity

    @classmethod
    def _read(cls, path: str) -> Identity:
        try:
            data = Path(path).read_bytes()
            message = crypto_pb2.PrivateKey.FromString(data)
            if message.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError("not an RSA key")
            key = _key_from_der(message.data)
        except (OSError, ValueError, TypeError) as exc:
            raise IdentityError(
                f"identity file {path!r} is not a libp2p RSA private key ({type(exc).__name__}: {exc}); "
                "point --identity-path at a file this tool or hivemind created, or at a path that does not exist yet"
            ) from None
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and cryptography's errors vary by version
            raise IdentityError(f"identity file {path!r} does not parse as a libp2p private key ({exc})") from None
        return cls(key, path, temporary=False)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)

    def close(self) -> None:
        """Remove a temporary identity file (p2pd has read it by then); a named one stays."""
        if self._temporary:
            try:
                os.chmod(self.path, 0o600)
                os.unlink(self.path)
            except OSError:
                pass


def grind(work: int) -> RSAPrivateKey:
    """A fresh RSA key whose peer id carries at least ``work`` bits of identity work: about 2**work tries, each a key
    generation (~0.05-0.2 s on a CPU core), with a log line every 10 s."""
    started = last = time.monotonic()
    tries = 0
    while True:
        key, tries = RSAPrivateKey(), tries + 1
        # the uncached count: the keys tried and thrown away stay out of work_bits' memory of the run's peers
        if work <= 0 or _leading_zero_bits(peer_id_of(key.get_public_key().to_bytes()) or "") >= work:
            if work > 0:
                took = time.monotonic() - started
                log.info("identity key with %d bits of work after %d tries, %.0fs", work, tries, took)
            return key
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            log.info(
                "making an identity key with %d bits of work (swarm.identity_work): %d tries in %.0fs, ~%d expected",
                work,
                tries,
                last - started,
                2**work,
            )


@functools.lru_cache(maxsize=4096)  # every record, vouch and group asks again for the same few peers
def work_bits(peer_id: object) -> int:
    """The identity work a peer id carries: the leading zero bits of sha256(WORK_DOMAIN + its text); 0 for a non-str."""
    return _leading_zero_bits(peer_id) if isinstance(peer_id, str) else 0


def _leading_zero_bits(peer_id: str) -> int:
    digest = int.from_bytes(hashlib.sha256(WORK_DOMAIN + peer_id.encode()).digest(), "big")
    return 256 - digest.bit_length()


@dataclass(frozen=True)
class Admission:
    """Who a run lets in: a closed run's listed peer ids (``swarm.authorized_keys``; None: any key) and the identity
    work each key must carry (``swarm.identity_work``). ``peer in admission``: both hold."""

    listed: frozenset[str] | None = None
    work: int = 0

    def __contains__(self, peer: object) -> bool:
        peer = str(peer)
        return (self.listed is None or peer in self.listed) and work_bits(peer) >= self.work

    @classmethod
    def of(cls, listed: frozenset[str] | None, work: int) -> Admission | None:
        """The run's admission, or None when it lets any key in (open, no work asked)."""
        return cls(listed, work) if listed is not None or work > 0 else None


def _write(path: str, key: RSAPrivateKey) -> None:
    message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes())
    with open(path, "wb") as f:
        f.write(message.SerializeToString())


def peer_id_of(public_key: bytes) -> str | None:
    """The libp2p peer id (base58) of an OpenSSH RSA public key; None for anything else."""
    if not isinstance(public_key, bytes) or len(public_key) > MAX_PUBLIC_KEY_BYTES:
        return None
    try:
        key = RSAPublicKey.from_bytes(public_key)._public_key
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except Exception:  # noqa: BLE001 - a stranger's bytes
        return None
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return str(PeerID(digest))


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of ``data``; False for anything malformed."""
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes) or len(public_key) > MAX_PUBLIC_KEY_BYTES:
        return False
    try:
        return bool(RSAPublicKey.from_bytes(public_key).verify(data, signature))
    except Exception:  # noqa: BLE001
        return False


def owner_of(subkey: object) -> bytes | None:
    """The public key in a signed DHT subkey ``b"[owner:<key>]"``; None when it holds none."""
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER_RE.fullmatch(subkey)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=4096)  # every DHT read of a run's keys asks again for the same few signers
def signer_of(subkey: object) -> str | None:
    """The peer id of the key in a signed DHT subkey; None when it holds no RSA public key."""
    owner = owner_of(subkey)
    return peer_id_of(owner) if owner is not None else None


def read_authorized_keys(path: str | os.PathLike[str]) -> frozenset[str]:
    """The peer ids of the public keys listed in ``path`` (one ``ssh-rsa ...`` key a line; ``#`` comments and
    blank lines skipped). Raises IdentityError naming the file and line of anything else."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IdentityError(f"swarm.authorized_keys {str(path)!r} cannot be read: {exc}") from None
    peers = set()
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        fields = text.split()
        peer = peer_id_of(" ".join(fields[:2]).encode()) if len(fields) >= 2 else None
        if peer is None:
            raise IdentityError(
                f"swarm.authorized_keys {str(path)!r} line {number} is not an RSA public key ({text[:40]!r}...); "
                "each line holds what `run_peer --print-public-key` printed"
            )
        peers.add(peer)
    if not peers:
        raise IdentityError(f"swarm.authorized_keys {str(path)!r} lists no key: a closed run needs at least one")
    return frozenset(peers)

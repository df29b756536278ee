"""A peer's identity (swarm/identity.py): the key file p2pd reads, the peer id it stands for, signatures, the
authorized_keys file of a closed run, what run_peer says to a peer such a run does not list, and identity work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hivemind.p2p import PeerID

from p2p_diloco.swarm.identity import (
    Admission,
    Identity,
    IdentityError,
    owner_of,
    peer_id_of,
    read_authorized_keys,
    verify,
    work_bits,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_key_file_is_created_once_and_names_the_same_peer_as_p2pd_would(tmp_path):
    path = tmp_path / "me.key"
    first = Identity.load(path)
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o400
    again = Identity.load(path)
    assert again.peer_id == first.peer_id == str(PeerID.from_identity(path.read_bytes()))
    assert first.public_key.startswith(b"ssh-rsa ") and peer_id_of(first.public_key) == first.peer_id


def test_a_temporary_identity_leaves_no_file():
    identity = Identity.load()
    assert os.path.exists(identity.path)
    identity.close()
    assert not os.path.exists(identity.path)
    assert identity.peer_id == peer_id_of(identity.public_key)  # the key stays in memory


@pytest.mark.parametrize("content", [b"", b"not a key", b"\x08\x00\x12\x03abc"])
def test_a_file_that_is_no_libp2p_key_is_refused_by_name(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match="bad.key"):
        Identity.load(path)


def test_a_missing_directory_is_named():
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load("/no/such/dir/me.key")


def test_signatures_and_strangers_bytes():
    a, b = Identity.load(), Identity.load()
    a.close(), b.close()
    signature = a.sign(b"round 3")
    assert verify(a.public_key, b"round 3", signature)
    assert not verify(a.public_key, b"round 4", signature)
    assert not verify(b.public_key, b"round 3", signature)
    for junk in (b"", b"ssh-rsa AAAA", "text", None, b"x" * 5000):
        assert peer_id_of(junk) is None  # type: ignore[arg-type]
        assert not verify(junk, b"round 3", signature)  # type: ignore[arg-type]
    assert owner_of(b"[owner:" + a.public_key + b"]") == a.public_key
    assert owner_of(b"peer") is None and owner_of("[owner:x]") is None


def test_authorized_keys_lists_peer_ids_and_names_a_bad_line(tmp_path):
    a, b = Identity.load(), Identity.load()
    a.close(), b.close()
    good = tmp_path / "keys"
    good.write_text(f"# the run's volunteers\n{a.public_key.decode()} alice\n\n{b.public_key.decode()}\n")
    assert read_authorized_keys(good) == {a.peer_id, b.peer_id}
    bad = tmp_path / "bad"
    bad.write_text(f"{a.public_key.decode()}\nQmNotAKey\n")
    with pytest.raises(IdentityError, match="line 2"):
        read_authorized_keys(bad)
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n")
    with pytest.raises(IdentityError, match="lists no key"):
        read_authorized_keys(empty)
    with pytest.raises(IdentityError, match="cannot be read"):
        read_authorized_keys(tmp_path / "missing")


def _run_peer(capfd, *args: str) -> tuple[int, str, str]:
    """run_peer's main in this process (a fresh interpreter took ~9 s a call in the suite): exit code, out, err."""
    from peers.run_peer import main

    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    said = capfd.readouterr()
    return code, said.out, said.err


def test_print_public_key_and_an_unlisted_peer_is_told_what_to_send(tmp_path, capfd):
    key = tmp_path / "me.key"
    code, out, err = _run_peer(capfd, "--identity-path", str(key), "--print-public-key")
    assert code == 0, err
    public_key, peer_id = out.strip().rsplit(" ", 1)
    assert peer_id == Identity.load(key).peer_id and public_key.startswith("ssh-rsa ")
    assert _run_peer(capfd, "--print-public-key")[0] == 2  # needs --identity-path

    other = Identity.load()
    other.close()
    allowed = tmp_path / "authorized_keys"
    allowed.write_text(other.public_key.decode() + "\n")
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--log-dir", str(tmp_path / "run"), "--new-swarm"]
    code, _, err = _run_peer(capfd, *args, "--identity-path", str(key), "--set", f"swarm.authorized_keys={allowed}")
    assert code == 2, err
    assert "is closed" in err and public_key in err, err
    assert "Traceback" not in err
    print(err.strip().splitlines()[-3:])


def test_identity_work_is_ground_into_a_new_key_and_checked_on_an_old_one(tmp_path):
    """swarm.identity_work N: a key made for such a run carries at least N bits (about 2**N key generations); an
    existing key without them is refused by name with what to do; an Admission lets in only keys with the work (and
    the listed ones, in a closed run)."""
    worked = Identity.load(tmp_path / "worked.key", work=3)
    assert work_bits(worked.peer_id) >= 3
    assert Identity.load(tmp_path / "worked.key", work=3).peer_id == worked.peer_id  # read again, not ground again
    plain = next(i for i in (Identity.load(tmp_path / f"plain{k}.key") for k in range(64)) if work_bits(i.peer_id) < 3)
    with pytest.raises(IdentityError, match=r"carries \d bits of identity work .* swarm.identity_work=3: point"):
        Identity.load(plain.path, work=3)
    assert work_bits(None) == 0 and work_bits(b"bytes") == 0 and work_bits("") >= 0

    admission = Admission.of(None, 3)
    assert worked.peer_id in admission and plain.peer_id not in admission
    closed = Admission.of(frozenset({plain.peer_id}), 0)
    assert plain.peer_id in closed and worked.peer_id not in closed
    both = Admission.of(frozenset({plain.peer_id, worked.peer_id}), 3)
    assert worked.peer_id in both and plain.peer_id not in both  # listed, but without the work
    assert Admission.of(None, 0) is None  # an open run without work asks nothing


def test_a_run_with_identity_work_says_what_is_wrong_with_the_key_given(tmp_path, capfd):
    """run_peer with --identity-path at a key without the run's work: exit 2, the reason named, no traceback."""
    plain = next(i for i in (Identity.load(tmp_path / f"p{k}.key") for k in range(64)) if work_bits(i.peer_id) < 4)
    config = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "swarm.identity_work=4"]
    code, _, said = _run_peer(capfd, "--identity-path", plain.path, "--log-dir", str(tmp_path / "run"), *config)
    assert code == 2, said
    assert "swarm.identity_work=4" in said and plain.path in said and "Traceback" not in said, said


def test_print_public_key_with_a_run_config_makes_a_key_with_its_identity_work(tmp_path, capfd):
    path = tmp_path / "me.key"
    config = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "swarm.identity_work=3"]
    code, out, err = _run_peer(capfd, "--identity-path", str(path), "--print-public-key", *config)
    assert code == 0, err
    line = out.split()
    assert line[0] == "ssh-rsa" and work_bits(line[2]) >= 3 and Identity.load(path).peer_id == line[2]

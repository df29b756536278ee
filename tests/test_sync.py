"""Verified state (swarm/sync.py): a peer adopts a downloaded outer state only when enough peers vouch for its
(round, checksum) and it matches this model; a bad offer is refused with a log line and the next donor is tried.

The donors here are in-process stand-ins for other peers' averagers (what each one serves is the variable under
test); the swarm tests (tests/test_adversarial.py) run the same path between real peer processes.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from p2p_diloco.config import load_config
from p2p_diloco.engine import Worker
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundTag
from p2p_diloco.state_parts import part_digests
from p2p_diloco.swarm.sync import StateSync
from p2p_diloco.swarm.vouches import Vouches

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def _batches(seed=0, vocab=257, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, shape, generator=g)


class _Donors:
    """The averager's ``manifest`` and ``piece``: each peer id serves what the test put there ((metadata,
    tensors), or a reason); a piece is a flat range of its tensors, whatever their dtype (state_pieces.py's own checks
    are tested in tests/test_download.py)."""

    def __init__(self, serves: dict[str, object]) -> None:
        self.serves, self.asked = serves, []

    def manifest(self, peer_id: str, timeout: float):
        self.asked.append(peer_id)
        served = self.serves[peer_id]
        return served if isinstance(served, str) else served[0]

    def piece(self, peer_id: str, tag, start: int, end: int, timeout: float):
        served = self.serves[peer_id]
        if isinstance(served, str) or not isinstance(served[1], list):
            return "the peer sent no piece"
        return torch.cat([t.reshape(-1) for t in served[1]])[start:end]


def _tag(state: OuterState) -> RoundTag:
    return RoundTag(state.round, state.checksum())


def _served(state: OuterState, fingerprint: str = "fp") -> tuple[dict, list[torch.Tensor]]:
    meta = {"round": state.round, "checksum": state.checksum(), "fingerprint": fingerprint, "consensus": True}
    return {**meta, "parts": part_digests(state.tensors())}, [t.clone() for t in state.tensors()]


def _setup(serves: dict[str, object], vouches: Vouches, quorum: int = 2):
    cfg = load_config(TINY, ["inner.steps=2", "data.eval_batches=1"])
    worker = Worker(cfg, 257, _batches())
    donors = _Donors(serves)
    return worker, donors, StateSync(worker, donors, "fp", 5.0, lambda: True, vouches=lambda: vouches, quorum=quorum)


def _trained(worker: Worker, rounds: int, scale: float = 1e-3) -> OuterState:
    """The swarm's state after ``rounds`` rounds (some other anchor than the seed's)."""
    state = worker.state.copy()
    state.round = rounds
    for t in state.anchor:
        t.add_(scale)
    return state


def _vouch(**tags: tuple[RoundTag, list[str]]) -> Vouches:
    """peer -> (its current tag, the other tags it vouches for)."""
    out = Vouches(live=set(tags))
    for peer, (tag, older) in tags.items():
        for t in [*older, tag]:
            out.vouchers.setdefault(t, set()).add(peer)
        out.holders.setdefault(tag, []).append(peer)
    return out


def test_a_state_only_one_peer_vouches_for_is_never_downloaded(caplog):
    """A bogus donor claims round 10**6: 1 of 3 peers vouches for it, so the joiner takes the honest state."""
    caplog.set_level(logging.WARNING, logger="p2p_diloco.sync")
    worker, _, _ = _setup({}, Vouches())
    honest = _trained(worker, 5)
    bogus = _trained(worker, 10**6, scale=50.0)
    vouches = _vouch(a=(_tag(honest), []), b=(_tag(honest), []), evil=(_tag(bogus), []))
    worker, donors, sync = _setup({"a": _served(honest), "b": _served(honest), "evil": _served(bogus)}, vouches)
    assert sync.download()
    assert _tag(worker.state) == _tag(honest)
    assert "evil" not in donors.asked
    assert any("fewer than 2 peers vouch" in r.getMessage() and "1000000" in r.getMessage() for r in caplog.records)


def test_a_download_whose_holders_moved_on_meanwhile_takes_the_state_they_vouch_for_next():
    """The swarm vouched for round 5 as we read it, but its holders serve round 6 by the time we ask (rounds of a
    second or two): refused, so the vouches are read again, and round 6, vouched for by then, is downloaded."""
    worker, _, _ = _setup({}, Vouches())
    old, new = _trained(worker, 5), _trained(worker, 6, scale=2e-3)
    reads = iter([_vouch(a=(_tag(old), []), b=(_tag(old), [])), _vouch(a=(_tag(new), [_tag(old)]), b=(_tag(new), []))])
    worker, donors, _ = _setup({"a": _served(new), "b": _served(new)}, Vouches())
    sync = StateSync(worker, donors, "fp", 5.0, lambda: True, vouches=lambda: next(reads), quorum=2)
    assert sync.download() and _tag(worker.state) == _tag(new)
    assert next(reads, None) is None  # read twice: once more after the first offer failed


def test_a_holder_serving_other_bytes_or_a_false_manifest_is_refused_and_the_state_comes_from_the_others(caplog):
    caplog.set_level(logging.WARNING, logger="p2p_diloco.sync")
    worker, _, _ = _setup({}, Vouches())
    honest = _trained(worker, 3)
    noise = honest.copy()
    for t in noise.anchor:
        t.normal_()
    liar = (_served(honest)[0], _served(noise)[1])  # the true manifest, other bytes
    forged = dict(_served(honest)[0], parts=part_digests(noise.tensors()))  # a manifest that is not the tag's
    vouches = _vouch(liar=(_tag(honest), []), forger=(_tag(honest), []), good=(_tag(honest), []))
    serves = {"liar": liar, "forger": (forged, _served(noise)[1]), "good": _served(honest)}
    tried: set[str] = set()
    for seed in range(64):  # whichever donor's manifest is read first, the honest state is the one adopted
        random.seed(seed)
        worker, donors, sync = _setup(serves, vouches)
        assert sync.download()
        assert _tag(worker.state) == _tag(honest)
        tried.add(donors.asked[0])
        if tried == set(serves):
            break
    assert tried == set(serves), tried
    lines = [r.getMessage() for r in caplog.records]
    assert any("liar" in line or "does not match the manifest" in line for line in lines), lines
    assert any("do not hash to the vouched checksum" in line for line in lines), lines


def test_malformed_metadata_and_wrong_rounds_are_refused_without_raising():
    worker, _, _ = _setup({}, Vouches())
    honest = _trained(worker, 2)
    bad = [
        ({"round": 2**63, "fingerprint": "fp"}, _served(honest)[1]),  # overflows the checksum's packing
        ({"round": 7, "fingerprint": "fp"}, _served(honest)[1]),  # not the round asked for
        ("not a dict", _served(honest)[1]),
        (_served(honest)[0], "not tensors"),
        (_served(honest, fingerprint="other")[0], _served(honest)[1]),
        (_served(honest)[0], [t.double() for t in _served(honest)[1]]),  # other dtypes
        "the peer sent no state",
    ]
    for offer in bad:
        worker, donors, sync = _setup({"a": offer}, _vouch(a=(_tag(honest), [])))
        assert not sync.download(), offer
        assert worker.state.round == 0 and donors.asked == ["a"]


def test_pieces_only_a_dropped_donor_held_are_fetched_from_the_others(caplog):
    """Every donor but one serves noise for its pieces: each is dropped on its first piece, which goes back to the
    pending pieces, and the one honest donor serves the whole state."""
    caplog.set_level(logging.WARNING, logger="p2p_diloco.sync")
    worker, _, _ = _setup({}, Vouches())
    honest = _trained(worker, 6)
    noise = honest.copy()
    for t in noise.momentum:
        t.normal_()
    liars = {f"liar{k}": (_served(honest)[0], _served(noise)[1]) for k in range(3)}
    vouches = _vouch(**{p: (_tag(honest), []) for p in [*liars, "good"]})
    worker, donors, sync = _setup({**liars, "good": _served(honest)}, vouches)
    assert sync.download()
    assert _tag(worker.state) == _tag(honest)
    refused = [r.getMessage() for r in caplog.records if "does not match the manifest" in r.getMessage()]
    assert refused, [r.getMessage() for r in caplog.records]


def test_quorum_is_every_peer_there_is_when_fewer_and_a_lone_claim_needs_company():
    worker, _, _ = _setup({}, Vouches())
    honest = _trained(worker, 4)
    # one other peer in the run: its word is all there is (quorum 2 -> 1)
    worker, _, sync = _setup({"a": _served(honest)}, _vouch(a=(_tag(honest), [])))
    assert sync.download() and _tag(worker.state) == _tag(honest)
    # two peers: the one that moved on vouches for round 4 in its history, so round 4's holder is trusted
    ahead = _trained(worker, 5)
    vouches = _vouch(a=(_tag(honest), []), b=(_tag(ahead), [_tag(honest)]))
    worker, donors, sync = _setup({"a": _served(honest), "b": _served(ahead)}, vouches)
    assert sync.download() and _tag(worker.state) == _tag(honest)
    assert donors.asked == ["a"]  # round 5 has one voucher of 2: not offered


def test_serving_copies_the_state_once_per_version():
    worker, _, sync = _setup({}, Vouches())
    first = sync.serve()
    again = sync.serve()
    assert again[1][0] is first[1][0]  # the same snapshot, no new copy under the lock
    sync.apply_outer([torch.zeros_like(t) for t in worker.state.anchor], consensus=True)
    moved = sync.serve()
    assert moved[0]["round"] == 1 and moved[1][0] is not first[1][0]

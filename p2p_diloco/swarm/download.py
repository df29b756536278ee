"""One vouched-for outer state from its holders: a manifest checked against the tag, then pieces from several donors
in parallel, each checked against the manifest, a failed piece fetched again from another donor.

Inputs:  the averager (``manifest(peer, timeout)`` and ``piece(peer, (round, checksum), start, end, timeout)``:
         state_pieces.py), this peer's own state tensors (the shapes and dtypes to fill), the run's fingerprint, the
         tag (round, checksum) the swarm vouches for, the peers that hold it now (its donors), a timeout.
Output:  ``download_state(...) -> (OuterState, consensus) | None``: an outer state whose checksum is the tag's,
         and whether its donor says it came out of a complete group; None when no donor's manifest checks out, or
         the pieces could not all be had from the donors left, within the timeout (each refusal logged: donor, why).
State:   per download: the donors dropped (a wrong manifest, a wrong piece, or MAX_FAILURES refused, failed or
         timed-out pieces: not asked again in this download), each donor's failed pieces, the pieces done, in
         flight and pending. The state is written once, into
         fresh tensors of our own shapes; no second copy.
Failure: nothing a donor sends raises here. A manifest with another fingerprint, round or part count, or whose
         digests do not hash to the tag's checksum, drops its donor and the next holder's manifest is read. A piece
         whose digests differ from the manifest's drops its donor at once; a piece that fails (refused, a broken or
         cut-short stream, a timeout) drops it at its MAX_FAILURES-th failure. Either way the piece goes back to the
         pending ones, for any donor still asked (a lone donor is asked again). When no piece
         is pending, an idle donor also fetches a piece already in flight elsewhere (at most two fetch one piece; the
         first that checks out is kept), so a slow donor holds up only its own pieces. Progress is logged every
         PROGRESS_SECONDS of a download.

Why a manifest can be trusted: the checksum is a hash over the part digests (state_parts.py), so a manifest that
hashes to the vouched checksum lists the vouched state's parts; each piece is then checked on its own, and a donor
that sends wrong bytes is caught on its first piece.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundTag
from p2p_diloco.state_parts import (
    DIGEST_BYTES,
    PART_VALUES,
    part_count,
    piece_digests,
    state_checksum,
    total_values,
    write_values,
)

__all__ = ["Manifest", "download_state", "read_manifest"]

log = logging.getLogger("p2p_diloco.sync")

MAX_DONORS = 8  # holders one download takes pieces from at once
IN_FLIGHT = 2  # pieces asked of one donor at a time (the next one is on its way while one is served)
PIECES_PER_DONOR = 4  # aim: at least this many pieces per donor, so the fast ones take more of the state
MAX_PIECE_PARTS = 4  # at most 4 MiB a piece (the donor serves up to averager.MAX_PIECE_PARTS)
# failed pieces (not wrong ones) that drop a donor: under load a stream is now and then cut short before its last
# message (seen on 100 Mbit/s links with 8 pieces in flight at one donor), which must not end a lone donor's download
MAX_FAILURES = 3
PROGRESS_SECONDS = 5.0


@dataclass
class Manifest:
    """A donor's description of the state it serves, checked against the vouched tag (``read_manifest``)."""

    donor: str
    tag: RoundTag
    digests: list[bytes]
    consensus: bool


def read_manifest(donor: str, meta: Any, tag: RoundTag, fingerprint: str, values: int) -> Manifest | str:
    """The manifest in ``meta`` if it is ``tag``'s for a state of ``values`` values with our fingerprint, else why
    not (a line; ``meta`` may already be one: why the donor sent none)."""
    if isinstance(meta, str):
        return meta
    if not isinstance(meta, dict):
        return "it sent no manifest"
    if meta.get("fingerprint") != fingerprint:
        return "it comes from a peer with other settings"
    rnd = meta.get("round")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd != tag.round:
        return f"it is at round {str(rnd)[:40]}, not {tag.round}"
    digests, want = meta.get("parts"), part_count(values)
    if not isinstance(digests, list) or len(digests) != want:
        count = len(digests) if isinstance(digests, list) else "no list of"
        return f"its manifest lists {count} parts, this model's state has {want}"
    if not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in digests):
        return "its manifest holds digests that are not 32 bytes"
    if state_checksum(rnd, digests) != tag.checksum:
        return "its manifest's parts do not hash to the vouched checksum"
    return Manifest(donor, tag, digests, meta.get("consensus") is True)


class _Pieces:
    """The pieces of one download and who fetches which (all under ``cond``)."""

    def __init__(self, total: int, donors: int) -> None:
        parts = part_count(total)
        per_piece = max(1, min(MAX_PIECE_PARTS, -(-parts // (PIECES_PER_DONOR * donors))))
        self.ranges = [(k * PART_VALUES, min(total, (k + per_piece) * PART_VALUES)) for k in range(0, parts, per_piece)]
        self.parts_per_piece = per_piece
        self.pending: deque[int] = deque(range(len(self.ranges)))
        self.fetching: dict[int, set[str]] = {}
        self.done: set[int] = set()
        self.dropped: dict[str, str] = {}  # donor -> why it is not asked again
        self.failures: dict[str, int] = {}  # donor -> its failed (not wrong) pieces so far
        self.bytes_done = 0
        self.cond = threading.Condition()

    def next_for(self, donor: str) -> int | None:
        """A pending piece, else one in flight at another donor only (endgame), else None."""
        while self.pending:
            piece = self.pending.popleft()
            if piece not in self.done:
                return piece
        slow = [p for p, who in self.fetching.items() if p not in self.done and donor not in who and len(who) < 2]
        return min(slow) if slow else None


def download_state(
    averager: Any,
    ours: Sequence[torch.Tensor],
    fingerprint: str,
    tag: RoundTag,
    donors: Sequence[str],
    timeout: float,
) -> tuple[OuterState, bool] | None:
    """The state ``tag`` from ``donors`` (see the module doc): (state, consensus), or None."""
    deadline, values = time.monotonic() + timeout, total_values(ours)
    donors = random.sample(list(donors), len(donors))
    refused: set[str] = set()
    for donor in donors:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        manifest = read_manifest(donor, averager.manifest(donor, left), tag, fingerprint, values)
        if isinstance(manifest, str):
            log.warning("refused the outer state peer %s offered for %s: %s", donor[-8:], tag, manifest)
            refused.add(donor)
            continue
        sources = [manifest.donor] + [d for d in donors if d not in refused and d != manifest.donor]
        state = _fetch_pieces(averager, ours, manifest, sources[:MAX_DONORS], deadline)
        if state is None:
            return None
        if state.checksum() != tag.checksum:  # cannot happen with every part checked; the adoption rule all the same
            log.warning("refused the outer state assembled for %s: its tensors do not hash to it", tag)
            return None
        return state, manifest.consensus
    return None


@dataclass
class _Refused:
    """A piece not had from a donor: why, and whether its bytes were wrong (else it failed: refused, broken)."""

    why: str
    wrong: bool


def _checked_piece(
    averager: Any, donor: str, manifest: Manifest, start: int, end: int, parts: int, deadline: float
) -> torch.Tensor | _Refused:
    """Values [start, end) from ``donor`` if they match the manifest's digests, else why not."""
    tag, left = manifest.tag, max(0.1, deadline - time.monotonic())
    try:
        got = averager.piece(donor, (tag.round, tag.checksum), start, end, left)
    except Exception as e:  # noqa: BLE001 - the averager's own failure is this donor's refused piece
        return _Refused(f"{type(e).__name__}: {e}", wrong=False)
    if isinstance(got, str):
        return _Refused(got, wrong=False)
    first = start // PART_VALUES
    fits = isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.numel() == end - start
    if not fits or piece_digests(got) != manifest.digests[first : first + parts]:
        return _Refused(f"its piece of values {start}-{end} does not match the manifest", wrong=True)
    return got


def _fetch_pieces(
    averager: Any, ours: Sequence[torch.Tensor], manifest: Manifest, donors: list[str], deadline: float
) -> OuterState | None:
    tag, total = manifest.tag, total_values(ours)
    out = [torch.empty(t.shape, dtype=torch.float32) for t in ours]
    pieces = _Pieces(total, len(donors))
    started = time.monotonic()

    def fetch_with(donor: str) -> None:
        while True:
            with pieces.cond:
                piece = None
                while piece is None:
                    if len(pieces.done) == len(pieces.ranges) or donor in pieces.dropped:
                        return
                    piece = pieces.next_for(donor)
                    if piece is None:
                        if not pieces.fetching:
                            return
                        pieces.cond.wait(0.5)
                    if time.monotonic() >= deadline:
                        return
                pieces.fetching.setdefault(piece, set()).add(donor)
            start, end = pieces.ranges[piece]
            got = _checked_piece(averager, donor, manifest, start, end, pieces.parts_per_piece, deadline)
            with pieces.cond:
                pieces.fetching[piece].discard(donor)
                if not pieces.fetching[piece]:
                    del pieces.fetching[piece]
                if isinstance(got, _Refused):
                    failed = pieces.failures[donor] = pieces.failures.get(donor, 0) + (not got.wrong)
                    if got.wrong or failed >= MAX_FAILURES:
                        pieces.dropped.setdefault(
                            donor, got.why if got.wrong else f"{failed} pieces failed, the last: {got.why}"
                        )
                    else:
                        log.warning("a piece from peer %s failed (%s): asking again", donor[-8:], got.why)
                    if piece not in pieces.done and piece not in pieces.fetching:
                        pieces.pending.appendleft(piece)
                elif piece not in pieces.done:
                    write_values(out, start, got)
                    pieces.done.add(piece)
                    pieces.bytes_done += 4 * (end - start)
                pieces.cond.notify_all()

    threads = [
        threading.Thread(target=fetch_with, args=(donor,), daemon=True, name=f"piece-{donor[-6:]}-{k}")
        for donor in donors
        for k in range(IN_FLIGHT)
    ]
    for thread in threads:
        thread.start()
    last_line = started
    with pieces.cond:
        while len(pieces.done) < len(pieces.ranges) and any(t.is_alive() for t in threads):
            now = time.monotonic()
            if now >= deadline:
                break
            if now - last_line >= PROGRESS_SECONDS:
                last_line = now
                log.info(
                    "downloading %s: %d of %d MB from %d donor(s), %.1f MB/s",
                    tag,
                    pieces.bytes_done >> 20,
                    (4 * total) >> 20,
                    len(donors) - len(pieces.dropped),
                    pieces.bytes_done / 2**20 / (now - started),
                )
            pieces.cond.wait(min(0.5, deadline - now))
        got, complete = len(pieces.done), len(pieces.done) == len(pieces.ranges)
        dropped = dict(pieces.dropped)
        pieces.pending.clear()
        pieces.done.update(range(len(pieces.ranges)))  # the threads still fetching stop at their next piece
        pieces.cond.notify_all()
    for donor, why in dropped.items():
        log.warning("refused the outer state peer %s offered for %s: %s", donor[-8:], tag, why)
    seconds = time.monotonic() - started
    if not complete:
        log.warning(
            "no complete outer state %s within swarm.state_timeout (%d of %d pieces; %d of %d donors dropped)",
            tag,
            got,
            len(pieces.ranges),
            len(dropped),
            len(donors),
        )
        return None
    log.info(
        "downloaded %s: %.0f MB in %.1f s (%.1f MB/s) from %d donor(s)",
        tag,
        4 * total / 2**20,
        seconds,
        4 * total / 2**20 / max(seconds, 1e-9),
        len(donors) - len(dropped),
    )
    half = len(out) // 2
    return OuterState(anchor=out[:half], momentum=out[half:], round=tag.round)

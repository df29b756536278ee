"""The pseudo-gradient all-reduce over hivemind: completeness detection, retries, state sharing.

Inputs:  ``reduce(pseudo_grads, weight, payload)``: one fp32 CPU tensor per parameter (the template shapes, the
         same on every peer), a finite weight > 0 (tokens this round), and this peer's GatherPayload (its round
         tag; protocol.py), which every member receives. At construction: ``RoundRules``, the reducers'
         ``aggregation`` rule and clip (robust.py; ``swarm.aggregation``) and ``max_tokens``, the most tokens one
         round can hold (robust.max_round_tokens). A reducer weighs each sender by the tokens its payload
         declared when its Δ counts and its wire weight says the same (0 otherwise), not by the wire weight.
         ``identity`` (identity.py): our payload is signed with it, bound to our peer id and the prefix, and every
         member's payload must carry a valid signature by the key its peer id stands for, else it is dropped and
         counted (a leader relays the group's payloads: it can drop one, never forge one). ``authorized``: the
         peer ids of a closed run (None: open).
Output:  ``(averaged, ReduceInfo)``: EITHER the weighted mean over a group where every member contributed
         and received every part (``complete``; bitwise equal on all members; the shared-memory buffers
         themselves, not a copy: read them before the next ``reduce``, which overwrites them), OR copies of the
         local pseudo-grads (``complete`` False, ``group_size`` 1, ``reason`` says why). Never a partial mean.
         ``ReduceInfo.gathered`` holds the members' payloads, parsed once in the averager process (malformed
         entries dropped and counted). A member whose Δ does not count (``protocol.decide``) sends weight 0.
State:   hivemind's averager child process with the shared-memory buffers (overwritten by each attempt);
         the state provider that serves late joiners (called in the host, in hivemind's fetch thread;
         ``shutdown`` refuses new serves and waits for the one in progress). In the averager process: the recent
         downloads per peer (at most ``max_state_downloads`` a minute each; more get an empty stream), and the
         reducers caught lying (``BAN_SECONDS``): like unlisted peers of a closed run, they are refused as followers
         (``rpc_join_group``), never asked to lead us (the ``_matchmaking`` setter), a group holding one is left
         before any part is sent, and they get no state.
Failure: ``ValueError`` for non-finite input, weight <= 0 or wrong shapes, before any network work. Network
         failures never raise: no group -> local result at once; incomplete or failed all-reduce -> retry on
         freshly copied buffers while ``max_reduce_attempts`` and ``round_deadline`` allow, else local.
         ``download`` never raises either: a refusal, a timeout, more tensors or bytes than asked for, a stream
         that stalls for ``next_chunk_timeout``: a line saying why. A reducer whose averaged part is too long to
         be an average of parts its rule accepts (butterfly.py) fails the attempt for this member and is banned.

Completeness (hivemind 1.1.12 returns success for a partly failed all-reduce). ``_aggregate_with_group``
(averager.py:514) is overridden; it runs ``_ExactRunner`` and then every member judges its own view:
``tensor_part_container.failed_size == 0`` (a failed reducer's slice keeps LOCAL values, partition.py:128-136)
and its own reducer got every part of every sender, nobody banned (``sender_failed_after`` all inf,
``num_parts_received`` full; a banned sender is silently left out of the rest of that slice, partition.py:248,
invisible to other members). Every member pushes its verdict by the unary RPC ``rpc_vote`` to every member that
accepts calls (all of them, unless some run in client mode: below), which answers with its own: the attempt is
complete only if every member's verdict is True; a member that is dead or silent until ``allreduce_timeout``
counts as False. Residual risk: a member dying inside the vote (about 10 ms) after
answering some peers only; the per-round checksum comparison of outer states is the backstop.
``ExactRunner`` (butterfly.py) is the all-reduce of one attempt: averaged parts bitwise equal on every member,
stalled senders banned, payload bytes counted.

Client mode (the DHT's ``client_mode``, hivemind's ``AveragingMode.CLIENT``: a peer others cannot dial, behind
NAT): it registers no RPC handler, never declares itself a leader and reduces nothing (its share of the vector is 0),
but sends its Δ to the reducers and takes the averaged parts back over the streams it opened, so it contributes and
ends bitwise equal to the group. Its vote goes to the group's nodes only, and each node answers with its group
view: its own verdict combined with every client's (``_collect_votes``), so two clients that cannot reach each
other still agree. A client thus trusts the nodes' views for the other clients' verdicts: in a group whose only
node is hostile, that node could tell one client "all complete" while another client's result differed (the
per-round checksum comparison of outer states is the backstop). It serves no
state. With ``reachable_members`` at 0 (no live node in the run) ``reduce`` returns the local result at once, with
``NO_REACHABLE_MEMBER`` as the reason. ``client_mode=True`` makes an averager a client on a reachable DHT node too:
the monitor's samples (monitor_samples.py) download the state that way and serve nothing.

Timing: ``matchmaking_seconds`` runs from ``step`` to the start of ``_aggregate_with_group`` in the averager
process (the group is assembled; a group smaller than the expected size forms only at the leader's
``matchmaking_time`` deadline); ``allreduce_seconds`` from there to the end of the vote. Both are summed over
attempts. ``bytes_sent`` / ``bytes_received`` are MEASURED payload bytes, also summed over attempts: the
protobuf size of every all-reduce message this member handed to the transport / took from it, before libp2p
framing and encryption (``ExactRunner`` adds them to shared counters as they pass, so a failed attempt's bytes
count too; the vote's few bytes are not counted). A member reducing
``m`` of ``S`` values in a group of ``n`` sends ``S - m`` values to the other reducers and its averaged
slice to ``n - 1`` members, ``(S - m) + (n - 1) m`` values (about ``2 (n - 1) / n`` of the vector) in the wire
codec (``compression``: codec.py; 4 bytes a value for none, 1.03 for int8), and receives as much; the messages
add a few dozen bytes each to that.
Round size: before each attempt ``expected_members()`` (the training peer: us and the run's live peers with our
settings) tells the averager process to assemble the round at that many members (within ``min_group_size`` and
``max_round_peers``), so a leader starts as soon as everyone that will come is in, not at ``matchmaking_time``. A round
of more than ``target_group_size`` members runs as several groups (protocol.split_groups; ``_plan``), each its own
butterfly, whose means each part's round reducer combines (butterfly.Combiner, ``rpc_combine_part``): one mean for the
whole round, bitwise equal on every member of every group, and one vote over all of them.

State sharing: donors are chosen by the caller (sync.py: peers whose signed announcements vouch for the state),
never from hivemind's unsigned ``all_averagers`` key, and ``download`` reads their stream with our own bounds
(hivemind's ``load_state_from_peers`` reads that key without a deadline inside this process).
``get_current_state`` serves the provider's output without the averager's tensor lock. The stock
one takes it, and an all-reduce holds it all round: measured (200 MB, next_chunk_timeout 2 s), a download from
a donor that was averaging failed with TimeoutError; lock-free, it succeeded first try. Sharing starts with
``set_state_provider``.
In pieces (swarm/download.py; the state as one flat fp32 vector, state_parts.py): ``manifest`` reads a donor's
served metadata with its part digests (the unary ``rpc_state_manifest``), ``piece`` values [start, end) of it
(``rpc_download_piece``: only whole parts, at most MAX_PIECE_PARTS, only while the donor still serves the tag
asked for; an empty stream otherwise). Each peer's downloads from us are charged against ``max_state_downloads``
states a minute: a whole download 1, a manifest MANIFEST_COST, a piece its share of the state (at least one part).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads rpc stream types by typing's _name

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.averager import DecentralizedAverager, _background_thread_fetch_current_state
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff
from hivemind.compression import NoCompression, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2p_diloco.codec import get_codec
from p2p_diloco.engine import ReduceInfo
from p2p_diloco.outer import is_finite
from p2p_diloco.protocol import Gathered, GatherPayload, RoundRules, RoundTag, split_groups
from p2p_diloco.state_parts import PART_VALUES, read_values, total_values
from p2p_diloco.swarm import limits as _limits  # noqa: F401 - caps the size of every message this process reads
from p2p_diloco.swarm.butterfly import (
    Aggregation,
    ExactRunner,
    PayloadBytes,
    RoundGroups,
    WireCodec,
    part_lengths,
    part_owners,
)
from p2p_diloco.swarm.dht import children_ignore_sigint
from p2p_diloco.swarm.identity import Identity, peer_id_of, verify
from p2p_diloco.swarm.in_thread import ThreadOrProcess

__all__ = ["PseudoGradAverager", "ReduceInfo"]

log = logging.getLogger("p2p_diloco.averager")
BAN_SECONDS = 600.0  # how long a reducer caught lying is kept out of our groups
NO_REACHABLE_MEMBER = (
    "no group: this peer runs as a client (not reachable from outside) and no live peer of the run is reachable, "
    "so nobody can lead a group or reduce; rounds stay local until a reachable peer joins (one with a forwarded "
    "port and --announce-maddrs, or a public address)"
)
_STATE_KEY = "p2p_diloco_state"  # wraps the metadata: hivemind drops a state whose metadata is falsy ({})
SERVE_GRACE = 60.0  # how long a shutdown waits for a serve of our state in progress to end


@dataclass(frozen=True)
class _Plan:
    """One member's butterfly in a round (``PseudoGradAverager._plan``): its members and their modes, the share of
    the vector each reduces, and how the round's groups combine (None: the round is one group)."""

    members: list[Any]
    modes: list[AveragingMode]
    fractions: list[int]
    groups: RoundGroups | None


def _state_thread_of(pipe: Any) -> threading.Thread | None:
    """hivemind's host-side thread that serves the state of the averager owning ``pipe`` (it keeps no handle to it:
    found by its target and arguments)."""
    for thread in threading.enumerate():
        target, args = getattr(thread, "_target", None), getattr(thread, "_args", ())
        if target is _background_thread_fetch_current_state and len(args) > 1 and args[1] is pipe:
            return thread
    return None


class _NoGroupIsNotAnError(logging.Filter):
    """hivemind logs a full traceback each time no group forms; reduce() reports that itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


logging.getLogger("hivemind.averaging.averager").addFilter(_NoGroupIsNotAnError())


def _digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """blake2b over the bytes of the averaged vector (16 bytes): equal on two members iff their results are."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().numpy())
    return h.digest()


def _vote_message(group_id: bytes, verdict: bool, digest: bytes) -> averaging_pb2.AveragingData:
    """A verdict on the wire: ``weight`` 1.0 / 0.0, the digest as a uint8 tensor part."""
    part = serialize_torch_tensor(torch.tensor(list(digest), dtype=torch.uint8))
    return averaging_pb2.AveragingData(group_id=group_id, weight=float(verdict), tensor_part=part)


def _read_vote(message: Any) -> tuple[bool, bytes]:
    """(verdict, digest) of a vote message; (False, b"") for anything that does not parse."""
    try:
        digest = bytes(deserialize_torch_tensor(message.tensor_part).to(torch.uint8).tolist())
        return message.weight == 1.0, digest
    except Exception:  # noqa: BLE001 - a member's garbage is a "no", never an error in our round
        return False, b""


class PseudoGradAverager(ThreadOrProcess, DecentralizedAverager):
    """DecentralizedAverager for fixed-shape fp32 pseudo-gradients; see the module docstring.

    All peers must use this class (hivemind names RPC handlers after the class) and the same ``prefix``.
    """

    _rpc_handlers, _stub_type = None, None  # collect this class's own rpc_* (hivemind caches them per class)
    _served_values = 0  # averager process: values in the state we served last (prices a piece before the host is asked)

    def __init__(
        self,
        dht: DHT,
        templates: Sequence[torch.Tensor],
        prefix: str,
        *,
        target_group_size: int,
        min_group_size: int,
        matchmaking_time: float,
        request_timeout: float,
        allreduce_timeout: float,
        next_chunk_timeout: float,
        part_size_bytes: int,
        round_deadline: float,
        max_reduce_attempts: int,
        max_round_peers: int | None = None,
        rules: RoundRules | None = None,
        aggregation: str = "mean",
        aggregation_clip: float = 1.0,
        max_tokens: int | None = None,
        identity: Identity | None = None,
        authorized: frozenset[str] | None = None,
        max_state_downloads: int = 4,
        compression: str = "none",
        client_mode: bool | None = None,
        start: bool = True,
        shutdown_timeout: float = 5.0,
        in_thread: bool = False,
    ):
        if "." in prefix or not prefix:
            raise ValueError(f"prefix={prefix!r} must be a non-empty string without '.'")
        if not 0 < request_timeout < matchmaking_time:
            raise ValueError(f"need 0 < request_timeout ({request_timeout}) < matchmaking_time ({matchmaking_time})")
        max_round_peers = (
            target_group_size if max_round_peers is None else max_round_peers
        )  # None: a round is one group
        if not 1 <= target_group_size <= max_round_peers:
            raise ValueError(f"need 1 <= target_group_size ({target_group_size}) <= max_round_peers={max_round_peers}")
        self.shapes = [tuple(t.shape) for t in templates]
        self.group_width = target_group_size  # the widest butterfly; a round of more peers runs as several groups
        self.in_thread = in_thread  # run as a thread of this process, not a child process (in_thread.py)
        super().__init__(
            [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes],
            dht,
            start=False,
            prefix=prefix,
            target_group_size=max_round_peers,  # one matchmaking assembles the whole round, of up to this many
            min_group_size=min_group_size,
            initial_group_bits="",
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            part_size_bytes=part_size_bytes,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            sender_timeout=next_chunk_timeout,
            reducer_timeout=2 * next_chunk_timeout,
            compression=WireCodec(get_codec(compression)),
            state_compression=NoCompression(),
            allow_state_sharing=False,
            client_mode=client_mode,  # None: the DHT's mode; True: serve nothing, even on a reachable node
            shutdown_timeout=shutdown_timeout,
        )
        self.matchmaking_time, self.request_timeout_s = matchmaking_time, request_timeout
        self.allreduce_timeout, self.round_deadline, self.max_reduce_attempts = (
            allreduce_timeout,
            round_deadline,
            max_reduce_attempts,
        )
        # read in the averager process (set before it forks)
        self.rules = rules or RoundRules()
        self.aggregation, self.aggregation_clip, self.max_tokens = aggregation, aggregation_clip, max_tokens
        # identity: sign our gather payload, and drop every member's that its author did not sign (None: unsigned
        # payloads, for tests of the all-reduce alone). authorized: the peer ids of a closed run (None: open).
        self.identity, self.authorized, self.max_state_downloads = identity, authorized, max_state_downloads
        # per downloading peer: (when, what share of a state) of its recent downloads, manifests and pieces
        self._downloads: dict[str, list[tuple[float, float]]] = {}
        self._banned: dict[str, float] = {}  # reducers caught lying -> until when we refuse to group with them
        self._state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None
        self._votes: OrderedDict[bytes, asyncio.Future] = OrderedDict()  # used in the averager process
        # payload bytes [sent, received] of every all-reduce so far, failed ones included: the averager process's
        # runners add each message as it passes, the host reads the growth per attempt (shared memory, made before
        # the process forks)
        self._payload_totals = torch.zeros(2, dtype=torch.int64).share_memory_()
        # host side: how many peers (us included) will come to this round's matchmaking (e.g. the run's live
        # members); a leader then assembles as soon as that many joined, instead of at matchmaking_time
        self.target_group_size_cap = max_round_peers
        self.expected_members: Callable[[], int] | None = None
        # host side, client mode only: how many live peers of the run accept calls (can lead and reduce); at 0 a
        # round is local at once, with the reason, instead of a matchmaking that cannot succeed
        self.reachable_members: Callable[[], int] | None = None
        # host side: seconds until the next peer of the run will be ready to average when none is now (e.g.
        # Membership.group_wait); reduce waits that long before matchmaking, and again after a matchmaking that found
        # nobody, within round_deadline, instead of averaging alone
        self.group_wait: Callable[[], float] | None = None
        # host side: say that this peer is ready to average now and looking for a group (e.g. Membership.looking);
        # called as reduce begins and every quarter of matchmaking_time while it waits, so that mates ending their
        # rounds meanwhile expect it, rather than reading its round's end as "averaging since"
        self.looking: Callable[[], None] | None = None
        # host side: the swarm's state when it is more than max_staleness rounds past the given tag (ours), else None
        # (e.g. Membership.ahead); asked as reduce begins and while it waits: a peer the swarm has left behind looks
        # for no group, since its Δ would not count and its joining would split its mates' group
        self.swarm_ahead: Callable[[RoundTag], RoundTag | None] | None = None
        # host side: how long this round's matchmaking stays open for the peers expected in it (e.g.
        # Membership.group_window: until the last of them is ready); None: matchmaking_time
        self.group_window: Callable[[], float] | None = None
        self._closing = threading.Event()
        self._state_thread = _state_thread_of(self._outer_pipe)  # hivemind's, serving our state: shutdown joins it
        if start:
            self.run_in_background(await_ready=True, timeout=60)

    @classmethod
    def from_config(
        cls, dht: DHT, templates: Sequence[torch.Tensor], swarm: Any, prefix: str, **kw: Any
    ) -> PseudoGradAverager:
        """Build from a SwarmConfig (same field names; ``matchmaking_time`` for the min time; its round rules)."""
        names = (
            "target_group_size",
            "min_group_size",
            "matchmaking_time",
            "request_timeout",
            "allreduce_timeout",
            "next_chunk_timeout",
            "part_size_bytes",
            "round_deadline",
            "max_reduce_attempts",
            "max_round_peers",
            "compression",
        )
        kw.setdefault("rules", RoundRules.from_config(swarm))
        kw.setdefault("aggregation", swarm.aggregation)
        kw.setdefault("aggregation_clip", swarm.aggregation_clip)
        kw.setdefault("max_state_downloads", swarm.max_state_downloads)
        return cls(dht, templates, prefix, **{name: getattr(swarm, name) for name in names}, **kw)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Like hivemind's, minus its side effect: it leaves SIGINT ignored in the HOST process for good."""
        with children_ignore_sigint():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def shutdown(self) -> None:
        """Stop the averager process; it is gone (joined, killed if it had to be) when this returns, and a serve of
        our state in progress has ended (new ones are refused from the start of the shutdown)."""
        self._closing.set()
        if self.is_alive():
            super().shutdown()  # also tells hivemind's state thread to stop
            self.join(self.shutdown_timeout)
        elif self._state_thread is not None and self._state_thread.is_alive():
            self._inner_pipe.send(("_SHUTDOWN", None))
        if self.is_alive():
            self.kill()
            self.join(self.shutdown_timeout)
        # that thread is a daemon: were the interpreter to end while it serves (torch code, the GIL released), the
        # process would abort ("terminate called without an active exception"; pytorch issue 38228)
        if self._state_thread is not None:
            self._state_thread.join(SERVE_GRACE)
            if self._state_thread.is_alive():
                log.warning("a serve of our state was still running %.0fs into the shutdown", SERVE_GRACE)

    # ---------------------------------------------------------------- host side: reduce
    def _check_inputs(self, pseudo_grads: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight={weight!r} must be a finite number > 0")
        if len(pseudo_grads) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} pseudo-gradient tensors, got {len(pseudo_grads)}")
        out = []
        for i, (grad, shape) in enumerate(zip(pseudo_grads, self.shapes, strict=True)):
            if tuple(grad.shape) != shape:
                raise ValueError(f"pseudo_grads[{i}] has shape {tuple(grad.shape)}, expected {shape}")
            grad = grad.detach().to("cpu", torch.float32)
            if not is_finite(grad):
                raise ValueError(f"pseudo_grads[{i}] is not finite (NaN or inf); refusing to average it")
            out.append(grad)
        return out

    def reduce(
        self, pseudo_grads: Sequence[torch.Tensor], weight: float, payload: GatherPayload | None = None
    ) -> tuple[list[torch.Tensor], ReduceInfo]:
        """Weighted mean over a complete group, or the local pseudo-gradients; never a partial mean."""
        start = time.monotonic()
        grads = self._check_inputs(pseudo_grads, weight)
        gather = self._sign(payload) if payload is not None else None
        alone = Gathered({str(self.peer_id): payload} if payload is not None else {})
        info = ReduceInfo(gathered=alone, check_seconds=time.monotonic() - start)
        notes: list[str] = []
        if self.client_mode and self._no_reachable_member():
            info.group_size, info.reason = 1, NO_REACHABLE_MEMBER
            return [g.clone() for g in grads], info
        attempt_budget = 2 * self.matchmaking_time + self.request_timeout_s + self.allreduce_timeout
        mine = payload.tag if isinstance(payload, GatherPayload) else None
        if not self._left_behind(mine, info):
            self._say_looking()
            self._wait_for_group(start + self.round_deadline - attempt_budget, info, notes, mine)
        while info.ahead is None and info.attempts < self.max_reduce_attempts:
            if info.attempts and time.monotonic() + attempt_budget > start + self.round_deadline:
                notes.append(f"no time for attempt {info.attempts + 1} within round_deadline={self.round_deadline}s")
                break
            info.attempts += 1
            averaged, why, retry = self._attempt(grads, float(weight), gather, info)
            if averaged is not None:
                info.complete, info.reason = True, "; ".join(notes)
                return averaged, info
            notes.append(f"attempt {info.attempts}: {why}")
            # nobody came, but peers will be ready later (they began their round while we looked): wait, retry
            if self._left_behind(mine, info):
                break
            if not retry and not self._wait_for_group(start + self.round_deadline - attempt_budget, info, notes, mine):
                break
        if info.ahead is not None:
            notes.append(f"the swarm holds {info.ahead}, past this peer's {mine}: no group looked for")
        info.group_size, info.complete, info.reason = 1, False, "; ".join(notes)
        return [g.clone() for g in grads], info

    def _wait_for_group(self, until: float, info: ReduceInfo, notes: list[str], mine: RoundTag | None) -> bool:
        """Wait while no mate is ready but one will be (``group_wait``), if that is before ``until`` (monotonic).
        The mates' round ends are estimates, revised as they go and early when they speed up, so the wait asks
        again every quarter of matchmaking_time, and says meanwhile that we are looking (``looking``): a mate that
        ends its round during the wait then expects us, and we join it within that quarter. The wait ends early
        when the swarm has left ``mine`` behind (``_left_behind``). The wait counts as matchmaking. Whether it
        waited, and may look for a group now."""
        began, expected = time.monotonic(), 0.0
        while not self._closing.is_set():
            if expected and self._left_behind(mine, info):
                break
            delay = self._ask_group_wait()
            if delay <= 0.0 or time.monotonic() + delay > until:
                break
            if not expected:
                expected = delay
                log.info("no peer is ready to average now; waiting up to %.1fs for the next one", delay)
            self._say_looking()
            self._closing.wait(min(delay, self.matchmaking_time / 4))
        waited = time.monotonic() - began
        if not expected:
            return False
        info.matchmaking_seconds += waited
        notes.append(f"waited {waited:.1f}s for the next peer to be ready (expected in {expected:.1f}s)")
        return not self._closing.is_set() and info.ahead is None

    def _left_behind(self, mine: RoundTag | None, info: ReduceInfo) -> bool:
        """Whether the swarm holds a state too far past ``mine`` for our Δ to count (``swarm_ahead``; it goes to
        ``info.ahead``); False when that is not known."""
        if self.swarm_ahead is None or mine is None:
            return False
        try:
            ahead = self.swarm_ahead(mine)
        except Exception as exc:  # noqa: BLE001 - not knowing where the swarm is: look for a group as before
            log.debug("where the swarm is is unknown (%r)", exc)
            return False
        if isinstance(ahead, RoundTag) and ahead.round > mine.round + self.rules.max_staleness:
            info.ahead = ahead
            log.info("the swarm holds %s, past this peer's %s: resyncing instead of looking for a group", ahead, mine)
        return info.ahead is not None

    def _ask_group_wait(self) -> float:
        """``group_wait``'s answer; 0 when there is none or it fails (then matchmaking goes ahead now)."""
        if self.group_wait is None:
            return 0.0
        try:
            return float(self.group_wait())
        except Exception as exc:  # noqa: BLE001 - not knowing when others are ready: go to matchmaking now
            log.debug("when peers are ready is unknown (%r)", exc)
            return 0.0

    def _say_looking(self) -> None:
        """Tell the mates we are ready now and looking for a group (``looking``), if anyone listens."""
        if self.looking is None:
            return
        try:
            self.looking()
        except Exception as exc:  # noqa: BLE001 - the mates then read our last announcement, as before
            log.debug("announcing that this peer is looking for a group failed (%r)", exc)

    def _no_reachable_member(self) -> bool:
        """Whether no live peer of the run can lead a group for us (client mode; ``reachable_members`` says 0)."""
        if self.reachable_members is None:
            return False
        try:
            return int(self.reachable_members()) == 0
        except Exception as exc:  # noqa: BLE001 - not knowing who is reachable: try matchmaking as usual
            log.debug("reachable members unknown (%r)", exc)
            return False

    def _sign(self, payload: GatherPayload) -> Any:
        """Our payload's wire form, signed with our key (bound to our peer id and this run's prefix)."""
        wire = payload.to_wire()
        if self.identity is not None and isinstance(payload, GatherPayload):
            message = payload.signed_bytes(self.prefix, self.identity.peer_id)
            wire = {**wire, "key": self.identity.public_key, "sig": self.identity.sign(message)}
        return wire

    def _opened(self, peer_id: str, raw: Any) -> Any:
        """A member's wire payload without its signature when its author signed it, else None (then dropped and
        counted). The signing key must be the one the member's peer id stands for: a leader that relays the
        group's payloads cannot forge one, nor pass one member's off as another's."""
        if self.identity is None:
            return raw
        if not isinstance(raw, dict) or not isinstance(raw.get("key"), bytes) or not isinstance(raw.get("sig"), bytes):
            return None
        wire = {k: v for k, v in raw.items() if k not in ("key", "sig")}
        payload = GatherPayload.from_wire(wire)
        if payload is None or peer_id_of(raw["key"]) != peer_id:
            return None
        return wire if verify(raw["key"], payload.signed_bytes(self.prefix, peer_id), raw["sig"]) else None

    def _attempt(
        self, grads: list[torch.Tensor], weight: float, gather: Any, info: ReduceInfo
    ) -> tuple[list[torch.Tensor] | None, str, bool]:
        """One step on freshly copied buffers -> (averaged or None, why not, whether a retry makes sense)."""
        if not self.is_alive():
            return None, "the averager process is not running", False
        t0 = time.monotonic()
        with self.get_tensors() as shared:
            for buf, grad in zip(shared, grads, strict=True):
                buf.copy_(grad)
        info.copy_seconds += time.monotonic() - t0
        window = self._expect_members()
        t0, control, totals = time.monotonic(), None, self._payload_totals.clone()
        # hivemind starts the all-reduce at the leader's deadline; a follower whose own step times out at the
        # same moment leaves a group the others then run without it. One more matchmaking period of slack.
        find_timeout = window + self.matchmaking_time + self.request_timeout_s
        try:
            control = self.step(weight=weight, gather=gather, timeout=find_timeout, allow_retries=False, wait=False)
            out = self._result_of(control, time.monotonic() + find_timeout + self.allreduce_timeout + 5.0)
        except BaseException as e:  # hivemind may raise asyncio.CancelledError
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            began = control is not None and control.began_allreduce
            if control is not None and not control.done():
                control.cancel()
            self._count_payload(info, totals)  # a failed all-reduce's bytes were sent all the same
            if not began:
                info.matchmaking_seconds += time.monotonic() - t0
                return None, f"no group formed ({type(e).__name__}: {e})", False
            info.allreduce_seconds += time.monotonic() - t0
            return None, f"all-reduce failed ({type(e).__name__}: {e})", True
        info.matchmaking_seconds += out["t_group"] - t0
        info.allreduce_seconds += time.monotonic() - out["t_group"]
        self._count_payload(info, totals)
        for peer, left in out.get("banned", {}).items():  # the averager process banned them: admits() says so too
            self._banned[peer] = max(self._banned.get(peer, 0.0), time.monotonic() + left)
        if not out["complete"]:
            return None, f"incomplete all-reduce in a group of {out['group_size']}: {out['reason']}", True
        t0 = time.monotonic()
        with self.get_tensors() as shared:  # the mean itself, not a copy: nothing writes there until our next step
            averaged = list(shared)
        finite = all(is_finite(t) for t in averaged)
        info.copy_seconds += time.monotonic() - t0
        if not finite:
            return None, "the group's average is not finite", False
        info.group_size, info.groups, info.gathered = out["group_size"], out["groups"], out["gathered"]
        log.info("averaged in a round of %d peer(s), %d group(s)", info.group_size, info.groups)
        return averaged, "", False

    def _result_of(self, control: Any, deadline: float) -> Any:
        """The step's result, by ``deadline`` (monotonic; TimeoutError after it). While it is still matchmaking, say
        every quarter of matchmaking_time that we are looking (``looking``): a mate that reads our announcement then
        still expects us and names the same leader (Membership.leader), where a ``ready_at`` gone stale would read as
        averaging since."""
        while True:
            try:
                return control.result(timeout=max(0.0, min(self.matchmaking_time / 4, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if not control.began_allreduce:
                    self._say_looking()

    def _count_payload(self, info: ReduceInfo, before: torch.Tensor) -> None:
        """Add the payload bytes counted since ``before`` (a copy of the totals) to ``info``. An attempt the host
        gave up on while its runner still ran counts the rest with the next attempt."""
        sent, received = (self._payload_totals - before).tolist()
        info.bytes_sent += sent
        info.bytes_received += received

    def _expect_members(self) -> float:
        """Tell the averager process how many members to assemble the round at and how long to hold its matchmaking
        open for them: the expected count, within [min_group_size, max_round_peers] (a leader whose group holds that
        many starts at once), and ``group_window`` (until the last expected peer is ready), within
        [matchmaking_time, round_deadline / 2]. Every peer declares that window, so the first to arrive leads and
        keeps the round open for the others (hivemind's matchmaking: the earliest expiration leads; a later peer
        whose window ends sooner takes the group over, the followers redirected to it). Returns the window."""
        expected, window = self.target_group_size_cap, self.matchmaking_time
        try:
            if self.expected_members is not None:
                expected = int(self.expected_members())
            if self.group_window is not None:
                window = min(max(float(self.group_window()), self.matchmaking_time), self.round_deadline / 2)
        except Exception as exc:  # noqa: BLE001 - not knowing who will come only costs the wait
            log.debug("expected members or their window unknown (%r): assembling at max_round_peers", exc)
        size = max(self.matchmaking_kwargs["min_group_size"], min(self.target_group_size_cap, expected))
        self._outer_pipe.send(("_set_group_target", [], dict(size=size, window=window)))
        log.info("looking for this round's group: %d peer(s) expected, open for up to %.1fs", size, window)
        return window

    async def _set_group_target(self, size: int, window: float | None = None) -> None:
        """(averager process) Assemble groups at ``size`` members from now on, holding the matchmaking open for
        ``window`` seconds at most (the next step reads both)."""
        matchmaking = self._matchmaking
        matchmaking.target_group_size = matchmaking.potential_leaders.target_group_size = size
        if window is not None:
            matchmaking.min_matchmaking_time = matchmaking.potential_leaders.min_matchmaking_time = window

    # ---------------------------------------------------------------- averager process: all-reduce + vote
    def _vote_state(self, group_id: bytes, members: Sequence[Any] | None = None) -> dict[str, Any]:
        """Per group: this peer's verdict and, on a node, its group view (futures of (complete, digest); see
        ``_collect_votes``), verdicts pushed to us by others, a change event, and the members (once known)."""
        if group_id not in self._votes:
            loop = asyncio.get_event_loop()
            self._votes[group_id] = dict(
                mine=loop.create_future(), view=loop.create_future(), heard={}, changed=asyncio.Event(), members=None
            )
            if len(self._votes) > 16:  # keep the verdicts of recent groups only
                self._votes.popitem(last=False)
        state = self._votes[group_id]
        if members is not None:
            state["members"] = {str(p) for p in members}
        return state

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        """Run the stock butterfly, judge this member's view of it, then agree with the group (rpc_vote)."""
        t_group, gathered, reason, verdict, runner, digest = time.monotonic(), Gathered(), "", False, None, b""
        groups = 1
        vote = self._vote_state(group_info.group_id, group_info.peer_ids)["mine"]
        modes = [AveragingMode.NODE] * group_info.group_size
        try:
            _, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            modes = [AveragingMode(m) for m in mode_ids]
            members = zip(group_info.peer_ids, user_bytes, strict=True)
            gathered = Gathered.parse({str(p): self._opened(str(p), self._decode(b)) for p, b in members})
            strangers = [str(p) for p in group_info.peer_ids if not self.admits(p)]
            if strangers:  # never send a part to, or take one from, a peer that is not listed or was caught lying
                raise PermissionError(f"the group holds {len(strangers)} unlisted or banned peer(s)")
            factors = self.rules.weight_factors(gathered)  # the members whose Δ counts (protocol.decide)
            if str(self.peer_id) not in factors:
                kwargs["weight"] = 0.0  # out of sync with the group: serve as a reducer, contribute nothing
            plan = self._plan(group_info, modes, gathered, factors)
            members = plan.members
            senders = [str(p) for p, m in zip(members, plan.modes, strict=True) if m != AveragingMode.AUX]
            declared = tuple(gathered.payloads[p].tokens if p in factors else None for p in senders)
            stale = tuple(factors.get(p, 1.0) for p in senders)
            aggregation = Aggregation(
                self.aggregation, self.aggregation_clip, declared, self.max_tokens, stale if min(stale) < 1 else None
            )
            groups = len(plan.groups.owners) if plan.groups is not None else 1
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = ExactRunner(
                    aggregation=aggregation,
                    payload_bytes=PayloadBytes(self._payload_totals),
                    groups=plan.groups,
                    p2p=self._p2p,
                    servicer_type=type(self),
                    prefix=self.prefix,
                    tensors=local_tensors,
                    group_id=group_info.group_id,
                    ordered_peer_ids=members,
                    peer_fractions=plan.fractions,
                    modes=plan.modes,
                    **kwargs,
                )
                self._running_groups[group_info.group_id].set_result(runner)
                async for tensor, averaged in azip(as_aiter(*local_tensors), runner):
                    tensor.copy_(averaged)
                digest = _digest(local_tensors)
            container, reducer = runner.tensor_part_container, runner.tensor_part_reducer
            if runner.lying_reducers:
                liars = sorted(str(p) for p in runner.lying_reducers)
                for liar in liars:
                    self._banned[liar] = time.monotonic() + BAN_SECONDS
                reason = f"reducer(s) {', '.join(p[-6:] for p in liars)} returned an average too long to be one: banned"
            elif container.failed_size:
                reason = f"{container.failed_size} of {container.total_size} values lost their reducer"
            elif runner.banned_senders or any(math.isfinite(x) for x in reducer.sender_failed_after):
                reason = "this peer's reducer dropped a sender mid-round"
            elif any(n != reducer.num_parts for n in reducer.num_parts_received):
                reason = f"this peer's reducer got {reducer.num_parts_received} of {reducer.num_parts} parts"
            else:
                verdict = True
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            if not vote.done():
                vote.set_result((verdict, digest))
        deadline = t_group + self.allreduce_timeout - 1.0
        against = await self._collect_votes(group_info, modes, verdict, digest, deadline)
        return dict(
            complete=verdict and not against,
            gathered=gathered,
            group_size=group_info.group_size,
            groups=groups,
            t_group=t_group,
            reason=reason or "members without a complete result: " + ", ".join(against),
            # the host's copy of the bans (it is another process): seconds each has left
            banned={p: until - time.monotonic() for p, until in self._banned.items()},
        )

    def _plan(
        self, group_info: GroupInfo, modes: list[AveragingMode], gathered: Gathered, factors: dict[str, float]
    ) -> _Plan:
        """This member's butterfly in the round: the whole round when it fits in one group (``group_width``: the
        config's target_group_size), else its group of the round (protocol.split_groups) and how the groups' means
        are combined part by part (butterfly.RoundGroups). The vector is shared evenly among a group's reducers
        (client-mode members reduce nothing), which every member computes alike: declared bandwidths are not used."""
        peers = list(group_info.peer_ids)
        reducers = [m != AveragingMode.CLIENT for m in modes]

        def fractions(members: Sequence[int]) -> list[int]:
            return list(hagenbach_bishoff(self.total_size, [1.0 if reducers[i] else 0.0 for i in members]))

        split = split_groups(reducers, self.group_width)
        if len(split) == 1:
            return _Plan(peers, modes, fractions(range(len(peers))), None)
        me = peers.index(self.peer_id)
        index = next(k for k, members in enumerate(split) if me in members)
        lengths = part_lengths(self.shapes, int(self.allreduce_kwargs["part_size_bytes"] / 4))
        owners = [[peers[members[i]] for i in part_owners(lengths, fractions(members))] for members in split]
        caps = [
            sum(gathered.payloads[p].tokens * factors[p] for p in (str(peers[i]) for i in members) if p in factors)
            for members in split
        ]

        async def call(peer: Any, request: Any) -> Any:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            return await stub.rpc_combine_part(request, timeout=self.allreduce_kwargs["reducer_timeout"])

        timeout = self.allreduce_kwargs["reducer_timeout"]
        groups = RoundGroups(index, owners, lengths, caps, call, timeout)
        mine = split[index]
        return _Plan([peers[i] for i in mine], [modes[i] for i in mine], fractions(mine), groups)

    async def rpc_combine_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Another group's mean of a part this peer is the round reducer of -> the round's mean of it, once every
        group's came (butterfly.Combiner); an empty reply for a round we are not running, or from a peer not
        admitted."""
        refused = averaging_pb2.DownloadData()
        try:
            group_id = self.serializer.loads(request.metadata)["group_id"] if len(request.metadata) <= 256 else None
        except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
            group_id = None
        if not isinstance(group_id, bytes) or not self.admits(context.remote_id):
            return refused
        deadline = time.monotonic() + self.request_timeout_s
        while group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the caller's group may have started its butterfly a moment before ours
        future = self._running_groups.get(group_id)
        if future is None:
            return refused
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            return refused
        if getattr(runner, "combiner", None) is None:
            return refused
        return await runner.combiner.serve(context.remote_id, request)

    def _decode(self, user_bytes: Any) -> Any:
        """One member's gather payload off the wire, or None when it does not decode (then dropped, counted)."""
        try:
            return self.serializer.loads(user_bytes)
        except Exception:  # noqa: BLE001 - whatever a member sent, it must not break the round
            return None

    async def _collect_votes(
        self, group_info: GroupInfo, modes: list[AveragingMode], verdict: bool, digest: bytes, deadline: float
    ) -> list[str]:
        """Exchange verdicts; return the members that did not confirm a complete result (empty: agreed).

        A verdict is (complete?, digest of the member's averaged vector): a member counts as confirming only with
        a True verdict and the same digest as ours, so a reducer that sent different members different results
        fails the attempt. Client-mode members (behind NAT) accept no calls, and two of them cannot reach each
        other, so the verdicts travel through the members that accept calls ("nodes"; a group always holds one,
        its leader): every member pushes its verdict to every node (``rpc_vote``), and a node answers with its
        GROUP VIEW: True only if its own verdict is and every client member pushed True with the node's digest
        (it waits for them until ``deadline``; the view is fixed once, so every caller gets the same answer). A
        node confirms the attempt when every other node's view and every client's push agree with it; a client
        when every node's view does (which covers the other clients).
        """
        state = self._vote_state(group_info.group_id, group_info.peer_ids)
        request = _vote_message(group_info.group_id, verdict, digest)
        others = [(p, m) for p, m in zip(group_info.peer_ids, modes, strict=True) if p != self.peer_id]
        callable_peers = [p for p, m in others if m != AveragingMode.CLIENT]
        clients = [str(p) for p, m in others if m == AveragingMode.CLIENT]

        async def ask(peer: Any) -> bool:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            timeout = max(0.5, deadline - time.monotonic())
            return _read_vote(await stub.rpc_vote(request, timeout=timeout)) == (True, digest)

        asks = asyncio.gather(*map(ask, callable_peers), return_exceptions=True)
        against: list[str] = []
        if self.mode != AveragingMode.CLIENT:  # a node: hear every client, then fix the view it answers with
            while not all(c in state["heard"] for c in clients) and time.monotonic() < deadline:
                state["changed"].clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(state["changed"].wait(), timeout=deadline - time.monotonic())
            heard = dict(state["heard"])
            against += [f"{p[-6:]}(no)" for p in clients if p in heard and heard[p] != (True, digest)]
            against += [f"{p[-6:]}(silent)" for p in clients if p not in heard]
            if not state["view"].done():
                state["view"].set_result((verdict and not against, digest))
        answers = await asks
        against = [
            f"{str(p)[-6:]}({'no' if a is False else type(a).__name__})"
            for p, a in zip(callable_peers, answers, strict=True)
            if a is not True
        ] + against
        return against

    async def rpc_vote(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """Record the caller's verdict; answer with this node's group view once fixed (False if not in time).

        Only for a group this peer is in, from a member of it: anything else is answered False and not kept, so a
        flood of made-up group ids cannot push the live group's verdicts out.
        """
        refused = _vote_message(request.group_id, False, b"")
        if request.group_id not in self._running_groups and request.group_id not in self._votes:
            return refused
        state = self._vote_state(request.group_id)
        if state["members"] is not None and str(context.remote_id) not in state["members"]:
            return refused
        state["heard"][str(context.remote_id)] = _read_vote(request)
        state["changed"].set()
        try:
            verdict, digest = await asyncio.wait_for(asyncio.shield(state["view"]), timeout=self.allreduce_timeout)
        except asyncio.TimeoutError:
            verdict, digest = False, b""
        return _vote_message(request.group_id, verdict, digest)

    # ---------------------------------------------------------------- state sharing
    def set_state_provider(self, fn: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        """Serve ``fn()`` -> (metadata dict, tensors) to peers calling ``load_state``; enables sharing. A client-mode
        averager (behind NAT: nobody can call it) keeps ``fn`` but serves nothing."""
        self._state_provider = fn
        if not self.client_mode:
            self.allow_state_sharing = True

    def get_current_state(self) -> tuple[dict, list[torch.Tensor], None]:
        """Called by hivemind in the host process when a peer downloads our state."""
        if self._state_provider is None:
            raise RuntimeError("no state provider set; this peer has no outer state to share")
        if self._closing.is_set():
            raise RuntimeError("this peer is leaving; ask another holder")
        metadata, tensors = self._state_provider()
        return {_STATE_KEY: metadata}, [t.detach().cpu() for t in tensors], None

    def admits(self, peer: Any) -> bool:
        """Whether ``peer`` may average with us and download our state: listed (in a closed run), not banned."""
        peer = str(peer)
        until = self._banned.get(peer)  # the reduce thread and the main thread (Membership) both ask
        if until is not None and until < time.monotonic():
            self._banned.pop(peer, None)
        return (self.authorized is None or peer in self.authorized) and peer not in self._banned

    @property
    def _matchmaking(self) -> Any:
        if "_matchmaking_" not in self.__dict__:  # the host process: hivemind builds it in the averager process
            raise AttributeError("_matchmaking")
        return self.__dict__["_matchmaking_"]

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Any) -> None:
        """hivemind builds its Matchmaking in the averager process; as a follower ours never asks a leader that is
        unlisted or banned to take it (it answers None, as for a leader that refused, and the search goes on)."""
        ask = matchmaking._request_join_group

        async def ask_admitted(leader: Any) -> Any:
            return await ask(leader) if self.admits(leader) else None

        matchmaking._request_join_group = ask_admitted
        self.__dict__["_matchmaking_"] = matchmaking

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, closed to peers that a closed run does not list."""
        if not self.admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Our state, to a listed peer that has not downloaded it ``max_state_downloads`` times in the last minute;
        anyone else gets an empty stream (hivemind's way to say no). The state is a snapshot (sync.py), so a flood
        of downloads never holds the training lock beyond one copy per state."""
        if not self._may_download(str(context.remote_id), 1.0):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def download(
        self, peer_id: str, timeout: float, max_tensors: int, max_bytes: int
    ) -> tuple[dict, list[torch.Tensor]] | str:
        """(metadata, tensors) of ``peer_id``'s state, or why not (a line). Bounded: ``timeout`` for the whole
        download, ``next_chunk_timeout`` between messages, at most ``max_tensors`` tensors and ``max_bytes`` bytes
        of tensor data (what the caller's state holds), plus 1 MiB for metadata and framing."""
        future: MPFuture = MPFuture()
        limits = dict(max_tensors=max_tensors, max_bytes=max_bytes + (1 << 20))
        self._outer_pipe.send(("_download", [], dict(peer_id=peer_id, timeout=timeout, future=future, **limits)))
        try:
            result = future.result(timeout=timeout + 5.0)
        except Exception as e:  # noqa: BLE001 - a dead averager process, a pipe error: no state, and why
            return f"{type(e).__name__}: {e}"
        if isinstance(result, str):
            return result
        metadata, tensors = result
        if not isinstance(metadata, dict) or not isinstance(metadata.get(_STATE_KEY), dict):
            return "the peer sent no state (it serves none, or refused us)"
        return metadata[_STATE_KEY], tensors

    async def _download(self, peer_id: str, timeout: float, future: MPFuture, **limits: int) -> None:
        await self._settle(future, self._fetch_state(PeerID.from_base58(peer_id), **limits), timeout, "state")

    async def _fetch_state(self, peer: PeerID, max_tensors: int, max_bytes: int) -> tuple[Any, list[torch.Tensor]]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors, received = None, [], [], 0
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            received += message.ByteSize()
            if received > max_bytes:
                raise ValueError(f"the peer sent over {max_bytes} bytes, more than this model's state holds")
            if message.metadata:
                if metadata is not None:
                    raise ValueError("the peer sent its metadata twice")
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype starts the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
                if len(tensors) > max_tensors:
                    raise ValueError(f"the peer sent over {max_tensors} tensors")
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return metadata, tensors

    # ---------------------------------------------------------------- state in pieces (swarm/download.py)
    def manifest(self, peer_id: str, timeout: float) -> dict | str:
        """The metadata of ``peer_id``'s served state (round, checksum, fingerprint, consensus and ``parts``: its
        part digests, state_parts.py), or why not (a line). One unary call of at most ``timeout`` seconds."""
        result = self._in_process("_manifest", timeout, peer_id=peer_id)
        if isinstance(result, str):
            return result
        if not isinstance(result, dict) or not isinstance(result.get(_STATE_KEY), dict):
            return "the peer sent no manifest (it serves none, or refused us)"
        return result[_STATE_KEY]

    def piece(self, peer_id: str, tag: tuple[int, str], start: int, end: int, timeout: float) -> torch.Tensor | str:
        """Values [start, end) of the flat state ``peer_id`` serves (fp32, state_parts.py), only if that state is
        still ``tag`` (round, checksum); or why not (a line). Bounded like ``download``: ``timeout`` for the piece,
        ``next_chunk_timeout`` between messages, at most the piece's own bytes plus 64 KiB read."""
        request = {"round": tag[0], "checksum": tag[1], "start": start, "end": end}
        return self._in_process("_piece", timeout, peer_id=peer_id, request=request)

    def _in_process(self, method: str, timeout: float, **kwargs: Any) -> Any:
        """Run ``method`` (a coroutine of the averager process) with a deadline; its result or why it failed."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send((method, [], dict(timeout=timeout, future=future, **kwargs)))
        try:
            return future.result(timeout=timeout + 5.0)
        except Exception as e:  # noqa: BLE001 - a dead averager process, a pipe error: nothing, and why
            return f"{type(e).__name__}: {e}"

    async def _settle(self, future: MPFuture, work: Any, timeout: float, what: str) -> None:
        try:
            result: Any = await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            result = f"no complete {what} within {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - whatever the donor did, it is a refused offer
            result = f"{type(e).__name__}: {e}"
        if not future.done():
            future.set_result(result)

    async def _manifest(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        async def call() -> Any:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            response = await stub.rpc_state_manifest(averaging_pb2.DownloadRequest(), timeout=timeout)
            return self.serializer.loads(response.metadata) if response.metadata else None

        await self._settle(future, call(), timeout, "manifest")

    async def _piece(self, peer_id: str, request: dict, timeout: float, future: MPFuture) -> None:
        async def call() -> torch.Tensor | str:
            values = request["end"] - request["start"]
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            stream = await stub.rpc_download_piece(averaging_pb2.DownloadData(metadata=self.serializer.dumps(request)))
            parts, received, cap = [], 0, 4 * values + (1 << 16)
            async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
                received += message.ByteSize()
                if received > cap:
                    raise ValueError(f"the peer sent over {cap} bytes for a piece of {values} values")
                parts.append(message.tensor_part)
            if not parts:
                return "the peer sent no piece (it holds another state now, or refused us)"
            piece = deserialize_torch_tensor(combine_from_streaming(parts))
            if piece.dtype != torch.float32 or piece.numel() != values:
                return f"the peer sent {piece.numel()} {piece.dtype} values, not {values} float32"
            return piece.reshape(-1)

        await self._settle(future, call(), timeout, "piece")

    def _may_download(self, peer: str, cost: float) -> bool:
        """Charge ``peer`` ``cost`` (a whole state is 1, a piece its share of the state, at least one part's) if
        its last minute's downloads from us stay within ``max_state_downloads`` states; refuse (False) if not."""
        now = time.monotonic()
        recent = [(t, c) for t, c in self._downloads.get(peer, []) if now - t < 60.0]
        if not self.admits(peer) or sum(c for _, c in recent) + cost > self.max_state_downloads + 1e-9:
            self._downloads[peer] = recent
            return False
        self._downloads[peer] = recent + [(now, cost)]
        if len(self._downloads) > 1024:  # forget the peers that downloaded least recently
            for stale in sorted(self._downloads, key=lambda p: max((t for t, _ in self._downloads[p]), default=0.0))[
                :512
            ]:
                del self._downloads[stale]
        return True

    async def rpc_state_manifest(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """The metadata of our served state, part digests included, to a listed peer within its download budget
        (a manifest costs MANIFEST_COST of a state); anyone else gets empty metadata."""
        if not self._may_download(str(context.remote_id), MANIFEST_COST):
            return averaging_pb2.DownloadData()
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        self._served_values = total_values(tensors)
        return averaging_pb2.DownloadData(metadata=metadata)

    async def rpc_download_piece(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Values [start, end) of our served state, if it is the (round, checksum) asked for and the range is whole
        parts, at most MAX_PIECE_PARTS of them; charged to the peer's download budget as its share of the state
        (at least one part; a request for another state is charged too). Anything else, or over budget: an empty
        stream."""
        want = _piece_request(request.metadata, self.serializer)
        peer, values = str(context.remote_id), self._served_values
        if want is None or (values and not _whole_parts(want[2], want[3], values)):
            return
        if values and not self._may_download(peer, _piece_cost(want, values)):  # a piece of another state pays too
            return
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        meta = self.serializer.loads(metadata).get(_STATE_KEY, {})
        total = self._served_values = total_values(tensors)
        rnd, checksum, start, end = want
        if (meta.get("round"), meta.get("checksum")) != (rnd, checksum) or not _whole_parts(start, end, total):
            return
        if not values and not self._may_download(peer, _piece_cost(want, total)):
            return
        piece = serialize_torch_tensor(read_values(tensors, start, end))
        for part in split_for_streaming(piece, _PIECE_CHUNK_BYTES):
            yield averaging_pb2.DownloadData(tensor_part=part)


MAX_PIECE_PARTS = 16  # the longest piece a peer serves: 16 MiB (state_parts.PART_BYTES each)
MANIFEST_COST = 1 / 16  # of a state's download budget: 16 manifests a minute per budgeted state
_PIECE_CHUNK_BYTES = 1 << 20  # stream message size of a piece (hivemind's default, 64 KiB, costs 16x the messages)


def _piece_request(raw: bytes, serializer: Any) -> tuple[int, str, int, int] | None:
    """(round, checksum, start, end) of a piece request, or None for anything malformed."""
    try:
        request = serializer.loads(raw) if len(raw) <= 1024 else None
        rnd, checksum, start, end = (request[k] for k in ("round", "checksum", "start", "end"))
    except Exception:  # noqa: BLE001 - a stranger's bytes: refused, never raised
        return None
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rnd, start, end))
    return (rnd, checksum, start, end) if ints and isinstance(checksum, str) else None


def _whole_parts(start: int, end: int, total: int) -> bool:
    """Whether [start, end) is 1 to MAX_PIECE_PARTS whole parts of a state of ``total`` values (the last may be
    short)."""
    aligned = start % PART_VALUES == 0 and (end % PART_VALUES == 0 or end == total)
    return aligned and 0 <= start < end <= total and end - start <= MAX_PIECE_PARTS * PART_VALUES


def _piece_cost(want: tuple[int, str, int, int], total: int) -> float:
    """A piece's charge against the download budget: its share of the state, at least one part's."""
    return max(want[3] - want[2], PART_VALUES) / max(total, 1)

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
         failures never raise: no group -> retried while a mate is still expected, else the local result;
         incomplete or failed all-reduce -> retry on freshly copied buffers while ``max_reduce_attempts`` and
         ``round_deadline`` allow, else local.
         ``download`` never raises either: a refusal, a timeout, more tensors or bytes than asked for, a stream
         that stalls for ``next_chunk_timeout``: a line saying why. A reducer whose averaged part is too long to
         be an average of parts its rule accepts (butterfly.py) fails the attempt for this member and is banned.

The parts, one job each (``PseudoGradAverager`` is hivemind's DecentralizedAverager with one mixin per part; hivemind
registers every ``rpc_*`` method the class has, its mixins' included, under the class's name):
  reduce.py         the host side of ``reduce``: the checks, attempts on fresh buffers, retries, timing and bytes
  matchmaking.py    whether, when, at what size and with whom to look for a group: the round's size and window,
                    the wait for mates that will be ready, admission (a closed run's list, the bans)
  aggregate.py      one attempt in the averager process: the members' signed payloads, the plan (one group or
                    several), the butterfly (butterfly.py) and this member's own verdict
  repair.py         a reducer's slice whose replies stopped short for us, copied whole from a mate that got it
  vote.py           the completeness vote: every member's verdict, agreed across the round
  state_serving.py  our state served whole, a donor's downloaded with our bounds; the per-peer download budget
  state_pieces.py   the state in pieces: a donor's manifest and ranges of its state (swarm/download.py)
This module: the class, its construction (``from_config``) and its averager process's start and shutdown.

Client mode (the DHT's ``client_mode``, hivemind's ``AveragingMode.CLIENT``: a peer others cannot dial, behind
NAT): it registers no RPC handler, never declares itself a leader and reduces nothing (its share of the vector is 0),
but sends its Δ to the reducers and takes the averaged parts back over the streams it opened, so it contributes and
ends bitwise equal to the group. Its vote goes to the group's nodes only (vote.py). It serves no state. With
``reachable_members`` at 0 (no live node in the run) ``reduce`` returns the local result at once, with
``NO_REACHABLE_MEMBER`` as the reason. ``client_mode=True`` makes an averager a client on a reachable DHT node too:
the monitor's samples (monitor_samples.py) download the state that way and serve nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import NoCompression
from hivemind.dht import DHT

from p2p_diloco.codec import get_codec
from p2p_diloco.protocol import RoundRules
from p2p_diloco.rounds import ReduceInfo
from p2p_diloco.swarm import limits as _limits  # noqa: F401 - caps the size of every message this process reads
from p2p_diloco.swarm.aggregate import AggregateMixin
from p2p_diloco.swarm.dht import children_ignore_sigint
from p2p_diloco.swarm.hooks import HostHooks
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.in_thread import ThreadOrProcess
from p2p_diloco.swarm.matchmaking import BAN_SECONDS, MatchmakingMixin
from p2p_diloco.swarm.reduce import NO_REACHABLE_MEMBER, ReduceMixin
from p2p_diloco.swarm.repair import RepairMixin
from p2p_diloco.swarm.state_pieces import MANIFEST_COST, MAX_PIECE_PARTS, StatePiecesMixin
from p2p_diloco.swarm.state_serving import SERVE_GRACE, StateServingMixin, _state_thread_of
from p2p_diloco.swarm.strikes import Strikes
from p2p_diloco.swarm.vote import VoteMixin
from p2p_diloco.swarm.wire import WireCodec

__all__ = [
    "BAN_SECONDS",
    "MANIFEST_COST",
    "MAX_PIECE_PARTS",
    "NO_REACHABLE_MEMBER",
    "SERVE_GRACE",
    "PseudoGradAverager",
    "ReduceInfo",
]

log = logging.getLogger("p2p_diloco.averager")


class PseudoGradAverager(
    ThreadOrProcess,
    ReduceMixin,
    MatchmakingMixin,
    AggregateMixin,
    RepairMixin,
    VoteMixin,
    StateServingMixin,
    StatePiecesMixin,
    DecentralizedAverager,
):
    """DecentralizedAverager for fixed-shape fp32 pseudo-gradients; see the module docstring.

    All peers must use this class (hivemind names RPC handlers after the class) and the same ``prefix``.
    """

    _rpc_handlers, _stub_type = None, None  # collect this class's own rpc_* (hivemind caches them per class)

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
        min_cosine: float = -1.0,
        max_skew: float = 1.0,
        max_tokens: int | None = None,
        identity: Identity | None = None,
        authorized: Container[str] | None = None,
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
        self.min_cosine = min_cosine
        self.max_skew = max_skew
        # identity: sign our gather payload, and drop every member's that its author did not sign (None: unsigned
        # payloads, for tests of the all-reduce alone). authorized: the peer ids of a closed run (None: open).
        self.identity, self.authorized, self.max_state_downloads = identity, authorized, max_state_downloads
        # per downloading peer: (when, what share of a state) of its recent downloads, manifests and pieces
        self._downloads: dict[str, list[tuple[float, float]]] = {}
        self._banned: dict[str, float] = {}  # reducers caught lying -> until when we refuse to group with them
        self._declared_until = 0.0  # when our last matchmaking declaration expires (DHT time; matchmaking.py)
        self._strikes = Strikes(me=str(dht.peer_id))  # senders our reducer dropped by direction, in a row (strikes.py)
        self._state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None
        self._votes: OrderedDict[bytes, asyncio.Future] = OrderedDict()  # used in the averager process
        # payload bytes [sent, received] of every all-reduce so far, failed ones included: the averager process's
        # runners add each message as it passes, the host reads the growth per attempt (shared memory, made before
        # the process forks)
        self._payload_totals = torch.zeros(2, dtype=torch.int64).share_memory_()
        # reads of the group key's declarations (DHT lookups of matchmaking) so far, counted as they are made in the
        # averager process (matchmaking.py: paced at READ_PAUSE), read per reduce by the host
        self._group_reads = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.target_group_size_cap = max_round_peers  # the most members one round's matchmaking assembles
        self.hooks = HostHooks()  # what the host (the training peer) tells us about the run (hooks.py)
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
        kw.setdefault("min_cosine", swarm.min_cosine)
        kw.setdefault("max_skew", swarm.max_skew)
        kw.setdefault("max_state_downloads", swarm.max_state_downloads)
        return cls(dht, templates, prefix, **{name: getattr(swarm, name) for name in names}, **kw)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Like hivemind's, minus its side effect: it leaves SIGINT ignored in the HOST process for good."""
        with children_ignore_sigint():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    async def remove_p2p_handlers(self, p2p: Any, *, namespace: str | None = None) -> None:
        """hivemind's (its averager process's shutdown calls it), except that a p2pd already gone is no error: a
        Ctrl-C reaches the whole process group, p2pd too, and its handlers went with it (removing them printed a
        FileNotFoundError traceback from the averager's thread at every Ctrl-C, and the shutdown left the running
        groups unfinalized)."""
        try:
            await super().remove_p2p_handlers(p2p, namespace=namespace)
        except OSError as exc:  # the daemon's control socket is closed or gone
            log.debug("p2pd gone before the averager's handlers were removed: %r", exc)

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

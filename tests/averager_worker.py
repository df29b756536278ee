"""A PseudoGradAverager peer as its own process, driven line by line (used by tests/test_averager.py).

Run: ``python tests/averager_worker.py '<json config>'``. Config keys: ``initial_peers`` (list of maddrs, or
``"stdin"``: read ``INITIAL <json list of maddrs>`` from stdin once the imports are done),
``prefix``, ``shapes`` (list of shapes), ``seed`` (pseudo-grads = make_grads(seed, shapes)), ``averager``
(PseudoGradAverager keyword arguments), optional ``tag`` ([round, checksum] this peer puts in its gather
payload; default [0, "start"], the same on every peer), optional ``kill_after_parts`` (SIGKILL this peer's
whole process group from inside the all-reduce once it has handed that many parts to other reducers;
tests/faults.py), optional
``state_meta`` (serve it with make_grads(seed + 1000, shapes) as the outer state; ``slow_state``: each serve first
does that many seconds of torch work and prints ``SERVING {json}`` as it begins), optional ``gather_garbage``
(send this value instead of a gather payload), optional ``weight_scale`` (put this multiple of the declared
tokens on the wire as the weight), optional ``forge`` (sign the payload with a key that is not this peer's),
optional ``lie_to_first`` (as a reducer, send the first sender a result 0.1% off), optional ``cut_replies_after``
(keep only that many averaged parts from the first other reducer, then fail its stream: prints ``CUT {json}``),
optional ``hostile_asks`` (before repairing a slice, ask each mate for it in ways it must refuse: ``ASKS {json}``),
optional ``drop_first_group`` (as a follower, give up on the first group a leader assembles with this peer, once its
BEGIN_ALLREDUCE is in: a group formed on the leader's side only; prints ``DROPPED {json}``), optional
``slow_first_group`` (as a follower, take in the first group's BEGIN_ALLREDUCE that many seconds late, as a busy
process does: its mates' parts come before it registers the group; prints ``SLOW {json}``), optional
``expected_members`` (what the host's ``expected_members`` answers: the peers this round's matchmaking expects),
optional ``client_mode``
(true: a client-mode DHT node and averager, as a peer behind NAT runs), optional ``identity_path``
(this peer's key file) and ``authorized_peers`` (with ``averager.authorized`` set: the peer ids of a closed run),
optional ``rules`` (protocol.RoundRules keyword arguments), optional ``group_wait`` (the waits the host's
``group_wait`` stands for, one after the other, each from when it is first asked: ``s`` seconds, answered as the time
left, or ``[s, real]``: said to be ``s`` seconds but over after ``real``, as an estimate of a mate's round end that
comes early; then 0), optional ``stop_after`` (the host's ``stopping`` says yes from that many seconds into each
REDUCE: a Ctrl-C while it looks for a group), optional ``ahead`` (``[after, round, checksum]``: the host's
``swarm_ahead`` says the swarm holds that state from ``after`` seconds after it is first asked; before, and without
it, nothing), ``out_dir``. The
RESULT's ``looking`` counts the calls of the host's ``looking``, its ``silent`` lists the members the host's ``silent``
was told of (so far); its ``in_place`` says whether the
result is the averager's shared buffers themselves.

stdout protocol, one line each: ``READY {json}`` once the DHT and averager run, then per stdin command:
``REDUCE <weight>`` -> ``RESULT {json}`` (tensors saved to out_dir/result.pt); ``NAN`` -> ``NAN {json}``;
``LOAD <donor peer id> <timeout>`` -> ``LOADED {json}`` (state saved to out_dir/state.pt; ``refused``: why not);
``EXIT`` -> ``BYE {json}``.
The kill hook prints ``DYING {json}`` just before the kill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # p2p_diloco of this working tree
from faults import install_kill_after_sends  # noqa: E402  (tests/, this file's directory, is sys.path[0])


def make_grads(seed: int, shapes: list[list[int]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=torch.float32) for shape in shapes]


def emit(tag: str, payload: dict) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def _busy(seconds: float, state: list[torch.Tensor]) -> list[torch.Tensor]:
    """``state`` after ``seconds`` of torch work in the calling thread (hivemind's state thread), said by ``SERVING``
    as it begins: a serve as slow as a large state's snapshot and digests."""
    if seconds > 0:
        emit("SERVING", {"seconds": seconds})
        work, until = torch.ones(1 << 20), time.monotonic() + seconds
        while time.monotonic() < until:
            work.mul_(1.0000001)
    return state


class _Garbage:
    """Stands in for a GatherPayload whose wire form is whatever the test says."""

    def __init__(self, value: object) -> None:
        self.value = value

    def to_wire(self) -> object:
        return self.value


def _install_split_lie() -> None:
    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.butterfly import ExactRunner

    honest = ExactRunner._accumulate_parts_streaming

    async def split(self, stream, sender_index):  # type: ignore[no-untyped-def]
        victim = 0 if self.sender_peer_ids[0] != self.peer_id else 1  # our own slice takes another path
        async for reply in honest(self, stream, sender_index):
            if sender_index == victim:
                off = self.wire.compress(self.wire.extract(reply.tensor_part) * 1.001)
                reply = averaging_pb2.AveragingData(code=reply.code, tensor_part=off)
            yield reply

    ExactRunner._accumulate_parts_streaming = split


def _install_cut_replies(after: int) -> None:
    """This member keeps only the first ``after`` averaged parts its first other reducer sends back each attempt,
    reads the rest (so the reducer finishes as usual: it sees nothing wrong) and then fails that stream, as a reset
    connection would: its slice of that reducer stops short, while every other member gets it whole."""
    from p2p_diloco.swarm.butterfly import ExactRunner

    original = ExactRunner._get_peer_stub

    def stub(self, peer):  # type: ignore[no-untyped-def]
        inner = original(self, peer)
        if peer != next(p for p in self.ordered_peer_ids if p != self.peer_id):
            return inner

        class Cut:
            def __getattr__(self, name: str) -> object:
                return getattr(inner, name)

            async def rpc_aggregate_part(self, requests):  # type: ignore[no-untyped-def]
                stream = await inner.rpc_aggregate_part(requests)

                async def cut():  # type: ignore[no-untyped-def]
                    kept = 0
                    async for message in stream:
                        kept += 1
                        if kept <= after:
                            yield message
                    emit("CUT", {"kept": after, "of": kept})
                    raise ConnectionResetError("injected: the reducer's replies cut short")

                return cut()

        return Cut()

    ExactRunner._get_peer_stub = stub


def _hostile_asks(runner, reducer: str) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    """Asks for ``reducer``'s averaged slice that a mate must refuse, by what is wrong with each (wire bytes)."""
    from hivemind.utils import MSGPackSerializer

    start, length = runner.slice_ranges[[str(p) for p in runner.ordered_peer_ids].index(reducer)]
    good = {"group_id": runner.group_id, "reducer": reducer, "start": start, "length": length}

    def ask(**changes: object) -> bytes:
        return MSGPackSerializer.dumps({**good, **changes})

    return {
        "not msgpack": b"\xc1\xff not an ask",
        "too long": ask(reducer=reducer + "x" * 600),
        "not a dict": MSGPackSerializer.dumps([runner.group_id, reducer, start, length]),
        "a field missing": MSGPackSerializer.dumps({k: v for k, v in good.items() if k != "length"}),
        "group id a str": ask(group_id="group"),
        "reducer a list": ask(reducer=[reducer]),
        "start a float": ask(start=float(start)),
        "length a str": ask(length=str(length)),
        "length a bool": ask(start=0, length=True),
        "another group": ask(group_id=bytes(len(runner.group_id))),
        "a reducer not in the group": ask(reducer="QmNotInThisGroup"),
        "another range": ask(start=start + 1),
        "a longer range": ask(length=length + 1),
        "an empty range": ask(length=0),
        "a negative start": ask(start=-1),
    }


def _install_hostile_asks() -> None:
    """Before this member repairs a slice, it sends each mate the asks of ``_hostile_asks`` and prints
    ``ASKS {json}``: per mate, per ask, "refused" (an empty reply), "served" or the error the call raised."""
    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.averager import PseudoGradAverager

    honest = PseudoGradAverager._repair_slices

    async def repair(self, runner, tensors, timeout):  # type: ignore[no-untyped-def]
        outcomes: dict[str, dict[str, str]] = {}
        reducer = next(iter(runner.failed_values), None)
        mates = [p for p in runner.ordered_peer_ids if p != self.peer_id]
        for mate in mates if reducer is not None else []:
            seen = outcomes.setdefault(str(mate)[-6:], {})
            stub = self.get_stub(self._p2p, mate, namespace=self.prefix)
            for what, meta in _hostile_asks(runner, reducer).items():
                try:
                    reply = await stub.rpc_averaged_slice(averaging_pb2.DownloadData(metadata=meta), timeout=timeout)
                    seen[what] = "served" if reply.HasField("tensor_part") else "refused"
                except Exception as exc:  # noqa: BLE001 - the mate's handler raised: what the test must not see
                    seen[what] = f"error: {exc!r:.200}"
        emit("ASKS", {"reducer": reducer, "mates": outcomes})
        return await honest(self, runner, tensors, timeout)

    PseudoGradAverager._repair_slices = repair


def _install_drop_first_group() -> None:
    """The first group a leader assembles with this member as a follower fails its matchmaking as its
    BEGIN_ALLREDUCE arrives (as when this member's search timed out a moment before): the leader runs the group with
    this member in it, and this member's step found no group."""
    from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException

    honest, dropped = Matchmaking.follower_assemble_group, []

    async def drop(self, leader, msg):  # type: ignore[no-untyped-def]
        if dropped:
            return await honest(self, leader, msg)
        dropped.append(str(leader))
        emit("DROPPED", {"leader": str(leader)})
        raise MatchmakingException("injected: gave up on the group its leader just assembled")

    Matchmaking.follower_assemble_group = drop


def _install_slow_first_group(seconds: float) -> None:
    """The first group a leader assembles with this member as a follower is taken in ``seconds`` late: accepted, its
    BEGIN_ALLREDUCE in, but registered only then (as a follower whose process is busy: 32 peers a process in the
    scale harness), while the leader and the other mates already send it parts."""
    from hivemind.averaging.matchmaking import Matchmaking

    honest, slowed = Matchmaking.follower_assemble_group, []

    async def slow(self, leader, msg):  # type: ignore[no-untyped-def]
        if not slowed:  # before hivemind's own: it hands the group to look_for_group, which registers it at once
            slowed.append(str(leader))
            emit("SLOW", {"leader": str(leader), "seconds": seconds})
            await asyncio.sleep(seconds)
        return await honest(self, leader, msg)

    Matchmaking.follower_assemble_group = slow


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    from hivemind.dht import DHT

    from p2p_diloco.protocol import GatherPayload, RoundRules, RoundTag
    from p2p_diloco.swarm.averager import PseudoGradAverager
    from p2p_diloco.swarm.identity import Identity

    if cfg.get("lie_to_first"):  # as a reducer, send the first other sender an average 0.1% off (the others the truth)
        _install_split_lie()
    if cfg.get("cut_replies_after") is not None:
        _install_cut_replies(int(cfg["cut_replies_after"]))
    if cfg.get("hostile_asks"):
        _install_hostile_asks()
    if cfg.get("drop_first_group"):
        _install_drop_first_group()
    if cfg.get("slow_first_group"):
        _install_slow_first_group(float(cfg["slow_first_group"]))
    if cfg.get("kill_after_parts"):
        install_kill_after_sends(int(cfg["kill_after_parts"]), lambda sent: emit("DYING", {"t": time.time()}))
    shapes, seed, out_dir = cfg["shapes"], cfg["seed"], cfg["out_dir"]
    identity = Identity.load(cfg.get("identity_path"))
    initial_peers = cfg.get("initial_peers") or None
    if initial_peers == "stdin":  # started beside the first peer, imports done while it came up: now its address
        initial_peers = json.loads(sys.stdin.readline().removeprefix("INITIAL "))
    dht = DHT(
        initial_peers=initial_peers,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=identity.path,
        check_if_identity_free=False,
        client_mode=bool(cfg.get("client_mode")),
    )
    identity.close()
    grads = make_grads(seed, shapes)
    kwargs = dict(cfg["averager"])
    if kwargs.pop("authorized", None) is not None:  # a closed run of the peers with these seeds' keys
        kwargs["authorized"] = frozenset(cfg["authorized_peers"])
    signer = identity
    if cfg.get("forge"):  # sign with a key that is not this peer's: its payload must not count anywhere
        signer = Identity.load()
        signer.close()
        signer.peer_id = identity.peer_id
    if cfg.get("rules") is not None:
        kwargs["rules"] = RoundRules(**cfg["rules"])
    averager = PseudoGradAverager(dht, grads, cfg["prefix"], identity=signer, **kwargs)
    waits, current, looking = list(cfg.get("group_wait") or []), [], [0]

    def group_wait() -> float:
        """As Membership.group_wait: the time said to be left until the next peer is ready; 0 once it is."""
        now = time.monotonic()
        if not current:
            if not waits:
                return 0.0
            said, real = (waits.pop(0),) * 2 if isinstance(waits[0], int | float) else waits.pop(0)
            current[:] = [now + said, now + real]
        if current[1] <= now:
            current.clear()
            return 0.0
        return current[0] - now

    averager.hooks.group_wait = group_wait
    if cfg.get("expected_members") is not None:
        averager.hooks.expected_members = lambda: int(cfg["expected_members"])
    averager.hooks.looking = lambda: looking.__setitem__(0, looking[0] + 1)
    reduce_began = [math.inf]
    if cfg.get("stop_after") is not None:
        averager.hooks.stopping = lambda: time.monotonic() - reduce_began[0] >= float(cfg["stop_after"])
    silent: list[str] = []  # the members the host was told did not answer a failed attempt's vote (Membership.suspect)
    averager.hooks.silent = silent.extend
    if cfg.get("ahead") is not None:
        after, ahead_round, ahead_checksum = cfg["ahead"]
        first_asked: list[float] = []

        def swarm_ahead(mine: RoundTag) -> RoundTag | None:
            """As Membership.ahead: the swarm's state once ``after`` seconds have passed since the first call."""
            first_asked[:] = first_asked or [time.monotonic()]
            return RoundTag(ahead_round, ahead_checksum) if time.monotonic() - first_asked[0] >= after else None

        averager.hooks.swarm_ahead = swarm_ahead
    rnd, checksum = cfg.get("tag") or [0, "start"]
    steps = []
    original_step = averager.step

    def counting_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append(time.monotonic())
        return original_step(*args, **kwargs)

    averager.step = counting_step
    if cfg.get("state_meta") is not None:
        state = make_grads(seed + 1000, shapes)
        averager.set_state_provider(lambda: (cfg["state_meta"], _busy(cfg.get("slow_state", 0.0), state)))
    emit("READY", {"maddrs": [str(m) for m in dht.get_visible_maddrs()], "peer_id": str(dht.peer_id)})

    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "REDUCE":
            t0 = reduce_began[0] = time.monotonic()
            weight = float(args[0])
            payload = GatherPayload(RoundTag(rnd, checksum), int(weight))
            if "gather_garbage" in cfg:  # what a broken or hostile peer could send instead of a payload
                payload = _Garbage(cfg["gather_garbage"])
            averaged, info = averager.reduce(grads, weight * cfg.get("weight_scale", 1.0), payload)
            seconds = time.monotonic() - t0
            with averager.get_tensors() as buffers:  # a group's mean is handed over in place, not copied
                in_place = all(a is b for a, b in zip(averaged, buffers, strict=True))
            torch.save(averaged, os.path.join(out_dir, "result.pt"))
            payloads = {p: g.to_wire() for p, g in info.gathered.payloads.items()}
            gathered = {"payloads": payloads, "malformed": info.gathered.malformed}
            report = {**dataclasses.asdict(info), "gathered": gathered}
            emit(
                "RESULT",
                {
                    "info": report,
                    "seconds": seconds,
                    "peer_id": str(dht.peer_id),
                    "looking": looking[0],
                    "silent": silent,
                    "in_place": in_place,
                },
            )
        elif cmd == "NAN":
            bad = [g.clone() for g in grads]
            bad[-1].view(-1)[0] = float("nan")
            t0, error = time.monotonic(), None
            try:
                averager.reduce(bad, 1.0)
            except ValueError as e:
                error = str(e)
            emit("NAN", {"error": error, "seconds": time.monotonic() - t0, "step_calls": len(steps)})
        elif cmd == "LOAD":  # LOAD <donor peer id> <timeout>
            t0 = time.monotonic()
            loaded = averager.download(args[0], float(args[1]), len(shapes), 4 * sum(math.prod(s) for s in shapes))
            if not isinstance(loaded, str):
                torch.save(loaded[1], os.path.join(out_dir, "state.pt"))
            meta, why = (None, loaded) if isinstance(loaded, str) else (loaded[0], None)
            emit("LOADED", {"metadata": meta, "refused": why, "seconds": time.monotonic() - t0})
        elif cmd == "EXIT":
            break
    averager.shutdown()
    alive = averager.is_alive()
    dht.shutdown()
    emit("BYE", {"averager_alive": alive})


if __name__ == "__main__":
    main()

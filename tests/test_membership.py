"""Membership (swarm/membership.py, readiness.py, announcements.py) over real DHT nodes on 127.0.0.1: signed
announcements, what they vouch for, and the difference between a peer that is there and one that left (its
announcement no longer refreshed)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.dht import shutdown_dht, start_dht, visible_maddrs
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.validators import make_validators

pytestmark = pytest.mark.swarm

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.timeout(90)
def test_a_peer_that_stopped_refreshing_vouches_but_is_not_counted_or_asked():
    cfg = load_config(TINY, [])
    short = load_config(TINY, [f"swarm.record_ttl={cfg.swarm.record_ttl - 2 * Membership.LIVE}"])
    a, b = Identity.load(), Identity.load()
    a.close(), b.close()
    nodes = []
    try:
        first = start_dht(
            [],
            new_swarm=True,
            host_maddrs=LOCAL,
            join_timeout=10,
            record_validators=make_validators(cfg.swarm.run_id, a),
        )
        nodes.append(first)
        second = start_dht(
            visible_maddrs(first),
            host_maddrs=LOCAL,
            join_timeout=10,
            record_validators=make_validators(cfg.swarm.run_id, b),
        )
        nodes.append(second)
        old, new = RoundTag(3, "c" * 16), RoundTag(4, "d" * 16)
        # a's announcement expires as if it had been stored LIVE seconds ago and never refreshed
        left = Membership(first, short, a, "fp", {"k": 1})
        assert left.announce(old) and left.announce(new)
        reader = Membership(second, cfg, b, "fp", {"k": 1})
        vouches = reader.vouches()
        assert vouches.vouchers == {old: {a.peer_id}, new: {a.peer_id}}
        assert vouches.peers == 0 and vouches.holders == {}
        assert reader.others()[a.peer_id]["live"] is False
        # refreshed with the run's own record_ttl: there, a donor for its current state
        there = Membership(first, cfg, a, "fp", {"k": 1})
        there.states = list(left.states)
        assert there.announce(new)
        vouches = reader.vouches()
        assert vouches.peers == 1 and vouches.holders == {new: [a.peer_id]}
        assert vouches.vouchers[old] == {a.peer_id}  # its history still vouches
    finally:
        for node in reversed(nodes):
            shutdown_dht(node)


@pytest.mark.timeout(90)
def test_a_round_waits_for_the_mates_ending_within_its_patience_and_for_the_next_one_when_none_is():
    """Announced ready_at: a mate ready now, or whose round ends at most ``patience`` after ours, is expected at this
    round's matchmaking, which stays open until it is ready (group_window), so the round's peers meet in one group;
    so is one whose round end is not known (not said yet, or said long ago); a slower one is not waited for. With
    nobody expected, group_wait says how long until the next mate is ready; a mate that says it is looking for a
    group is ready now."""
    from hivemind.utils.timed_storage import get_dht_time

    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, fast, slow), keys):
        tag, window = RoundTag(2, "e" * 16), cfg.swarm.matchmaking_time
        slow_id = keys[2].peer_id

        def announce(member: Membership, ready_at: float) -> None:
            member.ready_at = ready_at
            assert member.announce(tag)

        reader.expect_ready(get_dht_time(), patience=3 * window)  # mates up to 3 windows after us are waited for
        reader.looking()
        assert reader.expected_members() == 1 and reader.group_wait() == 0.0  # alone: nothing to wait for
        announce(fast, 0.0)  # not known yet (its first step): expected, the matchmaking open until our patience ends
        announce(slow, get_dht_time() + 100.0)
        assert reader.expected_members() == 2 and reader.group_wait() == 0.0
        assert 95.0 < reader.round_end() - get_dht_time() <= 100.0  # the only end ahead: where a newcomer aligns to
        assert 3.5 * window - 5.0 < reader.group_window() <= 3.5 * window
        announce(fast, get_dht_time() + 2 * window)  # ends within our patience: expected, and waited for in the
        # matchmaking, which stays open until it is ready and half a window more
        assert reader.expected_members() == 2 and reader.group_wait() == 0.0
        assert 2.5 * window - 5.0 < reader.group_window() <= 2.5 * window
        assert 2 * window - 5.0 < reader.round_end() - get_dht_time() <= 2 * window  # the earlier of the two ends
        announce(fast, get_dht_time() - 3 * window)  # said long ago: its next round's end is not known, expected
        assert reader.expected_members() == 2 and reader.group_wait() == 0.0
        fast.expect_ready(get_dht_time() + 4 * window)  # the non-blocking path, as the training peer announces
        deadline = get_dht_time() + 20
        # until the reader reads it back (the old announcement, "said long ago", still reads as expected: a wait of 0;
        # under load a read came before the store landed: seen once in 5 runs beside a busy process)
        while not 0.0 < reader.group_wait() <= 25.0 and get_dht_time() < deadline:
            time.sleep(0.2)
        # past our patience, as the slow one: nobody expected, so wait for the sooner of the two
        assert 10.0 < reader.group_wait() <= 20.0 and reader.expected_members() == 1
        slow.looking()  # it waits for a group now (e.g. for the others' next round): ready, so nobody waits for it
        while reader.group_wait() > 0.0 and get_dht_time() < deadline + 20:
            time.sleep(0.2)
        assert reader.group_wait() == 0.0 and reader.expected_members() == 2
        reader.admits = lambda peer: peer != slow_id  # our averager banned it (a lying reducer): never waited for
        expected, later = reader._readiness()
        assert slow_id not in expected and len(expected) + len(later) == 1, (expected, later)
        reader.admits = lambda peer: True
        assert slow.finish()  # its run is over: it lingers as a donor, but no matchmaking waits for it
        expected, later = reader._readiness()
        assert slow_id not in expected and len(expected) + len(later) == 1, (expected, later)
        assert slow_id in reader.vouches().holders.get(tag, []), reader.vouches()  # still a donor of its state


@pytest.mark.timeout(60)
def test_a_member_that_fell_silent_in_a_failed_attempt_is_not_waited_for_until_it_says_it_is_ready():
    """A mate that did not answer a failed attempt's vote (dead mid all-reduce) still reads as live for a while, its
    ready_at stale ("still finishing its exchange"): it is not expected from then on (the retry of the same round
    included), and it is again as soon as it announces a ready_at after the failure."""
    from hivemind.utils.timed_storage import get_dht_time

    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, alive, dead), keys):
        tag = RoundTag(2, "e" * 16)
        for member in (alive, dead):
            member.looking()  # both were in the group of the attempt that failed
            assert member.announce(tag)
        reader.expect_ready(get_dht_time())
        reader.looking()
        assert reader.expected_members() == 3
        time.sleep(0.05)
        reader.suspect([keys[1].peer_id, keys[2].peer_id])  # neither answered the vote
        assert reader.expected_members() == 1  # the retry of the same round waits for neither
        alive.expect_ready(get_dht_time())  # the live one says when it is ready, after the failure
        deadline = time.monotonic() + 20
        while reader.expected_members() != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.expected_members() == 2
        reader.expect_ready(get_dht_time() + 1.0)  # our next round
        while reader.expected_members() != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        expected, later = reader._readiness()
        assert set(expected) == {keys[1].peer_id} and later == [], (expected, later)
        dead.expect_ready(get_dht_time())  # it was not dead after all: it says when it is ready, and is expected again
        while reader.expected_members() != 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.expected_members() == 3


@pytest.mark.timeout(60)
def test_a_peer_is_alone_only_when_the_read_answered_and_no_mate_averages():
    """``alone`` (a round is then local at once): only when the run's members were read (our own announcement is in
    the answer) and no other peer with our settings is live and not done."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, mate, stranger), _):
        tag = RoundTag(1, "f" * 16)
        assert not reader.alone()  # nothing read back, not even our own announcement: not sure
        assert reader.announce(tag)
        assert reader.alone()
        stranger.fingerprint = "other settings"
        assert stranger.announce(tag)
        assert reader.alone()  # a peer of other settings never averages with us
        assert mate.announce(tag)
        assert not reader.alone()
        assert mate.finish()  # its run is over: it lingers as a donor only
        assert reader.alone()


@pytest.mark.timeout(60)
def test_reachable_members_is_unknown_when_the_read_may_have_missed_one():
    """``reachable_members`` (0 makes a client-mode peer's round local at once, with nobody to lead it): the live
    mates with our settings that accept calls; None (not known) when the DHT did not answer, or when a mate an
    earlier read showed averaging is missing from this one (a read can come back partial)."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, node, client), _):
        tag = RoundTag(1, "f" * 16)
        assert reader.announce(tag)
        assert reader.reachable_members() == 0  # nobody else
        client.client = True
        assert client.announce(tag)
        assert reader.reachable_members() == 0  # a client leads no group
        assert node.announce(tag)
        assert reader.reachable_members() == 1
        reader._averaging_seen["QmAMateThisReadLacks"] = time.monotonic()
        assert reader.reachable_members() is None  # seen averaging lately, missing from this read: not sure
        reader._averaging_seen.pop("QmAMateThisReadLacks")
        reader._signed = lambda *args: None  # the DHT did not answer in time
        assert reader.reachable_members() is None


@pytest.mark.timeout(60)
def test_a_run_is_over_when_a_peer_finished_on_a_trained_state_and_none_still_averages():
    """``run_over`` (a newcomer that took no state then stops with a message, first_state): the furthest state the
    run's peers finished on, once one announced itself done on a trained state and none with our settings still
    averages; None while one does, before anyone trained, or for peers of other settings."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((newcomer, one, other), _):
        assert newcomer.run_over() is None  # nobody yet
        assert one.announce(RoundTag(0, "s" * 16)) and one.finish()
        assert newcomer.run_over() is None  # done on the seed: it never trained, no run to speak of
        assert one.announce(RoundTag(3, "a" * 16)) and other.announce(RoundTag(2, "b" * 16))
        assert newcomer.run_over() is None  # the other one still averages
        assert other.announce(RoundTag(3, "b" * 16)) and other.finish()
        assert newcomer.run_over() == RoundTag(3, "a" * 16)  # the furthest, then the smallest checksum: all alike
        other.fingerprint = "other settings"
        assert other.announce(RoundTag(9, "c" * 16))
        assert newcomer.run_over() == RoundTag(3, "a" * 16)  # a peer of other settings is no peer of this run


@pytest.mark.timeout(60)
def test_a_done_peer_is_served_out_only_when_every_live_mate_is_done_on_its_state():
    """``served_out`` (a done peer then stops lingering): only when the read answered and every live mate with our
    settings is done and holds our final state; a mate still training, or done on another state, keeps us, and so
    does a mate an earlier read showed averaging that this read lacks."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, mate, stranger), _):
        final, other = RoundTag(3, "a" * 16), RoundTag(3, "b" * 16)
        assert not reader.served_out(final)  # nothing read back, not even our own announcement: not sure
        assert reader.announce(final) and reader.finish()
        assert reader.served_out(final)  # nobody else
        stranger.fingerprint = "other settings"
        assert stranger.announce(other)
        assert reader.served_out(final)  # a peer of other settings never takes our state
        assert mate.announce(other)
        assert not reader.served_out(final)  # training still
        assert mate.finish()
        assert not reader.served_out(final)  # done, but on another state: the end-of-run heal may take ours
        assert mate.announce(final)
        assert reader.served_out(final)
        reader._averaging_seen["QmAMateThisReadLacks"] = time.monotonic()
        assert not reader.served_out(final)  # seen averaging lately, missing from this read: not sure it is done


@pytest.mark.timeout(60)
def test_a_peer_on_the_smaller_lineage_of_a_split_moves_to_the_larger_one():
    """Two groups formed apart from one state: the lineage more live peers hold is canonical; its peers stay, the
    others take its furthest state the swarm offers; as many on each: the smaller checksum at the latest common
    round, alike for every reader."""
    cfg = load_config(TINY, ["swarm.state_quorum=1"])
    with _three_members(cfg) as ((reader, first, second), _):
        s0, a1, b1, b2 = (RoundTag(r, x * 16) for r, x in ((0, "0"), (1, "a"), (1, "b"), (2, "b")))
        for member, history in ((reader, [s0, a1]), (first, [s0, b1]), (second, [s0, b1, b2])):
            for tag in history:
                assert member.announce(tag)
        assert _target(reader, a1) == b2  # 2 hold lineage b: its furthest state
        assert _target(first, b1) is None and _target(second, b2) is None  # already on it
        first.states = []  # one of b's peers moves to a: 2 against 1 the other way
        for tag in (s0, a1):
            assert first.announce(tag)
        assert _target(reader, a1) is None and _target(first, a1) is None
        assert _target(second, b2) == a1
        assert second.finish()  # its run is over: it no longer counts
        first.states = []
        for tag in (s0, b1):  # one on each lineage: the smaller checksum at the latest common round (1) wins
            assert first.announce(tag)
        assert _target(reader, a1) is None and _target(first, b1) == a1
        # at the end of a run, lingering peers count too: b is held by two again (one of them done)
        assert _target(reader, a1, counting_done=True) == b2 and _target(first, b1, counting_done=True) is None


@pytest.mark.timeout(60)
def test_a_split_into_lone_peers_heals_under_the_default_quorum():
    """A round that failed for everyone leaves each peer on its own state: the canonical lineage is one peer's, and
    its state is taken though only that peer vouches for it (swarm.state_quorum 2 could never be met: seen in CI,
    3 honest peers on 3 states to the end); a peer the reader banned offers no lineage. A lineage of 2 still needs
    both to vouch: its furthest state, held by one, is not offered; the state both held is."""
    cfg = load_config(TINY, [])
    assert cfg.swarm.state_quorum == 2
    with _three_members(cfg) as ((reader, first, second), _):
        s0, a1, b1, b2, c1 = (RoundTag(r, x * 16) for r, x in ((0, "0"), (1, "a"), (1, "b"), (2, "b"), (1, "c")))
        for member, history in ((reader, [s0, c1]), (first, [s0, a1]), (second, [s0, b1, b2])):
            for tag in history:
                assert member.announce(tag)
        # three lineages of one: the smallest checksum at round 1, the latest all of them reached, is a's
        assert _target(reader, c1) == a1 and _target(second, b2) == a1 and _target(first, a1) is None
        assert reader.canonical(c1).quorum == 1  # its download then needs the one key the lineage holds
        reader.admits = lambda peer: peer != first.peer_id  # a reader that banned a's peer: b1 < c1, b's furthest
        assert _target(reader, c1) == b2
        reader.admits = lambda peer: True
        first.states = []
        for tag in (s0, b1):  # a lineage of 2 (first at round 1, second at 2) against the reader's
            assert first.announce(tag)
        assert _target(reader, c1) == b1  # b2 has 1 voucher of the 2 the lineage holds: not offered
        assert reader.canonical(c1).quorum == 2


@pytest.mark.timeout(60)
def test_a_peer_that_left_a_lineage_vouches_only_for_the_one_it_took():
    """Of a split's minority, one peer heals before the other: if it still vouched for the lineage it left, its
    history would hold both lineages' states, join them into one for every reader, and the other would see no split
    left to heal (seen at 64 harness peers: a minority that healed one peer at a time)."""
    cfg = load_config(TINY, ["swarm.state_quorum=1"])
    with _three_members(cfg) as ((reader, first, second), _):
        s0, a1, b1 = (RoundTag(r, x * 16) for r, x in ((0, "0"), (1, "a"), (1, "b")))
        for member, history in ((reader, [s0, a1]), (first, [s0, a1]), (second, [s0, b1])):
            for tag in history:
                assert member.announce(tag)
        assert _target(reader, a1) is None and _target(second, b1) == a1  # a: 2 against 1
        first.left_lineage()  # first moves to b (say, it read another split) and announces it
        assert first.announce(b1) and first.states == [b1]
        assert _target(reader, a1) == b1  # b: 2 against 1, and the split is still seen
        first.states = [s0, a1, b1]  # had it kept vouching for a1, the two lineages would read as one
        assert first.announce(b1)
        assert _target(reader, a1) is None


@pytest.mark.timeout(60)
def test_a_peer_waits_at_the_end_only_for_mates_whose_last_round_may_still_end():
    """``finishing(R)``: a live mate that still averages and holds round R - 1 or later may still end its last round
    (on another lineage: the end-of-run heal waits for it); one further behind, or done, is not waited for. One seen
    averaging lately and missing from a read is."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, one, other), _):
        assert not reader.finishing(3)  # nobody announced
        assert one.announce(RoundTag(1, "a" * 16)) and other.announce(RoundTag(1, "a" * 16))
        assert not reader.finishing(3)  # two rounds behind: not about to end a last round
        assert one.announce(RoundTag(2, "b" * 16))
        assert reader.finishing(3)
        assert other.announce(RoundTag(2, "b" * 16))
        reader.suspect([one.peer_id])  # silent in a failed attempt's vote: not waited for
        assert reader.finishing(3)  # the other still is
        reader.timeout = 0.0  # a read the DHT does not answer in time reads as nobody: not as "every mate is done"
        assert reader.others() == {} and reader.finishing(3)
        reader.timeout = cfg.swarm.dht_timeout
        assert other.finish() and not reader.finishing(3)  # its run is over
        assert reader.held() == {RoundTag(2, "b" * 16): 2}  # what the heal at the end logs


@pytest.mark.timeout(60)
def test_a_peer_reads_that_the_swarm_has_left_it_behind_from_the_states_its_mates_vouch_for():
    """``ahead``: the furthest state state_quorum mates vouch for, when it is more than max_staleness rounds past
    ours (the averager then resyncs instead of looking for a group); one mate's own state is not enough."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, one, other), keys):
        tag, behind = RoundTag(2, "e" * 16), RoundTag(1, "a" * 16)
        assert reader.ahead(RoundTag(0, "a" * 16)) is None  # nobody announced: nothing is known to be ahead
        assert one.announce(tag) and other.announce(tag)
        assert reader.ahead(behind) == tag and reader.ahead(RoundTag(0, "a" * 16)) == tag
        assert reader.ahead(tag) is None and reader.ahead(RoundTag(2, "b" * 16)) is None  # not behind: a group decides
        lenient = Membership(reader.dht, load_config(TINY, ["swarm.max_staleness=1"]), keys[0], "fp", {"k": 1})
        assert lenient.ahead(behind) is None and lenient.ahead(RoundTag(0, "a" * 16)) == tag  # its Δ may count
        assert one.announce(RoundTag(3, "f" * 16))  # only one peer vouches for it: not the swarm's
        assert reader.ahead(behind) == tag and reader.ahead(tag) is None


@pytest.mark.timeout(60)
def test_a_heartbeat_right_after_a_store_stores_nothing_and_a_fresh_read_may_serve_again():
    """Every stored version of an announcement is one more for every reader to verify: a heartbeat within HEARTBEAT
    seconds of the last store (a ready_at, a round) stores nothing; one later stores it again. A read may serve the
    questions asked at once (``others(max_age)``; the matchmaking's questions: ``read_reuse``); a plain read always
    asks the DHT."""
    cfg = load_config(TINY, [])
    with _three_members(cfg) as ((reader, writer, _), keys):

        def expiration() -> float:
            found = reader.dht.get(reader.key, latest=True)
            return found.value[writer.subkey].expiration_time

        assert writer.announce(RoundTag(2, "e" * 16))
        stored = expiration()
        time.sleep(0.05)
        writer.refresh()  # just stored: nothing to say
        assert reader.others()[keys[1].peer_id]["round"] == 2 and expiration() == stored
        writer._stored_at -= Membership.HEARTBEAT  # as if HEARTBEAT seconds had passed since
        writer.refresh()
        deadline = time.monotonic() + 20
        while expiration() == stored and time.monotonic() < deadline:
            time.sleep(0.1)
        assert expiration() > stored
        assert writer.announce(RoundTag(3, "f" * 16))
        assert reader.others(max_age=60.0)[keys[1].peer_id]["round"] == 2  # the last read, reused
        assert reader.others()[keys[1].peer_id]["round"] == 3  # a new one
        # the matchmaking's questions, asked at once as an exchange begins, share a read at most read_reuse old
        reader.read_reuse, read = 60.0, reader._last_read
        assert writer.finish()  # it averages no more: a new read would expect nobody
        assert reader.expected_members() == 2 and reader.reachable_members() == 1 and not reader.alone()
        assert reader.ahead(RoundTag(0, "a" * 16)) == RoundTag(3, "f" * 16) and reader.group_window() > 0.0
        assert reader._last_read is read  # no new read
        reader.read_reuse = 0.0
        assert reader.expected_members() == 1 and reader.reachable_members() == 0 and reader._last_read is not read


@pytest.mark.timeout(60)
def test_what_a_peer_said_already_is_not_stored_again():
    """Each store costs every node on its way a read of every announcement. A peer announces when its inner steps
    end, and revises it mid-round: a revision within matchmaking_time / 8 of what it said is not stored; a larger one
    is, and so is the first estimate of a round after looking for a group, however close. That it is looking for a
    group is stored only when the mates would not read it so already (``looking``). A state announced again
    unchanged (as a round settles, and once it is hashed) is not stored within half a HEARTBEAT, unless the caller
    waits for the store."""
    from hivemind.utils.timed_storage import get_dht_time

    cfg = load_config(TINY, [])
    close, far = cfg.swarm.matchmaking_time / 16, cfg.swarm.matchmaking_time / 4
    with _three_members(cfg) as ((writer, _, _), _):
        assert writer.announce(RoundTag(1, "a" * 16))
        end = get_dht_time() + 30.0
        for ready_at, stored in [(end, True), (end + close, False), (end + far, True), (end + far - close, False)]:
            before = writer._stored_at
            writer.expect_ready(ready_at)
            assert (writer._stored_at != before) == stored, (ready_at - end, stored)
        assert writer._value["ready_at"] == end + far  # what the mates read
        writer.looking()
        before = writer._stored_at
        writer.expect_ready(writer.ready_at + close)  # the next round's first estimate: said, however close
        assert writer._stored_at != before
        before = writer._stored_at
        writer.looking()  # its exchange begins within matchmaking_time / 8 of the end it said: read as ready already
        writer.looking()  # and while it waits, until that end is half of matchmaking_time past
        assert writer._stored_at == before
        writer.ready_at -= 0.6 * cfg.swarm.matchmaking_time  # as if that much time had passed
        writer.looking()
        assert writer._stored_at != before
        tag, before = RoundTag(2, "b" * 16), writer._stored_at
        assert writer.announce(tag, wait=False) and writer._stored_at != before  # a new state: stored
        before = writer._stored_at
        assert writer.announce(tag, wait=False) and writer._stored_at == before  # the same again: not
        assert writer.announce(tag) and writer._stored_at != before  # unless the caller waits for it


def _target(member, mine, **kw):
    """The state ``member``'s heal would take (Membership.canonical), or None."""
    heal = member.canonical(mine, **kw)
    return heal.target if heal is not None else None


@contextlib.contextmanager
def _three_members(cfg):
    """Three DHT nodes on 127.0.0.1 with a Membership each (fingerprint "fp"; nothing announced yet), and their keys."""
    keys = [Identity.load() for _ in range(3)]
    for key in keys:
        key.close()
    nodes = []
    try:
        for key in keys:
            nodes.append(
                start_dht(
                    visible_maddrs(nodes[0]) if nodes else [],
                    new_swarm=not nodes,
                    host_maddrs=LOCAL,
                    join_timeout=10,
                    record_validators=make_validators(cfg.swarm.run_id, key),
                )
            )
        members = [Membership(n, cfg, k, "fp", {"k": 1}) for n, k in zip(nodes, keys, strict=True)]
        for member in members:  # each check reads the announcements made just before it (the sharing of one read
            member.read_reuse = 0.0  # by the matchmaking's questions: its own test)
        yield members, keys
    finally:
        for node in reversed(nodes):
            shutdown_dht(node)

"""Membership (swarm/join.py) over real DHT nodes on 127.0.0.1: signed announcements, what they vouch for, and the
difference between a peer that is there and one that left (its announcement no longer refreshed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.swarm.dht import shutdown_dht, start_dht, visible_maddrs
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.join import Membership
from p2p_diloco.swarm.protocol import RoundTag
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

"""Streaming fragments (p2p_diloco/fragments.py and the Worker's rounds with swarm.fragments > 1)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from p2p_diloco.checkpoint import latest_checkpoint, load_worker_state, save_round
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.engine import Worker
from p2p_diloco.fragments import Fragments
from p2p_diloco.protocol import Gathered, RoundRules
from p2p_diloco.rounds import Contribution, ReduceInfo

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 257, (2, 16), generator=g)


def test_fragments_hold_about_equal_values_and_take_turns():
    sizes = [1000, 10, 500, 490, 20, 980]
    fragments = Fragments.of(sizes, 2)
    assert fragments.sizes(sizes) == [1500, 1500]  # 1000 + 490 + 10 and 980 + 500 + 20
    assert fragments.of_tensor == (0, 0, 1, 0, 1, 1)
    assert fragments.active(0) == [f == 0 for f in fragments.of_tensor]
    assert fragments.active(3) == [f == 1 for f in fragments.of_tensor]
    assert Fragments.of(sizes, 1).active(7) == [True] * 6
    with pytest.raises(ValueError, match="more than the model's 6 tensors"):
        Fragments.of(sizes, 7)
    with pytest.raises(ValueError, match="must be >= 1"):
        Fragments.of(sizes, 0)


def test_fragments_refuse_more_fragments_than_tensors_with_a_message():
    with pytest.raises(ConfigError, match="swarm.fragments"):
        load_config(TINY, ["swarm.fragments=0"])


# fragments 2 with eager overlap: round r's exchange settled after 2 of round r+1's 4 steps, half of them carried
EAGER_F2 = ["inner.steps=4", "train.rounds=4", "swarm.fragments=2", "swarm.compression=none", "swarm.overlap=eager"]
EAGER_F2 += ["swarm.overlap_steps=2", "swarm.overlap_carry=0.5"]


def _alone(mine: Contribution) -> Future:
    """The exchange of a group of one, done: its mean is the Δ sent."""
    done = Future()
    info = ReduceInfo(group_size=1, complete=True, attempts=1, gathered=Gathered({"me": mine.payload}))
    done.set_result(([d.clone() for d in mine.pseudo_grad], info))
    return done


def test_eager_overlap_carries_the_fragment_sent_and_leaves_the_others_training(tmp_path):
    """Eager with fragments: the round's exchange runs behind the next inner steps; the look-ahead moves the fragment
    sent only (the others go on from θ as it is); the drain puts the fragment sent on the settled anchor plus
    overlap_carry of the steps since, and leaves the others' θ where their steps took it, so the next fragment's Δ
    spans every step since the start. A checkpoint with the exchange in flight holds the fragment sent as a lost
    exchange would leave it (the anchor plus the carried steps), the others as they are."""
    cfg = load_config(TINY, EAGER_F2)
    worker = Worker(cfg, 257, _batches(2))
    first, start = worker.active(), [a.clone() for a in worker.state.anchor]
    mine = worker.contribute()
    theta = [p.detach().clone() for p in worker.model.parameters()]
    worker.launch(mine, _alone)
    ahead = worker.state.ahead(mine.pseudo_grad, worker.outer_lr(0), cfg.outer.momentum, cfg.outer.nesterov)
    for k, (p, on) in enumerate(zip(worker.model.parameters(), first)):
        assert torch.equal(p.detach(), ahead[k] if on else theta[k])  # the look-ahead: the fragment sent only

    saved = worker.local_state()  # in flight: the fragment sent as a lost exchange would leave it
    for k, (x, on) in enumerate(zip(saved["params"], first)):
        assert torch.equal(x, start[k] if on else theta[k])

    at_drain: list[list[torch.Tensor]] = []

    def drain() -> None:
        at_drain.append([p.detach().clone() for p in worker.model.parameters()])
        worker.drain(RoundRules())
        at_drain.append([p.detach().clone() for p in worker.model.parameters()])

    second = worker.contribute(drain=drain)
    assert worker.state.round == 1 and second.payload.tag.round == 1
    before, after = at_drain
    for k, on in enumerate(first):
        if on:  # on the settled anchor, with half of the 2 steps taken from the look-ahead
            expected = worker.state.anchor[k] + 0.5 * (before[k] - ahead[k])
            assert torch.allclose(after[k], expected, atol=1e-6)
        else:  # untouched by the drain
            assert torch.equal(after[k], before[k])
    params = list(worker.model.parameters())
    for k, on in enumerate(worker.active()):  # the second fragment: Δ over all 8 of its steps since the start
        expected = start[k] - params[k].detach() if on else torch.zeros_like(start[k])
        assert torch.equal(second.pseudo_grad[k], expected)


def test_a_round_exchanges_its_fragment_and_the_others_keep_training(tmp_path):
    """Round r sends Δ of fragment r mod F only (zeros elsewhere); its outer step moves that fragment's anchor and
    momentum and puts θ there; the other tensors keep θ where their inner steps took it, and their Δ, sent on their
    turn, spans every round since they were last exchanged. θ travels in the worker state for --resume."""
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=4", "swarm.fragments=2", "swarm.compression=none"])
    worker = Worker(cfg, 257, _batches(0))
    first = worker.active()
    assert sum(first) and not all(first)
    start = [a.clone() for a in worker.state.anchor]

    mine = worker.contribute()
    assert all(bool(d.any()) == on for d, on in zip(mine.pseudo_grad, first))  # zeros off the fragment
    theta = [p.detach().clone() for p in worker.model.parameters()]
    info = ReduceInfo(group_size=1, complete=True, attempts=1, gathered=Gathered({"me": mine.payload}))
    assert worker.settle(mine, mine.pseudo_grad, info, RoundRules()) is not None
    for k, on in enumerate(first):
        anchor, param = worker.state.anchor[k], next(p for i, p in enumerate(worker.model.parameters()) if i == k)
        if on:
            assert not torch.equal(anchor, start[k]) and torch.equal(param.detach(), anchor)
        else:  # untouched: anchor, momentum, and θ where the inner steps left it
            assert torch.equal(anchor, start[k]) and not bool(worker.state.momentum[k].any())
            assert torch.equal(param.detach(), theta[k])

    second = worker.active()
    assert second == [not on for on in first]
    mine = worker.contribute()  # the second fragment's Δ spans both rounds' inner steps
    params = list(worker.model.parameters())
    for k, on in enumerate(second):
        expected = start[k] - params[k].detach() if on else torch.zeros_like(start[k])
        assert torch.equal(mine.pseudo_grad[k], expected)

    save_round(tmp_path, worker.state, worker_state=worker.local_state())
    again = Worker(cfg, 257, _batches(0))
    again.load_state(worker.state.copy())
    again.restore_local_state(load_worker_state(latest_checkpoint(tmp_path)))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(again.model.parameters(), params))


def test_a_fragment_keeps_what_it_owes_while_the_others_take_their_turns():
    """Error feedback with fragments (topk3): a round adds the residual to its own fragment only, and the residual of
    the others waits for their turn; a local step clears what its fragment owed, not the others'."""
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=4", "swarm.fragments=2", "swarm.compression=topk3"])
    worker = Worker(cfg, 257, _batches(1))
    first = worker.active()
    mine = worker.contribute()
    info = ReduceInfo(group_size=1, complete=True, attempts=1, gathered=Gathered({"me": mine.payload}))
    assert worker.settle(mine, mine.pseudo_grad, info, RoundRules()) is not None
    owed_first = [r.clone() for r in worker.residual]
    assert all(bool(r.any()) == on for r, on in zip(owed_first, first))  # owed only where it sent

    mine = worker.contribute()  # the other fragment's turn: the first one's residual is not added, nor spent
    assert all(torch.equal(d, torch.zeros_like(d)) for d, on in zip(mine.pseudo_grad, first) if on)
    alone = ReduceInfo(group_size=1, complete=False, attempts=1, gathered=Gathered({"me": mine.payload}))
    assert worker.settle(mine, mine.pseudo_grad, alone, RoundRules()) is not None  # a local step
    for r, before, on in zip(worker.residual, owed_first, first):
        assert torch.equal(r, before) if on else not bool(r.any())


def test_a_download_while_a_fragment_is_in_flight_carries_every_tensor_onto_the_state_downloaded():
    """Eager with fragments, a state downloaded while the exchange is in flight (a resync, a catch-up): the drain drops
    the group's result (it belongs to the state replaced), counts the round lost, and puts every tensor on the
    downloaded anchor plus overlap_carry of the steps taken since the download."""
    cfg = load_config(TINY, EAGER_F2)
    worker, donor = Worker(cfg, 257, _batches(3)), Worker(cfg, 257, _batches(4))
    donor.apply_outer([torch.full_like(a, 0.01) for a in donor.state.anchor])
    worker.launch(worker.contribute(), _alone)
    downloaded = donor.state.copy()
    worker.load_state(downloaded)  # every tensor at the downloaded anchor, the steps from here on carried
    at_drain: list[list[torch.Tensor]] = []

    def drain() -> None:
        at_drain.append([p.detach().clone() for p in worker.model.parameters()])
        assert worker.drain(RoundRules()) is None
        at_drain.append([p.detach().clone() for p in worker.model.parameters()])

    worker.contribute(drain=drain)
    assert worker.state is downloaded and worker.state.round == 1
    assert [r.lost_reason for r in worker.take_lost()] == ["the outer state changed while its exchange was in flight"]
    before, after = at_drain
    for k, anchor in enumerate(downloaded.anchor):
        assert torch.allclose(after[k], anchor + 0.5 * (before[k] - anchor), atol=1e-6)

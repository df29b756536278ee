"""Outer step, pseudo-gradient, checksum and checkpoint: invariant 3 and the failure paths."""

import logging

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, save_round
from p2p_diloco.outer import NonFiniteUpdateError, OuterState, outer_lr_at, pseudo_gradient, weighted_mean


def _random_state(seed=0, shapes=((3, 4), (5,), (2, 2, 2))):
    g = torch.Generator().manual_seed(seed)
    return OuterState.from_params([torch.randn(s, generator=g) for s in shapes])


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_equals_torch_sgd(nesterov):
    """Invariant 3: the outer step is torch.optim.SGD(lr, momentum, nesterov) on the anchor."""
    state = _random_state()
    ref = [torch.nn.Parameter(a.clone()) for a in state.anchor]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=nesterov, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        delta = [torch.randn(a.shape, generator=g) for a in state.anchor]
        for p, d in zip(ref, delta):
            p.grad = d.clone()
        opt.step()
        state.apply(delta, lr=0.7, momentum=0.9, nesterov=nesterov)
        for a, p in zip(state.anchor, ref):
            assert torch.equal(a, p.detach())
        for buf, p in zip(state.momentum, ref):
            assert torch.equal(buf, opt.state[p]["momentum_buffer"])
    assert state.round == 5


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, True)])
def test_look_ahead_is_the_outer_step_without_taking_it(momentum, nesterov):
    """``ahead`` (eager overlap's look-ahead) is the anchor ``apply`` would leave, to fp32 rounding, and changes
    nothing; with momentum it sees the buffer of the steps before."""
    state = _random_state()
    g = torch.Generator().manual_seed(2)
    state.apply([torch.randn(a.shape, generator=g) for a in state.anchor], 0.7, momentum, nesterov)
    delta = [torch.randn(a.shape, generator=g) for a in state.anchor]
    before = state.copy()
    ahead = state.ahead(delta, 0.7, momentum, nesterov)
    assert state.checksum() == before.checksum()
    state.apply(delta, 0.7, momentum, nesterov)
    for x, a in zip(ahead, state.anchor):
        assert torch.allclose(x, a, rtol=0, atol=1e-6)
    assert any(not torch.equal(x, b) for x, b in zip(ahead, before.anchor))


def test_pseudo_gradient_sign_points_from_theta_to_anchor():
    state = _random_state()
    theta = [a - 0.25 for a in state.anchor]  # the worker moved every weight down by 0.25
    delta = pseudo_gradient(state.anchor, theta)
    assert all(torch.allclose(d, torch.full_like(d, 0.25)) for d in delta)
    state.apply(delta, lr=1.0, momentum=0.0)  # plain SGD with lr 1 lands on θ
    assert all(torch.allclose(a, t) for a, t in zip(state.anchor, theta))


def test_non_finite_updates_are_refused_and_leave_state_untouched():
    state = _random_state()
    before = state.checksum()
    theta = [a.clone() for a in state.anchor]
    theta[1][0] = float("nan")
    with pytest.raises(NonFiniteUpdateError, match="tensor 1"):
        pseudo_gradient(state.anchor, theta)
    bad = [torch.zeros_like(a) for a in state.anchor]
    bad[2][0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteUpdateError, match="averaged"):
        state.apply(bad, lr=0.7, momentum=0.9)
    assert state.checksum() == before and state.round == 0


def test_checksum_sees_every_part_of_the_state():
    a, b = _random_state(), _random_state()
    assert a.checksum() == b.checksum()
    b.round = 1
    assert a.checksum() != b.checksum()
    c = _random_state()
    c.momentum[0][0, 0] = 1e-30
    assert a.checksum() != c.checksum()
    d = OuterState.from_tensors(a.tensors(), a.round)
    assert d.checksum() == a.checksum()


def test_weighted_mean_and_outer_lr_warmup():
    x = [torch.tensor([1.0, 2.0])]
    y = [torch.tensor([3.0, 6.0])]
    (m,) = weighted_mean([x, y], [1.0, 3.0])
    assert torch.allclose(m, torch.tensor([2.5, 5.0]))
    with pytest.raises(ValueError):
        weighted_mean([x, y], [0.0, 0.0])
    assert outer_lr_at(0, 0.7, 4) == pytest.approx(0.175)
    assert outer_lr_at(3, 0.7, 4) == pytest.approx(0.7)
    assert outer_lr_at(10, 0.7, 0) == 0.7


def test_checkpoint_round_trip_keep_and_corruption(tmp_path, caplog):
    state = _random_state()
    for _ in range(4):
        state.apply([torch.ones_like(a) for a in state.anchor], lr=0.1, momentum=0.9)
        save_round(tmp_path, state, {"run": "t"}, keep=2)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "round_000004"
    assert len(list(tmp_path.glob("round_*"))) == 2
    loaded, meta = load_outer_state(latest)
    assert loaded.checksum() == state.checksum() and meta["run"] == "t" and loaded.round == 4
    # a crashed save leaves only a .tmp directory behind: the last good checkpoint still loads
    (tmp_path / "round_000005.tmp").mkdir()
    assert latest_checkpoint(tmp_path).name == "round_000004"
    (tmp_path / "round_000006").mkdir()  # a newer round without its meta: skipped, and said so
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.checkpoint"):
        assert latest_checkpoint(tmp_path).name == "round_000004"
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping {tmp_path / 'round_000006'}: it has no outer_state.json (incomplete or damaged)"
    ]
    (tmp_path / "round_000006").rmdir()
    (latest / "outer_state.json").write_text(
        (latest / "outer_state.json").read_text().replace('"round": 4', '"round": 3')
    )
    with pytest.raises(CheckpointError, match="checksum"):
        load_outer_state(latest)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_outer_state(tmp_path / "nothing")
    for meta in ("[1, 2]", '"text"', '{"num_tensors": 1}', '{"num_tensors": "x"}'):  # valid JSON, not a meta
        (latest / "outer_state.json").write_text(meta)
        with pytest.raises(CheckpointError, match="unreadable"):
            load_outer_state(latest)
    (latest / "outer_state.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_outer_state(latest)

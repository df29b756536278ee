"""The engine and the simulator: invariants 1-2 of diloco-notes.md, inner state, modes that learn."""

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointError, latest_checkpoint, load_outer_state, load_worker_state, save_round
from p2p_diloco.codec import get_codec, roundtrip_parts
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.engine import Worker, sparse_advice
from p2p_diloco.inner import lr_at
from p2p_diloco.model import build_model
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import Gathered, RoundRules
from p2p_diloco.rounds import ReduceInfo, fp32_bytes_sent
from p2p_diloco.simulate import main as simulation_main
from p2p_diloco.simulate import simulate

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
FAST = ["data.eval_batches=1", "train.eval_every=0"]


def _batches(seed, vocab=257, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, shape, generator=g)


def test_one_worker_lr1_no_momentum_equals_plain_adamw():
    """Invariant 1: R rounds of H steps with outer SGD lr 1, momentum 0 = R*H steps of plain AdamW."""
    cfg = load_config(
        TINY, ["inner.steps=4", "train.rounds=3", "outer.lr=1", "outer.momentum=0", "outer.lr_warmup_rounds=0"]
    )
    worker = Worker(cfg, 257, _batches(0))
    for _ in range(3):
        worker.train_inner()
        worker.apply_outer(worker.pseudo_grad())

    model = build_model(cfg.model, 257, cfg.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.inner.lr, betas=tuple(cfg.inner.betas), weight_decay=cfg.inner.weight_decay
    )
    batches = _batches(0)
    for step in range(12):
        batch = next(batches)
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.inner, 12)
        opt.step()
        opt.zero_grad()
    diff = max((a - p.detach()).abs().max().item() for a, p in zip(worker.state.anchor, model.parameters()))
    assert diff < 1e-5, diff


def test_inner_adamw_state_survives_rounds():
    cfg = load_config(TINY, ["inner.steps=3", "train.rounds=2"])
    worker = Worker(cfg, 257, _batches(1))
    worker.run_round(_SelfReducer(), RoundRules())
    first = next(iter(worker.inner.optimizer.state.values()))
    assert int(first["step"]) == 3 and first["exp_avg"].abs().sum() > 0
    saved = first["exp_avg_sq"].clone()
    worker.run_round(_SelfReducer(), RoundRules())
    state = next(iter(worker.inner.optimizer.state.values()))
    assert int(state["step"]) == 6
    assert not torch.equal(state["exp_avg_sq"], saved)
    # θ equals the anchor after every round
    assert all(torch.equal(a, p.detach()) for a, p in zip(worker.state.anchor, worker.model.parameters()))


class _SelfReducer:
    """A group of one: the mean is this worker's own Δ."""

    def reduce(self, pseudo_grads, weight, payload):
        gathered = Gathered({"me": payload})
        return pseudo_grads, ReduceInfo(group_size=1, complete=True, attempts=1, gathered=gathered)


def _local_round(worker):
    worker.train_inner()
    worker.apply_outer(worker.pseudo_grad())


def test_resume_from_a_checkpoint_continues_exactly_where_training_stopped(tmp_path):
    """A checkpoint carries the inner AdamW moments and the place in the shard: resuming is bitwise lossless."""
    cfg = load_config(TINY, ["inner.steps=3", "train.rounds=4", *FAST])
    straight = Worker(cfg, 257, _batches(2))
    for _ in range(2):
        _local_round(straight)
    save_round(tmp_path, straight.state, worker_state=straight.local_state())
    for _ in range(2):
        _local_round(straight)

    def resumed(with_local_state):
        ckpt = latest_checkpoint(tmp_path)
        worker = Worker(cfg, 257, _batches(2))
        worker.load_state(load_outer_state(ckpt)[0])
        if with_local_state:
            worker.restore_local_state(load_worker_state(ckpt))
        for _ in range(2):
            _local_round(worker)
        return worker

    again = resumed(with_local_state=True)
    assert again.batches_taken == straight.batches_taken == 4 * 3
    assert again.state.checksum() == straight.state.checksum()
    assert resumed(with_local_state=False).state.checksum() != straight.state.checksum()

    wider = Worker(load_config(TINY, ["model.hidden_size=64", "model.intermediate_size=128"]), 257, _batches(2))
    with pytest.raises(ValueError, match="does not fit this model"):
        wider.restore_local_state(load_worker_state(latest_checkpoint(tmp_path)))
    (latest_checkpoint(tmp_path) / "worker_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="worker_state.pt is unreadable"):
        load_worker_state(latest_checkpoint(tmp_path))


def test_h1_inner_sgd_equals_synchronous_data_parallel(tmp_path):
    """Invariant 2: H = 1, inner SGD, outer SGD lr 1 no momentum = synchronous SGD on averaged grads."""
    sets = [
        "inner.optimizer=sgd",
        "inner.steps=1",
        "inner.lr=0.05",
        "inner.weight_decay=0",
        "inner.grad_clip=0",
        "inner.warmup_steps=0",
        "inner.schedule=constant",
        "train.rounds=6",
        "swarm.aggregation=mean",  # the invariant is the plain mean's (one-batch gradients trip median_filter's bound)
        "swarm.compression=none",  # and exact fp32 arithmetic's (int8 on the wire is not synchronous SGD)
        *FAST,
    ]
    cfg = load_config(TINY, sets)
    simulate(
        dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, lr=1.0, momentum=0.0, lr_warmup_rounds=0)),
        "diloco",
        3,
        tmp_path / "diloco",
    )
    simulate(cfg, "sync", 3, tmp_path / "sync")
    a, _ = load_outer_state(tmp_path / "diloco" / "final_state")
    b, _ = load_outer_state(tmp_path / "sync" / "final_state")
    diff = max((x - y).abs().max().item() for x, y in zip(a.anchor, b.anchor))
    assert diff < 1e-5, diff
    moved = max((x - y).abs().max().item() for x, y in zip(a.anchor, Worker(cfg, 257, iter(())).state.anchor))
    assert moved > 1e-3  # the comparison is not between two untrained models


def test_diloco_lr1_momentum0_reproduces_fedavg_exactly(tmp_path):
    sets = ["inner.steps=5", "train.rounds=3", *FAST]
    simulate(
        load_config(TINY, [*sets, "outer.lr=1", "outer.momentum=0", "outer.lr_warmup_rounds=0"]),
        "diloco",
        2,
        tmp_path / "d",
    )
    simulate(load_config(TINY, sets), "fedavg", 2, tmp_path / "f")
    d = json.loads((tmp_path / "d" / "results.json").read_text())
    f = json.loads((tmp_path / "f" / "results.json").read_text())
    assert d["final_checksum"] == f["final_checksum"]
    assert d["final_eval_loss"] == f["final_eval_loss"]


@pytest.mark.parametrize("mode", ["diloco", "fedavg", "sync", "single"])
def test_every_mode_learns_on_tiny(tmp_path, mode):
    out = tmp_path / mode
    code = simulation_main(
        [
            "--config",
            str(TINY),
            "--mode",
            mode,
            "--workers",
            "2",
            "--out",
            str(out),
            "--set",
            "inner.steps=10",
            "--set",
            "train.rounds=6",
            "--set",
            "train.eval_every=3",
            "--set",
            "inner.warmup_steps=10",
            "--set",
            "data.eval_batches=2",
            "--set",
            "swarm.compression=none",  # fp32 on the wire: bytes by the plain formula below
        ]
    )
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["final_eval_loss"] < res["initial_eval_loss"] - 1.5, res
    assert res["tokens_per_worker"] == 6 * 10 * 8 * 64
    assert set(res["eval_loss_per_round"]) == {"0", "3", "6"}
    assert res["final_eval_loss_per_label"] and res["wall_seconds"] > 0
    expected_bytes = {"diloco": 6, "fedavg": 6, "sync": 60, "single": 0}[mode] * res["num_params"] * 4
    assert res["bytes_sent_per_worker"] == expected_bytes  # 2(n-1)/n = 1 for n = 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["outer_step"] for r in records] == list(range(1, 7))
    assert json.loads((out / "run_metadata.json").read_text())["shard_histograms"]


def test_simulation_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    assert simulation_main(["--config", str(TINY), "--out", str(tmp_path), "--set", "inner.lr=-1"]) == 2
    assert "inner.lr" in capsys.readouterr().err
    assert simulation_main(["--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert simulation_main(["--config", str(TINY), "--out", str(tmp_path), "--workers", "0"]) == 2
    for speeds in ("1,x", "1,1,1", "1,-1"):  # not numbers, one too many for 2 workers, not > 0
        assert (
            simulation_main(["--config", str(TINY), "--out", str(tmp_path), "--workers", "2", "--speeds", speeds]) == 2
        )
        assert "--speeds" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["single", "sync"])
def test_warm_start_is_ordinary_training_then_every_worker_starts_diloco_from_it(tmp_path, kind):
    steps, sets = 12, ["inner.steps=4", "train.rounds=2", "data.eval_batches=1", "train.eval_every=1"]
    warm = [f"train.warm_start={kind}", f"train.warm_start_steps={steps}"]
    res = simulate(load_config(TINY, [*sets, *warm]), "diloco", 3, tmp_path / "warm")
    # the same ordinary training as a run of its own: the single/sync mode for one round of `steps` steps
    per_round = steps // 3 if kind == "single" else steps  # single takes K x H steps a round
    alone_cfg = load_config(TINY, [f"inner.steps={per_round}", "train.rounds=1", "data.eval_batches=1"])
    alone = simulate(alone_cfg, kind, 3, tmp_path / "a")
    w = res["warm_start"]
    assert w["kind"] == kind and w["steps"] == steps
    assert w["bytes_sent_per_worker"] == (steps * fp32_bytes_sent(res["num_params"], 3) if kind == "sync" else 0)
    assert w["tokens"] == steps * (1 if kind == "single" else 3) * 8 * 64 == alone["tokens_per_worker"] * 3
    assert w["eval_loss"] == alone["final_eval_loss"] == res["eval_loss_per_round"]["0"]  # the same weights, exactly
    assert w["eval_loss"] < res["initial_eval_loss"] - 0.5 and res["tokens_per_worker"] == 2 * 4 * 8 * 64
    cold = simulate(load_config(TINY, sets), "diloco", 3, tmp_path / "cold")
    assert cold["warm_start"] is None and cold["eval_loss_per_round"]["0"] == cold["initial_eval_loss"]
    assert res["final_eval_loss"] < cold["final_eval_loss"]


def test_a_continued_warm_start_is_the_same_run_as_none(tmp_path):
    """warm_start_schedule continue: N sync steps, then the run goes on with their moments and lr schedule, so a
    data-parallel run warm-started by N data-parallel steps is bitwise the run of N more steps without one; with
    restart (fresh moments, a schedule of its own) it is not."""
    sets = ["inner.steps=4", "data.eval_batches=1", "train.eval_every=0"]
    warm = ["train.warm_start=sync", "train.warm_start_steps=8"]
    plain = simulate(load_config(TINY, [*sets, "train.rounds=3"]), "sync", 3, tmp_path / "plain")
    cont = simulate(
        load_config(TINY, [*sets, "train.rounds=1", *warm, "train.warm_start_schedule=continue"]), "sync", 3,
        tmp_path / "continue",
    )  # fmt: skip
    restart = simulate(load_config(TINY, [*sets, "train.rounds=1", *warm]), "sync", 3, tmp_path / "restart")
    assert cont["warm_start"]["schedule"] == "continue" and restart["warm_start"]["schedule"] == "restart"
    runs = ("plain", "continue", "restart")
    weights = {run: load_outer_state(tmp_path / run / "final_state")[0].anchor for run in runs}
    assert all(torch.equal(a, b) for a, b in zip(weights["plain"], weights["continue"], strict=True))
    assert cont["final_eval_loss"] == plain["final_eval_loss"] != restart["final_eval_loss"]
    assert not all(torch.equal(a, b) for a, b in zip(weights["plain"], weights["restart"], strict=True))


def test_warm_start_settings_are_checked_and_a_swarm_peer_refuses_them():
    with pytest.raises(ConfigError, match="train.warm_start_steps=0 is invalid: must be >= 1"):
        load_config(TINY, ["train.warm_start=sync"])
    with pytest.raises(ConfigError, match="must be 0 with train.warm_start=none"):
        load_config(TINY, ["train.warm_start_steps=5"])
    with pytest.raises(ConfigError, match="train.warm_start='lots' is invalid: must be one of none, single, sync"):
        load_config(TINY, ["train.warm_start=lots", "train.warm_start_steps=5"])
    with pytest.raises(ConfigError, match="train.warm_start_schedule='continue' is invalid: must be restart with"):
        load_config(TINY, ["train.warm_start_schedule=continue"])
    with pytest.raises(ConfigError, match="must be one of restart, continue"):
        load_config(TINY, ["train.warm_start=sync", "train.warm_start_steps=5", "train.warm_start_schedule=later"])
    from p2p_diloco.swarm.peer import PeerOptions, TrainingPeer

    cfg = load_config(TINY, ["train.warm_start=single", "train.warm_start_steps=5"])
    with pytest.raises(ConfigError, match="run_simulation only.*model.pretrained=MODEL"):
        TrainingPeer(cfg, PeerOptions(initial_peers=[], log_dir="unused", new_swarm=True))


def test_simulated_speeds_budget_steps_by_the_round_clock(tmp_path):
    """With inner.round_seconds each simulated worker takes round_seconds x its speed steps (its tokens weigh its
    Δ), and a round lasts round_seconds."""
    sets = [*FAST, "train.rounds=2", "inner.steps=12"]
    cfg = load_config(TINY, [*sets, "inner.round_seconds=6"])
    budget = simulate(cfg, "diloco", 3, tmp_path / "b", speeds=[2.0, 1.0, 0.25])
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    steps = [12, 6, 1]  # min(H, max(1, 6 x speed)): the fastest is capped at H
    assert [r["tokens"] for r in records] == [sum(steps) * cfg.data.batch_size * cfg.data.seq_len] * 2
    assert budget["simulated_seconds"] == 12.0 and budget["speeds"] == [2.0, 1.0, 0.25]


@pytest.mark.parametrize(("max_staleness", "counted_rounds"), [(1, 0), (2, 2)])
def test_fixed_h_with_a_straggler_never_waits_for_it_and_counts_its_delayed_delta_within_max_staleness(
    tmp_path, max_staleness, counted_rounds
):
    """Fixed H = 3, speeds 1, 1, 1/3: the fast pair averages every 3 simulated seconds without the straggler, which
    reaches every third group 2 rounds behind. Within max_staleness its Δ counts (then it catches up); beyond, it
    resyncs and its round is lost. Every group member ends bitwise on the group's state either way."""
    sets = [*FAST, "train.rounds=6", "inner.steps=3", f"swarm.max_staleness={max_staleness}"]
    cfg = load_config(TINY, sets)
    out = simulate(cfg, "diloco", 3, tmp_path, speeds=[1.0, 1.0, 1 / 3])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["group_size"] for r in records] == [2, 2, 3, 2, 2, 3]
    assert out["simulated_seconds"] == pytest.approx(18.0)  # 6 rounds of the fast workers: nobody waited
    per_round = 3 * cfg.data.batch_size * cfg.data.seq_len
    assert out["contributed_tokens_per_worker"] == [6 * per_round, 6 * per_round, counted_rounds * per_round]
    assert out["lost_rounds_per_worker"] == [0, 0, 2 - counted_rounds]


def test_a_straggler_simulation_refuses_what_it_does_not_model(tmp_path):
    cfg = load_config(TINY, [*FAST, "train.rounds=1", "inner.steps=2", "swarm.overlap=eager"])
    with pytest.raises(ConfigError, match="overlap"):
        simulate(cfg, "diloco", 2, tmp_path, speeds=[1.0, 0.5])


def test_pretrained_model_loads_from_a_local_path(tmp_path):
    cfg = load_config(TINY, ["seed=5"])
    model = build_model(cfg.model, 257, cfg.seed)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(load_config(TINY, [f"model.pretrained={tmp_path / 'ckpt'}"]).model, 257, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_eager_overlap_settles_after_overlap_steps_and_carries_the_steps_since_onto_the_new_state():
    """swarm.overlap eager, H 3, overlap_steps 2: round 1's Δ is sent and round 2's steps start from the look-ahead
    (the outer step with the own Δ, on a copy); after 2 of them the group's Δ̄ moves the outer state exactly as
    without overlap, and θ becomes the new anchor plus overlap_carry (0.25) x those 2 steps' displacement; round 2's
    Δ is then anchor - θ.
    A worker doing the same by hand, step for step, ends bitwise equal."""
    eager = ["swarm.overlap=eager", "swarm.overlap_steps=2", "swarm.overlap_carry=0.25"]
    cfg = load_config(TINY, ["inner.steps=3", "train.rounds=3", *eager, *FAST])
    worker, ref = Worker(cfg, 257, _batches(2)), Worker(cfg, 257, _batches(2))
    seed_tag = worker.tag()
    assert worker.run_round(_SelfReducer(), RoundRules()) is None  # its exchange is in flight
    assert worker.in_flight == 1 and worker.pending.mine.payload.tag == seed_tag == worker.tag()

    # by hand: round 1 blocking, the look-ahead, 2 steps from it, the outer step, the carry, 1 more step
    ref_delta = ref.contribute().pseudo_grad
    assert all(torch.equal(a, b) for a, b in zip(ref_delta, worker.pending.mine.pseudo_grad))
    ahead = ref.state.ahead(ref_delta, ref.outer_lr(0), cfg.outer.momentum, cfg.outer.nesterov)
    assert all(torch.equal(x, p) for x, p in zip(ahead, _params(worker.model)))  # θ at the look-ahead
    assert all(torch.equal(x, s) for x, s in zip(ahead, worker.start))
    assert worker.state.round == 0  # the outer state itself did not move
    with torch.no_grad():
        for p, x in zip(ref.model.parameters(), ahead):
            p.copy_(x)
    ref.inner.run(ref.batches, 2, 3, ref.autocast, ref.device)
    expected = ref.state.copy()
    expected.apply(ref_delta, ref.outer_lr(0), cfg.outer.momentum, cfg.outer.nesterov)  # Δ̄ of a group of one
    carried = [e + 0.25 * (p.detach() - x) for e, p, x in zip(expected.anchor, ref.model.parameters(), ahead)]
    with torch.no_grad():
        for p, c in zip(ref.model.parameters(), carried):
            p.copy_(c)
    ref.inner.run(ref.batches, 1, 5, ref.autocast, ref.device)

    result = worker.run_round(_SelfReducer(), RoundRules())  # round 2's steps, round 1 settled after 2 of them
    assert result is not None and result.outer_step == 1 and worker.state.checksum() == expected.checksum()
    assert result.checksum == expected.checksum()
    round2 = worker.pending.mine
    assert round2.payload.tag.round == 1  # tagged with the state it was measured from
    assert all(torch.equal(d, a - p) for d, a, p in zip(round2.pseudo_grad, expected.anchor, _params(ref.model)))
    assert int(next(iter(worker.inner.optimizer.state.values()))["step"]) == 6
    last = worker.drain(RoundRules())
    assert last is not None and last.outer_step == 2 and worker.pending is None and worker.start is None
    assert all(torch.equal(a, p) for a, p in zip(worker.state.anchor, _params(worker.model)))  # no step since


def test_delayed_overlap_trains_on_from_the_anchor_and_applies_the_groups_mean_when_settled():
    """swarm.overlap delayed, H 3, overlap_steps 2: round 2's steps start from the anchor as it is (no look-ahead);
    after 2 of them the group's Δ̄ moves the outer state exactly as without overlap, and θ becomes the new anchor
    plus overlap_carry (0.25) x those steps' displacement from the old one. A worker doing that by hand ends bitwise
    equal."""
    delayed = ["swarm.overlap=delayed", "swarm.overlap_steps=2", "swarm.overlap_carry=0.25"]
    cfg = load_config(TINY, ["inner.steps=3", "train.rounds=3", *delayed, *FAST])
    worker, ref = Worker(cfg, 257, _batches(2)), Worker(cfg, 257, _batches(2))
    assert worker.run_round(_SelfReducer(), RoundRules()) is None and worker.in_flight == 1
    anchor = [a.clone() for a in worker.state.anchor]
    assert worker.state.round == 0 and all(torch.equal(a, p) for a, p in zip(anchor, _params(worker.model)))

    ref_delta = ref.contribute().pseudo_grad
    ref.reset_params()  # θ ← the anchor, as the delayed worker's next steps start
    ref.inner.run(ref.batches, 2, 3, ref.autocast, ref.device)
    expected = ref.state.copy()
    expected.apply(ref_delta, ref.outer_lr(0), cfg.outer.momentum, cfg.outer.nesterov)  # Δ̄ of a group of one
    with torch.no_grad():
        for p, e, a in zip(ref.model.parameters(), expected.anchor, anchor):
            p.copy_(e + 0.25 * (p - a))
    ref.inner.run(ref.batches, 1, 5, ref.autocast, ref.device)

    result = worker.run_round(_SelfReducer(), RoundRules())
    assert result is not None and result.outer_step == 1 and worker.state.checksum() == expected.checksum()
    round2 = worker.pending.mine.pseudo_grad
    assert all(torch.equal(d, a - p) for d, a, p in zip(round2, expected.anchor, _params(ref.model)))
    worker.drain(RoundRules())


def test_eager_with_one_worker_and_plain_outer_sgd_is_plain_adamw():
    """Invariant 1 holds with overlap too: one worker, outer lr 1, no momentum, all carried (overlap_carry 1): the
    look-ahead is θ itself and the correction is zero, so R rounds of H steps are R x H steps of AdamW, whatever
    overlap_steps is (to fp32 rounding: the look-ahead is anchor - (anchor - θ), not θ's own bits)."""
    over = ["outer.lr=1.0", "outer.momentum=0.0", "outer.lr_warmup_rounds=0", "inner.steps=4", "train.rounds=3"]
    plain = Worker(load_config(TINY, [*FAST, *over]), 257, _batches(5))
    for _ in range(3):
        plain.run_round(_SelfReducer(), RoundRules())
    eager_cfg = load_config(
        TINY, [*FAST, *over, "swarm.overlap=eager", "swarm.overlap_steps=3", "swarm.overlap_carry=1"]
    )
    eager = Worker(eager_cfg, 257, _batches(5))
    for _ in range(3):
        eager.run_round(_SelfReducer(), RoundRules())
    eager.drain(RoundRules())
    assert eager.state.round == plain.state.round == 3
    assert max((a - b).abs().max().item() for a, b in zip(eager.state.anchor, plain.state.anchor)) < 1e-6


def test_eager_settles_at_the_end_of_a_round_shorter_than_overlap_steps():
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=3", "swarm.overlap=eager", "swarm.overlap_steps=5", *FAST])
    worker = Worker(cfg, 257, _batches(4))
    worker.run_round(_SelfReducer(), RoundRules())
    result = worker.run_round(_SelfReducer(), RoundRules())
    assert result is not None and result.outer_step == 1 and worker.pending.mine.payload.tag.round == 1
    with pytest.raises(RuntimeError, match="in flight"):  # a caller that would take Δ against a stale anchor
        worker.contribute()
    assert all(torch.equal(x, p) for x, p in zip(worker.start, _params(worker.model)))  # θ back where it started


class _SlowReducer(_SelfReducer):
    """A group of one whose exchange takes ``delay`` seconds."""

    delay = 0.0

    def reduce(self, pseudo_grads, weight, payload):
        time.sleep(self.delay)
        return super().reduce(pseudo_grads, weight, payload)


def test_eager_with_overlap_steps_0_settles_after_as_many_steps_as_the_last_exchange_took():
    """swarm.overlap_steps 0: τ starts at H // 10; after each exchange it is the inner steps that exchange took at
    the worker's pace, a quarter more and one to spare, so a slow exchange gets more steps next time and a fast one
    fewer; the record says after how many steps each was settled. A fixed τ does not move."""
    cfg = load_config(TINY, ["inner.steps=12", "train.rounds=6", "swarm.overlap=eager", "swarm.overlap_steps=0", *FAST])
    worker, reducer = Worker(cfg, 257, _batches(7)), _SlowReducer()
    try:
        assert worker.overlap_steps == 1  # H // 10 until an exchange was measured
        worker.run_round(reducer, RoundRules())  # round 1 sent (it takes no time)
        pace = worker.pending.mine.inner.seconds / 12
        result = worker.run_round(reducer, RoundRules())  # round 1 settled after 1 step; round 2 sent
        assert result.reduce.overlap_steps == 1 and result.record()["overlap_steps"] == 1
        # it was done at once: one step and one to spare (a step more when a loaded machine runs its thread late)
        assert worker.overlap_steps in (2, 3), worker.overlap_steps
        # round 2's exchange takes about 10 of round 1's steps: at least 4 (the bound below) even if a loaded machine
        # runs this round's steps 4x slower than round 1's (seen: 5 steps' time passed in under 1 of them)
        reducer.delay = 10 * pace
        result = worker.run_round(reducer, RoundRules())  # settled after 2 steps, waiting for the rest
        assert result.reduce.overlap_steps == 2 and result.reduce.wait_seconds > 0
        slow = worker.overlap_steps
        assert slow >= 4, slow
        reducer.delay = 0.0
        result = worker.run_round(reducer, RoundRules())  # round 3's exchange, given `slow` steps
        assert result.reduce.overlap_steps == slow
        assert worker.overlap_steps in (2, 3) and worker.overlap_steps < slow, (worker.overlap_steps, slow)
        worker.drain(RoundRules())
    finally:
        worker.close()

    fixed = Worker(
        load_config(TINY, ["inner.steps=6", "swarm.overlap=eager", "swarm.overlap_steps=3", *FAST]), 257, _batches(7)
    )
    try:
        for _ in range(3):
            fixed.run_round(reducer, RoundRules())
        assert fixed.overlap_steps == 3
    finally:
        fixed.close()


def test_eager_drops_an_exchange_whose_outer_state_was_replaced_meanwhile():
    """A rollback or download while the exchange is in flight: its Δ̄ belongs to another state, so it is dropped
    (not applied to the new one), and θ goes on from the new anchor with the steps taken since."""
    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=3", "swarm.overlap=eager", *FAST])
    worker = Worker(cfg, 257, _batches(3))
    worker.run_round(_SelfReducer(), RoundRules())
    downloaded = worker.state.copy()
    downloaded.round = 7
    worker.load_state(downloaded)
    assert all(torch.equal(x, a) for x, a in zip(worker.start, downloaded.anchor))
    assert worker.drain(RoundRules()) is None
    assert worker.state.round == 7 and worker.pending is None and worker.start is None
    assert all(torch.equal(a, p.detach()) for a, p in zip(worker.state.anchor, worker.model.parameters()))


def test_a_settled_round_is_hashed_in_the_background_and_the_next_outer_step_waits_for_it(monkeypatch):
    """settle leaves the checksum to a hashing thread (tag_soon); its tag is the settled state's, not the next
    one's: apply_outer, the only change in place, waits for a hashing still reading the state (made slow here, so
    that it still runs when the next outer step comes)."""
    hash_state = OuterState.checksum

    def slow_checksum(self):
        time.sleep(0.5)
        return hash_state(self)

    cfg = load_config(TINY, ["inner.steps=2", "train.rounds=3", *FAST])
    worker = Worker(cfg, 257, _batches(4))
    try:
        monkeypatch.setattr(OuterState, "checksum", slow_checksum)
        result = worker.run_round(_SelfReducer(), RoundRules())
        assert not isinstance(result.hashed, str)  # a future: the round's checksum is hashed off the main thread
        settled = worker.state.copy()
        delta = [torch.full_like(a, 0.01) for a in worker.state.anchor]
        worker.apply_outer(delta)  # while round 1's state is still being hashed
        assert not result.hashed.running()
        monkeypatch.undo()
        assert result.checksum == settled.checksum() != worker.state.checksum()
        hashed = worker.tag_soon()
        assert worker.tag_soon() is hashed  # one hashing per state
        assert hashed.result() == worker.tag() and worker.tag().checksum == worker.state.checksum()
        assert worker.tag_soon().result() == worker.tag()  # hashed before: done at once
    finally:
        worker.close()


@pytest.mark.parametrize(("name", "flag"), [("int4", "true"), ("topk3", "false")])
def test_error_feedback_sends_what_the_codec_left_out_in_the_next_round_and_keeps_it_through_a_checkpoint(
    tmp_path, name, flag
):
    """swarm.error_feedback with int4 (a top-k codec has it whatever the flag says): round t sends Δ_t + r_{t-1},
    and r_t is what the wire's round trip left out of that (exactly: the parts are cut as the swarm cuts them). So
    over rounds the state moves by the sum of the Δ minus only the last residual, and the residual travels in
    local_state through a checkpoint. A round that moved nothing keeps what was owed; a local step applies the
    whole Δ sent: nothing is owed after it."""
    cfg = load_config(
        TINY, ["inner.steps=2", "train.rounds=4", f"swarm.compression={name}", f"swarm.error_feedback={flag}"]
    )
    codec, part_values = get_codec(name), cfg.swarm.part_size_bytes // 4
    worker, owed = Worker(cfg, 257, _batches(3)), None
    for _ in range(3):
        mine = worker.contribute()
        raw = worker.pseudo_grad()  # θ is where the inner steps ended until the round settles
        expected = raw if owed is None else [d + r for d, r in zip(raw, owed)]
        assert all(torch.equal(a, b) for a, b in zip(mine.pseudo_grad, expected))
        carried = roundtrip_parts(mine.pseudo_grad, codec, part_values)
        info = ReduceInfo(group_size=1, complete=True, attempts=1, gathered=Gathered({"me": mine.payload}))
        assert worker.settle(mine, carried, info, RoundRules()) is not None
        owed = worker.residual
        assert all(torch.equal(r, d - c) for r, d, c in zip(owed, mine.pseudo_grad, carried))
        assert max(float(r.abs().max()) for r in owed) > 0  # the codec does lose something each round
    save_round(tmp_path, worker.state, worker_state=worker.local_state())
    again = Worker(cfg, 257, _batches(3))
    again.restore_local_state(load_worker_state(latest_checkpoint(tmp_path)))
    assert all(torch.equal(a, b) for a, b in zip(again.residual, owed))

    mine = worker.contribute()  # a round that moved nothing (alone_policy wait): the residual is still owed
    alone = ReduceInfo(group_size=1, complete=False, attempts=1, gathered=Gathered({"me": mine.payload}))
    assert worker.settle(mine, mine.pseudo_grad, alone, RoundRules(alone_policy="wait")) is None
    assert worker.residual is owed

    mine = worker.contribute()  # a group that failed: this peer steps alone with the Δ it sent, residual included
    alone = ReduceInfo(group_size=1, complete=False, attempts=1, gathered=Gathered({"me": mine.payload}))
    assert worker.settle(mine, mine.pseudo_grad, alone, RoundRules()) is not None
    assert worker.residual is None and "residual" not in worker.local_state()

    plain = Worker(load_config(TINY, ["inner.steps=2", "swarm.compression=int4"]), 257, _batches(3))
    assert plain.contribute().residual is None  # off by default
    short = {**again.local_state(), "residual": [r[:1] for r in owed]}
    with pytest.raises(ValueError, match="residual's shapes are not the model's"):
        plain.restore_local_state(short)


def test_a_top_k_codec_with_outer_momentum_gets_the_measured_advice():
    assert sparse_advice(load_config(TINY, ["swarm.compression=int8"])) is None
    assert sparse_advice(load_config(TINY, ["swarm.compression=topk3", "outer.momentum=0"])) is None
    advice = sparse_advice(load_config(TINY, ["swarm.compression=topk1"]))
    assert advice is not None and "outer.momentum=0" in advice and "swarm.feedback_decay=0.95" in advice

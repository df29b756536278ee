"""The monitor's samples without a network (p2p_diloco/monitor_samples.py, and how monitor.py, monitor_http.py and
run_monitor carry them): the vouched state from in-process stand-ins for the donors' averagers, what a failed
attempt leaves, a restart's resume, the console line, the page's section and the flags run_monitor refuses. The same
path between real processes: tests/test_monitor.py's sample test."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import urllib.request
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.data import ByteTokenizer
from p2p_diloco.generate import generate
from p2p_diloco.model import build_model
from p2p_diloco.monitor import ConsoleView, History, Monitor, SwarmTracker, render_table
from p2p_diloco.monitor_http import bind, page_html
from p2p_diloco.monitor_samples import StateSample, StateSampler
from p2p_diloco.outer import OuterState
from p2p_diloco.protocol import RoundTag
from p2p_diloco.state_parts import part_digests
from p2p_diloco.swarm.vouches import Vouches

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


class _Donors:
    """The averager's ``manifest`` and ``piece`` (what download.py calls): peer id -> (metadata, tensors) it serves."""

    def __init__(self, serves: dict[str, tuple[dict, list[torch.Tensor]]]) -> None:
        self.serves, self.asked = serves, []

    def manifest(self, peer_id: str, timeout: float) -> dict:
        self.asked.append(peer_id)
        return self.serves[peer_id][0]

    def piece(self, peer_id: str, tag: tuple, start: int, end: int, timeout: float) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.serves[peer_id][1]])[start:end].clone()


class _Announcements:
    """What monitor_samples reads from Announcements (announcements.py): the vouches, the others' announcements and
    settings."""

    def __init__(self, vouches: Vouches, others: dict | None = None) -> None:
        self.current, self.announced = vouches, others or {}

    def vouches(self) -> Vouches:
        return self.current

    def others(self) -> dict:
        return self.announced

    def settings_of(self, peer: str) -> dict | None:  # the summary a peer stored with its settings: here, beside
        return self.announced.get(peer, {}).get("summary")  # its announcement


def _served(state: OuterState) -> tuple[dict, list[torch.Tensor]]:
    meta = {"round": state.round, "checksum": state.checksum(), "fingerprint": "fp", "consensus": True}
    return {**meta, "parts": part_digests(state.tensors())}, [t.clone() for t in state.tensors()]


def _vouched(state: OuterState, peers: list[str]) -> Vouches:
    tag = RoundTag(state.round, state.checksum())
    return Vouches(vouchers={tag: set(peers)}, holders={tag: list(peers)}, live=set(peers))


@pytest.fixture(scope="module")
def run():
    cfg = load_config(TINY, ["swarm.state_timeout=10"])
    seed = build_model(dataclasses.replace(cfg.model, device="cpu"), ByteTokenizer.vocab_size, cfg.seed)
    return cfg, OuterState.from_params(seed.parameters())


def _trained(start: OuterState, round: int, scale: float) -> OuterState:
    state = start.copy()
    state.round = round
    gen = torch.Generator().manual_seed(round)
    for t in state.anchor:
        t.add_(scale * torch.randn(t.shape, generator=gen))
    return state


def _sampler(cfg, vouches: Vouches, serves: dict, others: dict | None = None, tokens: int = 12) -> StateSampler:
    model = build_model(dataclasses.replace(cfg.model, device="cpu"), ByteTokenizer.vocab_size, cfg.seed + 1).eval()
    announcements = _Announcements(vouches, others)
    return StateSampler(
        cfg, model, ByteTokenizer(), "fp", {"model.hidden_size": 128}, announcements, _Donors(serves), "def ", tokens
    )


def test_a_sample_is_the_vouched_states_greedy_text_and_the_same_state_is_not_fetched_again(run):
    cfg, seed = run
    state = _trained(seed, 3, 0.05)
    sampler = _sampler(cfg, _vouched(state, ["a", "b"]), {"a": _served(state), "b": _served(state)})
    assert sampler.latest == (None, None)
    sample = sampler.sample_once()
    assert sample is not None and sampler.latest == (sample, None)
    assert (sample.round, sample.checksum, sample.prompt) == (3, state.checksum(), "def ")
    assert sample.seconds >= sample.download_seconds > 0
    reference = build_model(dataclasses.replace(cfg.model, device="cpu"), ByteTokenizer.vocab_size, cfg.seed).eval()
    state.copy_to(reference.parameters())
    assert sample.text == generate(reference, ByteTokenizer(), "def ", 12, temperature=0.0).text  # greedy, this anchor
    for mine, theirs in zip(sampler.model.parameters(), state.anchor):
        assert torch.equal(mine, theirs)
    asked = len(sampler.averager.asked)
    assert sampler.sample_once() is None and sampler.latest == (sample, None)  # the swarm did not move: no download
    assert len(sampler.averager.asked) == asked
    json.dumps(sample.to_json(), allow_nan=False)
    assert StateSample.from_json(sample.to_json()) == sample


def test_a_failed_attempt_says_why_keeps_the_last_sample_and_never_raises(run, caplog):
    caplog.set_level(logging.WARNING)
    cfg, seed = run
    nothing = _sampler(cfg, Vouches(), {})
    assert nothing.sample_once() is None
    assert "no live peer of run 'tiny-demo' has announced itself yet" in nothing.latest[1]
    other = {"x": {"fingerprint": "other", "summary": {"model.hidden_size": 64}, "live": True}}
    mismatch = _sampler(cfg, Vouches(), {}, others=other)
    assert mismatch.sample_once() is None
    assert "other settings" in mismatch.latest[1] and "model.hidden_size: theirs 64, ours 128" in mismatch.latest[1]
    untrained = _sampler(cfg, _vouched(seed, ["a", "b"]), {"a": _served(seed), "b": _served(seed)})
    assert untrained.sample_once() is None and "no state past round 0" in untrained.latest[1]

    first, second = _trained(seed, 2, 0.05), _trained(seed, 3, 0.05)
    liar = (_served(second)[0], _served(first)[1])  # round 3's manifest, other bytes
    sampler = _sampler(cfg, _vouched(first, ["a", "b"]), {"a": _served(first), "b": _served(first), "c": liar})
    made = sampler.sample_once()
    assert made is not None and made.round == 2
    sampler.announcements.current = _vouched(second, ["c", "d"])
    sampler.averager.serves["d"] = liar
    assert sampler.sample_once() is None
    kept, error = sampler.latest
    assert kept == made and "no vouched state of round 3 could be downloaded" in error
    assert any("does not match the manifest" in r.getMessage() for r in caplog.records)
    broken = _sampler(cfg, _vouched(first, ["a"]), {"a": _served(first)})
    broken.averager = None  # anything unexpected inside an attempt
    assert broken.sample_once() is None and "AttributeError" in broken.latest[1]


def test_odd_history_lines_are_no_sample_and_a_restart_takes_the_last_one_back(run, tmp_path):
    cfg, seed = run
    good = StateSample(time=1.0, round=4, checksum="ab" * 8, prompt="p", text="t", seconds=1.0, download_seconds=0.5)
    for odd in (None, "x", {"round": 4}, {**good.to_json(), "round": "4"}, {**good.to_json(), "round": True}):
        assert StateSample.from_json(odd) is None, odd
    summary = dataclasses.replace(SwarmTracker("r").update({}, now=10.0), sample=good.to_json())
    History(tmp_path).append(summary)
    sampler = _sampler(cfg, Vouches(), {})
    Monitor(None, "r", tmp_path, 1.0, samples=sampler)
    assert sampler.latest == (good, None)


def test_the_console_prints_each_new_sample_once_and_the_table_shows_it():
    sample = StateSample(time=5.0, round=7, checksum="c0ffee" * 2, prompt="def ", text="f(x):", seconds=1.25,
                         download_seconds=1.0).to_json()  # fmt: skip
    s = dataclasses.replace(SwarmTracker("r").update({}, now=10.0), sample=sample)
    out = io.StringIO()
    view = ConsoleView(out, tty=False)
    for now in (10.0, 11.0):
        view.show(dataclasses.replace(s, time=now))
    view.show(dataclasses.replace(s, time=12.0, sample={**sample, "round": 8, "time": 6.0}))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("sample of round")]
    assert lines == [
        "sample of round 7 (checksum c0ffeec0ffee, 1.2s): 'def ' -> 'f(x):'",
        "sample of round 8 (checksum c0ffeec0ffee, 1.2s): 'def ' -> 'f(x):'",
    ]
    assert "sample of round 7" in render_table(s)


def test_the_page_has_a_sample_section_only_with_samples_and_status_carries_the_sample():
    assert 'id="sample"' not in page_html(1000, plots=False)
    assert 'id="sample"' in page_html(1000, plots=False, samples=True)
    sample = StateSample(time=5.0, round=7, checksum="ab" * 8, prompt="<b>", text="</pre>", seconds=1.0,
                         download_seconds=0.5).to_json()  # fmt: skip
    summary = dataclasses.replace(SwarmTracker("r").update({}, now=10.0), sample=sample, sample_error="timeout")
    server = bind("127.0.0.1", 0, lambda: summary, 1000, samples=True)
    server.start()
    try:
        with urllib.request.urlopen(server.url + "status", timeout=10) as r:
            status = json.loads(r.read())
        assert status["sample"] == sample and status["sample_error"] == "timeout"
        with urllib.request.urlopen(server.url, timeout=10) as r:
            page = r.read().decode()
        assert 'id="sample-continuation"' in page and "textContent" in page
    finally:
        server.close()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--samples"], "--samples needs --config FILE"),
        (["--samples", "--config", str(TINY), "--sample-every", "0"], "--sample-every 0.0 must be"),
        (["--samples", "--config", str(TINY), "--sample-every", "nan"], "--sample-every nan must be"),
        (["--samples", "--config", str(TINY), "--sample-tokens", "0"], "--sample-tokens 0 must be >= 1"),
        (["--set", "inner.steps=5"], "--set inner.steps=5 needs --config FILE"),
        (["--samples", "--config", str(TINY), "--set", "inner.nope=1"], "inner.nope"),
    ],
)
def test_run_monitor_refuses_sample_flags_that_cannot_work(tmp_path, capsys, flags, says):
    from peers.run_monitor import main

    assert main(["--out", str(tmp_path / "m"), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_run_monitor_refuses_samples_in_a_closed_run(tmp_path, capsys):
    from p2p_diloco.swarm.identity import Identity
    from peers.run_monitor import main

    keys = tmp_path / "keys.txt"
    keys.write_text(Identity.load(tmp_path / "k.key").public_key.decode() + "\n")
    flags = ["--samples", "--config", str(TINY), "--authorized-keys", str(keys)]
    assert main(["--out", str(tmp_path / "m"), *flags]) == 2
    assert "does not work in a closed run" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_sampler_for_a_warm_started_run_has_the_peers_fingerprint(tmp_path):
    """model.pretrained puts the weights in the fingerprint (model.weights_digest): the sampler builds the run's
    model as a peer does, from those weights, not from the config alone."""
    from hivemind import DHT

    from p2p_diloco.data import DataPipeline
    from p2p_diloco.fingerprint import swarm_fingerprint

    base = build_model(load_config(TINY).model, ByteTokenizer.vocab_size, seed=3)  # not the seed's init
    base.save_pretrained(tmp_path / "warm")
    cfg = load_config(TINY, [f"model.pretrained={tmp_path / 'warm'}"])
    peer_model = build_model(cfg.model, ByteTokenizer.vocab_size, cfg.seed)
    expected = swarm_fingerprint(cfg, peer_model, DataPipeline(cfg.data, cfg.seed))
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        sampler = StateSampler.build(dht, cfg)
        try:
            assert (sampler.fingerprint, sampler.summary) == expected
        finally:
            sampler.averager.shutdown()
    finally:
        dht.shutdown()

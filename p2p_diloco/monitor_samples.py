"""The monitor's samples: now and then, the outer state the swarm vouches for, as the run's model, continuing a prompt.

Inputs:  the monitor's DHT node; the run's Config (``run_monitor --config`` and ``--set``, as the peers were given:
         its model, tokenizer and data give the swarm fingerprint, and a donor's manifest is accepted only for that
         fingerprint); the prompt, the number of new tokens, the seconds between attempts (``every``), the stop Event;
         optionally the sample the monitor's history ended with (``resume``: a restart shows it and does not fetch the
         same state again).
Output:  ``latest`` -> (the latest :class:`StateSample` or None, why the last attempt failed or None), which
         monitor.py puts into every summary (``sample``, ``sample_error``). A sample is made from the furthest state
         past round 0 that ``swarm.state_quorum`` peers (or all there are, when fewer) vouch for in their signed
         announcements (swarm/announcements.py), downloaded through the peers' own path
         (swarm/sync.py ``fetch_vouched``, swarm/download.py: every part checked against the vouched checksum), so it
         shows a state the swarm vouches for, not what one peer claims. Its text is the greedy continuation
         (generate.py, temperature 0: the same state and prompt give the same text anywhere) of the prompt by up to
         ``max_new_tokens`` tokens, made on the CPU.
State:   the run's model on the CPU (fp32, one copy of the anchor's size: it holds the last sampled anchor between
         samples) and tokenizer, the fingerprint, a PseudoGradAverager in client mode (it calls the donors' manifest
         and piece RPCs and serves nothing, even when the DHT node is reachable; it never averages, so its buffer is
         one value, not the model's shapes), the latest sample and error, and the thread that makes them. A download
         holds the whole state (anchor and momentum, 8 bytes per parameter: the checksum covers both) until its
         anchor is copied into the model; then it is dropped, so one copy of the state lives only while a sample is
         being made. An attempt runs every ``every`` seconds, in its own thread: the monitor's refreshes keep their
         pace. A state the last sample came from is not fetched again.
Failure: building raises what building a peer's data and model raises (DataError, ConfigError: the corpus or the
         tokenizer is missing here) and SwarmSetupError for a closed run (donors serve only listed peers, and the
         monitor has no listed key). After that nothing raises out of an attempt: no peer of the run yet, peers with
         other settings than --config gives (the fields that differ are named), no state past round 0 vouched for
         yet, the donors' refusal or departure, ``swarm.state_timeout`` spent, a non-finite anchor, an error while
         generating: the reason is logged and kept in ``latest``, and the next attempt comes ``every`` seconds later.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Container, Mapping
from typing import Any

import torch
from hivemind.dht import DHT

from p2p_diloco.config import Config
from p2p_diloco.data import DataPipeline, Tokenizer
from p2p_diloco.fingerprint import fingerprint_differences, swarm_fingerprint
from p2p_diloco.generate import check_generation_args, generate
from p2p_diloco.model import build_model
from p2p_diloco.monitor import DEFAULT_EVERY, DEFAULT_PROMPT, DEFAULT_TOKENS
from p2p_diloco.outer import is_finite
from p2p_diloco.protocol import RoundTag
from p2p_diloco.swarm.announcements import Announcements
from p2p_diloco.swarm.averager import PseudoGradAverager
from p2p_diloco.swarm.dht import SwarmSetupError
from p2p_diloco.swarm.sync import fetch_vouched

__all__ = ["DEFAULT_EVERY", "DEFAULT_PROMPT", "DEFAULT_TOKENS", "StateSample", "StateSampler"]

log = logging.getLogger("p2p_diloco.monitor")

CLOSE_WAIT = 2.0  # seconds close() waits for an attempt in flight (then it is left to its daemon thread)


@dataclasses.dataclass(frozen=True)
class StateSample:
    """One sample: the state it came from, the prompt and its continuation, and how long it took."""

    time: float  # unix time it was made
    round: int
    checksum: str  # the vouched (round, checksum) tag's; the downloaded state hashes to it
    prompt: str
    text: str  # the continuation alone (greedy)
    seconds: float  # download + generation
    download_seconds: float

    @property
    def tag(self) -> RoundTag:
        return RoundTag(self.round, self.checksum)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> StateSample | None:
        """The sample a history line holds, or None for anything else (a line of another version, garbage)."""
        if not isinstance(value, Mapping):
            return None
        try:
            sample = cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError):
            return None
        types = (
            (sample.round, int),
            (sample.checksum, str),
            (sample.prompt, str),
            (sample.text, str),
            *((x, int | float) for x in (sample.time, sample.seconds, sample.download_seconds)),
        )
        return sample if all(isinstance(x, t) and not isinstance(x, bool) for x, t in types) else None


class StateSampler:
    """``start()`` makes a sample now and every ``every`` seconds until ``stop``; ``latest`` is what came of it."""

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        fingerprint: str,
        summary: dict[str, Any],
        announcements: Any,
        averager: Any,
        prompt: str = DEFAULT_PROMPT,
        max_new_tokens: int = DEFAULT_TOKENS,
        every: float = DEFAULT_EVERY,
        stop: threading.Event | None = None,
    ) -> None:
        check_generation_args(max_new_tokens, 0.0)
        if not (math.isfinite(every) and every > 0):
            raise ValueError(f"every={every} must be a number of seconds > 0")
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.fingerprint, self.summary = fingerprint, summary
        self.announcements, self.averager = announcements, averager
        self.prompt, self.max_new_tokens, self.every = prompt, max_new_tokens, every
        self.stop = stop or threading.Event()
        # tensors of the state's shapes (anchor, then momentum) for the download to fill: meta, they hold no memory
        self.shapes = [torch.empty(p.shape, device="meta") for p in model.parameters()] * 2
        self._lock = threading.Lock()
        self._sample: StateSample | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def build(
        cls,
        dht: DHT,
        cfg: Config,
        authorized: Container[str] | None = None,
        **kw: Any,
    ) -> StateSampler:
        """The run's data (for its tokenizer and fingerprint), its model on the CPU, the fingerprint, a reader of the
        run's announcements and a client-mode averager on ``dht``; raises at once what a peer's start would."""
        if authorized is not None:
            raise SwarmSetupError(
                "no samples in a closed run or one with swarm.identity_work: peers serve their state only to "
                "admitted keys (listed, or carrying the work), and the monitor has none"
            )
        data = DataPipeline(cfg.data, cfg.seed)
        # the peers' own build: with model.pretrained its weights are in the fingerprint (model.weights_digest)
        model = build_model(dataclasses.replace(cfg.model, device="cpu"), data.vocab_size, cfg.seed).eval()
        fingerprint, summary = swarm_fingerprint(cfg, model, data)
        tokenizer = data.tokenizer
        del data  # the documents were needed for the corpus digest only
        announcements = Announcements(dht, cfg, fingerprint)
        averager = PseudoGradAverager.from_config(
            dht, [torch.zeros(1)], cfg.swarm, prefix=f"{cfg.swarm.run_id}_{fingerprint}", client_mode=True
        )
        return cls(cfg, model, tokenizer, fingerprint, summary, announcements, averager, **kw)

    @property
    def latest(self) -> tuple[StateSample | None, str | None]:
        """(the latest sample, why the last attempt failed: None when it did not)."""
        with self._lock:
            return self._sample, self._error

    def resume(self, sample: Any) -> None:
        """Continue from the sample the monitor's history ended with (a history line's ``sample``; ignored if odd)."""
        got = StateSample.from_json(sample)
        if got is not None:
            with self._lock:
                self._sample = got

    # ---------------------------------------------------------------- one attempt
    def sample_once(self) -> StateSample | None:
        """Make a sample of the furthest state the swarm vouches for, unless the last sample came from it; None when
        no new sample came (``latest`` says why when the attempt failed). Never raises."""
        try:
            made, error = self._attempt()
        except Exception as exc:  # noqa: BLE001 - a sample is a view: a failed one must never stop the monitor
            log.exception("sample failed unexpectedly")
            made, error = None, f"{type(exc).__name__}: {exc}"
        with self._lock:
            if made is not None:
                self._sample = made
            self._error = error
        if error is not None:
            log.warning("no sample this time (trying again in %.0fs): %s", self.every, error)
        return made

    def _attempt(self) -> tuple[StateSample | None, str | None]:
        last, _ = self.latest
        began = time.monotonic()
        vouches, quorum = self.announcements.vouches(), self.cfg.swarm.state_quorum
        offers = [tag for tag, _ in vouches.offers(quorum, None) if tag.round > 0]
        if not offers:
            return None, self._why_none(vouches.peers)
        newest = offers[0].round
        if last is not None and last.tag in offers and last.round == newest:
            return None, None  # the swarm has not moved on since the last sample: nothing new to show
        offer = fetch_vouched(
            self.averager,
            vouches,
            self.shapes,
            self.fingerprint,
            quorum,
            self.cfg.swarm.state_timeout,
            lambda tag: tag.round == newest,  # the furthest round only: samples never go back to a lagging peer's
        )
        if offer is None:
            return None, (
                f"no vouched state of round {newest} could be downloaded within swarm.state_timeout="
                f"{self.cfg.swarm.state_timeout:g}s (the warnings above say why each donor was refused)"
            )
        state, tag = offer.state, offer.tag
        downloaded = time.monotonic() - began
        if not all(is_finite(a) for a in state.anchor):
            return None, f"the vouched state {tag} holds NaN or inf: nothing to sample"
        state.copy_to(self.model.parameters())
        del state, offer  # the model holds the anchor now: drop the downloaded state
        out = generate(self.model, self.tokenizer, self.prompt, self.max_new_tokens, temperature=0.0)
        sample = StateSample(
            time=time.time(),
            round=tag.round,
            checksum=tag.checksum,
            prompt=self.prompt,
            text=out.text,
            seconds=time.monotonic() - began,
            download_seconds=downloaded,
        )
        return sample, None

    def _why_none(self, peers: int) -> str:
        run = self.cfg.swarm.run_id
        if peers:
            return f"no state past round 0 that swarm.state_quorum={self.cfg.swarm.state_quorum} peers vouch for yet"
        others = self.announcements.others()
        if not others:
            return f"no live peer of run {run!r} has announced itself yet"
        peer, theirs = next(iter(others.items()))
        if theirs.get("fingerprint") != self.fingerprint:
            summary = self.announcements.settings_of(peer)
            fields = ([] if summary is None else fingerprint_differences(self.summary, summary))[:3] or ["fingerprint"]
            return (
                f"the {len(others)} peer(s) of run {run!r} run other settings than --config and --set give this "
                f"monitor ({'; '.join(fields)}): give it the peers' config and --set overrides"
            )
        return f"no live peer of run {run!r} with this monitor's settings holds a state"

    # ---------------------------------------------------------------- the thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="monitor-samples", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self.sample_once()
            self.stop.wait(max(0.0, self.every - (time.monotonic() - started)))

    def close(self) -> None:
        """Set ``stop``, wait CLOSE_WAIT seconds for an attempt in flight (then it is left to its daemon thread: a
        download keeps its own deadline), shut the averager down."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT)
        shutdown = getattr(self.averager, "shutdown", None)
        if callable(shutdown):
            shutdown()

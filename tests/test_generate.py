"""p2p_diloco/generate.py and run_generate: the same seed gives the same text, greedy is the argmax at every step, a
checkpoint and its export write the same text, bad input gets a message and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peer_checkpoint import train_peer_checkpoints

from p2p_diloco.export import export_checkpoint
from p2p_diloco.generate import GenerateError, generate, load_generator
from peers.run_generate import main as generate_main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The list type "


@pytest.fixture(scope="module")
def peer_log(tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("peer")
    train_peer_checkpoints(log_dir)
    return log_dir


@pytest.fixture(scope="module")
def loaded(peer_log):
    return load_generator(peer_log)


def test_the_same_seed_gives_the_same_text_and_another_seed_another(loaded):
    model, tok = loaded
    first, again = (generate(model, tok, PROMPT, 40, temperature=1.0, seed=1) for _ in range(2))
    assert first == again and first.prompt == PROMPT
    assert len(first.token_ids) == 40 or first.stopped_at_eos
    assert first.text == tok.decode(first.token_ids)  # bytes of a whole prompt: the continuation decodes alone
    assert generate(model, tok, PROMPT, 40, temperature=1.0, seed=2).text != first.text
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    generate(model, tok, PROMPT, 5, temperature=1.0, seed=1)
    assert torch.equal(torch.rand(1), before), "sampling must not draw from torch's global RNG"


def test_greedy_is_the_argmax_of_the_whole_text_at_every_step(loaded):
    model, tok = loaded
    greedy = generate(model, tok, PROMPT, 30, temperature=0.0, seed=0)
    assert generate(model, tok, PROMPT, 30, temperature=0.0, seed=7) == greedy
    ids = tok.encode(PROMPT)
    with torch.no_grad():  # no cache, the whole text each step: what the cached loop must reproduce
        for _ in range(len(greedy.token_ids)):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(tok.encode(PROMPT)) :] == greedy.token_ids


def test_a_checkpoint_and_its_export_write_the_same_text(peer_log, loaded, tmp_path):
    export_checkpoint(peer_log, tmp_path / "export")
    from_export = load_generator(tmp_path / "export")
    for temperature, seed in ((0.0, 0), (0.8, 3)):
        want = generate(*loaded, PROMPT, 30, temperature, seed)
        assert generate(*from_export, PROMPT, 30, temperature, seed) == want


def test_generation_goes_on_past_the_models_window(loaded):
    model, tok = loaded
    window = model.config.max_position_embeddings  # tiny: 128
    long = "The list type is a mutable sequence. " * 4  # 148 bytes: the prompt alone overflows the window
    sample = generate(model, tok, long, window + 20, temperature=1.0, seed=5)
    assert len(sample.token_ids) == window + 20 or sample.stopped_at_eos
    assert generate(model, tok, long, window + 20, temperature=1.0, seed=5) == sample
    empty = generate(model, tok, "", 10, temperature=1.0, seed=5)  # a new document: the model sees eos first
    assert empty.prompt == "" and (len(empty.token_ids) == 10 or empty.stopped_at_eos)
    assert generate(model, tok, PROMPT, 0).text == ""


def test_bad_generation_arguments_are_refused(loaded):
    model, tok = loaded
    for n, t, says in ((-1, 1.0, "max_new_tokens=-1"), (5, -0.5, "temperature=-0.5"), (5, float("nan"), "nan")):
        with pytest.raises(GenerateError, match=says):
            generate(model, tok, PROMPT, n, temperature=t)


def test_run_generate_refuses_bad_input_with_one_line(peer_log, tmp_path, capsys):
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere")], "does not exist"),
        (["--checkpoint", str(peer_log), "--max-new-tokens", "-3"], "max_new_tokens=-3 is invalid"),
        (["--checkpoint", str(peer_log), "--temperature", "-1"], "temperature=-1.0 is invalid"),
        (["--checkpoint", str(tmp_path)], "holds no checkpoint"),
    ]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")  # a model directory with nothing else in it
    cases.append((["--checkpoint", str(tmp_path / "half")], "holds a model but no tokenizer"))
    for argv, says in cases:
        assert generate_main(argv) == 2, argv
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert captured.out == "" and err[-1].startswith("run_generate: ") and says in err[-1], captured.err
        assert "Traceback" not in captured.err


def test_run_generate_prints_the_text_on_stdout_and_logs_on_stderr(peer_log, loaded):
    argv = ["--checkpoint", str(peer_log), "--prompt", PROMPT, "--max-new-tokens", "20", "--seed", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "peers.run_generate", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    sample = generate(*loaded, PROMPT, 20, temperature=0.8, seed=4)  # the CLI's default temperature
    assert done.stdout == PROMPT + sample.text + "\n"
    assert "loaded round 2" in done.stderr and "new tokens" in done.stderr

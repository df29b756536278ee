"""p2p_diloco/generate.py and run_generate: each token comes from the text the model sees (cache and window), the
same seed gives the same text, a checkpoint and its export write the same text, bad input gets a message and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peer_checkpoint import train_peer_checkpoints
from transformers import LlamaConfig, LlamaForCausalLM

from p2p_diloco.data import ByteTokenizer
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


@pytest.fixture(scope="module")
def sensitive():
    """A random Llama with large weights and a 32-token window: every token it sees moves its logits (a 40-step-trained
    tiny model mostly predicts byte frequencies, so a cache that dropped or repeated a token would go unnoticed)."""
    config = LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        initializer_range=0.2,
        eos_token_id=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval(), ByteTokenizer()


def _reference(model, tok, prompt: str, n: int, temperature: float, seed: int) -> list[int]:
    """No cache: each step reads the text the model is meant to see (the last ``window`` tokens at first; when that
    outgrows the window, the last half window and what follows it), softmax(logits / T) sampled from Generator(seed)."""
    window, gen = model.config.max_position_embeddings, torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt)
    start = max(0, len(ids) - window)
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > window:
                start = len(ids) - window // 2
            logits = model(input_ids=torch.tensor([ids[start:]])).logits[0, -1].double()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            if token == tok.eos_id:
                break
            ids.append(token)
    return ids[len(tok.encode(prompt)) :]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt", ["The list type ", "a prompt longer than the 32-token window of this model"])
def test_each_token_comes_from_the_text_the_model_sees(sensitive, temperature, prompt):
    """The cached loop reproduces reading the visible text again at every step, through several window overflows."""
    model, tok = sensitive
    sample = generate(model, tok, prompt, 80, temperature=temperature, seed=11)
    assert len(sample.token_ids) > 40, "a short sample would not overflow the window"
    assert sample.token_ids == _reference(model, tok, prompt, 80, temperature, 11)
    if temperature == 0:
        assert generate(model, tok, prompt, 80, temperature=0.0, seed=12) == sample  # greedy ignores the seed


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

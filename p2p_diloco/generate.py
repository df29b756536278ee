"""Text from a trained model: the continuation of a prompt, greedy or sampled, the same for the same seed.

Inputs:  ``load_generator(path)``: an export (a transformers model directory with its tokenizer: run_export's
         output, or any causal LM saved with save_pretrained) or anything export.load_anchor_model takes (a peer's
         log dir, one checkpoint, a simulation's --out). ``generate(model, tokenizer, prompt, max_new_tokens,
         temperature, seed)``: temperature 0 is greedy (argmax), above 0 samples from softmax(logits / T).
Output:  Sample: the prompt, the continuation's text and token ids, and whether it stopped at eos (the token that
         ends a document in training; it is not part of the text). An empty prompt starts a new document (the
         model sees eos first).
State:   none kept. Sampling draws from its own torch.Generator seeded with ``seed``, never from torch's global RNG,
         so the same model, prompt, N, T and seed give the same text (on the same device and torch build). The
         model sees at most its max_position_embeddings tokens (training rows start at position 0): when the text
         outgrows that, the cache is dropped and the last half window is read again.
Failure: GenerateError (a ValueError) for max_new_tokens < 0, a negative or non-finite temperature, or a device
         torch does not have. Loading raises
         CheckpointError (no model there, a corrupt checkpoint or export) and DataError (no tokenizer), each naming
         the path and the problem.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from p2p_diloco.checkpoint import CheckpointError
from p2p_diloco.data import DataError, HFTokenizer, Tokenizer
from p2p_diloco.export import load_anchor_model

__all__ = ["GenerateError", "Sample", "check_generation_args", "generate", "load_generator"]

log = logging.getLogger(__name__)


class GenerateError(ValueError):
    """A generation argument is out of range; the message says which and what is allowed."""


@dataclasses.dataclass
class Sample:
    prompt: str
    text: str  # the continuation alone
    token_ids: list[int]  # the continuation's tokens, eos excluded
    stopped_at_eos: bool


def check_generation_args(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"temperature={temperature} is invalid: must be a number >= 0 (0: greedy)")


def _device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise GenerateError(f"device {str(name)!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"device {str(name)!r} asked for, but torch sees no CUDA device: use cpu")
    return device


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file()


def load_generator(path: str | Path, device: str | torch.device = "cpu") -> tuple[PreTrainedModel, Tokenizer]:
    """The model (eval mode, fp32, on ``device``) and tokenizer at ``path``: an export or a checkpoint."""
    device = _device(device)
    path = Path(path)
    if path.is_dir() and _is_export(path):
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise DataError(f"{path} holds a model but no tokenizer (tokenizer.json): export it again with run_export")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as exc:  # missing or damaged weights, unknown architecture
            raise CheckpointError(f"{path} is not a loadable transformers model ({exc})") from None
        tokenizer: Tokenizer = HFTokenizer(str(path))
        log.info("loaded the export %s", path)
    else:
        loaded = load_anchor_model(path)
        model, tokenizer = loaded.model, loaded.tokenizer
        log.info("loaded round %d (%s) from %s", loaded.round, loaded.checksum, loaded.checkpoint)
    return model.to(device).eval(), tokenizer


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    logits = logits.to("cpu", torch.float64)  # sampled on the CPU: the generator and its draws are device-independent
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> Sample:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (fewer when the model writes eos)."""
    check_generation_args(max_new_tokens, temperature)
    window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    # newer transformers call the cache argument and output field `cache`, older ones `past_key_values`
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    context = tokenizer.encode(prompt) or [tokenizer.eos_id]
    new: list[int] = []
    past, cached, stopped = None, 0, False
    for _ in range(max_new_tokens):
        if past is None:  # (re)read the tail of the text: a whole window at first, half of one after an overflow
            feed = context[-(max(1, window // 2) if new else window) :]
            cached = len(feed)
        else:
            feed = context[-1:]
            cached += 1
        ids = torch.tensor([feed], dtype=torch.long, device=device)
        out = model(input_ids=ids, use_cache=True, **{cache_arg: past})
        past = getattr(out, cache_arg)
        token = _next_token(out.logits[0, -1], temperature, gen)
        if token == tokenizer.eos_id:
            stopped = True
            break
        new.append(token)
        context.append(token)
        if cached + 1 > window:
            past = None
    full = tokenizer.decode(tokenizer.encode(prompt) + new)
    head = tokenizer.decode(tokenizer.encode(prompt))
    text = full[len(head) :] if full.startswith(head) else tokenizer.decode(new)
    return Sample(prompt=prompt, text=text, token_ids=new, stopped_at_eos=stopped)

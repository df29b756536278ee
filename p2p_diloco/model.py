"""Build the causal language model from config; pick its device and autocast.

Inputs:  ModelConfig, the tokenizer's vocab size, a seed.
Output:  a transformers ``LlamaForCausalLM`` (random init from the seed, or ``model.pretrained``) on
         the resolved device, fp32 parameters; ``autocast(device, cfg)`` gives the forward context
         (bf16 autocast on CUDA by default, none on CPU).
         Forward contract: input_ids int64 [B, T] -> logits [B, T, V]; loss = mean next-token
         cross-entropy over B x (T - 1) positions, fp32 scalar.
State:   none beyond the returned module.
Failure: ConfigError for a CUDA device on a machine without one, or a pretrained model whose vocab is
         smaller than the tokenizer's. No hub access happens unless ``model.pretrained`` names one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from p2p_diloco.config import ConfigError, ModelConfig

__all__ = ["autocast", "build_model", "count_params", "architecture_fingerprint", "resolve_device"]

# torch's global RNG is one per process: peers built at once in threads of one process (the scale harness) would
# interleave its draws and start from different weights
_SEEDED_INIT = threading.Lock()


def resolve_device(cfg: ModelConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device={cfg.device!r} but torch sees no CUDA device: use --set model.device=cpu "
            "or install a CUDA build of torch"
        )
    return device


def autocast(device: torch.device, cfg: ModelConfig) -> contextlib.AbstractContextManager:
    use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def llama_config(cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=vocab_size - 1,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A fresh model: every process that calls this with the same arguments gets identical weights."""
    device = resolve_device(cfg)
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, torch_dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings < vocab_size:
            raise ConfigError(
                f"model.pretrained={cfg.pretrained!r} has a vocabulary of "
                f"{model.get_input_embeddings().num_embeddings} but the tokenizer needs {vocab_size}: "
                "use the model's own tokenizer (data.tokenizer)"
            )
    else:
        with _SEEDED_INIT, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(llama_config(cfg, vocab_size))
    return model.to(device)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def architecture_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of every parameter's name, shape and dtype: peers that differ must not average."""
    spec = [(name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]

"""A checkpoint's outer state (the anchor) as a model: in memory, or as a transformers model directory.

Inputs:  a path to one checkpoint (DIR/outer_state.safetensors + DIR/outer_state.json, checkpoint.py), a peer's
         log dir (its newest checkpoints/round_NNNNNN), a directory of round_NNNNNN, or a simulation's --out
         (its final_state/). The architecture and the tokenizer come from the config the checkpoint carries (a
         peer's outer_state.json holds it; else run_metadata.json beside the checkpoint or one level up).
Output:  ``load_anchor_model(path)`` -> AnchorModel: the run's model (fp32, CPU, eval mode) holding the anchor, the
         run's tokenizer (data.py), the config (its seed, model and data sections), round and checksum.
         ``export_checkpoint(path, out)`` writes ``out`` (and returns that AnchorModel), a directory that
         ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load offline: config.json,
         generation_config.json, model.safetensors, the tokenizer (the run's transformers one, saved again; for
         ``data.tokenizer=byte`` a tokenizers-backed one with ids 0..255 = the UTF-8 bytes and 256 = eos, see
         ``transformers_byte_tokenizer``) and p2p_diloco_export.json (its checkpoint, round, checksum, peer, config).
State:   none. ``out`` is written as ``out.tmp`` and renamed into place, so a failed export leaves no half directory.
Failure: CheckpointError (one line naming the path and the problem) for no checkpoint at the path, a missing file,
         an unreadable or inconsistent one (checkpoint.py checks the checksum), no config to rebuild the model, a
         seed, model or data section this version cannot read (the other sections are not read, so a checkpoint of
         another version exports as long as those agree), tensors whose number or shapes do not fit the config's
         model, or a non-finite anchor. DataError when the run's tokenizer cannot be loaded here (offline: a hub
         name that is not in the local cache). ExportError when ``out`` is taken by something that is not an
         earlier export, or is the checkpoint itself. Nothing is downloaded unless the config names a hub model or
         tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from p2p_diloco.checkpoint import META, TENSORS, CheckpointError, latest_checkpoint, load_outer_state
from p2p_diloco.config import Config, ConfigError, config_from_dict
from p2p_diloco.data import ByteTokenizer, DataError, Tokenizer, build_tokenizer
from p2p_diloco.model import build_model

__all__ = [
    "EXPORT_META",
    "AnchorModel",
    "ExportError",
    "export_checkpoint",
    "load_anchor_model",
    "resolve_checkpoint",
    "transformers_byte_tokenizer",
]

log = logging.getLogger(__name__)

EXPORT_META = "p2p_diloco_export.json"
_NEEDED = ("seed", "model", "data")  # the config sections an export reads
_WHERE = "a peer's --log-dir, one of its checkpoints/round_NNNNNN directories or a simulation's --out"


class ExportError(ValueError):
    """The export cannot be written where it was asked to go."""


@dataclasses.dataclass
class AnchorModel:
    model: PreTrainedModel  # fp32, CPU, eval mode, parameters = the checkpoint's anchor
    tokenizer: Tokenizer  # the run's own (data.build_tokenizer)
    config: Config  # the run's seed, model and data sections (the others: defaults)
    checkpoint: Path
    round: int
    checksum: str
    meta: dict[str, Any]  # outer_state.json as written


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, its newest round, or a simulation's final_state."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give {_WHERE}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a directory: give {_WHERE}")
    if (path / TENSORS).exists() or (path / META).exists():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            for newer in sorted(p for p in root.glob("round_*") if p.is_dir() and p.name > found.name):
                if not newer.name.endswith((".tmp", ".old")):
                    log.warning("skipping %s: it has no %s (an incomplete checkpoint)", newer, META)
            return found
    if (path / "final_state").is_dir():
        return path / "final_state"
    raise CheckpointError(
        f"{path} holds no checkpoint (no {TENSORS} + {META}, no round_NNNNNN directory in it or in checkpoints/, "
        f"no final_state/): give {_WHERE}"
    )


def _run_config(ckpt: Path, meta: dict[str, Any]) -> Config:
    tree, source = meta.get("config"), ckpt / META
    if tree is None:  # a simulation's final_state: the config is in the run's run_metadata.json
        for candidate in (ckpt.parent / "run_metadata.json", ckpt.parent.parent / "run_metadata.json"):
            if candidate.is_file():
                try:
                    tree, source = json.loads(candidate.read_text()).get("config"), candidate
                except (OSError, ValueError) as exc:
                    raise CheckpointError(f"{candidate} is unreadable ({exc})") from None
                break
    if not isinstance(tree, dict):
        raise CheckpointError(
            f"checkpoint {ckpt} carries no config (no 'config' in {META}, no run_metadata.json beside it or one "
            "level up): the model's architecture and tokenizer are unknown"
        )
    # Only what builds the model and the tokenizer: the other sections change between versions and do not matter here
    needed = {key: tree[key] for key in _NEEDED if key in tree}
    try:
        return config_from_dict(needed)
    except ConfigError as exc:
        raise CheckpointError(f"the config in {source} does not load with this version of p2p_diloco: {exc}") from None


def _architecture(cfg: Config, vocab_size: int) -> PreTrainedModel:
    """The model the run trained, on the CPU (fp32); its initial weights are overwritten by the anchor."""
    if cfg.model.pretrained:  # only its config is needed: the weights come from the checkpoint
        try:
            config = AutoConfig.from_pretrained(cfg.model.pretrained)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"the run started from model.pretrained={cfg.model.pretrained!r}, whose config cannot be loaded "
                f"here ({exc}): make that model available at that path or in the local cache"
            ) from None
        return AutoModelForCausalLM.from_config(config).float()
    return build_model(dataclasses.replace(cfg.model, device="cpu"), vocab_size, cfg.seed)


def _check_fits(ckpt: Path, anchor: list[torch.Tensor], model: PreTrainedModel, cfg: Config, vocab: int) -> None:
    m = cfg.model
    described = (
        f"model.pretrained={m.pretrained!r}"
        if m.pretrained
        else f"hidden_size={m.hidden_size}, num_layers={m.num_layers}, num_heads={m.num_heads}, "
        f"num_kv_heads={m.num_kv_heads}, intermediate_size={m.intermediate_size}, vocab {vocab}"
    )
    params = list(model.named_parameters())
    if len(params) != len(anchor):
        raise CheckpointError(
            f"checkpoint {ckpt} holds {len(anchor)} anchor tensors but the model its config describes "
            f"({described}) has {len(params)}: the checkpoint and its config do not belong together"
        )
    for k, ((name, p), a) in enumerate(zip(params, anchor, strict=True)):
        if p.shape != a.shape:
            raise CheckpointError(
                f"checkpoint {ckpt}: anchor.{k} has shape {list(a.shape)} but {name} of the model its config "
                f"describes ({described}) has {list(p.shape)}: the checkpoint and its config do not belong together"
            )
        if not torch.isfinite(a).all():
            raise CheckpointError(f"checkpoint {ckpt}: anchor.{k} ({name}) holds NaN or inf: export an earlier round")


def load_anchor_model(path: str | Path) -> AnchorModel:
    """The run's model holding the anchor of the checkpoint ``path`` names (see resolve_checkpoint)."""
    ckpt = resolve_checkpoint(path)
    try:
        state, meta = load_outer_state(ckpt)
    except CheckpointError as exc:
        others = sorted(p.name for p in ckpt.parent.glob("round_*") if p.is_dir() and p != ckpt and "." not in p.name)
        if not ckpt.name.startswith("round_") or not others:
            raise
        raise CheckpointError(f"{exc}; or give one of the other checkpoints beside it: {', '.join(others)}") from None
    cfg = _run_config(ckpt, meta)
    tokenizer = build_tokenizer(cfg.data)
    model = _architecture(cfg, tokenizer.vocab_size)
    _check_fits(ckpt, state.anchor, model, cfg, tokenizer.vocab_size)
    state.copy_to(model.parameters())
    model.config.eos_token_id = tokenizer.eos_id  # documents were separated by it; llama_config guesses vocab - 1
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_id
        model.generation_config.pad_token_id = tokenizer.eos_id
    model.eval()
    return AnchorModel(model, tokenizer, cfg, ckpt, state.round, state.checksum(), meta)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters: what the tokenizers ByteLevel pre-tokenizer emits."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def transformers_byte_tokenizer(model_max_length: int) -> PreTrainedTokenizerBase:
    """data.ByteTokenizer as a transformers tokenizer: encode gives the UTF-8 bytes (no merges, nothing added), id
    256 is eos ("<eos>"; the text "<eos>" in a prompt stays bytes), decode(skip_special_tokens=True) turns invalid
    UTF-8 into U+FFFD as ByteTokenizer.decode does."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _byte_to_char().items()}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=rust,
        eos_token="<eos>",
        split_special_tokens=True,  # like ByteTokenizer: no text encodes to eos
        clean_up_tokenization_spaces=False,  # else decode would turn " ." into "."
        model_max_length=model_max_length,
    )
    assert len(tok) == ByteTokenizer.vocab_size and tok.eos_token_id == ByteTokenizer.eos_id
    return tok


def _save_tokenizer(cfg: Config, directory: Path) -> None:
    if cfg.data.tokenizer == "byte":
        transformers_byte_tokenizer(cfg.model.max_seq_len).save_pretrained(directory)
        return
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(cfg.data.tokenizer).save_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise DataError(f"could not load the run's tokenizer {cfg.data.tokenizer!r} to save it ({exc})") from None


def _check_out(out: Path, ckpt: Path, overwrite: bool) -> None:
    here, there = out.resolve(), ckpt.resolve()
    if here == there or here in there.parents:
        raise ExportError(f"--out {out} would replace the checkpoint {ckpt}: pick a directory outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out} is a file: pick a new directory")
    if not any(out.iterdir()):
        return
    if not (out / EXPORT_META).is_file():
        raise ExportError(f"--out {out} exists and is not an export (no {EXPORT_META}): pick a new directory")
    if not overwrite:
        raise ExportError(f"--out {out} already holds an export: pick a new directory or pass --overwrite")


def export_checkpoint(path: str | Path, out: str | Path, overwrite: bool = False) -> AnchorModel:
    """Write the anchor of the checkpoint ``path`` names to ``out`` as a transformers model; returns what it wrote."""
    loaded = load_anchor_model(path)
    _check_out(Path(out), loaded.checkpoint, overwrite)
    out = Path(out).absolute()  # "." has no name to put ".tmp" after
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    loaded.model.save_pretrained(tmp)
    _save_tokenizer(loaded.config, tmp)
    provenance = {
        "checkpoint": str(loaded.checkpoint.resolve()),
        "round": loaded.round,
        "checksum": loaded.checksum,
        "peer_id": loaded.meta.get("peer_id"),
        "fingerprint": loaded.meta.get("fingerprint"),
        "tokenizer": loaded.config.data.tokenizer,
        "config": {key: value for key, value in loaded.config.to_dict().items() if key in _NEEDED},
    }
    (tmp / EXPORT_META).write_text(json.dumps(provenance, indent=2, default=str))
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    log.info("exported round %d (%s) of %s to %s", loaded.round, loaded.checksum, loaded.checkpoint, out)
    return loaded

"""What must match between the peers of one run: the swarm fingerprint, and the fields where two differ.

Inputs:  the resolved Config, the built model and the DataPipeline built from ``cfg.data`` and ``cfg.seed``
         (its documents and tokenizer are read, nothing is loaded again); for :func:`fingerprint_differences`
         our summary and the summary another peer announced (from the network: anything at all).
Output:  :func:`swarm_fingerprint` -> (12 hex digits, summary). The summary is a flat ``{dotted field: JSON
         scalar}`` dict (the shape peers announce in the DHT next to the digest); the digest is the sha256 of
         its sorted JSON, so two peers have the same digest iff every field is equal. Fields, in order:
           protocol                      PROTOCOL_VERSION
           model.architecture            every parameter's name, shape and dtype (model.architecture_fingerprint)
           model.hidden_size, .num_layers, .num_heads, .num_kv_heads, .intermediate_size, .rope_theta,
           .tie_embeddings               the built architecture (heads and rope change the function, not the
                                         shapes); with ``model.pretrained`` instead: model.pretrained (its hub
                                         name, or "local"), model.config_digest (the loaded model's config)
                                         and model.weights_digest (its weights: a warm start is identified by
                                         what it holds, not where it lies)
           tokenizer.name, .vocab_size, .vocab_digest
                                         "byte" or the hub name, or "local" for a tokenizer directory on this
                                         machine; the digest covers the sorted vocabulary and the eos id
           data.source                   offline | files | hub
           data.max_documents, data.corpus_digest
                                         offline and files: the documents themselves (DataPipeline.corpus_digest)
           data.path, .hub_config, .hub_split, .text_field, .label_field, .max_documents
                                         hub: the dataset's identity and what is read from it
           data.num_shards, .partition, data.dirichlet_alpha (only with partition=dirichlet, the only method that
           reads it), data.eval_fraction, data.seq_len
           seed, inner.steps, inner.round_seconds, outer.lr, outer.momentum, outer.nesterov, outer.lr_warmup_rounds
           swarm.aggregation, swarm.aggregation_clip, swarm.min_cosine, swarm.max_skew
                                         how the reducers bound each sender (robust.py)
           swarm.compression, swarm.part_size_bytes    the wire codec and the parts it encodes (codec.py)
           swarm.fragments                             which tensors each round exchanges (fragments.py)
           swarm.target_group_size                     how a round splits into groups (protocol.split_groups)
           swarm.max_staleness, swarm.staleness_decay  whose delayed Δ counts, and with what weight (protocol.py)
         :func:`fingerprint_differences` -> one line per differing field, ``"field: theirs X, ours Y"``.
State:   none; both functions are pure (no network, no hivemind).
Failure: swarm_fingerprint raises ValueError when ``data`` was not built from ``cfg.data``;
         fingerprint_differences never raises: a ``theirs`` that is not a dict counts as an empty summary, odd
         keys and values are shown by a shortened repr, values compare by their canonical JSON (so 1 vs 1.0
         differ exactly as the digests do, and NaN equals NaN).

Machine-local paths are never part of the fingerprint. Two volunteers who hold the same corpus at different
places (``data.path=/home/a/corpus`` and ``data.path=D:/data/corpus``) must be able to train together, so for
local data (``files``, and the built-in ``offline`` corpus, which depends on the Python version) the identity
is the digest of the loaded documents (labels and texts, in order; with ``files`` the label is the file's stem,
so the copies must keep the file names). For a hub dataset the documents are not digested: its name, config,
split and fields are its identity (a hub dataset that names an existing local path counts as local data). The
same holds for the tokenizer and a pretrained model given as a local directory: recorded as "local", their
identity is the vocabulary digest and the architecture/config digest. Settings that only shape one peer's own
work are left out on purpose: which shard it trains (data.shard_index), batch size, eval batches, inner
optimizer settings, device and autocast, CPU threads (train.threads), run length, checkpointing, logging,
swarm.error_feedback and swarm.feedback_decay (what one peer adds to its own Δ) and every swarm timing. The eval
split is decided per document by a hash of (seed, text), so peers that agree on the seed and eval_fraction can
never train on each other's eval documents. The vocabulary digest does not cover BPE merges or normalisation rules
(their serialisation differs between ``tokenizers`` versions); two tokenizers with the same name and vocabulary are
taken to be the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from p2p_diloco import PROTOCOL_VERSION
from p2p_diloco.config import Config
from p2p_diloco.data import ByteTokenizer, DataPipeline
from p2p_diloco.model import architecture_fingerprint

__all__ = ["fingerprint_differences", "swarm_fingerprint", "vocab_digest"]

_MISSING = object()
_SHOWN_CHARS = 80  # a value from the network is shown at most this long
_MAX_EXTRA_LINES = 20  # fields only the other peer has, listed before the rest are counted


def _sha(value: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _name_or_local(name: str | None) -> str | None:
    """``name`` unless it is a path that exists on this machine: then "local" (its content is the identity)."""
    if name and Path(name).expanduser().exists():
        return "local"
    return name


def vocab_digest(tokenizer: Any) -> str:
    """16 hex digits over the tokenizer's sorted vocabulary (token -> id, added tokens included) and eos id."""
    if isinstance(tokenizer, ByteTokenizer):
        return _sha(["utf-8 bytes 0..255", "eos", tokenizer.eos_id, tokenizer.vocab_size])
    inner = getattr(tokenizer, "_tok", tokenizer)  # HFTokenizer keeps the transformers tokenizer there
    get_vocab = getattr(inner, "get_vocab", None)
    vocab = sorted((str(tok), int(i)) for tok, i in get_vocab().items()) if callable(get_vocab) else None
    return _sha([type(inner).__name__ if vocab is None else "vocab", vocab, tokenizer.eos_id, tokenizer.vocab_size])


def _weights_digest(model: torch.nn.Module) -> str:
    """16 hex digits over every parameter's fp32 values, in order: peers that start from different weights (two
    warm starts, two revisions of one hub model) must not count as one run."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _model_fields(cfg: Config, model: torch.nn.Module) -> dict[str, Any]:
    m = cfg.model
    fields: dict[str, Any] = {"model.architecture": architecture_fingerprint(model)}
    if m.pretrained:
        config = getattr(model, "config", None)
        to_dict = getattr(config, "to_dict", None)
        spec = to_dict() if callable(to_dict) else {}
        for where in ("_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype"):
            spec.pop(where, None)  # where and with what it was loaded, not what it is
        fields.update({
            "model.pretrained": _name_or_local(m.pretrained),
            "model.config_digest": _sha(spec),
            "model.weights_digest": _weights_digest(model),
        })  # fmt: skip
    else:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            fields[f"model.{name}"] = getattr(m, name)
        fields.update({"model.rope_theta": m.rope_theta, "model.tie_embeddings": m.tie_embeddings})
    return fields


def _data_fields(cfg: Config, data: DataPipeline) -> dict[str, Any]:
    d = cfg.data
    fields: dict[str, Any] = {"data.source": d.source}
    if d.source == "hub" and _name_or_local(d.path) != "local":
        for name in ("path", "hub_config", "hub_split", "text_field", "label_field", "max_documents"):
            fields[f"data.{name}"] = getattr(d, name)
    else:  # offline, files, or a hub loader pointed at a local directory: the documents are the identity
        fields.update({"data.max_documents": d.max_documents, "data.corpus_digest": data.corpus_digest})
    fields.update({"data.num_shards": d.num_shards, "data.partition": d.partition})
    if d.partition == "dirichlet":
        fields["data.dirichlet_alpha"] = d.dirichlet_alpha
    fields.update({"data.eval_fraction": d.eval_fraction, "data.seq_len": d.seq_len})
    return fields


def swarm_fingerprint(cfg: Config, model: torch.nn.Module, data: DataPipeline) -> tuple[str, dict[str, Any]]:
    """(12 hex digits, summary) of everything two peers must share to average together; see the module doc."""
    built_alike = dataclasses.replace(data.cfg, shard_index=cfg.data.shard_index) == cfg.data  # it holds every shard
    if not built_alike or data.seed != cfg.seed:
        raise ValueError("swarm_fingerprint needs the DataPipeline built from cfg.data and cfg.seed")
    tok = data.tokenizer
    summary: dict[str, Any] = {"protocol": PROTOCOL_VERSION, **_model_fields(cfg, model)}
    summary.update(
        {
            "tokenizer.name": "byte" if cfg.data.tokenizer == "byte" else _name_or_local(cfg.data.tokenizer),
            "tokenizer.vocab_size": data.vocab_size,
            "tokenizer.vocab_digest": vocab_digest(tok),
        }
    )
    summary.update(_data_fields(cfg, data))
    summary.update(
        {
            "seed": cfg.seed,
            "inner.steps": cfg.inner.steps,
            "inner.round_seconds": cfg.inner.round_seconds,
            "outer.lr": cfg.outer.lr,
            "outer.momentum": cfg.outer.momentum,
            "outer.nesterov": cfg.outer.nesterov,
            "outer.lr_warmup_rounds": cfg.outer.lr_warmup_rounds,
            "swarm.aggregation": cfg.swarm.aggregation,
            "swarm.aggregation_clip": cfg.swarm.aggregation_clip,
            "swarm.min_cosine": cfg.swarm.min_cosine,
            "swarm.max_skew": cfg.swarm.max_skew,
            "swarm.compression": cfg.swarm.compression,
            "swarm.fragments": cfg.swarm.fragments,
            "swarm.part_size_bytes": cfg.swarm.part_size_bytes,
            "swarm.target_group_size": cfg.swarm.target_group_size,
            "swarm.max_staleness": cfg.swarm.max_staleness,
            "swarm.staleness_decay": cfg.swarm.staleness_decay,
        }
    )
    return _sha(summary, 12), summary


def _canonical(value: Any) -> str:
    """The JSON the digest would see (NaN as "NaN", so it equals itself); a repr for what JSON cannot hold."""
    try:
        return json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return f"<{type(value).__name__}> {_shown(value)}"


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(missing)"
    try:
        text = repr(value)
    except Exception:  # a value with a broken __repr__ still gets a line
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def fingerprint_differences(ours: dict[str, Any], theirs: Any) -> list[str]:
    """``"field: theirs X, ours Y"`` for every field whose values differ or that only one side has.

    Our fields come first, in our order, then the fields only ``theirs`` has (the first 20, then one line that
    counts the rest). ``theirs`` comes from the network: a non-dict counts as {} (every field missing there).
    """
    theirs = theirs if isinstance(theirs, dict) else {}
    lines = []
    for key, value in ours.items():
        other = theirs.get(key, _MISSING)
        if other is _MISSING or _canonical(other) != _canonical(value):
            lines.append(f"{key}: theirs {_shown(other)}, ours {_shown(value)}")
    extra = [k for k in theirs if not (isinstance(k, str) and k in ours)]
    for key in extra[:_MAX_EXTRA_LINES]:
        name = key if isinstance(key, str) and len(key) <= _SHOWN_CHARS else _shown(key)
        lines.append(f"{name}: theirs {_shown(theirs[key])}, ours (missing)")
    if len(extra) > _MAX_EXTRA_LINES:
        lines.append(f"(and {len(extra) - _MAX_EXTRA_LINES} more fields only theirs has)")
    return lines

"""Documents -> eval split -> shards -> packed token batches, deterministic from (DataConfig, seed).

Inputs:  a :class:`DataConfig` and the run seed (``cfg.seed``; every peer must use the same one, since the
         eval split and the shards are derived from it).
Sources: ``offline`` - Python's own English prose, no network: the language reference
         (``pydoc_data.topics``) and stdlib docstrings, grouped into 7 labels (language-reference,
         text-and-data, networking, os-and-files, concurrency, dev-tools, other). The corpus depends on the
         Python version, so peers compare :attr:`DataPipeline.corpus_digest` (as ``data.corpus_digest`` in
         the swarm fingerprint, p2p_diloco/fingerprint.py). ``max_documents`` keeps an evenly spaced subset.
         ``files`` - a file, directory (recursive) or glob of .txt/.jsonl/.json/.parquet read through
         ``datasets`` (streaming); .json/.jsonl/.parquet: one document per record, text from ``text_field``,
         label from ``label_field`` when set, else the file's stem; .txt: one document per blank-line
         separated block, labelled with the file's stem. ``max_documents`` keeps the first N (sorted files).
         ``hub`` - ``datasets.load_dataset(path, hub_config, split=hub_split, streaming=True)``, first
         ``max_documents`` (required) records; label from ``label_field``, else the dataset's name.
Contracts at each arrow:
  load_documents      cfg -> list[Document(text: non-empty str, label: str)], in a fixed order
  split_eval          docs -> (train, eval); a document is in eval iff sha256(seed, text) < eval_fraction,
                      so identical texts always land on the same side and eval is never trained on
  partition           train docs -> list[list[int]] of num_shards sorted index lists: disjoint, covering,
                      none empty
  train_batches       shard -> endless torch.int64 [B, T] (B=batch_size, T=seq_len), values in
                      [0, vocab_size); each document's tokens followed by eos, documents in a per-epoch
                      permutation from (seed, shard, epoch), one continuous stream cut into rows
  eval_sets           -> {label: int64 [N, T], "all": int64 [M, T]}, N, M <= eval_batches * batch_size;
                      labels whose eval text is shorter than one row are left out ("all" interleaves
                      the labels' rows; a label that is itself named "all" is only seen there)
State:   a DataPipeline caches per-document token ids and the eval sets; a batch iterator holds its
         position in its shard (epoch, permutation, leftover tokens). Nothing else is mutable.
Failure: :class:`DataError` (a ValueError) naming the problem and the fix: path not found, unknown file type,
         missing text/label field, hub without max_documents, hub unreachable, too few documents or labels
         for num_shards, an empty eval or train split, a shard shorter than one row, unloadable tokenizer.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from itertools import count
from typing import Protocol

import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.sources import DataError, Document, load_documents

__all__ = [
    "DataError",
    "DataPipeline",
    "Document",
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "corpus_digest",
    "label_histograms",
    "load_documents",
    "partition",
    "shard_for_peer",
    "split_eval",
]


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus eos = 256."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer behind the ByteTokenizer interface (no special tokens added by encode)."""

    def __init__(self, name_or_path: str) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:
            raise DataError(
                f"could not load tokenizer {name_or_path!r} ({exc}); use data.tokenizer=byte or "
                "a local directory holding a saved tokenizer"
            ) from None
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eos is None:
            raise DataError(f"tokenizer {name_or_path!r} has no eos (or sep) token to separate documents")
        tok.model_max_length = 1 << 60  # documents are packed into rows, so long texts are fine
        self._tok, self.vocab_size, self.eos_id = tok, len(tok), int(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def _hash_int(*parts: object) -> int:
    """A stable 64-bit integer from ``parts`` (unlike ``hash()``, the same in every process)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def corpus_digest(docs: Iterable[Document]) -> str:
    """16 hex digits over every document's label and text, in order: equal iff the corpora are (~2 ms for the
    1.6 MB offline corpus). Length-prefixed, so no text can imitate a document boundary."""
    h = hashlib.sha256()
    for doc in docs:
        label, text = (s.encode("utf-8", "surrogatepass") for s in (doc.label, doc.text))
        h.update(b"%d:%b%d:%b" % (len(label), label, len(text), text))
    return h.hexdigest()[:16]


def split_eval(docs: list[Document], eval_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """(train, eval): each document decided alone by a sha256 of (seed, text), order kept."""
    train, held = [], []
    for doc in docs:
        (held if _hash_int("eval", seed, doc.text) < eval_fraction * 2**64 else train).append(doc)
    return train, held


def partition(docs: list[Document], num_shards: int, method: str, alpha: float, seed: int) -> list[list[int]]:
    """Document indices per shard: disjoint, covering all docs, none empty, each list sorted."""
    n = len(docs)
    if n < num_shards:
        raise DataError(
            f"too few documents for the shards: {n} training documents cannot fill {num_shards} "
            "shards (each shard would need one); lower data.num_shards or add documents"
        )
    by_label: dict[str, list[int]] = defaultdict(list)
    for i, doc in enumerate(docs):
        by_label[doc.label].append(i)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    rng = random.Random(_hash_int(method, seed))  # Python's random: the same draws in every environment
    if method == "iid":
        perm = list(range(n))
        rng.shuffle(perm)
        for pos, i in enumerate(perm):
            shards[pos % num_shards].append(i)
    elif method == "dirichlet":
        for label in sorted(by_label):
            idx = list(by_label[label])
            rng.shuffle(idx)
            gam = [rng.gammavariate(alpha, 1.0) for _ in range(num_shards)]  # normalized: Dirichlet(alpha)
            if sum(gam) == 0:  # every draw underflowed (tiny alpha): the whole label goes to one shard
                gam[rng.randrange(num_shards)] = 1.0
            cum = [round(sum(gam[: k + 1]) / sum(gam) * len(idx)) for k in range(num_shards)]
            for k in range(num_shards):
                shards[k] += idx[(cum[k - 1] if k else 0) : cum[k]]
        while any(not s for s in shards):  # a doc from the biggest shard fills each empty one
            biggest = max(range(num_shards), key=lambda k: len(shards[k]))
            shards[next(k for k in range(num_shards) if not shards[k])].append(shards[biggest].pop())
    elif method == "by-label":
        if len(by_label) < num_shards:
            raise DataError(
                f"partition=by-label needs at least one label per shard: {len(by_label)} labels "
                f"({', '.join(sorted(by_label))}) for {num_shards} shards; lower data.num_shards "
                "or use partition=dirichlet"
            )
        for label in sorted(by_label, key=lambda lab: (-len(by_label[lab]), lab)):  # greedy, biggest first
            shards[min(range(num_shards), key=lambda k: (len(shards[k]), k))] += by_label[label]
    else:
        raise DataError(f"data.partition={method!r} is unknown: use iid, dirichlet or by-label")
    return [sorted(s) for s in shards]


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    """A stable shard index in [0, num_shards) from the sha256 of the peer id."""
    return int.from_bytes(hashlib.sha256(peer_id.encode("utf-8")).digest()[:8], "big") % num_shards


def label_histograms(docs: list[Document], shards: list[list[int]]) -> dict[str, dict[str, int]]:
    """{"shard k": {label: document count}} with labels sorted."""
    return {f"shard {k}": dict(sorted(Counter(docs[i].label for i in s).items())) for k, s in enumerate(shards)}


class DataPipeline:
    """Built once per process from a DataConfig + seed; deterministic.

    Attributes: ``tokenizer``, ``vocab_size``, ``train_docs`` and ``eval_docs`` (the split of the loaded
    documents), ``shards`` (indices into ``train_docs``), ``corpus_digest`` (16 hex digits over the loaded
    documents alone, see :func:`corpus_digest`; the swarm fingerprint carries it, so peers of one run hold the
    same corpus) and ``fingerprint`` (16 hex digits over the documents, the seed, the split and the shards:
    equal on peers whose whole data layout is equal; for tests and diagnostics).
    """

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        docs = load_documents(cfg)
        self.train_docs, self.eval_docs = split_eval(docs, cfg.eval_fraction, seed)
        if not self.train_docs or not self.eval_docs:
            raise DataError(
                f"the eval split left {len(self.train_docs)} training and {len(self.eval_docs)} "
                f"eval documents of {len(docs)} (data.eval_fraction={cfg.eval_fraction}): add "
                "documents or change data.eval_fraction"
            )
        self.shards = partition(self.train_docs, cfg.num_shards, cfg.partition, cfg.dirichlet_alpha, seed)
        self.tokenizer: Tokenizer = build_tokenizer(cfg)
        self.vocab_size: int = self.tokenizer.vocab_size
        self.corpus_digest: str = corpus_digest(docs)
        layout = (self.corpus_digest, seed, [len(d) for d in (self.train_docs, self.eval_docs)], self.shards)
        self.fingerprint = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]  # same docs, split and shards
        self._tokens: dict[int, torch.Tensor] = {}
        self._eval: dict[str, torch.Tensor] | None = None

    def _doc_tokens(self, doc: Document) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(doc.text) + [self.tokenizer.eos_id], dtype=torch.int32)

    def _train_tokens(self, i: int) -> torch.Tensor:
        if i not in self._tokens:
            self._tokens[i] = self._doc_tokens(self.train_docs[i])
        return self._tokens[i]

    def train_batches(self, shard_index: int, seed: int) -> Iterator[torch.Tensor]:
        """Endless int64 [B, T] batches from one shard; the same (shard, seed) gives the same batches."""
        if not 0 <= shard_index < len(self.shards):
            raise DataError(f"shard index {shard_index} is out of range: there are {len(self.shards)} shards")
        shard = self.shards[shard_index]
        docs = [self._train_tokens(i) for i in shard]
        total, rows = sum(len(t) for t in docs), self.cfg.seq_len
        if total < rows:
            raise DataError(
                f"shard {shard_index} holds {total} tokens in {len(shard)} documents, fewer than "
                f"one row of data.seq_len={rows}: lower data.seq_len or data.num_shards, or add "
                "documents"
            )
        return self._batches(docs, shard_index, seed)

    def _batches(self, docs: list[torch.Tensor], shard_index: int, seed: int) -> Iterator[torch.Tensor]:
        need = self.cfg.batch_size * self.cfg.seq_len
        pending: list[torch.Tensor] = []
        buffered = 0
        for epoch in count():
            gen = torch.Generator().manual_seed(_hash_int("train", seed, shard_index, epoch) >> 1)
            for j in torch.randperm(len(docs), generator=gen).tolist():
                pending.append(docs[j])
                buffered += len(docs[j])
                if buffered >= need:  # .to(int64) copies: batches never alias the cached tokens
                    stream = torch.cat(pending)
                    full = len(stream) // need
                    for b in range(full):
                        yield stream[b * need : (b + 1) * need].view(self.cfg.batch_size, -1).to(torch.int64)
                    pending, buffered = [stream[full * need :]], len(stream) - full * need

    def _rows(self, docs: Iterable[Document], cap: int) -> torch.Tensor:
        """Up to ``cap`` int64 rows [n, T] from ``docs`` joined with eos; tokenizes only what it needs."""
        parts: list[torch.Tensor] = []
        total, want = 0, cap * self.cfg.seq_len
        for doc in docs:
            if total >= want:
                break
            parts.append(self._doc_tokens(doc))
            total += len(parts[-1])
        n = min(cap, total // self.cfg.seq_len)
        stream = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
        return stream[: n * self.cfg.seq_len].view(n, self.cfg.seq_len).to(torch.int64)

    def eval_sets(self) -> dict[str, torch.Tensor]:
        """{label: int64 [N, T], "all": int64 [M, T]} from the eval split; cached, do not modify."""
        if self._eval is None:
            cap = self.cfg.eval_batches * self.cfg.batch_size
            by_label: dict[str, list[Document]] = defaultdict(list)
            for doc in self.eval_docs:
                by_label[doc.label].append(doc)
            sets = {lab: self._rows(by_label[lab], cap) for lab in sorted(by_label)}
            sets = {lab: rows for lab, rows in sets.items() if len(rows)}
            if not sets:
                raise DataError(
                    f"no eval label has {self.cfg.seq_len} tokens ({len(self.eval_docs)} eval "
                    "documents): raise data.eval_fraction or lower data.seq_len"
                )
            mixed = [rows[r] for r in range(cap) for rows in sets.values() if r < len(rows)][:cap]
            self._eval = {**sets, "all": torch.stack(mixed)}
        return self._eval

    def histograms(self) -> dict[str, dict[str, int]]:
        """Per-shard label histograms of the training documents, for run metadata."""
        return label_histograms(self.train_docs, self.shards)

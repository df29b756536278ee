"""Data pipeline invariants: shards disjoint and covering, eval never trained on, determinism, shapes, errors."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from itertools import islice

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from p2p_diloco import data as data_mod
from p2p_diloco.config import DataConfig
from p2p_diloco.data import (
    ByteTokenizer,
    DataError,
    DataPipeline,
    Document,
    build_tokenizer,
    label_histograms,
    load_documents,
    partition,
    shard_for_peer,
    split_eval,
)

METHODS = ("iid", "dirichlet", "by-label")


def synthetic(labels: int = 8, per_label: int = 60) -> list[Document]:
    return [Document(f"label {lab} document {i} " * 20, f"L{lab}") for lab in range(labels) for i in range(per_label)]


def offline(**kw: object) -> DataConfig:
    return dataclasses.replace(DataConfig(seq_len=64, batch_size=4, eval_batches=2), **kw)


@pytest.fixture(scope="module")
def pipe() -> DataPipeline:
    return DataPipeline(offline(), seed=0)


def check_disjoint_covering(shards: list[list[int]], n: int) -> None:
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == n and set(flat) == set(range(n))
    assert all(shards)


# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trips() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld → ☃\nline two"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # eos is dropped on decode


def test_hf_tokenizer_from_local_dir(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + sorted({w for d in synthetic(2, 3) for w in d.text.split()})
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    tok = build_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    assert (tok.vocab_size, tok.eos_id) == (len(words), 1)
    ids = tok.encode("label 0 document 1")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids) and 0 not in ids
    assert tok.decode(ids).split() == ["label", "0", "document", "1"]
    with pytest.raises(DataError, match="tokenizer"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))


# ---------------------------------------------------------------- offline corpus


def test_offline_corpus_is_real_labelled_and_capped(pipe: DataPipeline) -> None:
    docs = load_documents(DataConfig())
    labels = Counter(d.label for d in docs)
    assert len(docs) >= 300 and 4 <= len(labels) <= 8 and "language-reference" in labels
    assert min(labels.values()) >= 20 and all(d.text.strip() == d.text and d.text for d in docs)
    assert sum(len(d.text) for d in docs) > 500_000
    capped = load_documents(DataConfig(max_documents=50))
    assert len(capped) == 50 and capped == load_documents(DataConfig(max_documents=50))
    assert len({d.label for d in capped}) >= 4  # an evenly spaced subset, not the first 50
    assert pipe.fingerprint == DataPipeline(offline(), seed=0).fingerprint


# ---------------------------------------------------------------- partitions


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_partition_disjoint_and_covering(method: str, num_shards: int) -> None:
    docs = synthetic()
    shards = partition(docs, num_shards, method, alpha=0.3, seed=1)
    assert len(shards) == num_shards
    check_disjoint_covering(shards, len(docs))
    assert shards == partition(docs, num_shards, method, alpha=0.3, seed=1)


def test_iid_sizes_near_equal_and_seeded() -> None:
    docs = synthetic()
    shards = partition(docs, 7, "iid", 0.5, seed=0)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards != partition(docs, 7, "iid", 0.5, seed=1)


def mean_tv(docs: list[Document], shards: list[list[int]]) -> float:
    labels = sorted({d.label for d in docs})
    glob = Counter(d.label for d in docs)
    tv = []
    for shard in shards:
        local = Counter(docs[i].label for i in shard)
        tv.append(0.5 * sum(abs(local[lab] / len(shard) - glob[lab] / len(docs)) for lab in labels))
    return sum(tv) / len(tv)


def test_dirichlet_smaller_alpha_more_skew() -> None:
    docs = synthetic(labels=8, per_label=100)
    skew = {a: sum(mean_tv(docs, partition(docs, 4, "dirichlet", a, s)) for s in range(5)) / 5 for a in (0.1, 100)}
    assert skew[0.1] > 0.4 > 0.1 > skew[100]
    for seed in range(20):  # tiny alpha piles a label on one shard; no shard may end empty
        check_disjoint_covering(partition(docs[:40], 8, "dirichlet", 0.01, seed), 40)


def test_by_label_shards_have_exclusive_labels() -> None:
    docs = synthetic(labels=7)
    shards = partition(docs, 3, "by-label", 0.5, seed=0)
    label_sets = [{docs[i].label for i in s} for s in shards]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not label_sets[a] & label_sets[b]
    with pytest.raises(DataError, match=r"7 labels .* for 8 shards"):
        partition(docs, 8, "by-label", 0.5, seed=0)


@pytest.mark.parametrize("method", METHODS)
def test_too_many_shards_names_counts(method: str) -> None:
    with pytest.raises(DataError, match=r"5 training documents cannot fill 9 shards"):
        partition(synthetic(1, 5), 9, method, 0.5, seed=0)


def test_pipeline_too_many_shards() -> None:
    with pytest.raises(DataError, match=r"training documents cannot fill 500 shards"):
        DataPipeline(offline(max_documents=300, num_shards=500), seed=0)


def test_histograms(pipe: DataPipeline) -> None:
    hist = pipe.histograms()
    assert list(hist) == [f"shard {k}" for k in range(4)]
    assert sum(sum(h.values()) for h in hist.values()) == len(pipe.train_docs)
    assert label_histograms(pipe.train_docs, pipe.shards) == hist


# ---------------------------------------------------------------- eval split


def test_eval_split_disjoint_and_fraction(pipe: DataPipeline) -> None:
    n = len(pipe.train_docs) + len(pipe.eval_docs)
    assert 0.06 < len(pipe.eval_docs) / n < 0.14
    eval_texts = {d.text for d in pipe.eval_docs}
    for shard in pipe.shards:
        assert not eval_texts & {pipe.train_docs[i].text for i in shard}
    check_disjoint_covering(pipe.shards, len(pipe.train_docs))


def test_eval_split_is_per_document() -> None:
    docs = synthetic()
    train, held = split_eval(docs, 0.2, seed=3)
    train2, held2 = split_eval(docs[::-1] + [Document("new text", "x")], 0.2, seed=3)
    assert set(held) == set(held2) - {Document("new text", "x")} and set(train) <= set(train2)
    assert split_eval(docs, 0.2, seed=4)[1] != held


def test_eval_sets(pipe: DataPipeline) -> None:
    sets = pipe.eval_sets()
    cap = pipe.cfg.eval_batches * pipe.cfg.batch_size
    assert "all" in sets and len(sets) >= 4
    for rows in sets.values():
        assert rows.dtype == torch.int64 and rows.shape[1] == pipe.cfg.seq_len and 1 <= rows.shape[0] <= cap
        assert int(rows.max()) < pipe.vocab_size
    assert len(sets["all"]) == cap
    other = DataPipeline(offline(), seed=0).eval_sets()
    assert all(torch.equal(sets[k], other[k]) for k in sets) and sets.keys() == other.keys()


# ---------------------------------------------------------------- batches


def test_batches_shape_dtype_range(pipe: DataPipeline) -> None:
    for batch in islice(pipe.train_batches(2, seed=0), 3):
        assert batch.dtype == torch.int64 and batch.shape == (4, 64)
        assert 0 <= int(batch.min()) and int(batch.max()) < pipe.vocab_size


def test_batches_come_from_their_shard_and_span_epochs(tmp_path) -> None:
    with open(tmp_path / "tags.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"<{i:03d}>" * 4}) + "\n")
    cfg = DataConfig(source="files", path=str(tmp_path), seq_len=16, batch_size=8, num_shards=2, eval_fraction=0.2)
    p = DataPipeline(cfg, seed=0)
    tags = [{int(d.text[1:4]) for d in docs} for docs in ([p.train_docs[i] for i in s] for s in p.shards)]
    held = {int(d.text[1:4]) for d in p.eval_docs}
    assert held and not held & (tags[0] | tags[1]) and not tags[0] & tags[1]
    tokens = torch.cat(list(islice(p.train_batches(1, seed=5), 20))).flatten().tolist()  # > 2 epochs
    assert {int(t) for t in re.findall(r"<(\d{3})>", ByteTokenizer().decode(tokens))} == tags[1]
    eos = tokens.count(ByteTokenizer.eos_id)
    assert eos == pytest.approx(len(tokens) / 21, abs=2)  # every 20-byte document is followed by eos


def test_same_seed_same_batches_different_seed_different(pipe: DataPipeline) -> None:
    again = DataPipeline(offline(), seed=0)
    assert again.shards == pipe.shards
    first = list(islice(pipe.train_batches(1, seed=7), 3))
    assert all(torch.equal(a, b) for a, b in zip(first, islice(again.train_batches(1, seed=7), 3), strict=True))
    assert not torch.equal(first[0], next(pipe.train_batches(1, seed=8)))
    assert again.fingerprint == pipe.fingerprint
    other = DataPipeline(offline(), seed=1)
    assert other.shards != pipe.shards and other.fingerprint != pipe.fingerprint
    assert not torch.equal(first[0], next(other.train_batches(1, seed=7)))


def test_shard_shorter_than_one_row() -> None:
    p = DataPipeline(offline(max_documents=300, seq_len=10**7), seed=0)
    with pytest.raises(DataError, match=r"fewer than one row of data.seq_len=10000000"):
        p.train_batches(0, seed=0)
    with pytest.raises(DataError, match="out of range"):
        p.train_batches(4, seed=0)


def test_shard_for_peer_stable_and_in_range() -> None:
    assert shard_for_peer("QmPeerA", 8) == shard_for_peer("QmPeerA", 8)
    picks = [shard_for_peer(f"peer-{i}", 5) for i in range(200)]
    assert all(0 <= k < 5 for k in picks) and len(set(picks)) == 5
    assert shard_for_peer("x", 1) == 0


# ---------------------------------------------------------------- files and hub sources


def write_sources(root) -> None:
    (root / "poems.txt").write_text("first block\nstill first\n\n\nsecond block\n\nthird block\n")
    with open(root / "news.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"body": f"news item {i}", "topic": "sport" if i % 2 else "econ"}) + "\n")
    pq.write_table(pa.table({"body": [f"row {i}" for i in range(4)], "topic": ["pq"] * 4}), root / "rows.parquet")


def test_files_source_txt_jsonl_parquet(tmp_path) -> None:
    write_sources(tmp_path)
    (tmp_path / "README.md").write_text("ignored in a directory")
    txt = load_documents(DataConfig(source="files", path=str(tmp_path / "poems.txt")))
    assert txt == [
        Document("first block\nstill first", "poems"),
        Document("second block", "poems"),
        Document("third block", "poems"),
    ]
    jsonl = load_documents(DataConfig(source="files", path=str(tmp_path / "*.jsonl"), text_field="body"))
    assert [d.text for d in jsonl] == [f"news item {i}" for i in range(5)] and {d.label for d in jsonl} == {"news"}
    both = load_documents(
        DataConfig(source="files", path=str(tmp_path / "*.[jp]*"), text_field="body", label_field="topic")
    )  # .jsonl and .parquet
    assert Counter(d.label for d in both) == {"econ": 3, "sport": 2, "pq": 4}
    capped = load_documents(DataConfig(source="files", path=str(tmp_path), text_field="body", max_documents=7))
    assert Counter(d.label for d in capped) == {"news": 5, "poems": 2}  # sorted files, .txt ignores text_field


def test_files_source_errors(tmp_path) -> None:
    write_sources(tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match=r"no field 'text' in file .*news.jsonl.*body, topic.*data.text_field"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "news.jsonl")))
    with pytest.raises(DataError, match="no field 'lang'"):
        load_documents(
            DataConfig(source="files", path=str(tmp_path / "rows.parquet"), text_field="body", label_field="lang")
        )
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=r"unknown file type '.csv'"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "table.csv")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "empty")))


def test_hub_source_through_local_stand_in(tmp_path) -> None:
    hub = tmp_path / "tiny_corpus"
    (hub / "data").mkdir(parents=True)
    for part in range(2):
        texts = [f"hub record {part}-{i} " * 30 for i in range(50)]
        pq.write_table(pa.table({"text": texts, "src": [f"s{part}"] * 50}), hub / "data" / f"train-{part}.parquet")
    cfg = DataConfig(source="hub", path=str(hub), max_documents=60, num_shards=3, seq_len=32, batch_size=2)
    docs = load_documents(cfg)
    assert len(docs) == 60 and {d.label for d in docs} == {"tiny_corpus"}
    assert {d.label for d in load_documents(dataclasses.replace(cfg, label_field="src"))} == {"s0", "s1"}
    p = DataPipeline(cfg, seed=0)
    assert next(p.train_batches(2, seed=0)).shape == (2, 32)
    with pytest.raises(DataError, match="data.max_documents"):
        load_documents(dataclasses.replace(cfg, max_documents=None))


def test_hub_unreachable_says_so(monkeypatch) -> None:
    import datasets

    def offline_hub(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline_hub)
    with pytest.raises(DataError, match=r"could not reach the Hugging Face hub.*data.source=offline"):
        load_documents(DataConfig(source="hub", path="allenai/c4", hub_config="en", max_documents=10))
    assert data_mod.DataError is DataError and issubclass(DataError, ValueError)

"""The swarm fingerprint: it changes with every setting peers must share and with nothing else; the differences
between two summaries are listed field by field, whatever the other side sent; a swarm refuses a newcomer
whose data settings differ and names the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.data import DataPipeline, Document, corpus_digest
from p2p_diloco.fingerprint import fingerprint_differences, swarm_fingerprint, vocab_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
MODEL = torch.nn.Linear(2, 2)  # architecture_fingerprint only reads names, shapes and dtypes


def fingerprint(*overrides: str, model: torch.nn.Module = MODEL) -> tuple[str, dict]:
    cfg = load_config(TINY, list(overrides))
    return swarm_fingerprint(cfg, model, DataPipeline(cfg.data, cfg.seed))


def write_corpus(where: Path, changed: int | None = None) -> Path:
    """A directory of two .txt files, 40 blank-line separated documents each; ``changed``: one edited document."""
    where.mkdir(parents=True)
    for name in ("alpha", "beta"):
        docs = [
            f"{name} document {i}: " + f"the {i}th paragraph of {name}, with some words in it. " * 4 for i in range(40)
        ]
        if changed is not None and name == "beta":
            docs[changed] += " One more sentence."
        (where / f"{name}.txt").write_text("\n\n".join(docs) + "\n")
    return where


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("corpora")
    a = write_corpus(base / "a")
    copy = base / "elsewhere" / "deeper" / "copy"
    shutil.copytree(a, copy)
    return {"a": a, "copy": copy, "edited": write_corpus(base / "edited", changed=7)}


def files(path: Path, *more: str) -> list[str]:
    return ["data.source=files", f"data.path={path}", "data.num_shards=2", *more]


# ------------------------------------------------------------------ what is in it
def test_summary_is_flat_json_with_dotted_fields_and_the_digest_is_12_hex() -> None:
    digest, summary = fingerprint()
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert json.loads(json.dumps(summary)) == summary
    assert all(isinstance(v, str | int | float | bool | type(None)) for v in summary.values())
    for key in (
        "protocol",
        "model.architecture",
        "model.hidden_size",
        "tokenizer.name",
        "tokenizer.vocab_size",
        "tokenizer.vocab_digest",
        "data.source",
        "data.corpus_digest",
        "data.num_shards",
        "data.partition",
        "data.eval_fraction",
        "data.seq_len",
        "seed",
        "inner.steps",
        "outer.lr",
        "outer.momentum",
        "outer.nesterov",
        "outer.lr_warmup_rounds",
    ):
        assert key in summary, key
    assert fingerprint() == (digest, summary)  # deterministic


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["data.eval_fraction=0.2"], "data.eval_fraction"),
        (["data.num_shards=3"], "data.num_shards"),
        (["data.partition=dirichlet"], "data.partition"),
        (["data.seq_len=32"], "data.seq_len"),
        (["data.max_documents=600"], "data.corpus_digest"),
        (["inner.steps=10"], "inner.steps"),
        (["outer.lr=0.5"], "outer.lr"),
        (["outer.momentum=0.8"], "outer.momentum"),
        (["outer.nesterov=false"], "outer.nesterov"),
        (["outer.lr_warmup_rounds=0"], "outer.lr_warmup_rounds"),
        (["seed=1"], "seed"),
        (["model.hidden_size=64"], "model.hidden_size"),
        (["model.num_heads=8", "model.num_kv_heads=8"], "model.num_heads"),  # same shapes, another function
        (["model.rope_theta=500000"], "model.rope_theta"),
    ],
)
def test_the_digest_changes_with_each_setting_that_must_match(overrides: list[str], field: str) -> None:
    base, ours = fingerprint()
    other, theirs = fingerprint(*overrides)
    assert other != base
    assert any(line.startswith(f"{field}: ") for line in fingerprint_differences(ours, theirs))


def test_dirichlet_alpha_counts_only_when_the_partition_reads_it() -> None:
    d1, s1 = fingerprint("data.partition=dirichlet", "data.dirichlet_alpha=0.5")
    d2, s2 = fingerprint("data.partition=dirichlet", "data.dirichlet_alpha=0.3")
    assert d1 != d2 and fingerprint_differences(s1, s2) == ["data.dirichlet_alpha: theirs 0.3, ours 0.5"]
    assert fingerprint("data.dirichlet_alpha=0.3")[0] == fingerprint()[0]  # partition=iid ignores it


def test_the_model_architecture_is_part_of_it() -> None:
    (ours_d, ours), (theirs_d, theirs) = fingerprint(), fingerprint(model=torch.nn.Linear(2, 3))
    assert ours_d != theirs_d
    assert [line.split(":")[0] for line in fingerprint_differences(ours, theirs)] == ["model.architecture"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.shard_index=1"],
        ["swarm.matchmaking_time=7"],
        ["swarm.max_round_peers=20", "swarm.min_group_size=3", "swarm.start_peers=3"],
        ["logging.log_every=1", "logging.progress_bar=false"],
        ["logging.tensorboard=true", "logging.wandb_project=p2p", "logging.wandb_mode=online"],
        ["model.device=cpu", "model.autocast=none"],
        ["model.max_seq_len=256"],
        ["data.batch_size=4", "data.eval_batches=1"],
        ["inner.lr=0.01", "inner.warmup_steps=0", "inner.grad_accum=2"],
        ["train.rounds=3", "train.eval_every=0", "train.checkpoint_every=0"],
        ["train.threads=1"],
    ],
)
def test_the_digest_ignores_what_each_peer_may_choose_alone(overrides: list[str]) -> None:
    assert fingerprint(*overrides) == fingerprint()


# ------------------------------------------------------------------ local data: the content is the identity
def test_local_files_at_another_path_with_the_same_contents_match(corpora: dict[str, Path]) -> None:
    here, there = fingerprint(*files(corpora["a"])), fingerprint(*files(corpora["copy"]))
    assert here == there
    assert "data.path" not in here[1] and here[1]["data.source"] == "files"


def test_local_files_with_one_document_changed_differ(corpora: dict[str, Path]) -> None:
    (ours_d, ours), (theirs_d, theirs) = fingerprint(*files(corpora["a"])), fingerprint(*files(corpora["edited"]))
    assert ours_d != theirs_d
    assert [line.split(":")[0] for line in fingerprint_differences(ours, theirs)] == ["data.corpus_digest"]


def test_local_files_and_the_offline_corpus_differ(corpora: dict[str, Path]) -> None:
    (ours_d, ours), (theirs_d, theirs) = fingerprint(*files(corpora["a"])), fingerprint("data.num_shards=2")
    assert ours_d != theirs_d
    fields = [line.split(":")[0] for line in fingerprint_differences(ours, theirs)]
    assert fields == ["data.source", "data.corpus_digest"]


def test_the_corpus_digest_is_order_and_boundary_sensitive_and_cheap() -> None:
    docs = [Document("one two", "a"), Document("three", "a")]
    assert corpus_digest(docs) != corpus_digest(docs[::-1])
    assert corpus_digest(docs) != corpus_digest([Document("one", "a"), Document("two three", "a")])
    assert corpus_digest(docs) != corpus_digest([Document("one two", "b"), Document("three", "a")])
    assert corpus_digest(docs) == corpus_digest(list(docs))
    assert corpus_digest([Document("lone \ud800 surrogate", "x")])  # text decoded from JSON may hold one


def test_a_hub_source_is_identified_by_its_name_config_split_and_fields() -> None:
    cfg = load_config(TINY, ["data.num_shards=2"])
    data = DataPipeline(cfg.data, cfg.seed)  # the documents are offline ones; only the identity fields matter
    hub = load_config(TINY, ["data.num_shards=2", "data.source=hub", "data.path=org/corpus", "data.max_documents=9"])
    data.cfg = hub.data
    _, summary = swarm_fingerprint(hub, MODEL, data)
    assert {k: v for k, v in summary.items() if k.startswith("data.")} == {
        "data.source": "hub",
        "data.path": "org/corpus",
        "data.hub_config": None,
        "data.hub_split": "train",
        "data.text_field": "text",
        "data.label_field": None,
        "data.max_documents": 9,
        "data.num_shards": 2,
        "data.partition": "iid",
        "data.eval_fraction": 0.1,
        "data.seq_len": 64,
    }


def test_a_pipeline_built_from_other_settings_is_refused() -> None:
    cfg = load_config(TINY)
    other = load_config(TINY, ["data.eval_fraction=0.2"])
    with pytest.raises(ValueError, match="cfg.data"):
        swarm_fingerprint(other, MODEL, DataPipeline(cfg.data, cfg.seed))


def test_one_pipeline_serves_peers_that_train_different_shards() -> None:
    """A pipeline holds every shard, so peers in one process (the scale harness) share it whatever shard each takes."""
    cfg = load_config(TINY, ["data.num_shards=4"])
    data = DataPipeline(cfg.data, cfg.seed)
    fingerprints = {swarm_fingerprint(load_config(TINY, ["data.num_shards=4", f"data.shard_index={k}"]), MODEL, data)[0]
                    for k in range(4)}  # fmt: skip
    assert fingerprints == {swarm_fingerprint(cfg, MODEL, data)[0]}


# ------------------------------------------------------------------ the tokenizer's vocabulary
def save_tokenizer(where: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "</s>", *words]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(where)
    return where


def test_a_pretrained_model_is_identified_by_its_weights_wherever_it_lies(tmp_path: Path) -> None:
    from p2p_diloco.model import build_model

    base = build_model(load_config(TINY).model, 257, seed=0)
    base.save_pretrained(tmp_path / "a")
    base.save_pretrained(tmp_path / "elsewhere" / "a")
    with torch.no_grad():
        base.lm_head.weight[0, 0] += 1e-3  # one more warm-start step would do as much
    base.save_pretrained(tmp_path / "b")
    prints = {}
    for name in ("a", "elsewhere/a", "b"):
        cfg = load_config(TINY, [f"model.pretrained={tmp_path / name}"])
        prints[name] = swarm_fingerprint(cfg, build_model(cfg.model, 257, cfg.seed), DataPipeline(cfg.data, cfg.seed))
    assert prints["a"] == prints["elsewhere/a"] and prints["a"][1]["model.pretrained"] == "local"
    assert prints["a"][0] != prints["b"][0]
    differences = fingerprint_differences(prints["a"][1], prints["b"][1])
    assert [d.split(":")[0] for d in differences] == ["model.weights_digest"]


def test_a_local_tokenizer_is_identified_by_its_vocabulary(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(50)]
    a, b = save_tokenizer(tmp_path / "a", words), save_tokenizer(tmp_path / "x" / "b", words)
    other = save_tokenizer(tmp_path / "other", [*words[:-1], "changed"])  # same size, one token differs
    here, there, elsewhere = (fingerprint(f"data.tokenizer={p}") for p in (a, b, other))
    assert here == there and here[1]["tokenizer.name"] == "local"
    assert [line.split(":")[0] for line in fingerprint_differences(here[1], elsewhere[1])] == ["tokenizer.vocab_digest"]
    assert fingerprint()[1]["tokenizer.vocab_digest"] != here[1]["tokenizer.vocab_digest"]
    assert vocab_digest(DataPipeline(load_config(TINY).data, 0).tokenizer) == fingerprint()[1]["tokenizer.vocab_digest"]


# ------------------------------------------------------------------ fingerprint_differences
def test_differences_list_exactly_the_differing_fields() -> None:
    _, ours = fingerprint()
    theirs = {**ours, "data.eval_fraction": 0.2, "inner.steps": 10, "new.field": "x"}
    del theirs["seed"]
    assert fingerprint_differences(ours, theirs) == [
        "data.eval_fraction: theirs 0.2, ours 0.1",
        "seed: theirs (missing), ours 0",
        "inner.steps: theirs 10, ours 25",
        "new.field: theirs 'x', ours (missing)",
    ]
    assert fingerprint_differences(ours, dict(ours)) == []


def test_differences_compare_as_the_digest_does() -> None:
    assert fingerprint_differences({"a": 1.0}, {"a": 1}) == ["a: theirs 1, ours 1.0"]
    assert fingerprint_differences({"a": True}, {"a": 1}) == ["a: theirs 1, ours True"]
    assert fingerprint_differences({"a": float("nan")}, {"a": float("nan")}) == []


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize(
    "theirs",
    [
        None,
        "a string",
        7,
        [1, 2, 3],
        b"bytes",
        {1: 2, None: 3, (1, 2): [4]},
        {"protocol": object(), "seed": {"nested": {1: 2}}, "inner.steps": [1, {2: 3}]},
        {"protocol": Unprintable(), "x" * 10_000: "y" * 10_000},
        {f"k{i}": i for i in range(1000)},
    ],
)
def test_differences_survive_whatever_the_network_sent(theirs: object) -> None:
    _, ours = fingerprint()
    lines = fingerprint_differences(ours, theirs)
    assert all(isinstance(line, str) and len(line) < 300 for line in lines)
    assert len(lines) <= len(ours) + 21
    if not isinstance(theirs, dict):
        assert lines == [f"{k}: theirs (missing), ours {v!r}" for k, v in ours.items()]


def test_a_recursive_value_from_the_network_does_not_raise() -> None:
    loop: list = []
    loop.append(loop)
    assert fingerprint_differences({"a": 1}, {"a": loop}) == ["a: theirs [[...]], ours 1"]


# ------------------------------------------------------------------ the swarm refuses a newcomer with other data
@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_newcomer_with_other_data_settings_is_refused_naming_the_field(spawn, tmp_path: Path) -> None:
    from test_swarm import start_peer  # pytest puts tests/ on sys.path; imported here to keep unit tests light

    first = start_peer(spawn, [], tmp_path / "first", "train.rounds=200")
    line = first.wait_for_line(r"reachable as: --initial-peers ", timeout=90).string
    initial = line.split("--initial-peers ")[1].split()
    first.wait_for_line(r"^joined at round", timeout=90)  # its fingerprint is announced by then
    cases = [("data.eval_fraction=0.2", "data.eval_fraction"), ("data.num_shards=3", "data.num_shards")]
    newcomers = [start_peer(spawn, initial, tmp_path / f"newcomer{n}", o) for n, (o, _) in enumerate(cases)]
    for newcomer, (override, field) in zip(newcomers, cases):  # both at once: they are refused independently
        rc = newcomer.wait(timeout=90)
        print(f"newcomer with {override}: rc {rc}, stderr:\n{newcomer.stderr}")
        assert rc == 2, newcomer.describe()
        assert field in newcomer.stderr and "differ" in newcomer.stderr, newcomer.stderr
        assert "Traceback" not in newcomer.stderr
    assert first.popen.poll() is None, first.describe()  # the swarm's peer is unaffected

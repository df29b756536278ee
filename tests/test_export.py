"""p2p_diloco/export.py and run_export: the anchor as a transformers model, loaded offline with the peer's logits;
the byte tokenizer as a transformers tokenizer; refusals of partial or corrupt checkpoints with one line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peer_checkpoint import TINY, train_peer_checkpoints
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.checkpoint import latest_checkpoint, load_outer_state, save_outer_state
from p2p_diloco.config import load_config
from p2p_diloco.data import ByteTokenizer, DataPipeline, HFTokenizer
from p2p_diloco.export import EXPORT_META, export_checkpoint, load_anchor_model
from p2p_diloco.model import build_model
from p2p_diloco.outer import OuterState
from p2p_diloco.simulate import simulate
from p2p_diloco.sources import load_documents
from peers.run_export import main as export_main

pytestmark = pytest.mark.timeout(120)

TIGHT = {"rtol": 0.0, "atol": 1e-5}  # fp32 on the CPU, the same kernels: the logits have been bitwise equal here


@pytest.fixture(scope="module")
def peer_log(tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("peer")
    train_peer_checkpoints(log_dir)
    return log_dir


def _peer_model(ckpt: Path, overrides: list[str], vocab: int) -> torch.nn.Module:
    """What a peer holds after loading this checkpoint: model.py's model with the anchor copied in."""
    cfg = load_config(TINY, ["model.device=cpu", *overrides])
    model = build_model(cfg.model, vocab, cfg.seed)
    state, _ = load_outer_state(ckpt)
    state.copy_to(model.parameters())
    return model.eval()


def _eval_rows(overrides: list[str] = ()) -> torch.Tensor:
    cfg = load_config(TINY, ["data.eval_batches=1", *overrides])
    return DataPipeline(cfg.data, cfg.seed).eval_sets()["all"][:4]


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_peers_logits(tmp_path, tied):
    sets = [f"model.tie_embeddings={str(tied).lower()}"]
    train_peer_checkpoints(tmp_path / "peer", sets)
    assert export_main(["--checkpoint", str(tmp_path / "peer"), "--out", str(tmp_path / "export")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ckpt = latest_checkpoint(tmp_path / "peer" / "checkpoints")
    peer = _peer_model(ckpt, sets, vocab=257)
    fresh = build_model(load_config(TINY, ["model.device=cpu", *sets]).model, 257, seed=0)
    assert not all(torch.equal(a, b) for a, b in zip(peer.parameters(), fresh.parameters())), "trained: not the init"
    assert exported.config.tie_word_embeddings is tied
    rows = _eval_rows()
    with torch.no_grad():
        got, want = exported(input_ids=rows).logits, peer(input_ids=rows).logits
    diff = (got - want).abs().max().item()
    print(f"logits max abs difference (tied={tied}): {diff:.3g}")
    assert got.shape == (4, rows.shape[1], 257) and torch.allclose(got, want, **TIGHT), diff
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    anchor = load_outer_state(ckpt)[0].anchor
    assert torch.equal(weights["model.embed_tokens.weight"], anchor[0])
    assert len(weights) == len(anchor)  # a tied lm_head is not stored twice
    meta = json.loads((tmp_path / "export" / EXPORT_META).read_text())
    assert meta["round"] == 2 and meta["checkpoint"] == str(ckpt.resolve()) and meta["peer_id"] == "QmTestPeer"


def test_byte_tokenizer_export_encodes_and_decodes_the_same_bytes(peer_log, tmp_path):
    export_checkpoint(peer_log, tmp_path / "export")
    tok, byte = AutoTokenizer.from_pretrained(tmp_path / "export"), ByteTokenizer()
    assert len(tok) == 257 and tok.eos_token_id == 256
    texts = ["The list type.", "héllo wörld 🙂 日本語", " a , b . c  \n\t\x00", "x<eos>y", "don't", ""]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == byte.encode(text) == list(text.encode("utf-8")), text
        assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids) == text
    broken = [104, 0xC3, 0xFF, 0xE6, 0x97, 105, 256, 0xF0, 0x9F]  # cut and invalid UTF-8 sequences, eos
    assert tok.decode(broken, skip_special_tokens=True) == byte.decode(broken)
    assert bytes(i for i in broken if i < 256).decode("utf-8", "replace") == byte.decode(broken)  # README's snippet


def _local_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE trained here on the offline corpus: a transformers tokenizer with no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    docs = load_documents(load_config(TINY).data)[:200]
    rust.train_from_iterator([d.text for d in docs], trainer)
    PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="</s>").save_pretrained(directory)
    return directory


def test_a_run_with_a_transformers_tokenizer_exports_that_tokenizer(tmp_path):
    sets = [f"data.tokenizer={_local_tokenizer(tmp_path / 'tok')}"]
    train_peer_checkpoints(tmp_path / "peer", sets, rounds=1)
    export_checkpoint(tmp_path / "peer", tmp_path / "export")
    run_tok, exported_tok = HFTokenizer(str(tmp_path / "tok")), HFTokenizer(str(tmp_path / "export"))
    text = "The list type holds items; dict.get(key) returns None."
    assert exported_tok.encode(text) == run_tok.encode(text) and exported_tok.eos_id == run_tok.eos_id
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert exported.config.eos_token_id == run_tok.eos_id
    peer = _peer_model(latest_checkpoint(tmp_path / "peer" / "checkpoints"), sets, run_tok.vocab_size)
    rows = torch.tensor([run_tok.encode(text)])
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=rows).logits, peer(input_ids=rows).logits, **TIGHT)


def test_a_run_from_a_pretrained_model_exports_its_architecture(tmp_path):
    base = build_model(load_config(TINY, ["model.device=cpu", "model.num_layers=2"]).model, 257, seed=3)
    base.save_pretrained(tmp_path / "base")
    sets = [f"model.pretrained={tmp_path / 'base'}", "model.num_layers=9"]  # pretrained overrides the fields
    train_peer_checkpoints(tmp_path / "peer", sets, rounds=1)
    loaded = export_checkpoint(tmp_path / "peer", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert exported.config.num_hidden_layers == 2
    rows = _eval_rows()
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=rows).logits, loaded.model(input_ids=rows).logits, **TIGHT)
    assert not torch.equal(exported.model.embed_tokens.weight, base.model.embed_tokens.weight)  # trained since


def test_export_takes_a_log_dir_one_round_or_a_simulation(peer_log, tmp_path):
    rounds = lambda out: json.loads((out / EXPORT_META).read_text())["round"]  # noqa: E731
    assert export_main(["--checkpoint", str(peer_log), "--out", str(tmp_path / "latest")]) == 0
    assert rounds(tmp_path / "latest") == 2
    one = peer_log / "checkpoints" / "round_000001"
    assert export_main(["--checkpoint", str(one), "--out", str(tmp_path / "first")]) == 0
    assert rounds(tmp_path / "first") == 1
    assert export_main(["--checkpoint", str(peer_log / "checkpoints"), "--out", str(tmp_path / "dir")]) == 0
    assert rounds(tmp_path / "dir") == 2
    cfg = load_config(TINY, ["train.rounds=1", "inner.steps=2", "data.eval_batches=1", "train.eval_every=0"])
    simulate(cfg, "diloco", 2, tmp_path / "sim")  # final_state carries no config: run_metadata.json beside it does
    loaded = export_checkpoint(tmp_path / "sim", tmp_path / "from_sim")
    assert loaded.checkpoint == tmp_path / "sim" / "final_state" and rounds(tmp_path / "from_sim") == 1


def _refused(capsys, checkpoint: Path, out: Path, *extra: str) -> str:
    rc = export_main(["--checkpoint", str(checkpoint), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("run_export: ") and "Traceback" not in err, err
    return err


def _break(ckpt: Path, how: str) -> None:
    tensors, meta = ckpt / "outer_state.safetensors", ckpt / "outer_state.json"
    if how == "no safetensors":
        tensors.unlink()
    elif how == "no json":
        meta.unlink()
    elif how == "not safetensors":
        tensors.write_bytes(b"this is not a safetensors file")
    elif how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    elif how == "a tensor changed":
        data = load_file(str(tensors))
        data["anchor.3"][0, 0] += 1.0
        save_file(data, str(tensors))
    elif how.startswith("config "):  # the json edited: a config the tensors do not fit
        tree = json.loads(meta.read_text())
        key, value = how.removeprefix("config ").split("=")
        tree["config"]["model"][key] = int(value)
        meta.write_text(json.dumps(tree))
    elif how.startswith("unknown "):  # a key of another version of p2p_diloco
        tree = json.loads(meta.read_text())
        section, key = how.removeprefix("unknown ").split(".")
        tree["config"][section][key] = 1
        meta.write_text(json.dumps(tree))
    elif how == "no config":
        tree = json.loads(meta.read_text())
        del tree["config"]
        meta.write_text(json.dumps(tree))


@pytest.mark.parametrize(
    "how, says",
    [
        ("no safetensors", "is not a complete checkpoint (needs outer_state.safetensors"),
        ("no json", "is not a complete checkpoint (needs outer_state.safetensors and outer_state.json)"),
        ("not safetensors", "is unreadable"),
        ("truncated", "is unreadable"),
        ("a tensor changed", "fails its checksum"),
        ("config hidden_size=64", "anchor.0 has shape [257, 128] but model.embed_tokens.weight"),
        ("config num_layers=2", "holds 30 anchor tensors but the model its config describes"),
        ("no config", "carries no config"),
        ("unknown model.attention_sinks", "unknown key model.attention_sinks"),  # it could change the architecture
    ],
)
def test_export_refuses_a_partial_or_corrupt_checkpoint(peer_log, tmp_path, capsys, how, says):
    log_dir = tmp_path / "peer"
    shutil.copytree(peer_log, log_dir)
    latest = log_dir / "checkpoints" / "round_000002"
    _break(latest, how)
    err = _refused(capsys, latest, tmp_path / "out")
    assert says in err and str(latest) in err, err
    assert not (tmp_path / "out").exists()
    if how in ("not safetensors", "truncated"):  # from the log dir: the latest is refused, the others are named
        assert "round_000001" in _refused(capsys, log_dir, tmp_path / "out")


def test_a_checkpoint_of_another_version_exports_when_its_model_and_data_agree(peer_log, tmp_path):
    shutil.copytree(peer_log, tmp_path / "peer")
    _break(tmp_path / "peer" / "checkpoints" / "round_000002", "unknown swarm.some_newer_option")
    assert export_checkpoint(tmp_path / "peer", tmp_path / "export").round == 2


def test_export_refuses_a_non_finite_anchor_and_places_that_hold_no_checkpoint(peer_log, tmp_path, capsys):
    state, meta = load_outer_state(latest_checkpoint(peer_log / "checkpoints"))
    anchor = [a.clone() for a in state.anchor]
    anchor[5][0] = float("nan")
    save_outer_state(tmp_path / "nan", OuterState(anchor, state.momentum, state.round), meta)
    err = _refused(capsys, tmp_path / "nan", tmp_path / "out")
    assert "anchor.5" in err and "NaN" in err
    assert "does not exist" in _refused(capsys, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint" in _refused(capsys, tmp_path / "empty", tmp_path / "out")
    (tmp_path / "file").write_text("x")
    assert "is a file" in _refused(capsys, tmp_path / "file", tmp_path / "out")


def test_export_writes_only_a_new_directory_or_over_an_earlier_export(peer_log, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert "is not an export" in _refused(capsys, peer_log, tmp_path / "taken", "--overwrite")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert "would replace the checkpoint" in _refused(capsys, peer_log, peer_log / "checkpoints")
    assert export_main(["--checkpoint", str(peer_log), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    assert "already holds an export" in _refused(capsys, peer_log, tmp_path / "export")
    one = str(peer_log / "checkpoints" / "round_000001")
    assert export_main(["--checkpoint", one, "--out", str(tmp_path / "export"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "export" / EXPORT_META).read_text())["round"] == 1
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())


def test_load_anchor_model_holds_the_anchor(peer_log):
    loaded = load_anchor_model(peer_log)
    state, _ = load_outer_state(latest_checkpoint(peer_log / "checkpoints"))
    assert loaded.round == state.round == 2 and loaded.checksum == state.checksum()
    assert all(torch.equal(p, a) for p, a in zip(loaded.model.parameters(), state.anchor, strict=True))
    assert not loaded.model.training and next(loaded.model.parameters()).device.type == "cpu"

"""Config loading, overrides, validation messages and run metadata."""

import json
from pathlib import Path

import pytest

from p2p_diloco.config import ConfigError, load_config, write_run_metadata

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["tiny.yaml", "small.yaml", "150m.yaml"])
def test_presets_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.inner.steps >= 1 and cfg.outer.lr > 0


def test_overrides_apply_in_order_and_parse_yaml_values():
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        ["inner.steps=7", "outer.lr=1", "inner.betas=[0.8, 0.99]", "seed=3", "inner.steps=9", "data.shard_index=1"],
    )
    assert cfg.inner.steps == 9
    assert cfg.outer.lr == 1.0 and isinstance(cfg.outer.lr, float)
    assert cfg.inner.betas == [0.8, 0.99]
    assert cfg.seed == 3 and cfg.data.shard_index == 1


@pytest.mark.parametrize(
    ("override", "field", "hint"),
    [
        ("inner.stpes=3", "inner.stpes", "allowed keys"),
        ("bogus.x=1", "bogus", "allowed keys"),
        ("inner.steps=abc", "inner.steps", "expected int"),
        ("inner.steps=2.5", "inner.steps", "expected int"),
        ("inner.steps=0", "inner.steps", ">= 1"),
        ("inner.lr=0", "inner.lr", "> 0"),
        ("inner.lr=-1e-3", "inner.lr", "> 0"),
        ("inner.lr=fast", "inner.lr", "expected float"),
        ("outer.lr=0", "outer.lr", "> 0"),
        ("outer.momentum=1.0", "outer.momentum", "[0, 1)"),
        ("outer.momentum=-0.1", "outer.momentum", "[0, 1)"),
        ("train.rounds=0", "train.rounds", ">= 1"),
        ("train.threads=-1", "train.threads", ">= 0 (0: auto"),
        ("train.threads=1.5", "train.threads", "expected int"),
        ("inner.schedule=linear", "inner.schedule", "cosine"),
        ("data.partition=random", "data.partition", "dirichlet"),
        ("data.dirichlet_alpha=0", "data.dirichlet_alpha", "> 0"),
        ("data.seq_len=4096", "data.seq_len", "max_seq_len"),
        ("data.shard_index=9", "data.shard_index", "[0, 4)"),
        ("data.source=files", "data.path", "data.source"),
        ("model.hidden_size=130", "model.hidden_size", "multiple of model.num_heads"),
        ("model.device=tpu", "model.device", "cuda"),
        ("inner.betas=[0.9]", "inner.betas", "two numbers"),
        ("swarm.run_id=a.b", "swarm.run_id", "'.'"),
        ("swarm.request_timeout=100", "swarm.request_timeout", "matchmaking_time"),
        ("swarm.overlap=lazy", "swarm.overlap", "eager"),
        ("swarm.overlap_steps=-1", "swarm.overlap_steps", ">= 0 inner steps"),
        ("swarm.overlap_carry=1.5", "swarm.overlap_carry", "[0, 1]"),
        ("logging.progress_bar=maybe", "logging.progress_bar", "expected bool"),
        ("logging.log_every=-5", "logging.log_every", ">= 0 (0: a line per round only)"),
        ("logging.tensorboard=yes please", "logging.tensorboard", "expected bool"),
        ("logging.wandb_mode=cloud", "logging.wandb_mode", "offline, online"),
        ("logging.wandb_project=team/proj", "logging.wandb_project", "WANDB_ENTITY"),
        ("logging.wandb_project=' '", "logging.wandb_project", "project name"),
        ("model=3", "model", "mapping"),
    ],
)
def test_bad_values_name_the_field(override, field, hint):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", [override])
    message = str(err.value)
    assert field in message, message
    assert hint in message, message


def test_bad_files_and_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["inner.steps"])


def test_run_metadata_has_config_seed_versions_and_commit(tmp_path):
    cfg = load_config(CONFIGS / "tiny.yaml", ["seed=11"])
    path = write_run_metadata(tmp_path, cfg, mode="diloco")
    meta = json.loads(path.read_text())
    assert meta["seed"] == 11 and meta["config"]["seed"] == 11
    assert meta["config"]["inner"]["steps"] == cfg.inner.steps
    assert meta["versions"]["torch"] and meta["versions"]["hivemind"] == "1.1.12"
    assert "git_commit" in meta and meta["mode"] == "diloco"


def test_renamed_key_says_its_new_name(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.outer_steps is now called train\.rounds"):
        load_config(CONFIGS / "tiny.yaml", ["train.outer_steps=5"])
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  outer_steps: 5\n")
    with pytest.raises(ConfigError, match="train.rounds"):
        load_config(old)
    assert load_config(CONFIGS / "tiny.yaml", ["train.rounds=5"]).train.rounds == 5

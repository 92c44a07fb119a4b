"""Config loading, and every configs/*.yaml (GPU presets validated without building models)."""

from __future__ import annotations

import math

import pytest

from memaudit.config import load_config, load_raw
from memaudit.errors import ConfigError
from memaudit.models.presets import PRESETS, get_preset, param_count
from tests.conftest import REPO_ROOT

SWEEP_KEYS = {"grid", "base", "base_config"}  # sweep files (memaudit sweep) are tested with the sweep
CONFIGS = [p for p in sorted((REPO_ROOT / "configs").glob("*.yaml")) if not SWEEP_KEYS & set(load_raw(p))]


def test_there_are_configs():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "small", "125m", "350m", "1b", "8b"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = load_config(path)
    p = get_preset(cfg.model.preset)
    assert cfg.data.seq_len <= p.max_position_embeddings
    assert cfg.train.warmup_steps < cfg.train.steps
    assert p.hidden_size % p.num_attention_heads == 0
    assert p.num_attention_heads % p.num_key_value_heads == 0
    if cfg.train.micro_batch_size is not None:
        assert cfg.train.micro_batch_size <= cfg.train.batch_size


@pytest.mark.parametrize("name,stem", [("125m", "125m"), ("350m", "350m"), ("1b", "1b"), ("8b", "8b")])
def test_gpu_presets_by_parameter_count(name, stem):
    """Sizes from the preset arithmetic alone; the named configs use the named preset."""
    cfg = load_config(REPO_ROOT / "configs" / f"{stem}.yaml")
    assert cfg.model.preset == name and cfg.train.device in ("auto", "cuda")
    n = param_count(name) / 1e9
    expected = {"125m": (0.10, 0.20), "350m": (0.30, 0.45), "1b": (0.9, 1.3), "8b": (7.5, 8.5)}[name]
    assert expected[0] <= n <= expected[1], n


def test_param_count_matches_a_built_model():
    from memaudit.models.presets import build_model

    for name in ("tiny", "tiny2x", "small"):
        model = build_model(name, vocab_size=512, seed=0)
        assert sum(p.numel() for p in model.parameters()) == param_count(name, vocab_size=512)


def test_overrides_and_errors():
    cfg = load_config(REPO_ROOT / "configs" / "tiny.yaml", ["train.lr=3e-4", "model.preset=small",
                                                           "privacy.clip=inf"])
    assert (cfg.train.lr, cfg.model.preset, math.isinf(cfg.privacy.clip)) == (3e-4, "small", True)
    with pytest.raises(ConfigError, match="unknown key 'train.lrr'"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(None, ["train.lr=-1"])
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=many"])
    assert set(PRESETS) == {"tiny", "tiny2x", "small", "125m", "350m", "1b", "8b"}

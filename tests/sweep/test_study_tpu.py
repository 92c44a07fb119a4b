"""configs/study-tpu.yaml (issue 66) and its CPU rehearsal: the grid the issue asks for, the sizes
its targets need by memaudit's own power calculation, and a rehearsal that is the same study."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from memaudit.errors import ConfigError
from memaudit.models.presets import param_count
from memaudit.probes.power import minimum_detectable_effect, signflip_floor
from memaudit.sweep.config import (
    load_sweep_config,
    plan_points,
    point_config,
    sweep_config_from_dict,
)
from memaudit.sweep.pretrain import pretrained_sizes, public_base_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HOLM_STRICTEST = 0.05 / 66  # the report's one family of tests, as configs/study.yaml's report holds


@pytest.fixture(scope="module")
def study():
    return load_sweep_config(CONFIGS / "study-tpu.yaml")


def _shape(name: str, size: str) -> str:
    return name.replace(f"-{size}-", "-SIZE-")


def test_the_grid_the_issue_asks_for(study):
    points = plan_points(study)
    assert study.grid.models == ["tiny", "125m", "350m"]
    for size in study.grid.models:
        names = sorted(_shape(p.name, size) for p in points if p.model == size)
        assert names == sorted([
            "centralized-SIZE-epsinf-user-s0", "centralized-SIZE-epsinf-user-gf-s0",  # Goldfish at one setting
            "centralized-SIZE-eps8-user-els-s0", "centralized-SIZE-eps8-user-uls-s0",
            "centralized-SIZE-eps2-user-els-s0", "centralized-SIZE-eps2-user-uls-s0",
            "federated-SIZE-epsinf-s0", "federated-SIZE-eps8-s0", "federated-SIZE-eps2-s0"])
    for p in points:
        cfg = point_config(study, p)
        assert cfg.train.engine == "jax" and cfg.model.preset == p.model
        if cfg.privacy.enabled:
            assert cfg.privacy.unit == "user"
    # one compute budget: every point sees the same training tokens
    assert len({p.tokens_seen for p in points}) == 1


def test_a_private_world_of_thousands_of_users(study):
    data = point_config(study, plan_points(study)[0]).data
    assert data.synth.users >= 2000
    train_users = data.synth.users * (1 - data.heldout_users)
    members = train_users * data.synth.docs_per_user * data.holdout_fraction
    assert members >= 11_000


def test_public_pretraining_scaled_to_the_size(study):
    points = plan_points(study)
    assert pretrained_sizes(study, points) == ["tiny", "125m", "350m"]
    per_param = {}
    for size in ("125m", "350m"):
        t = public_base_config(study, size=size)
        per_param[size] = t.train.steps * t.train.batch_size * t.data.seq_len / param_count(size)
    # the tokens per parameter the config's comment states: 0.05 at both released sizes
    assert per_param == pytest.approx({"125m": 0.05, "350m": 0.05}, rel=0.02)
    # the later sizes read the first size's tokenizer
    shared = public_base_config(study, size="125m", tokenizer="/base-tiny/model")
    assert shared.data.tokenizer == "/base-tiny/model"


def test_canaries_sized_by_the_power_calculation(study):
    canaries = point_config(study, plan_points(study)[0]).data.canaries
    n = canaries.per_setting
    # the paired sign-flip test on one bucket can reach the report's strictest Holm step ...
    assert signflip_floor(n, "two-sided") < HOLM_STRICTEST
    assert signflip_floor(10, "two-sided") > HOLM_STRICTEST  # ... which configs/study.yaml's 10 cannot
    # ... and detects a 2-bit exposure difference at a 2-bit spread of the per-canary differences
    rng = np.random.default_rng(0)
    a = {"kind": "mean", "unit": "canaries", "ids": list(range(n)), "values": rng.normal(3, 2, n)}
    b = {**a, "values": a["values"] + rng.normal(0, 2, n)}
    assert minimum_detectable_effect(a, b, alternative="two-sided", alpha=HOLM_STRICTEST)["value"] <= 2.0


def test_membership_auc_mde_within_the_target(study):
    data = point_config(study, plan_points(study)[0]).data
    n = int(data.synth.users * (1 - data.heldout_users) * data.synth.docs_per_user * data.holdout_fraction)
    rng = np.random.default_rng(1)
    member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    x = rng.normal(0, 1, 2 * n) + 0.1 * member
    y = 0.5 * x + math.sqrt(0.75) * rng.normal(0, 1, 2 * n)  # two runs' scores, correlated 0.5
    a = {"kind": "auc", "unit": "documents", "ids": list(range(2 * n)), "values": x, "member": member}
    mde = minimum_detectable_effect(a, {**a, "values": y}, alternative="two-sided", alpha=HOLM_STRICTEST)
    assert mde["value"] <= 0.02


def test_the_rehearsal_is_the_same_study():
    study = load_sweep_config(CONFIGS / "study-tpu.yaml")
    rehearsal = load_sweep_config(CONFIGS / "study-tpu-rehearsal.yaml")
    skip = {"models"}
    assert {k: v for k, v in rehearsal.grid.model_dump().items() if k not in skip} == \
        {k: v for k, v in study.grid.model_dump().items() if k not in skip}
    shapes = {re.sub(r"-(tiny|125m|350m)-", "-SIZE-", p.name) for p in plan_points(rehearsal)}
    assert shapes == {re.sub(r"-(tiny|125m|350m)-", "-SIZE-", p.name) for p in plan_points(study)}
    assert rehearsal.grid.models[0] == "tiny"  # the tokenizer's size first, as the study's
    for key in ("heldout_users", "holdout_fraction"):
        assert rehearsal.base["data"][key] == study.base["data"][key]
    assert rehearsal.base["train"]["engine"] == study.base["train"]["engine"] == "jax"
    # about the same public pretraining per parameter
    t = public_base_config(rehearsal, size="tiny")
    assert t.train.steps * t.train.batch_size * t.data.seq_len / param_count("tiny") == pytest.approx(0.05, rel=0.2)


def _sizes(models: list[str]) -> dict:
    return {"pretrain": {"steps": 2}, "grid": {"backends": ["centralized"], "models": models}}


def test_sizes_of_other_vocabularies_share_the_first_base_tokenizer():
    cfg = sweep_config_from_dict(_sizes(["tiny", "125m"]))
    assert [p.model for p in plan_points(cfg)] == ["tiny", "125m"]
    with pytest.raises(ConfigError, match="smallest vocabulary's size first"):
        sweep_config_from_dict(_sizes(["125m", "tiny"]))
    with pytest.raises(ConfigError, match="different vocabularies"):
        sweep_config_from_dict({"grid": {"backends": ["centralized"], "models": ["tiny", "125m"]}})


def test_only_keeps_the_matching_points_and_names_a_miss():
    raw = {"grid": {"backends": ["centralized"], "epsilons": ["inf", 8], "goldfish": [False, True],
                    "only": ["*-epsinf-gf-*", "*-eps8-s0"]}}
    assert [p.name for p in plan_points(sweep_config_from_dict(raw))] == ["centralized-epsinf-gf-s0",
                                                                          "centralized-eps8-s0"]
    with pytest.raises(ConfigError, match="no point of the grid matches"):
        sweep_config_from_dict({**raw, "select": ["federated-*"]})
    with pytest.raises(ConfigError, match="pretrain.per_model.350m names a size"):
        sweep_config_from_dict({**_sizes(["tiny", "125m"]), "pretrain": {"per_model": {"350m": {}}}})


@pytest.mark.parametrize("name", ["study-tpu.yaml", "study-tpu-rehearsal.yaml"])
def test_the_public_corpus_shares_nothing_with_the_private_world(name):
    """What `memaudit sweep` checks before it trains anything (the study's 5,000 public authors
    against its 2,400 private users): it passes, so the study does not stop on the machine."""
    from memaudit.sweep.pretrain import check_public_corpus

    report = check_public_corpus(load_sweep_config(CONFIGS / name))
    assert report["disjoint"] and report["shared_pii_values"] == 0 and report["public_documents"] >= 1600

"""grid.finetune: full vs LoRA points, and the report's LoRA-against-full comparison."""

from __future__ import annotations

import math

import pytest

from memaudit.errors import ConfigError
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict


def test_finetune_axis_gives_full_and_lora_points_with_the_base_lora_settings():
    s = sweep_config_from_dict({"base": {"model": {"lora": {"rank": 2, "target_modules": ["q_proj"]}}},
                                "grid": {"backends": ["centralized", "federated"], "epsilons": [8],
                                         "finetune": ["full", "lora"]}})
    names = {p.name: p for p in plan_points(s)}
    assert set(names) == {"centralized-eps8-s0", "centralized-eps8-lora-s0", "federated-eps8-s0",
                          "federated-eps8-lora-s0"}
    assert point_config(s, names["centralized-eps8-s0"]).model.lora is None
    lora = point_config(s, names["federated-eps8-lora-s0"]).model.lora
    assert (lora.rank, lora.target_modules) == (2, ("q_proj",))
    assert names["centralized-eps8-lora-s0"].finetune == "lora"


def test_per_finetune_tunes_each_mode_at_equal_tokens():
    s = sweep_config_from_dict({"base": {"train": {"lr": 3e-3}},
                                "per_finetune": {"lora": {"train.lr": 1e-2, "federated.client_lr": 0.5}},
                                "grid": {"backends": ["centralized", "federated"], "finetune": ["full", "lora"]}})
    cfgs = {p.name: (p, point_config(s, p)) for p in plan_points(s)}
    assert cfgs["centralized-epsinf-s0"][1].train.lr == 3e-3
    assert cfgs["centralized-epsinf-lora-s0"][1].train.lr == 1e-2
    assert cfgs["federated-epsinf-lora-s0"][1].federated.client_lr == 0.5
    assert cfgs["federated-epsinf-s0"][1].federated.client_lr != 0.5
    assert len({p.tokens_seen for p, _c in cfgs.values() if p.backend == "centralized"}) == 1


@pytest.mark.parametrize("per_finetune, needle", [
    ({"lora": {"train.steps": 10}}, "per_finetune.lora.train.steps changes what a step trains on"),
    ({"lora": {"model.lora.rank": 2}}, "per_finetune.lora.model.lora.rank: grid.finetune and base.model.lora"),
    ({"full": {"train.lr": 1e-3}}, "per_finetune.full names a mode that is not in grid.finetune"),
    ({"qlora": {"train.lr": 1e-3}}, "per_finetune"),
])
def test_bad_per_finetune_is_one_line(per_finetune, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")) as e:
        sweep_config_from_dict({"per_finetune": per_finetune, "grid": {"finetune": ["lora"]}})
    assert "\n" not in str(e.value)


def test_finetune_axis_without_base_lora_uses_the_defaults_and_absent_axis_keeps_names():
    s = sweep_config_from_dict({"grid": {"backends": ["centralized"], "finetune": ["lora"]}})
    (p,) = plan_points(s)
    assert p.name == "centralized-epsinf-lora-s0" and point_config(s, p).model.lora.rank == 8
    (q,) = plan_points(sweep_config_from_dict({"grid": {"backends": ["centralized"]}}))
    assert q.name == "centralized-epsinf-s0" and q.finetune is None


@pytest.mark.parametrize("value", [[], ["full", "full"], ["adapters"]])
def test_bad_finetune_axis_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        sweep_config_from_dict({"grid": {"backends": ["centralized"], "finetune": value}})
    assert "finetune" in str(e.value) and "\n" not in str(e.value)


def test_report_compares_lora_with_the_full_fine_tune_at_equal_epsilon():
    from memaudit.reports import findings
    from memaudit.reports.build import SCHEMA, comparisons
    from memaudit.reports.render import render_markdown
    from tests.reports._fixtures import auc_units, run

    def mk(rid, trained, shift, eps=8.0):
        r = run(rid, "centralized", eps, mia={"value": 0.5 + shift, "ci_low": 0.5, "ci_high": 0.7, "n": 200,
                                           "unit": "documents"}, units={"mia_auc": auc_units(shift)})
        r["model"]["trained"] = trained
        return r

    runs = [mk("full", "full", 1.0), mk("lora", "lora(r=8, q_proj,v_proj)", 0.0)]
    runs[1]["model"]["upload_bytes_per_client_per_round"] = 28672
    comp = comparisons(runs)
    (eff,) = comp.effects
    assert eff.treatment == "LoRA fine-tuning (lora(r=8, q_proj,v_proj))" and eff.epsilon == 8.0
    assert set(eff.metrics) == {"mia_auc"}
    assert {c.label for c in comp.curves} == {"centralized", "centralized + LoRA"}
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comp}
    rep["comparisons"] = findings.adjust(rep)
    rep["findings"] = findings.generate(rep)
    md = render_markdown(rep)
    assert "upload 28672 bytes per client per round" in md and md.count("bytes per client") == 1
    assert "trained: lora(r=8, q_proj,v_proj)" in md and not math.isnan(eff.metrics["mia_auc"].side("treated").value)


def test_the_public_base_is_pretrained_in_full_whatever_the_fine_tunes_train():
    """base.model.lora is the LoRA points' setting: the public base pretrains every weight. It
    had pretrained LoRA adapters on a random initialisation (holdout perplexity 3,273 against 457
    for the same base in full), so every fine-tune of such a sweep started from noise."""
    from memaudit.sweep.pretrain import pretrain_key, public_base_config

    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    with_lora = sweep_config_from_dict({"pretrain": {"steps": 10, "users": 8, "docs_per_user": 2},
                                        "base": {"model": {"lora": lora}},
                                        "grid": {"backends": ["centralized"], "finetune": ["full", "lora"]}})
    plain = sweep_config_from_dict({"pretrain": {"steps": 10, "users": 8, "docs_per_user": 2},
                                    "grid": {"backends": ["centralized"]}})
    base = public_base_config(with_lora)
    assert base.model.lora is None
    # the same base as a sweep without LoRA: one pretraining serves both
    assert pretrain_key(base) == pretrain_key(public_base_config(plain))

"""Sweep configs (configs/quickstart.yaml, configs/paper-scale.yaml) and sweep/report bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from memaudit.cli import main
from memaudit.io import atomic_write_json
from memaudit.sweep.config import load_sweep_config, plan_points, point_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SWEEP_FILES = sorted(p for p in CONFIGS.glob("*.yaml") if {"grid", "base", "base_config"} & set(yaml.safe_load(p.read_text()) or {}))


def test_sweep_files_are_found():
    assert {p.name for p in SWEEP_FILES} >= {"quickstart.yaml", "paper-scale.yaml"}


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_every_sweep_config_validates_every_point(path):
    cfg = load_sweep_config(path)
    points = plan_points(cfg)
    assert points
    for p in points:
        run_cfg = point_config(cfg, p)
        assert run_cfg.backend == p.backend
        if p.level is None:
            assert not run_cfg.privacy.enabled
        if p.backend == "federated":
            assert not run_cfg.train.goldfish.enabled


def test_quickstart_is_both_backends_no_dp_and_two_epsilons_per_user_one_seed():
    cfg = load_sweep_config(CONFIGS / "quickstart.yaml")
    pts = plan_points(cfg)
    assert {p.backend for p in pts} == {"centralized", "federated"}
    assert sorted({p.nominal_epsilon for p in pts}) == [2.0, 8.0, math.inf]
    assert {p.seed for p in pts} == {0}
    assert point_config(cfg, pts[0]).model.preset == "tiny"
    # both backends at equal epsilon per user: centralized DP-SGD per user (ULS, k sequences a user)
    for p in pts:
        c = point_config(cfg, p)
        if c.privacy.enabled and p.backend == "centralized":  # (federated is always per user)
            assert c.privacy.unit == "user" and c.privacy.user_sampling == "uls"
            assert c.privacy.max_examples_per_user == 8
    m = cfg.match_utility  # a centralized point placed to meet the federated run at eps = 8 if none does
    assert m.enabled and m.target_backend == "federated" and m.levels == [8.0]


def test_paper_scale_is_gpu_scale():
    cfg = load_sweep_config(CONFIGS / "paper-scale.yaml")
    pts = plan_points(cfg)
    c = point_config(cfg, pts[0])
    assert c.model.preset == "1b" and c.data.path and c.parallel.world_size >= 16
    assert c.federated.cohort >= 100 and len(cfg.grid.seed_list) >= 3
    assert any(p.audit for p in pts) and any(p.goldfish for p in pts)
    assert not any(p.goldfish and p.backend == "federated" for p in pts)


def test_cli_overrides_shape_the_grid(tmp_path):
    cfg = load_sweep_config(CONFIGS / "quickstart.yaml", ["grid.epsilons=[1, 4, 16, inf]", "grid.seeds=3",
                                                          "grid.backends=[centralized]"])
    names = [p.name for p in plan_points(cfg)]
    assert len(names) == 12 and names[0] == "centralized-eps1-user-s0" and "centralized-epsinf-user-s2" in names


def test_a_set_inside_a_per_backend_map_changes_one_key_and_keeps_the_rest():
    """`--set per_backend.federated.federated.server_optimizer=sgd` sets that one key of the
    federated points; it once replaced their whole `federated` section (rounds, cohort, local
    steps back at their defaults: 1.6M tokens a point instead of the study's 4.9M)."""
    study = CONFIGS / "study-tpu.yaml"
    plain = load_sweep_config(study)
    cfg = load_sweep_config(study, ["per_backend.federated.federated.server_optimizer=sgd",
                                    "per_model.tiny.train.lr=0.001", "pretrain.per_model.125m.train.lr=0.0001",
                                    "pretrain.overrides.train.lr=0.002"])
    fed = next(p for p in plan_points(cfg) if p.name == "federated-tiny-eps8-s0")
    before = point_config(plain, next(p for p in plan_points(plain) if p.name == fed.name))
    after = point_config(cfg, fed)
    assert before.federated.server_optimizer == "fedadam" and after.federated.server_optimizer == "sgd"
    assert after.federated.model_dump(exclude={"server_optimizer"}) == before.federated.model_dump(
        exclude={"server_optimizer"})
    assert (after.federated.rounds, after.federated.cohort, after.privacy.clip) == (150, 32, 0.1)
    assert after.train.lr == 0.001 and cfg.per_model["tiny"]["train.lr"] == 0.001
    assert cfg.pretrain.overrides["train.lr"] == 0.002 and cfg.pretrain.overrides["train.eval_every"] == 100
    assert cfg.pretrain.per_model["125m"]["train.lr"] == 0.0001 and cfg.pretrain.per_model["125m"]["train.steps"] == 190


def test_a_nested_section_in_a_per_backend_map_merges_into_the_base(tmp_path):
    """A YAML author may write per_backend's overrides nested rather than dotted: they merge
    key by key into the base's sections, as the dotted keys do."""
    raw = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    raw["base_config"] = str(CONFIGS / raw["base_config"])
    raw.setdefault("per_backend", {}).setdefault("federated", {})["federated"] = {"server_lr": 0.01}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_sweep_config(tmp_path / "s.yaml")
    plain = load_sweep_config(CONFIGS / "quickstart.yaml")
    fed = next(p for p in plan_points(cfg) if p.backend == "federated")
    after, before = point_config(cfg, fed), point_config(plain, fed)
    assert after.federated.server_lr == 0.01
    assert after.federated.model_dump(exclude={"server_lr"}) == before.federated.model_dump(exclude={"server_lr"})


def test_a_set_inside_a_map_the_file_leaves_empty_makes_it(tmp_path):
    """`per_backend.federated:` written empty in the file (None): `--set per_backend.federated.
    federated.server_lr=...` makes the section and sets the key, as on an absent one; a map key
    that is not a section is refused."""
    from memaudit.errors import ConfigError

    raw = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    raw["base_config"] = str(CONFIGS / raw["base_config"])
    raw["per_backend"]["federated"] = None
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_sweep_config(tmp_path / "s.yaml", ["per_backend.federated.federated.server_lr=0.01"])
    assert cfg.per_backend["federated"] == {"federated.server_lr": 0.01}
    with pytest.raises(ConfigError, match="'federated' is not a section"):
        load_sweep_config(tmp_path / "s.yaml", ["per_backend.federated=1", "per_backend.federated.x.y=2"])


def test_per_backend_dp_sets_the_dp_points_of_its_backend_only(tmp_path, capsys):
    """per_backend_dp.federated applies after per_backend to the federated points with DP and to
    no other point; a key that changes what a step trains on, the model or the level is one line,
    exit 2, and `--set per_backend_dp.B.KEY=V` sets that one key."""
    sets = ["grid.epsilons=[inf, 8]", "grid.backends=[centralized, federated]",
            "per_backend_dp.federated.privacy.clip=0.1", "per_backend_dp.federated.federated.server_lr=0.001"]
    cfg = load_sweep_config(CONFIGS / "quickstart.yaml", sets)
    plain = load_sweep_config(CONFIGS / "quickstart.yaml", sets[:2])
    assert cfg.per_backend_dp == {"federated": {"privacy.clip": 0.1, "federated.server_lr": 0.001}}
    seen = set()
    for p in plan_points(cfg):
        got, before = point_config(cfg, p), point_config(plain, p)
        if p.backend == "federated" and p.level is not None:
            assert (got.privacy.clip, got.federated.server_lr) == (0.1, 0.001)
            assert got.model_dump(exclude={"privacy", "federated"}) == before.model_dump(exclude={"privacy", "federated"})
            seen.add("dp")
        else:
            assert got == before
            seen.add(p.backend)
    assert seen == {"dp", "federated", "centralized"}
    for bad, says in (("per_backend_dp.federated.federated.rounds=10", "changes what a step trains on"),
                      ("per_backend_dp.federated.privacy.target_epsilon=1", "the grid's levels set it"),
                      ("per_backend_dp.central.privacy.clip=1", "unknown backend 'central'"),
                      ("per_backend_dp.centralized.model.preset=125m", "fine-tunes the model"),
                      ("per_backend_dp.federated.train.goldfish.enabled=true", "centralized-only")):
        sweep = tmp_path / "s.yaml"
        sweep.write_text((CONFIGS / "quickstart.yaml").read_text().replace("base_config: ", f"base_config: {CONFIGS}/"))
        rc = main(["sweep", str(sweep), "--dry-run", "--set", bad])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (bad, err)


def test_audit_levels_pick_grid_levels(tmp_path, capsys):
    """audit.levels: all, dp_only, or a list of the grid's own levels; another level is one line."""
    base = ["grid.epsilons=[inf, 8, 2]", "grid.backends=[centralized, federated]", "audit.enabled=true",
            "audit.backends=[centralized]"]

    def audited(levels):
        cfg = load_sweep_config(CONFIGS / "quickstart.yaml", [*base, f"audit.levels={levels}"])
        return sorted(p.nominal_epsilon for p in plan_points(cfg) if p.audit)

    assert audited("all") == [2.0, 8.0, math.inf]
    assert audited("dp_only") == [2.0, 8.0]
    assert audited("[inf, 2]") == [2.0, math.inf]
    err = _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--out", str(tmp_path / "s"),
                        *[a for o in [*base, "audit.levels=[3]"] for a in ("--set", o)]])
    assert "audit.levels has 3" in err and "grid level" in err
    assert not (tmp_path / "s").exists()


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_sweep_bad_input_one_line(tmp_path, capsys):
    assert "unknown backend 'tpu'" in _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--backends", "parallel,tpu", "--out", str(tmp_path / "s")])
    fed_gf = tmp_path / "gf.yaml"
    fed_gf.write_text(yaml.safe_dump({"base_config": str(CONFIGS / "tiny.yaml"),
                                      "per_backend": {"federated": {"train.goldfish.enabled": True}}}))
    assert "centralized-only" in _err(capsys, ["sweep", str(fed_gf), "--out", str(tmp_path / "s")])
    assert "not a number" in _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--epsilons", "1,x"])
    assert "on or off" in _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--goldfish", "maybe"])
    assert "jobs" in _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--jobs", "0", "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


def test_report_bad_input_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no runs found" in _err(capsys, ["report", str(empty), "--out", str(tmp_path / "r")])
    run = tmp_path / "runs" / "a"
    atomic_write_json(run / "run.json", {"status": "complete", "backend": "parallel", "config": {}})
    msg = _err(capsys, ["report", str(tmp_path / "runs"), "--out", str(tmp_path / "r")])
    assert "no probes.json" in msg and str(run) in msg and "memaudit probe" in msg
    assert not (tmp_path / "r").exists()


def test_the_quickstarts_canary_buckets_can_show_dp_lowering_exposure():
    """The paired sign-flip test of DP against no DP on a bucket's canaries cannot go below
    p = 2^-n; below Holm's first-step threshold over the report's family (its size read from the
    quickstart snapshot, rebuilt from this config) it must be, or "DP lowers exposure" could never
    be shown (10 canaries a bucket: 1/1024 against 0.05 / 78)."""
    import json

    from memaudit.probes.stats import MIN_N

    cfg = load_sweep_config(CONFIGS / "quickstart.yaml")
    n = cfg.base["data"]["canaries"]["per_setting"]
    report = json.loads((CONFIGS.parent / "docs" / "snapshots" / "quickstart.report.json").read_text())
    family = report["findings"]["tests"]
    assert n >= MIN_N and 2.0 ** -n < report["findings"]["alpha"] / family, (n, family)


def test_the_quickstart_holds_out_enough_documents_for_tpr_at_one_percent_fpr():
    """Membership inference's TPR at 1% FPR needs >= 1,000 non-members; the quickstart's IID
    holdout (same users as the members, distinct texts, as `memaudit probe` counts them) has them."""
    from memaudit.data.prepare import private_documents
    from memaudit.probes.stats import needed_negatives

    cfg = load_sweep_config(CONFIGS / "quickstart.yaml")
    docs, split, _ = private_documents(point_config(cfg, plan_points(cfg)[0]).data)
    text = {d.id: d.text for d in docs}
    members = {text[i] for i in split.member_docs}
    holdout = {text[i] for i in split.holdout_docs} - members
    assert len(holdout) >= needed_negatives(0.01) == 1000
    assert len(members) >= 300  # and the member side keeps its size
    # the holdout are the training users' own messages: the test measures the message, not the user
    held = set(split.holdout_docs)
    users = {d.user for d in docs if d.id in held}
    assert users <= set(split.train_users)

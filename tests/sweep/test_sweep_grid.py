"""The model-size axis, the executor section and their bad input (one line, exit 2)."""

from __future__ import annotations

import builtins
from pathlib import Path

import yaml

from memaudit.cli import main
from memaudit.sweep.config import (
    load_sweep_config,
    plan_points,
    point_config,
    sweep_config_from_dict,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_size_axis_names_and_equal_tokens_seen():
    cfg = sweep_config_from_dict({
        "base": {"train": {"steps": 7, "batch_size": 4}, "data": {"seq_len": 32}},
        "grid": {"backends": ["centralized", "federated"], "models": ["tiny", "tiny2x"], "epsilons": ["inf", 4],
                 "goldfish": [False, True]},
        "per_model": {"tiny2x": {"parallel.data": 2, "train.lr": 1e-3}}})
    pts = plan_points(cfg)
    names = [p.name for p in pts]
    assert len(names) == len(set(names)) == 2 * 2 * 2 + 2 * 2
    assert "centralized-tiny2x-eps4-gf-s0" in names and "federated-tiny-epsinf-s0" in names
    for p in pts:
        c = point_config(cfg, p)
        assert c.model.preset == p.model and p.model in p.name
        if p.backend == "centralized":  # what the schedule feeds, recomputed here
            assert p.tokens_seen == 7 * 4 * 32 == c.train.steps * c.train.batch_size * c.data.seq_len
            assert c.parallel.world_size == (2 if p.model == "tiny2x" else 1)
    by_size = {}
    for p in pts:
        by_size.setdefault((p.backend, p.level, p.goldfish), set()).add(p.tokens_seen)
    assert all(len(v) == 1 for v in by_size.values())  # equal tokens seen across sizes


def test_names_without_the_axis_are_unchanged():
    cfg = load_sweep_config(CONFIGS / "quickstart.yaml", ["grid.units=null", "grid.epsilons=[inf, 32, 2]"])
    assert [p.name for p in plan_points(cfg)][:3] == ["centralized-epsinf-s0", "centralized-eps32-s0", "centralized-eps2-s0"]
    # the privacy-unit axis names its unit
    assert plan_points(load_sweep_config(CONFIGS / "quickstart.yaml"))[1].name == "centralized-eps8-user-s0"
    assert all(p.model is None for p in plan_points(cfg))


def test_base_config_merges_section_by_section(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"train": {"steps": 9, "lr": 1e-4, "batch_size": 3}}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"base_config": "run.yaml", "base": {"train": {"steps": 5}},
                                                     "grid": {"backends": ["centralized"]}}))
    cfg = load_sweep_config(tmp_path / "s.yaml")
    c = point_config(cfg, plan_points(cfg)[0])
    assert (c.train.steps, c.train.lr, c.train.batch_size) == (5, 1e-4, 3)


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def _sweep(tmp_path, **raw) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"grid": {"backends": ["centralized"]}, **raw}))
    return str(path)


def test_size_axis_bad_input_one_line(tmp_path, capsys):
    out = str(tmp_path / "out")
    msg = _err(capsys, ["sweep", _sweep(tmp_path, grid={"models": ["tiny", "huge"]}), "--out", out])
    assert "unknown model preset 'huge'" in msg and "tiny2x" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, grid={"models": ["tiny", "small"]}), "--out", out])
    assert "different vocabularies" in msg and "tiny: 4096" in msg and "small: 8192" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, grid={"models": ["tiny", "tiny2x"]},
                                       per_model={"tiny2x": {"train.steps": 3}}), "--out", out])
    assert "per_model.tiny2x.train.steps" in msg and "equal tokens" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, grid={"models": ["tiny"]}, per_model={"small": {}}), "--out", out])
    assert "per_model.small" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, grid={"models": ["tiny", "tiny"]}), "--out", out])
    assert "twice" in msg
    assert not Path(out).exists()


def test_shared_tokenizer_admits_sizes_of_other_vocabularies():
    cfg = sweep_config_from_dict({"base": {"data": {"tokenizer": "/public/tok"}},
                                  "grid": {"backends": ["centralized"], "models": ["1b", "8b"]}})
    assert [p.model for p in plan_points(cfg)] == ["1b", "8b"]


def test_executor_bad_input_one_line(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    qs = str(CONFIGS / "quickstart.yaml")
    assert "--executor 'pbs'" in _err(capsys, ["sweep", qs, "--executor", "pbs", "--out", out])
    msg = _err(capsys, ["sweep", _sweep(tmp_path, base={"parallel": {"data": 3}},
                                       executor={"nodes": 2}), "--executor", "slurm", "--out", out])
    assert "executor.nodes=2 does not divide the 3 ranks" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, base={"parallel": {"data": 8}},
                                       executor={"gpus_per_node": 4, "nodes": 1}), "--executor", "slurm", "--out", out])
    assert "exceed executor.gpus_per_node=4" in msg
    msg = _err(capsys, ["sweep", _sweep(tmp_path, base={"parallel": {"data": 2}}), "--executor",
                        "debug", "--out", out])
    assert "local" in msg
    monkeypatch.setattr("memaudit.sweep.executors.which", lambda name: None)  # no srun here, for memaudit only
    assert "no 'srun'" in _err(capsys, ["sweep", qs, "--executor", "slurm", "--out", out])
    assert not Path(out).exists()


def test_slurm_executor_without_submitit_names_the_extra(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_submitit(name, *a, **kw):
        if name == "submitit" or name.startswith("submitit."):
            raise ImportError("No module named 'submitit'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_submitit)
    out = tmp_path / "out"
    for kind in ("slurm", "local"):
        msg = _err(capsys, ["sweep", str(CONFIGS / "quickstart.yaml"), "--executor", kind, "--out", str(out)])
        assert "pip install memaudit[slurm]" in msg
    assert not out.exists()


def test_slurm_job_parameters_reach_sbatch():
    """The resources of a two-node parallel point as sbatch lines (submitit's own writer)."""
    from submitit.slurm.slurm import _make_sbatch_string

    from memaudit.sweep.executors import job_resources, slurm_parameters

    cfg = sweep_config_from_dict({
        "base": {"parallel": {"data": 2, "x": 2, "y": 2}},
        "grid": {"backends": ["centralized"]},
        "executor": {"kind": "slurm", "gpus_per_node": 4, "cpus_per_task": 8, "timeout_min": 90,
                     "partition": "gpu", "account": "proj1", "mem_gb": 200, "setup": ["module load cuda"],
                     "slurm_additional": {"exclusive": True}}})
    p = plan_points(cfg)[0]
    res = job_resources(cfg.executor, point_config(cfg, p))
    assert (res.nodes, res.tasks_per_node, res.tasks) == (2, 4, 8)
    text = _make_sbatch_string(command="python -m x", folder="/shared/jobs",
                               **slurm_parameters(cfg.executor, res, job_name="memaudit-" + p.name))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=90", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj1", "#SBATCH --mem=200GB", "#SBATCH --exclusive",
                 f"#SBATCH --job-name=memaudit-{p.name}", "module load cuda"):
        assert line in text, line
    one = job_resources(cfg.executor, point_config(cfg, p).model_copy(update={"backend": "federated"}))
    assert (one.nodes, one.tasks) == (1, 1)

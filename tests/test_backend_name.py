"""The centralized backend is called `centralized` in configs, runs and reports; `parallel`, its
name before the rename, still loads (configs, sweep files) and still reports, resumes and counts
as complete (run directories and report.json written before the rename)."""

from __future__ import annotations

import json

from memaudit.config import dump_config, load_config
from memaudit.reports.build import build_report
from memaudit.reports.schema import validate_report
from memaudit.reports.write import json_safe, load_report, rerender
from memaudit.rundir import written_by_memaudit
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict
from memaudit.sweep.point import stored_config
from tests.conftest import REPO_ROOT
from tests.reports._fixtures import write_run_dir


def test_an_old_config_with_backend_parallel_loads_as_centralized(tmp_path):
    text = (REPO_ROOT / "configs" / "tiny.yaml").read_text(encoding="utf-8")
    old = tmp_path / "old.yaml"
    old.write_text(text.replace("backend: centralized", "backend: parallel"), encoding="utf-8")
    assert "backend: parallel" in old.read_text(encoding="utf-8")
    cfg = load_config(old)
    assert cfg.backend == "centralized" and dump_config(cfg)["backend"] == "centralized"
    assert cfg == load_config(REPO_ROOT / "configs" / "tiny.yaml")
    assert load_config(REPO_ROOT / "configs" / "tiny.yaml", ["backend=parallel"]).backend == "centralized"


def test_an_old_sweep_file_names_its_centralized_points_centralized():
    s = sweep_config_from_dict({"grid": {"backends": ["parallel", "federated"], "epsilons": ["inf"]},
                                "per_backend": {"parallel": {"privacy.clip": 0.25}},
                                "match_utility": {"target_backend": "parallel"},
                                "audit": {"enabled": True, "backends": ["parallel"]}})
    assert s.grid.backends == ["centralized", "federated"] and set(s.per_backend) == {"centralized"}
    assert s.match_utility.target_backend == "centralized" and s.audit.backends == ["centralized"]
    points = {p.name: p for p in plan_points(s)}
    assert set(points) == {"centralized-epsinf-s0", "federated-epsinf-s0", "centralized-epsinf-audit-s0"}
    cfg = point_config(s, points["centralized-epsinf-s0"])
    assert cfg.backend == "centralized" and cfg.privacy.clip == 0.25


def test_an_old_run_json_is_memaudits_and_not_stale_for_its_name():
    old = {"memaudit_version": "0.1", "backend": "parallel", "config": {"backend": "parallel", "seed": 1}}
    assert written_by_memaudit(old)
    assert stored_config(old) == {"backend": "centralized", "seed": 1}
    assert not written_by_memaudit({**old, "backend": "mpi"})


def test_an_old_run_dir_with_backend_parallel_reports_as_centralized(tmp_path):
    write_run_dir(tmp_path / "runs" / "old", "parallel", ppl=80.0, dp=(1.0, 400, 16, 50))
    write_run_dir(tmp_path / "runs" / "new", "centralized", ppl=80.0, dp=(1.0, 400, 16, 50))
    rep = build_report([tmp_path / "runs"])
    validate_report(rep)
    by = {r["id"]: r for r in rep["runs"]}
    assert by["old"]["backend"] == by["new"]["backend"] == "centralized"
    assert by["old"]["privacy"]["mechanism"] == by["new"]["privacy"]["mechanism"] == "DP-SGD"
    assert by["old"]["privacy"]["epsilon"] == by["new"]["privacy"]["epsilon"]
    assert [c.label for c in rep["comparisons"].curves] == ["centralized"]


def test_an_old_report_json_rerenders_with_the_centralized_side(tmp_path):
    write_run_dir(tmp_path / "runs" / "par", "centralized", ppl=80.0, mia_shift=1.0)
    write_run_dir(tmp_path / "runs" / "fed", "federated", ppl=90.0)
    rep = json_safe(build_report([tmp_path / "runs"]))
    (matched,) = rep["comparisons"]["matched"]  # both without DP: matched at epsilon = inf
    assert set(matched["units"]) == set(matched["perplexity"]) == {"centralized", "federated"}
    new = tmp_path / "new" / "report.json"
    new.parent.mkdir()
    new.write_text(json.dumps(rep), encoding="utf-8")
    # report.json as memaudit wrote it before the rename: the runs' backend and the centralized
    # side of the backend comparisons said `parallel`
    old_rep = {**rep, "runs": [{**r, "backend": "parallel" if r["backend"] == "centralized" else r["backend"]}
                               for r in rep["runs"]],
               "comparisons": json.loads(json.dumps(rep["comparisons"]).replace('"centralized":', '"parallel":'))}
    assert '"parallel":' in json.dumps(old_rep["comparisons"])
    old = tmp_path / "old" / "report.json"
    old.parent.mkdir()
    old.write_text(json.dumps(old_rep), encoding="utf-8")
    assert load_report(old) == load_report(new)
    assert rerender(old)["md"].read_text(encoding="utf-8") == rerender(new)["md"].read_text(encoding="utf-8")

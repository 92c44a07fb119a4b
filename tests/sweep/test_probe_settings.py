"""A sweep re-probes a complete run whose probes.json was written under other probe settings
(it used to keep any probes.json newer than the model, so a changed `probe:` section left every
finished point with numbers from the old settings)."""

from __future__ import annotations

from types import SimpleNamespace

from memaudit.rundir import RunDir
from memaudit.sweep.config import sweep_config_from_dict
from memaudit.sweep.probing import probe_if_stale
from tests.reports._fixtures import write_run_dir


def test_a_changed_probe_setting_probes_the_run_again(tmp_path, monkeypatch):
    rd = RunDir(write_run_dir(tmp_path / "run", "centralized", ppl=50.0))
    rd.model_dir.mkdir()
    (rd.model_dir / "config.json").write_text("{}")  # trained after the old probes.json
    calls = []

    def fake_run_probes(target, settings, progress=None, partial=None, cache=None, keep_target_scores=False):
        calls.append(settings)
        return SimpleNamespace(document={"schema": 1, "settings": settings.model_dump(mode="json"), "probes": {}})

    monkeypatch.setattr("memaudit.probes.runner.run_probes", fake_run_probes)
    monkeypatch.setattr("memaudit.probes.targets.resolve_target", lambda path: SimpleNamespace(path=path))
    raw = {"grid": {"backends": ["centralized"]}, "probe": {"probes": ["exposure"], "n_boot": 100}}
    cfg = sweep_config_from_dict(raw)
    assert probe_if_stale(cfg, rd, None) is True  # older than the model
    assert probe_if_stale(cfg, rd, None) is False  # same settings, newer than the model
    changed = sweep_config_from_dict({**raw, "probe": {"probes": ["exposure"], "n_boot": 200}})
    assert probe_if_stale(changed, rd, None) is True
    assert [c.n_boot for c in calls] == [100, 200]
    assert probe_if_stale(changed, rd, None) is False

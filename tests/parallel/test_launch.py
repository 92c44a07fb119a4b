"""End to end through the CLI: `memaudit train` on a 2-process grid (spawned, gloo) against
the single-process trainer, the merged `model/` export, and resume from the gathered checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest

from memaudit.cli import main
from memaudit.rundir import RunDir
from tests.conftest import REPO_ROOT, tiny_train_args

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus):
    base = tmp_path_factory.mktemp("par_runs")
    common = tiny_train_args(f"data.path={tiny_corpus}", "train.steps=4", "train.checkpoint_every=2",
                             "train.eval_every=2")
    assert main(["train", TINY, "--out", str(base / "par"), *common, "--set", "parallel.x=2"]) == 0
    assert main(["train", TINY, "--out", str(base / "ser"), *common]) == 0
    return base


def test_parallel_run_matches_single_process(runs) -> None:
    par, ser = _metrics(runs / "par"), _metrics(runs / "ser")
    assert [m["step"] for m in par] == [1, 2, 3, 4]
    for a, b in zip(par, ser, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4
        if "holdout_loss" in b:
            assert abs(a["holdout_loss"] - b["holdout_loss"]) < 1e-4
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, b["grad_norm"])
    assert RunDir(runs / "par").read_manifest()["status"] == "complete"


def test_merged_export_loads_in_one_process(runs) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    par = AutoModelForCausalLM.from_pretrained(runs / "par" / "model")
    ser = AutoModelForCausalLM.from_pretrained(runs / "ser" / "model")
    for (k, a), (_, b) in zip(par.state_dict().items(), ser.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_from_gathered_checkpoint(runs, tmp_path) -> None:
    """A copy of the finished run, rolled back to its step-2 checkpoint, resumes to the same end."""
    import torch
    from safetensors.torch import load_file

    cp = tmp_path / "cp"
    shutil.copytree(runs / "par", cp)
    shutil.rmtree(cp / "model")
    RunDir(cp).update_manifest(status="interrupted")
    assert json.loads((cp / "state" / "trainer.json").read_text())["step"] == 2
    assert main(["train", "--resume", str(cp)]) == 0
    a, b = _metrics(cp), _metrics(runs / "par")
    assert [m["step"] for m in a] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6
    wa, wb = load_file(str(cp / "model" / "model.safetensors")), load_file(str(runs / "par" / "model" / "model.safetensors"))
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


def test_grid_that_does_not_divide_the_model_is_one_line(tmp_path, capsys) -> None:
    rc = main(["train", TINY, "--out", str(tmp_path / "bad"), "--set", "parallel.y=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not divisible by parallel.y=3" in err[0]

"""On a DP-SGD run with audit canaries, the one-run audit's lower bound stays below the ledger's ε."""

from __future__ import annotations

import json

from memaudit.cli import main
from tests.conftest import TINY_TRAIN_OVERRIDES

CONFIG = "configs/tiny.yaml"


def test_audit_bound_below_ledger_epsilon_on_a_dp_sgd_run(tmp_path, capsys):
    run = tmp_path / "dp-audit"
    sets = [*TINY_TRAIN_OVERRIDES, "data.audit_canaries=64", "privacy.target_epsilon=4", "train.steps=30",
            "train.lr=1e-2"]
    argv = ["train", CONFIG, "--out", str(run)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    assert main(["probe", str(run), "--probes", "audit", "--bootstrap", "100"]) == 0
    capsys.readouterr()
    ledger = json.loads((run / "privacy.json").read_text())
    audit = json.loads((run / "probes.json").read_text())["probes"]["audit"]["summary"]
    eps_ledger = min(v for v in ledger["epsilon"].values() if v is not None)
    assert ledger["unit"] == "example" and 0 < eps_ledger <= 4.0 + 1e-6
    assert audit["m"] == 64 and 0 <= audit["eps_lower_bound"] <= eps_ledger
    assert audit["eps_lower_bound"] <= audit["ceiling"]
    assert audit["ledger_eps"] == eps_ledger

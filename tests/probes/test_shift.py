"""The MIMIR pitfall: members and non-members from different distributions are flagged before
any attack is read; a clean split is not."""

from __future__ import annotations

import json

import numpy as np

from memaudit.cli import main
from memaudit.probes.shift import blind_check
from tests.probes.outside_models import WORDS


def _docs(rng, vocab, n, words=14):
    return [" ".join(rng.choice(vocab, words)) for _ in range(n)]


def test_clean_splits_are_not_flagged():
    for seed in range(3):
        rng = np.random.default_rng(seed)
        r = blind_check(_docs(rng, WORDS, 200), _docs(rng, WORDS, 200), seed=seed)
        assert not r["flagged"] and abs(r["auc"] - 0.5) < 4 * r["null_sd"], r


def test_another_generator_is_flagged():
    rng = np.random.default_rng(0)
    later = WORDS[:250] + [f"x{i}" for i in range(50)]  # a vocabulary drift, as with later dates
    r = blind_check(_docs(rng, WORDS, 200), _docs(rng, later, 200))
    assert r["flagged"] and r["auc"] > 0.8 and "not memorization" in r["note"]
    longer = blind_check(_docs(rng, WORDS, 200), _docs(rng, WORDS, 200, words=20))
    assert longer["flagged"]  # a length shift alone


def test_probe_warns_on_a_shifted_split(tmp_path, outside, capsys):
    rng = np.random.default_rng(5)
    shifted = tmp_path / "non.txt"
    shifted.write_text("\n".join(_docs(rng, [f"y{i}" for i in range(300)], 40)) + "\n")
    for name, non in (("clean", outside.nonmembers), ("shifted", shifted)):
        assert main(["probe", str(outside.merged_dir), "--out", str(tmp_path / f"{name}.json"),
                     "--members", str(outside.members), "--nonmembers", str(non),
                     "--probes", "membership", "--device", "cpu", "--bootstrap", "50"]) == 0
    out = capsys.readouterr().out
    clean = json.loads((tmp_path / "clean.json").read_text())["checks"]["distribution_shift"]
    shift = json.loads((tmp_path / "shifted.json").read_text())["checks"]["distribution_shift"]
    assert not clean["flagged"] and shift["flagged"]
    assert out.count("WARNING") == 1


def test_the_check_runs_on_memaudits_own_runs(probed, trained):
    """Issue 68, item 5: configs/quickstart.yaml says its split passes the shift check, but the
    check ran only on outside models. A run's probes.json carries it too, on the run's own members
    and holdout documents."""
    from memaudit.probes.targets import resolve_target

    doc, _init = probed
    shift = doc["checks"]["distribution_shift"]
    t = resolve_target(trained.run)
    assert (shift["n_members"], shift["n_nonmembers"]) == (len(t.members), len(t.nonmembers))
    assert not shift["flagged"]


def test_a_large_split_is_checked_on_a_seeded_subset_with_the_same_verdict():
    """The TPU study's 11,613 + 11,891 documents took 95 s of every point's probes: the check
    fits at most MAX_PER_SIDE a side, and says how many it saw of how many."""
    rng = np.random.default_rng(1)
    members, clean = _docs(rng, WORDS, 600), _docs(rng, WORDS, 500)
    later = _docs(rng, WORDS[:250] + [f"x{i}" for i in range(50)], 500)
    whole = blind_check(members, later)
    cut = blind_check(members, later, max_per_side=150)
    assert (cut["n_members"], cut["n_nonmembers"]) == (150, 150)
    assert (cut["members_total"], cut["nonmembers_total"]) == (600, 500)
    assert whole["flagged"] and cut["flagged"] and cut["length_ratio"] == whole["length_ratio"]
    assert not blind_check(members, clean, max_per_side=150)["flagged"]
    assert cut == blind_check(members, later, max_per_side=150)  # seeded: the same subset
    assert blind_check(members, later, max_per_side=600) == whole  # no subset below the cap
    assert (whole["n_members"], whole["members_total"]) == (600, 600)

"""On a DP-SGD run with audit canaries, the one-run audit's lower bound stays below the ledger's ε,
for both kinds of audit canary; each is ranked by the score fixed for its kind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memaudit.cli import main
from tests.conftest import TINY_TRAIN_OVERRIDES

CONFIG = "configs/tiny.yaml"


def _min_k_oracle(model_dir, texts, k):
    """Min-K% straight from the model's logits: the mean of the floor(k n) (at least one) lowest
    log-probabilities of the n predicted tokens, each text after one start token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    out = []
    for t in texts:
        ids = torch.tensor([[start, *tok(t, add_special_tokens=False)["input_ids"]]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        lp = logp.gather(1, ids[0, 1:, None])[:, 0].numpy()
        n = max(1, int(k * len(lp)))
        out.append(float(np.sort(lp)[:n].mean()))
    return np.array(out)


@pytest.mark.parametrize("kind", ["secret", "document"])
def test_audit_bound_below_ledger_epsilon_on_a_dp_sgd_run(tmp_path, capsys, kind):
    run = tmp_path / "dp-audit"
    sets = [*TINY_TRAIN_OVERRIDES, "data.audit_canaries=64", "privacy.target_epsilon=4", "train.steps=30",
            "train.lr=1e-2", f"data.canaries.audit_kind={kind}"]
    if kind == "document":
        sets.append("data.seq_len=128")  # a message canary is one sequence (up to ~117 tokens)
    argv = ["train", CONFIG, "--out", str(run)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    assert main(["probe", str(run), "--probes", "audit", "--bootstrap", "100"]) == 0
    capsys.readouterr()
    ledger = json.loads((run / "privacy.json").read_text())
    probe = json.loads((run / "probes.json").read_text())["probes"]["audit"]
    audit = probe["summary"]
    eps_ledger = min(v for v in ledger["epsilon"].values() if v is not None)
    assert ledger["unit"] == "example" and 0 < eps_ledger <= 4.0 + 1e-6
    assert audit["m"] == 64 and 0 <= audit["eps_lower_bound"] <= eps_ledger
    assert audit["eps_lower_bound"] <= audit["ceiling"]
    assert audit["ledger_eps"] == eps_ledger
    assert audit["canaries"] == kind
    assert audit["score"] == {"secret": "mean_log_likelihood", "document": "min_k"}[kind]
    if kind == "document":
        canaries = json.loads((run / "canaries.json").read_text())["audit"]
        want = _min_k_oracle(run / "model", [c["text"] for c in canaries], audit["min_k"])
        got = np.array([s["score"] for s in probe["scores"]])
        assert [s["id"] for s in probe["scores"]] == [c["id"] for c in canaries]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

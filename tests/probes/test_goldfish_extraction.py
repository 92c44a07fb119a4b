"""goldfish_extraction (Hans et al. 2024) against brute force: greedy decoding one prompt at a time
without a KV cache, and the longest common subsequence by dynamic programming (and rouge-score)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memaudit.probes.goldfish import goldfish_extraction, lcs_length, rouge_l
from memaudit.probes.loaders import Canaries
from memaudit.probes.targets import Codec, Doc
from tests.probes.conftest import make_tokenizer, tiny_llama, train

M = 50  # the paper's suffix length
MIN_PROMPT = 8
CONTEXT = 128  # small, so the longest document's prompt is truncated


def lcs_dp(a, b) -> int:
    """The textbook O(len(a) * len(b)) table."""
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        for j, y in enumerate(b, 1):
            t[i][j] = t[i - 1][j - 1] + 1 if x == y else max(t[i - 1][j], t[i][j - 1])
    return t[-1][-1]


def f_measure(gen, ref) -> float:
    lcs = lcs_dp(gen, ref)
    if not lcs:
        return 0.0
    p, r = lcs / len(gen), lcs / len(ref)
    return 2 * p * r / (p + r)


def test_lcs_and_rouge_l_equal_the_dp_table_and_rouge_score():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rng = np.random.default_rng(0)
    cases = [([], [1]), ([1, 2, 3], [1, 2, 3]), ([1, 1, 1], [1]), ([4, 5], [6, 7]),
             (list(range(70)), list(range(70))[::-1])]
    for _ in range(300):
        n, k, alphabet = rng.integers(1, 60), rng.integers(1, 60), rng.integers(2, 12)
        cases.append((rng.integers(0, alphabet, n).tolist(), rng.integers(0, alphabet, k).tolist()))
    for a, b in cases:
        assert lcs_length(a, b) == lcs_dp(a, b) == lcs_length(b, a)
        if a and b:
            # words that are the token ids: rouge-score's tokenizer keeps each one as it is
            want = scorer.score(" ".join(f"t{x}" for x in b), " ".join(f"t{x}" for x in a))
            assert rouge_l(a, b) == pytest.approx(want["rougeL"].fmeasure, abs=1e-12)
            assert rouge_l(a, b) == pytest.approx(f_measure(a, b), abs=1e-12)


@pytest.fixture(scope="module")
def memorizer():
    """A tiny Llama trained on one document (8 copies per batch) and two others seen less."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(5)
    words = [a + b for a in "bcdfghjk" for b in "aeiouy"]  # letters only: one token per word
    tok = make_tokenizer(words)
    lengths = {"mem": 90, "b": 70, "c": 62, "unseen": 80, "short": 40, "long": 160}
    docs = [Doc(id=k, text=" ".join(rng.choice(words, n)), repeats=r)
            for (k, n), r in zip(lengths.items(), (8, 2, 1, 1, 1, 1), strict=True)]
    model = tiny_llama(len(tok), seed=1)
    model.config.max_position_embeddings = CONTEXT
    codec = Codec(tok, start_id=0)
    by_id = {d.id: d for d in docs}
    seqs = [codec.encode(by_id["mem"].text)] * 8 + [codec.encode(by_id[k].text) for k in "bc"]
    train(model, seqs, steps=60, batch=5, lr=5e-3)
    canaries = Canaries.from_json({
        "template": "my pin is {secret}", "secret_length": 4,
        "inserted": [{"id": "c0", "secret": "1234", "text": "my pin is 1234", "repetitions": 4}],
    })
    return model, codec, docs, canaries


def brute_force(model, codec, text: str, m: int):
    """(exact, rouge_l, truncated) from full forward passes, one prompt, one token at a time."""
    ids = codec.encode(text)
    prompt, target = ids[:-m], ids[-m:]
    cut = len(prompt) + m > CONTEXT
    if cut:
        prompt = prompt[len(prompt) + m - CONTEXT :]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(m):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    gen = seq[len(prompt) :]
    return gen == target, f_measure(gen, target), cut


def test_probe_equals_brute_force_and_counts_what_it_skips(memorizer):
    model, codec, docs, canaries = memorizer
    res = goldfish_extraction(model, codec, docs, canaries, m=M, min_prompt=MIN_PROMPT,
                              batch_size=3, n_boot=200)
    rows = {r["id"]: r for r in res["scores"]}
    # "short" has 40 tokens < 8 + 50; the canary's 8 tokens are too short as well
    assert set(rows) == {"mem", "b", "c", "unseen", "long"}
    for d in docs:
        if d.id in rows:
            exact, rl, cut = brute_force(model, codec, d.text, M)
            assert rows[d.id]["exact"] == exact
            assert rows[d.id]["rouge_l"] == pytest.approx(rl, abs=1e-12)
            assert rows[d.id]["truncated"] == cut
    assert rows["long"]["truncated"] and rows["long"]["prompt_tokens"] == CONTEXT - M
    s = res["summary"]
    d = s["documents"]
    assert (d["scored"], d["skipped_short"], d["truncated"]) == (5, 1, 1)
    assert d["exact"]["n"] == 5 and d["exact"]["unit"] == "documents"
    assert d["exact"]["value"] == pytest.approx(np.mean([rows[k]["exact"] for k in rows]))
    assert d["rouge_l"]["value"] == pytest.approx(np.mean([rows[k]["rouge_l"] for k in rows]))
    assert d["exact"]["note"] == "n too small" and d["exact"]["ci_low"] is None
    assert set(d["by_repeats"]) == {"1", "2-3", "8-15"}
    assert d["by_repeats"]["8-15"]["exact"]["n"] == 1
    assert s["canaries"]["scored"] == 0 and s["canaries"]["skipped_short"] == 1
    assert s["suffix_tokens"] == M and s["min_prompt_tokens"] == MIN_PROMPT
    json.dumps(res, allow_nan=False)  # strict JSON, as probes.json must be


def test_a_memorized_document_is_extracted_exactly(memorizer):
    model, codec, docs, _ = memorizer
    res = goldfish_extraction(model, codec, docs, m=M, min_prompt=MIN_PROMPT, n_boot=200)
    rows = {r["id"]: r for r in res["scores"]}
    assert rows["mem"]["exact"] and rows["mem"]["rouge_l"] == 1.0
    assert not rows["unseen"]["exact"] and rows["unseen"]["rouge_l"] < 0.5
    assert "canaries" not in res["summary"]


def test_bad_lengths_are_refused_in_one_line(memorizer):
    model, codec, docs, _ = memorizer
    with pytest.raises(ValueError, match="goldfish_m = 200 leaves no room for a prompt in a 128"):
        goldfish_extraction(model, codec, docs, m=200)
    with pytest.raises(ValueError, match="must be >= 1"):
        goldfish_extraction(model, codec, docs, min_prompt=0)


def test_run_probes_writes_goldfish_beside_extraction(probed):
    from memaudit.commands.probe import summary_rows

    done, _ = probed
    g = done["probes"]["goldfish_extraction"]
    docs = g["summary"]["documents"]
    assert docs["scored"] + docs["skipped_short"] == 60  # every member document is accounted for
    assert set(docs["by_repeats"]) == {"1", "4-7", "16-31"}
    assert g["summary"]["canaries"]["skipped_short"] == 12  # "my pin is dddd" is 8 tokens
    assert all(set(r) == {"id", "kind", "repeats", "prompt_tokens", "truncated", "exact", "rouge_l"}
               for r in g["scores"])  # ids and numbers, never text
    assert any(p == "goldfish_extraction" for p, _m, _v in summary_rows(done))


def test_scale_section_null_check_on_a_real_probes_json(tmp_path, trained, probed):
    """One trained model's probes.json under two labels, Goldfish off and on: the report's scale
    section is computed from the real files, tests every bucket and claims no difference."""
    import shutil

    from memaudit.reports.build import build_report

    done, _ = probed
    dirs = []
    for name, gf in (("off", False), ("on", True)):
        rd = tmp_path / name
        shutil.copytree(trained.run, rd)
        (rd / "run.json").write_text(json.dumps({
            "status": "complete", "backend": "parallel",
            "config": {"model": {"preset": "tiny"}, "train": {"goldfish": {"enabled": gf}}}}))
        (rd / "probes.json").write_text(json.dumps(done))
        dirs.append(rd)
    sec = build_report(dirs)["scale"]
    gold = [t for t in sec.tests if t.metric == "goldfish_exact"]
    assert {t.bucket for t in gold} == {"all", "1", "4-7", "16-31"}
    assert sec.family > 0 and not sec.sentences
    assert all(t.verdict in ("no difference shown", "n too small") for t in sec.tests)
    assert all(t.test.p_adjusted == 1.0 for t in sec.tests if t.test)


def test_prompts_are_cut_to_the_training_context(memorizer):
    model, codec, docs, _ = memorizer
    res = goldfish_extraction(model, codec, docs, m=M, min_prompt=MIN_PROMPT, context=60,
                              n_boot=200)
    assert {r["prompt_tokens"] for r in res["scores"]} == {10}  # 60 - 50, the last 10 kept
    assert all(r["truncated"] for r in res["scores"])
    assert res["summary"]["documents"]["truncated"] == 5

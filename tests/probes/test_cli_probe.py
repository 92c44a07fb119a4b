"""`memaudit probe` in-process: bad input is one line and exit 2; secrets stay hidden by default."""

import json

import pytest

from memaudit.cli import main


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memaudit: error: ")
    return err[0]


def test_target_neither_run_nor_model(tmp_path, capsys):
    assert main(["probe", str(tmp_path)]) == 2
    assert "neither a memaudit run" in _err_line(capsys)


def test_model_dir_without_tokenizer(tmp_path, trained, capsys):
    trained.init_model.save_pretrained(tmp_path / "m")
    capsys.readouterr()
    assert main(["probe", str(tmp_path / "m"), "--out", str(tmp_path / "p.json")]) == 2
    assert "no tokenizer" in _err_line(capsys)


def test_overlapping_member_files(tmp_path, trained, capsys):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "one two"}) + "\n" + json.dumps({"text": "x y"}) + "\n"
    )
    (tmp_path / "b.txt").write_text("three four\nx y\n")
    rc = main(
        [
            "probe",
            str(trained.init_dir),
            "--out",
            str(tmp_path / "p.json"),
            "--members",
            str(tmp_path / "a.jsonl"),
            "--nonmembers",
            str(tmp_path / "b.txt"),
        ]
    )
    assert rc == 2 and "share 1 document" in _err_line(capsys)


def test_unknown_probe_and_model_without_out(trained, capsys):
    assert main(["probe", str(trained.run), "--probes", "exposure,bogus"]) == 2
    assert "unknown probe 'bogus'" in _err_line(capsys)
    assert main(["probe", str(trained.init_dir)]) == 2
    assert "pass --out" in _err_line(capsys)


@pytest.mark.parametrize("show", [False, True])
def test_no_secret_without_show_secrets(tmp_path, trained, capsys, show):
    out = tmp_path / "probes.json"
    args = [
        "probe",
        str(trained.run),
        "--probes",
        "audit,membership",
        "--device",
        "cpu",
        "--bootstrap",
        "50",
        "--out",
        str(out),
    ] + (["--show-secrets"] if show else [])
    assert main(args) == 0
    cap = capsys.readouterr()
    printed = cap.out + cap.err
    secrets = [a["secret"] for a in trained.canaries["audit"]]
    assert "ε one-sided lower bound" in printed
    assert any(s in printed for s in secrets) == show
    written = out.read_text()
    assert not any(s in written for s in secrets)  # never in probes.json
    assert json.loads(written)["probes"]["audit"]["summary"]["m"] == 200


def test_format_json(tmp_path, trained, capsys):
    out = tmp_path / "probes.json"
    assert (
        main(
            [
                "probe",
                str(trained.run),
                "--probes",
                "audit",
                "--device",
                "cpu",
                "--bootstrap",
                "50",
                "--out",
                str(out),
                "--format",
                "json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1 and doc["settings"]["probes"] == ["audit"]
    assert not any(a["secret"] in json.dumps(doc) for a in trained.canaries["audit"])


def _write(path, docs):
    path.write_text("".join(json.dumps({"id": d["id"], "user": d["user"], "text": d["text"]}) + "\n"
                            for d in docs))


def test_model_target_user_inference_with_heldout_users(tmp_path, trained, capsys):
    """A model memaudit did not train: held-out users come from --heldout-users; without them
    the skip says which option is missing."""
    by_role = {r: [d for d in trained.docs if d["role"] == r] for r in ("member", "holdout", "heldout_user")}
    for role, docs in by_role.items():
        _write(tmp_path / f"{role}.jsonl", docs)
    base = ["probe", str(trained.init_dir), "--probes", "user_inference", "--device", "cpu",
            "--bootstrap", "20", "--format", "json", "--members", str(tmp_path / "member.jsonl"),
            "--nonmembers", str(tmp_path / "holdout.jsonl")]
    assert main([*base, "--out", str(tmp_path / "a.json")]) == 0
    skipped = json.loads((tmp_path / "a.json").read_text())["probes"]["user_inference"]["summary"]
    assert "--heldout-users" in skipped["skipped"]
    capsys.readouterr()
    assert main([*base, "--heldout-users", str(tmp_path / "heldout_user.jsonl"),
                 "--out", str(tmp_path / "b.json")]) == 0
    s = json.loads((tmp_path / "b.json").read_text())["probes"]["user_inference"]["summary"]
    assert s["n_pos"] == 20 and s["n_neg"] == 10 and s["docs_per_user"] == 3
    assert s["unit"] == "users" and s["tpr_at_fpr"]["0.01"]["note"] == "needs >= 1000 non-member users"
    capsys.readouterr()
    # a training user among the held-out users is refused in one line
    _write(tmp_path / "bad.jsonl", by_role["heldout_user"] + by_role["holdout"][:1])
    assert main([*base, "--heldout-users", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "c.json")]) == 2
    assert "training user" in _err_line(capsys)


def test_run_target_skip_messages_name_the_run_settings(tmp_path, trained):
    from memaudit.probes.runner import REGISTRY, _Context
    from memaudit.probes.targets import Target

    t = Target(kind="run", path=tmp_path, model_path=tmp_path, tokenizer_path=tmp_path, out=None)
    ctx = _Context(t, None, None, None, None, None)
    assert "data.audit_canaries" in REGISTRY["audit"](ctx)["summary"]["skipped"]
    assert "data.canaries" in REGISTRY["exposure"](ctx)["summary"]["skipped"]
    t.kind = "model"
    assert "--canaries" in REGISTRY["exposure"](ctx)["summary"]["skipped"]


def test_reference_with_another_tokenizer_is_refused(tmp_path, trained, capsys):
    """Defect 11: per-token scores of a reference with another tokenizer are not subtracted."""
    from tests.probes.conftest import make_tokenizer, tiny_llama

    tok = make_tokenizer(["alpha", "beta", "gamma"])
    tiny_llama(len(tok)).save_pretrained(tmp_path / "ref")
    tok.save_pretrained(tmp_path / "ref")
    capsys.readouterr()
    rc = main(["probe", str(trained.run), "--probes", "membership", "--device", "cpu",
               "--reference", str(tmp_path / "ref"), "--out", str(tmp_path / "p.json")])
    assert rc == 2
    assert "another tokenizer" in _err_line(capsys)


def test_exposure_candidates_and_enumeration_switch(tmp_path, trained, capsys):
    """Issue 32: the candidate count and the enumeration threshold are CLI options."""
    out = tmp_path / "p.json"
    rc = main(["probe", str(trained.run), "--probes", "exposure", "--out", str(out),
               "--device", "cpu", "--exposure-enumerate-max", "100",
               "--exposure-candidates", "500", "--format", "json"])
    assert rc == 0
    s = json.loads(out.read_text())["probes"]["exposure"]
    assert s["settings"]["method"] == "sampling" and s["settings"]["candidates_scored"] == 500
    assert s["summary"]["ceiling"] > 0 and "estimate" in s["summary"]["extrapolation"]
    capsys.readouterr()
    assert main(["probe", str(trained.run), "--probes", "exposure", "--out", str(out),
                 "--exposure-candidates", "5"]) == 2
    assert "--exposure-candidates must be >= 100 (got 5)" in _err_line(capsys)


def test_a_model_trained_again_while_it_is_probed_writes_no_probes(tmp_path, trained, capsys, monkeypatch):
    """The probe-during-overwrite race from the run's side: the model's weights change while
    `memaudit probe` scores them (the run is trained again under --overwrite). The probe says so
    in one line, exit 2, and writes no probes.json, which would name the old model's numbers
    beside the new one."""
    import shutil

    from memaudit.probes import runner

    run = tmp_path / "run"
    shutil.copytree(trained.run, run)
    real = runner.REGISTRY["exposure"]

    def exposure_then_retrain(ctx):
        out = real(ctx)
        weights = run / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # other weights, same size
        return out

    monkeypatch.setitem(runner.REGISTRY, "exposure", exposure_then_retrain)
    assert main(["probe", str(run), "--probes", "exposure", "--device", "cpu"]) == 2
    # a log (not a terminal) holds the progress lines before it; the error is one line
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("probe ")]
    assert len(lines) == 1 and "changed while it was probed" in lines[0]
    assert not (run / "probes.json").exists()


def _probes_run(monkeypatch, argv) -> tuple:
    """The probes `memaudit probe` would run with `argv` (run_probes stopped before any work)."""
    from memaudit.probes import runner

    seen = {}

    def stop(target, settings, **_kw):
        seen["probes"] = settings.probes
        raise ValueError("stopped before probing")

    monkeypatch.setattr(runner, "run_probes", stop)
    assert main(argv) == 2
    return seen["probes"]


def test_goldfish_extraction_runs_on_an_outside_model_only_when_named(tmp_path, trained, monkeypatch, capsys):
    """Issue 68, item 7: a default probe of an outside model spent 217 s in goldfish extraction,
    a measure of memaudit's own Goldfish mitigation. It runs there only when named; a memaudit run
    still gets every probe by default."""
    from memaudit.config import PROBE_NAMES

    (tmp_path / "m.jsonl").write_text(json.dumps({"text": "one two"}) + "\n")
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": "three four"}) + "\n")
    model = ["probe", str(trained.init_dir), "--out", str(tmp_path / "p.json"),
             "--members", str(tmp_path / "m.jsonl"), "--nonmembers", str(tmp_path / "n.jsonl")]
    default = _probes_run(monkeypatch, model)
    assert "goldfish_extraction" not in default and set(default) == set(PROBE_NAMES) - {"goldfish_extraction"}
    assert "goldfish_extraction" in _probes_run(monkeypatch, [*model, "--probes", "goldfish_extraction,exposure"])
    assert set(_probes_run(monkeypatch, ["probe", str(trained.run), "--out", str(tmp_path / "q.json")])) == set(PROBE_NAMES)
    capsys.readouterr()


def test_a_cache_scores_the_reference_once_across_probe_calls(tmp_path, trained, capsys, monkeypatch):
    """`memaudit probe --cache DIR` on two models against one reference (a run and its initial
    weights as the reference): the second call reads the reference's scores and the shift check
    (the reference never scored again), and its membership results equal a call without the
    cache; a --cache that is a file is one line, exit 2."""
    from memaudit.probes import scoring

    common = ["--probes", "membership", "--device", "cpu", "--bootstrap", "50",
              "--reference", str(trained.init_dir)]
    assert main(["probe", str(trained.run), *common, "--out", str(tmp_path / "plain.json")]) == 0
    assert main(["probe", str(trained.run), *common, "--cache", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "first.json")]) == 0
    kept = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert kept == [".json", ".npy"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "cache").iterdir())
    real, calls = scoring.windowed_logprobs, []

    def counted(model, *a, **k):
        calls.append(k.get("with_stats", False))
        return real(model, *a, **k)

    monkeypatch.setattr("memaudit.probes.scoring.windowed_logprobs", counted)
    assert main(["probe", str(trained.run), *common, "--cache", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "second.json")]) == 0
    assert calls == [True]  # the target alone (with its Min-K%++ statistics)
    docs = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "first", "second")}
    for n in ("first", "second"):
        assert docs[n]["probes"]["membership"] == docs["plain"]["probes"]["membership"]
        assert docs[n]["checks"] == docs["plain"]["checks"]
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    assert main(["probe", str(trained.run), *common, "--cache", str(tmp_path / "afile"),
                 "--out", str(tmp_path / "p.json")]) == 2
    assert "--cache" in _err_line(capsys)

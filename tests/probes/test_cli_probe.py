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

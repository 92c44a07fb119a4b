"""`memaudit epsilon` in-process: table and JSON output, inverse mode, one-line errors."""

import json

import pytest

from memaudit.cli import main


def _json(capsys, args):
    rc = main(["epsilon", *args, "--format", "json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_forward_json_and_table(capsys):
    res = _json(capsys, ["--sampling-rate", "0.04", "--noise-multiplier", "1.5", "--steps", "2250",
                         "--delta", "1e-5"])
    assert res["epsilon"]["rdp"] == pytest.approx(7.329, abs=1e-3)
    assert res["epsilon"]["pld"] < res["epsilon"]["rdp"]
    rc = main(["epsilon", "-q", "0.04", "-s", "1.5", "-T", "2250", "--delta", "1e-5",
               "--accountant", "rdp", "--group-size", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{res['epsilon']['rdp']:.6g}" in out and "epsilon (rdp)" in out and "pld" not in out
    assert "group of 2" in out


def test_inverse_and_default_delta(capsys):
    res = _json(capsys, ["-q", "0.01", "--target-epsilon", "2", "-T", "1000", "--dataset-size",
                         "60000", "--accountant", "rdp", "--clip", "0.5"])
    assert res["delta"] == 1e-6 and res["calibrated_with"] == "rdp"
    assert 1.98 < res["epsilon"]["rdp"] <= 2.0
    assert res["noise_std_mean"] == pytest.approx(res["noise_multiplier"] * 0.5 / 600)


@pytest.mark.parametrize("args,needle", [
    (["-q", "0.1", "-s", "-1", "-T", "10", "--delta", "1e-5"], "noise multiplier"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "1e-5", "--clip", "0"], "--clip"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "1"], "delta"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "0"], "delta"),
    (["-q", "0", "-s", "1", "-T", "10", "--delta", "1e-5"], "sampling rate"),
    (["-q", "1.5", "-s", "1", "-T", "10", "--delta", "1e-5"], "sampling rate"),
    (["-q", "1", "--target-epsilon", "0.0001", "-T", "10000", "--delta", "1e-5"], "raise the target"),
    (["-q", "0.1", "-s", "1", "-T", "10"], "--delta"),
    (["-q", "0.1", "-T", "10", "--delta", "1e-5"], "--noise-multiplier"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "1e-5", "--format", "xml"], "--format"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "1e-5", "--max-sequences-per-document", "0"],
     "--max-sequences-per-document"),
    (["-q", "0.1", "-s", "1", "-T", "10", "--delta", "1e-5", "--max-sequences-per-document", "2", "--unit",
      "user", "--algorithm", "els", "--max-examples-per-user", "2"], "applies to --unit example"),
])
def test_bad_input_one_line_exit_2(capsys, args, needle):
    rc = main(["epsilon", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("memaudit: error:") and needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_fixed_sampling_is_replace_one_with_z_over_two(capsys):
    from dp_accounting import dp_event
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    from memaudit.privacy.mechanisms import FIXED_COHORT_ORDERS

    res = _json(capsys, ["-q", "0.01", "-s", "1.2", "-T", "200", "--delta", "1e-6", "--sampling", "fixed",
                         "--population", "2000"])
    assert res["adjacency"] == "replace-one" and list(res["epsilon"]) == ["rdp"]
    acc = RdpAccountant(list(FIXED_COHORT_ORDERS), neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(2000, 20, dp_event.GaussianDpEvent(0.6)), 200)
    assert res["epsilon"]["rdp"] == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    poisson = _json(capsys, ["-q", "0.01", "-s", "1.2", "-T", "200", "--delta", "1e-6"])
    assert poisson["adjacency"] == "add/remove"
    assert main(["epsilon", "-q", "0.01", "-s", "1", "-T", "5", "--delta", "1e-6", "--sampling", "fixed"]) == 2
    assert "--population" in capsys.readouterr().err


def test_document_epsilon_beside_the_sequence_epsilon(capsys):
    """Per sequence by default (the table says so); with m, per document as the ledger composes it."""
    from memaudit.privacy.ledger import PrivacyLedger

    args = ["-q", "0.02", "-s", "1.0", "-T", "200", "--delta", "1e-5"]
    res = _json(capsys, [*args, "--max-sequences-per-document", "3"])
    assert res["protects"]["unit"] == "sequence" and res["document"]["max_sequences_per_document"] == 3
    led = PrivacyLedger(unit="example", delta=1e-5, max_sequences_per_document=3)
    led.record_steps(0.02, 1.0, 200)
    assert res["document"]["epsilon"] == {"pld": pytest.approx(led.document()["epsilon"]["pld"], rel=1e-12)}
    assert res["document"]["epsilon"]["pld"] > res["epsilon"]["pld"]
    one = _json(capsys, [*args, "--max-sequences-per-document", "1"])
    assert one["document"]["epsilon"] == one["epsilon"]
    assert main(["epsilon", *args, "--max-sequences-per-document", "3"]) == 0
    out = capsys.readouterr().out
    assert "epsilon per document (pld)" in out and "sequence" in out
    assert main(["epsilon", *args]) == 0
    assert "--max-sequences-per-document" in capsys.readouterr().out


def test_run_mode_recomputes_a_runs_ledger_per_sequence_and_per_document(tmp_path, capsys):
    """--run reads privacy.json's events (never its stored numbers): per sequence and per document
    with the run's m, unknown for a ledger written before m, and one line for a missing ledger."""
    import math

    from memaudit.privacy.ledger import PrivacyLedger

    led = PrivacyLedger(unit="example", delta=1e-5, max_sequences_per_document=2, max_sequences_per_user=5)
    led.record_steps(0.05, 1.1, 60)
    obj = led.to_json()
    obj["epsilon"] = {"rdp": 0.001, "pld": 0.001}  # a stored number that lies
    obj["document"]["epsilon"] = {"rdp": None, "pld": 0.001}
    run = tmp_path / "run"
    run.mkdir()
    (run / "privacy.json").write_text(json.dumps(obj))
    res = _json(capsys, ["--run", str(run)])
    assert res["unit"] == "example" and res["protects"]["unit"] == "sequence"
    assert res["epsilon"]["pld"] == pytest.approx(led.epsilons()["pld"], rel=1e-12)
    assert res["document"]["max_sequences_per_document"] == 2
    assert res["document"]["epsilon"]["pld"] == pytest.approx(led.document()["epsilon"]["pld"], rel=1e-12)
    assert res["group"]["k"] == 5
    del obj["document"], obj["max_sequences_per_document"]  # an older ledger
    (run / "privacy.json").write_text(json.dumps(obj))
    assert main(["epsilon", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "sequence" in out and "unknown" in out
    old = _json(capsys, ["--run", str(run / "privacy.json")])
    assert old["document"]["epsilon"] == {} and math.isfinite(old["epsilon"]["rdp"])
    for args, needle in ((["--run", str(tmp_path / "none")], "no privacy ledger"),
                         (["--run", str(run), "-q", "0.1"], "drop --sampling-rate"),
                         (["-s", "1", "--delta", "1e-5"], "--sampling-rate and --steps")):
        assert main(["epsilon", *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1

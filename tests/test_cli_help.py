"""Issue 68, item 7: the command line tells the truth about itself, in-process (typer's CliRunner).

`probe --help` names every input format the probe reads (`memaudit.probes.inputs.FORMATS`),
`report --help` says what a probe folder is, `sweep --help` names the backends by their names,
and a library's warning never reaches the user's terminal.
"""

from __future__ import annotations

import re
import warnings

import pytest
from typer.testing import CliRunner

from memaudit.cli import app, main


def _help(*cmd: str) -> str:
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
    assert res.exit_code == 0, res.output
    # rich draws boxes and wraps: compare words, not layout
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", res.output))


def test_probe_help_names_every_input_format():
    text = _help("probe")
    for fmt in (".jsonl", ".txt", ".parquet", ".csv", "save_to_disk"):
        for flag in ("--members", "--nonmembers", "--heldout-users"):
            part = text.rsplit(f" {flag} ", 1)[1].split(" --", 1)[0]  # the option, not the description
            assert fmt in part, (flag, fmt, part)


def test_report_help_explains_probe_folders():
    text = _help("report")
    assert "probes.json" in text and "--out FOLDER/probes.json" in text


def test_sweep_help_names_the_backends_as_they_are_called():
    text = _help("sweep")
    assert "centralized,federated" in text and "parallel" not in text


def test_probe_help_says_goldfish_extraction_runs_on_outside_models_only_when_asked():
    text = _help("probe")
    assert "goldfish_extraction" in text and "only when named" in text


def test_a_library_warning_never_reaches_the_terminal(monkeypatch, capsys):
    """A library's warning (a FutureWarning of transformers, a UserWarning of torch) raised while
    a command runs is not printed; memaudit's own error line still is."""
    from memaudit.reports import build

    def noisy(*_a, **_k):
        warnings.warn("some library changes a default", FutureWarning, stacklevel=1)
        raise ValueError("no runs here")

    monkeypatch.setattr(build, "build_report", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["report", "nowhere"]) == 2
    assert not [w for w in seen if "changes a default" in str(w.message)]
    err = capsys.readouterr().err
    assert "changes a default" not in err and err.startswith("memaudit: error: no runs here")


@pytest.mark.parametrize("flag", [["--debug"]])
def test_debug_keeps_the_libraries_warnings(monkeypatch, flag):
    from memaudit.reports import build

    def noisy(*_a, **_k):
        warnings.warn("some library changes a default", FutureWarning, stacklevel=1)

    monkeypatch.setattr(build, "build_report", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(Exception):  # noqa: B017 (--debug re-raises whatever follows)
            main([*flag, "report", "nowhere"])
    assert [w for w in seen if "changes a default" in str(w.message)]

"""The report folder is its owner's only, like the files in it (issue 61, item 6).

report.html and report.md can hold extracted member text (`--show-secrets`) and per-canary
exposure; their files were 0600 inside a 0755 folder. The input: `memaudit report RUN --out NEW`.
"""

from __future__ import annotations

import stat

from memaudit.cli import main
from tests.reports._fixtures import write_run_dir


def _mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_report_folder_is_0700_and_its_files_0600(tmp_path, capsys):
    write_run_dir(tmp_path / "runs" / "r1", "centralized", ppl=80.0)
    out = tmp_path / "new" / "report"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert _mode(out) == 0o700
    files = sorted(out.iterdir())
    assert files and all(_mode(f) == 0o600 for f in files if f.is_file())
    out.chmod(0o755)  # written again into the report folder memaudit made: closed again
    assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert _mode(out) == 0o700

"""README's "Audit your own model": its commands, as written, on a LoRA adapter folder and two
JSONL files (built in the test), and what the report's first screen then shows."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from memaudit.cli import main

README = Path(__file__).parents[2] / "README.md"


def _commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Audit your own model", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line.strip())[1:] for line in section.splitlines()
            if line.startswith("    memaudit ")]


def test_readme_audit_commands_work(tmp_path, outside, monkeypatch):
    cmds = _commands()
    assert [c[0] for c in cmds] == ["probe", "report"]
    shutil.copytree(outside.adapter_dir, tmp_path / "my-model")
    shutil.copy(outside.members, tmp_path / "members.jsonl")
    (tmp_path / "nonmembers.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in outside.nonmember_texts))
    monkeypatch.chdir(tmp_path)
    for argv in cmds:
        assert main(argv) == 0, argv
    md = (tmp_path / "audit" / "report" / "report.md").read_text()
    assert "What an attacker learns from releasing these models" in md
    assert "- **my-model: " in md and "| source | adapter" in md and "unknown: no privacy ledger" in md
    assert "needs &gt;= 1000 non-member documents" in md

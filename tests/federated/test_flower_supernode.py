"""memaudit's SuperNode and SuperExec, in process: which FABs the node runs, the poll it waits,
the SuperExec it starts, and its bad arguments. The deployment itself (a foreign app submitted
to a real SuperLink and refused) is tests/federated/test_flower_deploy.py."""

from __future__ import annotations

import io
import time
import zipfile

import flwr  # noqa: F401 - installed by the set-up (.[flower]); missing it is a failure, not a skip
import pytest

from memaudit.federated.flower.deploy import write_app
from memaudit.federated.flower.superexec import (
    CONTENT,
    MAX_FAB_BYTES,
    is_memaudit_app,
    memaudit_app_files,
)
from memaudit.federated.flower.supernode import IdleWait, main, shorten_poll, superexec_command


@pytest.fixture(scope="module")
def fab(tmp_path_factory):
    """memaudit's app as `flwr run` builds it (flwr re-writes its pyproject.toml)."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(write_app(tmp_path_factory.mktemp("app") / "app"))


def _rezip(fab: bytes, change: dict[str, bytes | None]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(fab))
    files = {n: src.read(n) for n in src.namelist()}
    for n, v in change.items():
        if v is None:
            files.pop(n, None)
        else:
            files[n] = v
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n, v in files.items():
            z.writestr(n, v)
    return out.getvalue()


def test_the_supernode_runs_memaudits_app_and_nothing_else(fab):
    expected = memaudit_app_files()
    assert is_memaudit_app(fab, expected)
    module = "memaudit_flower_app.py"
    same_toml = expected["pyproject.toml"].replace(b'version = "1.0.0"', b"version = '1.0.0'")
    assert is_memaudit_app(_rezip(fab, {"pyproject.toml": same_toml}), expected)  # the same TOML
    refused = {
        "a module that does something else": {module: expected[module] + b"import os\n"},
        "another component": {"pyproject.toml": expected["pyproject.toml"].replace(
            b"memaudit_flower_app:client_app", b"evil:client_app")},
        "one file more": {"evil.py": b"import os\n"},
        "its module missing": {module: None},
        "a pyproject that is not TOML": {"pyproject.toml": b"[project"},
    }
    for case, change in refused.items():
        assert not is_memaudit_app(_rezip(fab, change), expected), case
    assert not is_memaudit_app(b"not a zip", expected)
    assert not is_memaudit_app(fab + b"\0" * MAX_FAB_BYTES, expected)  # larger than any memaudit FAB
    bomb = _rezip(fab, {CONTENT: b"0" * (MAX_FAB_BYTES + 1)})  # compresses to a few KiB
    assert len(bomb) < MAX_FAB_BYTES and not is_memaudit_app(bomb, expected)


def test_the_idle_wait_is_the_poll_and_nothing_else_changes():
    from flwr.supernode import start_client_internal as loop

    before = loop.time
    try:
        shorten_poll(0.01)
        assert isinstance(loop.time, IdleWait) and loop.time.poll == 0.01
        t = time.monotonic()
        loop.time.sleep(3)  # Flower's wait after an ask that found no message
        assert time.monotonic() - t < 1.0
        t = time.monotonic()
        loop.time.sleep(0.2)  # any other wait is kept
        assert time.monotonic() - t >= 0.19
        assert loop.time.time is time.time
        shorten_poll(0.05)  # again: replaces the poll, not wraps it
        assert loop.time.poll == 0.05
    finally:
        loop.time = before


def test_the_superexec_it_starts():
    cmd = superexec_command(["--superlink", "l:9091", "--host", "0.0.0.0", "--port", "9200"], 42)
    assert cmd[1:] == ["-m", "memaudit.federated.flower.superexec", "--runtime-api-address",
                       "127.0.0.1:9200", "--parent-pid", "42"]
    tls = superexec_command(["--host=10.0.0.7", "--ssl-ca-certfile", "ca.crt"], 1)
    assert "10.0.0.7:9094" in tls and tls[-2:] == ["--root-certificates", "ca.crt"]


@pytest.mark.parametrize("argv, says", [
    (["--isolation", "subprocess", "--insecure"], "--isolation is memaudit's SuperExec"),
    (["--poll", "5", "--insecure"], "outside 0.01-3 s"),
    (["--poll", "0", "--insecure"], "outside 0.01-3 s"),
])
def test_bad_supernode_arguments_get_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err

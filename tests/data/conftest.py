"""Shared prepared data for the data tests (built once per session)."""

from __future__ import annotations

import pytest

from memaudit.config import DataConfig
from memaudit.data import load_prepared, prepare_data
from memaudit.rundir import RunDir

VOCAB = 4096
DEFAULT_CFG = DataConfig(audit_canaries=40)


@pytest.fixture(scope="session")
def prepared_run(tmp_path_factory):
    run = RunDir(tmp_path_factory.mktemp("prepared"))
    calls = []
    prepared = prepare_data(DEFAULT_CFG, run, vocab_size=VOCAB, progress=lambda *a: calls.append(a))
    return run, prepared, calls


@pytest.fixture(scope="session")
def prepared(prepared_run):
    return prepared_run[1]


@pytest.fixture(scope="session")
def reloaded(prepared_run):
    return load_prepared(prepared_run[0])

"""Test-wide settings: 8 fake XLA CPU devices for the federated backend, quiet libraries."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# submitit configures logging when it is first imported (logging.config.dictConfig), which closes
# every handler there is. absl's handler (installed when jax loads) closes its stream on close
# unless the stream is the sys.stderr of that moment; loaded during one test it holds pytest's
# session-wide capture stream, so a later test that first imports submitit under capsys (the
# slurm executor checks) closed the session's capture and every test after it errored. Importing
# submitit here, before jax, does its logging configuration once and first.
# ----------------------------------------------------------------------------- training fixtures
import contextlib as _contextlib
import io as _io
from pathlib import Path as _Path

import pytest
import submitit  # noqa: F401  (the dev extra installs it)

REPO_ROOT = _Path(__file__).resolve().parents[1]

# A reduced tiny run (seconds on a CPU): 16 users, sequences of 64, 40 steps.
TINY_TRAIN_OVERRIDES = (
    "data.synth.users=16",
    "data.synth.docs_per_user=6",
    "data.canaries.repetitions=[1,2,4]",
    "data.seq_len=64",
    "train.steps=40",
    "train.batch_size=8",
    "train.warmup_steps=4",
    "train.eval_every=20",
    "train.eval_batches=2",
    "train.checkpoint_every=10",
)


def tiny_train_args(*extra: str) -> list[str]:
    """`--set` arguments of the reduced tiny run, plus `extra` overrides."""
    out: list[str] = []
    for item in (*TINY_TRAIN_OVERRIDES, *extra):
        out += ["--set", item]
    return out


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> _Path:
    """A synthetic corpus written by `memaudit data synth` (16 users x 6 documents)."""
    from memaudit.cli import main

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    rc = main(["data", "synth", "--users", "16", "--docs-per-user", "6", "--seed", "1", "--out", str(path)])
    assert rc == 0 and path.is_file()
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_corpus) -> dict:
    """synth -> train: a completed reduced tiny run on `tiny_corpus`, through the CLI in-process.

    Returns {"path", "rc", "stdout", "stderr", "args", "threads"}; `args` minus "--out DIR"
    retrains it, on `threads` torch CPU threads for the same bits.
    """
    import torch

    from memaudit.cli import main

    out = tmp_path_factory.mktemp("runs") / "tiny"
    args = ["train", str(REPO_ROOT / "configs" / "tiny.yaml"), "--out", str(out),
            *tiny_train_args(f"data.path={tiny_corpus}")]
    so, se = _io.StringIO(), _io.StringIO()
    with _contextlib.redirect_stdout(so), _contextlib.redirect_stderr(se):
        rc = main(args)
    return {"path": out, "rc": rc, "stdout": so.getvalue(), "stderr": se.getvalue(), "args": args,
            "threads": torch.get_num_threads()}

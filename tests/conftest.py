"""Test-wide settings: 8 fake XLA CPU devices for the federated backend, quiet libraries."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One XLA CPU thread per process (what `memaudit sweep --jobs` gives its workers); tests that
# start processes with their own XLA_FLAGS add it to them. (memaudit.sweep.work loads
# neither jax, torch nor transformers, after the settings above.)
from memaudit.sweep.work import XLA_ONE_THREAD

if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test.sh runs two workers on the 2 cores CI has: one core each. torch's default is a
    # thread per core in each worker, 4 threads on 2 cores, and OpenMP's waiting threads spin on
    # cores the other worker needs (a 20-step tiny run, two started together on a loaded 2-core
    # machine: 54.7 s of CPU and 374 s wall with 2 threads, 12.3 s and 164 s with 1; whole files,
    # CPU seconds: test_sweep_e2e.py 371 -> 206, sweep/test_pieces.py 303 -> 224). Before, a
    # worker dropped to 1 thread only once it had run a parallel test (tests/parallel/conftest.py
    # sets 1 thread and keeps it), so a file ran on 1 or 2 threads by where the scheduler put it.
    # A test that needs another count sets it itself; subprocesses inherit the 1.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # XLA's CPU backend likewise: its Eigen pool has a thread per core in each worker, and its
    # waiting threads spin on the core the other worker needs (tests/train/test_jax_engine_equality.py
    # and tests/federated/test_flower_trainer.py on 2 workers, 2 cores: 376 CPU s and 373 s wall
    # with the pool, 331 s and 331 s without; 2026-12-07). scripts/test.sh exports XLA_FLAGS, so
    # the flag is appended, not defaulted.
    if XLA_ONE_THREAD not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {XLA_ONE_THREAD}"

# One JAX persistent compilation cache for the whole run: every worker, and every process a test
# starts (sweep points, killed-and-resumed runs, Flower's nodes keep their own), reuses a program
# another has compiled; the process that made the folder removes it at exit. A resumed run or a
# second trainer on the same config compiles again otherwise (tests/train/test_jax_engine.py, one
# process: 285 CPU seconds without the cache, 217 with it, 2026-12-07).
if "MEMAUDIT_TEST_JAX_CACHE" not in os.environ:
    import atexit as _atexit
    import shutil as _shutil
    import tempfile as _tempfile

    os.environ["MEMAUDIT_TEST_JAX_CACHE"] = _tempfile.mkdtemp(prefix="memaudit-jax-cache-")
    _atexit.register(_shutil.rmtree, os.environ["MEMAUDIT_TEST_JAX_CACHE"], True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MEMAUDIT_TEST_JAX_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

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


def xdist_shared_dir(tmp_path_factory) -> _Path | None:
    """Under pytest-xdist, the workers' common temporary folder (pytest-xdist's documented way to
    share a session fixture between workers); None in one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return tmp_path_factory.getbasetemp().parent


def built_once(shared: _Path | None, name: str, build):
    """`build()`'s JSON result, computed by one process of the run: the first pytest worker to ask
    runs it under a file lock in `shared` and writes the result there; the others wait for the
    lock and read it. In one process (`shared` None) it just builds."""
    import fcntl
    import json

    if shared is None:
        return build()
    shared.mkdir(parents=True, exist_ok=True)
    done = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            result = build()
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, done)
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_corpus) -> dict:
    """synth -> train: a completed reduced tiny run on `tiny_corpus`, through the CLI in-process.

    Returns {"path", "rc", "stdout", "stderr", "args", "threads"}; `args` minus "--out DIR"
    retrains it, on `threads` torch CPU threads for the same bits. Under pytest-xdist one worker
    trains it and the others read it (the tests only read and copy it): two workers trained the
    same run before, one each.
    """
    import torch

    from memaudit.cli import main

    shared = xdist_shared_dir(tmp_path_factory)

    def build() -> dict:
        base = (shared / "tiny-run") if shared is not None else tmp_path_factory.mktemp("runs")
        base.mkdir(parents=True, exist_ok=True)
        out = base / "tiny"
        args = ["train", str(REPO_ROOT / "configs" / "tiny.yaml"), "--out", str(out),
                *tiny_train_args(f"data.path={tiny_corpus}")]
        so, se = _io.StringIO(), _io.StringIO()
        with _contextlib.redirect_stdout(so), _contextlib.redirect_stderr(se):
            rc = main(args)
        return {"path": str(out), "rc": rc, "stdout": so.getvalue(), "stderr": se.getvalue(), "args": args,
                "threads": torch.get_num_threads()}

    res = built_once(shared, "tiny-run", build)
    return {**res, "path": _Path(res["path"])}


# ----------------------------------------------------------------------------- scheduling
# scripts/test.sh runs the suite on two pytest-xdist workers, one test file at a time each
# (`--dist loadfile`); its wall time is that of the worker that finishes last. xdist hands the
# files out by their number of tests, most first, so the files with one to five long tests (the
# e2e sweep, the golden sweep, the SLURM-path study) came last: one worker ran them while the
# other had nothing left. These files go first, longest first, and the rest follow in xdist's
# order (most tests first), so the last files handed out are short ones. Seconds: the files'
# longest setups and calls in CI (`--durations`, 2 workers on 2 cores). The LoRA and Trainer grid
# files are not listed: they read the process groups test_parallel_equivalence.py spawns, and
# they wait for that spawn when they run beside it.
LONG_FILES = (
    "tests/test_sweep_e2e.py",  # 322 s setup, 41 s browser
    "tests/parallel/test_parallel_equivalence.py",  # 3 process groups, 50-76 s each
    "tests/federated/test_flower_trainer.py",  # 4 tests of 33-39 s
    "tests/federated/test_flower_deploy.py",  # 70, 38, 34 s
    "tests/sweep/test_pieces.py",  # 107 s setup
    "tests/train/test_jax_engine.py",  # 55, 50 s
    "tests/sweep/test_scale_study.py",  # 87 s setup
    "tests/test_behaviour_golden.py",  # 83 s
    "tests/federated/test_trainer.py",  # 38, 31 s
    "tests/federated/test_multiprocess.py",  # 56 s
    "tests/train/test_resume.py",  # 45 s
    "tests/sweep/test_match_utility.py",  # 44 s
    "tests/train/test_jax_engine_equality.py",  # 40 s
    "tests/federated/test_flower_secagg.py",  # 32 s
    "tests/parallel/test_launch.py",  # 26 s
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long files first (LONG_FILES' order), then the others by their number of tests, most
    first; a stable sort, so each file's tests stay together and in their order."""
    from collections import Counter

    rank = {path: i for i, path in enumerate(LONG_FILES)}
    counts = Counter(item.nodeid.split("::", 1)[0] for item in items)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank)), -counts[path]

    items.sort(key=key)

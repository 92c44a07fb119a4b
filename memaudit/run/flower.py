"""Federated on Flower: a run submitted to a Flower federation, and the ServerApp's side of it.

``memaudit train CONFIG federated.runtime=flower`` calls `train_on_flower` (`memaudit.run.dispatch`):
it checks that Flower is installed and the SuperLink reachable, writes a small Flower App
(`memaudit.federated.flower.deploy`) and submits it with ``flwr run``. The SuperLink starts
memaudit's ``ServerApp``, whose main (`memaudit.federated.flower.apps.serve`) calls `serve_run`:
it trains the run directory the launch folder names with `FederatedTrainer` over a
`FlowerRuntime` (`memaudit.federated.flower.trainer`), through the one driver, and leaves
``result.json`` or a one-line ``error.json`` for the submitting process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from memaudit.config import config_from_dict, dump_config
from memaudit.errors import MemauditError
from memaudit.federated.flower import deploy
from memaudit.federated.flower.trainer import FlowerNodes, check_supported, flower_trainer
from memaudit.io import atomic_write_json, read_json
from memaudit.run.driver import run_trainer
from memaudit.run.lifecycle import one_line_error
from memaudit.rundir import RunDir

CLAIM = "served"  # in a launch folder: a ServerApp has taken it
BOUND_WAIT_S = 60.0  # how long a ServerApp waits for its submitter to record the run id


def _private(path: Path, what: str) -> None:
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
        raise MemauditError(f"the {what} {path} is not this user's alone (owner, group- or world-writable, "
                            "or a link); submit the run with memaudit train, which makes it 0700")


def bind_launch(launch_dir: Path, run_id: int, *, wait_s: float = BOUND_WAIT_S) -> None:
    """Serve the launch folder only as the Flower run it was submitted as. ``memaudit train``
    makes the folder (mkdtemp: 0700, its user's) and records there the run id ``flwr run`` gave it
    (`deploy.submit`), on this host's filesystem. Anyone who only reaches the SuperLink can submit
    memaudit's own app naming the folder, but their run has another id, and it is refused before
    it reads or writes anything there (not even the claim, which would shut the real run out). A
    folder or id file another local user could have written is refused too.

    Raises:
        MemauditError: one line, when the id does not come within ``wait_s`` seconds, is not
            ``run_id``, or the folder or its id file is not this user's alone.
    """
    _private(launch_dir, "launch folder")
    path = launch_dir / deploy.RUN_ID
    deadline = time.monotonic() + wait_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise MemauditError(f"no Flower run id was recorded in the launch folder {launch_dir} within "
                                f"{wait_s:g} s; submit the run with memaudit train")
        time.sleep(0.05)
    _private(path, "launch folder's run id file")
    if read_json(path, what="Flower run id file").get("run_id") != int(run_id):
        raise MemauditError(f"the launch folder {launch_dir} was submitted as another Flower run than "
                            f"{int(run_id)}; submit the run with memaudit train")


def claim_launch(launch_dir: Path) -> None:
    """Take the launch folder for this ServerApp, once: a second ServerApp naming the same folder
    (a run submitted again with its launch-dir, by anyone who can reach the SuperLink) is refused
    before it reads anything, and writes nothing there, so it can neither train the run a second
    time beside the first (the submitting process holds the run's lock for one ServerApp) nor
    leave an error for the submitter to read."""
    try:
        os.close(os.open(launch_dir / CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise MemauditError(f"the launch folder {launch_dir} was already served by another ServerApp; "
                            "submit the run again with memaudit train") from None


def serve_run(grid: Any, *, launch_dir: Path, run_id: int) -> None:
    """The ServerApp's work, as Flower run ``run_id``: train the run ``launch_dir/launch.json``
    names on this ``grid``; writes ``result.json`` or a one-line ``error.json`` there for the
    submitting process. Only as the run the folder was submitted as (`bind_launch`), and one
    ServerApp a launch folder (`claim_launch`)."""
    bind_launch(launch_dir, run_id)
    claim_launch(launch_dir)
    launch = read_json(launch_dir / "launch.json", what="Flower launch file")
    try:
        cfg = config_from_dict(launch["config"], source="Flower launch file")
        trainer = flower_trainer(cfg, RunDir(launch["run_dir"]), FlowerNodes(grid, cfg.federated.flower))
        result = run_trainer(trainer, resume=launch["resume"], overwrite=launch["overwrite"], lock_held=True)
    except BaseException as e:
        text = (str(e).strip().splitlines() or [""])[0]
        msg = text if isinstance(e, MemauditError | ValueError) and text else one_line_error(e)
        atomic_write_json(launch_dir / "error.json", {"error": msg})
        raise
    atomic_write_json(launch_dir / "result.json", result)


def train_on_flower(cfg: Any, run: Any, *, resume: bool = False, progress: Any = None,
                    overwrite: bool = False, lock_held: bool = False) -> dict[str, Any]:
    """Submit the run to the Flower federation of ``cfg.federated.flower``; returns the result.

    Raises one-line errors when flwr is not installed, the SuperLink cannot be reached, or the
    ServerApp failed (its own one-line error: e.g. a SuperNode with an empty partition).
    """
    check_supported(cfg)
    deploy.require_flwr()
    fcfg = cfg.federated.flower
    deploy.check_reachable(fcfg.superlink)
    launch = Path(tempfile.mkdtemp(prefix="memaudit-flower-"))
    atomic_write_json(launch / "launch.json", {
        "config": dump_config(cfg), "run_dir": str(Path(run.path).resolve()), "resume": resume,
        "overwrite": overwrite})
    ok = False
    try:
        with contextlib.nullcontext() if lock_held else run.locked():
            code = deploy.submit(launch, fcfg, progress=_metrics_progress(run, cfg, progress))
        if (launch / "error.json").is_file():
            raise MemauditError(read_json(launch / "error.json")["error"])
        if not (launch / "result.json").is_file():
            raise MemauditError(f"the Flower run ended without a result (flwr run exit code {code}); "
                                f"see {launch / 'flwr-run.log'}")
        ok = True
        return read_json(launch / "result.json")
    finally:
        if ok:
            shutil.rmtree(launch, ignore_errors=True)


def _metrics_progress(run: Any, cfg: Any, progress: Any) -> Any:
    """A poll function passing new lines of metrics.jsonl on to ``progress``."""
    if progress is None:
        return None
    seen = [0]
    path = Path(run.path) / "metrics.jsonl"

    def poll() -> None:
        if not path.is_file():
            return
        lines = path.read_text().splitlines()
        for line in lines[seen[0]:]:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                progress(int(rec.get("round", 0)), cfg.federated.rounds, rec)
        seen[0] = len(lines)

    return poll

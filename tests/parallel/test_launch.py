"""End to end through the CLI: `memaudit train` on a 2-process grid (spawned, gloo) against
the single-process trainer, the merged `model/` export, DP-SGD through the launcher (one
ledger, dp_accounting's epsilon), killing one rank mid-run, then `--resume` from the
sharded checkpoint to the uninterrupted run's weights, and resuming on another grid (a
sharded checkpoint in one process or on another layout, a single-process one on a grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memaudit.cli import main
from memaudit.rundir import RunDir
from tests.conftest import REPO_ROOT, tiny_train_args
from tests.parallel._workers import assert_weights_close

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")


def _metrics(path) -> list[dict]:
    from tests._metrics import merged_metrics

    return merged_metrics(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus):
    base = tmp_path_factory.mktemp("par_runs")
    common = tiny_train_args(f"data.path={tiny_corpus}", "data.seq_len=32", "train.steps=4", "train.checkpoint_every=2",
                             "train.eval_every=2")
    assert main(["train", TINY, "--out", str(base / "par"), *common, "--set", "parallel.x=2"]) == 0
    assert main(["train", TINY, "--out", str(base / "ser"), *common]) == 0
    return base


def test_parallel_run_matches_single_process(runs) -> None:
    par, ser = _metrics(runs / "par"), _metrics(runs / "ser")
    assert [m["step"] for m in par] == [1, 2, 3, 4]
    for a, b in zip(par, ser, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4
        if "holdout_loss" in b:
            assert abs(a["holdout_loss"] - b["holdout_loss"]) < 1e-4
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, b["grad_norm"])
    assert RunDir(runs / "par").read_manifest()["status"] == "complete"


def test_merged_export_loads_in_one_process(runs) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    par = AutoModelForCausalLM.from_pretrained(runs / "par" / "model")
    ser = AutoModelForCausalLM.from_pretrained(runs / "ser" / "model")
    for (k, a), (_, b) in zip(par.state_dict().items(), ser.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


# ----------------------------------------------------------------------------- sharded checkpoints
def _interrupted_copy(src: Path, dst: Path) -> Path:
    """A copy of a complete run whose state/ (the step-2 checkpoint) is resumable."""
    import shutil

    shutil.copytree(src, dst)
    RunDir(dst).update_manifest(status="interrupted", result=None)
    return dst


def test_state_holds_one_shard_per_tensor_parallel_rank(runs) -> None:
    import torch
    from safetensors.torch import load_file

    from memaudit.parallel.checkpoint import ShardReader

    state = runs / "par" / "state"
    scalars = json.loads((state / "trainer.json").read_text())
    assert scalars["format"] == "sharded" and scalars["grid"] == [1, 2, 1, 1] and scalars["step"] == 2
    assert sorted(p.name for p in (state / "shards").iterdir()) == ["tp-00000-of-00002.safetensors",
                                                                    "tp-00001-of-00002.safetensors"]
    assert not (state / "model.safetensors").exists()  # nothing gathered
    s0, s1 = (load_file(str(state / "shards" / f"tp-0000{r}-of-00002.safetensors")) for r in (0, 1))
    name = "model.layers.0.self_attn.q_proj.weight"  # normal layer: x splits the in-features
    assert s0[f"param/{name}"].shape == (128 * 64,)  # the (128 x 64) block, flat (z shards it when z > 1)
    assert s0[f"optim/{name}/exp_avg"].shape == (128 * 64,) and s0[f"optim/{name}/step"].item() == 2
    # the saved layout puts the halves side by side (an independent concatenation)
    reader = ShardReader(state)
    for key in (f"param/{name}", f"optim/{name}/exp_avg_sq"):
        halves = [s[key].view(128, 64) for s in (s0, s1)]
        torch.testing.assert_close(reader.full(name, key), torch.cat(halves, dim=1), rtol=0, atol=0)
    # and step 2 of the sharded run is step 2 of the single-process run (its full checkpoint)
    serial = load_file(str(runs / "ser" / "state" / "model.safetensors"))
    for n, full in serial.items():
        torch.testing.assert_close(reader.full(n, f"param/{n}"), full, atol=1e-4, rtol=0)


def test_a_sharded_checkpoint_resumes_in_one_process_and_on_another_layout(runs, tmp_path) -> None:
    """x=2 shards resumed (a) in one process, merged, (b) on a z=2 grid, re-sliced: both end
    at the uninterrupted single-process run's weights and losses."""
    for name, grid in (("one", ["parallel.x=1"]), ("z2", ["parallel.x=1", "parallel.z=2"])):
        run = _interrupted_copy(runs / "par", tmp_path / name)
        args = [a for g in grid for a in ("--set", g)]
        assert main(["train", "--resume", str(run), *args]) == 0
        m = RunDir(run).read_manifest()
        assert m["status"] == "complete" and m["result"]["resumed_from_step"] == 2
        assert (m["config"]["parallel"]["x"], m["config"]["parallel"]["z"]) == ((1, 1) if name == "one" else (1, 2))
        a, b = _metrics(run), _metrics(runs / "ser")
        assert [r["step"] for r in a] == [1, 2, 3, 4]
        for x, y in zip(a[2:], b[2:], strict=True):
            assert abs(x["loss"] - y["loss"]) < 1e-4, (name, x, y)
        assert_weights_close(run, runs / "ser")


def test_a_single_process_checkpoint_resumes_on_a_grid(runs, tmp_path) -> None:
    run = _interrupted_copy(runs / "ser", tmp_path / "ser-on-y2")
    assert main(["train", "--resume", str(run), "--set", "parallel.y=2"]) == 0
    assert json.loads((run / "state" / "trainer.json").read_text()).get("format") is None  # not re-saved
    assert_weights_close(run, runs / "ser")


def test_resume_may_change_only_the_grid(runs, tmp_path, capsys) -> None:
    run = _interrupted_copy(runs / "par", tmp_path / "other")
    before = (run / "run.json").read_text()
    assert main(["train", "--resume", str(run), "--set", "train.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'train.lr' differs" in err[0] and "only parallel.*" in err[0]
    assert (run / "run.json").read_text() == before


# ----------------------------------------------------------------------------- DP, kill, resume
DP_STEPS = 6


def _dp_args(corpus) -> list[str]:
    return tiny_train_args(f"data.path={corpus}", "data.seq_len=32", f"train.steps={DP_STEPS}",
                           "train.checkpoint_every=2", "train.eval_every=6", "privacy.noise_multiplier=0.8",
                           "privacy.clip=1.0", "privacy.reproducible_randomness=true", "privacy.delta=1e-4", "parallel.x=2")


@pytest.fixture(scope="module")
def dp_ref(tmp_path_factory, tiny_corpus):
    """An uninterrupted DP-SGD (sigma=0.8) run on x=2, through the launcher."""
    out = tmp_path_factory.mktemp("dp_ref") / "run"
    assert main(["train", TINY, "--out", str(out), *_dp_args(tiny_corpus)]) == 0
    return out


def test_dp_through_the_launcher_writes_one_ledger_with_the_accounted_epsilon(dp_ref) -> None:
    import dp_accounting

    from memaudit.privacy.accounting import RDP_ORDERS

    assert [p.name for p in dp_ref.glob("privacy*.json")] == ["privacy.json"]  # one ledger, not one per rank
    ledger = json.loads((dp_ref / "privacy.json").read_text())
    result = RunDir(dp_ref).read_manifest()["result"]
    q = 8 / result["train_sequences"]
    assert ledger["steps"] == DP_STEPS and ledger["sampling_rate"] == pytest.approx(q, rel=1e-12)
    acc = dp_accounting.rdp.RdpAccountant(list(RDP_ORDERS))
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(0.8)), DP_STEPS))
    assert ledger["epsilon"]["rdp"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-6)
    assert result["privacy"]["epsilon"]["rdp"] == ledger["epsilon"]["rdp"]
    metrics = _metrics(dp_ref)
    assert [m["step"] for m in metrics] == list(range(1, DP_STEPS + 1))
    assert metrics[0]["noise_std"] == pytest.approx(0.8 * 1.0 / 8, rel=1e-9)
    # Poisson batch sizes are the sampler's own draws, whatever the grid
    from memaudit.privacy.randomness import DPRandomness
    from memaudit.train.sampling import PoissonSampler

    sampler = PoissonSampler(result["train_sequences"], q, DPRandomness.from_seed(0))  # reproducible_randomness
    assert [m["batch_size"] for m in metrics] == [len(sampler.indices(t)) for t in range(DP_STEPS)]


def _dead(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_killing_one_rank_stops_the_others_and_resume_recovers(dp_ref, tiny_corpus, tmp_path) -> None:
    """SIGKILL of rank 1 mid-run: the launcher stops rank 0 and exits non-zero, run.json says
    failed (or interrupted), and --resume ends with the uninterrupted run's weights and ledger."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch
    from safetensors.torch import load_file

    run, pids = tmp_path / "killed", tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "MEMAUDIT_PARALLEL_PID_DIR": str(pids), "MEMAUDIT_DIST_TIMEOUT_S": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "memaudit.cli", "train", TINY, "--out", str(run),
                             *_dp_args(tiny_corpus)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            m = run / "metrics.jsonl"
            if m.is_file() and len(m.read_text().splitlines()) >= 3:  # past the step-2 checkpoint
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        pid0, pid1 = (int((pids / f"rank{r}.pid").read_text()) for r in (0, 1))
        os.kill(pid1, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "parallel rank" in err.strip().splitlines()[-1], err
    # the killed rank's semaphores are the resource tracker's to clean, not a warning after that line
    assert "resource_tracker" not in err, err
    assert _dead(pid0) and _dead(pid1)
    assert stopped < 60, stopped  # a rank blocked in a collective was not waited on forever
    manifest = RunDir(run).read_manifest()
    assert manifest["status"] in ("failed", "interrupted"), manifest["status"]
    done = len(_metrics(run))
    assert 3 <= done < DP_STEPS  # it really stopped mid-run

    assert main(["train", "--resume", str(run)]) == 0
    assert RunDir(run).read_manifest()["status"] == "complete"
    a, b = _metrics(run), _metrics(dp_ref)
    assert [m["step"] for m in a] == list(range(1, DP_STEPS + 1))
    for x, y in zip(a, b, strict=True):
        assert x["batch_size"] == y["batch_size"] and abs(x["loss"] - y["loss"]) < 1e-6, (x, y)
    wa = load_file(str(run / "model" / "model.safetensors"))
    wb = load_file(str(dp_ref / "model" / "model.safetensors"))
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    la, lb = (json.loads((p / "privacy.json").read_text()) for p in (run, dp_ref))
    assert la["steps"] == lb["steps"] == DP_STEPS and la["epsilon"] == lb["epsilon"]


def _hang_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 never joins the collective and ignores SIGTERM; rank 0 must time out, not hang."""
    import os
    import signal
    import time

    import torch

    from memaudit.parallel.dims import ParallelDims
    from memaudit.run.launch import init_distributed

    os.setsid()  # as `_rank_main`: the stop helper kills process groups
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      MEMAUDIT_DIST_TIMEOUT_S="3")
    init_distributed(ParallelDims(x=2), requested_backend="gloo")
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        msg = "no error"
    except RuntimeError as e:
        msg = str(e).splitlines()[0]
    (Path(out) / "rank0.txt").write_text(json.dumps([time.monotonic() - t0, msg]))
    os._exit(0)  # (a clean destroy_process_group would wait for the hung peer)


def test_a_collective_with_a_hung_peer_times_out_and_the_stop_helper_kills_it(tmp_path) -> None:
    import socket
    import time

    import torch.multiprocessing as mp

    from memaudit.run.launch import _stop_ranks, rank_context

    rank_context()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = mp.start_processes(_hang_worker, args=(port, str(tmp_path)), nprocs=2, join=False,
                               start_method="forkserver")
    try:
        procs.processes[0].join(timeout=60)
        waited, msg = json.loads((tmp_path / "rank0.txt").read_text())
        assert 2.5 <= waited < 30, (waited, msg)  # MEMAUDIT_DIST_TIMEOUT_S=3 was honoured
        assert msg != "no error"
        assert procs.processes[1].is_alive()
        t0 = time.monotonic()
        _stop_ranks(procs, grace=1.0)  # SIGTERM is ignored: SIGKILL of its process group
        assert not procs.processes[1].is_alive() and time.monotonic() - t0 < 10
    finally:
        for pr in procs.processes:
            if pr.is_alive():
                pr.kill()


def test_dist_timeout_must_be_a_positive_number(monkeypatch) -> None:
    from memaudit.run.launch import dist_timeout

    monkeypatch.setenv("MEMAUDIT_DIST_TIMEOUT_S", "45")
    assert dist_timeout().total_seconds() == 45
    for bad in ("soon", "0"):
        monkeypatch.setenv("MEMAUDIT_DIST_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="MEMAUDIT_DIST_TIMEOUT_S") as e:
            dist_timeout()
        assert "\n" not in str(e.value)


def test_grid_that_does_not_divide_the_model_is_one_line(tmp_path, capsys) -> None:
    rc = main(["train", TINY, "--out", str(tmp_path / "bad"), "--set", "parallel.y=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not divisible by parallel.y=3" in err[0]


def test_the_ranks_resource_tracker_does_not_warn_after_the_launchers_error() -> None:
    """A semaphore left by a process killed with SIGKILL (here: a process that exits without
    cleaning up) is removed by multiprocessing's resource tracker, which warned about it on
    stderr at its exit: after the launcher's one-line error. A tracker started after
    `rank_context` does not; one started without it does (the oracle that the case is real)."""
    import subprocess
    import sys

    code = ("import os, sys\n"
            "from memaudit.run.launch import rank_context\n"
            "ctx = rank_context() if sys.argv[1] == 'ranks' else __import__('multiprocessing').get_context('forkserver')\n"
            "s = ctx.Semaphore()\n"
            "os._exit(0)\n")
    import os

    # Python's default warnings, whatever an in-process `memaudit.cli.main` of an earlier test set
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    err = {}
    for how in ("plain", "ranks"):
        # the tracker holds the stderr pipe until it exits: run() returns with its warning in
        err[how] = subprocess.run([sys.executable, "-c", code, how], check=True, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=120, env=env).stderr
    assert "leaked semaphore" in err["plain"]
    assert "resource_tracker" not in err["ranks"], err["ranks"]

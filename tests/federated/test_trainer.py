"""The federated trainer: client data, bad input, and one tiny end-to-end run that is killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

# The run's compilation cache (tests/conftest.py), shared with the training subprocesses started here.
CACHE_DIR = os.environ["MEMAUDIT_TEST_JAX_CACHE"]

OVERRIDES = [
    "backend=federated", "data.synth.users=16", "data.synth.docs_per_user=4", "data.seq_len=32",
    "data.canaries.repetitions=[1,2]", "federated.rounds=4", "federated.cohort=4",
    "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
    "federated.server_optimizer=fedavg", "federated.client_lr=0.2", "federated.eval_every=2",
    "federated.checkpoint_every=2", "federated.mesh_clients=4", "train.batch_size=8",
    "train.eval_batches=2",
]

# Run in a subprocess: train, and after round 2 (checkpoint written) signal and hang to be killed.
KILL_SCRIPT = """
import json, sys, time
from pathlib import Path
from memaudit.config import load_config
from memaudit.rundir import RunDir
from memaudit.run.federated import train_federated
out, marker, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
def progress(done, total, info):
    if done == 2 and "round" in info:
        marker.write_text("ready")
        time.sleep(600)
train_federated(load_config(None, overrides), RunDir(out), progress=progress)
"""


def _cfg(*extra):
    from memaudit.config import load_config

    return load_config(None, [*OVERRIDES, *extra])


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    """OVERRIDES plus one shared tokenizer: BPE training is not bit-reproducible across processes
    (tie order), so runs meant to be compared bit for bit must share the tokenizer."""
    from memaudit.data import prepare_data
    from memaudit.rundir import RunDir

    scratch = RunDir(tmp_path_factory.mktemp("tok") / "run")
    prepare_data(_cfg().data, scratch, vocab_size=4096)
    return [*OVERRIDES, f"data.tokenizer={scratch.data_dir / 'tokenizer'}"]


def _env():
    return {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}


def _weights(run_path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(run_path / "model" / "model.safetensors"))


# ---------------------------------------------------------------------------- client data
def test_client_data_groups_sequences_by_user_with_padding():
    from memaudit.data.packing import PackedSequences
    from memaudit.federated.data import build_client_data

    rng = np.random.default_rng(0)
    user_index = np.array([2, 0, 2, 2, 0, 3], np.int32)  # user 1 has no sequences
    ids = rng.integers(1, 50, (6, 5)).astype(np.int32)
    am = np.ones((6, 5), np.int8)
    cd = build_client_data(PackedSequences(ids, am, user_index, ("a", "b", "c", "d")))
    assert cd.users == ("a", "c", "d") and cd.num_examples.tolist() == [2, 3, 1]
    assert cd.input_ids.shape == (3, 3, 5)
    for k, u in enumerate([0, 2, 3]):  # oracle: a loop over the rows in order
        rows = [i for i in range(6) if user_index[i] == u]
        np.testing.assert_array_equal(cd.input_ids[k, : len(rows)], ids[rows])
        assert cd.example_mask[k].tolist() == [j < len(rows) for j in range(3)]
        assert not cd.input_ids[k, len(rows):].any() and not cd.attention_mask[k, len(rows):].any()


def test_loss_fn_is_per_sequence_token_mean():
    import jax.numpy as jnp

    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, causal_lm_loss

    cfg = FlaxLlamaConfig(vocab_size=20, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = FlaxLlama(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    ids = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]], jnp.int32)
    am = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], jnp.int32)
    # jitted, each side one program (op by op, every operation of the model compiles on its own)
    per, count = jax.jit(make_loss_fn(model))(params, {"input_ids": ids, "attention_mask": am})
    assert count.tolist() == [4.0, 2.0]
    alone = jax.jit(lambda p, i, m: causal_lm_loss(model.apply({"params": p}, i, m), i, m))
    for i in range(2):  # oracle: the summed loss of each sequence alone, divided by its targets
        s, c = alone(params, ids[i:i + 1], am[i:i + 1])
        assert float(per[i]) == pytest.approx(float(s) / float(c), rel=1e-5)


# ---------------------------------------------------------------------------- bad input
def test_bad_input_one_line_each(tmp_path, capsys):
    from memaudit.cli import main
    from memaudit.config import load_config
    from memaudit.errors import ConfigError, MemauditError
    from memaudit.run.checks import check_population

    with pytest.raises(ConfigError, match="local_steps"):
        load_config(None, ["federated.local_steps=0"])
    with pytest.raises(MemauditError, match="federated.cohort=4 is larger than the population of 3"):
        check_population(_cfg(), 3)
    with pytest.raises(MemauditError, match="at least 2 clients"):
        check_population(_cfg("federated.cohort=1"), 1)
    # through the CLI: a cohort larger than the 13 training users of this corpus
    args = ["train", "--out", str(tmp_path / "r")]
    for o in [*OVERRIDES, "federated.cohort=40"]:
        args += ["--set", o]
    args.insert(1, str(Path("configs/federated-tiny.yaml")))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "federated.cohort=40 is larger than the population" in err[0]
    assert not (tmp_path / "r").exists()  # refused before the run directory was written
    assert main(["train", "configs/federated-tiny.yaml", "--set", "federated.local_steps=0",
                 "--out", str(tmp_path / "z")]) == 2
    assert "local_steps" in capsys.readouterr().err


def test_federated_tiny_config_loads():
    from memaudit.config import load_config

    cfg = load_config("configs/federated-tiny.yaml")
    assert cfg.backend == "federated" and cfg.federated.sampling == "poisson"


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def fed_run(tmp_path_factory, overrides):
    """An uninterrupted tiny run (4 rounds, cohort 4 on a 4-device clients mesh)."""
    from memaudit.config import load_config
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    path = tmp_path_factory.mktemp("fed") / "run"
    seen = []
    cfg = load_config(None, overrides)
    result = train_federated(cfg, RunDir(path), progress=lambda d, t, i: seen.append((d, t, dict(i))))
    return {"path": path, "result": result, "progress": seen}


def test_run_lowers_holdout_loss_and_writes_the_contract(fed_run):
    from memaudit.io import read_jsonl

    path, result = fed_run["path"], fed_run["result"]
    assert result["final_holdout_loss"] < result["initial_holdout_loss"] - 0.1
    assert result["mesh_clients"] == 4 and result["clients"] == 13
    manifest = json.loads((path / "run.json").read_text())
    assert manifest["status"] == "complete" and manifest["backend"] == "federated"
    assert manifest["result"]["steps"] == 4 and manifest["data_fingerprint"]
    lines = read_jsonl(path / "metrics.jsonl")
    assert [m["round"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert m["cohort"] == 4 and m["loss"] > 0 and m["update_norm"] > 0 and m["tokens_per_s"] > 0
    assert "holdout_loss" in lines[1] and "holdout_perplexity" in lines[3]
    assert lines[3]["holdout_loss"] == pytest.approx(result["final_holdout_loss"])
    assert [d for d, _, i in fed_run["progress"] if "round" in i] == [1, 2, 3, 4]
    assert not (path / "run.lock").exists()


def test_checkpoint_loads_in_transformers_and_generates(fed_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memaudit.models.convert import load_hf_checkpoint
    from memaudit.models.presets import init_state_dict

    model_dir = fed_run["path"] / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok.encode("my account pin is")], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    # trained weights differ from the shared seeded initial weights
    init = init_state_dict("tiny", vocab_size=4096, seed=0)
    sd = model.state_dict()
    assert not torch.equal(sd["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])
    params, cfg = load_hf_checkpoint(model_dir)
    assert cfg["vocab_size"] == 4096 and "lm_head" in params


def test_sigkill_after_checkpoint_then_resume_gives_the_same_weights(fed_run, overrides, tmp_path):
    from memaudit.config import load_config
    from memaudit.io import read_json, read_jsonl
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    out, marker = tmp_path / "killed", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(out), str(marker), json.dumps(overrides)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = RunDir(out)
    assert run.status() == "interrupted"
    assert read_json(out / "state" / "trainer.json")["round"] == 2
    result = train_federated(load_config(None, overrides), run, resume=True)
    assert result["resumed_from_round"] == 2
    assert read_json(out / "run.json")["status"] == "complete"
    assert [m["round"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    ref, got = _weights(fed_run["path"]), _weights(out)
    assert ref.keys() == got.keys()
    for name in ref:
        assert np.array_equal(ref[name], got[name]), name


def test_dp_fedavg_run_records_a_user_level_ledger(overrides, tmp_path):
    """privacy.enabled wires DP-FedAvg (clip + noise on the sum, uniform weights) and the ledger."""
    from memaudit.config import load_config
    from memaudit.io import read_json, read_jsonl
    from memaudit.privacy.accounting import epsilon
    from memaudit.privacy.federated import dpfedavg_event
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    cfg = load_config(None, [*overrides, "federated.rounds=2", "federated.sampling=poisson",
                             "privacy.noise_multiplier=0.8", "privacy.clip=0.5", "privacy.reproducible_randomness=true"])
    result = train_federated(cfg, RunDir(tmp_path / "dp"))
    ledger = read_json(tmp_path / "dp" / "privacy.json")
    assert ledger["unit"] == "user" and result["privacy"]["noise_multiplier"] == 0.8
    ref = epsilon(dpfedavg_event(cohort=4, population=13, noise_multiplier=0.8, rounds=2),
                  ledger["delta"])
    assert ledger["epsilon"]["rdp"] == pytest.approx(ref, rel=1e-6)
    for m in read_jsonl(tmp_path / "dp" / "metrics.jsonl"):
        assert "noise_std" in m and not {"clip_fraction", "survivors", "cohort", "loss"} & set(m)
        assert m["noise_std"] == pytest.approx(0.8 * 0.5 / 4)
    sensitive = read_jsonl(tmp_path / "dp" / "sensitive_metrics.jsonl")
    assert [m["round"] for m in sensitive] == [1, 2]
    assert all({"clip_fraction", "survivors", "cohort"} <= set(m) for m in sensitive)
    from tests.test_lifecycle import scan_public_files

    scan_public_files(tmp_path / "dp")


# Run in a subprocess: checkpoint every round and die (SIGKILL) between the two renames of the
# second checkpoint's swap, the moment when state/ is moved aside and the new one not yet in.
SWAP_KILL_SCRIPT = """
import json, os, signal, sys
import memaudit.checkpoints as lc
from memaudit.config import load_config
from memaudit.rundir import RunDir
from memaudit.run.federated import train_federated
out, overrides = sys.argv[1], json.loads(sys.argv[2])
lc._between_renames = lambda: os.kill(os.getpid(), signal.SIGKILL)
train_federated(load_config(None, overrides), RunDir(out))
"""


def test_sigkill_inside_the_checkpoint_swap_then_resume_gives_the_same_weights(fed_run, overrides, tmp_path):
    from memaudit.config import load_config
    from memaudit.io import read_json
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    out = tmp_path / "swap"
    every_round = [*overrides, "federated.checkpoint_every=1"]  # the cadence does not change weights
    proc = subprocess.run([sys.executable, "-c", SWAP_KILL_SCRIPT, str(out), json.dumps(every_round)],
                          env=_env(), capture_output=True, timeout=400, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (out / "state").exists()  # killed with state/ moved aside and the new one beside it
    names = sorted(p.name for p in out.glob(".state.*"))
    assert len(names) == 2 and names[0] == ".state.2.tmp" and names[1].startswith(".state.old-"), names
    result = train_federated(load_config(None, every_round), RunDir(out), resume=True)
    assert result["resumed_from_round"] == 2  # the newer complete checkpoint, not a restart
    assert read_json(out / "run.json")["status"] == "complete"
    assert not list(out.glob(".state.*")) and not list(out.glob(".*.tmp"))
    ref, got = _weights(fed_run["path"]), _weights(out)
    for name in ref:
        assert np.array_equal(ref[name], got[name]), name


def test_an_aborted_secure_aggregation_round_costs_its_abort_bit_and_training_goes_on(overrides, tmp_path):
    """DP-FedAvg over secure aggregation with threshold 1 and dropouts: rounds where a client
    drops abort (nothing applied), the abort count is in the sensitive metrics file, and the run
    completes. Whether a round aborted depends on the realized cohort and is public: every round
    records its abort bit (issue 29, Found-5; before, an aborted round recorded nothing and the
    ledger held 4 - aborted steps), and the ledger's ε, recomputed from its events, counts it."""
    from memaudit.config import load_config
    from memaudit.io import read_json, read_jsonl
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    cfg = load_config(None, [*overrides, "federated.rounds=4", "federated.checkpoint_every=4",
                             "privacy.noise_multiplier=0.5", "privacy.clip=0.5", "privacy.delta=1e-3",
                             "privacy.reproducible_randomness=true",
                             "privacy.secure_aggregation.enabled=true",
                             "privacy.secure_aggregation.threshold=1.0",
                             "privacy.secure_aggregation.dropout=0.3"])
    out = tmp_path / "abort"
    result = train_federated(cfg, RunDir(out))
    assert read_json(out / "run.json")["status"] == "complete" and result["rounds"] == 4
    sensitive = read_jsonl(out / "sensitive_metrics.jsonl")
    aborted = sum(int(m["secagg_aborted"]) for m in sensitive)
    assert 0 < aborted < 4, sensitive  # this seed drops a client in some rounds, not all
    for m in sensitive:
        if m["secagg_aborted"]:
            assert m["update_norm"] == 0.0
    from memaudit.privacy.aborts import abort_event
    from memaudit.privacy.ledger import PrivacyLedger

    ledger = PrivacyLedger.from_json(read_json(out / "privacy.json"))
    assert ledger.steps == 4  # one event a round: the bit alone, or the noise composed with it
    alone = [e for e in ledger.events if getattr(e, "label", "").startswith("secure-aggregation abort bit")]
    assert sum(e.count for e in alone) == aborted
    eps_bit = ledger.mechanisms[0]["abort_bit_epsilon"]
    assert all(e.rdp == abort_event(eps_bit).rdp for e in alone)
    assert eps_bit == 0.0  # a fixed-size cohort: whether it aborts does not depend on who is in it
    assert not any("secagg_aborted" in m for m in read_jsonl(out / "metrics.jsonl"))
    from tests.test_lifecycle import scan_public_files

    scan_public_files(out)  # nothing that depends on the realized cohort (bits, degree, bytes)


def test_two_clients_per_step_give_the_one_client_run(fed_run, overrides, tmp_path):
    """federated.clients_per_step=2 on a 2-device clients mesh (one loop step of 2 clients per
    device) trains the weights of the one-client-per-step run on 4 devices, to float rounding."""
    from memaudit.config import load_config
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    cfg = load_config(None, [*overrides, "federated.mesh_clients=2", "federated.clients_per_step=2"])
    train_federated(cfg, RunDir(tmp_path / "k2"))
    ref, got = _weights(fed_run["path"]), _weights(tmp_path / "k2")
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)

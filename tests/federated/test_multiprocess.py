"""Two JAX processes on localhost (jax.distributed + gloo CPU collectives) run one federated round.

Each process owns 2 CPU devices; the clients mesh spans all 4. Process 0 writes the run; its
final weights must equal a single-process run of the same round on a 4-device mesh.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import XLA_ONE_THREAD

jax = pytest.importorskip("jax")

OVERRIDES = [
    "backend=federated", "data.synth.users=16", "data.synth.docs_per_user=4", "data.seq_len=32",
    "data.canaries.repetitions=[1,2]", "federated.rounds=1", "federated.cohort=4",
    "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
    "federated.server_optimizer=fedadam", "federated.server_lr=0.01", "federated.client_optimizer=adam",
    "federated.client_lr=0.01", "federated.mesh_clients=4", "train.batch_size=8", "train.eval_batches=1",
]

WORKER = """
import json, sys
from memaudit.config import load_config
from memaudit.rundir import RunDir
from memaudit.run.federated import train_federated
import jax
res = train_federated(load_config(None, json.loads(sys.argv[2])), RunDir(sys.argv[1]))
print("RESULT", jax.process_index(), jax.process_count(), len(jax.devices()), res["mesh_clients"], flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _weights(path):
    from safetensors.numpy import load_file

    return load_file(str(path / "model" / "model.safetensors"))


def test_two_processes_run_one_round(tmp_path):
    from memaudit.config import load_config
    from memaudit.data import prepare_data
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    scratch = RunDir(tmp_path / "tok")
    prepare_data(load_config(None, OVERRIDES).data, scratch, vocab_size=4096)
    overrides = [*OVERRIDES, f"data.tokenizer={scratch.data_dir / 'tokenizer'}"]

    out = tmp_path / "mp"
    port = _free_port()
    base_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in range(2):
        env = {**base_env, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {XLA_ONE_THREAD}",
               "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(out), json.dumps(overrides)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=500)
            outputs.append(stdout.decode())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for pid, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, text[-3000:]
        assert f"RESULT {pid} 2 4 4" in text  # process id, 2 processes, 4 global devices, mesh of 4

    ref_path = tmp_path / "single"
    train_federated(load_config(None, overrides), RunDir(ref_path))  # one process, 4 of 8 devices
    ref, got = _weights(ref_path), _weights(out)
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    from memaudit.models.presets import init_state_dict

    init = init_state_dict("tiny", vocab_size=4096, seed=0)["lm_head.weight"].numpy()
    assert not np.allclose(got["lm_head.weight"], init)  # the round did move the model
    assert json.loads((out / "run.json").read_text())["result"]["processes"] == 2

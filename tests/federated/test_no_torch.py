"""The JAX path needs no torch: the federated trainer, a round of the Flax Llama and the Flower
stage partitioner import and run with torch and transformers unimportable (as on a TPU host)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    class Blocked:  # torch and transformers cannot be imported (not even tried silently)
        tried = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers"):
                Blocked.tried.append(name)
                raise ImportError(f"{name} is blocked")
            return None

    sys.meta_path.insert(0, Blocked())
    import jax, jax.numpy as jnp, numpy as np, optax
    from memaudit.federated.algorithms import fedavg
    from memaudit.federated.cohorts import pack_clients
    from memaudit.federated.trainer import FederatedTrainer, make_loss_fn  # noqa: F401
    from memaudit.federated.flower import partition  # noqa: F401
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params
    from memaudit.models.precision import resolve_policy

    cfg = FlaxLlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    data = pack_clients([{"input_ids": rng.integers(0, 64, (2, 8)).astype(np.int32),
                          "attention_mask": np.ones((2, 8), np.int32)} for _ in range(2)])
    algo = fedavg(make_loss_fn(FlaxLlama(cfg)), client_optimizer=optax.sgd(0.1),
                  server_optimizer=optax.sgd(1.0), local_steps=1, batch_size=2)
    state, m = algo.round(algo.init(params), data, jax.random.key(0))
    assert np.isfinite(m["loss"]), m
    assert not [k for k in sys.modules if k.split(".")[0] in ("torch", "transformers")]
    print("tried", sorted(set(Blocked.tried)))
""")


def test_the_federated_jax_path_runs_without_torch():
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tried" in p.stdout
